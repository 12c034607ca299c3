"""The CLI's spelling of the library's Python arguments, and user-facing error messages.

The library names Python arguments in its errors (``leverage_max must be > 0``); the
CLI reports them with its own flags (``--leverage-max must be > 0``).
"""

from __future__ import annotations

from depthsat_theory.bounds import BoundError

__all__ = ["BOUND_OPTION_DEFAULTS", "FLAGS", "user_message"]

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
}


def user_message(exc: Exception) -> str:
    """The one-line message of a user-input error, with Python arguments spelled as CLI flags.

    Args:
        exc: the error (a :class:`~depthsat_theory.bounds.BoundError` is respelled with
            :data:`FLAGS`; any other error keeps its message).
    """
    if isinstance(exc, BoundError):
        return exc.render(FLAGS)
    return str(exc)
