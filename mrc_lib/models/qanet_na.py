"""QANet for SQuAD 2.0: QANet (Yu et al., ICLR 2018) with a no-answer option, optionally ABA.

The reader is :class:`~mrc_lib.models.qanet.QANet` layer for layer (its modules are reused, not
copied). Two additions:

* the no-answer score of Clark & Gardner (2018, Sec. 3.3), :class:`NoAnswerHead`, over the
  three model-encoder outputs ``[M0; M1; M2]``, pooled by the start scores, the end scores and
  a learned self-attention;
* with ``aba=True``, Adaptive Bi-directional Attention (:mod:`mrc_lib.models.aba`) in place of
  the context-query attention, over the history ``[E; C¹; …; Cⁿ; A]``: ``E`` the projected
  input embedding, ``Cᵇ`` the output of embedding-encoder block ``b`` and ``A`` the projected
  context-query attention.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from mrc_lib.models import register
from mrc_lib.models.aba import AdaptiveBiAttention, attend
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
class QANetNA(QANet):
    """QANet with a no-answer option. Hyperparameters: QANet's, and

    Args:
        aba: replace the context-query attention by Adaptive Bi-directional Attention.
        na_hidden: hidden size of the no-answer network.
    """

    def __init__(self, vocab, *, aba: bool = False, na_hidden: int = 128, **hparams):
        super().__init__(vocab, **hparams)
        d, p = self.attn_proj.out_features, self.dropout.p
        n_layers = len(self.emb_encoder.blocks)
        self.aba = AdaptiveBiAttention([d] * (n_layers + 2), p) if aba else None
        self.no_answer = NoAnswerHead(3 * d, na_hidden, p)

    def layers(self, words: Tensor, chars: Tensor, mask: Tensor,
               feats: Tensor | None = None) -> list[Tensor]:
        """Layers 1-2 for one side with every block's output kept, ``[E, C¹, …, Cⁿ]``;
        ``Cⁿ`` is what :meth:`QANet.encode` returns."""
        out = [self.embed_proj(self.embed(words, chars, feats))]
        for block in self.emb_encoder.blocks:
            out.append(block(out[-1], mask))
        return out

    def forward(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        c_mask = batch["c_mask"]
        # Layers 1-3: W[c; a; c⊙a; c⊙b] from the base attention, or W·I from ABA.
        x, attn = attend(self, batch)
        # Layers 4-5 as in QANet.
        m0 = self.model_encoder(self.dropout(x), c_mask)
        m1 = self.model_encoder(self.dropout(m0), c_mask)
        m2 = self.model_encoder(self.dropout(m1), c_mask)
        start = mask_logits(self.w1(torch.cat([m0, m1], dim=-1)).squeeze(-1).float(), c_mask)
        end = mask_logits(self.w2(torch.cat([m0, m2], dim=-1)).squeeze(-1).float(), c_mask)
        na = self.no_answer(torch.cat([m0, m1, m2], dim=-1), start, end, c_mask)
        return {"start_logits": start, "end_logits": end, "na_logits": na,
                "attention": attn.float()}
