"""Shared pytest fixtures for the depthsat_theory test suite."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

import cases

# CI draws the same hypothesis examples every run (a red CI must be reproducible);
# local runs explore new examples each time.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="session", params=DEVICES)
def device(request) -> torch.device:
    """Every engine test runs on CPU, and on CUDA too where a GPU is present.

    Session-scoped so that hypothesis ``@given`` tests may take it.
    """
    return torch.device(request.param)


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> str:
    """Cache folder for trained weights shared by the checker tests.

    ``$DEPTHSAT_CACHE`` when set (CI keeps it between runs), else a session temp dir.
    """
    return os.environ.get("DEPTHSAT_CACHE") or str(tmp_path_factory.mktemp("depthsat-cache"))


# ----------------------------------------------------------------------------- engine cases
# Cases as data (tests/cases.py), expanded here over engine × case × device.


@pytest.fixture(params=cases.ENGINE_CASES, ids=cases.ENGINE_CASE_IDS)
def engine_case(request) -> tuple[str, cases.Case, torch.device]:
    """One ``(engine, case, device)``: every engine that applies to the case, on every device."""
    engine, case, device = request.param
    return engine, case, torch.device(device)


@pytest.fixture(params=cases.EXACT_CASES, ids=cases.EXACT_CASE_IDS)
def exact_case(request) -> cases.Case:
    """One case with an exact finite measure (the symbolic engine applies)."""
    return request.param


# ----------------------------------------------------------------------------- slow tests
# Tests marked ``slow`` run as a fixed sample: ``--slow-sample N`` keeps the N slow tests whose
# SHA-256 of the test id is smallest (the same N on every run and machine), ``--slow-sample all``
# keeps every one, ``--slow-sample 0`` none. The default is what the README's ``./dev test`` (and CI)
# runs; ``$DEPTHSAT_SLOW_SAMPLE`` overrides it. A slow test named on the command line
# (``path::test``) always runs. The terminal summary says how many ran and were deselected.

SLOW_SAMPLE_DEFAULT = "1"


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--book-site",
        default=os.environ.get("DEPTHSAT_BOOK_SITE"),
        metavar="DIR",
        help="the built book (book/_build/html) for tests/test_book.py, which is collected only with it; "
        "./dev book builds the book and then runs that file with this option",
    )
    parser.addoption(
        "--slow-sample",
        default=os.environ.get("DEPTHSAT_SLOW_SAMPLE", SLOW_SAMPLE_DEFAULT),
        metavar="N|all",
        help="run N tests marked slow, chosen by a hash of their test id (default "
        f"$DEPTHSAT_SLOW_SAMPLE or {SLOW_SAMPLE_DEFAULT}); 'all' runs every slow test",
    )


def pytest_ignore_collect(collection_path, config) -> bool | None:
    """tests/test_book.py needs the built site: collected only with ``--book-site`` (``./dev book``)."""
    if collection_path.name == "test_book.py" and not config.getoption("book_site"):
        return True
    return None


def _slow_sample_size(config) -> int | None:
    """``--slow-sample`` as a count, or ``None`` for all."""
    raw = str(config.getoption("slow_sample")).strip().lower()
    if raw == "all":
        return None
    if not raw.isdigit():
        raise pytest.UsageError(f"--slow-sample must be a count >= 0 or 'all', got {raw!r}")
    return int(raw)


def _named_on_command_line(config) -> list[str]:
    """Test ids given as ``path::name`` arguments, relative to the rootdir like ``item.nodeid``."""
    named = []
    for arg in config.args:
        if "::" not in arg:
            continue
        path, rest = arg.split("::", 1)
        rel = os.path.relpath(os.path.abspath(os.path.join(config.invocation_params.dir, path)), config.rootpath)
        named.append(rel.replace(os.sep, "/") + "::" + rest)
    return named


def slow_test_hash(nodeid: str) -> str:
    """The sample key of a test: the SHA-256 hex digest of its test id (``tests/x.py::test_y``)."""
    import hashlib

    return hashlib.sha256(nodeid.encode()).hexdigest()


# selected: the slow test ids kept; deselected: how many were dropped; ran: those that reached their call
_SLOW: dict = {"selected": set(), "deselected": 0, "ran": set(), "size": None, "active": False}


def pytest_collection_modifyitems(config, items) -> None:
    size = _slow_sample_size(config)
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    named = _named_on_command_line(config)
    keep = {item.nodeid for item in slow if any(item.nodeid.startswith(n) for n in named)}
    ranked = sorted((item for item in slow if item.nodeid not in keep), key=lambda item: slow_test_hash(item.nodeid))
    keep.update(item.nodeid for item in (ranked if size is None else ranked[:size]))
    dropped = [item for item in slow if item.nodeid not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item.nodeid in keep or item.get_closest_marker("slow") is None]
    _SLOW.update(selected=keep, deselected=len(dropped), size=size, active=True)


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" and report.nodeid in _SLOW["selected"]:
        _SLOW["ran"].add(report.nodeid)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not _SLOW["active"]:
        return
    sample = "all" if _SLOW["size"] is None else _SLOW["size"]
    terminalreporter.write_line(
        f"slow tests: {len(_SLOW['ran'])} ran, {_SLOW['deselected']} deselected "
        f"(--slow-sample {sample}; --slow-sample all runs every one)"
    )
