"""Residual families ``h_θ`` with ``h_0 ≡ 0``: base classes, built-ins and the spec registry.

- :mod:`.base`: :class:`ResidualFamily`, :class:`FeatureFamily`, :class:`GeneralFamily`,
  :class:`FamilyError`, :func:`to_rows` / :func:`from_rows`;
- :mod:`.builtin`: the feature modules and the factories (:func:`linear`, :func:`polynomial`, :func:`powers`, …);
- :mod:`.specs`: the one spec registry (:data:`FAMILY_SPECS`) behind :func:`parse_family`.
"""

from depthsat_theory.families.base import (
    FamilyError,
    FeatureFamily,
    GeneralFamily,
    ResidualFamily,
    from_rows,
    to_rows,
)
from depthsat_theory.families.builtin import (
    causal_attention,
    conv1x1,
    conv3x3,
    even_features,
    linear,
    polynomial,
    powers,
    preln_mlp,
    product,
    random_features,
)
from depthsat_theory.families.specs import (
    FAMILY_SPECS,
    FamilySpec,
    family_help,
    family_specs,
    is_family_name,
    parse_family,
)

__all__ = [
    "FAMILY_SPECS",
    "FamilyError",
    "FamilySpec",
    "FeatureFamily",
    "GeneralFamily",
    "ResidualFamily",
    "causal_attention",
    "conv1x1",
    "conv3x3",
    "even_features",
    "family_help",
    "family_specs",
    "from_rows",
    "is_family_name",
    "linear",
    "parse_family",
    "polynomial",
    "powers",
    "preln_mlp",
    "product",
    "random_features",
    "to_rows",
]
