"""Multi-passage SQuAD: each question with ``M`` ranked paragraphs of its own article.

DynSAN (Zhuang & Wang, 2019) is evaluated on SearchQA and Quasar-T, where a retriever hands the
reader many passages per question; neither is obtainable here. This module builds the nearest
thing from real SQuAD v1.1: for every question, the paragraphs of its Wikipedia article are
ranked by TF-IDF cosine similarity to the question (sub-linear term frequency, inverse document
frequency over the split's paragraphs, lower-cased alphanumeric tokens); the reader gets the
gold paragraph plus the ``M − 1`` best-ranked others, **in rank order** (the gold paragraph sits
wherever its rank puts it), the lowest-ranked non-gold passages dropped until the total is at
most 5,000 tokens as in the paper. ``M = None`` takes the whole article.

An example's passages are joined (``"\\n\\n"``) into one SQuAD context, its answers shifted
into the concatenation, so the whole data pipeline (features, batching, official evaluation)
applies unchanged. Tokens are those of the prepared paragraphs (no re-tokenization); each token
also carries its passage index, which batches expose as ``c_passage`` ``[B, Lc]``, with
``c_passage_mask`` ``[B, M, Lp]`` (:func:`passage_mask`: the batch's layout, so that a reader
never reads lengths back from the device). Every
occurrence of the gold answer's tokens (lower-cased) anywhere in the example's passages is
listed too, for DynSAN's loss over all occurrences (Sec. 3.4.1): batches expose them as
``occ_start``/``occ_end`` ``[B, O]`` (``-1`` past an example's count; the gold span is always
among them).
Built splits are cached under ``<cache>/multipassage/``, keyed by the prepared data and the
options; the build is deterministic.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence, Sized

import numpy as np
import torch

from mrc_lib.data.cache import PreparedData, load_prepared
from mrc_lib.data.dataset import Split, Texts, encode
from mrc_lib.data.sources import cache_root
from mrc_lib.data.squad import Answer, Example, SquadFile
from mrc_lib.data.text import Tokens
from mrc_lib.utils import atomic_path

BUILD_VERSION = 3
TOKEN_CAP = 5000  # the paper's limit on the total length of an example's passages
SEPARATOR = "\n\n"
PASSAGE_COUNTS = (1, 2, 4, 8, None)  # M of Figure 5b; None: all paragraphs of the article


def passage_mask(passage: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``[B, M, Lp]``, True at the real tokens of each passage, from each token's passage
    ``passage`` ``[B, L]`` (contiguous and in order) and the token mask ``mask`` ``[B, L]``:
    ``M`` the batch's most passages, ``Lp`` its longest passage (at least 1)."""
    passage = np.where(mask, passage, 0)
    lengths = np.zeros((len(passage), int(passage.max(initial=0)) + 1), np.int64)
    np.add.at(lengths, (np.arange(len(passage))[:, None], passage), mask.astype(np.int64))
    return np.arange(max(int(lengths.max(initial=0)), 1)) < lengths[..., None]


class MultiPassageSplit(Split):
    """A :class:`Split` whose batches also hold ``c_passage`` ``[B, Lc]`` (long): the rank
    position of each token's passage, 0 at padding; ``c_passage_mask`` ``[B, M, Lp]``
    (:func:`passage_mask`); and ``occ_start``/``occ_end`` ``[B, O]``: the token spans of every
    occurrence of the answer, ``-1``-padded."""

    def subset(self, index: np.ndarray) -> MultiPassageSplit:
        return MultiPassageSplit(self.name, self.a, self.text, self.forms,
                                 index=self.index[index], context_limit=self.context_limit,
                                 question_limit=self.question_limit)

    def collate(self, pos: np.ndarray) -> dict[str, torch.Tensor]:
        batch = super().collate(pos)
        mask = batch["c_mask"].numpy()
        start = self.a["ctx_ptr"][self.a["ex_ctx"][self.index[pos]]]
        token = np.minimum(start[:, None] + np.arange(mask.shape[1]), len(self.a["ctx_form"]) - 1)
        passage = np.where(mask, self.a["ctx_passage"][token], 0)
        batch["c_passage"] = torch.from_numpy(passage.astype(np.int64))
        batch["c_passage_mask"] = torch.from_numpy(passage_mask(passage, mask))
        batch["occ_start"], batch["occ_end"] = self._occurrences(self.index[pos],
                                                                 mask.sum(1))
        return batch

    def _occurrences(self, ex: np.ndarray, lengths: np.ndarray
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The answer spans of examples ``ex``, ``-1`` past each one's count and past its
        (possibly cut) context length ``lengths``."""
        lo, hi = self.a["occ_ptr"][ex], self.a["occ_ptr"][ex + 1]
        occ = np.full((len(ex), max(int((hi - lo).max(initial=0)), 1), 2), -1, np.int64)
        for row, (a, b) in enumerate(zip(lo, hi)):
            occ[row, :b - a] = self.a["occ"][a:b]
        occ[occ[..., 1] >= lengths[:, None]] = -1  # cut off by a context limit
        return torch.from_numpy(occ[..., 0]), torch.from_numpy(occ[..., 1])

    def passage_spans(self, i: int) -> list[tuple[int, int]]:
        """Token ranges ``[start, end)`` of example ``i``'s passages, in rank order."""
        cid = self.a["ex_ctx"][self.index[i]]
        ids = self.a["ctx_passage"][self.a["ctx_ptr"][cid]:self.a["ctx_ptr"][cid + 1]]
        edges = np.flatnonzero(np.diff(ids)) + 1
        bounds = [0, *edges.tolist(), len(ids)]
        return list(zip(bounds[:-1], bounds[1:]))


# --- ranking -----------------------------------------------------------------------------------


class TfidfRanker:
    """TF-IDF cosine similarity between a question and the paragraphs of one article.

    A paragraph's vector has ``(1 + ln tf) · idf`` per term, ``idf = ln(N / df)`` over the
    article's ``N`` paragraphs (a term found in every paragraph does not help to choose); the
    question's is built the same way. Terms are lower-cased alphanumeric tokens.
    """

    def __init__(self, paragraphs: Sequence[list[str]]):
        counts = [Counter(self.terms(words)) for words in paragraphs]
        df = Counter(t for c in counts for t in c)
        self.idf = {t: math.log(len(counts) / n) for t, n in df.items()}
        self.vectors = [self.vector(c) for c in counts]

    @staticmethod
    def terms(words: list[str]) -> list[str]:
        return [w.lower() for w in words if w.isalnum()]

    def vector(self, counts: Counter) -> dict[str, float]:
        v = {t: (1 + math.log(n)) * self.idf.get(t, 0.0) for t, n in counts.items()}
        norm = math.sqrt(sum(x * x for x in v.values())) or 1.0
        return {t: x / norm for t, x in v.items()}

    def scores(self, question: list[str]) -> list[float]:
        q = self.vector(Counter(self.terms(question)))
        return [sum(x * p.get(t, 0.0) for t, x in q.items()) for p in self.vectors]

    def rank(self, question: list[str]) -> list[int]:
        """Indices of the paragraphs, best first (ties: article order)."""
        scores = self.scores(question)
        return sorted(range(len(scores)), key=lambda i: (-scores[i], i))


def choose_passages(ranked: list[int], gold: int, m: int | None,
                    tokens: Mapping[int, Sized], token_cap: int = TOKEN_CAP) -> list[int]:
    """The gold paragraph and the best ``m − 1`` others, in rank order; the lowest-ranked
    others are dropped until their token counts (``len(tokens[p])``) sum to at most
    ``token_cap``."""
    others = [p for p in ranked if p != gold]
    keep = set(others if m is None else others[:m - 1]) | {gold}
    chosen = [p for p in ranked if p in keep]
    total = sum(len(tokens[p]) for p in chosen)
    for p in reversed([p for p in chosen if p != gold]):
        if total <= token_cap:
            break
        chosen.remove(p)
        total -= len(tokens[p])
    return chosen


# --- building ----------------------------------------------------------------------------------


def find_occurrences(words: Sequence[str], answer: Sequence[str]) -> list[tuple[int, int]]:
    """Every ``(start, end)`` token span (inclusive) where ``answer`` occurs in ``words``,
    compared lower-cased."""
    words, answer = [w.lower() for w in words], [w.lower() for w in answer]
    n = len(answer)
    return [(i, i + n - 1) for i in range(len(words) - n + 1) if n and words[i:i + n] == answer]


def answer_occurrences(arrays: dict, contexts: list[Tokens]) -> tuple[np.ndarray, np.ndarray]:
    """``occ_ptr`` ``[n + 1]`` and ``occ`` ``[total, 2]``: for each example the occurrences of
    its gold answer span's tokens in its whole context (the gold span itself included)."""
    spans = []
    for e, (y1, y2) in enumerate(arrays["y"]):
        words = contexts[arrays["ex_ctx"][e]].words
        spans.append(find_occurrences(words, words[y1:y2 + 1]) if y1 >= 0 else [])
    ptr = np.concatenate([[0], np.cumsum([len(f) for f in spans])]).astype(np.int64)
    occ = np.asarray([o for f in spans for o in f], np.int32).reshape(-1, 2)
    return ptr, occ


def _paragraph_tokens(split: Split, cid: int) -> Tokens:
    a = split.a
    lo, hi = a["ctx_ptr"][cid], a["ctx_ptr"][cid + 1]
    words = [split.forms.strings[f] for f in a["ctx_form"][lo:hi]]
    return Tokens(words, split.starts[lo:hi], split.ends[lo:hi])


def _concatenate(parts: list[Tokens], texts: list[str]) -> tuple[Tokens, list[int], np.ndarray]:
    """One context from passages: its tokens (offsets shifted), each passage's character
    offset in the joined text, and each token's passage index."""
    shifts = np.cumsum([0] + [len(t) + len(SEPARATOR) for t in texts[:-1]]).tolist()
    tokens = Tokens([w for p in parts for w in p.words],
                    np.concatenate([p.starts + s for p, s in zip(parts, shifts)]),
                    np.concatenate([p.ends + s for p, s in zip(parts, shifts)]))
    passage = np.repeat(np.arange(len(parts), dtype=np.uint16), [len(p) for p in parts])
    return tokens, shifts, passage


def build_split(source: Split, vocab, m: int | None, token_cap: int = TOKEN_CAP,
                name: str | None = None) -> MultiPassageSplit:
    """Multi-passage examples for every question of ``source`` (a prepared paragraph split)."""
    text, a = source.text, source.a
    titles = text["titles"]
    articles: dict[str, list[int]] = {}
    for cid, title in enumerate(titles):
        articles.setdefault(title, []).append(cid)
    paragraphs: dict[int, Tokens] = {}
    rankers: dict[str, TfidfRanker] = {}

    def article(title: str) -> TfidfRanker:
        if title not in rankers:
            paragraphs.update((cid, _paragraph_tokens(source, cid)) for cid in articles[title])
            rankers[title] = TfidfRanker([paragraphs[cid].words for cid in articles[title]])
        return rankers[title]

    contexts: dict[tuple[int, ...], int] = {}
    ctx_tokens, ctx_text, ctx_titles, ctx_passage, shifts = [], [], [], [], []
    examples, q_tokens, gold_position, gold_rank, candidates = [], [], [], [], []
    for i in range(len(source)):
        e = source.index[i]
        gold = int(a["ex_ctx"][e])
        words = source.tokens(i, "q")
        title = titles[gold]
        ranked = [articles[title][r] for r in article(title).rank(words)]
        chosen = tuple(choose_passages(ranked, gold, m, paragraphs, token_cap))
        if chosen not in contexts:
            contexts[chosen] = len(ctx_tokens)
            texts = [text["contexts"][p] for p in chosen]
            tokens, shift, passage = _concatenate([paragraphs[p] for p in chosen], texts)
            ctx_tokens.append(tokens)
            ctx_text.append(SEPARATOR.join(texts))
            ctx_titles.append(titles[gold])
            ctx_passage.append(passage)
            shifts.append(dict(zip(chosen, shift)))
        cid = contexts[chosen]
        shift = shifts[cid][gold]
        answers = tuple(Answer(t, s + shift) for t, s in text["answers"][e])
        examples.append(Example(text["qids"][e], text["questions"][e], cid, answers))
        q_tokens.append(Tokens(words, np.zeros(len(words), np.int32),
                               np.zeros(len(words), np.int32)))
        gold_position.append(chosen.index(gold))
        gold_rank.append(ranked.index(gold))
        candidates.append(len(ranked))
    sq = SquadFile(path=f"<multi-passage {source.name}>", version="1.1", titles=ctx_titles,
                   contexts=ctx_text, examples=examples)
    form_index = {s: f for f, s in enumerate(source.forms.strings)}
    arrays, enc_text = encode(sq, ctx_tokens, q_tokens, form_index, vocab)
    arrays["ctx_passage"] = np.concatenate(ctx_passage) if ctx_passage else np.zeros(0, np.uint16)
    arrays["gold_position"] = np.asarray(gold_position, np.int32)
    arrays["gold_rank"] = np.asarray(gold_rank, np.int32)
    arrays["article_paragraphs"] = np.asarray(candidates, np.int32)
    arrays["occ_ptr"], arrays["occ"] = answer_occurrences(arrays, ctx_tokens)
    return MultiPassageSplit(name or source.name, arrays, enc_text, source.forms,
                             question_limit=source.question_limit)


# --- cache and loading -------------------------------------------------------------------------


def _cached_split(data: PreparedData, split: str, m: int | None, token_cap: int,
                  cache_dir=None) -> MultiPassageSplit:
    """``build_split`` of a prepared split, from the cache when it was built before."""
    source = data.splits[split]
    qids = hashlib.sha256("\n".join(source.qids).encode()).hexdigest()
    options = {"prepared": data.folder.name, "split": split, "m": m, "token_cap": token_cap,
               "qids": qids, "v": BUILD_VERSION}
    key = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:16]
    folder = cache_root(cache_dir) / "multipassage"
    arrays_path, text_path = folder / f"{key}.npz", folder / f"{key}.json.gz"
    if arrays_path.is_file() and text_path.is_file():
        with np.load(arrays_path) as f:
            arrays = {k: f[k] for k in f.files}
        return MultiPassageSplit(split, arrays, Texts(text_path), source.forms,
                                 question_limit=source.question_limit)
    built = build_split(source, data.vocab, m, token_cap, name=split)
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(text_path) as tmp, gzip.open(tmp, "wt", encoding="utf-8") as f:
        json.dump(built.text, f, ensure_ascii=False)
    with atomic_path(arrays_path) as tmp, open(tmp, "wb") as f:
        np.savez_compressed(f, **built.a)
    return built


def multipassage(data: PreparedData, m: int | None, *, token_cap: int = TOKEN_CAP,
                 cache_dir=None) -> PreparedData:
    """Multi-passage versions of the splits of prepared SQuAD v1.1 ``data``, ``m`` passages per
    question (``None``: the whole article), with the same vocabulary; the result trains with
    :func:`mrc_lib.train.train` (``data=``). Load ``data`` with ``context_limit=None`` so that
    no training question is dropped for its gold paragraph's length."""
    splits = {s: _cached_split(data, s, m, token_cap, cache_dir) for s in data.splits}
    name = f"squad-v1.1-multipassage-M{'all' if m is None else m}"
    meta = {"m": m, "token_cap": token_cap, "source": data.folder.name,
            "statistics": {s: statistics(sp) for s, sp in splits.items()}}
    return PreparedData(name, data.version, data.vocab, splits, data.digests, data.folder, meta)


def load_multipassage(m: int | None, *, limits: dict[str, int] | None = None,
                      token_cap: int = TOKEN_CAP, question_limit: int | None = 50,
                      glove: str = "glove.6B.50d", pipeline: str | None = None,
                      data_dir=None, cache_dir=None) -> PreparedData:
    """:func:`multipassage` over the first ``limits[split]`` questions of SQuAD v1.1 train and
    dev, none dropped for its length."""
    data = load_prepared("squad-v1.1", ("train", "dev"), glove=glove, pipeline=pipeline,
                         limits=limits, context_limit=None, question_limit=question_limit,
                         data_dir=data_dir, cache_dir=cache_dir)
    return multipassage(data, m, token_cap=token_cap, cache_dir=cache_dir)


def statistics(split: MultiPassageSplit) -> dict:
    """Tokens and passages per example, paragraphs in the question's article, and where the
    gold passage sits: its position among the example's passages and its TF-IDF rank in the
    whole article (both from 0)."""
    ex = split.index
    tokens = split.context_lengths()
    last = split.a["ctx_ptr"][split.a["ex_ctx"][ex] + 1] - 1  # each context's last token
    passages = split.a["ctx_passage"][last].astype(np.int64) + 1
    position = split.a["gold_position"][ex]
    pct = (50, 90, 99, 100)
    return {
        "questions": len(ex),
        "tokens_mean": float(tokens.mean()),
        "tokens_percentiles": {f"p{p}": int(v) for p, v in zip(pct, np.percentile(tokens, pct))},
        "passages_mean": float(passages.mean()),
        "article_paragraphs_mean": float(split.a["article_paragraphs"][ex].mean()),
        "gold_first": float((position == 0).mean()),
        "gold_position_counts": dict(Counter(position.tolist())),
        "gold_rank_counts": dict(Counter(split.a["gold_rank"][ex].tolist())),
    }
