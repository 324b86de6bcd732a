"""The command line: one-line errors with exit status 2, official evaluation output."""

import argparse
import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from mrc_lib.bench import full_readers, reader_hash
from mrc_lib.cli import main

from .conftest import ARTICLES, squad_json


def test_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "mrc_lib", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for command in ("validate", "evaluate", "prepare", "stats", "download", "train", "predict",
                    "bench", "reproduce", "queue"):
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


def load_bringup(name: str = "gpu_bringup"):
    """A script of ``benchmarks/`` as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    bringup = importlib.util.module_from_spec(spec)
    sys.modules[name] = bringup  # a dataclass looks its module up there
    spec.loader.exec_module(bringup)
    return bringup


def test_gpu_bringup_runs_every_reader_tiny_on_cpu(tmp_path):
    bringup = load_bringup()
    out = tmp_path / "gpu.json"
    result = bringup.main(["--device", "cpu", "--tiny", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert set(result["models"]) == set(full_readers()) and result["tiny"] and result["complete"]
    assert {"bidaf", "qanet", "rnet", "decaprop", "dynsan", "phasecond"} <= set(result["models"])
    for name, m in result["models"].items():
        assert "error" not in m, (name, m.get("error"))
        speed = m["speed"]["16"]
        assert speed["train_examples_per_s"] > 0 and speed["infer_examples_per_s"] > 0
        assert m["epoch_seconds"] == speed["epoch_seconds"] > 0 and m["peak_memory_bytes"] > 0


def test_gpu_bringup_records_the_readers_steps_as_cuda_graphs(tmp_path):
    bringup = load_bringup()
    out = tmp_path / "graphs.json"
    result = bringup.main(["--device", "cpu", "--tiny", "--cuda-graphs", "--models", "qanet",
                           "--out", str(out)])
    assert result["cuda_graphs"] and "error" not in result["models"]["qanet"]
    # a CPU records no graph (config cuda_graphs is CUDA-only), and the hash is the plain one
    assert "agreement" not in result["models"]["qanet"]
    # Beside it, the plain reader's rates at the same lengths, measured in the same process.
    assert set(result["models"]["qanet"]["plain_speed"]) == {"16"}
    assert result["models"]["qanet"]["config_hash"] == bringup.reader_hash(
        "qanet", "smoke", ["device=cpu", "batch_size=2"])
    # A file of an earlier check (revision 1 had no agreement_revision) keeps no reader.
    assert result["agreement_revision"] == bringup.AGREEMENT_REVISION
    assert set(bringup.kept(out, result, "cpu")) == {"qanet"}
    out.write_text(json.dumps({k: v for k, v in result.items() if k != "agreement_revision"}))
    assert bringup.kept(out, result, "cpu") == {}


def test_gpu_bringup_resume_keeps_what_a_cut_command_measured(tmp_path):
    """A cut command's file goes on: readers measured under the same settings with today's
    config hash are kept, the rest (a stale hash, an error, missing) measured again."""
    bringup = load_bringup()
    out = tmp_path / "gpu.json"
    first = bringup.main(["--device", "cpu", "--tiny", "--models", "bidaf,san", "--out",
                          str(out)])
    cut = dict(first, models={"bidaf": dict(first["models"]["bidaf"], seconds=-1.0),
                              "san": dict(first["models"]["san"], config_hash="stale")})
    del cut["complete"]
    out.write_text(json.dumps(cut))
    result = bringup.main(["--device", "cpu", "--tiny", "--models", "bidaf,san,qanet",
                           "--resume", "--out", str(out)])
    assert result["complete"] and list(result["models"]) == ["bidaf", "san", "qanet"]
    assert result["models"]["bidaf"]["seconds"] == -1.0  # kept
    assert result["models"]["san"]["config_hash"] == first["models"]["san"]["config_hash"]
    assert result["models"]["san"]["seconds"] >= 0 and "error" not in result["models"]["qanet"]
    out.write_text(json.dumps(cut))
    assert set(bringup.kept(out, cut, "cpu")) == {"bidaf"}
    older = {k: v for k, v in cut["models"]["bidaf"].items() if k != "speed_revision"}
    out.write_text(json.dumps(dict(cut, models={"bidaf": older})))
    assert bringup.kept(out, cut, "cpu") == {}  # measured of older code: again
    out.write_text(json.dumps(dict(cut, steps=5)))  # other settings: nothing is kept
    again = bringup.main(["--device", "cpu", "--tiny", "--models", "bidaf", "--resume",
                          "--out", str(out)])
    assert again["models"]["bidaf"]["seconds"] >= 0
    # A file of the readers compiled whole goes on only as such (earlier files, of their
    # blocks, have no compile_whole key).
    blocks = dict(first, compile=True, compile_mode="reduce-overhead", models={})
    out.write_text(json.dumps(dict(blocks, compile_whole=True, models=first["models"])))
    assert bringup.kept(out, blocks, "cpu") == {}
    assert set(bringup.kept(out, dict(blocks, compile_whole=True), "cpu")) == {"bidaf", "san"}
    # ... and of today's tracing (that file has no compile_revision: of the first)
    today = dict(blocks, compile_whole=True, compile_revision=bringup.COMPILE_REVISION)
    assert bringup.kept(out, today, "cpu") == {}
    # A reader is entered as cut before its measurement, and a SIGTERM adds its seconds
    # (with the seconds it had): measured again on --resume, except when compiled whole and
    # cut after WHOLE_FINAL_SECONDS (so long a compilation is the finding).
    cut = {"bidaf": {"error": bringup.CUT, "seconds": bringup.WHOLE_FINAL_SECONDS}}
    out.write_text(json.dumps(dict(blocks, models=cut)))
    assert bringup.kept(out, blocks, "cpu") == {}
    out.write_text(json.dumps(dict(blocks, compile_whole=True, models=cut)))
    assert bringup.kept(out, dict(blocks, compile_whole=True), "cpu") == cut
    cut["bidaf"]["seconds"] -= 1  # the step started with less than that left: tried again
    out.write_text(json.dumps(dict(blocks, compile_whole=True, models=cut)))
    assert bringup.kept(out, dict(blocks, compile_whole=True), "cpu") == {}
    # A file in full precision (bf16=false) goes on only as such too, its entries with that
    # config's hash; without --models it measures the readers whose full profile sets bf16.
    out.write_text(json.dumps(dict(first, fp32=True)))
    assert bringup.kept(out, first, "cpu") == {}
    assert bringup.default_readers(argparse.Namespace(fp32=True)) == \
        [name for name in full_readers() if name != "bidaf"]
    fp32 = bringup.main(["--device", "cpu", "--tiny", "--fp32", "--models", "qanet", "--out",
                         str(out)])
    assert fp32["fp32"] and fp32["models"]["qanet"]["config_hash"] == \
        reader_hash("qanet", "smoke", ["device=cpu", "batch_size=2", "bf16=false"])
    # Beside it, the profile's precision at the first length, measured in the same process.
    assert set(fp32["models"]["qanet"]["plain_speed"]) == {"16"}
    assert set(bringup.kept(out, fp32, "cpu")) == {"qanet"}
    alone = {k: v for k, v in fp32["models"]["qanet"].items() if k != "plain_speed"}
    out.write_text(json.dumps(dict(fp32, models={"qanet": alone})))
    assert bringup.kept(out, fp32, "cpu") == {}  # measured again, with its pair


def test_gpu_bringup_enters_the_reader_a_sigterm_cuts_with_its_seconds(tmp_path):
    """A GPU session's step that runs out of time sends SIGTERM: the reader being measured is
    left entered as cut, with the seconds it had."""
    bringup = load_bringup()
    out = tmp_path / "gpu.json"
    proc = subprocess.Popen([sys.executable, bringup.__file__, "--device", "cpu", "--tiny",
                             "--models", "qanet", "--out", str(out)])
    deadline = time.time() + 120
    while not (out.is_file() and json.loads(out.read_text())["models"]):
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    entry = json.loads(out.read_text())["models"]["qanet"]
    assert entry["error"] == bringup.CUT and entry["seconds"] >= 0
    assert "complete" not in json.loads(out.read_text())


def test_gpu_profile_times_and_profiles_a_step_tiny_on_cpu(tmp_path):
    profiler = load_bringup("gpu_profile")
    out = tmp_path / "profile.json"
    result = profiler.main(["--device", "cpu", "--tiny", "--models", "qanet,nosuch", "--top",
                            "5", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result)) and result["complete"]
    qanet = result["models"]["qanet"]
    assert qanet["wall_ms"] > 0 and qanet["kernel_ms"] == qanet["launches"] == 0  # no GPU
    assert len(qanet["ops"]) == 5 and qanet["kernels"] == []
    assert qanet["host_ms"] > 0 and len(qanet["host_ops"]) == 5 and qanet["syncs"] == {}
    assert qanet["copies"] == {}  # no GPU, no copy events
    assert all(op["name"] and op["calls"] > 0 and op["ms"] >= 0 for op in qanet["ops"])
    assert [op["ms"] for op in qanet["ops"]] == sorted((op["ms"] for op in qanet["ops"]),
                                                       reverse=True)
    assert "nosuch" in result["models"]["nosuch"]["error"]  # reported; the others still run


def test_op_counts_count_each_readers_kernels_tiny_on_cpu(tmp_path):
    """Every reader, counted and traced. No step reads the device back (issue 13): TorchDynamo
    breaks a graph at each ``.item()``, host read or data-dependent shape, so the only break a
    training forward and its loss may have is at an LSTM or GRU, which cuDNN runs between
    graphs."""
    op_counts = load_bringup("op_counts")
    out = tmp_path / "ops.json"
    result = op_counts.main(["--tiny", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    models = result["models"]
    assert set(models) == set(full_readers())
    assert all(m["ops"] > 0 and m["views"] > 0 and m["top"] for m in models.values())
    assert not models["qanet"]["gru_steps_on_cpu"] and models["rnet"]["gru_steps_on_cpu"]
    # bf16 autocast's casts, counted for the readers whose full profile sets bf16 (BiDAF's
    # does not): a float32 weight meets a matrix product in each.
    assert models["bidaf"]["bf16_casts"] is None
    assert all(m["bf16_casts"] > 0 for name, m in models.items() if name != "bidaf")
    for name in ("qanet", "qanet_na", "dynsan", "dynsan_mc"):
        assert (models[name]["graphs"], models[name]["graph_breaks"]) == (1, 0), name
    assert models["bidaf"]["graph_breaks"] > 0
    for name, m in models.items():
        assert set(m["break_reasons"]) <= {"Attempted to wrap RNN, GRU, or LSTM"}, name


def test_cudagraph_check_finds_a_float_hyperparameter_left_on_the_cpu():
    """DynSAN's gate penalty (Eq. 6) multiplies by β, a Python float. Traced with symbolic
    shapes and floats unspecialized (torch's default), β is a float64 scalar input on the CPU,
    and the cudagraphs backend would record no graph; specialized, as the trainer traces
    (``mrc_lib.train.specialize_floats``), the graphs are on the device alone."""
    import torch
    from torch import nn

    from mrc_lib.models.dynsa import gate_penalty

    check = load_bringup("cudagraph_check")

    class Penalized(nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.beta = nn.Parameter(torch.ones(3, 4)), 1e-5

        def forward(self, batch):  # as DynSAN.finish adds the penalty to its output
            gates = torch.sigmoid(batch["x"] @ self.w)
            return {"aux_loss": gate_penalty([gates], self.beta, len(gates))}

    model = Penalized().to("meta")
    batch = {"x": torch.ones(2, 5, 3, device="meta")}

    def loss_of(out, batch):
        return out["aux_loss"]

    before = torch._dynamo.config.specialize_float
    raw = check.trace(model, batch, loss_of, specialized=False)
    assert not raw["ready"] and {"cpu"} <= set(raw["graphs"][0]["devices"])
    ours = check.trace(model, batch, loss_of, specialized=True)
    assert ours["ready"] and [g["graph"] for g in ours["graphs"]] == ["forward", "backward"]
    assert all(not g["devices"] and g["nodes"] > 0 for g in ours["graphs"])
    # every symbolic size of a graph's tensors is one of its size inputs, which key recordings
    assert all(g["sizes"] and not g["unkeyed"] for g in ours["graphs"])
    assert torch._dynamo.config.specialize_float is before  # put back as it was


def test_padding_costs_count_extra_positions_and_shapes_by_hand():
    """Two batches of two: contexts 10, 12 and 30, 33 (cut at 32), questions 3, 5 and 7, 9."""
    padding = load_bringup("padding")
    batches = [np.array([1, 3]), np.array([0, 2])]
    costs = padding.padding_costs(batches, np.array([30, 10, 33, 12]), np.array([7, 3, 9, 5]),
                                  [1, 16], context_limit=32, question_limit=50)
    assert costs["batches"] == 2
    # Unpadded: 2·12 + 2·32 = 88 positions; to 16: 2·16 + 2·32 = 96; real tokens 84.
    assert costs["multiples"]["1"] == {"extra_context_positions": 0.0, "shapes": 2,
                                       "real_token_fraction": round(84 / 88, 4)}
    assert costs["multiples"]["16"] == {"extra_context_positions": round(96 / 88 - 1, 4),
                                        "shapes": 2, "real_token_fraction": round(84 / 96, 4)}


def _adadelta_checkpoint(optimizer="adadelta"):
    """A trainer-style checkpoint of a Linear(3, 2) after three Adadelta steps."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adadelta(model.parameters(), lr=0.5, rho=0.9, eps=1e-6)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 3)).pow(2).sum().backward()
        opt.step()
    config = {"model": "toy", "optimizer": optimizer, "lr": 0.5, "rho": 0.9, "eps": 1e-6}
    shadow = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"config": config, "model": model.state_dict(), "ema": {"shadow": shadow},
            "optimizer": opt.state_dict()}


def test_adadelta_steps_read_the_optimizer_state_by_hand(tmp_path):
    from mrc_lib.checkpoint import save_checkpoint
    from mrc_lib.errors import UserError
    from mrc_lib.records import config_hash

    steps = load_bringup("adadelta_steps")
    ck = _adadelta_checkpoint()
    result = steps.step_sizes(ck)
    weight, bias = (ck["optimizer"]["state"][i] for i in (0, 1))
    assert [t["name"] for t in result["tensors"]] == ["weight", "bias"]
    w = weight["acc_delta"].flatten().tolist()
    assert result["tensors"][0]["rms_step"] == pytest.approx(0.5 * (sum(w) / 6) ** 0.5)
    assert result["tensors"][0]["median_step"] == pytest.approx(0.5 * sorted(w)[2] ** 0.5)
    g = weight["square_avg"].flatten().tolist()
    assert result["tensors"][0]["rms_grad"] == pytest.approx((sum(g) / 6) ** 0.5)
    every = sorted(w + bias["acc_delta"].tolist())  # 8 weights: the median is between 4th, 5th
    assert result["overall"]["p50_step"] == pytest.approx(0.5 * ((every[3] + every[4]) / 2) ** 0.5)
    assert result["overall"]["weights"] == 8 and result["step"] == 3
    assert result["config_hash"] == config_hash(ck["config"])
    with pytest.raises(UserError, match="not adadelta"):
        steps.step_sizes(_adadelta_checkpoint("adam"))
    # On noise the step settles at a size set by lr, rho and eps alone: sqrt(eps) scales it.
    small, large = (steps.noise_steady_step(0.5, 0.95, eps, steps=300, weights=256)
                    for eps in (1e-8, 1e-6))
    assert large == pytest.approx(10 * small, rel=0.01)
    # The command: a checkpoint in parts and its record; the JSON it writes.
    save_checkpoint(tmp_path / "checkpoint.pt", ck, part_bytes=512)
    (tmp_path / "record.json").write_text(json.dumps({"device": "toy", "git_commit": "abc"}))
    out = tmp_path / "steps.json"
    written = steps.main(["--checkpoint", str(tmp_path / "checkpoint.pt"), "--record",
                          str(tmp_path / "record.json"), "--noise-steps", "10", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(written))
    assert (written["device"], written["git_commit"], written["step"]) == ("toy", "abc", 3)
    assert written["run"] == str(tmp_path / "checkpoint.pt")   # a record that names no run
    (tmp_path / "record.json").write_text(json.dumps({"chapter": "01_toy", "run": "toy"}))
    named = steps.main(["--checkpoint", str(tmp_path / "checkpoint.pt"), "--record",
                        str(tmp_path / "record.json"), "--noise-steps", "10", "--out", str(out)])
    assert named["run"] == "01_toy/toy"



def test_adadelta_steps_find_a_partial_run_in_a_queue_inbox(tmp_path):
    """The default source: a partial run packed by the queue, as a GPU session brings it."""
    from mrc_lib.checkpoint import save_checkpoint
    from mrc_lib.errors import UserError
    from mrc_lib.queue import pack

    steps = load_bringup("adadelta_steps")
    out = tmp_path / "queue"
    run = out / "01_toy" / "toy"
    run.mkdir(parents=True)
    save_checkpoint(run / "checkpoint.pt", _adadelta_checkpoint(), part_bytes=512)
    (run / "status.json").write_text(json.dumps({"complete": False}))
    (out / "records" / "01_toy").mkdir(parents=True)
    (out / "records" / "01_toy" / "toy.json").write_text(json.dumps({"device": "toy"}))
    pack(out, tmp_path / "inbox" / "1")
    written = steps.main(["--inbox", str(tmp_path / "inbox"), "--run", "01_toy/toy",
                          "--noise-steps", "10", "--out", str(tmp_path / "steps.json")])
    assert (written["run"], written["device"], written["step"]) == ("01_toy/toy", "toy", 3)
    with pytest.raises(UserError, match="no checkpoint of 01_toy/other"):
        steps.main(["--inbox", str(tmp_path / "inbox"), "--run", "01_toy/other",
                    "--out", str(tmp_path / "other.json")])

def test_gpu_packing_sums_concurrent_processes_tiny_on_cpu(tmp_path):
    packing = load_bringup("gpu_packing")
    out = tmp_path / "packing.json"
    result = packing.main(["--device", "cpu", "--tiny", "--models", "bidaf,no_such_reader",
                           "--parallel", "1,2", "--seconds", "0.5", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    bidaf = result["models"]["bidaf"]
    for n in ("1", "2"):
        assert bidaf[n]["train_examples_per_s"] > 0 and bidaf[n]["peak_memory_bytes"] > 0
    assert bidaf["2"]["per_process_examples_per_s"] * 2 == pytest.approx(
        bidaf["2"]["train_examples_per_s"], abs=0.2)
    # A reader whose process fails ends its series with the worker's error, one line.
    assert list(result["models"]["no_such_reader"]) == ["1"]
    assert "no_such_reader" in result["models"]["no_such_reader"]["1"]["error"]
    assert result["best_parallel"] == {"bidaf": 1 if bidaf["1"]["train_examples_per_s"]
                                       >= 0.95 * bidaf["2"]["train_examples_per_s"] else 2}
    assert result["recommended_parallel"] in (1, 2) and result["complete"]


def test_gpu_packing_recommends_the_best_geometric_mean():
    choose = load_bringup("gpu_packing").choose
    models = {"a": {"1": {"train_examples_per_s": 100}, "2": {"train_examples_per_s": 180},
                    "4": {"train_examples_per_s": 185}},
              "b": {"1": {"train_examples_per_s": 50}, "2": {"train_examples_per_s": 60},
                    "4": {"error": "CUDA out of memory"}}}
    assert choose(models) == ({"a": 2, "b": 2}, 2)
    models["b"]["4"] = {"train_examples_per_s": 40}
    assert choose(models) == ({"a": 2, "b": 2}, 2)  # 185/185 * 40/60 < 180/185 * 60/60


def cpu_has_bf16_rnn() -> bool:
    """Whether this CPU runs an LSTM under bf16 autocast."""
    import torch

    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.nn.LSTM(2, 2)(torch.zeros(1, 1, 2))
        return True
    except RuntimeError:
        return False


def float32_forward(forward):
    """``forward`` of an ``nn.LSTM``/``nn.GRU`` run in float32 with autocast off."""
    import torch
    from torch.nn.utils.rnn import PackedSequence

    def run(self, input, hx=None):
        if isinstance(input, PackedSequence):
            input = input._replace(data=input.data.float())
        else:
            input = input.float()
        with torch.autocast("cpu", enabled=False):
            return forward(self, input, hx)
    return run


def test_every_reader_trains_and_infers_under_bf16_autocast(tmp_path, monkeypatch):
    """The trainer turns bf16 autocast on only on CUDA, which CI lacks; CPU autocast is the
    nearest check that no reader mixes bf16 and float32 where an op needs one dtype."""
    import torch

    from mrc_lib import bench, inference, tasks, train

    def autocast(cfg, device):
        return torch.autocast(device.type, dtype=torch.bfloat16)

    for module in (inference, train, bench, tasks):
        monkeypatch.setattr(module, "autocast", autocast)
    if not cpu_has_bf16_rnn():
        # oneDNN builds a bf16 LSTM/GRU only on CPUs with bf16 instructions (cuDNN always
        # does): here the recurrences alone run in float32, everything around them in bf16.
        for cls in (torch.nn.LSTM, torch.nn.GRU):
            monkeypatch.setattr(cls, "forward", float32_forward(cls.forward))
    bringup = load_bringup()
    result = bringup.main(["--device", "cpu", "--tiny", "--out", str(tmp_path / "gpu.json")])
    assert set(result["models"]) == set(full_readers())
    for name, m in result["models"].items():
        assert "error" not in m, (name, m.get("error"))
