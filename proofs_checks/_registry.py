"""Registry and runner of the machine checks of ``theory/``'s claims.

Every check is a function ``fn(ctx) -> Outcome`` registered with :func:`check`; it names
the claim (``"T2"``), the ``theory/`` labels it verifies (``"thm-iff"``), and its method:

- ``symbolic``: an identity of a proof step verified by sympy (exact);
- ``numeric``: randomized instances through the numeric engine on torch models;
- ``converse``: an instance where an assumption of the claim fails, built so that the
  conclusion fails with it (evidence that the assumption is needed);
- ``coverage``: Monte Carlo coverage of a confidence statement.

``Outcome.counterexamples`` counts instances where the check's stated expectation did
not hold (for a converse check: where the constructed failure did not happen). A check
passes when it ran without error and has zero counterexamples.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from depthsat_theory.io import atomic_write

METHODS = ("symbolic", "numeric", "converse", "coverage")


@dataclass(frozen=True)
class Outcome:
    """What one check found.

    Attributes:
        instances: number of instances (identities, random draws, constructions) checked.
        counterexamples: instances where the stated expectation failed.
        converse: for converse checks, a short sentence of what failed where the
            assumption failed (e.g. ``"rotation: 24/24 improvable sites show no decrease"``).
        detail: one line of figures (largest deviation, tolerance, …).
        table: optional extra table printed after the main one, as
            ``(title, column names, rows)`` (e.g. T7's coverage per population and size).
    """

    instances: int
    counterexamples: int
    converse: str = ""
    detail: str = ""
    table: tuple[str, list[str], list[list]] | None = None


@dataclass(frozen=True)
class Check:
    """A registered check of one or more labelled claims."""

    claim: str
    labels: tuple[str, ...]
    name: str
    method: str
    fn: Callable[[Context], Outcome]
    module: str


@dataclass
class Context:
    """Run options handed to every check.

    Attributes:
        seed: base seed; each check derives its own generator from it and its name.
        quick: a smaller instance count (used by the test suite and ``--quick``).
    """

    seed: int = 0
    quick: bool = False

    def rng(self, name: str) -> np.random.Generator:
        """NumPy generator seeded from ``(seed, name)`` (stable across runs)."""
        return np.random.default_rng([self.seed, *name.encode()])

    def torch_generator(self, name: str) -> torch.Generator:
        """A torch CPU generator seeded from ``(seed, name)``."""
        return torch.Generator().manual_seed(int(self.rng(name).integers(2**62)))

    def count(self, full: int, quick: int) -> int:
        """Instance count for this run: ``quick`` under ``--quick``, else ``full``."""
        return quick if self.quick else full


CHECKS: list[Check] = []


def check(claim: str, labels: str | Iterable[str], name: str, method: str):
    """Decorator registering ``fn(ctx) -> Outcome`` as a check of ``labels``.

    Raises:
        ValueError: unknown method or a duplicate check name.
    """
    if method not in METHODS:
        raise ValueError(f"method {method!r} is not one of {METHODS}")
    labs = (labels,) if isinstance(labels, str) else tuple(labels)

    def deco(fn):
        if any(c.name == name for c in CHECKS):
            raise ValueError(f"duplicate check name {name!r}")
        CHECKS.append(Check(claim, labs, name, method, fn, fn.__module__))
        return fn

    return deco


@dataclass
class Row:
    """One line of the result table."""

    claim: str
    labels: list[str]
    check: str
    method: str
    instances: int
    counterexamples: int
    converse: str
    detail: str
    seconds: float
    error: str = ""
    table: tuple[str, list[str], list[list]] | None = None
    passed: bool = field(init=False)

    def __post_init__(self):
        self.passed = not self.error and self.counterexamples == 0 and self.instances > 0


def load_all() -> list[Check]:
    """Import every claim module (which registers its checks) and return the registry."""
    import importlib

    from . import MODULES

    for mod in MODULES:
        importlib.import_module(f"{__package__}.{mod}")
    return CHECKS


def run_checks(
    ctx: Context, *, only: Iterable[str] | None = None, progress: Callable[[Check], None] | None = None
) -> list[Row]:
    """Run the registered checks (optionally only those of some claims, e.g. ``{"T2"}``).

    A check that raises is recorded as failed with the exception's one-line summary;
    set ``DEPTHSAT_DEBUG=1`` to get the traceback printed as well.
    """
    wanted = {c.upper() for c in only} if only else None
    rows = []
    for chk in load_all():
        if wanted and chk.claim.upper() not in wanted:
            continue
        if progress:
            progress(chk)
        t0 = time.perf_counter()
        try:
            out = chk.fn(ctx)
            rows.append(
                Row(
                    chk.claim,
                    list(chk.labels),
                    chk.name,
                    chk.method,
                    out.instances,
                    out.counterexamples,
                    out.converse,
                    out.detail,
                    time.perf_counter() - t0,
                    table=out.table,
                )
            )
        except Exception as exc:
            if os.environ.get("DEPTHSAT_DEBUG"):
                traceback.print_exc()
            rows.append(
                Row(
                    chk.claim,
                    list(chk.labels),
                    chk.name,
                    chk.method,
                    0,
                    0,
                    "",
                    "",
                    time.perf_counter() - t0,
                    error=f"{type(exc).__name__}: {exc}",
                )
            )
    return rows


def write_json_atomic(rows: list[Row], ctx: Context, path: str) -> None:
    """Write the rows as JSON via a temporary file and ``os.replace`` (never half-written)."""
    doc = {
        "seed": ctx.seed,
        "quick": ctx.quick,
        "passed": all(r.passed for r in rows),
        "rows": [asdict(r) for r in rows],
    }
    atomic_write(path, lambda fh: json.dump(doc, fh, indent=1, default=_json_scalar))


def _json_scalar(obj: object) -> object:
    """A numpy scalar of the checks' tables (T7's probe sizes are ``np.int64``) as a Python number."""
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")
