"""QANet for SQuAD 2.0: QANet (Yu et al., ICLR 2018) for unanswerable questions, optionally ABA.

The reader is :class:`~mrc_lib.models.qanet.QANet` layer for layer (its modules are reused, not
copied). Additions:

* unanswerable questions: by default (``no_answer="last_token"``) the ABA paper's formulation
  (Chen et al. 2021, Sec. 2.1), the passage's last token as the answer
  (:func:`mrc_lib.models.aba.last_token_outputs`); ``no_answer="head"``: the no-answer score of
  Clark & Gardner (2018, Sec. 3.3), :class:`NoAnswerHead`, over the output layer's input,
  pooled by the start scores, the end scores and a learned self-attention, with its own loss;
* with ``aba=True``, Adaptive Bi-directional Attention (:mod:`mrc_lib.models.aba`) over the
  history ``[E; C¹; …; Cⁿ; A]``: ``E`` the projected input embedding and ``Cᵇ`` the output of
  embedding-encoder block ``b``. With ``aba_feed="output"`` (the paper's) ``A = [M0; M1; M2]``,
  everything QANet's output layer reads, and the output layer becomes ``p1 = softmax(W1 I)``,
  ``p2 = softmax(W2 I)``; with ``aba_feed="attention"`` ``A`` is the projected context-query
  attention and ``I`` takes its place before the model encoder.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from mrc_lib.models import register
from mrc_lib.models.aba import ABAReader
from mrc_lib.models.bidafpp import NoAnswerHead
from mrc_lib.models.qanet import QANet
from mrc_lib.nn import mask_logits


def with_parent_hparams(cls):
    """Class decorator for ``__init__(self, vocab, *, own…, **parent_hparams)``: advertise the
    parent reader's keyword-only hyperparameters too, so that
    :func:`mrc_lib.models.hparam_defaults` lists (and the trainer accepts) all of them."""
    own = inspect.signature(cls.__init__)
    parent = inspect.signature(cls.__mro__[1].__init__)
    params = [p for p in own.parameters.values() if p.kind is not p.VAR_KEYWORD]
    params += [p for p in parent.parameters.values() if p.kind is p.KEYWORD_ONLY]
    cls.__init__.__signature__ = own.replace(parameters=params)
    return cls


@register("qanet_na")
@with_parent_hparams
class QANetNA(QANet, ABAReader):
    """QANet for SQuAD 2.0. Hyperparameters: QANet's, and

    Args:
        no_answer: ``"last_token"`` (the ABA paper's) or ``"head"``.
        na_hidden: hidden size of the no-answer network (``no_answer="head"``).
        aba: add Adaptive Bi-directional Attention.
        aba_lam, aba_order, aba_feed: its ``lam``, ``hos_order`` and ``feed``
            (:class:`~mrc_lib.models.aba.AdaptiveBiAttention`).
    """

    def __init__(self, vocab, *, no_answer: str = "last_token", na_hidden: int = 128,
                 aba: bool = False, aba_lam: str = "paper", aba_order: str = "paper",
                 aba_feed: str = "output", **hparams):
        super().__init__(vocab, **hparams)
        d, p = self.attn_proj.out_features, self.dropout.p
        n_layers = len(self.emb_encoder.blocks)
        a_dim = 3 * d if aba_feed == "output" else d
        x_dim = self.init_aba([d] * (n_layers + 1) + [a_dim], p, no_answer=no_answer, aba=aba,
                              aba_lam=aba_lam, aba_order=aba_order, aba_feed=aba_feed,
                              attention_dim=4 * d, output_dim=3 * d)
        if self.aba is not None and aba_feed == "output":  # p1 = softmax(W1 I), p2 = softmax(W2 I)
            self.w1, self.w2 = nn.Linear(x_dim, 1, bias=False), nn.Linear(x_dim, 1, bias=False)
        self.no_answer = NoAnswerHead(x_dim, na_hidden, p) if no_answer == "head" else None

    def layers(self, words: Tensor, chars: Tensor, mask: Tensor,
               feats: Tensor | None = None) -> list[Tensor]:
        """Layers 1-2 for one side with every block's output kept, ``[E, C¹, …, Cⁿ]``;
        ``Cⁿ`` is what :meth:`QANet.encode` returns."""
        out = [self.embed_proj(self.embed(words, chars, feats))]
        for block in self.emb_encoder.blocks:
            out.append(block(out[-1], mask))
        return out

    def forward(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        c_mask, q_mask = batch["c_mask"], batch["q_mask"]
        # Layers 1-2.
        p = self.layers(batch["c_words"], batch["c_chars"], c_mask, batch.get("c_feats"))
        q = self.layers(batch["q_words"], batch["q_chars"], q_mask)
        # Layer 3: W[c; a; c⊙a; c⊙b], or W·I with ABA fed at the attention.
        g, attn = self.attention(p[-1], q[-1], c_mask, q_mask)
        x, attn = self.at_attention(p, q, g, attn, c_mask, q_mask)
        # Layer 4 as in QANet.
        m0 = self.model_encoder(self.dropout(x), c_mask)
        m1 = self.model_encoder(self.dropout(m0), c_mask)
        m2 = self.model_encoder(self.dropout(m1), c_mask)
        # Layer 5: W1[M0; M1], W2[M0; M2], or W1 I, W2 I with ABA fed at the output layer.
        m = torch.cat([m0, m1, m2], dim=-1)
        x, attn = self.at_output(p, q, m, attn, c_mask, q_mask)
        if x is m:
            start = self.w1(torch.cat([m0, m1], dim=-1))
            end = self.w2(torch.cat([m0, m2], dim=-1))
        else:
            start, end = self.w1(x), self.w2(x)
        start = mask_logits(start.squeeze(-1).float(), c_mask)
        end = mask_logits(end.squeeze(-1).float(), c_mask)
        na = self.no_answer(x, start, end, c_mask) if self.no_answer is not None else None
        return self.outputs(start, end, attn, batch, na)

    analysis = ABAReader.analysis  # the chapter's payload, not QANet's
