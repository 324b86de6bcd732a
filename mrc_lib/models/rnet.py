"""R-NET: Gated Self-Matching Networks for Reading Comprehension (Wang et al., ACL 2017), with
the enhancements DecaProp's authors gave their baseline (Tay et al., NeurIPS 2018, footnote 10).

The layers, each commented below with its equations:

1. input: word vectors, a character BiRNN read to its final states (R-NET Sec. 3.1) and, as in
   DecaProp's input encoder (Sec. 3.1), a binary match feature and a normalized frequency (ours:
   footnote 10 does not list them among the enhancements);
2. encoder: a stacked BiRNN shared by passage and question; *enhancement*: the outputs of all its
   layers are concatenated (shortcut connections after the encoder);
3. gated attention-based recurrent network (R-NET Sec. 3.2): each passage word attends to the
   question, a sigmoid gate scales ``[u_t; c_t]``, a BiRNN reads the result;
4. self-matching attention (R-NET Sec. 3.3): the same, passage against itself;
5. output: *enhancement*: a BiRNN pointer, two stacked BiRNNs whose states give the start and the
   end distributions (instead of R-NET's attention-pointer network).

*Enhancement*: every attention uses scaled dot-product scores between ReLU projections
(:class:`Affinity`) instead of R-NET's additive ``vᵀ tanh(W u + W' v)`` scores.

Dropout (DecaProp Sec. 4.2, "applied to all RNN and fully-connected layers"): variational
(locked) dropout on the input of every RNN, the character BiRNN included, and ordinary dropout on
the input of every dense layer (the projections ``F``, the gates ``W_g``, the pointer's ``w``).

The input layer, :class:`Affinity`, :class:`GatedAttention`, :class:`MatchingCore` and
:class:`BiRNNPointer` are DecaProp's building blocks too (:mod:`mrc_lib.models.decaprop`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from mrc_lib.data.vocab import UNK  # the word id of words without an embedding of their own
from mrc_lib.errors import UserError
from mrc_lib.models import register
from mrc_lib.nn import RNN, WordEmbedding, c2q_attention, mask_logits, zero_padding

GATES = ("p", "concat")
N_INPUT_FEATURES = 2  # DecaProp Sec. 3.1: a binary match feature and a normalized frequency
# Columns of the batch's c_feats and q_feats (mrc_lib.data.dataset): lower-case exact match in
# both, normalized term frequency in c_feats.
LOWER_MATCH, TERM_FREQUENCY = 1, 3


class CharRNN(nn.Module):
    """Character-level word vectors: the final states of a BiRNN over each word's characters
    (R-NET Sec. 3.1; DecaProp Sec. 3.1). ``[B, L, W]`` char ids to ``[B, L, 2·hidden]``; the
    tokens outside ``mask`` get zero vectors. Every position goes through the RNN, padding
    too (length-bucketed batches have little), so that no count is read back from the
    device."""

    def __init__(self, n_chars: int, char_dim: int, hidden: int, cell: str = "gru",
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(n_chars, char_dim, padding_idx=0)
        self.rnn = RNN(char_dim, hidden, cell=cell, dropout=dropout)
        self.out_dim = 2 * hidden

    def forward(self, chars: Tensor, mask: Tensor) -> Tensor:
        words = chars.flatten(0, 1)  # [B·L, W]
        final = self.rnn.final_states(self.embed(words), words != 0)  # [B·L, 2·hidden]
        return zero_padding(final.view(*mask.shape, self.out_dim), mask)


def passage_frequency(q_words: Tensor, c_words: Tensor, c_mask: Tensor) -> Tensor:
    """``[B, Lq]``: how often each question word's id occurs in the passage, over the passage
    length. UNK and padding count 0: distinct rare words share the UNK id."""
    same = (q_words.unsqueeze(2) == c_words.unsqueeze(1)) & c_mask.unsqueeze(1)
    count = (same.sum(dim=-1) * (q_words > UNK)).float()
    return count / c_mask.sum(dim=1, keepdim=True).clamp(min=1)


class InputEncoder(nn.Module):
    """``[w_i; CharBiRNN(chars_i); f_i]`` per token, ``d_w + h_c + 2`` features (DecaProp
    Sec. 3.1; no highway: the paper has none).

    ``f_i`` holds the paper's two features: the batch's lower-case exact match with the other
    side (``c_feats``, ``q_feats``) and the word's count in the passage over the passage length
    (passage: the batch's term frequency; question: :func:`passage_frequency`, from word ids).
    """

    def __init__(self, vocab, *, char_dim: int, char_hidden: int, cell: str,
                 dropout: float) -> None:
        super().__init__()
        self.word = WordEmbedding(torch.as_tensor(vocab.word_vectors, dtype=torch.float32),
                                  vocab.n_trainable)
        self.char = CharRNN(vocab.n_chars, char_dim, char_hidden, cell, dropout)
        self.out_dim = self.word.dim + self.char.out_dim + N_INPUT_FEATURES

    def embed(self, words: Tensor, chars: Tensor, mask: Tensor, feats: Tensor) -> Tensor:
        return torch.cat([self.word(words), self.char(chars, mask), feats], dim=-1)

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """Passage ``[B, Lc, out_dim]`` and question ``[B, Lq, out_dim]`` embeddings."""
        # Two views stacked, not an index list: a list is a host tensor copied to the GPU at
        # every step, which a CUDA graph cannot record (mrc_lib.graphs).
        c_feats = torch.stack([batch["c_feats"][..., k] for k in (LOWER_MATCH, TERM_FREQUENCY)],
                              dim=-1).float()
        q_feats = torch.stack([batch["q_feats"][..., LOWER_MATCH].float(), passage_frequency(
            batch["q_words"], batch["c_words"], batch["c_mask"])], dim=-1)
        p = self.embed(batch["c_words"], batch["c_chars"], batch["c_mask"], c_feats)
        q = self.embed(batch["q_words"], batch["q_chars"], batch["q_mask"], q_feats)
        return p, q


class Affinity(nn.Module):
    """``E_ij = F(p_i)ᵀ F(q_j) / √d`` with ``F`` a dense ReLU layer (DecaProp Eqs. 1 and 6).

    Returns ``[B, Lp, Lq]``. ``F`` is shared by both sides, so ``p`` and ``q`` have one size,
    ``dim``. Our reading of ``d``: the size of ``F``'s output, ``proj_dim`` (the paper: "the
    dimensionality of the vectors"). Dropout acts on ``F``'s input.
    """

    def __init__(self, dim: int, proj_dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.F = nn.Sequential(nn.Dropout(dropout), nn.Linear(dim, proj_dim), nn.ReLU())
        self.scale = 1.0 / math.sqrt(proj_dim)

    def forward(self, p: Tensor, q: Tensor) -> Tensor:
        return self.F(p) @ self.F(q).transpose(1, 2) * self.scale


class GatedAttention(nn.Module):
    """Gated attention-based recurrent layer (DecaProp Eqs. 6-8; R-NET Sec. 3.2).

    ``S = F(P) F(Q)ᵀ / √d`` (Eq. 6), ``P̄ = Softmax(S) Q`` (Eq. 7), then a sigmoid gate and a
    BiRNN (Eq. 8). ``gate`` picks what the gate scales:

    * ``"p"`` (DecaProp Eq. 8 as printed): ``P' = BiRNN(σ(W_g [P; P̄] + b_g) ⊙ P)``;
    * ``"concat"`` (R-NET Sec. 3.2): ``BiRNN(σ(W_g [P; P̄]) ⊙ [P; P̄])``, the form of the layer
      DecaProp says it follows. ``bias`` adds ``b_g``.

    Dropout acts on the gate's input ``[P; P̄]``. Self-attention is the case ``q = p``.
    """

    def __init__(self, dim: int, hidden: int, *, proj_dim: int, gate: str = "p",
                 bias: bool = True, cell: str = "gru", dropout: float = 0.0) -> None:
        super().__init__()
        if gate not in GATES:
            raise UserError(f"unknown gate {gate!r}; choose one of {', '.join(GATES)}")
        self.gate_on = gate
        gated_dim = dim if gate == "p" else 2 * dim
        self.affinity = Affinity(dim, proj_dim, dropout)
        self.gate = nn.Sequential(nn.Dropout(dropout), nn.Linear(2 * dim, gated_dim, bias=bias))
        self.rnn = RNN(gated_dim, hidden, cell=cell, dropout=dropout)

    def forward(self, p: Tensor, q: Tensor, p_mask: Tensor,
                q_mask: Tensor) -> tuple[Tensor, Tensor]:
        """``P'`` ``[B, Lp, 2·hidden]`` and the attention weights ``[B, Lp, Lq]`` (zero rows at
        padded passage positions)."""
        a = zero_padding(c2q_attention(self.affinity(p, q), q_mask), p_mask)
        pb = torch.cat([p, a @ q], dim=-1)  # [P; P̄], Eqs. 6-7
        gated = p if self.gate_on == "p" else pb
        return self.rnn(torch.sigmoid(self.gate(pb)) * gated, p_mask), a  # Eq. 8


class MatchingCore(nn.Module):
    """Passage-question gated attention, then gated self-attention (DecaProp Sec. 3.3; R-NET
    Sec. 3.2-3.3): returns ``U¹`` and ``U²``, both ``[B, Lp, 2·hidden]``, and the
    passage-to-question attention.

    ``attention=False`` (DecaProp Table 7, ablation 5) removes both attention layers and their
    gates; the input passes through to the BiRNNs of Eq. 8, ``U¹ = BiRNN(P)``,
    ``U² = BiRNN(U¹)``, and the attention returned is ``None``.
    """

    def __init__(self, dim: int, hidden: int, *, proj_dim: int, attention: bool = True,
                 gate: str = "p", bias: bool = True, cell: str = "gru",
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.attention = attention
        if attention:
            kw = dict(proj_dim=proj_dim, gate=gate, bias=bias, cell=cell, dropout=dropout)
            self.question = GatedAttention(dim, hidden, **kw)
            self.self_match = GatedAttention(2 * hidden, hidden, **kw)
        else:
            self.question = RNN(dim, hidden, cell=cell, dropout=dropout)
            self.self_match = RNN(2 * hidden, hidden, cell=cell, dropout=dropout)

    def forward(self, p: Tensor, q: Tensor, p_mask: Tensor,
                q_mask: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        if not self.attention:
            u1 = self.question(p, p_mask)
            return u1, self.self_match(u1, p_mask), None
        u1, attn = self.question(p, q, p_mask, q_mask)
        u2, _ = self.self_match(u1, u1, p_mask, p_mask)
        return u1, u2, attn


class BiRNNPointer(nn.Module):
    """Two stacked BiRNNs over ``M``: ``H†₁ = BiRNN(M)``, ``H†₂ = BiRNN(H†₁)`` (DecaProp Eq. 10);
    start and end logits ``w₁ᵀH†₁`` and ``w₂ᵀH†₂`` (Eq. 11, before the softmax), padding masked.
    Dropout acts on the input of ``w₁``, ``w₂``."""

    def __init__(self, dim: int, hidden: int, *, cell: str = "gru", dropout: float = 0.0) -> None:
        super().__init__()
        self.rnn1 = RNN(dim, hidden, cell=cell, dropout=dropout)
        self.rnn2 = RNN(2 * hidden, hidden, cell=cell, dropout=dropout)
        # w₁, w₂ without a bias, as in Eq. 11 (a bias would cancel in the softmax anyway).
        self.w1 = nn.Sequential(nn.Dropout(dropout), nn.Linear(2 * hidden, 1, bias=False))
        self.w2 = nn.Sequential(nn.Dropout(dropout), nn.Linear(2 * hidden, 1, bias=False))

    def forward(self, m: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        h1 = self.rnn1(m, mask)  # Eq. 10
        h2 = self.rnn2(h1, mask)
        start = mask_logits(self.w1(h1).squeeze(-1).float(), mask)  # Eq. 11
        end = mask_logits(self.w2(h2).squeeze(-1).float(), mask)
        return start, end


@register("rnet")
class RNet(nn.Module):
    """R-NET with the enhancements of DecaProp's footnote 10 (Table 7's row (1), "remove all").

    Args:
        vocab: see :mod:`mrc_lib.models`.
        hidden: RNN size per direction (R-NET: 75).
        encoder_layers: depth of the passage/question encoder (R-NET: 3).
        char_dim: character embedding size.
        char_hidden: size per direction of the character BiRNN (R-NET: 75).
        attention_dim: size of the ReLU projections ``F`` of the scaled dot-product attention.
        cell: ``gru`` (R-NET) or ``lstm``.
        dropout: on the input of every RNN (locked) and of every dense layer (R-NET: 0.2).
    """

    def __init__(self, vocab, *, hidden: int = 75, encoder_layers: int = 3, char_dim: int = 8,
                 char_hidden: int = 75, attention_dim: int = 75, cell: str = "gru",
                 dropout: float = 0.2):
        super().__init__()
        self.embed = InputEncoder(vocab, char_dim=char_dim, char_hidden=char_hidden, cell=cell,
                                  dropout=dropout)
        # Shortcut connections after the encoder: all layers concatenated.
        self.encoder = RNN(self.embed.out_dim, hidden, num_layers=encoder_layers, cell=cell,
                           dropout=dropout, concat_layers=True)
        # R-NET's gate: no bias, scales [u_t; c_t] (R-NET Sec. 3.2).
        self.core = MatchingCore(2 * hidden * encoder_layers, hidden, proj_dim=attention_dim,
                                 gate="concat", bias=False, cell=cell, dropout=dropout)
        self.pointer = BiRNNPointer(2 * hidden, hidden, cell=cell, dropout=dropout)

    def forward(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        c_mask, q_mask = batch["c_mask"], batch["q_mask"]
        p, q = self.embed(batch)
        u_p, u_q = self.encoder(p, c_mask), self.encoder(q, q_mask)
        _, h, attn = self.core(u_p, u_q, c_mask, q_mask)
        start, end = self.pointer(h, c_mask)
        return {"start_logits": start, "end_logits": end, "attention": attn.float()}
