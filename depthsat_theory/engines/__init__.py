"""Reference engines answering the numeric engine's questions: dense ``torch.func`` and symbolic (sympy).

Both return results with the field names of :class:`depthsat_theory.statistics.SaturationResult`
(``score``, ``gradient``, ``tangent_rank``, ``tangent_dim``, ``degenerate``, ``saturated``):
:class:`DenseSaturation` here, :class:`~depthsat_theory.engines.symbolic.SymbolicSaturation`
in :mod:`depthsat_theory.engines.symbolic` (imported on demand: it needs sympy).
"""

from depthsat_theory.engines.dense import (
    DenseSaturation,
    dense_jacobian,
    dense_saturation,
)

__all__ = [
    "DenseSaturation",
    "dense_jacobian",
    "dense_saturation",
]
