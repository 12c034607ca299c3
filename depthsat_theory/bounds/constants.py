"""The constants of the finite-sample bound: argument checks, :class:`Constant`, resolution.

:func:`resolve_constants` turns the caller's constants (:math:`γ`, ``L``, ``B``, :math:`μ`, :math:`λ`,
``V``, ``D``; see :mod:`depthsat_theory.bounds`) into :class:`Constant` objects, each
with its source (``user``, ``probe`` or ``derived``), and refuses a user constant that
the probe itself contradicts (theory page ``theory/finite-sample.md``, label
``thm-finite-sample``).

Errors are :class:`BoundError`; their messages name the Python arguments
(``leverage_max``), and :meth:`BoundError.render` respells them (the CLI passes its flags).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from numbers import Real
from typing import Any

import numpy as np

__all__ = [
    "PROBE_MAX_NOTE",
    "SLACK",
    "BoundError",
    "Constant",
    "argument",
    "check_delta",
    "check_n",
    "check_number",
    "resolve_constants",
]

#: relative rounding slack when comparing a user's almost-sure bound with the probe's maximum
SLACK = 1e-9

PROBE_MAX_NOTE = (
    "probe maximum: a lower bound of the essential supremum (exact only when the "
    "probe enumerates a finite population), so the interval is a plug-in, not a "
    "guarantee"
)

_ARGUMENT = re.compile(r"⟦(\w+)(?:=([^⟧]*))?⟧")


def argument(name: str, value: object = None) -> str:
    """A reference to the Python argument ``name`` (with its ``value``) in a :class:`BoundError`.

    ``str(error)`` spells it ``name`` (``name=value``); :meth:`BoundError.render` with a
    mapping ``{name: spelling}`` spells it ``spelling`` (``spelling value``).

    Args:
        name: the Python argument, e.g. ``"leverage_max"``.
        value: the value to quote with it (``None``: none).

    Returns:
        The marker ``⟦name⟧``, or ``⟦name=value⟧`` when ``value`` is given.
    """
    return f"⟦{name}⟧" if value is None else f"⟦{name}={value}⟧"


class BoundError(ValueError):
    """Bad input to a finite-sample bound (δ, n, ε or a constant out of range or missing).

    The message names Python arguments (``leverage_max must be > 0, got -2``);
    :meth:`render` respells them, e.g. as the CLI's flags.
    """

    def render(self, names: Mapping[str, str] | None = None) -> str:
        """The message with every argument spelled by ``names`` (default: its Python name).

        Args:
            names: ``{argument: spelling}``; an argument quoted with a value is written
                ``spelling value`` (``name=value`` when not in ``names``).

        Returns:
            The one-line message.
        """
        spell = names or {}

        def one(match: re.Match[str]) -> str:
            name, value = match[1], match[2]
            if name in spell:
                return spell[name] if value is None else f"{spell[name]} {value}"
            return name if value is None else f"{name}={value}"

        return _ARGUMENT.sub(one, str(self.args[0]) if self.args else "")

    def __str__(self) -> str:
        return self.render()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.render()!r})"


# ----------------------------------------------------------------------------- argument checks
def _is_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (Real, np.floating, np.integer))


def check_number(key: str, value: Any, *, positive: bool = False, allow_none: bool = True) -> float | None:
    """Validate a real constant: finite, :math:`≥ 0` (``> 0`` when ``positive``).

    Args:
        key: the Python argument name (used in the error message).
        value: the value (``None`` allowed when ``allow_none``).
        positive: require ``> 0``.
        allow_none: return ``None`` for ``None`` instead of raising.

    Returns:
        The value as a float, or ``None``.

    Raises:
        BoundError: if the value is missing (``allow_none=False``), not a number, NaN,
            infinite, negative, or ``0`` with ``positive``.
    """
    name = argument(key)
    if value is None:
        if allow_none:
            return None
        raise BoundError(f"missing constant {name}")
    if not _is_number(value):
        raise BoundError(f"{name} must be a number, got {value!r}")
    val = float(value)
    if math.isnan(val):
        raise BoundError(f"{name} is NaN")
    if math.isinf(val):
        raise BoundError(f"{name} must be finite, got {val}")
    if positive and val <= 0:
        raise BoundError(f"{name} must be > 0, got {val:g}")
    if val < 0:
        raise BoundError(f"{name} must be >= 0, got {val:g}")
    return val


def check_delta(delta: Any) -> float:
    """Validate a confidence level :math:`δ ∈ (0, 1)`.

    Args:
        delta: the confidence level to check (any number-like value).

    Returns:
        :math:`δ` as a ``float``.

    Raises:
        BoundError: if :math:`δ` is missing, not a number, NaN, or outside ``(0, 1)``.
    """
    name = argument("delta")
    if delta is None:
        raise BoundError(f"missing {name}")
    if not _is_number(delta):
        raise BoundError(f"{name} must be a number in (0, 1), got {delta!r}")
    val = float(delta)
    if not 0.0 < val < 1.0:  # also rejects NaN
        raise BoundError(f"{name} must be in (0, 1), got {delta}")
    return val


def check_n(n: Any, key: str = "n") -> int:
    """Validate a probe size (a positive integer).

    Args:
        n: the value.
        key: the Python argument name (used in the error message).

    Returns:
        ``n`` as an ``int``.

    Raises:
        BoundError: if ``n`` is not an integer :math:`≥ 1`.
    """
    name = argument(key)
    if not _is_number(n):
        raise BoundError(f"{name} must be a positive integer, got {n!r}")
    if isinstance(n, float) and (math.isnan(n) or n != int(n)):
        raise BoundError(f"{name} must be a positive integer, got {n}")
    if int(n) <= 0:
        raise BoundError(f"{name} must be a positive integer (n >= 1), got {n}")
    return int(n)


# ----------------------------------------------------------------------------- constants
@dataclass(frozen=True)
class Constant:
    """One constant of the bound, with where it came from.

    Attributes:
        symbol: the symbol in ``theory/finite-sample.md`` (:math:`γ`, ``L``, ``V``, …).
        value: its value.
        source: ``"user"`` (given), ``"probe"`` (estimated from the probe) or
            ``"derived"`` (computed from other constants, rigorously).
        note: what the value means and whether it is a guarantee.
    """

    symbol: str
    value: float
    source: str
    note: str

    def to_dict(self) -> dict:
        """JSON-ready dictionary.

        Returns:
            The dataclass fields as a plain ``dict`` (:func:`dataclasses.asdict`).
        """
        return asdict(self)


@dataclass(frozen=True)
class _Inputs:
    """The caller's constants, validated (``None``: not given)."""

    ridge: float
    gam: float | None
    lev: float | None
    bnorm: float | None
    mu: float | None
    var: float | None
    dim: int | None


def _inputs(ridge, grad_max, leverage_max, feature_norm_max, eig_floor, variance, dim) -> _Inputs:
    inp = _Inputs(
        ridge=check_number("ridge", ridge) or 0.0,
        gam=check_number("grad_max", grad_max),
        lev=check_number("leverage_max", leverage_max, positive=True),
        bnorm=check_number("feature_norm_max", feature_norm_max, positive=True),
        mu=check_number("eig_floor", eig_floor, positive=True),
        var=check_number("variance", variance),
        dim=None if dim is None else check_n(dim, "dim"),
    )
    if inp.lev is not None and inp.bnorm is not None:
        raise BoundError(
            f"give either {argument('leverage_max')} or {argument('feature_norm_max')} with "
            f"{argument('eig_floor')}/{argument('ridge')}, not both"
        )
    return inp


def _check_maxima(inp: _Inputs, probe: dict) -> None:
    """A user :math:`γ` or ``B`` below the probe's own maximum is not an almost-sure bound."""
    if inp.gam is not None and probe["g_max"] > inp.gam * (1 + SLACK):
        raise BoundError(
            f"{argument('grad_max', f'{inp.gam:g}')} is below the probe's own max ‖g(x)‖_F = "
            f"{probe['g_max']:.4g}, so it is not an almost-sure bound"
        )
    fmax = probe.get("feat_max")
    if inp.bnorm is not None and fmax is not None and fmax > inp.bnorm * (1 + SLACK):
        raise BoundError(
            f"{argument('feature_norm_max', f'{inp.bnorm:g}')} is below the probe's own max "
            f"(Σ_t ‖φ̃_t‖²)^{{1/2}} = {fmax:.4g}, so it is not an almost-sure bound"
        )


def _grad_constant(inp: _Inputs, probe: dict | None) -> Constant:
    if inp.gam is not None:
        return Constant("γ", inp.gam, "user", "almost-sure bound on ‖g(x)‖_F")
    if probe is not None:
        return Constant("γ", probe["g_max"], "probe", "AG_max of the probe; " + PROBE_MAX_NOTE)
    raise BoundError(f"missing constant {argument('grad_max')}: an almost-sure bound γ on ‖g(x)‖_F")


def _probe_leverage_note(exact: bool) -> str:
    if exact:
        return "largest leverage ℓ̂(x_i) = tr(Σ̂_λ⁺ Σ_{x_i}) over the probe (plug-in with the probe's Σ̂; not a guarantee)"
    return (
        "max_i Σ_t‖φ̃_t‖² · ‖Σ̂_λ⁺‖ over the probe (an upper estimate of the probe's largest "
        "leverage; rows not kept; plug-in, not a guarantee)"
    )


def _leverage_constants(inp: _Inputs, probe: dict | None) -> dict[str, Constant]:
    """``L`` (and ``B`` when it derives ``L``): user, derived :math:`B^2/(μ + λ)`, or the probe."""
    if inp.lev is not None:
        return {"leverage_max": Constant("L", inp.lev, "user", "almost-sure bound on the leverage ℓ_λ(x)")}
    if inp.bnorm is not None:
        if inp.mu is None and inp.ridge <= 0:
            raise BoundError(
                f"{argument('feature_norm_max')} bounds the leverage only together with "
                f"{argument('eig_floor')} or {argument('ridge')} > 0 (L = B²/(μ + λ))"
            )
        big_l = inp.bnorm**2 / ((inp.mu or 0.0) + inp.ridge)
        return {
            "feature_norm_max": Constant("B", inp.bnorm, "user", "almost-sure bound on (Σ_t ‖φ̃_t‖²)^{1/2}"),
            "leverage_max": Constant("L", big_l, "derived", "L = B²/(μ + λ) ≥ ℓ_λ(x)"),
        }
    if probe is not None:
        note = _probe_leverage_note(probe["lev_exact"])
        return {"leverage_max": Constant("L", probe["lev_max"], "probe", note)}
    raise BoundError(
        f"missing constant {argument('leverage_max')} (or {argument('feature_norm_max')} "
        f"with {argument('eig_floor')} or {argument('ridge')}): an almost-sure bound L on "
        f"the leverage"
    )


def _check_leverage_vs_rank(lev: Constant, ridge: float, rank: int | None) -> None:
    """With ``λ = 0``, ``rank Σ̂ ≤ rank Σ = E ℓ_0(x) ≤ L``: a user or derived ``L`` must allow it."""
    if lev.value <= 0:
        raise BoundError("the leverage bound L is 0: the family is degenerate (Σ = 0) on this probe")
    if ridge != 0 or lev.source == "probe":
        return
    big_l = lev.value
    what = (
        argument("leverage_max", f"{big_l:g}")
        if lev.source == "user"
        else (
            f"L = B²/μ = {big_l:.4g} (from {argument('feature_norm_max')} and {argument('eig_floor')}; "
            f"{argument('eig_floor')} is too large)"
        )
    )
    if rank is not None and rank > big_l * (1 + SLACK):
        raise BoundError(
            f"{what} is below the probe's rank Σ̂ = {rank}, but rank Σ̂ ≤ rank Σ = "
            f"E ℓ_0(x) ≤ L, so it is not an almost-sure bound"
        )
    if big_l * (1 + SLACK) < 1 and (rank is None or rank >= 1):
        raise BoundError(
            f"{what} is below 1: with {argument('ridge', '0')}, rank Σ = E ℓ_0(x) ≤ L < 1 forces "
            f"Σ = 0 (a degenerate family); a non-degenerate family has L ≥ 1"
        )


def _dim_constant(inp: _Inputs, big_l: float, probe: dict | None) -> Constant:
    """``D ≥ rank Σ``: given, ``min(k̃, ⌊L⌋)`` for ``λ = 0``, else ``k̃``."""
    rank = probe.get("rank") if probe is not None else None
    k = probe["k"] if probe is not None else None
    if inp.dim is not None:
        if rank is not None and rank > inp.dim:
            raise BoundError(
                f"{argument('dim', inp.dim)} is below the probe's rank Σ̂ = {rank} ≤ rank Σ, so it does not bound rank Σ"
            )
        return Constant("D", float(inp.dim), "user", "bound on rank Σ")
    if inp.ridge == 0:
        # rank Σ is an integer ≤ L, hence ≤ ⌊L⌋ (slack against rounding; at least 1)
        fl = max(1, math.floor(big_l * (1 + SLACK)))
        val = float(min(k, fl)) if k is not None else float(fl)
        return Constant("D", val, "derived", "rank Σ ≤ min(k̃, ⌊L⌋) because rank Σ = E ℓ_0(x) ≤ L is an integer")
    if k is not None:
        return Constant("D", float(k), "derived", "rank Σ ≤ k̃, the number of features")
    raise BoundError(
        f"missing constant {argument('dim')}: with {argument('ridge')} > 0 the bound "
        f"needs D ≥ rank Σ (e.g. the number of features k̃)"
    )


def resolve_constants(
    *,
    ridge: Any,
    grad_max: Any,
    leverage_max: Any,
    feature_norm_max: Any,
    eig_floor: Any,
    variance: Any,
    dim: Any,
    probe: dict | None,
) -> dict[str, Constant]:
    r"""Constants ``γ, L, D, R`` (and ``λ``, ``μ``, ``B``, ``V`` when given): from the user, derived, or the probe.

    ``probe`` (when there is one) has ``g_max``, ``lev_max``, ``lev_exact``, ``k`` and
    (optionally) ``feat_max`` (:math:`\max (Σ_t ‖\tilde{φ}_t‖^2)^{1/2}`) and ``rank`` (numerical rank of
    :math:`\hat{Σ}`); without a probe, :math:`γ` and ``L`` (or ``B`` with :math:`μ`/:math:`λ`) are required.

    A user almost-sure bound the probe itself contradicts is an error: :math:`γ` or ``B``
    below the probe's own maximum, and (:math:`λ = 0`) ``L`` or ``D`` below :math:`\operatorname{rank} \hat{Σ}`
    (:math:`\operatorname{rank} \hat{Σ} ≤ \operatorname{rank} Σ = E ℓ_0(x) ≤ L`).  ``D`` derived from ``L``
    (:math:`λ = 0`) is the
    integer :math:`⌊L⌋`: :math:`\operatorname{rank} Σ` is an integer :math:`≤ L` (``thm-finite-sample``).

    Args:
        ridge: :math:`λ ≥ 0`, the ridge added to :math:`Σ` (the interval is then for :math:`s_λ ≤ s`); ``None`` means
            ``0``.
        grad_max: :math:`γ`, an almost-sure bound :math:`γ ≥ ‖g(x)‖_F` (``None``: not given).
        leverage_max: ``L``, an almost-sure bound :math:`L ≥ ℓ_λ(x) = \operatorname{tr}(Σ_λ^+ Σ_x)` (``None``: not
            given).
        feature_norm_max: ``B``, an almost-sure bound on :math:`(Σ_t ‖\tilde{φ}_t‖^2)^{1/2}`, giving
            :math:`L = B^2/(μ + λ)` with :math:`μ` and/or :math:`λ` (``None``: not given).
        eig_floor: :math:`μ`, a floor on the nonzero eigenvalues of :math:`Σ` (``None``: not given).
        variance: ``V``, a bound on :math:`E‖G_x Σ_λ^{+1/2}‖_F^2` (``None``: not given).
        dim: :math:`D ≥ \operatorname{rank} Σ` (``None``: not given).
        probe: the probe's maxima and rank, or ``None``.

    Returns:
        ``{name: Constant}`` keyed by the Python argument names, plus ``whitened_max``
        (:math:`R = γ√L`).

    Raises:
        BoundError: a constant missing, out of range, given together with a conflicting
            one, or contradicted by the probe.
    """
    inp = _inputs(ridge, grad_max, leverage_max, feature_norm_max, eig_floor, variance, dim)
    if probe is not None:
        _check_maxima(inp, probe)
    out: dict[str, Constant] = {}
    if inp.ridge > 0:
        out["ridge"] = Constant("λ", inp.ridge, "user", "ridge added to Σ: the interval is for s_λ ≤ s")
    if inp.mu is not None:
        out["eig_floor"] = Constant("μ", inp.mu, "user", "floor on the nonzero eigenvalues of Σ")
    out["grad_max"] = _grad_constant(inp, probe)
    out.update(_leverage_constants(inp, probe))
    big_l = out["leverage_max"].value
    _check_leverage_vs_rank(out["leverage_max"], inp.ridge, probe.get("rank") if probe is not None else None)
    out["dim"] = _dim_constant(inp, big_l, probe)
    gam = out["grad_max"].value
    out["whitened_max"] = Constant("R", gam * math.sqrt(big_l), "derived", "R = γ √L ≥ ‖G_x Σ_λ^{+1/2}‖_F")
    if inp.var is not None:
        out["variance"] = Constant("V", inp.var, "user", "bound on E‖G_x Σ_λ^{+1/2}‖_F²")
    return out
