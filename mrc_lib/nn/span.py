"""Span-extraction loss and decoding, shared by every extractive reader."""

import torch
import torch.nn.functional as F
from torch import Tensor


def span_loss(start_logits: Tensor, end_logits: Tensor, y1: Tensor, y2: Tensor) -> Tensor:
    """BiDAF Eq. 5: ``−(1/N) Σ_i [log p¹(y¹_i) + log p²(y²_i)]``, the two ends' negative
    log-likelihoods summed and averaged over the batch (targets ``-100`` are left out of the
    mean). Logits are ``[B, L]`` and already masked. The sum, not the mean of the two, is what
    the papers train: it sets the gradient's scale, which gradient clipping and Adadelta (whose
    step is proportional to the gradient while its accumulators are below ``ε``) see. A batch
    without any target gives 0 (cross-entropy's own mean would be NaN), and no count is read
    back from the device.
    """
    return _mean_nll(start_logits, y1) + _mean_nll(end_logits, y2)


def _mean_nll(logits: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy's mean over the targets other than ``-100``; 0 if there are none."""
    kept = (target != -100).sum().clamp(min=1)
    return F.cross_entropy(logits, target, reduction="sum") / kept


def decode_span(p_start: Tensor, p_end: Tensor, max_len: int) -> tuple[Tensor, Tensor, Tensor]:
    """Most probable span: ``argmax p_start[i] · p_end[j]`` over ``i ≤ j`` with ``j − i < max_len``.

    ``p_start`` and ``p_end`` are ``[B, L]`` probabilities. Only the ``[B, L, max_len]`` band of
    candidate pairs ``(i, i + k)`` is scored; ties go to the smallest ``i`` and then the smallest
    ``j``, as in a scan over ``i`` then ``j``. A ``max_len`` of at least ``L`` scores every span
    with ``i ≤ j`` (BiDAF's rule, Sec. 2; DecaProp's, Sec. 3.4). Returns
    ``(start, end, score)``, each ``[B]``.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be at least 1, got {max_len}")
    L = p_start.shape[1]
    max_len = min(max_len, L)   # longer spans cannot start anywhere
    # band[b, i, k] = p_end[b, i + k], with positions past the end padded and masked below.
    band = F.pad(p_end, (0, max_len - 1)).unfold(1, max_len, 1)  # [B, L, max_len]
    scores = p_start.unsqueeze(-1) * band
    i = torch.arange(L, device=p_start.device).unsqueeze(1)
    k = torch.arange(max_len, device=p_start.device)
    scores = scores.masked_fill(i + k >= L, float("-inf"))
    # argmax returns the first maximum of the row-major (i, k) order, i.e. of the (i, j) order.
    scores = scores.flatten(1)
    flat = scores.argmax(dim=1)
    score = scores.gather(1, flat.unsqueeze(1)).squeeze(1)
    start = flat // max_len
    return start, start + flat % max_len, score
