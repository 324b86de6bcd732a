"""Reading SQuAD v1.1 / v2.0 files with strict validation of the official schema.

Every problem is reported as a :class:`~mrc_lib.errors.UserError` whose one-line message names
the file, the record (question id, or the JSON path when there is no id yet) and what is wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from mrc_lib.errors import UserError


@dataclass(frozen=True)
class Answer:
    text: str
    start: int  # character offset into the context


@dataclass(frozen=True)
class Example:
    qid: str
    question: str
    context_id: int  # index into SquadFile.contexts
    answers: tuple[Answer, ...]
    is_impossible: bool = False


@dataclass
class SquadFile:
    path: str
    version: str  # "1.1" or "2.0"
    titles: list[str] = field(default_factory=list)  # one per context
    contexts: list[str] = field(default_factory=list)
    examples: list[Example] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "file": self.path,
            "version": self.version,
            "articles": len(dict.fromkeys(self.titles)),
            "paragraphs": len(self.contexts),
            "questions": len(self.examples),
            "unanswerable": sum(e.is_impossible for e in self.examples),
        }


def _load_json(path: Path):
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot read file: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text: invalid byte 0x{raw[e.start]:02x} at byte "
                        f"offset {e.start}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
                        ) from None


class _Checker:
    """Type checks with error messages that point at the record."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, where: str, what: str):
        raise UserError(f"{self.path}: {where}: {what}")

    def get(self, obj: dict, key: str, typ, where: str):
        if key not in obj:
            self.fail(where, f"missing key {key!r}")
        value = obj[key]
        if not isinstance(value, typ) or isinstance(value, bool) and typ is not bool:
            names = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
            self.fail(where, f"{key!r} should be {names}, got {type(value).__name__}")
        return value


def read_squad(path, *, require_answers: bool = True) -> SquadFile:
    """Read and validate a SQuAD-format file.

    ``require_answers=False`` accepts answerable questions without answers (a file of questions
    to predict on); otherwise a v1.1 question needs at least one answer, and a v2.0 question
    needs answers exactly when ``is_impossible`` is false.
    """
    path = Path(path)
    root = _load_json(path)
    ck = _Checker(path)
    if not isinstance(root, dict):
        ck.fail("top level", f"should be an object with 'data', got {type(root).__name__}")
    data = ck.get(root, "data", list, "top level")
    has_v2_keys = any("is_impossible" in qa for a in data if isinstance(a, dict)
                      for p in a.get("paragraphs", []) if isinstance(p, dict)
                      for qa in p.get("qas", []) if isinstance(qa, dict))
    version = "2.0" if str(root.get("version", "")).lstrip("v").startswith("2") or has_v2_keys \
        else "1.1"
    out = SquadFile(path=str(path), version=version)
    seen: set[str] = set()
    for ai, article in enumerate(data):
        where = f"data[{ai}]"
        if not isinstance(article, dict):
            ck.fail(where, f"should be an object, got {type(article).__name__}")
        title = article.get("title", "")
        for pi, para in enumerate(ck.get(article, "paragraphs", list, where)):
            pwhere = f"{where}.paragraphs[{pi}]"
            if not isinstance(para, dict):
                ck.fail(pwhere, f"should be an object, got {type(para).__name__}")
            context = ck.get(para, "context", str, pwhere)
            if not context.strip():
                ck.fail(pwhere, "empty context")
            cid = len(out.contexts)
            out.contexts.append(context)
            out.titles.append(str(title))
            for qi, qa in enumerate(ck.get(para, "qas", list, pwhere)):
                out.examples.append(_read_question(ck, qa, f"{pwhere}.qas[{qi}]", context, cid,
                                                   version, require_answers, seen))
    return out


def _read_question(ck: _Checker, qa, where: str, context: str, cid: int, version: str,
                   require_answers: bool, seen: set[str]) -> Example:
    if not isinstance(qa, dict):
        ck.fail(where, f"should be an object, got {type(qa).__name__}")
    qid = ck.get(qa, "id", str, where)
    where = f"question {qid!r}"
    if qid in seen:
        ck.fail(where, "duplicate id")
    seen.add(qid)
    question = ck.get(qa, "question", str, where)
    if not question.strip():
        ck.fail(where, "empty question")
    impossible = ck.get(qa, "is_impossible", bool, where) if "is_impossible" in qa else False
    answers = []
    for k, ans in enumerate(ck.get(qa, "answers", list, where)):
        awhere = f"{where} answer {k}"
        if not isinstance(ans, dict):
            ck.fail(awhere, f"should be an object, got {type(ans).__name__}")
        text = ck.get(ans, "text", str, awhere)
        start = ck.get(ans, "answer_start", int, awhere)
        if not 0 <= start < len(context) or start + len(text) > len(context):
            ck.fail(awhere, f"answer_start {start} out of range for a context of "
                            f"{len(context)} characters")
        if context[start:start + len(text)] != text:
            ck.fail(awhere, f"answer_start {start} does not match the answer text {text!r} "
                            f"(context has {context[start:start + len(text)]!r})")
        answers.append(Answer(text, start))
    if impossible and answers:
        ck.fail(where, "is_impossible is true but answers are given")
    if require_answers and not impossible and not answers:
        ck.fail(where, "no answers" + (" (and is_impossible is false)" if version == "2.0" else ""))
    return Example(qid, question, cid, tuple(answers), impossible)
