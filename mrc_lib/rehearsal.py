"""A rehearsal of the full profile on a CPU: every chapter built from stand-in records of every
queue run, in a clone of the repository, before a GPU minute is spent.

    python -m mrc_lib reproduce --all --profile smoke     # the smoke records stand-ins copy
    python -m mrc_lib queue rehearse --to ../rehearsal    # clone, stand-ins, every chapter

Once a GPU session has trained the queue's runs, each chapter reads their records at the full
profile. Two things can go wrong only then, and both waste GPU work: a chapter that builds
another config than its queue entry never finds the record (and would train it again), and a
code path that only the full profile takes (a table, figure or claim drawn from records, a run
list longer than smoke's) fails. ``queue verify`` checks the configs of the runs that smoke
trains; the rehearsal checks them all, and those code paths:

1. clone the repository's ``HEAD`` into a new folder (the committed state; the repository's
   own ``book/runs`` is never written);
2. write there, for every queue run, a *stand-in* record (:func:`standin`): the chapter's smoke
   record of that run (else of the same reader, with the most hyperparameters in common) under
   the run's full-profile config, config hash and data digests, marked ``standin: true`` with
   the device :data:`STANDIN_DEVICE`. Its numbers are the smoke run's: they mean nothing. Every
   measurement of the book (:func:`mrc_lib.measurements.registry`: the speeds of chapters 02
   and 07) gets one too, its smoke record under its full-profile spec
   (:func:`measurement_standin`);
3. reproduce every chapter there at the full profile with ``--records-only``: a chapter that
   would train a run or make a measurement stops, naming the record and why it does not match.
   Chapter 07 is then also checked for what it draws from the records (:func:`check_comparison`:
   every headline reader scored, no claim "not yet measured").

The data digests need each distinct full-profile data config loaded once (what ``queue
prepare`` builds into the cache).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mrc_lib import records
from mrc_lib.errors import UserError
from mrc_lib.reproduce import NOTEBOOK_PATTERN

STANDIN_DEVICE = "stand-in (rehearsal: a smoke record's numbers)"
COMPARISON = "07_comparison"  # also checked by check_comparison


def smoke_records(runs: Path) -> dict[str, list[tuple[str, dict]]]:
    """Every chapter's smoke records of training runs under ``runs/<chapter>/smoke/``, as
    ``(run, record)``."""
    found: dict[str, list[tuple[str, dict]]] = {}
    for path in sorted(runs.glob("*/smoke/**/record.json")):
        chapter = path.relative_to(runs).parts[0]
        name = path.parent.relative_to(runs / chapter / "smoke").as_posix()
        record = records.read_record(path)
        if not records.is_measurement(record):
            found.setdefault(chapter, []).append((name, record))
    return found


def source_record(job, smoke: dict[str, list[tuple[str, dict]]]) -> dict:
    """The smoke record a job's stand-in copies: the job's own run, else the run of the same
    reader with the most hyperparameters equal to the job's."""
    chapter, hparams = smoke.get(job.entry.chapter, []), job.config("full").hparams
    for name, record in chapter:
        if name == job.name:
            return record
    same = [r for _, r in chapter if r["config"]["model"] == job.entry.model]
    if not same:
        raise UserError(f"{job.key}: no smoke record of reader {job.entry.model!r} in "
                        f"runs/{job.entry.chapter}/smoke/; run `python -m mrc_lib reproduce "
                        f"{job.entry.chapter} --profile smoke` first")
    return max(same, key=lambda r: sum(r["config"]["hparams"].get(k) == v
                                       for k, v in hparams.items()))


def standin(job, source: dict, digests: dict) -> dict:
    """The stand-in record of ``job``: ``source``'s metrics and payload under the job's
    full-profile config, hash and data digests."""
    config = job.config("full").to_dict()
    return {**source, **epochs_of(source, config["epochs"]), "chapter": job.entry.chapter,
            "run": job.name, "profile": "full", "config": config,
            "config_hash": records.config_hash(config), "data_digests": digests,
            "complete": True, "standin": True, "device": STANDIN_DEVICE}


def epochs_of(source: dict, epochs: int) -> dict:
    """``source``'s history (and seconds per epoch) with its last epoch repeated up to the full
    schedule's ``epochs``: a chapter may read a headline run's first epochs as the matched
    baseline of its shorter ablations (:func:`mrc_lib.records.after_epochs`)."""
    history, seconds = source.get("history") or [], source.get("seconds_per_epoch") or []
    more = range(len(history) + 1, epochs + 1)
    if not history or not more:
        return {}
    return {"history": history + [{**history[-1], "epoch": e} for e in more],
            "seconds_per_epoch": seconds + seconds[-1:] * len(more), "epochs_run": epochs}


def measurement_standin(m, runs: Path) -> dict:
    """The stand-in record of measurement ``m``: its smoke record's result under its
    full-profile spec."""
    from mrc_lib import measurements

    path = runs / m.chapter / "smoke" / m.name / "record.json"
    if not path.is_file():
        raise UserError(f"{path}: no smoke record of measurement {m.key}; run `python -m "
                        f"mrc_lib reproduce {m.chapter} --profile smoke` first")
    spec = m.spec("full")
    return {**records.read_record(path), "profile": "full", "spec": spec,
            "spec_hash": measurements.spec_hash(spec), "standin": True,
            "device": STANDIN_DEVICE}


def write_standins(jobs, runs: Path, book_runs: Path, log=print) -> int:
    """Write every job's and every measurement's stand-in record under ``book_runs``; returns
    how many."""
    from mrc_lib.measurements import registry
    from mrc_lib.queue import data_key
    from mrc_lib.train import load_data

    smoke, digests = smoke_records(runs), {}
    for job in jobs:
        cfg = job.config("full")
        key = data_key(cfg)
        if key not in digests:
            log(f"loading {key}")
            digests[key] = load_data(cfg).digests
        record = standin(job, source_record(job, smoke), digests[key])
        records.write_record(records.record_path(job.entry.chapter, job.name, book_runs), record)
    for m in registry().values():
        records.write_record(records.record_path(m.chapter, m.name, book_runs),
                             measurement_standin(m, runs))
    return len(jobs) + len(registry())


def check_comparison(book_runs: Path) -> str:
    """Chapter 07's use of the records: with a record for every queue run, each headline
    reader has a score and no claim is "not yet measured"; ``ok`` or what is missing."""
    from mrc_lib.comparison import HEADLINE_RUNS, NOT_MEASURED, Side, claims, load_records, score

    found = load_records(book_runs)
    missing = [f"reader {name}" for name in HEADLINE_RUNS
               if score(found, Side.headline(name)) is None]
    missing += [f"claim {row[0]!r}" for row in claims(found) if row[-1] == NOT_MEASURED]
    return "ok" if not missing else "no record found for " + "; ".join(missing)


def rehearse(jobs, dest: Path, runs: Path = records.ROOT / "runs",
             log=print) -> dict[str, str]:
    """Clone the repository into ``dest``, write the stand-ins there and reproduce each chapter
    at the full profile with ``--records-only`` (chapter 07 also checked by
    :func:`check_comparison`). Returns, per chapter, ``ok`` or the error it stopped with."""
    if dest.exists() and any(dest.iterdir()):
        raise UserError(f"{dest}: not empty; queue rehearse clones the repository into a new "
                        "folder")
    subprocess.run(["git", "clone", "--quiet", str(records.ROOT), str(dest)], check=True)
    log(f"{write_standins(jobs, runs, dest / 'book' / 'runs', log)} stand-in records in {dest}")
    chapters = sorted(p.stem for p in (dest / "notebooks").glob(NOTEBOOK_PATTERN))
    env = {**os.environ, "PYTHONPATH": str(dest)}  # the clone's library, in its kernels too
    outcome = {}
    for chapter in chapters:
        done = subprocess.run([sys.executable, "-m", "mrc_lib", "reproduce", chapter,
                               "--profile", "full", "--records-only"], cwd=dest, env=env,
                              capture_output=True, text=True)
        errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
        outcome[chapter] = "ok" if done.returncode == 0 else (
            errors[-1] if errors else f"exit status {done.returncode}")
        if chapter == COMPARISON and outcome[chapter] == "ok":
            outcome[chapter] = check_comparison(dest / "book" / "runs")
        log(f"{chapter}: {outcome[chapter]}")
    (dest / "rehearsal.json").write_text(json.dumps(outcome, indent=1))
    return outcome
