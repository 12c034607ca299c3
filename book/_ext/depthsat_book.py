"""Sphinx extension of the depthsat book.

Its jobs: the page's real text behind the download button, an ``.ipynb`` download of every
executed chapter, the docstrings' cross-references resolved to the one place each object is
documented, theory labels in docstrings made links, and a search that ranks chapters above the API
reference's attributes (``search_scorer.js``).

The theory pages are one-line include stubs (``{include} ../../theory/iff.md``); Sphinx copies the
stub to ``_sources/``, so the ".md" download button handed out two lines. After the build, each
copied stub is replaced by the text of the file it includes.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
from functools import lru_cache
from pathlib import Path

from docutils import nodes
from sphinx.addnodes import pending_xref
from sphinx.application import Sphinx
from sphinx.domains.python import PythonDomain
from sphinx.environment import BuildEnvironment
from sphinx.ext import autosummary

_INCLUDE = re.compile(r"^```\{include\}\s+(?P<path>\S+)\s*\n```\s*$")


def _replace_include_stubs(app: Sphinx, exception: Exception | None) -> None:
    if exception is not None or app.builder.format != "html":
        return
    sources = Path(app.outdir) / "_sources"
    for docname in app.env.found_docs:
        src = Path(app.env.doc2path(docname))
        match = _INCLUDE.match(src.read_text(encoding="utf-8").strip())
        if match is None:
            continue
        target = (src.parent / match["path"]).resolve()
        copied = sources / (docname + src.suffix)
        if copied.exists():
            copied.write_text(target.read_text(encoding="utf-8"), encoding="utf-8")


_INCLUDE_BLOCK = re.compile(r"^```\{include\}\s+(?P<path>\S+)\s*\n(?P<options>(?::[\w-]+:.*\n)*)```[ \t]*$", re.M)
#: where the notebooks are published, relative to the site's root
NOTEBOOKS = "_notebooks"


def is_executed_chapter(text: str) -> bool:
    """Whether a MyST source is a notebook (a ``kernelspec`` in its front matter), executed at build time."""
    if not text.startswith("---\n"):
        return False
    front = text.split("---\n", 2)[1] if text.count("---\n") >= 2 else ""
    return "kernelspec:" in front


def expand_includes(text: str, folder: Path) -> str:
    """``text`` with each ``{include}`` block replaced by the included text (``start-after``/``end-before`` kept)."""

    def one(match: re.Match) -> str:
        included = (folder / match["path"]).read_text(encoding="utf-8")
        options = dict(re.findall(r"^:([\w-]+):\s*(.*)$", match["options"], flags=re.M))
        if "start-after" in options:
            included = included.split(options["start-after"], 1)[1]
        if "end-before" in options:
            included = included.split(options["end-before"], 1)[0]
        return included.strip("\n")

    return _INCLUDE_BLOCK.sub(one, text)


def chapter_notebook(src: Path) -> object:
    """The executed chapter ``src`` (MyST Markdown) as an ``nbformat`` notebook, includes expanded.

    The notebook runs where the chapter runs (its own folder in ``book/``, with the repository on
    ``PYTHONPATH``), so its relative paths (``../data/…``) hold there.
    """
    from myst_nb.core.read import read_myst_markdown_notebook

    return read_myst_markdown_notebook(expand_includes(src.read_text(encoding="utf-8"), src.parent))


def _notebook_href(docname: str) -> str:
    return "../" * docname.count("/") + f"{NOTEBOOKS}/{docname}.ipynb"


def _write_notebooks(app: Sphinx, exception: Exception | None) -> None:
    """Write ``_notebooks/DOCNAME.ipynb`` for every executed chapter."""
    if exception is not None or app.builder.format != "html":
        return
    import nbformat

    for docname in sorted(app.env.found_docs):
        src = Path(app.env.doc2path(docname))
        if src.suffix == ".md" and is_executed_chapter(src.read_text(encoding="utf-8")):
            out = Path(app.outdir) / NOTEBOOKS / f"{docname}.ipynb"
            out.parent.mkdir(parents=True, exist_ok=True)
            nbformat.write(chapter_notebook(src), str(out))


def _notebook_link(app: Sphinx, doctree: nodes.document, docname: str) -> None:
    """Put a "download this chapter as a notebook" line under an executed chapter's title."""
    src = Path(app.env.doc2path(docname))
    if src.suffix != ".md" or not is_executed_chapter(src.read_text(encoding="utf-8")):
        return
    section = next(iter(doctree.findall(nodes.section)), None)
    if section is None:
        return
    name = Path(docname).name + ".ipynb"
    link = nodes.reference("", name, refuri=_notebook_href(docname), classes=["depthsat-notebook"])
    link["download"] = name
    para = nodes.paragraph(
        "",
        "",
        nodes.Text("Run this chapter yourself: "),
        link,
        nodes.Text(" (a Jupyter notebook; run it from its folder in book/ of a clone, after ./dev setup book)."),
        classes=["depthsat-notebook-line"],
    )
    title = next(iter(section.findall(nodes.title)), None)
    section.insert(section.index(title) + 1 if title is not None else 0, para)


_REDIRECT = re.compile(r'<meta http-equiv="Refresh" content="0; url=(?P<url>[^"<>]+)" />\s*')


def _index_with_icon(app: Sphinx, exception: Exception | None) -> None:
    """Give the root ``index.html`` redirect (written by sphinx_external_toc) a head with the icon.

    The bare one-line redirect has no ``<link rel="icon">``, so a browser opening the site's root asks
    for ``/favicon.ico``, which the site does not have (a 404 in the console, seen by the browser test
    on a slow machine). Same redirect, now a small HTML page with the site's icon and a visible link.
    """
    if exception is not None or app.builder.format != "html" or not app.config.html_favicon:
        return
    index = Path(app.outdir) / "index.html"
    match = _REDIRECT.fullmatch(index.read_text(encoding="utf-8")) if index.is_file() else None
    if match is None:
        return
    url, icon = match["url"], Path(app.config.html_favicon).name
    index.write_text(
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8" />\n'
        f'<meta http-equiv="Refresh" content="0; url={url}" />\n<link rel="icon" href="_static/{icon}" />\n'
        f"<title>{app.config.project}</title>\n</head>\n"
        f'<body><p><a href="{url}">{url}</a></p></body>\n</html>\n',
        encoding="utf-8",
    )


def _canonical(target: str) -> str | None:
    """The defining module's name of an object reached through a re-export, or None.

    ``depthsat_theory.statistics.StreamingStatistic.state_dict`` becomes
    ``depthsat_theory.statistics.protocol.StreamingStatistic.state_dict``.
    """
    if not target.startswith(("depthsat_theory.", "proofs_checks.")):
        return None
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        return f"{module}.{qualname}" if module and qualname else None
    return None


def _shared(name: str, module: str) -> int:
    """How many leading dotted components two names share."""
    count = 0
    for a, b in zip(name.split("."), module.split("."), strict=False):
        if a != b:
            break
        count += 1
    return count


def _documented(domain: PythonDomain, target: str, reftype: str, module: str) -> str | None:
    """The one documented object a (possibly short or re-exported) name means, or None."""
    objtypes = set(domain.objtypes_for_role(reftype) or ()) if reftype else set()
    canonical = _canonical(target)
    if canonical in domain.objects:
        return canonical
    names = [
        name
        for name, entry in domain.objects.items()
        if (name == target or name.endswith("." + target)) and (not objtypes or entry.objtype in objtypes)
    ]
    if not names and objtypes:  # a type alias documented as data, written :class:`Statistics`
        return _documented(domain, target, "", module)
    if not names and "." in target:  # a re-exported module attribute (data has no __module__)
        package, _, attr = target.rpartition(".")
        names = [name for name in domain.objects if name.startswith(package + ".") and name.endswith("." + attr)]
    if len(names) > 1:  # prefer the object closest to the module whose docstring refers to it
        best = max(_shared(name, module) for name in names)
        names = [name for name in names if _shared(name, module) == best]
    return names[0] if len(names) == 1 else None


def _resolve_py(
    app: Sphinx, env: BuildEnvironment, node: pending_xref, contnode: nodes.Element
) -> nodes.Element | None:
    """Resolve a py reference the docstrings write by a re-exported or a short name.

    ``depthsat_theory.statistics.SaturationResult`` is documented once, at its defining module
    ``depthsat_theory.statistics.result``; a short name (``ZeroStateUpdate.make_optimizer``) written in
    another module's docstring resolves to the documented object ending with it (the one nearest the
    referring module when several do). An enum member (``Verdict.DEGENERATE``) links to its enum.
    Anything else stays unresolved, so nitpicky mode still fails on a wrong name.
    """
    if node.get("refdomain") != "py":
        return None
    domain = env.get_domain("py")
    assert isinstance(domain, PythonDomain)
    target = node["reftarget"].lstrip("~.")
    module = node.get("py:module") or ""
    reftype = node["reftype"]
    found = _documented(domain, target, reftype, module)
    if found is None and reftype == "attr" and "." in target:
        parent = _documented(domain, target.rpartition(".")[0], "class", module)
        if parent is not None and domain.objects[parent].objtype == "class":
            found, reftype = parent, "class"
    if found is None:
        return None
    new = node.deepcopy()
    new["reftarget"] = found
    new["refspecific"] = False
    return domain.resolve_xref(env, node["refdoc"], app.builder, reftype, found, new, contnode)


def _foreign_docstring(app: Sphinx, what: str, name: str, obj: object, options: object, lines: list[str]) -> None:
    """Module data whose only docstring is its foreign class's: name its type instead.

    A ``#:`` comment on the data (the typer ``app``) is kept, with the type appended.
    """
    cls = type(obj)
    own_package = cls.__module__.split(".")[0] in ("depthsat_theory", "proofs_checks", "builtins")
    if what != "data" or own_package or obj.__doc__ is not cls.__doc__:
        return
    kind = f"A ``{cls.__module__}.{cls.__qualname__}`` instance."
    first = next((line.strip() for line in lines if line.strip()), "")
    class_first = next((line.strip() for line in (cls.__doc__ or "").splitlines() if line.strip()), "")
    lines[:] = [kind] if not first or first == class_first else [*lines, "", kind]


def _no_call_signature_for_data(app: Sphinx, domain: str, objtype: str, contentnode: nodes.Element) -> None:
    """No "Parameters: args, kwargs" under module data that happens to be callable (the typer ``app``).

    ``autodoc_typehints = "description"`` records the signature of every callable it documents; runs
    before autodoc's own handler, which would merge it into the data's description.
    """
    if domain != "py" or objtype != "data":
        return
    sig = contentnode.parent[0]
    fullname = ".".join(part for part in (sig.get("module"), sig.get("fullname")) if part)
    app.env.temp_data.get("annotations", {}).pop(fullname, None)


_import_by_name = autosummary._import_by_name


def _import_modules_first(name: str, grouped_exception: bool = True) -> tuple[object, object, str]:
    """autosummary's import, except that a submodule wins over a package attribute of the same name.

    ``depthsat_theory.cli`` re-exports the typer object ``app`` from its submodule
    ``depthsat_theory.cli.app``, so ``getattr(depthsat_theory.cli, "app")`` is the object, and
    autosummary (which tries ``MODULE.ATTR`` first) documented the object under the module's name and
    never the module. Here the module gets its page, and the object is documented in it
    (``depthsat_theory.cli.app.app``).
    """
    obj, parent, modname = _import_by_name(name, grouped_exception)
    if not inspect.ismodule(obj) and name.startswith(("depthsat_theory.", "proofs_checks.")):
        try:
            return importlib.import_module(name), None, name
        except ImportError:
            pass
    return obj, parent, modname


#: Warnings the chapters' kernels must not print: tqdm's "IProgress not found" (no ipywidgets in the
#: kernel) carried the build machine's site-packages path into the pages.
_QUIET_KERNEL_WARNINGS = ("ignore:IProgress not found",)


def _quiet_kernels() -> None:
    """Pass the kernels (child processes, which inherit the environment) the warning filters above."""
    current = [w for w in os.environ.get("PYTHONWARNINGS", "").split(",") if w]
    os.environ["PYTHONWARNINGS"] = ",".join(dict.fromkeys([*current, *_QUIET_KERNEL_WARNINGS]))


_THEORY = Path(__file__).resolve().parents[2] / "theory"
_LITERAL = re.compile(r"(``[^`]+``)")


@lru_cache(maxsize=1)
def theory_labels() -> frozenset[str]:
    """The labels of ``theory/*.md`` (``(thm-iff)=`` lines): the names docstrings cite their sources by."""
    found: set[str] = set()
    for page in _THEORY.glob("*.md"):
        found.update(re.findall(r"^\(([a-z][a-z0-9-]*)\)=\s*$", page.read_text(encoding="utf-8"), flags=re.M))
    return frozenset(found)


def link_theory_labels(line: str, labels: frozenset[str]) -> str:
    """``line`` with each theory label it cites (``thm-iff``, `thm-iff` or bare thm-iff) made a :ref: link.

    A label inside a longer literal (````theory/iff.md thm-iff````) is left as it is.
    """

    def ref(label: str) -> str:
        return f":ref:`{label} <{label}>`"

    def bare(text: str) -> str:
        text = re.sub(r"(?<![:`\w])`([a-z][a-z0-9-]*)`(?![`\w])", lambda m: ref(m[1]) if m[1] in labels else m[0], text)
        return re.sub(
            r"(?<![\w`<-])([a-z]+-[a-z0-9-]*[a-z0-9])(?![\w`>-])",
            lambda m: ref(m[1]) if m[1] in labels else m[0],
            text,
        )

    parts = _LITERAL.split(line)
    return "".join(
        (ref(part[2:-2]) if part[2:-2] in labels else part) if _LITERAL.fullmatch(part) else bare(part)
        for part in parts
    )


def _theory_links(app: Sphinx, what: str, name: str, obj: object, options: object, lines: list[str]) -> None:
    """Docstrings cite their sources by theory label: make each one a link to its place in the book."""
    labels = theory_labels()
    in_code = in_table = False
    for i, line in enumerate(lines):
        stripped = line.strip()
        if re.fullmatch(r"=+(\s+=+)+|\+[-=+]+\+", stripped):  # an RST table's rule: widths must not change
            in_table = True  # until the blank line after the table
            continue
        if in_table and not stripped:
            in_table = False
        if in_table:
            continue
        if stripped.startswith(">>>") or stripped.endswith("::"):
            in_code = stripped.endswith("::")
            continue
        if in_code and (not stripped or line.startswith((" ", "\t"))):
            continue
        in_code = False
        lines[i] = link_theory_labels(line, labels)


_SEARCH_SCORER = Path(__file__).resolve().parent / "search_scorer.js"


def _search_scorer(app: Sphinx, config: object) -> None:
    """Rank chapters above the API reference's attributes in the search (``search_scorer.js``)."""
    if not app.config.html_search_scorer:
        app.config.html_search_scorer = str(_SEARCH_SCORER)


def setup(app: Sphinx) -> dict[str, object]:
    """Register the build-finished hook, and quiet the chapters' kernels."""
    _quiet_kernels()
    app.connect("config-inited", _search_scorer)
    app.connect("build-finished", _replace_include_stubs)
    app.connect("build-finished", _write_notebooks)
    app.connect("doctree-resolved", _notebook_link)
    app.connect("build-finished", _index_with_icon, priority=600)  # after sphinx_external_toc's redirect
    app.connect("missing-reference", _resolve_py)
    app.connect("autodoc-process-docstring", _foreign_docstring)
    app.connect("autodoc-process-docstring", _theory_links, priority=600)
    app.connect("object-description-transform", _no_call_signature_for_data, priority=400)
    autosummary._import_by_name = _import_modules_first  # import_by_name looks it up at call time
    return {"parallel_read_safe": True, "parallel_write_safe": True}
