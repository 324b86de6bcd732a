"""SQuAD 2.0 for the ABA chapter: the official protocol, or an offline one built from what we have.

**Official protocol** (when ``train-v2.0.json`` resolves, e.g. after a download): train on
SQuAD 2.0 train, tune the no-answer threshold on and report on SQuAD 2.0 dev (the official
script's ``best_f1_thresh`` practice; ``adapt`` and ``eval`` are then the same file).

**Offline protocol** (SQuAD 2.0 train is not available offline):

* dev-v2.0 is split by article into two fixed halves, ``adapt`` and ``eval``, as close in
  size and in share of unanswerable questions as :func:`split_by_article`'s deterministic
  search gets them (on the real file: 5,936 and 5,937 questions, 50.1% and 50.0%
  unanswerable);
* the training set is SQuAD v1.1 train, plus one unanswerable question for every other v1.1
  question (:func:`synthesize_unanswerable`: the question paired with another paragraph of
  its article that contains none of its answers, so one third of these examples are
  unanswerable, as in SQuAD 2.0), plus the ``adapt`` half;
* the threshold is tuned on ``adapt``; scores are reported on ``eval`` only.

SQuAD v1.1 train and v2.0 dev share no article (v2.0 dev is built on v1.1 dev's articles);
:func:`check_disjoint` asserts it.

The derived files are encoded with the SQuAD v1.1 vocabulary (``load_prepared("squad-v1.1")``)
and cached under ``<cache>/prepared/squad-v2.0-<protocol>-<key>/``, every file written
atomically, ``meta.json`` last.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from mrc_lib.data.dataset import Split, Texts, encode_squad
from mrc_lib.data.sources import cache_root, resolve
from mrc_lib.data.squad import Example, SquadFile, read_squad
from mrc_lib.data.text import Tokenizer
from mrc_lib.data.vocab import Forms, Vocab
from mrc_lib.errors import UserError
from mrc_lib.utils import atomic_path, atomic_write_json, file_digest

CACHE_VERSION = 2  # 2: question-side exact match (q_em)
SYNTH_SEED = 2018  # the seed of the synthesized unanswerable questions and the sampling
EVAL_SPLITS = ("adapt", "eval")


# --- SquadFile surgery ----------------------------------------------------------------------------


def articles(sq: SquadFile) -> dict[str, list[int]]:
    """Article title → the indices of its examples, in file order."""
    out: dict[str, list[int]] = {}
    for i, ex in enumerate(sq.examples):
        out.setdefault(sq.titles[ex.context_id], []).append(i)
    return out


def select(sq: SquadFile, index) -> SquadFile:
    """The examples ``index`` of ``sq`` (in that order) with only the contexts they use."""
    examples = [sq.examples[i] for i in index]
    used = sorted({ex.context_id for ex in examples})
    new_id = {cid: k for k, cid in enumerate(used)}
    return SquadFile(path=sq.path, version=sq.version,
                     titles=[sq.titles[c] for c in used], contexts=[sq.contexts[c] for c in used],
                     examples=[replace(ex, context_id=new_id[ex.context_id]) for ex in examples])


def concat(files: list[SquadFile], path: str) -> SquadFile:
    """One SQuAD 2.0 file holding the contexts and examples of ``files``, in order."""
    out = SquadFile(path=path, version="2.0")
    for sq in files:
        offset = len(out.contexts)
        out.titles += sq.titles
        out.contexts += sq.contexts
        out.examples += [replace(ex, context_id=ex.context_id + offset) for ex in sq.examples]
    return out


def sample(sq: SquadFile, n: int | None, seed: int = SYNTH_SEED) -> SquadFile:
    """``n`` examples drawn without replacement (deterministic in ``seed``), kept in file
    order; all of them when ``n`` is ``None`` or not smaller."""
    if n is None or n >= len(sq.examples):
        return sq
    keep = np.sort(np.random.default_rng(seed).permutation(len(sq.examples))[:n])
    return select(sq, keep)


def shuffled(sq: SquadFile, seed: int = SYNTH_SEED) -> SquadFile:
    """The examples in a fixed random order: the first ``N`` are then a fair sample of all
    sources (the trainer's ``limits``)."""
    return select(sq, np.random.default_rng(seed).permutation(len(sq.examples)))


# --- the offline protocol -------------------------------------------------------------------------


def split_by_article(dev: SquadFile) -> dict[str, SquadFile]:
    """Split ``dev`` by article into ``adapt`` and ``eval`` of equal size and equal share of
    unanswerable questions.

    The cost of a split is ``|share_adapt − share_eval| + |n_adapt − n_eval| / n`` (``share``:
    the fraction of unanswerable questions, ``n``: questions). Articles, largest first (ties by
    title), go one at a time to the half with fewer questions; then, while a move of one
    article or a swap of two lowers the cost, the best one is made (the first in title order
    on ties). Deterministic: no random numbers are involved.
    """
    groups = articles(dev)
    titles = sorted(groups)
    counts = np.array([(len(groups[t]), sum(dev.examples[i].is_impossible for i in groups[t]))
                       for t in titles], dtype=float)  # [articles, (questions, unanswerable)]

    def cost(in_adapt: np.ndarray) -> float:
        (n_a, u_a), (n_e, u_e) = counts[in_adapt].sum(0), counts[~in_adapt].sum(0)
        if not n_a or not n_e:
            return np.inf
        return abs(u_a / n_a - u_e / n_e) + abs(n_a - n_e) / (n_a + n_e)

    in_adapt = np.zeros(len(titles), dtype=bool)
    placed = np.zeros(len(titles), dtype=bool)
    for k in sorted(range(len(titles)), key=lambda k: (-counts[k, 0], titles[k])):
        in_adapt[k] = counts[placed & in_adapt, 0].sum() <= counts[placed & ~in_adapt, 0].sum()
        placed[k] = True
    while True:
        moves = [[k] for k in range(len(titles))]
        moves += [[j, k] for j in range(len(titles)) for k in range(j + 1, len(titles))
                  if in_adapt[j] != in_adapt[k]]
        best, best_cost = None, cost(in_adapt)
        for move in moves:
            trial = in_adapt.copy()
            trial[move] = ~trial[move]
            if cost(trial) < best_cost - 1e-12:
                best, best_cost = trial, cost(trial)
        if best is None:
            break
        in_adapt = best
    halves = {"adapt": in_adapt, "eval": ~in_adapt}
    return {name: select(dev, [i for t, take in zip(titles, chosen) if take for i in groups[t]])
            for name, chosen in halves.items()}


def synthesize_unanswerable(train: SquadFile, seed: int = SYNTH_SEED) -> SquadFile:
    """``train`` (answerable questions) plus one unanswerable question for every other one,
    a third of the result (rounded up): a question paired with another paragraph of the same
    article that contains none of its answer texts (compared in lower case), ``id`` suffixed
    ``-na``. Questions and paragraphs are drawn with ``seed``; a question whose article offers
    no such paragraph is skipped for the next one."""
    rng = np.random.default_rng(seed)
    lowered = [c.lower() for c in train.contexts]
    paragraphs: dict[str, list[int]] = {}
    for cid, title in enumerate(train.titles):
        paragraphs.setdefault(title, []).append(cid)
    want = (len(train.examples) + 1) // 2
    made = []
    for i in rng.permutation(len(train.examples)):
        if len(made) == want:
            break
        ex = train.examples[i]
        answers = [a.text.lower() for a in ex.answers]
        other = next((int(c) for c in rng.permutation(paragraphs[train.titles[ex.context_id]])
                      if c != ex.context_id and not any(a in lowered[c] for a in answers)), None)
        if other is not None:
            made.append(Example(f"{ex.qid}-na", ex.question, other, (), True))
    return SquadFile(path=train.path, version="2.0", titles=train.titles,
                     contexts=train.contexts, examples=[*train.examples, *made])


def check_disjoint(train: SquadFile, dev: SquadFile) -> None:
    """Refuse a training file that shares an article (title) or a passage with ``dev``."""
    shared = sorted(set(train.titles) & set(dev.titles))
    shared_text = set(train.contexts) & set(dev.contexts)
    if shared or shared_text:
        raise UserError(f"{train.path} and {dev.path} share {len(shared)} article(s) "
                        f"({', '.join(shared[:3])}) and {len(shared_text)} passage(s); the "
                        "offline SQuAD 2.0 protocol needs them disjoint")


def offline_files(v11_train: SquadFile, v2_dev: SquadFile) -> dict[str, SquadFile]:
    """The offline protocol's ``train``, ``adapt`` and ``eval`` files (module docstring)."""
    check_disjoint(v11_train, v2_dev)
    halves = split_by_article(v2_dev)
    synthetic = synthesize_unanswerable(v11_train)
    train = concat([synthetic, halves["adapt"]], "v1.1 train + synthesized + dev-v2.0 adapt")
    return {"train": shuffled(train), **halves}


# --- encoding, cache, loading ---------------------------------------------------------------------


@dataclass
class Squad2Data:
    """What the trainer needs (``version``, ``vocab``, ``splits`` with ``train`` and ``dev`` =
    ``adapt``, ``digests``), plus the ``adapt`` and ``eval`` splits and the protocol used."""

    protocol: str  # "official" or "offline"
    vocab: Vocab
    splits: dict[str, Split]
    adapt: Split
    eval: Split
    digests: dict[str, str]
    folder: Path
    meta: dict = field(default_factory=dict)
    version: str = "2.0"


def _sources(data_dir=None, cache_dir=None) -> tuple[str, dict[str, Path]]:
    """The protocol and its input files (no download is attempted)."""
    where = {"data_dir": data_dir, "cache_dir": cache_dir, "download": False}
    dev = resolve("squad-v2.0", "dev", **where)
    try:
        return "official", {"train": resolve("squad-v2.0", "train", **where), "dev": dev}
    except UserError:
        return "offline", {"train": resolve("squad-v1.1", "train", **where), "dev": dev}


def build_files(protocol: str, paths: dict[str, Path]) -> dict[str, SquadFile]:
    """The ``train``, ``adapt`` and ``eval`` SQuAD files of ``protocol``."""
    train, dev = read_squad(paths["train"]), read_squad(paths["dev"])
    if protocol == "official":
        return {"train": shuffled(train), "adapt": dev, "eval": dev}
    return offline_files(train, dev)


def _save(folder: Path, name: str, split: Split) -> None:
    with atomic_path(folder / f"{name}.npz") as tmp, open(tmp, "wb") as f:
        np.savez_compressed(f, **split.a)
    with atomic_path(folder / f"{name}.forms.npz") as tmp, open(tmp, "wb") as f:
        np.savez_compressed(f, word=split.forms.word, chars=split.forms.chars,
                            strings=np.array(split.forms.strings, dtype=object))
    with atomic_path(folder / f"{name}.json.gz") as tmp:
        with gzip.open(tmp, "wt", encoding="utf-8") as f:
            json.dump(dict(split.text), f, ensure_ascii=False)


def _load(folder: Path, name: str, **limits) -> Split:
    with np.load(folder / f"{name}.npz") as f:
        arrays = {k: f[k] for k in f.files}
    with np.load(folder / f"{name}.forms.npz", allow_pickle=True) as f:
        forms = Forms(list(f["strings"]), f["word"], f["chars"])
    return Split(name, arrays, Texts(folder / f"{name}.json.gz"), forms, **limits)


def load_squad2(*, limits: dict[str, int] | None = None, context_limit: int | None = 400,
                question_limit: int | None = 50, glove: str = "glove.6B.50d",
                data_dir=None, cache_dir=None) -> Squad2Data:
    """The SQuAD 2.0 splits of the available protocol, encoded with the v1.1 vocabulary.

    ``limits`` (``{"train": N, "adapt": N, "eval": N}``) keeps a fixed random sample of N
    examples of a split (before encoding, so a small profile encodes little). Training examples
    with contexts longer than ``context_limit`` are dropped; questions are truncated to
    ``question_limit`` tokens. Without the raw files, the newest cache built with the same
    vocabulary and limits is used (a GPU machine may get the cache alone).
    """
    from mrc_lib.data.cache import load_prepared

    v11 = load_prepared("squad-v1.1", glove=glove, data_dir=data_dir, cache_dir=cache_dir,
                        vocab_only=True)
    limits = {k: v for k, v in (limits or {}).items() if v}
    try:
        protocol, paths = _sources(data_dir, cache_dir)
    except UserError:
        folder = _find_built(v11.folder.name, limits, cache_dir)
        if folder is None:
            raise
    else:
        folder = _build(protocol, paths, v11, limits, cache_dir)
    meta = json.loads((folder / "meta.json").read_text())
    train = _load(folder, "train", question_limit=question_limit)
    if context_limit:
        train = train.subset(np.flatnonzero(train.context_lengths() <= context_limit))
    adapt, eval_ = (_load(folder, s, question_limit=question_limit) for s in EVAL_SPLITS)
    return Squad2Data(meta["protocol"], v11.vocab, {"train": train, "dev": adapt}, adapt, eval_,
                      {**v11.digests, **meta["digests"]}, folder, meta)


def _build(protocol: str, paths: dict[str, Path], v11, limits: dict, cache_dir) -> Path:
    """The cache folder of these inputs, built first if missing."""
    digests = {p.name: file_digest(p) for p in paths.values()}
    blob = json.dumps({"digests": digests, "vocab": v11.folder.name, "limits": limits,
                       "v": CACHE_VERSION}, sort_keys=True)
    key = hashlib.sha256(blob.encode()).hexdigest()[:16]
    folder = cache_root(cache_dir) / "prepared" / f"squad-v2.0-{protocol}-{key}"
    if (folder / "meta.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"protocol": protocol, "digests": digests, "vocab": v11.folder.name,
            "limits": limits, "splits": {}}
    for name, sq in build_files(protocol, paths).items():
        sq = sample(sq, limits.get(name))
        _save(folder, name, encode_squad(sq, v11.vocab, Tokenizer()))
        meta["splits"][name] = {**sq.summary(), "titles": sorted(set(sq.titles))}
    atomic_write_json(folder / "meta.json", meta)  # last: marks the folder complete
    return folder


def _find_built(vocab: str, limits: dict, cache_dir) -> Path | None:
    """The newest complete cache folder for this vocabulary and these limits."""
    found = [m.parent for m in (cache_root(cache_dir) / "prepared").glob("squad-v2.0-*/meta.json")
             if (meta := json.loads(m.read_text())).get("vocab") == vocab
             and meta.get("limits") == limits]
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


# --- thresholded evaluation -----------------------------------------------------------------------


def tuned_scores(model, data: Squad2Data, cfg, device) -> dict:
    """Official SQuAD 2.0 scores on ``eval`` at the no-answer threshold that maximizes F1 on
    ``adapt``: ``{"threshold", "adapt": {...}, "eval": {...}, "answered"}`` (``model`` in eval
    mode; ``answered``: the % of ``eval`` questions given an answer at that threshold)."""
    from mrc_lib.inference import predict_spans
    from mrc_lib.metrics import evaluate

    def raw(split):
        """Best span text of every question (never empty) and its no-answer probability."""
        preds, na, qids = {}, {}, split.qids
        for i, start, end, _, p_na in predict_spans(model, split, cfg, device):
            preds[qids[i]], na[qids[i]] = split.answer_text(i, start, end), p_na
        return preds, na

    adapt = evaluate(data.adapt.squad_json(), *raw(data.adapt))
    threshold = adapt["best_f1_thresh"]
    preds, na = raw(data.eval)
    scores = evaluate(data.eval.squad_json(), preds, na, na_prob_thresh=threshold)
    answered = 100.0 * sum(p <= threshold for p in na.values()) / len(na)  # % given an answer
    return {"threshold": threshold, "adapt": adapt, "eval": scores, "answered": answered}
