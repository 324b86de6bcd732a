"""The tasks of :mod:`mrc_lib.tasks`: defaults per dataset, objectives, losses, the choice
evaluation and the score each task ranks by, on tiny tensors and tiny in-memory cloze sets."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mrc_lib import train as engine
from mrc_lib.config import CHOICES, TrainConfig, resolve_config
from mrc_lib.data.choice import ClozeSplit
from mrc_lib.data.cloze import PAD, StringTable, encode_examples
from mrc_lib.errors import UserError
from mrc_lib.models import MODELS
from mrc_lib.tasks import TASKS, Cloze, MultipleChoice, Span, SpanNoAnswer, get_task
from tests.test_cloze import make_examples, synthetic_article

# --- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize("dataset, task", [
    ("squad-v1.1", "span"), ("squad-v2.0", "span_na"), ("wiki-cloze", "cloze"),
    ("toy", "span"),  # any other dataset: span extraction
])
def test_task_defaults_to_the_datasets_own(dataset, task):
    cfg = TrainConfig(model="bidaf", dataset=dataset)
    assert cfg.task == task
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_an_explicit_task_is_kept_and_recorded():
    cfg = TrainConfig(model="dynsan_mc", dataset="wiki-cloze", task="multiple_choice",
                      data_options={"subset": "NE"})
    assert cfg.task == "multiple_choice" and cfg.data_options == {"subset": "NE"}
    assert cfg.to_dict()["task"] == "multiple_choice"
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert TrainConfig(model="bidaf", dataset="squad-v2.0", task="span").task == "span"


def test_profiles_name_their_task():
    assert resolve_config("ea_reader", profile="smoke").task == "cloze"
    assert resolve_config("dynsan_mc", profile="smoke").task == "multiple_choice"
    assert resolve_config("bidaf", profile="smoke").task == "span"
    cfg = resolve_config("ea_reader", profile="smoke", overrides=["data_options.subset=ANON"])
    assert cfg.data_options["subset"] == "ANON"


def test_unknown_task_is_a_user_error():
    with pytest.raises(UserError, match="task='qa': expected one of span, span_na"):
        TrainConfig(model="bidaf", task="qa")
    with pytest.raises(UserError, match="task='qa'"):
        resolve_config("bidaf", overrides=["task=qa"])
    with pytest.raises(UserError, match="unknown task 'qa'; known: span, span_na"):
        get_task("qa")


def test_every_configurable_task_is_registered():
    assert set(TASKS) == set(CHOICES["task"])
    assert all(get_task(name).name == name for name in TASKS)
    assert isinstance(get_task("span"), Span) and isinstance(get_task("span_na"), SpanNoAnswer)
    assert isinstance(get_task("cloze"), Cloze)
    assert isinstance(get_task("multiple_choice"), MultipleChoice)


@pytest.mark.parametrize("task", ["cloze", "multiple_choice"])
def test_wiki_cloze_needs_a_subset_before_reading_any_data(task):
    cfg = TrainConfig(model="ea_reader", dataset="wiki-cloze", task=task,
                      data_options={"articles": {"train": 1}})
    with pytest.raises(UserError, match="needs data_options.subset"):
        get_task(task).load(cfg)
    with pytest.raises(UserError, match="needs data_options.subset"):
        engine.load_data(cfg)  # the trainer's loader is the task's


def test_a_choice_task_reads_only_wiki_cloze():
    cfg = TrainConfig(model="ea_reader", dataset="squad-v1.1", task="cloze",
                      data_options={"subset": "NE"})
    with pytest.raises(UserError, match="reads dataset 'wiki-cloze', not 'squad-v1.1'"):
        get_task("cloze").load(cfg)


def test_readers_of_every_task_are_registered():
    assert {"bidaf", "ea_reader", "dynsan", "dynsan_mc"} <= set(MODELS)


# --- objectives and the training loss --------------------------------------------------------


def span_batch():
    torch.manual_seed(0)
    out = {"start_logits": torch.randn(3, 5), "end_logits": torch.randn(3, 5)}
    batch = {"y1": torch.tensor([1, 0, 2]), "y2": torch.tensor([3, 0, 4]),
             "has_answer": torch.tensor([True, False, True])}
    return out, batch


def nll(logits: torch.Tensor, target: int) -> torch.Tensor:
    return -logits.log_softmax(-1)[target]


def test_span_objective_is_eq6_over_the_answerable_rows_only():
    out, batch = span_batch()
    s, e = out["start_logits"], out["end_logits"]
    expected = (nll(s[0], 1) + nll(s[2], 2) + nll(e[0], 3) + nll(e[2], 4)) / 2  # 2 answerable
    torch.testing.assert_close(get_task("span").objective(out, batch), expected)
    # The unanswerable row's targets (and logits) do not matter.
    batch["y1"][1], batch["y2"][1] = 4, 4
    out["start_logits"][1] += 100 * torch.arange(5.0)
    torch.testing.assert_close(get_task("span").objective(out, batch), expected)
    # na_logits are not the span task's business.
    torch.testing.assert_close(get_task("span").objective(
        {**out, "na_logits": torch.randn(3)}, batch), expected)


def test_span_na_adds_the_no_answer_bce_only_with_na_logits():
    out, batch = span_batch()
    span, span_na = get_task("span"), get_task("span_na")
    torch.testing.assert_close(span_na.objective(out, batch), span.objective(out, batch))
    na = torch.tensor([-1.0, 2.0, 0.5])
    with_na = {**out, "na_logits": na}
    p = torch.sigmoid(na)
    bce = -(torch.log(1 - p[0]) + torch.log(p[1]) + torch.log(1 - p[2])) / 3
    torch.testing.assert_close(span_na.objective(with_na, batch),
                               span.objective(out, batch) + bce)
    # No answerable row: the BCE alone (the span term is 0, where cross-entropy's mean is NaN).
    none = {**batch, "has_answer": torch.zeros(3, dtype=torch.bool)}
    loss = span_na.objective(with_na, none)
    torch.testing.assert_close(loss, F.binary_cross_entropy_with_logits(na, torch.ones(3)))
    assert torch.isfinite(loss)


@pytest.mark.parametrize("task", ["span", "span_na"])
def test_loss_adds_aux_and_a_readers_own_loss_replaces_the_objective(task):
    out, batch = span_batch()
    t = get_task(task)
    objective = t.objective(out, batch)
    aux, own = torch.tensor(0.25), torch.tensor(1.5)
    torch.testing.assert_close(t.loss(out, batch), objective)
    torch.testing.assert_close(t.loss({**out, "aux_loss": aux}, batch), objective + aux)
    torch.testing.assert_close(t.loss({**out, "loss": own}, batch), own)
    torch.testing.assert_close(t.loss({**out, "loss": own, "aux_loss": aux}, batch), own + aux)
    # A reader's own loss needs no span outputs at all; a bfloat16 one comes back float32.
    got = t.loss({"loss": own.bfloat16(), "aux_loss": aux.bfloat16()}, batch)
    assert got.dtype == torch.float32 and got.item() == pytest.approx(1.75)


@pytest.mark.parametrize("task", ["cloze", "multiple_choice"])
def test_choice_objective_is_the_answer_nll_over_reachable_rows(task):
    t = get_task(task)
    scores = torch.tensor([[1.0, 2.0, 0.0], [0.5, 0.0, 0.0], [3.0, 1.0, -1.0]],
                          requires_grad=True)
    present = torch.tensor([[True, True, True], [True, False, False], [True, True, False]])
    log_p = scores.masked_fill(~present, float("-inf")).log_softmax(-1)
    out, batch = {"candidate_log_probs": log_p}, {"answer": torch.tensor([1, 2, 0])}
    expected = -(log_p[0, 1] + log_p[2, 0]) / 2  # row 1: its answer is not in the document
    torch.testing.assert_close(t.objective(out, batch), expected)
    aux = torch.tensor(0.5)
    torch.testing.assert_close(t.loss({**out, "aux_loss": aux}, batch), expected + aux)
    unreachable = t.loss({"candidate_log_probs": log_p[1:2]}, {"answer": torch.tensor([1])})
    assert unreachable.item() == 0 and unreachable.requires_grad  # kept in the graph
    unreachable.backward()
    assert torch.isfinite(scores.grad).all() and (scores.grad == 0).all()


# --- the choice evaluation ---------------------------------------------------------------------


def cloze_split(limit=None) -> ClozeSplit:
    table = StringTable()
    data = encode_examples(make_examples(synthetic_article(16), (0, 0, 1), "NE", stride=1,
                                         doc_sentences=8), table)
    return ClozeSplit(data, np.arange(len(table.words)), "valid", limit)


class EvenRight(nn.Module):
    """Chooses the answer for even-numbered questions and the next candidate for odd ones."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, batch):
        real = batch["cand_forms"] != PAD
        n = real.sum(-1)
        choice = torch.where(batch["idx"] % 2 == 0, batch["answer"], (batch["answer"] + 1) % n)
        scores = torch.zeros(real.shape).scatter(1, choice[:, None], 5.0) + self.w
        return {"candidate_log_probs": scores.masked_fill(~real, float("-inf")).log_softmax(-1)}


@pytest.mark.parametrize("limit", [None, 5])
def test_choice_evaluate_accuracy_chance_and_predictions(limit):
    split = cloze_split(limit)
    n = len(split)
    assert n == (limit or len(split.data)) and n >= 5
    model = EvenRight().train()
    cfg = TrainConfig(model="ea_reader", dataset="wiki-cloze", eval_batch_size=3, device="cpu")
    evaluation = get_task("cloze").evaluate(model, split, cfg, torch.device("cpu"))
    assert not model.training
    scores = evaluation.scores
    assert scores["questions"] == n
    assert scores["accuracy"] == pytest.approx(100 * len(range(0, n, 2)) / n)
    assert scores["chance"] == pytest.approx(
        100 * np.mean([1 / len(split.candidates(i)) for i in range(n)]))
    assert 0 < scores["chance"] < 100
    predictions = evaluation.files["predictions.json"]
    assert list(evaluation.files) == ["predictions.json"]
    assert sorted(predictions) == sorted(split.qids) == sorted(f"valid-{i}" for i in range(n))
    for i, qid in enumerate(split.qids):
        assert predictions[qid] in split.candidates(i)
        assert (predictions[qid] == split.answer(i)) == (i % 2 == 0)
    assert get_task("cloze").score(scores) == scores["accuracy"]


def test_choice_batches_are_deterministic_and_skip_for_a_resume():
    split = cloze_split()
    n = len(split)
    ordered = [b["idx"].tolist() for b in split.batches(3, shuffle=False)]
    assert sum(ordered, []) == list(range(n)) and split.num_batches(3) == len(ordered)
    shuffled = [b["idx"].tolist() for b in split.batches(3, shuffle=True, seed=1, epoch=2)]
    assert sorted(sum(shuffled, [])) == list(range(n)) and shuffled != ordered
    again = [b["idx"].tolist() for b in split.batches(3, shuffle=True, seed=1, epoch=2)]
    assert again == shuffled
    other = [b["idx"].tolist() for b in split.batches(3, shuffle=True, seed=1, epoch=3)]
    assert other != shuffled
    resumed = [b["idx"].tolist() for b in split.batches(3, shuffle=True, seed=1, epoch=2,
                                                         skip=2)]
    assert resumed == shuffled[2:]
    batch = next(split.batches(3, shuffle=False))
    assert torch.equal(batch["answer"], split.data.collate([0, 1, 2], split.word_ids)["answer"])


# --- the score that ranks evaluations ---------------------------------------------------------


def test_score_per_task():
    v1 = {"exact_match": 50.0, "f1": 60.0}
    v2 = {"exact": 40.0, "f1": 45.0, "HasAns_f1": 30.0}
    for name in ("span", "span_na"):
        t = get_task(name)
        assert t.score(v1) == t.score(v1, "f1") == 60.0
        assert t.score(v1, "em") == 50.0
        assert t.score(v2) == 45.0 and t.score(v2, "em") == 40.0
    choice = {"accuracy": 37.5, "questions": 8, "chance": 20.0}
    for name in ("cloze", "multiple_choice"):
        t = get_task(name)
        assert t.score(choice) == t.score(choice, "f1") == t.score(choice, "em") == 37.5


def test_a_checkpoint_older_than_a_config_key_resumes_at_its_default(tmp_path):
    cfg = resolve_config("bidaf")
    saved = {k: v for k, v in cfg.to_dict().items() if k not in ("task", "data_options")}
    trainer = type("T", (), {"cfg": cfg, "out": tmp_path})()
    engine.Trainer._check_resumable(trainer, saved)  # the keys it predates are at their default
    with pytest.raises(UserError, match="task: 'span' -> 'span_na'"):
        engine.Trainer._check_resumable(
            type("T", (), {"cfg": resolve_config("bidaf", overrides=["task=span_na"]),
                           "out": tmp_path})(), saved)


def test_predict_refuses_a_choice_tasks_run(tmp_path):
    cfg = resolve_config("ea_reader", profile="smoke", overrides=["data_options.subset=NE"])
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    with pytest.raises(UserError, match="a run of task 'cloze'; predict answers SQuAD-style"):
        engine.load_run(tmp_path, torch.device("cpu"))
