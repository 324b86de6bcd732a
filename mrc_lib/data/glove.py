"""Reading pre-trained GloVe vectors (Pennington et al., 2014).

A GloVe file has one word per line followed by its ``d`` values, separated by single spaces.
It is read as ``.txt``, ``.txt.gz`` or straight from the official ``.zip`` (``member`` names the
file inside). Only the lines whose word is wanted are parsed, so picking a vocabulary's rows out
of the 400,000 lines of ``glove.6B`` takes a few seconds.

``glove.840B.300d`` has a few words that contain spaces (``". . ."``), so a line is split from
the right into exactly ``d`` values and the word before them.
"""

from __future__ import annotations

import gzip
import io
import itertools
import zipfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

import numpy as np

from mrc_lib.errors import UserError


@contextmanager
def _open_text(path: Path, member: str | None) -> Iterator[TextIO]:
    """The lines of a ``.txt``, ``.txt.gz`` or ``.zip`` (its ``member``) GloVe file."""
    try:
        if path.suffix == ".zip":
            with zipfile.ZipFile(path) as archive:
                member = member or _only_text_member(path, archive)
                if member not in archive.namelist():
                    raise UserError(f"{path}: no member {member!r} in this zip")
                with archive.open(member) as raw:
                    yield io.TextIOWrapper(raw, encoding="utf-8", errors="replace")
        elif path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
                yield f
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f
    except (OSError, EOFError, zipfile.BadZipFile) as e:
        raise UserError(f"{path}: cannot read GloVe vectors: {e}") from e


def _only_text_member(path: Path, archive: zipfile.ZipFile) -> str:
    members = [n for n in archive.namelist() if n.endswith(".txt")]
    if len(members) != 1:
        raise UserError(f"{path}: pass the member to read, one of {', '.join(members)}")
    return members[0]


def _is_float(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _parse(path: Path, lineno: int, line: str, dim: int) -> tuple[str, np.ndarray]:
    """The word and vector of one line: its last ``dim`` fields are values, the rest the word."""
    word, *values = line.rstrip().rsplit(" ", dim)
    # A word with a space that ends in a number is a line with too many values.
    if len(values) != dim or (" " in word and _is_float(word.rsplit(" ", 1)[1])):
        raise UserError(f"{path}:{lineno}: expected {dim} values after the word, "
                        f"found {len(line.split()) - 1}")
    try:
        return word, np.array(values, dtype=np.float32)
    except ValueError as e:
        raise UserError(f"{path}:{lineno}: not a number: {e}") from e


def _dim(path: Path, first_line: str) -> int:
    dim = len(first_line.rstrip().split(" ")) - 1
    if dim < 1:
        raise UserError(f"{path}:1: not a GloVe line (a word and its values)")
    return dim


def load_glove(path, words: Iterable[str] | None = None, *,
               member: str | None = None) -> tuple[list[str], np.ndarray]:
    """The words of ``words`` found in the file (all words if None) and their vectors.

    Returns the found words in file order (a word listed twice in the file: its first line)
    and a float32 array of shape ``(len(found), d)``.
    """
    path = Path(path)
    wanted = None if words is None else set(words)
    # A wanted word is looked at only if the line starts with its first token.
    heads = None if wanted is None else {w.split(" ", 1)[0] for w in wanted}
    found: list[str] = []
    seen: set[str] = set()
    rows: list[np.ndarray] = []
    with _open_text(path, member) as lines:
        first = next(lines, "")
        dim = _dim(path, first)
        for lineno, line in enumerate(itertools.chain([first], lines), start=1):
            if heads is not None and line.partition(" ")[0] not in heads:
                continue
            word, vector = _parse(path, lineno, line, dim)
            if (wanted is None or word in wanted) and word not in seen:
                found.append(word)
                rows.append(vector)
                seen.add(word)
    vectors = np.stack(rows) if rows else np.zeros((0, dim), dtype=np.float32)
    return found, vectors


def glove_dim(path, member: str | None = None) -> int:
    """The dimension ``d`` of a GloVe file, read from its first line."""
    path = Path(path)
    with _open_text(path, member) as lines:
        return _dim(path, next(lines, ""))
