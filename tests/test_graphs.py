"""Tests of the training step recorded as CUDA graphs (config ``cuda_graphs``,
:mod:`mrc_lib.graphs`), on the CPU.

A CPU records no CUDA graph, so :class:`Emulated` stands in for the recorder with a graph's
semantics: recording runs nothing, and a replay runs the recorded step again on the
recording's own input tensors, writing its loss into the tensor the recording returned. What is
tested is everything around the recording: warm-ups and recordings per batch shape, the batch
copied into the recording's inputs, the learning rate and the weight average's weight read from
tensors written before each step, the loss copied out, and the fall-back to eager steps.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mrc_lib import bench, records
from mrc_lib import train as engine
from mrc_lib.config import TrainConfig
from mrc_lib.errors import UserError
from mrc_lib.graphs import GraphedStep

LENGTHS = (12, 16, 12, 12, 16, 20, 12)  # context lengths of the steps: three shapes, repeated


class Emulated:
    """A CUDA graph's semantics on the CPU. A graph replays the kernels its recording
    launched, whatever the Python state at the replay: given the ``model``, a replay runs in
    the train or eval modes its modules had when it was recorded (dropout on, say, in a reader
    since put in eval mode)."""

    def __init__(self, model: torch.nn.Module | None = None):
        self.modules = [] if model is None else list(model.modules())
        self.released = 0

    def warm_up(self, fn):
        return fn()

    def release(self):
        self.released += 1

    def record(self, fn):
        loss, recorded = torch.zeros(()), [m.training for m in self.modules]

        def replay():
            now = [m.training for m in self.modules]
            set_modes(self.modules, recorded)
            loss.copy_(fn())
            set_modes(self.modules, now)

        return replay, loss


def set_modes(modules: list[torch.nn.Module], modes: list[bool]) -> None:
    for m, training in zip(modules, modes):
        m.training = training


class Refusing(Emulated):
    """A recorder torch refuses as it refuses an operation that cannot be captured: the
    operation's error, then the recording's end reporting it invalidated."""

    def record(self, fn):
        try:
            raise RuntimeError("operation not permitted when stream is capturing")
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during "
                               "capture") from None


OOM = "CUDA out of memory. Tried to allocate 4.38 GiB."


class OutOfMemory(Emulated):
    """A recorder whose pool has grown until the device is full: after ``recordings``
    recordings, the next warm-up (or, with ``when="record"``, the next recording) runs out of
    memory before the optimizer steps, as a forward or backward does."""

    def __init__(self, recordings: int, when: str):
        super().__init__()
        self.recordings, self.when, self.calls = recordings, when, 0

    def warm_up(self, fn):
        if self.when == "warm_up" and self.calls >= self.recordings:
            raise torch.OutOfMemoryError(OOM)
        return fn()

    def record(self, fn):
        self.calls += 1
        if self.when == "record" and self.calls > self.recordings:
            raise torch.OutOfMemoryError(OOM)
        return super().record(fn)


def train(recorder=None):
    """QANet (smoke size, dropout and stochastic depth on) trained a step per length of
    :data:`LENGTHS`, with a warm-up that changes the learning rate at every step and a weight
    average; through a :class:`GraphedStep` with ``recorder``, else eagerly. Both use the
    fused Adam reading its rate from a tensor, as recorded steps do (the CPU's reads it as
    CUDA's does): what differs is the recording alone."""
    s = bench.setup("qanet", "smoke", ["device=cpu", "batch_size=2", "warmup_steps=5",
                                       "ema_decay=0.99"], vocab_size=2_000)
    cfg, model = s.cfg, s.model
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad],
                                 lr=cfg.lr, fused=True)
    schedule = engine.LRSchedule(optimizer, cfg, s.device)
    step = engine.TrainingStep(model, model, optimizer, s.ema, cfg, s.device)
    if recorder is not None:
        step.graphs = GraphedStep(step._recorded, s.device, recorder)
    torch.manual_seed(1)
    model.train()
    losses = []
    for k, n in enumerate(LENGTHS):
        losses.append(step(bench.synthetic_batch(s.vocab, 2, n, seed=k)))
        schedule.step()
    return {"losses": losses, "params": [p.detach() for p in model.parameters()],
            "average": list(s.ema.shadow.values()), "graphs": step.graphs,
            "lr": optimizer.param_groups[0]["lr"]}


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_replayed_steps_train_exactly_as_eager_steps():
    eager, graphs = train(), train(Emulated())
    for key in ("losses", "params", "average"):
        assert same(eager[key], graphs[key]), key
    # 12: warm-up, 16: warm-up, 12: recorded, 12, 16: recorded, 20: warm-up, 12
    run = graphs["graphs"]
    assert dict(run.counts) == {"eager": 3, "recorded": 2, "replayed": 4}
    assert len(run.recordings) == 2 and run.failed is None


def test_a_recording_torch_refuses_leaves_the_run_eager():
    eager, refused = train(), train(Refusing())
    for key in ("losses", "params", "average"):
        assert same(eager[key], refused[key]), key
    run = refused["graphs"]
    assert run.failed == ("RuntimeError: operation not permitted when stream is capturing "
                          "(RuntimeError: CUDA error: operation failed due to a previous error "
                          "during capture)")
    assert dict(run.counts) == {"eager": len(LENGTHS)} and not run.recordings


@pytest.mark.parametrize("when", ["warm_up", "record"])
def test_running_out_of_memory_drops_the_recordings_and_the_run_goes_on_eagerly(when):
    # 12: warm-up, 16: warm-up, 12: recorded, 12, 16: out of memory (record) or recorded, 20:
    # out of memory (warm_up), 12: eager
    eager, short = train(), train(OutOfMemory(recordings=1 if when == "record" else 2, when=when))
    for key in ("losses", "params", "average"):
        assert same(eager[key], short[key]), key
    run = short["graphs"]
    assert run.failed == f"OutOfMemoryError: {OOM}"
    assert not run.recordings and run.recorder.released == 1
    replayed = {"record": 2, "warm_up": 3}[when]
    assert dict(run.counts) == {"eager": len(LENGTHS) - replayed,
                                "recorded": replayed - 1, "replayed": replayed}


def test_cuda_graphs_is_how_a_run_computes_not_what():
    plain = TrainConfig(model="qanet", optimizer="adam")
    graphs = TrainConfig(model="qanet", optimizer="adam", cuda_graphs=True, pad_multiple=16)
    assert records.config_hash(plain.to_dict()) == records.config_hash(graphs.to_dict())
    assert not engine.graphed(graphs, torch.device("cpu"))  # CUDA only, as bf16
    assert engine.graphed(graphs, torch.device("cuda"))


def test_cuda_graphs_records_the_eager_step_not_a_compiled_one():
    with pytest.raises(UserError, match="cuda_graphs=true records the eager step"):
        TrainConfig(model="qanet", cuda_graphs=True, compile=True)


def test_the_rate_on_the_device_is_written_in_place():
    cfg = TrainConfig(model="qanet", lr=0.01, warmup_steps=4)
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=cfg.lr, fused=True)
    schedule = engine.LRSchedule(optimizer, cfg, torch.device("cpu"))
    rate = optimizer.param_groups[0]["lr"]
    schedule.step()
    assert optimizer.param_groups[0]["lr"] is rate  # where a recording reads it
    assert rate.dtype == torch.float32 and rate.item() == pytest.approx(schedule.lr)
    # A checkpoint of an eager run brings a Python float back: the rate is a tensor again.
    saved = {"optimizer": optimizer.state_dict(), "schedule": schedule.state_dict()}
    saved["optimizer"]["param_groups"][0]["lr"] = 0.5
    optimizer.load_state_dict(saved["optimizer"])
    schedule.load_state_dict(saved["schedule"])
    assert isinstance(optimizer.param_groups[0]["lr"], torch.Tensor)
    assert optimizer.param_groups[0]["lr"].item() == pytest.approx(schedule.lr)


class Inert(Emulated):
    """A recording whose replay trains nothing: what a replay that missed its inputs, rate
    or weights would come close to."""

    def record(self, fn):
        return (lambda: None), torch.zeros(())


@pytest.mark.parametrize("recorder, expected", [(Emulated, 0.0), (Inert, 1.0)])
def test_the_bring_up_tells_whether_a_replay_trains_as_the_eager_step(recorder, expected):
    from tests.test_cli import load_bringup

    s = bench.setup("qanet", "smoke", ["device=cpu", "batch_size=2", "ema_decay=0.99"],
                    vocab_size=2_000)
    optimizer = torch.optim.Adam([p for p in s.model.parameters() if p.requires_grad],
                                 lr=s.cfg.lr, fused=True)
    step = engine.TrainingStep(s.model, s.model, optimizer, s.ema, s.cfg, s.device)
    step.graphs = GraphedStep(step._recorded, s.device, recorder(s.model))
    s.model.train()
    batch = bench.synthetic_batch(s.vocab, 2, 12)
    step(batch), step(batch)  # the warm-up, then the recording
    s.model.eval()  # as the bring-up's inference timing leaves it: agreement trains
    before = [p.detach().clone() for p in s.model.parameters()]
    assert load_bringup().agreement(step, batch) == expected
    assert all(torch.equal(a, b) for a, b in zip(before, s.model.parameters()))  # restored


class HostReads(TorchDispatchMode):
    """The operations of a step that a CUDA graph cannot record: a value read back to the host
    (``.item()``, a tensor's truth, a data-dependent shape) or a tensor made from Python data
    (an index list, ``torch.tensor``), which on a GPU is copied from the host at every step."""

    NAMES = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero",
             "aten::masked_select", "aten::_unique2", "aten::lift_fresh"}

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.NAMES:
            self.found.append(func._schema.name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", bench.full_readers())
def test_no_readers_step_reads_back_or_copies_from_the_host(name):
    s = bench.setup(name, "smoke", ["device=cpu", "batch_size=2"], vocab_size=2_000)
    optimizer = s.optimizer if s.cfg.optimizer == "adadelta" else torch.optim.Adam(
        [p for p in s.model.parameters() if p.requires_grad], fused=True)  # as on CUDA
    step = engine.TrainingStep(s.model, s.model, optimizer, s.ema, s.cfg, s.device)
    batch = bench.synthetic_batch(s.vocab, 2, 24)
    s.model.train()
    step(batch)  # the first step builds the optimizer's state
    with HostReads() as reads:
        step(batch)
    assert reads.found == []
