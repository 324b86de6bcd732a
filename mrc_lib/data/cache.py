"""The prepared-data cache: tokenize, align and encode once, load in a second.

A prepared dataset is a folder ``<cache>/prepared/<dataset>-<key>/`` holding ``meta.json``,
the vocabulary (``vocab.json``, ``vectors.npy``), the form table (``forms.npz``) and, per
split, ``<split>.npz`` (arrays) and ``<split>.json.gz`` (texts for answers and evaluation, read
on first use: training needs none, so a copy for a GPU machine may leave ``train.json.gz`` out).
``key`` hashes the digests of the input files and the preprocessing config, so a changed file
or option builds a new folder. The folder is written under a temporary name and renamed in one
step: a crash never leaves a half-written cache behind.

Loading needs neither spaCy nor the raw JSON: a GPU machine gets the folder and sets
``MRC_CACHE_DIR`` (or passes ``prepared=PATH``).
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mrc_lib.data.dataset import Split, Texts, encode, index_forms
from mrc_lib.data.glove import load_glove
from mrc_lib.data.sources import cache_root, glove_member, resolve
from mrc_lib.data.squad import read_squad
from mrc_lib.data.text import Tokenizer
from mrc_lib.data.vocab import Forms, Vocab, build_vocab
from mrc_lib.errors import UserError
from mrc_lib.utils import file_digest

CACHE_VERSION = 2  # 2: question-side exact match (q_em)
OOV_MIN_COUNT = 5
CHAR_MIN_COUNT = 20


@dataclass
class PreparedData:
    dataset: str
    version: str
    vocab: Vocab
    splits: dict[str, Split]
    digests: dict[str, str]  # input file name -> sha256
    folder: Path
    meta: dict


def _key(digests: dict, config: dict) -> str:
    blob = json.dumps({"digests": digests, "config": config, "v": CACHE_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _config(dataset, splits, glove, pipeline) -> dict:
    return {"dataset": dataset, "splits": list(splits), "glove": glove,
            "pipeline": pipeline or "blank:en", "oov_min_count": OOV_MIN_COUNT,
            "char_min_count": CHAR_MIN_COUNT}


def prepare(dataset: str = "squad-v1.1", splits=("train", "dev"), glove: str = "glove.6B.50d",
            pipeline: str | None = None, *, rebuild: bool = False, data_dir=None,
            cache_dir=None, download: bool = True) -> dict:
    """Build (or reuse) the prepared cache and return a JSON-able summary."""
    t0 = time.perf_counter()
    where = {"data_dir": data_dir, "cache_dir": cache_dir, "download": download}
    paths = {s: resolve(dataset, s, **where) for s in splits}
    glove_path = resolve(glove, **where)
    digests = {p.name: file_digest(p) for p in [*paths.values(), glove_path]}
    config = _config(dataset, splits, glove, pipeline)
    folder = cache_root(cache_dir) / "prepared" / f"{dataset}-{_key(digests, config)}"
    with _locked(folder):  # concurrent processes (test workers, notebooks) build it once
        built = rebuild or not (folder / "meta.json").exists()
        if built:
            _build(folder, paths, glove, glove_path, pipeline, digests, config)
    meta = json.loads((folder / "meta.json").read_text())
    size = sum(f.stat().st_size for f in folder.iterdir())
    return {**meta, "cache": str(folder), "cache_bytes": size, "built": built,
            "seconds": round(time.perf_counter() - t0, 2)}


def _build(folder: Path, paths: dict, glove: str, glove_path: Path, pipeline, digests, config):
    t0 = time.perf_counter()
    files = {s: read_squad(p) for s, p in paths.items()}
    tokenizer = Tokenizer(pipeline)
    texts = [t for sq in files.values() for t in (*sq.contexts, *(e.question for e in sq.examples))]
    flat = iter(tokenizer.all(texts))
    toks = {s: ([next(flat) for _ in sq.contexts], [next(flat) for _ in sq.examples])
            for s, sq in files.items()}
    t_tok = time.perf_counter() - t0
    lowercase = glove.startswith("glove.6B")
    everything = [t for ctx, qs in toks.values() for t in ctx + qs]
    wanted = {w.lower() if lowercase else w for t in everything for w in t.words}
    member = glove_member(glove) if glove_path.suffix == ".zip" else None
    glove_words, glove_vectors = load_glove(glove_path, wanted, member=member)
    train_words = [t.words for t in (toks["train"][0] + toks["train"][1])] if "train" in toks \
        else [t.words for t in everything]
    tags = ({p for t in everything for p in t.pos}, {n for t in everything for n in t.ner}) \
        if tokenizer.tagged else ((), ())
    vocab = build_vocab(train_words, glove_words, glove_vectors, lowercase=lowercase,
                        oov_min_count=OOV_MIN_COUNT, char_min_count=CHAR_MIN_COUNT,
                        pos_tags=sorted(tags[0]), ner_tags=sorted(tags[1]))
    form_index = index_forms(everything)
    forms = vocab.forms(list(form_index))
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=_mkdir(folder.parent)))
    try:
        vocab.save(tmp)
        np.savez_compressed(tmp / "forms.npz", word=forms.word, chars=forms.chars,
                            strings=np.array(list(form_index), dtype=object))
        split_meta = {}
        for s, sq in files.items():
            arrays, text = encode(sq, *toks[s], form_index, vocab)
            np.savez_compressed(tmp / f"{s}.npz", **arrays)
            with gzip.open(tmp / f"{s}.json.gz", "wt", encoding="utf-8", compresslevel=6) as f:
                json.dump(text, f, ensure_ascii=False)
            split_meta[s] = {**sq.summary(), "alignment": text["alignment"]}
        meta = {"dataset": config["dataset"], "version": next(iter(files.values())).version,
                "config": config, "digests": digests, "splits": split_meta,
                "vocab": {"words": len(vocab.words), "trainable": vocab.n_trainable,
                          "glove_found": len(glove_words), "chars": vocab.n_chars},
                "build_seconds": {"tokenize": round(t_tok, 2),
                                  "total": round(time.perf_counter() - t0, 2)}}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def _locked(folder: Path):
    with open(_mkdir(folder.parent) / f".{folder.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def find_prepared(dataset: str, splits, glove: str, pipeline: str | None,
                  cache_dir=None) -> Path | None:
    """The newest prepared folder with these splits and options, found without the raw
    files."""
    config = {"dataset": dataset, "glove": glove, "pipeline": pipeline or "blank:en"}
    found = []
    for meta_file in (cache_root(cache_dir) / "prepared").glob(f"{dataset}-*/meta.json"):
        meta = json.loads(meta_file.read_text())
        if all(meta["config"].get(k) == v for k, v in config.items()) and \
                set(splits) <= set(meta["splits"]):
            found.append(meta_file.parent)
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


def load_prepared(dataset: str = "squad-v1.1", splits=("train", "dev"), *,
                  glove: str = "glove.6B.50d", pipeline: str | None = None,
                  limits: dict[str, int] | None = None, context_limit: int | None = 400,
                  question_limit: int | None = 50, dev_context_limit: int | None = None,
                  data_dir=None, cache_dir=None, prepared=None,
                  vocab_only: bool = False) -> PreparedData:
    """Load prepared splits, building the cache first if needed.

    ``limits`` keeps the first N examples of a split (a small real subset). Training examples
    whose context is longer than ``context_limit`` are dropped (as BiDAF and QANet do); other
    splits are truncated to ``dev_context_limit`` (None: kept whole), never dropped. With
    ``vocab_only``, the cache of ``splits`` is found or built alike, but only its vocabulary is
    read (no split), so that a machine given the cache needs only those files of it.
    """
    folder = Path(prepared) if prepared else None
    if folder is None:  # raw files at hand, else a cache built elsewhere, else download
        args = (dataset, splits, glove, pipeline)
        try:
            folder = Path(prepare(*args, data_dir=data_dir, cache_dir=cache_dir,
                                  download=False)["cache"])
        except UserError:
            folder = find_prepared(dataset, splits, glove, pipeline, cache_dir) or Path(
                prepare(*args, data_dir=data_dir, cache_dir=cache_dir)["cache"])
    meta = json.loads((folder / "meta.json").read_text())
    missing = [s for s in splits if s not in meta["splits"]]
    if missing:
        raise UserError(f"{folder}: prepared cache has no split(s) {', '.join(missing)}")
    vocab = Vocab.load(folder)
    if vocab_only:
        return PreparedData(dataset, meta["version"], vocab, {}, meta["digests"], folder, meta)
    with np.load(folder / "forms.npz", allow_pickle=True) as f:
        forms = Forms(list(f["strings"]), f["word"], f["chars"])
    out = {}
    for s in splits:
        with np.load(folder / f"{s}.npz") as f:
            arrays = {k: f[k] for k in f.files}
        train = s == "train"
        split = Split(s, arrays, Texts(folder / f"{s}.json.gz"), forms,
                      question_limit=question_limit,
                      context_limit=None if train else dev_context_limit)
        if train and context_limit:
            split = split.subset(np.flatnonzero(split.context_lengths() <= context_limit))
        if limits and limits.get(s):
            split = split.subset(np.arange(min(limits[s], len(split))))
        out[s] = split
    return PreparedData(dataset, meta["version"], vocab, out, meta["digests"], folder, meta)


def stats_table(dataset: str = "squad-v1.1", glove: str = "glove.6B.50d") -> str:
    """A plain-text table of counts and token-length percentiles per split."""
    splits = ("train", "dev") if dataset == "squad-v1.1" else ("dev",)
    data = load_prepared(dataset, splits, glove=glove, context_limit=None, question_limit=None)
    pct = (50, 90, 95, 99, 100)
    head = (f"{'split':6} {'articles':>8} {'paras':>6} {'questions':>9} {'no-ans':>6}  "
            + "  ".join(f"ctx p{p:<3}" for p in pct) + "  " + "  ".join(f"q p{p:<3}" for p in pct))
    lines = [head, "-" * len(head)]
    for s, split in data.splits.items():
        m = data.meta["splits"][s]
        c = np.percentile(split.context_lengths(), pct).astype(int)
        q = np.percentile(split.question_lengths(), pct).astype(int)
        lines.append(f"{s:6} {m['articles']:>8} {m['paragraphs']:>6} {m['questions']:>9} "
                     f"{m['unanswerable']:>6}  " + "  ".join(f"{v:>8}" for v in c) + "  "
                     + "  ".join(f"{v:>6}" for v in q))
    return "\n".join(lines)
