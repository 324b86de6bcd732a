"""Masked softmax, similarity functions and the attention layers of BiDAF, QANet and friends.

Conventions: tensors are batch-first, masks are ``bool`` with ``True`` marking a real token.
``c`` is the context (``H`` in BiDAF, ``C`` in QANet) with length ``Lc``; ``q`` is the query
(``U`` in BiDAF, ``Q`` in QANet) with length ``Lq``; ``S`` is the ``[B, Lc, Lq]`` similarity
matrix between them.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mrc_lib.errors import UserError


def mask_logits(x: Tensor, mask: Tensor) -> Tensor:
    """Replace masked-out entries of ``x`` by the most negative finite value of its dtype.

    A softmax over the result gives exactly 0 to those entries whenever one entry is real.
    The finite value (not ``-inf``) keeps a fully masked row free of NaN.
    """
    return x.masked_fill(~mask, torch.finfo(x.dtype).min)


def zero_padding(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` ``[B, L, ...]`` with every entry at a padding position (``mask`` ``[B, L]``, or any
    leading part of ``x``'s shape, ``False``) set to 0; ``mask`` may also have ``x``'s rank.

    A multiplication by the mask: one kernel forward and one backward on a GPU, where
    ``x.masked_fill(~mask, 0)`` launches three (the negation, a copy, the fill) and two. Equal to
    it wherever ``x`` is finite (``0 · inf`` is NaN; a zero may come out as ``-0.0``).
    """
    return x * mask.view(*mask.shape, *[1] * (x.dim() - mask.dim()))


def masked_softmax(x: Tensor, mask: Tensor, dim: int = -1) -> Tensor:
    """Softmax over ``dim`` where masked-out entries get exactly 0 probability.

    ``mask`` is broadcastable to ``x``. A row without any real entry comes out all zeros (the
    product by the mask, as in :func:`zero_padding`: the probabilities are finite).
    """
    return torch.softmax(mask_logits(x, mask), dim=dim) * mask


class TrilinearSimilarity(nn.Module):
    """``S_tj = w^T [c_t; q_j; c_t ⊙ q_j]`` (BiDAF Eq. 1, QANet Sec. 2.2): no bias, as in both
    papers (a scalar bias would shift every score of a softmax row alike and cancel).

    Splitting ``w = [w1; w2; w3]`` gives ``S = c w1 + (q w2)^T + (c ⊙ w3) q^T``, which never
    materialises the ``[B, Lc, Lq, 3d]`` tensor of concatenations.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(3 * dim)
        self.w = nn.Parameter(torch.empty(3, dim).uniform_(-bound, bound))

    def forward(self, c: Tensor, q: Tensor) -> Tensor:
        w1, w2, w3 = self.w
        s_c = (c @ w1).unsqueeze(2)  # [B, Lc, 1]
        s_q = (q @ w2).unsqueeze(1)  # [B, 1, Lq]
        s_cq = (c * w3) @ q.transpose(1, 2)  # [B, Lc, Lq]
        return s_c + s_q + s_cq


class DotSimilarity(nn.Module):
    """``S_tj = c_t^T q_j`` (Luong et al. 2015)."""

    def forward(self, c: Tensor, q: Tensor) -> Tensor:
        return c @ q.transpose(1, 2)


class ScaledDotSimilarity(DotSimilarity):
    """``S_tj = c_t^T q_j / sqrt(d)`` (Vaswani et al. 2017)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = 1.0 / math.sqrt(dim)

    def forward(self, c: Tensor, q: Tensor) -> Tensor:
        return super().forward(c, q) * self.scale


class BilinearSimilarity(nn.Module):
    """``S_tj = c_t^T W q_j`` with ``W`` of shape ``[d1, d2]`` (Luong et al. 2015, "general")."""

    def __init__(self, d1: int, d2: int) -> None:
        super().__init__()
        self.W = nn.Linear(d2, d1, bias=False)

    def forward(self, c: Tensor, q: Tensor) -> Tensor:
        return c @ self.W(q).transpose(1, 2)


class AdditiveSimilarity(nn.Module):
    """``S_tj = v^T tanh(W1 c_t + W2 q_j)`` (Bahdanau et al. 2015); uses ``[B, Lc, Lq, hidden]``."""

    def __init__(self, d1: int, d2: int, hidden: int) -> None:
        super().__init__()
        self.W1 = nn.Linear(d1, hidden, bias=False)
        self.W2 = nn.Linear(d2, hidden, bias=False)
        self.v = nn.Linear(hidden, 1, bias=False)

    def forward(self, c: Tensor, q: Tensor) -> Tensor:
        h = torch.tanh(self.W1(c).unsqueeze(2) + self.W2(q).unsqueeze(1))
        return self.v(h).squeeze(-1)


SIMILARITIES = ("trilinear", "dot", "scaled_dot", "bilinear", "additive")


def build_similarity(
    name: str, d1: int, d2: int | None = None, hidden: int | None = None
) -> nn.Module:
    """Build a similarity function by name; ``d2`` and ``hidden`` default to ``d1``."""
    d2 = d1 if d2 is None else d2
    hidden = d1 if hidden is None else hidden
    if name in ("trilinear", "dot", "scaled_dot") and d1 != d2:
        raise UserError(f"similarity {name!r} needs equal dimensions, got {d1} and {d2}")
    if name == "trilinear":
        return TrilinearSimilarity(d1)
    if name == "dot":
        return DotSimilarity()
    if name == "scaled_dot":
        return ScaledDotSimilarity(d1)
    if name == "bilinear":
        return BilinearSimilarity(d1, d2)
    if name == "additive":
        return AdditiveSimilarity(d1, d2, hidden)
    raise UserError(f"unknown similarity {name!r}; choose one of {', '.join(SIMILARITIES)}")


def c2q_attention(S: Tensor, q_mask: Tensor) -> Tensor:
    """Context-to-query attention weights ``a_t = softmax(S_t:)`` (BiDAF, between Eqs. 1 and
    2): ``[B, Lc, Lq]``."""
    return masked_softmax(S, q_mask.unsqueeze(1), dim=-1)


def context_to_query(S: Tensor, q: Tensor, q_mask: Tensor) -> Tensor:
    """Attended query vectors ``Ũ_:t = Σ_j a_tj U_:j`` (BiDAF, between Eqs. 1 and 2):
    ``[B, Lc, d]``."""
    return c2q_attention(S, q_mask) @ q


def query_to_context(S: Tensor, c: Tensor, c_mask: Tensor, q_mask: Tensor) -> Tensor:
    """BiDAF query-to-context attention (between Eqs. 1 and 2), tiled over the context:
    ``[B, Lc, d]``.

    ``b = softmax_t(max_j S_tj)`` and ``h̃ = Σ_t b_t H_:t``; the one vector ``h̃`` is repeated
    ``Lc`` times to give ``H̃``.
    """
    best = mask_logits(S, q_mask.unsqueeze(1)).amax(dim=-1)  # max_j S_tj: [B, Lc]
    b = masked_softmax(best, c_mask, dim=-1)
    h_tilde = (b.unsqueeze(1) @ c).squeeze(1)  # [B, d]
    return h_tilde.unsqueeze(1).expand_as(c)


def query_to_context_dcn(S: Tensor, c: Tensor, c_mask: Tensor, q_mask: Tensor) -> Tensor:
    """QANet's query-to-context attention from DCN (Yu et al. 2018 Sec. 2.2): ``[B, Lc, d]``.

    ``B = S̄ · S̄̄^T · C`` with ``S̄`` the row softmax (over the query) and ``S̄̄`` the column
    softmax (over the context) of ``S``; evaluated right to left to stay ``O(Lc · Lq · d)``.
    """
    s_row = c2q_attention(S, q_mask)  # S̄: [B, Lc, Lq]
    s_col = masked_softmax(S, c_mask.unsqueeze(2), dim=1)  # S̄̄: [B, Lc, Lq]
    return s_row @ (s_col.transpose(1, 2) @ c)


class BiDAFAttention(nn.Module):
    """BiDAF's attention flow layer (Seo et al. 2017 Sec. 2.4).

    Returns ``G = [H; Ũ; H ⊙ Ũ; H ⊙ H̃]`` (Eq. 2 with the simple ``β``), ``[B, Lc, 4d]``, zero at
    padded context positions, and the context-to-query attention map ``a`` (``[B, Lc, Lq]``,
    zero rows at padded context positions).
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.similarity = TrilinearSimilarity(dim)

    @staticmethod
    def q2c(S: Tensor, c: Tensor, c_mask: Tensor, q_mask: Tensor) -> Tensor:
        return query_to_context(S, c, c_mask, q_mask)

    def forward(
        self, c: Tensor, q: Tensor, c_mask: Tensor, q_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        S = self.similarity(c, q)  # Eq. 1
        attn = zero_padding(c2q_attention(S, q_mask), c_mask)
        u_tilde = attn @ q  # context-to-query
        h_tilde = self.q2c(S, c, c_mask, q_mask)  # query-to-context
        G = torch.cat([c, u_tilde, c * u_tilde, c * h_tilde], dim=-1)  # Eq. 2
        return zero_padding(G, c_mask), attn


class CoAttention(BiDAFAttention):
    """QANet's context-query attention (Yu et al. 2018 Sec. 2.2).

    Same as :class:`BiDAFAttention` with the DCN query-to-context attention ``B``:
    returns ``([C; A; C ⊙ A; C ⊙ B], attn)``.
    """

    @staticmethod
    def q2c(S: Tensor, c: Tensor, c_mask: Tensor, q_mask: Tensor) -> Tensor:
        return query_to_context_dcn(S, c, c_mask, q_mask)


class MultiHeadSelfAttention(nn.Module):
    """Multi-head self-attention (Vaswani et al. 2017 Sec. 3.2.2) over a padded sequence.

    Keys at padding positions are masked out; outputs at padding positions are zero.
    """

    def __init__(self, dim: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.heads = heads
        self.dropout = dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        B, L, D = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        # An all-padding sequence attends everywhere rather than nowhere (no empty softmax
        # row on any backend); its outputs are zeroed below.
        keys = mask | ~mask.any(dim=-1, keepdim=True)
        h = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=keys[:, None, None, :],
            dropout_p=self.dropout if self.training else 0.0,
        )  # softmax(Q K^T / sqrt(d_k)) V per head: [B, heads, L, d_k]
        h = self.out(h.transpose(1, 2).reshape(B, L, D))
        return zero_padding(h, mask)
