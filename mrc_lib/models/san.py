"""SAN for SQuAD 2.0: the stochastic answer network (Liu, Li, Fang, Kim, Duh & Gao, 2018).

The third base reader of the ABA paper's Table 1 (Chen et al. 2021 cite it as [3]). The SAN
papers are not among the papers at hand (``../shared/papers``): this is the design as we recall
it from the SAN papers, not checked against their text, with their layer names, without
pretrained contextual vectors (no CoVe) and with our GloVe vectors:

1. lexicon encoding ``E``: the word vectors, for the passage with the question-aligned word
   vectors ``Σ_j softmax_j(ReLU(W x_i) · ReLU(W y_j)) y_j`` (DrQA's ``f_align``) and the token
   features, each side through its own two-layer position-wise feed-forward network to width
   ``d``;
2. contextual encoding: two BiLSTM layers shared by passage and question, ``C¹`` and ``C²``;
   ``Hᵖ = [C¹_p; C²_p]``, ``H^q = [C¹_q; C²_q]``;
3. memory generation: ``C = dropout(f_attention(Ĥ^q, Ĥᵖ))`` with ``Ĥ = ReLU(W₃ H)`` and the dot
   product, ``Uᵖ = [Hᵖ; H^q C]``, the self-attention ``Ûᵖ = Uᵖ drop_diag(f_attention(Uᵖ,
   Uᵖ))`` and the memory ``M = BiLSTM([Uᵖ; Ûᵖ])``;
4. answer module: ``s₀ = Σ_j α_j H^q_j`` (``α = softmax(w₄ H^q)``), for ``t = 1 … T``:
   ``x_t = Σ_j β_j M_j`` with ``β = softmax(s_{t−1} W₅ M)``, ``s_t = GRU(s_{t−1}, x_t)``,
   ``P_t^begin = softmax(s_t W₆ M)``, ``P_t^end = softmax([s_t; Σ_j P_{t,j}^begin M_j] W₇ M)``;
   the prediction averages the ``T`` steps, and in training each step is dropped with
   probability ``step_dropout`` (stochastic prediction dropout; at least one step is kept);
5. unanswerable questions: ``no_answer="head"`` is SAN's binary classifier
   ``P^u = σ(w₈ [s₀; m])`` with ``m = Σ_j γ_j M_j``, ``γ = softmax(w₉ M)``, trained jointly
   with the span (the trainer adds its binary cross-entropy); ``no_answer="last_token"``
   (default, the ABA paper's) points unanswerable questions at the passage's last token.

Departures we know of: plain BiLSTMs where SAN uses maxout BiLSTMs, no CoVe vectors, no POS/NER
embeddings (our token features are exact match and term frequency).

With ``aba=True``, Adaptive Bi-directional Attention over ``[E; C¹; C²; A]``: with
``aba_feed="output"`` (the paper's) ``A = M`` and the answer module reads ``I`` as its memory;
with ``aba_feed="attention"`` ``A = Uᵖ`` and ``I``, mapped to the width of ``Uᵖ``, takes its
place before the self-attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mrc_lib.models import register
from mrc_lib.models.aba import ABAReader
from mrc_lib.nn import RNN, LockedDropout, WordEmbedding, mask_logits, masked_softmax, zero_padding


class FeedForward2(nn.Sequential):
    """A two-layer position-wise feed-forward network with ReLU: SAN's lexicon encoder."""

    def __init__(self, d_in: int, d_out: int, dropout: float) -> None:
        super().__init__(LockedDropout(dropout), nn.Linear(d_in, d_out), nn.ReLU(),
                         nn.Linear(d_out, d_out), nn.ReLU())


class AnswerModule(nn.Module):
    """Layer 4: ``T`` steps of GRU reasoning over the memory, averaged (stochastic prediction
    dropout in training)."""

    def __init__(self, state: int, memory: int, steps: int, step_dropout: float) -> None:
        super().__init__()
        self.steps, self.step_dropout = steps, step_dropout
        self.W5 = nn.Linear(state, memory, bias=False)
        self.W6 = nn.Linear(state, memory, bias=False)
        self.W7 = nn.Linear(state + memory, memory, bias=False)
        self.gru = nn.GRUCell(memory, state)

    def forward(self, s0: Tensor, m: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """``s₀`` ``[B, state]``, memory ``[B, L, memory]``: the mean ``P^begin`` and
        ``P^end`` ``[B, L]``."""
        s, begins, ends = s0, [], []
        for _ in range(self.steps):
            beta = masked_softmax((self.W5(s).unsqueeze(1) * m).sum(-1), mask)
            s = self.gru((beta.unsqueeze(1) @ m).squeeze(1), s)  # s_t = GRU(s_{t−1}, x_t)
            p_begin = masked_softmax((self.W6(s).unsqueeze(1) * m).sum(-1), mask)
            read = (p_begin.unsqueeze(1) @ m).squeeze(1)
            p_end = masked_softmax((self.W7(torch.cat([s, read], -1)).unsqueeze(1) * m).sum(-1),
                                   mask)
            begins.append(p_begin)
            ends.append(p_end)
        keep = self.kept_steps(s0)
        begin = (torch.stack(begins, 1) * keep[..., None]).sum(1) / keep.sum(1, keepdim=True)
        end = (torch.stack(ends, 1) * keep[..., None]).sum(1) / keep.sum(1, keepdim=True)
        return begin, end

    def kept_steps(self, s0: Tensor) -> Tensor:
        """``[B, T]`` 1 for the steps averaged: all in eval, a random subset in training."""
        keep = torch.ones(s0.shape[0], self.steps, device=s0.device)
        if not self.training or self.step_dropout == 0.0:
            return keep
        keep = keep.bernoulli_(1.0 - self.step_dropout)
        # A row that dropped every step keeps one, drawn once on the host for all such rows.
        none = keep.sum(1, keepdim=True) == 0
        step = torch.arange(self.steps, device=keep.device) == torch.randint(self.steps, ())
        return keep.masked_fill_(none & step, 1.0)


@register("san")
class SAN(ABAReader):
    """The SAN reader for SQuAD 2.0, optionally with ABA.

    Args:
        vocab: see :mod:`mrc_lib.models`.
        d_lexicon: width of the lexicon encoding ``E``.
        hidden: BiLSTM size per direction.
        d_align: width of the ReLU projections of the word-alignment and memory attentions.
        steps: ``T``, the answer module's reasoning steps.
        step_dropout: stochastic prediction dropout, the probability of dropping a step.
        dropout: variational dropout on the input of every LSTM and feed-forward layer, and on
            the attention matrix ``C``.
        no_answer: ``"last_token"`` (the ABA paper's) or ``"head"`` (SAN's classifier).
        aba, aba_lam, aba_order, aba_feed: Adaptive Bi-directional Attention and its options.
        use_features: append the data pipeline's token features to the passage's lexicon input.
    """

    def __init__(self, vocab, *, d_lexicon: int = 250, hidden: int = 125, d_align: int = 250,
                 steps: int = 5, step_dropout: float = 0.4, dropout: float = 0.4,
                 no_answer: str = "last_token", aba: bool = False, aba_lam: str = "paper",
                 aba_order: str = "paper", aba_feed: str = "output", use_features: bool = True):
        super().__init__()
        self.word = WordEmbedding(torch.as_tensor(vocab.word_vectors, dtype=torch.float32),
                                  vocab.n_trainable)
        d_word = vocab.word_vectors.shape[1]
        self.n_feats = vocab.n_feats if use_features else 0
        # 1. Lexicon encoding.
        self.align = nn.Linear(d_word, d_word)
        self.lexicon_p = FeedForward2(2 * d_word + self.n_feats, d_lexicon, dropout)
        self.lexicon_q = FeedForward2(d_word, d_lexicon, dropout)
        # 2. Contextual encoding: two BiLSTM layers.
        self.context1 = RNN(d_lexicon, hidden, dropout=dropout)
        self.context2 = RNN(2 * hidden, hidden, dropout=dropout)
        # 3. Memory generation.
        self.W3 = nn.Linear(4 * hidden, d_align)
        self.dropout = nn.Dropout(dropout)
        self.memory_rnn = RNN(16 * hidden, hidden, dropout=dropout)
        # ABA over [E; C¹; C²; A]: A = M (output) or Uᵖ (attention).
        a_dim = 2 * hidden if aba_feed == "output" else 8 * hidden
        memory = self.init_aba([d_lexicon, 2 * hidden, 2 * hidden, a_dim], dropout,
                               no_answer=no_answer, aba=aba, aba_lam=aba_lam, aba_order=aba_order,
                               aba_feed=aba_feed, attention_dim=8 * hidden, output_dim=2 * hidden)
        self.attn_proj = nn.Identity()  # Uᵖ is the attention layer's output as it is
        # 4. Answer module over M (or I, memory wide).
        self.w4 = nn.Linear(4 * hidden, 1, bias=False)
        self.answer = AnswerModule(4 * hidden, memory, steps, step_dropout)
        # 5. SAN's classifier.
        self.classifier = (nn.ModuleDict({"w9": nn.Linear(memory, 1, bias=False),
                                          "w8": nn.Linear(4 * hidden + memory, 1)})
                           if no_answer == "head" else None)

    def layers(self, words: Tensor, mask: Tensor, lexicon: nn.Module,
               extra: list[Tensor] = ()) -> list[Tensor]:
        """Layers 1-2 for one side: ``[E, C¹, C²]``."""
        e = lexicon(torch.cat([self.word(words), *extra], dim=-1))
        c1 = self.context1(e, mask)
        return [e, c1, self.context2(c1, mask)]

    def aligned(self, p: Tensor, q: Tensor, q_mask: Tensor) -> Tensor:
        """``f_align``: each passage word's attention-weighted question word vectors."""
        scores = F.relu(self.align(p)) @ F.relu(self.align(q)).transpose(1, 2)
        return masked_softmax(scores, q_mask.unsqueeze(1)) @ q

    def memory_attention(self, h_p: Tensor, h_q: Tensor, c_mask: Tensor,
                         q_mask: Tensor) -> tuple[Tensor, Tensor]:
        """``Uᵖ = [Hᵖ; H^q C]`` with ``C = dropout(ReLU(W₃ H^q) · ReLU(W₃ Hᵖ))`` normalised over
        the question, and that map ``[B, Lc, Lq]``."""
        scores = self.dropout(F.relu(self.W3(h_p)) @ F.relu(self.W3(h_q)).transpose(1, 2))
        attn = zero_padding(masked_softmax(scores, q_mask.unsqueeze(1)), c_mask)
        return torch.cat([h_p, attn @ h_q], dim=-1), attn

    def memory(self, u: Tensor, c_mask: Tensor) -> Tensor:
        """``M = BiLSTM([Uᵖ; Ûᵖ])`` with ``Ûᵖ = Uᵖ drop_diag(Uᵖ Uᵖᵀ)`` (a word never attends
        to itself)."""
        eye = torch.eye(c_mask.shape[1], dtype=torch.bool, device=c_mask.device)
        u_hat = masked_softmax(u @ u.transpose(1, 2), c_mask.unsqueeze(1) & ~eye) @ u
        return self.memory_rnn(torch.cat([u, u_hat], dim=-1), c_mask)

    def forward(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        c_mask, q_mask = batch["c_mask"], batch["q_mask"]
        # 1-2.
        x_p, x_q = self.word(batch["c_words"]), self.word(batch["q_words"])
        extra = [self.aligned(x_p, x_q, q_mask)]
        if self.n_feats:
            extra.append(batch["c_feats"].to(x_p.dtype))
        p = self.layers(batch["c_words"], c_mask, self.lexicon_p, extra)
        q = self.layers(batch["q_words"], q_mask, self.lexicon_q)
        h_p, h_q = torch.cat(p[1:], -1), torch.cat(q[1:], -1)
        # 3. Uᵖ (or I with ABA fed at the attention), then M (or I fed at the output).
        u, attn = self.memory_attention(h_p, h_q, c_mask, q_mask)
        u, attn = self.at_attention(p, q, u, attn, c_mask, q_mask)
        m, attn = self.at_output(p, q, self.memory(u, c_mask), attn, c_mask, q_mask)
        # 4.
        s0 = (masked_softmax(self.w4(h_q).squeeze(-1), q_mask).unsqueeze(1) @ h_q).squeeze(1)
        p_begin, p_end = self.answer(s0, m, c_mask)
        tiny = torch.finfo(p_begin.dtype).tiny
        start = mask_logits(p_begin.clamp_min(tiny).log().float(), c_mask)
        end = mask_logits(p_end.clamp_min(tiny).log().float(), c_mask)
        if self.classifier is None:
            return self.outputs(start, end, attn, batch)
        # 5. P^u = σ(w₈ [s₀; m]).
        gamma = masked_softmax(self.classifier["w9"](m).squeeze(-1), c_mask)
        summary = (gamma.unsqueeze(1) @ m).squeeze(1)
        na = self.classifier["w8"](torch.cat([s0, summary], -1)).squeeze(-1).float()
        return self.outputs(start, end, attn, batch, na)
