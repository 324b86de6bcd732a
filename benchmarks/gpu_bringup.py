"""GPU bring-up: every registered reader forward and backward on the device, and its speed.

    python benchmarks/gpu_bringup.py                      # CUDA, full-profile sizes
    python benchmarks/gpu_bringup.py --compile            # also through torch.compile
    python benchmarks/gpu_bringup.py --compile --compile-mode reduce-overhead  # CUDA graphs
    python benchmarks/gpu_bringup.py --compile --whole ...  # the whole reader, not its blocks
    python benchmarks/gpu_bringup.py --compile --compile-mode cudagraphs --whole  # CUDA graphs
                                                          # of the traced step, no inductor
    python benchmarks/gpu_bringup.py --fp32               # the bf16 readers in full precision
    python benchmarks/gpu_bringup.py --cuda-graphs        # each step recorded as CUDA graphs
    python benchmarks/gpu_bringup.py --device cpu --tiny  # the script's own check (CI)

For each reader of :data:`mrc_lib.models.MODELS` that the full profile configures, at its full
profile's hyperparameters, batch size and precision (bf16 autocast where the profile sets
``bf16``; the RNN readers whose profile turns it off run in TF32), on synthetic batches the size
of SQuAD's (:mod:`mrc_lib.bench`):

* one training step (the trainer's ``train_step``: forward, loss, backward, clipping, optimizer),
  its time (``first_step_seconds``: with ``--compile``, mostly compilation, for each length) and
  a check that the loss and every gradient are finite;
* training and inference examples per second after warm-up, at each ``--seq-len`` (context
  tokens; the first one gives the epoch estimate: contexts are padded to a batch's longest, so
  400 is an upper bound and the mean SQuAD context, about 140 tokens, a lower one);
* seconds per SQuAD v1.1 training epoch (87,599 questions) at that rate;
* peak memory (CUDA allocator; the process's peak RSS on CPU).

A reader that fails is reported with its error and the others still run. The result goes to
``benchmarks/results/gpu_<device>.json`` (or ``--out``), rewritten after each reader.
``--resume`` goes on with a file that a cut command left: the readers it holds under the same
settings, without an error and with their current config hash, are kept, and only the others
are measured (a GPU session's compile step, cut after QANet, compiles DynSAN next time).
``--whole`` compiles a reader that names repeated blocks to compile (``compile_regions``: QANet,
DynSAN) whole, as config ``compile_whole`` does, and times training alone (the trainer
evaluates the reader itself, not the compiled whole). A reader is entered as cut
(:data:`CUT`) before it is measured, and a SIGTERM (a GPU session's step running out of time)
adds the seconds it had; ``--resume`` measures a cut reader again, except one compiled whole
that had :data:`WHOLE_FINAL_SECONDS`: so long a compilation is the finding.
Under a CUDA graph mode (``reduce-overhead``, ``cudagraphs``) on a GPU, a graph that torch
refuses to record is the reader's error, with torch's reason, rather than a rate of graphs run
eagerly (``benchmarks/cudagraph_check.py`` makes the same checks on the CPU).
``--fp32`` measures the readers whose profile sets ``bf16`` in full precision instead (config
``bf16: false``: TF32 matrix products, no autocast): an eager step of QANet or DynSAN waits on
its launches, and autocast adds a cast kernel before each matrix product and convolution whose
input or weight is float32 (``benchmarks/op_counts.py`` counts them, ``bf16_casts``), which
full precision does without. Its entries have the config hash of ``bf16: false``.
``--cuda-graphs`` measures the readers with their step recorded once per batch shape and
replayed as CUDA graphs (config ``cuda_graphs``,
:mod:`mrc_lib.graphs`): no torch.compile, nothing traced, every kernel of the step (the
optimizer's and the weight average's too) in one launch. A recording torch refuses is the
reader's error. Each entry also says how a replay agrees with the eager step from the same
state (``agreement``, :func:`agreement`), and its config hash is the plain bring-up's
(``cuda_graphs`` changes how a step is computed, not what).
Under ``--fp32`` and ``--cuda-graphs`` each entry also holds the reader as the plain bring-up
measures it (its profile's precision, eager), at the same lengths, measured just before in the
same process (``plain_speed``): the eager rates of one reader on two H200 sessions' machines
differed by more than its precisions do, so only a pair of one process says which way is
faster.
``--tiny`` uses the smoke profile's shrunk readers, batches of 2 and one timed step: it checks
the script, not the speed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
import torch._inductor.config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mrc_lib import records  # noqa: E402
from mrc_lib.bench import (  # noqa: E402
    AGREEMENT_REVISION,
    CUT,
    SPEED_REVISION,
    SQUAD_TRAIN_EXAMPLES,
    WHOLE_FINAL_SECONDS,
    full_readers,
    overrides,
    reader_hash,
    same_code,
    setup,
    time_steps,
)
from mrc_lib.config import CHOICES, resolve_config  # noqa: E402
from mrc_lib.inference import bf16_autocast  # noqa: E402
from mrc_lib.train import (  # noqa: E402
    COMPILE_REVISION,
    GRAPH_MODES,
    TrainingStep,
    compiled,
    count_parameters,
    device_name,
    peak_memory_bytes,
    resolve_device,
)
from mrc_lib.utils import atomic_write_json, slug  # noqa: E402


def speed(step: TrainingStep, batch, steps: int, infer: bool = True) -> dict:
    """A checked training step on ``batch``, then training and (with ``infer``) inference
    examples per second and the seconds per SQuAD epoch at that rate."""
    step.model.train()
    tic = time.perf_counter()
    finite = bool(torch.isfinite(step(batch)))  # waits for it; with cuda_graphs, eager
    first_step = time.perf_counter() - tic  # with torch.compile: the compilation
    grads = [p.grad for p in step.model.parameters() if p.grad is not None]
    if not finite or not all(torch.isfinite(g).all() for g in grads):
        raise FloatingPointError(f"non-finite loss or gradient at {batch['c_words'].shape[1]} "
                                 "tokens")
    train_s, infer_s = time_steps(step, batch, steps, infer=infer)
    rate = steps * step.cfg.batch_size / train_s
    return {"first_step_seconds": round(first_step, 2), "train_examples_per_s": round(rate, 1),
            "infer_examples_per_s": None if infer_s is None else
            round(steps * step.cfg.batch_size / infer_s, 1),
            "epoch_seconds": round(SQUAD_TRAIN_EXAMPLES / rate, 1)}


def agreement(step: TrainingStep, batch) -> float:
    """How far a replayed step moves the weights from where the eager step moves them, both
    from the same weights, optimizer state, average and random state (dropout draws the same
    masks): ``‖Δ_replay − Δ_eager‖ / ‖Δ_eager‖`` over all trainable parameters together.
    Rounding (bf16, atomic sums, the kernels' order) gives a small number; a replay that trains
    nothing gives 1, one reading a stale batch, rate or random state a number near it. Both
    steps train: the eager one in train mode, as the replay was recorded (the inference timing
    of :func:`speed` leaves the reader in eval mode, in which a cuDNN RNN has no backward)."""
    model, ema, dev = step.model, step.ema, step.device
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    state = params + [t for st in step.optimizer.state.values() for t in st.values()
                      if isinstance(t, torch.Tensor)] + \
        (list(ema.shadow.values()) if ema is not None else [])
    saved = [t.detach().clone() for t in state]
    cuda = dev.type == "cuda"
    updates = ema.num_updates if ema is not None else 0
    rng = torch.cuda.get_rng_state(dev) if cuda else torch.get_rng_state()

    def restore() -> None:
        with torch.no_grad():
            torch._foreach_copy_(state, saved)
        if ema is not None:
            ema.num_updates = updates
        if cuda:
            torch.cuda.set_rng_state(rng, dev)
        else:
            torch.set_rng_state(rng)

    def moved() -> list[torch.Tensor]:
        return [p.detach() - before for p, before in zip(params, saved)]

    restore()
    step(batch)  # replayed: the batch's shape is recorded
    replay = moved()
    restore()
    step.eager(batch)
    eager = moved()
    restore()
    norm = torch.linalg.vector_norm
    gap = norm(torch.stack([norm((r - e).double()) for r, e in zip(replay, eager)]))
    return (gap / norm(torch.stack([norm(e.double()) for e in eager])).clamp(min=1e-30)).item()


def measure(name: str, device: str, seq_lens: list[int], steps: int, tiny: bool,
            compile_mode: str | None, whole: bool = False, fp32: bool = False,
            cuda_graphs: bool = False) -> dict:
    """One reader's bring-up: a checked training step, then speeds and peak memory; through
    :func:`torch.compile` in ``compile_mode`` (of the ``whole`` reader) unless it is
    ``None``; in full precision with ``fp32``; its step recorded as CUDA graphs with
    ``cuda_graphs``, and then how a replay agrees with the eager step (:func:`agreement`).
    The last two first measure the plain reader in this process (``plain_speed``): sessions'
    machines differ too much for a rate of another session to say which way is faster."""
    beside = None
    if fp32 or cuda_graphs:
        beside = measure(name, device, seq_lens, steps, tiny, None)["speed"]
        gc.collect()  # that reader, before this one's memory peak
    s = setup(name, "smoke" if tiny else "full",
              overrides(device, tiny, compile_mode, whole, fp32, cuda_graphs),
              2_000 if tiny else None)
    cfg, dev, model = s.cfg, s.device, s.model
    net = compiled(model, mode=cfg.compile_mode, whole=cfg.compile_whole) if cfg.compile \
        else model
    step = TrainingStep(net, model, s.optimizer, s.ema, cfg, dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    result = {"batch_size": cfg.batch_size, "bf16": bf16_autocast(cfg.bf16, dev.type),
              "config_hash": records.config_hash(cfg.to_dict()),
              "speed_revision": SPEED_REVISION,
              "params": count_parameters(model), "speed": {}}
    if beside is not None:
        result["plain_speed"] = beside
    # Under CUDA graphs on a GPU, a graph that torch refuses to record (it says why) is an
    # error, not a graph run eagerly and timed as if it were replayed (a CPU records none).
    graphs = bool(cfg.compile) and cfg.compile_mode in GRAPH_MODES and dev.type == "cuda"
    with torch._inductor.config.patch({"triton.cudagraph_or_error": graphs}):
        for k, seq_len in enumerate(seq_lens):
            result["speed"][str(seq_len)] = speed(step, s.batch(seq_len, seed=k), steps,
                                                  infer=not whole)
    if step.graphs is not None:
        recorded = step.graphs
        if recorded.failed:  # its rates are the eager step's
            raise RuntimeError(f"cuda_graphs: {recorded.failed}")
        result["cuda_graphs"] = {**recorded.counts, "shapes": len(recorded.recordings)}
        result["agreement"] = float(f"{agreement(step, s.batch(seq_lens[0], seed=0)):.3g}")
    result["epoch_seconds"] = result["speed"][str(seq_lens[0])]["epoch_seconds"]
    result["peak_memory_bytes"] = peak_memory_bytes(dev)
    return result


SETTINGS = ("device", "torch", "cuda", "compile", "compile_mode", "compile_revision",
            "compile_whole", "fp32", "cuda_graphs", "agreement_revision", "tiny", "seq_lens",
            "steps")  # a file holds the fourth to the tenth only where they apply
# (compile_revision under --compile, agreement_revision under --cuda-graphs, the others when
# true)


def kept(out: Path, results: dict, device: str) -> dict:
    """The readers of a cut file ``out`` to keep: measured under ``results``' settings, without
    an error, with the config hash each has today and today's code (:data:`SPEED_REVISION`),
    and, in full precision or recorded as CUDA graphs, with the plain reader's rates measured
    beside them (``plain_speed``)."""
    if not out.is_file():
        return {}
    earlier = json.loads(out.read_text(encoding="utf-8"))
    if any(earlier.get(key) != results.get(key) for key in SETTINGS):
        return {}
    profile = "smoke" if results["tiny"] else "full"
    keys = overrides(device, results["tiny"], results["compile_mode"],
                     results.get("compile_whole", False), results.get("fp32", False),
                     results.get("cuda_graphs", False))

    def final(name: str, entry: dict) -> bool:
        """Measured with today's config, or compiled whole and cut after long enough."""
        if entry.get("error") == CUT:
            return bool(results.get("compile_whole")) and \
                entry.get("seconds", 0) >= WHOLE_FINAL_SECONDS
        return "error" not in entry and same_code(entry) and \
            entry.get("config_hash") == reader_hash(name, profile, keys) and \
            ("plain_speed" in entry or not (results.get("fp32") or results.get("cuda_graphs")))

    return {name: entry for name, entry in earlier.get("models", {}).items()
            if final(name, entry)}


def default_readers(args) -> list[str]:
    """Every reader the full profile configures; with ``--fp32``, those it runs in bf16 (the
    others' full-precision rate is the plain bring-up's)."""
    if not args.fp32:
        return full_readers()
    return [name for name in full_readers() if resolve_config(name, profile="full").bf16]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="smoke-size readers: checks the script")
    p.add_argument("--compile", action="store_true", help="train and infer via torch.compile")
    p.add_argument("--compile-mode", default="default", choices=CHOICES["compile_mode"],
                   help="torch.compile's mode with --compile (reduce-overhead: CUDA graphs; "
                   "cudagraphs: its cudagraphs backend)")
    p.add_argument("--whole", action="store_true",
                   help="with --compile, compile each reader whole, not its compile_regions")
    p.add_argument("--fp32", action="store_true",
                   help="the readers whose profile sets bf16, in full precision (bf16=false)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="the step recorded as CUDA graphs and replayed (cuda_graphs=true)")
    p.add_argument("--seq-len", default="400,140", help="context lengths, comma-separated")
    p.add_argument("--steps", type=int, default=10, help="timed steps per measurement")
    p.add_argument("--models", default=None, help="comma-separated (default: every reader)")
    p.add_argument("--out", default=None)
    p.add_argument("--resume", action="store_true",
                   help="keep the readers that a cut --out file already holds")
    args = p.parse_args(argv)
    seq_lens = [16] if args.tiny else [int(s) for s in args.seq_len.split(",")]
    steps = 1 if args.tiny else args.steps
    dev = resolve_device(args.device)
    device = device_name(dev)
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"gpu_{slug(device)}.json")
    results = {"device": device, "torch": torch.__version__,
               "cuda": torch.version.cuda, "compile": args.compile,
               "compile_mode": args.compile_mode if args.compile else None, "tiny": args.tiny,
               "seq_lens": seq_lens, "steps": steps, "models": {}}
    if args.compile:
        results["compile_revision"] = COMPILE_REVISION
    if args.compile and args.whole:
        results["compile_whole"] = True
    if args.fp32:
        results["fp32"] = True
    if args.cuda_graphs:
        results["cuda_graphs"] = True
        results["agreement_revision"] = AGREEMENT_REVISION
    if args.resume:
        results["models"] = kept(out, results, args.device)
    measuring = {}  # the reader being measured, and since when

    def cut(signum, frame):
        """SIGTERM: enter the reader being measured as cut, with the seconds it had."""
        if measuring:
            results["models"][measuring["name"]] = {
                "error": CUT, "seconds": round(time.perf_counter() - measuring["tic"], 1)}
            atomic_write_json(out, results)
        os._exit(128 + signum)  # at once: an exception raised here could be swallowed

    previous = signal.signal(signal.SIGTERM, cut)
    try:
        for name in args.models.split(",") if args.models else default_readers(args):
            if name in results["models"]:
                print(name, "kept", flush=True)
                continue
            tic = time.perf_counter()
            measuring.update(name=name, tic=tic)
            # what a command killed during this reader leaves (gpu_session.settle_cut gives it
            # its seconds where a compilation kept the handler below from running)
            results["models"][name] = {"error": CUT, "started": time.time()}
            atomic_write_json(out, results)
            try:
                results["models"][name] = measure(name, args.device, seq_lens, steps,
                                                  args.tiny,
                                                  args.compile_mode if args.compile else None,
                                                  args.compile and args.whole, args.fp32,
                                                  args.cuda_graphs)
            except Exception as e:  # noqa: BLE001 (reported, and the next reader runs)
                results["models"][name] = {"error": f"{type(e).__name__}: {e}",
                                           "traceback": traceback.format_exc(limit=-3)}
            measuring.clear()
            gc.collect()  # the reader and its recordings (a cycle: the step holds its own
            # method) before the next reader's, whose memory peak is measured alone
            results["models"][name]["seconds"] = round(time.perf_counter() - tic, 1)
            print(name, results["models"][name].get("epoch_seconds",
                                                    results["models"][name].get("error")),
                  flush=True)
            atomic_write_json(out, results)  # after each reader: a command cut short keeps them
    finally:
        signal.signal(signal.SIGTERM, previous)
    results["complete"] = True  # a command cut short leaves the file without it
    atomic_write_json(out, results)
    print(out)
    return results


if __name__ == "__main__":
    main()
