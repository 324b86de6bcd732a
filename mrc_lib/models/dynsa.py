"""The token-level dynamic self-attention block (DynSA; Zhuang & Wang, ACL 2019, Sec. 2).

Full self-attention over ``L`` tokens builds an ``L × L`` matrix. DynSA lets a gate pick, per
head, the ``K`` tokens that matter and runs self-attention among those ``K`` only; the other
tokens keep their (gated) features. Memory is ``O(L · H · d + H · K²)``: linear in ``L``.

For an input ``X`` ``[B, L, D]`` with real-token mask ``m``:

* local encoder: two depthwise-separable convolutions of width 7, each ``X ← Conv(LN(X)) + X``;
  call its output ``U``;
* gate (Eq. 1): ``F = F^U(LN(U))`` split into ``H`` heads ``F_h`` ``[L, D/H]``, and
  ``G = σ(F^G(F))`` ``[L, H]``, one activity ``g_h`` per token and head;
* selection: per head the top-``K`` tokens by ``g_h`` (all of them when ``L ≤ K``; padding is
  never chosen); gathered into ``F*_h`` ``[K, D/H]``;
* attention among the chosen (Eq. 2): ``A*_h = softmax(F*_h F*_hᵀ / √(D/H)) F*_h``, scattered
  back to their positions, zeros elsewhere: ``A_h`` ``[L, D/H]``;
* gating (Eqs. 3-4): ``Z_h = (F_h + A_h) ⊙ g_h / max_t g_{h,t}``;
* output (Eq. 5): ``Y = F^Y([Z_1; …; Z_H]) + U``;
* sparsity (Eq. 6): the training loss gets ``β‖G‖₁`` (``β = 1e-5``), pushing most gates to 0.

The selection is a batched ``topk`` + ``gather`` + ``scatter``: no ``L × L`` tensor is ever
built. Switches for the paper's ablations (Table 3): ``conv=False`` (no local encoder),
``attention=False`` (no self-attention: conv and gating only), ``selection="random"`` (``K``
random real tokens instead of the top-``K`` gates), ``gate_scaling=False`` (``Z_h = F_h + A_h``:
the gate still chooses but no longer scales); ``beta=0`` in :class:`~mrc_lib.models.dynsan.DynSAN`
drops the L1 penalty.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mrc_lib.nn import DepthwiseSeparableConv

SELECTIONS = ("gate", "random")


def gate_penalty(gates: list[Tensor], beta: float, batch_size: int) -> Tensor:
    """Eq. 6: ``β‖G‖₁`` over every gate activity of an example (``G = σ(·) ≥ 0``, so the
    norm is the sum), averaged over the batch like the span loss. The reader returns it as
    ``aux_loss`` and the trainer adds it to the loss."""
    return beta * sum(g.float().sum() for g in gates) / batch_size


def select_tokens(scores: Tensor, mask: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Per head, the ``k`` real tokens of highest score: ``scores`` ``[B, H, L]``, ``mask``
    ``[B, L]``. Returns the positions ``[B, H, k']`` (``k' = min(k, L)``) and whether each is a
    real token (a sequence with fewer than ``k'`` real tokens fills up with padding, flagged
    ``False``). Padding is ranked below every real token, so it is chosen only then."""
    k = min(k, scores.shape[-1])
    ranked = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    index = ranked.topk(k, dim=-1, sorted=False).indices
    chosen = mask.unsqueeze(1).expand_as(scores).gather(-1, index)
    return index, chosen


def sparse_attention(f: Tensor, index: Tensor, chosen: Tensor) -> Tensor:
    """Eq. 2 and the scatter: scaled dot-product self-attention among the chosen tokens of
    each head, their outputs put back at their positions and zeros elsewhere.

    ``f`` ``[B, H, L, d]``, ``index`` and ``chosen`` ``[B, H, k]`` (from :func:`select_tokens`).
    Returns ``A`` ``[B, H, L, d]``. Only ``[B, H, k, k]`` scores are formed.
    """
    d = f.shape[-1]
    rows = index.unsqueeze(-1).expand(*index.shape, d)
    f_star = f.gather(2, rows)  # F*_h: [B, H, k, d]
    # A head of a sequence without real tokens attends everywhere (no empty softmax row on any
    # backend); its outputs are zeroed just below.
    keys = chosen | ~chosen.any(dim=-1, keepdim=True)
    a_star = F.scaled_dot_product_attention(f_star, f_star, f_star,
                                            attn_mask=keys.unsqueeze(-2))
    a_star = a_star.masked_fill(~chosen.unsqueeze(-1), 0.0)
    return torch.zeros_like(f).scatter(2, rows, a_star)


class DynSA(nn.Module):
    """One DynSA block (Sec. 2): ``[B, L, dim]`` to ``[B, L, dim]``, zero at padding.

    Args:
        dim: ``D``, the model width.
        heads: ``H``, gates and attention heads (paper: 8).
        top_k: ``K``, tokens attended per head (paper: 256).
        num_convs, kernel_size: the local encoder (paper: 2 convolutions of width 7).
        dropout: dropout on every residual branch (paper: 0.1).
        conv, attention, selection, gate_scaling: the ablation switches of the module
            docstring (defaults: the full block).

    ``forward`` returns ``Y`` and the gate activities ``G`` ``[B, L, H]`` (0 at padding).
    """

    def __init__(self, dim: int, heads: int = 8, top_k: int = 256, num_convs: int = 2,
                 kernel_size: int = 7, dropout: float = 0.1, *,
                 conv: bool = True, attention: bool = True, selection: str = "gate",
                 gate_scaling: bool = True):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        if selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
        self.heads, self.top_k = heads, top_k
        self.attention, self.selection, self.gate_scaling = attention, selection, gate_scaling
        self.convs = nn.ModuleList(DepthwiseSeparableConv(dim, dim, kernel_size, relu=True)
                                   for _ in range(num_convs if conv else 0))
        self.conv_norms = nn.ModuleList(nn.LayerNorm(dim) for _ in self.convs)
        self.norm = nn.LayerNorm(dim)
        self.f_u = nn.Linear(dim, dim)  # F^U
        self.f_g = nn.Linear(dim, heads)  # F^G
        self.f_y = nn.Linear(dim, dim)  # F^Y
        self.dropout = nn.Dropout(dropout)

    def local_encoder(self, x: Tensor, mask: Tensor) -> Tensor:
        """``X ← Conv(LN(X)) + X`` for each convolution: ``U``."""
        for conv, norm in zip(self.convs, self.conv_norms):
            x = x + self.dropout(conv(norm(x), mask))
        return x

    def gate(self, f: Tensor, mask: Tensor) -> Tensor:
        """Eq. 1: ``G = σ(F^G(F))`` ``[B, L, H]``, 0 at padding."""
        return torch.sigmoid(self.f_g(f)).masked_fill(~mask.unsqueeze(-1), 0.0)

    def forward(self, x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        B, L, D = x.shape
        u = self.local_encoder(x, mask)
        f = self.f_u(self.norm(u))  # F = F^U(U)
        g = self.gate(f, mask)  # Eq. 1
        f_h = f.view(B, L, self.heads, D // self.heads).transpose(1, 2)  # F_h: [B, H, L, d]
        g_h = g.transpose(1, 2)  # [B, H, L]
        z = f_h
        if self.attention:
            scores = torch.rand_like(g_h) if self.selection == "random" else g_h.detach()
            index, chosen = select_tokens(scores, mask, self.top_k)
            z = z + sparse_attention(f_h, index, chosen)  # F_h + A_h, Eq. 2
        if self.gate_scaling:  # Eqs. 3-4: (F_h + A_h) · g_h / max(g_h)
            g_max = g_h.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(g.dtype).tiny)
            z = z * (g_h / g_max).unsqueeze(-1)
        y = self.f_y(z.transpose(1, 2).reshape(B, L, D))  # F^Y([Z_1; ...; Z_H])
        y = u + self.dropout(y)  # Eq. 5
        return y.masked_fill(~mask.unsqueeze(-1), 0.0), g
