"""Reading-comprehension tasks: what a reader is trained on and how it is scored.

A task defines, in one place, its data (a loader whose splits make the batches), its training
objective, its decoding and its official metric. :mod:`mrc_lib.train` trains any registered
reader on any task: ``TrainConfig.task``, by default the dataset's own.

* ``span``: SQuAD v1.1 (:class:`~mrc_lib.data.Split` batches). Objective: the span NLL (BiDAF
  Eq. 5). Decoding: the best span. Metric: the official v1.1 EM and F1.
* ``span_na``: the SQuAD 2.0 protocol (:mod:`mrc_lib.data.squad2`). Objective: the span NLL on
  the answerable questions plus the binary cross-entropy of ``σ(na_logits)``. Decoding: the best
  span and P(no answer). Metric: the official v2.0 scores.
* ``cloze``: Wiki-cloze as document, query and candidate words
  (:class:`~mrc_lib.data.choice.ClozeSplit`). Objective: the answer's NLL among the
  candidates. Decoding: the most probable candidate. Metric: accuracy (%).
* ``multiple_choice``: Wiki-cloze in multi-passage form
  (:class:`~mrc_lib.data.choice.PassageSplit`), for a span reader's encoder with a candidate
  head. Objective, decoding and metric: as ``cloze``.

The readers' outputs that the tasks read: ``start_logits`` / ``end_logits`` ``[B, L]`` (and
``na_logits`` ``[B]``) for the span tasks, ``candidate_log_probs`` ``[B, C]`` (``-inf`` for a
candidate the reader cannot choose) for the choice tasks. A reader whose paper defines another
objective returns it as ``loss``, computed in ``forward`` from the batch's targets, and it
replaces the task's; a reader's extra training term ``aux_loss`` (e.g. DynSAN's L1 gate penalty)
is added to either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mrc_lib.config import TrainConfig
from mrc_lib.errors import UserError
from mrc_lib.inference import autocast, predict_spans, to_device
from mrc_lib.metrics import evaluate as official_evaluate
from mrc_lib.nn import span_loss


@dataclass
class Evaluation:
    """A split's official scores, and the JSON files a run writes from it (file name ->
    content: the predictions, the no-answer probabilities)."""

    scores: dict
    files: dict[str, dict]


class Task:
    """The interface; each subclass fills it for one task."""

    name: str

    def load(self, cfg: TrainConfig):
        """The data ``cfg`` names: ``vocab``, ``splits`` (``train``, ``dev``, optionally
        ``test``), ``digests`` and a ``version`` label."""
        raise NotImplementedError

    def objective(self, out: dict[str, Tensor], batch: dict[str, Tensor]) -> Tensor:
        raise NotImplementedError

    def evaluate(self, model: nn.Module, split, cfg: TrainConfig,
                 device: torch.device) -> Evaluation:
        """Decode ``model``'s (eval mode) answer to every question of ``split`` and score it."""
        raise NotImplementedError

    def score(self, scores: dict, metric: str = "f1") -> float:
        """The one number that ranks evaluations (model selection, the plateau schedule)."""
        raise NotImplementedError

    def loss(self, out: dict[str, Tensor], batch: dict[str, Tensor]) -> Tensor:
        """The training loss: the reader's own ``loss`` or the task's objective, plus the
        reader's ``aux_loss``."""
        main = out["loss"].float() if "loss" in out else self.objective(out, batch)
        return main + out["aux_loss"].float() if "aux_loss" in out else main


class Span(Task):
    """Extractive QA (SQuAD v1.1): the answer is a span of the context."""

    name = "span"

    def load(self, cfg: TrainConfig):
        """SQuAD v1.1; with ``data_options.passages`` M, its multi-passage form (DynSAN's
        setting, :mod:`mrc_lib.data.multipassage`): each question with M ranked paragraphs of
        its article (``all``: the whole article), at most ``data_options.token_cap`` tokens
        (default 5,000), no training question dropped for its length."""
        from mrc_lib.data import load_prepared  # the data pipeline imports spaCy

        options = dict(cfg.data_options)
        if not options:
            return load_prepared(cfg.dataset, splits=("train", "dev"), pipeline=cfg.pipeline,
                                 **_limits(cfg))
        from mrc_lib.data.multipassage import TOKEN_CAP, load_multipassage

        if cfg.dataset != "squad-v1.1" or "passages" not in options or \
                set(options) - {"passages", "token_cap"}:
            raise UserError(f"data_options {options} of {cfg.dataset}: the span task takes "
                            "passages (M or 'all') and token_cap, for multi-passage SQuAD v1.1")
        m = options["passages"]
        return load_multipassage(None if m == "all" else m, limits=cfg.limits,
                                 token_cap=options.get("token_cap", TOKEN_CAP),
                                 question_limit=cfg.question_limit, glove=cfg.glove,
                                 pipeline=cfg.pipeline)

    def objective(self, out: dict[str, Tensor], batch: dict[str, Tensor]) -> Tensor:
        """The span negative log-likelihood (BiDAF Eq. 5: the two ends summed), averaged over
        the answerable examples: an unanswerable one (or one whose answer the context limit cut
        off) gets the target -100, which cross-entropy ignores in its mean."""
        has = batch["has_answer"]
        y1, y2 = batch["y1"].where(has, -100), batch["y2"].where(has, -100)
        return span_loss(out["start_logits"].float(), out["end_logits"].float(), y1, y2)

    def evaluate(self, model: nn.Module, split, cfg: TrainConfig,
                 device: torch.device) -> Evaluation:
        """Official scores of the best spans (qid -> the span's text). With no-answer
        probabilities (SQuAD 2.0), a question counts as unanswered when its probability
        exceeds 1/2, as in the official v2.0 evaluation, which also searches the best
        thresholds over the raw spans."""
        model.eval()
        qids = split.qids
        predictions, na_probs = {}, {}
        for i, start, end, _, na in predict_spans(model, split, cfg, device):
            predictions[qids[i]] = split.answer_text(i, start, end)
            if na is not None:
                na_probs[qids[i]] = na
        scores = official_evaluate(split.squad_json(), predictions, na_probs or None,
                                   na_prob_thresh=0.5)
        files = {"predictions.json": predictions}
        if na_probs:
            files["na_prob.json"] = na_probs
        return Evaluation(scores, files)

    def score(self, scores: dict, metric: str = "f1") -> float:
        """F1, or exact match (``exact_match`` in the v1.1 evaluation, ``exact`` in v2.0)."""
        return scores["f1"] if metric == "f1" else scores.get("exact_match", scores.get("exact"))


class SpanNoAnswer(Span):
    """SQuAD 2.0: a span, or no answer (the protocol of :mod:`mrc_lib.data.squad2`)."""

    name = "span_na"

    def load(self, cfg: TrainConfig):
        from mrc_lib.data.squad2 import load_squad2

        return load_squad2(**_limits(cfg))

    def objective(self, out: dict[str, Tensor], batch: dict[str, Tensor]) -> Tensor:
        """The span NLL over the answerable examples plus, for a reader with a no-answer
        output, the binary cross-entropy of ``σ(na_logits)`` against "no answer"."""
        if "na_logits" not in out:
            return super().objective(out, batch)
        has = batch["has_answer"]
        na = F.binary_cross_entropy_with_logits(out["na_logits"].float(), (~has).float())
        return na + super().objective(out, batch)  # the span term is 0 without answerables


class Choice(Task):
    """Choose the answer among candidates (shared by the two choice tasks)."""

    def objective(self, out: dict[str, Tensor], batch: dict[str, Tensor]) -> Tensor:
        """Negative log-likelihood of the answer, over the examples whose answer the reader
        can choose (a CBT answer may be missing from its document)."""
        log_p = out["candidate_log_probs"].float().gather(1, batch["answer"].unsqueeze(1))
        reachable = log_p.isfinite()
        # The mean over the reachable rows, without asking the device whether there are any:
        # none gives a zero that keeps the graph.
        return -log_p.masked_fill(~reachable, 0.0).sum() / reachable.sum().clamp(min=1)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split, cfg: TrainConfig,
                 device: torch.device) -> Evaluation:
        """Accuracy (%) of the most probable candidate, the accuracy of a random choice, and
        the predictions (qid -> the chosen candidate)."""
        model.eval()
        predictions, right = {}, 0
        qids = split.qids
        for batch in split.batches(cfg.eval_batch_size, shuffle=False):
            with autocast(cfg, device):
                out = model(to_device(batch, device))
            choice = out["candidate_log_probs"].float().argmax(-1).cpu()
            right += int((choice == batch["answer"]).sum())
            for i, c in zip(batch["idx"].tolist(), choice.tolist()):
                predictions[qids[i]] = split.candidates(i)[c]
        scores = {"accuracy": 100.0 * right / max(len(split), 1), "questions": len(split),
                  "chance": split.chance()}
        return Evaluation(scores, {"predictions.json": predictions})

    def score(self, scores: dict, metric: str = "f1") -> float:
        return scores["accuracy"]


class Cloze(Choice):
    """Cloze questions with candidates (Wiki-cloze, :mod:`mrc_lib.data.cloze`), read as a
    document, a query with a blank and candidate words: the EA Reader's task (chapter 05)."""

    name = "cloze"

    def load(self, cfg: TrainConfig):
        from mrc_lib.data.choice import load_cloze_data

        return load_cloze_data(limits=cfg.limits, glove=cfg.glove, **_wiki_options(cfg))


class MultipleChoice(Choice):
    """The Wiki-cloze questions as multiple-choice reading over passages, for a span reader's
    encoder with a candidate head (DynSAN's Eqs. 7-8, chapter 02)."""

    name = "multiple_choice"

    def load(self, cfg: TrainConfig):
        from mrc_lib.data.choice import load_passage_data

        return load_passage_data(limits=cfg.limits, glove=cfg.glove, **_wiki_options(cfg))


TASKS: dict[str, Task] = {t.name: t for t in (Span(), SpanNoAnswer(), Cloze(), MultipleChoice())}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise UserError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    return TASKS[name]


def _limits(cfg: TrainConfig) -> dict:
    return {"limits": cfg.limits, "context_limit": cfg.context_limit,
            "question_limit": cfg.question_limit, "glove": cfg.glove}


def _wiki_options(cfg: TrainConfig) -> dict:
    """``cfg.data_options`` for Wiki-cloze: ``subset`` (required), and the options of
    :func:`mrc_lib.data.cloze.load_wiki_cloze` (``articles``, ``doc_sentences``, ``seed``...)."""
    if cfg.dataset != "wiki-cloze":
        raise UserError(f"task {cfg.task!r} reads dataset 'wiki-cloze', not {cfg.dataset!r}")
    if "subset" not in cfg.data_options:
        raise UserError(f"task {cfg.task!r} needs data_options.subset (NE, CN or ANON)")
    return dict(cfg.data_options)

