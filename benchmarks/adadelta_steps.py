"""The steps Adadelta took in a training run, read from its checkpoint's optimizer state, beside
the step the same settings settle at when the gradients are pure noise.

    python benchmarks/adadelta_steps.py          # BiDAF in the queue's carry-over, runs/inbox
    python benchmarks/adadelta_steps.py --inbox DIR --run 01_bidaf_qanet/bidaf
    python benchmarks/adadelta_steps.py --checkpoint runs/x/checkpoint.pt [--record R.json]

Adadelta (Zeiler, 2012) keeps for each weight running means (decay ``ρ``) of the squared
gradient, ``E[g²]``, and of its own squared step before the learning rate, ``E[Δx²]``, and steps
by ``Δθ = −lr · sqrt(E[Δx²] + ε) / sqrt(E[g²] + ε) · g``. So ``lr · sqrt(E[Δx²])`` is the
root-mean-square step a weight has taken over its last ``1 / (1 − ρ)`` steps or so. For each
trainable tensor this writes

* ``rms_step``: ``lr · sqrt(mean E[Δx²])`` over the tensor's weights;
* ``median_step``: ``lr · sqrt(median E[Δx²])``;
* ``rms_grad``: ``sqrt(mean E[g²])``, the size of its recent gradients;

the 10th, 50th and 90th percentiles of ``lr · sqrt(E[Δx²])`` over all weights, and
``noise_steady_step``: the ``rms_step`` that ``torch.optim.Adadelta`` with the run's ``lr``,
``ρ`` and ``ε`` reaches on independent N(0, 1) gradients (any scale gives the same), after
``--noise-steps`` steps. Results go to ``benchmarks/results/adadelta_steps_bidaf.json`` (or
``--out``), with the run's step, config hash, device and commit from its record.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mrc_lib.checkpoint import load_checkpoint  # noqa: E402
from mrc_lib.errors import UserError  # noqa: E402
from mrc_lib.records import config_hash  # noqa: E402
from mrc_lib.utils import atomic_write_json  # noqa: E402

PERCENTILES = (10, 50, 90)


def step_sizes(checkpoint: dict, where: str = "checkpoint") -> dict:
    """Per-tensor and overall step sizes of a trainer checkpoint whose optimizer is Adadelta.
    Its ``ema`` shadow (or, without one, its ``model``) names the trainable tensors in the
    optimizer's order."""
    cfg = checkpoint["config"]
    if cfg["optimizer"] != "adadelta":
        raise UserError(f"{where}: optimizer is {cfg['optimizer']!r}, not adadelta")
    lr = checkpoint["optimizer"]["param_groups"][0]["lr"]
    state = checkpoint["optimizer"]["state"]
    names = list((checkpoint.get("ema") or {}).get("shadow") or checkpoint["model"])
    if len(names) != len(state):
        raise UserError(f"{where}: {len(state)} optimizer states for {len(names)} named tensors")
    tensors, deltas = [], []
    for name, s in zip(names, (state[i] for i in sorted(state))):
        delta, grad2 = s["acc_delta"].double().flatten(), s["square_avg"].double().flatten()
        deltas.append(delta)
        tensors.append({"name": name, "weights": delta.numel(),
                        "rms_step": lr * delta.mean().sqrt().item(),
                        "median_step": lr * delta.median().sqrt().item(),
                        "rms_grad": grad2.mean().sqrt().item()})
    every = torch.cat(deltas)
    q = np.percentile(every.numpy(), PERCENTILES)
    return {"optimizer": {"lr": lr, "rho": cfg["rho"], "eps": cfg["eps"]},
            "step": int(next(iter(state.values()))["step"]),
            "config_hash": config_hash(cfg),
            "overall": {"weights": len(every), "rms_step": lr * every.mean().sqrt().item(),
                        **{f"p{p}_step": lr * float(np.sqrt(v)) for p, v in zip(PERCENTILES, q)}},
            "tensors": tensors}


def noise_steady_step(lr: float, rho: float, eps: float, steps: int = 5000,
                      weights: int = 4096, seed: int = 0) -> float:
    """``lr · sqrt(mean E[Δx²])`` of ``torch.optim.Adadelta`` after ``steps`` steps on
    independent N(0, 1) gradients."""
    gen = torch.Generator().manual_seed(seed)
    theta = torch.zeros(weights, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.Adadelta([theta], lr=lr, rho=rho, eps=eps)
    for _ in range(steps):
        theta.grad = torch.randn(weights, generator=gen, dtype=torch.float64)
        optimizer.step()
    return lr * optimizer.state[theta]["acc_delta"].mean().sqrt().item()


def from_inbox(inbox: Path, run: str, folder: Path) -> tuple[Path, Path | None]:
    """Unpack the bundles under a queue inbox into ``folder`` (a new one); the run's
    checkpoint and record."""
    from mrc_lib.queue import restore

    restore(folder, inbox, log=lambda line: None)
    checkpoint, record = folder / run / "checkpoint.pt", folder / "records" / f"{run}.json"
    if not checkpoint.exists():
        raise UserError(f"{inbox}: no checkpoint of {run} in this inbox")
    return checkpoint, record if record.exists() else None


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--inbox", default=str(ROOT / "runs" / "inbox"),
                   help="a queue inbox (the bundles of a GPU session) holding the run")
    p.add_argument("--run", default="01_bidaf_qanet/bidaf", help="the queue run (CHAPTER/RUN)")
    p.add_argument("--checkpoint", help="a trainer checkpoint instead of --inbox/--run")
    p.add_argument("--record", help="the run's record, for its name, device and commit")
    p.add_argument("--noise-steps", type=int, default=5000)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"
                                        / "adadelta_steps_bidaf.json"))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.checkpoint:
            checkpoint, record = Path(args.checkpoint), args.record and Path(args.record)
        else:
            checkpoint, record = from_inbox(Path(args.inbox), args.run, Path(tmp) / "out")
            record = Path(args.record) if args.record else record
        results = step_sizes(load_checkpoint(checkpoint), str(checkpoint))
        meta = json.loads(record.read_text(encoding="utf-8")) if record else {}
    named = "chapter" in meta and "run" in meta   # a run record names its run
    results = {"run": f"{meta['chapter']}/{meta['run']}" if named else args.checkpoint or args.run,
               **{k: meta.get(k) for k in ("device", "git_commit", "profile")},
               **results}
    opt = results["optimizer"]
    results["noise_steady_step"] = noise_steady_step(opt["lr"], opt["rho"], opt["eps"],
                                                     args.noise_steps)
    results["noise_steps"] = args.noise_steps
    atomic_write_json(Path(args.out), results)
    print(json.dumps({k: v for k, v in results.items() if k != "tensors"}, indent=1))
    print(args.out)
    return results


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
