"""R-NET: Gated Self-Matching Networks for Reading Comprehension (Wang et al., ACL 2017), with
the enhancements DecaProp's authors gave their baseline (Tay et al., NeurIPS 2018, footnote 10).

The layers, each commented below with its equations:

1. input: word vectors, a character BiRNN read to its final states (R-NET Sec. 3.1) and, as in
   DecaProp's input encoder, match features and normalized term frequency, through a highway
   network;
2. encoder: a stacked BiRNN shared by passage and question; *enhancement*: the outputs of all its
   layers are concatenated (shortcut connections after the encoder);
3. gated attention-based recurrent network (R-NET Sec. 3.2): each passage word attends to the
   question, a sigmoid gate scales ``[u_t; c_t]``, a BiRNN reads the result;
4. self-matching attention (R-NET Sec. 3.3): the same, passage against itself;
5. output: *enhancement*: a BiRNN pointer, two stacked BiRNNs whose states give the start and the
   end distributions (instead of R-NET's attention-pointer network).

*Enhancement*: every attention uses scaled dot-product scores between ReLU projections
(:class:`Affinity`) instead of R-NET's additive ``vᵀ tanh(W u + W' v)`` scores.

The input layer, :class:`Affinity`, :class:`GatedAttention`, :class:`MatchingCore` and
:class:`BiRNNPointer` are DecaProp's building blocks too (:mod:`mrc_lib.models.decaprop`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from mrc_lib.models import register
from mrc_lib.nn import RNN, Highway, WordEmbedding, c2q_attention, mask_logits


class CharRNN(nn.Module):
    """Character-level word vectors: the final states of a BiRNN over each word's characters
    (R-NET Sec. 3.1; DecaProp Sec. 3.1). ``[B, L, W]`` char ids to ``[B, L, 2·hidden]``; only the
    real tokens of ``mask`` are read, the others get zero vectors."""

    def __init__(self, n_chars: int, char_dim: int, hidden: int, cell: str = "gru") -> None:
        super().__init__()
        self.embed = nn.Embedding(n_chars, char_dim, padding_idx=0)
        self.rnn = RNN(char_dim, hidden, cell=cell)
        self.out_dim = 2 * hidden

    def forward(self, chars: Tensor, mask: Tensor) -> Tensor:
        words = chars[mask]  # [N, W]: the real tokens only
        final = self.rnn.final_states(self.embed(words), words != 0)  # [N, 2·hidden]
        out = final.new_zeros(*mask.shape, self.out_dim)
        out[mask] = final
        return out


def question_match(q_words: Tensor, c_words: Tensor, c_mask: Tensor) -> Tensor:
    """``[B, Lq]``: 1 where the question word's id occurs in the passage (the question side of
    the binary match features, from word ids)."""
    same = (q_words.unsqueeze(2) == c_words.unsqueeze(1)) & c_mask.unsqueeze(1)
    return same.any(dim=-1).float()


class InputEncoder(nn.Module):
    """``Highway([word(w); CharRNN(chars); f])`` per token (DecaProp Sec. 3.1).

    ``f`` (``vocab.n_feats`` values) is the batch's ``c_feats`` for the passage (exact match of
    the original, lower-case and lemma forms, normalized term frequency). The batch has no
    question features: the question gets its word-id match with the passage in the three match
    slots and 0 for term frequency.
    """

    def __init__(self, vocab, *, char_dim: int, char_hidden: int, cell: str,
                 highway_layers: int, dropout: float) -> None:
        super().__init__()
        self.word = WordEmbedding(torch.as_tensor(vocab.word_vectors, dtype=torch.float32),
                                  vocab.n_trainable)
        self.char = CharRNN(vocab.n_chars, char_dim, char_hidden, cell)
        self.n_feats = vocab.n_feats
        self.out_dim = self.word.dim + self.char.out_dim + self.n_feats
        self.highway = Highway(self.out_dim, highway_layers, dropout)
        self.dropout = nn.Dropout(dropout)

    def embed(self, words: Tensor, chars: Tensor, mask: Tensor, feats: Tensor) -> Tensor:
        parts = [self.dropout(self.word(words)), self.char(chars, mask), feats]
        return self.highway(torch.cat(parts, dim=-1))

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """Passage ``[B, Lc, out_dim]`` and question ``[B, Lq, out_dim]`` embeddings."""
        c_feats = batch["c_feats"].float()
        match = question_match(batch["q_words"], batch["c_words"], batch["c_mask"])
        q_feats = torch.cat([match.unsqueeze(-1).expand(*match.shape, self.n_feats - 1),
                             match.new_zeros(*match.shape, 1)], dim=-1)
        p = self.embed(batch["c_words"], batch["c_chars"], batch["c_mask"], c_feats)
        q = self.embed(batch["q_words"], batch["q_chars"], batch["q_mask"], q_feats)
        return p, q


class Affinity(nn.Module):
    """``E_ij = F(p_i)ᵀ F(q_j) / √d`` with ``F`` a dense ReLU layer (DecaProp Eq. 1).

    Returns ``[B, Lp, Lq]``. ``F`` is shared by both sides, so ``p`` and ``q`` have one size,
    ``dim``.
    """

    def __init__(self, dim: int, proj_dim: int) -> None:
        super().__init__()
        self.F = nn.Sequential(nn.Linear(dim, proj_dim), nn.ReLU())
        self.scale = 1.0 / math.sqrt(proj_dim)

    def forward(self, p: Tensor, q: Tensor) -> Tensor:
        return self.F(p) @ self.F(q).transpose(1, 2) * self.scale


class GatedAttention(nn.Module):
    """Gated attention-based recurrent layer (R-NET Sec. 3.2; DecaProp Eqs. 6-8).

    ``b_i = Σ_j softmax_j(E_ij) q_j`` (Eq. 6), ``x_i = σ(W_g [p_i; b_i]) ⊙ [p_i; b_i]`` (Eq. 7),
    ``U = BiRNN(x)`` (Eq. 8). With ``gated=False`` the gate is left out (``x_i = [p_i; b_i]``).
    Self-attention is the case ``q = p``.
    """

    def __init__(self, dim: int, hidden: int, *, proj_dim: int, gated: bool = True,
                 cell: str = "gru", dropout: float = 0.0) -> None:
        super().__init__()
        self.affinity = Affinity(dim, proj_dim)
        self.gate = nn.Linear(2 * dim, 2 * dim, bias=False) if gated else None
        self.rnn = RNN(2 * dim, hidden, cell=cell, dropout=dropout)

    def forward(self, p: Tensor, q: Tensor, p_mask: Tensor,
                q_mask: Tensor) -> tuple[Tensor, Tensor]:
        """``U`` ``[B, Lp, 2·hidden]`` and the attention weights ``[B, Lp, Lq]`` (zero rows at
        padded passage positions)."""
        a = c2q_attention(self.affinity(p, q), q_mask).masked_fill(~p_mask.unsqueeze(-1), 0.0)
        x = torch.cat([p, a @ q], dim=-1)  # [p_i; b_i], Eq. 6
        if self.gate is not None:
            x = torch.sigmoid(self.gate(x)) * x  # Eq. 7
        return self.rnn(x, p_mask), a  # Eq. 8


class MatchingCore(nn.Module):
    """Passage-question gated attention, then gated self-attention (R-NET Sec. 3.2-3.3): returns
    ``U¹`` and ``U²``, both ``[B, Lp, 2·hidden]``, and the passage-to-question attention."""

    def __init__(self, dim: int, hidden: int, *, proj_dim: int, gated: bool = True,
                 cell: str = "gru", dropout: float = 0.0) -> None:
        super().__init__()
        kw = dict(proj_dim=proj_dim, gated=gated, cell=cell, dropout=dropout)
        self.question = GatedAttention(dim, hidden, **kw)
        self.self_match = GatedAttention(2 * hidden, hidden, **kw)

    def forward(self, p: Tensor, q: Tensor, p_mask: Tensor,
                q_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        u1, attn = self.question(p, q, p_mask, q_mask)
        u2, _ = self.self_match(u1, u1, p_mask, p_mask)
        return u1, u2, attn


class BiRNNPointer(nn.Module):
    """Two stacked BiRNNs over ``M``: ``H¹ = BiRNN(M)``, ``H² = BiRNN(H¹)``; start and end logits
    ``w₁ᵀH¹`` and ``w₂ᵀH²`` (DecaProp Eqs. 10-11), padding masked."""

    def __init__(self, dim: int, hidden: int, *, cell: str = "gru", dropout: float = 0.0) -> None:
        super().__init__()
        self.rnn1 = RNN(dim, hidden, cell=cell, dropout=dropout)
        self.rnn2 = RNN(2 * hidden, hidden, cell=cell, dropout=dropout)
        self.w1 = nn.Linear(2 * hidden, 1)
        self.w2 = nn.Linear(2 * hidden, 1)

    def forward(self, m: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        h1 = self.rnn1(m, mask)
        h2 = self.rnn2(h1, mask)
        start = mask_logits(self.w1(h1).squeeze(-1).float(), mask)  # Eq. 10
        end = mask_logits(self.w2(h2).squeeze(-1).float(), mask)  # Eq. 11
        return start, end


@register("rnet")
class RNet(nn.Module):
    """R-NET with the enhancements of DecaProp's footnote 10.

    Args:
        vocab: see :mod:`mrc_lib.models`.
        hidden: RNN size per direction (R-NET: 75).
        encoder_layers: depth of the passage/question encoder (R-NET: 3).
        char_dim: character embedding size.
        char_hidden: size per direction of the character BiRNN (R-NET: 75).
        attention_dim: size of the ReLU projections ``F`` of the scaled dot-product attention.
        highway_layers: depth of the input highway network.
        cell: ``gru`` (R-NET) or ``lstm``.
        dropout: dropout on word vectors, in the highway and (locked) on every RNN input
            (R-NET: 0.2).
    """

    def __init__(self, vocab, *, hidden: int = 75, encoder_layers: int = 3, char_dim: int = 8,
                 char_hidden: int = 75, attention_dim: int = 75, highway_layers: int = 2,
                 cell: str = "gru", dropout: float = 0.2):
        super().__init__()
        self.embed = InputEncoder(vocab, char_dim=char_dim, char_hidden=char_hidden, cell=cell,
                                  highway_layers=highway_layers, dropout=dropout)
        # Shortcut connections after the encoder: all layers concatenated.
        self.encoder = RNN(self.embed.out_dim, hidden, num_layers=encoder_layers, cell=cell,
                           dropout=dropout, concat_layers=True)
        self.core = MatchingCore(2 * hidden * encoder_layers, hidden, proj_dim=attention_dim,
                                 cell=cell, dropout=dropout)
        self.pointer = BiRNNPointer(2 * hidden, hidden, cell=cell, dropout=dropout)

    def forward(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        c_mask, q_mask = batch["c_mask"], batch["q_mask"]
        p, q = self.embed(batch)
        u_p, u_q = self.encoder(p, c_mask), self.encoder(q, q_mask)
        _, h, attn = self.core(u_p, u_q, c_mask, q_mask)
        start, end = self.pointer(h, c_mask)
        return {"start_logits": start, "end_logits": end, "attention": attn.float()}
