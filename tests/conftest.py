"""Shared fixtures: a tiny SQuAD + GloVe mirror written by the tests, and the real data."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

REAL_DATA = os.environ.get("MRC_DATA_DIR")

ARTICLES = {
    "Super_Bowl": [
        ("Super Bowl 50 was an American football game. The Denver Broncos defeated the "
         "Carolina Panthers 24-10 to earn their third Super Bowl title.",
         [("Which team won Super Bowl 50?", "Denver Broncos"),
          ("How many titles have the Broncos won?", "third"),
          ("What was the final score?", "24-10")]),
        ("The game was played on February 7, 2016, at Levi's Stadium in Santa Clara.",
         [("Where was the game played?", "Levi's Stadium"),
          ("When was Super Bowl 50?", "February 7, 2016")]),
    ],
    "Warsaw": [
        ("Warsaw is the capital and largest city of Poland. It stands on the Vistula River.",
         [("What river does Warsaw stand on?", "Vistula River"),
          ("Warsaw is the capital of which country?", "Poland")]),
    ],
}
WORDS = ("the was an american football game . denver broncos defeated carolina panthers "
         "to earn their third super bowl title which team won how many titles have what "
         "final score where played on february 7 , 2016 at stadium in santa clara when "
         "warsaw is capital and largest city of poland it stands river does country ?").split()


def squad_json(articles, version="1.1", prefix="q"):
    data, n = [], 0
    for title, paras in articles.items():
        ps = []
        for context, qas in paras:
            items = []
            for question, answer in qas:
                items.append({"id": f"{prefix}{n}", "question": question, "answers": [
                    {"text": answer, "answer_start": context.index(answer)}]})
                n += 1
            ps.append({"context": context, "qas": items})
        data.append({"title": title, "paragraphs": ps})
    return {"version": version, "data": data}


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    """A folder laid out like ../shared/data with a tiny SQuAD and a 6-d GloVe; the cache goes
    to a fresh folder."""
    root = tmp_path / "mirror"
    (root / "squad").mkdir(parents=True)
    (root / "glove").mkdir()
    (root / "squad" / "train-v1.1.json").write_text(json.dumps(squad_json(ARTICLES)))
    dev = {"Warsaw": ARTICLES["Warsaw"]}
    (root / "squad" / "dev-v1.1.json").write_text(json.dumps(squad_json(dev, prefix="d")))
    rng = np.random.default_rng(0)
    lines = [w + " " + " ".join(f"{x:.4f}" for x in rng.normal(size=6)) for w in WORDS]
    (root / "glove" / "glove.6B.50d.txt").write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("MRC_DATA_DIR", str(root))
    monkeypatch.setenv("MRC_CACHE_DIR", str(tmp_path / "cache"))
    return root


@pytest.fixture
def squad2_mirror(mirror):
    """The tiny v1.1 mirror plus a SQuAD 2.0 dev file of four articles of its own."""
    words = "denver broncos won the game in santa clara".split()
    data = []
    for a in range(4):
        context = " ".join(words[a:] + words[:a]) + " ."
        qas = [{"id": f"v2-{a}-{k}", "question": f"which {words[k]} won ?",
                "is_impossible": k % 2 == 1,
                "answers": [] if k % 2 else [{"text": words[k], "answer_start":
                                              context.index(words[k])}]} for k in range(4)]
        data.append({"title": f"Dev_{a}", "paragraphs": [{"context": context, "qas": qas}]})
    (mirror / "squad" / "dev-v2.0.json").write_text(json.dumps({"version": "v2.0",
                                                                 "data": data}))
    return mirror


@pytest.fixture(scope="session")
def real_squad():
    """The real SQuAD v1.1 train+dev, prepared (built once per cache; skipped without data)."""
    if not REAL_DATA:
        pytest.skip("MRC_DATA_DIR is not set")
    from mrc_lib.data import load_prepared

    return load_prepared("squad-v1.1", data_dir=Path(REAL_DATA))
