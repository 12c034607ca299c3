"""Mutation testing in one process: mutmut's mutants, this suite's tests, no pytest start per mutant.

``./dev mutate`` runs ``mutmut run``, which starts a pytest session for every mutant (about 6 s each
on two loaded cores: hours for the ~1,900 mutants of the verdict code). This script uses the same
mutants (mutmut 3.8.1 generates them from ``[tool.mutmut]`` in pyproject.toml into ``mutants/``)
and evaluates them in one interpreter:

1. every case of the given test modules (``pytest.mark.parametrize`` expanded; fixtures
   ``tmp_path``, ``monkeypatch`` and ``device`` (CPU) provided, tests needing others left out and
   counted) runs once on the unmutated code under mutmut's ``stats`` trampoline, which records the
   mutated functions it reaches, and its time;
2. each mutant is activated through ``MUTANT_UNDER_TEST`` and only the cases reaching its function
   run, fastest first, until one raises: *killed* (a case over 20× its clean time: *timeout*);
   none raises: *survived*; no case reaches it: *no tests*.

It is mutmut's own verdict rule (a mutant is killed when a test fails), minus pytest's process
isolation: a mutant that corrupts module state could leak into the next one, so survivors are
worth a confirming ``mutmut run NAME``.

Usage, from the repository root (``OMP_NUM_THREADS=1``)::

    python tests/mutate_inprocess.py --tests test_interval_reference,test_bounds \\
        --out mutants/interval.json 'depthsat_theory.bounds.interval.*'

``--reuse`` skips the generation when ``mutants/`` is already there; ``--max-case-seconds S`` leaves
out (and lists) the cases whose clean run takes longer than ``S`` (a quicker, weaker run).  Prints a table per function
(killed / survived / timeout / no tests) and every survivor's name; ``mutmut show NAME`` gives the
diff.  Exit status 0 (the survivors are for a person to judge: killed by a new test or explained).
"""

from __future__ import annotations

import argparse
import collections
import fnmatch
import importlib
import itertools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

FIXTURES = {"tmp_path", "monkeypatch", "device"}


def generate() -> None:
    """mutmut's generation step (``mutmut run`` before its stats), into ``mutants/``."""
    from mutmut.__main__ import create_mutants
    from mutmut.mutation.trampoline import set_mutant_under_test
    from mutmut.utils.file_utils import copy_also_copy_files, copy_src_dir, setup_source_paths

    set_mutant_under_test("mutant_generation")
    shutil.rmtree("mutants", ignore_errors=True)
    os.makedirs("mutants")
    copy_src_dir()
    copy_also_copy_files()
    setup_source_paths()
    create_mutants(1)
    set_mutant_under_test(None)
    os.environ.pop("MUTANT_UNDER_TEST", None)


def mutant_names(root: Path, globs: list[str]) -> list[str]:
    names: list[str] = []
    for meta in sorted(root.rglob("*.py.meta")):
        keys = json.loads(meta.read_text())["exit_code_by_key"]
        names += [k for k in keys if any(fnmatch.fnmatch(k, g) for g in globs)]
    return names


def cases_of(modules: list[str]) -> tuple[list[tuple], int]:
    """``(name, function, kwargs, fixtures)`` for every runnable case, and the count left out."""
    out, skipped = [], 0
    for modname in modules:
        mod = importlib.import_module(modname)
        for name in sorted(dir(mod)):
            fn = getattr(mod, name)
            if not (name.startswith("test_") and callable(fn)):
                continue
            marks = getattr(fn, "pytestmark", [])
            if any(m.name in ("skip", "skipif", "slow") for m in marks):
                skipped += 1
                continue
            grids = []
            for m in (m for m in marks if m.name == "parametrize"):
                argnames = m.args[0]
                argnames = [a.strip() for a in argnames.split(",")] if isinstance(argnames, str) else list(argnames)
                vals = []
                for v in m.args[1]:
                    v = v.values if type(v).__name__ == "ParameterSet" else v
                    vals.append(dict(zip(argnames, v if len(argnames) > 1 else (v,), strict=True)))
                grids.append(vals)
            params = fn.__code__.co_varnames[: fn.__code__.co_argcount]
            for combo in itertools.product(*grids) if grids else [()]:
                kw = {k: v for d in combo for k, v in d.items()}
                if any(p not in kw and p not in FIXTURES for p in params):
                    skipped += 1
                    continue
                out.append((f"{modname}::{name}[{kw}]", fn, kw, [p for p in params if p in FIXTURES]))
    return out, skipped


def call(fn, kw: dict, fixtures: list[str]) -> None:
    import pytest
    import torch

    kw = dict(kw)
    tmp = mp = None
    if "tmp_path" in fixtures:
        tmp = tempfile.mkdtemp()
        kw["tmp_path"] = Path(tmp)
    if "monkeypatch" in fixtures:
        mp = pytest.MonkeyPatch()
        kw["monkeypatch"] = mp
    if "device" in fixtures:
        kw["device"] = torch.device("cpu")
    try:
        fn(**kw)
    finally:
        if mp is not None:
            mp.undo()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


class _Timeout(Exception):
    pass


def _alarm(*_):
    raise _Timeout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("globs", nargs="+", help="mutant-name globs, or @FILE with one name per line")
    ap.add_argument("--tests", required=True, help="comma-separated test modules (tests/ on the path)")
    ap.add_argument("--out", default="mutants/inprocess.json")
    ap.add_argument("--reuse", action="store_true", help="keep the existing mutants/ folder")
    ap.add_argument(
        "--max-case-seconds",
        type=float,
        default=float("inf"),
        help="leave out cases whose clean run takes longer (listed; a quicker, weaker run)",
    )
    args = ap.parse_args()
    if not args.reuse or not Path("mutants").is_dir():
        generate()
    root = Path("mutants").resolve()
    out_path = Path(args.out).resolve()
    globs = args.globs
    names = Path(globs[0][1:]).read_text().split() if globs[0].startswith("@") else mutant_names(root, globs)
    sys.path[:0] = [str(root), str(root / "tests")]
    os.chdir(root)
    import mutmut.mutation.trampoline as trampoline

    hits: set[str] = set()
    trampoline.record_trampoline_hit = lambda name, caller=None: hits.add(name)
    cases, skipped = cases_of(args.tests.split(","))
    assert importlib.import_module("depthsat_theory").__file__.startswith(str(root)), "mutants/ is not first"
    cov, dur, good = {}, {}, []
    os.environ["MUTANT_UNDER_TEST"] = "stats"
    for case in cases:
        hits.clear()
        t = time.perf_counter()
        try:
            call(*case[1:])
        except BaseException as exc:  # a failing clean case is reported and left out
            print(f"clean run failed, left out: {case[0]}: {type(exc).__name__}: {exc}"[:300], file=sys.stderr)
            continue
        dur[case[0]], cov[case[0]] = time.perf_counter() - t, set(hits)
        if dur[case[0]] > args.max_case_seconds:
            print(f"slow case left out ({dur[case[0]]:.1f} s): {case[0]}"[:300], file=sys.stderr)
            skipped += 1
            continue
        good.append(case)
    print(
        f"{len(good)} cases ({skipped} left out: fixtures/slow), clean run {sum(dur.values()):.0f} s", file=sys.stderr
    )
    signal.signal(signal.SIGALRM, _alarm)
    res: dict[str, list] = {}
    for i, name in enumerate(names):
        fn = name.rsplit("__mutmut_", 1)[0]
        mine = sorted((c for c in good if fn in cov[c[0]]), key=lambda c: dur[c[0]])
        os.environ["MUTANT_UNDER_TEST"] = name
        verdict: list = ["survived" if mine else "no tests", None]
        for case in mine:
            signal.alarm(max(20, int(20 * dur[case[0]])))
            try:
                call(*case[1:])
            except _Timeout:
                verdict = ["timeout", case[0]]
                break
            except BaseException:  # any failure kills the mutant
                verdict = ["killed", case[0]]
                break
            finally:
                signal.alarm(0)
        res[name] = verdict
        print(f"{i + 1}/{len(names)} {name} {verdict[0]}", file=sys.stderr, flush=True)
    os.environ["MUTANT_UNDER_TEST"] = ""
    out_path.write_text(json.dumps(res, indent=0))
    table: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for name, (v, _) in res.items():
        table[name.rsplit(".", 1)[-1].rsplit("__mutmut_", 1)[0]][v] += 1
    print(f"{'function':50} killed survived timeout no-tests")
    for fn, c in table.items():
        print(f"{fn:50} {c['killed']:6} {c['survived']:8} {c['timeout']:7} {c['no tests']:8}")
    print("survivors:", *[n for n, (v, _) in res.items() if v == "survived"], sep="\n  ")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
