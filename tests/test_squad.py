"""Strict SQuAD validation: every malformed file gives a one-line error naming file and record."""

import json

import pytest

from mrc_lib.cli import main
from mrc_lib.data.squad import read_squad
from mrc_lib.errors import UserError

CONTEXT = "Denver Broncos won Super Bowl 50."


def squad(qas=None, context=CONTEXT, version="1.1"):
    qas = qas if qas is not None else [
        {"id": "q1", "question": "Who won?", "answers": [{"text": "Denver Broncos",
                                                          "answer_start": 0}]}]
    return {"version": version, "data": [{"title": "SB", "paragraphs": [
        {"context": context, "qas": qas}]}]}


def q(**kw):
    base = {"id": "q1", "question": "Who won?",
            "answers": [{"text": "Denver Broncos", "answer_start": 0}]}
    base.update(kw)
    return base


def write(tmp_path, obj, name="f.json"):
    p = tmp_path / name
    p.write_bytes(obj if isinstance(obj, bytes) else json.dumps(obj).encode())
    return p


def test_reads_v1_and_v2(tmp_path):
    f = read_squad(write(tmp_path, squad()))
    assert f.version == "1.1" and f.summary()["questions"] == 1
    ex = f.examples[0]
    assert f.contexts[ex.context_id][ex.answers[0].start:][:6] == "Denver"
    v2 = squad([q(), q(id="q2", answers=[], is_impossible=True)], version="v2.0")
    f2 = read_squad(write(tmp_path, v2))
    assert f2.version == "2.0" and f2.summary()["unanswerable"] == 1


MALFORMED = [
    ("bad json", b'{"data": [', "not valid JSON"),
    ("not utf-8", b'{"data": "\xff\xfe"}', "not UTF-8"),
    ("top level list", [], "top level"),
    ("missing data", {"version": "1.1"}, "missing key 'data'"),
    ("missing paragraphs", {"data": [{"title": "x"}]}, "data[0]: missing key 'paragraphs'"),
    ("empty context", squad(context="   "), "empty context"),
    ("context not str", squad(context=5), "'context' should be str"),
    ("missing id", squad([{"question": "x", "answers": []}]), "missing key 'id'"),
    ("duplicate id", squad([q(), q()]), "question 'q1': duplicate id"),
    ("missing answers", squad([q(answers=None) | {"answers": None}]), "'answers' should be list"),
    ("start out of range", squad([q(answers=[{"text": "x", "answer_start": 999}])]),
     "out of range"),
    ("start not matching", squad([q(answers=[{"text": "Broncos", "answer_start": 0}])]),
     "does not match the answer text 'Broncos'"),
    ("start is str", squad([q(answers=[{"text": "D", "answer_start": "0"}])]),
     "'answer_start' should be int"),
    ("bool start", squad([q(answers=[{"text": "D", "answer_start": True}])]),
     "'answer_start' should be int"),
    ("no answers v1", squad([q(answers=[])]), "question 'q1': no answers"),
    ("impossible with answers", squad([q(is_impossible=True)], version="v2.0"),
     "is_impossible is true but answers are given"),
    ("is_impossible not bool", squad([q(is_impossible="no")], version="v2.0"),
     "'is_impossible' should be bool"),
    ("empty question", squad([q(question=" ")]), "question 'q1': empty question"),
]


@pytest.mark.parametrize("name,obj,message", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_file_gives_clear_error(tmp_path, name, obj, message):
    path = write(tmp_path, obj)
    with pytest.raises(UserError) as err:
        read_squad(path)
    text = str(err.value)
    assert message in text and str(path) in text and "\n" not in text


def test_cli_validate_exit_codes(tmp_path, capsys):
    assert main(["validate", str(write(tmp_path, squad()))]) == 0
    assert json.loads(capsys.readouterr().out)["questions"] == 1
    bad = write(tmp_path, squad([q(), q()]), "bad.json")
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "duplicate id" in err and err.count("\n") == 1
    assert "Traceback" not in err


def test_cli_validate_missing_file(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "nope.json")]) == 2
    assert "cannot read file" in capsys.readouterr().err
