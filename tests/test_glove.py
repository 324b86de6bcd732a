"""GloVe reading from .txt, .txt.gz and .zip, checked against a direct parse of the text."""

import gzip
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

from mrc_lib.data.glove import glove_dim, load_glove
from mrc_lib.errors import UserError

# ". . ." has spaces in the word, as in glove.840B; "cat" appears twice (the first one counts).
LINES = [
    "the 0.418 0.24968 -0.41242",
    ", 0.013441 0.23682 -0.16899",
    ". . . 1.5 -2.25 3e-2",
    "of 0.70853 0.57088 -0.4716",
    "cat -1 0 1",
    "théâtre 0.5 0.25 0.125",
    "cat 9 9 9",
]
TEXT = "\n".join(LINES) + "\n"


def expected(words):
    """Rows parsed directly: word = everything before the last three fields."""
    rows = {}
    for line in LINES:
        *word, a, b, c = line.split(" ")
        rows.setdefault(" ".join(word), [float(a), float(b), float(c)])
    keep = [w for w in rows if words is None or w in words]
    return keep, np.array([rows[w] for w in keep], dtype=np.float32).reshape(-1, 3)


def write_all(folder: Path, text: str) -> list[Path]:
    """The same vectors as ``toy.txt``, ``toy.txt.gz`` and member ``toy.txt`` of ``toy.zip``."""
    txt = folder / "toy.txt"
    txt.write_text(text, encoding="utf-8")
    gz = folder / "toy.txt.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.write(text)
    zp = folder / "toy.zip"
    with zipfile.ZipFile(zp, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("toy.txt", text)
    return [txt, gz, zp]


@pytest.fixture
def files(tmp_path):
    return write_all(tmp_path, TEXT)


@pytest.mark.parametrize("words", [None, ["of", "the", "dog", ". . .", "cat", "théâtre"], [","],
                                   [], ["."]])
def test_all_formats_match_direct_parse(files, words):
    want_words, want_vectors = expected(words)
    for path in files:
        got_words, got_vectors = load_glove(path, words)
        assert got_words == want_words, path
        assert got_vectors.dtype == np.float32 and got_vectors.shape == (len(want_words), 3)
        np.testing.assert_array_equal(got_vectors, want_vectors)


def test_glove_dim(files):
    assert [glove_dim(p) for p in files] == [3, 3, 3]


def test_zip_member_choice(tmp_path):
    zp = tmp_path / "two.zip"
    with zipfile.ZipFile(zp, "w") as z:
        z.writestr("a.3d.txt", "x 1 2 3\n")
        z.writestr("b.2d.txt", "y 4 5\n")
    words, vectors = load_glove(zp, member="b.2d.txt")
    assert words == ["y"] and vectors.tolist() == [[4.0, 5.0]]
    assert glove_dim(zp, member="a.3d.txt") == 3
    with pytest.raises(UserError, match="two.zip.*a.3d.txt, b.2d.txt"):
        load_glove(zp)
    with pytest.raises(UserError, match="two.zip.*'c.txt'"):
        load_glove(zp, member="c.txt")


@pytest.mark.parametrize("bad_line, match", [
    ("dog 1 2", "expected 3 values after the word, found 2"),
    ("dog 1 2 3 4", "expected 3 values after the word, found 4"),
    ("dog 1 two 3", "not a number"),
])
def test_malformed_line_names_file_and_line(tmp_path, bad_line, match):
    text = "\n".join(LINES[:2] + [bad_line] + LINES[2:]) + "\n"
    for path in write_all(tmp_path, text):
        with pytest.raises(UserError, match=rf"{path.name}:3: {match}"):
            load_glove(path)
        with pytest.raises(UserError, match=rf"{path.name}:3: "):
            load_glove(path, ["dog"])
        assert load_glove(path, ["the"])[0] == ["the"]  # unwanted lines are not parsed


def test_unreadable_files(tmp_path):
    with pytest.raises(UserError, match="missing.txt.gz"):
        load_glove(tmp_path / "missing.txt.gz")
    (tmp_path / "broken.zip").write_bytes(b"not a zip")
    with pytest.raises(UserError, match="broken.zip"):
        load_glove(tmp_path / "broken.zip")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserError, match="empty.txt:1"):
        load_glove(tmp_path / "empty.txt")


@pytest.mark.real_data
@pytest.mark.skipif(not os.environ.get("MRC_DATA_DIR"), reason="MRC_DATA_DIR not set")
def test_real_glove_6b_50d():
    path = Path(os.environ["MRC_DATA_DIR"]) / "glove/glove.6B.50d.txt.gz"
    words, vectors = load_glove(path, ["of", "the", ","])
    assert words == ["the", ",", "of"]  # file (frequency) order
    assert vectors.shape == (3, 50) and vectors.dtype == np.float32
    assert vectors[0, 0] == np.float32(0.418)
    assert glove_dim(path) == 50
