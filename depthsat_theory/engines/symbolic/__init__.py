"""Symbolic (sympy) engine: exact answers to the numeric engine's questions.

Mirrors :mod:`depthsat_theory.families.base`, :mod:`depthsat_theory.statistics` and
:mod:`depthsat_theory.optimizers.updates` with exact sympy arithmetic so results can be
cross-checked (theory/definitions.md; theory labels thm-gradient T1, thm-iff T2,
thm-update-invariance T3, thm-reparameterization T4, thm-zero-output T5,
thm-realizability T6):

- :mod:`.algebra`: exact zero tests and simplification (:func:`is_zero`, :func:`simplified`);
- :mod:`.family`: :class:`SymbolicFamily` (parse text, built-in factories);
- :mod:`.measures`: :class:`FiniteMeasure`, :class:`ProductMeasure` (``sympy.stats``);
- :mod:`.engine`: tangent map, ``K``, ``b``, projection, ``s``, ``r``, ``ρ``, ranks,
  reparameterizations, :class:`SymbolicSaturation`;
- :mod:`.optimizers`: zero-state first steps derived from update equations;
- :mod:`.bridge`: numpy/torch functions, :class:`~depthsat_theory.families.base.GeneralFamily`
  wrappers and numeric probes from measures.
"""

from depthsat_theory.engines.symbolic.algebra import is_zero, simplified
from depthsat_theory.engines.symbolic.bridge import (
    finite_support,
    lambdify_family,
    lambdify_matrix,
    lambdify_units,
    replicated_support,
    sample,
    to_general_family,
)
from depthsat_theory.engines.symbolic.engine import (
    SymbolicSaturation,
    gradient,
    is_degenerate,
    is_function_preserving,
    is_regular_reparameterization,
    projection,
    raw_score,
    realizability_defect,
    reparameterize,
    saturation,
    saturation_score,
    tangent_gram,
    tangent_map,
    tangent_rank,
)
from depthsat_theory.engines.symbolic.family import (
    ALLOWED_FUNCTIONS,
    SymbolicFamily,
    elementwise_square_param,
    linear,
    param_symbols,
    polynomial,
    powers,
    product,
    random_features,
    unit_symbols,
)
from depthsat_theory.engines.symbolic.measures import (
    FiniteMeasure,
    Measure,
    MeasureError,
    ProductMeasure,
    as_measure,
    finite_density,
)
from depthsat_theory.engines.symbolic.optimizers import (
    EXTRA_UPDATES,
    SYMBOLIC_UPDATES,
    FirstOrderChange,
    default_hyper,
    first_order_change,
    is_descent_compatible,
    zero_state_step,
    zero_state_update,
)
from depthsat_theory.engines.symbolic.secondorder import SymbolicSaddle, saddle

__all__ = [
    "ALLOWED_FUNCTIONS",
    "EXTRA_UPDATES",
    "SYMBOLIC_UPDATES",
    "FiniteMeasure",
    "FirstOrderChange",
    "Measure",
    "MeasureError",
    "ProductMeasure",
    "SymbolicFamily",
    "SymbolicSaddle",
    "SymbolicSaturation",
    "as_measure",
    "default_hyper",
    "elementwise_square_param",
    "finite_density",
    "finite_support",
    "first_order_change",
    "gradient",
    "is_degenerate",
    "is_descent_compatible",
    "is_function_preserving",
    "is_regular_reparameterization",
    "is_zero",
    "lambdify_family",
    "lambdify_matrix",
    "lambdify_units",
    "linear",
    "param_symbols",
    "polynomial",
    "powers",
    "product",
    "projection",
    "random_features",
    "raw_score",
    "realizability_defect",
    "reparameterize",
    "replicated_support",
    "saddle",
    "sample",
    "saturation",
    "saturation_score",
    "simplified",
    "tangent_gram",
    "tangent_map",
    "tangent_rank",
    "to_general_family",
    "unit_symbols",
    "zero_state_step",
    "zero_state_update",
]
