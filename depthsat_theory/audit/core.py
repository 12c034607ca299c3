"""Audit a residual family: function preservation, tangent rank, regularity, certificates.

:func:`audit_family` answers, for one residual family on one probe ``(z, g)``
(activations and per-example activation gradients at a site), the questions a user
asks before trusting a saturation score:

1. **Function preservation** (``def-family``): is ``h(0, u) = 0`` on every probe
   unit?  Measured as ``max |h(0, z)|`` over the probe (and, for a model site, as the
   max deviation of the model's output after inserting the block,
   :func:`~depthsat_theory.capture.sites.check_function_preserving`); for sympy families the
   symbolic engine's exact verdict on ``h(0, u) ≡ 0`` counts too (a residual that
   vanishes on the probe but not identically is caught).  A family that is not
   function-preserving is rejected (:class:`~depthsat_theory.capture.sites.NotFunctionPreservingError`).
2. **Tangent space** (``def-tangent``): ``p`` tangent coordinates and the numerical
   rank of ``K = E[AᵀA]`` on the probe's units; ``rank K = 0`` is *degenerate*
   (``T = {0}``, T4), reported apart from saturation.
3. **Regularity of the parameterization** (``thm-reparameterization``, T4).  On the
   probe, the parameterization is called *regular* when the tangent map
   ``v ↦ A v`` is injective, i.e. ``rank K = p``: every parameter direction moves
   ``h`` at first order, so locally ``θ`` is identifiable to first order and any
   reparameterization ``θ = χ(ξ)`` with ``Dχ(0)`` invertible keeps ``T``, ``Π`` and
   ``s`` (T4).  ``parameter_redundancy = p − rank K`` counts the first-order
   redundant directions (zero tangent columns, such as ``θ = ξ ⊙ ξ`` coordinates,
   plus linear dependencies such as ``t1·u + t2·u``); ``T``, ``Π`` and ``s`` do not
   depend on them, the gradient ``b`` and optimizer steps do.  The rank is computed
   twice: by the statistics (eigendecomposition of the diagonally scaled ``K``) and
   independently by an SVD of the diagonally scaled tangent Jacobian ``A`` (features
   ``Φ̃`` for feature families), with the same relative cutoff; disagreement means a
   singular value sits at the cutoff (numerically ambiguous rank).  For sympy families
   the engine's function-space rank of ``A`` (generic units, no probe) is reported as
   well; the parameterization is symbolically regular when it equals ``p``, and a
   probe rank below it means the probe does not separate the tangent directions.
4. **Realizability** (``thm-realizability``, T6): the defect
   ``ρ̂ = ‖m̂ − Π m̂‖ / ‖m̂‖`` with ``m̂`` pooling exactly equal units.  It is exact on
   finite/discrete populations and **biased upward for continuous units** (then
   ``m̂ = g`` and ``r̂ = AG_rms``), so a positive ``ρ̂`` on a continuous probe does not
   prove a positive population defect.
5. **Raw-gradient certificate**: ``AG_max = 0 ⇒ saturated`` always holds.  It is
   *exact* on the probe (``AG_max = 0 ⇔ saturated``) when ``g`` lies in ``T`` there:
   ``g = m̂`` (no within-tie variation of ``g``) and ``ρ̂ = 0``, both up to
   ``defect_rtol`` (relative to ``AG_rms``; default ``max(1e-8, 100 ε(dtype))``,
   the resolution of a Gram-based float64 projection).  Then ``s = r̂ = AG_rms``
   (T6).  Otherwise it is *conservative only*: ``AG_max > 0`` does not imply
   improvable.  For a degenerate family it is *not applicable*.
6. **Score**: ``s``, ``s / AG_rms`` and the verdict *saturated* (``s ≤ tol``),
   *improvable* or *degenerate*.

:func:`load_family` resolves the three ways of naming a family (see its docstring),
:func:`synthetic_probe` builds the documented default probe, and :func:`audit_model`
audits a family at a site of a torch model (a task from
:func:`~depthsat_theory.tasks.training.trained_task`).

Example::

    from depthsat_theory.audit.core import audit_family, load_family, synthetic_probe
    fam = load_family("poly:2")
    z, g, layout, label = synthetic_probe(fam.family)
    report = audit_family(fam, z, g, layout=layout, probe=label)
    print(report.status, report.tangent_rank, report.regular, report.ag_certificate)
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from depthsat_theory.capture import (
    NotFunctionPreservingError,
    SiteError,
    accumulate,
    check_function_preserving,
    insert_block,
)
from depthsat_theory.families import FamilyError, FeatureFamily, ResidualFamily, parse_family, to_rows
from depthsat_theory.statistics import StatisticsError, statistics_for

__all__ = [
    "JACOBIAN_BUDGET",
    "SYNTHETIC_PROBE",
    "AuditError",
    "AuditReport",
    "LoadedFamily",
    "audit_family",
    "audit_model",
    "load_family",
    "report_table",
    "synthetic_probe",
]

#: Description of the default probe (see :func:`synthetic_probe`).
SYNTHETIC_PROBE = (
    "synthetic probe (seed 0, float64): units u ~ N(0, I_d), d = 8 unless the family fixes d; "
    "g(u) = tanh(Ω₁u + β)·Ω₂ᵀ row-wise with Ω₁ ∈ R^(16×d) ~ N(0, 1/d), β ~ N(0, 1/4), "
    "Ω₂ ∈ R^(d×16) ~ N(0, 1/16); vector sites: n = 256 rows; sequence sites: 32 × 8 tokens; "
    "image sites: 32 × d × 4 × 4"
)

#: Largest tangent Jacobian (entries) formed for the independent rank check of a
#: general family; larger probes use their first examples only (a lower bound).
JACOBIAN_BUDGET = 1 << 23

_BUILTIN_NAMES = (
    "linear",
    "linear-nobias",
    "poly",
    "relu",
    "gelu",
    "tanh",
    "even",
    "preln",
    "conv1x1",
    "conv3x3",
    "attention",
    "product",
)
_MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")
_SYMBOL_RE = re.compile(r"(?<![A-Za-z0-9_])[ut][0-9]+(?![A-Za-z0-9_])")


class AuditError(ValueError):
    """Bad input to an audit (a family that cannot be loaded, a wrong site, …)."""


# ----------------------------------------------------------------------------- loading
@dataclass
class LoadedFamily:
    """A residual family resolved from text by :func:`load_family`.

    Attributes:
        family: the numeric family (a :class:`~depthsat_theory.families.base.ResidualFamily`).
        source: ``"builtin"``, ``"module"`` or ``"sympy"``.
        text: the text it was loaded from.
        symbolic: the symbolic family (``source == "sympy"``), else ``None``.
        d: the unit dimension the family fixes (sympy expressions), else ``None``.
    """

    family: ResidualFamily
    source: str
    text: str
    symbolic: Any = None
    d: int | None = None


def load_family(text: str, *, d: int | None = None) -> LoadedFamily:
    """Resolve a family given as a built-in spec, a ``module:attr`` path or a sympy expression.

    Rules, in this order:

    1. a built-in spec accepted by :func:`~depthsat_theory.families.base.parse_family`
       (``linear``, ``poly:2``, ``relu:64:1``, ``product:2``, …);
    2. ``sympy:EXPR``: a sympy expression (explicit);
    3. ``package.module:attr`` (dotted identifiers, one colon): a user family, imported
       with :func:`importlib.import_module` from ``sys.path`` (nothing else is
       imported); ``attr`` must be a
       :class:`~depthsat_theory.families.base.ResidualFamily` instance, or a zero-argument
       callable (a factory or a class) returning one;
    4. text containing symbols ``u1, u2, …`` or ``t1, t2, …``: a sympy expression in
       units ``u1..ud`` and parameters ``t1..tp``, e.g. ``"t1*u1 + t2*u1**3"`` or
       ``"[t1*u1 + t2, t3*u2]"`` (one component per unit coordinate).

    A text whose head is a built-in family name (``relu:abc``) is reported as a bad
    built-in spec, never imported.

    Args:
        text: the family text.
        d: unit dimension for sympy expressions (default: inferred from the largest
            ``u`` index).

    Returns:
        A :class:`LoadedFamily`.

    Raises:
        AuditError: on text that fits none of the rules, a module that does not exist or
            fails to import, a missing attribute, or an attribute of the wrong type.
        FamilyError: on a malformed built-in spec or an unparsable sympy expression.
    """
    raw = text.strip()
    if not raw:
        raise AuditError("empty family text; " + _FORMS)
    try:
        return LoadedFamily(parse_family(raw), "builtin", raw)
    except FamilyError as exc:
        builtin_error = exc
    if raw.lower().startswith("sympy:"):
        return _load_sympy(raw[len("sympy:") :].strip(), raw, d)
    head = raw.split(":", 1)[0].strip().lower()
    if ":" in raw and head in _BUILTIN_NAMES:
        raise builtin_error
    if _MODULE_RE.fullmatch(raw):
        return _load_module(raw)
    if _SYMBOL_RE.search(raw):
        return _load_sympy(raw, raw, d)
    hint = ""
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+", raw):
        hint = f" (to load a user family write 'module:attr' with a colon, e.g. {raw.rpartition('.')[0]}:{raw.rpartition('.')[2]})"
    raise AuditError(f"cannot interpret {text!r} as a residual family{hint}; {_FORMS}")


_FORMS = (
    "give a built-in spec (linear, poly:D, relu:K[:SEED], … product:R), a user family "
    "'module:attr', or a sympy expression in units u1..ud and parameters t1..tp "
    "(optionally prefixed 'sympy:')"
)


def _load_module(text: str) -> LoadedFamily:
    modname, attr = text.split(":")
    try:
        module = importlib.import_module(modname)
    except ModuleNotFoundError as exc:
        if exc.name and (modname == exc.name or modname.startswith(exc.name + ".")):
            raise AuditError(
                f"user family {text!r}: no module named {exc.name!r} on the Python "
                f"path (run from its folder or add it to PYTHONPATH)"
            ) from None
        raise AuditError(
            f"user family {text!r}: importing module {modname!r} failed (ModuleNotFoundError: {exc})"
        ) from None
    except Exception as exc:
        raise AuditError(
            f"user family {text!r}: importing module {modname!r} raised {type(exc).__name__}: {exc}"
        ) from None
    if not hasattr(module, attr):
        public = sorted(n for n in vars(module) if not n.startswith("_"))[:10]
        raise AuditError(
            f"user family {text!r}: module {modname!r} has no attribute {attr!r} "
            f"(public names: {', '.join(public) or 'none'})"
        )
    obj = getattr(module, attr)
    if isinstance(obj, ResidualFamily):
        return LoadedFamily(obj, "module", text)
    if not callable(obj):
        raise AuditError(
            f"user family {text!r}: {attr!r} is a {type(obj).__name__}, expected a "
            f"depthsat_theory ResidualFamily instance or a zero-argument factory "
            f"returning one"
        )
    if inspect.isclass(obj) and inspect.isabstract(obj):
        raise AuditError(f"user family {text!r}: {attr!r} is an abstract class; give an instance or a factory")
    try:
        made = obj()
    except Exception as exc:
        raise AuditError(
            f"user family {text!r}: calling {attr}() with no arguments raised {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(made, ResidualFamily):
        raise AuditError(
            f"user family {text!r}: {attr}() returned a {type(made).__name__}, expected "
            f"a depthsat_theory ResidualFamily (e.g. GeneralFamily(fn, p))"
        )
    return LoadedFamily(made, "module", text)


_SYMBOLIC_NAMES = ("SymbolicFamily", "to_general_family", "is_function_preserving", "tangent_rank", "is_degenerate")


def _symbolic_module():
    """The symbolic engine :mod:`depthsat_theory.engines.symbolic` (parser, bridge, exact verdicts)."""
    try:
        sym = importlib.import_module("depthsat_theory.engines.symbolic")
    except ImportError as exc:
        raise AuditError(
            f"sympy families need the symbolic engine depthsat_theory.engines.symbolic, which is not available ({exc})"
        ) from None
    missing = [a for a in _SYMBOLIC_NAMES if not hasattr(sym, a)]
    if missing:
        raise AuditError(f"the symbolic engine lacks {', '.join(missing)}; sympy families cannot be audited")
    return sym


def _load_sympy(expr: str, text: str, d: int | None) -> LoadedFamily:
    sym = _symbolic_module()
    if not expr:
        raise FamilyError(f"empty sympy expression in {text!r}")
    fam = sym.SymbolicFamily.parse(expr, d=d)
    return LoadedFamily(sym.to_general_family(fam), "sympy", text, symbolic=fam, d=int(fam.d))


# ----------------------------------------------------------------------------- probes
def synthetic_probe(
    family: ResidualFamily | LoadedFamily | None = None, *, d: int | None = None, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, str, str]:
    """The documented default probe (:data:`SYNTHETIC_PROBE`).

    Units are standard normal; ``g`` is a fixed smooth random function of each row, so
    ``g`` is a function of the unit (``g = m``) and realizability is a property of
    the family.  The layout is the first of ``vector``, ``sequence``, ``image`` the
    family fits.

    Args:
        family: the family (fixes the layout and, for sympy families, ``d``).
        d: unit dimension (default: the family's, else 8).
        seed: numpy seed.

    Returns:
        ``(z, g, layout, label)``: float64 arrays ``(256, d)``, ``(32, 8, d)`` or
        ``(32, d, 4, 4)``, the layout and a one-line description.
    """
    loaded = family if isinstance(family, LoadedFamily) else None
    fam = loaded.family if loaded else family
    d = int(d or (loaded.d if loaded and loaded.d else 8))
    layouts = getattr(fam, "layouts", ("vector",)) if fam is not None else ("vector",)
    layout = next((lay for lay in ("vector", "sequence", "image") if lay in layouts), "vector")
    rng = np.random.default_rng(seed)
    w1 = rng.normal(size=(16, d)) / math.sqrt(d)
    beta = rng.normal(size=16) * 0.5
    w2 = rng.normal(size=(d, 16)) / 4.0
    shape = {"vector": (256, d), "sequence": (32, 8, d), "image": (32, d, 4, 4)}[layout]
    z = rng.normal(size=shape)
    rows = np.moveaxis(z, 1, -1) if layout == "image" else z
    grows = np.tanh(rows @ w1.T + beta) @ w2.T
    g = np.ascontiguousarray(np.moveaxis(grows, -1, 1) if layout == "image" else grows)
    label = f"{SYNTHETIC_PROBE} (here: {layout}, shape {shape})"
    return z, g, layout, label


# ----------------------------------------------------------------------------- report
@dataclass
class AuditReport:
    """What :func:`audit_family` found (all norms in the probe's empirical measure).

    Attributes:
        family: family spec/name; ``source``: ``"builtin"``, ``"module"``, ``"sympy"``
            or ``"object"``; ``text``: the text it was loaded from (if any).
        probe: description of the probe; ``layout``; ``shape`` (per example);
            ``n`` examples; ``units``: rows (row-wise families) or examples (``unit =
            "tensor"``); ``distinct_units`` after pooling exactly equal units;
            ``dtype`` of the probe.
        function_preserving: ``max_deviation == 0`` (and ``model_deviation == 0``).
        max_deviation: ``max |h(0, z)|`` over the probe (``def-family``).
        model_deviation: max deviation of the model output after insertion (model
            audits), else ``None``.
        tangent_dim: ``p``, the number of tangent coordinates.
        tangent_rank: numerical rank of ``K`` (statistics: eigh of the scaled ``K``).
        rank_check: the same rank from an SVD of the scaled tangent Jacobian (or
            ``Φ̃``); ``rank_check_method`` says how; ``rank_agrees``.
        zero_tangent_columns: coordinates whose tangent column vanishes on the probe.
        parameter_redundancy: ``p − tangent_rank``.
        regular: ``tangent_rank == p`` (T4, see the module docstring).
        parameterization: ``"regular"``, ``"redundant"`` or ``"degenerate"``.
        degenerate: ``tangent_rank == 0``; ``rank_deficient``: ``tangent_rank < p``.
        realizability_defect: ``ρ̂`` (``None`` if ``m̂ = 0``); ``noise``:
            ``‖g − m̂‖ / AG_rms`` (within-tie variation of ``g``); ``defect_rtol``.
        ag_certificate: ``"exact"``, ``"conservative only"`` or ``"not applicable
            (degenerate)"``.
        score, relative_score, raw_score, ag_rms, ag_max, tol, activation_scaled_score:
            the saturation quantities (:class:`~depthsat_theory.statistics.tangent.SaturationResult`).
        status: ``"saturated"``, ``"improvable"`` or ``"degenerate"``.
        gradient_check: model audits: ``max |b_autograd − b_statistics| / max |b|`` (T1).
        symbolic: sympy families: the symbolic engine's verdicts, else ``None``.
        notes: caveats to print with the report.
    """

    family: str
    source: str
    text: str
    probe: str
    layout: str
    shape: list
    n: int
    units: int
    distinct_units: int
    dtype: str
    function_preserving: bool
    max_deviation: float
    model_deviation: float | None
    tangent_dim: int
    tangent_rank: int
    rank_check: int | None
    rank_check_method: str
    rank_agrees: bool | None
    zero_tangent_columns: int
    parameter_redundancy: int
    regular: bool
    parameterization: str
    degenerate: bool
    rank_deficient: bool
    realizability_defect: float | None
    noise: float | None
    defect_rtol: float
    ag_certificate: str
    score: float
    relative_score: float | None
    raw_score: float | None
    ag_rms: float
    ag_max: float
    tol: float
    activation_scaled_score: float
    rtol: float
    status: str
    gradient_check: float | None = None
    symbolic: dict | None = None
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready dictionary (``nan`` and ``inf`` become ``None``/strings)."""
        return _jsonable(asdict(self))


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.floating, np.integer, np.bool_)):
        obj = obj.item()
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
    return obj


# ----------------------------------------------------------------------------- audit
def _layout_for(ndim: int) -> str:
    try:
        return {2: "vector", 3: "sequence", 4: "image"}[ndim]
    except KeyError:
        raise AuditError(
            f"probe tensors must have 2 (n × d), 3 (n × T × d) or 4 (n × C × H × W) dimensions, got {ndim}"
        ) from None


def _as_tensor(x, name: str) -> Tensor:
    t = x.detach() if isinstance(x, Tensor) else torch.from_numpy(np.asarray(x))
    if not torch.is_floating_point(t):
        raise StatisticsError(f"{name} must be float32 or float64, got {t.dtype}")
    return t.cpu()


def _guard(spec: str, what: str, fn: Callable):
    """Run user-reachable family code; turn unexpected exceptions into one-line errors."""
    try:
        return fn()
    except (FamilyError, StatisticsError, AuditError, NotFunctionPreservingError, SiteError):
        raise
    except Exception as exc:
        raise FamilyError(f"family {spec!r} failed while {what}: {type(exc).__name__}: {exc}") from None


def _deviation(family: ResidualFamily, z64: Tensor, layout: str) -> float:
    p = family.param_dim(tuple(z64.shape[1:]))
    with torch.no_grad():
        out = family.functional(torch.zeros(p, dtype=torch.float64), z64, layout)
    if not isinstance(out, Tensor) or out.shape != z64.shape:
        shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise FamilyError(
            f"family {family.spec!r} returned {shape} for site tensors of shape "
            f"{tuple(z64.shape)}; a residual block must preserve the shape"
        )
    if out.numel() == 0:
        return 0.0
    dev = float(out.abs().max())
    return math.inf if math.isnan(dev) else dev


def _scaled_rank(mat: np.ndarray, rtol: float) -> int:
    """Rank of ``mat`` with unit-norm columns: ``#{σ² > rtol σ_max²}`` (SVD, zero columns dropped)."""
    norms = np.sqrt((mat * mat).sum(axis=0))
    live = norms > 0
    if not live.any():
        return 0
    sv = np.linalg.svd(mat[:, live] / norms[live], compute_uv=False)
    return int((sv * sv > rtol * sv[0] * sv[0]).sum())


def _independent_rank(family: ResidualFamily, z64: Tensor, layout: str, rtol: float, stats) -> tuple[int, str, int]:
    """``(rank, method, zero columns)`` of the tangent map on the probe, not via ``K``."""
    shape = tuple(z64.shape[1:])
    if isinstance(family, FeatureFamily):
        fmap = family.frozen_feature_map(shape, layout)
        with torch.no_grad():
            phi = family.augmented_features(fmap, z64).reshape(-1, stats.k).numpy()
        d = stats.d
        zero = int(d * (np.abs(phi).sum(axis=0) == 0).sum())
        return d * _scaled_rank(phi, rtol), "d · rank Φ̃ (SVD of the column-scaled feature matrix)", zero
    p = family.param_dim(shape)
    per_example = max(int(np.prod(shape)) * p, 1)
    m = max(1, min(z64.shape[0], JACOBIAN_BUDGET // per_example))
    theta0 = torch.zeros(p, dtype=torch.float64)
    sub = z64[:m]
    jac = torch.func.jacfwd(lambda th: family.functional(th, sub, layout))(theta0)
    a = jac.reshape(-1, p).detach().numpy()
    zero = int((np.abs(a).sum(axis=0) == 0).sum()) if m == z64.shape[0] else -1
    method = "SVD of the column-scaled tangent Jacobian A"
    if m < z64.shape[0]:
        method += f" on the first {m} of {z64.shape[0]} examples (a lower bound)"
    return _scaled_rank(a, rtol), method, zero


def _tie_noise(family: ResidualFamily, z: np.ndarray, g: np.ndarray, layout: str) -> tuple[float, int, int]:
    """``(‖g − m̂‖², distinct units, units)`` with ``m̂`` pooling exactly equal units (per example mass)."""
    if family.unit == "row":
        zu = to_rows(torch.from_numpy(z), layout).reshape(-1, _row_dim(z, layout)).numpy()
        gu = to_rows(torch.from_numpy(g), layout).reshape(zu.shape[0], -1).numpy()
    else:
        zu, gu = z.reshape(z.shape[0], -1), g.reshape(g.shape[0], -1)
    zu = zu + 0.0
    uniq, inv = np.unique(zu, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    sums = np.zeros((uniq.shape[0], gu.shape[1]))
    np.add.at(sums, inv, gu)
    counts = np.bincount(inv, minlength=uniq.shape[0])
    resid = gu - (sums / counts[:, None])[inv]
    return float((resid * resid).sum()) / z.shape[0], int(uniq.shape[0]), int(zu.shape[0])


def _row_dim(z: np.ndarray, layout: str) -> int:
    return int(z.shape[1] if layout == "image" else z.shape[-1])


def audit_family(
    family: ResidualFamily | LoadedFamily,
    z,
    g,
    *,
    layout: str | None = None,
    probe: str = "user probe",
    strict: bool = True,
    defect_rtol: float | None = None,
    model_deviation: float | None = None,
) -> AuditReport:
    """Audit a residual family on a probe (see the module docstring for every verdict).

    Args:
        family: the family, or a :class:`LoadedFamily` (then its source and, for sympy
            families, the symbolic verdicts are reported).
        z: site activations, float32/float64 array or tensor ``(n, d)``, ``(n, T, d)``
            or ``(n, C, H, W)``.
        g: activation gradients of the per-example losses, same shape.
        layout: ``"vector"``, ``"sequence"`` or ``"image"`` (default: from ``z.ndim``).
        probe: a description of the probe for the report.
        strict: raise if the family is not function-preserving (default); with
            ``False`` the report is returned with ``function_preserving = False``.
        defect_rtol: relative tolerance of the certificate (module docstring).
        model_deviation: the model-output deviation after insertion (model audits).

    Returns:
        An :class:`AuditReport`.

    Raises:
        NotFunctionPreservingError: if ``strict`` and ``max |h(0, z)| > 0`` or
            ``model_deviation > 0`` (``def-family``).
        FamilyError: if the family does not fit the site, or its code fails on the probe.
        StatisticsError: on bad probe values (shape mismatch, NaN/Inf, empty).
        AuditError: on a probe with an unsupported number of dimensions, or a sympy
            family whose dimension differs from the probe's.
    """
    loaded = family if isinstance(family, LoadedFamily) else LoadedFamily(family, "object", "")
    fam = loaded.family
    spec = fam.spec or type(fam).__name__
    zt, gt = _as_tensor(z, "z"), _as_tensor(g, "g")
    if zt.shape != gt.shape:
        raise StatisticsError(f"z {tuple(zt.shape)} and g {tuple(gt.shape)} must have the same shape")
    layout = layout or _layout_for(zt.dim())
    shape = tuple(int(s) for s in zt.shape[1:])
    fam.check_site(shape, layout)
    if loaded.d is not None and _row_dim(zt, layout) != loaded.d:
        raise AuditError(
            f"family {loaded.text!r} acts on units of dimension d = {loaded.d} "
            f"(u1..u{loaded.d}), but the probe has d = {_row_dim(zt, layout)}"
        )
    dtype = zt.dtype
    z64 = zt.to(torch.float64)

    dev = _guard(spec, "evaluating h(0, z)", lambda: _deviation(fam, z64, layout))
    symbolic = _symbolic_preservation(loaded) if loaded.symbolic is not None else None
    fp = dev == 0.0 and (model_deviation is None or model_deviation == 0.0)
    fp = fp and (symbolic is None or symbolic["function_preserving"])
    if strict and not fp:
        if dev != 0.0:
            where = f"max |h(0,u)| = {dev:.3g} on the probe"
        elif model_deviation:
            where = f"inserting it changes the model output by {model_deviation:.3g}"
        else:
            where = f"h(0,u) = {symbolic['residual']} symbolically (0 on the probe's units)"
        raise NotFunctionPreservingError(
            f"family {loaded.text or spec!r} is not function-preserving: {where} (h(0, ·) must vanish identically)"
        )

    stats = statistics_for(fam, shape, layout, pool_ties=True)
    _guard(spec, "computing tangent statistics", lambda: stats.update(zt, gt))
    res = stats.result()
    rank_check, method, zero_cols = _guard(
        spec, "computing the tangent Jacobian", lambda: _independent_rank(fam, z64, layout, res.rtol, stats)
    )
    if zero_cols < 0:  # subsampled Jacobian: count zero columns from diag K instead
        zero_cols = int((np.diag(stats.k_mat.cpu().numpy()) == 0).sum())
    noise2, distinct, units = _tie_noise(fam, z64.numpy(), gt.to(torch.float64).numpy(), layout)

    p, rank = res.tangent_dim, res.tangent_rank
    degenerate = rank == 0
    regular = rank == p
    if defect_rtol is None:
        defect_rtol = max(1e-8, 100 * torch.finfo(dtype).eps)
    rho = res.realizability_defect
    noise = math.sqrt(noise2) / res.ag_rms if res.ag_rms > 0 else 0.0
    if degenerate:
        cert = "not applicable (degenerate)"
    elif res.ag_rms == 0 or (
        not math.isnan(rho) and rho * res.raw_score <= defect_rtol * res.ag_rms and noise <= defect_rtol
    ):
        cert = "exact"  # g = 0, or g ∈ T on the probe (g = m̂ and ρ̂ = 0)
    else:
        cert = "conservative only"
    status = "degenerate" if degenerate else ("saturated" if res.saturated else "improvable")

    notes = [
        (
            "realizability defect pools exactly equal units only: exact on finite/discrete "
            "populations, biased upward for continuous units (then raw_score = ag_rms)"
        )
    ]
    if degenerate:
        notes.append(
            "degenerate family (rank K = 0, T = {0}): no first-order change is possible; this is not saturation (T4)"
        )
    elif not regular:
        notes.append(
            f"redundant parameterization: {p - rank} of {p} parameter directions do not move h "
            f"at first order; T, Π and s are unaffected (T4), the gradient b and optimizer "
            f"steps are not"
        )
    if rank_check is not None and rank_check != rank:
        notes.append(
            f"numerical rank ambiguous: statistics give {rank}, the SVD check {rank_check} "
            f"(a singular value sits at the cutoff rtol = {res.rtol:.2g})"
        )
    if cert == "exact" and not degenerate:
        notes.append("g lies in T on this probe: s = AG_rms, so AG_max = 0 ⇔ saturated here (T6)")
    elif cert == "conservative only":
        notes.append(
            "AG_max = 0 would certify saturation, but AG_max > 0 does not imply improvable (g ∉ T on this probe; T6)"
        )
    if isinstance(fam, FeatureFamily):
        notes.append("feature parameters ψ have zero tangent and are not counted in p")

    report = AuditReport(
        family=spec,
        source=loaded.source,
        text=loaded.text,
        probe=probe,
        layout=layout,
        shape=list(shape),
        n=res.n,
        units=units,
        distinct_units=distinct,
        dtype=str(dtype).replace("torch.", ""),
        function_preserving=fp,
        max_deviation=dev,
        model_deviation=model_deviation,
        tangent_dim=p,
        tangent_rank=rank,
        rank_check=rank_check,
        rank_check_method=method,
        rank_agrees=None if rank_check is None else rank_check == rank,
        zero_tangent_columns=zero_cols,
        parameter_redundancy=p - rank,
        regular=regular,
        parameterization="degenerate" if degenerate else ("regular" if regular else "redundant"),
        degenerate=degenerate,
        rank_deficient=rank < p,
        realizability_defect=None if math.isnan(rho) else rho,
        noise=noise,
        defect_rtol=defect_rtol,
        ag_certificate=cert,
        score=res.score,
        relative_score=None if res.relative_score != res.relative_score else res.relative_score,
        raw_score=None if res.raw_score != res.raw_score else res.raw_score,
        ag_rms=res.ag_rms,
        ag_max=res.ag_max,
        tol=res.tol,
        activation_scaled_score=res.activation_scaled_score,
        rtol=res.rtol,
        status=status,
        notes=notes,
    )
    if symbolic is not None:
        report.symbolic = _symbolic_verdicts(loaded, report, symbolic)
    return report


def _symbolic_preservation(loaded: LoadedFamily) -> dict:
    """The engine's exact verdict on ``h(0, u) ≡ 0`` (``def-family``)."""
    sym = _symbolic_module()
    fp, residual = sym.is_function_preserving(loaded.symbolic)
    comps = [str(e) for e in residual]
    return {"function_preserving": bool(fp), "residual": comps[0] if len(comps) == 1 else "[" + ", ".join(comps) + "]"}


def _symbolic_verdicts(loaded: LoadedFamily, report: AuditReport, out: dict) -> dict:
    """The symbolic engine's verdicts on a sympy family, compared with the numeric ones.

    ``tangent_rank`` is the engine's function-space rank of ``A`` (generic units, no
    measure); the parameterization is symbolically regular when it equals ``p``.
    """
    sym = _symbolic_module()
    fam = loaded.symbolic
    rank = sym.tangent_rank(fam)
    out["tangent_rank"] = int(rank)
    out["degenerate"] = bool(sym.is_degenerate(fam))
    out["regular"] = int(rank) == report.tangent_dim
    out["rank_agrees_with_probe"] = int(rank) == report.tangent_rank
    if not out["rank_agrees_with_probe"]:
        report.notes.append(
            f"the symbolic (generic-unit) tangent rank is {rank} but the probe's is "
            f"{report.tangent_rank}: the probe does not separate the tangent directions"
        )
    return out


# ----------------------------------------------------------------------------- models
class _Collector:
    """An accumulator-like sink for :func:`~depthsat_theory.capture.sites.accumulate` keeping ``(z, g)``."""

    def __init__(self):
        self.z: list[Tensor] = []
        self.g: list[Tensor] = []

    def update(self, z: Tensor, g: Tensor) -> None:
        self.z.append(z.detach().to(torch.float64).cpu())
        self.g.append(g.detach().to(torch.float64).cpu())


def audit_model(
    family: ResidualFamily | LoadedFamily,
    model: torch.nn.Module,
    site: str,
    inputs,
    targets,
    loss: Callable[[Tensor, Tensor], Tensor],
    *,
    layout: str | None = None,
    probe: str = "model probe",
    batch_size: int = 256,
    strict: bool = True,
    sites: list[str] | None = None,
) -> AuditReport:
    """Audit a family at a site of a torch model on a probe batch.

    Captures ``z`` and the per-example ``g`` at ``site`` with
    :func:`~depthsat_theory.capture.sites.accumulate`, inserts the family's zero block after
    the site (:func:`~depthsat_theory.capture.sites.insert_block`) and measures the output
    deviation (:func:`~depthsat_theory.capture.sites.check_function_preserving`), then runs
    :func:`audit_family`; also compares autograd's gradient of the inserted block
    with the statistics' ``b`` (T1, ``gradient_check``, relative).

    Args:
        family: the family (or a :class:`LoadedFamily`).
        model: the reference model (float64, eval mode recommended).
        site: module name of the site.
        inputs, targets: the probe (first dimension = examples).
        loss: per-example loss ``loss(model(x), y) -> (B,)``.
        layout: site layout (default: ``model.layout`` or from the tensor rank).
        probe: description for the report.
        batch_size: examples per forward/backward pass.
        strict: as in :func:`audit_family`.
        sites: the model's valid site names (for the error message; default
            ``model.site_names()`` when it exists).

    Raises:
        SiteError: if ``site`` is not one of the model's sites.
        NotFunctionPreservingError, FamilyError, StatisticsError: as in :func:`audit_family`.
    """
    loaded = family if isinstance(family, LoadedFamily) else LoadedFamily(family, "object", "")
    valid = sites if sites is not None else (model.site_names() if hasattr(model, "site_names") else None)
    if valid is not None and site not in valid:
        raise SiteError(f"unknown site {site!r}; valid sites: {', '.join(valid)}")
    n = int(inputs.shape[0])
    batches = [(inputs[i : i + batch_size], targets[i : i + batch_size]) for i in range(0, n, batch_size)]
    sink = _Collector()
    accumulate(model, [site], batches, loss, {site: sink})
    z, g = torch.cat(sink.z), torch.cat(sink.g)
    layout = layout or getattr(model, "layout", None) or _layout_for(z.dim())
    shape = tuple(z.shape[1:])
    fam = loaded.family
    spec = fam.spec or type(fam).__name__
    fam.check_site(shape, layout)
    with torch.no_grad():
        ref = model(inputs)
    block = _guard(spec, "building its block", lambda: fam.block(shape, layout, dtype=torch.float64))
    new, blk = insert_block(model, site, block)
    try:
        mdev = _guard(
            spec,
            "running the model with the inserted block",
            lambda: check_function_preserving(ref, new, inputs, atol=math.inf),
        )
    except NotFunctionPreservingError:  # NaN deviation
        mdev = math.inf
    report = audit_family(loaded, z, g, layout=layout, probe=probe, strict=strict, model_deviation=mdev)
    # T1: autograd's gradient of the inserted block's tangent parameters vs the statistics' b
    try:
        tparams = fam.tangent_parameters(blk)
        j = loss(new(inputs), targets).mean()
        grads = torch.autograd.grad(j, tparams, allow_unused=True)
        b_auto = (
            torch.cat(
                [(torch.zeros_like(p) if gr is None else gr).reshape(-1) for p, gr in zip(tparams, grads, strict=False)]
            )
            .detach()
            .numpy()
        )
        stats = statistics_for(fam, shape, layout)
        stats.update(z, g)
        b_stat = stats.result().gradient
        if b_auto.shape == b_stat.shape and b_auto.size:
            scale = max(float(np.abs(b_stat).max()), float(np.abs(b_auto).max()), 1e-300)
            report.gradient_check = float(np.abs(b_auto - b_stat).max()) / scale
        elif b_auto.shape == b_stat.shape:
            report.gradient_check = 0.0
    except Exception:
        report.gradient_check = None
    return report


# ----------------------------------------------------------------------------- display
def report_table(report: AuditReport):
    """A :class:`rich.table.Table` of the report (the CLI's human-readable output)."""
    from rich.table import Table

    r = report

    def num(x, fmt=".4g"):
        return "n/a" if x is None else (format(x, fmt) if isinstance(x, float) else str(x))

    t = Table(title=f"depthsat audit: {r.family} ({r.source})", show_lines=False)
    t.add_column("check", no_wrap=True)
    t.add_column("verdict", no_wrap=True)
    t.add_column("evidence")
    fp_ev = f"max |h(0,u)| = {num(r.max_deviation)} on the probe"
    if r.model_deviation is not None:
        fp_ev += f"; model output deviation after insertion {num(r.model_deviation)}"
    if r.symbolic is not None:
        fp_ev += f"; symbolic h(0,u) = {r.symbolic['residual']}"
    t.add_row("function-preserving", "yes" if r.function_preserving else "NO", fp_ev)
    t.add_row(
        "tangent rank",
        f"{r.tangent_rank} / p = {r.tangent_dim}",
        f"rank K (eigh, rtol {r.rtol:.2g}); check: {num(r.rank_check)} by {r.rank_check_method}"
        + (f"; symbolic (generic units): {r.symbolic['tangent_rank']}" if r.symbolic else ""),
    )
    t.add_row(
        "parameterization",
        r.parameterization,
        f"redundancy p − rank = {r.parameter_redundancy}; zero tangent columns "
        f"{r.zero_tangent_columns}" + (f"; symbolic regular: {r.symbolic['regular']}" if r.symbolic else ""),
    )
    t.add_row(
        "realizability defect ρ̂",
        num(r.realizability_defect),
        f"raw score r̂ = {num(r.raw_score)}; within-tie noise ‖g − m̂‖/AG_rms = {num(r.noise)}; "
        f"{r.distinct_units} distinct of {r.units} units",
    )
    t.add_row(
        "AG_max certificate",
        r.ag_certificate,
        f"AG_max = {num(r.ag_max)}, AG_rms = {num(r.ag_rms)}; exact iff g ∈ T up to {r.defect_rtol:.1g}·AG_rms",
    )
    t.add_row(
        "score",
        r.status,
        f"s = {num(r.score)}, s/AG_rms = {num(r.relative_score)}, tol = {num(r.tol, '.3g')}, "
        f"s·z_rms = {num(r.activation_scaled_score)}",
    )
    if r.gradient_check is not None:
        t.add_row(
            "T1 gradient check",
            "ok" if r.gradient_check <= 1e-8 else "MISMATCH",
            f"max |b_autograd − b_statistics| / max |b| = {num(r.gradient_check, '.2g')}",
        )
    return t
