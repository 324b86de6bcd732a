"""Every page of the built book in headless Chromium.

Each page of ``_build/html`` is served on 127.0.0.1, loaded in Chromium (``--dump-dom`` after a
virtual-time budget, plus ``--screenshot`` into ``_build/screenshots/``) and fails the test if
an image does not load, an internal link points to no file, or its math was not rendered by
the book's own (offline) MathJax.

Without Chromium or a built book the test is skipped, unless ``MRC_REQUIRE_BROWSER=1``: then
it fails, so that CI cannot pass by skipping it.
"""

import contextlib
import functools
import http.server
import io
import os
import shutil
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import pytest

from mrc_lib.book import ROOT, fetch_mathjax

pytestmark = pytest.mark.slow

HTML = ROOT / "_build" / "html"
SCREENSHOTS = ROOT / "_build" / "screenshots"
CHROMIUM = os.environ.get("MRC_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync",
                  "--virtual-time-budget=10000", "--window-size=1280,2000"]
# Served after every page's content: record, once the page has loaded, whether each image did.
PROBE = b"""<script>
for (const img of document.images) img.loading = "eager";
window.addEventListener("load", () => {
  for (const img of document.images) img.setAttribute("data-natural-width", img.naturalWidth);
  document.body.setAttribute("data-loaded", location.href);
});
</script>"""


def unavailable(reason: str):
    if os.environ.get("MRC_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{reason} (required: MRC_REQUIRE_BROWSER=1)")
    pytest.skip(reason)


class Page(HTMLParser):
    """What the checks need from a rendered DOM."""

    def __init__(self, dom: str):
        super().__init__()
        self.images, self.links = [], []
        self.math = self.rendered_math = self.math_errors = 0
        self.url = None  # where the page ended up, after any redirect
        self.feed(dom)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "body":
            self.url = attrs.get("data-loaded")
        self.math += "math" in (attrs.get("class") or "").split()
        self.rendered_math += tag == "mjx-container"
        self.math_errors += tag == "mjx-merror"
        if tag == "img":
            self.images.append((attrs.get("src"), attrs.get("data-natural-width")))
        for name in ("href", "src"):
            if attrs.get(name) and tag in ("a", "link", "img", "script"):
                self.links.append(attrs[name])


def problems(page: Page, site: Path) -> list[str]:
    """Everything wrong with one loaded page; ``site`` is the folder the server serves."""
    if not (url := page.url):
        return ["the page did not finish loading"]
    found = []
    found += [f"image {src} did not load" for src, width in page.images if width in (None, "0")]
    for link in page.links:
        target = urlsplit(urljoin(url, link))
        if target.scheme not in ("http", "https") or target.netloc != urlsplit(url).netloc:
            continue
        path = site / unquote(target.path).lstrip("/")
        if not (path / "index.html" if path.is_dir() else path).is_file():
            found.append(f"broken internal link {link}")
    if page.rendered_math < page.math:
        found.append(f"math not rendered: {page.math} math elements, "
                     f"{page.rendered_math} MathJax containers")
    if page.math_errors:
        found.append(f"{page.math_errors} MathJax errors")
    return found


class ProbingHandler(http.server.SimpleHTTPRequestHandler):
    """Serves a folder; HTML pages get :data:`PROBE` appended."""

    def send_head(self):
        path = Path(self.translate_path(self.path))
        if path.suffix != ".html" or not path.is_file():
            return super().send_head()
        body = path.read_bytes().replace(b"</body>", PROBE + b"</body>")
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serve(site: Path):
    """Serve ``site`` on an ephemeral port of 127.0.0.1; yield its base URL."""
    handler = functools.partial(ProbingHandler, directory=str(site))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}/"
        finally:
            server.shutdown()


def load(url: str, screenshot: Path, profile: Path) -> str:
    """The DOM of ``url`` after its scripts ran, and a screenshot of it."""
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    run = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                          f"--screenshot={screenshot}", "--dump-dom", url],
                         capture_output=True, text=True, timeout=180)
    if run.returncode != 0 or "<html" not in run.stdout:
        raise AssertionError(f"chromium failed on {url}: {run.stderr[-2000:]}")
    return run.stdout


def check_site(site: Path, pages: list[str], shots: Path, tmp: Path) -> dict[str, list[str]]:
    """Load every page (two at a time) and return its problems, by page."""
    def check(base, i, page):
        url = urljoin(base, page)
        dom = load(url, shots / (page.replace("/", "__") + ".png"), tmp / f"profile{i}")
        return page, problems(Page(dom), site)

    with serve(site) as base, ThreadPoolExecutor(max_workers=2) as pool:
        results = pool.map(check, [base] * len(pages), range(len(pages)), pages)
        return {page: found for page, found in results if found}


@pytest.fixture(scope="module")
def chromium():
    if not Path(CHROMIUM).is_file():
        unavailable(f"no Chromium at {CHROMIUM} (apt-get install chromium)")


@pytest.fixture(scope="module")
def site(chromium):
    """The built book: reused if present, else built here unless CI requires it prebuilt."""
    if not (HTML / "index.html").is_file():
        if os.environ.get("MRC_REQUIRE_BROWSER") == "1":
            pytest.fail(f"no built book at {HTML}: build it before the tests")
        if shutil.which("jupyter-book") is None:
            pytest.skip(f"no built book at {HTML} and no jupyter-book to build it")
        fetch_mathjax()
        subprocess.run(["jupyter-book", "build", str(ROOT), "-W", "-n", "--keep-going"],
                       check=True, capture_output=True)
    return HTML


def png() -> bytes:
    """A 1x1 PNG, written with matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    plt.imsave(buffer, [[0.5]], format="png")
    return buffer.getvalue()


def test_checks_catch_broken_pages(chromium, tmp_path):
    """The checks themselves: a page with a missing image, a dead link and raw math fails."""
    site = tmp_path / "site"
    (site / "sub").mkdir(parents=True)
    (site / "ok.png").write_bytes(png())
    (site / "sub" / "page.html").write_text(
        '<html><body><img src="../ok.png"><img src="../missing.png">'
        '<a href="../sub/page.html#top">self</a><a href="../nowhere.html">dead</a>'
        '<a href="https://example.org/">external</a>'
        '<span class="math notranslate">\\(x^2\\)</span></body></html>')
    found = check_site(site, ["sub/page.html"], tmp_path / "shots", tmp_path)
    assert found == {"sub/page.html": [
        "image ../missing.png did not load", "broken internal link ../missing.png",
        "broken internal link ../nowhere.html",
        "math not rendered: 1 math elements, 0 MathJax containers"]}
    assert (tmp_path / "shots" / "sub__page.html.png").stat().st_size > 0


def test_every_page_renders(site, tmp_path):
    assert (site / "_static" / "mathjax" / "tex-mml-chtml.js").is_file(), \
        "MathJax is not served with the book: run `python -m mrc_lib.book fetch-mathjax` first"
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html")
                   if not any(part.startswith("_") for part in p.relative_to(site).parts))
    assert "book/intro.html" in pages and "book/reproductions.html" in pages
    assert 'class="math' in (site / "book" / "intro.html").read_text(), "the math check needs math"
    shutil.rmtree(SCREENSHOTS, ignore_errors=True)
    found = check_site(site, pages, SCREENSHOTS, tmp_path)
    assert not found, "\n".join(f"{page}: {p}" for page, ps in found.items() for p in ps)
    assert len(list(SCREENSHOTS.glob("*.png"))) == len(pages)
