"""The official SQuAD metrics, against hand-computed values and brute-force searches."""

import json
import os
import random
from pathlib import Path

import pytest

from mrc_lib import metrics
from mrc_lib.errors import UserError
from mrc_lib.metrics import (
    apply_no_ans_threshold,
    compute_exact,
    compute_f1,
    detect_version,
    evaluate,
    evaluate_files,
    evaluate_v1,
    evaluate_v2,
    exact_match_score,
    f1_score,
    find_best_thresh,
    get_raw_scores,
    make_qid_to_has_ans,
    normalize_answer,
)


def squad(questions, version="1.1"):
    """A one-paragraph SQuAD JSON from ``(id, [answer texts])`` pairs."""
    qas = []
    for qid, answers in questions:
        qa = {"id": qid, "question": "?", "answers": [{"text": a, "answer_start": 0}
                                                     for a in answers]}
        if version == "2.0":
            qa["is_impossible"] = not answers
        qas.append(qa)
    return {"version": version, "data": [{"title": "t", "paragraphs": [
        {"context": "c", "qas": qas}]}]}


# --- normalization and per-answer scores -------------------------------------------------------


@pytest.mark.parametrize("text, normalized", [
    ("The Cat", "cat"),
    ("  a  dog,  an owl!  ", "dog owl"),
    ("theater", "theater"),          # articles only as whole words
    ("Denver Broncos.", "denver broncos"),
    ("U.S.-born", "usborn"),        # punctuation removed, not replaced by a space
    ("an", ""),
    ("", ""),
])
def test_normalize_answer(text, normalized):
    assert normalize_answer(text) == normalized


def test_f1_hand_computed():
    # pred "the big red dog" -> [big, red, dog]; gold "red dog barks" -> [red, dog, barks]
    # common 2: precision 2/3, recall 2/3, F1 2/3.
    assert f1_score("the big red dog", "red dog barks") == pytest.approx(2 / 3)
    # repeated tokens count with multiplicity: pred [x x x] vs gold [x]: P 1/3, R 1, F1 1/2
    assert f1_score("x x x", "x") == pytest.approx(0.5)
    assert f1_score("cat", "dog") == 0
    assert compute_f1("red dog barks", "the big red dog") == pytest.approx(2 / 3)


def test_exact_match():
    assert exact_match_score("The Denver Broncos!", "denver broncos")
    assert not exact_match_score("Denver", "Denver Broncos")
    assert compute_exact("Denver Broncos", "the denver  broncos") == 1


def test_v2_empty_answer_rules():
    assert compute_f1("", "") == 1          # both no-answer
    assert compute_f1("", "Denver") == 0    # gold no-answer, prediction not
    assert compute_f1("Denver", "") == 0
    assert compute_f1("the", "") == 1       # normalizes to nothing: counts as no answer
    assert compute_exact("", "") == 1
    assert compute_exact("", "a") == 1      # "a" normalizes to ""


# --- v1.1 ----------------------------------------------------------------------------------------


def test_v1_hand_computed():
    data = squad([("q1", ["Denver Broncos", "Broncos"]), ("q2", ["red dog barks"]),
                  ("q3", ["Paris"])])["data"]
    preds = {"q1": "the broncos", "q2": "the big red dog", "q3": "London"}
    result = evaluate_v1(data, preds)
    assert list(result) == ["exact_match", "f1"]
    assert result["exact_match"] == pytest.approx(100 / 3)
    assert result["f1"] == pytest.approx(100 * (1 + 2 / 3 + 0) / 3)


def test_v1_unanswered_counts_zero_and_is_logged_once(capsys):
    data = squad([("q1", ["yes"]), ("q2", ["no"]), ("q3", ["maybe"])])["data"]
    result = evaluate_v1(data, {"q1": "yes"})
    assert result == {"exact_match": pytest.approx(100 / 3), "f1": pytest.approx(100 / 3)}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "2 of 3" in err


# --- v2.0 ----------------------------------------------------------------------------------------


V2 = squad([("a1", ["Denver Broncos"]), ("a2", ["red dog barks", "dog"]),
            ("n1", []), ("n2", [])], version="2.0")


def test_v2_hand_computed():
    preds = {"a1": "Denver Broncos", "a2": "the big red dog", "n1": "", "n2": "Paris"}
    result = evaluate_v2(V2["data"], preds)
    # exact: a1 1, a2 0, n1 1, n2 0. F1 of a2 = max over its golds:
    # vs "red dog barks" P 2/3 R 2/3 F1 2/3; vs "dog" P 1/3 R 1 F1 1/2 -> 2/3
    f1 = [1, 2 / 3, 1, 0]
    assert list(result) == ["exact", "f1", "total", "HasAns_exact", "HasAns_f1",
                            "HasAns_total", "NoAns_exact", "NoAns_f1", "NoAns_total"]
    assert result["exact"] == pytest.approx(50.0)
    assert result["f1"] == pytest.approx(100 * sum(f1) / 4)
    assert result["total"] == 4
    assert result["HasAns_exact"] == pytest.approx(50.0)
    assert result["HasAns_f1"] == pytest.approx(100 * (1 + 2 / 3) / 2)
    assert (result["HasAns_total"], result["NoAns_total"]) == (2, 2)
    assert result["NoAns_exact"] == result["NoAns_f1"] == pytest.approx(50.0)


def test_v2_gold_answers_that_normalize_empty_are_dropped():
    data = squad([("q", ["the", "Paris"])], version="2.0")["data"]
    exact, f1 = get_raw_scores(data, {"q": ""})
    assert exact == {"q": 0} and f1 == {"q": 0}    # gold is ["Paris"], not [""]
    data = squad([("q", ["the"])], version="2.0")["data"]
    exact, f1 = get_raw_scores(data, {"q": ""})     # only empty golds: gold is [""]
    assert exact == {"q": 1} and f1 == {"q": 1}


def test_apply_no_ans_threshold():
    has_ans = {"a": True, "n": False}
    scores = {"a": 0.5, "n": 0}
    probs = {"a": 0.9, "n": 0.2}
    # prob > thresh predicts no answer: right (1.0) for "n", wrong (0.0) for "a".
    assert apply_no_ans_threshold(scores, probs, has_ans, 0.1) == {"a": 0.0, "n": 1.0}
    assert apply_no_ans_threshold(scores, probs, has_ans, 0.5) == {"a": 0.0, "n": 0}
    assert apply_no_ans_threshold(scores, probs, has_ans, 0.9) == {"a": 0.5, "n": 0}


def test_v2_threshold_changes_scores():
    preds = {"a1": "Denver Broncos", "a2": "the big red dog", "n1": "", "n2": "Paris"}
    probs = {"a1": 0.1, "a2": 0.8, "n1": 0.3, "n2": 0.9}
    result = evaluate_v2(V2["data"], preds, probs, na_prob_thresh=0.5)
    # a2 and n2 become "no answer": exact a1 1, a2 0, n1 1, n2 1; f1 the same.
    assert result["exact"] == result["f1"] == pytest.approx(75.0)
    assert list(result)[-4:] == ["best_exact", "best_exact_thresh", "best_f1", "best_f1_thresh"]


def brute_force_best(preds, raw, probs, has_ans):
    """The best mean score over every threshold 0.0 and each na_prob, and the smallest such."""
    best = None
    for t in sorted({0.0, *probs.values()}):
        score = sum(apply_no_ans_threshold(raw, probs, has_ans, t).values())
        if best is None or score > best[0]:
            best = (score, t)
    return 100.0 * best[0] / len(raw), best[1]


@pytest.mark.parametrize("seed", range(20))
def test_find_best_thresh_matches_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    questions = [(f"q{i}", rng.choice([[], ["red dog"], ["big cat", "cat"]])) for i in range(n)]
    data = squad(questions, version="2.0")["data"]
    preds = {qid: rng.choice(["", "red dog", "the cat", "dog"]) for qid, _ in questions}
    # distinct positive probabilities: every threshold is a distinct cut
    probs = dict(zip(preds, rng.sample(range(1, 1000), n)))
    probs = {k: v / 1000 for k, v in probs.items()}
    has_ans = make_qid_to_has_ans(data)
    exact, f1 = get_raw_scores(data, preds)
    for raw in (exact, f1):
        best, thresh = find_best_thresh(preds, raw, probs, has_ans)
        want_best, want_thresh = brute_force_best(preds, raw, probs, has_ans)
        assert best == pytest.approx(want_best)
        assert thresh == want_thresh
    result = evaluate_v2(data, preds, probs)
    assert result["best_exact"] == pytest.approx(brute_force_best(preds, exact, probs, has_ans)[0])


def test_v2_missing_prediction_is_an_error():
    # The official script prints "Missing prediction" and then fails with a KeyError.
    with pytest.raises(UserError, match="missing prediction.*first n2"):
        evaluate_v2(V2["data"], {"a1": "", "a2": "", "n1": ""})
    with pytest.raises(UserError, match="no-answer probability.*first a2"):
        evaluate_v2(V2["data"], dict.fromkeys(["a1", "a2", "n1", "n2"], ""), {"a1": 0.5})


# --- dispatch and files --------------------------------------------------------------------------


def test_detect_version():
    assert detect_version(squad([("q", ["x"])])) == "1.1"
    assert detect_version(squad([("q", ["x"])], version="v2.0")) == "2.0"
    mislabeled = squad([("q", [])], version="2.0")
    mislabeled["version"] = "1.1"
    assert detect_version(mislabeled) == "2.0"   # is_impossible present


def write(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj))
    return path


def test_evaluate_files_both_versions(tmp_path):
    data = write(tmp_path / "v1.json", squad([("q1", ["yes"]), ("q2", ["no"])]))
    preds = write(tmp_path / "p.json", {"q1": "Yes.", "q2": "maybe"})
    assert evaluate_files(data, preds) == {"exact_match": 50.0, "f1": 50.0}
    data2 = write(tmp_path / "v2.json", V2)
    preds2 = write(tmp_path / "p2.json", dict.fromkeys(["a1", "a2", "n1", "n2"], ""))
    probs = write(tmp_path / "na.json", dict.fromkeys(["a1", "a2", "n1", "n2"], 1))
    result = evaluate_files(data2, preds2, probs, na_prob_thresh=0.5)
    assert result["exact"] == 50.0 and result["best_exact"] == 50.0
    assert result == evaluate(V2, json.loads(preds2.read_text()), json.loads(probs.read_text()),
                              0.5)


@pytest.mark.parametrize("content, match", [
    ("[1, 2]", "p.json.*JSON object"),
    ('{"q1": 3}', "p.json.*question q1"),
    ('{"q1": ', "p.json.*not valid JSON"),
])
def test_bad_prediction_files(tmp_path, content, match):
    data = write(tmp_path / "d.json", squad([("q1", ["yes"])]))
    (tmp_path / "p.json").write_text(content)
    with pytest.raises(UserError, match=match):
        evaluate_files(data, tmp_path / "p.json")


def test_bad_data_files(tmp_path):
    preds = write(tmp_path / "p.json", {})
    with pytest.raises(UserError, match="missing.json"):
        evaluate_files(tmp_path / "missing.json", preds)
    with pytest.raises(UserError, match="d.json.*not a SQuAD file"):
        evaluate_files(write(tmp_path / "d.json", {"data": [{"paragraphs": [{}]}]}), preds)
    with pytest.raises(UserError, match="na.json.*no-answer probability"):
        evaluate_files(write(tmp_path / "v2.json", V2), preds,
                       write(tmp_path / "na.json", {"a1": "high"}))


# --- real data -----------------------------------------------------------------------------------

DATA_DIR = os.environ.get("MRC_DATA_DIR")
real_data = pytest.mark.skipif(not DATA_DIR, reason="MRC_DATA_DIR not set")


def gold_predictions(dataset_json):
    """The first gold answer ("" if none) and a no-answer probability of 0 or 1."""
    qas = list(metrics._questions(dataset_json["data"]))
    preds = {qa["id"]: qa["answers"][0]["text"] if qa["answers"] else "" for qa in qas}
    na_probs = {qa["id"]: float(not qa["answers"]) for qa in qas}
    return preds, na_probs


@pytest.mark.real_data
@real_data
def test_gold_answers_score_100_on_dev_v1(tmp_path):
    data = Path(DATA_DIR) / "squad/dev-v1.1.json"
    preds, _ = gold_predictions(json.loads(data.read_text()))
    assert evaluate_files(data, write(tmp_path / "p.json", preds)) == {
        "exact_match": 100.0, "f1": 100.0}


@pytest.mark.real_data
@real_data
def test_gold_answers_score_100_on_dev_v2():
    dataset_json = json.loads((Path(DATA_DIR) / "squad/dev-v2.0.json").read_text())
    preds, na_probs = gold_predictions(dataset_json)
    result = evaluate(dataset_json, preds, na_probs)
    assert (result["HasAns_total"], result["NoAns_total"], result["total"]) == (5928, 5945, 11873)
    for key in ["exact", "f1", "HasAns_exact", "HasAns_f1", "NoAns_exact", "NoAns_f1",
                "best_exact", "best_f1"]:
        assert result[key] == 100.0, key
    # answering nothing: right on every unanswerable question, wrong on every other
    nothing = evaluate(dataset_json, dict.fromkeys(preds, ""))
    assert (nothing["HasAns_f1"], nothing["NoAns_f1"]) == (0.0, 100.0)
    assert nothing["exact"] == pytest.approx(100 * 5945 / 11873)
