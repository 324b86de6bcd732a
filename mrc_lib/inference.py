"""Running a reader on a split: the pieces that both the trainer (:mod:`mrc_lib.train`) and
data-side evaluations (:func:`mrc_lib.data.squad2.tuned_scores`) need, kept here so that
:mod:`mrc_lib.data` never imports the engine."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from mrc_lib.config import TrainConfig
from mrc_lib.nn import decode_span


def to_device(batch: dict[str, Tensor], device: torch.device,
              copy: bool = False) -> dict[str, Tensor]:
    """``batch`` on ``device`` (with ``copy``, new tensors even where it is there already)."""
    return {key: value.to(device, non_blocking=True, copy=copy) for key, value in batch.items()}


def bf16_autocast(bf16: bool, device_type: str) -> bool:
    """Whether a run computes under bfloat16 autocast: where its config asks (``bf16``) and
    only on CUDA; otherwise in full precision."""
    return bool(bf16) and device_type == "cuda"


def autocast(cfg: TrainConfig, device: torch.device):
    """bfloat16 autocast when :func:`bf16_autocast`; otherwise full precision."""
    return torch.autocast(device.type, dtype=torch.bfloat16,
                          enabled=bf16_autocast(cfg.bf16, device.type))


@torch.no_grad()
def predict_spans(model: nn.Module, split, cfg: TrainConfig,
                  device: torch.device) -> Iterator[tuple[int, int, int, float, float | None]]:
    """The most probable span of every example of ``split`` (``model`` in eval mode), as
    ``(index, start_token, end_token, p_start · p_end, no-answer probability or None)``."""
    for batch in split.batches(cfg.eval_batch_size, shuffle=False):
        with autocast(cfg, device):
            out = model(to_device(batch, device))
        p_start = out["start_logits"].float().softmax(-1)
        p_end = out["end_logits"].float().softmax(-1)
        start, end, score = decode_span(p_start, p_end, cfg.max_answer_len)
        na = (out["na_logits"].float().sigmoid().tolist() if "na_logits" in out
              else [None] * len(start))
        yield from zip(batch["idx"].tolist(), start.tolist(), end.tolist(), score.tolist(), na)
