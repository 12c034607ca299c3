r"""Where to grow: order a diagnosis' sites by how much a new block can reduce the loss (:func:`rank_sites`).

Scores are not comparable across sites (their units follow the site's activation gradient), so
the ranking uses the scale-free :math:`s / \mathrm{AG}_{rms} \in [0, 1]`: the certified lower end
:math:`s_{lower} / \mathrm{AG}_{rms}` of the ``(1 − δ)`` interval (``thm-finite-sample``) when every
site has a non-vacuous interval, else the headline, the bias-corrected :math:`s_U / \mathrm{AG}_{rms}`
(theory/decision.md, ``def-bias-corrected-score``), never the plug-in :math:`\hat s`, whose chance level
:math:`\sqrt{\tilde k / n}` ranks noise by the number of features.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from depthsat_theory.diagnose.report import Diagnosis, SiteDiagnosis, headline_or_none
from depthsat_theory.grow.errors import GrowError
from depthsat_theory.statistics import SaturationResult
from depthsat_theory.vocabulary import Verdict

__all__ = [
    "BY_CERTIFIED",
    "BY_DECIDED",
    "BY_HEADLINE",
    "BY_POINT",
    "RankedSite",
    "SiteRanking",
    "even_positions",
    "headline_key",
    "rank_sites",
]

#: ``SiteRanking.by`` when sites were ranked by the certified lower end of the scale-free score.
BY_CERTIFIED = "certified lower end of s/AG_rms"
#: ``SiteRanking.by`` when sites were ranked by the headline ``s_U/AG_rms`` (no or vacuous intervals).
BY_HEADLINE = "bias-corrected s_U/AG_rms"
#: Deprecated alias of :data:`BY_HEADLINE` (the ranking no longer uses the plug-in point estimate).
BY_POINT = BY_HEADLINE

#: :attr:`SiteRanking.by` of a probe streamed until decided (``diagnose(..., until_decided=True)``): the sites
#: the anytime noise test decided (improvable at its level whatever the stopping, ``thm-anytime-noise-test``)
#: first, each group in order of the headline ``s_U/AG_rms``
BY_DECIDED = "anytime decision, then bias-corrected s_U/AG_rms"


@dataclass(frozen=True)
class RankedSite:
    """One site in a :class:`SiteRanking`.

    Attributes:
        site: module name; ``depth``: its position in depth order (0 = first site).
        key: the value ranked on (scale-free, in ``[0, 1]``; ``-inf`` for a degenerate or NaN score).
        relative_score: the plug-in ``ŝ / AG_rms`` (biased upward; shown second).
        relative_lower: ``s_lower / AG_rms`` (``None`` without an interval).
        verdict: the site's verdict (``improvable``, ``saturated``, ``undetermined``, ``degenerate``).
        relative_headline: the headline ``s_U / AG_rms`` (``None`` without the noise moment ``v̂``).
    """

    site: str
    depth: int
    key: float
    relative_score: float
    relative_lower: float | None
    verdict: str
    relative_headline: float | None = None

    def to_dict(self) -> dict:
        """JSON-ready dictionary (non-finite numbers become ``None``).

        Returns:
            A ``dict`` with ``site``, ``depth``, ``key``, ``relative_headline``, ``relative_score``,
            ``relative_lower`` and ``verdict`` (non-finite numbers as ``None``).
        """
        return {
            "site": self.site,
            "depth": self.depth,
            "key": self.key if math.isfinite(self.key) else None,
            "relative_headline": _finite_or_none(self.relative_headline),
            "relative_score": self.relative_score if math.isfinite(self.relative_score) else None,
            "relative_lower": self.relative_lower,
            "verdict": self.verdict,
        }


@dataclass(frozen=True)
class SiteRanking:
    """Sites ordered best first.

    Attributes:
        sites: the ranked sites, largest ``key`` first (ties: shallower first).
        by: :data:`BY_CERTIFIED`, :data:`BY_POINT` or :data:`BY_DECIDED` (streamed until decided): what was ranked on.
        reason: one line saying why.
    """

    sites: list[RankedSite]
    by: str
    reason: str

    def top(self, k: int) -> list[str]:
        """The ``k`` best site names.

        Args:
            k: how many sites, ``1 ≤ k ≤ len(sites)``.

        Returns:
            The names of the first ``k`` sites of the ranking.

        Raises:
            GrowError: ``k`` outside ``1..len(sites)``.
        """
        if not 1 <= k <= len(self.sites):
            raise GrowError(f"cannot pick {k} sites: the diagnosis has {len(self.sites)} (give 1..{len(self.sites)})")
        return [r.site for r in self.sites[:k]]

    def to_dict(self) -> dict:
        """JSON-ready dictionary.

        Returns:
            A ``dict`` with ``by``, ``reason`` and ``sites`` (each :meth:`RankedSite.to_dict`, best first).
        """
        return {"by": self.by, "reason": self.reason, "sites": [r.to_dict() for r in self.sites]}


def _relative(value: float, ag_rms: float) -> float:
    return value / ag_rms if ag_rms > 0 and math.isfinite(value) else float("nan")


def _finite_or_none(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def headline_key(result: SaturationResult) -> float:
    """The headline ``s_U / AG_rms`` of a result, the ranking key without intervals (``-inf``: none, or degenerate).

    Args:
        result: a site's :class:`~depthsat_theory.statistics.SaturationResult`.

    Returns:
        ``s_U / AG_rms`` (``def-bias-corrected-score``), or ``-inf`` when the result is degenerate, has no
        noise moment ``v̂`` (``n < 2``) or ``AG_rms = 0``.
    """
    head = None if result.verdict is Verdict.DEGENERATE else headline_or_none(result)
    return head.relative_score if head is not None and math.isfinite(head.relative_score) else -math.inf


def _entry(sd: SiteDiagnosis, certified: bool) -> RankedSite:
    r = sd.result
    lower = _relative(sd.interval.score_lower, r.ag_rms) if sd.interval is not None else None
    head = headline_key(r)
    key = lower if certified and lower is not None else head
    if r.verdict is Verdict.DEGENERATE or key is None or not math.isfinite(key):
        key = -math.inf
    return RankedSite(
        sd.site,
        sd.depth,
        float(key),
        float(r.relative_score),
        None if lower is None or not math.isfinite(lower) else float(lower),
        sd.verdict.value,
        head if math.isfinite(head) else None,
    )


def rank_sites(diagnosis: Diagnosis) -> SiteRanking:
    """Order the sites of a diagnosis by the scale-free score, best first, and say what was used.

    When every site has a ``(1 − δ)`` interval (``diagnose(..., delta=δ)``) and none is vacuous,
    the key is the certified lower end ``s_lower / AG_rms``: a site ranked first by it has, with
    probability ``1 − δ`` over the probe (union-bounded over the sites), at least that much
    first-order loss decrease per unit function-space step relative to its activation gradient.
    Otherwise the key is the headline ``s_U / AG_rms``, the bias-corrected score (``def-bias-corrected-score``),
    not the plug-in ``ŝ / AG_rms`` (which reads about ``sqrt(k̃/n)`` on pure noise, ``prop-plugin-chance-level``).
    Degenerate sites (``T = {0}``) come last.

    Args:
        diagnosis: a :class:`~depthsat_theory.diagnose.Diagnosis`.

    Returns:
        A :class:`SiteRanking` (``by`` is :data:`BY_CERTIFIED` or :data:`BY_HEADLINE`, ``reason`` says why).

    Raises:
        GrowError: a diagnosis without sites.
    """
    if not diagnosis.sites:
        raise GrowError("the diagnosis has no sites to rank")
    if getattr(diagnosis, "until_decided", False):
        return _rank_streamed(diagnosis)
    intervals = [sd.interval for sd in diagnosis.sites]
    if all(iv is not None for iv in intervals):
        vacuous = [sd.site for sd in diagnosis.sites if sd.interval is not None and sd.interval.vacuous]
        certified = not vacuous
        reason = (
            f"every site has a non-vacuous {1 - (diagnosis.delta or 0):g} interval"
            if certified
            else f"the interval of {len(vacuous)} site(s) is vacuous (e.g. {vacuous[0]}: the probe is too small)"
        )
    else:
        certified, reason = False, "no confidence intervals (diagnose without --delta)"
    ranked = sorted((_entry(sd, certified) for sd in diagnosis.sites), key=lambda r: (-r.key, r.depth))
    return SiteRanking(ranked, BY_CERTIFIED if certified else BY_HEADLINE, reason)


def _rank_streamed(diagnosis: Diagnosis) -> SiteRanking:
    """:func:`rank_sites` for a streamed diagnosis: decided sites first (:data:`BY_DECIDED`)."""
    decided = {sd.site for sd in diagnosis.sites if sd.verdict is Verdict.IMPROVABLE}
    ranked = sorted(
        (_entry(sd, False) for sd in diagnosis.sites), key=lambda r: (r.site not in decided, -r.key, r.depth)
    )
    reason = (
        f"streamed until decided: the {len(decided)} of {len(diagnosis.sites)} site(s) the anytime noise test "
        f"decided come first (thm-anytime-noise-test)"
    )
    return SiteRanking(ranked, BY_DECIDED, reason)


def even_positions(n: int, k: int) -> list[int]:
    """``k`` evenly spaced indices in ``0..n−1`` (LLaMA-Pro's placement: after every ``n/k``-th layer).

    Index ``j`` is ``⌈(j + 1) n / k⌉ − 1``, so the last one is ``n − 1``.

    Args:
        n: number of sites (layers).
        k: number of positions, ``1 ≤ k ≤ n``.

    Returns:
        ``k`` increasing indices, the last ``n − 1``.

    Raises:
        GrowError: ``k`` outside ``1..n``.
    """
    if not 1 <= k <= n:
        raise GrowError(f"cannot place {k} blocks evenly among {n} sites (give 1..{n})")
    return [-(-(j + 1) * n // k) - 1 for j in range(k)]
