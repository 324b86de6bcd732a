"""The training engine shared by every reader.

One loop trains any reader of :mod:`mrc_lib.models` on any task of :mod:`mrc_lib.tasks` (span
extraction, SQuAD 2.0, cloze, multiple choice), as the papers describe it: minimize the task's
loss with Adam or Adadelta, a learning-rate warm-up (QANet), gradient clipping and an
exponential moving average of the weights, which is what gets evaluated and saved. Every epoch
ends with the task's official evaluation on dev (and on test, where the task's data has one).

A run lives in one directory ``OUT``:

* ``config.json``: the resolved :class:`~mrc_lib.config.TrainConfig`;
* ``log.jsonl``: one JSON line per ``log_every`` steps and per epoch;
* ``checkpoint.pt``: everything needed to resume exactly (trainable weights, averaged weights,
  optimizer, schedule, random-number states, position in the data, history; not the fixed GloVe
  rows, which are rebuilt from the data), written atomically every ``checkpoint_every`` steps,
  at each epoch end (unless ``epoch_checkpoints`` is off) and when a ``deadline`` or a signal
  (SIGTERM, Ctrl-C: :func:`stopped_by_signals`) stops the run, as a manifest and parts of at
  most 15 MiB, packed losslessly to about 0.84 of its size
  (:func:`mrc_lib.checkpoint.save_checkpoint`);
* ``metrics.json``, ``predictions.json`` (``na_prob.json`` for readers with a no-answer head),
  ``model.pt`` (averaged weights) and, for the SQuAD tasks, ``vocab/``: the latest epoch's
  results, enough for :func:`predict_cli`.

Under ``torchrun`` (``WORLD_SIZE > 1``) each process takes every ``world_size``-th batch of the
same deterministic order, gradients are averaged by DistributedDataParallel and only rank 0
evaluates and writes files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
import platform
import resource
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from mrc_lib.checkpoint import (
    PACKED_RATIO,
    PART_BYTES,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    seed_everything,
    set_rng_state,
)
from mrc_lib.config import SPAN_TASKS, TrainConfig, apply_overrides, resolve_config
from mrc_lib.data.dataset import pad_lengths
from mrc_lib.data.vocab import Vocab
from mrc_lib.errors import UserError
from mrc_lib.graphs import GraphedStep
from mrc_lib.inference import autocast, predict_spans, to_device
from mrc_lib.models import build_model, effective_hparams
from mrc_lib.nn.embedding import WordEmbedding
from mrc_lib.nn.rnn import has_rnn_layers
from mrc_lib.records import UNHASHED, json_hash
from mrc_lib.tasks import get_task
from mrc_lib.utils import (
    atomic_path,
    atomic_write_bytes,
    atomic_write_json,
    git_commit,
    on_stop_signals,
)

# Config keys that may differ when a run is resumed; any other change is refused: those that
# change how a run is computed, not what (the keys its record's hash leaves out), and its length.
RESUMABLE_CHANGES = {"epochs", "max_steps", *UNHASHED}


# --- weight averaging and learning-rate schedule -----------------------------------------------


class EMA:
    """Exponential moving average of the trainable weights (BiDAF, QANet).

    After the ``n``-th optimizer step, ``θ̄ ← d_n θ̄ + (1 − d_n) θ`` with
    ``d_n = min(d, (1 + n) / (10 + n))``: TensorFlow's ``ExponentialMovingAverage`` with
    ``num_updates``. The papers give only the decay ``d``, so this is our reading. The plain
    form, ``d_n = d`` (BiDAF's code, ``basic/model.py``), starts the average at the random
    initialization and keeps a share ``d^n`` of it: at QANet's and DynSAN's 0.9999, 76% after
    QANet's first epoch (2,731 steps), so per-epoch dev scores would measure the start, not
    the reader. The two forms differ by less than 1% of the weight after
    ``ln 0.01 / ln d`` steps: 4,603 at 0.999, 46,050 at 0.9999.
    """

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.num_updates = 0
        self.shadow = {name: p.detach().clone() for name, p in model.named_parameters()
                       if p.requires_grad}

    def _params(self, model: nn.Module) -> list[Tensor]:
        params = dict(model.named_parameters())
        return [params[name] for name in self.shadow]

    def update(self, model: nn.Module) -> None:
        self.average(model, self.next_weight())

    def next_weight(self) -> float:
        """Count the next update ``n`` and return its weight ``1 − d_n``."""
        self.num_updates += 1
        n = self.num_updates
        return 1 - min(self.decay, (1 + n) / (10 + n))

    @torch.no_grad()
    def average(self, model: nn.Module, weight: float | Tensor) -> None:
        """``θ̄ + w (θ − θ̄) = d θ̄ + (1 − d) θ`` for ``w = 1 − d``, one fused kernel for all
        tensors. A weight on the device (a 0-dim tensor, written before each replay of a CUDA
        graph: :mod:`mrc_lib.graphs`) is read there, in the same arithmetic."""
        shadow = list(self.shadow.values())
        weights = weight if isinstance(weight, float) else [weight] * len(shadow)
        torch._foreach_lerp_(shadow, self._params(model), weights)

    @contextlib.contextmanager
    def applied(self, model: nn.Module):
        """Load the averaged weights into ``model`` for the duration of the block."""
        params = self._params(model)
        with torch.no_grad():
            backup = [p.detach().clone() for p in params]
            torch._foreach_copy_(params, list(self.shadow.values()))
        try:
            yield model
        finally:
            with torch.no_grad():
                torch._foreach_copy_(params, backup)

    def state_dict(self) -> dict:
        return {"num_updates": self.num_updates, "shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        self.num_updates = state["num_updates"]
        for name, value in state["shadow"].items():
            self.shadow[name].copy_(value)


def averaged(model: nn.Module, ema: EMA | None):
    """The block runs with ``model``'s averaged weights (its own weights without an EMA)."""
    return ema.applied(model) if ema is not None else contextlib.nullcontext(model)


def warmup_factor(k: int, warmup_steps: int, kind: str) -> float:
    """Fraction of the peak learning rate at optimizer step ``k = 1, 2, ...``: ``k / W``
    (``linear``) or ``ln(k + 1) / ln(W + 1)`` (``log``, QANet's inverse-exponential increase),
    and 1 from step ``W`` on."""
    if k >= warmup_steps:
        return 1.0
    if kind == "linear":
        return k / warmup_steps
    return math.log(k + 1) / math.log(warmup_steps + 1)


class LRSchedule:
    """``lr_k = lr · warmup(k) · factor^m``: the warm-up advances with every optimizer step, and
    ``m`` counts the plateaus, runs of ``plateau_patience`` epochs without a better dev score
    (the task's :meth:`~mrc_lib.tasks.Task.score` of ``cfg.plateau_metric``).

    With ``device``, each parameter group's rate is a float32 tensor there, written in place:
    what a CUDA graph of the optimizer's step reads (:mod:`mrc_lib.graphs`). The step then
    computes with the rate rounded to float32 (a relative change of at most 6e-8) where, given
    a Python float, it computes with the float64 rate."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: TrainConfig,
                 device: torch.device | None = None):
        self.optimizer, self.cfg, self.device = optimizer, cfg, device
        self.steps = 0
        self.scale = 1.0
        self.best = -math.inf
        self.bad_epochs = 0
        self._apply()

    @property
    def lr(self) -> float:
        """The learning rate of the next optimizer step."""
        cfg = self.cfg
        return cfg.lr * warmup_factor(self.steps + 1, cfg.warmup_steps, cfg.warmup) * self.scale

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            if self.device is None:
                group["lr"] = self.lr
            elif isinstance(group["lr"], Tensor) and group["lr"].device == self.device:
                group["lr"].fill_(self.lr)
            else:  # the first time, or a rate a checkpoint's optimizer state brought back
                group["lr"] = torch.tensor(self.lr, device=self.device)

    def step(self) -> None:
        """Call after each optimizer step."""
        self.steps += 1
        self._apply()

    def epoch_end(self, score: float) -> None:
        """Call after each evaluation with the dev score."""
        if self.cfg.plateau_factor is None:
            return
        if score > self.best:
            self.best, self.bad_epochs = score, 0
            return
        self.bad_epochs += 1
        if self.bad_epochs >= self.cfg.plateau_patience:
            self.scale *= self.cfg.plateau_factor
            self.bad_epochs = 0
            self._apply()

    def state_dict(self) -> dict:
        return {"steps": self.steps, "scale": self.scale, "best": self.best,
                "bad_epochs": self.bad_epochs}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.scale = state["steps"], state["scale"]
        self.best, self.bad_epochs = state["best"], state["bad_epochs"]
        self._apply()


def graphed(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether training steps replay as CUDA graphs: ``cuda_graphs`` on a CUDA device."""
    return cfg.cuda_graphs and device.type == "cuda"


def build_optimizer(cfg: TrainConfig, model: nn.Module,
                    device: torch.device) -> torch.optim.Optimizer:
    """The optimizer named by ``cfg`` over ``model``'s trainable parameters (Adam fused on
    CUDA). When its steps replay as CUDA graphs (:func:`graphed`) it is ``capturable``: its
    step count and learning rate stay on the device (Adadelta's multi-tensor step reads a
    tensor rate there; its one-tensor step would read it back to the host)."""
    params = [p for p in model.parameters() if p.requires_grad]
    graphs = graphed(cfg, device)
    if cfg.optimizer == "adadelta":
        return torch.optim.Adadelta(params, lr=cfg.lr, rho=cfg.rho, eps=cfg.eps,
                                    weight_decay=cfg.weight_decay, capturable=graphs,
                                    foreach=True if graphs else None)
    adam = torch.optim.Adam if cfg.optimizer == "adam" else torch.optim.AdamW
    return adam(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                fused=device.type == "cuda", capturable=graphs)


# The optimizer options that follow from the device, not from the run (build_optimizer).
DEVICE_OPTIONS = ("capturable", "foreach", "fused")


def on_this_device(state: dict, optimizer: torch.optim.Optimizer) -> dict:
    """``state``, an optimizer's saved state, with ``optimizer``'s :data:`DEVICE_OPTIONS`
    in place of its own: a run checkpointed on a GPU (``capturable`` where its steps replay as
    CUDA graphs) resumes on a CPU, and the other way round. ``load_state_dict`` takes the saved
    groups' options, and places each step count by them (on the device when ``capturable`` or
    ``fused``, else where it was saved)."""
    groups = [{**saved, **{k: group[k] for k in DEVICE_OPTIONS if k in group}}
              for saved, group in zip(state["param_groups"], optimizer.param_groups)]
    return {**state, "param_groups": groups}


# How compiled() traces a reader, as the compiled bring-ups know it (each compiled file records
# it): a change in its tracing raises it, and a GPU session then measures again a compile step
# whose file holds an error of an earlier revision (benchmarks/gpu_session.py), which the
# change may have fixed. 1: torch's own cudagraphs backend, the backward traced under the
# forward's autocast (to 2026-11-27); 2: cudagraphs_by_size, the backward outside autocast.
COMPILE_REVISION = 2


def compiled(model: nn.Module, net: nn.Module | None = None, mode: str = "default",
             whole: bool = False) -> nn.Module:
    """``model`` (run as ``net``, ``model`` itself by default) for training through
    :func:`torch.compile` in ``mode`` (a :data:`mrc_lib.config.CHOICES` ``compile_mode``), with
    symbolic shapes from the first call: lengths change from batch to batch, and one
    compilation serves them all.

    A reader that names its repeated blocks in ``compile_regions`` gets each of those modules
    compiled in place (regional compilation: one graph per kind of block, which its copies
    share, compiled in a fraction of the time of the whole step) and ``net`` is returned as it
    is, unless ``whole`` (config ``compile_whole``); any other reader's ``net`` is compiled
    whole. Mode ``cudagraphs`` is torch.compile's ``cudagraphs`` backend, not a mode of
    inductor (:func:`cudagraphs_by_size`): the graphs that AOT autograd traces replay as CUDA
    graphs, their operations unfused. Python floats are specialized
    (:func:`specialize_floats`) and the backward computes as eager's does
    (:func:`backward_outside_autocast`).
    """
    specialize_floats()
    backward_outside_autocast()
    net = model if net is None else net
    options = {"dynamic": True, "backend": cudagraphs_by_size} if mode == "cudagraphs" else \
        {"dynamic": True, "mode": None if mode == "default" else mode}
    regions = () if whole else getattr(model, "compile_regions", ())
    if not regions:
        return torch.compile(net, **options)
    for module in model.modules():
        if isinstance(module, regions):
            module.compile(**options)
    return net


def cudagraphs_by_size(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """torch.compile's ``cudagraphs`` backend, recording one CUDA graph per set of sizes.

    The backend's recorder (``cudagraphify_impl`` of ``torch/_inductor/cudagraph_trees.py``)
    keys its recordings by the graph's inputs that are ints when it is built. Under symbolic
    shapes those inputs are SymInts, so it keys nothing and replays its first recording at
    every size: on an H100, "The size of tensor a (140) must match the size of tensor b (400)"
    (``benchmarks/results/gpu_*_compile_whole_cudagraphs.json``). Here the recorder is built
    with each SymInt given as an int, so it keys every recording by the sizes it was recorded
    at, as inductor's own CUDA graph trees do. Each tensor size of a reader's graphs is one of
    those inputs (none is ``unkeyed`` in ``benchmarks/cudagraph_check.py``)."""
    import torch._inductor.cudagraph_trees as trees
    from torch._dynamo.backends.cudagraphs import cudagraphs

    record = trees.cudagraphify_impl

    def keyed(model, inputs, *args, **kwargs):
        return record(model, [0 if isinstance(v, torch.SymInt) else v for v in inputs],
                      *args, **kwargs)

    trees.cudagraphify_impl = keyed  # the backend imports it when called, binding it for good
    try:
        return cudagraphs(gm, example_inputs)
    finally:
        trees.cudagraphify_impl = record


def specialize_floats() -> None:
    """Trace the Python floats a reader computes with (hyperparameters, such as DynSAN's gate
    penalty β, Eq. 6) as constants of its graphs. With symbolic shapes torch leaves them
    unspecialized: each becomes a float64 scalar tensor on the CPU, an input of the graph, and
    the ``cudagraphs`` backend then replays no CUDA graph of it ("cpu device";
    ``benchmarks/cudagraph_check.py`` finds them on the CPU). A reader's floats never change
    between steps, so specializing costs no recompilation."""
    torch._dynamo.config.specialize_float = True


def backward_outside_autocast() -> None:
    """Trace a compiled reader's backward without autocast, as :func:`train_step` runs eager's
    (``loss.backward()`` after the autocast block). torch's default (``same_as_forward``)
    traces it under the forward's bf16 autocast: gradients computed in other precisions than
    eager's, and on an H100 PhaseCond's traced backward failed in autocast's type promotion
    ("Unexpected floating ScalarType in at::autocast::prioritize")."""
    from torch._functorch import config

    config.backward_pass_autocast = "off"


# The compile modes whose graphs replay as CUDA graphs (inductor's CUDA graph trees).
GRAPH_MODES = ("reduce-overhead", "cudagraphs")


def new_graph_step(cfg: TrainConfig) -> None:
    """Under CUDA graphs (a :data:`GRAPH_MODES` ``compile_mode``), mark the start of a step:
    the graphs' outputs of the previous one may be overwritten from here on."""
    if cfg.compile and cfg.compile_mode in GRAPH_MODES:
        torch.compiler.cudagraph_mark_step_begin()


# A folder of torch.compile's cache artifacts, one file per compile_key (a GPU session sets it
# for its queue workers, benchmarks/gpu_session.py): a worker whose compiled graphs are on file
# loads them instead of compiling, and the first to compile a key writes them.
COMPILE_CACHE = "MRC_COMPILE_CACHE"


def compile_key(cfg: TrainConfig, device: torch.device) -> str:
    """The name of the cache artifacts of ``cfg``'s compiled reader on ``device``: the reader,
    what builds its graphs (hyperparameters with the reader's defaults, data options, task,
    precision, the compile keys) and what the artifacts are valid for (torch, the GPU)."""
    graphs = {"model": cfg.model, "dataset": cfg.dataset, "task": cfg.task,
              "hparams": effective_hparams(cfg.to_dict()), "data_options": cfg.data_options,
              "bf16": cfg.bf16, "compile_mode": cfg.compile_mode,
              "compile_whole": cfg.compile_whole, "torch": torch.__version__,
              "device": device_name(device)}
    return f"{cfg.model}-{json_hash(graphs)}"


def load_compile_cache(folder: Path, key: str) -> str:
    """Load the artifacts of ``key`` from ``folder`` into torch.compile's caches, before the
    reader compiles; say what happened. Artifacts torch rejects (another torch or GPU) are
    left, and the reader compiles as without them."""
    path = folder / f"{key}.bin"
    if not path.is_file():
        return "none on file"
    try:
        torch.compiler.load_cache_artifacts(path.read_bytes())
    except Exception as e:  # noqa: BLE001 (a cache: compiling without it loses nothing)
        return f"{path}: not loaded ({type(e).__name__}: {e})"
    return f"loaded {path.name} ({path.stat().st_size / 2**20:.1f} MiB)"


def save_compile_cache(folder: Path, key: str) -> str:
    """Write what this process compiled to ``folder`` as ``key``'s artifacts, unless a file of
    ``key`` is there already (loaded, or written by another worker first); say what
    happened."""
    path = folder / f"{key}.bin"
    if path.exists():
        return "on file"
    artifacts = torch.compiler.save_cache_artifacts()
    if artifacts is None:
        return "nothing compiled"
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, artifacts[0])
    return f"wrote {path.name} ({len(artifacts[0]) / 2**20:.1f} MiB)"


# --- one step -----------------------------------------------------------------------------------


def train_step(net: nn.Module, batch: dict[str, Tensor], optimizer: torch.optim.Optimizer,
               cfg: TrainConfig, device: torch.device) -> Tensor:
    """The last step's gradients dropped, then forward, the task's loss, backward, gradient
    clipping and one optimizer step on a batch already on ``device``; returns the loss,
    detached but left on the device (no synchronization). Dropping the gradients first frees
    them before the forward's activations (in a recorded step, the recordings' pool holds
    them: :meth:`mrc_lib.graphs.GraphedStep.turn_off` can then give it back)."""
    new_graph_step(cfg)
    optimizer.zero_grad(set_to_none=True)
    with autocast(cfg, device):
        out = net(batch)
    loss = get_task(cfg.task).loss(out, batch)
    loss.backward()
    if cfg.grad_clip is not None:
        nn.utils.clip_grad_norm_(net.parameters(), cfg.grad_clip)
    optimizer.step()
    return loss.detach()


class TrainingStep:
    """The trainer's step on a batch (on the host or the device): :func:`train_step`, then the
    weight average's update; a call returns the loss, on the device. With ``cuda_graphs`` on
    CUDA (:func:`graphed`), the same step recorded once per batch shape and replayed
    (:attr:`graphs`, a :class:`mrc_lib.graphs.GraphedStep`), the average's weight written to
    the device before each step."""

    def __init__(self, net: nn.Module, model: nn.Module, optimizer: torch.optim.Optimizer,
                 ema: EMA | None, cfg: TrainConfig, device: torch.device):
        self.net, self.model, self.optimizer, self.ema = net, model, optimizer, ema
        self.cfg, self.device = cfg, device
        self.graphs = GraphedStep(self._recorded, device) if graphed(cfg, device) else None
        self.weight = torch.zeros((), device=device)  # 1 − d_n of the average, for graphs

    def __call__(self, batch: dict[str, Tensor]) -> Tensor:
        if self.graphs is None:
            return self.eager(batch)
        if self.ema is not None:
            self.weight.fill_(self.ema.next_weight())
        return self.graphs(batch)

    def eager(self, batch: dict[str, Tensor]) -> Tensor:
        """The step as it runs without ``cuda_graphs``, whatever the config says."""
        loss = train_step(self.net, to_device(batch, self.device), self.optimizer, self.cfg,
                          self.device)
        if self.ema is not None:
            self.ema.update(self.model)
        return loss

    def _recorded(self, batch: dict[str, Tensor]) -> Tensor:
        """What a recording holds: the step on a batch on the device, the average's update
        reading its weight there."""
        loss = train_step(self.net, batch, self.optimizer, self.cfg, self.device)
        if self.ema is not None:
            self.ema.average(self.model, self.weight)
        return loss


# --- the machine -------------------------------------------------------------------------------


# The fraction of the GPU's memory this process's allocator may hold (`queue run` sets it for
# workers that share a GPU). Past it the allocator gives back what it caches and tries again
# before it runs out, where without it one process's cache could take what the others need:
# on the H200 on 2026-11-29 R-NET's eager worker held 102 GiB for a 13 GiB peak of tensors.
GPU_SHARE = "MRC_GPU_SHARE"


def resolve_device(name: str, index: int = 0) -> torch.device:
    """``auto``, ``cpu`` or ``cuda`` to a device (``cuda:index``, made current, with TF32
    matrix products as cuDNN already uses for convolutions and LSTMs, and this process's
    allocator held to the share of the GPU's memory that :data:`GPU_SHARE` gives it)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError("device 'cuda' requested but CUDA is not available; use "
                        "--set device=cpu")
    torch.cuda.set_device(index)
    torch.set_float32_matmul_precision("high")
    if os.environ.get(GPU_SHARE):
        torch.cuda.set_per_process_memory_fraction(float(os.environ[GPU_SHARE]), index)
    return torch.device("cuda", index)


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU model from ``/proc/cpuinfo``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def peak_memory_bytes(device: torch.device) -> int:
    """Peak CUDA memory allocated, or the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def rnn_precision(model: nn.Module, device: torch.device) -> str | None:
    """How the reader's RNN layers compute (:func:`mrc_lib.nn.rnn.full_precision`): TF32 on
    CUDA, fp32 on a CPU; ``None`` for a reader without any."""
    if not has_rnn_layers(model):
        return None
    return "TF32" if device.type == "cuda" else "fp32"


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Trainable parameters, and all of them with the buffers (e.g. the fixed GloVe rows)."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return {"trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "total": sum(t.numel() for t in tensors)}


@dataclass
class Process:
    """This process's place in a (possibly single-process) distributed run."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> Process:
        """Read the variables ``torchrun`` sets."""
        env = os.environ
        return cls(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)),
                   int(env.get("LOCAL_RANK", 0)))


# --- training ----------------------------------------------------------------------------------


def rebuilt_from_data(model: nn.Module) -> set[str]:
    """State-dict keys a checkpoint leaves out: the fixed pretrained word vectors, which the
    vocabulary rebuilds (and which are most of a reader's size)."""
    return {f"{name}.fixed" if name else "fixed" for name, module in model.named_modules()
            if isinstance(module, WordEmbedding)}


def checkpoint_bytes(cfg: TrainConfig, model: nn.Module) -> int:
    """The size of the trainer's checkpoint of ``model`` under ``cfg``, before any step, at
    most: its state less what the data rebuilds, the optimizer's two tensors per trainable
    parameter (Adam's moments, Adadelta's running averages) and the weight average's copy,
    packed (:data:`mrc_lib.checkpoint.PACKED_RATIO`); the schedule, random-number states and
    progress add a few kilobytes."""
    skip = rebuilt_from_data(model)
    state = sum(v.nbytes for k, v in model.state_dict().items() if k not in skip)
    trainable = sum(p.nbytes for p in model.parameters() if p.requires_grad)
    return int(PACKED_RATIO * (state + trainable * (2 + (cfg.ema_decay is not None))))


@dataclass
class Progress:
    """Where a run stands; saved in every checkpoint."""

    epoch: int = 0  # the current epoch, from 0
    step_in_epoch: int = 0  # optimizer steps done in it
    global_step: int = 0
    train_seconds: float = 0.0  # training time spent in the current epoch so far
    loss_sum: float = 0.0  # sum of the current epoch's losses so far
    seconds_per_epoch: list[float] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)  # one record per evaluation
    best: dict | None = None  # the best evaluation: {"epoch", "score", "dev", "test"}
    log_bytes: int = 0  # size of log.jsonl when the checkpoint was written
    peak_memory_bytes: int = 0  # the highest peak of the run's processes up to the checkpoint
    # Where each session that trained the run ran, from its first step (:meth:`Trainer.start`);
    # a checkpoint older than this list starts it at step 0 with the device of the folder's
    # record of that time, or an unrecorded one (:meth:`Trainer._sessions_before`).
    sessions: list[dict] = field(default_factory=list)


class Trainer:
    """Trains ``cfg.model`` on ``data.splits["train"]`` for ``cfg.task``, evaluating on
    ``data.splits["dev"]`` (and ``["test"]``)."""

    def __init__(self, cfg: TrainConfig, out: Path, data, process: Process,
                 device: torch.device, deadline: float | None = None):
        self.cfg, self.out, self.data = cfg, out, data
        self.deadline = deadline  # time.time() at which to checkpoint and stop
        self.signalled: str | None = None  # a signal's name: checkpoint and stop at once
        self.stopped = False  # the deadline or a signal stopped the run
        self.process, self.device = process, device
        self.task = get_task(cfg.task)
        self.model = build_model(cfg.model, data.vocab, **cfg.hparams).to(device)
        self.ema = EMA(self.model, cfg.ema_decay) if cfg.ema_decay is not None else None
        self.optimizer = build_optimizer(cfg, self.model, device)
        self.schedule = LRSchedule(self.optimizer, cfg, device if graphed(cfg, device) else None)
        self.net = self.model
        if process.world_size > 1 and graphed(cfg, device):
            raise UserError("config cuda_graphs=true records one process's step: train with "
                            "one process per run (the queue packs runs instead)")
        if process.world_size > 1:
            self.net = DistributedDataParallel(
                self.model, device_ids=[device.index] if device.type == "cuda" else None)
        if cfg.compile:
            self.net = compiled(self.model, self.net, cfg.compile_mode, cfg.compile_whole)
        self.step = TrainingStep(self.net, self.model, self.optimizer, self.ema, cfg, device)
        # Each process draws its own dropout masks.
        torch.manual_seed(cfg.seed + process.rank)
        self.progress = Progress()
        self.pending: list[Tensor] = []  # losses since the last check, still on the device
        self.summary: dict | None = None  # the metrics of the latest epoch
        self.analysis: dict | None = None  # the reader's figure payload, once training ends
        self.commit = git_commit()
        self.clock = time.perf_counter()

    # -- state ----------------------------------------------------------------------------------

    @property
    def checkpoint_path(self) -> Path:
        return self.out / "checkpoint.pt"

    def state_dict(self) -> dict:
        skip = rebuilt_from_data(self.model)
        model = {k: v for k, v in self.model.state_dict().items() if k not in skip}
        return {"config": self.cfg.to_dict(), "model": model,
                "ema": self.ema.state_dict() if self.ema is not None else None,
                "optimizer": self.optimizer.state_dict(),
                "schedule": self.schedule.state_dict(), "rng": rng_state(),
                "progress": dataclasses.asdict(self.progress)}

    def load_state_dict(self, state: dict) -> None:
        missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
        if set(missing) - rebuilt_from_data(self.model) or unexpected:
            raise UserError(f"{self.checkpoint_path}: the checkpoint does not fit model "
                            f"{self.cfg.model!r} (missing {sorted(missing)}, unexpected "
                            f"{sorted(unexpected)})")
        if self.ema is not None:
            self.ema.load_state_dict(state["ema"])
        self.optimizer.load_state_dict(on_this_device(state["optimizer"], self.optimizer))
        self.schedule.load_state_dict(state["schedule"])
        set_rng_state(state["rng"])
        self.progress = Progress(**state["progress"])

    def start(self, resume: bool) -> None:
        """Load the checkpoint (``resume``) or check that ``out`` holds no run yet; write the
        configuration and the vocabulary."""
        if resume:
            state = load_checkpoint(self.checkpoint_path)
            self._check_resumable(state["config"])
            self.load_state_dict(state)
        elif self.checkpoint_path.exists():
            raise UserError(f"{self.out} already holds a run; pass --resume to continue it or "
                            "choose another --out")
        self._add_session()
        if self.process.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            with open(self.out / "log.jsonl", "a+b") as log:
                log.truncate(self.progress.log_bytes)  # drop lines after the checkpoint
            atomic_write_json(self.out / "config.json", self.cfg.to_dict())
            if isinstance(self.data.vocab, Vocab):  # the SQuAD vocabulary: predict reloads it
                self.data.vocab.save(self.out / "vocab")

    def _add_session(self) -> None:
        """Note in the progress where this session trains, from the step it starts at. Steps
        trained before sessions were noted (a leading unrecorded device) take what
        :meth:`_sessions_before` finds."""
        sessions, step = self.progress.sessions, self.progress.global_step
        if step and (not sessions or sessions[0]["device"] is None):
            sessions[:1] = self._sessions_before(sessions[1]["step"] if sessions[1:] else step)
        sessions.append({"step": step, **self._where()})

    def _where(self) -> dict:
        """Where this session trains, as a session of the progress and the run's record name it."""
        return {"device": device_name(self.device), "device_type": self.device.type,
                "rnn_precision": rnn_precision(self.model, self.device),
                "torch": str(torch.__version__), "cuda": torch.version.cuda,
                "git_commit": self.commit}

    def _sessions_before(self, until: int) -> list[dict]:
        """The sessions of steps 1-``until``, trained before sessions were noted. The folder's
        ``metrics.json`` of that time (one without ``sessions``: it names the device of the
        session that wrote it, :func:`mrc_lib.records.trained_on`) gives the device of its
        steps; any steps after them, and all of them without such a record, stay unrecorded."""
        path = self.out / "metrics.json"
        try:
            record = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise UserError(f"{path}: not a readable metrics record ({err})") from None
        steps = record.get("steps") or 0
        if record.get("sessions") or not 0 < steps <= until or record.get("device") is None:
            return [{"step": 0, "device": None}]
        known = {"step": 0, **{key: record[key] for key in self._where() if key in record}}
        return [known, *([{"step": steps, "device": None}] if steps < until else [])]

    def _check_resumable(self, saved: dict) -> None:
        """Refuse a resume whose config differs from the checkpoint's in more than
        :data:`RESUMABLE_CHANGES` (a key the checkpoint predates counts at its default)."""
        saved, now = TrainConfig.from_dict(saved).to_dict(), self.cfg.to_dict()
        saved["hparams"], now["hparams"] = effective_hparams(saved), effective_hparams(now)
        changed = sorted(k for k in now if saved.get(k) != now[k] and k not in RESUMABLE_CHANGES)
        if changed:
            details = "; ".join(f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in changed)
            raise UserError(f"cannot resume {self.out}: the config differs from the "
                            f"checkpoint's ({details}); only {', '.join(sorted(RESUMABLE_CHANGES))}"
                            " may change")

    # -- the loop -------------------------------------------------------------------------------

    def fit(self) -> dict:
        """Train until ``cfg.epochs`` epochs or ``cfg.max_steps`` steps; return the metrics."""
        cfg, progress = self.cfg, self.progress
        while progress.epoch < cfg.epochs and not self._out_of_steps():
            finished = self._train_epoch()
            if self.stopped:
                return self.metrics()
            self._end_epoch(finished)
            if not finished:
                break
        if self.summary is None and self.process.is_main and self._finished_all():
            self.analysis = self._analysis()  # resumed a finished run: nothing was trained
        return self.summary or self.metrics()

    def _out_of_steps(self) -> bool:
        return self.cfg.max_steps is not None and self.progress.global_step >= self.cfg.max_steps

    def _my_batches(self) -> tuple[Iterator[dict], int]:
        """This process's remaining batches of the current epoch, and the epoch's length in
        steps. All processes draw the same order; process ``r`` takes batches ``r, r + w, ...``,
        and the last incomplete round is dropped so that every process takes as many steps."""
        cfg, progress, world = self.cfg, self.progress, self.process.world_size
        split = self.data.splits["train"]
        steps = split.num_batches(cfg.batch_size) // world
        if steps == 0:
            raise UserError(f"the training split ({len(split)} examples) gives fewer batches "
                            f"of {cfg.batch_size} than there are processes ({world})")
        batches = split.batches(cfg.batch_size, shuffle=True, seed=cfg.seed,
                                epoch=progress.epoch, skip=progress.step_in_epoch * world)
        stop = (steps - progress.step_in_epoch) * world
        return itertools.islice(batches, self.process.rank, stop, world), steps

    def _train_epoch(self) -> bool:
        """Train to the end of the current epoch; ``False`` if ``max_steps`` stopped it first."""
        cfg, progress = self.cfg, self.progress
        batches, steps = self._my_batches()
        self.net.train()
        self.clock = time.perf_counter()
        with tqdm(batches, total=steps, initial=progress.step_in_epoch,
                  desc=f"epoch {progress.epoch + 1}/{cfg.epochs}",
                  disable=not (self.process.is_main and sys.stderr.isatty())) as bar:
            for batch in bar:
                self.pending.append(self._step(batch))
                progress.step_in_epoch += 1
                progress.global_step += 1
                if progress.global_step % cfg.log_every == 0:
                    self._flush()
                if cfg.checkpoint_every and progress.global_step % cfg.checkpoint_every == 0:
                    self._tick()
                    self._checkpoint()
                if self._out_of_steps():
                    return progress.step_in_epoch == steps
                if self.signalled or (self.deadline is not None and
                                      time.time() >= self.deadline):
                    self._stop()
                    return False
        return True

    def _step(self, batch: dict[str, Tensor]) -> Tensor:
        """One optimizer step and the average's update, then the schedule; returns the loss,
        left on the device."""
        loss = self.step(pad_lengths(batch, self.cfg.pad_multiple))
        self.schedule.step()
        return loss

    def _flush(self) -> None:
        """Check the losses since the last flush and log their mean. A non-finite loss stops the
        run before anything else is written, so the last checkpoint stays the last good one."""
        if not self.pending:
            return
        # In float64 the sum of float32 losses is exact, so the epoch's sum does not depend
        # on where flushes fall: a run cut at a deadline and resumed sums as one run does.
        losses = torch.stack(self.pending).double().cpu()
        self.pending.clear()
        bad = (~torch.isfinite(losses)).nonzero()
        if len(bad):
            step = self.progress.global_step - len(losses) + 1 + int(bad[0])
            saved = (f"the last good checkpoint, {self.checkpoint_path}, is unchanged"
                     if self.checkpoint_path.exists() else "no checkpoint was written")
            raise UserError(f"training loss is {losses[bad[0]].item()} at step {step} "
                            f"(epoch {self.progress.epoch + 1}); stopped: {saved}. Lower the "
                            "learning rate or set grad_clip")
        self.progress.loss_sum += losses.sum().item()
        self._log({"event": "step", "epoch": self.progress.epoch + 1,
                   "step": self.progress.global_step, "loss": losses.mean().item(),
                   "lr": self.schedule.lr})

    def _tick(self) -> None:
        """Add the time since the last tick to the epoch's training time."""
        now = time.perf_counter()
        self.progress.train_seconds += now - self.clock
        self.clock = now

    def _checkpoint(self) -> None:
        self._flush()
        if self.process.is_main:
            self.progress.log_bytes = (self.out / "log.jsonl").stat().st_size
            self.progress.peak_memory_bytes = self._peak_memory()
            save_checkpoint(self.checkpoint_path, self.state_dict(), PART_BYTES)

    def _stop(self) -> None:
        """The deadline has passed, or a signal came: checkpoint where the run stands (a resume
        continues it exactly) and stop."""
        self._tick()
        self._checkpoint()
        self.stopped = True
        step = self.progress.global_step
        if self.signalled:
            self._log({"event": "signal", "signal": self.signalled, "step": step})
            print(f"{self.signalled}: stopped at step {step} with a checkpoint in {self.out}; "
                  "--resume continues it", file=sys.stderr, flush=True)
        else:
            self._log({"event": "deadline", "step": step})

    def _end_epoch(self, finished: bool) -> None:
        """Evaluate the averaged weights on dev (and test, where the task's data has one),
        update the schedule and the history, write the checkpoint and the run's outputs."""
        self._flush()
        self._tick()
        progress, task = self.progress, self.task
        record = {"epoch": progress.epoch + 1, "step": progress.global_step,
                  "train_loss": progress.loss_sum / max(progress.step_in_epoch, 1),
                  "lr": self.schedule.lr, "seconds": progress.train_seconds}
        if self.step.graphs is not None:  # how this process ran the epoch's steps
            graphs = self.step.graphs
            record["cuda_graphs"] = {**graphs.counts, "shapes": len(graphs.recordings),
                                     "failed": graphs.failed}
            graphs.counts.clear()
        if self.process.is_main:
            tic = time.perf_counter()
            new_graph_step(self.cfg)  # evaluation's graphs are not the training step's
            with averaged(self.model, self.ema):
                dev = task.evaluate(self.model, self.data.splits["dev"], self.cfg, self.device)
                self._write_outputs(dev.files)
                if "test" in self.data.splits:
                    record["test"] = task.evaluate(self.model, self.data.splits["test"],
                                                   self.cfg, self.device).scores
            record.update(eval_seconds=time.perf_counter() - tic, dev=dev.scores)
        dev = self._broadcast(record.get("dev"))
        self.schedule.epoch_end(task.score(dev, self.cfg.plateau_metric))
        progress.history.append(record)
        score = task.score(dev)
        if progress.best is None or score > progress.best["score"]:
            progress.best = {"epoch": record["epoch"], "score": score,
                             "dev": record.get("dev"), "test": record.get("test")}
        progress.seconds_per_epoch.append(progress.train_seconds)
        progress.train_seconds = progress.loss_sum = 0.0
        if finished:
            progress.epoch, progress.step_in_epoch = progress.epoch + 1, 0
        self._log({"event": "epoch", **record})
        if self.cfg.epoch_checkpoints:
            self._checkpoint()
        if self.process.is_main and self._finished_all():
            self.analysis = self._analysis()
        self.summary = self.metrics()
        if self.process.is_main:
            atomic_write_json(self.out / "metrics.json", self.summary)

    def _finished_all(self) -> bool:
        return self.progress.epoch >= self.cfg.epochs or self._out_of_steps()

    def _analysis(self) -> dict | None:
        """The reader's figure payload (its optional ``analysis(data, cfg)`` method, averaged
        weights, eval mode): small JSON data the chapter draws from, kept in the run's record so
        that a figure can be redrawn without the weights."""
        if getattr(self.model, "analysis", None) is None:
            return None
        with averaged(self.model, self.ema), torch.no_grad():
            self.model.eval()
            return self.model.analysis(self.data, self.cfg)

    def _broadcast(self, value):
        """Rank 0's ``value`` on every process."""
        if self.process.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _peak_memory(self) -> int:
        """The run's peak memory: this process's, or a process before a resume's if higher (a
        run that spans sessions peaks in any of them)."""
        return max(self.progress.peak_memory_bytes, peak_memory_bytes(self.device))

    # -- outputs --------------------------------------------------------------------------------

    def _log(self, record: dict) -> None:
        if self.process.is_main:
            with open(self.out / "log.jsonl", "a", encoding="utf-8") as log:
                log.write(json.dumps(record) + "\n")

    def _write_outputs(self, files: dict[str, dict]) -> None:
        """The evaluation's files (the predictions...) and the (averaged) weights."""
        for name, content in files.items():
            atomic_write_json(self.out / name, content)
        with atomic_path(self.out / "model.pt") as tmp:
            torch.save(self.model.state_dict(), tmp)

    def metrics(self) -> dict:
        """The run's summary (``metrics.json``)."""
        progress, cfg = self.progress, self.cfg
        last = progress.history[-1] if progress.history else {}
        best = progress.best or {}
        return {
            "model": cfg.model, "dataset": cfg.dataset, "task": cfg.task,
            "version": self.data.version, "profile": cfg.profile,
            "dev": last.get("dev"), "best_epoch": best.get("epoch"), "best_dev": best.get("dev"),
            **({"test": last.get("test"), "best_test": best.get("test")}
               if "test" in self.data.splits else {}),
            "epochs_run": len(progress.seconds_per_epoch), "steps": progress.global_step,
            "seconds_per_epoch": progress.seconds_per_epoch,
            # the training seconds of an epoch a deadline or a signal cut (0 at an epoch's end)
            "seconds_this_epoch": progress.train_seconds,
            "peak_memory_bytes": self._peak_memory(),
            "params": count_parameters(self.model),
            **self._where(), "world_size": self.process.world_size,
            "complete": self._finished_all(),
            "data_digests": self.data.digests, "config": cfg.to_dict(),
            "history": progress.history, "sessions": progress.sessions,
            **({"analysis": self.analysis} if self.analysis is not None else {}),
        }


def load_data(cfg: TrainConfig):
    """The data of ``cfg``'s task (:meth:`mrc_lib.tasks.Task.load`)."""
    return get_task(cfg.task).load(cfg)


def train(cfg: TrainConfig, out: str | Path, *, resume: bool = False, data=None,
          deadline: float | None = None, signals: bool = False) -> dict:
    """Train per ``cfg`` into directory ``out`` (continuing its checkpoint if ``resume``) and
    return the metrics (``complete`` is false when ``deadline``, a ``time.time()``, or with
    ``signals`` a SIGTERM or Ctrl-C (:func:`stopped_by_signals`) stopped the run first: it then
    resumes from its checkpoint). ``data`` defaults to :func:`load_data`; under ``torchrun``
    this joins the process group (NCCL on CUDA, Gloo on CPU)."""
    process = Process.from_env()
    if deadline is not None and process.world_size > 1:
        raise UserError("a deadline stops single-process runs only (processes would disagree "
                        "on the step to stop at)")
    device = resolve_device(cfg.device, process.local_rank)
    joined = process.world_size > 1 and not dist.is_initialized()
    if joined:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        seed_everything(cfg.seed)
        if device.type == "cpu":
            torch.use_deterministic_algorithms(True)
        data = data if data is not None else load_data(cfg)
        trainer = Trainer(cfg, Path(out), data, process, device, deadline)
        trainer.start(resume)
        stoppable = signals and process.world_size == 1
        with stopped_by_signals(trainer) if stoppable else contextlib.nullcontext():
            return trainer.fit()
    finally:
        if joined:
            dist.destroy_process_group()


def stopped_by_signals(trainer: Trainer):
    """While ``trainer`` trains, SIGTERM or SIGINT (Ctrl-C) stops it as a deadline would: after
    the step under way, with a checkpoint that a resume continues exactly (the packed runner
    sends its workers SIGTERM when it is stopped itself). A second SIGINT interrupts at once.
    For the command line's single-process runs (``train``, the runner's workers): processes
    would disagree on the step to stop at, and a notebook's interrupt stops its cell."""
    interrupts = []

    def stop(signum, frame) -> None:
        if signum == signal.SIGINT:
            if interrupts:
                raise KeyboardInterrupt
            interrupts.append(signum)
        trainer.signalled = trainer.signalled or signal.Signals(signum).name

    return on_stop_signals(stop)


def train_cli(args) -> dict:
    """``python -m mrc_lib train``: a new run from a profile, or ``--resume`` of the run in
    ``--out`` (its ``config.json``, with ``--config``/``--set`` applied on top). With
    ``--record PATH`` a finished run also writes its record (:mod:`mrc_lib.records`) there."""
    from mrc_lib import records

    out = Path(args.out)
    if not args.resume:
        cfg = resolve_config(args.model, args.dataset, args.profile, args.config,
                             args.overrides)
    else:
        saved = _read_json(out / "config.json", "run configuration")
        if saved.get("model") != args.model:
            raise UserError(f"{out} is a run of model {saved.get('model')!r}, not "
                            f"{args.model!r}")
        cfg = apply_overrides(saved, args.config, args.overrides)
    metrics = train(cfg, out, resume=args.resume, signals=True)
    if args.record and metrics["complete"] and Process.from_env().is_main:
        records.write_record(args.record, records.make_record(
            metrics, chapter=args.chapter, run=args.run or out.name, log_path=out / "log.jsonl"))
    return metrics


# --- prediction --------------------------------------------------------------------------------


def _read_json(path: Path, what: str):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: no {what} found (is this a training run's directory?)") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: invalid JSON: {e}") from None


def load_run(run: str | Path, device: torch.device) -> tuple[TrainConfig, object, nn.Module]:
    """The configuration, vocabulary and averaged-weight reader (eval mode) of a span task's
    trained run."""
    run = Path(run)
    cfg = TrainConfig.from_dict(_read_json(run / "config.json", "run configuration"))
    if cfg.task not in SPAN_TASKS:
        raise UserError(f"{run}: a run of task {cfg.task!r}; predict answers SQuAD-style "
                        "questions with a span reader's run")
    vocab = Vocab.load(run / "vocab")
    model = build_model(cfg.model, vocab, **cfg.hparams)
    if not (run / "model.pt").is_file():
        raise UserError(f"{run / 'model.pt'}: no trained weights (has an epoch finished?)")
    model.load_state_dict(torch.load(run / "model.pt", map_location="cpu", weights_only=True))
    return cfg, vocab, model.to(device).eval()


def _questions(args) -> tuple[list[str], list[tuple[str, str]]]:
    """Ids and ``(context, question)`` pairs from ``--file`` or ``--context``/``--question``."""
    if args.file:
        from mrc_lib.data.squad import read_squad

        squad = read_squad(args.file, require_answers=False)
        return ([ex.qid for ex in squad.examples],
                [(squad.contexts[ex.context_id], ex.question) for ex in squad.examples])
    if not (args.context and args.question):
        raise UserError("predict needs --file, or both --context and --question")
    return ["0"], [(args.context, args.question)]


def predict_cli(args) -> list[dict]:
    """``python -m mrc_lib predict``: the answer of a trained run to every question, with its
    character offsets in the context and its probability ``p_start · p_end``."""
    from mrc_lib.data import encode_texts

    device = resolve_device("auto")
    cfg, vocab, model = load_run(args.run, device)
    ids, pairs = _questions(args)
    split = encode_texts(vocab, pairs, qids=ids)
    answers: list[dict] = [{} for _ in ids]
    for i, start, end, score, na in predict_spans(model, split, cfg, device):
        char_start, char_end = split.char_span(i, start, end)
        answers[i] = {"id": ids[i], "answer": split.answer_text(i, start, end),
                      "char_start": char_start, "char_end": char_end, "probability": score}
        if na is not None:
            answers[i]["no_answer_probability"] = na
    return answers
