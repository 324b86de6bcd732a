"""``benchmarks/gpu_session.py``, the one command of a GPU session, checked on a CPU with
``--tiny``: the data it carries, its steps under a deadline, the files it sends back, and
their import into the repository."""

from __future__ import annotations

import json
import lzma
import sys
import tarfile
import time
from argparse import Namespace

import pytest
import torch

from mrc_lib import bench, queue, records
from mrc_lib.bench import SPEED_REVISION, full_readers
from mrc_lib.config import resolve_config
from mrc_lib.train import device_name

from .test_cli import load_bringup
from .test_queue import TINY, write_queue

gs = load_bringup("gpu_session")


def test_one_session_prepare_run_import_tiny_on_cpu(mirror, tmp_path, monkeypatch, capsys):
    q = write_queue(tmp_path, {"tq": [{"run": "bidaf", "model": "bidaf", "priority": 1,
                                       "minutes": 1, "schedule": "tiny", "overrides": TINY}]})
    travel = tmp_path / "travel.tar.xz"
    paths = {k: tmp_path / k for k in ("runner", "inbox", "staged", "work", "results", "out",
                                       "compile_cache", "staged_cache")}
    # The committed compile cache: a file for this machine's CPU (the tiny session's device),
    # one for an H200. Prepare moves it out of the tree into the data file.
    cpu = gs.slug(device_name(torch.device("cpu")))
    for device in (cpu, "nvidia_h200"):
        (paths["compile_cache"] / device).mkdir(parents=True)
        (paths["compile_cache"] / device / "bidaf-0123456789ab.bin.xz").write_bytes(
            lzma.compress(device.encode()))
    caches = [f"--compile-cache={paths['compile_cache']}",
              f"--staged-cache={paths['staged_cache']}"]
    # The repository's own carry-over (two bundles, 72 MiB, on 2026-11-29) is out of the tree
    # in a session, which moves it to .devcache: here it is not the inbox, so leave it out.
    tree_mib = gs.tree_mib
    monkeypatch.setattr(gs, "tree_mib", lambda *staged: tree_mib(*staged, gs.INBOX))
    gs.main(["prepare", "--only", "tq/*", "--queue-file", q, "--travel", str(travel),
             f"--inbox={paths['inbox']}", f"--staged={paths['staged']}", *caches])
    assert not paths["compile_cache"].exists() and paths["staged_cache"].is_dir()
    with tarfile.open(travel) as tar:
        names = tar.getnames()
    assert {n.rsplit("/", 1)[-1] for n in names} >= {"meta.json", "vectors.npy", "train.npz",
                                                     "dev.npz", "dev.json.gz"}
    assert not any(n.endswith("train.json.gz") for n in names)  # training never reads it
    assert f"compile_cache/{cpu}/bidaf-0123456789ab.bin.xz" in names
    said = capsys.readouterr().out
    info = json.loads(gs.travel_info(travel).read_text())  # carried beside the data
    # 64 MiB less the tree and growth
    carry = gs.carry_mib(gs.tree_mib(paths["inbox"], paths["compile_cache"]))
    assert info["carry_mib"] == carry and info["growth_mib"] == gs.GROWTH_MIB
    assert info["bundles"] == gs.CARRY_BUNDLES
    assert info["compile_cache_mib"] == round(gs.folder_mib(paths["staged_cache"]), 2)
    assert info["calls"] == [[str(travel), str(gs.travel_info(travel))]]  # no carry-over
    assert f"this session sends on at most {gs.CARRY_BUNDLES} bundle(s) of {carry:g} MiB" in said
    assert "never started" not in said  # one minute: it ends within a command

    # The GPU machine has no raw data: the run reads only what was carried.
    monkeypatch.delenv("MRC_DATA_DIR")
    (paths["results"]).mkdir()
    common = [f"--{k}={paths[k]}" for k in ("runner", "inbox", "staged", "work", "results")]
    common += caches
    # Six minutes of clock, though the session ends in about 35 s: train starts only with
    # two and a half minutes left, and on a loaded machine (the test failed once on a clock of
    # four, a CI and another pytest sharing two cores) the steps before it take longer.
    result = gs.main(["run", "--tiny", "--out", str(paths["out"]), "--minutes", "6",
                      "--steps", "bringup,measure,profile,compile,fp32,train", "--only", "tq/*",
                      "--queue-file", q, "--profile", "smoke", "--travel", str(travel),
                      *common])
    states = {step["step"]: step["state"] for step in result["steps"]}
    seeded = paths["work"] / "compile_cache" / "bidaf-0123456789ab.bin"
    assert states.pop("compile cache") == f"1 file(s) for the {device_name(torch.device('cpu'))}" \
        f" into {seeded.parent}" and seeded.read_bytes() == cpu.encode()
    assert states == {"data": states["data"], "inbox": "nothing to unpack", "bringup": "done",
                      "measure": "done", "profile": "done", "compile": "skipped",
                      "fp32": "done", "train": "done"}, result
    back = [p for p in paths["out"].rglob("*") if p.is_file()]
    assert len(back) <= 8 and (paths["out"] / "session.tar").is_file()
    assert (paths["out"] / "b1" / "queue.json").is_file()
    with tarfile.open(paths["out"] / "session.tar") as tar:  # what import carries on
        summary = json.load(tar.extractfile("session.json"))
    assert summary["carry_mib"] == carry and summary["carry_bundles"] == gs.CARRY_BUNDLES
    assert summary["bundles"] == 1  # the records alone

    book = tmp_path / "book" / "runs"
    monkeypatch.setattr(records, "BOOK_RUNS", book)
    here = tmp_path / "here"
    lines = gs.main(["import", str(paths["out"]), "--keep", str(tmp_path / "keep"),
                     f"--results={paths['results']}", f"--runner={here}",
                     f"--inbox={paths['inbox']}", f"--staged={paths['staged']}",
                     "--queue-file", q, *caches])
    assert any(line.startswith("benchmark ") for line in lines)
    assert lines[-1] == f"page {tmp_path / 'book' / 'full_runs.md'}: commit it"
    page = (tmp_path / "book" / "full_runs.md").read_text()  # a smoke run: not the full config
    assert "| tq | 1 | 0 | 0 | 1 | 1 |" in page and "| bidaf | done, earlier config" in page
    eager, fp32 = (json.loads(p.read_text()) for p in sorted(paths["results"].glob("gpu_*")))
    assert eager["models"]["bidaf"]  # the CPU's name: gpu_<name>.json, gpu_<name>_fp32.json
    assert fp32["fp32"] and fp32["complete"] and not fp32["models"]["qanet"]["bf16"]
    profiled = json.loads(next(paths["results"].glob("profile_*.json")).read_text())
    assert profiled["complete"] and profiled["models"]["bidaf"]["wall_ms"] > 0
    assert records.read_record(book / "tq" / "bidaf.json")["complete"]
    assert records.is_measurement(records.read_record(book / "07_comparison" / "speed.json"))
    assert "no partial run" in lines[-2] and not paths["inbox"].exists()
    # The compile cache is back in the tree as it was (nothing compiled anew came back).
    assert not paths["staged_cache"].exists()
    assert sorted(p.parent.name for p in paths["compile_cache"].glob("*/*.xz")) == sorted(
        [cpu, "nvidia_h200"]) and not any(line.startswith("compile cache") for line in lines)


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
        resolve_config(name, profile="full").to_dict()), "speed_revision": SPEED_REVISION}
        for name in full_readers()}
    path = results / "gpu_cpu.json"
    path.write_text(json.dumps({"models": models}))
    assert gs.bringup_skip(s) is None  # cut short: no "complete"
    path.write_text(json.dumps({"models": models, "complete": True}))
    assert gs.bringup_skip(s) == "every reader's bring-up matches its config and code"
    del models["san"]["speed_revision"]  # measured of the code before revision 2
    path.write_text(json.dumps({"models": models, "complete": True}))
    assert gs.bringup_skip(s) is None
    models["san"]["speed_revision"] = SPEED_REVISION
    models["bidaf"]["config_hash"] = "another"
    path.write_text(json.dumps({"models": models, "complete": True}))
    assert gs.bringup_skip(s) is None


def test_the_profile_runs_again_for_another_revision_of_the_readers_code(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    s = session(tmp_path / "w", tiny=False, results=results)
    profile = {"device": "cpu", "complete": True, "speed_revision": SPEED_REVISION}
    (results / "profile_cpu.json").write_text(json.dumps(profile))
    assert gs.profile_skip(s) == "on file"
    (results / "profile_cpu.json").write_text(json.dumps(dict(profile, speed_revision=1)))
    assert gs.profile_skip(s) is None


def test_full_precision_is_measured_again_beside_the_profiles_precision(tmp_path):
    """A full-precision file on file is measured again when a reader's entry is of another
    revision of the readers' code, or lacks its profile's precision measured beside it in the
    same process: only that pair says which precision is faster (sessions' machines differ)."""
    results = tmp_path / "results"
    results.mkdir()
    s = session(tmp_path / "w", tiny=False, results=results)
    paired = {"speed_revision": SPEED_REVISION, "speed": {}, "plain_speed": {}}
    fp32 = {"device": "cpu", "complete": True, "fp32": True,
            "models": {"qanet": paired, "dynsan": {"error": "RuntimeError: x"}}}
    (results / "gpu_cpu_fp32.json").write_text(json.dumps(fp32))
    assert gs.fp32_skip(s) == "on file"
    for stale in ({**paired, "speed_revision": SPEED_REVISION - 1},
                  {k: v for k, v in paired.items() if k != "plain_speed"}):
        (results / "gpu_cpu_fp32.json").write_text(json.dumps(dict(fp32, models={"qanet": stale})))
        assert gs.fp32_skip(s) is None


def test_an_h100_reads_the_packing_profile_and_compile_files_of_the_h200(tmp_path):
    """The H100 and the H200 are one chip (GH100): what the H200 measured of packing, the
    profile and compiling is not measured again on an H100 (its bring-up is), and the H200's
    recommended process count serves it; a cut file of the other GPU does not count."""
    results = tmp_path / "results"
    results.mkdir()
    args = Namespace(tiny=False, runner=None, started="now", minutes=1.0, only=None,
                     parallel=None)
    s = gs.Session(args, "NVIDIA H100 80GB HBM3", tmp_path / "w", results, time.time() + 60)
    steps = {step.name: step for step in gs.STEPS}
    names = {"packing": "packing_nvidia_h200.json", "profile": "profile_nvidia_h200.json",
             "compile": "gpu_nvidia_h200_compile.json",
             "compile_ro": "gpu_nvidia_h200_compile_reduce_overhead.json",
             "compile_whole": "gpu_nvidia_h200_compile_whole_reduce_overhead.json",
             "graphs": "gpu_nvidia_h200_compile_whole_cudagraphs.json",
             "fp32": "gpu_nvidia_h200_fp32.json",
             "cuda_graphs": "gpu_nvidia_h200_cuda_graphs.json"}
    for step, name in names.items():
        assert steps[step].skip(s) is None
        (results / name).write_text(json.dumps({"device": "NVIDIA H200"}))  # cut: not whole
        assert steps[step].skip(s) is None
        (results / name).write_text(json.dumps({"device": "NVIDIA H200", "complete": True,
                                                "recommended_parallel": 3,
                                                "speed_revision": SPEED_REVISION,
                                                "agreement_revision":
                                                    bench.AGREEMENT_REVISION}))
        assert steps[step].skip(s) == "on file for the NVIDIA H200 (the same chip)"
    assert gs.parallel(s) == 3
    (results / "packing_nvidia_h100_80gb_hbm3.json").write_text(json.dumps(
        {"device": s.device, "complete": True, "recommended_parallel": 5}))
    assert steps["packing"].skip(s) == "on file" and gs.parallel(s) == 5  # its own first
    (results / "gpu_nvidia_h200.json").write_text(json.dumps({"complete": True, "models": {}}))
    assert gs.bringup_skip(s) is None  # the bring-up is per GPU
    other = gs.Session(args, "NVIDIA A100-SXM4-80GB", tmp_path / "w", results, time.time())
    assert steps["packing"].skip(other) is None  # another chip


def test_a_compile_step_runs_again_for_an_error_of_an_earlier_tracing(tmp_path):
    """A compile file on file for the chip, whole, in which a reader failed under an earlier
    revision of ``compiled()``'s tracing, is measured again: the revision may have fixed it (on
    an H100 torch's cudagraphs backend replayed a graph at other sizes). An error under today's
    tracing, or a compilation cut, is the finding, and stays."""
    from mrc_lib.bench import CUT
    from mrc_lib.train import COMPILE_REVISION

    results = tmp_path / "results"
    results.mkdir()
    s = session(tmp_path / "w", tiny=False, results=results)
    s = gs.Session(s.args, "NVIDIA H100 80GB HBM3", s.work, results, time.time() + 60)
    graphs = next(step for step in gs.STEPS if step.name == "graphs")
    path = results / "gpu_nvidia_h200_compile_whole_cudagraphs.json"

    def on_file(error, **revision):
        path.write_text(json.dumps({"device": "NVIDIA H200", "complete": True, **revision,
                                    "models": {"qanet": {"error": error}, "bidaf": {}}}))
        return graphs.skip(s)

    assert on_file("RuntimeError: The size of tensor a (140) must match") is None
    same_chip = "on file for the NVIDIA H200 (the same chip)"
    assert on_file("RuntimeError: boom", compile_revision=COMPILE_REVISION) == same_chip
    assert on_file(CUT) == same_chip


def test_a_whole_compile_step_measures_only_the_readers_not_final_on_the_chip(tmp_path):
    """The H200 compiled QANet whole under reduce-overhead for 298 s before its command was
    cut: on an H100 (the same chip) the step compiles DynSAN alone, and once DynSAN is
    measured there the step is not needed. A cut shorter than the final time is tried again."""
    from mrc_lib.bench import CUT, WHOLE_FINAL_SECONDS

    results = tmp_path / "results"
    results.mkdir()
    s = session(tmp_path / "w", tiny=False, results=results)
    s = gs.Session(s.args, "NVIDIA H100 80GB HBM3", s.work, results, time.time() + 60)
    whole = next(step for step in gs.STEPS if step.name == "compile_whole")

    def models(argv):
        return argv[argv.index("--models") + 1]

    h200 = results / "gpu_nvidia_h200_compile_whole_reduce_overhead.json"
    h200.write_text(json.dumps({"device": "NVIDIA H200", "models": {
        "qanet": {"error": CUT, "seconds": WHOLE_FINAL_SECONDS - 1}}}))
    assert whole.skip(s) is None and models(whole.argv(s, 300)) == "qanet,dynsan"
    h200.write_text(json.dumps({"device": "NVIDIA H200", "models": {
        "qanet": {"error": CUT, "seconds": 298.3}}}))
    assert whole.skip(s) is None and models(whole.argv(s, 300)) == "dynsan"
    (results / "gpu_nvidia_h100_80gb_hbm3_compile_whole_reduce_overhead.json").write_text(
        json.dumps({"device": s.device, "models": {"dynsan": {"speed": {}}}}))
    assert whole.skip(s).startswith("every reader compiled whole on this chip")
    # A bring-up killed inside a compilation (its SIGTERM handler never ran) gets the seconds
    # its reader had from when the entry started, and a final cut counts as such.
    cut = results / "cut.json"
    cut.write_text(json.dumps({"models": {"qanet": {"error": CUT, "started": 1000.0},
                                          "dynsan": {"speed": {}}}}))
    gs.settle_cut(["python", "benchmarks/gpu_bringup.py", "--out", str(cut)], 1298.3)
    assert json.loads(cut.read_text())["models"] == {
        "qanet": {"error": CUT, "started": 1000.0, "seconds": 298.3}, "dynsan": {"speed": {}}}


def test_a_carry_over_too_large_beside_the_data_travels_in_calls_of_its_own(tmp_path,
                                                                           monkeypatch):
    """``prepare`` moves the committed carry-over out of the tree and names the calls: the
    data and each bundle, in as few calls as hold them beside the tree, the command in the
    last (the warm machine keeps what the others carried); ``run`` restores the moved one; an
    import that gets nothing back puts it back, one that gets a bundle spends it."""
    inbox, staged = tmp_path / "inbox", tmp_path / "staged"
    assert gs.stage(inbox, staged) == 0  # nothing to carry on
    for k in (1, 2):
        (inbox / f"b{k}").mkdir(parents=True)
        (inbox / f"b{k}" / "queue.json").write_text("{}")
        (inbox / f"b{k}" / f"queue.000.00{k}").write_bytes(b"x" * 2**20)
    mib = gs.stage(inbox, staged)
    assert not inbox.exists() and (staged / "b1" / "queue.000.001").is_file() and 2 < mib < 2.01
    assert gs.stage(inbox, staged) == mib  # a second prepare keeps what the first moved
    travel = tmp_path / "travel.tar.xz"
    data = [str(travel), str(tmp_path / "travel.json")]
    b1, b2 = str(staged / "b1"), str(staged / "b2")
    assert gs.calls_for(travel, 20, staged, 6.5) == [data + [b1, b2]]
    assert gs.calls_for(travel, 20, staged, 42.5) == [data + [b1], [b2]]  # 21.5 MiB a call
    assert gs.calls_for(travel, 20, staged, 43.5) == [data, [b1, b2]]
    (staged / "b2" / "queue.000.002").write_bytes(b"x" * 2**20 * 19)  # 19 MiB: the largest
    assert gs.calls_for(travel, 20, staged, 42.5) == [data + [b1], [b2]]
    assert gs.calls_for(travel, 18.5, staged, 42.5) == [[b1, b2], data]  # the fewest calls
    (staged / "b2" / "queue.000.002").write_bytes(b"x" * 2**20)
    assert gs.calls_for(travel, 20, tmp_path / "none", 43.5) == [data]
    assert [gs.rel(gs.TRAVEL), gs.rel(gs.STAGED / "b1")] == [  # as the device tool names them
        ".devcache/travel.tar.xz", ".devcache/inbox/b1"]
    assert gs.carry_mib(6.5) == 56.0 and gs.carry_mib(0.1) == 60  # what comes back, at most

    monkeypatch.setattr(records, "BOOK_RUNS", tmp_path / "book" / "runs")  # the page's folder
    keep = tmp_path / "back"
    (keep / "session").mkdir(parents=True)
    (keep / "session" / "session.json").write_text(json.dumps(
        {"device": "cpu", "started": "now", "steps": []}))
    with tarfile.open(keep / "session.tar", "w") as tar:
        tar.add(keep / "session", arcname=".")
    args = Namespace(source=[str(keep)], keep=str(tmp_path / "kept"), results=str(tmp_path),
                     runner=tmp_path / "runner", inbox=inbox, staged=staged,
                     compile_cache=tmp_path / "cc", staged_cache=tmp_path / "staged_cc",
                     queue_file=str(write_queue(tmp_path, {"tq": []})))
    lines = gs.import_session(args)
    assert f"no bundle came back: {inbox} is the carry-over that was sent" in lines
    assert (inbox / "b2" / "queue.000.002").is_file() and not staged.exists()


def test_two_imports_in_one_second_keep_two_folders(tmp_path):
    assert gs.unused(tmp_path / "t") == tmp_path / "t"
    (tmp_path / "t").mkdir()
    (tmp_path / "t-2").mkdir()
    assert gs.unused(tmp_path / "t") == tmp_path / "t-3"


def test_a_cut_compile_step_goes_on_from_the_file_it_left(tmp_path):
    """The compile step cut after QANet on an H200: the next command starts from that file
    (``--resume``), so it compiles DynSAN instead of QANet again."""
    results = tmp_path / "results"
    results.mkdir()
    s = session(tmp_path / "w", tiny=False, results=results)
    (s.work / "results").mkdir()
    step = next(step for step in gs.STEPS if step.name == "compile")
    argv = step.argv(s, 180)
    assert "--resume" in argv and not (s.work / "results" / "gpu_cpu_compile.json").exists()
    cut = {"models": {"qanet": {"config_hash": "h"}}}
    (results / "gpu_cpu_compile.json").write_text(json.dumps(cut))
    assert step.skip(s) is None  # not whole
    out = step.argv(s, 180)[step.argv(s, 180).index("--out") + 1]
    assert json.loads(open(out).read()) == cut  # this command's file starts as the cut one
    (s.work / "results" / "gpu_cpu_compile.json").write_text("{}")
    assert json.loads(open(step.argv(s, 180)[-1]).read()) == {}  # its own, once written
    assert "--resume" in gs.bringup_argv(s, 150)
    whole = next(step for step in gs.STEPS if step.name == "compile_whole")
    argv = whole.argv(s, 300)
    assert argv[argv.index("--compile-mode") + 1] == "reduce-overhead" and "--whole" in argv
    assert argv[argv.index("--seq-len") + 1] == "140,400" and "--whole" not in step.argv(s, 180)
    graphs = next(step for step in gs.STEPS if step.name == "graphs").argv(s, 300)
    assert graphs[graphs.index("--compile-mode") + 1] == "cudagraphs" and "--whole" in graphs
    assert graphs[graphs.index("--models") + 1] == "qanet,dynsan,phasecond"


def test_the_sessions_runs_write_no_epoch_checkpoints_unless_told(tmp_path):
    """The runner's folder lasts one command: its trainers checkpoint only when the deadline
    cuts them (RUNNER_SETTINGS), a setting the queue accepts (hash-free); the session's own
    ``--set`` comes after, so it wins."""
    s = session(tmp_path / "w", tiny=False, runner=tmp_path / "runner")
    s.args.set, s.args.parallel, s.args.queue_file, s.args.profile = [], 2, "q.yaml", "full"
    s.carry, s.bundles = 55.9, 2
    argv = gs.train_argv(s, 300)
    assert argv[argv.index("--carry-mib") + 1] == "111.8"  # every bundle of the carry-over
    sets = [a.removeprefix("--set=") for a in argv if a.startswith("--set=")]
    assert sets == ["epoch_checkpoints=false"] and queue.check_settings(sets)
    s.args.set = ["epoch_checkpoints=true"]
    sets = [a.removeprefix("--set=") for a in gs.train_argv(s, 300) if a.startswith("--set=")]
    assert sets == ["epoch_checkpoints=false", "epoch_checkpoints=true"]


def test_the_queue_replays_the_readers_whose_recorded_steps_agree_and_gain(tmp_path):
    """A reader trains with its step replayed as CUDA graphs when the --cuda-graphs bring-up on
    the chip measured it without error, its replay agreeing with the eager step and at least
    GRAPHS_GAIN times the eager rate at 140 tokens that its process measured beside it (not
    the eager bring-up's, perhaps of another machine)."""
    results = tmp_path / "results"
    results.mkdir()
    s = session(tmp_path / "w", tiny=False, results=results, runner=tmp_path / "runner")
    s.device = "NVIDIA H100 80GB HBM3"
    s.args.set, s.args.parallel, s.args.queue_file, s.args.profile = [], 2, "q.yaml", "full"
    s.carry, s.bundles = 55.9, 2
    assert gs.graphed(s) == [] and not any(a.startswith("--graphed") for a in
                                            gs.train_argv(s, 300))

    def entry(rate: float, eager: float | None = 100.0, **more) -> dict:
        plain = {} if eager is None else {"plain_speed": {"140": {"train_examples_per_s": eager}}}
        return {"speed": {"140": {"train_examples_per_s": rate}}, **plain, **more}

    # The bring-up's machine was slower: its eager rates do not count.
    (results / "gpu_nvidia_h200.json").write_text(json.dumps({"models": {
        name: entry(10.0) for name in ("qanet", "qanet_na", "bidaf")}}))
    checked = {"qanet": entry(300.0, agreement=0.002), "dynsan": entry(300.0, agreement=0.9),
               "phasecond": entry(110.0, agreement=0.001), "san": {"error": "cuda_graphs: ..."},
               "ea_reader": entry(50.0, eager=40.0, agreement=0.0),
               "qanet_na": entry(300.0, eager=260.0, agreement=0.0),
               "bidaf": entry(300.0, eager=None, agreement=0.0)}  # no eager rate beside it
    graphs_file = results / "gpu_nvidia_h200_cuda_graphs.json"
    on_file = {"device": "NVIDIA H200", "models": checked, "complete": True}
    graphs_file.write_text(json.dumps(on_file))
    # A file of the first check (no agreement_revision) is measured again, and trusted for none.
    assert gs.graphed(s) == [] and gs.cuda_graphs_skip(s) is None
    graphs_file.write_text(json.dumps({**on_file,
                                       "agreement_revision": bench.AGREEMENT_REVISION}))
    assert gs.cuda_graphs_skip(s) == "on file for the NVIDIA H200 (the same chip)"
    assert gs.graphed(s) == ["qanet", "ea_reader"]
    assert "--graphed=qanet,ea_reader" in gs.train_argv(s, 300)
    # The compile steps run while the recorded step does not replay all of their readers.
    compiling = [step for step in gs.STEPS if step.name in ("graphs", "compile_whole",
                                                            "compile", "compile_ro")]
    assert [step.skip(s) for step in compiling] == [None] * 4
    graphs_file.write_text(json.dumps({"agreement_revision": bench.AGREEMENT_REVISION,
                                       "models": {name: entry(110.0, agreement=0.0)
                                                  for name in ("qanet", "dynsan", "phasecond")}}))
    assert {step.skip(s) for step in compiling} == {
        "the recorded eager step replays these readers (cuda_graphs)"}


def test_import_keeps_a_partial_run_as_the_next_sessions_carry_over(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "BOOK_RUNS", tmp_path / "book" / "runs")
    gpu, out = tmp_path / "gpu", tmp_path / "out"
    run = gpu / "ch" / "r"
    run.mkdir(parents=True)
    (gpu / "ch" / "done").mkdir(parents=True)  # a finished run: its status is in "records"
    (gpu / "ch" / "done" / "status.json").write_text(json.dumps({"complete": True}))
    (run / "status.json").write_text(json.dumps({"complete": False}))
    (run / "checkpoint.pt").write_bytes(b"weights")
    gs.queue.pack(gpu, out / "b1")
    (tmp_path / "session.json").write_text(json.dumps(
        {"device": "GPU", "started": "now", "steps": [{"step": "train", "state": "done"}]}))
    with tarfile.open(out / "session.tar", "w") as tar:
        tar.add(tmp_path / "session.json", arcname="session.json")
    inbox, staged = tmp_path / "inbox", tmp_path / "staged"
    staged.mkdir()  # the carry-over this session was sent: spent once bundles come back
    lines = gs.main(["import", str(out), "--keep", str(tmp_path / "keep"),
                     f"--results={tmp_path}", f"--runner={tmp_path / 'here'}",
                     f"--inbox={inbox}", f"--staged={staged}"])
    assert not staged.exists()
    assert lines[1] == "  train: done" and lines[-2].startswith("carry-over")
    assert (tmp_path / "here" / "ch" / "r" / "checkpoint.pt").read_bytes() == b"weights"
    back = tmp_path / "back"
    gs.queue.unpack([inbox / "b1"], back)  # what the next session starts from
    assert (back / "ch" / "r" / "checkpoint.pt").read_bytes() == b"weights"
    # The records are in book/runs, which travels with the tree: not again in the inbox.
    listing = json.loads((inbox / "b1" / "queue.json").read_text())
    assert [unit["unit"] for unit in listing["units"]] == ["ch/r"]
    # The next prepare moves it out of the tree; the next command restores it from there.
    args = Namespace(inbox=inbox, staged=staged)
    assert gs.carried(args) == inbox
    gs.stage(inbox, staged)
    assert gs.carried(args) == staged and not inbox.exists()
    assert gs.queue.restore(tmp_path / "next", gs.carried(args), log=lambda line: None)
    assert (tmp_path / "next" / "ch" / "r" / "checkpoint.pt").read_bytes() == b"weights"


def test_a_partial_run_too_large_to_carry_on_stays_on_the_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(gs.queue, "PIECE_BYTES", 20_000)
    runner = tmp_path / "runner"
    for name, size in (("small", 10_000), ("large", 60_000)):
        (runner / "ch" / name).mkdir(parents=True)
        (runner / "ch" / name / "status.json").write_text(json.dumps({"complete": False}))
        (runner / "ch" / name / "checkpoint.pt").write_bytes(bytes(size))
    s = session(tmp_path / "w", runner=runner)
    s.carry = 40_000 / 2**20
    assert gs.pack_out(s, tmp_path / "out") == ["ch/large stays here: over the "
                                                 f"{s.carry:g} MiB carried on"]
    back = tmp_path / "back"
    assert gs.queue.unpack([tmp_path / "out" / "b1"], back)[1] == []  # not sent at all
    assert not (back / "ch" / "large").exists()
    assert (back / "ch" / "small" / "checkpoint.pt").stat().st_size == 10_000
    with tarfile.open(tmp_path / "out" / "session.tar") as tar:
        assert json.load(tar.extractfile("session.json"))["notes"] == [
            f"ch/large stays here: over the {s.carry:g} MiB carried on"]


def test_a_carry_over_of_two_bundles_comes_back_in_two_calls_and_goes_on_in_two(
        tmp_path, monkeypatch):
    """A partial run larger than one call's carry-over (PhaseCond's checkpoint, 96 MiB) comes
    back in bundles: the command sends bundle 1 and names the others, ``send`` writes each in a
    call of its own, ``import`` takes the replies together and commits the carry-over as two
    bundles, which the next session carries in two calls. A run that does not come back whole
    goes on from the carry-over it was sent with."""
    monkeypatch.setattr(gs.queue, "PIECE_BYTES", 20_000)
    monkeypatch.setattr(records, "BOOK_RUNS", tmp_path / "book" / "runs")
    runner = tmp_path / "runner"
    for name, size in (("small", 10_000), ("large", 50_000)):
        (runner / "ch" / name).mkdir(parents=True)
        (runner / "ch" / name / "status.json").write_text(json.dumps({"complete": False}))
        (runner / "ch" / name / "checkpoint.pt").write_bytes(bytes([len(name)]) * size)
    s = session(tmp_path / "w", runner=runner)
    s.carry, s.bundles = 50_000 / 2**20, 2  # tar pads each unit to 10 KiB
    first, second = tmp_path / "reply1", tmp_path / "reply2"
    notes = gs.pack_out(s, first)
    assert notes == ["the carry-over fills 2 bundles: send the others back, each in a call "
                     "of its own: " + gs.SEND.format(k=2)]
    assert sorted(p.name for p in first.iterdir()) == ["b1", "session.tar"]
    common = [f"--runner={runner}", f"--work={s.work}"]
    files = gs.main(["send", "--bundle", "2", "--out", str(second), *common])
    assert files[0].parent == second / "b2" and sum(f.stat().st_size for f in files) < 51_000
    with pytest.raises(SystemExit):  # no third bundle
        gs.main(["send", "--bundle", "3", "--out", str(tmp_path / "reply3"), *common])

    inbox, staged = tmp_path / "inbox", tmp_path / "staged"
    imported = ["--results", str(tmp_path), f"--inbox={inbox}", f"--staged={staged}",
                "--queue-file", str(write_queue(tmp_path, {"tq": []}))]
    with pytest.raises(SystemExit):  # two commands' replies are imported one by one
        gs.main(["import", str(first), str(first), *imported])
    lines = gs.main(["import", str(first), str(second), "--keep", str(tmp_path / "k1"),
                     f"--runner={tmp_path / 'here'}", *imported])
    assert f"carry-over {inbox} (2 bundle(s)): commit it" in lines
    assert [p.name for p in gs.queue.bundles_in(inbox)] == ["b1", "b2"]
    gs.stage(inbox, staged)  # the next session: the data, then a call per bundle
    assert gs.calls_for(tmp_path / "t.tar.xz", 0.5, staged, 64 - 0.56) == [
        [str(tmp_path / "t.tar.xz"), str(tmp_path / "travel.json"), str(staged / "b1")],
        [str(staged / "b2")]]
    assert gs.queue.restore(tmp_path / "next", staged, log=lambda line: None)
    assert (tmp_path / "next" / "ch" / "large" / "checkpoint.pt").read_bytes() == \
        bytes([5]) * 50_000

    # That session's runs go on, but only its first reply comes back: the large run, in
    # both bundles, goes on from what was sent, on a CPU side that never held it.
    (runner / "ch" / "large" / "checkpoint.pt").write_bytes(b"newer" * 10_000)
    gs.pack_out(s, tmp_path / "reply4")
    lines = gs.main(["import", str(tmp_path / "reply4"), "--keep", str(tmp_path / "k2"),
                     f"--runner={tmp_path / 'fresh'}", *imported])
    assert "not brought back: ch/large" in lines and not staged.exists()
    back = tmp_path / "again"
    gs.queue.unpack(gs.queue.bundles_in(inbox), back)
    assert (back / "ch" / "large" / "checkpoint.pt").read_bytes() == bytes([5]) * 50_000


def test_session_tar_comes_back_when_packing_the_runner_fails(tmp_path):
    runner = tmp_path / "runner" / "ch" / "r"
    runner.mkdir(parents=True)
    (runner / "status.json").write_text("{")  # a worker killed mid-write, say
    s = session(tmp_path / "w", runner=runner.parent.parent)
    notes = gs.pack_out(s, tmp_path / "out")
    assert len(notes) == 1 and notes[0].startswith("packing the runner folder failed: ")
    assert (tmp_path / "out" / "session.tar").is_file()


def test_plan_gives_each_queue_run_its_checkpoint_data_and_fate(mirror, tmp_path, capsys):
    """``plan`` on a tiny queue: a run within a command, one that resumes from session to
    session, one whose checkpoint outgrows the carry-over; and the committed plan of the
    book's queue, one entry per run, which ``queue`` shows."""
    q = write_queue(tmp_path, {"tq": [
        {"run": run, "model": "bidaf", "priority": 1, "minutes": minutes, "schedule": "tiny",
         "overrides": TINY + hidden} for run, minutes, hidden in (
            ("short", 4, []), ("long", 20, []), ("wide", 20, ["hparams.hidden=320"]))]})
    out = tmp_path / "plan.json"
    result = gs.main(["plan", "--queue-file", q, "--plan", str(out),
                      f"--work={tmp_path / 'work'}"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    runs = result["runs"]
    assert {k: v["fate"] for k, v in runs.items()} == {"tq/short": "command",
                                                      "tq/long": "carried",
                                                      "tq/wide": "stranded"}
    carry = runs["tq/long"]["carry_mib"]
    tree = gs.tree_mib(gs.INBOX, gs.COMPILE_CACHE)  # 64 MiB less the tree and what the import adds
    assert result["bundles"] == gs.CARRY_BUNDLES  # of what one call carries beside the tree
    assert 1 < carry and abs(carry - gs.CARRY_BUNDLES * gs.carry_mib(tree)) < 0.11
    # (one 0.1 MiB step of the floor apart at most: the other worker's tests write files)
    assert runs["tq/long"]["checkpoint_mib"] < carry < runs["tq/wide"]["checkpoint_mib"]
    # Twenty minutes span three commands: a run's checkpoint is committed after two of them.
    assert runs["tq/short"]["history_mib"] == 0
    assert runs["tq/long"]["history_mib"] == pytest.approx(
        2 * runs["tq/long"]["checkpoint_mib"], abs=0.1)
    assert result["chapters"]["tq"].pop("history_mib") == pytest.approx(
        runs["tq/long"]["history_mib"] + runs["tq/wide"]["history_mib"], abs=0.1)
    assert result["chapters"]["tq"] == {"runs": 3, "minutes": 44, "command": 1,
                                        "command_minutes": 4, "carried": 1,
                                        "carried_minutes": 20, "stranded": 1,
                                        "stranded_minutes": 20}
    table = gs.queue.status_table(gs.queue.load_queue(q), None, "full", plan=out)
    assert "stranded  tq/wide" in table and table.splitlines()[-2].startswith("1 stranded (20")
    history = sum(run["history_mib"] for run in runs.values()) / 1024  # nothing is done yet
    assert table.splitlines()[-1].endswith(f"about {history:.1f} GiB to the history")

    committed = json.loads(gs.queue.PLAN.read_text())
    assert set(committed["runs"]) == {j.key for j in gs.queue.load_queue()}
    assert committed["command_minutes"] == gs.queue.COMMAND_MINUTES
    assert (committed["travel_mib"], committed["growth_mib"]) == (gs.TRAVEL_MIB, gs.GROWTH_MIB)
    # Made with today's tree, give or take a session's records: rerun plan after an import.
    assert abs(committed["tree_mib"] - tree) < gs.GROWTH_MIB


def test_the_data_file_holds_the_files_loading_reads_and_the_texts_evaluation_reads(
        squad2_mirror, tmp_path, monkeypatch):
    """ABA's SQuAD 2.0 reads only the vocabulary of the prepared SQuAD v1.1 it is encoded
    with, so only that part of its folder travels; the SQuAD 2.0 folder's training texts stay
    behind; and the file alone loads on a machine without raw data."""
    q = write_queue(tmp_path, {"tq": [{"run": "aba", "model": "bidafpp",
                                       "dataset": "squad-v2.0", "priority": 1, "minutes": 1,
                                       "schedule": "tiny"}]})
    travel = tmp_path / "travel.tar.xz"
    gs.write_travel(gs.queue.load_queue(q), travel, log=lambda line: None)
    with tarfile.open(travel) as tar:
        names = {tuple(n.split("/")[1:]) for n in tar.getnames()}
    v11 = {name for folder, name in names if folder.startswith("squad-v1.1")}
    v2 = {name for folder, name in names if folder.startswith("squad-v2.0")}
    assert v11 == {"meta.json", "vocab.json", "vectors.npy"}
    assert {"adapt.json.gz", "eval.json.gz", "train.npz", "meta.json"} <= v2
    assert "train.json.gz" not in v2

    from mrc_lib.data.squad2 import load_squad2

    with tarfile.open(travel) as tar:
        tar.extractall(tmp_path / "carried", filter="data")
    monkeypatch.setenv("MRC_DATA_DIR", str(tmp_path / "nothing"))
    monkeypatch.setenv("MRC_CACHE_DIR", str(tmp_path / "carried"))
    data = load_squad2(context_limit=None)
    assert len(data.eval) == 8 and data.eval.text["titles"]  # evaluation reads its texts


def test_the_data_file_stores_deflated_members_for_xz_to_pack(tmp_path):
    """A cache's ``.npz`` and ``.gz`` files travel with their members stored, not deflated:
    the same arrays and text, read the same way, and smaller under xz."""
    import gzip
    import io
    import lzma
    import zipfile

    import numpy as np

    rng = np.random.default_rng(0)
    arrays = {"ids": rng.zipf(1.3, 50_000).astype(np.int32) % 5000,
              "strings": np.array(["a", "bb", "ccc"], dtype=object)}
    np.savez_compressed(tmp_path / "split.npz", **arrays)
    text = " ".join(f"word{k % 997}" for k in range(50_000))
    (tmp_path / "split.json.gz").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "vectors.npy").write_bytes(b"\x93NUMPY as it is")

    blob = gs.stored(tmp_path / "split.npz")
    assert {m.compress_type for m in zipfile.ZipFile(io.BytesIO(blob)).infolist()} == {
        zipfile.ZIP_STORED}
    with np.load(io.BytesIO(blob), allow_pickle=True) as carried:
        assert np.array_equal(carried["ids"], arrays["ids"])
        assert list(carried["strings"]) == ["a", "bb", "ccc"]
    assert len(lzma.compress(blob)) < len(lzma.compress((tmp_path / "split.npz").read_bytes()))
    assert gzip.decompress(gs.stored(tmp_path / "split.json.gz")).decode() == text
    assert gs.stored(tmp_path / "vectors.npy") == b"\x93NUMPY as it is"


def test_new_compile_artifacts_go_back_compressed_within_their_room_and_into_the_tree(
        tmp_path, monkeypatch):
    """The artifacts a session's workers wrote anew (not those it was sent) go back in
    session.tar, xz-compressed, while they fit CACHE_BACK_MIB; import puts the staged cache back
    in the tree with them, keeping a file of the same name that is there."""
    s = session(tmp_path / "w")
    s.device = "NVIDIA H200"
    folder = s.work / "compile_cache"
    folder.mkdir()
    for name, blob in (("old-1.bin", b"sent"), ("new-1.bin", b"a" * 4096),
                       ("new-2.bin", bytes(range(256)) * 64)):
        (folder / name).write_bytes(blob)
    s.seeded.add("old-1.bin")
    monkeypatch.setattr(gs, "CACHE_BACK_MIB", (len(lzma.compress(b"a" * 4096)) + 1) / 2**20)
    members, notes = gs.compile_cache_back(s)
    assert [name for name, _ in members] == ["compile_cache/nvidia_h200/new-1.bin.xz"]
    assert lzma.decompress(members[0][1]) == b"a" * 4096
    assert notes[0].startswith("compile cache new-1.bin: ") and notes[0].endswith("sent back")
    assert notes[1].startswith("compile cache new-2.bin stays here")

    gs.pack_out(s, tmp_path / "out")
    with tarfile.open(tmp_path / "out" / "session.tar") as tar:
        tar.extractall(tmp_path / "back", filter="data")
    cache, staged = tmp_path / "tree", tmp_path / "staged"
    (staged / "nvidia_h200").mkdir(parents=True)
    (staged / "nvidia_h200" / "new-1.bin.xz").write_bytes(b"committed")
    lines = gs.import_compile_cache(tmp_path / "back" / "compile_cache", cache, staged)
    assert lines == [] and not staged.exists()  # the one on file stays
    assert (cache / "nvidia_h200" / "new-1.bin.xz").read_bytes() == b"committed"
    (cache / "nvidia_h200" / "new-1.bin.xz").unlink()
    lines = gs.import_compile_cache(tmp_path / "back" / "compile_cache", cache, staged)
    assert lines == [f"compile cache {cache / 'nvidia_h200' / 'new-1.bin.xz'}: commit it"]


def test_a_second_command_on_the_warm_machine_reads_what_the_first_measured(tmp_path):
    work = tmp_path / "session"
    gs.fresh_work(work)
    (work / "results" / "gpu_x_cuda_graphs.json").write_text("{}")
    (work / "logs" / "train.log").write_text("first")
    (work / "session.json").write_text("{}")
    (work / "cache").mkdir()
    assert gs.fresh_work(work) == work
    assert sorted(p.relative_to(work).as_posix() for p in work.rglob("*")) == [
        "logs", "results", "results/gpu_x_cuda_graphs.json"]
