"""Reproduce a chapter: execute its notebook with papermill and publish the results in the book.

    python -m mrc_lib reproduce NAME --profile auto|smoke|full [-p KEY VALUE ...] [--force]
    python -m mrc_lib reproduce --all

``NAME`` is a notebook ``notebooks/NAME.ipynb`` such as ``01_bidaf_qanet``; ``--all`` runs every
``notebooks/[0-9][0-9]_*.ipynb`` in order. Profile ``auto`` means ``full`` when CUDA is
available and ``smoke`` otherwise.

The notebook's contract
-----------------------
Papermill sets the notebook's ``parameters`` cell: ``profile`` (``smoke`` or ``full``),
``out_dir`` (the run folder, relative to ``notebooks/``, which is the working directory),
``data_dir`` (``MRC_DATA_DIR`` or ``""``) and any ``-p KEY VALUE`` (values parsed as YAML).
The notebook writes ``{out_dir}/results.json``::

    {
      "tables": {                       # keyed by the paper's own numbering
        "table4": {
          "caption": "Single-model results.",
          "columns": ["Model", "EM", "EM (paper)", "F1", "F1 (paper)"],
          "paper_columns": ["EM (paper)", "F1 (paper)"],
          "rows": [["BiDAF", 41.2, 67.7, 52.3, 77.3]],
          "dataset": "SQuAD v1.1 dev",       # the data our numbers are measured on
          "paper_source": "Seo et al. (2017), Table 1, SQuAD v1.1 dev",   # optional
          "profile": "smoke"                 # optional; must equal the run's profile
        }
      },
      "figures": {"figure5a": "figure5a.png"},   # png files
      "notes": ["Trained on 1% of SQuAD v1.1 train."],              # optional
      "data_files": ["/abs/path/squad/dev-v1.1.json"],                # optional: digested
      "data_digests": {"dev-v1.1.json": "<sha256>"},                   # optional: as recorded
      "device": "NVIDIA A100-SXM4-40GB"          # optional: what the notebook ran on
    }

``columns`` is the whole header, in display order; ``paper_columns`` names the columns that
hold the paper's reported numbers, which must stand beside ours in every table (at least one
paper column, at least one of ours, at least one reported number). Cells are strings, numbers
or ``null`` (not reported). Relative paths are relative to ``out_dir``.

What the driver writes
----------------------
After a successful run, and only then: ``book/NAME.ipynb`` (the executed notebook),
``book/figures/NAME_figure5a.png`` (each figure), ``book/results/NAME.json``::

    {"name": ..., "title": <the notebook's first heading>, "tables": {...},
     "figures": {"figure5a": "figures/NAME_figure5a.png"}, "notes": [...],
     "metadata": {"profile", "device", "commit", "data": {file name: sha256},
                  "dirty": [tracked files that differed from the commit, book/ outputs and
                            notebooks' outputs excepted (mrc_lib.utils.git_state)],
                  "duration_s", "timestamp", "parameters",
                  "runs": {run: where its metrics came from (mrc_lib.notebook.Run.runs)}}}

and regenerates ``book/reproductions.md`` (:mod:`mrc_lib.book`). A smoke run starts from an
empty run folder (``runs/NAME/smoke``); a full one resumes the checkpoints it finds there. A
smoke run never replaces a full-profile result unless ``--force``. Every file is written atomically.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import yaml

from mrc_lib import book
from mrc_lib.errors import UserError
from mrc_lib.utils import (
    GENERATED,
    atomic_write_bytes,
    atomic_write_json,
    file_digest,
    git_state,
)

PROFILES = ("smoke", "full")
NOTEBOOK_PATTERN = "[0-9][0-9]_*.ipynb"
KERNEL = "python3"
CHECK_OUTPUT = "# NBVAL_CHECK_OUTPUT"


@dataclass(frozen=True)
class Layout:
    """Where notebooks are read from and where runs and the book are written."""

    root: Path = book.ROOT

    @property
    def notebooks(self) -> Path:
        return self.root / "notebooks"

    @property
    def book(self) -> Path:
        return self.root / "book"

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    def results(self, name: str) -> Path:
        return self.book / "results" / f"{name}.json"


def available(layout: Layout) -> list[str]:
    return sorted(p.stem for p in layout.notebooks.glob(NOTEBOOK_PATTERN))


def resolve_names(layout: Layout, name: str | None, run_all: bool) -> list[str]:
    """The notebooks to run: ``[name]`` or, with ``run_all``, every chapter in order."""
    names = available(layout)
    if run_all == (name is not None):
        raise UserError("give exactly one of NAME or --all")
    if run_all:
        if not names:
            raise UserError(f"no notebooks matching {NOTEBOOK_PATTERN} in {layout.notebooks}")
        return names
    if name not in names:
        raise UserError(f"unknown notebook {name!r}; available: {', '.join(names) or 'none'}")
    return [name]


def resolve_profile(profile: str) -> str:
    """``auto`` is ``full`` on a CUDA machine and ``smoke`` elsewhere."""
    if profile == "auto":
        import torch

        return "full" if torch.cuda.is_available() else "smoke"
    if profile not in PROFILES:
        raise UserError(f"unknown profile {profile!r}; use auto, smoke or full")
    return profile


def parse_params(pairs: list[list[str]]) -> dict:
    """``-p KEY VALUE`` pairs as notebook parameters; values are YAML (``1`` is a number)."""
    return {key: yaml.safe_load(value) for key, value in pairs}


def describe_device() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"


def check_overwrite(layout: Layout, name: str, profile: str, force: bool) -> None:
    """Refuse to let a smoke run replace a full-profile result, unless forced."""
    path = layout.results(name)
    if profile != "smoke" or force or not path.exists():
        return
    if json.loads(path.read_text(encoding="utf-8")).get("metadata", {}).get("profile") == "full":
        raise UserError(f"{path} holds a full-profile result and a smoke run would replace it; "
                        "run with --profile full, or add --force to replace it")


def _fail(source: Path, where: str, problem: str):
    raise UserError(f"{source}: {where}: {problem}")


def validate_table(source: Path, key: str, table: dict, profile: str) -> None:
    """Check one table against the contract in the module docstring."""
    where = f"tables.{key}"
    for field in ("caption", "dataset"):
        if not isinstance(table.get(field), str) or not table[field].strip():
            _fail(source, where, f"{field!r} must be a non-empty string")
    columns, paper = table.get("columns"), table.get("paper_columns")
    if not columns or len(set(columns)) != len(columns):
        _fail(source, where, "'columns' must be a non-empty list of distinct names")
    if not paper:
        _fail(source, where, "'paper_columns' is missing: every table shows the paper's "
                             "numbers beside ours")
    if not set(paper) < set(columns):
        _fail(source, where, "'paper_columns' must be some, not all, of 'columns'")
    rows = table.get("rows")
    if not isinstance(rows, list) or not all(
            isinstance(r, list) and len(r) == len(columns) for r in rows):
        _fail(source, where, f"'rows' must be a list of rows of {len(columns)} cells")
    cells = [c for r in rows for c in r]
    if not all(c is None or isinstance(c, str | int | float) for c in cells):
        _fail(source, where, "cells must be strings, numbers or null")
    paper_index = [columns.index(c) for c in paper]
    if all(r[i] is None for r in rows for i in paper_index):
        _fail(source, where, "no paper number in 'paper_columns'")
    if table.get("profile", profile) != profile:
        _fail(source, where, f"profile {table['profile']!r} but the run's is {profile!r}")


def validate_results(source: Path, results: dict, profile: str) -> None:
    """Check a notebook's ``results.json``; raise :class:`UserError` naming what is wrong."""
    tables, figures = results.get("tables", {}), results.get("figures", {})
    if not tables and not figures:
        _fail(source, "results", "no tables and no figures")
    for key, table in tables.items():
        if not re.fullmatch(r"table\w+", key):
            _fail(source, f"tables.{key}", "keys are the paper's numbering, like 'table4'")
        validate_table(source, key, table, profile)
    for key, path in figures.items():
        if not re.fullmatch(r"figure\w+", key):
            _fail(source, f"figures.{key}", "keys are the paper's numbering, like 'figure5a'")
        if not (source.parent / path).is_file():
            _fail(source, f"figures.{key}", f"no file {source.parent / path}")
    for path in results.get("data_files", []):
        if not (source.parent / path).is_file():
            _fail(source, "data_files", f"no file {source.parent / path}")


def notebook_title(path: Path, default: str) -> str:
    """The first Markdown heading of a notebook."""
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        if cell["cell_type"] == "markdown":
            if m := re.search(r"^#+\s+(.+)$", "".join(cell["source"]), re.MULTILINE):
                return m.group(1).strip()
    return default


def publish_notebook(executed: Path, dest: Path, root: Path) -> None:
    """Copy an executed notebook into the book, with papermill's paths made project-relative."""
    notebook = json.loads(executed.read_text(encoding="utf-8"))
    meta = notebook["metadata"].get("papermill", {})
    for key in ("input_path", "output_path"):
        if meta.get(key):
            meta[key] = os.path.relpath(meta[key], root)
    atomic_write_json(dest, notebook, indent=1)


def sync_checked_outputs(executed: Path, source: Path) -> None:
    """Give the source notebook the outputs nbval compares and nothing else: cells starting
    with ``# NBVAL_CHECK_OUTPUT`` take the executed run's outputs (matched by cell id), every
    other output and execution count is stripped."""
    ran = {c.get("id"): c for c in json.loads(executed.read_text(encoding="utf-8"))["cells"]}
    notebook = json.loads(source.read_text(encoding="utf-8"))
    for cell in notebook["cells"]:
        if cell["cell_type"] != "code":
            continue
        checked = "".join(cell["source"]).lstrip().startswith(CHECK_OUTPUT)
        done = ran.get(cell.get("id")) if checked else None
        # nbval refuses stored outputs without an execution count: keep the run's count
        cell["outputs"] = done["outputs"] if done else []
        cell["execution_count"] = done.get("execution_count") if done else None
    atomic_write_json(source, notebook, indent=1)


@contextlib.contextmanager
def environment(**values: str):
    """Set environment variables (inherited by the kernel) for the duration of a block."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def execute(layout: Layout, name: str, parameters: dict, out_dir: Path, env: dict) -> Path:
    """Run ``notebooks/NAME.ipynb`` in ``notebooks/`` with papermill; return the executed copy."""
    import papermill

    executed = out_dir / f"{name}.ipynb"
    try:
        with environment(**env):
            papermill.execute_notebook(str(layout.notebooks / f"{name}.ipynb"), str(executed),
                                       parameters=parameters, kernel_name=KERNEL,
                                       cwd=str(layout.notebooks), progress_bar=False)
    except papermill.PapermillExecutionError as e:
        raise UserError(f"notebook {name} failed in cell {e.exec_count}: {e.ename}: "
                        f"{e.evalue} (executed notebook: {executed})") from e
    return executed


def reproduce(name: str, profile: str, params: dict | None = None, force: bool = False,
              layout: Layout = Layout(), *, retrain: bool = False,
              records_only: bool = False) -> Path:
    """Run one chapter at a resolved ``profile`` and publish it; return its results file.
    At the full profile the notebook reads each run's record (``book/runs/NAME/``) instead of
    training it, unless ``retrain``; with ``records_only`` it stops where a run has no record
    (:mod:`mrc_lib.records`)."""
    check_overwrite(layout, name, profile, force)
    out_dir = layout.runs / name / profile
    if profile == "smoke":  # minutes of CPU: start afresh, never resume runs of older code
        shutil.rmtree(out_dir, ignore_errors=True)
    (out_dir / "results.json").unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    # The kernel runs in notebooks/: a relative MRC_DATA_DIR (relative to where we run) is
    # passed on relative to notebooks/ as a parameter, and absolute in the environment.
    data_dir = os.environ.get("MRC_DATA_DIR", "")
    data_dir = os.path.abspath(data_dir) if data_dir else ""
    parameters = {
        "profile": profile,
        "out_dir": os.path.relpath(out_dir, layout.notebooks),
        "data_dir": os.path.relpath(data_dir, layout.notebooks) if data_dir else "",
        **(params or {}),
    }
    start = time.monotonic()
    env = {"MRC_CHAPTER": name, "MRC_RETRAIN": "1" if retrain else "0",
           "MRC_RECORDS_ONLY": "1" if records_only else "0",
           **({"MRC_DATA_DIR": data_dir} if data_dir else {})}
    executed = execute(layout, name, parameters, out_dir, env)
    duration = time.monotonic() - start

    source = out_dir / "results.json"
    if not source.is_file():
        raise UserError(f"notebook {name} did not write {source}")
    results = json.loads(source.read_text(encoding="utf-8"))
    validate_results(source, results, profile)

    figures = {}
    for key, path in results.get("figures", {}).items():
        figure = Path("figures") / f"{name}_{key}{Path(path).suffix}"
        atomic_write_bytes(layout.book / figure, (out_dir / path).read_bytes())
        figures[key] = figure.as_posix()
    publish_notebook(executed, layout.book / f"{name}.ipynb", layout.root)
    if profile == "smoke":  # what nbval checks in CI is what this CPU run printed
        sync_checked_outputs(executed, layout.notebooks / f"{name}.ipynb")
    published = {
        "name": name,
        "title": notebook_title(executed, default=name),
        "tables": {k: {**t, "profile": profile} for k, t in results.get("tables", {}).items()},
        "figures": figures,
        "figure_scales": results.get("figure_scales", {}),  # figures the same at every profile
        "notes": results.get("notes", []),
        "metadata": {
            "profile": profile,
            "device": results.get("device") or describe_device(),
            **git_state(layout.root, GENERATED),  # "commit", "dirty": what ran
            "data": {**results.get("data_digests", {}),
                     **{Path(p).name: file_digest(out_dir / p)
                        for p in results.get("data_files", [])}},
            "duration_s": round(duration, 1),
            "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
            "parameters": parameters,
            "runs": results.get("runs", {}),
        },
    }
    atomic_write_json(layout.results(name), published)
    book.write_reproductions(layout.book / "results", layout.book / "reproductions.md")
    return layout.results(name)


def reproduce_cli(args, layout: Layout = Layout()) -> list[Path]:
    """``python -m mrc_lib reproduce``: check every chapter may be written, then run each."""
    names = resolve_names(layout, args.name, args.all)
    profile = resolve_profile(args.profile)
    params = parse_params(args.params)
    retrain, records_only = getattr(args, "retrain", False), getattr(args, "records_only", False)
    if records_only and (profile != "full" or retrain):
        raise UserError("--records-only builds a chapter from its full-profile run records: "
                        "use it with --profile full and without --retrain")
    for name in names:
        check_overwrite(layout, name, profile, args.force)
    written = []
    for name in names:
        written.append(reproduce(name, profile, params, args.force, layout,
                                 retrain=retrain, records_only=records_only))
        print(written[-1])
    return written
