"""Run records: what a training run measured, small enough to commit.

A record is one JSON file, ``book/runs/<chapter>/<run>.json`` for a full-profile run (committed)
and ``<run folder>/record.json`` for any other profile (under ``runs/``, not committed, so that
smoke runs never churn the book). It holds the trainer's metrics (final and per-epoch dev
scores, train loss, seconds per epoch, parameters, device, torch/CUDA versions, commit, where
each session that trained it ran (:func:`trained_on`), data digests, the resolved config and
the reader's ``analysis`` payload) plus the chapter, the run's name, the training-loss curve
(at most :data:`CURVE_POINTS` points of ``log.jsonl``), the run's config hash, the training
examples per second and the wall time (training plus evaluation seconds, summed over every
session that resumed it); predictions are never in it. It is written atomically and must stay
under :data:`MAX_BYTES`. A run stopped before the end of its schedule (a GPU session's
deadline) has a partial record, ``complete: false``: it counts as progress, never as a result
(:func:`finished`). A record that one of another config replaces is kept, when it holds an
epoch, under ``earlier/`` beside it (:func:`keep_earlier`): the result a run wrote is never
lost to a change of config.

At the full profile a notebook's ``run.train(name, cfg, data)`` returns the record of ``name``
instead of training when its config hash and data digests equal the new run's
(:func:`lookup`); ``retrain`` forces training, and ``records_only`` (``reproduce
--records-only``) stops the chapter where it would train, saying why (:func:`match`). What
a chapter measures at the full profile (speed, memory) is a record too, of kind
``measurement`` (:mod:`mrc_lib.measurements`).
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from mrc_lib.errors import UserError
from mrc_lib.utils import atomic_write_bytes

ROOT = Path(__file__).resolve().parent.parent
BOOK_RUNS = ROOT / "book" / "runs"
MAX_BYTES = 1_000_000
EARLIER = "earlier"  # the folder, beside a run's record, of its earlier configs' records
CURVE_POINTS = 200
SCHEMA = 1
# Config keys that do not change what a run computes (where and how it is computed,
# checkpointed, logged and evaluated in batches), left out of the hash so that a GPU run's
# record serves a CPU re-execution of its chapter.
UNHASHED = ("device", "compile", "compile_mode", "compile_whole", "cuda_graphs", "pad_multiple",
            "checkpoint_every", "epoch_checkpoints", "log_every", "eval_batch_size")
REQUIRED = ("schema", "chapter", "run", "config", "config_hash", "data_digests", "dev",
            "history", "device")
# A measurement's record (kind MEASUREMENT, :mod:`mrc_lib.measurements`) holds these instead.
MEASUREMENT = "measurement"
MEASUREMENT_REQUIRED = ("schema", "kind", "chapter", "run", "profile", "spec", "spec_hash",
                        "device", "device_type", "result")


def hashed(config: dict) -> dict:
    """What :func:`config_hash` hashes: the resolved config without :data:`UNHASHED` keys, its
    ``hparams`` completed by the reader's defaults (:func:`mrc_lib.models.effective_hparams`),
    so that a record does not match a reader whose defaults changed since it ran."""
    from mrc_lib.models import effective_hparams

    kept = {k: v for k, v in config.items() if k not in UNHASHED}
    kept["hparams"] = effective_hparams(config)
    return kept


def json_hash(obj) -> str:
    """SHA-256 (first 16 hex digits) of ``obj`` as JSON with sorted keys."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def config_hash(config: dict) -> str:
    """:func:`json_hash` of :func:`hashed` ``config``."""
    return json_hash(hashed(config))


def is_measurement(record: dict) -> bool:
    """Whether ``record`` is a measurement's (:mod:`mrc_lib.measurements`), not a run's."""
    return record.get("kind") == MEASUREMENT


def record_path(chapter: str, run: str, root: Path | None = None) -> Path:
    """Where the record of a chapter's full-profile run lives: under ``root`` (default
    ``book/runs``, committed)."""
    return (root or BOOK_RUNS) / chapter / f"{run}.json"


def loss_curve(log_path: Path) -> list[list[float]]:
    """``[step, mean training loss]`` of the run's ``log.jsonl``, thinned to at most
    :data:`CURVE_POINTS` evenly spaced points (the last one kept)."""
    if not log_path.exists():
        return []
    with log_path.open(encoding="utf-8") as lines:
        points = [[e["step"], round(e["loss"], 5)] for e in map(json.loads, lines)
                  if e["event"] == "step"]
    stride = -(-len(points) // CURVE_POINTS)
    return points[::-1][::stride][::-1] if points else []


def make_record(metrics: dict, *, chapter: str, run: str, log_path: Path | None = None) -> dict:
    """The record of a run from the metrics :func:`mrc_lib.train.train` returned (and the
    loss curve of its ``log_path``). Its config lists every hyperparameter the reader was built
    with, defaults included."""
    from mrc_lib.models import effective_hparams

    config = {**metrics["config"], "hparams": effective_hparams(metrics["config"])}
    # every training second, those of an epoch a deadline cut included, as the steps are
    train_seconds = sum(metrics["seconds_per_epoch"]) + metrics.get("seconds_this_epoch", 0.0)
    wall = train_seconds + sum(h.get("eval_seconds", 0.0) for h in metrics["history"])
    examples = metrics["steps"] * config["batch_size"] * metrics.get("world_size", 1)
    return {"schema": SCHEMA, "chapter": chapter, "run": run,
            "config_hash": config_hash(config), "wall_seconds": round(wall, 3),
            "examples_per_second": round(examples / train_seconds, 1) if train_seconds else None,
            "loss_curve": loss_curve(log_path) if log_path else [], **metrics, "config": config}


def write_record(path: str | Path, record: dict) -> Path:
    """Write ``record`` atomically (:func:`dumps`), keeping the record of another config that
    it replaces (:func:`keep_earlier`); a record over :data:`MAX_BYTES` is refused."""
    path = Path(path)
    blob = (dumps(record) + "\n").encode()
    if len(blob) > MAX_BYTES:
        raise UserError(f"{path}: record of {len(blob)} bytes is over {MAX_BYTES}; "
                        "shrink the reader's analysis payload")
    keep_earlier(path, record)
    atomic_write_bytes(path, blob)
    return path


def earlier_path(path: str | Path, record: dict) -> Path:
    """Where the record ``record``, found at ``path``, is kept once a record of another config
    replaces it: ``<folder>/earlier/<run>.<its config hash>.json``."""
    path = Path(path)
    return path.parent / EARLIER / f"{path.stem}.{record['config_hash']}.json"


def keep_earlier(path: str | Path, record: dict) -> Path | None:
    """Before ``record`` is written to ``path``: copy the training record there aside
    (:func:`earlier_path`, the same bytes, atomically) when it is of another config and holds
    at least one epoch, and return where it went. A record of the same config (a partial run
    going on), one without an epoch, a measurement or an unreadable file is simply replaced."""
    path = Path(path)
    if not path.is_file() or is_measurement(record):
        return None
    try:
        old = read_record(path)
    except UserError:
        return None
    if is_measurement(old) or old["config_hash"] == record["config_hash"] or not old["history"]:
        return None
    dest = earlier_path(path, old)
    atomic_write_bytes(dest, path.read_bytes())
    return dest


def is_earlier(path: str | Path) -> bool:
    """Whether the record at ``path`` is one kept from an earlier config (:func:`keep_earlier`)."""
    return Path(path).parent.name == EARLIER


def earlier(chapter: str, run: str, root: Path | None = None) -> list[dict]:
    """The records of a chapter's run kept from its earlier configs (:func:`keep_earlier`),
    in the order of their file names (config hashes)."""
    current = record_path(chapter, run, root)
    return [read_record(p) for p in sorted((current.parent / EARLIER).glob("*.json"))
            if p.stem.rsplit(".", 1)[0] == current.stem]


def dumps(obj, level: int = 0) -> str:
    """``obj`` as JSON, one key per line, but each list of plain values (a row of an attention
    map, a sentence's tokens) on one line: readable in a diff, and about 40% smaller than
    indenting every number, which matters because the records travel to every GPU session
    with the tree."""
    pad, inner = " " * level, " " * (level + 1)
    if isinstance(obj, dict) and obj:
        items = [f"{inner}{json.dumps(k, ensure_ascii=False)}: {dumps(v, level + 1)}"
                 for k, v in obj.items()]
    elif isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        items = [inner + dumps(v, level + 1) for v in obj]
    else:
        return json.dumps(obj, ensure_ascii=False)
    opening, closing = ("{", "}") if isinstance(obj, dict) else ("[", "]")
    return f"{opening}\n" + ",\n".join(items) + f"\n{pad}{closing}"


def read_record(path: str | Path) -> dict:
    """A record (a training run's, or a measurement's), checked; a corrupt one is a one-line
    :class:`UserError` naming the file."""
    path = Path(path)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: no run record") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: corrupt run record: {e}") from None
    if not isinstance(record, dict):
        raise UserError(f"{path}: corrupt run record: not a JSON object")
    required = MEASUREMENT_REQUIRED if is_measurement(record) else REQUIRED
    missing = [k for k in required if k not in record]
    if missing:
        raise UserError(f"{path}: corrupt run record: missing {', '.join(missing)}")
    return record


def finished(record: dict) -> bool:
    """Whether the record's run finished its schedule (a partial record says ``complete:
    false``: a GPU session ended first)."""
    return record.get("complete", True)


def match(path: str | Path, config: dict, digests: dict) -> tuple[dict | None, str | None]:
    """``(record, None)`` if the record at ``path`` is of a finished run of this config (hash)
    and data (digests), else ``(None, why not)`` in a few words."""
    path = Path(path)
    if not path.exists():
        return None, "no record"
    record = read_record(path)
    if record["config_hash"] != config_hash(config):
        return None, f"a record of config {record['config_hash']}, not {config_hash(config)}"
    if record["data_digests"] != digests:
        return None, "a record of other data (its digests differ)"
    if not finished(record):
        return None, "a partial record (its schedule did not finish)"
    return record, None


def after_epochs(record: dict, epochs: int) -> dict:
    """``record``'s run as it stood after its first ``epochs`` epochs: the last of them is
    ``dev`` (and ``test``), the best of them ``best_dev``, with their seconds and history.

    The matched baseline of ablations and sweeps trained on a shorter schedule than their
    headline run (``epochs=E`` of the same config): nothing in the trainer's schedule depends on
    the number of epochs (warm-up and decay count steps, the plateau halving looks back), so
    the headline's first ``E`` epochs are the same run as the shorter one. The ``analysis``
    payload, drawn at the end of the whole run, is left out; the wall time, loss curve and
    config hash stay the whole run's (``after_epochs`` says the record was cut)."""
    from mrc_lib.tasks import get_task

    history = record["history"][:epochs]
    if epochs < 1 or len(history) < epochs:
        raise UserError(f"run {record['chapter']}/{record['run']}: {epochs} epoch(s) asked, its "
                        f"record has {len(record['history'])}")
    score = get_task(record["task"]).score
    best = max(history, key=lambda h: score(h["dev"]))  # the first of equals, as the trainer
    tests = {"test": history[-1]["test"], "best_test": best["test"]} if "test" in best else {}
    cut = {k: v for k, v in record.items() if k != "analysis"}
    return {**cut, "dev": history[-1]["dev"], "best_epoch": best["epoch"],
            "best_dev": best["dev"], **tests, "epochs_run": epochs, "steps": history[-1]["step"],
            "seconds_per_epoch": record["seconds_per_epoch"][:epochs], "seconds_this_epoch": 0.0,
            "history": history,
            "config": {**record["config"], "epochs": epochs}, "after_epochs": epochs}


def lookup(path: str | Path, config: dict, digests: dict) -> dict | None:
    """The record at ``path`` if it is of a finished run of the same config (hash) and data
    (digests), else ``None`` (no record, a partial or a stale one: the caller trains)."""
    return match(path, config, digests)[0]


def precision(record: dict) -> str:
    """How a run computed (:func:`mrc_lib.inference.autocast`): ``bf16`` autocast only where the
    config asks for it and the run was on CUDA; else full precision, whose matrix products CUDA
    runs in ``TF32`` (:func:`mrc_lib.train.train`) and a CPU in ``fp32``. A full-profile record
    trained on a CPU has the same config (hash) as a GPU's, and computed in fp32. Records
    older than their ``device_type`` ran on CUDA exactly when their torch had it.

    Under bf16 a reader's RNN layers are named apart: in full precision (the record's
    ``rnn_precision``), or, in a record older than that key, in fp16, as torch's autocast ran
    cuDNN RNNs then (:func:`mrc_lib.nn.rnn.full_precision`)."""
    from mrc_lib.inference import bf16_autocast

    device_type = record.get("device_type", "cuda" if record.get("cuda") else "cpu")
    if bf16_autocast(record["config"].get("bf16"), device_type):
        rnns = record["rnn_precision"] if "rnn_precision" in record else \
            "fp16" if has_rnns(record["config"]) else None
        return "bf16" if rnns is None else f"bf16, RNNs {rnns}"
    return "TF32" if device_type == "cuda" else "fp32"


@functools.lru_cache(maxsize=64)
def _has_rnns(model: str, hparams: str) -> bool:
    import torch

    from mrc_lib.bench import SyntheticVocab
    from mrc_lib.models import build_model
    from mrc_lib.nn.rnn import has_rnn_layers

    with torch.device("meta"):
        return has_rnn_layers(build_model(model, SyntheticVocab.random(size=1_000),
                                          **json.loads(hparams)))


def has_rnns(config: dict) -> bool:
    """Whether the reader ``config`` builds has RNN layers (built on the meta device)."""
    from mrc_lib.models import MODELS

    return config.get("model") in MODELS and \
        _has_rnns(config["model"], json.dumps(config.get("hparams", {}), sort_keys=True))


def trained_on(record: dict) -> str:
    """Where a run trained and in what precision (:func:`precision`): ``NVIDIA H200 (bf16)``;
    for a run whose sessions (``sessions``, :class:`mrc_lib.train.Progress`) trained on more
    than one device, each device with the steps it took: ``NVIDIA H200 (bf16) for steps
    1-1854 and Intel(R) Xeon(R) Processor (fp32) for steps 1855-7575``. A record older than
    ``sessions`` names the device of the session that wrote it, as it did then."""
    def where(session: dict) -> str:
        if session.get("device") is None:
            return "an unrecorded device"
        return f"{session['device']} ({precision({'config': record['config'], **session})})"

    sessions = record.get("sessions")
    if not sessions:
        return where(record)
    spans: list[list] = []  # [where, first step, last step] of consecutive sessions
    for session, after in zip(sessions, [*sessions[1:], None]):
        first, last = session["step"] + 1, after["step"] if after else record["steps"]
        if last < first:  # a session that took no step (it evaluated or stopped at once)
            continue
        if spans and spans[-1][0] == where(session):
            spans[-1][2] = last
        else:
            spans.append([where(session), first, last])
    if len(spans) < 2:
        return spans[0][0] if spans else where(sessions[-1])
    return " and ".join(f"{name} for steps {first}-{last}" for name, first, last in spans)


def provenance(record: dict) -> str:
    """Where and how a run was trained, for a table caption: device and precision
    (:func:`trained_on`), schedule, profile."""
    cfg = record["config"]
    steps = f", {record['steps']} steps" if cfg.get("max_steps") else ""
    return (f"{trained_on(record)}, {record['epochs_run']} epoch(s) of "
            f"batch {cfg['batch_size']}{steps}, {cfg['optimizer']}, "
            f"profile {record.get('profile')}")
