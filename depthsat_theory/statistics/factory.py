"""Choose the streaming statistics that fit a residual family."""

from __future__ import annotations

from depthsat_theory.families import FamilyError, FeatureFamily, GeneralFamily, ResidualFamily
from depthsat_theory.statistics.feature import FeatureStatistics
from depthsat_theory.statistics.general import GeneralStatistics

__all__ = ["statistics_for"]


def statistics_for(
    family: ResidualFamily,
    shape: tuple[int, ...],
    layout: str,
    *,
    pool_ties: bool = False,
    products: str = "float64",
    gram: str = "auto",
) -> FeatureStatistics | GeneralStatistics:
    """The streaming statistics that fit a residual family at an insertion site.

    Feed them with ``update(z, g)`` (``z``, ``g``: ``(B, *shape)`` float32/float64 site
    tensors and activation gradients of the per-example loss) and read ``result()``, a
    :class:`~depthsat_theory.statistics.SaturationResult` (scores in loss units per unit
    function-space step, e.g. nats per example; theory/definitions.md, ``def-score``).

    Args:
        family: the residual family (a :class:`~depthsat_theory.families.FeatureFamily`
            or a :class:`~depthsat_theory.families.GeneralFamily`).
        shape: the per-example site shape, ``(d,)``, ``(T, d)`` or ``(C, H, W)``.
        layout: ``"vector"``, ``"sequence"`` or ``"image"``
            (:class:`~depthsat_theory.vocabulary.Layout`).
        pool_ties: also pool exactly equal units for ``r̂`` and ``ρ̂`` (memory grows with
            the number of distinct units).
        products: dtype of the per-batch products of feature families, ``"float64"`` (default)
            or ``"float32"`` (:class:`FeatureStatistics`; general families always use float64).
        gram: ``"auto"`` (default), ``"features"`` or ``"units"``: whether a feature family streams the
            ``k̃ × k̃`` Gram or keeps the unit rows (:class:`FeatureStatistics`, theory/numerics.md
            ``thm-unit-gram``); ignored by general families.

    Raises:
        FamilyError: if the family does not fit the site (shape or layout) or has no statistics.

    Returns:
        :class:`FeatureStatistics` for feature families (cross-gradient path),
        :class:`GeneralStatistics` otherwise (matrix-free ``torch.func`` path).
    """
    if isinstance(family, FeatureFamily):
        return FeatureStatistics(family, shape, layout, pool_ties=pool_ties, products=products, gram=gram)
    if isinstance(family, GeneralFamily):
        return GeneralStatistics(family, shape, layout, pool_ties=pool_ties)
    raise FamilyError(f"no statistics for family type {type(family).__name__}")
