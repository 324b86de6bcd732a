"""Measurements as run records: made once (on a GPU), read by every later execution of the
chapter at the full profile, carried by the queue's pack and import like training records."""

from __future__ import annotations

import json

import pytest
import torch

from mrc_lib import comparison, measurements, notebook, queue, records, rehearsal, scaling
from mrc_lib.cli import main
from mrc_lib.errors import UserError


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A registry of one measurement, ``ch/speed``, whose spec follows ``size`` and whose
    method counts its calls; ``book/runs`` under ``tmp_path``."""
    calls, size = [], {"value": 2}

    def method(spec, device):
        calls.append(device)
        return {"examples_per_s": 10.0 * spec["size"], "device": device}

    m = measurements.Measurement("ch", "speed", lambda profile: {"size": size["value"],
                                                                 "profile": profile}, method)
    monkeypatch.setattr(measurements, "registry", lambda: {m.key: m})
    monkeypatch.setattr(records, "BOOK_RUNS", tmp_path / "book" / "runs")
    monkeypatch.setattr(records, "ROOT", tmp_path)
    return m, calls, size


def run_at(tmp_path, profile, **kw) -> notebook.Run:
    return notebook.Run(profile, 0, torch.device("cpu"), tmp_path / "runs" / "ch" / profile,
                        chapter="ch", **kw)


def test_a_measurement_record_says_what_where_and_with_what(fake):
    m, calls, _ = fake
    record = measurements.make(m, "full", "cpu")
    assert record["kind"] == "measurement" and (record["chapter"], record["run"]) == ("ch",
                                                                                      "speed")
    assert record["spec"] == {"size": 2, "profile": "full"}
    assert record["spec_hash"] == measurements.spec_hash(record["spec"])
    assert record["device_type"] == "cpu" and record["torch"] == torch.__version__
    assert record["result"] == {"examples_per_s": 20.0, "device": "cpu"} and calls == ["cpu"]


def test_full_measures_once_then_reads_its_record(tmp_path, fake):
    m, calls, size = fake
    first = run_at(tmp_path, "full").measure("speed")
    path = records.record_path("ch", "speed")
    assert path.is_file() and records.read_record(path) == first and len(calls) == 1
    again = run_at(tmp_path, "full")
    assert again.measure("speed") == first and len(calls) == 1  # read, not measured
    assert again.runs["speed"]["record"] == "book/runs/ch/speed.json"
    assert again.runs["speed"]["provenance"].startswith("measured on ")
    run_at(tmp_path, "full", retrain=True).measure("speed")
    assert len(calls) == 2  # --retrain measures again
    size["value"] = 3  # another spec (a reader changed): the record is stale
    with pytest.raises(UserError, match=r"ch/speed.json: a measurement of spec [0-9a-f]{16}, "
                                        r"not [0-9a-f]{16}; measurement 'speed' would run"):
        run_at(tmp_path, "full", records_only=True).measure("speed")
    assert run_at(tmp_path, "full").measure("speed")["result"]["examples_per_s"] == 30.0


def test_smoke_always_measures_into_the_run_folder(tmp_path, fake):
    _, calls, _ = fake
    run = run_at(tmp_path, "smoke")
    record = run.measure("speed")
    assert (run.out_dir / "speed" / "record.json").is_file() and record["profile"] == "smoke"
    run_at(tmp_path, "smoke").measure("speed")
    assert len(calls) == 2 and not records.BOOK_RUNS.exists()


def test_a_cpu_measurement_is_never_read_on_a_gpu(tmp_path, fake):
    m, _, _ = fake
    path = records.write_record(tmp_path / "speed.json", measurements.make(m, "full", "cpu"))
    spec = m.spec("full")
    assert measurements.match(path, spec, "cpu")[0] is not None
    found, why = measurements.match(path, spec, "cuda")
    assert found is None and why.startswith("measured on a CPU")
    gpu = {**records.read_record(path), "device": "NVIDIA H100", "device_type": "cuda"}
    records.write_record(path, gpu)
    assert measurements.match(path, spec, "cpu")[0] == gpu  # a GPU's is read anywhere
    assert measurements.match(tmp_path / "none.json", spec, "cpu") == (None, "no record")


def test_a_corrupt_measurement_is_a_one_line_error(tmp_path):
    path = tmp_path / "speed.json"
    path.write_text(json.dumps({"schema": 1, "kind": "measurement", "chapter": "ch"}))
    with pytest.raises(UserError, match=r"speed.json: corrupt run record: missing run, profile"):
        records.read_record(path)
    path.write_text("[1]")
    with pytest.raises(UserError, match="not a JSON object"):
        records.read_record(path)


def test_the_command_measures_into_the_runner_folder_and_queue_import_brings_it(
        tmp_path, fake, capsys):
    _, calls, _ = fake
    out = tmp_path / "queue"
    assert main(["measure", "--out", str(out), "--device", "cpu"]) == 0
    made = out / "records" / "ch" / "speed.json"
    assert made.is_file() and len(calls) == 1
    assert main(["measure", "--out", str(out), "--device", "cpu"]) == 0
    assert len(calls) == 1 and "measured on" in capsys.readouterr().out.splitlines()[-1]
    cpu_only = f"cpu only ({made_device(made)}) measurement ch/speed"
    assert measurements.state_lines(out) == [cpu_only]
    gpu = {**records.read_record(made), "device": "NVIDIA H100", "device_type": "cuda"}
    records.write_record(records.record_path("ch", "speed"), gpu)  # a GPU's, in book/runs
    assert measurements.state_lines(out) == ["done (NVIDIA H100) measurement ch/speed"]
    assert measurements.state_lines(None) == ["done (NVIDIA H100) measurement ch/speed"]
    records.record_path("ch", "speed").unlink()
    assert measurements.state_lines(None) == ["missing   measurement ch/speed"]
    assert queue.import_records(out) == [records.record_path("ch", "speed")]
    assert main(["measure", "--only", "nothing/*"]) == 2
    assert "no measurement matches" in capsys.readouterr().err


def made_device(path) -> str:
    return json.loads(path.read_text())["device"]


def test_rehearsal_stands_a_smoke_measurement_in_for_the_full_one(tmp_path, fake):
    m, _, _ = fake
    runs = tmp_path / "runs"
    with pytest.raises(UserError, match="no smoke record of measurement ch/speed.*reproduce ch "
                                        "--profile smoke"):
        rehearsal.measurement_standin(m, runs)
    run_at(tmp_path, "smoke").measure("speed")
    standin = rehearsal.measurement_standin(m, runs)
    path = records.write_record(tmp_path / "standin.json", standin)
    found = measurements.match(path, m.spec("full"), "cpu")[0]
    assert found["standin"] and found["device"] == rehearsal.STANDIN_DEVICE
    assert found["result"] == records.read_record(runs / "ch" / "smoke" / "speed" /
                                                  "record.json")["result"]
    assert rehearsal.smoke_records(runs) == {}  # a measurement is no training run's source


def test_chapter_07_specs_name_every_span_reader_and_its_hyperparameters():
    readers, _ = comparison.span_readers("smoke")
    for spec_of, protocols in ((comparison.speed_spec, comparison.SPEED),
                               (comparison.context_length_spec, comparison.CONTEXT_LENGTH)):
        spec = spec_of("smoke")
        assert list(spec["readers"]) == readers and spec["protocol"] == protocols["smoke"]
        assert spec_of("full")["readers"]["bidaf"] != spec["readers"]["bidaf"]
        assert spec_of("full")["readers"]["bidaf"] == comparison.reader_key("bidaf", "full")


def test_chapter_07_measures_its_readers_and_the_context_sweep():
    readers = {"size": "smoke", "readers": {"bidaf": "k"}}
    speed = comparison.measure_speed(
        {**readers, "protocol": {**comparison.SPEED["smoke"], "seq_len": 16}}, "cpu")
    assert set(speed["readers"]) == {"bidaf"} and speed["readers"]["bidaf"]["seq_len"] == 16
    sweep = {**readers, "protocol": {**comparison.CONTEXT_LENGTH["smoke"], "lengths": [16, 32]}}
    result = comparison.measure_context_length(sweep, "cpu")
    assert [(r["reader"], r["length"]) for r in result["sweep"]] == [("bidaf", 16), ("bidaf", 32)]
    assert result["notes"] == []
    sweep["protocol"]["step_limit"] = 0  # every step is over the limit: no longer length
    stopped = comparison.measure_context_length(sweep, "cpu")
    assert [r["length"] for r in stopped["sweep"]] == [16]


def test_every_measurement_of_the_book_has_a_json_spec_at_both_profiles():
    for m in measurements.registry().values():
        for profile in ("smoke", "full"):
            spec = m.spec(profile)
            assert spec == json.loads(json.dumps(spec)), m.key
        assert m.spec("smoke") != m.spec("full"), m.key


def test_chapter_02_measures_each_table_4_reader_its_own_way():
    spec = scaling.table4_spec("smoke")
    assert list(spec["rows"]) == list(scaling.TABLE4_SPEED_ROWS)
    rows = spec["rows"]
    assert rows["Full SAN (SDPA)"]["hparams"] == rows["Full SAN (materialized L×L)"]["hparams"]
    assert rows["Full SAN (materialized L×L)"]["materialize"]
    assert rows["Bi-BloSAN"]["hparams"]["conv"] is False
    assert rows["DynSAN (K = 32)"]["hparams"]["top_k"] == 32
    tiny = {**spec, "length": 24, "batch_size": 2,
            "rows": {k: rows[k] for k in ("Bi-LSTM", "Full SAN (materialized L×L)")}}
    result = scaling.measure_table4(tiny, "cpu")
    assert list(result) == ["Bi-LSTM", "Full SAN (materialized L×L)"]
    assert all(r["seconds_per_step"] > 0 and r["length"] == 24 for r in result.values())


def test_a_failing_measurement_is_named_and_the_others_still_run(tmp_path, fake, monkeypatch,
                                                                 capsys):
    m, calls, _ = fake

    def broken(spec, device):
        raise RuntimeError("CUDA out of memory\nmore")

    bad = measurements.Measurement("ch", "broken", m.spec, broken)
    monkeypatch.setattr(measurements, "registry", lambda: {bad.key: bad, m.key: m})
    assert main(["measure", "--out", str(tmp_path / "q"), "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert "ch/broken: FAILED: RuntimeError: CUDA out of memory" in out
    assert (tmp_path / "q" / "records" / "ch" / "speed.json").is_file() and len(calls) == 1
    assert "1 measurement(s) failed: ch/broken" in err
