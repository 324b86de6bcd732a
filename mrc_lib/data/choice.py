"""Candidate-choice data: the Wiki-cloze questions (:mod:`mrc_lib.data.cloze`) as the two choice
tasks of :mod:`mrc_lib.tasks` read them.

* ``cloze`` (EA Reader, chapter 05): the document, the query with its blank and the candidates,
  as rows of the cloze set's own embedding table (:class:`ClozeSplit`).
* ``multiple_choice`` (DynSAN's Eqs. 7-8, chapter 02): the same questions in **multi-passage
  form** for a span reader's encoder, with the SQuAD v1.1 vocabulary: every sentence of the
  document is a passage, in document order (its rank), the query with its blank is the
  question, and a binary candidate flag is the one context feature (:class:`PassageSplit`).
  Entity units (words joined by ``_``) have no GloVe vector and get the unknown word's; the
  character CNN and the candidate feature tell them apart.

Both batch alike (:class:`ChoiceSplit`): ``answer`` is the answer's place among the candidates
and ``idx`` each example's position in the split; ``valid`` is the trainer's ``dev`` split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from mrc_lib.data.cloze import PAD, ClozeExample, ClozeSet, cloze_embeddings, load_wiki_cloze
from mrc_lib.data.dataset import bucketed_batches
from mrc_lib.data.multipassage import passage_mask
from mrc_lib.data.vocab import MAX_WORD_CHARS, Vocab

SENTENCE_ENDS = frozenset({".", "!", "?"})
SPLITS = {"train": "train", "dev": "valid", "test": "test"}  # trainer's name -> Wiki-cloze's


@dataclass
class ChoiceData:
    """What the trainer reads: ``vocab`` (what the reader is built over), ``splits``
    (``train``, ``dev``, ``test``), ``digests`` of the input files, and a ``version`` label."""

    version: str
    vocab: object
    splits: dict
    digests: dict


class ChoiceSplit:
    """Batching shared by the choice splits, bucketed by document length like SQuAD's
    (:func:`~mrc_lib.data.dataset.bucketed_batches`); a subclass defines ``__len__``,
    ``lengths()``, ``collate``, ``candidates(i)`` and ``answer(i)`` (strings)."""

    name: str

    def num_batches(self, batch_size: int) -> int:
        return -(-len(self) // batch_size)

    def batches(self, batch_size: int, *, shuffle: bool, seed: int = 0, epoch: int = 0,
                skip: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Batches in an order fixed by ``(seed, epoch)``; the first ``skip`` batches are left
        out (a resumed epoch)."""
        order = bucketed_batches(self.lengths(), batch_size, shuffle=shuffle, seed=seed,
                                 epoch=epoch)
        for pos in order[skip:]:
            yield {**self.collate(pos), "idx": torch.as_tensor(pos, dtype=torch.int64)}

    @property
    def qids(self) -> list[str]:
        return [f"{self.name}-{i}" for i in range(len(self))]

    def chance(self) -> float:
        """Accuracy (%) of a uniformly random choice among each question's candidates."""
        return 100.0 * float(np.mean([1 / len(self.candidates(i)) for i in range(len(self))]))


class ClozeSplit(ChoiceSplit):
    """The first ``limit`` examples of a :class:`ClozeSet` with its embedding rows
    ``word_ids`` (form id -> row): the batches of :meth:`ClozeSet.collate`."""

    def __init__(self, data: ClozeSet, word_ids: np.ndarray, name: str,
                 limit: int | None = None):
        self.data, self.word_ids, self.name = data, word_ids, name
        self.n = len(data) if limit is None else min(limit, len(data))

    def __len__(self) -> int:
        return self.n

    def lengths(self) -> np.ndarray:
        return np.diff(self.data.doc_offsets[:self.n + 1])

    def collate(self, pos: Sequence[int]) -> dict[str, torch.Tensor]:
        return self.data.collate(pos, self.word_ids)

    def tokens(self, i: int, part: str = "d") -> list[str]:
        return self.data.text(self.data.doc(i) if part == "d" else self.data.qry(i))

    def question(self, i: int) -> str:
        return " ".join(self.tokens(i, "q"))

    def candidates(self, i: int) -> list[str]:
        cands = self.data.candidates[i]
        return self.data.text(cands[cands != PAD])

    def answer(self, i: int) -> str:
        return self.data.words[self.data.answer[i]]


def sentence_passages(document: list[str]) -> np.ndarray:
    """Each token's passage: a new passage starts after every sentence-final token."""
    ends = np.fromiter((w in SENTENCE_ENDS for w in document), bool, len(document))
    return np.concatenate([[0], np.cumsum(ends[:-1])]).astype(np.int64)


class PassageSplit(ChoiceSplit):
    """Cloze questions in multi-passage form, encoded with ``vocab`` (word and char ids).

    Batch keys: those of a SQuAD batch that an encoder reads (``c_words``, ``c_chars``,
    ``q_words``, ``q_chars``, masks, ``c_passage``, ``c_passage_mask``), ``c_feats``
    ``[B, L, 1]`` (the candidate flag), ``cand_index`` ``[B, L]`` (each token's candidate,
    ``-1`` for none), ``cand_mask`` ``[B, C]`` and ``answer``.
    """

    def __init__(self, examples: Sequence[ClozeExample], vocab: Vocab, name: str):
        self.examples, self.vocab, self.name = list(examples), vocab, name
        self.rows = [self._encode(e) for e in self.examples]

    def _ids(self, words: list[str]) -> tuple[np.ndarray, np.ndarray]:
        chars = np.zeros((len(words), MAX_WORD_CHARS), np.int64)
        for t, w in enumerate(words):
            ids = self.vocab.char_ids(w)
            chars[t, :len(ids)] = ids
        return np.fromiter((self.vocab.word_id(w) for w in words), np.int64, len(words)), chars

    def _encode(self, e: ClozeExample) -> dict:
        index = {c: k for k, c in enumerate(e.candidates)}
        cand = np.fromiter((index.get(w, -1) for w in e.document), np.int64, len(e.document))
        return {"c": self._ids(e.document), "q": self._ids(e.query), "cand": cand,
                "passage": sentence_passages(e.document), "answer": index[e.answer]}

    def __len__(self) -> int:
        return len(self.examples)

    def lengths(self) -> np.ndarray:
        return np.fromiter((len(r["cand"]) for r in self.rows), np.int64, len(self.rows))

    def tokens(self, i: int, side: str = "c") -> list[str]:
        return list(self.examples[i].document if side == "c" else self.examples[i].query)

    def question(self, i: int) -> str:
        return " ".join(self.examples[i].query)

    def candidates(self, i: int) -> list[str]:
        return list(self.examples[i].candidates)

    def answer(self, i: int) -> str:
        return self.examples[i].answer

    def collate(self, pos: Sequence[int]) -> dict[str, torch.Tensor]:
        rows = [self.rows[i] for i in pos]
        Lc, Lq = max(len(r["cand"]) for r in rows), max(len(r["q"][0]) for r in rows)
        n_cands = [len(self.examples[i].candidates) for i in pos]
        B = len(rows)
        batch = {k: np.zeros(shape, np.int64) for k, shape in (
            ("c_words", (B, Lc)), ("c_chars", (B, Lc, MAX_WORD_CHARS)),
            ("q_words", (B, Lq)), ("q_chars", (B, Lq, MAX_WORD_CHARS)), ("c_passage", (B, Lc)))}
        batch["cand_index"] = np.full((B, Lc), -1, np.int64)
        for b, r in enumerate(rows):
            n, m = len(r["cand"]), len(r["q"][0])
            batch["c_words"][b, :n], batch["c_chars"][b, :n] = r["c"]
            batch["q_words"][b, :m], batch["q_chars"][b, :m] = r["q"]
            batch["c_passage"][b, :n], batch["cand_index"][b, :n] = r["passage"], r["cand"]
        out = {k: torch.from_numpy(v) for k, v in batch.items()}
        out["c_mask"], out["q_mask"] = out["c_words"] != 0, out["q_words"] != 0
        out["c_passage_mask"] = torch.from_numpy(passage_mask(batch["c_passage"],
                                                              batch["c_words"] != 0))
        out["c_feats"] = (out["cand_index"] >= 0).float().unsqueeze(-1)  # candidate feature
        out["cand_mask"] = torch.arange(max(n_cands))[None] < torch.tensor(n_cands)[:, None]
        out["answer"] = torch.tensor([r["answer"] for r in rows])
        return out


# --- the two tasks' data ---------------------------------------------------------------------


def load_cloze_data(*, subset: str, limits: dict | None = None, glove: str = "glove.6B.50d",
                    seed: int = 0, **wiki) -> ChoiceData:
    """Wiki-cloze subset ``subset`` for the ``cloze`` task: the first ``limits[split]`` examples
    of each split, over the embedding rows of every subset's training words
    (:func:`~mrc_lib.data.cloze.cloze_embeddings`); ``wiki`` are
    :func:`~mrc_lib.data.cloze.load_wiki_cloze`'s options (``limits`` there is ``articles``
    here)."""
    cloze = _wiki_cloze(seed, wiki)
    word_ids, vectors, glove_digest = cloze_embeddings(cloze, glove, seed=seed)
    limits = limits or {}
    splits = {name: ClozeSplit(cloze.sets[subset][source], word_ids, source, limits.get(name))
              for name, source in SPLITS.items()}
    return ChoiceData(f"wiki-cloze {subset}", SimpleNamespace(word_vectors=vectors), splits,
                      {**cloze.digests, **glove_digest})


def load_passage_data(*, subset: str, limits: dict | None = None, glove: str = "glove.6B.50d",
                      seed: int = 0, **wiki) -> ChoiceData:
    """Wiki-cloze subset ``subset`` in multi-passage form for the ``multiple_choice`` task,
    encoded with the SQuAD v1.1 vocabulary (one context feature: the candidate flag)."""
    from mrc_lib.data.cache import load_prepared

    squad = load_prepared("squad-v1.1", ("train", "dev"), glove=glove, vocab_only=True)
    cloze = _wiki_cloze(seed, wiki)
    limits = limits or {}
    splits = {name: PassageSplit(cloze.examples(subset, source)[:limits.get(name)], squad.vocab,
                                 source)
              for name, source in SPLITS.items()}
    return ChoiceData(f"wiki-cloze {subset}, multi-passage",
                      dataclasses.replace(squad.vocab, n_feats=1), splits,
                      {**squad.digests, **cloze.digests})


def _wiki_cloze(seed: int, options: dict):
    """:func:`~mrc_lib.data.cloze.load_wiki_cloze` with the tasks' ``data_options`` (whose
    ``articles`` is its ``limits``)."""
    options = dict(options)
    return load_wiki_cloze(limits=options.pop("articles", None), seed=seed, **options)
