"""Whether a reader's whole training step can replay as CUDA graphs, checked on the CPU.

    python benchmarks/cudagraph_check.py                    # QANet, DynSAN, PhaseCond; full sizes
    python benchmarks/cudagraph_check.py --models dynsan    # one reader
    python benchmarks/cudagraph_check.py --tiny             # the script's own check (CI)

``compile_mode: cudagraphs`` (``mrc_lib.train.compiled``: torch.compile's ``cudagraphs``
backend) hands each graph that AOT autograd traces, forward and backward, to a check before it
records it as a CUDA graph (``check_for_skip`` in ``torch/_dynamo/backends/cudagraphs.py``).
The check refuses a graph that mutates one of its inputs, that holds a tensor on the CPU or on
two devices, or an operation that cannot be captured (such as reading a tensor's value, or a
shape that depends on one). A refused graph runs its operations one by one, as eager does,
with a warning in the log: the GPU session's ``graphs`` step would then time no CUDA graph at
all, and spend its minutes compiling for nothing.

None of this needs a GPU. The script traces each reader whole, as ``compiled(..., whole=True)``
does (TorchDynamo with symbolic shapes, then AOT autograd: the graphs the backend receives),
with its parameters and a synthetic batch on the ``meta`` device. There a tensor on the CPU can
only be one made apart from the reader's inputs, which on a GPU would stay on the CPU too. For
each graph it records the nodes, the input it mutates (if any), every device other than
``meta`` with the first node on it, and the first operation that cannot be captured; nothing is
computed. It also records the graph's size inputs (SymInts), by which
:func:`mrc_lib.train.cudagraphs_by_size` keys one recording per set of sizes, and any symbolic
size of a tensor input that is not among them (``unkeyed``): there a recording would replay at
other shapes, as torch's own backend, which keys none, did on an H100.

It traces twice: with the trainer's settings (:func:`mrc_lib.train.specialize_floats`,
``specialized``) and with torch's own default (``unspecialized``), under which each Python
float a reader computes with becomes a float64 scalar input on the CPU. A reader is ``ready``
when no graph of the trainer's trace has any of these.

Results go to ``benchmarks/results/cudagraph_check.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.cudagraphs import (
    check_for_mutation_ignore_cuda_graph_managed_tensor,
    get_device_node_mapping,
)
from torch._dynamo.backends.debugging import boxed_nop
from torch._inductor.utils import (
    count_tangents,
    get_first_incompatible_cudagraph_node,
    num_fw_fixed_arguments,
)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mrc_lib.bench import SyntheticVocab, synthetic_batch  # noqa: E402
from mrc_lib.config import resolve_config  # noqa: E402
from mrc_lib.models import build_model  # noqa: E402
from mrc_lib.tasks import get_task  # noqa: E402
from mrc_lib.train import specialize_floats  # noqa: E402
from mrc_lib.utils import atomic_write_json  # noqa: E402

MODELS = "qanet,dynsan,phasecond"  # gpu_session.py's PROFILE_MODELS, which its graphs step times


def check(gm: torch.fx.GraphModule, fixed: int, inputs: list) -> dict:
    """What the cudagraphs backend's check would find in graph ``gm`` (its first ``fixed``
    inputs are the parameters, which it may mutate), traced on the meta device, and the sizes
    of its tensor ``inputs`` by which no recording would be keyed (:func:`unkeyed`)."""
    devices = {str(d): n.name for d, n in get_device_node_mapping(gm).items() if d.type != "meta"}
    unsafe = get_first_incompatible_cudagraph_node(gm)
    return {"nodes": len(gm.graph.nodes),
            "mutation": check_for_mutation_ignore_cuda_graph_managed_tensor(gm, fixed),
            "devices": devices,
            "unsafe": None if unsafe is None else f"{unsafe.name}: {unsafe.target}",
            "sizes": sorted({str(v.node.expr) for v in inputs if isinstance(v, torch.SymInt)}),
            "unkeyed": unkeyed(inputs)}


def unkeyed(inputs: list) -> list[str]:
    """The symbols in the sizes and strides of a graph's tensor ``inputs`` that are none of its
    size inputs (SymInts). :func:`mrc_lib.train.cudagraphs_by_size` records one CUDA graph per
    set of size inputs; a tensor size outside them would replay a recording at other shapes."""
    keys = set().union(*(v.node.expr.free_symbols for v in inputs if isinstance(v, torch.SymInt)))
    found = set()
    for v in inputs:
        if isinstance(v, torch.Tensor):
            for n in (*v.shape, *v.stride()):
                if isinstance(n, torch.SymInt):
                    found |= n.node.expr.free_symbols - keys
    return sorted(map(str, found))


def reader(name: str, seq_len: int, tiny: bool, specialized: bool) -> dict:
    """:func:`trace` of reader ``name`` (the full profile's, or with ``tiny`` the smoke
    profile's) in training mode, with the task's loss, on a synthetic batch."""
    cfg = resolve_config(name, profile="smoke" if tiny else "full", overrides=["device=cpu"])
    vocab = SyntheticVocab.random(size=2_000)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, vocab, **cfg.hparams).to("meta").train()
    batch = {k: v.to("meta") for k, v in
             synthetic_batch(vocab, 2 if tiny else cfg.batch_size, seq_len, seed=0).items()}
    return trace(model, batch, get_task(cfg.task).loss, specialized)


def trace(model: torch.nn.Module, batch: dict, loss_of, specialized: bool) -> dict:
    """One forward of ``model`` on ``batch`` and the backward of ``loss_of(out, batch)``,
    through TorchDynamo (symbolic shapes) and AOT autograd, everything on the meta device:
    :func:`check` of each graph; floats ``specialized`` as the trainer does, or not."""
    graphs = []

    def backend(dynamo_gm, dynamo_inputs):
        """The cudagraphs backend's AOT autograd, with :func:`check` for its recording."""
        def forward(gm, inputs):
            fixed = num_fw_fixed_arguments(len(dynamo_inputs), len(inputs))
            graphs.append({"graph": "forward", **check(gm, fixed, inputs)})
            return boxed_nop(gm, inputs)

        def backward(gm, inputs):
            graphs.append({"graph": "backward", **check(gm, count_tangents(gm), inputs)})
            return boxed_nop(gm, inputs)

        return aot_autograd(fw_compiler=forward, bw_compiler=backward)(dynamo_gm, dynamo_inputs)

    torch._dynamo.reset()
    before = torch._dynamo.config.specialize_float
    if specialized:
        specialize_floats()
    else:
        torch._dynamo.config.specialize_float = False
    try:
        tic = time.perf_counter()
        net = torch.compile(model, backend=backend, dynamic=True)
        loss_of(net(batch), batch).backward()
        seconds = time.perf_counter() - tic
    finally:
        torch._dynamo.config.specialize_float = before
        torch._dynamo.reset()
    ready = all(not (g["mutation"] or g["devices"] or g["unsafe"] or g["unkeyed"])
                for g in graphs)
    return {"ready": ready, "seconds": round(seconds, 1), "graphs": graphs}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=140, help="context tokens")
    p.add_argument("--models", default=MODELS, help="comma-separated")
    p.add_argument("--tiny", action="store_true", help="smoke-size readers: checks the script")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cudagraph_check.json"))
    args = p.parse_args(argv)
    seq_len = 16 if args.tiny else args.seq_len
    results = {"what": "each reader's whole training step traced on the meta device, checked as "
               "torch.compile's cudagraphs backend checks each graph before recording it",
               "torch": torch.__version__, "tiny": args.tiny, "seq_len": seq_len, "models": {}}
    for name in args.models.split(","):
        results["models"][name] = {
            "specialized": reader(name, seq_len, args.tiny, specialized=True),
            "unspecialized": reader(name, seq_len, args.tiny, specialized=False)}
        print(name, {k: v["ready"] for k, v in results["models"][name].items()}, flush=True)
        atomic_write_json(args.out, results)
    print(args.out)
    return results


if __name__ == "__main__":
    main()
