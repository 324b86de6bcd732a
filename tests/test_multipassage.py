"""Multi-passage SQuAD: ranking, passage choice, answers moved into the concatenation, cache."""

import dataclasses
import math
from collections import Counter

import numpy as np
import pytest

from mrc_lib.data.multipassage import (
    SEPARATOR,
    MultiPassageSplit,
    TfidfRanker,
    choose_passages,
    find_occurrences,
    load_multipassage,
    multipassage,
    statistics,
)


def test_tfidf_ranker_equals_dense_computation():
    paragraphs = [["The", "cat", "sat", "."], ["A", "dog", "and", "a", "cat", "ran"],
                  ["Dogs", "bark", "at", "the", "dog"]]
    question = ["Which", "dog", "ran", "?"]
    ranker = TfidfRanker(paragraphs)
    terms = sorted({w.lower() for p in paragraphs for w in p if w.isalnum()})
    df = {t: sum(t in {w.lower() for w in p} for p in paragraphs) for t in terms}

    def dense(words):
        c = Counter(w.lower() for w in words if w.isalnum())
        v = np.array([(1 + math.log(c[t])) * math.log(3 / df[t]) if c[t] else 0.0
                      for t in terms])
        return v / (np.linalg.norm(v) or 1.0)

    expected = [float(dense(question) @ dense(p)) for p in paragraphs]
    np.testing.assert_allclose(ranker.scores(question), expected, atol=1e-12)
    assert ranker.rank(question) == sorted(range(3), key=lambda i: (-expected[i], i))


def test_choose_passages_keeps_rank_order_gold_and_cap():
    ranked = [4, 2, 7, 1, 9]
    tokens = {4: "x" * 10, 2: "x" * 10, 7: "x" * 10, 1: "x" * 10, 9: "x" * 10}
    assert choose_passages(ranked, 7, 1, tokens) == [7]
    assert choose_passages(ranked, 7, 2, tokens) == [4, 7]  # gold plus the best other
    assert choose_passages(ranked, 9, 3, tokens) == [4, 2, 9]  # gold at its rank, last
    assert choose_passages(ranked, 2, None, tokens) == ranked
    assert choose_passages(ranked, 9, None, tokens, token_cap=30) == [4, 2, 9]  # drop lowest


def test_find_occurrences_lower_cased_everywhere():
    words = ["The", "Leek", "is", "a", "leek", ".", "the", "leek"]
    assert find_occurrences(words, ["leek"]) == [(1, 1), (4, 4), (7, 7)]
    assert find_occurrences(words, ["the", "leek"]) == [(0, 1), (6, 7)]
    assert find_occurrences(words, []) == []


def test_multipassage_squad_from_the_fixture(mirror):
    data = load_multipassage(2)
    dev, train = data.splits["dev"], data.splits["train"]
    assert len(train) == 7 and len(dev) == 2
    for split in (train, dev):
        gold = split.squad_json()
        answers = {qa["id"]: qa["answers"] for a in gold["data"] for p in a["paragraphs"]
                   for qa in p["qas"]}
        for i in range(len(split)):
            context = split.context(i)
            for ans in answers[split.qids[i]]:  # offsets point into the concatenation
                assert context[ans["answer_start"]:][:len(ans["text"])] == ans["text"]
            y1, y2 = split.a["y"][split.index[i]]
            assert split.answer_text(i, y1, y2) == answers[split.qids[i]][0]["text"]
            spans = split.passage_spans(i)
            assert len(spans) == len(context.split(SEPARATOR))
            position = split.a["gold_position"][split.index[i]]
            assert spans[position][0] <= y1 <= y2 < spans[position][1]
    batch = train.collate(np.arange(len(train)))
    for row in range(len(train)):  # every occurrence of the answer, the gold span among them
        words = [w.lower() for w in train.tokens(row)]
        y1, y2 = int(batch["y1"][row]), int(batch["y2"][row])
        spans = [(int(s), int(e)) for s, e in zip(batch["occ_start"][row], batch["occ_end"][row])
                 if s >= 0]
        assert (y1, y2) in spans
        assert spans == [(i, i + y2 - y1) for i in range(len(words))
                         if words[i:i + y2 - y1 + 1] == words[y1:y2 + 1]]
    cut = MultiPassageSplit(train.name, train.a, train.text, train.forms, context_limit=20)
    short = cut.collate(np.arange(len(cut)))  # occurrences past a context limit are dropped
    for row in range(len(train)):
        kept = short["occ_end"][row][short["occ_start"][row] >= 0]
        full = batch["occ_end"][row][batch["occ_start"][row] >= 0]
        assert kept.tolist() == [e for e in full.tolist() if e < short["c_mask"][row].sum()]
    assert (short["occ_start"] < 0).all(1).sum() == 2  # two answers lie past token 20
    for row in range(len(train)):
        ids = batch["c_passage"][row][batch["c_mask"][row]].numpy()
        expected = np.concatenate([np.full(e - s, p) for p, (s, e) in
                                   enumerate(train.passage_spans(row))])
        np.testing.assert_array_equal(ids, expected)
        lengths = [e - s for s, e in train.passage_spans(row)]  # c_passage_mask: the layout
        assert batch["c_passage_mask"][row].sum(-1).tolist()[:len(lengths)] == lengths
    assert batch["c_passage_mask"].shape[1:] == (2, max(
        e - s for i in range(len(train)) for s, e in train.passage_spans(i)))
    # Super_Bowl has two paragraphs, Warsaw one: M = 2 gives 2 and 1 passages.
    assert [len(train.passage_spans(i)) for i in range(len(train))] == [2] * 5 + [1] * 2
    assert statistics(dev)["passages_mean"] == 1.0
    again = load_multipassage(2)  # from the cache, identical
    for name, array in train.a.items():
        np.testing.assert_array_equal(again.splits["train"].a[name], array)


def test_a_runs_config_names_its_multi_passage_data(mirror):
    """The span task builds multi-passage SQuAD from ``data_options`` alone, so the queue's
    packed runner trains chapter 02's multi-passage runs on the data the chapter builds."""
    from mrc_lib.config import resolve_config
    from mrc_lib.errors import UserError
    from mrc_lib.train import load_data

    def config(*options):
        return resolve_config("dynsan", "squad-v1.1", "smoke", overrides=list(options))

    data = load_data(config("data_options.passages=2", "data_options.token_cap=5000"))
    reference = load_multipassage(2)
    assert data.dataset == reference.dataset and data.digests == reference.digests
    for split in ("train", "dev"):
        for name, array in reference.splits[split].a.items():
            np.testing.assert_array_equal(data.splits[split].a[name], array)
    whole = load_data(config("data_options.passages=all", "limits.train=3"))
    assert whole.meta["m"] is None and len(whole.splits["train"]) == 3
    for bad in (["data_options.token_cap=400"], ["data_options.passages=2", "data_options.m=2"]):
        with pytest.raises(UserError, match="takes passages"):
            load_data(config(*bad))


@pytest.mark.real_data
def test_real_multipassage_dev(real_squad):
    subset = {s: split.subset(np.arange(60)) for s, split in real_squad.splits.items()}
    data = multipassage(dataclasses.replace(real_squad, splits=subset), 4)
    dev = data.splits["dev"]
    stats = statistics(dev)
    assert stats["questions"] == 60 and stats["passages_mean"] == 4.0
    assert stats["tokens_percentiles"]["p100"] <= 5000
    assert 0 < stats["gold_first"] < 1  # the gold paragraph is not always ranked first
    hits = sum(dev.answer_text(i, *dev.a["y"][dev.index[i]]) in
               [a for a, _ in dev.text["answers"][dev.index[i]]] for i in range(len(dev)))
    assert hits >= 58  # the paragraph-level alignment carries over
