"""DecaProp (Tay et al. 2018) and the enhanced R-NET baseline: each equation recomputed by hand
from the modules' own parameters, and each Table 7 switch checked for what it removes."""

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from mrc_lib.errors import UserError
from mrc_lib.models import build_model
from mrc_lib.models.decaprop import BAC, DecaCore, DecaEnc, FactorizationMachine, build_compressor
from mrc_lib.models.rnet import CharRNN, GatedAttention, passage_frequency

V, N_CHARS = 40, 20
SMALL = dict(hidden=6, char_dim=4, char_hidden=3, attention_dim=5)
ABLATIONS = {  # Table 7's rows on DecaProp; (1) "remove all" is the rnet reader
    "(2) w/o DecaCore": {"dense_core": False},
    "(3) w/o DecaEnc": {"use_enc": False},
    "(4) w/o cross hierarchy": {"cross_hierarchy": False},
    "(5) w/o gated attention": {"gated_attention": False},
    "(6) n = 2": {"n_layers": 2},
    "(7) n = 4": {"n_layers": 4},
    "(8) linear": {"compressor": "linear"},
    "(9) nonlinear": {"compressor": "nonlinear"},
    "full": {},
    "Eq. 9 as d + 12n": {"core_connectors": "12n"},
    "R-NET gate": {"gate": "concat"},
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
    q_words = torch.randint(2, V, (len(c_len), Lq), generator=g) * q_mask
    c_words = torch.randint(2, V, (len(c_len), Lc), generator=g) * c_mask
    c_words[:, 0] = q_words[:, 0]  # some exact matches
    batch = {
        "c_words": c_words, "q_words": q_words, "c_mask": c_mask, "q_mask": q_mask,
        "c_chars": torch.randint(1, N_CHARS, (len(c_len), Lc, W), generator=g) * c_mask[..., None],
        "q_chars": torch.randint(1, N_CHARS, (len(c_len), Lq, W), generator=g) * q_mask[..., None],
        "c_feats": torch.rand(len(c_len), Lc, 4, generator=g) * c_mask[..., None],
        "q_feats": torch.randint(0, 2, (len(c_len), Lq, 3), generator=g) * q_mask[..., None],
    }
    pads = {"c": pad_c, "q": pad_q}
    for key, value in batch.items():
        n = pads[key[0]]
        if n:
            shape = list(value.shape)
            shape[1] = n
            batch[key] = torch.cat([value, value.new_zeros(shape)], dim=1)
    return batch


def relu_alive(module: nn.Module) -> None:
    """Positive biases on every ``F`` keep its ReLUs alive, so that the scores vary."""
    with torch.no_grad():
        for m in module.modules():
            if hasattr(m, "F"):
                m.F[1].bias.fill_(2.0)


def affinity_by_hand(aff, P: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """``E_ij = F(p_i)ᵀ F(q_j) / √d`` with explicit loops (Eqs. 1 and 6)."""
    W, b = aff.F[1].weight, aff.F[1].bias
    E = torch.stack([torch.stack([torch.relu(W @ pi + b) @ torch.relu(W @ qj + b) for qj in Q])
                     for pi in P])
    return E / math.sqrt(W.shape[0])


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
    linear = build_compressor("linear", 6, 3)
    assert [m.weight.shape for m in linear if hasattr(m, "weight")] == [(1, 6)]
    with pytest.raises(UserError):
        build_compressor("mlp", 6, 3)


# --- Eqs. 1-3: the bidirectional attention connector -------------------------------------------


def test_bac_equations_recomputed_directly():
    torch.manual_seed(0)
    d, proj = 4, 3
    bac = BAC(d, proj_dim=proj, k=2).eval()
    relu_alive(bac)
    p_mask, q_mask = lengths_mask([5, 3], 5), lengths_mask([4, 2], 4)
    p, q = torch.randn(2, 5, d), torch.randn(2, 4, d)
    g_p, g_q = bac(p, q, p_mask, q_mask)
    G1, G2, G3 = bac.G
    for n in range(2):
        P, Q = p[n, :int(p_mask[n].sum())], q[n, :int(q_mask[n].sum())]
        E = affinity_by_hand(bac.affinity, P, Q)  # Eq. 1
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


# --- Eq. 5: DecaEnc ----------------------------------------------------------------------------


def test_decaenc_sizes_and_connectors():
    torch.manual_seed(0)
    h, n = 3, 3
    enc = DecaEnc(5, h, n_layers=n, proj_dim=4, k=2).eval()
    # d -> 2h, then 2h + 3 -> 2h: the same-level BAC features feed the next layer.
    assert [rnn.layers[0].input_size for rnn in enc.layers] == [5, 2 * h + 3, 2 * h + 3]
    assert enc.out_dim == 2 * h * n + 3 * n * n
    p_mask, q_mask = lengths_mask([6, 4], 6), lengths_mask([3, 2], 3)
    p, q = torch.randn(2, 6, 5), torch.randn(2, 3, 5)
    (p_out, q_out), (ps, qs), (z_p, z_q) = enc(p, q, p_mask, q_mask)
    assert p_out.shape == (2, 6, enc.out_dim) and q_out.shape == (2, 3, enc.out_dim)
    assert z_p.shape == (2, 6, n * n, 3) and z_q.shape == (2, 3, n * n, 3)
    # The layers by hand: P¹ = BiRNN(P), P² = BiRNN([P¹; g^p of BAC(P¹, Q¹)]), ...
    x_p, x_q = p, q
    for i in range(n):
        if i:
            g_p, g_q = enc.bacs[f"{i - 1}_{i - 1}"](ps[i - 1], qs[i - 1], p_mask, q_mask)
            x_p, x_q = torch.cat([ps[i - 1], g_p], -1), torch.cat([qs[i - 1], g_q], -1)
        torch.testing.assert_close(ps[i], enc.layers[i](x_p, p_mask))
        torch.testing.assert_close(qs[i], enc.layers[i](x_q, q_mask))
    # Eq. 5: Z^{ij} = F_C(Pⁱ, Qʲ) for every pair, e.g. (P¹, Q³).
    for i, j in [(0, 2), (2, 0), (1, 1)]:
        want_p, want_q = enc.bacs[f"{i}_{j}"](ps[i], qs[j], p_mask, q_mask)
        torch.testing.assert_close(z_p[:, :, enc.pairs.index((i, j))], want_p)
        torch.testing.assert_close(z_q[:, :, enc.pairs.index((i, j))], want_q)
    torch.testing.assert_close(p_out, torch.cat([*ps, z_p.flatten(2)], -1))


# --- Eqs. 6-8: gated attention ---------------------------------------------------------------


@pytest.mark.parametrize("gate", ["p", "concat"])
def test_gated_attention_eqs_6_to_8(gate):
    torch.manual_seed(0)
    ga = GatedAttention(4, 3, proj_dim=4, gate=gate, bias=gate == "p").eval()
    relu_alive(ga)
    seen = {}
    ga.rnn.register_forward_pre_hook(lambda _, args: seen.update(x=args[0]))
    p_mask, q_mask = lengths_mask([5], 5), lengths_mask([3], 4)
    p, q = torch.randn(1, 5, 4), torch.randn(1, 4, 4)
    out, attn = ga(p, q, p_mask, q_mask)
    S = affinity_by_hand(ga.affinity, p[0], q[0, :3])  # Eq. 6
    P_bar = torch.softmax(S, dim=1) @ q[0, :3]  # Eq. 7
    pb = torch.cat([p[0], P_bar], dim=-1)
    W_g, b_g = ga.gate[1].weight, ga.gate[1].bias
    if gate == "p":  # Eq. 8 as printed: σ(W_g [P; P̄] + b_g) ⊙ P
        assert W_g.shape == (4, 8) and b_g is not None
        want = torch.sigmoid(pb @ W_g.T + b_g) * p[0]
    else:  # R-NET: σ(W_g [P; P̄]) ⊙ [P; P̄]
        assert W_g.shape == (8, 8) and b_g is None
        want = torch.sigmoid(pb @ W_g.T) * pb
    torch.testing.assert_close(seen["x"][0], want)
    torch.testing.assert_close(out, ga.rnn(want[None], p_mask))  # P' = BiRNN(...)
    torch.testing.assert_close(attn[0, :, :3], torch.softmax(S, dim=1))
    assert not attn[0, :, 3].any()
    with pytest.raises(UserError):
        GatedAttention(4, 3, proj_dim=4, gate="sum")


# --- Eq. 9: the dense core ---------------------------------------------------------------------


@pytest.mark.parametrize("connectors", ["eq9", "12n"])
def test_dense_core_eq_9(connectors):
    torch.manual_seed(0)
    h, n = 3, 2
    core = DecaCore(7, h, n_layers=n, connectors=connectors, proj_dim=4, k=2).eval()
    p_mask, q_mask = lengths_mask([6, 4], 6), lengths_mask([3, 2], 3)
    p, q = torch.randn(2, 6, 7), torch.randn(2, 3, 7)
    ps = [torch.randn(2, 6, 2 * h) * p_mask[..., None] for _ in range(n)]
    qs = [torch.randn(2, 3, 2 * h) * q_mask[..., None] for _ in range(n)]
    m, _ = core(p, q, p_mask, q_mask, (ps, qs))
    u1, u2, _ = core.match(p, q, p_mask, q_mask)
    targets = [(x, q_mask) for x in qs] + ([(x, p_mask) for x in ps] if connectors == "12n" else [])
    assert len(core.bacs) == 2 * len(targets)
    r, b = [], 0
    for u in (u1, u2):  # R^{kj} = F'_C(U^j, Q^k), j = 1, 2, k = 1..n
        for x, mask in targets:
            r.append(core.bacs[b].one_sided(u, x, p_mask, mask))
            b += 1
    torch.testing.assert_close(m, torch.cat([u2, *r], -1))  # M = [U²; R']
    assert core.out_dim == 2 * h + (6 * n if connectors == "eq9" else 12 * n)
    with pytest.raises(UserError):
        DecaCore(7, h, connectors="all", proj_dim=4)


# --- Sec. 3.1 inputs, Eqs. 10-11 pointer --------------------------------------------------------


def test_passage_frequency():
    q = torch.tensor([[3, 4, 5, 1, 0]])
    c = torch.tensor([[5, 7, 3, 3, 1, 4]])
    c_mask = torch.tensor([[True, True, True, True, True, False]])  # the 4 is padding
    # 3 occurs twice in 5 passage words, 4 only in padding, 5 once, UNK (1) never counts.
    torch.testing.assert_close(passage_frequency(q, c, c_mask)[0],
                               torch.tensor([0.4, 0.0, 0.2, 0.0, 0.0]))


def test_char_rnn_is_each_words_final_states_and_zero_at_padding():
    torch.manual_seed(0)
    char_rnn = CharRNN(n_chars=12, char_dim=3, hidden=4).eval()
    chars = torch.tensor([[[3, 5, 2], [7, 0, 0], [0, 0, 0]], [[4, 4, 4], [9, 1, 0], [6, 0, 0]]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    with torch.no_grad():
        out = char_rnn(chars, mask)
        for b, t in mask.nonzero().tolist():  # one word at a time, its real characters only
            word = chars[b, t][chars[b, t] != 0].unsqueeze(0)
            states = char_rnn.rnn.layers[0](char_rnn.embed(word))[1]  # [2, 1, 4]
            torch.testing.assert_close(out[b, t], states.flatten(), rtol=1e-5, atol=1e-6)
    assert (out[0, 2] == 0).all()


def test_input_encoder_sec_3_1(vocab):
    torch.manual_seed(0)
    model = build_model("decaprop", vocab, **SMALL).eval()
    emb = model.embed
    assert emb.out_dim == 8 + 2 * SMALL["char_hidden"] + 2  # d_w + h_c + 2
    assert not any("highway" in name for name, _ in model.named_modules())
    batch = make_batch()
    p, q = emb(batch)
    c_feats = batch["c_feats"][..., [1, 3]]  # lower-case match, term frequency
    want_p = torch.cat([emb.word(batch["c_words"]), emb.char(batch["c_chars"], batch["c_mask"]),
                        c_feats], -1)
    torch.testing.assert_close(p, want_p)
    torch.testing.assert_close(q[..., -2], batch["q_feats"][..., 1].float())  # lower-case match
    torch.testing.assert_close(q[..., -1], passage_frequency(batch["q_words"], batch["c_words"],
                                                             batch["c_mask"]))


def test_pointer_eqs_10_11(vocab):
    torch.manual_seed(0)
    model = build_model("decaprop", vocab, **SMALL).eval()
    seen = {}
    model.pointer.register_forward_pre_hook(lambda _, args: seen.update(m=args[0]))
    batch = make_batch()
    out = model(batch)
    ptr, mask = model.pointer, batch["c_mask"]
    h1 = ptr.rnn1(seen["m"], mask)  # H†₁ = BiRNN(M)
    h2 = ptr.rnn2(h1, mask)  # H†₂ = BiRNN(H†₁)
    assert ptr.w1[1].bias is None and ptr.w2[1].bias is None  # w₁, w₂ ∈ R^d only
    start = h1 @ ptr.w1[1].weight[0]  # w₁ᵀH†₁
    end = h2 @ ptr.w2[1].weight[0]
    torch.testing.assert_close(out["start_logits"][mask], start[mask])
    torch.testing.assert_close(out["end_logits"][mask], end[mask])


# --- dropout (Sec. 4.2) ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["decaprop", "rnet"])
def test_dropout_before_every_dense_layer_and_rnn(vocab, name):
    model = build_model(name, vocab, dropout=0.3, **SMALL)
    rnns = [m for m in model.modules() if hasattr(m, "layers") and hasattr(m, "dropout")]
    assert rnns and all(m.dropout.p == 0.3 for m in rnns)  # locked dropout on each RNN input
    dense = [m for m in model.modules() if isinstance(m, nn.Sequential)
             and any(isinstance(x, nn.Linear) for x in m)
             and not type(m).__name__ == "MLPCompressor"]
    assert dense and all(isinstance(m[0], nn.Dropout) and m[0].p == 0.3 for m in dense)
    bacs = [m for m in model.modules() if isinstance(m, BAC)]
    assert all(b.dropout.p == 0.3 for b in bacs)  # on the compressors' inputs
    assert (name == "decaprop") == bool(bacs)
    batch = make_batch()
    torch.manual_seed(0)
    a = model(batch)["start_logits"]
    b = model(batch)["start_logits"]
    assert not torch.equal(a, b)  # training mode: dropout active
    model.eval()
    torch.testing.assert_close(model(batch)["start_logits"], model(batch)["start_logits"])


# --- the readers and Table 7's switches ---------------------------------------------------------


@pytest.mark.parametrize("name", list(ABLATIONS))
def test_each_ablation_builds_and_runs(vocab, name):
    torch.manual_seed(0)
    model = build_model("decaprop", vocab, factors=3, **SMALL, **ABLATIONS[name])
    batch = make_batch()
    out = model(batch)
    assert out["start_logits"].shape == out["end_logits"].shape == (3, 9)
    for key in ("start_logits", "end_logits"):
        real = out[key][batch["c_mask"]]
        assert torch.isfinite(real).all()
        assert (out[key][~batch["c_mask"]] == torch.finfo(torch.float32).min).all()


def test_what_each_ablation_removes(vocab):
    h, n = SMALL["hidden"], 3

    def build(**kw):
        return build_model("decaprop", vocab, factors=3, **SMALL, **kw)

    full = build()
    assert len(full.enc.bacs) == n * n and len(full.core.bacs) == 2 * n
    assert full.core.out_dim == 2 * h + 6 * n
    # (1) remove all: R-NET has no connector at all, and R-NET's gate.
    rnet = build_model("rnet", vocab, **SMALL)
    assert not [m for m in rnet.modules() if isinstance(m, BAC)]
    assert rnet.core.question.gate_on == "concat" and rnet.core.question.gate[1].bias is None
    # (2) w/o DecaCore: the gated attention layers stay, M = U².
    no_core = build(dense_core=False).eval()
    assert not no_core.core.bacs and no_core.core.match.attention
    seen = {}
    no_core.pointer.register_forward_pre_hook(lambda _, args: seen.update(m=args[0]))
    batch = make_batch()
    no_core(batch)
    p, q = no_core.embed(batch)
    (p, q), _, _ = no_core.enc(p, q, batch["c_mask"], batch["q_mask"])
    _, u2, _ = no_core.core.match(p, q, batch["c_mask"], batch["q_mask"])
    torch.testing.assert_close(seen["m"], u2)
    # (3) w/o DecaEnc: a plain 3-layer BiRNN, its top layer as output; the core stays dense.
    no_enc = build(use_enc=False)
    assert not no_enc.enc.bacs and len(no_enc.enc.layers) == n and no_enc.enc.out_dim == 2 * h
    assert len(no_enc.core.bacs) == 2 * n
    # (4) w/o cross hierarchy: same-level connectors only.
    assert build(cross_hierarchy=False).enc.pairs == [(i, i) for i in range(n)]
    # (5) w/o gated attention: no attention, no gate, U¹ = BiRNN(P'), U² = BiRNN(U¹).
    no_ga = build(gated_attention=False).eval()
    assert not [m for m in no_ga.modules() if isinstance(m, GatedAttention)]
    assert "attention" not in no_ga(batch)
    p, q = no_ga.embed(batch)
    (p, q), _, _ = no_ga.enc(p, q, batch["c_mask"], batch["q_mask"])
    u1, u2, _ = no_ga.core.match(p, q, batch["c_mask"], batch["q_mask"])
    torch.testing.assert_close(u1, no_ga.core.match.question(p, batch["c_mask"]))
    torch.testing.assert_close(u2, no_ga.core.match.self_match(u1, batch["c_mask"]))
    assert len(no_ga.core.bacs) == 2 * n
    # (6)-(7) the DecaEnc depth, with the dense core following it.
    for depth in (2, 4):
        m = build(n_layers=depth)
        assert len(m.enc.layers) == depth and len(m.enc.bacs) == depth ** 2
        assert len(m.core.bacs) == 2 * depth
    # (8)-(9) the compressors.
    assert all(type(g).__name__ == "MLPCompressor" and len(g) == 1
               for b in build(compressor="linear").modules() if isinstance(b, BAC) for g in b.G)
    assert all(len(g) == 3
               for b in build(compressor="nonlinear").modules() if isinstance(b, BAC)
               for g in b.G)
    # Eq. 9 read as d + 12n.
    assert build(core_connectors="12n").core.out_dim == 2 * h + 12 * n


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


class FakeSplit:
    """The dev-split interface ``analysis`` uses: ``collate``, ``tokens``, ``question``."""

    def __init__(self):
        self.batch = make_batch()

    def __len__(self):
        return 3

    def collate(self, idx):
        return {k: v[torch.as_tensor(idx)] for k, v in self.batch.items()}

    def tokens(self, i, side="c"):
        return [f"w{t}" for t in range(int(self.batch[f"{side}_mask"][i].sum()))]

    def question(self, i):
        return " ".join(self.tokens(i, "q"))


def test_analysis_payload(vocab):
    torch.manual_seed(0)
    model = build_model("decaprop", vocab, **SMALL).eval()
    split = FakeSplit()
    data = SimpleNamespace(splits={"dev": split})
    with torch.no_grad():
        payload = model.analysis(data, None)
        p, q = model.embed(split.batch)
        *_, (z_p, _) = model.enc(p, q, split.batch["c_mask"], split.batch["q_mask"])
    assert payload["pairs"] == [[i, j] for i in range(3) for j in range(3)]
    assert [e["index"] for e in payload["examples"]] == [0, 1]
    first = payload["examples"][1]
    assert len(first["tokens"]) == 6 and np.shape(first["features"]) == (6, 9, 3)
    np.testing.assert_allclose(first["features"], z_p[1, :6].numpy(), atol=1e-4)
    assert len(json.dumps(payload)) < 200_000
    assert build_model("decaprop", vocab, use_enc=False, **SMALL).analysis(data, None) == {}


def test_plateau_on_dev_em_sec_4_2():
    """Sec. 4.2: the learning rate is halved after 3 epochs without a better dev EM."""
    from mrc_lib.config import resolve_config
    from mrc_lib.tasks import get_task

    cfg = resolve_config("decaprop", "squad-v1.1", "full")
    assert (cfg.plateau_metric, cfg.plateau_factor, cfg.plateau_patience) == ("em", 0.5, 3)
    assert (cfg.optimizer, cfg.lr, cfg.ema_decay, cfg.grad_clip) == ("adadelta", 0.5, None, None)
    task = get_task(cfg.task)  # what the trainer's plateau schedule watches
    assert task.score({"exact_match": 50.0, "f1": 60.0}, cfg.plateau_metric) == 50.0
    assert task.score({"exact": 40.0, "f1": 45.0}, cfg.plateau_metric) == 40.0
    assert task.score({"exact_match": 50.0, "f1": 60.0}, "f1") == 60.0
