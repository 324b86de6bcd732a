"""The trainer's whole step as CUDA graphs (config ``cuda_graphs``).

An eager step of the launch-bound readers waits on the host, which launches its thousands of
kernels one by one: at 400 context tokens the GPU was busy for 19% of DynSAN's step, 30-34% of
PhaseCond's and 37-47% of QANet's, on an H100 and an H200
(``benchmarks/results/profile_*.json``). A CUDA graph records a step's kernels once and
replays them all with one launch. :class:`GraphedStep` records a step once per batch shape and
replays it for every later batch of that shape: the whole-network capture of PyTorch's notes on
CUDA graphs ("CUDA semantics"), applied to the trainer's step, which the optimizer's update
and the weight average end.

A recorded step replays what it recorded, so what changes from step to step lives on the
device and is written there before each replay: the batch (copied into the recording's own
input tensors), the learning rate (:class:`mrc_lib.train.LRSchedule` writes it into a tensor
that the ``capturable`` optimizer's step reads) and the weight average's ``1 − d_n``
(:meth:`mrc_lib.train.EMA.average`). Parameters, optimizer state and the average are updated
in place, where the recordings read them. Random draws (dropout, stochastic depth) come from
PyTorch's graph-safe generator: each replay advances its offset as the eager step does, so a
checkpoint's random state resumes a run. And nothing in a reader's step reads a value back to
the host (``benchmarks/cudagraph_check.py`` checks the readers' steps for it).

The first batch of each shape trains eagerly, on the side stream that records (warm-up: cuDNN
and cuBLAS choose their algorithms for the shape outside a recording); the next batch of that
shape is recorded, then replayed like every later one. The recordings share one memory pool:
they replay one after another, and nothing of one outlives its replay but the loss, which is
copied at once. A recording that fails (an operation that cannot be captured, or memory) turns
graphs off for the rest of the run, with torch's reason in :attr:`GraphedStep.failed`, and so
does a warm-up that runs out of memory (the pool holds the memory of every recording so far,
one per batch shape: DecaProp's held 22.9 GiB on the H200 on 2026-11-29): the recordings are
dropped, their pool given back, and the steps run eagerly on the current stream, as without
``cuda_graphs``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from mrc_lib.inference import to_device


def shape_key(batch: dict[str, Tensor]) -> tuple:
    """What a recording is kept by: each input's name, shape and type."""
    return tuple((name, tuple(v.shape), v.dtype) for name, v in sorted(batch.items()))


@dataclass
class Recording:
    """One batch shape's recorded step: its replay, the input tensors it reads and the loss it
    writes."""

    replay: Callable[[], object]
    inputs: dict[str, Tensor]
    loss: Tensor


class CudaRecorder:
    """Where :class:`GraphedStep` warms up and records on a CUDA device: a side stream (PyTorch
    requires warm-up and recording off the default stream) and one memory pool for all
    recordings."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()

    def warm_up(self, fn: Callable[[], Tensor]) -> Tensor:
        """Run ``fn`` on the side stream, ordered after and before the current stream's work
        (also when it fails: what it queued ends before the step that follows)."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        try:
            with torch.cuda.stream(self.stream):
                return fn()
        finally:
            current.wait_stream(self.stream)

    def release(self) -> None:
        """Give the device the memory that dropped recordings held: their pool is freed once
        no recording and no tensor allocated in it is left (the step frees its gradients
        first), here or when the allocator next needs memory. Nothing records after this."""
        self.pool = None
        torch.cuda.empty_cache()

    def record(self, fn: Callable[[], Tensor]) -> tuple[Callable[[], object], Tensor]:
        """Record ``fn`` (nothing runs): its replay and the tensor its output is written to."""
        graph, current = torch.cuda.CUDAGraph(), torch.cuda.current_stream(self.device)
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream,
                                  capture_error_mode="thread_local"):
                out = fn()
        finally:  # a recording whose end fails leaves its stream current
            torch.cuda.set_stream(current)
        return graph.replay, out


class GraphedStep:
    """``step`` (a training step on a batch already on ``device``, returning its loss on the
    device) recorded once per batch shape and replayed.

    Call it with a batch on the host (or on the device) for one training step; it returns the
    loss, on the device. :attr:`counts` counts the steps run ``eager`` (warm-ups, and every
    step after a failure), ``recorded`` and ``replayed`` (a recorded step is replayed too).
    ``recorder`` warms up, records and gives memory back (:class:`CudaRecorder` by default;
    a test can stand in for CUDA).
    """

    def __init__(self, step: Callable[[dict[str, Tensor]], Tensor], device: torch.device,
                 recorder=None):
        self.step, self.device = step, device
        self.recorder = recorder or CudaRecorder(device)
        self.recordings: dict[tuple, Recording] = {}
        self.warm: set[tuple] = set()  # the shapes whose warm-up step has run
        self.failed: str | None = None
        self.counts: Counter = Counter()

    def __call__(self, batch: dict[str, Tensor]) -> Tensor:
        key = shape_key(batch)
        recording = self.recordings.get(key)
        if recording is None and key in self.warm and self.failed is None:
            recording = self.record(key, batch)
        elif recording is not None:
            for name, static in recording.inputs.items():
                static.copy_(self.staged(batch[name]), non_blocking=True)
        if recording is None:
            return self.eager(key, batch)
        recording.replay()
        self.counts["replayed"] += 1
        return recording.loss.clone()  # the next replay of any recording may overwrite it

    def staged(self, v: Tensor) -> Tensor:
        """``v``, in pinned memory where it goes from the host to a GPU: a copy from pageable
        memory waits for the GPU's queue to drain first, and the host, no longer launching
        each kernel, would then wait for every replay before preparing the next batch."""
        return v.pin_memory() if v.device.type == "cpu" and self.device.type == "cuda" else v

    def eager(self, key: tuple, batch: dict[str, Tensor]) -> Tensor:
        """A step without a recording: the shape's warm-up while graphs are on, else a step
        on the current stream."""
        self.counts["eager"] += 1
        if self.failed is None:
            try:
                loss = self.recorder.warm_up(lambda: self.step(to_device(batch, self.device)))
            except torch.OutOfMemoryError as e:  # the optimizer has not stepped: step again
                self.turn_off(reason(e))
            else:
                self.warm.add(key)
                return loss
        return self.step(to_device(batch, self.device))

    def record(self, key: tuple, batch: dict[str, Tensor]) -> Recording | None:
        """Record the step on ``batch``'s shape, its inputs holding ``batch`` (the replay that
        follows trains on it); ``None`` if torch refuses, with :attr:`failed` saying why."""
        inputs = to_device(batch, self.device, copy=True)  # outside the pool, kept with it
        try:
            replay, loss = self.recorder.record(lambda: self.step(inputs))
        except Exception as e:  # noqa: BLE001 (named in failed; the run goes on eagerly)
            self.turn_off(reason(e))
            return None
        self.counts["recorded"] += 1
        self.recordings[key] = Recording(replay, inputs, loss)
        return self.recordings[key]

    def turn_off(self, why: str) -> None:
        """Graphs off for the rest of the run, ``why`` in :attr:`failed`: the recordings,
        never replayed again, are dropped and their memory given back."""
        self.failed = why
        self.recordings.clear()
        self.recorder.release()


def reason(e: BaseException) -> str:
    """The first line of ``e``, after that of the error it was raised in handling (a failed
    recording's own error, which ending the recording then reports as invalidated)."""
    def line(x: BaseException) -> str:
        return (f"{type(x).__name__}: {x}".strip().splitlines() or [""])[0]

    return line(e) if e.__context__ is None else f"{line(e.__context__)} ({line(e)})"
