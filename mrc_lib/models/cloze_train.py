"""Training and evaluation of cloze readers (EA Reader and its ablations) on
:class:`mrc_lib.data.cloze.ClozeSet` splits.

As in the paper: Adam with learning rate 1e-3, batches of 32, the answer's negative
log-likelihood. Our additions (the paper does not state them): gradient-norm clipping and
model selection on valid accuracy. One call of :func:`train_cloze` is one run and returns its
metrics dict. A run lives in one folder: ``config.json``, ``checkpoint.pt`` (written atomically
at every epoch end: weights, best weights, optimizer, random-number states, history; a run
resumes from it), ``model.pt`` (the best weights) and ``metrics.json``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from mrc_lib.checkpoint import (
    load_checkpoint,
    rng_state,
    save_checkpoint,
    seed_everything,
    set_rng_state,
)
from mrc_lib.data.cloze import ClozeSet, ReaderSplit
from mrc_lib.errors import UserError
from mrc_lib.inference import to_device
from mrc_lib.models.ea_reader import EAReader, cloze_loss, predict
from mrc_lib.utils import atomic_write_json

# Settings that may differ when a run is resumed; any other change is refused.
RESUMABLE = {"epochs", "eval_batch_size", "device"}


@dataclass
class ClozeConfig:
    """One training run; ``hparams`` are :class:`EAReader` keyword arguments."""

    hparams: dict = field(default_factory=dict)
    epochs: int = 2
    batch_size: int = 32
    lr: float = 1e-3
    grad_clip: float = 10.0
    max_train: int | None = None  # first N training examples (None: all)
    max_eval: int | None = None  # first N valid/test examples (None: all)
    eval_batch_size: int = 64
    seed: int = 0
    device: str = "cpu"


def batches(data: ClozeSet, word_ids: np.ndarray, batch_size: int, limit: int | None,
            order_seed: list[int] | None = None):
    """Padded batches of the first ``limit`` examples, shuffled when ``order_seed`` is given."""
    n = len(data) if limit is None else min(limit, len(data))
    order = np.arange(n) if order_seed is None else np.random.default_rng(order_seed).permutation(n)
    for start in range(0, n, batch_size):
        yield data.collate(order[start:start + batch_size], word_ids)


def autocast(device: torch.device):
    """bf16 autocast on CUDA, a no-op elsewhere."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def accuracy(model: nn.Module, data: ClozeSet, word_ids: np.ndarray, cfg: ClozeConfig) -> float:
    """Percentage of examples whose highest-scoring candidate is the answer."""
    model.eval()
    device = torch.device(cfg.device)
    correct = total = 0
    for batch in batches(data, word_ids, cfg.eval_batch_size, cfg.max_eval):
        batch = to_device(batch, device)
        with autocast(device):
            out = model(batch)
        correct += int((predict(out) == batch["answer"]).sum())
        total += len(batch["answer"])
    return 100.0 * correct / total


def train_cloze(sets: dict[str, ClozeSet], word_ids: np.ndarray, vectors: np.ndarray,
                cfg: ClozeConfig, out_dir, resume: bool = True) -> dict:
    """Train on ``sets["train"]``, select on ``sets["valid"]``, report ``sets["test"]``.

    Returns the metrics: ``valid`` and ``test`` accuracy (%) of the best valid epoch,
    ``history``, ``params``, ``seconds_per_epoch`` and ``analysis``, the reader's figure
    payload (:meth:`EAReader.analysis` on the valid split, best weights, eval mode). With
    ``resume``, a finished run in ``out_dir`` is loaded instead of retrained and an unfinished
    one continues.
    """
    out_dir = Path(out_dir)
    path = out_dir / "checkpoint.pt"
    resume = resume and path.is_file()
    if resume:
        check_resumable(out_dir / "config.json", cfg)
    atomic_write_json(out_dir / "config.json", dataclasses.asdict(cfg))
    device = torch.device(cfg.device)
    seed_everything(cfg.seed)
    model = EAReader(vectors, **cfg.hparams).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    state = {"epoch": 0, "history": [], "best": -1.0, "best_weights": model.state_dict(),
             "seconds": []}
    if resume:
        saved = load_checkpoint(path)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        set_rng_state(saved["rng"])
        state = saved["state"]
    while state["epoch"] < cfg.epochs:
        start = time.perf_counter()
        train_epoch(model, optimizer, sets["train"], word_ids, cfg, state["epoch"])
        valid = accuracy(model, sets["valid"], word_ids, cfg)
        state["epoch"] += 1
        state["seconds"].append(time.perf_counter() - start)
        state["history"].append({"epoch": state["epoch"], "valid": valid})
        if valid > state["best"]:
            state["best"] = valid
            state["best_weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        save_checkpoint(path, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                               "rng": rng_state(), "state": state})
    model.load_state_dict(state["best_weights"])
    save_checkpoint(out_dir / "model.pt", state["best_weights"])
    metrics = {"valid": state["best"], "test": accuracy(model, sets["test"], word_ids, cfg),
               "history": state["history"], "seconds_per_epoch": state["seconds"],
               "params": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    with torch.no_grad(), autocast(device):
        metrics["analysis"] = model.eval().analysis(ReaderSplit(sets["valid"], word_ids))
    atomic_write_json(out_dir / "metrics.json", metrics)
    return metrics


def check_resumable(path: Path, cfg: ClozeConfig) -> None:
    """Refuse to resume a run whose configuration differs in more than :data:`RESUMABLE`."""
    saved = json.loads(path.read_text(encoding="utf-8"))
    changed = sorted(k for k, v in dataclasses.asdict(cfg).items()
                     if k not in RESUMABLE and saved.get(k) != v)
    if changed:
        raise UserError(f"{path.parent} holds a run with other {', '.join(changed)}; "
                        "use another folder, or resume=False to start over")


def train_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, data: ClozeSet,
                word_ids: np.ndarray, cfg: ClozeConfig, epoch: int) -> None:
    """One pass over the (shuffled) training examples."""
    model.train()
    device = torch.device(cfg.device)
    for batch in batches(data, word_ids, cfg.batch_size, cfg.max_train, [cfg.seed, epoch]):
        batch = to_device(batch, device)
        with autocast(device):
            out = model(batch)
        loss = cloze_loss(out["logits"], out["candidates"], batch["answer"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
