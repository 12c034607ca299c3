"""The errors of :mod:`depthsat_theory.grow`."""

from __future__ import annotations

from depthsat_theory.capture.sites import NotFunctionPreservingError

__all__ = ["GrowError", "NotFunctionPreservingError"]


class GrowError(ValueError):
    """Bad growth request: a position outside the layer list, an unsupported architecture, a bad folder."""
