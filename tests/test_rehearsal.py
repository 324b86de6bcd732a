"""The full-profile rehearsal: stand-in records that a chapter reads as its runs' records, built
from the chapters' smoke records, never committed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mrc_lib import queue, records, rehearsal
from mrc_lib.cli import main
from mrc_lib.errors import UserError
from tests.test_queue import TINY, write_queue


@pytest.fixture
def jobs(tmp_path):
    path = write_queue(tmp_path, {"ch": [
        {"run": "bidaf_seed{seed}", "model": "bidaf", "seeds": [0, 1], "priority": 1,
         "minutes": 1, "schedule": "tiny", "overrides": TINY},
        {"run": "bidaf_wide", "model": "bidaf", "priority": 2, "minutes": 1, "schedule": "tiny",
         "overrides": [*TINY, "hparams.hidden=16"]}]})
    return queue.load_queue(path)


def smoke_record(runs: Path, job, hidden: int, payload: str) -> None:
    cfg = job.config("smoke").to_dict()
    cfg["hparams"] = {**cfg["hparams"], "hidden": hidden}
    path = runs / job.entry.chapter / "smoke" / job.name / "record.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({
        "schema": 1, "chapter": job.entry.chapter, "run": job.name, "config": cfg,
        "config_hash": records.config_hash(cfg), "data_digests": {"smoke": "1"},
        "dev": {"f1": 1.0}, "history": [], "device": "cpu", "profile": "smoke",
        "analysis": {"payload": payload}}))


def test_a_chapter_reads_each_stand_in_as_its_runs_record(tmp_path, jobs, monkeypatch):
    seed0, seed1, wide = jobs
    runs, book_runs = tmp_path / "runs", tmp_path / "book" / "runs"
    smoke_record(runs, seed0, 8, "seed0's")
    smoke_record(runs, wide, 16, "wide's")
    loads = []

    def load_data(cfg):
        loads.append(cfg)
        return type("Data", (), {"digests": {"full": "1"}})()

    monkeypatch.setattr("mrc_lib.train.load_data", load_data)
    monkeypatch.setattr("mrc_lib.measurements.registry", dict)  # tests/test_measurements.py
    assert rehearsal.write_standins(jobs, runs, book_runs, log=lambda line: None) == 3
    assert len(loads) == 1  # one load per distinct data config
    for job, payload in [(seed0, "seed0's"), (seed1, "seed0's"), (wide, "wide's")]:
        path = records.record_path("ch", job.name, book_runs)
        found = records.lookup(path, job.config("full").to_dict(), {"full": "1"})
        assert found is not None, job.key
        assert found["analysis"]["payload"] == payload  # its own, else the closest reader's
        assert found["standin"] and found["device"] == rehearsal.STANDIN_DEVICE
        assert (found["chapter"], found["run"], found["profile"]) == ("ch", job.name, "full")


def test_a_stand_in_has_every_epoch_of_the_full_schedule(jobs):
    """A chapter reads the first epochs of a headline record as the baseline of its shorter
    ablations (records.after_epochs): a stand-in of a one-epoch smoke record has them all."""
    epoch = {"epoch": 1, "step": 4, "dev": {"f1": 1.0}}
    source = {"history": [epoch], "seconds_per_epoch": [2.0], "epochs_run": 1}
    found = rehearsal.standin(jobs[0], source, {"full": "1"})
    epochs = jobs[0].config("full").epochs
    assert [h["epoch"] for h in found["history"]] == list(range(1, epochs + 1))
    assert found["seconds_per_epoch"] == [2.0] * epochs and found["epochs_run"] == epochs
    assert source["history"] == [epoch]  # the smoke record is left as it was


def test_a_reader_without_a_smoke_record_is_named(tmp_path, jobs):
    with pytest.raises(UserError, match="ch/bidaf_seed0: no smoke record of reader 'bidaf'.*"
                                        "reproduce ch --profile smoke"):
        rehearsal.source_record(jobs[0], rehearsal.smoke_records(tmp_path / "runs"))


def test_rehearse_needs_a_new_folder(tmp_path, jobs, capsys):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "file").write_text("x")
    with pytest.raises(UserError, match="not empty"):
        rehearsal.rehearse(jobs, tmp_path / "used")
    assert main(["queue", "rehearse"]) == 2
    assert "queue rehearse needs --to DEST" in capsys.readouterr().err


def test_no_committed_record_is_a_stand_in():
    standins = [str(p) for p in records.BOOK_RUNS.glob("**/*.json")
                if json.loads(p.read_text()).get("standin")]
    assert standins == [], "stand-in records (queue rehearse) must never be committed"


def test_chapter_07_is_checked_through_the_records_it_reads(tmp_path):
    result = rehearsal.check_comparison(tmp_path / "book" / "runs")
    assert result.startswith("no record found for reader bidaf;")
    assert "claim 'PhaseCond beats the Iterative Aligner" in result
