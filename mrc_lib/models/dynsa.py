"""The token-level dynamic self-attention block (DynSA; Zhuang & Wang, ACL 2019, Sec. 2).

Full self-attention over ``L`` tokens builds an ``L × L`` matrix. DynSA lets a gate pick, per
head, the ``K`` tokens that matter and runs self-attention among those ``K`` only; the other
tokens keep their (gated) non-linear features. Memory is ``O(L · D + H · K²)``: linear in ``L``.

For an input ``X`` ``[B, L, D]`` with real-token mask ``m`` and ``H`` heads of width ``d = D/H``:

* local encoder (Sec. 2.1): two depthwise-separable convolutions of width 7, each
  ``X ← ReLU(Conv(LN(X))) + X`` (the ReLU is QANet's, our reading: the paper writes
  ``Conv(LN(X)) + X``); its output is ``U``;
* Eq. 1: ``G = σ(F^G(F^U(U)))`` ``[L, H]`` with ``F^U`` a fully connected layer with a ReLU
  (the paper says "non-linear" without naming the activation; ReLU is our choice) and ``F^G``
  affine: one activity ``g_{h,i}`` per token and head;
* selection: per head the top-``K`` tokens by ``g_h`` (all of them when ``L ≤ K``; padding is
  never chosen); their rows of ``U`` form ``U_h`` ``[K, D]``;
* Eq. 2: ``A_h = softmax(Q_h K_hᵀ / √(D/H)) V_h`` with ``Q_h = U_h W^Q_h``, ``K_h = U_h W^K_h``,
  ``V_h = U_h W^V_h`` (per-head linear projections ``D → d``), scattered back to the chosen
  positions with zeros elsewhere: ``A*_h`` ``[L, d]``;
* Eq. 4: ``F_h = F^H_h(F^U_h(U))`` with ``F^U_h(U)`` head ``h``'s ``d`` columns of ``F^U(U)``
  (the layer of Eq. 1; a separate non-linear layer per head is the other reading) and
  ``F^H_h`` a per-head affine layer ``d → d``;
* Eq. 3: ``Z_h = (F_h + A*_h) ⊙ g_h / max(g_h)``, the maximum over the sequence's tokens;
* Eq. 5: ``Y = F^Y([Z_1; …; Z_H]) + U`` with ``F^Y`` linear;
* Eq. 6: the training loss gets ``β‖G‖₁`` (``β = 1e-5``), pushing most gates to 0.

The selection is a batched ``topk`` + ``gather`` + ``scatter``: no ``L × L`` tensor is ever
built. Switches for the paper's ablations (Table 3): ``conv=False`` (c: no local encoder),
``attention=False`` (b: no self-attention), ``selection="random"`` (d: ``K`` random real
tokens instead of the top-``K`` gates) and ``gate=False`` (e, on top of d: no gate at all,
``Z_h = F_h + A*_h``); ``beta=0`` in :class:`~mrc_lib.models.dynsan.DynSAN` is (f).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mrc_lib.nn import DepthwiseSeparableConv, zero_padding

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


def gather_rows(u: Tensor, index: Tensor) -> Tensor:
    """``U_h``: the rows ``index`` ``[B, H, k]`` of ``u`` ``[B, L, D]``, ``[B, H, k, D]``."""
    B, H, k = index.shape
    rows = index.unsqueeze(-1).expand(B, H, k, u.shape[-1])
    return u.unsqueeze(1).expand(B, H, *u.shape[1:]).gather(2, rows)


def scatter_rows(a: Tensor, index: Tensor, length: int) -> Tensor:
    """``Pad``: ``a`` ``[B, H, k, d]`` put at positions ``index`` of a zero ``[B, H, L, d]``."""
    B, H, k, d = a.shape
    rows = index.unsqueeze(-1).expand(B, H, k, d)
    return a.new_zeros(B, H, length, d).scatter(2, rows, a)


def chosen_attention(q: Tensor, k: Tensor, v: Tensor, chosen: Tensor) -> Tensor:
    """Eq. 2 among the chosen tokens of each head: ``softmax(Q Kᵀ / √d) V`` with ``q, k, v``
    ``[B, H, k, d]``; keys that are padding are masked, and their rows come out zero."""
    # A head of a sequence without real tokens attends everywhere (no empty softmax row on any
    # backend); its outputs are zeroed just below.
    keys = chosen | ~chosen.any(dim=-1, keepdim=True)
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=keys.unsqueeze(-2))
    return zero_padding(a, chosen)


class HeadLinear(nn.Module):
    """One affine (or linear) map per head: ``[B, H, N, d_in]`` to ``[B, H, N, d_out]``."""

    def __init__(self, heads: int, d_in: int, d_out: int, bias: bool = True):
        super().__init__()
        bound = 1.0 / math.sqrt(d_in)  # nn.Linear's default initialisation
        self.weight = nn.Parameter(torch.empty(heads, d_in, d_out).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(heads, 1, d_out).uniform_(-bound, bound)) \
            if bias else None

    def forward(self, x: Tensor) -> Tensor:
        y = torch.einsum("bhni,hio->bhno", x, self.weight)
        return y if self.bias is None else y + self.bias


class LocalEncoder(nn.Module):
    """Sec. 2.1: ``X ← Conv(LN(X)) + X`` for each of ``num_convs`` depthwise-separable
    convolutions (none when ``num_convs = 0``)."""

    def __init__(self, dim: int, num_convs: int, kernel_size: int, dropout: float):
        super().__init__()
        self.convs = nn.ModuleList(DepthwiseSeparableConv(dim, dim, kernel_size, relu=True)
                                   for _ in range(num_convs))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in self.convs)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        for conv, norm in zip(self.convs, self.norms):
            x = x + self.dropout(conv(norm(x), mask))
        return x


class DynSA(nn.Module):
    """One DynSA block (Sec. 2): ``[B, L, dim]`` to ``[B, L, dim]``, zero at padding.

    Args:
        dim: ``D``, the model width.
        heads: ``H``, gates and attention heads (paper: 8).
        top_k: ``K``, tokens attended per head (paper: 256).
        num_convs, kernel_size: the local encoder (paper: 2 convolutions of width 7).
        dropout: dropout on every residual branch (paper: 0.1 between layers).
        conv, attention, selection, gate: the ablation switches of the module docstring
            (defaults: the full block); ``gate=False`` needs ``selection="random"``.

    ``forward`` returns ``Y`` and the gate activities ``G`` ``[B, L, H]`` (0 at padding), or
    ``None`` for ``G`` without a gate.
    """

    def __init__(self, dim: int, heads: int = 8, top_k: int = 256, num_convs: int = 2,
                 kernel_size: int = 7, dropout: float = 0.1, *,
                 conv: bool = True, attention: bool = True, selection: str = "gate",
                 gate: bool = True):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        if selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
        if not gate and selection == "gate":
            raise ValueError("without a gate the tokens cannot be selected by it: "
                             "use selection='random' (Table 3 (e))")
        d = dim // heads
        self.heads, self.top_k = heads, top_k
        self.attention, self.selection = attention, selection
        self.local = LocalEncoder(dim, num_convs if conv else 0, kernel_size, dropout)
        self.f_u = nn.Linear(dim, dim)  # F^U (Eqs. 1, 4), with a ReLU
        self.f_g = nn.Linear(dim, heads) if gate else None  # F^G (Eq. 1)
        self.f_h = HeadLinear(heads, d, d)  # F^H_h (Eq. 4)
        if attention:  # W^Q_h, W^K_h, W^V_h (Eq. 2)
            self.w_q, self.w_k, self.w_v = (HeadLinear(heads, dim, d, bias=False)
                                            for _ in range(3))
        self.f_y = nn.Linear(dim, dim, bias=False)  # F^Y (Eq. 5)
        self.dropout = nn.Dropout(dropout)

    def local_encoder(self, x: Tensor, mask: Tensor) -> Tensor:
        """Sec. 2.1: ``U``."""
        return self.local(x, mask)

    def gate(self, f_u: Tensor, mask: Tensor) -> Tensor | None:
        """Eq. 1: ``G = σ(F^G(F^U(U)))`` ``[B, L, H]``, 0 at padding (``None`` without gate)."""
        if self.f_g is None:
            return None
        return zero_padding(torch.sigmoid(self.f_g(f_u)), mask)

    def attend(self, u: Tensor, scores: Tensor, mask: Tensor) -> Tensor:
        """Selection and Eq. 2: ``A*_h`` ``[B, H, L, d]``, zero at the unchosen positions."""
        index, chosen = select_tokens(scores, mask, self.top_k)
        u_h = gather_rows(u, index)  # U_h: [B, H, k, D]
        a = chosen_attention(self.w_q(u_h), self.w_k(u_h), self.w_v(u_h), chosen)
        return scatter_rows(a, index, u.shape[1])

    def forward(self, x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor | None]:
        B, L, D = x.shape
        u = self.local_encoder(x, mask)
        f_u = torch.relu(self.f_u(u))  # F^U(U)
        g = self.gate(f_u, mask)  # Eq. 1
        z = self.f_h(f_u.view(B, L, self.heads, -1).transpose(1, 2))  # F_h, Eq. 4: [B,H,L,d]
        if self.attention:
            scores = torch.rand(B, self.heads, L, device=x.device) \
                if self.selection == "random" else g.detach().transpose(1, 2)
            z = z + self.attend(u, scores, mask)  # F_h + A*_h
        if g is not None:  # Eq. 3: (F_h + A*_h) · g_h / max(g_h)
            g_h = g.transpose(1, 2)  # [B, H, L]
            g_max = g_h.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(g.dtype).tiny)
            z = z * (g_h / g_max).unsqueeze(-1)
        y = self.f_y(z.transpose(1, 2).reshape(B, L, D))  # F^Y([Z_1; ...; Z_H])
        y = u + self.dropout(y)  # Eq. 5
        return zero_padding(y, mask), g
