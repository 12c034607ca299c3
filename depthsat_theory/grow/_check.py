"""Function preservation on a probe batch, with a dtype-scaled tolerance (``def-family``)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from depthsat_theory.capture.insertion import first_output
from depthsat_theory.capture.probe import call_model
from depthsat_theory.capture.sites import NotFunctionPreservingError

#: Multiple of the unit roundoff (times ``max(1, max |f(x)|)``) that the output may move.
TOLERANCE_FACTOR = 64.0


def reference_output(model: nn.Module, probe: Any) -> Tensor:
    """The primary output tensor of ``model`` on ``probe`` (no gradient), detached."""
    with torch.no_grad():
        return first_output(call_model(model, probe)).detach()


def tolerance(ref: Tensor) -> float:
    """``64 u max(1, max |f(x)|)``, ``u`` the unit roundoff of the output's dtype."""
    u = torch.finfo(ref.dtype).eps / 2 if ref.is_floating_point() else 0.0
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    return TOLERANCE_FACTOR * u * max(1.0, scale if math.isfinite(scale) else 1.0)


def check_preserved(ref: Tensor, grown: nn.Module, probe: Any, why: str = "") -> tuple[float, float]:
    """Measure ``max |f(x) − f_grown(x)|`` on ``probe`` and refuse a grown model that moved.

    Args:
        ref: the original model's output on ``probe`` (:func:`reference_output`).
        grown: the grown model.
        probe: a batch both models accept (a tensor, or a mapping of keyword tensors).
        why: extra text for the error message.

    Returns:
        ``(deviation, tol)``.

    Raises:
        NotFunctionPreservingError: if the deviation exceeds :func:`tolerance` (or is NaN).
    """
    new = reference_output(grown, probe)
    if new.shape != ref.shape:
        raise NotFunctionPreservingError(
            f"the grown model's output has shape {tuple(new.shape)}, the original's {tuple(ref.shape)}"
        )
    dev = float((new.to(ref.dtype) - ref).abs().max()) if ref.numel() else 0.0
    tol = tolerance(ref)
    if not dev <= tol:
        raise NotFunctionPreservingError(
            f"the grown model's output moved by {dev:.3g} (> tolerance {tol:.3g}) on the probe batch: "
            f"the growth is not function-preserving{why}"
        )
    return dev, tol
