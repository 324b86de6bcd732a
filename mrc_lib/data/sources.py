"""Named data sources: where each file comes from, where it is looked for, how it is fetched.

A file is looked for, in order, in

1. the data mirror: the ``data_dir`` argument, else ``$MRC_DATA_DIR`` (a folder laid out like
   ``shared/data``: ``squad/dev-v1.1.json``, ``glove/glove.6B.50d.txt.gz``, ...); mirror files
   are trusted as they are, with no checksum;
2. the download cache: the ``cache_dir`` argument, else ``$MRC_CACHE_DIR``, else
   ``~/.cache/mrc_lib``, with the same layout;
3. the network, if allowed: the file is streamed into the cache, checked against its published
   digest and only then renamed into place, so the cache never holds a partial or unverified
   file, and a file found there is used without hashing it again.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm  # plain bars: notebooks here have no ipywidgets

from mrc_lib.errors import ChecksumError, UserError
from mrc_lib.utils import atomic_path, file_digest

SQUAD_URL = "https://rajpurkar.github.io/SQuAD-explorer/dataset"
GLOVE_URL = "https://nlp.stanford.edu/data"


@dataclass(frozen=True)
class RemoteFile:
    """One downloadable file and the mirror-relative paths it may be found under.

    ``paths[0]`` is where a download is stored; the others are accepted equivalents (the same
    vectors as ``.txt`` or ``.txt.gz``). ``member`` names the file to read inside a zip.
    """

    url: str
    paths: tuple[str, ...]
    md5: str | None = None
    sha256: str | None = None
    member: str | None = None


@dataclass(frozen=True)
class Source:
    name: str
    files: dict[str, RemoteFile]  # split ("train", "dev") or "vectors" -> file

    def file(self, split: str | None = None) -> RemoteFile:
        if split is None and len(self.files) == 1:
            return next(iter(self.files.values()))
        if split not in self.files:
            raise UserError(f"source {self.name} has splits {', '.join(self.files)}; "
                            f"got {split!r}")
        return self.files[split]


def _squad(file_name: str, md5: str, sha256: str | None = None) -> RemoteFile:
    return RemoteFile(f"{SQUAD_URL}/{file_name}", (f"squad/{file_name}",), md5, sha256)


def _glove(name: str, zip_name: str, zip_md5: str) -> Source:
    """GloVe vectors ``name`` read straight from the official ``zip_name`` (never extracted)."""
    vectors = RemoteFile(f"{GLOVE_URL}/{zip_name}",
                         (f"glove/{zip_name}", f"glove/{name}.txt.gz", f"glove/{name}.txt"),
                         md5=zip_md5, member=f"{name}.txt")
    return Source(name, {"vectors": vectors})


# Digests. SQuAD: the md5s pinned by torchtext's SQuAD1/SQuAD2 datasets (and ParlAI, PaddleNLP);
# the v1.1 dev md5 and sha256 were also checked on the official file (shared/data/README.md).
# GloVe: the zip md5s pinned by public download scripts, e.g. LEAF's sent140 setup
# (glove.6B.zip) and facebookresearch/SentEval's data script (glove.840B.300d.zip).
GLOVE_6B_MD5 = "056ea991adb4740ac6bf1b6d9b50408b"
SOURCES: dict[str, Source] = {s.name: s for s in [
    Source("squad-v1.1", {
        "train": _squad("train-v1.1.json", "981b29407e0affa3b1b156f72073b945"),
        "dev": _squad("dev-v1.1.json", "3e85deb501d4e538b6bc56f786231552",
                      "95aa6a52d5d6a735563366753ca50492a658031da74f301ac5238b03966972c9"),
    }),
    Source("squad-v2.0", {
        "train": _squad("train-v2.0.json", "62108c273c268d70893182d5cf8df740"),
        "dev": _squad("dev-v2.0.json", "246adae8b7002f8679c027697b0b7cf8"),
    }),
    *(_glove(f"glove.6B.{d}d", "glove.6B.zip", GLOVE_6B_MD5) for d in (50, 100, 200, 300)),
    _glove("glove.840B.300d", "glove.840B.300d.zip", "2ffafcc9f9ae46fc8c95f32372976137"),
]}


def get_source(name: str) -> Source:
    if name not in SOURCES:
        raise UserError(f"unknown source {name!r}; known: {', '.join(SOURCES)}")
    return SOURCES[name]


def glove_member(name: str) -> str:
    """The file to read inside the GloVe zip of source ``name``, e.g. ``glove.6B.50d.txt``."""
    member = get_source(name).file().member
    if member is None:
        raise UserError(f"{name} is not a GloVe source")
    return member


def cache_root(cache_dir=None) -> Path:
    """The download cache: ``cache_dir``, else ``$MRC_CACHE_DIR``, else ``~/.cache/mrc_lib``."""
    return Path(cache_dir or os.environ.get("MRC_CACHE_DIR") or Path.home() / ".cache/mrc_lib")


def _mirror_root(data_dir=None) -> Path | None:
    root = data_dir or os.environ.get("MRC_DATA_DIR")
    return Path(root) if root else None


def resolve(name: str, split: str | None = None, *, data_dir=None, cache_dir=None,
            download: bool = True) -> Path:
    """The local path of a source's file: from the mirror, the cache, or a fresh download."""
    remote = get_source(name).file(split)
    cache = cache_root(cache_dir)
    roots = [r for r in (_mirror_root(data_dir), cache) if r is not None]
    candidates = [root / rel for root in roots for rel in remote.paths]
    for path in candidates:
        if path.is_file():
            return path
    looked = ", ".join(map(str, candidates))
    hint = (f"set MRC_DATA_DIR to a data mirror, or run `python -m mrc_lib download {name}` "
            f"on a machine with internet access")
    if not download:
        raise UserError(f"{name}: not found (looked at {looked}); {hint}")
    try:
        return download_file(remote.url, cache / remote.paths[0], md5=remote.md5,
                             sha256=remote.sha256, desc=name)
    except ChecksumError:
        raise
    except UserError as e:
        raise UserError(f"{name}: not found (looked at {looked}) and {e}; {hint}") from e


def download(name: str, cache_dir=None) -> list[Path]:
    """Download every file of source ``name`` into the cache (skipping verified ones)."""
    root = cache_root(cache_dir)
    return [download_file(f.url, root / f.paths[0], md5=f.md5, sha256=f.sha256, desc=name)
            for f in get_source(name).files.values()]


def _digests_match(path: Path, md5: str | None, sha256: str | None) -> bool:
    return all(file_digest(path, algo) == want
               for algo, want in (("md5", md5), ("sha256", sha256)) if want)


def download_file(url: str, dest, *, md5: str | None = None, sha256: str | None = None,
                  desc: str | None = None, timeout: float = 60.0,
                  chunk_size: int = 1 << 20) -> Path:
    """Stream ``url`` to ``dest``, verify its digests, and only then move it into place.

    An existing ``dest`` with the right digests is kept as is. Raises :class:`ChecksumError` if
    the digests differ, :class:`UserError` on a network error or a truncated transfer; in every
    failure no partial file is left next to ``dest``.
    """
    dest = Path(dest)
    if dest.is_file() and _digests_match(dest, md5, sha256):
        return dest
    hashes = {"md5": hashlib.md5(), "sha256": hashlib.sha256()}
    with atomic_path(dest) as tmp:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as f:
                length = response.headers.get("Content-Length")
                expected = int(length) if length is not None else None
                received = 0
                with tqdm(total=expected, unit="B", unit_scale=True, unit_divisor=1024,
                          desc=desc or dest.name, disable=None) as bar:
                    while block := response.read(chunk_size):
                        f.write(block)
                        for h in hashes.values():
                            h.update(block)
                        received += len(block)
                        bar.update(len(block))
        except (OSError, http.client.HTTPException) as e:
            raise UserError(f"download of {url} failed: {e}") from e
        if expected is not None and received != expected:
            raise UserError(f"download of {url} failed: truncated transfer "
                            f"({received} of {expected} bytes)")
        for algo, want in (("md5", md5), ("sha256", sha256)):
            if want and hashes[algo].hexdigest() != want:
                raise ChecksumError(f"{url}: {algo} mismatch: expected {want}, "
                                    f"got {hashes[algo].hexdigest()}")
    return dest


def digest_record(path) -> dict:
    """Provenance of a data file: its path and sha256."""
    return {"path": str(path), "sha256": file_digest(path)}
