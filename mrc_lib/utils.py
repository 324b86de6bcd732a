"""Small shared helpers: atomic writes, files cut into checked parts, digests, JSON, git
commit."""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import re
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

from mrc_lib.errors import UserError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary path next to ``path``; rename it onto ``path`` only on success, with
    the permissions a plain ``open()`` would have given it (``mkstemp``'s are owner-only).

    A crash or exception leaves the old file (if any) untouched and no partial file behind.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, _new_file_mode())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _new_file_mode() -> int:
    """The mode ``open()`` gives a new file: ``0o666`` less the process's umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def on_stop_signals(handler):
    """Call ``handler(signum, frame)`` on SIGTERM and SIGINT (Ctrl-C) while the block runs, then
    restore the handlers before it; a no-op outside the main thread, where handlers cannot be
    set."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, previous in before.items():
            signal.signal(s, previous)


def select_keys(items: list, patterns: list[str] | None, what: str) -> list:
    """The ``items`` whose ``key`` matches one of the shell ``patterns`` (all of them without
    patterns); a pattern that matches none is a :class:`UserError` (``--only``: a typo)."""
    if not patterns:
        return items
    if unmatched := [p for p in patterns
                     if not any(fnmatch.fnmatchcase(item.key, p) for item in items)]:
        raise UserError(f"--only {' '.join(unmatched)}: no {what} matches")
    return [item for item in items if any(fnmatch.fnmatchcase(item.key, p) for p in patterns)]


def atomic_write_bytes(path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def cut_parts(blob: bytes, prefix: str, part_bytes: int) -> list[tuple[dict, bytes]]:
    """``blob`` cut into chunks of at most ``part_bytes`` (one, possibly empty, at least), each
    with its manifest entry ``{"name": "<prefix>.000", "bytes", "sha256"}``."""
    parts = []
    for k, start in enumerate(range(0, max(len(blob), 1), part_bytes)):
        chunk = blob[start:start + part_bytes]
        parts.append(({"name": f"{prefix}.{k:03d}", "bytes": len(chunk),
                       "sha256": hashlib.sha256(chunk).hexdigest()}, chunk))
    return parts


def write_parts(blob: bytes, folder: Path, prefix: str, part_bytes: int) -> list[dict]:
    """Write ``blob`` as ``folder/<prefix>.000``, ``.001``, ... of at most ``part_bytes``
    each (:func:`cut_parts`); return their manifest entries."""
    parts = cut_parts(blob, prefix, part_bytes)
    for part, chunk in parts:
        atomic_write_bytes(folder / part["name"], chunk)
    return [part for part, _ in parts]


def join_parts(manifest: Path, parts: list[dict], what: str = "checkpoint part",
               folders: dict[str, Path] | None = None) -> bytes:
    """The parts :func:`write_parts` listed in ``manifest``, checked and concatenated; each
    is read beside the manifest, or from ``folders[name]`` where given. A missing or altered
    one is a one-line :class:`UserError` naming it."""
    chunks = []
    for part in parts:
        file = (folders or {}).get(part["name"], manifest.parent) / part["name"]
        try:
            chunk = file.read_bytes()
        except FileNotFoundError:
            raise UserError(f"{file}: {what} missing (listed in {manifest})") from None
        if len(chunk) != part["bytes"] or hashlib.sha256(chunk).hexdigest() != part["sha256"]:
            raise UserError(f"{file}: {what} corrupt (size or SHA-256 differs from "
                            f"{manifest})")
        chunks.append(chunk)
    return b"".join(chunks)


def slug(text: str) -> str:
    """``text`` in lower case with runs of other characters as ``_``: a device name as a file
    name (``NVIDIA H100 80GB HBM3`` to ``nvidia_h100_80gb_hbm3``)."""
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def atomic_write_json(path, obj, indent: int | None = 2) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=indent, ensure_ascii=False) + "\n").encode())


def file_digest(path, algo: str = "sha256", chunk: int = 1 << 20) -> str:
    h = hashlib.new(algo)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _git(cwd, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                          check=True).stdout


def _notebook_sources(text: str) -> list[tuple[str, str]]:
    """A notebook's cells without their outputs: what a change to it can change."""
    return [(c["cell_type"], "".join(c["source"])) for c in json.loads(text)["cells"]]


def _differs(cwd, path: str) -> bool:
    """Whether a tracked file differs from ``HEAD``, notebooks by their cells' sources only."""
    if not path.endswith(".ipynb"):
        return True
    try:
        return (_notebook_sources(_git(cwd, "show", f"HEAD:{path}"))
                != _notebook_sources((Path(cwd) / path).read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, subprocess.CalledProcessError):
        return True


def git_state(cwd=None, ignore: tuple[str, ...] = ()) -> dict:
    """``{"commit": HEAD's sha or None, "dirty": [tracked paths that differ from it]}``.

    Paths under an ``ignore`` prefix do not count, nor notebooks whose only changes are outputs
    (a reproduction writes both: they are what a run produced, not what it ran).
    """
    cwd = cwd or Path(__file__).resolve().parent.parent
    try:
        sha = _git(cwd, "rev-parse", "HEAD").strip()
        changed = _git(cwd, "diff", "HEAD", "--name-only", "--no-renames").split()
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": []}
    return {"commit": sha, "dirty": sorted(p for p in changed
                                           if not p.startswith(ignore) and _differs(cwd, p))}


GENERATED = ("book/",)  # what runs write (results, figures, executed notebooks, records)


def git_commit(cwd=None) -> str | None:
    """The current git commit of the project, with ``-dirty`` if tracked sources differ from
    it (:data:`GENERATED` outputs and notebooks' outputs excepted; :func:`git_state` says
    which files)."""
    state = git_state(cwd, GENERATED)
    return state["commit"] and state["commit"] + ("-dirty" if state["dirty"] else "")
