"""Benchmark: peak memory and time of a training step against sequence length, for a stack of
DynSA blocks and the encoders it replaces (beyond DynSAN's paper, Zhuang & Wang 2019).

Five encoders of ``N = 4`` blocks, width ``D = 128``, ``H = 8`` heads, over one sequence of
``L`` tokens (batch 1, no padding); a step is forward, backward and an Adam update:

* ``dynsa``: DynSA blocks with ``K = 256`` (:mod:`mrc_lib.models.dynsa`);
* ``bilstm``: one Bi-LSTM layer per block (:class:`mrc_lib.nn.RNN`);
* ``san_materialized``: QANet encoder blocks whose self-attention builds the ``L × L`` score
  matrix explicitly, as 2019 implementations did;
* ``san_sdpa``: the same blocks through ``scaled_dot_product_attention``, which on a GPU runs
  fused kernels (FlashAttention / memory-efficient) that never store the ``L × L`` matrix;
* ``bibosa``: Bi-BloSA blocks (:mod:`mrc_lib.models.bibosa`), the block-level rival of
  DynSAN's Tables 3 and 4.

Peak memory is the growth over the timed steps, from a baseline taken after one warm-up step
(model, input and Adam's state allocated), of CUDA's peak allocated bytes or, on a CPU, of the
peak resident set (reset through ``/proc/self/clear_refs``, Linux): the activations, gradients
and temporaries of a step. The sweep runs each point in a fresh process (an out-of-memory
failure ends only that point).
A spec with ``"reader": true`` measures the whole DynSAN reader instead (Table 4),
``"materialize": true`` with every SDPA self-attention swapped for the materialized one.
Inference (forward only, no gradients) is timed too. Writes
``benchmarks/results/dynsa_scaling_<device>.json`` with a log-log slope per encoder::

    python benchmarks/dynsa_scaling.py --lengths 512 1024 2048 4096 8192 16384   # a GPU
    python benchmarks/dynsa_scaling.py --lengths 256 512 1024 2048 --device cpu
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import math
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from mrc_lib.bench import SyntheticVocab, synthetic_batch
from mrc_lib.models import build_model
from mrc_lib.models.bibosa import BiBloSABlock
from mrc_lib.models.dynsa import DynSA
from mrc_lib.models.dynsan import Baseline
from mrc_lib.nn import RNN, EncoderBlock, MultiHeadSelfAttention, mask_logits, span_loss
from mrc_lib.train import device_name, resolve_device
from mrc_lib.utils import atomic_write_json

ENCODERS = ("dynsa", "bilstm", "san_materialized", "san_sdpa", "bibosa")
RESULTS = Path(__file__).parent / "results"


class MaterializedSelfAttention(MultiHeadSelfAttention):
    """:class:`MultiHeadSelfAttention` computed as ``softmax(Q Kᵀ / √d_k) V`` with the
    ``[B, heads, L, L]`` scores stored (kept for the backward pass)."""

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        B, L, D = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(D // self.heads)
        h = torch.softmax(mask_logits(scores, mask[:, None, None, :]), dim=-1) @ v
        h = self.out(h.transpose(1, 2).reshape(B, L, D))
        return h.masked_fill(~mask.unsqueeze(-1), 0.0)


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


def measure_isolated(spec: dict, timeout: float = 600) -> dict:
    """:func:`measure` in a fresh Python process; an out-of-memory or failed run gives
    ``None`` for the time and the memory."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(spec)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**spec, "seconds_per_step": None, "seconds_per_inference": None,
                "peak_memory_bytes": None, "error": "timeout"}
    if done.returncode != 0:
        error = (done.stderr.strip().splitlines() or ["failed"])[-1]
        return {**spec, "seconds_per_step": None, "seconds_per_inference": None,
                "peak_memory_bytes": None, "error": error}
    return json.loads(done.stdout.strip().splitlines()[-1])


def loglog_slope(lengths: list[int], values: list[float | None]) -> float | None:
    """Least-squares slope of ``log value`` on ``log length`` (1: linear, 2: quadratic)."""
    pairs = [(math.log(n), math.log(v)) for n, v in zip(lengths, values) if v]
    if len(pairs) < 2:
        return None
    x, y = np.array(pairs).T
    return float(np.polyfit(x, y, 1)[0])


def sweep(lengths: list[int], device: str = "auto", encoders=ENCODERS, dim: int = 128,
          heads: int = 8, top_k: int = 256, blocks: int = 4, steps: int = 3) -> dict:
    """Every encoder at every length; stops an encoder after its first failure (e.g. OOM)."""
    rows = []
    for kind in encoders:
        for L in lengths:
            spec = {"encoder": kind, "length": L, "dim": dim, "heads": heads, "top_k": top_k,
                    "blocks": blocks, "steps": steps, "device": device}
            rows.append(measure_isolated(spec))
            print(json.dumps(rows[-1]), flush=True)
            if rows[-1]["peak_memory_bytes"] is None:
                break
    slopes = {}
    for kind in encoders:
        mine = [r for r in rows if r["encoder"] == kind]
        n = [r["length"] for r in mine]
        slopes[kind] = {"memory": loglog_slope(n, [r["peak_memory_bytes"] for r in mine]),
                        "time": loglog_slope(n, [r["seconds_per_step"] for r in mine])}
    names = [r["device_name"] for r in rows if "device_name" in r]
    return {"benchmark": "DynSA scaling: one training step of a 4-block encoder, batch 1",
            "device": names[0] if names else device, "torch": torch.__version__,
            "rows": rows, "slopes": slopes}


def device_slug(name: str) -> str:
    """``cpu`` for any CPU, else the GPU name in lower case with dashes."""
    if not name.lower().startswith("nvidia") and "gpu" not in name.lower():
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--encoders", nargs="+", default=list(ENCODERS), choices=ENCODERS)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None, help="JSON file (default: results/...)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a single measure() spec, as JSON
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(json.loads(args.one))))
        return
    result = sweep(args.lengths, args.device, args.encoders, steps=args.steps)
    slug = device_slug(result["device"])
    out = Path(args.out) if args.out else RESULTS / f"dynsa_scaling_{slug}.json"
    atomic_write_json(out, result)
    print(out)


if __name__ == "__main__":
    main()
