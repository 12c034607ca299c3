"""Hypothesis strategies for property-testing residual families, probes and models.

These strategies draw the objects of theory/definitions.md at sizes small enough for dense
reference computations, so that users can property-test their own families against
the toolkit (and the toolkit against independent references):

* :func:`residual_families`: built-in families with small widths (linear, polynomial,
  random features, even features, pre-LN MLP; attention/conv for sequence/image
  layouts), the degenerate ``product:R``, and random polynomial
  :class:`~depthsat_theory.families.base.GeneralFamily` objects
  (:class:`PolynomialFamily`, whose tangent columns are known in closed form);
* :func:`finite_measures` / :func:`measures`: finite weighted point sets with integer
  multiplicities (:class:`FinitePointSet`; as a probe, its empirical measure *is* the
  population, so ``r̂`` and ``ρ̂`` are exact), or the symbolic engine's measures;
* :func:`probes`: float64 ``(z, g)`` with controllable rank and scale, including exact
  saturated probes (``g ⟂ T`` up to rounding) and realizable ones (``g ∈ T``);
* :func:`small_models`: tiny residual MLPs (:class:`SmallModel`) with named sites,
  built from a drawn seed.

``hypothesis`` is a test extra: ``pip install 'depthsat[test]'`` (or ``pip install
hypothesis``).  Importing this module without it raises :class:`ImportError` saying so.

Example — property-test your own family (a pytest file; runs in a few seconds)::

    import numpy as np
    import torch
    from hypothesis import given, settings
    from depthsat_theory import GeneralFamily, statistics_for
    from depthsat_theory.strategies import probes

    def my_fn(theta, u):                        # h(θ, u) = θ0 tanh(u) + θ1 u², rows u ∈ R^d
        return theta[0] * torch.tanh(u) + theta[1] * u * u

    my_family = GeneralFamily(my_fn, 2, name="mine")

    @settings(max_examples=25, deadline=None)
    @given(probes(d=3, n=12))
    def test_my_family(probe):
        z, g = probe
        zt = torch.from_numpy(z)
        # function preservation (def-family): h(0, u) = 0 on every unit
        assert my_family.functional(torch.zeros(2, dtype=torch.float64), zt, "vector").abs().max() == 0
        # the score never exceeds AG_rms (a projection is a contraction), AG_rms <= AG_max
        acc = statistics_for(my_family, (3,), "vector", pool_ties=True)
        acc.update(zt, torch.from_numpy(g))
        res = acc.result()
        assert res.score <= res.ag_rms * (1 + 1e-12) <= res.ag_max * (1 + 1e-12)

    @settings(max_examples=25, deadline=None)
    @given(probes(d=3, n=12, family=my_family, kind="saturated"))
    def test_my_family_saturated(probe):    # g ⟂ T by construction ⇒ s ≈ 0
        acc = statistics_for(my_family, (3,), "vector")
        acc.update(torch.from_numpy(probe.z), torch.from_numpy(probe.g))
        assert acc.result().saturated

Outside pytest, call ``test_my_family()`` directly: hypothesis runs the examples.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

try:
    import hypothesis.strategies as st
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "depthsat_theory.strategies needs hypothesis, a test extra: "
        "pip install 'depthsat[test]' (or: pip install hypothesis)"
    ) from exc

import numpy as np
import torch
from torch import Tensor, nn

from depthsat_theory.families import (
    GeneralFamily,
    ResidualFamily,
    causal_attention,
    conv1x1,
    conv3x3,
    even_features,
    linear,
    polynomial,
    preln_mlp,
    product,
    random_features,
)

__all__ = [
    "FinitePointSet",
    "PolynomialFamily",
    "Probe",
    "SmallModel",
    "finite_measures",
    "measures",
    "polynomial_families",
    "probes",
    "residual_families",
    "small_models",
    "tangent_jacobian",
]

_COEFS = (-2.0, -1.0, -0.5, 0.5, 1.0, 2.0)


def _value(x, draw):
    """An int/float argument or a strategy to draw it from."""
    return draw(x) if isinstance(x, st.SearchStrategy) else x


# ----------------------------------------------------------------------------- families
class PolynomialFamily(GeneralFamily):
    """A random elementwise polynomial family ``h(θ, u) = Σ_j c_j θ_{a_j}^{α_j} u^{β_j}``.

    Powers of ``u`` act elementwise on the row ``u ∈ R^d``; ``α_j ≥ 1``, so ``h(0, ·) ≡ 0``.
    Only terms with ``α_j = 1`` reach the tangent map: the column of ``θ_a`` is
    ``Σ_{j: a_j = a, α_j = 1} c_j u^{β_j}``, known in closed form (:meth:`tangent_columns`),
    which makes the family a fixture for independent checks.

    Attributes:
        terms: tuples ``(c, a, α, β)`` (coefficient, 0-based parameter index, parameter
            power, unit power).
        p: number of parameters.
    """

    def __init__(self, terms: list[tuple[float, int, int, int]], p: int):
        self.terms = [(float(c), int(a), int(al), int(be)) for c, a, al, be in terms]
        self.p = int(p)
        terms_ = self.terms

        def fn(theta: Tensor, u: Tensor) -> Tensor:
            out = torch.zeros_like(u)
            for c, a, al, be in terms_:
                out = out + c * theta[a] ** al * (u**be if be else torch.ones_like(u))
            return out

        super().__init__(fn, self.p, name=self.expression(), layouts=("vector", "sequence", "image"))

    def expression(self, d: int | None = None) -> str:
        """The family as text: elementwise in ``u`` (``d = None``) or a sympy vector in ``u1..ud``.

        With ``d`` the text is accepted by the symbolic engine's ``SymbolicFamily.parse``.

        Args:
            d: the unit dimension, or ``None`` for the elementwise form.

        Returns:
            The expression text in parameters ``t1..tp``.
        """

        def comp(u: str) -> str:
            parts = []
            for c, a, al, be in self.terms:
                t = f"t{a + 1}" + (f"**{al}" if al > 1 else "")
                x = "" if be == 0 else ("*" + u + (f"**{be}" if be > 1 else ""))
                parts.append(f"({c!r})*{t}{x}")
            return " + ".join(parts)

        if d is None:
            return comp("u")
        return "[" + ", ".join(comp(f"u{i}") for i in range(1, d + 1)) + "]"

    def tangent_columns(self, z: np.ndarray) -> np.ndarray:
        """The tangent Jacobian from the closed form: ``(z.size, p)`` float64 (rows = entries of ``z``).

        Args:
            z: the units (any shape; flattened).

        Returns:
            ``(z.size, p)`` float64: column ``a`` is ``Σ c u^β`` over the terms of ``θ_a`` with ``α = 1``.
        """
        flat = np.asarray(z, dtype=np.float64).reshape(-1)
        cols = np.zeros((flat.size, self.p))
        for c, a, al, be in self.terms:
            if al == 1:
                cols[:, a] += c * flat**be
        return cols


@st.composite
def polynomial_families(draw, *, max_terms: int = 4, max_params: int = 3) -> PolynomialFamily:
    """Random :class:`PolynomialFamily` objects (general families for the ``torch.func`` path).

    Args:
        draw: Hypothesis' draw function, supplied by ``st.composite`` (callers omit it).
        max_terms: largest number of terms.
        max_params: largest number of parameters ``p`` (every parameter appears).
    """
    p = draw(st.integers(1, max_params))
    n_terms = draw(st.integers(p, max(p, max_terms)))
    terms = []
    for j in range(n_terms):
        a = j if j < p else draw(st.integers(0, p - 1))
        terms.append((draw(st.sampled_from(_COEFS)), a, draw(st.sampled_from((1, 1, 2))), draw(st.integers(0, 3))))
    return PolynomialFamily(terms, p)


def residual_families(
    *, layout: str = "vector", max_width: int = 6, degenerate: bool = True, general: bool = True
) -> st.SearchStrategy[ResidualFamily]:
    """Residual families that fit a ``layout`` site, with small widths.

    Args:
        layout: ``"vector"``, ``"sequence"`` (adds causal attention) or ``"image"``
            (adds ``conv1x1``, ``conv3x3``).
        max_width: largest feature width ``K`` of random-feature families.
        degenerate: include ``product:R`` (``T = {0}``: reported degenerate, T4).
        general: include random :func:`polynomial_families`.

    Returns:
        A strategy of :class:`~depthsat_theory.families.base.ResidualFamily` instances.
    """
    width = st.integers(1, max_width)
    seed = st.integers(0, 3)
    opts: list[st.SearchStrategy[ResidualFamily]] = [
        st.sampled_from([linear(), linear(bias=False), even_features("abs"), even_features("square")]),
        st.integers(1, 3).map(polynomial),
        st.builds(lambda k, act, s: random_features(k, act, s), width, st.sampled_from(("relu", "gelu", "tanh")), seed),
        st.builds(preln_mlp, width, seed),
    ]
    if layout == "sequence":
        opts.append(st.builds(lambda k, s: causal_attention(k, heads=1, seed=s), width, seed))
    if layout == "image":
        opts.append(st.just(conv1x1()))
        opts.append(st.builds(conv3x3, width, seed))
    if degenerate:
        opts.append(st.integers(1, 2).map(product))
    if general:
        opts.append(polynomial_families())
    return st.one_of(*opts)


# ----------------------------------------------------------------------------- measures
@dataclass
class FinitePointSet:
    """A finite measure on ``R^d`` with integer multiplicities: ``μ = Σ_i (c_i / Σc) δ_{x_i}``.

    Atoms are distinct multiples of ``1/8`` (exact in binary, so the symbolic
    conversion is exact).  :meth:`units` repeats each atom ``c_i`` times: a probe on
    those rows has *exactly* this measure as its empirical measure, so the pooled
    ``r̂`` and ``ρ̂`` of :mod:`depthsat_theory.statistics` are the population values.

    Attributes:
        points: ``(m, d)`` float64 distinct atoms.
        counts: ``(m,)`` int multiplicities ``≥ 1``.
    """

    points: np.ndarray
    counts: np.ndarray

    @property
    def d(self) -> int:
        """Dimension ``d`` of the atoms (``points.shape[1]``)."""
        return int(self.points.shape[1])

    @property
    def weights(self) -> np.ndarray:
        """Probabilities ``c_i / Σ c`` (float64)."""
        return self.counts / self.counts.sum()

    def units(self) -> np.ndarray:
        """The atoms repeated by multiplicity: ``(Σ c, d)`` float64 (a probe's rows).

        Returns:
            ``(Σ c, d)`` float64.
        """
        return np.repeat(self.points, self.counts, axis=0)

    def expect(self, f: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """``E_μ f = Σ_i w_i f(x_i)`` for ``f`` mapping ``(m, d)`` rows to ``(m, …)``.

        Args:
            f: a function of the ``(m, d)`` atoms, returning ``(m, …)``.

        Returns:
            ``Σ_i w_i f(x_i)`` as float64, shape ``(…)``.
        """
        vals = np.asarray(f(self.points), dtype=np.float64)
        return np.tensordot(self.weights, vals, axes=(0, 0))

    def to_symbolic(self):
        """The symbolic engine's exact ``FiniteMeasure`` (requires ``depthsat_theory.engines.symbolic``).

        Returns:
            A ``FiniteMeasure`` on the atoms with the integer counts as masses.
        """
        from depthsat_theory.engines.symbolic.measures import FiniteMeasure

        return FiniteMeasure([list(p) for p in self.points.tolist()], [int(c) for c in self.counts])


@st.composite
def finite_measures(
    draw, d: int | st.SearchStrategy[int] = 2, *, max_atoms: int = 6, max_count: int = 4
) -> FinitePointSet:
    """Finite weighted point sets (:class:`FinitePointSet`) in ``R^d``.

    Args:
        draw: Hypothesis' draw function, supplied by ``st.composite`` (callers omit it).
        d: dimension (an int or a strategy).
        max_atoms: largest number of distinct atoms.
        max_count: largest multiplicity of an atom.
    """
    dim = int(_value(d, draw))
    m = draw(st.integers(1, max_atoms))
    grid = st.integers(-16, 16).map(lambda k: k / 8.0)
    pts = draw(st.lists(st.tuples(*[grid] * dim), min_size=m, max_size=m, unique=True))
    counts = draw(st.lists(st.integers(1, max_count), min_size=m, max_size=m))
    return FinitePointSet(np.array(pts, dtype=np.float64).reshape(m, dim), np.array(counts, dtype=np.int64))


def measures(d: int | st.SearchStrategy[int] | None = None, *, symbolic: bool = False) -> st.SearchStrategy:
    """Unit measures: :class:`FinitePointSet` objects, or the symbolic engine's measures.

    Args:
        d: dimension (default: drawn from 1..3).
        symbolic: draw ``depthsat_theory.engines.symbolic`` measures instead: exact
            ``FiniteMeasure`` objects, and ``ProductMeasure`` objects of independent
            ``Normal(μ, σ)`` / ``Uniform(a, b)`` coordinates with small integer
            parameters.

    Returns:
        A hypothesis strategy of measures.

    Raises:
        ImportError: if ``symbolic`` and the symbolic engine is missing.
    """
    dims = st.integers(1, 3) if d is None else (d if isinstance(d, st.SearchStrategy) else st.just(d))
    if not symbolic:
        return dims.flatmap(lambda k: finite_measures(k))
    from depthsat_theory.engines.symbolic.measures import ProductMeasure  # noqa: F401 - fail early without the engine

    return dims.flatmap(lambda k: st.one_of(finite_measures(k).map(FinitePointSet.to_symbolic), _product_measures(k)))


@st.composite
def _product_measures(draw, d: int):
    import sympy.stats as sps

    from depthsat_theory.engines.symbolic.measures import ProductMeasure

    rvs = []
    for i in range(d):
        if draw(st.booleans()):
            rvs.append(sps.Normal(f"X{i + 1}", draw(st.integers(-1, 1)), draw(st.integers(1, 2))))
        else:
            a = draw(st.integers(-2, 0))
            rvs.append(sps.Uniform(f"X{i + 1}", a, a + draw(st.integers(1, 3))))
    return ProductMeasure(rvs)


# ----------------------------------------------------------------------------- probes
class Probe(NamedTuple):
    """A probe: site activations ``z`` and activation gradients ``g``, float64 ``(n, d)``."""

    z: np.ndarray
    g: np.ndarray


def tangent_jacobian(family: ResidualFamily, z: np.ndarray, layout: str = "vector") -> np.ndarray:
    """The family's tangent Jacobian on ``z`` by forward-mode ``torch.func``: ``(z.size, p)`` float64.

    Args:
        family: the family.
        z: site tensors ``(B, *shape)`` (converted to float64).
        layout: the site's layout.

    Returns:
        ``∂ vec h(θ, z)/∂θ`` at ``θ = 0``, ``(z.size, p)`` float64.
    """
    zt = torch.from_numpy(np.ascontiguousarray(z, dtype=np.float64))
    p = family.param_dim(tuple(zt.shape[1:]))
    theta0 = torch.zeros(p, dtype=torch.float64)
    with torch.no_grad():  # build lazily created feature maps outside vmap (they draw random inits)
        family.functional(theta0, zt, layout)
    jac = torch.func.jacfwd(lambda th: family.functional(th, zt, layout))(theta0)
    return jac.reshape(-1, p).detach().numpy()


@st.composite
def probes(
    draw,
    d: int | st.SearchStrategy[int] = 3,
    n: int | st.SearchStrategy[int] = 16,
    *,
    rank: int | st.SearchStrategy[int] | None = None,
    z_scale: float | st.SearchStrategy[float] | None = None,
    g_scale: float | st.SearchStrategy[float] | None = None,
    family: ResidualFamily | None = None,
    kind: str = "generic",
) -> Probe:
    """Float64 probes ``(z, g)`` of ``n`` rows in ``R^d`` (vector sites).

    Args:
        draw: Hypothesis' draw function, supplied by ``st.composite`` (callers omit it).
        d: dimension (an int or a strategy).
        n: number of rows (an int or a strategy).
        rank: rank of ``z`` (``z = B C`` with ``B ∈ R^{n×r}``, ``C ∈ R^{r×d}``; default
            generic full rank).
        z_scale: multiplier of ``z`` (a float or a strategy; default: drawn from ``{1e-2, 1, 1e2}``).
        g_scale: multiplier of ``g`` (a float or a strategy; default: drawn from ``{1e-2, 1, 1e2}``).
        family: the family for ``kind="saturated"`` / ``"realizable"``.
        kind: ``"generic"`` (``g`` standard normal), ``"saturated"`` (``g ⟂ T`` on the
            probe: a random ``g`` minus its projection onto the span of the family's
            column-scaled tangent Jacobian, singular values above ``1e-10 σ_max``, so
            ``s`` is zero up to rounding, T2), ``"realizable"``
            (``g = A v ∈ T``, so ``s = AG_rms`` and the raw-gradient certificate is exact,
            T6), or ``"any"`` (one of the three).

    Returns:
        A :class:`Probe` (unpacks as ``z, g``).

    Raises:
        ValueError: on an unknown ``kind`` or a missing ``family``.
    """
    kinds = ("generic", "saturated", "realizable")
    if kind == "any":
        kind = draw(st.sampled_from(kinds if family is not None else ("generic",)))
    if kind not in kinds:
        raise ValueError(f"kind must be one of {kinds} or 'any', got {kind!r}")
    if kind != "generic" and family is None:
        raise ValueError(f"kind={kind!r} needs a family")
    d, n = int(_value(d, draw)), int(_value(n, draw))
    scales = st.sampled_from((1e-2, 1.0, 1e2))
    zs = float(_value(z_scale if z_scale is not None else scales, draw))
    gs = float(_value(g_scale if g_scale is not None else scales, draw))
    r = None if rank is None else int(_value(rank, draw))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if r is None:
        z = rng.normal(size=(n, d))
    else:
        z = rng.normal(size=(n, r)) @ rng.normal(size=(r, d)) / math.sqrt(max(r, 1))
    z = z * zs
    g = rng.normal(size=(n, d))
    if kind != "generic":
        assert family is not None  # checked above
        a = tangent_jacobian(family, z)
        if kind == "saturated":  # remove every direction of the column-scaled A that float64 resolves
            norms = np.linalg.norm(a, axis=0)
            live = norms > 0
            gv = g.reshape(-1)
            if live.any():
                u, sv, _ = np.linalg.svd(a[:, live] / norms[live], full_matrices=False)
                u = u[:, sv > 1e-15 * sv[0]]  # the engine keeps amplitudes down to ~1e-15 (theory/numerics.md)
                before = float(np.linalg.norm(gv))
                gv = gv - u @ (u.T @ gv)
                gv = gv - u @ (u.T @ gv)  # second pass: orthogonal to rounding level
                if float(np.linalg.norm(gv)) <= 1e-12 * before:  # T spans every field on this probe: g ⟂ T is 0
                    gv = np.zeros_like(gv)
            g = gv.reshape(n, d)
        else:
            g = (a @ rng.normal(size=a.shape[1])).reshape(n, d)
            norm = math.sqrt(float((g * g).sum()) / n)
            g = g / norm if norm > 0 else g
    return Probe(np.ascontiguousarray(z), np.ascontiguousarray(g * gs))


# ----------------------------------------------------------------------------- models
@dataclass
class SmallModel:
    """A tiny float64 residual MLP with its probe batch (drawn by :func:`small_models`).

    Attributes:
        model: :class:`~depthsat_theory.tasks.models.ResidualMLP` in float64, eval mode.
        sites: site names in depth order (``["embed", "blocks.0", …]``).
        inputs: ``(n, in_dim)`` float64; ``targets``: ``(n,)`` long labels.
        loss: per-example cross-entropy ``loss(logits, y) -> (n,)``.
        layout: ``"vector"``; ``width``: site dimension ``d``; ``seed``: the drawn seed.
    """

    model: nn.Module = field(repr=False)
    sites: list
    inputs: Tensor = field(repr=False)
    targets: Tensor = field(repr=False)
    loss: Callable[[Tensor, Tensor], Tensor] = field(repr=False)
    width: int = 0
    seed: int = 0
    layout: str = "vector"
    config: dict = field(default_factory=dict)


@st.composite
def small_models(draw, *, max_width: int = 6, max_depth: int = 3, max_n: int = 24) -> SmallModel:
    """Tiny residual MLPs with named sites, deterministic in a drawn seed.

    Args:
        draw: Hypothesis' draw function, supplied by ``st.composite`` (callers omit it).
        max_width: largest stream width ``d``.
        max_depth: largest number of residual blocks.
        max_n: largest probe size.
    """
    from depthsat_theory.tasks import ResidualMLP, classification_loss

    seed = draw(st.integers(0, 2**31 - 1))
    cfg: dict[str, Any] = {
        "in_dim": draw(st.integers(2, 5)),
        "width": draw(st.integers(2, max_width)),
        "depth": draw(st.integers(1, max_depth)),
        "n_classes": draw(st.integers(2, 4)),
        "activation": draw(st.sampled_from(("gelu", "tanh", "relu"))),
    }
    n = draw(st.integers(4, max_n))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ResidualMLP(**cfg).to(torch.float64).eval()
        inputs = torch.randn(n, cfg["in_dim"], dtype=torch.float64)
        targets = torch.randint(0, cfg["n_classes"], (n,))
    return SmallModel(
        model=model,
        sites=model.site_names(),
        inputs=inputs,
        targets=targets,
        loss=classification_loss,
        width=cfg["width"],
        seed=seed,
        config=cfg,
    )
