"""A GPU session in one command. The device tool lends a session 15 device-minutes: one
machine start and one command of at most 10 minutes. This script is that command. It spends
the time on what is still missing for this GPU, in this order:

1. ``bringup``: every reader forward and backward, its speeds and peak memory
   (``gpu_bringup.py``). It runs again when a reader's config hash differs from its entry.
2. ``measure``: the chapters' measurements that no GPU has made (``python -m mrc_lib measure``).
3. ``packing``: how many training processes share the GPU best (``gpu_packing.py``).
4. ``profile``: where QANet's, DynSAN's and PhaseCond's steps spend their time: kernel time
   against wall time, host time, synchronisations, and the operators and kernels that take the
   most (``gpu_profile.py``).
5. ``cuda_graphs``: every reader the full profile configures, its whole step recorded
   once per batch shape and replayed as CUDA graphs, without torch.compile
   (``gpu_bringup.py --cuda-graphs``, config ``cuda_graphs``), and how a replay agrees with
   the eager step. ``train`` then gives ``queue run --graphed`` the readers whose replays agree
   and gain (:func:`graphed`).
6. ``compile``, ``compile_ro``: QANet and DynSAN through ``torch.compile``, in its default
   mode and with CUDA graphs (``gpu_bringup.py --compile``), their repeated blocks compiled
   in place; ``compile_whole``: the two readers compiled whole, with CUDA graphs (``--whole``),
   at 140 and 400 tokens; before it, ``graphs``: those two and PhaseCond traced whole and
   replayed as CUDA graphs without inductor (``compile_mode: cudagraphs``).
7. ``fp32``: the readers whose profile sets bf16, eager in full precision (``gpu_bringup.py
   --fp32``): whether autocast's casts cost these launch-bound steps more than bf16 saves.
8. ``train``: the queue runs that ``--only`` selects, with the minutes left (``queue run``).

Then it packs what it wrote under ``--out``: ``session.tar`` (the benchmark files, the logs
and ``session.json``, one entry per step) and bundle 1 of the runner folder's carry-over,
``b1``: every record, measurements included, and the partial runs that the next session can
resume, as far as they fit; where the carry-over fills more bundles (``session.json`` says how
many), ``send --bundle K`` writes bundle ``K`` to ``$OUT`` in a call of its own after the
command, on the same warm machine. A step is skipped when its result is already on file for
this GPU, whole, and ``packing``, ``profile`` and the compile steps also when it is for
another GPU on the same chip (:data:`mrc_lib.queue.CHIPS`: the H100 and the H200 are both
GH100, so an H100's first session trains after its bring-up where the H200 measured the
rest); ``bringup`` and the compile steps go on from a file that a cut left without
``"complete": true`` (its readers are kept, the others measured). A step that fails or runs
out of time is named in ``session.json``, and the next step still runs.

    python benchmarks/gpu_session.py prepare --only '05_ea_reader/*'   # CPU side: the data
    python benchmarks/gpu_session.py run --out $OUT --only '05_ea_reader/*'   # the command
    python benchmarks/gpu_session.py send --bundle 2 --out $OUT        # the next call, if told
    python benchmarks/gpu_session.py import FILES_AT [FILES_AT_2 ...]  # CPU side: into the repo
    python benchmarks/gpu_session.py plan                # CPU side: which runs sessions can train

``prepare`` loads the selected runs' data here, where spaCy, the raw files and GloVe are,
notes the cache files that the loading reads, and writes them, with the texts that evaluation
reads, to ``.devcache/travel.tar.xz``. SQuAD's training texts stay behind (training never
reads them) unless a run on DynSAN's multi-passage SQuAD is selected: the GPU machine builds
that from them. ``run`` unpacks that file into a cache of its own. A call carries 64 MiB,
the tree included. ``prepare`` also moves the last session's carry-over, committed in
``runs/inbox`` as one folder per bundle, out of the tree to ``.devcache/inbox``, and names the
calls (:func:`calls_for`): the data and each bundle, in as few calls as hold them beside the
tree, the command going in the last; the warm machine keeps what the calls before it carried.
So a bundle is what one call carries beside the tree (as measured by ``prepare``, plus
:data:`GROWTH_MIB` for the records the import adds: :func:`carry_mib`), and the carry-over
this session may send on is ``--bundles`` of them (:data:`CARRY_BUNDLES`; both written to
``.devcache/travel.json``, which travels with the data); its ``queue run`` starts a run that
will be cut only while its checkpoint fits (``--carry-mib``). Import puts the next carry-over
in ``runs/inbox``, or the one it was sent back there if nothing came back; a run that was sent
but did not come back whole goes on from where it was sent. The data file also carries the
committed compile cache, ``runs/compile_cache`` (moved out of the tree like the carry-over):
``run`` unpacks this GPU's artifacts into the folder its queue workers load compiled graphs
from and write new ones to (:data:`COMPILE_CACHE`), sends the new ones back in
``session.tar``, and import puts them in the tree. ``plan`` writes every queue run's
checkpoint, data and fate under those limits to ``benchmarks/results/session_plan.json``.
``--tiny`` is the script's own check (CI): small readers, the smoke profile, seconds per step.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import io
import json
import lzma
import math
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mrc_lib import book, queue  # noqa: E402
from mrc_lib.errors import UserError  # noqa: E402
from mrc_lib.utils import atomic_write_json, slug  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TRAVEL = ROOT / ".devcache" / "travel.tar.xz"
RUNNER = ROOT / "runs" / "queue"
INBOX = ROOT / "runs" / "inbox"
# Where prepare moves the committed carry-over, out of the tree, to carry it as a path of its
# own: in the command's call, while the data went in a call before it (calls_for).
STAGED = ROOT / ".devcache" / "inbox"
WORK = ROOT / "runs" / "session"
# torch.compile's cache artifacts of the queue's compiled runs, committed: a folder per GPU,
# a file per mrc_lib.train.compile_key, xz-compressed. Like the carry-over, prepare moves it out
# of the tree (into the data file, which carries it) and import puts it back with what the
# session compiled anew, so that a session's workers load their graphs instead of compiling.
COMPILE_CACHE = ROOT / "runs" / "compile_cache"
STAGED_CACHE = ROOT / ".devcache" / "compile_cache"
# The most a reply brings back of new artifacts (compressed): session.tar is one reply file of
# 16 MB at most, beside the benchmark files and logs.
CACHE_BACK_MIB = 12
TRAVEL_MIB = 64  # what one call to the device tool carries, the tree included
# Kept beside the tree for what a session's import adds to it (records, benchmark files)
# before the next session carries the carry-over it sent: all 52 EA Reader records of a CPU
# rehearsal come to 1.15 MiB, PhaseCond's 35 to 2.0, every queue run's to 4.7.
GROWTH_MIB = 1.5
PACK_SECONDS = 30  # kept for packing at the end
RUNNER_EXIT = 15  # for `queue run` to print its table and exit
# `queue run --reserve`: its trainers stop this long before it ends, room for the SQuAD dev
# evaluation an epoch's end may start just before (QANet's took 6 to 10 s on the H100,
# book/runs/01_bidaf_qanet/qanet.json), a checkpoint and the worker's exit (in the second H100
# session's second command, the packing and the exit after the runner took 9 s). `queue run`'s
# own default, 60 s, is for use by hand.
TRAINER_RESERVE = 30
# How the session's runs are computed (queue run --set; a later --set of the session wins): the
# runner's folder lasts one command, where a checkpoint is worth writing only when a deadline
# cuts a run (it is then carried on), not at each epoch's end.
RUNNER_SETTINGS = ("epoch_checkpoints=false",)
COMPILE_MODELS = "qanet,dynsan"  # launch-bound at the first bring-up (how_to_reproduce.md)
# Those two and PhaseCond, which stands for the recurrent readers in bf16 whose H200 rate is the
# same at 140 and 400 tokens (IA, SAN, BiDAF++): what fixes their steps' time?
PROFILE_MODELS = COMPILE_MODELS + ",phasecond"
PY = sys.executable
# The bundles a session's carry-over may fill (prepare --bundles): each is what one call
# carries beside the tree, and costs a call each way (the command sends bundle 1 back, `send`
# each other; the next session carries each in a call of its own) and its MiB in the history
# of runs/inbox. One held every partial run of 18 queue entries (PhaseCond's, DynSAN's with
# Bi-BloSA: checkpoints of 62-99 MiB) back from any session, and let a command cut only one or
# two long runs at a time (checkpoints of 10-48 MiB); two carry them, and four runs of most.
CARRY_BUNDLES = 2


@dataclass
class Session:
    """What the steps share: the options, this device's name and the folders."""

    args: argparse.Namespace
    device: str
    work: Path
    results: Path  # where this device's earlier results are read
    deadline: float
    carry: float = queue.CARRY_MIB  # the MiB of each bundle of the carry-over (carry_mib)
    bundles: int = 1  # the bundles of runner folder that go on to the next session
    # Every step's log names each torch.compile recompilation and its cause: the compile
    # steps' first step at their second length (400 tokens) took 33-35 s on both chips, where
    # a CPU compiles QANet's blocks for 140 tokens and then no more.
    env: dict = field(default_factory=lambda: {"TORCH_LOGS": "recompiles"})
    log: list = field(default_factory=list)
    seeded: set = field(default_factory=set)  # the compile cache's files it was sent

    @property
    def tiny(self) -> bool:
        return self.args.tiny

    def result(self, name: str) -> Path:
        """Where this command writes benchmark file ``name`` (``name`` with the device)."""
        return self.work / "results" / name.format(device=slug(self.device))

    def resumed(self, name: str) -> Path:
        """Where this command writes ``name``, holding the file on file for this device when
        this command has none yet: a measurement that a cut step left goes on from it."""
        path = self.result(name)
        earlier = self.results / path.name
        if not path.exists() and earlier.is_file():
            shutil.copyfile(earlier, path)
        return path

    def on_file(self, name: str, chip: bool = False) -> dict | None:
        """This device's benchmark file ``name``: written by this command, else on file; with
        ``chip``, else one on file for another GPU on its chip (:func:`queue.chip_mates`)."""
        for folder in (self.work / "results", self.results):
            path = queue.chip_file(folder, name, self.device) if chip else \
                folder / name.format(device=slug(self.device))
            if path is not None and path.is_file():
                return json.loads(path.read_text(encoding="utf-8"))
        return None

    def left(self) -> float:
        return self.deadline - time.time()


@dataclass(frozen=True)
class Step:
    """A step: ``skip(session)`` says why it is not needed (``None``: run it); ``argv`` its
    command; it starts only with ``least`` seconds left, and runs at most ``cap`` seconds."""

    name: str
    cap: float
    least: float
    skip: Callable[[Session], str | None]
    argv: Callable[[Session, float], list[str]]


# --- the steps ----------------------------------------------------------------------------------


def bringup_skip(s: Session) -> str | None:
    from mrc_lib.bench import full_readers, reader_hash, same_code

    found = s.on_file("gpu_{device}.json")
    if s.tiny or found is None or not found.get("complete"):
        return None
    stale = [name for name in full_readers()
             if found["models"].get(name, {}).get("config_hash") != reader_hash(name)
             or not same_code(found["models"][name])]
    return None if stale else "every reader's bring-up matches its config and code"


def bringup_argv(s: Session, budget: float) -> list[str]:
    tiny = ["--device", "cpu", "--tiny", "--models", "bidaf"] if s.tiny else []
    return [PY, "benchmarks/gpu_bringup.py", *tiny, "--resume",
            "--out", str(s.resumed("gpu_{device}.json"))]


def measure_skip(s: Session) -> str | None:
    from mrc_lib.measurements import states

    if s.tiny or any(where != "done" for where, _ in states(s.args.runner).values()):
        return None
    return "every measurement was made on a GPU"


def measure_argv(s: Session, budget: float) -> list[str]:
    tiny = ["--device", "cpu", "--profile", "smoke", "--only", "07_comparison/speed"]
    return [PY, "-m", "mrc_lib", "measure", "--out", str(s.args.runner), *(tiny if s.tiny else [])]


def chip_skip(s: Session, name: str) -> str | None:
    """Why a step whose file ``name`` holds for every GPU on a chip is not needed: that file
    is on file, whole, for this GPU or another on its chip."""
    found = s.on_file(name, chip=True)
    if s.tiny or found is None or not found.get("complete"):
        return None
    device = found.get("device")
    return "on file" if device == s.device else f"on file for the {device} (the same chip)"


def packing_skip(s: Session) -> str | None:
    return chip_skip(s, "packing_{device}.json")


def packing_argv(s: Session, budget: float) -> list[str]:
    tiny = ["--device", "cpu", "--tiny", "--models", "bidaf", "--parallel", "1,2",
            "--seconds", "0.5"]
    return [PY, "benchmarks/gpu_packing.py", *(tiny if s.tiny else []),
            "--out", str(s.result("packing_{device}.json"))]


def profile_skip(s: Session) -> str | None:
    """On file for the chip, and of today's readers' code (else profiled again, to see what a
    change of the code did to the step)."""
    from mrc_lib.bench import same_code

    found = s.on_file("profile_{device}.json", chip=True)
    return chip_skip(s, "profile_{device}.json") if found and same_code(found) else None


def profile_argv(s: Session, budget: float) -> list[str]:
    tiny = ["--device", "cpu", "--tiny"] if s.tiny else []
    return [PY, "benchmarks/gpu_profile.py", *tiny, "--models",
            "bidaf" if s.tiny else PROFILE_MODELS, "--out", str(s.result("profile_{device}.json"))]


def compile_step(name: str, mode: str, file: str, whole: bool = False,
                 models: str = COMPILE_MODELS) -> Step:
    """A ``gpu_bringup.py --compile`` step of ``models`` in ``mode``: their
    ``compile_regions`` at three lengths (the third shows whether a new length compiles
    again), or the ``whole`` readers at two, for longer (the whole step compiles at once: QANet's
    took several times its blocks' time on a CPU). Each compile step looks for a step that
    waits less on its launches; it is skipped once the recorded eager step replays every one of
    ``models`` (:func:`recorded`), which waits on none and compiles nothing: a session's
    minutes then go to training."""
    def left(s: Session) -> list[str]:
        final = final_on_chip(s, file) if whole else set()
        return [name for name in models.split(",") if name not in final]

    def skip(s: Session) -> str | None:
        if s.tiny:
            return "CUDA only"
        if set(models.split(",")) <= set(recorded(s)):
            return "the recorded eager step replays these readers (cuda_graphs)"
        if earlier_error(s, file):
            return None
        if not left(s):
            return "every reader compiled whole on this chip, or cut after a final time"
        return chip_skip(s, file)

    def argv(s: Session, budget: float) -> list[str]:
        return [PY, "benchmarks/gpu_bringup.py", "--compile", "--compile-mode", mode,
                *(["--whole"] if whole else []), "--models", ",".join(left(s)),
                "--seq-len", "140,400" if whole else "140,400,250", "--resume",
                "--out", str(s.resumed(file))]

    return Step(name, 300, 200, skip, argv) if whole else Step(name, 180, 120, skip, argv)


def final_on_chip(s: Session, file: str) -> set[str]:
    """The readers that whole-reader compile file ``file`` of this GPU, or of another on its
    chip, holds as final: measured, or cut after :data:`mrc_lib.bench.WHOLE_FINAL_SECONDS`
    of compiling (so long a compilation is the finding). A step measures only the others: a
    GPU on the chip that is new to the step does not compile QANet whole again for minutes."""
    from mrc_lib.bench import CUT, WHOLE_FINAL_SECONDS

    final = set()
    for device in (s.device, *queue.chip_mates(s.device)):
        for folder in (s.work / "results", s.results):
            path = folder / file.format(device=slug(device))
            models = json.loads(path.read_text(encoding="utf-8")).get("models", {}) \
                if path.is_file() else {}
            final |= {name for name, m in models.items() if "error" not in m or (
                m["error"] == CUT and m.get("seconds", 0) >= WHOLE_FINAL_SECONDS)}
    return final


def earlier_error(s: Session, file: str) -> bool:
    """Whether compile file ``file`` on file for the chip holds a reader's error from an
    earlier revision of ``compiled()``'s tracing (:data:`mrc_lib.train.COMPILE_REVISION`),
    which that revision may have fixed: then its step runs again."""
    from mrc_lib.bench import CUT
    from mrc_lib.train import COMPILE_REVISION

    found = s.on_file(file, chip=True)
    return found is not None and found.get("compile_revision", 1) < COMPILE_REVISION and any(
        m.get("error") not in (None, CUT) for m in found.get("models", {}).values())


FP32_FILE = "gpu_{device}_fp32.json"


def fp32_skip(s: Session) -> str | None:
    """On file for the chip, every reader of today's code beside its profile's precision
    (``plain_speed``, measured in the same process); else measured again: a full-precision rate
    says which precision is faster only beside the other precision's on the same machine."""
    from mrc_lib.bench import same_code

    found = s.on_file(FP32_FILE, chip=True)
    stale = found is not None and any(
        not same_code(m) or "plain_speed" not in m
        for m in found.get("models", {}).values() if "error" not in m)
    return None if stale else chip_skip(s, FP32_FILE)


def fp32_argv(s: Session, budget: float) -> list[str]:
    tiny = ["--device", "cpu", "--tiny", "--models", "qanet"] if s.tiny else []
    return [PY, "benchmarks/gpu_bringup.py", "--fp32", *tiny, "--resume",
            "--out", str(s.resumed(FP32_FILE))]


GRAPHS_FILE = "gpu_{device}_cuda_graphs.json"
# The readers whose steps the cuda_graphs step records: the three profiled first, then the
# others by the queue minutes they would save (BiDAF, at 48 s an epoch on the H100, last).
GRAPHS_MODELS = PROFILE_MODELS + \
    ",qanet_na,san,iterative_aligner,decaprop,rnet,ea_reader,dynsan_mc,bidafpp,bidaf"
# A reader's runs replay their steps as CUDA graphs (queue run --graphed) when its recorded
# step trained as the eager one (agreement: relative distance of the two updates) and was this
# much faster at 140 context tokens, SQuAD's mean context, than its eager step measured
# beside it in the same process (plain_speed).
AGREEMENT_MAX = 0.05
GRAPHS_GAIN = 1.2


def cuda_graphs_skip(s: Session) -> str | None:
    """On file for the chip, and checked by today's :data:`mrc_lib.bench.AGREEMENT_REVISION`
    (else measured again)."""
    from mrc_lib.bench import same_check

    found = s.on_file(GRAPHS_FILE, chip=True)
    return chip_skip(s, GRAPHS_FILE) if found and same_check(found) else None


def cuda_graphs_argv(s: Session, budget: float) -> list[str]:
    models = ["--device", "cpu", "--tiny", "--models", "qanet"] if s.tiny else \
        ["--models", GRAPHS_MODELS]
    return [PY, "benchmarks/gpu_bringup.py", "--cuda-graphs", *models, "--resume",
            "--out", str(s.resumed(GRAPHS_FILE))]


def recorded(s: Session) -> dict[str, dict]:
    """The entries of the readers whose recorded steps ``gpu_bringup.py --cuda-graphs``
    measured on this chip without error, agreeing with their eager steps (``agreement`` at
    most :data:`AGREEMENT_MAX`) by today's check (:func:`mrc_lib.bench.same_check`)."""
    from mrc_lib.bench import same_check

    found = s.on_file(GRAPHS_FILE, chip=True) or {}
    if not same_check(found):
        return {}
    return {name: m for name, m in found.get("models", {}).items()
            if "error" not in m and m.get("agreement", 1.0) <= AGREEMENT_MAX}


def graphed(s: Session) -> list[str]:
    """The readers whose runs this session's queue replays as CUDA graphs: those
    :func:`recorded` at :data:`GRAPHS_GAIN` times the eager rate at 140 tokens that the same
    process measured beside the recording (``plain_speed``), not the eager bring-up's, which
    another session's machine may have measured."""
    def rate(m: dict, key: str) -> float | None:
        return m.get(key, {}).get("140", {}).get("train_examples_per_s")

    return [name for name, m in recorded(s).items()
            if rate(m, "plain_speed") and rate(m, "speed") >= GRAPHS_GAIN * rate(m, "plain_speed")]


def train_skip(s: Session) -> str | None:
    if not s.args.only:
        return "no --only (the runs to train are those whose data was carried)"
    jobs = queue.select(queue.load_queue(s.args.queue_file), s.args.only)
    todo = queue.pending(jobs, s.args.runner, s.args.profile)
    return None if todo else "no run selected by --only is left"


def parallel(s: Session) -> int:
    """``--parallel``, else what the packing benchmark recommends for this GPU (or one on its
    chip), else 2."""
    if s.args.parallel:
        return s.args.parallel
    found = s.on_file("packing_{device}.json", chip=True)
    return int(found["recommended_parallel"]) if found and not s.tiny and \
        found.get("recommended_parallel") else 2


def train_argv(s: Session, budget: float) -> list[str]:
    minutes = (budget - RUNNER_EXIT) / 60  # its trainers stop a --reserve before that
    readers = graphed(s)
    return [PY, "-m", "mrc_lib", "queue", "run", "--minutes", f"{minutes:.2f}",
            "--reserve", str(TRAINER_RESERVE),
            "--out", str(s.args.runner), "--parallel", str(parallel(s)),
            "--carry-mib", f"{s.carry * s.bundles:g}",
            "--file", str(s.args.queue_file), "--profile", s.args.profile,
            *(f"--only={p}" for p in s.args.only or []),
            *(f"--set={v}" for v in (*RUNNER_SETTINGS, *s.args.set)),
            *([f"--graphed={','.join(readers)}"] if readers else [])]


STEPS = [
    Step("bringup", 150, 60, bringup_skip, bringup_argv),
    Step("measure", 330, 120, measure_skip, measure_argv),
    Step("packing", 270, 200, packing_skip, packing_argv),
    Step("profile", 120, 45, profile_skip, profile_argv),
    # The step recorded as CUDA graphs without torch.compile (nothing traced or compiled): the
    # readers whose replays agree with the eager step and are faster train so in `train`.
    Step("cuda_graphs", 180, 45, cuda_graphs_skip, cuda_graphs_argv),
    # The whole step traced and replayed as CUDA graphs without inductor first: on the H200
    # inductor had not compiled QANet whole after 298 s, where the trace alone took 27 s on
    # this project's 2-core CPU at one length (139 s with symbolic lengths). Then the whole
    # step under inductor's CUDA graphs: compiling QANet's blocks alone (compile, compile_ro)
    # gained little on both chips, and DynSAN's regional rates come after it.
    compile_step("graphs", "cudagraphs", "gpu_{device}_compile_whole_cudagraphs.json",
                 whole=True, models=PROFILE_MODELS),
    compile_step("compile_whole", "reduce-overhead",
                 "gpu_{device}_compile_whole_reduce_overhead.json", whole=True),
    # Eleven readers eager, as the bring-up (which took under a minute for twelve on the H100).
    Step("fp32", 120, 45, fp32_skip, fp32_argv),
    compile_step("compile", "default", "gpu_{device}_compile.json"),
    compile_step("compile_ro", "reduce-overhead", "gpu_{device}_compile_reduce_overhead.json"),
    Step("train", 600, 150, train_skip, train_argv),
]


# --- running them -------------------------------------------------------------------------------


def run_step(s: Session, step: Step) -> dict:
    """Run one step as its own process group, at most ``cap`` seconds and never past the
    session's end; its output goes to ``logs/<step>.log``."""
    try:
        why = step.skip(s)
        budget = min(step.cap, s.left() - PACK_SECONDS)
        argv = None if why or budget < step.least else step.argv(s, budget)
    except Exception as e:  # noqa: BLE001 (named, and the next step runs)
        return {"step": step.name, "state": f"failed: {type(e).__name__}: {e}"}
    if argv is None:
        return {"step": step.name, "state": "skipped", "why": why or f"{budget:.0f} s left"}
    log = s.work / "logs" / f"{step.name}.log"
    print(f"[{step.name}] up to {budget:.0f} s: {' '.join(argv[1:])}", flush=True)
    tic = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env=os.environ | s.env, start_new_session=True)
        try:
            code = proc.wait(timeout=budget)
            state = "done" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                settle_cut(argv, time.time())
            state = "cut at its time"
    tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-5:]
    return {"step": step.name, "state": state, "seconds": round(time.perf_counter() - tic, 1),
            "command": argv[1:], "log_tail": tail}


def settle_cut(argv: list[str], now: float) -> None:
    """A bring-up killed inside a compilation, where its SIGTERM handler never ran, leaves its
    reader entered as cut without the seconds it had compiled: give them, from when the entry
    says it started, so that a final cut (:func:`final_on_chip`) is not compiled again."""
    from mrc_lib.bench import CUT

    path = Path(argv[argv.index("--out") + 1]) if "--out" in argv else None
    if path is None or not path.is_file():
        return
    results = json.loads(path.read_text(encoding="utf-8"))
    for m in results.get("models", {}).values():
        if m.get("error") == CUT and "seconds" not in m and "started" in m:
            m["seconds"] = round(now - m["started"], 1)
    atomic_write_json(path, results)


def unpack_travel(path: Path, cache: Path) -> str:
    """The carried data, unpacked into a cache of its own."""
    with tarfile.open(path) as tar:
        tar.extractall(cache, filter="data")
    return f"{path.stat().st_size / 2**20:.1f} MiB of data from {path} into {cache}"


def seed_compile_cache(s: Session) -> str:
    """The compile cache artifacts of this GPU that the data carried, unpacked into the folder
    the session's queue workers load from and write to (:data:`mrc_lib.train.COMPILE_CACHE`)."""
    from mrc_lib.train import COMPILE_CACHE as VARIABLE

    folder = s.work / "compile_cache"
    folder.mkdir(exist_ok=True)
    s.env[VARIABLE] = str(folder)
    for path in sorted((s.work / "cache" / "compile_cache" / slug(s.device)).glob("*.bin.xz")):
        name = path.name.removesuffix(".xz")
        (folder / name).write_bytes(lzma.decompress(path.read_bytes()))
        s.seeded.add(name)
    return f"{len(s.seeded)} file(s) for the {s.device} into {folder}"


def compile_cache_back(s: Session) -> tuple[list[tuple[str, bytes]], list[str]]:
    """The artifacts the session's workers wrote anew, xz-compressed, as ``session.tar``'s
    members, as long as they stay within :data:`CACHE_BACK_MIB` together; and a note for each
    left here."""
    members, notes, total = [], [], 0
    for path in sorted((s.work / "compile_cache").glob("*.bin")):
        if path.name in s.seeded:
            continue
        blob = lzma.compress(path.read_bytes())
        if total + len(blob) > CACHE_BACK_MIB * 2**20:
            notes.append(f"compile cache {path.name} stays here: {len(blob) / 2**20:.1f} MiB "
                         f"compressed, over the {CACHE_BACK_MIB} MiB a reply brings back")
            continue
        total += len(blob)
        members.append((f"compile_cache/{slug(s.device)}/{path.name}.xz", blob))
        notes.append(f"compile cache {path.name}: {len(blob) / 2**20:.1f} MiB compressed, "
                     "sent back")
    return members, notes


def pack_out(s: Session, out: Path) -> list[str]:
    """Bundle 1 of the runner folder's carry-over (every record, and what the next session
    resumes from) and ``session.tar``, with the compile cache's new artifacts
    (:func:`compile_cache_back`); ``session.json`` says how many bundles the carry-over
    fills (:func:`send` writes the others). A partial run that does not fit the carry-over's
    bundles whole could come back but never be carried on, so none of it is sent."""
    notes = []
    out.mkdir(parents=True, exist_ok=True)
    bundles = 0
    try:  # session.tar is written whatever happens here
        if s.args.runner.is_dir():
            _, left, bundles = queue.carry_over(s.args.runner, out, int(s.carry * 2**20),
                                                s.bundles, which=[1])
            notes += [f"{unit} stays here: over the {s.carry * s.bundles:g} MiB carried on"
                      for unit in left]
            if bundles > 1:
                notes.append(f"the carry-over fills {bundles} bundles: send the others back, "
                             "each in a call of its own: "
                             + ", ".join(SEND.format(k=k) for k in range(2, bundles + 1)))
    except Exception as e:  # noqa: BLE001 (named in session.json)
        notes.append(f"packing the runner folder failed: {type(e).__name__}: {e}")
    cache = []
    try:
        cache, cache_notes = compile_cache_back(s)
        notes += cache_notes
    except Exception as e:  # noqa: BLE001 (named in session.json)
        notes.append(f"packing the compile cache failed: {type(e).__name__}: {e}")
    atomic_write_json(s.work / "session.json", {
        "device": s.device, "started": s.args.started, "minutes": s.args.minutes,
        "only": s.args.only, "carry_mib": s.carry, "carry_bundles": s.bundles,
        "bundles": bundles, "steps": s.log, "notes": notes})
    with tarfile.open(out / "session.tar", "w") as tar:
        for name in ("session.json", "results", "logs"):
            if (s.work / name).exists():
                tar.add(s.work / name, arcname=name)
        for name, blob in cache:
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return notes


SEND = "`python benchmarks/gpu_session.py send --bundle {k} --out $OUT`"


def send(args) -> list[Path]:
    """``send``: bundle ``--bundle`` of the carry-over that the last command packed (its
    ``session.json`` gives the bundles' size and count), into ``--out``; the runner folder has
    not changed since, so the bundle belongs to the same pack as bundle 1."""
    work = Path(args.work) / "session.json"
    try:
        summary = json.loads(work.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{work}: no session here (send runs after `run`, on the same "
                        "machine)") from None
    if not 2 <= args.bundle <= summary.get("bundles", 1):
        raise UserError(f"{work}: the carry-over fills {summary.get('bundles', 1)} bundle(s); "
                        f"bundle {args.bundle} is not one to send")
    queue.carry_over(args.runner, Path(args.out), int(summary["carry_mib"] * 2**20),
                     summary["bundles"], which=[args.bundle])
    folder = queue.bundle_folder(Path(args.out), args.bundle)
    print(f"{folder}: bundle {args.bundle} of {summary['bundles']}")
    return sorted(folder.iterdir())


def fresh_work(work: Path) -> Path:
    """The command's folder, emptied but for the benchmark files of a command before it on
    this machine (a warm machine's second command, ``--steps train``, reads what the first
    measured: which readers replay their steps as CUDA graphs, :func:`graphed`); they go back
    again in this command's ``session.tar``, which import takes as the newer."""
    for path in work.iterdir() if work.is_dir() else ():
        if path.name != "results":
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    for sub in ("results", "logs"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    return work


def session(args) -> dict:
    """``run``: every step in turn, then the files to take back."""
    from mrc_lib.train import device_name, resolve_device

    args.started = datetime.now(UTC).isoformat(timespec="seconds")
    work = fresh_work(Path(args.work))
    s = Session(args, device_name(resolve_device("cpu" if args.tiny else "cuda")), work,
                Path(args.results), time.time() + 60 * args.minutes)
    try:  # without its data or carry-over a run fails or starts over; the benchmarks still run
        if args.travel and Path(args.travel).is_file():
            info = json.loads(travel_info(Path(args.travel)).read_text())
            s.carry, s.bundles = info["carry_mib"], info.get("bundles", 1)
            s.env["MRC_CACHE_DIR"] = str(work / "cache")
            s.log.append({"step": "data",
                          "state": unpack_travel(Path(args.travel), work / "cache")})
            s.log.append({"step": "compile cache", "state": seed_compile_cache(s)})
        restored = queue.restore(args.runner, carried(args), log=lambda line: None)
        s.log.append({"step": "inbox", "state": "unpacked" if restored else "nothing to unpack"})
    except Exception as e:  # noqa: BLE001 (named in session.json)
        s.log.append({"step": "data and inbox", "state": f"failed: {type(e).__name__}: {e}"})
    chosen = args.steps.split(",")
    for step in STEPS:
        if step.name in chosen:
            s.log.append(run_step(s, step))
            print(f"[{step.name}] {s.log[-1]['state']}", s.log[-1].get("why", ""), flush=True)
    notes = pack_out(s, Path(args.out))
    for note in notes:
        print(note)
    return {"device": s.device, "steps": s.log, "notes": notes}


# --- the CPU side -------------------------------------------------------------------------------


_READ: set[Path] | None = None  # the cache files read while prepare() records them


def _audit(event: str, event_args: tuple) -> None:
    """Note each file opened for reading while :data:`_READ` records."""
    if _READ is None or event != "open" or not isinstance(event_args[0], (str, os.PathLike)):
        return
    mode, flags = event_args[1], event_args[2]
    if (mode.startswith("r") and "+" not in mode) if mode else \
            not flags & (os.O_WRONLY | os.O_RDWR):
        _READ.add(Path(event_args[0]).resolve())


@functools.cache
def _install_audit() -> None:
    """Install :func:`_audit`, once per process (an audit hook cannot be removed)."""
    sys.addaudithook(_audit)


def travel_files(jobs: list[queue.Job], log=print) -> set[Path]:
    """The cache files that loading ``jobs``' data reads (building what the cache lacks), in
    folders that hold a ``meta.json``, with those ``meta.json``."""
    global _READ
    from mrc_lib.data.sources import cache_root

    root = cache_root().resolve()
    _READ = set()
    _install_audit()
    try:
        queue.prepare(jobs, log=log)
        read = {p for p in _READ if p.is_relative_to(root) and p.is_file()
                and (p.parent / "meta.json").is_file()}
    finally:
        _READ = None
    return read | {p.parent / "meta.json" for p in read}


def write_travel(jobs: list[queue.Job], travel: Path, log=print,
                 cache: Path | None = None) -> float:
    """Write the cache files that ``jobs``' data reads to ``travel``, with the texts of each
    split read (``X.json.gz`` beside ``X.npz``), which evaluation reads; SQuAD's training
    texts only where a multi-passage run builds its data from them; and the compile cache's
    files (``cache``, its folders per GPU) under ``compile_cache/``. Return its MiB."""
    from mrc_lib.data.sources import cache_root

    root = cache_root().resolve()
    files = travel_files(jobs, log)
    texts = any("passages" in job.config().data_options for job in jobs)
    for path in list(files):
        text = path.with_name(path.name.removesuffix(".npz") + ".json.gz")
        if path.suffix == ".npz" and text.is_file() and (texts or text.name != "train.json.gz"):
            files.add(text)
    travel.parent.mkdir(parents=True, exist_ok=True)
    part = travel.with_name(travel.name + ".part")
    with tarfile.open(part, "w:xz", preset=6) as tar:  # xz: 4-7 MiB less than gzip
        for path in sorted(files):
            blob = stored(path)
            info = tarfile.TarInfo(str(path.relative_to(root)))
            info.size, info.mtime = len(blob), int(path.stat().st_mtime)
            tar.addfile(info, io.BytesIO(blob))
        if cache is not None:
            tar.add(cache, arcname="compile_cache")
    part.replace(travel)
    return travel.stat().st_size / 2**20


def stored(path: Path) -> bytes:
    """``path``'s bytes, with an ``.npz`` or ``.gz`` file's deflated members stored instead
    (the same arrays and texts, read the same way), so that xz packs what deflate cannot:
    SQuAD's data files 2.5-3 MiB smaller."""
    if path.suffix == ".npz":
        buffer = io.BytesIO()
        with np.load(path, allow_pickle=True) as arrays:
            np.savez(buffer, **{name: arrays[name] for name in arrays.files})
        return buffer.getvalue()
    if path.suffix == ".gz":
        return gzip.compress(gzip.decompress(path.read_bytes()), compresslevel=0, mtime=0)
    return path.read_bytes()


def carry_mib(tree: float) -> float:
    """The MiB of each bundle of runner folder that a session sends on to the next: what one
    call carries, less the tree (``tree`` MiB now, and :data:`GROWTH_MIB` for what this
    session's import adds). The data need not fit beside it: where the two do not fit one
    call, the data goes to the warm machine in a call of its own first (:func:`calls_for`)."""
    mib = math.floor(10 * (TRAVEL_MIB - tree - GROWTH_MIB)) / 10
    return min(mib, queue.PACK_BUDGET / 2**20)  # and what comes back from one command


def calls_for(travel: Path, travel_mib: float, staged: Path, tree: float) -> list[list[str]]:
    """The device tool's calls of a session, as the ``carry`` list of each: the data
    (``travel`` and its :func:`travel_info`) and each bundle of the carry-over ``staged`` (if
    any), as few calls as hold them beside the tree (the largest first, each into the first
    call with room), the command going in the last. A warm machine keeps what an earlier call
    carried (a path that a call does not name)."""
    items = [([rel(travel), rel(travel_info(travel))], travel_mib)]
    items += [([rel(folder)], folder_mib(folder)) for folder in queue.bundles_in(staged)]
    calls: list[list[int]] = []  # the items of each call
    for k in sorted(range(len(items)), key=lambda k: -items[k][1]):
        call = next((c for c in calls if sum(items[j][1] for j in c) + items[k][1]
                     <= TRAVEL_MIB - tree), None)
        if call is None:
            calls.append(call := [])
        call.append(k)
    return [[path for k in sorted(call) for path in items[k][0]] for call in calls]


def folder_mib(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


def rel(path: Path) -> str:
    """``path`` as the device tool's ``carry`` names it: from the repository's root."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def stage(folder: Path, staged: Path) -> float:
    """Move the committed ``folder`` out of the tree to ``staged`` (replacing what an earlier
    prepare left there), where a call carries it apart from the tree; return its MiB (0:
    none). The carry-over (``runs/inbox``) travels as a path of its own, and import puts the
    next one in its place, or this one back; the compile cache travels in the data file, and
    import puts it back with what the session added."""
    if folder.is_dir() and any(p.is_file() for p in folder.rglob("*")):
        shutil.rmtree(staged, ignore_errors=True)
        staged.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(folder, staged)
    return folder_mib(staged) if staged.is_dir() else 0.0


def carried(args) -> Path:
    """Where the carry-over reached this machine: ``--staged``, where ``prepare`` moved it and
    a call carried it, else the tree's ``--inbox``."""
    return Path(args.staged) if queue.bundles_in(Path(args.staged)) else args.inbox


def travel_info(travel: Path) -> Path:
    """The file beside the data file where ``prepare`` writes the sizes and the carry-over,
    for ``run``: the tree is measured here, with git, and this file travels with the data."""
    return travel.with_name("travel.json")


def prepare(args) -> Path:
    """``prepare``: load the selected runs' data here and write the cache files that loading
    reads to ``--travel`` (:func:`write_travel`); check that it fits a command beside the tree
    and a carry-over, and name the selected runs that sessions never start."""
    jobs = queue.select(queue.load_queue(args.queue_file), args.only)
    travel = Path(args.travel)
    cache = stage(args.compile_cache, args.staged_cache)
    mib = write_travel(jobs, travel, cache=args.staged_cache if cache else None)
    tree = tree_mib(args.inbox, args.compile_cache)
    carry = carry_mib(tree)
    staged = stage(args.inbox, Path(args.staged))
    calls = calls_for(travel, mib, Path(args.staged), tree)
    atomic_write_json(travel_info(travel), {"travel_mib": round(mib, 2), "tree_mib": round(
        tree, 2), "growth_mib": GROWTH_MIB, "carry_mib": carry, "bundles": args.bundles,
        "staged_mib": round(staged, 2), "compile_cache_mib": round(cache, 2), "calls": calls,
        "only": args.only})
    print(f"{travel} and {travel_info(travel).name}: {mib:.1f} MiB, the compile cache "
          f"{cache:.1f} MiB of it; the carry-over "
          f"{staged:.1f} MiB ({args.staged}); the tree {tree:.1f} MiB without them, and "
          f"{GROWTH_MIB:g} for the records the import adds; {TRAVEL_MIB} MiB a call; this "
          f"session sends on at most {args.bundles} bundle(s) of {carry:g} MiB")
    if tree + mib > TRAVEL_MIB:
        raise UserError(f"{travel}: {mib:.1f} MiB of data does not fit a call beside the "
                        f"{tree:.1f} MiB tree: select runs of fewer datasets with --only")
    for k, paths in enumerate(calls, 1):
        what = "the command" if k == len(calls) else "a call before it (command: true)"
        print(f"call {k} of {len(calls)}, {what}: carry {json.dumps(paths)}")
    for job, size in queue.stranded(jobs, carry * args.bundles, args.profile):
        print(f"never started: {job.key} (~{job.entry.minutes:g} min, longer than a command; "
              f"its {size / 2**20:.1f} MiB checkpoint does not fit the carry-over)")
    return travel


def tree_mib(*staged: Path) -> float:
    """The MiB of the working tree that a command carries (tracked files, and untracked ones
    git does not ignore), without the ``staged`` folders, which prepare moves out of it (the
    carry-over, the compile cache)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=ROOT, capture_output=True, check=True)
    paths = [ROOT / name for name in listed.stdout.decode().split("\0") if name]
    return sum(p.stat().st_size for p in paths if p.is_file() and not any(
        p.resolve().is_relative_to(folder.resolve()) for folder in staged)) / 2**20


def plan(args) -> dict:
    """``plan``: every queue run's checkpoint, the data it travels with and its fate in
    sessions of one command (:data:`FATES`), to ``--plan``."""
    jobs = queue.load_queue(args.queue_file)
    groups: dict[str, list[queue.Job]] = {}
    for job in jobs:
        groups.setdefault(queue.data_key(job.config(args.profile)), []).append(job)
    runs, chapters = {}, {}
    scratch = Path(args.work) / "plan.tar.xz"
    tree = tree_mib(args.inbox, args.compile_cache)
    carry = carry_mib(tree) * args.bundles
    for group in groups.values():
        mib = write_travel(group, scratch, log=lambda line: None)
        for job in group:
            size = queue.checkpoint_size(job, args.profile)
            fate = queue.fate(job, size, carry)
            history = history_mib(job, size)
            runs[job.key] = {"priority": job.priority, "minutes": job.entry.minutes,
                             "checkpoint_mib": round(size / 2**20, 1),
                             "travel_mib": round(mib, 1), "carry_mib": carry, "fate": fate,
                             "history_mib": history}
            total = chapters.setdefault(job.entry.chapter, {"runs": 0, "minutes": 0.0,
                                                            "history_mib": 0.0})
            for key in ("runs", fate):
                total[key] = total.get(key, 0) + 1
            for key in ("minutes", f"{fate}_minutes"):
                total[key] = total.get(key, 0.0) + job.entry.minutes
            total["history_mib"] = round(total["history_mib"] + history, 1)
            print(f"{job.key}: ~{job.entry.minutes:g} min, {size / 2**20:.1f} MiB, data "
                  f"{mib:.1f} MiB, carry-over {carry:g} MiB: {fate}", flush=True)
    scratch.unlink(missing_ok=True)
    result = {"what": FATES, "command_minutes": queue.COMMAND_MINUTES,
              "travel_mib": TRAVEL_MIB, "tree_mib": round(tree, 1), "growth_mib": GROWTH_MIB,
              "bundles": args.bundles, "profile": args.profile,
              "runs": {key: runs[key] for key in sorted(runs)}, "chapters": chapters}
    atomic_write_json(args.plan, result)
    print(args.plan)
    return result


def history_mib(job: queue.Job, size: int) -> float:
    """The MiB that ``job``'s carry-overs add to the repository's history: its checkpoint
    (``size`` bytes), committed in ``runs/inbox`` after each session that cuts it, one fewer
    than the commands its estimate spans (:data:`mrc_lib.queue.COMMAND_MINUTES` each)."""
    cuts = math.ceil(job.entry.minutes / queue.COMMAND_MINUTES) - 1
    return round(cuts * size / 2**20, 1)


FATES = ("each queue run's estimated H100 minutes; its checkpoint's MiB; the MiB of its data "
         "file alone (prepare); the carry-over, its bundles together (each what one call "
         "carries beside the tree; the data goes to the warm machine in a call of its own "
         "where it does not fit beside one); and its fate in sessions of one command: command "
         "(it ends within one), carried (it is longer and its checkpoint fits the carry-over: "
         "it resumes from session to session) or stranded (neither: a session never starts "
         "it); and the MiB its carry-overs add to the history of runs/inbox, its checkpoint "
         "once per session that cuts it (history_mib)")


def unused(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``... where that is taken (two imports in a second)."""
    k = 1
    while (found := path if k == 1 else path.with_name(f"{path.name}-{k}")).exists():
        k += 1
    return found


def import_session(args) -> list[str]:
    """``import``: keep what came back outside the repository (the command's reply, then each
    ``send``'s), copy the benchmark files into ``benchmarks/results``, unpack the bundles into
    the runner folder, import its records into ``book/runs`` (and rewrite
    ``book/full_runs.md`` from them) and make ``runs/inbox`` the carry-over of the next
    session."""
    sources = [Path(source) for source in args.source]
    keep = Path(args.keep) if args.keep else unused(ROOT.parent / "back" / datetime.now(
        UTC).strftime("%Y%m%dT%H%M%S"))
    if not (sources[0] / "session.tar").is_file():
        raise UserError(f"{sources[0]}: no session.tar (not what `gpu_session.py run` wrote)")
    for source in sources[1:]:
        if (source / "session.tar").is_file():
            raise UserError(f"{source}: another command's reply (import each command's on "
                            "its own, the first first, with the sends that followed it)")
    for source in sources:
        shutil.copytree(source, keep, dirs_exist_ok=True)
    with tarfile.open(keep / "session.tar") as tar:
        tar.extractall(keep / "session", filter="data")
    summary = json.loads((keep / "session" / "session.json").read_text(encoding="utf-8"))
    lines = [f"{summary['device']}, {summary['started']}: kept in {keep}"]
    lines += [f"  {step['step']}: {step['state']} {step.get('why', '')}".rstrip()
              for step in summary["steps"]]
    lines += [f"  {note}" for note in summary.get("notes", [])]
    results = Path(args.results)
    for path in sorted((keep / "session" / "results").glob("*.json")):
        shutil.copyfile(path, results / path.name)
        lines.append(f"benchmark {results / path.name}")
    lines += import_compile_cache(keep / "session" / "compile_cache", args.compile_cache,
                                  args.staged_cache)
    bundles, staged = queue.bundles_in(keep), Path(args.staged)
    sent = queue.bundles_in(staged)
    if not bundles and sent and not args.inbox.exists():
        shutil.move(staged, args.inbox)  # nothing came back: the carry-over sent still holds
        lines.append(f"no bundle came back: {args.inbox} is the carry-over that was sent")
    if bundles:
        if sent:  # where the session began: a run that did not come back whole goes on there
            queue.unpack(sent, args.runner)
        left_out = queue.unpack(bundles, args.runner)[1]
        lines += [f"record {p}" for p in queue.import_records(args.runner)]
        lines += [f"not brought back: {unit}" for unit in left_out]
        shutil.rmtree(args.inbox, ignore_errors=True)
        carry = summary.get("carry_mib", queue.CARRY_MIB)
        # The partial runs alone: book/runs, which travels with the tree, has every record.
        # Cut unit by unit: git stores a run that has not changed since once.
        kept, _, n = queue.carry_over(args.runner, args.inbox, int(carry * 2**20),
                                      summary.get("carry_bundles", 1), records=False,
                                      by_unit=True)
        shutil.rmtree(staged, ignore_errors=True)  # the carry-over it was sent is spent
        if kept:
            lines.append(f"carry-over {args.inbox} ({n} bundle(s)): commit it")
        else:
            shutil.rmtree(args.inbox)
            lines.append(f"no partial run: no carry-over ({args.inbox} removed)")
    page = book.write_full_runs(queue_file=args.queue_file, results_dir=results)
    return [*lines, f"page {page}: commit it"]


def import_compile_cache(back: Path, cache: Path, staged: Path) -> list[str]:
    """Put the compile cache that prepare moved out (``staged``) back in the tree (``cache``),
    and beside it the artifacts that the session wrote anew (``back``, a folder per GPU); a
    file of the same name already there stays (it was loaded, not compiled again)."""
    if staged.is_dir() and not cache.exists():
        shutil.move(staged, cache)
    shutil.rmtree(staged, ignore_errors=True)
    lines = []
    for path in sorted(back.glob("*/*.bin.xz")):
        dest = cache / path.parent.name / path.name
        if not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest)
            lines.append(f"compile cache {dest}: commit it")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("action", choices=["prepare", "run", "send", "import", "plan"])
    p.add_argument("source", nargs="*", help="import: the folders the device tool's files lie "
                   "in, the command's first, then each send's")
    p.add_argument("--only", action="append", metavar="GLOB",
                   help="the queue runs to prepare and train (repeatable)")
    p.add_argument("--out", help="run, send: where the files to take back go ($OUT)")
    p.add_argument("--bundle", type=int, default=2, help="send: which bundle of the "
                   "carry-over")
    p.add_argument("--bundles", type=int, default=CARRY_BUNDLES, help="prepare, plan: the "
                   "bundles the carry-over may fill, each a call each way")
    p.add_argument("--minutes", type=float, default=8.5,
                   help="run: the session's wall clock, packing included")
    p.add_argument("--steps", default=",".join(step.name for step in STEPS),
                   help="run: the steps to consider, comma-separated")
    p.add_argument("--parallel", type=int, default=None,
                   help="train: processes (default: the packing benchmark's, else 2)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="train: how every run is computed (queue run --set)")
    p.add_argument("--travel", default=str(TRAVEL), help="the data file (prepare writes it)")
    p.add_argument("--keep", default=None, help="import: where to keep what came back "
                   "(default ../back/<time>)")
    p.add_argument("--tiny", action="store_true", help="the script's own check, on a CPU")
    p.add_argument("--queue-file", default=str(queue.QUEUE_FILE), help=argparse.SUPPRESS)
    p.add_argument("--profile", default="full", help=argparse.SUPPRESS)
    p.add_argument("--results", default=str(RESULTS), help=argparse.SUPPRESS)
    p.add_argument("--runner", type=Path, default=RUNNER, help=argparse.SUPPRESS)
    p.add_argument("--inbox", type=Path, default=INBOX, help=argparse.SUPPRESS)
    p.add_argument("--staged", type=Path, default=STAGED, help=argparse.SUPPRESS)
    p.add_argument("--compile-cache", type=Path, default=COMPILE_CACHE, help=argparse.SUPPRESS)
    p.add_argument("--staged-cache", type=Path, default=STAGED_CACHE, help=argparse.SUPPRESS)
    p.add_argument("--work", default=str(WORK), help=argparse.SUPPRESS)
    p.add_argument("--plan", default=str(queue.PLAN), help="plan: where it goes")
    args = p.parse_args(argv)
    try:
        if args.action == "prepare":
            return prepare(args)
        if args.action == "plan":
            return plan(args)
        if args.action in ("run", "send"):
            if not args.out:
                p.error(f"{args.action} needs --out (the device tool's $OUT)")
            return session(args) if args.action == "run" else send(args)
        if not args.source:
            p.error("import needs the folder the device tool's files lie in")
        lines = import_session(args)
        print("\n".join(lines))
        return lines
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
