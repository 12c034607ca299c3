"""Reference engines answering the numeric engine's questions: dense ``torch.func`` and symbolic (sympy)."""

from depthsat_theory.engines.dense import (
    dense_jacobian,
    dense_saturation,
)

__all__ = [
    "dense_jacobian",
    "dense_saturation",
]
