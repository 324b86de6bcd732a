"""The queue of full-profile runs (``mrc_lib/queue.yaml``) and the packed runner.

    python -m mrc_lib queue [--out DIR]                      # done / partial / missing
                                                             # (and the measurements)
    python -m mrc_lib queue prepare                          # the data, into the cache
    python -m mrc_lib queue run --minutes M --out DIR [--parallel N] [--only GLOB] [--inbox DEST]
                                [--set compile=true] [--carry-mib C] [--graphed READERS]
    python -m mrc_lib queue pack --out DIR --to DEST [--bundle K]   # DIR -> bundle K
    python -m mrc_lib queue unpack --from DEST... --out DIR   # the bundles -> DIR
    python -m mrc_lib queue import --out DIR                  # DIR's records -> book/runs
    python -m mrc_lib queue verify                            # chapters build these configs?
    python -m mrc_lib queue estimates [--write]               # estimates against the bring-up
    python -m mrc_lib queue rehearse --to DIR                 # every chapter at full, stand-ins

The file lists, per chapter, every run the full book needs (its header documents the keys);
:func:`load_queue` checks it and reports a bad entry in one line naming the file and entry.

``queue run`` trains the highest-priority runs without a finished record (partial runs first,
within a priority) as ``N`` concurrent worker processes on one device, starting the next as one
ends, until ``M`` minutes minus ``--reserve`` seconds; each worker's trainer checkpoints and stops
cleanly at that deadline (checked between steps), and the same command on the same ``DIR``
resumes it exactly (``--carry-mib``: where ``DIR`` reaches the next command only as a
carry-over of at most ``C`` MiB, a run that will be cut starts only if its checkpoint fits it,
see :func:`startable`). ``DIR`` holds ``<chapter>/<run>/`` (the run folder: checkpoint parts,
log, ``status.json``) and ``records/<chapter>/<run>.json``, the record of each run as it last
stopped (``complete`` says whether it finished: a partial record keeps the dev scores of the
epochs a GPU ran even when the checkpoint cannot travel on). Every entry's
data follows from its config (multi-passage SQuAD and Wiki-cloze subsets are data options), so
every run the book needs is a packed run. ``--only`` keeps the runs whose ``<chapter>/<run>``
matches a pattern (a command runs only the runs whose data it carries); ``--inbox`` unpacks
the bundles in ``DEST`` first when ``DIR`` does not exist yet, i.e. on a machine that starts
bare, so a command resumes whether or not the machine kept the last one's folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from mrc_lib import records
from mrc_lib.errors import UserError
from mrc_lib.utils import (
    atomic_write_bytes,
    atomic_write_json,
    cut_parts,
    join_parts,
    on_stop_signals,
    select_keys,
    slug,
)

QUEUE_FILE = Path(__file__).parent / "queue.yaml"
PACKING_RESULTS = records.ROOT / "benchmarks" / "results"  # benchmarks/gpu_packing.py's output
PLAN = PACKING_RESULTS / "session_plan.json"  # benchmarks/gpu_session.py plan's output
ESTIMATES = PACKING_RESULTS / "queue_estimates.json"  # the last `queue estimates --write`
EXTRA_SEED_PRIORITY = 3  # seeds after an entry's first are extra seeds
PIECE_BYTES = 15 * 2**20
PACK_BUDGET = 60 * 2**20  # what may come back from the GPU machine per command
COMMAND_MINUTES = 9.0  # the most one GPU command trains (10 minutes, less start and pack)
# What one command's runner folder may carry on to the next GPU session's (one bundle) where
# its data is not carried: a session with a data file takes what one call carries beside the
# tree per bundle (benchmarks/gpu_session.py carry_mib: 56 MiB, the data going in a call of
# its own), and CARRY_BUNDLES bundles.
CARRY_MIB = 29
LEFT_BEHIND = ("model.pt", "predictions.json", "na_prob.json", "vocab")  # rebuilt or not needed


@dataclass(frozen=True)
class Entry:
    """One entry of the queue file (see its header)."""

    chapter: str
    run: str
    model: str
    priority: int
    minutes: float
    schedule: str
    dataset: str = "squad-v1.1"
    overrides: tuple[str, ...] = ()
    smoke_overrides: tuple[str, ...] = ()
    seeds: tuple[int, ...] = (0,)
    note: str = ""


@dataclass(frozen=True)
class Job:
    """One seed of an entry: one run, one record."""

    entry: Entry
    seed: int
    priority: int

    @property
    def name(self) -> str:
        return self.entry.run.replace("{seed}", str(self.seed))

    @property
    def key(self) -> str:
        return f"{self.entry.chapter}/{self.name}"

    def config(self, profile: str = "full", settings: tuple[str, ...] = ()):
        """The run's config at ``profile`` (the entry's ``smoke_overrides`` too at smoke), with
        ``settings`` (``KEY=VALUE`` of keys that leave the config hash alone, see
        :func:`check_settings`)."""
        from mrc_lib.config import resolve_config

        e = self.entry
        smoke = e.smoke_overrides if profile == "smoke" else ()
        return resolve_config(e.model, e.dataset, profile,
                              overrides=[*e.overrides, *smoke, f"seed={self.seed}", *settings])


# What `queue run --graphed` sets for a reader whose step replays as CUDA graphs
# (benchmarks/gpu_bringup.py --cuda-graphs): one recording per batch shape, and the lengths
# padded to a multiple of 16, at which an epoch of SQuAD v1.1 has 47 shapes for 5% more
# context positions (benchmarks/results/padding_squad.json).
GRAPH_SETTINGS = ("cuda_graphs=true", "pad_multiple=16")


# Workers that share a GPU each get this share of its memory, less HEADROOM for the CUDA
# contexts, which no allocator counts (mrc_lib.train.GPU_SHARE).
HEADROOM = 0.05


def worker_env(job: Job, parallel: int, graphed: Collection[str]) -> dict[str, str]:
    """The environment of ``job``'s worker among ``parallel`` on one GPU: its share of the
    GPU's memory, and, where its steps run eagerly, expandable segments, which map the
    tensors of changing batch shapes into one growing segment rather than caching a segment
    per size (PyTorch's advice for memory reserved but unallocated; a recorded step's pool is
    left as the bring-up measured it). A variable already set is kept."""
    from mrc_lib.train import GPU_SHARE

    env = dict(os.environ)
    if parallel > 1:
        env.setdefault(GPU_SHARE, f"{(1 - HEADROOM) / parallel:.4f}")
    if job.entry.model not in graphed:
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return env


def check_settings(settings: list[str] | None) -> tuple[str, ...]:
    """``queue run --set KEY=VALUE`` may change only how a run is computed, never what: the keys
    that the config hash leaves out (:data:`mrc_lib.records.UNHASHED`), so that the chapter
    still finds the record."""
    for setting in settings or ():
        key = setting.partition("=")[0]
        if key not in records.UNHASHED:
            raise UserError(f"queue run --set {setting}: only {', '.join(records.UNHASHED)} "
                            "may differ from the config the chapter builds")
    return tuple(settings or ())


def _entry(path: Path, chapter: str, k: int, item) -> Entry:
    where = f"{path}: {chapter}[{k}]"
    if not isinstance(item, dict):
        raise UserError(f"{where}: an entry is a mapping of {', '.join(_fields())}")
    unknown = sorted(set(item) - set(_fields()))
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)}; known: "
                        f"{', '.join(_fields())}")
    try:
        entry = Entry(chapter=chapter, **{
            **item, "overrides": tuple(item.get("overrides", ())),
            "smoke_overrides": tuple(item.get("smoke_overrides", ())),
            "seeds": tuple(item.get("seeds", (0,)))})
    except TypeError as e:
        raise UserError(f"{where}: {e}") from None
    where = f"{where} ({entry.run})"
    if entry.priority not in (1, 2, 3) or not entry.seeds:
        raise UserError(f"{where}: priority must be 1, 2 or 3 and seeds a non-empty list")
    if len(entry.seeds) > 1 and "{seed}" not in entry.run:
        raise UserError(f"{where}: several seeds need '{{seed}}' in the run name")
    _check_model(where, entry)
    return entry


def _fields() -> list[str]:
    return [f.name for f in dataclasses.fields(Entry) if f.name != "chapter"]


def _check_model(where: str, entry: Entry) -> None:
    from mrc_lib.models import MODELS

    if entry.model not in MODELS:
        raise UserError(f"{where}: unknown model {entry.model!r}; known: "
                        f"{', '.join(sorted(MODELS))}")
    try:
        Job(entry, entry.seeds[0], entry.priority).config()
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


def load_queue(path: str | Path = QUEUE_FILE) -> list[Job]:
    """Every job of the queue file, checked (a bad entry is a :class:`UserError`)."""
    from mrc_lib.config import read_mapping

    path = Path(path)
    sections = read_mapping(path, "queue", of="chapter -> list of entries")
    jobs = []
    for chapter, items in sections.items():
        if not isinstance(items, list):
            raise UserError(f"{path}: {chapter}: expected a list of entries")
        for k, item in enumerate(items):
            entry = _entry(path, chapter, k, item)
            jobs += [Job(entry, s, entry.priority if i == 0 else
                         max(entry.priority, EXTRA_SEED_PRIORITY))
                     for i, s in enumerate(entry.seeds)]
    names = [j.key for j in jobs]
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        raise UserError(f"{path}: run names used twice: {', '.join(dupes)}")
    return jobs


def select(jobs: list[Job], patterns: list[str] | None) -> list[Job]:
    """The jobs whose ``<chapter>/<run>`` matches one of the shell ``patterns`` (all jobs
    without patterns); a pattern that matches no job is an error, as a typo would be."""
    return select_keys(jobs, patterns, "run of the queue")


# --- estimates against the bring-up ------------------------------------------------------------

# Each SQuAD training set's questions (their prepared caches' meta.json): SQuAD v1.1 train, and
# the offline SQuAD 2.0 set (mrc_lib.data.squad2: v1.1 train, an unanswerable question for
# every other one, and the adapt half of v2.0 dev).
TRAIN_QUESTIONS = {"squad-v1.1": 87_599, "squad-v2.0": 137_335}
EVALUATION = 1.1  # the evaluations after each epoch, against training alone


def bringup_speeds(folder: Path = PACKING_RESULTS, chip: str = "GH100") -> dict[str, float]:
    """Each reader's seconds per SQuAD v1.1 train epoch (400 context tokens, eager, alone on
    the GPU) in the bring-ups (``gpu_<device>.json``, benchmarks/gpu_bringup.py) of ``chip``'s
    GPUs that measured the readers' code and config of today; the slowest GPU's where several
    did."""
    from mrc_lib import bench

    speeds: dict[str, float] = {}
    for device in CHIPS[chip]:
        path = folder / f"gpu_{slug(device)}.json"
        models = json.loads(path.read_text())["models"] if path.is_file() else {}
        for name, entry in models.items():
            if entry.get("epoch_seconds") and bench.same_code(entry) and \
                    entry.get("config_hash") == bench.reader_hash(name):
                speeds[name] = max(speeds.get(name, 0.0), entry["epoch_seconds"])
    return speeds


def bringup_minutes(job: Job, speeds: dict[str, float]) -> float | None:
    """The minutes of ``job``'s schedule at the speed the bring-up measured for its reader's
    default architecture (``speeds``, :func:`bringup_speeds`): its epochs of its training set
    at the measured seconds per SQuAD v1.1 epoch, plus evaluations; ``None`` where the
    bring-up has no speed for the reader or the data is not SQuAD. A floor more than an
    estimate: the run's overrides and the sharing of the GPU by packed runs are not in it."""
    cfg = job.config()
    if cfg.model not in speeds or cfg.dataset not in TRAIN_QUESTIONS:
        return None
    epochs = cfg.epochs * TRAIN_QUESTIONS[cfg.dataset] / TRAIN_QUESTIONS["squad-v1.1"]
    return EVALUATION * epochs * speeds[cfg.model] / 60


def families(jobs: list[Job]) -> dict[tuple[str, str], list[Entry]]:
    """The queue's entries by reader and dataset, each family in file order."""
    found: dict[tuple[str, str], list[Entry]] = {}
    for job in jobs:
        if job.seed == job.entry.seeds[0]:
            cfg = job.config()
            found.setdefault((cfg.model, cfg.dataset), []).append(job.entry)
    return found


def headline(family: list[Entry]) -> Entry:
    """A family's headline run: its first entry of the highest priority."""
    return min(family, key=lambda e: e.priority)


def calibration(jobs: list[Job], speeds: dict[str, float]) -> dict[tuple[str, str], dict]:
    """For each family whose reader the bring-up measured on SQuAD: its headline run, that
    run's estimate and its bring-up floor (:func:`bringup_minutes`), and the factor that
    lifts the family's estimates so the headline's meets its floor (1 where it does)."""
    out = {}
    for key, family in families(jobs).items():
        head = headline(family)
        floor = bringup_minutes(Job(head, head.seeds[0], head.priority), speeds)
        if floor is not None:
            out[key] = {"headline": f"{head.chapter}/{head.run}", "minutes": head.minutes,
                        "floor": round(floor, 1), "factor": max(1.0, floor / head.minutes)}
    return out


def raise_estimates(path: Path, jobs: list[Job], speeds: dict[str, float]) -> list[str]:
    """Rewrite the queue file at ``path`` so that no family's headline estimate is below its
    bring-up floor (:func:`calibration`): every entry of such a family has its ``minutes``
    multiplied by the family's factor, rounded up; the rest of the file is left as it is.
    Returns one line per entry changed."""
    factors = {key: c["factor"] for key, c in calibration(jobs, speeds).items()
               if c["factor"] > 1}
    lifted = {(e.chapter, e.run): math.ceil(e.minutes * factors[key])
              for key, family in families(jobs).items() if key in factors for e in family}
    text, changed, chapter = path.read_text(encoding="utf-8"), [], None
    starts = [m for m in re.finditer(r'^(\S+):$|^  - \{run: "?([^",]+)"?', text, re.M)]
    pieces, at = [], 0
    for k, m in enumerate(starts):
        if m.group(1):
            chapter = m.group(1)
            continue
        new = lifted.get((chapter, m.group(2)))
        if new is None:
            continue
        end = starts[k + 1].start() if k + 1 < len(starts) else len(text)
        minutes = re.compile(r"minutes: ([0-9.]+)").search(text, m.start(), end)
        pieces += [text[at:minutes.start(1)], str(new)]
        at = minutes.end(1)
        changed.append(f"{chapter}/{m.group(2)}: {minutes.group(1)} -> {new} min")
    if changed:
        atomic_write_bytes(path, ("".join(pieces) + text[at:]).encode("utf-8"))
    return changed


def estimates_table(jobs: list[Job], speeds: dict[str, float]) -> str:
    """``queue estimates``: each family's headline estimate against its bring-up floor."""
    lines = [f"{'reader':18} {'dataset':11} {'s/epoch':>7} {'min':>5} {'floor':>6}  headline"]
    for (model, dataset), c in calibration(jobs, speeds).items():
        lines.append(f"{model:18} {dataset:11} {speeds[model]:7.1f} {c['minutes']:5g} "
                     f"{c['floor']:6.1f}  {c['headline']}" +
                     (f"  (below: x{c['factor']:.2f})" if c["factor"] > 1 else ""))
    return "\n".join(lines)


# --- where each job stands ---------------------------------------------------------------------


def record_of(job: Job, out: Path | None = None, profile: str = "full",
              complete: bool = True, runs: Path | None = None) -> dict | None:
    """The job's record of the same config, in ``runs`` (``book/runs``) or in
    ``out/records``: a finished run's (``complete``), else the most advanced partial one."""
    config_hash = records.config_hash(job.config(profile).to_dict())
    found = []
    for root in (runs or records.BOOK_RUNS, *([out / "records"] if out else [])):
        path = records.record_path(job.entry.chapter, job.name, root)
        if path.exists():
            record = records.read_record(path)
            if record["config_hash"] == config_hash and records.finished(record) == complete:
                found.append(record)
    return max(found, key=lambda r: r["steps"], default=None)


def progress_of(job: Job, out: Path | None) -> dict | None:
    """The ``status.json`` a worker left in the job's run folder, if any."""
    path = out / job.entry.chapter / job.name / "status.json" if out else None
    if path is None or not path.exists():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: corrupt run status: {e}") from None


def state_of(job: Job, out: Path | None, profile: str = "full",
             runs: Path | None = None) -> tuple[str, float]:
    """``(done | partial | missing, fraction done)``: partial when the runner folder holds the
    run's checkpoint (it resumes) or a partial record says how far a GPU took it (it restarts:
    the checkpoint stayed on that machine). Records are looked up in ``runs`` (``book/runs``)
    and ``out``."""
    if record_of(job, out, profile, runs=runs) is not None:
        return "done", 1.0
    status = progress_of(job, out)
    if status is not None:
        return "partial", min(status["fraction"], 0.99)
    record = record_of(job, out, profile, complete=False, runs=runs)
    if record is None:
        return "missing", 0.0
    return "partial", min(progress(record["steps"], record["epochs_run"], job.config(profile)),
                          0.99)


def status_table(jobs: list[Job], out: Path | None = None, profile: str = "full",
                 plan: Path = PLAN) -> str:
    """One line per job, with its fate in GPU sessions of one command where ``plan``
    (``benchmarks/gpu_session.py plan``) has it, then the GPU-minutes done and left, and what
    the carry-overs of the runs left would add to the repository's history (the plan's
    ``history_mib``, for the part of each run not done)."""
    planned = json.loads(plan.read_text())["runs"] if plan.is_file() else {}
    fates = {k: v["fate"] for k, v in planned.items()}
    lines = [f"{'state':9} {'prio':>4} {'min':>5}  {'fate':8}  run"]
    done = left = history = 0.0
    for job in sorted(jobs, key=lambda j: (j.entry.chapter, j.priority)):
        state, fraction = state_of(job, out, profile)
        done += job.entry.minutes * fraction
        left += job.entry.minutes * (1 - fraction)
        history += planned.get(job.key, {}).get("history_mib", 0.0) * (1 - fraction)
        lines.append(f"{state:9} {job.priority:>4} {job.entry.minutes:>5.0f}  "
                     f"{fates.get(job.key, '-'):8}  {job.key}")
    counts = {s: sum(line.startswith(s) for line in lines[1:])
              for s in ("done", "partial", "missing")}
    stranded = [j for j in jobs if fates.get(j.key) == "stranded"]
    if stranded:
        lines.append(f"{len(stranded)} stranded ({sum(j.entry.minutes for j in stranded):.0f}"
                     " min): longer than a GPU command, with checkpoints over the carry-over of "
                     f"a session ({plan.name}: more bundles, or a GPU that keeps the runner "
                     "folder)")
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()) +
                 f"; GPU-minutes (H100, estimated) done {done:.0f}, left {left:.0f}" +
                 (f"; their carry-overs add about {history / 1024:.1f} GiB to the history"
                  if history else ""))
    return "\n".join(lines)


# --- the packed runner -------------------------------------------------------------------------


def pending(jobs: list[Job], out: Path, profile: str = "full") -> list[Job]:
    """Jobs without a record, by priority, partial ones first, then in file order."""
    todo = [(j, state_of(j, out, profile)[0]) for j in jobs]
    todo = [(j, s) for j, s in todo if s in ("missing", "partial")]
    return [j for j, s in sorted(todo, key=lambda js: (js[0].priority, js[1] != "partial"))]


def work(job: Job, out: Path, deadline: float | None, profile: str = "full",
         settings: tuple[str, ...] = ()) -> dict:
    """Train ``job`` in ``out/<chapter>/<run>`` until it ends or ``deadline``; write its
    ``status.json`` and its record under ``out/records`` (partial until it is complete).
    A compiled run with :data:`mrc_lib.train.COMPILE_CACHE` set loads its graphs' cache
    artifacts from that folder first and writes them there after, unless on file.
    The status also gives the times (``time.time()``) at which the worker began, had its data
    and its trainer ended, and the record's ``wall_seconds`` (training and evaluation alone):
    the runner's log (:func:`run_queue`) shows from them where a worker's time went."""
    from mrc_lib import train as engine

    began = time.time()
    cfg = job.config(profile, settings)
    folder = out / job.entry.chapter / job.name
    data = engine.load_data(cfg)
    loaded = time.time()
    cache = os.environ.get(engine.COMPILE_CACHE) if cfg.compile else None
    if cache:
        key = engine.compile_key(cfg, engine.resolve_device(cfg.device))
        print("compile cache:", engine.load_compile_cache(Path(cache), key), flush=True)
    metrics = engine.train(cfg, folder, resume=(folder / "checkpoint.pt").exists(), data=data,
                           deadline=deadline, signals=True)
    if cache:
        print("compile cache:", engine.save_compile_cache(Path(cache), key), flush=True)
    trained = time.time()
    record = records.make_record(metrics, chapter=job.entry.chapter, run=job.name,
                                 log_path=folder / "log.jsonl")
    fraction = 1.0 if metrics["complete"] else progress(metrics["steps"],
                                                         metrics["epochs_run"], cfg)
    atomic_write_json(folder / "status.json", {
        "complete": metrics["complete"], "steps": metrics["steps"],
        "epochs_run": metrics["epochs_run"], "fraction": fraction,
        "times": {"began": began, "loaded": loaded, "trained": trained},
        "wall_seconds": record["wall_seconds"]})
    records.write_record(records.record_path(job.entry.chapter, job.name, out / "records"),
                         record)
    return metrics


def worker_times(status: dict | None, started: float, ended: float) -> str:
    """Where a worker started at ``started`` and seen ended at ``ended`` spent its time, from
    its ``status`` (:func:`work`): Python's start and the queue (``start``), the data, the
    trainer (building the reader, its steps, evaluations, checkpoints and analysis; the
    record's ``wall_seconds`` are its steps and evaluations) and what came after (the record,
    the exit); empty without the times (a worker that failed)."""
    times = (status or {}).get("times")
    if not times or times["began"] < started:  # none, or an earlier command's
        return ""
    return (f"; worker {ended - started:.1f} s: start {times['began'] - started:.1f}, data "
            f"{times['loaded'] - times['began']:.1f}, trainer "
            f"{times['trained'] - times['loaded']:.1f} (wall_seconds "
            f"{status['wall_seconds']:.1f}), after {ended - times['trained']:.1f}")


def progress(steps: int, epochs_run: int, cfg) -> float:
    """The fraction of its schedule a run has done: of ``max_steps``, else of its epochs."""
    return steps / cfg.max_steps if cfg.max_steps else epochs_run / cfg.epochs


def run_queue(jobs: list[Job], out: Path, minutes: float, parallel: int = 1,
              reserve: float = 60.0, profile: str = "full", queue_file: Path = QUEUE_FILE,
              settings: tuple[str, ...] = (), carry_mib: float | None = None,
              graphed: Collection[str] = (), log=print) -> dict[str, int]:
    """Run the pending jobs as ``parallel`` worker processes until ``minutes`` minus
    ``reserve`` seconds from now (the trainers' deadline), each with ``settings`` (and
    :data:`GRAPH_SETTINGS` where its reader is one of ``graphed``), starting
    only what :func:`startable` allows (with a :class:`Carry` of ``carry_mib`` when ``out``
    reaches the next command only as its carry-over); return each started job's exit status
    (0: complete or cleanly stopped). Each start and end is logged with the seconds since the
    call began: against the records' ``wall_seconds`` (the trainer's time), a log shows what
    each worker spent beside its trainer and how long a slot stood idle.

    SIGTERM or SIGINT (Ctrl-C) stops the runner as its deadline would: it starts nothing more
    and sends its workers SIGTERM, which stops each trainer after its step with a checkpoint
    (:func:`mrc_lib.train.stopped_by_signals`; a worker still loading its data ends at once),
    then waits for them. A second SIGINT interrupts at once."""
    began = time.time()
    deadline = began + 60 * minutes - reserve
    todo = pending(jobs, out, profile)
    carry = None if carry_mib is None else Carry(out, int(carry_mib * 2**20), profile)
    running: dict[str, tuple[subprocess.Popen, object]] = {}
    started: dict[str, float] = {}  # time.time() at each worker's start
    codes: dict[str, int] = {}
    stopping: list[str] = []  # the signals that came
    told: set[str] = set()  # the workers already sent SIGTERM

    def stop(signum, frame) -> None:
        name = signal.Signals(signum).name
        if name == "SIGINT" and name in stopping:
            raise KeyboardInterrupt
        stopping.append(name)

    out.mkdir(parents=True, exist_ok=True)
    with on_stop_signals(stop):
        while todo or running:
            while len(running) < parallel and time.time() < deadline and not stopping:
                left = (deadline - time.time()) / 60
                job = next((j for j in todo if startable(j, out, left, carry)), None)
                if job is None:
                    break
                todo.remove(job)
                log(f"start {job.key} (priority {job.priority}, ~{job.entry.minutes:.0f} min) "
                    f"at {time.time() - began:.0f} s")
                folder = out / job.entry.chapter / job.name
                folder.mkdir(parents=True, exist_ok=True)
                log_file = open(folder / "worker.log", "ab")  # noqa: SIM115 (closed when it ends)
                started[job.key] = time.time()
                running[job.key] = (subprocess.Popen(
                    [sys.executable, "-m", "mrc_lib", "queue", "work", "--out", str(out),
                     "--file", str(queue_file), "--job", job.key, "--deadline", str(deadline),
                     "--profile", profile, *(f"--set={s}" for s in settings),
                     *(f"--set={s}" for s in GRAPH_SETTINGS if job.entry.model in graphed)],
                    stdout=log_file, stderr=subprocess.STDOUT,
                    env=worker_env(job, parallel, graphed)), log_file)
            if not running:
                break
            time.sleep(0.2)
            for key, (proc, _) in running.items():
                if stopping and key not in told:
                    if not told:
                        log(f"{stopping[0]} at {time.time() - began:.0f} s: stopping the workers "
                            "with checkpoints")
                    proc.send_signal(signal.SIGTERM)
                    told.add(key)
            for key, (proc, log_file) in list(running.items()):
                if proc.poll() is not None:
                    codes[key] = proc.returncode
                    log_file.close()
                    del running[key]
                    job = find_job(jobs, key)
                    now = time.time()
                    log(f"{'ended' if proc.returncode == 0 else 'FAILED'} {key} "
                        f"(exit {proc.returncode}; log {out / key / 'worker.log'}) "
                        f"at {now - began:.0f} s"
                        + worker_times(progress_of(job, out), started[key], now))
                    if carry is not None and state_of(job, out, profile)[0] == "done":
                        carry.release(job)
    for job in todo:
        why = f"stopped by {stopping[0]}" if stopping else "too long for what was left"
        if carry is not None and job.key in carry.refused:
            why += (f", and its {carry.refused[job.key] / 2**20:.1f} MiB checkpoint would not "
                    f"fit the {carry_mib:g} MiB carried on")
        log(f"not started {job.key}: ~{job.entry.minutes:g} min, {why}")
    return codes


def startable(job: Job, out: Path, left: float, carry: Carry | None = None) -> bool:
    """Whether to start ``job`` with ``left`` minutes before the trainers' deadline.

    Without ``carry`` (the runner folder stays where it is): a run that resumes (its folder
    holds a checkpoint) starts, and so does one whose estimate is longer than a GPU command
    (:data:`COMMAND_MINUTES`: it goes on from its checkpoint in the next); a shorter one starts
    only if its estimate fits what is left. Cut, it would take its steps again in a later
    command unless its checkpoint travelled, and a shorter run may fit instead.

    With ``carry`` (the folder reaches the next command only as its carry-over, on a machine
    that starts bare): a run whose estimate, less what it has done, fits what is left starts;
    one that will be cut starts only if it is longer than a command and its checkpoint still
    fits the carry-over (:meth:`Carry.take`). Cut with a checkpoint left behind, its minutes
    would be lost; a shorter run ends within the next session's command anyway, and carrying
    its checkpoint would cost that session a call each way."""
    status = progress_of(job, out)
    if carry is None:
        return status is not None or job.entry.minutes > COMMAND_MINUTES or \
            job.entry.minutes <= left
    done = status["fraction"] if status is not None else 0.0
    return job.entry.minutes * (1 - done) <= left or (
        (status is not None or job.entry.minutes > COMMAND_MINUTES) and carry.take(job))


class Carry:
    """What the runner folder's carry-over (:func:`carry_over`: its bundles, at most
    ``budget`` bytes together) holds when a command ends: its records, the partial runs it
    found, and each run the command starts that will be cut, each with ``slack`` for what the
    command adds beside checkpoints (records, logs, tar headers)."""

    SLACK = 2**18

    def __init__(self, out: Path, budget: int, profile: str = "full",
                 slack: int = SLACK) -> None:
        self.budget, self.profile, self.slack = budget, profile, slack
        units = _units(out) if out.is_dir() else [("records", [])]
        self.held = {name: sum(p.stat().st_size for p in files) + slack
                     for name, files in units}
        self.refused: dict[str, int] = {}  # the runs take() turned down, with their sizes

    @property
    def used(self) -> int:
        return sum(self.held.values())

    def take(self, job: Job) -> bool:
        """Whether ``job``, cut, would be carried on: it is already held, or its checkpoint
        (:func:`checkpoint_size`) fits what is left, and is then held."""
        if job.key in self.held:
            return True
        size = checkpoint_size(job, self.profile)
        if self.used + size + self.slack > self.budget:
            self.refused[job.key] = size
            return False
        self.held[job.key] = size + self.slack
        return True

    def release(self, job: Job) -> None:
        """``job`` finished: its run folder stays behind, its record is carried."""
        self.held.pop(job.key, None)


def stranded(jobs: list[Job], carry_mib: float, profile: str = "full") -> list[tuple[Job, int]]:
    """The jobs, with their checkpoint sizes, that commands whose runner folder moves on as a
    carry-over of at most ``carry_mib`` MiB never finish: longer than one command
    (:data:`COMMAND_MINUTES`), with a checkpoint that does not fit the carry-over beside the
    records (:class:`Carry`), so :func:`startable` never starts them."""
    sizes = [(job, checkpoint_size(job, profile)) for job in jobs
             if job.entry.minutes > COMMAND_MINUTES]
    return [(job, size) for job, size in sizes if fate(job, size, carry_mib) == "stranded"]


def fate(job: Job, size: int, carry_mib: float) -> str:
    """``job``'s fate in commands whose runner folder moves on as a carry-over of at most
    ``carry_mib`` MiB, its checkpoint weighing ``size`` bytes: ``command`` (it ends within
    one), ``carried`` (longer, its checkpoint fits beside the records, with :class:`Carry`'s
    slack for each: it resumes from command to command) or ``stranded`` (neither)."""
    if job.entry.minutes <= COMMAND_MINUTES:
        return "command"
    return "carried" if size + 2 * Carry.SLACK <= carry_mib * 2**20 else "stranded"


@functools.cache
def checkpoint_size(job: Job, profile: str = "full") -> int:
    """The bytes of ``job``'s checkpoint (:func:`mrc_lib.train.checkpoint_bytes`), its reader
    built on its data's vocabulary (a multi-passage run's is its source's, the prepared SQuAD,
    which loads without building the passages)."""
    from mrc_lib.models import build_model
    from mrc_lib.train import checkpoint_bytes

    cfg = job.config(profile)
    source = dataclasses.replace(cfg, data_options={}) if "passages" in cfg.data_options else cfg
    return checkpoint_bytes(cfg, build_model(cfg.model, _vocab(source), **cfg.hparams))


_VOCABS: dict[str, object] = {}  # data_key -> vocabulary, for checkpoint_size


def _vocab(cfg):
    """The vocabulary of ``cfg``'s data, loaded once per :func:`data_key`."""
    from mrc_lib.train import load_data

    key = data_key(cfg)
    if key not in _VOCABS:
        _VOCABS[key] = load_data(cfg).vocab
    return _VOCABS[key]


# GPUs on one chip. How training processes share the chip (benchmarks/gpu_packing.py) and
# where a step's time goes (gpu_profile.py, the compile steps' choice) hold for each of them:
# the H100 SXM and the H200 are both GH100 (132 SMs, the same kernels) and differ in memory
# (80 GB of HBM3 at 3.35 TB/s against 141 GB of HBM3e at 4.8 TB/s). Their names as CUDA gives.
CHIPS = {"GH100": ("NVIDIA H100 80GB HBM3", "NVIDIA H200")}


def chip_mates(device: str) -> tuple[str, ...]:
    """The other GPUs on ``device``'s chip (:data:`CHIPS`)."""
    names = next((names for names in CHIPS.values() if device in names), ())
    return tuple(name for name in names if name != device)


def chip_file(folder: Path, pattern: str, device: str) -> Path | None:
    """``folder``'s file ``pattern`` (``{device}`` standing for the device's slug) for
    ``device``, else for another GPU on its chip (:func:`chip_mates`); ``None`` if neither."""
    for name in (device, *chip_mates(device)):
        path = folder / pattern.format(device=slug(name))
        if path.is_file():
            return path
    return None


def measured_parallel(results: Path = PACKING_RESULTS) -> int:
    """``--parallel auto``: the process count that ``benchmarks/gpu_packing.py`` recommends
    for this machine's GPU, or one on its chip (``recommended_parallel`` in
    ``packing_<device>.json``)."""
    import torch

    if not torch.cuda.is_available():
        raise UserError("--parallel auto reads the packing benchmark of this machine's GPU, "
                        "and there is no GPU: give --parallel N")
    device = torch.cuda.get_device_name()
    path = chip_file(results, "packing_{device}.json", device)
    if path is None:
        raise UserError(f"--parallel auto: no {results / f'packing_{slug(device)}.json'}; run "
                        "benchmarks/gpu_packing.py on this GPU first, or give --parallel N")
    parallel = json.loads(path.read_text()).get("recommended_parallel")
    if not parallel:
        raise UserError(f"{path}: no recommended_parallel (did every measurement fail?)")
    return int(parallel)


def parallel_count(value: str) -> int | str:
    """``--parallel``: a count of at least 1, or ``auto``."""
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a count of at least 1 or 'auto'")
    return int(value)


def find_job(jobs: list[Job], key: str) -> Job:
    for job in jobs:
        if job.key == key:
            return job
    raise UserError(f"no run {key!r} in the queue")


# --- moving a runner folder between machines, in bundles that fit one command -----------------


def _units(out: Path, records: bool = True) -> list[tuple[str, list[Path]]]:
    """``out``'s files worth moving, as units that arrive whole or not at all: ``records``
    (every record, and every finished run's status; left out without ``records``) first, then
    each partial run's folder (checkpoint parts included), smallest first. Finished runs'
    checkpoints stay behind: their record is what counts."""
    head = sorted((out / "records").rglob("*.json")) if (out / "records").is_dir() else []
    runs = []
    for status in sorted(out.glob("*/**/status.json")):
        folder = status.parent
        if json.loads(status.read_text(encoding="utf-8"))["complete"]:
            head.append(status)
            continue
        files = sorted(p for p in folder.rglob("*") if p.is_file() and
                       not any(part in LEFT_BEHIND for part in p.relative_to(folder).parts)
                       and not p.name.endswith(".part"))
        runs.append((str(folder.relative_to(out)), files))
    runs.sort(key=lambda unit: (sum(p.stat().st_size for p in unit[1]), unit[0]))
    return [("records", head), *runs] if records else runs


def _tar(out: Path, files: list[Path]) -> bytes:
    """``files`` as one tar, named relative to ``out``: the same bytes for the same files, so
    that each bundle of one pack may be written by its own command."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in files:
            info = tar.gettarinfo(path, arcname=str(path.relative_to(out)))
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = int(info.mtime)
            with open(path, "rb") as f:
                tar.addfile(info, f)
    return buffer.getvalue()


def _layout(units: list[tuple[str, bytes]], budget: int,
            by_unit: bool = False) -> tuple[dict, bytes]:
    """A transfer of ``units`` (name, tar): their tars one after another, a stream that fills
    bundles of ``budget`` bytes to the brim, so ``k`` bundles hold ``k * budget`` bytes of
    units, each bundle cut into pieces of at most 15 MiB, ``queue.<bundle>.<piece>``: four at
    most, whatever the units' sizes (a reply brings back eight files: a bundle's pieces, its
    listing and ``session.tar``). ``by_unit`` (for a carry-over committed to git, which no
    reply brings back) also cuts where each unit begins, so that a unit that has not changed
    is the same pieces wherever it lies in its bundle, and git stores them once. Returns the
    listing (each unit's place in the stream and checksum, each piece's bundle, place and
    checksum) and the stream."""
    stream = b"".join(blob for _, blob in units)
    listing = {"units": [], "pieces": []}
    bundles = range(0, max(len(stream), 1), budget)
    cuts = set(bundles)  # where a piece begins
    offset = 0
    for name, blob in units:
        listing["units"].append({"unit": name, "offset": offset, "bytes": len(blob),
                                 "sha256": hashlib.sha256(blob).hexdigest()})
        if by_unit and offset < len(stream):
            cuts.add(offset)
        offset += len(blob)
    cuts = sorted(cuts)
    for start, end in zip(cuts, [*cuts[1:], len(stream)]):
        bundle = start // budget + 1
        first = sum(p["bundle"] == bundle for p in listing["pieces"])
        for k, (piece, _) in enumerate(cut_parts(stream[start:end], "", PIECE_BYTES), first):
            listing["pieces"].append(piece | {"name": f"queue.{bundle:03d}.{k:03d}",
                                              "bundle": bundle, "offset": start})
            start += piece["bytes"]
    listing["bundles"] = len(bundles)
    return listing, stream


def _write_bundle(dest: Path, listing: dict, stream: bytes, bundle: int) -> list[Path]:
    """Write bundle ``bundle`` of a transfer (:func:`_layout`) into ``dest``: its pieces and
    ``queue.json``, the whole listing."""
    pieces = [p for p in listing["pieces"] if p["bundle"] == bundle]
    dest.mkdir(parents=True, exist_ok=True)
    for stale in dest.glob("queue.[0-9]*.[0-9]*"):
        if stale.name not in {p["name"] for p in pieces}:
            stale.unlink()
    for piece in pieces:
        atomic_write_bytes(dest / piece["name"],
                           stream[piece["offset"]:piece["offset"] + piece["bytes"]])
    atomic_write_json(dest / "queue.json", listing)
    return [dest / "queue.json", *(dest / p["name"] for p in pieces)]


def _tars(out: Path, records: bool) -> list[tuple[str, bytes]]:
    return [(name, _tar(out, files)) for name, files in _units(out, records)]


def pack(out: Path, dest: Path, bundle: int = 1, budget: int = PACK_BUDGET,
         records: bool = True, by_unit: bool = False) -> tuple[list[Path], int]:
    """Write bundle ``bundle`` of ``out``'s transfer (:func:`_layout` of its units,
    :func:`_units`, in bundles of ``budget`` bytes, 60 MiB being what may come back from the
    GPU machine per command) into ``dest``; return the files written and the number of
    bundles. A partial run larger than one command's transfer (PhaseCond's checkpoint packs to
    about 95 MiB) travels over several. Every bundle holds ``queue.json``, the whole listing,
    so that :func:`unpack` can check that its bundles belong together. ``out`` must not change
    between the commands that write one pack's bundles. ``by_unit``: see :func:`_layout`."""
    listing, stream = _layout(_tars(out, records), budget, by_unit)
    if not 1 <= bundle <= listing["bundles"]:
        raise UserError(f"{out}: its pack has {listing['bundles']} bundle(s); there is no "
                        f"bundle {bundle}")
    return _write_bundle(dest, listing, stream, bundle), listing["bundles"]


def bundle_folder(dest: Path, k: int) -> Path:
    """Where bundle ``k`` of a carry-over goes: ``dest/b<k>``."""
    return dest / f"b{k}"


def bundles_in(folder: Path) -> list[Path]:
    """The bundles under ``folder`` (each a folder with its ``queue.json``), in order."""
    return sorted({p.parent for p in folder.rglob("queue.json")}) if folder.is_dir() else []


def carry_over(out: Path, dest: Path, budget: int, bundles: int = 1, records: bool = True,
               which: list[int] | None = None,
               by_unit: bool = False) -> tuple[list[str], list[str], int]:
    """What one session sends on to the next: the units of ``out`` (:func:`_units`,
    ``records`` or not) that fit ``bundles`` bundles of ``budget`` bytes, in order, as a
    transfer of their own (:func:`_layout`) in ``dest/b1``, ``dest/b2``...
    (:func:`bundle_folder`), one call each way per bundle; ``which`` writes only those
    bundles (each GPU call sends back its own); ``by_unit``: see :func:`_layout`. Returns the
    units kept (``records`` first), those left behind, and the bundles the kept ones fill."""
    kept, left, size = [], [], 0
    for name, blob in _tars(out, records):
        if size + len(blob) <= bundles * budget:
            kept.append((name, blob))
            size += len(blob)
        else:
            left.append(name)
    listing, stream = _layout(kept, budget, by_unit)
    for k in which or range(1, listing["bundles"] + 1):
        if not 1 <= k <= listing["bundles"]:
            raise UserError(f"{out}: its carry-over has {listing['bundles']} bundle(s); there "
                            f"is no bundle {k}")
        _write_bundle(bundle_folder(dest, k), listing, stream, k)
    return [name for name, _ in kept], left, listing["bundles"]


def unpack(sources: list[Path], out: Path) -> tuple[list[str], list[str]]:
    """Extract into ``out`` every unit of a transfer whose pieces are all in ``sources`` (the
    folders of its bundles, in any order); a partial run's folder is replaced whole. Returns
    the files extracted and the units left out because a bundle is missing. A corrupt piece,
    or bundles of different packs, is a one-line error."""
    listings = {}
    for source in sources:
        manifest = source / "queue.json"
        try:
            listing = json.loads(manifest.read_text(encoding="utf-8"))
            listings[manifest] = {key: listing[key] for key in ("units", "pieces")}
        except FileNotFoundError:
            raise UserError(f"{manifest}: no packed queue here") from None
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(f"{manifest}: corrupt manifest: {e}") from None
    manifest, listing = next(iter(listings.items()))
    for other, each in listings.items():
        if each != listing:
            raise UserError(f"{other}: a bundle of another pack than {manifest}'s (the queue "
                            "folder changed between the two packs)")
    folders = {p.name: p.parent for source in sources for p in source.glob("queue.[0-9]*")}
    names, left_out = [], []
    for unit in listing["units"]:
        if Path(unit["unit"]).is_absolute() or ".." in Path(unit["unit"]).parts:
            raise UserError(f"{manifest}: unit {unit['unit']!r} is outside the queue folder")
        end = unit["offset"] + unit["bytes"]
        span = [p for p in listing["pieces"]
                if p["offset"] < end and p["offset"] + p["bytes"] > unit["offset"]]
        if any(p["name"] not in folders for p in span):
            left_out.append(unit["unit"])
            continue
        start = unit["offset"] - span[0]["offset"] if span else 0
        blob = join_parts(manifest, span, what="piece", folders=folders)[
            start:start + unit["bytes"]]
        if hashlib.sha256(blob).hexdigest() != unit["sha256"]:
            raise UserError(f"{manifest}: unit {unit['unit']!r} does not match its checksum")
        if unit["unit"] != "records":
            shutil.rmtree(out / unit["unit"], ignore_errors=True)
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r") as tar:
            names += tar.getnames()
            tar.extractall(out, filter="data")
    return names, left_out


def restore(out: Path, inbox: Path, log=print) -> bool:
    """On a machine that starts bare (no ``out``), unpack the bundles found under ``inbox``
    into ``out``; return whether it did. An ``out`` the machine kept is newer than any bundle
    carried to it, and is left alone."""
    if out.exists():
        log(f"{out} is here from the last command; {inbox} is not needed")
        return False
    bundles = bundles_in(inbox)
    if not bundles:
        log(f"{out} starts empty: no bundles under {inbox}")
        return False
    names, left_out = unpack(bundles, out)
    log(f"{len(names)} files from {len(bundles)} bundle(s) under {inbox} into {out}"
        + (f"; left out, a bundle missing: {', '.join(left_out)}" if left_out else ""))
    return True


def import_records(out: Path) -> list[Path]:
    """Copy ``out/records/<chapter>/<run>.json`` into ``book/runs`` (each one checked); a
    partial record never replaces a finished one of its config, and one of another config is
    kept under ``earlier/`` (:func:`mrc_lib.records.keep_earlier`)."""
    copied = []
    for path in sorted((out / "records").rglob("*.json")):
        record = records.read_record(path)
        dest = records.record_path(record["chapter"], record["run"])
        if not records.finished(record) and dest.exists():
            found = records.read_record(dest)
            if records.finished(found) and found["config_hash"] == record["config_hash"]:
                continue
        records.write_record(dest, record)
        copied.append(dest)
    return copied


# --- the data, built on the CPU side -----------------------------------------------------------


def data_key(cfg) -> str:
    """What a run's data follows from (runs with the same key load the same data)."""
    return json.dumps([cfg.dataset, cfg.task, cfg.pipeline, cfg.glove, cfg.data_options,
                       cfg.limits], sort_keys=True)


def prepare(jobs: list[Job], profile: str = "full", log=print) -> list[str]:
    """Build the data of every job into the cache here, where spaCy, the raw files and GloVe
    are: the GPU machine has only the cache. One load per distinct data config; multi-passage
    SQuAD is left to the GPU machine (too large to carry), which builds it from the prepared
    SQuAD loaded here. Returns the data configs loaded, one line each."""
    from mrc_lib.train import load_data

    loaded = []
    for job in jobs:
        cfg = job.config(profile)
        if "passages" in cfg.data_options:  # its source, the prepared SQuAD
            cfg = dataclasses.replace(cfg, data_options={})
        what = data_key(cfg)
        if what not in loaded:
            log(f"{job.key}: {what}")
            load_data(cfg)
            loaded.append(what)
    return loaded


# --- does each chapter build its entry's config? --------------------------------------------


def verify(jobs: list[Job], runs: Path) -> tuple[list[str], list[str], list[str]]:
    """Check, before any GPU minute is spent, that each chapter builds the config its packed
    entries list: a chapter that built another would never find the entry's record. The
    chapter's smoke reproduction (``reproduce NAME --profile smoke``) leaves each run's record
    at ``runs/<chapter>/smoke/<run>/record.json``; the entry's config, resolved at the smoke
    profile with the same overrides, must have the same hash. Returns the matching jobs, the
    mismatches (with the keys that differ) and the jobs no smoke run recorded (unchecked)."""
    matched, mismatched, unchecked = [], [], []
    for job in jobs:
        path = runs / job.entry.chapter / "smoke" / job.name / "record.json"
        if not path.is_file():
            unchecked.append(job.key)
            continue
        built, listed = records.read_record(path)["config"], job.config("smoke").to_dict()
        if records.config_hash(built) == records.config_hash(listed):
            matched.append(job.key)
            continue
        built, listed = records.hashed(built), records.hashed(listed)  # as the hash sees them
        keys = sorted(k for k in listed if built.get(k) != listed[k])
        mismatched.append(f"{job.key}: " + "; ".join(
            f"{k}: chapter {built.get(k)!r}, queue {listed[k]!r}" for k in keys))
    return matched, mismatched, unchecked


# --- the command line --------------------------------------------------------------------------


def queue_cli(args) -> None:
    """``python -m mrc_lib queue [run|work|pack|unpack|import|verify|estimates]``."""
    action = args.action or "status"
    out = Path(args.out) if args.out else None
    if action in ("run", "work", "pack", "unpack", "import") and out is None:
        raise UserError(f"queue {action} needs --out DIR")
    if action in ("pack", "rehearse") and args.to is None:
        raise UserError(f"queue {action} needs --to DEST")
    if action == "unpack" and not args.source:
        raise UserError("queue unpack needs --from DEST...")
    if action == "pack":
        files, n_bundles = pack(out, Path(args.to), args.bundle, int(args.bundle_mib * 2**20),
                                by_unit=args.by_unit)
        print("\n".join(map(str, files)))
        if n_bundles > 1:
            print(f"bundle {args.bundle} of {n_bundles}: pack the others with --bundle K, "
                  f"before {out} changes", file=sys.stderr)
        return
    if action == "unpack":
        names, left_out = unpack([Path(s) for s in args.source], out)
        print(f"{len(names)} files into {out}")
        if left_out:
            print(f"left out, a bundle missing: {', '.join(left_out)}", file=sys.stderr)
        return
    if action == "import":
        print("\n".join(map(str, import_records(out))))
        return
    jobs = select(load_queue(args.file), args.only)
    if action == "estimates":
        speeds = bringup_speeds()
        if args.write:
            before = calibration(jobs, speeds)
            if changed := raise_estimates(Path(args.file), jobs, speeds):
                print("\n".join(changed))
                atomic_write_json(ESTIMATES, {
                    "what": "queue estimates --write: each reader's speed (s per SQuAD v1.1 "
                            "epoch, bring-ups), each family's headline estimate and floor "
                            "before, and the entries it lifted",
                    "speeds": speeds, "changed": changed,
                    "before": {f"{m} {d}": c for (m, d), c in before.items()}})
            jobs = select(load_queue(args.file), args.only)
        print(estimates_table(jobs, speeds))
        return
    if action == "prepare":
        prepare(jobs, args.profile)
        return
    if action == "rehearse":
        from mrc_lib.rehearsal import rehearse

        outcome = rehearse(jobs, Path(args.to))
        failed = [chapter for chapter, result in outcome.items() if result != "ok"]
        if failed:
            raise UserError(f"{len(failed)} chapter(s) failed at the full profile from stand-in "
                            f"records: {', '.join(failed)} ({args.to}/rehearsal.json)")
        return
    if action == "verify":
        matched, mismatched, unchecked = verify(jobs, out or Path("runs"))
        print(f"{len(matched)} runs build their queue entry's config, {len(mismatched)} do "
              f"not, {len(unchecked)} have no smoke record to check")
        print("\n".join(mismatched))
        if mismatched:
            raise UserError(f"{len(mismatched)} chapter run(s) build another config than "
                            "their queue entry")
        return
    if action == "status":
        from mrc_lib.measurements import state_lines

        print(status_table(jobs, out, args.profile))
        if args.profile == "full":  # what the chapters measure: python -m mrc_lib measure
            print("\n".join(state_lines(out)))
    elif action == "work":
        work(find_job(jobs, args.job), out, args.deadline, args.profile,
             check_settings(args.set))
    else:
        settings = check_settings(args.set)
        if args.parallel == "auto":
            args.parallel = measured_parallel()
            print(f"--parallel auto: {args.parallel} processes")
        if args.inbox:
            restore(out, Path(args.inbox))
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1)
                                                         // args.parallel)))
        codes = run_queue(jobs, out, args.minutes, args.parallel, args.reserve, args.profile,
                          Path(args.file), settings, args.carry_mib,
                          (args.graphed or "").split(","))
        print(status_table(jobs, out, args.profile))
        if any(codes.values()):
            raise UserError(f"{sum(c != 0 for c in codes.values())} worker(s) failed: "
                            + ", ".join(k for k, c in codes.items() if c))


def add_parser(sub) -> None:
    s = sub.add_parser("queue", help="the full-profile runs: status, packed runner, transfer")
    s.add_argument("action", nargs="?", choices=["status", "prepare", "run", "work", "pack",
                                                 "unpack", "import", "verify", "rehearse",
                                                 "estimates"])
    s.add_argument("--file", default=str(QUEUE_FILE), help="the queue file")
    s.add_argument("--out", default=None, help="the runner's folder (runs, records); verify: "
                   "the smoke run folder (default runs)")
    s.add_argument("--minutes", type=float, default=9.0, help="wall-clock budget of `run`")
    s.add_argument("--parallel", type=parallel_count, default=1,
                   help="concurrent worker processes, or auto: as many as "
                   "benchmarks/gpu_packing.py found fastest on this GPU or one on its chip")
    s.add_argument("--only", action="append", metavar="GLOB",
                   help="only the runs whose <chapter>/<run> matches (repeatable)")
    s.add_argument("--inbox", default=None, metavar="DEST",
                   help="run: unpack the bundles under DEST first when --out does not exist")
    s.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="run: how every run is computed, e.g. compile=true (only keys outside "
                   "the config hash)")
    s.add_argument("--graphed", default=None, metavar="READERS",
                   help="run: the readers (comma-separated) whose runs replay their steps as "
                   f"CUDA graphs ({', '.join(GRAPH_SETTINGS)})")
    s.add_argument("--carry-mib", type=float, default=None,
                   help="run: --out reaches the next command only as its carry-over (its "
                   "bundles, at most this many MiB together): a run that will be cut starts "
                   "only if it is longer than a command and its checkpoint still fits it")
    s.add_argument("--reserve", type=float, default=60.0,
                   help="seconds before the end at which trainers checkpoint and stop")
    s.add_argument("--write", action="store_true",
                   help="estimates: raise each family's minutes whose headline is below the "
                   "bring-up's floor, in the queue file")
    s.add_argument("--profile", default="full", help=argparse.SUPPRESS)
    s.add_argument("--job", default=None, help=argparse.SUPPRESS)
    s.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    s.add_argument("--to", default=None, help="pack: the folder to write the bundle to; "
                   "rehearse: the new folder to clone the repository into")
    s.add_argument("--bundle", type=int, default=1, help="pack: which bundle to write")
    s.add_argument("--bundle-mib", type=float, default=PACK_BUDGET / 2**20,
                   help="pack: the most MiB a bundle holds")
    s.add_argument("--by-unit", action="store_true",
                   help="pack: also begin a piece at each unit, for a carry-over committed to "
                        "git (runs/inbox), which stores an unchanged run's pieces once; not "
                        "for a reply, whose bundle may then exceed four pieces")
    s.add_argument("--from", dest="source", nargs="+", default=None,
                   help="unpack: the bundles' folders")
    s.set_defaults(func=queue_cli)

