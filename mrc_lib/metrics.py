"""The official SQuAD metrics: exact match and token F1 (Rajpurkar et al., 2016, 2018).

This module reproduces the logic of the official scripts ``evaluate-v1.1.py`` and
``evaluate-v2.0.py`` from the SQuAD explorer, function by function, so that a number printed
here is the number the leaderboard would print. Both compare a prediction with every gold
answer after :func:`normalize_answer` and keep the best match; they differ in details:

* v1.1 scores a question without a prediction 0 but still counts it.
* v2.0 treats an unanswerable question's only gold answer as ``""``, can override predictions
  with a no-answer probability above a threshold, and reports HasAns/NoAns splits and the best
  threshold. It needs a prediction for every question (the official script stops with a
  ``KeyError`` otherwise; here that is a :class:`~mrc_lib.errors.UserError`).
"""

from __future__ import annotations

import json
import re
import string
import sys
from collections import Counter
from collections.abc import Callable, Iterator

from mrc_lib.errors import UserError

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", s).split())


def _questions(dataset: list) -> Iterator[dict]:
    """Every question (``qa`` record) of a SQuAD ``data`` list, in file order."""
    for article in dataset:
        for paragraph in article["paragraphs"]:
            yield from paragraph["qas"]


# --- SQuAD v1.1 --------------------------------------------------------------------------------


def f1_score(prediction: str, ground_truth: str) -> float:
    """Harmonic mean of token precision and recall of the normalized answers."""
    prediction_tokens = normalize_answer(prediction).split()
    ground_truth_tokens = normalize_answer(ground_truth).split()
    common = Counter(prediction_tokens) & Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(prediction_tokens)
    recall = 1.0 * num_same / len(ground_truth_tokens)
    return (2 * precision * recall) / (precision + recall)


def exact_match_score(prediction: str, ground_truth: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(ground_truth)


def metric_max_over_ground_truths(metric_fn: Callable, prediction: str,
                                  ground_truths: list[str]) -> float:
    return max(metric_fn(prediction, ground_truth) for ground_truth in ground_truths)


def evaluate_v1(dataset: list, predictions: dict) -> dict:
    """``evaluate()`` of ``evaluate-v1.1.py``: ``{"exact_match": %, "f1": %}``.

    A question without a prediction scores 0; one line on stderr says how many there were.
    """
    f1 = exact_match = total = 0
    unanswered = []
    for qa in _questions(dataset):
        total += 1
        if qa["id"] not in predictions:
            unanswered.append(qa["id"])
            continue
        ground_truths = [answer["text"] for answer in qa["answers"]]
        if not ground_truths:
            raise UserError(f"question {qa['id']} has no gold answer: not a SQuAD v1.1 question")
        prediction = predictions[qa["id"]]
        # Accumulated one by one, as the official script does, so the sums are bit-identical.
        exact_match += metric_max_over_ground_truths(exact_match_score, prediction, ground_truths)
        f1 += metric_max_over_ground_truths(f1_score, prediction, ground_truths)
    if total == 0:
        raise UserError("the dataset has no questions")
    if unanswered:
        print(f"{len(unanswered)} of {total} unanswered questions (first {unanswered[0]}) "
              "will receive score 0.", file=sys.stderr)
    return {"exact_match": 100.0 * exact_match / total, "f1": 100.0 * f1 / total}


# --- SQuAD v2.0 --------------------------------------------------------------------------------


def get_tokens(s: str) -> list[str]:
    if not s:
        return []
    return normalize_answer(s).split()


def compute_exact(a_gold: str, a_pred: str) -> int:
    return int(normalize_answer(a_gold) == normalize_answer(a_pred))


def compute_f1(a_gold: str, a_pred: str) -> float:
    """Token F1; if either answer is empty (no answer), 1 when both are, else 0."""
    gold_toks = get_tokens(a_gold)
    pred_toks = get_tokens(a_pred)
    common = Counter(gold_toks) & Counter(pred_toks)
    num_same = sum(common.values())
    if len(gold_toks) == 0 or len(pred_toks) == 0:
        return int(gold_toks == pred_toks)
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(pred_toks)
    recall = 1.0 * num_same / len(gold_toks)
    return (2 * precision * recall) / (precision + recall)


def make_qid_to_has_ans(dataset: list) -> dict[str, bool]:
    return {qa["id"]: bool(qa["answers"]) for qa in _questions(dataset)}


def get_raw_scores(dataset: list, preds: dict) -> tuple[dict, dict]:
    """Exact and F1 score of every question, each the max over its gold answers.

    Gold answers are the texts that normalize to something non-empty; an unanswerable question's
    only correct answer is ``""``.
    """
    exact_scores, f1_scores = {}, {}
    for qa in _questions(dataset):
        qid = qa["id"]
        gold_answers = [a["text"] for a in qa["answers"] if normalize_answer(a["text"])] or [""]
        a_pred = preds[qid]
        exact_scores[qid] = max(compute_exact(a, a_pred) for a in gold_answers)
        f1_scores[qid] = max(compute_f1(a, a_pred) for a in gold_answers)
    return exact_scores, f1_scores


def apply_no_ans_threshold(scores: dict, na_probs: dict, qid_to_has_ans: dict,
                           na_prob_thresh: float) -> dict:
    """Predict no answer where the no-answer probability exceeds the threshold."""
    new_scores = {}
    for qid, s in scores.items():
        pred_na = na_probs[qid] > na_prob_thresh
        new_scores[qid] = float(not qid_to_has_ans[qid]) if pred_na else s
    return new_scores


def make_eval_dict(exact_scores: dict, f1_scores: dict, qid_list: list | None = None) -> dict:
    """Mean exact and F1 (in %) over ``qid_list`` (all scored questions if empty)."""
    qid_list = qid_list or list(exact_scores)
    total = len(qid_list)
    return {
        "exact": 100.0 * sum(exact_scores[k] for k in qid_list) / total,
        "f1": 100.0 * sum(f1_scores[k] for k in qid_list) / total,
        "total": total,
    }


def merge_eval(main_eval: dict, new_eval: dict, prefix: str) -> None:
    for k in new_eval:
        main_eval[f"{prefix}_{k}"] = new_eval[k]


def find_best_thresh(preds: dict, scores: dict, na_probs: dict,
                     qid_to_has_ans: dict) -> tuple[float, float]:
    """The no-answer threshold that maximizes the mean score, by one sweep over sorted probs.

    Starting from "no answer everywhere" (score = number of unanswerable questions), questions
    are switched to their prediction in order of increasing no-answer probability.
    """
    cur_score = best_score = sum(1 for k in qid_to_has_ans if not qid_to_has_ans[k])
    best_thresh = 0.0
    for qid in sorted(na_probs, key=lambda k: na_probs[k]):
        if qid not in scores:
            continue
        if qid_to_has_ans[qid]:
            diff = scores[qid]
        else:
            diff = -1 if preds[qid] else 0
        cur_score += diff
        if cur_score > best_score:
            best_score = cur_score
            best_thresh = na_probs[qid]
    return 100.0 * best_score / len(scores), best_thresh


def find_all_best_thresh(main_eval: dict, preds: dict, exact_raw: dict, f1_raw: dict,
                         na_probs: dict, qid_to_has_ans: dict) -> None:
    best_exact, exact_thresh = find_best_thresh(preds, exact_raw, na_probs, qid_to_has_ans)
    best_f1, f1_thresh = find_best_thresh(preds, f1_raw, na_probs, qid_to_has_ans)
    main_eval["best_exact"] = best_exact
    main_eval["best_exact_thresh"] = exact_thresh
    main_eval["best_f1"] = best_f1
    main_eval["best_f1_thresh"] = f1_thresh


def _require(mapping: dict, qids: dict, what: str) -> None:
    """Raise a :class:`UserError` unless ``mapping`` has an entry for every question."""
    missing = [qid for qid in qids if qid not in mapping]
    if missing:
        raise UserError(f"missing {what} for {len(missing)} of {len(qids)} questions, "
                        f"first {missing[0]}")


def evaluate_v2(dataset: list, predictions: dict, na_probs: dict | None = None,
                na_prob_thresh: float = 1.0) -> dict:
    """``main()`` of ``evaluate-v2.0.py``: the same keys, order and values as its JSON."""
    qid_to_has_ans = make_qid_to_has_ans(dataset)
    if not qid_to_has_ans:
        raise UserError("the dataset has no questions")
    # The official script prints "Missing prediction" and then fails with a KeyError.
    _require(predictions, qid_to_has_ans, 'prediction ("" for no answer)')
    if na_probs is not None:
        _require(na_probs, qid_to_has_ans, "no-answer probability")
    has_ans_qids = [k for k, v in qid_to_has_ans.items() if v]
    no_ans_qids = [k for k, v in qid_to_has_ans.items() if not v]
    exact_raw, f1_raw = get_raw_scores(dataset, predictions)
    probs = na_probs if na_probs is not None else {k: 0.0 for k in predictions}
    exact_thresh = apply_no_ans_threshold(exact_raw, probs, qid_to_has_ans, na_prob_thresh)
    f1_thresh = apply_no_ans_threshold(f1_raw, probs, qid_to_has_ans, na_prob_thresh)
    out_eval = make_eval_dict(exact_thresh, f1_thresh)
    if has_ans_qids:
        merge_eval(out_eval, make_eval_dict(exact_thresh, f1_thresh, has_ans_qids), "HasAns")
    if no_ans_qids:
        merge_eval(out_eval, make_eval_dict(exact_thresh, f1_thresh, no_ans_qids), "NoAns")
    if na_probs is not None:
        find_all_best_thresh(out_eval, predictions, exact_raw, f1_raw, na_probs, qid_to_has_ans)
    return out_eval


# --- dispatch and files ------------------------------------------------------------------------


def detect_version(dataset_json: dict) -> str:
    """``"2.0"`` if the file says so or any question has ``is_impossible``, else ``"1.1"``."""
    version = str(dataset_json.get("version", "")).lstrip("v")
    if version.startswith("2"):
        return "2.0"
    if any("is_impossible" in qa for qa in _questions(dataset_json["data"])):
        return "2.0"
    return "1.1"


def evaluate(dataset_json: dict, predictions: dict, na_probs: dict | None = None,
             na_prob_thresh: float = 1.0) -> dict:
    """Evaluate with the official script that matches the dataset's version."""
    if detect_version(dataset_json) == "2.0":
        return evaluate_v2(dataset_json["data"], predictions, na_probs, na_prob_thresh)
    if na_probs is not None:
        raise UserError("no-answer probabilities apply to SQuAD v2.0 only; this is v1.1")
    return evaluate_v1(dataset_json["data"], predictions)


def _load_json(path) -> object:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise UserError(f"{path}: cannot read: {e.strerror or e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not valid JSON: {e}") from e


def _load_dataset(path) -> dict:
    """A SQuAD JSON file, checked for the fields the evaluation reads."""
    dataset_json = _load_json(path)
    if not isinstance(dataset_json, dict) or not isinstance(dataset_json.get("data"), list):
        raise UserError(f'{path}: not a SQuAD file (no "data" list)')
    try:
        for qa in _questions(dataset_json["data"]):
            if not isinstance(qa["id"], str) or not all(
                    isinstance(a["text"], str) for a in qa["answers"]):
                raise TypeError(f"question {qa['id']!r} has a non-string id or answer")
    except (KeyError, TypeError) as e:
        raise UserError(f"{path}: not a SQuAD file: {type(e).__name__} {e}") from e
    return dataset_json


def _load_mapping(path, value_types: tuple[type, ...], what: str) -> dict:
    """A JSON object from question id to ``value_types``; ``what`` names the values."""
    mapping = _load_json(path)
    if not isinstance(mapping, dict):
        raise UserError(f"{path}: expected a JSON object of question id -> {what}")
    for qid, value in mapping.items():
        if isinstance(value, bool) or not isinstance(value, value_types):
            raise UserError(f"{path}: question {qid}: expected {what}, got {value!r}")
    return mapping


def evaluate_files(data_file, pred_file, na_prob_file=None, na_prob_thresh: float = 1.0) -> dict:
    """The CLI's ``evaluate DATA PRED [--na-prob-file F] [--na-prob-thresh T]``."""
    dataset_json = _load_dataset(data_file)
    predictions = _load_mapping(pred_file, (str,), "an answer string")
    na_probs = None if na_prob_file is None else _load_mapping(
        na_prob_file, (int, float), "a no-answer probability")
    try:
        return evaluate(dataset_json, predictions, na_probs, na_prob_thresh)
    except UserError as e:
        raise UserError(f"evaluating {pred_file} on {data_file}: {e}") from e
