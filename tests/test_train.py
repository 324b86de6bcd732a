"""Tests of the training engine: schedule, EMA, configs, checkpoints, exact resume, NaN guard.

Most tests train a tiny reader (``toy``, registered here) on a synthetic task encoded by the
real data pipeline: the context is a row of distinct words, the question ``what follows X`` and
the answer the word after ``X``. The ``real_data`` tests overfit BiDAF and QANet on 32 real
SQuAD training questions.
"""

from __future__ import annotations

import io
import json
import math
import os
import signal
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from mrc_lib import records
from mrc_lib import train as engine
from mrc_lib.checkpoint import load_checkpoint, save_checkpoint
from mrc_lib.config import TrainConfig, parse_override, resolve_config
from mrc_lib.data.cache import PreparedData
from mrc_lib.data.dataset import Split, encode, index_forms
from mrc_lib.data.squad import Answer, Example, SquadFile
from mrc_lib.data.text import Tokens
from mrc_lib.data.vocab import Vocab
from mrc_lib.errors import UserError
from mrc_lib.models import build_model, hparam_defaults, register
from mrc_lib.nn import mask_logits
from mrc_lib.utils import git_commit, write_parts

WORDS = [f"w{k}" for k in range(40)]


# --- a toy task and a toy reader ---------------------------------------------------------------


def _tokens(text: str) -> Tokens:
    """Whitespace tokenization with character offsets."""
    words, starts, pos = text.split(), [], 0
    for w in words:
        pos = text.index(w, pos)
        starts.append(pos)
        pos += len(w)
    starts = np.array(starts, np.int32)
    return Tokens(words, starts, starts + np.array([len(w) for w in words], np.int32))


def toy_vocab(dim: int = 16) -> Vocab:
    words = ["<pad>", "<unk>", "what", "follows", *WORDS]
    chars = ["<pad>", "<unk>", *sorted(set("".join(words[2:])))]
    vectors = np.random.default_rng(0).normal(size=(len(words), dim)).astype(np.float32)
    return Vocab(words, chars, vectors, len(words), False, ["<pad>"], ["<pad>"])


def toy_split(name: str, n: int, vocab: Vocab, seed: int) -> Split:
    """``n`` questions "what follows X" over contexts of 12 distinct words."""
    rng = np.random.default_rng(seed)
    contexts, examples = [], []
    for i in range(n):
        row = list(rng.choice(WORDS, 12, replace=False))
        p = int(rng.integers(0, 11))
        context = " ".join(row)
        start = len(" ".join(row[:p + 1])) + 1
        contexts.append(context)
        examples.append(Example(f"{name}-{i}", f"what follows {row[p]}", i,
                                (Answer(row[p + 1], start),)))
    sq = SquadFile(name, "1.1", ["toy"] * n, contexts, examples)
    ctx, qs = [_tokens(c) for c in contexts], [_tokens(e.question) for e in examples]
    forms = index_forms(ctx + qs)
    arrays, text = encode(sq, ctx, qs, forms, vocab)
    return Split(name, arrays, text, vocab.forms(list(forms)))


def toy_data(n_train: int = 64, n_dev: int = 32) -> PreparedData:
    vocab = toy_vocab()
    splits = {"train": toy_split("train", n_train, vocab, 1),
              "dev": toy_split("dev", n_dev, vocab, 2)}
    return PreparedData("toy", "1.1", vocab, splits, {"toy.json": "0" * 64}, Path("."), {})


@register("toy")
class ToyReader(nn.Module):
    """Scores token ``i`` as a start by ``(W_s e_{i-1}) · q̄`` and as an end by
    ``(W_e e_{i-1}) · q̄``, ``q̄`` the mean question embedding."""

    def __init__(self, vocab, *, dropout: float = 0.1):
        super().__init__()
        dim = vocab.word_vectors.shape[1]
        self.embed = nn.Embedding.from_pretrained(torch.tensor(vocab.word_vectors),
                                                  freeze=False)
        self.w_start = nn.Linear(dim, dim)
        self.w_end = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, batch):
        c = self.dropout(self.embed(batch["c_words"]))
        prev = nn.functional.pad(c, (0, 0, 1, 0))[:, :-1]  # e_{i-1}
        q_mask = batch["q_mask"].unsqueeze(-1).float()
        q = (self.embed(batch["q_words"]) * q_mask).sum(1) / q_mask.sum(1)
        start = (self.w_start(prev) * q.unsqueeze(1)).sum(-1)
        end = (self.w_end(prev) * q.unsqueeze(1)).sum(-1)
        return {"start_logits": mask_logits(start, batch["c_mask"]),
                "end_logits": mask_logits(end, batch["c_mask"])}


def toy_config(**changes) -> TrainConfig:
    values = dict(model="toy", dataset="toy", optimizer="adam", lr=0.05, epochs=2,
                  batch_size=16, eval_batch_size=32, ema_decay=0.9, warmup_steps=2,
                  device="cpu", log_every=2, checkpoint_every=3, max_answer_len=3)
    return TrainConfig(**{**values, **changes})


@pytest.fixture(scope="module")
def data() -> PreparedData:
    return toy_data()


class Killed(Exception):
    """Stands for the process being killed."""


class DiesAfter:
    """A training split whose batch stream dies at batch ``n`` of epoch ``epoch``."""

    def __init__(self, split: Split, epoch: int, n: int):
        self.split, self.epoch, self.n = split, epoch, n

    def __getattr__(self, name):
        return getattr(self.split, name)

    def __len__(self):
        return len(self.split)

    def batches(self, batch_size, *, shuffle, seed=0, epoch=0, skip=0):
        stream = self.split.batches(batch_size, shuffle=shuffle, seed=seed, epoch=epoch,
                                    skip=skip)
        for k, batch in enumerate(stream, start=skip):
            if epoch == self.epoch and k == self.n:
                raise Killed
            yield batch


def state_of(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


# --- learning-rate schedule and EMA ------------------------------------------------------------


def test_warmup_factor_values():
    W = 4
    assert [engine.warmup_factor(k, W, "linear") for k in range(1, 7)] == \
        [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    log = [engine.warmup_factor(k, W, "log") for k in range(1, 7)]
    assert log == pytest.approx([math.log(2) / math.log(5), math.log(3) / math.log(5),
                                 math.log(4) / math.log(5), 1.0, 1.0, 1.0])
    assert all(a < b for a, b in zip(log[:3], log[1:4]))
    assert engine.warmup_factor(1, 0, "log") == 1.0  # no warm-up


def test_schedule_sets_optimizer_lr_with_warmup_and_plateau_decay():
    cfg = toy_config(lr=1.0, warmup_steps=3, plateau_factor=0.5, plateau_patience=2)
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=123.0)
    schedule = engine.LRSchedule(optimizer, cfg)
    seen = [optimizer.param_groups[0]["lr"]]
    for _ in range(4):
        schedule.step()
        seen.append(optimizer.param_groups[0]["lr"])
    assert seen == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0, 1.0])
    for f1 in (50.0, 40.0, 50.0):  # best 50, then two epochs without improvement
        schedule.epoch_end(f1)
    assert optimizer.param_groups[0]["lr"] == 0.5
    schedule.epoch_end(60.0)
    schedule.epoch_end(59.0)
    assert optimizer.param_groups[0]["lr"] == 0.5
    restored = engine.LRSchedule(optimizer, cfg)
    restored.load_state_dict(schedule.state_dict())
    assert restored.lr == schedule.lr == 0.5


def test_ema_matches_direct_computation():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    model[1].bias.requires_grad_(False)  # frozen weights are not averaged
    ema = engine.EMA(model, decay=0.9)
    expected = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    for n_update in range(1, 31):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update(model)
        d = min(0.9, (1 + n_update) / (10 + n_update))
        for name, p in model.named_parameters():
            if p.requires_grad:
                expected[name] = d * expected[name] + (1 - d) * p.detach()
    assert set(ema.shadow) == set(expected) == {"0.weight", "0.bias", "1.weight"}
    for name, value in expected.items():
        torch.testing.assert_close(ema.shadow[name], value)
    live = {n: p.detach().clone() for n, p in model.named_parameters()}
    with engine.averaged(model, ema):
        for name, p in model.named_parameters():
            torch.testing.assert_close(p, expected.get(name, live[name]))
    for name, p in model.named_parameters():
        assert torch.equal(p, live[name])


# --- configuration -----------------------------------------------------------------------------


def test_profiles_resolve_for_both_models():
    for model in ("bidaf", "qanet"):
        for profile in ("smoke", "full"):
            cfg = resolve_config(model, profile=profile)
            assert cfg.model == model and cfg.profile == profile
    full = resolve_config("qanet", profile="full")
    assert (full.optimizer, full.lr, full.betas, full.eps) == ("adam", 1e-3, (0.8, 0.999), 1e-7)
    assert (full.warmup_steps, full.ema_decay) == (1000, 0.9999)
    assert full.grad_clip is None  # the paper clips nothing; NLPLearn's 5 is a departure
    bidaf = resolve_config("bidaf", profile="full")
    assert (bidaf.optimizer, bidaf.lr, bidaf.batch_size, bidaf.ema_decay) == \
        ("adadelta", 0.5, 60, 0.999)
    assert bidaf.hparams["hidden"] == 100 and bidaf.hparams["dropout"] == 0.2


def test_overrides_file_then_set(tmp_path):
    config_file = tmp_path / "c.yaml"
    config_file.write_text("lr: 0.01\nhparams: {dropout: 0.3}\nepochs: 7\n")
    cfg = resolve_config("bidaf", profile="smoke", config_file=config_file,
                         overrides=["lr=2e-3", "hparams.hidden=7", "limits.train=10",
                                    "betas=[0.8, 0.9]", "max_steps=null", "bf16=true"])
    smoke = resolve_config("bidaf", profile="smoke")
    assert cfg.lr == 2e-3 and cfg.epochs == 7 and cfg.betas == (0.8, 0.9) and cfg.bf16
    assert cfg.hparams == {**smoke.hparams, "dropout": 0.3, "hidden": 7}
    assert cfg.limits == {**smoke.limits, "train": 10} and cfg.max_steps is None
    as_json = tmp_path / "c.json"
    as_json.write_text(json.dumps({"seed": 3}))
    assert resolve_config("bidaf", config_file=as_json).seed == 3
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("overrides, message", [
    (["learning_rate=1"], "unknown config key"),
    (["lr=fast"], "lr='fast'"),
    (["epochs=2.5"], "epochs=2.5"),
    (["optimizer=sgd"], "expected one of adam, adamw, adadelta"),
    (["lr"], "expected KEY=VALUE"),
    (["betas=[0.9]"], "betas"),
    (["bf16=maybe"], "bf16"),
])
def test_bad_overrides_are_user_errors(overrides, message):
    with pytest.raises(UserError, match=message):
        resolve_config("bidaf", overrides=overrides)


def test_bad_profiles_and_files_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="unknown profile 'nope'; known: full, smoke"):
        resolve_config("bidaf", profile="nope")
    with pytest.raises(UserError, match="no section for model 'toy'"):
        resolve_config("toy", profile="smoke")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(UserError, match="mapping"):
        resolve_config("bidaf", config_file=bad)
    bad.write_text("colour: blue\n")
    with pytest.raises(UserError, match="unknown config key.*colour"):
        resolve_config("bidaf", config_file=bad)
    assert parse_override("hparams.a.b=[1, 2]") == {"hparams": {"a": {"b": [1, 2]}}}


def test_a_profile_file_is_parsed_once_while_unchanged_and_each_caller_gets_a_copy(tmp_path):
    """Loading the queue resolves every run's config; each profile file is parsed once (per
    modification time and size), and a caller that changes what it got changes no one else's."""
    from mrc_lib.config import profile_sections

    path = tmp_path / "p.yaml"
    path.write_text("bidaf: {hparams: {hidden: 8}}\n")
    first = profile_sections(path)
    first["bidaf"]["hparams"]["hidden"] = 99
    assert profile_sections(path) == {"bidaf": {"hparams": {"hidden": 8}}}
    path.write_text("bidaf: {hparams: {hidden: 16, char_dim: 4}}\n")  # another size
    assert profile_sections(path)["bidaf"]["hparams"] == {"hidden": 16, "char_dim": 4}
    path.unlink()
    with pytest.raises(UserError, match="cannot read profile"):
        profile_sections(path)


# --- checkpoints -------------------------------------------------------------------------------


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"step": torch.tensor(1)})
    before = path.read_bytes()

    def broken_save(obj, f):
        Path(f).write_bytes(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, {"step": torch.tensor(2)})
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    assert load_checkpoint(path)["step"] == 1


def test_rng_states_round_trip_through_a_checkpoint(tmp_path):
    import random

    from mrc_lib.checkpoint import rng_state, set_rng_state

    save_checkpoint(tmp_path / "c.pt", {"rng": rng_state()})
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(load_checkpoint(tmp_path / "c.pt")["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


# --- training runs -----------------------------------------------------------------------------


def test_run_writes_its_outputs(tmp_path, data):
    metrics = engine.train(toy_config(), tmp_path, data=data)
    files = {p.name for p in tmp_path.iterdir()}
    assert {"config.json", "log.jsonl", "metrics.json", "predictions.json", "model.pt",
            "vocab", "checkpoint.pt"} <= files
    assert json.loads((tmp_path / "metrics.json").read_text()) == json.loads(json.dumps(metrics))
    assert metrics["steps"] == 2 * 4 and len(metrics["seconds_per_epoch"]) == 2
    assert set(metrics["dev"]) == {"exact_match", "f1"}
    assert metrics["best_epoch"] in (1, 2)
    assert metrics["task"] == "span"  # the dataset's own task: span extraction
    assert "test" not in metrics and "best_test" not in metrics  # no test split
    best = load_checkpoint(tmp_path / "checkpoint.pt")["progress"]["best"]
    assert best == {"epoch": metrics["best_epoch"], "score": metrics["best_dev"]["f1"],
                    "dev": metrics["best_dev"], "test": None}
    assert metrics["params"]["trainable"] == sum(
        p.numel() for p in ToyReader(data.vocab).parameters())
    assert metrics["data_digests"] == data.digests and metrics["peak_memory_bytes"] > 0
    predictions = json.loads((tmp_path / "predictions.json").read_text())
    assert set(predictions) == set(data.splits["dev"].qids)
    assert all(p.startswith("w") for p in predictions.values())
    events = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "step"] == [2, 3, 4, 6, 8]
    assert [e["epoch"] for e in events if e["event"] == "epoch"] == [1, 2]
    assert TrainConfig.from_dict(json.loads((tmp_path / "config.json").read_text())) == \
        toy_config()
    with pytest.raises(UserError, match="already holds a run"):
        engine.train(toy_config(), tmp_path, data=data)


def test_training_learns_the_toy_task(tmp_path, data):
    metrics = engine.train(toy_config(epochs=12, checkpoint_every=None), tmp_path, data=data)
    first, last = metrics["history"][0]["dev"]["f1"], metrics["dev"]["f1"]
    assert last > max(first, 50.0)


def test_resume_after_a_kill_is_exact(tmp_path, data):
    cfg = toy_config(epochs=3)
    whole = engine.train(cfg, tmp_path / "whole", data=data)
    # Killed at batch 2 of epoch 2 (global step 7): the last checkpoint is step 6.
    dying = PreparedData(**{**vars(data), "splits": {**data.splits,
                            "train": DiesAfter(data.splits["train"], epoch=1, n=2)}})
    with pytest.raises(Killed):
        engine.train(cfg, tmp_path / "cut", data=dying)
    assert load_checkpoint(tmp_path / "cut" / "checkpoint.pt")["progress"]["global_step"] == 6
    resumed = engine.train(cfg, tmp_path / "cut", resume=True, data=data)
    for key in ("dev", "best_epoch", "best_dev", "steps"):
        assert resumed[key] == whole[key]
    for a, b in zip(resumed["history"], whole["history"], strict=True):
        assert (a["dev"], a["train_loss"], a["lr"]) == (b["dev"], b["train_loss"], b["lr"])
    final, uncut = state_of(tmp_path / "cut" / "model.pt"), state_of(tmp_path / "whole/model.pt")
    assert all(torch.equal(final[k], uncut[k]) for k in uncut)
    logs = [[{k: v for k, v in json.loads(line).items() if "seconds" not in k}
             for line in (tmp_path / run / "log.jsonl").read_text().splitlines()]
            for run in ("whole", "cut")]
    assert logs[0] == logs[1]


def test_resume_extends_a_finished_run_and_refuses_other_changes(tmp_path, data):
    engine.train(toy_config(epochs=1), tmp_path, data=data)
    with pytest.raises(UserError, match="lr: 0.05 -> 0.1"):
        engine.train(toy_config(epochs=2, lr=0.1), tmp_path, resume=True, data=data)
    # Naming a hyperparameter at its default is no change; another value is.
    default = hparam_defaults("toy")["dropout"]
    with pytest.raises(UserError, match="hparams"):
        engine.train(toy_config(epochs=2, hparams={"dropout": default / 2}), tmp_path,
                     resume=True, data=data)
    longer = engine.train(toy_config(epochs=2, hparams={"dropout": default}), tmp_path,
                          resume=True, data=data)
    assert longer["steps"] == 8 and [h["epoch"] for h in longer["history"]] == [1, 2]
    with pytest.raises(UserError, match="no checkpoint to resume"):
        engine.train(toy_config(), tmp_path / "empty", resume=True, data=data)


@pytest.mark.parametrize("optimizer", ["adam", "adadelta"])
def test_a_checkpoint_of_graphed_steps_resumes_on_a_cpu(tmp_path, data, optimizer):
    """A GPU session whose steps replay as CUDA graphs checkpoints a ``capturable`` optimizer
    (Adam also ``fused``; step counts and rates float32 tensors). A CPU resumes it with its own
    options (:func:`mrc_lib.train.on_this_device`), exactly as from its own checkpoint."""
    cfg = toy_config(epochs=1, optimizer=optimizer)
    engine.train(cfg, tmp_path / "cpu", data=data)
    state = load_checkpoint(tmp_path / "cpu" / "checkpoint.pt")
    saved = state["optimizer"]
    graphed = {**saved, "param_groups": [
        {**g, "capturable": True, "foreach": True, "lr": torch.tensor(g["lr"]),
         **({"fused": True} if "fused" in g else {})} for g in saved["param_groups"]],
        "state": {i: {k: v.float() if k == "step" else v for k, v in s.items()}
                  for i, s in saved["state"].items()}}
    (tmp_path / "gpu").mkdir()
    for name in ("config.json", "log.jsonl"):
        (tmp_path / "gpu" / name).write_bytes((tmp_path / "cpu" / name).read_bytes())
    save_checkpoint(tmp_path / "gpu" / "checkpoint.pt", {**state, "optimizer": graphed})
    longer = toy_config(epochs=2, optimizer=optimizer)
    ours = engine.train(longer, tmp_path / "cpu", resume=True, data=data)
    theirs = engine.train(longer, tmp_path / "gpu", resume=True, data=data)
    for a, b in zip(theirs["history"], ours["history"], strict=True):
        assert (a["dev"], a["train_loss"], a["lr"]) == (b["dev"], b["train_loss"], b["lr"])
    final, own = state_of(tmp_path / "gpu" / "model.pt"), state_of(tmp_path / "cpu/model.pt")
    assert all(torch.equal(final[k], own[k]) for k in own)
    groups = load_checkpoint(tmp_path / "gpu" / "checkpoint.pt")["optimizer"]["param_groups"]
    assert not any(g["capturable"] or g.get("fused") for g in groups)


def test_a_shorter_schedule_is_the_first_epochs_of_the_longer_run(tmp_path, data):
    """The matched baseline of ablations on a shorter schedule (``records.after_epochs``): a
    run of ``epochs=5`` is the first five epochs of the same config's longer run, plateau
    halving and warm-up included, so the longer run's record gives its scores."""
    cfg = dict(lr=0.5, plateau_factor=0.5, plateau_patience=1, checkpoint_every=None)
    whole = records.make_record(engine.train(toy_config(epochs=6, **cfg), tmp_path / "w",
                                             data=data), chapter="toy", run="whole")
    short = engine.train(toy_config(epochs=5, **cfg), tmp_path / "s", data=data)
    cut = records.after_epochs(whole, 5)
    for key in ("dev", "best_epoch", "best_dev", "epochs_run", "steps", "seconds_this_epoch"):
        assert cut[key] == short[key], key
    for a, b in zip(cut["history"], short["history"], strict=True):
        assert (a["dev"], a["train_loss"], a["lr"]) == (b["dev"], b["train_loss"], b["lr"])
    # the prefix holds a halving and a best epoch before its last
    assert cut["history"][-1]["lr"] < cut["history"][0]["lr"] and cut["best_epoch"] < 5
    assert cut["config"]["epochs"] == 5 and cut["after_epochs"] == 5
    assert whole["epochs_run"] == 6  # the record itself is left as it was
    with pytest.raises(UserError, match="toy/whole: 7 epoch"):
        records.after_epochs(whole, 7)


def test_padding_batches_to_a_multiple_trains_the_same(tmp_path, data):
    """``pad_multiple`` only adds padding: a reader that masks it (and no dropout, whose masks
    would be drawn over more positions) has the same losses and dev scores. Weights are not
    compared: the toy's biases have a true gradient of 0, and Adam scales its rounding noise,
    which the longer sums change, up to a full step."""
    off = {"hparams": {"dropout": 0.0}}
    plain = engine.train(toy_config(epochs=2, **off), tmp_path / "plain", data=data)
    padded = engine.train(toy_config(epochs=2, pad_multiple=16, **off), tmp_path / "padded",
                          data=data)
    for a, b in zip(padded["history"], plain["history"], strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)
        assert a["dev"] == pytest.approx(b["dev"])
    with pytest.raises(UserError, match="pad_multiple=0"):
        toy_config(pad_multiple=0)


def test_max_steps_stops_mid_epoch(tmp_path, data):
    metrics = engine.train(toy_config(max_steps=6), tmp_path, data=data)
    assert metrics["steps"] == 6 and [h["step"] for h in metrics["history"]] == [4, 6]


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, data):
    # Adam's first step moves every weight by about lr = 1e30: the next logits overflow.
    cfg = toy_config(lr=1e30, warmup_steps=0, ema_decay=None, checkpoint_every=1, log_every=1)
    with pytest.raises(UserError, match=r"training loss is (nan|inf) at step 2 \(epoch 1\).*"
                                        r"last good checkpoint.*is unchanged"):
        engine.train(cfg, tmp_path, data=data)
    state = load_checkpoint(tmp_path / "checkpoint.pt")
    assert state["progress"]["global_step"] == 1
    assert all(torch.isfinite(v).all() for v in state["model"].values())
    assert not (tmp_path / "metrics.json").exists()


def test_config_errors_surface_before_training(tmp_path, data):
    with pytest.raises(UserError, match="unknown hyperparameter"):
        engine.train(toy_config(hparams={"width": 3}), tmp_path, data=data)
    with pytest.raises(UserError, match="unknown model 'tiny'"):
        engine.train(toy_config(model="tiny"), tmp_path, data=data)


# --- the command line, on the tiny mirror of conftest.py -----------------------------------------


def test_cli_trains_resumes_and_predicts(mirror, tmp_path):
    from mrc_lib.cli import main

    out = tmp_path / "run"
    args = Namespace(model="bidaf", dataset="squad-v1.1", profile="smoke", out=str(out),
                     config=None, resume=False, record=str(tmp_path / "record.json"),
                     chapter="01_bidaf_qanet", run=None,
                     overrides=["epochs=1", "batch_size=2", "limits=null", "hparams.hidden=8",
                                "hparams.char_channels=8", "checkpoint_every=null"])
    first = engine.train_cli(args)
    assert first["steps"] == 4 and set(first["dev"]) == {"exact_match", "f1"}
    record = json.loads((tmp_path / "record.json").read_text())
    assert (record["chapter"], record["run"], record["dev"]) == ("01_bidaf_qanet", "run",
                                                                 first["dev"])
    longer = engine.train_cli(Namespace(**{**vars(args), "resume": True,
                                           "overrides": ["epochs=2"]}))
    assert longer["steps"] == 8 and longer["config"]["hparams"]["hidden"] == 8
    context = "Warsaw is the capital and largest city of Poland."
    [answer] = engine.predict_cli(Namespace(run=str(out), context=context,
                                            question="What is Warsaw?", file=None))
    assert answer["id"] == "0" and 0 < answer["probability"] <= 1
    assert context[answer["char_start"]:answer["char_end"]] == answer["answer"] != ""
    answers = engine.predict_cli(Namespace(run=str(out), context=None, question=None,
                                           file=str(mirror / "squad" / "dev-v1.1.json")))
    assert [a["id"] for a in answers] == ["d0", "d1"]
    assert main(["train", "--model", "bidaf", "--out", str(tmp_path / "x"),
                 "--set", "lr=fast"]) == 2
    assert main(["predict", "--run", str(out), "--context", context]) == 2


# --- real data ---------------------------------------------------------------------------------


@pytest.mark.real_data
@pytest.mark.slow
# Epochs: about 10 past the first epoch at 100 F1 (BiDAF's 39th, QANet's 32nd, seed 0).
@pytest.mark.parametrize("model, changes", [
    ("bidaf", dict(hparams={"hidden": 32, "char_channels": 32, "dropout": 0.0},
                   optimizer="adam", lr=1e-2, epochs=50)),
    ("qanet", dict(hparams={"d_model": 32, "heads": 2, "model_blocks": 2, "char_channels": 32,
                            "char_dim": 16, "dropout": 0.0, "char_dropout": 0.0,
                            "layer_dropout": 0.0}, optimizer="adam", lr=3e-3, epochs=45)),
])
def test_overfits_32_real_questions(real_squad, tmp_path, model, changes):
    first = real_squad.splits["train"].subset(np.arange(32))
    data = PreparedData(**{**vars(real_squad), "splits": {"train": first, "dev": first}})
    cfg = TrainConfig(model=model, dataset="squad-v1.1", batch_size=32,
                      ema_decay=None, device="cpu", log_every=10, **changes)
    metrics = engine.train(cfg, tmp_path, data=data)
    assert metrics["dev"]["f1"] >= 90.0  # the official metric, on the training questions


# --- checkpoints in parts, frozen vectors left out, the deadline stop ----------------------------


def test_checkpoint_parts_split_join_and_replace(tmp_path):
    from mrc_lib.checkpoint import checkpoint_files

    path = tmp_path / "checkpoint.pt"
    state = {"w": torch.randn(1000, generator=torch.Generator().manual_seed(0)), "step": 1}
    save_checkpoint(path, state, part_bytes=1000)
    files = checkpoint_files(path)
    assert len(files) > 4 and all(f.stat().st_size <= 1000 for f in files[1:])
    loaded = load_checkpoint(path)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 1
    save_checkpoint(path, {**state, "step": 2}, part_bytes=1000)  # the old parts go
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f.name for f in checkpoint_files(path))
    assert load_checkpoint(path)["step"] == 2


def test_split_checkpoints_are_packed_bit_for_bit_and_smaller(tmp_path):
    from mrc_lib.checkpoint import (
        CODEC_KEY,
        PACKED_RATIO,
        PARTS_KEY,
        checkpoint_files,
        from_planes,
        to_planes,
    )

    odd = torch.tensor([0.0, -0.0, float("nan"), float("inf"), 1e-45, -3.5])
    payload = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)  # a NaN's bits
    state = {"odd": odd, "payload": payload, "half": odd.half(), "bf16": odd.bfloat16(),
             "double": odd.double(), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
             "ints": torch.arange(5), "nested": [(torch.ones(2, 2), "a"), {"b": None}]}
    unpacked = from_planes(to_planes(state))
    for key in ("odd", "payload", "half", "bf16", "double", "scalar", "empty", "ints"):
        a, b = state[key], unpacked[key]
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    assert type(unpacked["nested"][0]) is tuple and unpacked["nested"][0][1] == "a"
    assert torch.equal(unpacked["nested"][0][0], torch.ones(2, 2))

    # A trainer's state (weights and Adam's moments after a few steps) packs within the bound
    # the queue plans with, and loads back bit for bit.
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(20):
        optimizer.zero_grad()
        model(torch.randn(32, 64)).square().mean().backward()
        optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    raw = sum(t.nbytes for t in (*state["model"].values(),
                                 *(v for s in optimizer.state.values() for v in s.values())))
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, state, part_bytes=2**20)
    packed = sum(f.stat().st_size for f in checkpoint_files(path)[1:])
    assert packed < PACKED_RATIO * raw
    loaded = load_checkpoint(path)
    for k, v in state["model"].items():
        assert torch.equal(loaded["model"][k], v)
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg_sq"],
                       optimizer.state_dict()["state"][0]["exp_avg_sq"])

    # A split checkpoint of an older version (parts not packed) still loads; an unknown
    # packing is a one-line error.
    manifest = torch.load(path, weights_only=True)
    old = tmp_path / "old.pt"
    blob = io.BytesIO()
    torch.save({"w": torch.ones(3)}, blob)
    parts = write_parts(blob.getvalue(), tmp_path, "old.pt.x", 2**20)
    torch.save({PARTS_KEY: parts}, old)
    assert torch.equal(load_checkpoint(old)["w"], torch.ones(3))
    torch.save({**manifest, CODEC_KEY: "zstd"}, path)
    with pytest.raises(UserError, match="packed as 'zstd'"):
        load_checkpoint(path)


@pytest.mark.parametrize("damage, message", [
    (lambda f: f.write_bytes(f.read_bytes()[:-1]), "checkpoint part corrupt"),
    (lambda f: f.write_bytes(b"x" + f.read_bytes()[1:]), "checkpoint part corrupt"),
    (lambda f: f.unlink(), "checkpoint part missing"),
])
def test_a_damaged_part_is_a_one_line_error_naming_it(tmp_path, damage, message):
    from mrc_lib.checkpoint import checkpoint_files

    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"w": torch.randn(600, generator=torch.Generator().manual_seed(0))},
                    part_bytes=1000)
    part = checkpoint_files(path)[2]
    damage(part)
    with pytest.raises(UserError, match=message) as e:
        load_checkpoint(path)
    assert str(part) in str(e.value) and "\n" not in str(e.value)
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="not a readable checkpoint") as e:
        load_checkpoint(path)
    assert "\n" not in str(e.value)


def test_checkpoints_leave_out_the_fixed_vectors_and_resume(mirror, tmp_path):
    from mrc_lib.train import load_data, rebuilt_from_data

    cfg = resolve_config("bidaf", profile="smoke", overrides=[
        "epochs=1", "batch_size=2", "limits=null", "hparams.hidden=8",
        "hparams.char_channels=8", "max_steps=2"])
    data = load_data(cfg)
    engine.train(cfg, tmp_path, data=data)
    saved = load_checkpoint(tmp_path / "checkpoint.pt")["model"]
    model = build_model("bidaf", data.vocab, **cfg.hparams)
    skipped = rebuilt_from_data(model)
    assert skipped and not skipped & set(saved)
    assert set(saved) | skipped == set(model.state_dict())
    longer = TrainConfig.from_dict({**cfg.to_dict(), "max_steps": 3})
    assert engine.train(longer, tmp_path, resume=True, data=data)["steps"] == 3


def last_event(run: Path) -> dict:
    return json.loads((run / "log.jsonl").read_text().splitlines()[-1])


def assert_resumes_as_whole(cfg: TrainConfig, run: Path, data, whole: dict) -> None:
    """Resumed to its end, the stopped ``run`` has the uninterrupted run's results."""
    resumed = engine.train(cfg, run, resume=True, data=data)
    assert resumed["complete"]
    for key in ("dev", "best_dev", "steps"):
        assert resumed[key] == whole[key]
    for a, b in zip(resumed["history"], whole["history"], strict=True):
        assert (a["dev"], a["train_loss"], a["lr"]) == (b["dev"], b["train_loss"], b["lr"])


@pytest.mark.parametrize("stop_at", [1, 4])  # mid-epoch; the epoch's last step, before its eval
def test_a_deadline_stops_cleanly_and_the_resume_is_exact(tmp_path, data, monkeypatch, stop_at):
    cfg = toy_config(epochs=2, checkpoint_every=None)
    whole = engine.train(cfg, tmp_path / "whole", data=data)
    assert whole["complete"]
    steps = iter(range(1, 100))  # time.time() is read once after every step: step k -> k
    monkeypatch.setattr(engine.time, "time", lambda: next(steps))
    cut = engine.train(cfg, tmp_path / "cut", data=data, deadline=stop_at)
    monkeypatch.undo()
    assert not cut["complete"] and cut["steps"] == stop_at and cut["history"] == []
    state = load_checkpoint(tmp_path / "cut" / "checkpoint.pt")
    assert state["progress"]["global_step"] == stop_at
    assert last_event(tmp_path / "cut") == {"event": "deadline", "step": stop_at}
    assert_resumes_as_whole(cfg, tmp_path / "cut", data, whole)


def signal_after(monkeypatch, step: int, signum: int, times: int = 1) -> None:
    """Send this process ``signum`` (``times`` times) right after training step ``step``."""
    taken = iter(range(1, 100))
    original = engine.Trainer._step

    def step_then_signal(self, batch):
        loss = original(self, batch)
        if next(taken) == step:
            for _ in range(times):
                os.kill(os.getpid(), signum)
        return loss

    monkeypatch.setattr(engine.Trainer, "_step", step_then_signal)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_cleanly_after_its_step_and_the_resume_is_exact(
        tmp_path, data, monkeypatch, capsys, signum):
    """SIGTERM (the packed runner stopped) or Ctrl-C stops a run as a deadline does."""
    cfg = toy_config(epochs=2, checkpoint_every=None)
    whole = engine.train(cfg, tmp_path / "whole", data=data)
    before = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)]
    signal_after(monkeypatch, 3, signum)
    cut = engine.train(cfg, tmp_path / "cut", data=data, signals=True)
    monkeypatch.undo()
    assert [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)] == before
    assert not cut["complete"] and cut["steps"] == 3
    assert load_checkpoint(tmp_path / "cut" / "checkpoint.pt")["progress"]["global_step"] == 3
    name = signal.Signals(signum).name
    assert last_event(tmp_path / "cut") == {"event": "signal", "signal": name, "step": 3}
    assert f"{name}: stopped at step 3 with a checkpoint in {tmp_path / 'cut'}; --resume" \
        in capsys.readouterr().err
    assert_resumes_as_whole(cfg, tmp_path / "cut", data, whole)


@pytest.mark.parametrize("signals, times", [(True, 2), (False, 1)])
def test_a_second_ctrl_c_or_one_in_a_notebook_interrupts_at_once(tmp_path, data, monkeypatch,
                                                                 signals, times):
    """Only the command line's runs stop on signals: a notebook's interrupt stops its cell."""
    cfg = toy_config(epochs=2, checkpoint_every=None)
    signal_after(monkeypatch, 2, signal.SIGINT, times=times)
    with pytest.raises(KeyboardInterrupt):
        engine.train(cfg, tmp_path, data=data, signals=signals)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert not (tmp_path / "checkpoint.pt").exists()


def test_each_session_notes_where_it_trained_from_its_first_step(tmp_path, data, monkeypatch):
    """A run resumed on another machine names both (records.trained_on): every session adds
    its device, device type, RNN precision, torch, CUDA and commit at the step it starts from;
    a checkpoint older than the list starts it with an unrecorded device at step 0."""
    cfg = toy_config(epochs=2, checkpoint_every=None)
    steps = iter(range(1, 100))
    monkeypatch.setattr(engine.time, "time", lambda: next(steps))
    cut = engine.train(cfg, tmp_path / "cut", data=data, deadline=2)
    monkeypatch.undo()
    first = {"step": 0, "device": engine.device_name(torch.device("cpu")), "device_type": "cpu",
             "rnn_precision": None, "torch": str(torch.__version__), "cuda": torch.version.cuda,
             "git_commit": git_commit()}
    assert cut["sessions"] == [first]
    monkeypatch.setattr(engine, "device_name", lambda device: "Another CPU")
    resumed = engine.train(cfg, tmp_path / "cut", resume=True, data=data)
    assert resumed["sessions"] == [first, {**first, "step": 2, "device": "Another CPU"}]
    assert load_checkpoint(tmp_path / "cut" / "checkpoint.pt")["progress"]["sessions"] == \
        resumed["sessions"]
    # A checkpoint written before sessions were noted.
    path = tmp_path / "cut" / "checkpoint.pt"
    state = load_checkpoint(path)
    del state["progress"]["sessions"]
    save_checkpoint(path, state)
    again = engine.train(toy_config(epochs=3, checkpoint_every=None), tmp_path / "cut",
                         resume=True, data=data)
    assert [s["step"] for s in again["sessions"]] == [0, resumed["steps"]]
    assert again["sessions"][0] == {"step": 0, "device": None}


@pytest.mark.parametrize("record_steps, before", [
    (1, None),  # a checkpoint older than the sessions list
    (1, [{"step": 0, "device": None}, {"step": 2, "device": "Old CPU"}]),  # resumed before
    (2, None),  # the record was written at the checkpoint's step
])
def test_steps_before_sessions_were_noted_take_the_device_of_that_times_record(
        tmp_path, data, monkeypatch, record_steps, before):
    """A checkpoint older than the sessions list (or resumed by code that noted its first
    steps as an unrecorded device) takes the device of the folder's ``metrics.json`` of that
    time, one without ``sessions``, for that record's steps; steps after them stay
    unrecorded. A record with sessions, or none, leaves the unrecorded device."""
    steps = iter(range(1, 100))
    monkeypatch.setattr(engine.time, "time", lambda: next(steps))
    engine.train(toy_config(epochs=2, checkpoint_every=None), tmp_path, data=data, deadline=2)
    monkeypatch.undo()
    path = tmp_path / "checkpoint.pt"
    state = load_checkpoint(path)
    assert state["progress"]["global_step"] == 2
    if before is None:
        del state["progress"]["sessions"]
    else:
        state["progress"]["sessions"] = before
    save_checkpoint(path, state)
    h200 = {"device": "NVIDIA H200", "device_type": "cuda", "rnn_precision": "TF32",
            "torch": "2.11.0+cu130", "cuda": "13.0", "git_commit": "67e4dea"}
    (tmp_path / "metrics.json").write_text(json.dumps({"steps": record_steps, **h200,
                                                       "sessions": None}))
    monkeypatch.setattr(engine, "device_name", lambda device: "Another CPU")
    resumed = engine.train(toy_config(epochs=2, checkpoint_every=None), tmp_path, resume=True,
                           data=data)
    unrecorded = [{"step": 1, "device": None}] if record_steps < 2 else []
    assert [{"step": 0, **h200}, *unrecorded, *(before or [])[1:]] == resumed["sessions"][:-1]
    assert resumed["sessions"][-1]["device"] == "Another CPU"
    where = records.trained_on(resumed)
    assert where.startswith(f"NVIDIA H200 (TF32) for steps 1-{record_steps} and ")
    assert ("an unrecorded device for steps 2-2" in where) == (record_steps < 2)
    # A record that notes sessions (written by this code) leaves the unrecorded device.
    state = load_checkpoint(path)
    state["progress"]["sessions"] = [{"step": 0, "device": None}]
    save_checkpoint(path, state)
    again = engine.train(toy_config(epochs=3, checkpoint_every=None), tmp_path, resume=True,
                         data=data)
    assert again["sessions"][0] == {"step": 0, "device": None}


def test_an_unreadable_record_of_a_run_before_sessions_is_a_one_line_error(tmp_path, data):
    engine.train(toy_config(epochs=1, checkpoint_every=None), tmp_path, data=data)
    path = tmp_path / "checkpoint.pt"
    state = load_checkpoint(path)
    del state["progress"]["sessions"]
    save_checkpoint(path, state)
    (tmp_path / "metrics.json").write_text("{not json")
    with pytest.raises(UserError, match=r"metrics\.json: not a readable metrics record"):
        engine.train(toy_config(epochs=2, checkpoint_every=None), tmp_path, resume=True,
                     data=data)


def test_peak_memory_is_the_highest_of_the_sessions_a_run_spans(tmp_path, data, monkeypatch):
    """A resumed run reports the peak of every process it ran in, not only the last one's."""
    cfg = toy_config(epochs=2, checkpoint_every=None)
    steps = iter(range(1, 100))
    monkeypatch.setattr(engine.time, "time", lambda: next(steps))
    monkeypatch.setattr(engine, "peak_memory_bytes", lambda device: 5 * 2**30)
    cut = engine.train(cfg, tmp_path, data=data, deadline=2)
    assert not cut["complete"] and cut["peak_memory_bytes"] == 5 * 2**30
    assert load_checkpoint(tmp_path / "checkpoint.pt")["progress"]["peak_memory_bytes"] == \
        5 * 2**30
    monkeypatch.undo()
    monkeypatch.setattr(engine, "peak_memory_bytes", lambda device: 3 * 2**30)
    resumed = engine.train(cfg, tmp_path, resume=True, data=data)
    assert resumed["complete"] and resumed["peak_memory_bytes"] == 5 * 2**30


def test_without_epoch_checkpoints_only_a_deadline_writes_one_and_the_resume_is_exact(
        tmp_path, data, monkeypatch):
    """``epoch_checkpoints=false`` (a GPU session's runner): a finished run leaves no
    checkpoint; a run cut in its second epoch has the deadline's, and resuming it (the setting
    may change on resume) ends where the uninterrupted run with epoch checkpoints ends."""
    cfg = toy_config(epochs=2, checkpoint_every=None)
    whole = engine.train(cfg, tmp_path / "whole", data=data)
    quiet = toy_config(epochs=2, checkpoint_every=None, epoch_checkpoints=False)
    done = engine.train(quiet, tmp_path / "quiet", data=data)
    assert done["complete"] and not (tmp_path / "quiet" / "checkpoint.pt").exists()
    assert (done["dev"], done["history"][-1]["train_loss"]) == \
        (whole["dev"], whole["history"][-1]["train_loss"])
    stop_at = whole["steps"] // 2 + 1  # into the second epoch, inside a log_every window
    steps = iter(range(1, 100))
    monkeypatch.setattr(engine.time, "time", lambda: next(steps))
    cut = engine.train(quiet, tmp_path / "cut", data=data, deadline=stop_at)
    monkeypatch.undo()
    assert not cut["complete"] and len(cut["history"]) == 1
    state = load_checkpoint(tmp_path / "cut" / "checkpoint.pt")
    assert state["progress"]["global_step"] == stop_at
    resumed = engine.train(cfg, tmp_path / "cut", resume=True, data=data)
    for key in ("dev", "best_dev", "steps"):
        assert resumed[key] == whole[key]
    for a, b in zip(resumed["history"], whole["history"], strict=True):
        assert (a["dev"], a["train_loss"], a["lr"]) == (b["dev"], b["train_loss"], b["lr"])


@pytest.mark.parametrize("model, hparams", [
    ("bidaf", {"hidden": 8, "char_channels": 8}),
    ("qanet", {"d_model": 8, "heads": 2, "model_blocks": 1, "char_dim": 4, "char_channels": 8}),
])
def test_attention_analysis_payload_is_the_forward_attention(mirror, model, hparams):
    from mrc_lib.config import resolve_config
    from mrc_lib.train import load_data

    data = load_data(resolve_config(model, overrides=["limits=null"]))
    dev = data.splits["dev"]
    reader = build_model(model, data.vocab, **hparams).eval()
    with torch.no_grad():
        payload = reader.analysis(data, None)["attention"]
        att = reader({k: v for k, v in dev.collate(np.array([1])).items()})["attention"][0]
    assert len(payload) == 2 and payload[1]["question"] == dev.question(1)
    assert payload[1]["context_tokens"] == list(dev.tokens(1))[:40]
    q = len(dev.tokens(1, "q"))
    got = torch.tensor(payload[1]["attention"])
    assert got.shape == (min(40, len(dev.tokens(1))), q)
    assert torch.allclose(got, att[:got.shape[0], :q], atol=1e-4)
    assert len(json.dumps(payload)) < 200_000


def test_compile_compiles_a_readers_regions_in_place_or_the_whole_reader():
    from mrc_lib.bench import SyntheticVocab
    from mrc_lib.models.dynsa import DynSA
    from mrc_lib.nn import EncoderBlock

    vocab = SyntheticVocab.random(size=2_000)
    for name, region in (("qanet", EncoderBlock), ("dynsan", DynSA)):
        model = build_model(name, vocab, **resolve_config(name, profile="smoke").hparams)
        keys = list(model.state_dict())
        assert engine.compiled(model) is model  # nothing compiles until the first call
        blocks = [m for m in model.modules() if isinstance(m, region)]
        assert blocks and all(m._compiled_call_impl is not None for m in blocks)
        assert model._compiled_call_impl is None and list(model.state_dict()) == keys
        # compile_whole: the reader itself, as one graph.
        whole = build_model(name, vocab, **resolve_config(name, profile="smoke").hparams)
        assert isinstance(engine.compiled(whole, whole=True),
                          torch._dynamo.eval_frame.OptimizedModule)
        assert all(m._compiled_call_impl is None for m in whole.modules()
                   if isinstance(m, region))
    bidaf = build_model("bidaf", vocab, **resolve_config("bidaf", profile="smoke").hparams)
    assert isinstance(engine.compiled(bidaf), torch._dynamo.eval_frame.OptimizedModule)


def test_cudagraphs_mode_trains_as_eager():
    """``compile_mode: cudagraphs`` really compiles (torch.compile's ``cudagraphs`` backend;
    on a CPU it skips the graphs and runs what AOT autograd traced): the trainer's steps give
    eager's losses."""
    from mrc_lib.bench import setup

    losses = {}
    for mode in ("eager", "cudagraphs"):
        s = setup("bidaf", "smoke", ["device=cpu", "batch_size=2"], 2_000)
        net = s.model if mode == "eager" else engine.compiled(s.model, mode=mode, whole=True)
        cfg = resolve_config("bidaf", profile="smoke", overrides=[
            "device=cpu", "batch_size=2", "compile=true", "compile_mode=cudagraphs"]) \
            if mode != "eager" else s.cfg
        losses[mode] = [float(engine.train_step(net, s.batch(9, seed=k), s.optimizer, cfg,
                                                s.device)) for k in range(2)]
    torch._dynamo.reset()
    assert losses["cudagraphs"] == pytest.approx(losses["eager"], rel=1e-5)


def test_cudagraphs_backend_keys_each_recording_by_its_sizes(monkeypatch):
    """Under symbolic shapes torch's own ``cudagraphs`` backend keys no recording by the sizes
    it was recorded at, and replays the first at every size (on an H100: "The size of tensor a
    (140) must match the size of tensor b (400)"); :func:`engine.cudagraphs_by_size` keys each.
    On the CPU the recorder is a stand-in that keys as torch's does (by the inputs that are
    ints when it is built) and refuses a key seen before at other shapes."""
    import torch._dynamo.backends.cudagraphs as backend
    import torch._inductor.cudagraph_trees as trees

    keys = []

    def recorder(model, inputs, static_input_idxs, **kwargs):
        at = [i for i, v in enumerate(inputs) if isinstance(v, int)]
        shapes_of = {}

        def replay(args):
            key = tuple(args[i] for i in at)
            shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
            if shapes_of.setdefault(key, shapes) != shapes:
                raise RuntimeError(f"recorded at {shapes_of[key]}, replayed at {shapes}")
            keys.append(key)
            return model(args)
        return replay

    monkeypatch.setattr(trees, "cudagraphify_impl", recorder)
    monkeypatch.setattr(backend, "check_for_skip", lambda *args: None)  # it refuses the CPU
    monkeypatch.setattr(backend, "get_device_index", lambda gm: 0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    def steps(compiled_net):
        for length in (3, 5, 3):
            compiled_net(torch.randn(2, length, 4)).sum().backward()

    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="replayed at"):
        steps(torch.compile(net, backend="cudagraphs", dynamic=True))
    torch._dynamo.reset()
    keys.clear()
    steps(engine.compiled(net, mode="cudagraphs"))
    torch._dynamo.reset()
    # the forward's and the backward's recorder each record at 3 and 5 tokens, then replay 3
    assert len(set(keys)) == 4 and keys[4:] == keys[:2]


def test_compiled_backward_computes_as_eager_backward_under_autocast():
    """``loss.backward()`` runs after the autocast block in :func:`engine.train_step`, so a
    compiled reader's backward is traced without autocast too
    (:func:`engine.backward_outside_autocast`): torch's default traces it under the forward's,
    and a full-precision region's gradient then differs from eager's."""

    class Region(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(64, 64))

        def forward(self, x):
            with torch.autocast("cpu", enabled=False):
                return x.float() @ self.w.float().T

    torch.manual_seed(0)
    region, x = Region(), torch.randn(4, 64)
    grads = []
    for net in (region, engine.compiled(region, mode="cudagraphs")):
        region.w.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = net(x)
        y.sum().backward()
        grads.append(region.w.grad.clone())
    torch._dynamo.reset()
    assert torch.equal(grads[0], grads[1])


def test_compile_mode_reaches_torch_compile_and_marks_each_graph_step(monkeypatch):
    """``compile_mode`` is torch.compile's ``mode`` (``default``: its own default, None), for a
    whole reader and for regions, and ``cudagraphs`` its backend; under both of these every
    training step marks a new CUDA-graph step."""
    from mrc_lib.bench import SyntheticVocab, synthetic_batch

    calls, steps = [], []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: steps.append(1))
    vocab = SyntheticVocab.random(size=2_000)
    for name in ("bidaf", "qanet"):
        model = build_model(name, vocab, **resolve_config(name, profile="smoke").hparams)
        for mode in ("default", "reduce-overhead", "cudagraphs"):
            engine.compiled(model, mode=mode)
    assert {kw.get("mode") for kw in calls if "backend" not in kw} == {None, "reduce-overhead"}
    backend = [kw for kw in calls if "backend" in kw]
    assert backend and all(kw == {"dynamic": True, "backend": engine.cudagraphs_by_size}
                           for kw in backend)
    assert all(kw["dynamic"] for kw in calls)
    # Floats are constants of the graphs: unspecialized, DynSAN's β would be a CPU input, on
    # which no CUDA graph is recorded (benchmarks/cudagraph_check.py).
    assert torch._dynamo.config.specialize_float
    assert torch._functorch.config.backward_pass_autocast == "off"
    model = build_model("bidaf", vocab, **resolve_config("bidaf", profile="smoke").hparams)
    batch = synthetic_batch(vocab, 2, 9)
    for compile_mode, marks in (("default", 0), ("reduce-overhead", 1), ("cudagraphs", 1)):
        cfg = resolve_config("bidaf", profile="smoke",
                             overrides=["compile=true", f"compile_mode={compile_mode}"])
        steps.clear()
        engine.train_step(model, batch, engine.build_optimizer(cfg, model, torch.device("cpu")),
                          cfg, torch.device("cpu"))
        assert len(steps) == marks


def test_a_worker_given_a_share_of_the_gpu_holds_its_allocator_to_it(monkeypatch):
    fractions = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(torch, "set_float32_matmul_precision", lambda precision: None)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, index: fractions.append((fraction, index)))
    monkeypatch.delenv(engine.GPU_SHARE, raising=False)
    assert engine.resolve_device("cuda") == torch.device("cuda", 0) and fractions == []
    monkeypatch.setenv(engine.GPU_SHARE, "0.2375")
    engine.resolve_device("cuda")
    assert fractions == [(0.2375, 0)]


def test_a_step_drops_the_last_steps_gradients_before_its_forward():
    from mrc_lib import bench

    s = bench.setup("bidaf", "smoke", ["device=cpu", "batch_size=2"], vocab_size=500)
    optimizer = torch.optim.Adam(p for p in s.model.parameters() if p.requires_grad)
    before_forward = []
    s.model.register_forward_pre_hook(lambda m, args: before_forward.append(
        [p.grad is None for p in m.parameters()]))
    batch = bench.synthetic_batch(s.vocab, 2, 12)
    for _ in range(2):
        engine.train_step(s.model, batch, optimizer, s.cfg, s.device)
    assert all(before_forward[1]) and any(p.grad is not None for p in s.model.parameters())
