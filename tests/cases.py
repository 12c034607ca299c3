"""Small engine test cases as data (expanded by fixtures in ``conftest.py``).

Each :class:`Case` names a numeric family spec (:func:`depthsat_theory.families.parse_family`),
a site layout and per-example shape, and a probe: either a seeded random probe of ``n``
examples, or an exact finite measure (points, integer weights) with a conditional
activation gradient ``m(u)`` in the symbolic engine's grammar.  Cases with an exact
measure are also answered by the symbolic engine.

``verdict`` and (where a closed form exists) ``tangent_rank``/``tangent_dim`` are derived
by hand from the mathematics, not by running an engine:

* feature families ``h = W φ̃(u)`` have ``K = I_d ⊗ Σ`` (T5), so
  ``tangent_rank = d · rank Σ`` and ``tangent_dim = d · k̃``; for the linear family with
  bias ``φ̃ = (u, 1)`` and generic units, ``rank Σ = min(d + 1, #units)``;
* ``product:R`` has ``A ≡ 0`` (T4): degenerate, rank 0, ``tangent_dim = 2 d R``;
* on the four points ``(±1, ±1)`` with equal weights, ``m = u1 u2`` is orthogonal to
  ``1``, ``u1``, ``u2`` (and ``u1² = u2² = 1`` are constants), so ``s = 0`` for the
  linear and ``powers:2`` families: saturated;
* ``gradient="orthogonal"`` builds ``g`` orthogonal to ``T = {W z + c}`` of the linear
  family in the probe's empirical measure (QR of ``[Z, 1]``): saturated.

Modelled on curvlinops' ``test/cases.py`` (cases as data, ids from the data).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from depthsat_theory.vocabulary import Layout, Verdict

__all__ = [
    "CASES",
    "CASE_IDS",
    "DEVICES",
    "ENGINES",
    "ENGINE_CASES",
    "ENGINE_CASE_IDS",
    "EXACT_CASES",
    "EXACT_CASE_IDS",
    "Case",
]


@dataclass(frozen=True)
class Case:
    """One engine test case.

    Attributes:
        name: short id (unique).
        family: numeric family spec for :func:`depthsat_theory.families.parse_family`.
        layout: the site layout.
        shape: per-example site shape (``(d,)``, ``(T, d)`` or ``(C, H, W)``).
        verdict: the expected verdict, derived by hand (module docstring).
        n: number of probe examples (random probes).
        seed: seed of the random probe.
        gradient: ``"random"`` (Gaussian ``g``) or ``"orthogonal"`` (``g ⟂ T`` of the
            linear family, vector layout only).
        points: support of an exact finite measure on ``R^d`` (``None``: random probe).
        weights: positive integer weights of ``points``.
        m: the conditional activation gradient ``m(u)`` on the measure (symbolic grammar).
        tangent_rank: expected ``rank K`` when a closed form exists, else ``None``.
        tangent_dim: expected ``p`` when a closed form exists, else ``None``.
        realizable: ``m ∈ T`` by construction (exact cases): ``s = r`` and ``ρ = 0``.
    """

    name: str
    family: str
    layout: Layout
    shape: tuple[int, ...]
    verdict: Verdict
    n: int = 0
    seed: int = 0
    gradient: str = "random"
    points: tuple[tuple[int, ...], ...] | None = None
    weights: tuple[int, ...] | None = None
    m: str | None = None
    tangent_rank: int | None = None
    tangent_dim: int | None = None
    realizable: bool = False

    @property
    def exact(self) -> bool:
        """Whether the case carries an exact finite measure (symbolic engine applies)."""
        return self.points is not None


_SQUARE = ((1, 1), (1, -1), (-1, 1), (-1, -1))
_WEIGHTED = ((0, 1), (1, -1), (2, 3), (-1, 0), (1, 1))
_WEIGHTS = (1, 2, 3, 1, 1)

#: Exact finite-measure cases (numeric, dense and symbolic engines).
EXACT_CASES: list[Case] = [
    Case(
        "linear-square-saturated",
        "linear",
        Layout.VECTOR,
        (2,),
        Verdict.SATURATED,
        points=_SQUARE,
        weights=(1, 1, 1, 1),
        m="[u1*u2, u1*u2]",
        tangent_rank=6,
        tangent_dim=6,
    ),
    Case(
        "powers2-square-saturated",  # u² ≡ 1 on the square: rank Σ = 3 of k̃ = 5
        "powers:2",
        Layout.VECTOR,
        (2,),
        Verdict.SATURATED,
        points=_SQUARE,
        weights=(1, 1, 1, 1),
        m="[u1*u2, -u1*u2]",
        tangent_rank=6,
        tangent_dim=10,
    ),
    Case(
        "linear-weighted-improvable",
        "linear",
        Layout.VECTOR,
        (2,),
        Verdict.IMPROVABLE,
        points=_WEIGHTED,
        weights=_WEIGHTS,
        m="[u1**2 - u2, u1*u2 + 1]",
        tangent_rank=6,
        tangent_dim=6,
    ),
    Case(
        "powers2-weighted-realizable",  # m ∈ T: s = r > 0
        "powers:2",
        Layout.VECTOR,
        (2,),
        Verdict.IMPROVABLE,
        points=_WEIGHTED,
        weights=_WEIGHTS,
        m="[2*u1**2 - u2 + 1, u1 - 3*u2**2]",
        realizable=True,
    ),
    Case(
        "product-weighted-degenerate",
        "product:1",
        Layout.VECTOR,
        (2,),
        Verdict.DEGENERATE,
        points=_WEIGHTED,
        weights=_WEIGHTS,
        m="[u1, u2]",
        tangent_rank=0,
        tangent_dim=4,
    ),
]

#: Seeded random-probe cases (numeric and dense engines), one or more per layout.
RANDOM_CASES: list[Case] = [
    Case("linear-vector", "linear", Layout.VECTOR, (3,), Verdict.IMPROVABLE, n=16, tangent_rank=12, tangent_dim=12),
    Case(
        "linear-vector-orthogonal",
        "linear",
        Layout.VECTOR,
        (3,),
        Verdict.SATURATED,
        n=10,
        seed=1,
        gradient="orthogonal",
        tangent_rank=12,
        tangent_dim=12,
    ),
    Case(
        "linear-nobias-sequence",
        "linear-nobias",
        Layout.SEQUENCE,
        (4, 2),
        Verdict.IMPROVABLE,
        n=5,
        seed=2,
        tangent_rank=4,
        tangent_dim=4,
    ),
    Case(
        "linear-image",
        "linear",
        Layout.IMAGE,
        (2, 3, 3),
        Verdict.IMPROVABLE,
        n=4,
        seed=3,
        tangent_rank=6,
        tangent_dim=6,
    ),
    Case(
        "powers2-vector",
        "powers:2",
        Layout.VECTOR,
        (2,),
        Verdict.IMPROVABLE,
        n=20,
        seed=4,
        tangent_rank=10,
        tangent_dim=10,
    ),
    Case("relu4-vector", "relu:4", Layout.VECTOR, (3,), Verdict.IMPROVABLE, n=12, seed=5, tangent_dim=15),
    Case("tanh3-sequence", "tanh:3", Layout.SEQUENCE, (3, 2), Verdict.IMPROVABLE, n=4, seed=6, tangent_dim=8),
    Case(
        "product-vector-degenerate",
        "product:1",
        Layout.VECTOR,
        (3,),
        Verdict.DEGENERATE,
        n=8,
        seed=7,
        tangent_rank=0,
        tangent_dim=6,
    ),
]

CASES: list[Case] = RANDOM_CASES + EXACT_CASES
CASE_IDS: list[str] = [c.name for c in CASES]
EXACT_CASE_IDS: list[str] = [c.name for c in EXACT_CASES]

#: The engines answering a case: streaming statistics, dense ``torch.func`` Jacobian, sympy.
ENGINES: tuple[str, ...] = ("numeric", "dense", "symbolic")

#: CPU everywhere; CUDA too where a GPU exists (as the suite's ``device`` fixture).
DEVICES: list[str] = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _applies(engine: str, case: Case, device: str) -> bool:
    """The symbolic engine answers exact finite measures only, in exact (device-free) arithmetic."""
    return engine != "symbolic" or (case.exact and device == "cpu")


#: Every (engine, case, device) combination that applies: no test is generated only to be skipped.
ENGINE_CASES: list[tuple[str, Case, str]] = [
    (e, c, d) for e in ENGINES for c in CASES for d in DEVICES if _applies(e, c, d)
]
ENGINE_CASE_IDS: list[str] = [f"{e}-{c.name}-{d}" for e, c, d in ENGINE_CASES]
