"""Checkpoints: atomic writes and the random-number state needed to resume a run exactly.

A checkpoint is one ``torch.save`` dict. It is written to a temporary file and renamed onto its
name only once complete (:func:`mrc_lib.utils.atomic_path`), so a crash while saving leaves the
previous checkpoint intact. Everything in it is made of tensors and plain Python values, so it
loads with ``weights_only=True``.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from mrc_lib.errors import UserError
from mrc_lib.utils import atomic_path


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's (CPU and CUDA) generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """The state of every global generator a training step may draw from."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.copy()), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: str | Path, state: dict) -> None:
    """Write ``state`` to ``path`` atomically: all of it, or nothing and the old file kept."""
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def load_checkpoint(path: str | Path) -> dict:
    """Read a checkpoint written by :func:`save_checkpoint` onto the CPU."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"{path}: no checkpoint to resume from") from None
    except (RuntimeError, EOFError) as e:
        raise UserError(f"{path}: not a readable checkpoint: {e}") from None
