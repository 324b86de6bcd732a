"""What every chapter notebook does around its content: resolve the papermill parameters, label
smoke-scale runs, and write ``results.json`` (tables with the paper's numbers beside ours,
figures) in the format :mod:`mrc_lib.reproduce` publishes."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from mrc_lib.errors import UserError
from mrc_lib.reproduce import resolve_profile, validate_results
from mrc_lib.train import device_name, resolve_device
from mrc_lib.utils import atomic_write_json

SMOKE_BANNER = ("**Smoke-scale (CPU) run.** Small real subset, shrunk models, a few minutes on a "
                "CPU: the numbers below check that everything runs end to end and are **not** "
                "comparable to the paper's. The full profile runs on a GPU "
                "(`python -m mrc_lib reproduce NAME --profile full`).")


@dataclass
class Run:
    """One execution of a chapter notebook."""

    profile: str
    seed: int
    device: torch.device
    out_dir: Path
    tables: dict = field(default_factory=dict)
    figures: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    data_digests: dict = field(default_factory=dict)  # file name -> sha256 of the data used
    chapter: str = ""  # the notebook's name, e.g. "01_bidaf_qanet": where its records go
    retrain: bool = False  # at full, train even where a matching record exists
    records_only: bool = False  # at full, never train: a run without its record is an error
    runs: dict = field(default_factory=dict)  # run name -> where its metrics came from
    figure_scales: dict = field(default_factory=dict)  # figure key -> data, at every profile

    @property
    def smoke(self) -> bool:
        return self.profile == "smoke"

    @property
    def tag(self) -> str:
        """A label for figure titles: smoke-scale results say so wherever they appear."""
        return " (smoke-scale run)" if self.smoke else ""

    def table(self, key: str, *, caption: str, columns: list[str], rows: list[list],
              paper_columns: list[str], dataset: str, paper_source: str | None = None,
              scale: str | None = None):
        """Record a table; ``paper_columns`` name the columns holding the paper's numbers.
        ``scale`` names the data a table was computed on when that is the same at every
        profile (e.g. "full SQuAD v1.1 dev"): it is then labelled by it, not as smoke-scale."""
        self.tables[key] = {"caption": caption + ("" if scale else self.tag), "columns": columns,
                            "rows": rows, "paper_columns": paper_columns, "dataset": dataset,
                            "profile": self.profile,
                            **({"paper_source": paper_source} if paper_source else {}),
                            **({"scale": scale} if scale else {})}
        import pandas as pd

        return pd.DataFrame(rows, columns=columns)

    def figure(self, key: str, fig, *, dpi: int = 110, scale: str | None = None) -> Path:
        """Save ``fig`` as ``key.png``; a smoke-scale figure is stamped as such in its corner,
        unless ``scale`` names the data it was computed on at every profile (as for tables)."""
        if scale:
            self.figure_scales[key] = scale
        elif self.smoke:
            fig.text(0.995, 0.003, "smoke-scale run (CPU): not comparable to the paper",
                     ha="right", va="bottom", fontsize=8, color="firebrick")
        path = self.out_dir / f"{key}.png"
        fig.savefig(path, dpi=dpi, bbox_inches="tight")
        self.figures[key] = path.name
        return path

    def record_path(self, name: str) -> Path:
        """Run ``name``'s record: committed under ``book/runs/<chapter>/`` at the full profile,
        in the run folder (not committed) otherwise."""
        from mrc_lib import records

        if self.smoke:
            return self.out_dir / name / "record.json"
        return records.record_path(self.chapter, name)

    def train(self, name: str, cfg, data=None, *, retrain: bool | None = None) -> dict:
        """Train run ``name`` of this chapter per ``cfg`` (resuming its checkpoint if one is
        there), write its record and return its metrics, with the reader's ``analysis``
        payload when it has one. At the full profile, a record of the same config and data
        (:func:`mrc_lib.records.match`) is returned instead, unless ``retrain`` (default: the
        run's ``retrain``); with ``records_only`` a run without its record is a one-line
        :class:`UserError` naming the record and why it does not match. Chapters train through
        this one call, so that runs are recorded in one place."""
        from mrc_lib import records
        from mrc_lib.train import load_data, train

        data = data if data is not None else load_data(cfg)
        path, out = self.record_path(name), self.out_dir / name

        def trained() -> dict:
            metrics = train(cfg, out, resume=(out / "checkpoint.pt").exists(), data=data)
            return records.make_record(metrics, chapter=self.chapter, run=name,
                                       log_path=out / "log.jsonl")

        return self._record(name, path, lambda: records.match(path, cfg.to_dict(), data.digests),
                            trained, self.retrain if retrain is None else retrain,
                            f"run {name!r} would train")

    def measure(self, name: str) -> dict:
        """The record of this chapter's measurement ``name``
        (:func:`mrc_lib.measurements.registry`): at the full profile, the committed one when it
        measured the same spec and this device may read it (:func:`mrc_lib.measurements.match`),
        unless ``retrain``; with ``records_only`` a missing one is a one-line
        :class:`UserError`. Otherwise it measures on this run's device and writes the record
        (:meth:`record_path`)."""
        from mrc_lib import measurements

        m = measurements.find(self.chapter, name)
        path, spec = self.record_path(name), m.spec(self.profile)
        return self._record(name, path, lambda: measurements.match(path, spec, self.device.type),
                            lambda: measurements.make(m, self.profile, self.device.type, spec),
                            self.retrain, f"measurement {name!r} would run")

    def _record(self, name: str, path: Path, match, make, retrain: bool, would: str) -> dict:
        """At the full profile and unless ``retrain``, the record ``match()`` finds at ``path``
        (``(record, None)`` or ``(None, why not)``); with ``records_only`` a miss is a
        one-line :class:`UserError` saying why and what ``would`` happen. Otherwise ``make()``'s
        record, written to ``path``."""
        from mrc_lib import records

        if not self.smoke and not retrain:
            found, why = match()
            if found is not None:
                self._note(name, found, record=str(path.relative_to(records.ROOT)))
                return found
            if self.records_only:
                raise UserError(f"{path}: {why}; {would}, and records_only (reproduce "
                                "--records-only) never does")
        record = make()
        records.write_record(path, record)
        self._note(name, record, **{"measured" if records.is_measurement(record)
                                    else "trained": True})
        return record

    def _note(self, name: str, found: dict, **source) -> None:
        """Where run ``name``'s metrics came from (``results.json``'s ``runs``)."""
        from mrc_lib import records

        if records.is_measurement(found):
            from mrc_lib.measurements import provenance

            self.runs[name] = {**source, "profile": found["profile"], "complete": True,
                               "provenance": provenance(found)}
            return
        self.runs[name] = {**source, "profile": found["config"]["profile"],
                           "complete": records.finished(found),
                           "provenance": records.provenance(found)}

    def save(self) -> Path:
        results = {"tables": self.tables, "figures": self.figures, "notes": self.notes,
                   "data_digests": self.data_digests, "device": device_name(self.device),
                   "runs": self.runs, "figure_scales": self.figure_scales}
        path = self.out_dir / "results.json"
        partial = sorted(name for name, r in self.runs.items()
                         if r["profile"] != self.profile or not r["complete"])
        if not self.smoke and partial:
            raise UserError(f"{path}: runs {', '.join(partial)} are not complete {self.profile}-"
                            "profile runs; a chapter is full only when all its runs are")
        validate_results(path, results, self.profile)
        atomic_write_json(path, results)
        return path


def start(profile: str = "auto", seed: int = 0, data_dir: str = "", device: str = "auto",
          out_dir: str = "runs/notebook", *, chapter: str = "", retrain: bool = False,
          banner: bool = True) -> Run:
    """Resolve parameters (``auto`` profile: full on CUDA, smoke otherwise), seed everything,
    point the data pipeline at ``data_dir`` and show the smoke banner when it applies.
    ``chapter`` defaults to ``MRC_CHAPTER`` (set by ``reproduce``), else the name of
    ``out_dir``'s parent (``runs/<chapter>/<profile>``); ``retrain`` is also set by
    ``MRC_RETRAIN=1`` (``reproduce --retrain``), ``records_only`` by ``MRC_RECORDS_ONLY=1``
    (``reproduce --records-only``). ``banner=False``: a chapter whose work is the
    same at every profile shows no smoke banner (it labels its tables with ``scale``).
    pandas then shows table cells whole: its default cuts them at 50 characters, which would
    hide a claim or a paper's numbers on the rendered page."""
    import pandas as pd

    pd.set_option("display.max_colwidth", None)
    if data_dir:
        os.environ["MRC_DATA_DIR"] = str(Path(data_dir).resolve())
    chapter = chapter or os.environ.get("MRC_CHAPTER") or Path(out_dir).resolve().parent.name
    retrain = retrain or os.environ.get("MRC_RETRAIN") == "1"
    run = Run(resolve_profile(profile), seed, resolve_device(device), Path(out_dir),
              chapter=chapter, retrain=retrain,
              records_only=os.environ.get("MRC_RECORDS_ONLY") == "1")
    run.out_dir.mkdir(parents=True, exist_ok=True)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if run.smoke and banner:
        from IPython.display import Markdown, display

        display(Markdown(SMOKE_BANNER))
    return run
