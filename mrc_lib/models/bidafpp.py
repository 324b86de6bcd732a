"""BiDAF++: BiDAF with self-attention and a no-answer option (Clark & Gardner, ACL 2018).

"Simple and Effective Multi-Paragraph Reading Comprehension". That paper is not among the
papers at hand: the layers below are its Sec. 3.1-3.3 as we recall them, unchecked.

1. embedding: fixed GloVe vectors and a character CNN max-pooled over each word;
2. pre-process: a bidirectional GRU shared by passage and question (``C¹``);
3. attention: BiDAF's (trilinear similarity, context-to-query, max-pooled query-to-context),
   ``[h; c; h ⊙ c; q2c ⊙ h]``, then a linear layer with ReLU;
4. self-attention: a bidirectional GRU, the same attention between the passage and itself with
   the diagonal masked (a word may not attend to itself), ``[x; x̃; x ⊙ x̃]``, a linear layer
   with ReLU, added to the layer's input (residual);
5. prediction: a bidirectional GRU and a linear layer give the start scores; its input and
   output, through a second bidirectional GRU and linear layer, give the end scores;
6. no-answer option: a score ``z`` from the hidden states pooled three ways, by the start
   scores, by the end scores and by a learned self-attention, through a two-layer network.

Variational dropout (one mask per sequence) of 0.2 acts on the input of every GRU and linear
layer.

Unanswerable questions: by default (``no_answer="last_token"``) the ABA paper's formulation
(Chen et al. 2021, Sec. 2.1), the passage's last token as the answer
(:func:`mrc_lib.models.aba.last_token_outputs`), for the readers with and without ABA alike.
``no_answer="head"`` uses layer 6, trained with the binary cross-entropy of ``σ(z)`` against
"no answer" added to the span loss of the answerable questions (task ``span_na`` of
:mod:`mrc_lib.tasks`; Clark & Gardner train ``z`` jointly with the spans in one softmax
instead).

With ``aba=True``, Adaptive Bi-directional Attention (:mod:`mrc_lib.models.aba`) over the
history ``[E; C¹; A]``: with ``aba_feed="output"`` (the paper's) ``A`` is the output of layer 4
and ``I`` is the input of layer 5; with ``aba_feed="attention"`` ``A`` is the output of layer
3 and ``I`` takes the place of layer 3's attention output.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mrc_lib.models import register
from mrc_lib.models.aba import ABAReader
from mrc_lib.models.inputs import InputEmbedding
from mrc_lib.nn import (
    RNN,
    BiDAFAttention,
    LockedDropout,
    TrilinearSimilarity,
    mask_logits,
    masked_softmax,
)


def linear_relu(d_in: int, d_out: int, dropout: float) -> nn.Sequential:
    """Dropout, a linear layer and a ReLU: Clark & Gardner's fully connected layers."""
    return nn.Sequential(LockedDropout(dropout), nn.Linear(d_in, d_out), nn.ReLU())


class SelfAttention(nn.Module):
    """Layer 4: ``x + ReLU(W[x'; x̃; x' ⊙ x̃])`` with ``x' = BiGRU(x)`` and ``x̃`` the passage
    attending to itself through the trilinear similarity, its diagonal masked."""

    def __init__(self, dim: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.rnn = RNN(dim, hidden, cell="gru", dropout=dropout)
        self.similarity = TrilinearSimilarity(2 * hidden)
        self.out = linear_relu(6 * hidden, dim, dropout)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.rnn(x, mask)
        eye = torch.eye(mask.shape[1], dtype=torch.bool, device=mask.device)
        keys = mask.unsqueeze(1) & ~eye  # [B, L, L]: real words other than itself
        h_tilde = masked_softmax(self.similarity(h, h), keys) @ h
        return x + self.out(torch.cat([h, h_tilde, h * h_tilde], dim=-1))


class NoAnswerHead(nn.Module):
    """The no-answer score ``z`` (Clark & Gardner Sec. 3.3): ``v₁ = softmax(s)ᵀh``,
    ``v₂ = softmax(e)ᵀh``, ``v₃ = softmax(w·h)ᵀh``, ``z = w_zᵀ ReLU(W[v₁; v₂; v₃])``."""

    def __init__(self, dim: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.w = nn.Linear(dim, 1, bias=False)
        self.mlp = nn.Sequential(nn.Dropout(dropout), nn.Linear(3 * dim, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 1))

    def forward(self, h: Tensor, start_logits: Tensor, end_logits: Tensor,
                mask: Tensor) -> Tensor:
        """``h`` ``[B, L, dim]``, masked logits ``[B, L]``: the no-answer logit ``[B]``."""
        scores = torch.stack([start_logits, end_logits, self.w(h).squeeze(-1).float()], dim=1)
        pooled = masked_softmax(scores, mask.unsqueeze(1)).to(h.dtype) @ h  # [B, 3, dim]
        return self.mlp(pooled.flatten(1)).squeeze(-1).float()


@register("bidafpp")
class BiDAFPP(ABAReader):
    """The BiDAF++ reader for SQuAD 2.0, optionally with ABA.

    Args:
        vocab: see :mod:`mrc_lib.models`.
        hidden: GRU size per direction (paper: 100).
        proj: width of the linear + ReLU layers (paper: 200 = 2 · hidden).
        char_dim, char_channels, char_kernel: character embedding size, CNN filters and width
            (paper: 20, 100, 5).
        dropout: variational dropout on every GRU and linear layer input (paper: 0.2).
        no_answer: ``"last_token"`` (the ABA paper's) or ``"head"`` (layer 6).
        na_hidden: hidden size of the no-answer network (``no_answer="head"``).
        aba: add Adaptive Bi-directional Attention.
        aba_lam, aba_order, aba_feed: its ``lam``, ``hos_order`` and ``feed``
            (:class:`~mrc_lib.models.aba.AdaptiveBiAttention`).
        use_features: append the data pipeline's token features to the context embedding.
    """

    def __init__(self, vocab, *, hidden: int = 100, proj: int = 200, char_dim: int = 20,
                 char_channels: int = 100, char_kernel: int = 5, dropout: float = 0.2,
                 no_answer: str = "last_token", na_hidden: int = 100, aba: bool = False,
                 aba_lam: str = "paper", aba_order: str = "paper", aba_feed: str = "output",
                 use_features: bool = False):
        super().__init__()
        # 1. GloVe and char CNN, no highway.
        self.embed = InputEmbedding(vocab, char_dim=char_dim, char_channels=char_channels,
                                    char_kernel=char_kernel, highway_layers=0,
                                    char_dropout=dropout, use_features=use_features)
        # 2. Shared BiGRU: C¹.
        self.encoder = RNN(self.embed.out_dim, hidden, cell="gru", dropout=dropout)
        # 3. BiDAF attention, then linear + ReLU.
        self.attention = BiDAFAttention(2 * hidden)
        self.attn_proj = linear_relu(8 * hidden, proj, dropout)
        # ABA over [E; C¹; A], A of width proj either way.
        x_dim = self.init_aba([self.embed.out_dim, 2 * hidden, proj], dropout,
                              no_answer=no_answer, aba=aba, aba_lam=aba_lam, aba_order=aba_order,
                              aba_feed=aba_feed, attention_dim=8 * hidden, output_dim=proj)
        # 4. Residual self-attention.
        self.self_attention = SelfAttention(proj, hidden, dropout)
        # 5. Start and end: BiGRU + linear each, reading x (or I, x_dim wide).
        self.start_rnn = RNN(x_dim, hidden, cell="gru", dropout=dropout)
        self.end_rnn = RNN(x_dim + 2 * hidden, hidden, cell="gru", dropout=dropout)
        self.w_start = nn.Sequential(LockedDropout(dropout), nn.Linear(2 * hidden, 1))
        self.w_end = nn.Sequential(LockedDropout(dropout), nn.Linear(2 * hidden, 1))
        # 6. No-answer option over both prediction GRUs' states.
        self.no_answer = NoAnswerHead(4 * hidden, na_hidden, dropout) if no_answer == "head" \
            else None

    def layers(self, words: Tensor, chars: Tensor, mask: Tensor,
               feats: Tensor | None = None) -> list[Tensor]:
        """Layers 1-2 for one side: ``[E, C¹]``."""
        e = self.embed(words, chars, feats)
        return [e, self.encoder(e, mask)]

    def forward(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        c_mask, q_mask = batch["c_mask"], batch["q_mask"]
        # 1-2.
        p = self.layers(batch["c_words"], batch["c_chars"], c_mask, batch.get("c_feats"))
        q = self.layers(batch["q_words"], batch["q_chars"], q_mask)
        # 3. ReLU(W G), or ReLU(W I) with ABA fed at the attention.
        g, attn = self.attention(p[-1], q[-1], c_mask, q_mask)
        x, attn = self.at_attention(p, q, g, attn, c_mask, q_mask)
        # 4. Then I in place of x with ABA fed at the output layer.
        x = self.self_attention(x, c_mask)
        x, attn = self.at_output(p, q, x, attn, c_mask, q_mask)
        # 5.
        h_start = self.start_rnn(x, c_mask)
        h_end = self.end_rnn(torch.cat([x, h_start], dim=-1), c_mask)
        start = mask_logits(self.w_start(h_start).squeeze(-1).float(), c_mask)
        end = mask_logits(self.w_end(h_end).squeeze(-1).float(), c_mask)
        # 6. (or the passage's last token)
        na = (self.no_answer(torch.cat([h_start, h_end], dim=-1), start, end, c_mask)
              if self.no_answer is not None else None)
        return self.outputs(start, end, attn, batch, na)
