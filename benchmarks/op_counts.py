"""ATen operations per training step of every reader: a device-independent count of the
kernels an eager step launches.

    python benchmarks/op_counts.py                  # every reader, full-profile sizes
    python benchmarks/op_counts.py --models bidaf,qanet --seq-len 140
    python benchmarks/op_counts.py --tiny           # the script's own check (CI)

The first H100 bring-up (``benchmarks/results/gpu_nvidia_h100_80gb_hbm3.json``) trained QANet
no faster at 140 context tokens than at 400: its step time is per-step overhead, and in eager
PyTorch that is mostly one kernel launch per operation. This script counts those operations on
the CPU, where no GPU is needed: one forward and backward of the reader (the optimizer and the
weight average are left out, as on CUDA they are fused into a few kernels) on a synthetic
batch of the full profile's batch size, each operation that reaches an ATen kernel counted
once, views and other metadata-only operations apart. A CUDA step launches about the counted
operations (plus bf16 casts, minus what its kernels fuse, such as dropout, plus the copy inside
each out-of-place ``masked_fill``, which ATen makes before filling in place: ``hidden_copies``,
in the H100 profile the ``cudaMemcpyAsync`` calls within the GPU), so the count tracks changes
that cut launches, with one exception: the CPU runs a GRU one time step at a time
(about ten operations per step), where cuDNN runs a whole layer in one call, so the counts of
readers with a GRU (``gru_steps_on_cpu``) are far above what CUDA launches.

A reader whose full profile sets ``bf16`` runs its CUDA forward under bf16 autocast, which adds a
cast kernel wherever a matrix product or convolution meets a float32 input or weight (and
casts back where an operation runs in float32). ``bf16_casts`` counts the casts (``_to_copy``)
of the same forward and backward under the CPU's bf16 autocast, whose lists of operations cast
to bf16 are close to CUDA's: the launches that full precision (``bf16: false``, TF32 matrix
products; ``gpu_bringup.py --fp32`` measures it) does without.

The other cure for launch overhead is ``torch.compile``, which fuses a graph's operations into
a few kernels; how much it can fuse depends on how many graphs it captures. For each reader the
script also traces the training forward and its loss with TorchDynamo (nothing is compiled) and
records the graphs, the breaks between them and the distinct reasons (an LSTM or GRU is left to
cuDNN between graphs; a tensor read as a Python number or a data-dependent shape breaks a
graph, and on a GPU it is also a host synchronisation).
Results go to ``benchmarks/results/op_counts.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mrc_lib.bench import SyntheticVocab, full_readers, synthetic_batch  # noqa: E402
from mrc_lib.config import resolve_config  # noqa: E402
from mrc_lib.models import build_model  # noqa: E402
from mrc_lib.tasks import get_task  # noqa: E402
from mrc_lib.utils import atomic_write_json  # noqa: E402

# Operations that only make a new view of a tensor's memory: no kernel.
VIEWS = {"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "unsqueeze",
         "squeeze", "slice", "select", "narrow", "split", "split_with_sizes", "unbind",
         "as_strided", "alias", "detach", "unfold", "view_as_real", "_reshape_alias"}


class Count(TorchDispatchMode):
    """Counts the ATen operations dispatched under it, by name."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count(name: str, seq_len: int, tiny: bool) -> dict:
    """Kernel-launching operations (and views) of one forward and backward of ``name``."""
    cfg = resolve_config(name, profile="smoke" if tiny else "full", overrides=["device=cpu"])
    batch_size = 2 if tiny else cfg.batch_size
    vocab = SyntheticVocab.random(size=2_000)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, vocab, **cfg.hparams).train()
    loss_of = get_task(cfg.task).loss
    batch = synthetic_batch(vocab, batch_size, seq_len, seed=0)
    ops = step_ops(model, loss_of, batch)
    casts = step_ops(model, loss_of, batch, bf16=True)["_to_copy"] \
        if resolve_config(name, profile="full").bf16 else None
    views = sum(n for op, n in ops.items() if op in VIEWS)
    kernels = collections.Counter({op: n for op, n in ops.items() if op not in VIEWS})
    return {"batch_size": batch_size, "seq_len": seq_len, "ops": sum(kernels.values()),
            "hidden_copies": kernels["masked_fill"], "bf16_casts": casts, "views": views,
            "top": dict(kernels.most_common(8)),
            "gru_steps_on_cpu": any(isinstance(m, torch.nn.GRU) for m in model.modules()),
            **graphs(lambda b: loss_of(model(b), b), batch)}


def step_ops(model, loss_of, batch: dict, bf16: bool = False) -> collections.Counter:
    """The operations of one forward and backward of ``model`` on ``batch``, with ``bf16``
    under the CPU's bf16 autocast (as the trainer's forward on CUDA); a first, uncounted pass
    leaves out first-call work (lazy initialisation)."""
    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(batch)
        loss_of(out, batch).backward()
        model.zero_grad(set_to_none=True)

    step()
    with Count() as counted:
        step()
    return counted.ops


def graphs(forward, batch: dict) -> dict:
    """How ``torch.compile`` would capture the training forward (the reader and the task's
    loss): its graphs, and the distinct reasons it breaks between them (the first line of
    each), from TorchDynamo's trace alone (nothing is compiled)."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(forward)(batch)
    reasons = sorted({str(r.reason).strip().splitlines()[0] for r in explained.break_reasons})
    torch._dynamo.reset()
    return {"graphs": explained.graph_count, "graph_breaks": explained.graph_break_count,
            "break_reasons": reasons}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=140, help="context tokens")
    p.add_argument("--models", default=None, help="comma-separated (default: every reader)")
    p.add_argument("--tiny", action="store_true", help="smoke-size readers: checks the script")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "op_counts.json"))
    args = p.parse_args(argv)
    results = {"what": "ATen operations of one forward and backward, views apart; the graphs "
               "torch.compile would capture of the training forward and its loss",
               "torch": torch.__version__, "tiny": args.tiny, "models": {}}
    for name in args.models.split(",") if args.models else full_readers():
        results["models"][name] = count(name, 16 if args.tiny else args.seq_len, args.tiny)
        print(name, results["models"][name]["ops"], results["models"][name]["graphs"],
              flush=True)
    atomic_write_json(args.out, results)
    print(args.out)
    return results


if __name__ == "__main__":
    main()
