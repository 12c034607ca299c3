"""The ``slow`` marker keeps its promise: ``--slow-sample N`` runs a fixed sample of N slow tests.

Each case runs pytest in a subprocess on a scratch folder holding a copy of ``tests/conftest.py``
(with the ``cases`` module it imports) and a file of 5 slow and 2 fast tests.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

_FAKE_TESTS = """
import pytest

@pytest.mark.slow
@pytest.mark.parametrize("i", range(5))
def test_slow(i):
    pass

def test_fast_a():
    pass

def test_fast_b():
    pass
"""
_SLOW_IDS = [f"test_fake.py::test_slow[{i}]" for i in range(5)]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("slow-sample")
    shutil.copy(Path(__file__).with_name("conftest.py"), folder / "conftest.py")
    shutil.copy(Path(__file__).with_name("cases.py"), folder / "cases.py")  # the conftest's engine cases
    (folder / "test_fake.py").write_text(_FAKE_TESTS)
    (folder / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\naddopts = --strict-markers\n")
    return folder


def _run(folder: Path, *args: str) -> tuple[int, set[str], str]:
    env = {k: v for k, v in os.environ.items() if k != "DEPTHSAT_SLOW_SAMPLE"}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    passed = set(re.findall(r"^(test_fake\.py::\S+) PASSED", res.stdout, flags=re.M))
    return res.returncode, passed, res.stdout + res.stderr


def _smallest_hashes(n: int) -> set[str]:
    return set(sorted(_SLOW_IDS, key=lambda t: hashlib.sha256(t.encode()).hexdigest())[:n])


def test_default_sample_is_one_slow_test(scratch):
    rc, passed, out = _run(scratch)
    assert rc == 0, out
    assert passed == {"test_fake.py::test_fast_a", "test_fake.py::test_fast_b"} | _smallest_hashes(1)
    assert "slow tests: 1 ran, 4 deselected (--slow-sample 1" in out


def test_sample_of_two_is_deterministic(scratch):
    first = _run(scratch, "--slow-sample", "2")
    again = _run(scratch, "--slow-sample", "2")
    assert first[0] == 0 and first[1] == again[1]
    assert first[1] - {"test_fake.py::test_fast_a", "test_fake.py::test_fast_b"} == _smallest_hashes(2)
    assert "slow tests: 2 ran, 3 deselected" in first[2]


def test_all_and_none(scratch):
    rc, passed, out = _run(scratch, "--slow-sample", "all")
    assert rc == 0 and len(passed) == 7
    assert "slow tests: 5 ran, 0 deselected (--slow-sample all" in out
    rc, passed, out = _run(scratch, "--slow-sample", "0")
    assert rc == 0 and passed == {"test_fake.py::test_fast_a", "test_fake.py::test_fast_b"}
    assert "slow tests: 0 ran, 5 deselected" in out


def test_environment_variable_sets_the_default(scratch):
    env_run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=scratch,
        env=dict(os.environ, DEPTHSAT_SLOW_SAMPLE="3"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "slow tests: 3 ran, 2 deselected" in env_run.stdout


def test_named_slow_test_always_runs(scratch):
    outside = sorted(set(_SLOW_IDS) - _smallest_hashes(1))[0]
    rc, passed, out = _run(scratch, "--slow-sample", "0", outside)
    assert rc == 0 and passed == {outside}, out
    assert "slow tests: 1 ran, 0 deselected" in out


def test_bad_value_is_a_usage_error(scratch):
    rc, _, out = _run(scratch, "--slow-sample", "some")
    assert rc == 4
    assert "--slow-sample must be a count >= 0 or 'all', got 'some'" in out
