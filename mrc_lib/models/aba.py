"""Adaptive Bi-directional Attention (Chen, Liu, You, Zhou & Zou, ICASSP 2021).

A reader's encoder turns each word into a stack of representations, from fine (the embedding
``E``) to coarse (the last encoder layer ``Cⁿ``); the usual attention layer, and so the answer
layer, sees only the coarsest. ABA gives the answer layer the whole *history of semantics*:

* ``HOS_p = [E_p; C_p¹; …; C_pⁿ; A]`` and ``HOS_q = [E_q; C_q¹; …; C_qⁿ; A]`` (Eqs. 1-2), where
  ``A`` is the output of the base reader's attention layer;
* ``ĤOS = Σ_k λ_k HOS⁽ᵏ⁾`` with one trainable weight per granularity (Eq. 3), initialised so
  that training starts from the base reader;
* ``H = dropout(f_attention[ĤOS_p, ĤOS_q])`` with BiDAF's trilinear function; the row softmax
  ``Ĥ`` gives passage-to-question ``M = Ĥ ĤOS_q``, the column softmax ``H̄`` the DCN-style
  question-to-passage ``S = Ĥ H̄ᵀ ĤOS_p``, and ``I = [ĤOS_p; M; ĤOS_p ⊙ M; ĤOS_p ⊙ S]``
  (Eq. 4) takes the place of the base attention's output in the rest of the reader.

Our reading of the points the paper leaves open
-----------------------------------------------
1. *Order and initialisation.* The paper initialises λ to ``[1, 0, …, 0]`` "so that training
   starts from the base model", which holds only if the first weighted representation is the
   one the base attention reads, ``Cⁿ``. We therefore store the stack newest encoder layer
   first, ``[Cⁿ; …; C¹; E; A]`` (:func:`granularities`); the weighted sum of Eq. 3 does not
   depend on the order otherwise. At initialisation ``ĤOS_p = C_pⁿ`` and ``ĤOS_q = C_qⁿ``
   exactly: the base reader's attention inputs.
2. *Stacking layers of different widths.* ``[· ; ·]`` in Eqs. 1-2 is a stack over granularity,
   not a feature concatenation (Eq. 3 sums over it). Every granularity is brought to the width
   ``d`` of ``Cⁿ`` by its own bias-free linear map; a granularity already ``d`` wide is used as
   it is (so ``Cⁿ`` never is projected, and point 1 holds exactly).
3. *A on the question side.* ``A`` has one vector per passage word. A question word ``j``
   receives the passage's ``A`` averaged with the weights of the passage words that attended
   to it in the base attention: ``A_q[j] = Σ_t ā_tj A_t / Σ_t ā_tj``, with ``ā`` the base
   reader's context-to-query map (:func:`question_side`). Both sides then stack the same
   number of granularities of the same meaning.
4. *λ.* Unnormalised scalars (a softmax could not start from a one-hot ``[1, 0, …]``), one per
   granularity, shared by passage and question so that both sides are compared at the same mix.
5. *Where ``A`` comes from.* The base reader's own attention still runs; its projected output
   ``A`` (QANet: the ``4d → d`` map; BiDAF++: the linear + ReLU layer) is the last
   granularity, and the same projection maps ``I`` into the rest of the reader.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from mrc_lib.nn import CoAttention, TrilinearSimilarity


def granularities(encoder_layers: Sequence[Tensor], a: Tensor) -> list[Tensor]:
    """``HOS`` (Eqs. 1-2) from ``encoder_layers = [E, C¹, …, Cⁿ]`` and ``A``, stored newest
    encoder layer first: ``[Cⁿ, …, C¹, E, A]`` (reading 1 of the module docstring)."""
    return [*reversed(encoder_layers), a]


def granularity_names(n_layers: int) -> list[str]:
    """Labels of :func:`granularities` for ``n_layers`` encoder layers ``C¹ … Cⁿ``."""
    return [*(f"C{i}" for i in range(n_layers, 0, -1)), "E", "A"]


def question_side(a: Tensor, attn: Tensor, c_mask: Tensor) -> Tensor:
    """``A`` carried to the question words (reading 3): ``A_q[j] = Σ_t ā_tj A_t / Σ_t ā_tj``.

    ``a`` is ``[B, Lc, d]``, ``attn`` the base context-to-query map ``ā`` ``[B, Lc, Lq]`` (rows
    sum to 1 over the question); returns ``[B, Lq, d]``, zero at padded question words.
    """
    weights = attn.masked_fill(~c_mask.unsqueeze(2), 0.0)
    weights = weights / weights.sum(dim=1, keepdim=True).clamp_min(torch.finfo(a.dtype).tiny)
    return weights.transpose(1, 2) @ a


class DroppedTrilinear(TrilinearSimilarity):
    """``H = dropout(f_attention[ĤOS_p, ĤOS_q])`` with BiDAF's trilinear ``f_attention``
    (Eq. 4)."""

    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__(dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, c: Tensor, q: Tensor) -> Tensor:
        return self.dropout(super().forward(c, q))


class ABAttention(CoAttention):
    """Eq. 4: ``I = [ĤOS_p; M; ĤOS_p ⊙ M; ĤOS_p ⊙ S]`` with ``M = Ĥ ĤOS_q`` (row softmax
    ``Ĥ``) and ``S = Ĥ H̄ᵀ ĤOS_p`` (column softmax ``H̄``): QANet's context-query attention
    over the weighted histories, with dropout on the similarity matrix."""

    def __init__(self, dim: int, dropout: float = 0.0) -> None:
        super().__init__(dim)
        self.similarity = DroppedTrilinear(dim, dropout)


class AdaptiveBiAttention(nn.Module):
    """ABA over a base reader's history of semantics (Eqs. 1-4).

    Args:
        widths: the width of each granularity, in the order of :func:`granularities`
            (``widths[0]`` is the width ``d`` of ``Cⁿ``, the base attention's input).
        dropout: dropout on the similarity matrix ``H`` (Eq. 4).
    """

    def __init__(self, widths: Sequence[int], dropout: float = 0.0) -> None:
        super().__init__()
        dim = widths[0]
        self.project = nn.ModuleList(
            nn.Identity() if w == dim else nn.Linear(w, dim, bias=False) for w in widths)
        # Eq. 3: λ = [1, 0, …, 0], so that ĤOS starts as the base reader's Cⁿ.
        self.lam = nn.Parameter(torch.tensor([1.0] + [0.0] * (len(widths) - 1)))
        self.attention = ABAttention(dim, dropout)

    def weighted(self, hos: Sequence[Tensor]) -> Tensor:
        """``ĤOS = Σ_k λ_k P_k(HOS⁽ᵏ⁾)`` (Eq. 3), ``P_k`` the map to width ``d``."""
        return sum(lam * project(h) for lam, project, h in zip(self.lam, self.project, hos))

    def forward(self, p_layers: Sequence[Tensor], q_layers: Sequence[Tensor], a: Tensor,
                base_attn: Tensor, c_mask: Tensor, q_mask: Tensor) -> tuple[Tensor, Tensor]:
        """``I`` ``[B, Lc, 4d]`` and the row softmax ``Ĥ`` ``[B, Lc, Lq]``.

        ``p_layers``/``q_layers`` are ``[E, C¹, …, Cⁿ]`` of each side, ``a`` the base
        attention's projected output ``A`` and ``base_attn`` its context-to-query map.
        """
        hos_p = granularities(p_layers, a)  # Eq. 1
        hos_q = granularities(q_layers, question_side(a, base_attn, c_mask))  # Eq. 2
        return self.attention(self.weighted(hos_p), self.weighted(hos_q), c_mask, q_mask)


def attend(reader: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """A reader's attention layer with or without ABA: ``(project(G), map)`` from the base
    attention, or ``(project(I), Ĥ)`` when ``reader.aba`` is set, with ``A = project(G)`` as the
    last granularity (reading 5). The reader provides ``layers(words, chars, mask, feats)``
    (``[E, C¹, …, Cⁿ]`` for one side), ``attention``, ``attn_proj`` and ``aba``."""
    c_mask, q_mask = batch["c_mask"], batch["q_mask"]
    p_layers = reader.layers(batch["c_words"], batch["c_chars"], c_mask, batch.get("c_feats"))
    q_layers = reader.layers(batch["q_words"], batch["q_chars"], q_mask)
    g, attn = reader.attention(p_layers[-1], q_layers[-1], c_mask, q_mask)
    a = reader.attn_proj(g)
    if reader.aba is None:
        return a, attn
    i, attn = reader.aba(p_layers, q_layers, a, attn, c_mask, q_mask)
    return reader.attn_proj(i), attn
