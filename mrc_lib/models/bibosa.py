"""Bi-directional block self-attention (Bi-BloSA; Shen et al., ICLR 2018), the block-level
baseline of DynSAN's Table 3 (g, h) and Table 4 (Zhuang & Wang, 2019).

Where DynSA chooses *tokens* to attend among, Bi-BloSA cuts the sequence into blocks of ``r``
tokens, attends within each block, summarises each block in one vector and attends among the
blocks: memory ``O(n·r + (n/r)²)`` per feature instead of ``O(n²)``. Masked block
self-attention (mBloSA) with a directional mask ``M`` (a token sees only earlier tokens,
``fw``, or only later ones, ``bw``), for ``x`` ``[n, d]`` cut into ``m = ⌈n/r⌉`` blocks
``x^l``:

1. intra-block: ``h^l = mSA(x^l, M)``, with the multi-dimensional token2token attention of
   DiSAN: ``f(x_i, x_j) = c·tanh((W^1 x_i + W^2 x_j + b^1)/c) + M_ij`` (a vector, one score per
   feature, ``c = 5``), ``s_i = Σ_j softmax_j(f(x_i, x_j)) ⊙ x_j``, fused with a gate
   ``F = σ(W^f1 s + W^f2 x + b^f)``, ``mSA = F ⊙ x + (1 − F) ⊙ s``;
2. block summary: ``v_l = Σ_i softmax_i(f(h^l_i)) ⊙ h^l_i``, the multi-dimensional
   source2token attention ``f(h) = W relu(W^1 h + b^1) + b`` (the activation is our choice);
3. inter-block: ``o = mSA(v, M)`` over the ``m`` block vectors, gated ``G = σ(W^g1 o + W^g2 v
   + b^g)``, ``e = G ⊙ o + (1 − G) ⊙ v``;
4. context fusion: ``e_l`` is given to every token of block ``l``;
   ``F = relu(W^f1 [e; x; h] + b^f1)``, ``G = σ(W^f2 [e; x; h] + b^f2)``,
   ``u = G ⊙ F + (1 − G) ⊙ x``.

Bi-BloSA is ``[mBloSA_fw(x); mBloSA_bw(x)]``; the block length defaults to
``r = ⌈(2n)^{1/3}⌉``, which minimises the memory ``n·r + (n/r)²`` of the two attentions. Each
score is a ``d``-vector, so the attentions hold ``[·, r, r, d]`` tensors; in training they are
recomputed in the backward pass (activation checkpointing): same gradients, far less memory.

The summary above is our reading of Shen et al. (2018), whose paper is not in this book's
collection; DynSAN used the authors' code. To stand in a DynSA block's place (same width, same
interface) :class:`BiBloSABlock` adds what DynSA has around its attention: the optional local
encoder of two convolutions (row (h)), a linear projection of the ``2D`` output back to ``D``
and the residual ``+ X`` (as in DynSA's Eq. 5).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from mrc_lib.models.dynsa import LocalEncoder
from mrc_lib.nn import masked_softmax, zero_padding

DIRECTIONS = ("fw", "bw")


def block_length(n: int) -> int:
    """``r = ⌈(2n)^{1/3}⌉``: the block length that balances intra- and inter-block memory."""
    return max(1, math.ceil((2 * n) ** (1 / 3)))


def direction_mask(n: int, direction: str, device=None) -> Tensor:
    """``[n, n]`` bool, True where token ``i`` may attend to token ``j``: ``j < i`` (``fw``) or
    ``j > i`` (``bw``)."""
    i = torch.arange(n, device=device)
    return i[None, :] < i[:, None] if direction == "fw" else i[None, :] > i[:, None]


class MultiDimSelfAttention(nn.Module):
    """Masked multi-dimensional token2token self-attention with a fusion gate (step 1 and 3):
    ``x`` ``[N, n, d]``, ``mask`` ``[N, n]`` to ``[N, n, d]``."""

    def __init__(self, dim: int, direction: str, c: float = 5.0):
        super().__init__()
        self.direction, self.c = direction, c
        self.w1 = nn.Linear(dim, dim, bias=False)
        self.w2 = nn.Linear(dim, dim)  # carries b^1
        self.fuse_s = nn.Linear(dim, dim, bias=False)  # W^f1
        self.fuse_x = nn.Linear(dim, dim)  # W^f2, b^f

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        if torch.is_grad_enabled():
            # The [N, n, n, d] scores would be stored several times over for the backward pass
            # (gigabytes at thousands of tokens): recompute them there instead.
            return checkpoint(self.attend, x, mask, use_reentrant=False)
        return self.attend(x, mask)

    def attend(self, x: Tensor, mask: Tensor) -> Tensor:
        n = x.shape[1]
        # f(x_i, x_j) = c · tanh((W^1 x_i + W^2 x_j + b^1) / c): [N, n, n, d]
        f = self.c * torch.tanh((self.w1(x).unsqueeze(2) + self.w2(x).unsqueeze(1)) / self.c)
        allowed = direction_mask(n, self.direction, x.device) & mask[:, None, :]  # [N, n, n]
        p = masked_softmax(f, allowed.unsqueeze(-1), dim=2)  # softmax over j, per feature
        s = (p * x.unsqueeze(1)).sum(2)  # s_i = Σ_j p_ij ⊙ x_j
        gate = torch.sigmoid(self.fuse_s(s) + self.fuse_x(x))
        return gate * x + (1 - gate) * s


class SourceToToken(nn.Module):
    """Multi-dimensional source2token attention (step 2): ``[N, n, d]`` to ``[N, d]``."""

    def __init__(self, dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, dim)
        self.w = nn.Linear(dim, dim)

    def forward(self, h: Tensor, mask: Tensor) -> Tensor:
        p = masked_softmax(self.w(torch.relu(self.w1(h))), mask.unsqueeze(-1), dim=1)
        return (p * h).sum(1)


class MaskedBlockSelfAttention(nn.Module):
    """mBloSA in one direction (steps 1-4): ``[B, n, d]`` to ``[B, n, d]``."""

    def __init__(self, dim: int, direction: str, block_len: int | None = None):
        super().__init__()
        self.block_len = block_len
        self.intra = MultiDimSelfAttention(dim, direction)
        self.summary = SourceToToken(dim)
        self.inter = MultiDimSelfAttention(dim, direction)
        self.gate_o = nn.Linear(dim, dim, bias=False)  # W^g1
        self.gate_v = nn.Linear(dim, dim)  # W^g2, b^g
        self.fuse_f = nn.Linear(3 * dim, dim)  # W^f1, b^f1
        self.fuse_g = nn.Linear(3 * dim, dim)  # W^f2, b^f2

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        B, n, d = x.shape
        # r from the longest real sequence, so that extra padding does not change the blocks
        r = self.block_len or block_length(int(mask.sum(-1).max()))
        m = math.ceil(n / r)
        pad = m * r - n
        xb = nn.functional.pad(x, (0, 0, 0, pad)).view(B * m, r, d)  # the blocks x^l
        mb = nn.functional.pad(mask, (0, pad)).view(B * m, r)
        h = self.intra(xb, mb)  # 1. h^l = mSA(x^l, M)
        v = self.summary(h, mb).view(B, m, d)  # 2. v_l
        block_mask = mb.any(-1).view(B, m)
        o = self.inter(v, block_mask)  # 3. o = mSA(v, M)
        g = torch.sigmoid(self.gate_o(o) + self.gate_v(v))
        e = g * o + (1 - g) * v
        # 4. context fusion, e_l given to every token of block l
        e = e.repeat_interleave(r, dim=1)[:, :n]
        h = h.view(B, m * r, d)[:, :n]
        exh = torch.cat([e, x, h], dim=-1)
        f, g = torch.relu(self.fuse_f(exh)), torch.sigmoid(self.fuse_g(exh))
        return g * f + (1 - g) * x


class BiBloSA(nn.Module):
    """Bi-BloSA: ``[mBloSA_fw(x); mBloSA_bw(x)]``, ``[B, n, d]`` to ``[B, n, 2d]``."""

    def __init__(self, dim: int, block_len: int | None = None):
        super().__init__()
        self.directions = nn.ModuleList(MaskedBlockSelfAttention(dim, k, block_len)
                                        for k in DIRECTIONS)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return torch.cat([mblosa(x, mask) for mblosa in self.directions], dim=-1)


class BiBloSABlock(nn.Module):
    """Bi-BloSA in a DynSA block's place: ``Y = F^O(BiBloSA(U)) + U`` with ``U`` the local
    encoder's output (``conv=True``, Table 3 (h)) or the input (``conv=False``, (g) and
    Table 4's Bi-BloSAN). Same interface as :class:`~mrc_lib.models.dynsa.DynSA`; no gates."""

    def __init__(self, dim: int, num_convs: int = 2, kernel_size: int = 7,
                 dropout: float = 0.1, *, conv: bool = True, block_len: int | None = None):
        super().__init__()
        self.local = LocalEncoder(dim, num_convs if conv else 0, kernel_size, dropout)
        self.blosa = BiBloSA(dim, block_len)
        self.out = nn.Linear(2 * dim, dim, bias=False)  # F^O
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, mask: Tensor) -> tuple[Tensor, None]:
        u = self.local(x, mask)
        x = zero_padding(u, mask)
        y = x + self.dropout(self.out(self.blosa(x, mask)))
        return zero_padding(y, mask), None
