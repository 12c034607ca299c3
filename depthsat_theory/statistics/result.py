"""The result type of every engine (:class:`SaturationResult`) and the statistics' input error."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from depthsat_theory.vocabulary import Verdict

__all__ = ["SaturationResult", "StatisticsError"]


class StatisticsError(ValueError):
    """Bad input to the statistics (shape mismatch, NaN/Inf, empty probe)."""


@dataclass
class SaturationResult:
    """Saturation quantities of one (site, family) on a probe (theory/definitions.md).

    All norms use the empirical measure of the probe; ``score``, ``raw_score``,
    ``ag_rms`` and ``ag_max`` are in (loss units) per unit function-space step,
    e.g. nats per example.

    Attributes:
        score: ``s = ‖Π g‖``, the saturation score.
        raw_score: ``r̂ = ‖m̂‖`` with ``m̂`` pooling exactly equal units (``nan`` when
            pooling was off).  Exact on finite/discrete populations; for continuous
            units ``r̂ = AG_rms`` (biased upward against the population ``r``).
        ag_rms: ``sqrt(E ‖g‖_F²)`` over whole site tensors.
        ag_max: ``max_x ‖g(x)‖_F`` over the probe (a lower bound of the ess-sup).
        realizability_defect: ``ρ̂ = ‖m̂ − Π m̂‖ / ‖m̂‖`` (``nan`` if pooling was off
            or ``m̂ = 0``); same caveat as ``raw_score``.
        relative_score: ``s / AG_rms`` ∈ [0, 1], scale-free (``nan`` if ``AG_rms = 0``).
        activation_scaled_score: ``s · z_rms`` with ``z_rms = sqrt(E ‖z‖_F²)``: the
            first-order loss decrease for a step the size of the activations.
        tangent_rank: numerical rank of ``K`` (``d · rank Σ`` for feature families).
        tangent_dim: ``p``, the number of tangent coordinates.
        degenerate: ``tangent_rank == 0`` (``T = {0}``): never "saturated".
        saturated: ``score <= tol`` and not degenerate.
        tol: the saturation threshold used.
        cutoff: absolute eigenvalue cutoff used for ``Σ`` / ``K``.
        rtol: relative cutoff (``cutoff / λ_max``).
        n: number of probe examples; ``units``: number of units (rows) seen.
        family: family spec; ``unit``: ``"row"`` or ``"tensor"``.
        dtype: dtype of the forward pass the statistics came from.
        gradient: ``b`` as a float64 numpy vector (``vec_row(G)`` for feature
            families, in the order of the block's tangent parameters).
    """

    score: float
    raw_score: float
    ag_rms: float
    ag_max: float
    realizability_defect: float
    relative_score: float
    activation_scaled_score: float
    tangent_rank: int
    tangent_dim: int
    degenerate: bool
    saturated: bool
    tol: float
    cutoff: float
    rtol: float
    n: int
    units: int
    family: str
    unit: str
    dtype: str
    gradient: np.ndarray = field(repr=False)

    @property
    def verdict(self) -> Verdict:
        """The verdict on the probe (:class:`~depthsat_theory.vocabulary.Verdict`).

        ``DEGENERATE`` when ``T = {0}`` (never "saturated", T4), ``SATURATED`` when
        ``s ≤ tol``, else ``IMPROVABLE`` (theory label ``thm-iff``).  A statement about the
        probe's empirical measure; the population needs the interval of
        :mod:`depthsat_theory.bounds`.
        """
        if self.degenerate:
            return Verdict.DEGENERATE
        return Verdict.SATURATED if self.saturated else Verdict.IMPROVABLE

    def to_dict(self, *, with_gradient: bool = False) -> dict:
        """JSON-ready dictionary (``nan`` becomes ``None``), with the ``verdict`` as its string."""
        d = asdict(self)
        d["verdict"] = self.verdict.value
        grad = d.pop("gradient")
        if with_gradient:
            d["gradient"] = grad.tolist()
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}
