"""Word and character vocabularies, and the table of token forms that links them.

Word ids: 0 = PAD, 1 = UNK, then ``n_trainable - 2`` training words missing from GloVe
(trainable rows, randomly initialised), then words with a GloVe vector (fixed rows). This is
the split the readers use: pretrained vectors stay fixed, OOV words learn (QANet instead maps
every OOV word to the UNK row, its Sec. 2.2: ``WordEmbedding(oov_rows=False)``).

A *form* is a token string as it appears in the text (cased). Each split stores form ids; the
form table maps a form to its word id and its character ids, so characters are stored once per
distinct string instead of once per token.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mrc_lib.utils import atomic_path

PAD, UNK = 0, 1
MAX_WORD_CHARS = 16  # QANet truncates words to 16 characters
N_FEATS = 4  # exact match (original, lower-case, lemma) + normalized term frequency


@dataclass
class Vocab:
    words: list[str]
    chars: list[str]
    word_vectors: np.ndarray  # float32 [V, d]
    n_trainable: int
    lowercase: bool
    pos_tags: list[str]
    ner_tags: list[str]
    n_feats: int = N_FEATS

    def __post_init__(self):
        self.word_index = {w: i for i, w in enumerate(self.words)}
        self.char_index = {c: i for i, c in enumerate(self.chars)}

    @property
    def n_chars(self) -> int:
        return len(self.chars)

    def word_id(self, token: str) -> int:
        return self.word_index.get(token.lower() if self.lowercase else token, UNK)

    def char_ids(self, token: str) -> list[int]:
        return [self.char_index.get(c, UNK) for c in token[:MAX_WORD_CHARS]]

    def forms(self, strings: list[str]) -> Forms:
        """The form table for a list of distinct token strings (index 0 must be the PAD form)."""
        word = np.fromiter((self.word_id(s) for s in strings), np.int32, len(strings))
        chars = np.zeros((len(strings), MAX_WORD_CHARS), np.int16)
        for i, s in enumerate(strings):
            ids = self.char_ids(s)
            chars[i, :len(ids)] = ids
        word[0], chars[0] = PAD, PAD
        return Forms(strings, word, chars)

    def save(self, folder) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        with atomic_path(folder / "vectors.npy") as tmp, open(tmp, "wb") as f:
            np.save(f, self.word_vectors)
        meta = {k: getattr(self, k) for k in
                ("words", "chars", "n_trainable", "lowercase", "pos_tags", "ner_tags")}
        with atomic_path(folder / "vocab.json") as tmp:
            tmp.write_text(json.dumps(meta, ensure_ascii=False))

    @classmethod
    def load(cls, folder) -> Vocab:
        folder = Path(folder)
        meta = json.loads((folder / "vocab.json").read_text())
        return cls(word_vectors=np.load(folder / "vectors.npy"), **meta)


@dataclass
class Forms:
    strings: list[str]
    word: np.ndarray  # int32 [F]: word id of each form
    chars: np.ndarray  # int16 [F, MAX_WORD_CHARS]: char ids, 0-padded


def build_vocab(train_tokens: list[list[str]], glove_words,
                glove_vectors: np.ndarray, *, lowercase: bool, oov_min_count: int,
                char_min_count: int, pos_tags=(), ner_tags=(), seed: int = 0) -> Vocab:
    """Build the vocabulary from tokenized texts.

    ``glove_words``/``glove_vectors`` are GloVe restricted to the words of all splits (their
    vectors are fixed, so including dev words leaks nothing); OOV rows come from training only.
    """
    norm = str.lower if lowercase else str
    counts = Counter(norm(w) for toks in train_tokens for w in toks)
    in_glove = set(glove_words)
    oov = sorted((w for w, c in counts.items() if c >= oov_min_count and w not in in_glove),
                 key=lambda w: (-counts[w], w))
    words = ["<pad>", "<unk>", *oov, *glove_words]
    d = glove_vectors.shape[1]
    rng = np.random.default_rng(seed)
    scale = float(glove_vectors.std()) if len(glove_vectors) else 0.1
    trainable = rng.normal(0.0, scale, (len(oov) + 2, d)).astype(np.float32)
    trainable[PAD] = 0.0
    vectors = np.concatenate([trainable, glove_vectors.astype(np.float32)])
    char_counts = Counter(c for toks in train_tokens for w in toks for c in w[:MAX_WORD_CHARS])
    chars = ["<pad>", "<unk>", *sorted(c for c, n in char_counts.items() if n >= char_min_count)]
    return Vocab(words, chars, vectors, len(oov) + 2, lowercase, ["<pad>", *pos_tags],
                 ["<pad>", *ner_tags])
