"""Encoded SQuAD splits and length-bucketed batching.

A split is a handful of flat arrays (CSR layout: ``*_ptr`` gives where each context or question
starts), so loading needs neither spaCy nor the raw JSON, and a batch is assembled with a few
vectorised gathers. Batch keys (all ``torch.Tensor``):

=============  ============  =====================================================================
key            shape         meaning
=============  ============  =====================================================================
c_words        [B, Lc] long  word ids of the context (0 = PAD)
c_chars        [B, Lc, W]    char ids of each context token
c_mask         [B, Lc] bool  True at real tokens
q_words ...    [B, Lq] ...   the same for the question
c_feats        [B, Lc, 4]    exact match (original, lower-case, lemma), normalized term frequency
q_feats        [B, Lq, 3]    exact match of each question word in its whole context (original,
                             lower-case, lemma)
q_type         [B] long      index into :data:`mrc_lib.data.text.QUESTION_TYPES`
y1, y2         [B] long      gold start/end token (-1 when unanswerable)
has_answer     [B] bool
idx            [B] long      position of the example in the split
c_pos ...      [B, Lc]       POS / NER tag ids, only when a tagging pipeline was used
=============  ============  =====================================================================
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from mrc_lib.data.squad import SquadFile
from mrc_lib.data.text import Tokenizer, Tokens, char_to_token_span, question_type
from mrc_lib.data.vocab import PAD, Forms, Vocab
from mrc_lib.errors import UserError

BUCKET_CHUNK = 100  # batches per sorting chunk: enough to bucket by length, still random


def index_forms(token_lists, index: dict[str, int] | None = None) -> dict[str, int]:
    """Give every distinct token string a form id (0 is reserved for PAD)."""
    index = {"<pad>": 0} if index is None else index
    for toks in token_lists:
        for w in toks.words:
            if w not in index:
                index[w] = len(index)
    return index


def encode(sq: SquadFile, ctx: list[Tokens], qs: list[Tokens], form_index: dict[str, int],
           vocab: Vocab) -> tuple[dict[str, np.ndarray], dict]:
    """Turn a tokenized SQuAD file into flat arrays (see the module docstring) and text."""
    def csr(tok_lists, field):
        lens = np.fromiter((len(t) for t in tok_lists), np.int64, len(tok_lists))
        ptr = np.concatenate([[0], np.cumsum(lens)])
        if field == "form":
            flat = [form_index[w] for t in tok_lists for w in t.words]
            return ptr, np.asarray(flat, np.int32)
        return ptr, np.concatenate([getattr(t, field) for t in tok_lists]).astype(np.int32)

    a: dict[str, np.ndarray] = {}
    a["ctx_ptr"], a["ctx_form"] = csr(ctx, "form")
    _, starts = csr(ctx, "starts")
    _, ends = csr(ctx, "ends")
    a["ctx_gap"], a["ctx_len"] = pack_offsets(a["ctx_ptr"], starts, ends)
    a["q_ptr"], a["q_form"] = csr(qs, "form")
    lower = {}  # lower-cased string -> id, for the lower-case match and term frequency
    lid = [np.fromiter((lower.setdefault(w.lower(), len(lower)) for w in t.words), np.int64,
                       len(t)) for t in ctx]
    # Term frequency (DrQA; DecaProp Sec. 3.1): count in the context, normalized in collate().
    tf = [np.unique(ids, return_inverse=True, return_counts=True)[1:] for ids in lid]
    a["ctx_count"] = np.concatenate([c[inv] for inv, c in tf]).clip(0, 255).astype(np.uint8)
    if ctx and ctx[0].pos is not None:
        pos = {t: i for i, t in enumerate(vocab.pos_tags)}
        ner = {t: i for i, t in enumerate(vocab.ner_tags)}
        for name, toks in (("ctx", ctx), ("q", qs)):
            a[f"{name}_pos"] = np.array([pos.get(p, 0) for t in toks for p in t.pos], np.uint8)
            a[f"{name}_ner"] = np.array([ner.get(n, 0) for t in toks for n in t.ner], np.uint8)
    n = len(sq.examples)
    y = np.full((n, 2), -1, np.int32)
    qtype = np.zeros(n, np.uint8)
    em, q_em = [], []
    inexact = unaligned = 0
    for i, ex in enumerate(sq.examples):
        c, q = ctx[ex.context_id], qs[i]
        qtype[i] = question_type(q.words)
        qset = set(q.words)
        qlow = {w.lower() for w in q.words}
        bits = (np.fromiter((w in qset for w in c.words), np.uint8, len(c))
                | np.fromiter((w.lower() in qlow for w in c.words), np.uint8, len(c)) << 1)
        if c.lemmas is not None:
            qlem = set(q.lemmas)
            bits |= np.fromiter((w in qlem for w in c.lemmas), np.uint8, len(c)) << 2
        em.append(bits)
        # The question side: does each question word occur in the (whole) context.
        cset, clow = set(c.words), {w.lower() for w in c.words}
        qbits = (np.fromiter((w in cset for w in q.words), np.uint8, len(q))
                 | np.fromiter((w.lower() in clow for w in q.words), np.uint8, len(q)) << 1)
        if q.lemmas is not None and c.lemmas is not None:
            clem = set(c.lemmas)
            qbits |= np.fromiter((w in clem for w in q.lemmas), np.uint8, len(q)) << 2
        q_em.append(qbits)
        spans = [char_to_token_span(c, ans.start, ans.start + len(ans.text)) for ans in ex.answers]
        inexact += sum(not s[2] for s in spans)
        good = [s for s in spans if s[0] >= 0]
        unaligned += len(spans) - len(good)
        if good:  # the first answer that falls on token boundaries, else the first one
            y[i] = next((s for s in good if s[2]), good[0])[:2]
    a["ex_ctx"] = np.fromiter((e.context_id for e in sq.examples), np.int32, n)
    a["ex_q"] = np.arange(n, dtype=np.int32)
    a["y"], a["q_type"] = y, qtype
    a["has_answer"] = np.array([not e.is_impossible and y[i, 0] >= 0
                                for i, e in enumerate(sq.examples)], bool)
    a["em"] = np.concatenate(em) if em else np.zeros(0, np.uint8)
    a["q_em"] = np.concatenate(q_em) if q_em else np.zeros(0, np.uint8)
    text = {
        "version": sq.version, "contexts": sq.contexts, "titles": sq.titles,
        "qids": [e.qid for e in sq.examples], "questions": [e.question for e in sq.examples],
        "answers": [[[x.text, x.start] for x in e.answers] for e in sq.examples],
        "impossible": [e.is_impossible for e in sq.examples],
        "alignment": {"answers": sum(len(e.answers) for e in sq.examples),
                      "not_on_token_boundaries": inexact, "no_overlapping_token": unaligned},
    }
    return a, text


class Texts(Mapping):
    """A saved split's texts (``<split>.json.gz``: version, questions, contexts, answers), read
    on first use. Training reads none of them, so the copy of a cache carried to a GPU machine
    may leave the training split's out (``book/how_to_reproduce.md``); what needs them then
    names the missing file."""

    def __init__(self, path: Path):
        self.path, self._texts = Path(path), None

    def _load(self) -> dict:
        if self._texts is None:
            try:
                with gzip.open(self.path, "rt", encoding="utf-8") as f:
                    self._texts = json.load(f)
            except FileNotFoundError:
                raise UserError(f"{self.path}: missing; this copy of the cache has the split's "
                                "arrays but not its texts, which this step needs") from None
        return self._texts

    def __getitem__(self, key: str):
        return self._load()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())


class Split:
    """One encoded split: the arrays of :func:`encode`, its text (a dict, or :class:`Texts`
    read on first use), and the form table."""

    def __init__(self, name: str, arrays: dict, text: dict, forms: Forms, *,
                 index: np.ndarray | None = None, context_limit: int | None = None,
                 question_limit: int | None = None):
        self.name, self.a, self.text, self.forms = name, arrays, text, forms
        self.starts, self.ends = unpack_offsets(arrays["ctx_ptr"], arrays["ctx_gap"],
                                                arrays["ctx_len"])
        self.context_limit, self.question_limit = context_limit, question_limit
        self._em_ptr = np.concatenate([[0], np.cumsum(self._ctx_len(arrays["ex_ctx"]))])
        self.index = np.arange(len(arrays["ex_ctx"])) if index is None else index

    @property
    def version(self) -> str:
        return self.text["version"]

    def _ctx_len(self, cid):
        return self.a["ctx_ptr"][cid + 1] - self.a["ctx_ptr"][cid]

    def subset(self, index: np.ndarray) -> Split:
        return Split(self.name, self.a, self.text, self.forms, index=self.index[index],
                     context_limit=self.context_limit, question_limit=self.question_limit)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def qids(self) -> list[str]:
        return [self.text["qids"][e] for e in self.index]

    def context_lengths(self) -> np.ndarray:
        return self._ctx_len(self.a["ex_ctx"][self.index])

    def question_lengths(self) -> np.ndarray:
        q = self.a["ex_q"][self.index]
        return self.a["q_ptr"][q + 1] - self.a["q_ptr"][q]

    # ----------------------------------------------------------------- batching
    def num_batches(self, batch_size: int) -> int:
        return -(-len(self) // batch_size)

    def batch_order(self, batch_size: int, *, shuffle: bool, seed: int = 0,
                    epoch: int = 0) -> list[np.ndarray]:
        """Positions of each batch, bucketed by context length (:func:`bucketed_batches`)."""
        return bucketed_batches(self.context_lengths(), batch_size, shuffle=shuffle, seed=seed,
                                epoch=epoch)

    def batches(self, batch_size: int, *, shuffle: bool, seed: int = 0, epoch: int = 0,
                skip: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        for pos in self.batch_order(batch_size, shuffle=shuffle, seed=seed, epoch=epoch)[skip:]:
            yield self.collate(pos)

    def collate(self, pos: np.ndarray) -> dict[str, torch.Tensor]:
        a, ex = self.a, self.index[pos]
        cid, qid = a["ex_ctx"][ex], a["ex_q"][ex]
        c_start, c_len = a["ctx_ptr"][cid], self._ctx_len(cid)
        q_start, q_len = a["q_ptr"][qid], a["q_ptr"][qid + 1] - a["q_ptr"][qid]
        if self.context_limit:
            c_len = np.minimum(c_len, self.context_limit)
        if self.question_limit:
            q_len = np.minimum(q_len, self.question_limit)
        c_idx, c_mask = _ragged(c_start, c_len)
        q_idx, q_mask = _ragged(q_start, q_len)
        e_idx, _ = _ragged(self._em_ptr[ex], c_len)
        c_form = np.where(c_mask, a["ctx_form"][c_idx], PAD)
        q_form = np.where(q_mask, a["q_form"][q_idx], PAD)
        bits = a["em"][e_idx]
        tf = a["ctx_count"][c_idx] / self._ctx_len(cid)[:, None]
        feats = np.concatenate([_bits(bits), tf[..., None]], -1) * c_mask[..., None]
        y = a["y"][ex].astype(np.int64)
        y[(y >= c_len[:, None]).any(1)] = -1  # answer cut off by the context limit
        batch = {
            "c_words": self.forms.word[c_form].astype(np.int64), "c_chars": self._chars(c_form),
            "q_words": self.forms.word[q_form].astype(np.int64), "q_chars": self._chars(q_form),
            "c_mask": c_mask, "q_mask": q_mask,
            "c_feats": feats.astype(np.float32), "q_type": a["q_type"][ex].astype(np.int64),
            "q_feats": (_bits(a["q_em"][q_idx]) * q_mask[..., None]).astype(np.float32),
            "y1": y[:, 0], "y2": y[:, 1], "has_answer": a["has_answer"][ex] & (y[:, 0] >= 0),
            "idx": pos.astype(np.int64),
        }
        if "ctx_pos" in a:
            for side, idx, mask in (("c", c_idx, c_mask), ("q", q_idx, q_mask)):
                name = "ctx" if side == "c" else "q"
                batch[f"{side}_pos"] = np.where(mask, a[f"{name}_pos"][idx], 0).astype(np.int64)
                batch[f"{side}_ner"] = np.where(mask, a[f"{name}_ner"][idx], 0).astype(np.int64)
        return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()}

    def _chars(self, forms: np.ndarray) -> np.ndarray:
        chars = self.forms.chars[forms]
        width = max(int((chars != 0).sum(-1).max(initial=1)), 1)
        return chars[..., :width].astype(np.int64)

    # ----------------------------------------------------------------- answers
    def char_span(self, i: int, start: int, end: int) -> tuple[int, int]:
        """Character span of tokens ``start..end`` (inclusive) of example ``i``'s context."""
        base = self.a["ctx_ptr"][self.a["ex_ctx"][self.index[i]]]
        return int(self.starts[base + start]), int(self.ends[base + end])

    def context(self, i: int) -> str:
        return self.text["contexts"][self.a["ex_ctx"][self.index[i]]]

    def question(self, i: int) -> str:
        return self.text["questions"][self.index[i]]

    def tokens(self, i: int, side: str = "c") -> list[str]:
        """The token strings of the context (``"c"``) or question (``"q"``) of example ``i``."""
        ptr, form, row = ((self.a["ctx_ptr"], self.a["ctx_form"], self.a["ex_ctx"])
                          if side == "c" else (self.a["q_ptr"], self.a["q_form"], self.a["ex_q"]))
        r = row[self.index[i]]
        return [self.forms.strings[f] for f in form[ptr[r]:ptr[r + 1]]]

    def answer_text(self, i: int, start: int, end: int) -> str:
        s, e = self.char_span(i, start, end)
        return self.context(i)[s:e]

    def squad_json(self) -> dict:
        """The split's questions in the official SQuAD format, for official evaluation."""
        t, paras = self.text, {}
        for e in self.index:
            cid = int(self.a["ex_ctx"][e])
            qa = {"id": t["qids"][e], "question": t["questions"][e],
                  "answers": [{"text": x, "answer_start": s} for x, s in t["answers"][e]]}
            if self.version == "2.0":
                qa["is_impossible"] = t["impossible"][e]
            paras.setdefault(cid, []).append(qa)
        data = {}
        for cid, qas in paras.items():
            title = t["titles"][cid]
            data.setdefault(title, []).append({"context": t["contexts"][cid], "qas": qas})
        return {"version": self.version,
                "data": [{"title": k, "paragraphs": v} for k, v in data.items()]}


def bucketed_batches(lengths: np.ndarray, batch_size: int, *, shuffle: bool, seed: int = 0,
                     epoch: int = 0) -> list[np.ndarray]:
    """Positions of each batch of examples of these ``lengths``. Shuffled: random chunks of
    ``BUCKET_CHUNK`` batches, each sorted by length, cut into batches, batches shuffled;
    deterministic for (seed, epoch). Not shuffled: sorted by length (for evaluation)."""
    if not shuffle:
        order = np.argsort(lengths, kind="stable")
        return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    rng = np.random.default_rng([seed, epoch])
    perm = rng.permutation(len(lengths))
    chunk = batch_size * BUCKET_CHUNK
    batches = []
    for i in range(0, len(perm), chunk):
        part = perm[i:i + chunk]
        part = part[np.argsort(lengths[part], kind="stable")]
        batches += [part[j:j + batch_size] for j in range(0, len(part), batch_size)]
    return [batches[k] for k in rng.permutation(len(batches))]


# The keys of every task's batches that run along the context (a document) and the question
# (a query): ``pad_lengths`` lengthens them with padding; ``FILL`` gives a key's padding value
# where it is not 0 (``cand_index``: -1, no candidate). ``c_passage_mask`` ``[B, M, Lp]`` runs
# along a passage (its last axis).
CONTEXT_KEYS, QUESTION_KEYS = ("c_", "doc_", "cand_index"), ("q_", "query_")
FILL = {"cand_index": -1}


def pad_lengths(batch: Mapping[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
    """``batch`` with its context, question and passage lengths rounded up to a multiple of
    ``multiple`` by more padding (``multiple`` 1: unchanged), so that batch shapes recur. Keys
    are matched by :data:`CONTEXT_KEYS` and :data:`QUESTION_KEYS` prefixes and padded along
    their second axis (``c_passage_mask`` along its last)."""
    out = dict(batch)
    if multiple <= 1:
        return out
    for key, v in batch.items():
        if v.dim() < 2 or not key.startswith(CONTEXT_KEYS + QUESTION_KEYS):
            continue
        axis = -1 if key == "c_passage_mask" else 1
        extra = -v.shape[axis] % multiple
        if extra:
            shape = list(v.shape)
            shape[axis] = extra
            out[key] = torch.cat([v, v.new_full(shape, FILL.get(key, 0))], axis)
    return out


def pack_offsets(ptr, starts, ends) -> tuple[np.ndarray, np.ndarray]:
    """Character offsets as (gap before each token, token length): small numbers that
    compress ~10x better than absolute offsets."""
    prev_end = np.concatenate([[0], ends[:-1]])
    prev_end[ptr[:-1][ptr[:-1] < len(ends)]] = 0  # the first token of a text starts from 0
    return (starts - prev_end).astype(np.uint16), (ends - starts).astype(np.uint16)


def unpack_offsets(ptr, gap, length) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`pack_offsets`."""
    step = gap.astype(np.int64) + length
    total = np.cumsum(step)
    base = np.repeat(total[ptr[:-1]] - step[ptr[:-1]], np.diff(ptr)) if len(step) else total
    ends = total - base
    return (ends - length).astype(np.int32), ends.astype(np.int32)


def _bits(bits: np.ndarray) -> np.ndarray:
    """The three exact-match bits (original form, lower case, lemma) of packed ``uint8``s, as a
    last axis of 0/1."""
    return np.stack([bits & 1, bits >> 1 & 1, bits >> 2 & 1], -1)


def _ragged(start: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gather indices ``start[b] + j`` for ``j < length[b]`` as a padded matrix, and its mask."""
    j = np.arange(max(int(length.max(initial=0)), 1))
    mask = j[None, :] < length[:, None]
    return np.where(mask, start[:, None] + j[None, :], 0), mask


def encode_texts(vocab: Vocab, pairs: list[tuple[str, str]], *, pipeline: str | None = None,
                 qids: list[str] | None = None) -> Split:
    """Encode free (context, question) pairs with a trained run's vocabulary (for ``predict``)."""
    from mrc_lib.data.squad import Example

    qids = qids or [str(i) for i in range(len(pairs))]
    sq = SquadFile(path="<input>", version="1.1", titles=[""] * len(pairs),
                   contexts=[c for c, _ in pairs],
                   examples=[Example(q_id, q, i, ()) for i, (q_id, (_, q)) in
                             enumerate(zip(qids, pairs))])
    return encode_squad(sq, vocab, Tokenizer(pipeline))


def encode_squad(sq: SquadFile, vocab: Vocab, tokenizer: Tokenizer) -> Split:
    """Encode a (validated) SQuAD file with an existing vocabulary."""
    ctx = list(tokenizer(sq.contexts))
    qs = list(tokenizer(e.question for e in sq.examples))
    index = index_forms(ctx + qs)
    arrays, text = encode(sq, ctx, qs, index, vocab)
    return Split("input", arrays, text, vocab.forms(list(index)))
