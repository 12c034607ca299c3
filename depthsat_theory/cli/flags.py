"""The CLI's spelling of the library's Python arguments, and user-facing error messages.

The library names Python arguments in its errors (``leverage_max must be > 0``); the
CLI reports them with its own flags (``--leverage-max must be > 0``).
"""

from __future__ import annotations

import re

from depthsat_theory.bounds import BoundError
from depthsat_theory.diagnose import DiagnoseError

__all__ = ["BOUND_OPTION_DEFAULTS", "CHECK_FLAGS", "DIAGNOSE_FLAGS", "FLAGS", "respell", "user_message"]

#: CLI flag of each Python argument of the bounds (``depthsat score``/``bound``/``diagnose``)
FLAGS: dict[str, str] = {
    "delta": "--delta",
    "n": "--n",
    "epsilon": "--epsilon",
    "grad_max": "--grad-max",
    "leverage_max": "--leverage-max",
    "feature_norm_max": "--feature-norm-max",
    "eig_floor": "--eig-floor",
    "ridge": "--ridge",
    "variance": "--variance",
    "dim": "--dim",
    "score_max": "--score-max",
    "candidates": "--candidates",
    "bootstrap": "--bootstrap",
    "matrix_bound": "--matrix-bound",
}

#: CLI flag of each field of :class:`~depthsat_theory.check.CheckConfig` (``depthsat check``)
CHECK_FLAGS: dict[str, str] = {
    "instances": "--instances",
    "construction_fraction": "--construction-fraction",
    "optimizers": "--optimizers",
    "kinds": "--models",
    "seed": "--seed",
    "device": "--device",
}

#: CLI flag of the arguments :func:`~depthsat_theory.diagnose.diagnose` names in its errors, and of the
#: configuration keys a checkpoint must match (``user.*``: what the CLI stores)
DIAGNOSE_FLAGS: dict[str, str] = {
    "delta": "--delta",
    "checkpoint_every": "--checkpoint-every",
    "realizability": "--rho",
    "beta": "--beta",
    "second_order": "--second-order",
    "curvature": "--curvature",
    "until_decided.max_examples": "--max-examples",
    "until_decided": "--until-decided",
    "max_examples": "--max-examples",
    "decision": "--decision",
    "user.model": "--model",
    "user.seed": "--seed",
    "user.batch_size": "--batch-size",
    "user.device": "--device",
}

#: the options of ``depthsat score`` that act only on the interval, with their defaults
BOUND_OPTION_DEFAULTS: dict[str, object] = {
    "epsilon": None,
    "grad_max": None,
    "leverage_max": None,
    "feature_norm_max": None,
    "eig_floor": None,
    "ridge": 0.0,
    "variance": None,
    "candidates": 1,
    "bootstrap": 200,
    "matrix_bound": "worst-case",
}


def user_message(exc: Exception) -> str:
    """The one-line message of a user-input error, with Python arguments spelled as CLI flags.

    Args:
        exc: the error (a :class:`~depthsat_theory.bounds.BoundError` is respelled with
            :data:`FLAGS`, a :class:`~depthsat_theory.diagnose.DiagnoseError` with
            :data:`DIAGNOSE_FLAGS`; any other error keeps its message).

    Returns:
        The error's message with its Python argument names respelled as CLI flags.
    """
    if isinstance(exc, BoundError):
        return exc.render(FLAGS)
    if isinstance(exc, DiagnoseError):  # CheckpointError included
        return respell(str(exc), DIAGNOSE_FLAGS)
    return str(exc)


def respell(message: str, names: dict[str, str]) -> str:
    """``message`` with every whole-word Python argument of ``names`` replaced by its flag.

    Args:
        message: a library error message that names Python arguments (``instances must be >= 1``).
        names: ``{argument: flag}``.

    Returns:
        The message in the CLI's terms (``--instances must be >= 1``).
    """
    if not names:
        return message
    pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, names)) + r")(?![\w-])")
    return pattern.sub(lambda m: names[m[1]], message)
