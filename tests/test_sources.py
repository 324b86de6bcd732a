"""Data sources: resolution order, and downloads from a local HTTP server that misbehaves."""

import hashlib
import http.server
import os
import threading
from pathlib import Path

import pytest

from mrc_lib.data import sources
from mrc_lib.data.sources import (
    RemoteFile,
    Source,
    digest_record,
    download,
    download_file,
    glove_member,
    resolve,
)
from mrc_lib.errors import ChecksumError, UserError

BODY = b'{"version": "1.1", "data": []}\n' * 100
MD5 = hashlib.md5(BODY).hexdigest()
SHA256 = hashlib.sha256(BODY).hexdigest()
DATA_DIR = os.environ.get("MRC_DATA_DIR")  # read before the autouse fixture removes it


class Handler(http.server.BaseHTTPRequestHandler):
    """``/good`` serves BODY, ``/truncated`` promises more bytes than it sends, else 404."""

    hits: list[str] = []

    def do_GET(self):
        self.hits.append(self.path)
        if self.path not in ("/good", "/truncated"):
            self.send_error(404)
            return
        self.send_response(200)
        extra = 1000 if self.path == "/truncated" else 0
        self.send_header("Content-Length", str(len(BODY) + extra))
        self.end_headers()
        self.wfile.write(BODY)  # HTTP/1.0: the connection closes after the response

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.timeout = 5
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch, tmp_path):
    """No real mirror, and a cache inside tmp_path."""
    monkeypatch.delenv("MRC_DATA_DIR", raising=False)
    monkeypatch.setenv("MRC_CACHE_DIR", str(tmp_path / "cache"))


def files_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


# --- download_file -------------------------------------------------------------------------------


def test_download_verifies_and_places_file(server, tmp_path):
    dest = tmp_path / "dl" / "good.json"
    assert download_file(f"{server}/good", dest, md5=MD5, sha256=SHA256, timeout=5) == dest
    assert dest.read_bytes() == BODY
    assert files_in(tmp_path / "dl") == ["good.json"]


def test_corrupted_download_raises_and_leaves_nothing(server, tmp_path):
    wrong = "0" * 32
    with pytest.raises(ChecksumError) as e:
        download_file(f"{server}/good", tmp_path / "dl" / "x.json", md5=wrong, timeout=5)
    assert f"{server}/good" in str(e.value) and wrong in str(e.value) and MD5 in str(e.value)
    assert files_in(tmp_path / "dl") == []


def test_truncated_download_raises_and_leaves_nothing(server, tmp_path):
    with pytest.raises(UserError, match="truncated"):
        download_file(f"{server}/truncated", tmp_path / "dl" / "x.json", timeout=5)
    assert files_in(tmp_path / "dl") == []


def test_network_error_raises_and_leaves_nothing(server, tmp_path):
    with pytest.raises(UserError, match="404"):
        download_file(f"{server}/nowhere", tmp_path / "dl" / "x.json", timeout=5)
    assert files_in(tmp_path / "dl") == []


def test_present_file_with_right_digest_is_not_downloaded(server, tmp_path):
    dest = tmp_path / "dl" / "x.json"
    dest.parent.mkdir()
    dest.write_bytes(BODY)
    before = len(Handler.hits)
    download_file(f"{server}/good", dest, md5=MD5, timeout=5)
    assert len(Handler.hits) == before
    dest.write_bytes(b"stale")  # wrong digest: fetched again
    download_file(f"{server}/good", dest, md5=MD5, timeout=5)
    assert len(Handler.hits) == before + 1 and dest.read_bytes() == BODY


# --- resolve -------------------------------------------------------------------------------------


@pytest.fixture
def toy(monkeypatch, server):
    """A source ``toy`` whose dev file is served by the local server."""
    remote = RemoteFile(f"{server}/good", ("toy/dev.json",), md5=MD5)
    monkeypatch.setitem(sources.SOURCES, "toy", Source("toy", {"dev": remote}))
    return remote


def put(root: Path, rel: str, data: bytes = b"x") -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_mirror_comes_first_and_is_not_checksummed(toy, tmp_path, monkeypatch):
    mirrored = put(tmp_path / "mirror", "toy/dev.json", b"not the official bytes")
    put(tmp_path / "cache", "toy/dev.json")
    monkeypatch.setenv("MRC_DATA_DIR", str(tmp_path / "mirror"))
    assert resolve("toy", "dev", download=False) == mirrored
    # the data_dir argument beats the environment
    other = put(tmp_path / "other", "toy/dev.json")
    assert resolve("toy", "dev", data_dir=tmp_path / "other", download=False) == other


def test_empty_mirror_falls_back_to_cache_then_download(toy, tmp_path, monkeypatch):
    (tmp_path / "mirror").mkdir()
    monkeypatch.setenv("MRC_DATA_DIR", str(tmp_path / "mirror"))
    path = resolve("toy", "dev")
    assert path == tmp_path / "cache" / "toy/dev.json" and path.read_bytes() == BODY
    before = len(Handler.hits)
    assert resolve("toy", "dev") == path and len(Handler.hits) == before  # now cached


def test_missing_everywhere_names_source_paths_and_command(toy, tmp_path, monkeypatch):
    monkeypatch.setenv("MRC_DATA_DIR", str(tmp_path / "mirror"))
    with pytest.raises(UserError) as e:
        resolve("toy", "dev", download=False)
    message = str(e.value)
    for needle in ["toy", str(tmp_path / "mirror" / "toy/dev.json"),
                   str(tmp_path / "cache" / "toy/dev.json"), "python -m mrc_lib download toy"]:
        assert needle in message
    assert "\n" not in message


def test_failed_download_in_resolve_names_the_paths(server, tmp_path, monkeypatch):
    remote = RemoteFile(f"{server}/nowhere", ("toy/dev.json",))
    monkeypatch.setitem(sources.SOURCES, "toy", Source("toy", {"dev": remote}))
    with pytest.raises(UserError, match=r"toy: not found .*cache.*404"):
        resolve("toy", "dev")
    assert files_in(tmp_path / "cache") == []


def test_download_command_fills_the_cache(toy, tmp_path):
    assert download("toy") == [tmp_path / "cache" / "toy/dev.json"]
    assert download("toy", cache_dir=tmp_path / "c2") == [tmp_path / "c2" / "toy/dev.json"]


def test_split_and_name_errors():
    with pytest.raises(UserError, match="train, dev"):
        resolve("squad-v1.1", download=False)
    with pytest.raises(UserError, match="unknown source"):
        resolve("squad-v3", "dev", download=False)


def test_glove_accepts_txt_gz_txt_and_zip(tmp_path):
    mirror = tmp_path / "mirror"
    for rel in ["glove/glove.6B.zip", "glove/glove.6B.50d.txt", "glove/glove.6B.50d.txt.gz"]:
        path = put(mirror, rel)
        assert resolve("glove.6B.50d", data_dir=mirror, download=False) == path
        path.unlink()
    assert glove_member("glove.6B.100d") == "glove.6B.100d.txt"
    assert glove_member("glove.840B.300d") == "glove.840B.300d.txt"
    assert sources.SOURCES["glove.6B.300d"].file().url == "https://nlp.stanford.edu/data/glove.6B.zip"


def test_digest_record(tmp_path):
    path = put(tmp_path, "f.json", BODY)
    assert digest_record(path) == {"path": str(path), "sha256": SHA256}


@pytest.mark.real_data
@pytest.mark.skipif(not DATA_DIR, reason="MRC_DATA_DIR not set")
def test_registry_digest_matches_the_official_dev_file():
    path = resolve("squad-v1.1", "dev", data_dir=DATA_DIR, download=False)
    remote = sources.SOURCES["squad-v1.1"].file("dev")
    assert digest_record(path)["sha256"] == remote.sha256
    assert hashlib.md5(path.read_bytes()).hexdigest() == remote.md5
