"""The comparison chapter's logic: run records read tolerantly, each reader's accuracy from
them, and the papers' claims with a verdict computed from the records.

A record is :mod:`mrc_lib.records`' JSON under ``book/runs/<chapter>/<run>.json``. A side of a
claim names the queue runs of the paper's table row (``runs``: ``<chapter>/<run>`` as in
``mrc_lib/queue.yaml``, ``{seed}`` for any seed), so that an ablation, a sweep or another
setting of the same reader never counts for it. A record counts when it is one of those runs,
its config matches the side's ``model``, ``dataset``, ``data_options`` and ``hparams`` (a
subset), it is complete and at the ``full`` profile. A side with no such run is *not yet
measured*, never a number.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean

from mrc_lib.errors import UserError
from mrc_lib.models import hparam_defaults
from mrc_lib.records import BOOK_RUNS, finished

REPRODUCED, NOT_REPRODUCED, NOT_MEASURED = "reproduced", "not reproduced", "not yet measured"
V2 = "squad-v2.0"


def load_records(root: str | Path = BOOK_RUNS) -> list[dict]:
    """Every readable record in a chapter folder under ``root``, at any depth (a run named
    ``phasecond/seed0`` is ``06_phasecond/phasecond/seed0.json``); none when the folder is
    absent. A file that is not a record (unreadable, or no ``config``/``dev``) is skipped."""
    found = []
    for path in sorted(Path(root).glob("*/**/*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and "config" in record and "dev" in record:
            found.append(record)
    return found


# The queue run that stands for each span reader in this chapter's tables: its paper's
# SQuAD v1.1 headline row. DynSAN's is Table 4's (Zhuang & Wang 2019, Sec. 4.7: top K = 32 on
# SQuAD), not the profile's multi-passage K = 256.
HEADLINE_RUNS = {
    "bidaf": "01_bidaf_qanet/bidaf",
    "qanet": "01_bidaf_qanet/qanet",
    "dynsan": "02_dynsan/table4_dynsa",
    "rnet": "03_decaprop/rnet",
    "decaprop": "03_decaprop/decaprop",
    "iterative_aligner": "06_phasecond/iterative_aligner/seed{seed}",
    "phasecond": "06_phasecond/phasecond_qpattplus/seed{seed}",
}


@dataclass(frozen=True)
class Side:
    """The runs one side of a claim names: ``runs`` (``<chapter>/<run>``, ``{seed}`` standing
    for any seed; ``None``: any run) of ``model`` on ``dataset`` with ``data_options`` and
    ``hparams`` (a subset of the record's)."""

    model: str
    dataset: str = "squad-v1.1"
    hparams: dict = field(default_factory=dict)
    runs: str | None = None
    data_options: dict = field(default_factory=dict)

    @classmethod
    def headline(cls, model: str, profile: str = "full") -> Side:
        """The reader's headline run (:data:`HEADLINE_RUNS`); for a reader without one, any
        run of the reader as its ``profile`` configures it (not an ablation of it)."""
        from mrc_lib.config import resolve_config

        if model in HEADLINE_RUNS:
            return cls(model, runs=HEADLINE_RUNS[model])
        cfg = resolve_config(model, profile=profile)
        return cls(model, cfg.dataset, {**hparam_defaults(model), **cfg.hparams},
                   data_options=dict(cfg.data_options))

    def names(self, record: dict) -> bool:
        """Is ``record`` one of the side's runs?"""
        if self.runs is None:
            return True
        pattern = re.escape(self.runs).replace(re.escape("{seed}"), r"\d+")
        return re.fullmatch(pattern, f"{record.get('chapter')}/{record.get('run')}") is not None

    def matches(self, record: dict) -> bool:
        config = record["config"]
        if config.get("model") != self.model or not self.names(record):
            return False
        hparams = {**hparam_defaults(self.model), **config.get("hparams", {})}
        return (config.get("dataset") == self.dataset and config.get("profile") == "full"
                and dict(config.get("data_options") or {}) == self.data_options
                and finished(record)
                and all(hparams.get(k) == v for k, v in self.hparams.items()))


def reported(record: dict) -> dict:
    """The scores a run's chapter reports. A SQuAD 2.0 run's ``dev`` is the ``adapt`` half at
    a fixed threshold, and offline that half is also training data
    (:mod:`mrc_lib.data.squad2`); it reports the ``eval`` half at the threshold tuned on
    ``adapt``, as chapter 04 does. Any other run reports ``dev``."""
    if record["config"].get("dataset") == V2:
        return ((record.get("analysis") or {}).get("scores") or {}).get("eval") or {}
    return record["dev"]


def score(records: list[dict], side: Side, metric: str = "f1") -> float | None:
    """The mean reported ``metric`` (:func:`reported`) of the side's runs (seeds), or None
    when it has none."""
    values = [reported(r)[metric] for r in records if side.matches(r) and metric in reported(r)]
    return mean(values) if values else None


def speed(records: list[dict], side: Side) -> float | None:
    """The mean training examples per second of the side's runs, or None."""
    values = [r["examples_per_second"] for r in records
              if side.matches(r) and r.get("examples_per_second")]
    return mean(values) if values else None


def verdict_better(ours: float | None, baseline: float | None) -> str:
    """"A beats B": reproduced when our A scores above our B."""
    if ours is None or baseline is None:
        return NOT_MEASURED
    return REPRODUCED if ours > baseline else NOT_REPRODUCED


def verdict_all_better(pairs: list[tuple[float | None, float | None]]) -> str:
    """"A helps every base": reproduced when it beats each base; not yet measured while any
    pair is missing."""
    verdicts = [verdict_better(a, b) for a, b in pairs]
    if NOT_MEASURED in verdicts:
        return NOT_MEASURED
    return REPRODUCED if all(v == REPRODUCED for v in verdicts) else NOT_REPRODUCED


def verdict_faster_similar(speed_a: float | None, speed_b: float | None, f1_a: float | None,
                           f1_b: float | None, tolerance: float = 1.0) -> str:
    """"A is faster than B at similar accuracy": A trains more examples per second and its F1
    is within ``tolerance`` points of B's (the paper's own gap, 80.1 vs 79.5, is 0.6)."""
    if None in (speed_a, speed_b, f1_a, f1_b):
        return NOT_MEASURED
    return REPRODUCED if speed_a > speed_b and f1_a >= f1_b - tolerance else NOT_REPRODUCED


def fmt(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.2f}"


# The sides of the claims: the queue runs of the paper rows each claim compares.
SIDES = {
    "rnet": Side("rnet", runs=HEADLINE_RUNS["rnet"]),
    "decaprop": Side("decaprop", runs=HEADLINE_RUNS["decaprop"]),
    # PhaseCond's Table 2 like-for-like rows: both without the extra question encoders (QPAtt+)
    "aligner": Side("iterative_aligner", runs="06_phasecond/iterative_aligner/seed{seed}"),
    "phasecond": Side("phasecond", runs="06_phasecond/phasecond/seed{seed}"),
    # DynSAN's Table 4 rows: single-passage SQuAD v1.1, DynSAN with K = 32
    "dynsan": Side("dynsan", runs=HEADLINE_RUNS["dynsan"]),
    "fullsan": Side("dynsan", runs="02_dynsan/table4_fullsan"),
    # ABA's Table 1 rows: each base with and without ABA, on the SQuAD 2.0 protocol
    "bidafpp": Side("bidafpp", V2, runs="04_aba/bidafplusplus_seed{seed}"),
    "bidafpp_aba": Side("bidafpp", V2, runs="04_aba/bidafplusplus_plus_aba_seed{seed}"),
    "qanet_na": Side("qanet_na", V2, runs="04_aba/qanet_seed{seed}"),
    "qanet_na_aba": Side("qanet_na", V2, runs="04_aba/qanet_plus_aba_seed{seed}"),
    "san": Side("san", V2, runs="04_aba/san_seed{seed}"),
    "san_aba": Side("san", V2, runs="04_aba/san_plus_aba_seed{seed}"),
}


def claims(records: list[dict]) -> list[list]:
    """Rows ``[claim, paper's numbers (table named), ours, verdict]`` of the papers' claims."""
    rnet, decaprop, aligner, phasecond, dynsan, fullsan = (
        SIDES[k] for k in ("rnet", "decaprop", "aligner", "phasecond", "dynsan", "fullsan"))
    bases = [(name, SIDES[key], SIDES[f"{key}_aba"])
             for name, key in (("BiDAF++", "bidafpp"), ("QANet", "qanet_na"), ("SAN", "san"))]
    base_scores = [(score(records, with_aba), score(records, base))
                   for _, base, with_aba in bases]
    return [
        ["DecaProp beats R-NET (SQuAD v1.1 dev F1)",
         "Tay et al. (2018), Table 6 (SQuAD dev; v1.1 by our reading, the version is not "
         "printed): DecaProp 81.4 F1, R-NET (their re-implementation) 79.6",
         f"DecaProp {fmt(score(records, decaprop))}, R-NET {fmt(score(records, rnet))}",
         verdict_better(score(records, decaprop), score(records, rnet))],
        ["PhaseCond beats the Iterative Aligner (SQuAD v1.1 dev F1, mean of runs)",
         "PhaseCond paper (ICLR 2018 submission), Table 2: PhaseCond 80.53, Iterative "
         "Aligner 80.23 (F1 mean of five runs)",
         f"PhaseCond {fmt(score(records, phasecond))}, Iterative Aligner "
         f"{fmt(score(records, aligner))}",
         verdict_better(score(records, phasecond), score(records, aligner))],
        ["ABA helps each of the three bases we train (SQuAD 2.0 F1; ours on the eval half of "
         "dev-v2.0, threshold tuned on the adapt half, as in chapter 04)",
         "Chen et al. (2021), Table 1 (SQuAD 2.0, split not stated): BiDAF++ 68.7 → 70.8, "
         "QANet 67.2 → 69.1, SAN 71.4 → 73.7 (F1)",
         "; ".join(f"{name} {fmt(b)} → {fmt(a)}" for (name, _, _), (a, b)
                   in zip(bases, base_scores)),
         verdict_all_better(base_scores)],
        ["DynSAN trains faster than full self-attention at similar accuracy (SQuAD v1.1; ours "
         "on dev; our full SAN is QANet's encoder block with torch's fused attention, chapter "
         "02's table4_fullsan run, where chapter 02 also sets the paper's row beside an "
         "attention that materializes L × L)",
         "Zhuang & Wang (2019), Table 4 (SQuAD 1.1, split not stated): training speed-up over "
         "Bi-LSTM DynSAN 4.3x, Full SAN 3.5x; EM/F1 69.9/79.5 and 70.6/80.1",
         f"examples/s DynSAN {fmt(speed(records, dynsan))}, full SAN "
         f"{fmt(speed(records, fullsan))}; F1 {fmt(score(records, dynsan))} and "
         f"{fmt(score(records, fullsan))}",
         verdict_faster_similar(speed(records, dynsan), speed(records, fullsan),
                                score(records, dynsan), score(records, fullsan))],
    ]


# The chapter's two measurements per profile (:mod:`mrc_lib.measurements`), each its own
# record so that a cut GPU command loses at most one. Speed: every reader at one context length
# and batch, ``steps`` timed after ``warmup``. Context length: each reader at every length of
# ``lengths`` (batch ``batch_size``) until one training step takes over ``step_limit`` seconds.
SPEED = {"smoke": {"seq_len": 256, "batch_size": 4, "steps": 2, "warmup": 1},
         "full": {"seq_len": 400, "batch_size": 32, "steps": 10, "warmup": 3}}
CONTEXT_LENGTH = {
    "smoke": {"lengths": [256, 1024, 4096], "batch_size": 1, "steps": 1, "warmup": 0,
              "step_limit": 2},
    "full": {"lengths": [256, 1024, 4096], "batch_size": 8, "steps": 5, "warmup": 2,
             "step_limit": 10},
}


def reader_key(model: str, profile: str) -> str:
    """What a reader's speed follows from at ``profile``, hashed: its hyperparameters (defaults
    included), bf16, optimizer and weight average; its data and schedule do not count."""
    from mrc_lib.config import resolve_config
    from mrc_lib.records import config_hash

    cfg = resolve_config(model, profile=profile).to_dict()
    return config_hash({k: cfg[k] for k in ("model", "hparams", "bf16", "optimizer",
                                            "ema_decay")})


def _spec(protocols: dict, profile: str) -> dict:
    size = "smoke" if profile == "smoke" else "full"
    readers, _ = span_readers(size)
    return {"size": size, "protocol": protocols[size],
            "readers": {name: reader_key(name, size) for name in readers}}


def speed_spec(profile: str) -> dict:
    """What the speed measurement measures at ``profile``: :data:`SPEED`'s protocol and every
    span reader's :func:`reader_key`."""
    return _spec(SPEED, profile)


def context_length_spec(profile: str) -> dict:
    """What the context-length measurement measures at ``profile``: :data:`CONTEXT_LENGTH`'s
    protocol and every span reader's :func:`reader_key`."""
    return _spec(CONTEXT_LENGTH, profile)


def measure_speed(spec: dict, device: str) -> dict:
    """:func:`speed_spec`'s measurement on ``device``: ``readers``, the
    :func:`mrc_lib.bench.bench` of each."""
    from mrc_lib.bench import bench

    p = spec["protocol"]
    return {"readers": {name: bench(name, p["seq_len"], p["batch_size"], p["steps"], device,
                                    profile=spec["size"], warmup=p["warmup"])
                        for name in spec["readers"]}}


def measure_context_length(spec: dict, device: str) -> dict:
    """:func:`context_length_spec`'s measurement on ``device``: ``sweep`` (training examples/s
    and peak memory per reader and context length) and ``notes`` (a reader out of GPU memory
    at a length)."""
    import torch

    from mrc_lib.bench import bench

    p = spec["protocol"]
    sweep, notes = [], []
    for name in spec["readers"]:
        for length in p["lengths"]:
            try:
                b = bench(name, length, p["batch_size"], p["steps"], device,
                          profile=spec["size"], warmup=p["warmup"])
            except torch.cuda.OutOfMemoryError:
                notes.append(f"{name}: out of GPU memory at {length} context tokens")
                torch.cuda.empty_cache()
                break
            sweep.append({"reader": name, "length": length,
                          "train ex/s": b["train_examples_per_s"],
                          "peak MiB": b["peak_memory_bytes"] / 2**20})
            if p["batch_size"] / b["train_examples_per_s"] > p["step_limit"]:  # s per step
                break
    return {"sweep": sweep, "notes": notes}


def span_readers(profile: str = "smoke") -> tuple[list[str], dict[str, str]]:
    """The registry's span readers (``mrc_lib.models.MODELS``, enumerated), and the others with
    why they are left out: a reader without a section in ``profile``, a reader whose profile
    trains it on a choice task (:mod:`mrc_lib.tasks`), a reader with a no-answer head (a
    SQuAD 2.0 reader), and one that cannot read a span batch."""
    import torch

    from mrc_lib.bench import SyntheticVocab, synthetic_batch
    from mrc_lib.config import SPAN_TASKS, resolve_config
    from mrc_lib.models import MODELS, _import_readers, build_model

    _import_readers()
    vocab = SyntheticVocab.random(size=1000)
    batch = synthetic_batch(vocab, 1, 32)
    readers, excluded = [], {}
    for name in sorted(MODELS):
        try:
            cfg = resolve_config(name, profile=profile)
        except UserError:
            excluded[name] = f"no section in the {profile} profile"
            continue
        if cfg.task not in SPAN_TASKS:
            excluded[name] = f"a {cfg.task.replace('_', '-')} reader, not a span reader"
            continue
        try:
            with torch.no_grad():
                out = build_model(name, vocab, **cfg.hparams).eval()(batch)
        except Exception as e:  # noqa: BLE001 - any failure means: not a span reader here
            excluded[name] = f"not a span reader on SQuAD batches ({type(e).__name__})"
            continue
        if "na_logits" in out:
            excluded[name] = "no-answer head: a SQuAD 2.0 reader (chapter 04)"
        elif "start_logits" in out:
            readers.append(name)
        else:
            excluded[name] = "no span output"
    return readers, excluded
