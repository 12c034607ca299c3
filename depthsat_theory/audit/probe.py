"""The documented default probe of ``depthsat audit`` (:func:`synthetic_probe`)."""

from __future__ import annotations

import math

import numpy as np

from depthsat_theory.audit.loading import LoadedFamily
from depthsat_theory.families import ResidualFamily
from depthsat_theory.vocabulary import Layout

__all__ = ["SYNTHETIC_PROBE", "synthetic_probe"]

#: Description of the default probe (see :func:`synthetic_probe`).
SYNTHETIC_PROBE = (
    "synthetic probe (seed 0, float64): units u ~ N(0, I_d), d = 8 unless the family fixes d; "
    "g(u) = tanh(Ω₁u + β)·Ω₂ᵀ row-wise with Ω₁ ∈ R^(16×d) ~ N(0, 1/d), β ~ N(0, 1/4), "
    "Ω₂ ∈ R^(d×16) ~ N(0, 1/16); vector sites: n = 256 rows; sequence sites: 32 × 8 tokens; "
    "image sites: 32 × d × 4 × 4"
)


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
    layouts = getattr(fam, "layouts", (Layout.VECTOR,)) if fam is not None else (Layout.VECTOR,)
    layout = next((lay for lay in Layout if lay in layouts), Layout.VECTOR)
    rng = np.random.default_rng(seed)
    w1 = rng.normal(size=(16, d)) / math.sqrt(d)
    beta = rng.normal(size=16) * 0.5
    w2 = rng.normal(size=(d, 16)) / 4.0
    shape = {Layout.VECTOR: (256, d), Layout.SEQUENCE: (32, 8, d), Layout.IMAGE: (32, d, 4, 4)}[layout]
    z = rng.normal(size=shape)
    rows = np.moveaxis(z, 1, -1) if layout == Layout.IMAGE else z
    grows = np.tanh(rows @ w1.T + beta) @ w2.T
    g = np.ascontiguousarray(np.moveaxis(grows, -1, 1) if layout == Layout.IMAGE else grows)
    label = f"{SYNTHETIC_PROBE} (here: {layout}, shape {shape})"
    return z, g, layout, label
