"""Run records: written by every run, compact, atomic, checked; read instead of training at the
full profile when the config and the data are the same."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from mrc_lib import notebook, records
from mrc_lib import train as engine
from mrc_lib.config import resolve_config
from mrc_lib.errors import UserError
from mrc_lib.models import effective_hparams
from tests.test_train import toy_config, toy_data


@pytest.fixture(scope="module")
def data():
    return toy_data()


def notebook_run(tmp_path, profile, monkeypatch, **kw) -> notebook.Run:
    monkeypatch.setattr(records, "BOOK_RUNS", tmp_path / "book" / "runs")
    monkeypatch.setattr(records, "ROOT", tmp_path)
    return notebook.Run(profile, 0, torch.device("cpu"), tmp_path / "runs" / "ch" / profile,
                        chapter="ch", **kw)


def test_a_record_is_the_metrics_without_predictions_plus_provenance(tmp_path, data):
    metrics = engine.train(toy_config(), tmp_path / "run", data=data)
    record = records.make_record(metrics, chapter="ch", run="toy")
    path = records.write_record(tmp_path / "toy.json", record)
    back = records.read_record(path)
    assert back == json.loads(json.dumps(record))
    assert back["config_hash"] == records.config_hash(toy_config().to_dict())
    assert back["examples_per_second"] > 0 and back["wall_seconds"] > 0
    assert back["complete"] and back["cuda"] == torch.version.cuda
    assert back["device_type"] == "cpu" and records.precision(back) == "fp32"
    assert back["rnn_precision"] is None  # the toy reader has no RNN
    assert {"history", "dev", "device", "torch", "git_commit", "peak_memory_bytes",
            "data_digests", "config", "seconds_per_epoch"} <= set(back)
    assert "predictions" not in json.dumps(back) and path.stat().st_size < 20_000
    # The record names every hyperparameter the reader was built with, defaults included.
    assert back["config"]["hparams"] == effective_hparams(toy_config().to_dict())


def test_provenance_names_the_precision_a_run_computed_in():
    """bf16 autocast needs CUDA: a full-profile record trained on a CPU (same config hash)
    computed in fp32, and its provenance says so."""
    config = {"bf16": True, "batch_size": 32, "optimizer": "adam"}
    gpu = {"device": "NVIDIA H200", "cuda": "13.0", "epochs_run": 10, "profile": "full",
           "config": config}
    cpu = {**gpu, "device": "AMD EPYC", "cuda": None}
    assert records.precision(gpu) == "bf16" and records.precision(cpu) == "fp32"
    assert records.precision({**gpu, "config": {**config, "bf16": False}}) == "TF32"
    assert records.provenance(cpu).startswith("AMD EPYC (fp32), 10 epoch(s) of batch 32")
    # A CPU run of a torch built with CUDA: its device type says where it ran.
    assert records.precision({**gpu, "device": "AMD EPYC", "device_type": "cpu"}) == "fp32"
    assert records.precision({**gpu, "device_type": "cuda"}) == "bf16"
    # A bf16 reader's RNN layers: in full precision (the record says so), or, in a record
    # older than rnn_precision, in fp16, as torch's autocast ran cuDNN RNNs; QANet has none.
    ea = {**gpu, "config": {**config, "model": "ea_reader", "hparams": {}}}
    assert records.precision(ea) == "bf16, RNNs fp16"
    assert records.precision({**ea, "rnn_precision": "TF32"}) == "bf16, RNNs TF32"
    assert records.precision({**ea, "config": {**ea["config"], "model": "qanet"}}) == "bf16"
    assert records.precision({**ea, "rnn_precision": None}) == "bf16"


def test_a_run_trained_on_several_devices_names_each_with_its_steps():
    """The sessions of a run (mrc_lib.train.Progress.sessions) that trained on more than one
    device: each device and precision with the steps it took, consecutive sessions on the same
    one joined, a session that took no step left out; one device reads as before."""
    config = {"bf16": True, "batch_size": 32, "optimizer": "adam"}
    h200 = {"device": "NVIDIA H200", "device_type": "cuda", "rnn_precision": None}
    xeon = {"device": "Intel Xeon", "device_type": "cpu", "rnn_precision": None}
    record = {**h200, "steps": 3000, "config": config, "epochs_run": 2, "profile": "full",
              "sessions": [{"step": 0, **h200}, {"step": 900, **h200}, {"step": 1854, **xeon},
                           {"step": 2000, **xeon}, {"step": 3000, **h200}]}
    assert records.trained_on(record) == \
        "NVIDIA H200 (bf16) for steps 1-1854 and Intel Xeon (fp32) for steps 1855-3000"
    assert records.provenance(record).startswith(records.trained_on(record) + ", 2 epoch(s)")
    old = {**record, "sessions": [{"step": 0, "device": None}, {"step": 1854, **xeon}]}
    assert records.trained_on(old) == \
        "an unrecorded device for steps 1-1854 and Intel Xeon (fp32) for steps 1855-3000"
    one = {**record, "sessions": [{"step": 0, **xeon}, {"step": 10, **xeon}]}
    assert records.trained_on(one) == "Intel Xeon (fp32)"
    before = {k: v for k, v in record.items() if k != "sessions"}  # a record older than them
    assert records.trained_on(before) == "NVIDIA H200 (bf16)"


def test_a_record_keeps_each_list_of_plain_values_on_one_line(tmp_path):
    """Records travel to every GPU session with the tree: a row of an attention map is one
    line, not one line per number; the JSON is the same."""
    record = {"dev": {"f1": 71.25}, "analysis": {"tokens": ["a", "(", "]"],
                                                 "map": [[0.125, 0.5], [1, 2]], "empty": {}},
              "loss_curve": [], "runs": [{"seed": 0}]}
    text = records.write_record(tmp_path / "r.json", record).read_text()
    assert json.loads(text) == record
    assert '  "tokens": ["a", "(", "]"],\n' in text and '   [0.125, 0.5],\n' in text
    assert '"empty": {}' in text and '"loss_curve": [],' in text
    assert len(text) < len(json.dumps(record, indent=1))


def test_the_hash_ignores_where_and_how_often_a_run_is_checkpointed():
    base = toy_config().to_dict()
    same = {**base, "device": "cuda", "checkpoint_every": 7, "eval_batch_size": 9}
    assert records.config_hash(same) == records.config_hash(base)
    assert records.config_hash({**base, "lr": 0.1}) != records.config_hash(base)


def test_the_hash_covers_the_readers_defaults(monkeypatch):
    """Naming a default leaves the hash alone; changing a reader's default changes it, so a
    record of a run built with the old default no longer matches."""
    from mrc_lib import models

    cfg = resolve_config("bidaf", profile="full").to_dict()
    named = {**cfg, "hparams": {**cfg["hparams"], "locked_dropout": False}}
    assert records.config_hash(named) == records.config_hash(cfg)
    before, defaults = records.config_hash(cfg), models.hparam_defaults("bidaf")
    monkeypatch.setattr(models, "hparam_defaults",
                        lambda name: {**defaults, "locked_dropout": True})
    assert records.config_hash(cfg) != before


def test_writes_are_atomic_and_oversized_records_refused(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    good = {k: 1 for k in records.REQUIRED}
    records.write_record(path, good)
    before = path.read_bytes()
    with pytest.raises(UserError, match="over 1000000"):
        records.write_record(path, {**good, "analysis": "x" * records.MAX_BYTES})
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["r.json"]
    # readable as a file written by open(), not owner-only as mkstemp's temporary file
    mask = os.umask(0o022)
    try:
        records.write_record(path, good)
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
    finally:
        os.umask(mask)
    before = path.read_bytes()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("mrc_lib.utils.os.replace", broken)
    with pytest.raises(OSError):
        records.write_record(path, {**good, "dev": 2})
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_a_record_of_another_config_is_kept_not_lost(tmp_path):
    path = records.record_path("ch", "bidaf", tmp_path)
    first = {**{k: 1 for k in records.REQUIRED}, "config_hash": "a" * 16,
             "history": [{"epoch": 1, "dev": {"f1": 70.0}}]}
    records.write_record(path, first)
    written = path.read_bytes()
    records.write_record(path, {**first, "steps": 2})  # the same config goes on: replaced
    assert not (path.parent / records.EARLIER).exists()
    records.write_record(path, first)
    second = {**first, "config_hash": "b" * 16, "history": []}
    records.write_record(path, second)  # another config: the first is kept, byte for byte
    kept = path.parent / records.EARLIER / f"bidaf.{'a' * 16}.json"
    assert kept.read_bytes() == written
    assert records.read_record(path)["config_hash"] == "b" * 16
    assert records.earlier("ch", "bidaf", tmp_path) == [first]
    assert records.earlier("ch", "bid", tmp_path) == []
    # A record without an epoch, a measurement and a corrupt file are replaced, not kept.
    records.write_record(path, {**second, "config_hash": "c" * 16})
    measurement = {k: 1 for k in records.MEASUREMENT_REQUIRED} | {"kind": records.MEASUREMENT}
    records.write_record(path, measurement)
    path.write_text("{not json")
    records.write_record(path, first)
    assert sorted(p.name for p in kept.parent.iterdir()) == [kept.name]
    # A run in a folder of its chapter (EA Reader's NE/...) keeps its records beside it.
    nested = records.record_path("ch", "NE/r", tmp_path)
    records.write_record(nested, first)
    records.write_record(nested, second)
    assert records.is_earlier(nested.parent / records.EARLIER / f"r.{'a' * 16}.json")
    assert records.earlier("ch", "NE/r", tmp_path) == [first]


@pytest.mark.parametrize("text, message", [("{not json", "corrupt run record"),
                                           ('{"schema": 1}', "missing chapter")])
def test_a_corrupt_record_is_a_one_line_error_naming_the_file(tmp_path, text, message):
    path = tmp_path / "r.json"
    path.write_text(text)
    with pytest.raises(UserError, match=message) as e:
        records.read_record(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_smoke_trains_and_writes_the_record_in_the_run_folder(tmp_path, data, monkeypatch):
    run = notebook_run(tmp_path, "smoke", monkeypatch)
    metrics = run.train("toy", toy_config(), data)
    path = run.out_dir / "toy" / "record.json"
    assert records.read_record(path)["dev"] == metrics["dev"]
    assert metrics["loss_curve"][-1][0] == metrics["steps"] == 8
    assert not (tmp_path / "book").exists()
    again = run.train("toy", toy_config(), data)  # the finished run is resumed, not retrained
    assert again["dev"] == metrics["dev"] and again["steps"] == metrics["steps"]


def test_full_reads_a_matching_record_and_retrains_on_request(tmp_path, data, monkeypatch):
    cfg = toy_config(profile="full")
    run = notebook_run(tmp_path, "full", monkeypatch)
    trained = run.train("toy", cfg, data)
    path = tmp_path / "book" / "runs" / "ch" / "toy.json"
    assert records.read_record(path)["dev"] == trained["dev"]
    assert run.runs["toy"]["trained"]

    def no_training(*args, **kwargs):
        raise AssertionError("trained although a matching record exists")

    monkeypatch.setattr(engine, "train", no_training)
    again = notebook_run(tmp_path, "full", monkeypatch)
    read = again.train("toy", cfg, data)
    assert read == records.read_record(path)
    assert again.runs["toy"]["record"] == "book/runs/ch/toy.json"
    for stale in (toy_config(profile="full", lr=0.01), None):  # another config, or data
        other = data if stale else type(data)(**{**vars(data), "digests": {"x": "1"}})
        with pytest.raises(AssertionError, match="trained although"):
            again.train("toy", stale or cfg, other)
    with pytest.raises(AssertionError, match="trained although"):
        again.train("toy", cfg, data, retrain=True)
    with pytest.raises(AssertionError, match="trained although"):
        notebook_run(tmp_path, "full", monkeypatch, retrain=True).train("toy", cfg, data)


def test_records_only_never_trains_and_says_why_a_record_does_not_match(tmp_path, data,
                                                                         monkeypatch):
    """``reproduce --records-only``: a chapter built from its records stops, naming the record
    and why it is not the run's, where it would otherwise train."""
    def no_training(*args, **kwargs):
        raise AssertionError("trained under records_only")

    cfg, path = toy_config(profile="full"), tmp_path / "book" / "runs" / "ch" / "toy.json"
    run = notebook_run(tmp_path, "full", monkeypatch, records_only=True)
    monkeypatch.setattr(engine, "train", no_training)
    with pytest.raises(UserError, match="no record; run 'toy' would train") as e:
        run.train("toy", cfg, data)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    monkeypatch.undo()
    trained = notebook_run(tmp_path, "full", monkeypatch).train("toy", cfg, data)
    run = notebook_run(tmp_path, "full", monkeypatch, records_only=True)
    monkeypatch.setattr(engine, "train", no_training)
    assert run.train("toy", cfg, data)["dev"] == trained["dev"]
    other = type(data)(**{**vars(data), "digests": {"x": "1"}})
    stale = toy_config(profile="full", lr=0.01)
    for config, digests, why in [(stale, data, "a record of config"),
                                 (cfg, other, "a record of other data")]:
        with pytest.raises(UserError, match=why):
            run.train("toy", config, digests)
    records.write_record(path, {**records.read_record(path), "complete": False})
    with pytest.raises(UserError, match="a partial record"):
        run.train("toy", cfg, data)


def test_a_full_chapter_needs_every_run_complete_and_full(tmp_path, data, monkeypatch):
    run = notebook_run(tmp_path, "full", monkeypatch)
    run.out_dir.mkdir(parents=True)
    run.train("short", toy_config(profile="smoke"), data)
    with pytest.raises(UserError, match="runs short are not complete full-profile runs"):
        run.save()


def test_start_takes_chapter_and_retrain_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setattr("IPython.display.display", lambda *a: None)
    monkeypatch.delenv("MRC_CHAPTER", raising=False)
    monkeypatch.delenv("MRC_RETRAIN", raising=False)
    run = notebook.start("smoke", 0, "", "cpu", str(tmp_path / "runs" / "07_x" / "smoke"))
    assert (run.chapter, run.retrain) == ("07_x", False)
    monkeypatch.setenv("MRC_CHAPTER", "08_y")
    monkeypatch.setenv("MRC_RETRAIN", "1")
    run = notebook.start("smoke", 0, "", "cpu", str(tmp_path / "o"))
    assert (run.chapter, run.retrain, run.records_only) == ("08_y", True, False)
    monkeypatch.setenv("MRC_RECORDS_ONLY", "1")
    assert notebook.start("smoke", 0, "", "cpu", str(tmp_path / "o")).records_only


def test_rnn_precision_names_how_a_readers_rnn_layers_compute():
    from mrc_lib.nn import RNN

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert engine.rnn_precision(torch.nn.Linear(2, 2), cuda) is None
    assert engine.rnn_precision(RNN(2, 2), cpu) == "fp32"
    assert engine.rnn_precision(RNN(2, 2), cuda) == "TF32"
