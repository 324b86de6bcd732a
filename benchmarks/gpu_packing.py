"""How many training processes to pack onto one GPU: the summed training speed of N concurrent
processes of each reader, for each N.

    python benchmarks/gpu_packing.py                                # bidaf,qanet; N = 1,2,4,8
    python benchmarks/gpu_packing.py --models qanet --parallel 1,3,6 --seconds 30
    python benchmarks/gpu_packing.py --device cpu --tiny            # the script's own check (CI)

The first H100 bring-up (``benchmarks/results/gpu_nvidia_h100_80gb_hbm3.json``) found the
readers bound by per-step overhead, not by the GPU: QANet trained no faster at 140 context
tokens than at 400. One process then leaves the GPU mostly idle, and ``queue run --parallel N``
runs N of them side by side. This script measures what N buys. For each reader and each N it
starts N processes; each builds the reader at its full profile, takes warm-up steps of the
trainer's ``train_step`` (and the weight average's update) on a synthetic batch the size of
SQuAD's (:mod:`mrc_lib.bench`, ``--seq-len`` context tokens), waits until all N are ready, then
trains for ``--seconds``. Their examples per second, summed, is the packed speed; a process
that fails (out of memory, say) ends that reader's series.

The result goes to ``benchmarks/results/packing_<device>.json`` (or ``--out``), rewritten after
each measurement: per reader and N the summed and per-process speed and the peak memory; per
reader ``best_parallel``, the smallest N within 5% of its fastest; and
``recommended_parallel``, the N with the highest geometric mean over the readers of the speed
relative to that reader's fastest, which ``queue run --parallel auto`` uses on that device.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mrc_lib.bench import WARMUP_STEPS, setup  # noqa: E402
from mrc_lib.train import (  # noqa: E402
    device_name,
    peak_memory_bytes,
    resolve_device,
    train_step,
)
from mrc_lib.utils import atomic_write_json, slug  # noqa: E402

NEAR_BEST = 0.95  # best_parallel: the smallest N at least this fraction of the fastest


def worker(name: str, device: str, seq_len: int, seconds: float, tiny: bool) -> dict:
    """One process of a measurement: warm up, say ``ready``, wait for ``go`` on stdin, train
    for ``seconds``; returns its steps, time and peak memory."""
    overrides = [f"device={device}"] + (["batch_size=2"] if tiny else [])
    s = setup(name, "smoke" if tiny else "full", overrides, 2_000 if tiny else None)
    s.model.train()
    batch = s.batch(seq_len)

    def step():
        train_step(s.model, batch, s.optimizer, s.cfg, s.device)
        if s.ema is not None:
            s.ema.update(s.model)

    def sync():
        if s.device.type == "cuda":
            torch.cuda.synchronize(s.device)

    for _ in range(WARMUP_STEPS):
        step()
    sync()
    print("ready", flush=True)
    sys.stdin.readline()
    steps, tic = 0, time.perf_counter()
    while time.perf_counter() - tic < seconds:
        step()
        steps += 1
    sync()
    elapsed = time.perf_counter() - tic
    return {"steps": steps, "seconds": elapsed, "batch_size": s.cfg.batch_size,
            "peak_memory_bytes": peak_memory_bytes(s.device)}


def packed(name: str, n: int, args) -> dict:
    """Start ``n`` workers of ``name``, release them together and sum their speeds."""
    command = [sys.executable, __file__, "--worker", "--models", name, "--device", args.device,
               "--seq-len", str(args.seq_len), "--seconds", str(args.seconds)]
    logs = [tempfile.TemporaryFile("w+") for _ in range(n)]
    procs = [subprocess.Popen(command + (["--tiny"] if args.tiny else []), text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
             for log in logs]

    def failure(k: int) -> RuntimeError:
        procs[k].wait()
        logs[k].seek(0)
        lines = logs[k].read().strip().splitlines() or [f"exit {procs[k].returncode}"]
        return RuntimeError(lines[-1])

    try:
        for k, proc in enumerate(procs):  # every worker warms up before any is timed
            if proc.stdout.readline().strip() != "ready":
                raise failure(k)
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = []
        for k, proc in enumerate(procs):
            out, _ = proc.communicate()
            if proc.returncode != 0:
                raise failure(k)
            results.append(json.loads(out))
    finally:
        for proc, log in zip(procs, logs):
            if proc.poll() is None:
                proc.kill()
            log.close()
    rates = [r["steps"] * r["batch_size"] / r["seconds"] for r in results]
    return {"train_examples_per_s": round(sum(rates), 1),
            "per_process_examples_per_s": round(sum(rates) / n, 1),
            "peak_memory_bytes": max(r["peak_memory_bytes"] for r in results)}


def choose(models: dict) -> tuple[dict, int | None]:
    """Each reader's ``best_parallel`` and the N with the best geometric mean of the relative
    speed over the readers measured at every N."""
    best, relative = {}, {}
    for name, series in models.items():
        speeds = {int(n): m["train_examples_per_s"] for n, m in series.items() if "error" not in m}
        if not speeds:
            continue
        top = max(speeds.values())
        best[name] = min(n for n, s in speeds.items() if s >= NEAR_BEST * top)
        relative[name] = {n: s / top for n, s in speeds.items()}
    common = set.intersection(*(set(r) for r in relative.values())) if relative else set()
    if not common:
        return best, None
    return best, max(sorted(common),
                     key=lambda n: math.prod(r[n] for r in relative.values()))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="smoke-size readers: checks the script")
    p.add_argument("--models", default="bidaf,qanet", help="comma-separated readers")
    p.add_argument("--parallel", default="1,2,4,8", help="process counts, comma-separated")
    p.add_argument("--seq-len", type=int, default=140, help="context tokens of the batch")
    p.add_argument("--seconds", type=float, default=10.0, help="timed training per process")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args.seq_len = 16
    if args.worker:
        print(json.dumps(worker(args.models, args.device, args.seq_len, args.seconds,
                                args.tiny)))
        return {}
    device = device_name(resolve_device(args.device))
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"packing_{slug(device)}.json")
    results = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
               "tiny": args.tiny, "seq_len": args.seq_len, "seconds": args.seconds,
               "models": {}}
    for name in args.models.split(","):
        series = results["models"][name] = {}
        for n in (int(s) for s in args.parallel.split(",")):
            try:
                series[str(n)] = packed(name, n, args)
            except RuntimeError as e:
                series[str(n)] = {"error": str(e)}
            print(name, n, series[str(n)], flush=True)
            results["best_parallel"], results["recommended_parallel"] = choose(
                results["models"])
            atomic_write_json(out, results)  # after each measurement: a cut command keeps them
            if "error" in series[str(n)]:
                break
    results["complete"] = True  # a command cut short leaves the file without it
    atomic_write_json(out, results)
    print(out)
    return results


if __name__ == "__main__":
    main()
