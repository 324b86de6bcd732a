"""EA Reader: multi-space bit-wise attention and a writable memory (Fu & Zhang, AAAI 2019).

A cloze reader: a document ``d_1..d_n``, a query with a blank and a set of candidate words; the
answer is the candidate that fills the blank.

* Encoders (Eq. 1): BiGRUs over the document, ``D = [d_1..d_n]`` (``[B, n, 2h]``), and over the
  query, whose final forward and backward states give the query vector ``q`` (``[B, 2h]``).
* MSCF, Multi-Space based Context Fusion (Eqs. 2, 5-7): ``D`` and ``q`` are projected into ``L``
  subspaces of width ``2h/L`` (Eq. 2); in each, a *bit-wise* score map
  ``A^l = W_a^l tanh(D^l ⊙ q^l)`` gives one score per token *and feature*, normalized over the
  tokens separately for every feature (Eq. 5); ``c^l = Σ_i Ã^l_{:,i} ⊙ d^l_i`` (Eq. 6) and
  ``o = relu(W_c [c^1; ...; c^L])`` (Eq. 7). Token-wise scoring functions (one score per token,
  shared by its features) replace the bit-wise one for comparison: bilinear ``d^T W q``
  (Eq. 3, the Stanford Attentive Reader's), additive ``v^T tanh(W_1 d + W_2 q)`` (Eq. 4), dot
  product, and the scaled dot product per subspace, i.e. multi-head attention.
* Multi-hop reading (Eqs. 8-10), weights shared across the ``T`` hops: the memory starts as
  ``M_0 = D`` and the state as ``s_0 = q``; hop ``t`` *reads* ``e_t = MSCF(M_t, s_t)``,
  *updates* ``s_{t+1} = W_s s_t + e_t`` (Eq. 8) and *writes*
  ``M_{t+1} = G_t ⊙ (e_t ⊗ 1) + (1 − G_t) ⊙ M_t`` through the gate
  ``G_t = σ(W_e [e_t ⊗ 1] + W_m M_t)`` (Eqs. 9-10), ``e_t ⊗ 1`` being ``e_t`` repeated at
  every token. Without write, ``M_t = D`` at every hop.
* Answer (Eq. 11 restricted to the candidates): a token distribution
  ``α_i = softmax_i(m_i^T W_o s_T)`` over the final memory, summed over each candidate's
  occurrences in the document (as attention-sum readers do) and renormalized over the
  candidates: ``P(c) ∝ Σ_{i: d_i = c} α_i``. In logits: ``logsumexp`` of the token scores over
  the occurrences. A candidate that does not occur in the document gets probability 0.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mrc_lib.errors import UserError
from mrc_lib.nn import RNN, build_similarity, mask_logits, masked_softmax

TOKENWISE = ("bilinear", "additive", "dot", "scaled_dot")
SCORINGS = ("bitwise", *TOKENWISE)


class BitwiseScore(nn.Module):
    """``A_{:,i} = W_a tanh(d_i ⊙ q)`` (Eq. 5): one score per token and feature, ``[B, n, k]``.

    ``W_a`` has no bias: a per-feature constant cancels in the softmax over tokens.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.W_a = nn.Linear(dim, dim, bias=False)

    def forward(self, d: Tensor, q: Tensor) -> Tensor:
        return self.W_a(torch.tanh(d * q.unsqueeze(1)))


class TokenwiseScore(nn.Module):
    """One score per token, ``[B, n, 1]``, from a :mod:`mrc_lib.nn` similarity function
    (bilinear Eq. 3, additive Eq. 4, dot, scaled dot), shared by all features of the token."""

    def __init__(self, name: str, dim: int) -> None:
        super().__init__()
        self.similarity = build_similarity(name, dim)

    def forward(self, d: Tensor, q: Tensor) -> Tensor:
        return self.similarity(d, q.unsqueeze(1))


def build_score(scoring: str, dim: int) -> nn.Module:
    if scoring == "bitwise":
        return BitwiseScore(dim)
    if scoring in TOKENWISE:
        return TokenwiseScore(scoring, dim)
    raise UserError(f"unknown scoring {scoring!r}; choose one of {', '.join(SCORINGS)}")


class MSCF(nn.Module):
    """Multi-Space based Context Fusion (Eqs. 2, 5-7).

    The ``L`` projections ``W^l_d`` (and ``W^l_q``) of Eq. 2, each ``2h → 2h/L``, are the row
    blocks of one ``2h × 2h`` matrix. ``fusion=False`` (only with ``L = 1``) drops the
    projections and the fusion layer: ``o = c``, the Stanford Attentive Reader's output.
    """

    def __init__(self, dim: int, subspaces: int = 6, scoring: str = "bitwise",
                 fusion: bool = True) -> None:
        super().__init__()
        if dim % subspaces:
            raise UserError(f"2h = {dim} is not divisible by the number of subspaces {subspaces}")
        if not fusion and subspaces != 1:
            raise UserError("fusion=False (Stanford AR) needs a single space (subspaces=1)")
        self.L, self.k = subspaces, dim // subspaces
        self.project_d = nn.Linear(dim, dim, bias=False) if fusion else nn.Identity()  # Eq. 2
        self.project_q = nn.Linear(dim, dim, bias=False) if fusion else nn.Identity()
        self.scores = nn.ModuleList(build_score(scoring, self.k) for _ in range(subspaces))
        self.fuse = nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) if fusion else nn.Identity()

    def forward(self, D: Tensor, q: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """``D [B, n, 2h]``, ``q [B, 2h]``, ``mask [B, n]`` to the context vector ``o``
        (``[B, 2h]``) and the attention ``Ã`` (``[B, n, L, k]``, zero at padding)."""
        B, n, dim = D.shape
        D_l = self.project_d(D).view(B, n, self.L, self.k)  # Eq. 2
        q_l = self.project_q(q).view(B, self.L, self.k)
        A = torch.stack([score(D_l[:, :, l], q_l[:, l]) for l, score in enumerate(self.scores)],
                        dim=2)  # [B, n, L, k] bit-wise, [B, n, L, 1] token-wise
        A = masked_softmax(A, mask[:, :, None, None], dim=1)  # Eq. 5: over tokens, per feature
        A = A.expand(B, n, self.L, self.k)
        c = (A * D_l).sum(dim=1)  # Eq. 6: c^l = Σ_i Ã^l_{:,i} ⊙ d^l_i, [B, L, k]
        return self.fuse(c.reshape(B, dim)), A  # Eq. 7


class MemoryWrite(nn.Module):
    """Gated write (Eqs. 9-10): ``G = σ(W_e [e ⊗ 1] + W_m M)``,
    ``M' = G ⊙ (e ⊗ 1) + (1 − G) ⊙ M``; padding rows stay 0."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.W_e = nn.Linear(dim, dim)
        self.W_m = nn.Linear(dim, dim, bias=False)

    def forward(self, M: Tensor, e: Tensor, mask: Tensor) -> Tensor:
        e_tiled = e.unsqueeze(1).expand_as(M)  # e ⊗ 1
        G = torch.sigmoid(self.W_e(e_tiled) + self.W_m(M))  # Eq. 9
        M_next = G * e_tiled + (1 - G) * M  # Eq. 10
        return M_next.masked_fill(~mask.unsqueeze(-1), 0.0)


def candidate_logits(z: Tensor, doc_forms: Tensor, doc_mask: Tensor, cand_forms: Tensor) -> Tensor:
    """Candidate logits from token scores ``z [B, n]``: ``log Σ_{i: d_i = c} exp z_i``.

    Their softmax over the candidates is ``Σ_{i: d_i = c} α_i / Σ_{c'} Σ_{i: d_i = c'} α_i``
    with ``α = softmax(z)``: attention summed over a candidate's occurrences and renormalized
    over the candidates. A candidate without occurrence (or padding, form 0) is masked out.
    """
    occurs = ((doc_forms.unsqueeze(1) == cand_forms.unsqueeze(2)) & doc_mask.unsqueeze(1)
              & (cand_forms != 0).unsqueeze(2))  # [B, C, n]
    scores = mask_logits(z.unsqueeze(1).expand(occurs.shape), occurs)
    return mask_logits(torch.logsumexp(scores, dim=-1), occurs.any(dim=-1))


class EAReader(nn.Module):
    """EA Reader and its ablations: ``subspaces`` (L), ``hops`` (T), ``write``, ``scoring``;
    ``fusion=False`` with ``subspaces=1, scoring="bilinear", hops=1`` is the Stanford AR
    reading step. Defaults: the paper's ``h = 240``, ``L = 6``, GRU dropout 0.1."""

    def __init__(self, vectors: Tensor | np.ndarray, *, hidden: int = 240, subspaces: int = 6,
                 hops: int = 2, write: bool = True, scoring: str = "bitwise",
                 fusion: bool = True, dropout: float = 0.1) -> None:
        super().__init__()
        vectors = torch.as_tensor(vectors, dtype=torch.float32)
        self.hops = hops
        self.embed = nn.Embedding.from_pretrained(vectors, freeze=False, padding_idx=0)
        self.doc_encoder = RNN(vectors.shape[1], hidden, cell="gru", dropout=dropout)
        self.query_encoder = RNN(vectors.shape[1], hidden, cell="gru", dropout=dropout)
        dim = 2 * hidden
        self.mscf = MSCF(dim, subspaces, scoring, fusion)
        self.W_s = nn.Linear(dim, dim, bias=False)  # Eq. 8
        self.write = MemoryWrite(dim) if write else None
        self.W_o = nn.Linear(dim, dim, bias=False)  # answer scores m_i^T W_o s_T

    def forward(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Batch of :meth:`mrc_lib.data.cloze.ClozeSet.collate` to ``logits`` ``[B, C]`` over the
        candidates and ``attention`` ``[B, T, n, L]`` (Ã of each hop, averaged over features)."""
        mask = batch["doc_mask"]
        M = self.doc_encoder(self.embed(batch["doc_words"]), mask)  # Eq. 1: M_0 = D
        s = self.query_encoder.final_states(self.embed(batch["query_words"]),
                                            batch["query_mask"])  # s_0 = q
        attention = []
        for _ in range(self.hops):
            e, A = self.mscf(M, s, mask)  # read
            s = self.W_s(s) + e  # update, Eq. 8
            if self.write is not None:
                M = self.write(M, e, mask)  # write, Eqs. 9-10
            attention.append(A.mean(dim=-1))
        z = (M @ self.W_o(s).unsqueeze(-1)).squeeze(-1)  # [B, n]
        logits = candidate_logits(z, batch["doc_forms"], mask, batch["cand_forms"])  # Eq. 11
        return {"logits": logits, "attention": torch.stack(attention, dim=1)}


def cloze_loss(logits: Tensor, answer: Tensor) -> Tensor:
    """Negative log-likelihood of the answer candidate, over the examples whose answer occurs in
    the document (always true for Wiki-cloze; a CBT answer may be missing from the text)."""
    reachable = logits.gather(1, answer.unsqueeze(1)).squeeze(1) > torch.finfo(logits.dtype).min
    return F.cross_entropy(logits[reachable], answer[reachable])
