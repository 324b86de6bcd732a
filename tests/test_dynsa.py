"""DynSA (Zhuang & Wang 2019, Eqs. 1-6) against direct computations, and the DynSAN reader."""

import math

import numpy as np
import pytest
import torch

from mrc_lib.bench import SyntheticVocab, synthetic_batch
from mrc_lib.models import build_model
from mrc_lib.models.dynsa import DynSA, select_tokens, sparse_attention
from mrc_lib.models.dynsan import PassageLayout
from mrc_lib.nn import span_loss
from mrc_lib.train import reader_loss
from tests.test_models import make_batch, tiny_vocab

B, L, D, H = 3, 11, 16, 4
LENGTHS = [11, 7, 2]


@pytest.fixture
def inputs():
    torch.manual_seed(0)
    mask = torch.arange(L)[None] < torch.tensor(LENGTHS)[:, None]
    return torch.randn(B, L, D), mask


def direct_dynsa(block: DynSA, x, mask, chosen_sets):
    """Eqs. 1-5 token by token: attention among ``chosen_sets[b][h]`` (real positions)."""
    u = block.local_encoder(x, mask)
    f = block.f_u(block.norm(u))
    d = D // H
    y = torch.zeros_like(x)
    for b in range(B):
        n = int(mask[b].sum())
        g = torch.sigmoid(block.f_g(f[b, :n]))  # Eq. 1: [n, H]
        z = []
        for h in range(H):
            f_h = f[b, :n, h * d:(h + 1) * d]
            a_h = torch.zeros_like(f_h)
            idx = sorted(chosen_sets[b][h])
            for t in idx:  # Eq. 2 for each chosen token
                weights = torch.softmax(torch.stack([f_h[t] @ f_h[s] for s in idx]) / math.sqrt(d),
                                        0)
                a_h[t] = sum(w * f_h[s] for w, s in zip(weights, idx))
            z.append((f_h + a_h) * (g[:, h] / g[:, h].max()).unsqueeze(-1))  # Eqs. 3-4
        y[b, :n] = block.f_y(torch.cat(z, dim=-1)) + u[b, :n]  # Eq. 5
    return y


def test_k_at_least_length_equals_direct_eqs_1_to_5(inputs):
    x, mask = inputs
    block = DynSA(D, heads=H, top_k=L).eval()
    with torch.no_grad():
        y, g = block(x, mask)
        everything = [[set(range(n))] * H for n in LENGTHS]
        expected = direct_dynsa(block, x, mask, everything)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    assert (g[~mask] == 0).all()


def test_small_k_attends_among_the_top_k_gates(inputs):
    x, mask = inputs
    k = 3
    block = DynSA(D, heads=H, top_k=k).eval()
    with torch.no_grad():
        y, g = block(x, mask)
        top = [[set(np.argsort(-g[b, :n, h].numpy(), kind="stable")[:k].tolist())
                for h in range(H)] for b, n in enumerate(LENGTHS)]
        expected = direct_dynsa(block, x, mask, top)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


def test_selection_is_brute_force_top_k_and_never_padding():
    torch.manual_seed(1)
    scores = torch.rand(B, H, L)
    mask = torch.arange(L)[None] < torch.tensor(LENGTHS)[:, None]
    for k in (1, 4, 7, 20):
        index, chosen = select_tokens(scores, mask, k)
        assert index.shape == (B, H, min(k, L))
        for b, n in enumerate(LENGTHS):
            for h in range(H):
                picked = {int(i) for i, c in zip(index[b, h], chosen[b, h]) if c}
                brute = sorted(range(n), key=lambda t: -float(scores[b, h, t]))[:k]
                assert picked == set(brute)
                assert all(mask[b, int(i)] == c for i, c in zip(index[b, h], chosen[b, h]))
                assert len(set(index[b, h].tolist())) == index.shape[-1]  # no repeats


def test_sparse_attention_never_builds_l_by_l(monkeypatch):
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append(q.shape)
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    f = torch.randn(2, H, 50, 4)
    mask = torch.ones(2, 50, dtype=torch.bool)
    index, chosen = select_tokens(torch.rand(2, H, 50), mask, 5)
    a = sparse_attention(f, index, chosen)
    assert seen == [(2, H, 5, 4)]
    unchosen = torch.ones(2, H, 50, dtype=torch.bool).scatter(2, index, False)
    assert (a[unchosen] == 0).all()


def test_padding_does_not_change_real_outputs(inputs):
    x, mask = inputs
    block = DynSA(D, heads=H, top_k=4).eval()
    padded = torch.cat([x, torch.randn(B, 5, D)], dim=1)
    with torch.no_grad():
        y, _ = block(x, mask)
        y_pad, _ = block(padded, torch.cat([mask, torch.zeros(B, 5, dtype=torch.bool)], 1))
    torch.testing.assert_close(y_pad[:, :L], y, atol=1e-5, rtol=1e-5)
    assert (y_pad[:, L:] == 0).all()


@pytest.mark.parametrize("switches", [{}, {"attention": False}, {"conv": False},
                                      {"selection": "random"}])
def test_gradients_reach_the_gate(inputs, switches):
    x, mask = inputs
    block = DynSA(D, heads=H, top_k=3, **switches).train()
    y, _ = block(x.requires_grad_(), mask)
    y.square().sum().backward()
    assert block.f_g.weight.grad.abs().sum() > 0
    assert x.grad[~mask].abs().sum() == 0  # nothing flows from padding


def test_without_gate_scaling_only_the_penalty_trains_the_gate(inputs):
    x, mask = inputs
    block = DynSA(D, heads=H, top_k=3, gate_scaling=False).train()
    y, _ = block(x, mask)
    y.square().sum().backward()
    assert block.f_g.weight.grad is None or block.f_g.weight.grad.abs().sum() == 0


def test_l1_penalty_is_the_aux_loss_the_trainer_adds():
    """Eq. 6: in training the reader returns β‖G‖₁ over every DynSA gate (question side
    included), averaged over the batch, and ``reader_loss`` adds it to the span loss."""
    torch.manual_seed(0)
    model = build_model("dynsan", tiny_vocab(), **{**TINY, "beta": 0.3}).train()
    batch = make_batch(c_lens=[16, 12], q_lens=[5, 4])
    seen = []
    for m in model.modules():
        if isinstance(m, DynSA):
            m.register_forward_hook(lambda mod, args, out: seen.append(out[1]))
    out = model(batch)
    expected = 0.3 * sum(g.sum() for g in seen) / 2
    assert len(seen) >= 2 + TINY.get("num_blocks", 4)  # question, passages, aligned, blocks
    torch.testing.assert_close(out["aux_loss"], expected)
    span = span_loss(out["start_logits"], out["end_logits"], batch["y1"], batch["y2"])
    torch.testing.assert_close(reader_loss(out, batch), span + out["aux_loss"])
    assert "aux_loss" not in model.eval()(batch)
    assert "aux_loss" not in build_model("dynsan", tiny_vocab(), **{**TINY, "beta": 0.0})(batch)


def test_passage_layout_split_and_merge():
    passage = torch.tensor([[0, 0, 0, 1, 1, 2, 0], [0, 1, 1, 1, 1, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    layout = PassageLayout.of(passage, mask)
    x = torch.arange(14.0).view(2, 7, 1) + 1
    parts = layout.split(x)
    assert parts.shape == (2 * 3, 4, 1)  # B·M passages of the longest passage's length
    expected = [[1, 2, 3, 0], [4, 5, 0, 0], [6, 0, 0, 0],
                [8, 0, 0, 0], [9, 10, 11, 12], [0, 0, 0, 0]]
    assert parts.squeeze(-1).tolist() == expected
    assert layout.passage_mask.long().tolist() == [[int(v > 0) for v in r] for r in expected]
    assert torch.equal(layout.merge(parts), x.masked_fill(~mask.unsqueeze(-1), 0))


def small_reader(vocab, **hparams):
    return build_model("dynsan", vocab, d_model=16, heads=2, top_k=8, num_blocks=2, char_dim=4,
                       char_channels=8, **hparams).eval()


@pytest.fixture
def multi_batch():
    vocab = SyntheticVocab.random(size=600, dim=8)
    batch = synthetic_batch(vocab, 2, 30, question_len=6)
    batch["c_passage"] = (torch.arange(30) // 10).expand(2, 30).clone()
    return vocab, batch


@pytest.mark.parametrize("cross", [True, False])
def test_cross_passage_attention_links_passages(multi_batch, cross):
    vocab, batch = multi_batch
    torch.manual_seed(0)
    model = small_reader(vocab, cross_passage=cross)
    changed = dict(batch, c_words=batch["c_words"].clone())
    changed["c_words"][:, 25] = 7  # a word of the last passage
    with torch.no_grad():
        a, b = model(batch)["start_logits"], model(changed)["start_logits"]
    first_passage_same = torch.allclose(a[:, :10], b[:, :10])
    assert first_passage_same != cross


@pytest.mark.parametrize("block", ["dynsa", "bilstm", "fullsan"])
def test_reader_blocks_train(multi_batch, block):
    vocab, batch = multi_batch
    model = small_reader(vocab, block=block).train()
    out = model(batch)
    assert out["start_logits"].shape == out["end_logits"].shape == (2, 30)
    assert ("gates" in out) == (block == "dynsa")
    if block == "dynsa":
        assert out["gates"].shape == (2, 2 + 2, 30, 2)  # encoder, aligned, N = 2 blocks
    (out["start_logits"].logsumexp(-1) - out["start_logits"][:, 3]).sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "blocks.1" in n)


TINY = dict(d_model=16, heads=2, top_k=4, num_blocks=2, kernel_size=3, char_dim=4,
            char_channels=6, char_kernel=3, dropout=0.0, char_dropout=0.0)


def test_reader_masks_padding_and_ignores_it():
    """Padding gets zero probability and does not change the real positions' outputs, even
    with K smaller than the real lengths (padding must never be chosen)."""
    torch.manual_seed(0)
    model = build_model("dynsan", tiny_vocab(), **TINY).eval()
    short = make_batch([9], [4], seed=3)
    padded = make_batch([9], [4], seed=3, pad_to=(15, 7))
    with torch.no_grad():
        a, b = model(short), model(padded)
    for key in ("start_logits", "end_logits"):
        torch.testing.assert_close(b[key][:, :9], a[key], rtol=1e-5, atol=1e-5)
        assert (torch.softmax(b[key], -1)[:, 9:] == 0).all()
    torch.testing.assert_close(b["attention"].sum(-1), padded["c_mask"].float())


def test_reader_overfits_a_tiny_batch():
    torch.manual_seed(0)
    model = build_model("dynsan", tiny_vocab(), **TINY)
    batch = make_batch(c_lens=[16, 12, 14, 10, 16, 9, 13, 15], q_lens=[5, 4, 5, 3, 4, 5, 2, 4])
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    losses = []
    for _ in range(30):
        out = model(batch)
        loss = span_loss(out["start_logits"], out["end_logits"], batch["y1"], batch["y2"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 10, losses
