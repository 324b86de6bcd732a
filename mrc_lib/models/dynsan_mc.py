"""DynSAN's multiple-choice head (Zhuang & Wang, ACL 2019, Sec. 3.4.2, Eqs. 7-8).

With ``S`` ``[L, D]`` the output of the cross-passage attention layer over all ``M`` passages:

* Eq. 7: ``r = softmax(F^S(S))``, a distribution over all ``L`` tokens (``F^S`` linear);
* Eq. 8: ``P(c | q, P) = Σ_{i ∈ T_c} r_i``, ``T_c`` the positions of candidate ``c``'s mentions;
* training maximises ``log P(answer | q, P)`` (the ``multiple_choice`` task of
  :mod:`mrc_lib.tasks`).

For WikiHop the paper concatenates a binary feature to the word and character embeddings: is
the token (part of) a candidate answer (Sec. 4.1). :class:`DynSANMC` is the DynSAN reader with
that feature (``c_feats`` ``[B, L, 1]``) and this head in place of the span pointers.

WikiHop is not available here. The stand-in is chapter 05's cloze set in multi-passage form
(:class:`mrc_lib.data.choice.PassageSplit`, subset NE).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mrc_lib.models import register
from mrc_lib.models.dynsan import DynSAN
from mrc_lib.nn import mask_logits


def candidate_log_probs(logits: Tensor, cand_index: Tensor, n_candidates: int) -> Tensor:
    """Eqs. 7-8 in log space: ``log Σ_{i ∈ T_c} r_i`` with ``r = softmax(logits)`` (masked
    logits ``[B, L]``) and ``T_c`` the positions where ``cand_index`` ``[B, L]`` is ``c``
    (``-1``: no candidate). Returns ``[B, n_candidates]``; a candidate without mentions gets
    ``-inf``."""
    log_r = logits.log_softmax(-1)  # Eq. 7
    c = torch.arange(n_candidates, device=logits.device)
    mentions = cand_index.unsqueeze(1) == c[None, :, None]  # [B, C, L]: i ∈ T_c
    return log_r.unsqueeze(1).masked_fill(~mentions, float("-inf")).logsumexp(-1)  # Eq. 8


@register("dynsan_mc")
class DynSANMC(DynSAN):
    """DynSAN with the candidate feature and the multiple-choice head (Eqs. 7-8).

    ``forward`` returns ``candidate_log_probs`` ``[B, C]`` (Eq. 8, in log space; ``-inf`` for
    padding candidates) and, in training, the Eq. 6 penalty as ``aux_loss``. ``vocab`` has
    ``n_feats = 1`` (:func:`mrc_lib.data.choice.load_passage_data`). It keeps no figure
    payload: chapter 02 draws Figures 3 and 4 from the span reader.
    """

    FEATURES = True
    analysis = None

    def build_head(self, d_model: int, make_block) -> None:
        self.f_s = nn.Linear(d_model, 1, bias=False)  # F^S (Eq. 7)

    def forward(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        enc = self.encode(batch)
        logits = mask_logits(self.f_s(enc.s).squeeze(-1).float(), enc.c_mask)
        log_p = candidate_log_probs(logits, batch["cand_index"], batch["cand_mask"].shape[1])
        out = {"candidate_log_probs": log_p.masked_fill(~batch["cand_mask"], float("-inf"))}
        return self.finish(out, enc)
