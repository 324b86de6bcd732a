"""``benchmarks/gpu_session.py``, the one command of a GPU session, checked on a CPU with
``--tiny``: the data it carries, its steps under a deadline, the files it sends back, and
their import into the repository."""

from __future__ import annotations

import json
import sys
import tarfile
import time
from argparse import Namespace

from mrc_lib import records
from mrc_lib.bench import full_readers
from mrc_lib.config import resolve_config

from .test_cli import load_bringup
from .test_queue import TINY, write_queue

gs = load_bringup("gpu_session")


def test_one_session_prepare_run_import_tiny_on_cpu(mirror, tmp_path, monkeypatch, capsys):
    q = write_queue(tmp_path, {"tq": [{"run": "bidaf", "model": "bidaf", "priority": 1,
                                       "minutes": 1, "schedule": "tiny", "overrides": TINY}]})
    travel = tmp_path / "travel.tar.gz"
    gs.main(["prepare", "--only", "tq/*", "--queue-file", q, "--travel", str(travel)])
    with tarfile.open(travel) as tar:
        names = tar.getnames()
    assert {n.rsplit("/", 1)[1] for n in names} >= {"meta.json", "vectors.npy", "train.npz",
                                                     "dev.npz", "dev.json.gz"}
    assert not any(n.endswith("train.json.gz") for n in names)  # training never reads it

    # The GPU machine has no raw data: the run reads only what was carried.
    monkeypatch.delenv("MRC_DATA_DIR")
    paths = {k: tmp_path / k for k in ("runner", "inbox", "work", "results", "out")}
    (paths["results"]).mkdir()
    common = [f"--{k}={paths[k]}" for k in ("runner", "inbox", "work", "results")]
    result = gs.main(["run", "--tiny", "--out", str(paths["out"]), "--minutes", "4",
                      "--steps", "bringup,measure,compile,train", "--only", "tq/*",
                      "--queue-file", q, "--profile", "smoke", "--travel", str(travel),
                      *common])
    states = {step["step"]: step["state"] for step in result["steps"]}
    assert states == {"data": states["data"], "inbox": "nothing to unpack", "bringup": "done",
                      "measure": "done", "compile": "skipped", "train": "done"}, result
    back = [p for p in paths["out"].rglob("*") if p.is_file()]
    assert len(back) <= 8 and (paths["out"] / "session.tar").is_file()
    assert (paths["out"] / "b1" / "queue.json").is_file()

    book = tmp_path / "book" / "runs"
    monkeypatch.setattr(records, "BOOK_RUNS", book)
    here = tmp_path / "here"
    lines = gs.main(["import", str(paths["out"]), "--keep", str(tmp_path / "keep"),
                     f"--results={paths['results']}", f"--runner={here}",
                     f"--inbox={paths['inbox']}"])
    assert any(line.startswith("benchmark ") for line in lines)
    assert json.loads(next(paths["results"].glob("gpu_*.json")).read_text())["models"]["bidaf"]
    assert records.read_record(book / "tq" / "bidaf.json")["complete"]
    assert records.is_measurement(records.read_record(book / "07_comparison" / "speed.json"))
    assert "no partial run" in lines[-1] and not paths["inbox"].exists()


def session(tmp_path, minutes: float = 1.0, tiny: bool = True, results=None,
            runner=None) -> gs.Session:
    (tmp_path / "logs").mkdir(parents=True, exist_ok=True)
    args = Namespace(tiny=tiny, runner=runner, started="now", minutes=minutes, only=None)
    return gs.Session(args, "cpu", tmp_path, results or tmp_path, time.time() + 60 * minutes)


def test_a_step_that_fails_or_outruns_its_time_is_named_and_stopped(tmp_path):
    s = session(tmp_path)

    def command(code: str):
        return lambda s, budget: [sys.executable, "-c", code]

    tic = time.perf_counter()
    cut = gs.run_step(s, gs.Step("slow", 1, 0, lambda s: None,
                                 command("import time; print('started', flush=True); "
                                         "time.sleep(60)")))
    assert cut["state"] == "cut at its time" and cut["log_tail"] == ["started"]
    assert time.perf_counter() - tic < 30
    failed = gs.run_step(s, gs.Step("bad", 10, 0, lambda s: None, command("raise SystemExit(3)")))
    assert failed["state"] == "failed (exit 3)"
    # One minute, less the half-minute kept for packing: too little for a step of two.
    skipped = gs.run_step(session(tmp_path), gs.Step("big", 600, 120, lambda s: None,
                                                     command("")))
    assert skipped == {"step": "big", "state": "skipped", "why": "30 s left"}

    def broken(s):
        raise gs.UserError("no run in the queue matches 'tq/*'")

    assert gs.run_step(s, gs.Step("train", 10, 0, broken, command(""))) == {
        "step": "train", "state": "failed: UserError: no run in the queue matches 'tq/*'"}


def test_bringup_runs_again_when_a_readers_config_changed(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    s = session(tmp_path / "w", tiny=False, results=results)
    assert gs.bringup_skip(s) is None  # nothing on file
    models = {name: {"config_hash": records.config_hash(
        resolve_config(name, profile="full").to_dict())} for name in full_readers()}
    path = results / "gpu_cpu.json"
    path.write_text(json.dumps({"models": models}))
    assert gs.bringup_skip(s) is None  # cut short: no "complete"
    path.write_text(json.dumps({"models": models, "complete": True}))
    assert gs.bringup_skip(s) == "every reader's bring-up matches its config"
    models["bidaf"]["config_hash"] = "another"
    path.write_text(json.dumps({"models": models, "complete": True}))
    assert gs.bringup_skip(s) is None


def test_import_keeps_a_partial_run_as_the_next_sessions_carry_over(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "BOOK_RUNS", tmp_path / "book" / "runs")
    gpu, out = tmp_path / "gpu", tmp_path / "out"
    run = gpu / "ch" / "r"
    run.mkdir(parents=True)
    (run / "status.json").write_text(json.dumps({"complete": False}))
    (run / "checkpoint.pt").write_bytes(b"weights")
    gs.queue.pack(gpu, out / "b1")
    (tmp_path / "session.json").write_text(json.dumps(
        {"device": "GPU", "started": "now", "steps": [{"step": "train", "state": "done"}]}))
    with tarfile.open(out / "session.tar", "w") as tar:
        tar.add(tmp_path / "session.json", arcname="session.json")
    inbox = tmp_path / "inbox"
    lines = gs.main(["import", str(out), "--keep", str(tmp_path / "keep"),
                     f"--results={tmp_path}", f"--runner={tmp_path / 'here'}",
                     f"--inbox={inbox}"])
    assert lines[1] == "  train: done" and lines[-1].startswith("carry-over")
    assert (tmp_path / "here" / "ch" / "r" / "checkpoint.pt").read_bytes() == b"weights"
    back = tmp_path / "back"
    gs.queue.unpack([inbox / "1"], back)  # what the next session starts from
    assert (back / "ch" / "r" / "checkpoint.pt").read_bytes() == b"weights"


def test_a_partial_run_too_large_to_carry_on_stays_on_the_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(gs.queue, "PIECE_BYTES", 20_000)
    monkeypatch.setattr(gs, "BUNDLE_MIB", 40_000 / 2**20)
    runner = tmp_path / "runner"
    for name, size in (("small", 10_000), ("large", 60_000)):
        (runner / "ch" / name).mkdir(parents=True)
        (runner / "ch" / name / "status.json").write_text(json.dumps({"complete": False}))
        (runner / "ch" / name / "checkpoint.pt").write_bytes(bytes(size))
    s = session(tmp_path / "w", runner=runner)
    assert gs.pack_out(s, tmp_path / "out") == ["ch/large stays here: over the "
                                                 f"{gs.BUNDLE_MIB} MiB carried on"]
    back = tmp_path / "back"
    assert gs.queue.unpack([tmp_path / "out" / "b1"], back)[1] == ["ch/large"]
    assert (back / "ch" / "small" / "checkpoint.pt").stat().st_size == 10_000
    with tarfile.open(tmp_path / "out" / "session.tar") as tar:
        assert json.load(tar.extractfile("session.json"))["notes"] == [
            f"ch/large stays here: over the {gs.BUNDLE_MIB} MiB carried on"]


def test_session_tar_comes_back_when_packing_the_runner_fails(tmp_path):
    runner = tmp_path / "runner" / "ch" / "r"
    runner.mkdir(parents=True)
    (runner / "status.json").write_text("{")  # a worker killed mid-write, say
    s = session(tmp_path / "w", runner=runner.parent.parent)
    notes = gs.pack_out(s, tmp_path / "out")
    assert len(notes) == 1 and notes[0].startswith("packing the runner folder failed: ")
    assert (tmp_path / "out" / "session.tar").is_file()
