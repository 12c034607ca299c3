"""The built book, tested the way a reader meets it: in headless Chromium, served on 127.0.0.1.

Needs the built site (``./dev book`` builds it, then runs this file with ``--book-site
book/_build/html``; without ``--book-site`` pytest does not collect this file, see
tests/conftest.py). Chromium and its driver are the Debian packages ``chromium`` and
``chromium-driver`` (``./dev book`` installs them when missing), driven by selenium.

For every page: math typeset (each Sphinx math element holds a MathJax container, no MathJax
error, no raw TeX such as ``\\frac`` in the visible text outside code), no console error, every
image loaded, no element wider than the text column unless inside a scrolling box, no display
equation clipped (wider than its box after the book's fit-to-column script), no page scrolling
sideways, and no request to a host other than 127.0.0.1, each at 1280 px (a laptop) and at 390 px
(a phone). Over the whole site: every internal link and
anchor resolves, every ``theory/`` page and every public module has its page.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import pkgutil
import re
import shutil
import sys
import threading
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urldefrag, urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]
WIDTH, HEIGHT = 1280, 900
#: the widths every page is read at: a laptop and a phone
WIDTHS = (1280, 390)
RAW_TEX = re.compile(r"\\(frac|sqrt|mathbb|mathrm|lVert|rVert|sum|begin|operatorname|hat|tilde)\b|\$\$")

# ----------------------------------------------------------------------------- the site


@pytest.fixture(scope="module")
def site(request) -> Path:
    option = request.config.getoption("book_site")
    if not option:
        pytest.fail("tests/test_book.py needs the built book: run ./dev book, or pass --book-site book/_build/html")
    path = Path(option).resolve()
    if not (path / "index.html").is_file():
        pytest.fail(f"--book-site {path}: no index.html there; build the book first (./dev book)")
    return path


def _pages(site: Path) -> list[Path]:
    skip = {"_static", "_sources", "_images", "reports", "_sphinx_design_static", "_modules", "_notebooks"}
    return sorted(p for p in site.rglob("*.html") if not skip & set(p.relative_to(site).parts))


@pytest.fixture(scope="module")
def server(site: Path):
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass


@pytest.fixture(scope="module")
def browser():
    driver = chromium()
    yield driver
    driver.quit()


def chromium():
    """A headless Chromium at 1280 px that logs the console and every network request."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not binary or not driver_path:
        pytest.fail("headless Chromium is needed: apt-get install -y chromium chromium-driver (./dev book does)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={WIDTH},{HEIGHT}",
        # nothing may leave 127.0.0.1: other hosts do not resolve (requests are still logged)
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-default-apps",
        "--disable-sync",
    ):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service(driver_path))
    driver.set_window_size(WIDTH, HEIGHT)
    driver.set_script_timeout(120)
    return driver


# ----------------------------------------------------------------------------- one page in the browser

_WAIT_MATHJAX = """
const done = arguments[arguments.length - 1];
let settled = false;
const settle = () => { if (!settled) { settled = true; setTimeout(() => done(true), 50); } };
const deadline = Date.now() + 10000;  // a page whose math never typesets is reported by _INSPECT
function check() {
  const mj = window.MathJax;
  if (document.readyState !== "complete" && Date.now() < deadline) { setTimeout(check, 50); }
  else if (mj && mj.startup && mj.startup.promise) {
    mj.startup.promise.then(settle, settle);
    setTimeout(settle, Math.max(deadline - Date.now(), 0) + 10000);  // a promise that never settles
  }
  else if (document.querySelector(".math") && Date.now() < deadline) { setTimeout(check, 100); }
  else { settle(); }
}
check();
"""

_INSPECT = """
const article = document.querySelector("article.bd-article") || document.querySelector("main") || document.body;
const math = Array.from(document.querySelectorAll("span.math, div.math"));  // the sidebar's titles too
const untypeset = math.filter(el => !el.querySelector("mjx-container")).map(el => el.textContent.slice(0, 80));
const errors = Array.from(document.querySelectorAll("mjx-merror, [data-mjx-error]")).map(el =>
  el.getAttribute("data-mjx-error") || el.textContent.slice(0, 80));
const clone = article.cloneNode(true);
clone.querySelectorAll("pre, code, mjx-container, script, style, .highlight, textarea").forEach(el => el.remove());
const text = clone.textContent;
const images = Array.from(article.querySelectorAll("img")).map(img => ({
  src: img.getAttribute("src"), ok: img.complete && img.naturalWidth > 0}));
if (window.depthsatFitMath) window.depthsatFitMath();
const col = article.getBoundingClientRect();
const clippedMath = Array.from(article.querySelectorAll('mjx-container[display="true"]'))
  .filter(el => el.getBoundingClientRect().width > 0 && el.scrollWidth > el.clientWidth + 1)
  .map(el => `${Math.round(el.scrollWidth - el.clientWidth)} px hidden: ${(el.getAttribute("aria-label") ||
    el.textContent).slice(0, 60)}`);
const pageScroll = Math.round(document.documentElement.scrollWidth - window.innerWidth);
const scrolls = el => ["auto", "scroll", "hidden", "clip"].includes(getComputedStyle(el).overflowX);
const overflow = [];
for (const el of article.querySelectorAll("*")) {
  const r = el.getBoundingClientRect();
  if (r.width === 0 || r.height === 0 || r.right <= col.right + 1) continue;
  let clipped = false;
  for (let p = el.parentElement; p && p !== article; p = p.parentElement) {
    if (scrolls(p)) { clipped = true; break; }
  }
  const past = Math.round(r.right - col.right);
  const name = `${el.tagName.toLowerCase()}.${el.className}`;
  if (!clipped && !scrolls(el)) overflow.push(`${name} (${past} px past the column)`);
  if (overflow.length > 5) break;
}
return {math: math.length, containers: document.querySelectorAll("mjx-container").length, untypeset, errors,
        text, images, overflow, columnWidth: col.width, clippedMath, pageScroll};
"""


def _visit(browser, url: str) -> dict:
    from selenium.common.exceptions import TimeoutException

    browser.get_log("browser")
    browser.get_log("performance")
    browser.get(url)
    try:
        browser.execute_async_script(_WAIT_MATHJAX)
    except TimeoutException:  # a browser stalled by a loaded machine (seen once): one fresh load, then it counts
        browser.get(url)
        browser.execute_async_script(_WAIT_MATHJAX)
    browser.execute_script("document.querySelectorAll('img[loading=lazy]').forEach(i => i.loading = 'eager');")
    info = browser.execute_script(_INSPECT)
    info["console"] = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    info["requests"] = [
        msg["params"]["request"]["url"]
        for msg in (json.loads(e["message"])["message"] for e in browser.get_log("performance"))
        if msg["method"] == "Network.requestWillBeSent"
    ]
    return info


def _foreign(urls: list[str]) -> list[str]:
    local = ("data", "blob", "about")
    return [u for u in urls if urlparse(u).scheme not in local and urlparse(u).hostname != "127.0.0.1"]


@pytest.mark.parametrize("width", WIDTHS)
def test_every_page_as_a_reader_sees_it(site, server, browser, width):
    problems: dict[str, list[str]] = {}
    pages = _pages(site)
    assert len(pages) > 20, f"only {len(pages)} pages in {site}"
    typeset = 0
    browser.set_window_size(width, HEIGHT)
    for page in pages:
        rel = page.relative_to(site).as_posix()
        info = _visit(browser, server + rel)
        found = [f"display math clipped at {width} px: {m}" for m in info["clippedMath"]]
        if info["pageScroll"] > 1:
            found.append(f"the page scrolls sideways by {info['pageScroll']} px at {width} px")
        if info["untypeset"]:
            found.append(f"{len(info['untypeset'])} math elements not typeset, e.g. {info['untypeset'][0]!r}")
        if info["errors"]:
            found.append(f"MathJax errors: {info['errors'][:3]}")
        raw = RAW_TEX.search(info["text"])
        if raw:
            start = max(raw.start() - 40, 0)
            found.append(f"raw TeX in the visible text: …{info['text'][start : raw.end() + 40]!r}…")
        found += [f"console error: {m}" for m in info["console"]]
        found += [f"image not loaded: {img['src']}" for img in info["images"] if not img["ok"]]
        found += [f"overflows the {info['columnWidth']:.0f} px column: {o}" for o in info["overflow"]]
        found += [f"request leaves 127.0.0.1: {u}" for u in _foreign(info["requests"])]
        if found:
            problems[rel] = found
        typeset += info["containers"]
    assert typeset > 500, f"only {typeset} typeset formulas in the whole book"
    browser.set_window_size(WIDTH, HEIGHT)
    assert not problems, "\n".join(f"{page}: {p}" for page, found in problems.items() for p in found)


def test_chapters_show_their_executed_figures(site, server, browser):
    figures = {}
    for rel in (
        "chapters/setting.html",
        "chapters/optimizers.html",
        "chapters/beyond.html",
        "chapters/joint.html",
        "chapters/diagnosis.html",
        "chapters/growth.html",
    ):
        info = _visit(browser, server + rel)
        figures[rel] = [img for img in info["images"] if img["ok"]]
    assert all(figures.values()), {rel: len(imgs) for rel, imgs in figures.items()}


def test_search_results_typeset_math(site, server, browser):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server + "search.html?q=projector")
    # Sphinx adds the results one by one and then says "Search finished"; the summaries are typeset as
    # they arrive (after a quiet 300 ms), so on a loaded machine wait for both before reading the text
    WebDriverWait(browser, 60).until(lambda d: "Search finished" in d.find_element("id", "search-results").text)
    with contextlib.suppress(TimeoutException):  # the assertion below reports what is left
        WebDriverWait(browser, 60).until(
            lambda d: not re.search(r"\\\(|\\\)", d.find_element("id", "search-results").text)
        )
    text = browser.find_element("id", "search-results").text
    assert not re.search(r"\\\(|\\\)", text), f"raw TeX delimiters in the search results: {text[:300]!r}"


def _search(browser, server: str, query: str) -> list[str]:
    """The hrefs of the site search's results for ``query``, best first (relative to the site)."""
    from urllib.parse import quote

    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server + "search.html?q=" + quote(query))
    WebDriverWait(browser, 60).until(lambda d: "Search finished" in d.find_element("id", "search-results").text)
    links = browser.execute_script(
        "return Array.from(document.querySelectorAll('#search-results ul.search > li > a'))"
        ".map(a => a.getAttribute('href'));"
    )
    return [href.removeprefix(server) for href in links]


def test_search_ranks_chapters_above_attributes(site, server, browser):
    """A concept's search finds the book's pages before API attributes; an object's name finds its own page."""
    hits = _search(browser, server, "saturation score")
    assert len(hits) >= 5, f"too few search results for 'saturation score': {hits}"
    api = [h for h in hits[:5] if h.startswith("_autosummary/")]
    assert not api, f"API pages among the first five hits for 'saturation score': {hits[:5]}"
    # a concept that is also the name of many attributes (SiteDiagnosis.verdict, ...): they come after the
    # book's pages; the class Verdict, searched for by its name, stays first
    hits = _search(browser, server, "verdict")
    assert hits[0].endswith("#depthsat_theory.vocabulary.Verdict"), hits[:5]
    attributes = [h for h in hits[:5] if h.endswith(".verdict")]
    assert not attributes, f"API attributes among the first five hits for 'verdict': {hits[:5]}"
    # the API stays findable by name: the function's own entry first
    hits = _search(browser, server, "plan_bound")
    assert hits and hits[0].split("#")[-1] == "depthsat_theory.bounds.plan.plan_bound", hits[:5]


# ----------------------------------------------------------------------------- the whole site, statically


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("href"):
            self.links.append(a["href"])
        if tag in ("img", "script") and a.get("src"):
            self.links.append(a["src"])
        if tag == "link" and a.get("href"):
            self.links.append(a["href"])


def test_every_internal_link_resolves(site):
    parsed = {}
    for page in site.rglob("*.html"):
        p = _Links()
        p.feed(page.read_text(encoding="utf-8"))
        parsed[page.resolve()] = p
    broken = []
    for page in _pages(site):
        for href in parsed[page.resolve()].links:
            url = urlparse(href)
            if url.scheme in ("http", "https", "mailto", "data", "javascript") or href.startswith("//"):
                continue
            path, fragment = urldefrag(unquote(href))
            target = (page.parent / path).resolve() if path else page.resolve()
            if path.endswith("/"):
                target = target / "index.html"
            target = Path(str(target).split("?")[0])
            if not target.exists():
                broken.append(f"{page.relative_to(site)}: {href} (no file)")
            elif fragment and target.suffix == ".html" and fragment not in parsed[target].ids:
                broken.append(f"{page.relative_to(site)}: {href} (no anchor #{fragment})")
    assert not broken, "\n".join(broken[:40])


def test_no_page_links_to_another_host_for_its_assets(site):
    pattern = re.compile(r"""<(?:script|link|img)[^>]+(?:src|href)=["'](?:https?:)?//""", re.I)
    offenders = [p.relative_to(site).as_posix() for p in _pages(site) if pattern.search(p.read_text(encoding="utf-8"))]
    assert not offenders, offenders


def test_no_build_machine_path_or_warning_in_outputs(site):
    """Executed outputs show neither this checkout's path, a scratch folder, nor a Python warning."""
    import tempfile

    scratch = re.escape(tempfile.gettempdir()) + r"/tmp\w+"
    pattern = re.compile("|".join([re.escape(str(ROOT)), re.escape(sys.prefix), scratch, r"\w+Warning: "]))
    found = []
    for page in _pages(site):
        text = re.sub(r"<[^>]+>", "", page.read_text(encoding="utf-8"))
        found += [
            f"{page.relative_to(site)}: …{text[max(m.start() - 60, 0) : m.end() + 60]!r}…"
            for m in pattern.finditer(text)
        ]
    assert not found, "\n".join(found[:20])


def test_every_theory_page_is_in_the_book(site):
    missing = []
    for md in sorted((ROOT / "theory").glob("*.md")):
        if md.name == "README.md":
            continue
        html = site / "theory" / f"{md.stem}.html"
        heading = next(line for line in md.read_text(encoding="utf-8").splitlines() if line.startswith("# "))
        title = re.sub(r"[`*$\\]", "", heading[2:]).split("(")[0].strip()
        if not html.is_file() or title not in html.read_text(encoding="utf-8"):
            missing.append(f"theory/{md.name} ({title!r})")
    assert not missing, f"theory pages missing from the book: {missing}"


def _public_modules() -> list[str]:
    import depthsat_theory
    import proofs_checks

    names = []
    for pkg in (depthsat_theory, proofs_checks):
        names.append(pkg.__name__)
        for mod in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if not any(part.startswith("_") for part in mod.name.split(".")):
                names.append(mod.name)
    return names


def test_every_public_module_is_in_the_api_reference(site):
    modules = _public_modules()
    assert "depthsat_theory.statistics.tangent" in modules and len(modules) > 50
    missing = [m for m in modules if not (site / "_autosummary" / f"{m}.html").is_file()]
    assert not missing, f"modules without an API page: {missing}"
    api = (site / "api.html").read_text(encoding="utf-8")
    assert "depthsat_theory.statistics" in api


# ----------------------------------------------------------------------------- notebook downloads


def _executed_chapters() -> list[str]:
    """Docnames of the book's executed chapters (MyST notebooks), from the sources."""
    sys.path.insert(0, str(ROOT / "book" / "_ext"))
    try:
        from depthsat_book import is_executed_chapter
    finally:
        sys.path.remove(str(ROOT / "book" / "_ext"))
    book = ROOT / "book"
    return sorted(
        p.relative_to(book).with_suffix("").as_posix()
        for p in book.glob("*/*.md")
        if not {"_build", "_autosummary"} & set(p.relative_to(book).parts)
        and is_executed_chapter(p.read_text(encoding="utf-8"))
    )


def test_every_executed_chapter_links_its_notebook(site):
    import nbformat

    chapters = _executed_chapters()
    assert "theory/iff" in chapters and "chapters/setting" in chapters and len(chapters) > 10
    problems = []
    for doc in chapters:
        html = (site / f"{doc}.html").read_text(encoding="utf-8")
        if f"_notebooks/{doc}.ipynb" not in html:
            problems.append(f"{doc}.html: no link to its notebook")
        nb_path = site / "_notebooks" / f"{doc}.ipynb"
        if not nb_path.is_file():
            problems.append(f"{doc}: no notebook in the site")
            continue
        nb = nbformat.read(str(nb_path), as_version=4)
        nbformat.validate(nb)
        source = (ROOT / "book" / f"{doc}.md").read_text(encoding="utf-8")
        if sum(c.cell_type == "code" for c in nb.cells) != source.count("```{code-cell}"):
            problems.append(f"{doc}: the notebook's code cells differ from the chapter's")
        if "{include}" in "".join(c.source for c in nb.cells):
            problems.append(f"{doc}: an include directive left unexpanded")
    assert not problems, "\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("doc", _executed_chapters())
def test_downloaded_notebook_executes(site, doc):
    """The notebook a reader downloads runs from top to bottom in a clone (its folder in book/)."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(str(site / "_notebooks" / f"{doc}.ipynb"), as_version=4)
    env_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    os.environ["PYTHONPATH"] = env_path  # the kernel inherits it
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "book" / Path(doc).parent)}}
    ).execute()
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"
    ]
    assert errors == []
