"""EA Reader: multi-space bit-wise attention and a writable memory (Fu & Zhang, AAAI 2019).

A cloze reader: a document ``d_1..d_m``, a query with a blank and a set of candidates that occur
in the document; the answer is the candidate that fills the blank.

* Encoders (Eq. 1): BiGRUs over the document, ``D = [d_1..d_m]`` (``[B, m, 2h]``), and over the
  query, whose last forward and backward states give the query vector ``q`` (``[B, 2h]``).
* MSCF, Multi-Space based Context Fusion (Eqs. 2, 5-7): ``D`` and ``q`` are projected into ``L``
  subspaces of width ``2h/L`` (Eq. 2); in each, the *bit-wise* score map
  ``A^l_{:,i} = W^l tanh(d^l_i ⊙ q^l)`` gives one score per token *and feature*, normalized over
  the tokens separately for every feature (Eq. 5; the axis is our reading, the paper does not
  name it); ``c^l = Σ_i Ã^l_{:,i} ⊙ d^l_i`` (Eq. 6) and
  ``o = relu(W_c [c^1; ...; c^L])`` (Eq. 7).
* Token-wise scoring functions for the ablations (one score per token, shared by its
  features): bilinear ``(d^l_i)^T W_b^l q^l`` (Eq. 3, the Stanford AR's), additive
  ``(w^l)^T tanh(W_1^l d^l_i + W_2^l q^l)`` (Eq. 4), the dot product ``(d^l_i)^T q^l``
  (the paper's "multiplicative attention", Table 3) and multi-head attention (Vaswani et al.,
  2017; Table 3), built by us from Eq. 2's maps as query and key projections, a value projection
  ``v^l_i = W_v^l d_i`` and scores ``(d^l_i)^T q^l / sqrt(2h/L)``; its output projection is
  Eq. 7's ``W_c``.
* Multi-hop reading (Eqs. 8-10): the memory starts as ``M_0 = D`` and the state as ``s_0 = q``;
  hop ``t`` *reads* ``e_t = MSCF(M_t, s_t)``, *updates* ``s_{t+1} = W_s s_t + e_t`` (Eq. 8) and
  *writes* ``M_{t+1} = G_t ⊙ (e_t ⊗ r_m) + (1 − G_t) ⊙ M_t`` through the gate
  ``G_t = σ(W_e [e_t ⊗ r_m] + W_m M_t)`` (Eqs. 9-10), ``e_t ⊗ r_m`` being ``e_t`` repeated at
  every token. ``W_s``, ``W_e``, ``W_m`` are shared across hops, as the paper states. Whether
  MSCF is shared the paper does not say; we read "multiple memory modules are stacked" as one
  MSCF per hop (default) and offer ``share_mscf=True``. Without write, ``M_t = D``.
* Answer (Eq. 11): ``p = softmax(W_a s_T)``, a distribution over every word of the vocabulary
  (padding aside), trained by its negative log-likelihood; the most probable candidate that
  appears in the document is the answer. ``normalize="candidates"`` (a departure, off by
  default) normalizes over those candidates only, in training too, as an entity classifier
  restricted to the document would. ``W_a`` is tied to the word embeddings through a learned
  projection, ``W_a = E P`` (our choice: the paper does not say how ``W_a`` is parameterized; tying
  gives an answer never seen in training a GloVe-initialized row, and an anonymized marker
  ``@entityN`` its own trained row). ``answer="final_state_free"`` is the other reading: ``W_a``
  a free matrix, one row per word but padding, randomly initialized (``2h × (V − 1)`` weights,
  ``V`` the vocabulary size). ``readout="context"`` answers from the last context
  vector ``o`` instead of ``s_T``: the Stanford AR's classifier.
* ``answer="pointer_sum"`` (not the paper's answer layer, which the paper explicitly contrasts
  with pointer-sum attention): token scores ``z_i = m_i^T W_o s_T`` over the final memory,
  ``α = softmax(z)`` summed over each candidate's occurrences (Kadlec et al., 2016).
* ``answer="memory_mean"`` (not the paper's; it asks where the answer is read): Eq. 11 with
  candidate ``c``'s row of ``W_a`` read from the final memory instead of the word's row,
  ``score_c = m̄_c^T W_o s_T`` with ``m̄_c`` the mean of ``M_T`` over ``c``'s occurrences, a
  softmax over the candidates. Being linear in ``m̄_c``, the score is the mean of the token
  scores ``z_i`` over the occurrences: it differs from pointer-sum only in that it averages the
  occurrences' scores instead of summing their attention.
* ``answer="memory_mean_projected"`` (not the paper's; it splits ``memory_mean``'s change from
  Eq. 11 in two): Eq. 11's ``W_a x = E P x`` with candidate ``c``'s row of ``E`` replaced by
  ``R m̄_c``, the mean memory of its occurrences mapped to the word vectors' width ``k``:
  ``score_c = (R m̄_c)^T P s_T``. It reads the row where ``memory_mean`` does, through a map
  of ``P``'s shape (``W_o = R^T P``, rank at most ``k``, instead of a full ``2h × 2h`` one).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mrc_lib.errors import UserError
from mrc_lib.models import register
from mrc_lib.nn import RNN, build_similarity, mask_logits, masked_softmax, zero_padding

TOKENWISE = ("bilinear", "additive", "dot")
SCORINGS = ("bitwise", *TOKENWISE, "multihead")
ANSWERS = ("final_state", "final_state_free", "pointer_sum", "memory_mean",
           "memory_mean_projected")
MEMORY_ANSWERS = ("pointer_sum", "memory_mean", "memory_mean_projected")  # read M_T
NORMALIZATIONS = ("vocabulary", "candidates")
READOUTS = ("state", "context")


class BitwiseScore(nn.Module):
    """``A_{:,i} = W tanh(d_i ⊙ q)`` (Eq. 5): one score per token and feature, ``[B, m, k]``.

    ``W`` has no bias: a per-feature constant cancels in the softmax over tokens.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.W = nn.Linear(dim, dim, bias=False)

    def forward(self, d: Tensor, q: Tensor) -> Tensor:
        return self.W(torch.tanh(d * q.unsqueeze(1)))


class TokenwiseScore(nn.Module):
    """One score per token, ``[B, m, 1]``, from a :mod:`mrc_lib.nn` similarity function
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
    if scoring == "multihead":
        return TokenwiseScore("scaled_dot", dim)
    raise UserError(f"unknown scoring {scoring!r}; choose one of {', '.join(SCORINGS)}")


def projection(dim: int, learned: bool) -> nn.Module:
    """The ``L`` maps ``W^l`` of Eq. 2, each ``2h → 2h/L``, as the row blocks of one
    ``2h × 2h`` matrix; identity maps (``D^l`` = the ``l``-th block of features) if not
    ``learned``."""
    return nn.Linear(dim, dim, bias=False) if learned else nn.Identity()


class MSCF(nn.Module):
    """Multi-Space based Context Fusion (Eqs. 2, 5-7) and its ablations.

    ``projections=False``: identity maps in Eq. 2 (one reading of Table 1's "w/o multi-space
    projections"; the other is ``subspaces=1``). ``fusion=False`` (only with ``L = 1``) also
    drops the fusion layer: ``o = c``, the Stanford AR's output. ``W_c`` has no bias, as
    Eq. 7 writes it.
    """

    def __init__(self, dim: int, subspaces: int = 6, scoring: str = "bitwise",
                 fusion: bool = True, projections: bool = True) -> None:
        super().__init__()
        if dim % subspaces:
            raise UserError(f"2h = {dim} is not divisible by the number of subspaces {subspaces}")
        if not fusion and subspaces != 1:
            raise UserError("fusion=False (Stanford AR) needs a single space (subspaces=1)")
        self.L, self.k = subspaces, dim // subspaces
        learned = projections and fusion
        self.project_d = projection(dim, learned)  # Eq. 2, W_d^l
        self.project_q = projection(dim, learned)  # Eq. 2, W_q^l
        self.project_v = projection(dim, True) if scoring == "multihead" else None  # W_v^l
        self.scores = nn.ModuleList(build_score(scoring, self.k) for _ in range(subspaces))
        self.fuse = (nn.Sequential(nn.Linear(dim, dim, bias=False), nn.ReLU()) if fusion
                     else nn.Identity())  # Eq. 7: relu(W_c [c^1; ...; c^L])

    def forward(self, D: Tensor, q: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """``D [B, m, 2h]``, ``q [B, 2h]``, ``mask [B, m]`` to the context vector ``o``
        (``[B, 2h]``) and the attention ``Ã`` (``[B, m, L, k]``, zero at padding)."""
        B, m, dim = D.shape
        D_l = self.project_d(D).view(B, m, self.L, self.k)  # Eq. 2
        q_l = self.project_q(q).view(B, self.L, self.k)
        A = torch.stack([score(D_l[:, :, l], q_l[:, l]) for l, score in enumerate(self.scores)],
                        dim=2)  # [B, m, L, k] bit-wise, [B, m, L, 1] token-wise
        A = masked_softmax(A, mask[:, :, None, None], dim=1)  # Eq. 5: over tokens, per feature
        A = A.expand(B, m, self.L, self.k)
        values = D_l if self.project_v is None else self.project_v(D).view(B, m, self.L, self.k)
        c = (A * values).sum(dim=1)  # Eq. 6: c^l = Σ_i Ã^l_{:,i} ⊙ d^l_i, [B, L, k]
        return self.fuse(c.reshape(B, dim)), A  # Eq. 7


class MemoryWrite(nn.Module):
    """Gated write (Eqs. 9-10): ``G = σ(W_e [e ⊗ r_m] + W_m M)``,
    ``M' = G ⊙ (e ⊗ r_m) + (1 − G) ⊙ M``; padding rows stay 0. No bias, as Eq. 9 writes it."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.W_e = nn.Linear(dim, dim, bias=False)
        self.W_m = nn.Linear(dim, dim, bias=False)

    def forward(self, M: Tensor, e: Tensor, mask: Tensor) -> Tensor:
        e_tiled = e.unsqueeze(1).expand_as(M)  # e ⊗ r_m
        G = torch.sigmoid(self.W_e(e_tiled) + self.W_m(M))  # Eq. 9
        M_next = G * e_tiled + (1 - G) * M  # Eq. 10
        return zero_padding(M_next, mask)


def occurrences(doc_forms: Tensor, doc_mask: Tensor, cand_forms: Tensor) -> Tensor:
    """``[B, C, m]``: whether document token ``i`` is candidate ``c`` (form 0 is padding)."""
    return ((doc_forms.unsqueeze(1) == cand_forms.unsqueeze(2)) & doc_mask.unsqueeze(1)
            & (cand_forms != 0).unsqueeze(2))


def pointer_sum(z: Tensor, occurs: Tensor) -> Tensor:
    """Candidate scores ``log Σ_{i: d_i = c} exp z_i`` from token scores ``z [B, m]``.

    Their softmax over the candidates is ``Σ_{i: d_i = c} α_i / Σ_{c'} Σ_{i: d_i = c'} α_i``
    with ``α = softmax(z)``. The score of a candidate without occurrence is meaningless: the
    candidate mask removes it.
    """
    return torch.logsumexp(mask_logits(z.unsqueeze(1).expand(occurs.shape), occurs), dim=-1)


def occurrence_mean(z: Tensor, occurs: Tensor) -> Tensor:
    """Candidate scores ``mean_{i: d_i = c} z_i`` from token scores ``z [B, m]``: the score
    ``m̄_c^T W_o s_T`` of the mean memory ``m̄_c`` of ``c``'s occurrences, ``z`` being linear
    in ``m_i``. A candidate without occurrence scores 0; the candidate mask removes it."""
    occurs = occurs.to(z.dtype)
    return (occurs @ z.unsqueeze(-1)).squeeze(-1) / occurs.sum(-1).clamp(min=1)


def restrict(logits: Tensor, candidates: Tensor) -> Tensor:
    """Float32 scores with ``-inf`` outside the candidate mask: exact under any autocast dtype
    (no finite "most negative" value to compare with float32 logits)."""
    return logits.float().masked_fill(~candidates, float("-inf"))


@register("ea_reader")
class EAReader(nn.Module):
    """EA Reader and its ablations: ``subspaces`` (L), ``hops`` (T), ``write``, ``scoring``,
    ``projections``, ``share_mscf``, ``answer``, ``readout``, ``normalize`` (what Eq. 11's
    softmax runs over: the vocabulary, or the candidates in the document; the final-state
    answers only, the memory answers being over the candidates by construction);
    ``fusion=False`` with ``subspaces=1, scoring="bilinear", hops=1, readout="context"`` is the
    Stanford AR.
    Defaults: the paper's ``h = 240``, ``L = 6``, GRU dropout 0.1 (the paper gives only the
    rate, citing Srivastava et al.; our reading: on each BiGRU's input, a new mask at every
    position); ``locked_dropout``, one mask per sequence, is a departure. Built over the cloze
    task's ``vocab`` (its ``word_vectors``, :func:`mrc_lib.data.choice.load_cloze_data`);
    trained and scored by the ``cloze`` task of :mod:`mrc_lib.tasks`."""

    def __init__(self, vocab, *, hidden: int = 240, subspaces: int = 6,
                 hops: int = 2, write: bool = True, scoring: str = "bitwise",
                 fusion: bool = True, projections: bool = True, share_mscf: bool = False,
                 answer: str = "final_state", readout: str = "state",
                 normalize: str = "vocabulary", dropout: float = 0.1,
                 locked_dropout: bool = False) -> None:
        super().__init__()
        if answer not in ANSWERS or readout not in READOUTS or normalize not in NORMALIZATIONS:
            raise UserError(f"answer must be one of {ANSWERS}, readout one of {READOUTS}, "
                            f"normalize one of {NORMALIZATIONS}")
        # Every row is trained (the paper updates its embeddings).
        vectors = torch.as_tensor(vocab.word_vectors, dtype=torch.float32).clone()
        self.hops, self.answer, self.readout = hops, answer, readout
        self.normalize = normalize
        self.embed = nn.Embedding.from_pretrained(vectors, freeze=False, padding_idx=0)
        self.doc_encoder = RNN(vectors.shape[1], hidden, cell="gru", dropout=dropout,
                               locked=locked_dropout)
        self.query_encoder = RNN(vectors.shape[1], hidden, cell="gru", dropout=dropout,
                                 locked=locked_dropout)
        dim = 2 * hidden
        self.mscf = nn.ModuleList(MSCF(dim, subspaces, scoring, fusion, projections)
                                  for _ in range(1 if share_mscf else hops))
        # Eq. 8; the Stanford AR (one hop, answer from o) has no state update.
        self.W_s = nn.Linear(dim, dim, bias=False) if readout == "state" or hops > 1 else None
        self.write = MemoryWrite(dim) if write else None
        if answer in ("final_state", "memory_mean_projected"):
            self.P = nn.Linear(dim, vectors.shape[1], bias=False)  # Eq. 11: W_a = E P
        if answer == "memory_mean_projected":
            self.R = nn.Linear(dim, vectors.shape[1], bias=False)  # E's row c -> R m̄_c
        if answer == "final_state_free":
            self.W_a = nn.Linear(dim, len(vectors) - 1, bias=False)  # Eq. 11: word w is row w - 1
        if answer in ("pointer_sum", "memory_mean"):
            self.W_o = nn.Linear(dim, dim, bias=False)  # z_i = m_i^T W_o s_T

    def read(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
        """Eqs. 1-10: the last memory (``M_T`` when the answer reads the memory, else
        ``M_{T-1}``), the state ``s_T``, the last context vector ``e_{T-1}`` and each hop's
        attention ``Ã``."""
        mask = batch["doc_mask"]
        M = self.doc_encoder(self.embed(batch["doc_words"]), mask)  # Eq. 1: M_0 = D
        s = self.query_encoder.final_states(self.embed(batch["query_words"]),
                                            batch["query_mask"])  # s_0 = q
        attention = []
        for t in range(self.hops):
            e, A = self.mscf[min(t, len(self.mscf) - 1)](M, s, mask)  # read
            if self.W_s is not None:
                s = self.W_s(s) + e  # update, Eq. 8
            if self.write is not None and (t < self.hops - 1 or self.answer in MEMORY_ANSWERS):
                M = self.write(M, e, mask)  # write, Eqs. 9-10 (M_T: read by memory answers only)
            attention.append(A)
        return M, s, e, attention

    def forward(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Batch of :meth:`mrc_lib.data.cloze.ClozeSet.collate` to ``candidate_log_probs``
        ``[B, C]`` (Eq. 11: the log-probabilities of the candidates that occur in the document,
        under the softmax over the vocabulary or over those candidates; ``-inf`` for the
        others; float32) and ``attention`` ``[B, T, m, L]`` (Ã of each hop,
        averaged over features)."""
        occurs = occurrences(batch["doc_forms"], batch["doc_mask"], batch["cand_forms"])
        M, s, e, attention = self.read(batch)
        x = s if self.readout == "state" else e  # s_T (Eq. 11), or o for the Stanford AR
        present = occurs.any(dim=-1)
        # word w is column w - 1 of Eq. 11's scores; a padding candidate (word 0) is not
        # present: restricted
        columns = (batch["cand_words"] - 1).clamp(min=0)
        if self.answer not in MEMORY_ANSWERS and self.normalize == "vocabulary":
            # Eq. 11: p = softmax(W_a x) over the vocabulary; padding is no word
            log_p = self.vocabulary_scores(x).float().log_softmax(-1)  # [B, V-1]
            log_p = restrict(log_p.gather(1, columns), present)
        else:
            if self.answer == "final_state":
                E_c = self.embed(batch["cand_words"])  # [B, C, k], rows of E
                logits = (E_c @ self.P(x).unsqueeze(-1)).squeeze(-1)  # W_a x = E P x
            elif self.answer == "final_state_free":
                logits = (self.W_a.weight[columns] @ x.unsqueeze(-1)).squeeze(-1)  # W_a x
            else:
                z = self.token_scores(M, x)  # [B, m]
                logits = (pointer_sum(z, occurs) if self.answer == "pointer_sum"
                          else occurrence_mean(z, occurs))
            log_p = restrict(logits, present).log_softmax(-1)
        return {"candidate_log_probs": log_p,
                "attention": torch.stack([A.mean(dim=-1) for A in attention], dim=1)}

    def token_scores(self, M: Tensor, x: Tensor) -> Tensor:
        """The memory answers' token scores ``[B, m]``: ``z_i = m_i^T W_o x``, or
        ``(R m_i)^T P x`` (``memory_mean_projected``; linear in ``m_i``, so their mean over
        ``c``'s occurrences is ``(R m̄_c)^T P x``)."""
        if self.answer == "memory_mean_projected":
            return (self.R(M) @ self.P(x).unsqueeze(-1)).squeeze(-1)
        return (M @ self.W_o(x).unsqueeze(-1)).squeeze(-1)

    def vocabulary_scores(self, x: Tensor) -> Tensor:
        """Eq. 11's ``W_a x`` for every word but padding, ``[B, V-1]``: ``E P x`` (tied) or a
        free ``W_a``."""
        if self.answer == "final_state_free":
            return self.W_a(x)
        return self.P(x) @ self.embed.weight[1:].T  # W_a x = E P x

    @torch.no_grad()
    def analysis(self, data, cfg, examples: int = 3, tokens: int = 80) -> dict:
        """Figure payload for the first ``examples`` questions of the dev (valid) split: their
        first ``tokens`` document tokens, the query, candidates, answer, each hop's attention
        per subspace (averaged over features, ``[T][n][L]``) and the candidate
        probabilities."""
        split = data.splits["dev"]
        index = list(range(min(examples, len(split))))
        batch = {k: v.to(self.embed.weight.device) for k, v in split.collate(index).items()}
        out = self(batch)
        p = out["candidate_log_probs"].exp()
        payload = []
        for row, i in enumerate(index):
            n = min(tokens, int(batch["doc_mask"][row].sum()))
            cands = split.candidates(i)
            payload.append({
                "tokens": split.tokens(i)[:n], "query": split.question(i),
                "answer": split.answer(i), "candidates": cands,
                "probabilities": [round(float(v), 4) for v in p[row, :len(cands)]],
                "attention": [[[round(float(v), 5) for v in tok] for tok in hop[:n]]
                              for hop in out["attention"][row].float().cpu()]})
        return {"examples": payload}
