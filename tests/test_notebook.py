"""The notebook helper: smoke-scale outputs say so, results files validate."""

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from mrc_lib.errors import UserError  # noqa: E402
from mrc_lib.notebook import Run, start  # noqa: E402


def make_run(tmp_path, profile):
    return Run(profile, 0, torch.device("cpu"), tmp_path)


@pytest.mark.parametrize("profile, labelled", [("smoke", True), ("full", False)])
def test_smoke_figures_and_tables_are_labelled(tmp_path, profile, labelled):
    run = make_run(tmp_path, profile)
    fig, ax = plt.subplots()
    ax.plot([0, 1])
    run.figure("figure1", fig)
    stamped = any("smoke-scale" in t.get_text() for t in fig.texts)
    assert stamped == labelled and (tmp_path / "figure1.png").is_file()
    run.table("table1", caption="Scores", columns=["Model", "F1", "F1 (paper)"],
              rows=[["x", 1.0, 77.3]], paper_columns=["F1 (paper)"], dataset="SQuAD v1.1 dev")
    assert ("smoke-scale" in run.tables["table1"]["caption"]) == labelled
    results = json.loads(run.save().read_text())
    assert results["figures"] == {"figure1": "figure1.png"}
    plt.close(fig)


def test_table_without_paper_numbers_is_refused(tmp_path):
    run = make_run(tmp_path, "smoke")
    run.table("table1", caption="Scores", columns=["Model", "F1", "F1 (paper)"],
              rows=[["x", 1.0, None]], paper_columns=["F1 (paper)"], dataset="SQuAD v1.1 dev")
    with pytest.raises(UserError):
        run.save()


def test_tables_and_figures_of_full_data_are_labelled_by_it(tmp_path):
    run = make_run(tmp_path, "smoke")
    fig, ax = plt.subplots()
    run.figure("figure_lengths", fig, scale="full SQuAD v1.1")
    assert not any("smoke-scale" in t.get_text() for t in fig.texts)
    run.table("table_files", caption="Counts", columns=["File", "N", "N (published)"],
              rows=[["dev", 1, 1]], paper_columns=["N (published)"], dataset="SQuAD v1.1 dev",
              scale="full SQuAD v1.1 dev")
    assert "smoke-scale" not in run.tables["table_files"]["caption"]
    results = json.loads(run.save().read_text())
    assert results["figure_scales"] == {"figure_lengths": "full SQuAD v1.1"}
    assert results["tables"]["table_files"]["scale"] == "full SQuAD v1.1 dev"
    plt.close(fig)


def test_start_shows_table_cells_whole(tmp_path):
    import pandas as pd

    pd.reset_option("display.max_colwidth")
    start("smoke", out_dir=str(tmp_path / "runs" / "ch" / "smoke"), banner=False)
    assert pd.get_option("display.max_colwidth") is None
    assert "x" * 80 in pd.DataFrame([["x" * 80]]).to_html()
