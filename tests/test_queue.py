"""The queue file, its validator and status, the packed runner (two concurrent processes, a
deadline stop, an exact resume) and the transfer of its folder in pieces, at smoke size on the
tiny mirror of conftest.py."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from mrc_lib import queue, records
from mrc_lib.cli import main
from mrc_lib.errors import UserError
from mrc_lib.models import effective_hparams

TINY = ["epochs=2", "batch_size=2", "limits=null", "hparams.hidden=8", "hparams.char_channels=8",
        "checkpoint_every=null", "log_every=1", "device=cpu"]
KEYS = ("dev", "best_dev", "steps", "epochs_run", "config_hash")


def write_queue(tmp_path, entries: dict) -> str:
    path = tmp_path / "queue.yaml"
    path.write_text(json.dumps(entries))
    return str(path)


@pytest.fixture
def tiny_queue(tmp_path):
    return write_queue(tmp_path, {"tq": [
        {"run": "bidaf_seed{seed}", "model": "bidaf", "seeds": [0, 1], "priority": 1,
         "minutes": 1, "schedule": "tiny", "overrides": TINY}]})


def test_the_book_queue_is_valid_and_covers_every_chapter():
    jobs = queue.load_queue()
    chapters = {j.entry.chapter for j in jobs}
    assert {"01_bidaf_qanet", "02_dynsan", "03_decaprop", "04_aba", "05_ea_reader",
            "06_phasecond"} <= chapters
    assert {j.key for j in jobs if j.priority == 1} >= {"01_bidaf_qanet/bidaf",
                                                        "01_bidaf_qanet/qanet"}
    table = queue.status_table(jobs)
    assert "GPU-minutes (H100, estimated) done" in table.splitlines()[-1]
    # every run the comparison chapter names is a queue run of that reader and dataset, and
    # each of the seeds of a side's entry counts for it
    from mrc_lib.comparison import HEADLINE_RUNS, SIDES, Side

    for side in [*SIDES.values(), *(Side(m, runs=r) for m, r in HEADLINE_RUNS.items())]:
        named = [j for j in jobs if side.names({"chapter": j.entry.chapter, "run": j.name})]
        assert named, side
        assert {(j.entry.model, j.config().dataset) for j in named} == {(side.model,
                                                                         side.dataset)}
        assert len(named) == len(named[0].entry.seeds), side


@pytest.mark.parametrize("entry, message", [
    ({"model": "bidef"}, "unknown model 'bidef'"),
    ({"epochs": 3}, "unknown key(s) epochs"),
    ({"overrides": ["lr=fast"]}, "config lr='fast'"),
    ({"seeds": [0, 1]}, "several seeds need '{seed}'"),
])
def test_a_bad_entry_is_a_one_line_error_naming_file_and_entry(tmp_path, entry, message):
    good = {"run": "a", "model": "bidaf", "priority": 1, "minutes": 1, "schedule": "-"}
    path = write_queue(tmp_path, {"ch": [good, {**good, "run": "b", **entry}]})
    with pytest.raises(UserError, match=re.escape(message)) as e:
        queue.load_queue(path)
    assert f"{path}: ch[1] (b)" in str(e.value) or f"{path}: ch[1]:" in str(e.value)
    assert "\n" not in str(e.value)
    assert main(["queue", "--file", path]) == 2


def test_worker_times_split_a_workers_seconds_from_its_status():
    status = {"times": {"began": 102.0, "loaded": 103.5, "trained": 140.0},
              "wall_seconds": 31.25}
    assert queue.worker_times(status, 100.0, 141.0) == (
        "; worker 41.0 s: start 2.0, data 1.5, trainer 36.5 (wall_seconds 31.2), after 1.0")
    assert queue.worker_times(status, 110.0, 141.0) == ""  # an earlier command's status
    assert queue.worker_times(None, 100.0, 141.0) == ""  # a worker that failed early
    assert queue.worker_times({"complete": False}, 100.0, 141.0) == ""


def test_runner_two_processes_deadline_stop_and_exact_resume(mirror, tmp_path, tiny_queue,
                                                             capsys, monkeypatch):
    jobs = queue.load_queue(tiny_queue)
    seed0, seed1 = jobs[0], jobs[1]
    whole = queue.work(seed0, tmp_path / "whole", None, "smoke")  # uninterrupted, in-process
    assert whole["complete"]

    gpu = tmp_path / "gpu"
    cut = queue.work(seed0, gpu, 0.0, "smoke")  # the deadline has passed: one step, then stop
    assert not cut["complete"] and cut["steps"] == 1
    # Its partial record keeps how far it got, for a checkout that never sees its checkpoint.
    partial = json.loads((gpu / "records" / "tq" / "bidaf_seed0.json").read_text())
    assert partial["complete"] is False and partial["steps"] == 1
    # Its time is that step's, cut before its epoch's end, as its throughput is.
    assert partial["seconds_this_epoch"] > 0 and partial["history"] == []
    assert partial["wall_seconds"] == round(partial["seconds_this_epoch"], 3)
    assert partial["examples_per_second"] > 0
    assert queue.record_of(seed0, gpu, "smoke") is None
    assert queue.record_of(seed0, gpu, "smoke", complete=False)["steps"] == 1
    # The carry-over's estimate of its checkpoint, made before any step, is its packed size at
    # most, less the few kilobytes of schedule, random-number states and serialization.
    written = sum(p.stat().st_size for p in (gpu / "tq" / "bidaf_seed0").glob("checkpoint.pt*"))
    assert written - queue.checkpoint_size(seed0, "smoke") < queue.Carry.SLACK
    assert records.lookup(gpu / "records" / "tq" / "bidaf_seed0.json", partial["config"],
                          partial["data_digests"]) is None  # a notebook trains instead
    book = tmp_path / "book" / "runs"
    monkeypatch.setattr(records, "BOOK_RUNS", book)
    assert queue.import_records(gpu) == [book / "tq" / "bidaf_seed0.json"]
    assert queue.state_of(seed0, None, "smoke") == ("partial", 0.0)  # epoch 0 of 2
    # The partial run moves to another machine in several bundles, as a PhaseCond run would.
    monkeypatch.setattr(queue, "PIECE_BYTES", 20_000)
    n_bundles = queue.pack(gpu, tmp_path / "b1", budget=40_000)[1]
    assert n_bundles > 1
    for k in range(2, n_bundles + 1):
        queue.pack(gpu, tmp_path / f"b{k}", bundle=k, budget=40_000)
    out = tmp_path / "q"
    queue.unpack([tmp_path / f"b{k}" for k in range(1, n_bundles + 1)], out)
    assert queue.state_of(seed0, out, "smoke")[0] == "partial"
    assert [j.key for j in queue.pending(jobs, out, "smoke")] == [seed0.key, seed1.key]

    lines = []
    codes = queue.run_queue(jobs, out, minutes=5, parallel=2, reserve=0, profile="smoke",
                            queue_file=tiny_queue, settings=("eval_batch_size=3",),
                            log=lines.append)
    assert codes == {seed0.key: 0, seed1.key: 0}  # both ran, as two processes at once
    # Each start and end says when, in seconds since the call began.
    assert [re.sub(r" \(.*\)", "", line) for line in lines[:2]] == [
        f"start {seed0.key} at 0 s", f"start {seed1.key} at 0 s"]
    assert all(re.fullmatch(r"(start|ended) \S+ \(.*\) at \d+ s(; .*)?", line) for line in lines)
    assert sorted(line.split()[0] for line in lines) == ["ended", "ended", "start", "start"]
    # ... and each end where the worker's time went, from its status.json.
    phases = r"; worker [\d.]+ s: start [\d.]+, data [\d.]+, trainer [\d.]+ \(wall_seconds " \
             r"[\d.]+\), after [\d.]+"
    assert all(re.search(phases + "$", line) for line in lines if line.startswith("ended"))
    done = [json.loads((out / "records" / "tq" / f"bidaf_seed{s}.json").read_text())
            for s in (0, 1)]
    reference = json.loads(json.dumps(whole))
    for key in KEYS[:-1]:
        assert done[0][key] == reference[key]  # the resumed run equals the uninterrupted one
    for a, b in zip(done[0]["history"], reference["history"], strict=True):
        assert (a["dev"], a["train_loss"]) == (b["dev"], b["train_loss"])
    assert done[1]["config"]["seed"] == 1
    assert done[1]["config"]["eval_batch_size"] == 3  # --set: how, never what, is computed
    assert done[1]["config_hash"] == records.config_hash(seed1.config("smoke").to_dict())
    assert [queue.state_of(j, out, "smoke")[0] for j in jobs] == ["done", "done"]
    assert queue.pending(jobs, out, "smoke") == []

    assert main(["queue", "--file", tiny_queue, "--out", str(out), "--profile", "smoke"]) == 0
    assert "2 done, 0 partial, 0 missing;" in capsys.readouterr().out
    # Importing the finished records replaces the partial one; a partial one never replaces
    # a finished one.
    queue.import_records(out)
    assert records.read_record(book / "tq" / "bidaf_seed0.json")["complete"]
    assert book / "tq" / "bidaf_seed0.json" not in queue.import_records(gpu)
    assert records.read_record(book / "tq" / "bidaf_seed0.json")["complete"]
    # A partial record of another config replaces it, and the finished one is kept.
    finished = (book / "tq" / "bidaf_seed0.json").read_bytes()
    other = gpu / "records" / "tq" / "bidaf_seed0.json"
    records.write_record(other, {**partial, "config_hash": "0" * 16})
    assert queue.import_records(gpu) == [book / "tq" / "bidaf_seed0.json"]
    assert not records.read_record(book / "tq" / "bidaf_seed0.json")["complete"]
    assert records.earlier("tq", "bidaf_seed0", book) == [json.loads(finished)]


def test_a_stopped_runner_stops_its_workers_with_checkpoints(mirror, tmp_path):
    """SIGTERM to the runner (or Ctrl-C) reaches its workers: each trainer checkpoints after its
    step and exits cleanly, leaving a partial record, and nothing more starts."""
    path = write_queue(tmp_path, {"tq": [
        {"run": "long_seed{seed}", "model": "bidaf", "seeds": [0, 1], "priority": 1,
         "minutes": 1, "schedule": "longer than the test", "overrides": [*TINY, "epochs=500"]}]})
    jobs = queue.load_queue(path)
    out = tmp_path / "q"
    log = out / "tq" / "long_seed0" / "log.jsonl"

    def stop_when_training() -> None:  # the runner's main thread handles the signal
        waited = time.time() + 300
        while time.time() < waited and '"step"' not in (log.read_text() if log.exists() else ""):
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_when_training, daemon=True).start()
    lines = []
    codes = queue.run_queue(jobs, out, minutes=10, parallel=1, reserve=0, profile="smoke",
                            queue_file=path, log=lines.append)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert codes == {jobs[0].key: 0}
    assert re.fullmatch(r"SIGTERM at \d+ s: stopping the workers with checkpoints", lines[1])
    assert lines[2].startswith(f"ended {jobs[0].key} (exit 0;")
    assert lines[3] == f"not started {jobs[1].key}: ~1 min, stopped by SIGTERM"
    record = queue.record_of(jobs[0], out, "smoke", complete=False)
    assert record["complete"] is False and record["steps"] >= 1
    assert queue.state_of(jobs[0], out, "smoke")[0] == "partial"
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert events[-1] == {"event": "signal", "signal": "SIGTERM", "step": record["steps"]}
    assert "SIGTERM: stopped at step" in (log.parent / "worker.log").read_text()


def _runner_folder(out: Path) -> tuple[Path, Path]:
    """A runner folder with one record, a partial run ``ch/b`` and a finished run ``ch/c``."""
    (out / "records" / "ch").mkdir(parents=True)
    (out / "records" / "ch" / "a.json").write_text("{}")
    partial, complete = out / "ch" / "b", out / "ch" / "c"
    for folder, done in ((partial, False), (complete, True)):
        folder.mkdir(parents=True)
        (folder / "status.json").write_text(json.dumps({"complete": done, "fraction": 0.5}))
        (folder / "checkpoint.pt").write_bytes(b"m" * 100)
        (folder / "checkpoint.pt.abc.000").write_bytes(bytes(range(256)) * 40)
        (folder / "model.pt").write_bytes(b"w" * 5000)  # left behind: rebuilt or not needed
    return partial, complete


def test_pack_and_unpack_in_pieces(tmp_path, monkeypatch):
    out = tmp_path / "q"
    partial, _ = _runner_folder(out)
    monkeypatch.setattr(queue, "PIECE_BYTES", 4000)
    files, n_bundles = queue.pack(out, tmp_path / "back")
    assert n_bundles == 1 and len(files) > 2 and all(f.stat().st_size <= 4000 for f in files)
    (tmp_path / "again" / "ch" / "b").mkdir(parents=True)
    (tmp_path / "again" / "ch" / "b" / "stale.000").write_text("replaced with the folder")
    names, left_out = queue.unpack([tmp_path / "back"], tmp_path / "again")
    assert left_out == []
    assert sorted(names) == ["ch/b/checkpoint.pt", "ch/b/checkpoint.pt.abc.000",
                             "ch/b/status.json", "ch/c/status.json", "records/ch/a.json"]
    again = tmp_path / "again" / "ch" / "b"
    assert sorted(p.name for p in again.iterdir()) == ["checkpoint.pt", "checkpoint.pt.abc.000",
                                                       "status.json"]
    assert (again / "checkpoint.pt.abc.000").read_bytes() == \
        (partial / "checkpoint.pt.abc.000").read_bytes()

    piece = tmp_path / "back" / "queue.001.001"
    piece.write_bytes(piece.read_bytes()[:-1])
    with pytest.raises(UserError, match="piece corrupt") as e:
        queue.unpack([tmp_path / "back"], tmp_path / "third")
    assert str(piece) in str(e.value)


def test_a_bare_machine_restores_the_inbox_and_a_kept_folder_wins(tmp_path):
    _runner_folder(tmp_path / "last")
    queue.pack(tmp_path / "last", tmp_path / "inbox" / "1")
    out, lines = tmp_path / "q", []
    assert not queue.restore(out, tmp_path / "nothing", log=lines.append)  # the first command
    assert "starts empty" in lines[-1] and not out.exists()
    assert queue.restore(out, tmp_path / "inbox", log=lines.append)  # a machine started bare
    assert (out / "ch" / "b" / "checkpoint.pt.abc.000").exists()
    assert "from 1 bundle(s)" in lines[-1]
    (out / "records" / "ch" / "newer.json").write_text("{}")
    assert not queue.restore(out, tmp_path / "inbox", log=lines.append)  # the machine kept it
    assert (out / "records" / "ch" / "newer.json").exists()


def test_set_may_change_only_keys_outside_the_config_hash(tiny_queue, tmp_path, capsys):
    assert queue.check_settings(["compile=true", "device=cuda"]) == ("compile=true",
                                                                      "device=cuda")
    cuda_graphs = ["compile_mode=reduce-overhead", "pad_multiple=32"]
    assert queue.check_settings(cuda_graphs) == tuple(cuda_graphs)
    with pytest.raises(UserError, match=r"--set lr=1: only device, compile"):
        queue.check_settings(["compile=true", "lr=1"])
    assert main(["queue", "run", "--file", tiny_queue, "--out", str(tmp_path / "q"),
                 "--set", "epochs=1"]) == 2
    assert "queue run --set epochs=1: only" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


def test_only_selects_runs_by_pattern_and_refuses_a_pattern_matching_none(tiny_queue, capsys):
    jobs = queue.load_queue(tiny_queue)
    assert queue.select(jobs, None) == jobs
    assert [j.key for j in queue.select(jobs, ["tq/*seed1"])] == ["tq/bidaf_seed1"]
    with pytest.raises(UserError, match=r"--only nope/\*: no run"):
        queue.select(jobs, ["tq/*", "nope/*"])
    assert main(["queue", "--file", tiny_queue, "--only", "tq/*seed0"]) == 0
    assert "0 done, 0 partial, 1 missing" in capsys.readouterr().out


def test_a_run_larger_than_a_bundle_travels_over_several(tmp_path, monkeypatch):
    """PhaseCond's checkpoint (113 MiB) is larger than what one command may carry or bring
    back: its pieces fill several bundles, each written by its own ``pack --bundle K``."""
    out = tmp_path / "q"
    partial, _ = _runner_folder(out)
    (partial / "checkpoint.pt.abc.000").write_bytes(bytes(range(256)) * 160)  # 40 KiB
    monkeypatch.setattr(queue, "PIECE_BYTES", 15_000)
    _, n_bundles = queue.pack(out, tmp_path / "b1", budget=31_000)
    assert n_bundles > 1
    bundles = []
    for k in range(1, n_bundles + 1):
        files, _ = queue.pack(out, tmp_path / f"b{k}", bundle=k, budget=31_000)
        size = sum(f.stat().st_size for f in files[1:])
        assert size == 31_000 if k < n_bundles else size <= 31_000  # filled to the brim
        assert all(f.stat().st_size <= 15_000 for f in files[1:])
        bundles.append(tmp_path / f"b{k}")
    with pytest.raises(UserError, match=f"no bundle {n_bundles + 1}"):
        queue.pack(out, tmp_path / "extra", bundle=n_bundles + 1, budget=31_000)

    # the records come first; the partial run needs every bundle
    names, left_out = queue.unpack(bundles[:1], tmp_path / "first")
    assert left_out == ["ch/b"] and "records/ch/a.json" in names
    assert not (tmp_path / "first" / "ch" / "b").exists()
    names, left_out = queue.unpack(bundles[::-1], tmp_path / "all")
    assert left_out == [] and "ch/b/checkpoint.pt.abc.000" in names
    assert (tmp_path / "all" / "ch" / "b" / "checkpoint.pt.abc.000").read_bytes() == \
        (partial / "checkpoint.pt.abc.000").read_bytes()

    # A carry-over of fewer bundles leaves the partial run behind, whole.
    kept, left, used = queue.carry_over(out, tmp_path / "carry", 31_000, bundles=1)
    assert (kept, left, used) == (["records"], ["ch/b"], 1)
    assert queue.unpack([tmp_path / "carry" / "b1"], tmp_path / "c")[1] == []  # not listed
    assert not (tmp_path / "c" / "ch" / "b").exists()
    kept, left, used = queue.carry_over(out, tmp_path / "carry", 31_000, bundles=n_bundles)
    assert (kept, left, used) == (["records", "ch/b"], [], n_bundles)
    carried = [queue.bundle_folder(tmp_path / "carry", k) for k in range(1, used + 1)]
    assert queue.unpack(carried, tmp_path / "d")[1] == []
    assert (tmp_path / "d" / "ch" / "b" / "checkpoint.pt.abc.000").read_bytes() == \
        (partial / "checkpoint.pt.abc.000").read_bytes()

    (partial / "checkpoint.pt").write_bytes(b"n" * 100)  # the run moved on after bundle 1
    queue.pack(out, tmp_path / "b2", bundle=2, budget=31_000)
    with pytest.raises(UserError, match="another pack"):
        queue.unpack(bundles, tmp_path / "mixed")


def test_a_carry_over_cut_by_unit_keeps_an_unchanged_runs_pieces(tmp_path, monkeypatch):
    """A committed carry-over (``by_unit``) begins a piece at each unit: when the records and
    one run change size between two sessions, the run that did not change is cut into the same
    pieces, which git stores once; cut only by size, every piece after the change differs."""
    out = tmp_path / "q"
    for name, size in (("moving", 20_000), ("still", 40_000)):
        run = out / "ch" / name
        run.mkdir(parents=True)
        (run / "status.json").write_text(json.dumps({"complete": False}))
        (run / "checkpoint.pt.000").write_bytes(random.Random(name).randbytes(size))
    (out / "records" / "ch").mkdir(parents=True)
    (out / "records" / "ch" / "moving.json").write_text("{}")
    monkeypatch.setattr(queue, "PIECE_BYTES", 15_000)

    def pieces(dest: Path, by_unit: bool) -> tuple[dict, set[str]]:
        files, _ = queue.pack(out, dest, budget=200_000, by_unit=by_unit)
        listing = json.loads(files[0].read_text())
        return listing, {p["sha256"] for p in listing["pieces"]}

    before, cut = pieces(tmp_path / "before", True)
    for piece in before["pieces"]:  # no piece straddles two units
        units = [u for u in before["units"] if u["offset"] <= piece["offset"]
                 < u["offset"] + u["bytes"]]
        assert piece["offset"] + piece["bytes"] <= units[0]["offset"] + units[0]["bytes"]
    trained = random.Random(1).randbytes(30_000)
    (out / "ch" / "moving" / "checkpoint.pt.000").write_bytes(trained)  # it trained on
    (out / "records" / "ch" / "moving.json").write_text(json.dumps({"x": "y" * 20_000}))
    after, _ = pieces(tmp_path / "after", True)
    still = next(u for u in after["units"] if u["unit"] == "ch/still")
    assert still["offset"] != next(u for u in before["units"]
                                   if u["unit"] == "ch/still")["offset"]  # it moved
    assert {p["sha256"] for p in after["pieces"] if still["offset"] <= p["offset"]} <= cut
    assert queue.unpack([tmp_path / "after"], tmp_path / "back")[1] == []
    assert (tmp_path / "back" / "ch" / "moving" / "checkpoint.pt.000").read_bytes() == trained
    # cut by size alone, the run that did not change is new pieces
    (out / "ch" / "moving" / "checkpoint.pt.000").write_bytes(random.Random(0).randbytes(20_000))
    (out / "records" / "ch" / "moving.json").write_text("{}")
    _, plain = pieces(tmp_path / "plain", False)
    (out / "ch" / "moving" / "checkpoint.pt.000").write_bytes(trained)
    moved, _ = pieces(tmp_path / "moved", False)
    changed = next(u for u in moved["units"] if u["unit"] == "ch/moving")["offset"]
    assert not {p["sha256"] for p in moved["pieces"]
                if p["offset"] + p["bytes"] > changed} & plain


def test_a_bundle_is_at_most_four_pieces_whatever_its_runs(tmp_path, monkeypatch):
    """A reply brings back eight files: ``session.tar``, ``queue.json`` and the pieces. The
    units' tars run on from one piece into the next, so a bundle of 56 MiB is four pieces of at
    most 15, where pieces cut per run were two for each run a little over 15 MiB (DecaProp's
    ablations, 17 to 20 MiB: three of them and the records made nine files)."""
    out = tmp_path / "q"
    for k in range(5):  # five partial runs a little over a piece each
        run = out / "ch" / f"r{k}"
        run.mkdir(parents=True)
        (run / "status.json").write_text(json.dumps({"complete": False}))
        (run / "checkpoint.pt.000").write_bytes(bytes([k]) * 16_000)
    monkeypatch.setattr(queue, "PIECE_BYTES", 15_000)
    # tar pads each run to 20 KiB: records and five runs, 110 KiB in two bundles of 60,000 B
    kept, left, used = queue.carry_over(out, tmp_path / "carry", 60_000, bundles=2)
    assert len(kept) == 6 and left == [] and used == 2
    for k in (1, 2):
        pieces = sorted((tmp_path / "carry" / f"b{k}").glob("queue.[0-9]*"))
        assert len(pieces) <= 4 and all(p.stat().st_size <= 15_000 for p in pieces)
    names, left_out = queue.unpack([tmp_path / "carry" / "b2", tmp_path / "carry" / "b1"],
                                   tmp_path / "back")
    assert left_out == [] and all((tmp_path / "back" / "ch" / f"r{k}" / "checkpoint.pt.000")
                                  .read_bytes() == bytes([k]) * 16_000 for k in range(5))
    # A piece altered on the way is named.
    piece = next((tmp_path / "carry" / "b2").glob("queue.[0-9]*"))
    piece.write_bytes(b"x" + piece.read_bytes()[1:])
    with pytest.raises(UserError, match=piece.name):
        queue.unpack([tmp_path / "carry" / "b1", tmp_path / "carry" / "b2"], tmp_path / "bad")


def test_queue_configs_hash_like_the_chapter_01_notebook_builds_them():
    from mrc_lib.config import resolve_config
    from mrc_lib.records import config_hash

    jobs = {j.name: j for j in queue.load_queue() if j.entry.chapter == "01_bidaf_qanet"}
    for name in ("bidaf", "qanet"):  # the notebook: resolve_config(name, ..., seed, device)
        notebook_cfg = resolve_config(name, "squad-v1.1", "full", overrides=["seed=0",
                                                                             "device=cpu"])
        assert config_hash(jobs[name].config().to_dict()) == config_hash(notebook_cfg.to_dict())


def test_cli_pack_unpack_import(tmp_path, monkeypatch, capsys):

    monkeypatch.setattr(records, "BOOK_RUNS", tmp_path / "book" / "runs")
    out = tmp_path / "q"
    record = {k: 1 for k in records.REQUIRED} | {"chapter": "ch", "run": "r"}
    records.write_record(out / "records" / "ch" / "r.json", record)
    assert main(["queue", "pack", "--out", str(out), "--to", str(tmp_path / "back")]) == 0
    assert main(["queue", "unpack", "--from", str(tmp_path / "back"),
                 "--out", str(tmp_path / "here")]) == 0
    assert main(["queue", "import", "--out", str(tmp_path / "here")]) == 0
    assert records.read_record(tmp_path / "book" / "runs" / "ch" / "r.json") == record
    (out / "records" / "ch" / "r.json").write_text("{")
    assert main(["queue", "import", "--out", str(out)]) == 2
    assert "r.json: corrupt run record" in capsys.readouterr().err
    assert main(["queue", "run"]) == 2  # no --out
    assert main(["queue", "pack", "--out", str(out)]) == 2  # no --to
    assert "needs --to" in capsys.readouterr().err


def test_prepare_loads_each_distinct_data_once_and_leaves_multi_passage_to_the_gpu(
        tmp_path, monkeypatch):
    from mrc_lib import train

    entry = {"priority": 1, "minutes": 1, "schedule": "-"}
    path = write_queue(tmp_path, {"ch": [
        {**entry, "run": "bidaf_seed{seed}", "model": "bidaf", "seeds": [0, 1]},
        {**entry, "run": "mp4", "model": "dynsan", "overrides": ["data_options.passages=4"]},
        {**entry, "run": "mp2", "model": "dynsan", "overrides": ["data_options.passages=2"]},
        {**entry, "run": "ne", "model": "ea_reader", "dataset": "wiki-cloze",
         "overrides": ["data_options.subset=NE"]},
        {**entry, "run": "cn", "model": "ea_reader", "dataset": "wiki-cloze",
         "overrides": ["data_options.subset=CN"]}]})
    loads = []
    monkeypatch.setattr(train, "load_data", loads.append)
    queue.prepare(queue.load_queue(path), log=lambda line: None)
    assert [(c.dataset, c.data_options.get("subset")) for c in loads] == [
        ("squad-v1.1", None), ("wiki-cloze", "NE"), ("wiki-cloze", "CN")]
    assert all("passages" not in c.data_options for c in loads)


def test_verify_compares_each_chapters_smoke_record_with_its_entry(tmp_path, tiny_queue, capsys):

    jobs = queue.load_queue(tiny_queue)
    runs = tmp_path / "runs"

    def smoke_record(job, cfg):
        path = runs / job.entry.chapter / "smoke" / job.name / "record.json"
        path.parent.mkdir(parents=True)
        record = {"schema": 1, "chapter": job.entry.chapter, "run": job.name,
                  "config": cfg.to_dict(), "config_hash": records.config_hash(cfg.to_dict()),
                  "data_digests": {}, "dev": {}, "history": [], "device": "cpu"}
        path.write_text(json.dumps(record))

    seed0, seed1 = jobs
    smoke_record(seed0, seed0.config("smoke"))  # the chapter built the entry's config
    other = seed1.config("smoke")
    other.lr *= 2  # the chapter built another config
    # and named every hyperparameter, as records do: the same reader, so no difference listed
    other.hparams = effective_hparams(other.to_dict())
    assert other.hparams != seed1.config("smoke").hparams
    smoke_record(seed1, other)
    matched, mismatched, unchecked = queue.verify(jobs, runs)
    assert matched == [seed0.key] and unchecked == []
    assert mismatched == [f"{seed1.key}: lr: chapter {other.lr!r}, queue {other.lr / 2!r}"]
    assert main(["queue", "verify", "--file", tiny_queue, "--out", str(runs)]) == 2
    printed = capsys.readouterr()
    assert "1 runs build their queue entry's config, 1 do not" in printed.out
    assert "1 chapter run(s) build another config" in printed.err


def test_records_and_the_inbox_are_committed_run_folders_are_not():
    import subprocess

    def ignored(path: str) -> bool:
        return subprocess.run(["git", "check-ignore", "-q", path], cwd=records.ROOT).returncode == 0

    path = records.record_path("01_bidaf_qanet", "bidaf").relative_to(records.ROOT)
    assert not ignored(str(path)), f"{path} is ignored by git: records would never land"
    assert not ignored("runs/inbox/1/queue.json"), "the carry-over would never land"
    assert not ignored("runs/compile_cache/nvidia_h200/qanet-0123456789ab.bin.xz")
    assert ignored("runs/queue/records/ch/r.json") and ignored("runs/01_bidaf_qanet/smoke/x")


def test_a_compiled_worker_loads_its_graphs_cache_and_the_first_to_compile_writes_it(
        mirror, tmp_path, tiny_queue, monkeypatch, capsys):
    """With MRC_COMPILE_CACHE (a GPU session's), a compiled run loads the artifacts of its
    compile_key before it trains and writes what it compiled after, unless a file of its key
    is there: another seed of the same reader shares the key (torch.compile is faked here;
    compiling on a CPU takes minutes)."""
    import torch

    from mrc_lib import train as engine

    loaded = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", loaded.append)
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"graphs", None))
    cache = tmp_path / "cache"
    monkeypatch.setenv(engine.COMPILE_CACHE, str(cache))
    seed0, seed1 = queue.load_queue(tiny_queue)
    queue.work(seed0, tmp_path / "out", None, "smoke", ("compile=true",))
    key = engine.compile_key(seed0.config("smoke", ("compile=true",)), torch.device("cpu"))
    assert key == engine.compile_key(seed1.config("smoke", ("compile=true",)),
                                     torch.device("cpu"))
    assert loaded == [] and (cache / f"{key}.bin").read_bytes() == b"graphs"
    assert f"compile cache: none on file\ncompile cache: wrote {key}.bin" in capsys.readouterr().out
    queue.work(seed1, tmp_path / "out", None, "smoke", ("compile=true",))
    assert loaded == [b"graphs"]
    assert "compile cache: on file" in capsys.readouterr().out
    # Another reader's hyperparameters, another precision or compile mode: another key.
    cfg = seed0.config("smoke", ("compile=true",))
    keys = {engine.compile_key(c, torch.device("cpu")) for c in (
        cfg, dataclasses.replace(cfg, bf16=True),
        dataclasses.replace(cfg, compile_mode="reduce-overhead"),
        dataclasses.replace(cfg, hparams={**cfg.hparams, "hidden": 16}))}
    assert len(keys) == 4 and all(k.startswith("bidaf-") for k in keys)
    # Artifacts torch rejects are said so, and the reader compiles without them.
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts",
                        lambda blob: (_ for _ in ()).throw(RuntimeError("another torch")))
    said = engine.load_compile_cache(cache, key)
    assert said.endswith("not loaded (RuntimeError: another torch)") and str(cache) in said


def test_smoke_overrides_apply_at_the_smoke_profile_only(tmp_path):
    path = write_queue(tmp_path, {"ch": [
        {"run": "r", "model": "bidaf", "priority": 2, "minutes": 1, "schedule": "-",
         "overrides": ["hparams.hidden=8"], "smoke_overrides": ["max_steps=4"]}]})
    (job,) = queue.load_queue(path)
    assert job.config("smoke").max_steps == 4 and job.config("smoke").hparams["hidden"] == 8
    assert job.config("full").max_steps is None and job.config("full").hparams["hidden"] == 8


def test_parallel_auto_reads_the_packing_benchmark_of_this_gpu(tmp_path, monkeypatch):
    import argparse

    import torch

    assert queue.parallel_count("3") == 3 and queue.parallel_count("auto") == "auto"
    for bad in ("0", "-1", "two"):
        with pytest.raises(argparse.ArgumentTypeError, match=bad):
            queue.parallel_count(bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="no GPU"):
        queue.measured_parallel(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    path = tmp_path / "packing_nvidia_h100_80gb_hbm3.json"
    with pytest.raises(UserError, match="gpu_packing.py"):
        queue.measured_parallel(tmp_path)
    mate = tmp_path / "packing_nvidia_h200.json"  # the same chip (GH100): its file serves
    mate.write_text(json.dumps({"recommended_parallel": 3}))
    assert queue.measured_parallel(tmp_path) == 3
    path.write_text(json.dumps({"recommended_parallel": None}))  # the GPU's own comes first
    with pytest.raises(UserError, match="no recommended_parallel"):
        queue.measured_parallel(tmp_path)
    path.write_text(json.dumps({"recommended_parallel": 6}))
    assert queue.measured_parallel(tmp_path) == 6


def test_a_run_that_cannot_finish_in_what_is_left_is_not_started(tmp_path, tiny_queue):
    q = write_queue(tmp_path, {"tq": [
        {"run": "short", "model": "bidaf", "priority": 1, "minutes": 4, "schedule": "tiny",
         "overrides": TINY},
        {"run": "long", "model": "bidaf", "priority": 1, "minutes": 20, "schedule": "tiny",
         "overrides": TINY}]})
    short, long = queue.load_queue(q)
    out = tmp_path / "q"
    assert queue.startable(short, out, left=4)
    assert not queue.startable(short, out, left=3.9)  # cut, it would start over
    assert queue.startable(long, out, left=1)  # longer than any command: it resumes in the next
    (out / "tq" / "short").mkdir(parents=True)
    (out / "tq" / "short" / "status.json").write_text(json.dumps({"fraction": 0.5}))
    assert queue.startable(short, out, left=1)  # it resumes
    lines = []
    assert queue.run_queue([short], tmp_path / "empty", minutes=5, reserve=120,
                           queue_file=q, log=lines.append) == {}
    assert lines == ["not started tq/short: ~4 min, too long for what was left"]


def test_the_graphed_readers_runs_replay_their_steps_as_cuda_graphs(tmp_path, monkeypatch):
    q = write_queue(tmp_path, {"tq": [
        {"run": "a", "model": "qanet", "priority": 1, "minutes": 1, "schedule": "tiny"},
        {"run": "b", "model": "bidaf", "priority": 1, "minutes": 1, "schedule": "tiny"}]})
    commands = {}

    class Worker:  # a worker that ends at once, having been given its command line
        def __init__(self, argv, **kwargs):
            commands[argv[argv.index("--job") + 1]] = argv
            self.returncode = 0

        def poll(self):
            return 0

    monkeypatch.setattr(queue.subprocess, "Popen", Worker)
    queue.run_queue(queue.load_queue(q), tmp_path / "q", minutes=5, reserve=0, parallel=2,
                    queue_file=q, settings=("log_every=1",), graphed=["qanet"], log=print)
    sets = {key: [a for a in argv if a.startswith("--set=")] for key, argv in commands.items()}
    assert sets == {"tq/a": ["--set=log_every=1", "--set=cuda_graphs=true",
                             "--set=pad_multiple=16"],
                    "tq/b": ["--set=log_every=1"]}
    assert queue.check_settings(list(queue.GRAPH_SETTINGS))  # keys outside the config hash


@pytest.mark.parametrize("parallel", [1, 4])
def test_workers_sharing_a_gpu_each_hold_a_share_of_its_memory(tmp_path, monkeypatch,
                                                               parallel):
    from mrc_lib.train import GPU_SHARE

    q = write_queue(tmp_path, {"tq": [
        {"run": "a", "model": "qanet", "priority": 1, "minutes": 1, "schedule": "tiny"},
        {"run": "b", "model": "rnet", "priority": 1, "minutes": 1, "schedule": "tiny"}]})
    envs = {}

    class Worker:  # a worker that ends at once, having been given its environment
        def __init__(self, argv, env, **kwargs):
            envs[argv[argv.index("--job") + 1]] = env
            self.returncode = 0

        def poll(self):
            return 0

    monkeypatch.setattr(queue.subprocess, "Popen", Worker)
    monkeypatch.delenv(GPU_SHARE, raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    queue.run_queue(queue.load_queue(q), tmp_path / "q", minutes=5, reserve=0,
                    parallel=parallel, queue_file=q, graphed=["qanet"], log=print)
    share = {1: None, 4: "0.2375"}[parallel]  # (1 - 0.05) / 4
    assert {key: env.get(GPU_SHARE) for key, env in envs.items()} == {"tq/a": share,
                                                                      "tq/b": share}
    # The eager worker's tensors of changing shapes go into one growing segment.
    assert envs["tq/b"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in envs["tq/a"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.8")
    assert queue.worker_env(queue.load_queue(q)[1], 2, ())["PYTORCH_CUDA_ALLOC_CONF"] == \
        "garbage_collection_threshold:0.8"  # the user's own is kept


def test_with_a_carry_over_a_run_that_will_be_cut_starts_only_if_its_checkpoint_fits(
        tmp_path, monkeypatch):
    q = write_queue(tmp_path, {"tq": [
        {"run": run, "model": "bidaf", "priority": 1, "minutes": minutes, "schedule": "tiny",
         "overrides": TINY} for run, minutes in (("short", 4), ("long", 20), ("long2", 20))]})
    short, long, long2 = queue.load_queue(q)
    mib = 2**20
    monkeypatch.setattr(queue, "checkpoint_size", lambda job, profile="full": 10 * mib)
    out = tmp_path / "q"
    carry = queue.Carry(out, 15 * mib)
    assert carry.used == queue.Carry.SLACK  # the records to come
    assert queue.startable(short, out, left=4, carry=carry)  # it finishes: nothing to carry
    assert queue.startable(long, out, left=4, carry=carry)  # cut, it fits the carry-over
    assert carry.held["tq/long"] == 10 * mib + queue.Carry.SLACK
    assert queue.startable(long, out, left=4, carry=carry)  # held already
    assert not queue.startable(long2, out, left=4, carry=carry)  # cut, it would not fit too
    assert not queue.startable(short, out, left=3, carry=carry)
    assert carry.refused == {"tq/long2": 10 * mib}
    carry.release(long)
    # A run within a command is not started to be cut: the next session's command ends it,
    # where its checkpoint would have cost that session a call each way.
    assert not queue.startable(short, out, left=3, carry=carry) and "tq/short" not in carry.held
    assert queue.startable(long2, out, left=4, carry=carry)
    # Longer than a command, with a checkpoint over the carry-over: never started.
    assert queue.stranded([short, long], 10.4) == [(long, 10 * mib)]
    assert queue.stranded([short, long], 10.6) == []
    # A partial run in the folder is carried on whatever the command starts, and what it has
    # done counts: 20 min at 90% leaves 2.
    (out / "tq" / "long").mkdir(parents=True)
    (out / "tq" / "long" / "status.json").write_text(json.dumps({"complete": False,
                                                                  "fraction": 0.9}))
    (out / "tq" / "long" / "checkpoint.pt.000").write_bytes(bytes(6 * mib))
    carry = queue.Carry(out, 15 * mib)
    assert carry.held["tq/long"] > 6 * mib
    assert queue.startable(long, out, left=2, carry=carry)
    assert not queue.startable(long2, out, left=4, carry=carry)
    lines = []
    assert queue.run_queue([long2], tmp_path / "empty", minutes=5, reserve=120, queue_file=q,
                           carry_mib=5, log=lines.append) == {}
    assert lines == ["not started tq/long2: ~20 min, too long for what was left, and its "
                     "10.0 MiB checkpoint would not fit the 5 MiB carried on"]



def test_bringup_minutes_are_the_schedule_at_the_measured_speed_by_hand():
    """Eq.: 1.1 x epochs x (training questions / SQuAD v1.1's) x seconds per v1.1 epoch / 60."""
    jobs = {j.key: j for j in queue.load_queue()}
    qanet = jobs["04_aba/qanet_seed0"]  # 30 epochs of the offline SQuAD 2.0 set
    assert queue.bringup_minutes(qanet, {"qanet_na": 100.0}) == pytest.approx(
        1.1 * 30 * (137_335 / 87_599) * 100.0 / 60)
    assert queue.bringup_minutes(jobs["01_bidaf_qanet/bidaf"], {"bidaf": 50.0}) == \
        pytest.approx(1.1 * 12 * 50.0 / 60)
    assert queue.bringup_minutes(qanet, {"bidaf": 50.0}) is None  # not measured
    ea = next(j for k, j in jobs.items() if k.startswith("05_ea_reader/"))
    assert queue.bringup_minutes(ea, {"ea_reader": 50.0}) is None  # not SQuAD


QUEUE_TEXT = """# a comment: minutes: 5
ch:
  # the headline first
  - {run: "a", model: bidaf, priority: 2, minutes: 10, schedule: "s",
     overrides: ["epochs=2"]}
  - {run: b, model: bidaf, priority: 1, minutes: 3,
     schedule: "s", overrides: ["epochs=2"]}
  - {run: "c_seed{seed}", model: qanet, priority: 1, seeds: [0, 1], minutes: 7, schedule: "s"}
"""


def test_estimates_below_the_bringup_are_lifted_family_by_family(tmp_path, capsys):
    path = tmp_path / "queue.yaml"
    path.write_text(QUEUE_TEXT)
    jobs = queue.load_queue(path)
    # bidaf's headline is b (priority 1): 2 epochs at 90 s, plus 10%: 3.3 minutes, over its 3.
    speeds = {"bidaf": 90.0, "qanet": 1.0}
    [bidaf] = [c for (model, _), c in queue.calibration(jobs, speeds).items() if model == "bidaf"]
    assert bidaf["headline"] == "ch/b" and bidaf["factor"] == pytest.approx(3.3 / 3)
    changed = queue.raise_estimates(path, jobs, speeds)
    assert changed == ["ch/a: 10 -> 11 min", "ch/b: 3 -> 4 min"]  # x1.1, rounded up
    assert path.read_text() == QUEUE_TEXT.replace("minutes: 10", "minutes: 11").replace(
        "minutes: 3,", "minutes: 4,")  # qanet's family, at its floor, and the rest unchanged
    assert queue.raise_estimates(path, queue.load_queue(path), speeds) == []  # idempotent
    assert main(["queue", "estimates", "--file", str(path)]) in (None, 0)
    assert "ch/b" in capsys.readouterr().out


def test_the_queue_estimates_are_not_below_the_bringups():
    """After a GPU session measures a reader slower, `python -m mrc_lib queue estimates
    --write` lifts its runs' estimates (then `benchmarks/gpu_session.py plan`)."""
    below = {key: c for key, c in queue.calibration(queue.load_queue(),
                                                    queue.bringup_speeds()).items()
             if c["factor"] > 1}
    assert not below, f"run `python -m mrc_lib queue estimates --write`: {below}"
