"""PhaseCond and its Iterative Aligner baseline: each equation recomputed directly on tiny tensors,
padding exactness, gradient flow and the switches of Tables 2 and 4."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mrc_lib.config import resolve_config
from mrc_lib.errors import UserError
from mrc_lib.models import build_model, hparam_defaults
from mrc_lib.models.phasecond import (
    InnerFusion,
    MemoryAnswerPointer,
    question_passage_attention,
    self_attention,
)
from mrc_lib.train import reader_loss

SMALL = {"hidden": 4, "char_dim": 3, "char_channels": 5, "pos_dim": 3, "ner_dim": 2,
         "qtype_dim": 2, "dropout": 0.0}


def make_vocab(tagged: bool = True):
    rng = np.random.default_rng(0)
    tags = ["<pad>", "NN", "VB"] if tagged else ["<pad>"]
    return SimpleNamespace(word_vectors=rng.normal(size=(30, 6)).astype(np.float32),
                           n_trainable=6, n_chars=12, n_feats=4, pos_tags=tags, ner_tags=tags)


def make_batch(c_len=(7, 5), q_len=(4, 3), tagged=True, pad_c=0, pad_q=0, seed=0):
    """A random batch; ``pad_c``/``pad_q`` add that much extra padding at the end."""
    g = torch.Generator().manual_seed(seed)
    B, Lc, Lq = len(c_len), max(c_len), max(q_len)
    c_mask = torch.arange(Lc)[None] < torch.tensor(c_len)[:, None]
    q_mask = torch.arange(Lq)[None] < torch.tensor(q_len)[:, None]

    def ids(high, mask, *extra):
        x = torch.randint(1, high, (*mask.shape, *extra), generator=g)
        return x * mask.view(*mask.shape, *[1] * len(extra))

    batch = {"c_words": ids(30, c_mask), "q_words": ids(30, q_mask),
             "c_chars": ids(12, c_mask, 3), "q_chars": ids(12, q_mask, 3),
             "c_mask": c_mask, "q_mask": q_mask,
             "c_feats": torch.rand(B, Lc, 4, generator=g) * c_mask[..., None],
             "q_type": torch.randint(0, 9, (B,), generator=g),
             "y1": torch.tensor([1, 0]), "y2": torch.tensor([2, 3]),
             "has_answer": torch.tensor([True, True])}
    if tagged:
        for side, mask in (("c", c_mask), ("q", q_mask)):
            batch[f"{side}_pos"], batch[f"{side}_ner"] = ids(3, mask), ids(3, mask)
    if pad_c or pad_q:
        batch = pad(batch, pad_c, pad_q)
    return batch


def pad(batch, extra_c, extra_q):
    """The same batch with ``extra_c``/``extra_q`` more padding positions (id 0, mask False)."""
    out = dict(batch)
    for key, value in batch.items():
        side = key.split("_")[0]
        extra = {"c": extra_c, "q": extra_q}.get(side, 0)
        if extra and value.dim() >= 2 and key != "c_feats":
            shape = list(value.shape)
            shape[1] = extra
            out[key] = torch.cat([value, value.new_zeros(shape)], dim=1)
    feats = batch["c_feats"]
    out["c_feats"] = torch.cat([feats, feats.new_zeros(feats.shape[0], extra_c, 4)], dim=1)
    return out


def build(name="phasecond", tagged=True, **hparams):
    torch.manual_seed(0)
    return build_model(name, make_vocab(tagged), **{**SMALL, "use_tags": tagged, **hparams})


# --- Eqs. 4-5, 9-10, 11-13 ---------------------------------------------------------------------


def test_question_passage_attention_eqs_4_5():
    torch.manual_seed(0)
    h, u, v = torch.randn(2, 5, 3), torch.randn(2, 4, 3), torch.randn(2, 4, 3)
    q_mask = torch.tensor([[True] * 4, [True, True, False, False]])
    out, scores = question_passage_attention(h, u, v, q_mask)
    for b in range(2):
        n = int(q_mask[b].sum())
        for j in range(5):
            s = torch.stack([h[b, j] @ u[b, i] for i in range(n)])  # h^{t-1}_j · u^Q_i
            alpha = torch.exp(s) / torch.exp(s).sum()  # Eq. 4
            expected = sum(alpha[i] * v[b, i] for i in range(n))  # Eq. 5
            assert torch.allclose(out[b, j], expected, atol=1e-5)
            assert torch.allclose(scores[b, j, :n], s, atol=1e-5)


def test_self_attention_eqs_9_10():
    torch.manual_seed(1)
    h = torch.randn(2, 5, 3)
    c_mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    out, scores = self_attention(h, c_mask)
    for b in range(2):
        n = int(c_mask[b].sum())
        for j in range(n):
            s = torch.stack([h[b, j] @ h[b, k] for k in range(n)])
            S = torch.exp(s) / torch.exp(s).sum()  # Eq. 9
            assert torch.allclose(out[b, j], sum(S[k] * h[b, k] for k in range(n)), atol=1e-5)
            assert torch.allclose(scores[b, j, :n], s, atol=1e-5)


def test_inner_fusion_eqs_11_13():
    torch.manual_seed(2)
    fuse = InnerFusion(3)
    h, b = torch.randn(4, 3), torch.randn(4, 3)
    for t in range(4):
        x = torch.cat([h[t], b[t], h[t] * b[t], h[t] - b[t]])  # Eq. 11
        h_tilde = torch.tanh(fuse.W_r.weight @ x + fuse.W_r.bias)  # Eq. 12
        g = torch.sigmoid(fuse.W_g.weight @ x + fuse.W_g.bias)
        assert torch.allclose(fuse(h, b)[t], g * h_tilde + (1 - g) * h[t], atol=1e-6)  # Eq. 13


def highway(layer, x):
    """mrc_lib's highway (Eqs. 6-8) written out: ``g ⊙ relu(W x) + (1 − g) ⊙ x``."""
    for transform, gate in zip(layer.transforms, layer.gates):
        g = torch.sigmoid(x @ gate.weight.T + gate.bias)
        x = g * torch.relu(x @ transform.weight.T + transform.bias) + (1 - g) * x
    return x


@pytest.mark.parametrize("qpatt_plus", [True, False])
def test_phasecond_phases_recomputed(qpatt_plus):
    """Eqs. 1-13 chained by hand: two QP layers, outer fusion, two self-attention layers."""
    model = build(qpatt_plus=qpatt_plus).eval()
    batch = make_batch()
    c_mask, q_mask = batch["c_mask"], batch["q_mask"]
    with torch.no_grad():
        e_p, e_q = model.embed(batch, "c"), model.embed(batch, "q")
        h_p = model.shared_encoder(e_p, c_mask)  # Eq. 2
        u_q = model.shared_encoder(e_q, q_mask)  # Eq. 3: the same weights
        v_q = model.question_encoder(e_q, q_mask) if qpatt_plus else u_q  # Eq. 1 / same U
        assert all(torch.equal(a, b) for a, b in zip(model.encode(batch), (h_p, u_q, v_q)))
        h1 = torch.softmax((h_p @ u_q.mT).masked_fill(~q_mask[:, None], -1e30), -1) @ v_q
        h2 = torch.softmax((h1 @ u_q.mT).masked_fill(~q_mask[:, None], -1e30), -1) @ v_q
        c = highway(model.outer_fusion, torch.cat([h_p, h1, h2], -1))  # C^0 and Eqs. 6-8
        for fuse in model.inner_fusion:
            S = torch.softmax((c @ c.mT).masked_fill(~c_mask[:, None], -1e30), -1)
            c = fuse(c, S @ c)
        got, qp_scores, self_scores = model.attend(h_p, u_q, v_q, c_mask, q_mask)
    real = c_mask[..., None]
    assert torch.allclose(got * real, c * real, atol=1e-5)
    assert len(qp_scores) == 2 and len(self_scores) == 2


def test_iterative_aligner_recomputed():
    model = build("iterative_aligner", qpatt_plus=True).eval()
    batch = make_batch()
    c_mask, q_mask = batch["c_mask"], batch["q_mask"]
    with torch.no_grad():
        h_p, u_q, v_q = model.encode(batch)
        c = h_p
        for q_fuse, s_fuse in zip(model.question_fusion, model.self_fusion):
            a = torch.softmax((c @ u_q.mT).masked_fill(~q_mask[:, None], -1e30), -1) @ v_q
            c = q_fuse(c, a)  # L^Q -> F_inner
            S = torch.softmax((c @ c.mT).masked_fill(~c_mask[:, None], -1e30), -1)
            c = s_fuse(c, S @ c)  # L^S -> F_inner
        got = model.attend(h_p, u_q, v_q, c_mask, q_mask)[0]
    real = c_mask[..., None]
    assert torch.allclose(got * real, c * real, atol=1e-5)


def test_memory_answer_pointer_hops():
    torch.manual_seed(3)
    pointer = MemoryAnswerPointer(4, hops=2)
    r, z = torch.randn(2, 6, 4), torch.randn(2, 4)
    c_mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])

    def score(layer, z):
        zz = z[:, None].expand_as(r)
        s = layer.w(torch.tanh(layer.W(torch.cat([r, zz, r * zz], -1)))).squeeze(-1)
        return s.masked_fill(~c_mask, -1e30)

    hops = pointer(r, z, c_mask)
    for start, end in hops:
        s = score(pointer.start_score, z)
        z = pointer.start_fusion(z, torch.einsum("bj,bjd->bd", s.softmax(-1), r))
        e = score(pointer.end_score, z)
        z = pointer.end_fusion(z, torch.einsum("bj,bjd->bd", e.softmax(-1), r))
        assert torch.allclose(start[c_mask], s[c_mask], atol=1e-5)
        assert torch.allclose(end[c_mask], e[c_mask], atol=1e-5)
        assert (start[~c_mask] < -1e30).all() and (end[~c_mask] < -1e30).all()
    assert len(hops) == 2


def test_model_returns_the_last_hop():
    model = build().eval()
    batch = make_batch()
    with torch.no_grad():
        out = model(batch)
        h_p, u_q, v_q = model.encode(batch)
        c = model.attend(h_p, u_q, v_q, batch["c_mask"], batch["q_mask"])[0]
        r = model.evidence(c, batch["c_mask"])
        hops = model.pointer(r, model.summary(v_q, batch["q_mask"]), batch["c_mask"])
    assert torch.equal(out["start_logits"], hops[-1][0])
    assert torch.equal(out["end_logits"], hops[-1][1])
    assert not torch.equal(hops[0][0], hops[-1][0])


# --- padding, gradients ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["phasecond", "iterative_aligner"])
def test_padding_does_not_change_real_positions(name):
    model = build(name).eval()
    with torch.no_grad():
        a = model(make_batch())
        b = model(make_batch(pad_c=4, pad_q=3))
    mask = make_batch()["c_mask"]
    for key in ("start_logits", "end_logits"):
        assert torch.allclose(a[key][mask], b[key][:, :7][mask], atol=1e-5)
        assert (b[key][:, 7:] < -1e30).all()
    assert torch.allclose(a["qp_scores"], b["qp_scores"][:, :, :7, :4], atol=1e-5)
    assert torch.allclose(a["attention"], b["attention"][:, :7, :4], atol=1e-6)


@pytest.mark.parametrize("name", ["phasecond", "iterative_aligner"])
def test_every_parameter_gets_a_gradient(name):
    model = build(name, dropout=0.2).train()
    batch = make_batch()
    reader_loss(model(batch), batch).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, pname


# --- switches ----------------------------------------------------------------------------------


@pytest.mark.parametrize("qp_layers,self_layers", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_layer_switches(qp_layers, self_layers):
    model = build(qp_layers=qp_layers, self_layers=self_layers).eval()
    with torch.no_grad():
        out = model(make_batch())
    assert out["qp_scores"].shape == (2, qp_layers, 7, 4)
    assert out["self_scores"].shape == (2, self_layers, 7, 7)
    assert model.outer_fusion.transforms[0].in_features == (qp_layers + 1) * 8


def test_qpatt_plus_switch():
    plus, same = build(qpatt_plus=True), build(qpatt_plus=False)
    assert plus.question_encoder is not None and same.question_encoder is None
    h_p, u_q, v_q = same.encode(make_batch())
    assert v_q is u_q
    h_p, u_q, v_q = plus.encode(make_batch())
    assert not torch.allclose(v_q, u_q)


def test_tags_switch():
    with pytest.raises(UserError, match="use_tags"):
        build(tagged=False, use_tags=True)
    with pytest.raises(UserError, match="no POS/NER"):
        build(tagged=True)(make_batch(tagged=False))
    model = build(tagged=False).eval()  # use_tags=False ignores tags the batch may have
    with torch.no_grad():
        a, b = model(make_batch(tagged=False)), model(make_batch(tagged=True))
    assert torch.equal(a["start_logits"], b["start_logits"])
    assert build(tagged=True).embed.out_dim == model.embed.out_dim + SMALL["pos_dim"] + 2


def test_paper_defaults_and_profiles():
    defaults = hparam_defaults("phasecond")
    assert (defaults["hidden"], defaults["dropout"]) == (128, 0.2)
    assert (defaults["char_channels"], defaults["char_kernel"]) == (100, 5)
    assert hparam_defaults("iterative_aligner")["qpatt_plus"] is False
    for name in ("phasecond", "iterative_aligner"):
        full = resolve_config(name, profile="full")
        assert (full.lr, full.plateau_factor, full.plateau_patience) == (6e-4, 0.5, 1)
        assert full.hparams["hidden"] == 128 and full.hparams["use_tags"] is True
        assert resolve_config(name, profile="smoke").hparams["use_tags"] is False
