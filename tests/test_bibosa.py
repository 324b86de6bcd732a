"""Bi-BloSA (Shen et al. 2018, as DynSAN's Table 3 (g, h) uses it) against loops by hand."""

import math

import pytest
import torch

from mrc_lib.models.bibosa import (
    BiBloSA,
    BiBloSABlock,
    MaskedBlockSelfAttention,
    MultiDimSelfAttention,
    SourceToToken,
    block_length,
    direction_mask,
)

D = 6


def lin(layer, x):
    return x @ layer.weight.T + (layer.bias if layer.bias is not None else 0)


def msa_by_hand(m: MultiDimSelfAttention, x, allowed):
    """Token2token multi-dimensional attention with the fusion gate, one token at a time."""
    n = len(x)
    out = []
    for i in range(n):
        js = [j for j in range(n) if allowed[i][j]]
        if js:
            f = torch.stack([m.c * torch.tanh((lin(m.w1, x[i]) + lin(m.w2, x[j])) / m.c)
                             for j in js])  # [|js|, d]: one score per feature
            s = (f.softmax(0) * x[js]).sum(0)
        else:
            s = torch.zeros(D)
        gate = torch.sigmoid(lin(m.fuse_s, s) + lin(m.fuse_x, x[i]))
        out.append(gate * x[i] + (1 - gate) * s)
    return torch.stack(out)


def s2t_by_hand(m: SourceToToken, h):
    f = torch.stack([lin(m.w, torch.relu(lin(m.w1, hi))) for hi in h])
    return (f.softmax(0) * h).sum(0)


@pytest.mark.parametrize("direction", ["fw", "bw"])
def test_multi_dim_self_attention_by_hand(direction):
    torch.manual_seed(0)
    m = MultiDimSelfAttention(D, direction)
    x = torch.randn(1, 5, D)
    mask = torch.tensor([[True, True, True, True, False]])
    allowed = [[(j < i if direction == "fw" else j > i) and bool(mask[0, j]) for j in range(5)]
               for i in range(5)]
    with torch.no_grad():
        torch.testing.assert_close(m(x, mask)[0], msa_by_hand(m, x[0], allowed))


def test_source_to_token_by_hand():
    torch.manual_seed(0)
    m = SourceToToken(D)
    h = torch.randn(1, 4, D)
    with torch.no_grad():
        torch.testing.assert_close(m(h, torch.ones(1, 4, dtype=torch.bool))[0],
                                   s2t_by_hand(m, h[0]))


@pytest.mark.parametrize("direction", ["fw", "bw"])
def test_masked_block_self_attention_by_hand(direction):
    """Steps 1-4 with r = 3 on 7 tokens: blocks [0-2], [3-5], [6]."""
    torch.manual_seed(0)
    n, r = 7, 3
    m = MaskedBlockSelfAttention(D, direction, block_len=r)
    x = torch.randn(1, n, D)
    mask = torch.ones(1, n, dtype=torch.bool)
    fw = direction == "fw"

    def allowed(k):
        return [[(j < i) if fw else (j > i) for j in range(k)] for i in range(k)]

    with torch.no_grad():
        blocks = [x[0, lo:lo + r] for lo in range(0, n, r)]
        h = [msa_by_hand(m.intra, b, allowed(len(b))) for b in blocks]  # 1.
        v = torch.stack([s2t_by_hand(m.summary, hb) for hb in h])  # 2.
        o = msa_by_hand(m.inter, v, allowed(len(v)))  # 3.
        g = torch.sigmoid(lin(m.gate_o, o) + lin(m.gate_v, v))
        e = g * o + (1 - g) * v
        rows = []
        for t in range(n):  # 4.
            exh = torch.cat([e[t // r], x[0, t], h[t // r][t % r]])
            f, gate = torch.relu(lin(m.fuse_f, exh)), torch.sigmoid(lin(m.fuse_g, exh))
            rows.append(gate * f + (1 - gate) * x[0, t])
        torch.testing.assert_close(m(x, mask)[0], torch.stack(rows), atol=1e-6, rtol=1e-5)


def test_bi_blosa_concatenates_both_directions_and_the_block_length():
    torch.manual_seed(0)
    m = BiBloSA(D, block_len=2)
    x, mask = torch.randn(2, 5, D), torch.ones(2, 5, dtype=torch.bool)
    with torch.no_grad():
        y = m(x, mask)
        fw, bw = m.directions
        torch.testing.assert_close(y, torch.cat([fw(x, mask), bw(x, mask)], -1))
    assert y.shape == (2, 5, 2 * D)
    assert [block_length(n) for n in (4, 32, 500, 5000)] == [2, 4, 10, 22]
    assert block_length(5000) == math.ceil(10000 ** (1 / 3))
    assert direction_mask(3, "fw").tolist() == [[False] * 3, [True, False, False],
                                                [True, True, False]]


@pytest.mark.parametrize("conv", [False, True])
def test_block_ignores_padding_and_is_residual(conv):
    """Table 3 (g) without, (h) with the two convolutions; padding never changes real outputs."""
    torch.manual_seed(0)
    block = BiBloSABlock(D, kernel_size=3, dropout=0.0, conv=conv).eval()
    assert len(block.local.convs) == (2 if conv else 0)
    x = torch.randn(1, 6, D)
    mask = torch.ones(1, 6, dtype=torch.bool)
    padded = torch.cat([x, torch.randn(1, 3, D)], 1)
    pmask = torch.cat([mask, torch.zeros(1, 3, dtype=torch.bool)], 1)
    with torch.no_grad():
        y, g = block(x, mask)
        y_pad, _ = block(padded, pmask)
        u = block.local(x, mask)
        torch.testing.assert_close(y, u + block.out(block.blosa(u, mask)))
    assert g is None
    torch.testing.assert_close(y_pad[:, :6], y, atol=1e-6, rtol=1e-5)
    assert (y_pad[:, 6:] == 0).all()


def test_recomputed_backward_gives_the_same_gradients():
    """Training recomputes the [N, n, n, d] scores in the backward pass (checkpointing)."""
    torch.manual_seed(0)
    m = MultiDimSelfAttention(D, "fw")
    x = torch.randn(2, 5, D, requires_grad=True)
    mask = torch.ones(2, 5, dtype=torch.bool)
    m(x, mask).square().sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in m.parameters()]
    x.grad = None
    m.zero_grad()
    m.attend(x, mask).square().sum().backward()
    for a, b in zip(grads, [x.grad] + [p.grad for p in m.parameters()]):
        torch.testing.assert_close(a, b)
