"""The command line: one-line errors with exit status 2, official evaluation output."""

import json
import subprocess
import sys

from mrc_lib.cli import main

from .conftest import ARTICLES, squad_json


def test_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "mrc_lib", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for command in ("validate", "evaluate", "prepare", "stats", "download", "train", "predict",
                    "bench", "reproduce"):
        assert command in out


def test_evaluate_prints_official_json(tmp_path, capsys):
    data = squad_json(ARTICLES)
    (tmp_path / "data.json").write_text(json.dumps(data))
    qas = [qa for a in data["data"] for p in a["paragraphs"] for qa in p["qas"]]
    preds = {qa["id"]: qa["answers"][0]["text"] for qa in qas}
    preds[qas[0]["id"]] = "wrong"
    (tmp_path / "pred.json").write_text(json.dumps(preds))
    assert main(["evaluate", str(tmp_path / "data.json"), str(tmp_path / "pred.json")]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert list(scores) == ["exact_match", "f1"]
    assert abs(scores["exact_match"] - 100 * (len(qas) - 1) / len(qas)) < 1e-9


def test_evaluate_bad_prediction_file(tmp_path, capsys):
    (tmp_path / "data.json").write_text(json.dumps(squad_json(ARTICLES)))
    (tmp_path / "pred.json").write_text("[1, 2]")
    assert main(["evaluate", str(tmp_path / "data.json"), str(tmp_path / "pred.json")]) == 2
    err = capsys.readouterr().err
    assert "pred.json" in err and err.count("\n") == 1


def test_unknown_source_is_a_user_error(capsys):
    assert main(["download", "no-such-dataset"]) == 2
    assert "no-such-dataset" in capsys.readouterr().err
