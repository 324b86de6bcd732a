"""The cost of one training step, in time and peak memory: of the DynSAN reader with any of
its encoder blocks (Zhuang & Wang 2019, Table 4), or of a stack of encoder blocks alone
(``benchmarks/dynsa_scaling.py``'s sweep over sequence lengths, beyond the paper).

Peak memory is the growth over the timed steps, from a baseline taken after one warm-up step
(model, input and Adam's state allocated), of CUDA's peak allocated bytes or, on a CPU, of the
peak resident set (reset through ``/proc/self/clear_refs``, Linux): the activations, gradients
and temporaries of a step. A spec with ``"reader": true`` measures the whole DynSAN reader,
``"materialize": true`` with every SDPA self-attention swapped for one that stores the
``L × L`` scores, as 2019 implementations did. Inference (forward only) is timed too.

Chapter 02's Table 4 measurement (:func:`table4_spec`, :func:`measure_table4`) is a run record
of :mod:`mrc_lib.measurements`: made once on a GPU, read by every later execution.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import math
import statistics
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from mrc_lib.bench import SyntheticVocab, synthetic_batch
from mrc_lib.models import build_model
from mrc_lib.models.bibosa import BiBloSABlock
from mrc_lib.models.dynsa import DynSA
from mrc_lib.models.dynsan import Baseline
from mrc_lib.nn import (
    RNN,
    EncoderBlock,
    MultiHeadSelfAttention,
    mask_logits,
    span_loss,
    zero_padding,
)
from mrc_lib.train import device_name, resolve_device

# Table 4's encoders: the hyperparameters that swap DynSAN's DynSA blocks for each rival.
TABLE4_ENCODERS = {"Bi-LSTM": {"block": "bilstm"}, "Full SAN": {"block": "fullsan"},
                   "Bi-BloSAN": {"block": "bibosa", "conv": False},
                   "DynSAN (K = 32)": {"block": "dynsa", "top_k": 32}}
# The rows of its speed measurement: (encoder, materialized); full self-attention both ways.
TABLE4_SPEED_ROWS = {"Bi-LSTM": ("Bi-LSTM", False), "Full SAN (SDPA)": ("Full SAN", False),
                     "Full SAN (materialized L×L)": ("Full SAN", True),
                     "Bi-BloSAN": ("Bi-BloSAN", False),
                     "DynSAN (K = 32)": ("DynSAN (K = 32)", False)}


class MaterializedSelfAttention(MultiHeadSelfAttention):
    """:class:`MultiHeadSelfAttention` computed as ``softmax(Q Kᵀ / √d_k) V`` with the
    ``[B, heads, L, L]`` scores stored (kept for the backward pass)."""

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        B, L, D = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(D // self.heads)
        h = torch.softmax(mask_logits(scores, mask[:, None, None, :]), dim=-1) @ v
        h = self.out(h.transpose(1, 2).reshape(B, L, D))
        return zero_padding(h, mask)


def materialize(model: nn.Module) -> nn.Module:
    """Swap every SDPA self-attention of ``model`` for a materialized one with its weights."""
    for name, module in list(model.named_modules()):
        if type(module) is MultiHeadSelfAttention:
            explicit = MaterializedSelfAttention(module.out.in_features, module.heads,
                                                 module.dropout)
            explicit.load_state_dict(module.state_dict())
            model.set_submodule(name, explicit)
    return model


def encoder_block(kind: str, dim: int, heads: int, top_k: int) -> nn.Module:
    """One block of ``kind``, returning ``(y, gates or None)`` like :class:`DynSA`."""
    if kind == "dynsa":
        return DynSA(dim, heads, top_k)
    if kind == "bilstm":
        return Baseline(RNN(dim, dim // 2))
    if kind == "bibosa":
        return BiBloSABlock(dim, conv=False)
    block = EncoderBlock(dim, num_convs=2, kernel_size=7, heads=heads)
    if kind == "san_materialized":
        materialize(block)
    return Baseline(block)


def measure(spec: dict) -> dict:
    """Time per step and peak memory of one configuration, in this process."""
    device = resolve_device(spec["device"])
    torch.manual_seed(0)
    L, B = spec["length"], spec.get("batch_size", 1)
    if spec.get("reader"):
        vocab = SyntheticVocab.random(size=20_000)
        model = build_model("dynsan", vocab, **spec["hparams"])
        model = (materialize(model) if spec.get("materialize") else model).to(device)
        batch = {k: v.to(device) for k, v in synthetic_batch(vocab, B, L).items()}

        def loss() -> Tensor:
            # the reader's own objective in training; the span NLL in eval (no loss returned)
            out = model(batch)
            return out["loss"] if "loss" in out else span_loss(
                out["start_logits"], out["end_logits"], batch["y1"], batch["y2"])
    else:
        blocks = nn.ModuleList(encoder_block(spec["encoder"], spec["dim"], spec["heads"],
                                             spec["top_k"]) for _ in range(spec["blocks"]))
        model = blocks.to(device)
        x = torch.randn(B, L, spec["dim"], device=device)
        mask = torch.ones(B, L, dtype=torch.bool, device=device)

        def loss() -> Tensor:
            y = x
            for block in blocks:
                y, _ = block(y, mask)
            return y.square().mean()
    optimizer = torch.optim.Adam(model.parameters())
    model.train()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss().backward()
        optimizer.step()

    step()  # warm-up, untimed; allocates Adam's state before the memory baseline
    base = memory_baseline(device)
    seconds = [_timed(step, device) for _ in range(spec["steps"])]
    peak = memory_peak(device)
    model.eval()
    with torch.no_grad():
        inference = [_timed(loss, device) for _ in range(spec["steps"] + 1)][1:]
    return {**spec, "seconds_per_step": statistics.median(seconds),
            "seconds_per_inference": statistics.median(inference),
            "peak_memory_bytes": int(peak - base), "device_name": device_name(device)}


def _proc_status(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (Linux), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/self/status")


def memory_baseline(device: torch.device) -> int:
    """Reset the peak-memory counter and return the memory in use now. On a CPU: return freed
    heap to the system (``malloc_trim``), reset the peak resident set (``clear_refs``, Linux)
    and read the resident set."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    gc.collect()
    ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return _proc_status("VmRSS")


def memory_peak(device: torch.device) -> int:
    """The peak memory since :func:`memory_baseline`."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _proc_status("VmHWM")


def _timed(fn, device: torch.device) -> float:
    tic = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - tic


def table4_spec(profile: str) -> dict:
    """What chapter 02's Table 4 speed measurement measures at ``profile``: each row's reader
    (the DynSAN reader of the profile's SQuAD v1.1 config with that encoder, hyperparameters
    with defaults) at the config's context limit and batch size."""
    from mrc_lib.config import resolve_config
    from mrc_lib.models import effective_hparams

    cfg = resolve_config("dynsan", "squad-v1.1", profile)
    rows = {}
    for row, (encoder, materialized) in TABLE4_SPEED_ROWS.items():
        hparams = effective_hparams({"model": "dynsan",
                                     "hparams": {**cfg.hparams, **TABLE4_ENCODERS[encoder]}})
        rows[row] = {"hparams": hparams, "materialize": materialized}
    return {"length": cfg.context_limit, "batch_size": cfg.batch_size,
            "steps": 1 if profile == "smoke" else 10, "rows": rows}


def measure_table4(spec: dict, device: str) -> dict:
    """:func:`table4_spec`'s measurement on ``device``: :func:`measure` of each row's reader."""
    return {row: measure({"reader": True, "length": spec["length"],
                          "batch_size": spec["batch_size"], "steps": spec["steps"],
                          "device": device, **reader})
            for row, reader in spec["rows"].items()}
