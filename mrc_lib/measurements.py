"""Measurements as run records: what a chapter measures of its readers (speed, memory) at the
full profile, made once on a GPU and read by every later execution of the chapter.

    python -m mrc_lib measure [--only GLOB] [--out DIR] [--retrain]   # on the GPU machine

A training run's record lets a chapter re-execute on a CPU from what a GPU trained
(:mod:`mrc_lib.records`). A chapter that also *measures* its readers (chapter 02 times Table
4's encoders, chapter 07 every span reader at its full size) would, re-executed on a CPU,
measure them again there: for chapter 07 hours of a 2-core machine, and for both another
device's numbers beside the accuracy that a GPU trained.
So a measurement is a record too, ``book/runs/<chapter>/<name>.json`` at the full profile:

* ``spec``: what is measured, as JSON (the protocol, the readers and their hyperparameters or
  a hash of them), never the device; ``spec_hash`` is its hash;
* ``result``: what the measurement returned; ``device``/``device_type``, torch, CUDA, commit
  and ``seconds`` say where, with what and how long it ran.

``run.measure(name)`` in a chapter (:meth:`mrc_lib.notebook.Run.measure`) returns the record of
the chapter's measurement ``name`` when its spec hash matches (:func:`match`), measures and
writes it otherwise; a measurement made on a CPU is never read by a run on a GPU (the GPU
measures again). ``retrain`` measures anyway; ``records_only`` stops with the record and why
it does not match. At the smoke profile it always measures, and the record goes to the run
folder (for ``queue rehearse``'s stand-ins), like a smoke training run's.

Every measurement the full book makes is in :func:`registry`, so that a GPU session makes them
all with one command, before its training (a timing shares the GPU with nothing), into a
folder (``--out DIR``: ``DIR/records/<chapter>/<name>.json``) that ``queue import`` brings into
``book/runs`` as it does training records.
"""

from __future__ import annotations

import argparse
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mrc_lib import records
from mrc_lib.errors import UserError
from mrc_lib.utils import select_keys


@dataclass(frozen=True)
class Measurement:
    """What chapter ``chapter`` measures as ``name``: ``spec(profile)`` says what (JSON, no
    device), ``method(spec, device)`` measures it on a device (``cpu``, ``cuda``) and returns
    the result (JSON)."""

    chapter: str
    name: str
    spec: Callable[[str], dict]
    method: Callable[[dict, str], dict]

    @property
    def key(self) -> str:
        return f"{self.chapter}/{self.name}"


def registry() -> dict[str, Measurement]:
    """Every measurement of the book, by ``<chapter>/<name>``, in the order ``measure`` makes
    them (the headline table's first)."""
    from mrc_lib import comparison, scaling

    found = [Measurement("07_comparison", "speed", comparison.speed_spec,
                         comparison.measure_speed),
             Measurement("02_dynsan", "table4_speed", scaling.table4_spec,
                         scaling.measure_table4),
             Measurement("07_comparison", "context_length", comparison.context_length_spec,
                         comparison.measure_context_length)]
    return {m.key: m for m in found}


def find(chapter: str, name: str) -> Measurement:
    key, known = f"{chapter}/{name}", registry()
    if key not in known:
        raise UserError(f"no measurement {key!r}; known: {', '.join(known)}")
    return known[key]


def spec_hash(spec: dict) -> str:
    """What a record's ``spec_hash`` holds: the spec's :func:`mrc_lib.records.json_hash`."""
    return records.json_hash(spec)


def make(m: Measurement, profile: str, device: str, spec: dict | None = None) -> dict:
    """Measure ``m`` at ``profile`` (its ``spec`` there, when the caller has it) on ``device``
    (``auto``: CUDA when there is one); its record."""
    import torch

    from mrc_lib.train import device_name, resolve_device
    from mrc_lib.utils import git_commit

    dev = resolve_device(device)
    spec = m.spec(profile) if spec is None else spec
    tic = time.perf_counter()
    result = m.method(spec, dev.type)
    return {"schema": records.SCHEMA, "kind": records.MEASUREMENT, "chapter": m.chapter,
            "run": m.name, "profile": profile, "spec": spec, "spec_hash": spec_hash(spec),
            "device": device_name(dev), "device_type": dev.type, "torch": torch.__version__,
            "cuda": torch.version.cuda, "git_commit": git_commit(),
            "seconds": round(time.perf_counter() - tic, 1), "result": result}


def match(path: str | Path, spec: dict, device_type: str) -> tuple[dict | None, str | None]:
    """``(record, None)`` if the record at ``path`` measured ``spec`` and a run on
    ``device_type`` may read it (not a CPU's measurement read on a GPU), else ``(None, why
    not)`` in a few words."""
    path = Path(path)
    if not path.exists():
        return None, "no record"
    record = records.read_record(path)
    if not records.is_measurement(record):
        return None, "a training record, not a measurement"
    if record["spec_hash"] != spec_hash(spec):
        return None, f"a measurement of spec {record['spec_hash']}, not {spec_hash(spec)}"
    if record["device_type"] == "cpu" and device_type == "cuda":
        return None, f"measured on a CPU ({record['device']}); this run is on a GPU"
    return record, None


def provenance(record: dict) -> str:
    """Where a measurement ran, for ``results.json``'s ``runs``."""
    return (f"measured on {record['device']} (torch {record['torch']}), profile "
            f"{record['profile']}, {record['seconds']:.0f} s")


def states(out: Path | None = None) -> dict[str, tuple[str, str | None]]:
    """Where every measurement stands at the full profile, from its record in ``book/runs``
    (else under ``out/records``), by key: ``("done", device)`` when a GPU measured it,
    ``("cpu only", device)`` when only a CPU did (a GPU measures again), else
    ``("missing", None)``."""
    found_states = {}
    for m in registry().values():
        spec, state = m.spec("full"), ("missing", None)
        for root in (records.BOOK_RUNS, *([out / "records"] if out else [])):
            found = match(records.record_path(m.chapter, m.name, root), spec, "cpu")[0]
            if found is not None and (state[0] == "missing" or found["device_type"] != "cpu"):
                state = ("cpu only" if found["device_type"] == "cpu" else "done",
                         found["device"])
        found_states[m.key] = state
    return found_states


def state_lines(out: Path | None = None) -> list[str]:
    """:func:`states`, a line each, for ``python -m mrc_lib queue``."""
    return [f"{f'{where} ({device})' if device else where:9} measurement {key}"
            for key, (where, device) in states(out).items()]


def measure_cli(args) -> None:
    """``python -m mrc_lib measure``: make every selected measurement at the full profile on
    this machine's device, unless ``book/runs`` (or ``--out``'s records) already has it; write
    each record under ``--out DIR/records`` (then ``queue pack`` carries it), or straight into
    ``book/runs`` without ``--out``. A measurement that fails is named and does not stop the
    others (GPU minutes are scarce); the command then ends with an error naming them all."""
    from mrc_lib.train import resolve_device

    device_type = resolve_device(args.device).type
    out = Path(args.out) / "records" if args.out else None
    failed = []
    for m in select_keys(list(registry().values()), args.only, "measurement"):
        dest, spec = records.record_path(m.chapter, m.name, out), m.spec(args.profile)
        if not args.retrain:
            found = [r for path in {records.record_path(m.chapter, m.name), dest}
                     if (r := match(path, spec, device_type)[0]) is not None]
            if found:
                print(f"{m.key}: measured on {found[0]['device']} already (--retrain to "
                      "measure again)")
                continue
        try:
            record = make(m, args.profile, args.device, spec)
        except Exception as e:  # noqa: BLE001 - reported, and the others still run
            failed.append(m.key)
            print(f"{m.key}: FAILED: {type(e).__name__}: {e}".splitlines()[0], flush=True)
            traceback.print_exc()
            continue
        records.write_record(dest, record)
        print(f"{m.key}: {record['seconds']:.0f} s on {record['device']} -> {dest}", flush=True)
    if failed:
        raise UserError(f"{len(failed)} measurement(s) failed: {', '.join(failed)} (tracebacks "
                        "above)")


def add_parser(sub) -> None:
    s = sub.add_parser("measure", help="the chapters' full-profile measurements (speed, "
                       "memory), as run records")
    s.add_argument("--only", action="append", metavar="GLOB",
                   help="only the measurements whose <chapter>/<name> matches (repeatable)")
    s.add_argument("--out", default=None, help="the runner's folder: records go to "
                   "DIR/records/<chapter>/<name>.json (default: book/runs)")
    s.add_argument("--device", default="auto", help="auto (CUDA when there is one), cuda, cpu")
    s.add_argument("--retrain", action="store_true", help="measure even where a record matches")
    s.add_argument("--profile", default="full", help=argparse.SUPPRESS)  # smoke: tests
    s.set_defaults(func=measure_cli)
