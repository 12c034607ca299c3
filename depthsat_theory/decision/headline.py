"""The headline of a site: the bias-corrected score ``s_U``, its interval, and the plug-in beside its chance level.

theory/decision.md: ``def-bias-corrected-score``, ``prop-plugin-chance-level``, ``prop-headline-interval``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from depthsat_theory.statistics.linalg import noise_threshold
from depthsat_theory.statistics.result import SaturationResult, StatisticsError

__all__ = ["Headline", "headline", "headline_from_moments"]

#: Largest level of the headline's interval (its lower end uses the noise test at ``α/2 ≤ 0.215``).
HEADLINE_ALPHA_MAX = 0.43


@dataclass(frozen=True)
class Headline:
    """The numbers a site is read and ranked by (theory/decision.md, ``def-bias-corrected-score``).

    All scores are in (loss units) per unit function-space step, e.g. nats per example; the
    ``relative_*`` fields divide by ``AG_rms`` (dimensionless, ``nan`` when ``AG_rms = 0``).

    Attributes:
        score: the headline ``s_U = sqrt(max(0, ŝ²_U))``.
        relative_score: ``s_U / AG_rms``.
        low: lower end of the interval of ``s`` (``prop-headline-interval``).
        high: upper end of the interval of ``s``.
        level: the interval's nominal coverage ``1 − α`` (asymptotic, Gram as measured).
        plugin: the plug-in ``ŝ`` (biased upward by about ``v̂/n``).
        relative_plugin: ``ŝ / AG_rms``.
        chance: the plug-in's chance level ``sqrt(v̂/n)``: what ``ŝ`` reads on pure noise
            (``prop-plugin-chance-level``; ``AG_rms · sqrt(k̃/n)`` for one unit per example and ``g``
            independent of the features).
        relative_chance: ``chance / AG_rms``.
        ag_rms: ``AG_rms``.
        n: probe size (examples).
    """

    score: float
    relative_score: float
    low: float
    high: float
    level: float
    plugin: float
    relative_plugin: float
    chance: float
    relative_chance: float
    ag_rms: float
    n: int

    def to_dict(self) -> dict:
        """JSON-ready dictionary (non-finite floats as ``None``).

        Returns:
            The fields as a ``dict``.
        """
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def headline_from_moments(
    *,
    score: float,
    noise_variance: float,
    n: int,
    ag_rms: float,
    alpha: float = 0.05,
    noise_ratio: float | None = None,
) -> Headline:
    """The headline from ``ŝ``, ``v̂``, ``n`` and ``AG_rms`` (``def-bias-corrected-score``).

    ``ŝ²_U = (n ŝ² − v̂)/(n − 1)``; its standard-error bound
    ``sqrt(4 v̂ max(ŝ²_U, 0)/n + 2 v̂²/(n(n−1)))`` (``thm-noise-test``); the interval of ``s²`` is
    ``[L, max(ŝ²_U, 0) + z se]`` with ``z = Φ⁻¹(1 − α/2)`` and ``L = max(0, ŝ²_U − z se)`` when the noise
    test at level ``α/2`` rejects, else ``0`` (``prop-headline-interval``); the interval of ``s`` is its
    square root.

    Args:
        score: the plug-in ``ŝ`` ``≥ 0``.
        noise_variance: ``v̂ ≥ 0`` (finite).
        n: probe size, ``≥ 2``.
        ag_rms: ``AG_rms ≥ 0``.
        alpha: ``1 −`` the interval's coverage, in ``(0, 0.43]``.
        noise_ratio: the noise statistic to test against ``χ²_{1,1−α/2}`` (default ``n ŝ²/v̂``; a result
            with float32 products passes its conservative ``n (ŝ − e)₊²/v̂_up``).

    Returns:
        The :class:`Headline`.

    Raises:
        StatisticsError: for ``n < 2``, a negative or non-finite ``ŝ``, ``v̂`` or ``AG_rms``, or ``α``
            outside ``(0, 0.43]``.
    """
    if int(n) < 2:
        raise StatisticsError(f"n = {n}: the bias-corrected score needs at least 2 examples")
    for name, val in (("score", score), ("noise_variance", noise_variance), ("ag_rms", ag_rms)):
        if not (math.isfinite(val) and val >= 0):
            raise StatisticsError(f"{name} = {val!r}: must be finite and >= 0 (was v̂ streamed?)")
    if not 0 < alpha <= HEADLINE_ALPHA_MAX:
        raise StatisticsError(f"alpha = {alpha!r}: the headline's interval needs 0 < alpha <= {HEADLINE_ALPHA_MAX}")
    from scipy.stats import norm

    n = int(n)
    s2u = (n * score * score - noise_variance) / (n - 1)
    pos = max(s2u, 0.0)
    se = math.sqrt(4 * noise_variance * pos / n + 2 * noise_variance**2 / (n * (n - 1)))
    z = float(norm.isf(alpha / 2))
    if noise_ratio is None:
        noise_ratio = n * score * score / noise_variance if noise_variance > 0 else (math.inf if score > 0 else 0.0)
    rejects = noise_ratio > noise_threshold(alpha / 2)
    low2 = max(0.0, s2u - z * se) if rejects else 0.0
    chance = math.sqrt(noise_variance / n)
    s_u = math.sqrt(pos)
    return Headline(
        score=s_u,
        relative_score=_ratio(s_u, ag_rms),
        low=math.sqrt(low2),
        high=math.sqrt(pos + z * se),
        level=1.0 - alpha,
        plugin=float(score),
        relative_plugin=_ratio(score, ag_rms),
        chance=chance,
        relative_chance=_ratio(chance, ag_rms),
        ag_rms=float(ag_rms),
        n=n,
    )


def headline(result: SaturationResult, *, alpha: float | None = None) -> Headline:
    """The headline of a site's :class:`~depthsat_theory.statistics.SaturationResult` (``def-bias-corrected-score``).

    Reads ``score``, ``noise_variance``, ``n`` and ``ag_rms``; the interval's ``α`` defaults to the
    result's noise-test level.

    Args:
        result: a result whose noise moment was streamed (``noise_variance`` finite).
        alpha: ``1 −`` the interval's coverage (default ``result.alpha``).

    Returns:
        The :class:`Headline`.

    Raises:
        StatisticsError: when ``v̂`` was not streamed (``nan``), ``n < 2``, or for a bad ``α``.
    """
    return headline_from_moments(
        score=result.score,
        noise_variance=result.noise_variance,
        n=result.n,
        ag_rms=result.ag_rms,
        alpha=result.alpha if alpha is None else alpha,
        noise_ratio=None if math.isnan(result.noise_ratio) else result.noise_ratio,
    )
