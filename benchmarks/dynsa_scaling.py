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

Each point is one training step and one inference pass of the stack
(:func:`mrc_lib.scaling.measure`, which also says how peak memory is taken), run in a fresh
process (an out-of-memory failure ends only that point). Writes
``benchmarks/results/dynsa_scaling_<device>.json`` with a log-log slope per encoder::

    python benchmarks/dynsa_scaling.py --lengths 512 1024 2048 4096 8192 16384   # a GPU
    python benchmarks/dynsa_scaling.py --lengths 256 512 1024 2048 --device cpu
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from mrc_lib.scaling import measure
from mrc_lib.utils import atomic_write_json

ENCODERS = ("dynsa", "bilstm", "san_materialized", "san_sdpa", "bibosa")
RESULTS = Path(__file__).parent / "results"


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
