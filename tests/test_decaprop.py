"""DecaProp (Tay et al. 2018) and the enhanced R-NET baseline: each equation recomputed directly."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mrc_lib.errors import UserError
from mrc_lib.models import build_model
from mrc_lib.models.decaprop import BAC, DecaEnc, FactorizationMachine, build_compressor
from mrc_lib.models.rnet import GatedAttention, question_match

V, N_CHARS = 40, 20
SMALL = dict(hidden=6, char_dim=4, char_hidden=3, attention_dim=5)
ABLATIONS = {
    "full": {},
    "no DecaCore": {"use_core": False},
    "no DecaEnc": {"use_enc": False},
    "no cross-hierarchy": {"cross_hierarchy": False},
    "no gated attention": {"gated_attention": False},
    "n = 2": {"n_layers": 2},
    "n = 4": {"n_layers": 4},
    "linear compressor": {"compressor": "linear"},
    "nonlinear compressor": {"compressor": "nonlinear"},
}


@pytest.fixture
def vocab():
    rng = np.random.default_rng(0)
    return SimpleNamespace(word_vectors=rng.normal(size=(V, 8)).astype(np.float32),
                           n_trainable=6, n_chars=N_CHARS, n_feats=4)


def lengths_mask(lengths: list[int], total: int) -> torch.Tensor:
    return torch.arange(total)[None] < torch.tensor(lengths)[:, None]


def make_batch(c_len=(9, 6, 4), q_len=(5, 3, 2), pad_c=0, pad_q=0, seed=0):
    """A random batch; ``pad_c``/``pad_q`` extra padding columns leave the content unchanged."""
    g = torch.Generator().manual_seed(seed)
    Lc, Lq, W = max(c_len), max(q_len), 4
    c_mask, q_mask = lengths_mask(list(c_len), Lc), lengths_mask(list(q_len), Lq)
    q_words = torch.randint(1, V, (len(c_len), Lq), generator=g) * q_mask
    c_words = torch.randint(1, V, (len(c_len), Lc), generator=g) * c_mask
    c_words[:, 0] = q_words[:, 0]  # some exact matches
    batch = {
        "c_words": c_words, "q_words": q_words, "c_mask": c_mask, "q_mask": q_mask,
        "c_chars": torch.randint(1, N_CHARS, (len(c_len), Lc, W), generator=g) * c_mask[..., None],
        "q_chars": torch.randint(1, N_CHARS, (len(c_len), Lq, W), generator=g) * q_mask[..., None],
        "c_feats": torch.rand(len(c_len), Lc, 4, generator=g) * c_mask[..., None],
    }
    pads = {"c": pad_c, "q": pad_q}
    for key, value in batch.items():
        n = pads[key[0]]
        if n:
            shape = list(value.shape)
            shape[1] = n
            batch[key] = torch.cat([value, value.new_zeros(shape)], dim=1)
    return batch


# --- Eq. 4: the factorization machine --------------------------------------------------------


def fm_direct(fm: FactorizationMachine, x: torch.Tensor) -> torch.Tensor:
    """``w₀ + Σ wᵢxᵢ + Σ_{i<j} ⟨vᵢ, vⱼ⟩ xᵢxⱼ`` with the explicit double sum."""
    n = x.shape[0]
    total = fm.linear.bias[0] + fm.linear.weight[0] @ x
    for i in range(n):
        for j in range(i + 1, n):
            total = total + (fm.V[i] @ fm.V[j]) * x[i] * x[j]
    return total


def test_fm_equals_explicit_double_sum():
    torch.manual_seed(0)
    fm = FactorizationMachine(7, k=4)
    with torch.no_grad():
        fm.V.normal_()  # interactions as large as the linear part
    x = torch.randn(2, 3, 7)
    out = fm(x)
    assert out.shape == (2, 3)
    direct = torch.stack([fm_direct(fm, v) for v in x.reshape(-1, 7)]).view(2, 3)
    torch.testing.assert_close(out, direct, rtol=1e-5, atol=1e-5)


def test_compressors_map_to_scalars():
    x = torch.randn(2, 5, 6)
    for kind in ("fm", "linear", "nonlinear"):
        assert build_compressor(kind, 6, 3)(x).shape == (2, 5)
    nonlinear = build_compressor("nonlinear", 6, 3)
    assert [m.weight.shape for m in nonlinear if hasattr(m, "weight")] == [(6, 6), (1, 6)]
    with pytest.raises(UserError):
        build_compressor("mlp", 6, 3)


# --- Eqs. 1-3: the bidirectional attention connector -------------------------------------------


def test_bac_equations_recomputed_directly():
    torch.manual_seed(0)
    d, proj = 4, 3
    bac = BAC(d, proj_dim=proj, k=2)
    with torch.no_grad():  # keep every ReLU of F alive, so that E varies
        bac.affinity.F[0].bias.fill_(2.0)
    p_mask, q_mask = lengths_mask([5, 3], 5), lengths_mask([4, 2], 4)
    p, q = torch.randn(2, 5, d), torch.randn(2, 4, d)
    g_p, g_q = bac(p, q, p_mask, q_mask)
    W, b = bac.affinity.F[0].weight, bac.affinity.F[0].bias
    G1, G2, G3 = bac.G
    for n in range(2):
        P, Q = p[n, :int(p_mask[n].sum())], q[n, :int(q_mask[n].sum())]
        E = torch.stack([torch.stack([torch.relu(W @ pi + b) @ torch.relu(W @ qj + b)
                                      for qj in Q]) for pi in P]) / math.sqrt(proj)  # Eq. 1
        assert E.std() > 0.1
        B = torch.softmax(E, dim=1) @ Q  # Eq. 2: B = Softmax(E) Q
        A = torch.softmax(E.T, dim=1) @ P  # Eq. 2: A = Softmax(Eᵀ) P
        for i, (bi, pi) in enumerate(zip(B, P)):  # Eq. 3, passage side
            want = torch.stack([G1(torch.cat([bi, pi])), G2(bi - pi), G3(bi * pi)])
            torch.testing.assert_close(g_p[n, i], want, rtol=1e-5, atol=1e-5)
        for j, (aj, qj) in enumerate(zip(A, Q)):  # Eq. 3, query side
            want = torch.stack([G1(torch.cat([aj, qj])), G2(aj - qj), G3(aj * qj)])
            torch.testing.assert_close(g_q[n, j], want, rtol=1e-5, atol=1e-5)
    assert not g_p[~p_mask].any() and not g_q[~q_mask].any()  # exactly zero at padding
    torch.testing.assert_close(bac.one_sided(p, q, p_mask, q_mask), g_p)


def test_bac_ignores_padding():
    torch.manual_seed(0)
    bac = BAC(4, proj_dim=4, k=2)
    p, q = torch.randn(1, 5, 4), torch.randn(1, 3, 4)
    full = bac(p, q, torch.ones(1, 5, dtype=torch.bool), torch.ones(1, 3, dtype=torch.bool))
    p_pad, q_pad = torch.cat([p, torch.randn(1, 2, 4)], 1), torch.cat([q, torch.randn(1, 4, 4)], 1)
    padded = bac(p_pad, q_pad, lengths_mask([5], 7), lengths_mask([3], 7))
    torch.testing.assert_close(padded[0][:, :5], full[0])
    torch.testing.assert_close(padded[1][:, :3], full[1])


# --- DecaEnc, DecaCore, gated attention -----------------------------------------------------


def test_decaenc_sizes_and_connectors():
    torch.manual_seed(0)
    h, n = 3, 3
    enc = DecaEnc(5, h, n_layers=n, proj_dim=4, k=2)
    # d -> 2h, then 2h + 3 -> 2h: the same-level BAC features feed the next layer.
    assert [rnn.layers[0].input_size for rnn in enc.layers] == [5, 2 * h + 3, 2 * h + 3]
    assert enc.out_dim == 2 * h * n + 3 * n * n
    p_mask, q_mask = lengths_mask([6, 4], 6), lengths_mask([3, 2], 3)
    (p_out, q_out), (ps, qs), (z_p, z_q) = enc(torch.randn(2, 6, 5), torch.randn(2, 3, 5),
                                               p_mask, q_mask)
    assert p_out.shape == (2, 6, enc.out_dim) and q_out.shape == (2, 3, enc.out_dim)
    assert z_p.shape == (2, 6, n * n, 3) and z_q.shape == (2, 3, n * n, 3)
    # Cross-hierarchy pair (0, 2) is the BAC between P¹ and Q³.
    want = enc.bacs["0_2"](ps[0], qs[2], p_mask, q_mask)[0]
    torch.testing.assert_close(z_p[:, :, enc.pairs.index((0, 2))], want)
    plain = DecaEnc(5, h, n_layers=n, dense=False, proj_dim=4, k=2)
    assert plain.out_dim == 2 * h and not plain.bacs
    same_level = DecaEnc(5, h, n_layers=n, cross_hierarchy=False, proj_dim=4, k=2)
    assert same_level.pairs == [(0, 0), (1, 1), (2, 2)]


def test_gated_attention_eqs_6_7():
    torch.manual_seed(0)
    ga = GatedAttention(4, 3, proj_dim=4)
    seen = {}
    ga.rnn.register_forward_pre_hook(lambda _, args: seen.update(x=args[0]))
    p_mask, q_mask = lengths_mask([5], 5), lengths_mask([3], 4)
    p, q = torch.randn(1, 5, 4), torch.randn(1, 4, 4)
    _, attn = ga(p, q, p_mask, q_mask)
    E = ga.affinity(p, q)[0, :, :3]
    b = torch.softmax(E, dim=1) @ q[0, :3]  # Eq. 6
    pb = torch.cat([p[0], b], dim=-1)
    torch.testing.assert_close(seen["x"][0], torch.sigmoid(pb @ ga.gate.weight.T) * pb)  # Eq. 7
    torch.testing.assert_close(attn[0, :, :3], torch.softmax(E, dim=1))
    assert not attn[0, :, 3].any()


def test_question_match_from_word_ids():
    q = torch.tensor([[3, 4, 5, 0]])
    c = torch.tensor([[5, 7, 3, 4]])
    c_mask = torch.tensor([[True, True, True, False]])  # the 4 is padding
    assert question_match(q, c, c_mask).tolist() == [[1.0, 0.0, 1.0, 0.0]]


# --- the readers -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ABLATIONS))
def test_each_ablation_builds_and_runs(vocab, name):
    torch.manual_seed(0)
    model = build_model("decaprop", vocab, factors=3, **SMALL, **ABLATIONS[name])
    batch = make_batch()
    out = model(batch)
    assert out["start_logits"].shape == out["end_logits"].shape == (3, 9)
    assert out["attention"].shape == (3, 9, 5)
    for key in ("start_logits", "end_logits"):
        real = out[key][batch["c_mask"]]
        assert torch.isfinite(real).all()
        assert (out[key][~batch["c_mask"]] == torch.finfo(torch.float32).min).all()
    n = ABLATIONS[name].get("n_layers", 3)
    if ABLATIONS[name].get("use_enc", True):
        pairs = n if ABLATIONS[name].get("cross_hierarchy") is False else n * n
        assert out["connectors"].shape == (3, 9, pairs, 3)
    if ABLATIONS[name].get("use_core", True):
        assert model.core.out_dim == 2 * SMALL["hidden"] + 12 * n  # M = [U²; R′]


def test_decaprop_needs_an_encoder_or_a_core(vocab):
    with pytest.raises(UserError):
        build_model("decaprop", vocab, use_enc=False, use_core=False, **SMALL)


@pytest.mark.parametrize("name", ["decaprop", "rnet"])
def test_padding_does_not_change_real_positions(vocab, name):
    torch.manual_seed(0)
    model = build_model(name, vocab, **SMALL).eval()
    with torch.no_grad():
        out = model(make_batch())
        padded = model(make_batch(pad_c=3, pad_q=2))
    for key in ("start_logits", "end_logits"):
        torch.testing.assert_close(padded[key][:, :9], out[key], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["decaprop", "rnet"])
def test_gradients_reach_every_parameter(vocab, name):
    torch.manual_seed(0)
    model = build_model(name, vocab, **SMALL)
    batch = make_batch()
    out = model(batch)
    y = torch.tensor([1, 2, 0])
    loss = (torch.nn.functional.cross_entropy(out["start_logits"], y)
            + torch.nn.functional.cross_entropy(out["end_logits"], y))
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert not missing
