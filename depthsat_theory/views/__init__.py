"""Other views of "is this residual network deep enough?", for any residual model with sites.

* :mod:`~depthsat_theory.views.exits` — the residual stream at every depth, per-depth exit
  readouts (logit lens through the final norm and head for language models; a linear readout
  fitted on a training split otherwise), the per-example exit loss table ``ℓ_l(x)``, ShortGPT's
  block influence ``1 − cos(z_in, z_out)`` and the diminishing-returns check of seed 002.
* :mod:`~depthsat_theory.views.stopping` — seed 002's optimal stopping depth: the oracle
  ``argmin_l ℓ_l(x) + c·l`` and a causal confidence-threshold policy tuned on a validation split.
* :mod:`~depthsat_theory.views.regularizer` — the ``L_depth`` training penalty (our reconstruction
  of seed 002's regularizer; see its docstring for where it departs).

The experiment that puts these views next to the first-order criterion on the depth sweep's
models is :mod:`depthsat_theory.experiments.views` (``depthsat experiment views``).
"""

from depthsat_theory.views.exits import (
    ExitTable,
    StreamStates,
    block_influence,
    capture_stream,
    diminishing_returns,
    fit_linear_readouts,
    logit_lens_table,
    readout_table,
    residual_blocks,
    update_ratios,
)
from depthsat_theory.views.regularizer import depth_regularizer, depth_weights
from depthsat_theory.views.stopping import (
    StoppingSummary,
    oracle_stopping_depth,
    stopping_summary,
    threshold_stopping_depth,
    tune_threshold,
)

__all__ = [
    "ExitTable",
    "StoppingSummary",
    "StreamStates",
    "block_influence",
    "capture_stream",
    "depth_regularizer",
    "depth_weights",
    "diminishing_returns",
    "fit_linear_readouts",
    "logit_lens_table",
    "oracle_stopping_depth",
    "readout_table",
    "residual_blocks",
    "stopping_summary",
    "threshold_stopping_depth",
    "tune_threshold",
    "update_ratios",
]
