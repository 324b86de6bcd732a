"""Where a reader's training step spends its time: the GPU's kernels, by operator, against the
step's wall time.

    python benchmarks/gpu_profile.py                      # QANet, DynSAN, PhaseCond on CUDA
    python benchmarks/gpu_profile.py --models qanet --seq-len 140
    python benchmarks/gpu_profile.py --device cpu --tiny  # the script's own check (CI)

The bring-up gives each reader's rate; this script says why a rate is what it is. For each
reader, at its full profile's hyperparameters, batch size and precision, on a synthetic batch
of ``--seq-len`` context tokens (:mod:`mrc_lib.bench`), after warm-up steps:

* ``wall_ms``: the trainer's step (``train_step`` and the weight average), timed alone;
* under :mod:`torch.profiler`, the same steps again: ``kernel_ms``, the time the GPU's kernels
  ran, and ``launches``, the kernels launched (the CUDA runtime's launch calls), per step;
  ``busy`` = ``kernel_ms / wall_ms``. A step far from busy waits on the host, launching one
  kernel per operation (what CUDA graphs or packing several runs onto the GPU cure); a busy one
  is bound by its kernels, named next;
* ``ops``: the operators with the most kernel time (``top`` of them; on a CPU, the most CPU
  time), each with its calls and milliseconds per step, and ``kernels``, the slowest kernels by
  name;
* for a step that waits on the host: ``host_ms``, the time the host spent inside operators
  (their own CPU time, launches included, summed; the profiler's overhead inflates it),
  ``host_ops``, the operators with the most of it, ``syncs``, the CUDA runtime calls per step
  that hold the host until the GPU has caught up (stream, event and device synchronisations),
  by name, and ``copies``, the GPU's memory copies per step by direction: one to host memory
  (``DtoH``, as ``.item()`` makes) holds the host too, one within the GPU (``DtoD``, as a
  ``clone`` or ``.contiguous()`` makes) is one more launch. (The first H100 profile, of
  2026-11-26, counted ``cudaMemcpyAsync`` calls among its ``syncs``; they are copies of any
  direction, mostly within the GPU, and hold the host only towards it.)

A reader that fails is reported with its error and the others still run. The result goes to
``benchmarks/results/profile_<device>.json`` (or ``--out``), rewritten after each reader and
marked ``"complete": true`` at the end, with the readers' code revision
(:data:`mrc_lib.bench.SPEED_REVISION`). ``--tiny`` uses the smoke profile's shrunk readers and
batches of 2: it checks the script, not the speed.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mrc_lib.bench import SPEED_REVISION, _seconds, overrides, setup  # noqa: E402
from mrc_lib.train import device_name, resolve_device, train_step  # noqa: E402
from mrc_lib.utils import atomic_write_json, slug  # noqa: E402

LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
# CUDA runtime calls that hold the host until the GPU has caught up.
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
         "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize")
COPIES = "Memcpy"  # the GPU's copy events: "Memcpy DtoD (Device -> Device)", "Memcpy DtoH ..."


def table(entries, time: str, steps: int, top: int) -> list[dict]:
    """The ``top`` entries by ``time`` (an attribute in microseconds), per step."""
    rows = sorted(entries, key=lambda e: -getattr(e, time))[:top]
    return [{"name": e.key, "calls": round(e.count / steps, 2),
             "ms": round(getattr(e, time) / steps / 1e3, 3)} for e in rows]


def measure(name: str, device: str, seq_len: int, steps: int, tiny: bool, top: int) -> dict:
    """One reader's step, timed, then profiled."""
    s = setup(name, "smoke" if tiny else "full", overrides(device, tiny), 2_000 if tiny else None)
    batch, dev = s.batch(seq_len), s.device

    def step():
        train_step(s.model, batch, s.optimizer, s.cfg, dev)
        if s.ema is not None:
            s.ema.update(s.model)

    s.model.train()
    wall = _seconds(step, steps, dev) / steps * 1e3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    events = prof.key_averages()
    ops = [e for e in events if e.device_type == DeviceType.CPU]
    on_gpu = [e for e in events if e.device_type == DeviceType.CUDA]
    kernel = sum(e.self_device_time_total for e in ops) / steps / 1e3
    host = sum(e.self_cpu_time_total for e in ops) / steps / 1e3
    by = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    return {"batch_size": s.cfg.batch_size, "seq_len": seq_len, "bf16": s.cfg.bf16 and
            dev.type == "cuda", "wall_ms": round(wall, 3), "kernel_ms": round(kernel, 3),
            "busy": round(kernel / wall, 3),
            "launches": round(sum(e.count for e in ops if e.key in LAUNCHES) / steps, 1),
            "ops": table(ops, by, steps, top),
            "kernels": table(on_gpu, "self_device_time_total", steps, top),
            "host_ms": round(host, 3), "host_ops": table(ops, "self_cpu_time_total", steps, top),
            "syncs": {e.key: round(e.count / steps, 2) for e in ops
                      if e.key.startswith(SYNCS)},
            "copies": {e.key: round(e.count / steps, 2) for e in on_gpu
                       if e.key.startswith(COPIES)}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="smoke-size readers: checks the script")
    p.add_argument("--models", default="qanet,dynsan,phasecond", help="comma-separated")
    p.add_argument("--seq-len", type=int, default=400, help="context tokens")
    p.add_argument("--steps", type=int, default=5, help="steps timed, then profiled")
    p.add_argument("--top", type=int, default=15, help="operators and kernels listed")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dev = resolve_device(args.device)
    device = device_name(dev)
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"profile_{slug(device)}.json")
    seq_len, steps = (16, 1) if args.tiny else (args.seq_len, args.steps)
    results = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
               "speed_revision": SPEED_REVISION, "tiny": args.tiny, "steps": steps,
               "models": {}}
    for name in args.models.split(","):
        try:
            results["models"][name] = measure(name, args.device, seq_len, steps, args.tiny,
                                              args.top)
        except Exception as e:  # noqa: BLE001 (reported, and the next reader runs)
            results["models"][name] = {"error": f"{type(e).__name__}: {e}",
                                       "traceback": traceback.format_exc(limit=-3)}
        entry = results["models"][name]
        print(name, *(f"{k} {entry[k]}" for k in ("wall_ms", "kernel_ms", "busy", "launches")
                      if k in entry), entry.get("error", ""), flush=True)
        atomic_write_json(out, results)  # after each reader: a command cut short keeps them
    results["complete"] = True
    atomic_write_json(out, results)
    print(out)
    return results


if __name__ == "__main__":
    main()
