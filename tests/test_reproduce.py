"""The reproduction driver on a tiny chapter notebook, in a temporary project tree."""

import argparse
import hashlib
import json

import nbformat
import pytest

from mrc_lib.cli import main
from mrc_lib.errors import UserError
from mrc_lib.reproduce import (
    Layout,
    describe_device,
    parse_params,
    reproduce,
    reproduce_cli,
    resolve_names,
    validate_results,
)

PARAMETERS = """\
profile = "smoke"
out_dir = "."
data_dir = ""
seed = 0
device = "auto"
"""

CHAPTER = """\
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

out = Path(out_dir)
fig, ax = plt.subplots(figsize=(2, 2))
ax.plot([0, 1], [seed, 1])
fig.savefig(out / "curve.png")
(out / "data.txt").write_text("tiny data")
table = {"caption": "Tiny.", "columns": ["Model", "F1", "F1 (paper)"],
         "paper_columns": ["F1 (paper)"], "rows": [["tiny", 1.5, 77.3]],
         "dataset": "fixture data"}
results = {"tables": {"table2": table}, "figures": {"figure3": "curve.png"},
           "notes": [f"seed {seed}", f"data {Path(data_dir).resolve() if data_dir else ''}"],
           "data_files": [str((out / "data.txt").resolve())]}
(out / "results.json").write_text(json.dumps(results))
"""


def write_chapter(root, name="01_tiny"):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(PARAMETERS, metadata={"tags": ["parameters"]}),
                nbformat.v4.new_markdown_cell("# A tiny chapter\n\nIt plots a line."),
                nbformat.v4.new_code_cell(CHAPTER)]
    (root / "notebooks").mkdir(exist_ok=True)
    nbformat.write(nb, root / "notebooks" / f"{name}.ipynb")


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One smoke reproduction of the tiny chapter, with a relative MRC_DATA_DIR."""
    root = tmp_path_factory.mktemp("project")
    write_chapter(root)
    (root / "data").mkdir()
    stale = root / "runs" / "01_tiny" / "smoke" / "bidaf" / "checkpoint.pt"
    stale.parent.mkdir(parents=True)
    stale.write_text("a run of older code")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.setenv("MRC_DATA_DIR", "data")
        path = reproduce("01_tiny", "smoke", {"seed": 3}, layout=Layout(root))
    return root, path


def test_publishes_notebook_results_and_figure(smoke_run):
    root, path = smoke_run
    assert path == root / "book" / "results" / "01_tiny.json"
    published = json.loads(path.read_text())
    assert published["title"] == "A tiny chapter"
    table = published["tables"]["table2"]
    assert table["rows"] == [["tiny", 1.5, 77.3]] and table["profile"] == "smoke"
    assert published["figures"] == {"figure3": "figures/01_tiny_figure3.png"}
    run = root / "runs" / "01_tiny" / "smoke"
    assert (root / "book" / "figures" / "01_tiny_figure3.png").read_bytes() == \
        (run / "curve.png").read_bytes()
    executed = nbformat.read(root / "book" / "01_tiny.ipynb", as_version=4)
    assert [c.outputs for c in executed.cells if c.cell_type == "code"]  # was executed
    assert executed.metadata.papermill.input_path == "notebooks/01_tiny.ipynb"


def test_smoke_starts_from_an_empty_run_folder(smoke_run):
    root, _ = smoke_run
    assert not (root / "runs" / "01_tiny" / "smoke" / "bidaf").exists()


def test_parameters_reach_the_notebook(smoke_run):
    root, path = smoke_run
    published = json.loads(path.read_text())
    assert published["notes"] == ["seed 3", f"data {(root / 'data').resolve()}"]
    assert published["metadata"]["parameters"] == {
        "profile": "smoke", "out_dir": "../runs/01_tiny/smoke", "data_dir": "../data", "seed": 3}


def test_metadata(smoke_run):
    root, path = smoke_run
    meta = json.loads(path.read_text())["metadata"]
    assert meta["profile"] == "smoke"
    assert meta["device"] == describe_device()
    assert meta["data"] == {"data.txt": hashlib.sha256(b"tiny data").hexdigest()}
    assert meta["duration_s"] > 0 and meta["timestamp"].endswith("+00:00")
    assert "commit" in meta
    page = (root / "book" / "reproductions.md").read_text()
    assert "## A tiny chapter" in page and "Smoke-scale (CPU)" in page


def full_result(root, name="01_tiny"):
    path = root / "book" / "results" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"metadata": {"profile": "full"}}))
    return path


def test_smoke_never_replaces_full(tmp_path):
    write_chapter(tmp_path)
    path = full_result(tmp_path)
    before = path.read_text()
    with pytest.raises(UserError, match="full-profile result") as e:
        reproduce("01_tiny", "smoke", layout=Layout(tmp_path))
    assert e.value.exit_code == 2
    assert path.read_text() == before
    assert not (tmp_path / "runs").exists() and not (tmp_path / "book" / "01_tiny.ipynb").exists()


def test_all_checks_every_chapter_before_running_any(tmp_path):
    write_chapter(tmp_path, "01_tiny")
    write_chapter(tmp_path, "02_tiny")
    full_result(tmp_path, "02_tiny")
    args = argparse.Namespace(name=None, all=True, profile="smoke", params=[], force=False)
    with pytest.raises(UserError, match="02_tiny.json"):
        reproduce_cli(args, Layout(tmp_path))
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("profile, retrain", [("smoke", False), ("full", True)])
def test_records_only_is_for_the_full_profile_without_retrain(tmp_path, profile, retrain):
    write_chapter(tmp_path)
    args = argparse.Namespace(name="01_tiny", all=False, profile=profile, params=[],
                              force=False, retrain=retrain, records_only=True)
    with pytest.raises(UserError, match="--records-only builds a chapter"):
        reproduce_cli(args, Layout(tmp_path))
    assert not (tmp_path / "runs").exists()


def test_force_replaces_full(tmp_path):
    write_chapter(tmp_path)
    path = full_result(tmp_path)
    args = argparse.Namespace(name="01_tiny", all=False, profile="smoke", params=[["seed", "1"]],
                              force=True)
    assert reproduce_cli(args, Layout(tmp_path)) == [path]
    assert json.loads(path.read_text())["metadata"]["profile"] == "smoke"


def valid_table():
    return {"caption": "Tiny.", "columns": ["Model", "F1", "F1 (paper)"],
            "paper_columns": ["F1 (paper)"], "rows": [["tiny", 1.5, 77.3]], "dataset": "d"}


@pytest.mark.parametrize("change, problem", [
    ({"paper_columns": None}, "paper_columns' is missing"),
    ({"paper_columns": ["Model", "F1", "F1 (paper)"]}, "some, not all"),
    ({"paper_columns": ["EM (paper)"]}, "some, not all"),
    ({"rows": [["tiny", 1.5, None]]}, "no paper number"),
    ({"rows": [["tiny", 1.5]]}, "rows of 3 cells"),
    ({"dataset": ""}, "'dataset' must be"),
    ({"profile": "full"}, "the run's is 'smoke'"),
])
def test_invalid_tables_are_refused(tmp_path, change, problem):
    source = tmp_path / "results.json"
    validate_results(source, {"tables": {"table1": valid_table()}}, "smoke")
    table = {k: v for k, v in {**valid_table(), **change}.items() if v is not None}
    with pytest.raises(UserError, match=problem):
        validate_results(source, {"tables": {"table1": table}}, "smoke")


def test_invalid_keys_and_missing_figures_are_refused(tmp_path):
    source = tmp_path / "results.json"
    with pytest.raises(UserError, match="paper's numbering"):
        validate_results(source, {"tables": {"results": valid_table()}}, "smoke")
    with pytest.raises(UserError, match="no file"):
        validate_results(source, {"figures": {"figure1": "missing.png"}}, "smoke")
    with pytest.raises(UserError, match="no tables and no figures"):
        validate_results(source, {"notes": ["nothing"]}, "smoke")


def test_unknown_name_lists_available(tmp_path, capsys):
    write_chapter(tmp_path, "01_tiny")
    write_chapter(tmp_path, "02_tiny")
    with pytest.raises(UserError, match="available: 01_tiny, 02_tiny"):
        resolve_names(Layout(tmp_path), "03_nope", False)
    assert resolve_names(Layout(tmp_path), None, True) == ["01_tiny", "02_tiny"]
    assert main(["reproduce", "99_no_such_chapter", "--profile", "smoke"]) == 2
    assert "unknown notebook '99_no_such_chapter'" in capsys.readouterr().err


def test_params_are_yaml():
    assert parse_params([["seed", "1"], ["lr", "0.5"], ["device", "cpu"], ["x", "true"]]) == \
        {"seed": 1, "lr": 0.5, "device": "cpu", "x": True}
