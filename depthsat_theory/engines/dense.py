"""Dense reference implementation (for tests and cross-checks only).

Builds the full tangent Jacobian ``A`` of shape ``(n·|z|, p)`` with
``torch.func.jacrev`` and projects the activation gradient by SVD least squares,
independently of the streaming statistics in :mod:`depthsat_theory.statistics.tangent`.
Cost ``O(n |z| p²)`` time and ``O(n |z| p)`` memory: use at small sizes.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from depthsat_theory.families import ResidualFamily

__all__ = [
    "dense_jacobian",
    "dense_saturation",
]


def dense_jacobian(family: ResidualFamily, z: Tensor, layout: str) -> np.ndarray:
    """``A`` stacked over the probe: ``(n·|z|, p)`` float64, ``A[i] = ∂h_θ(z)_i/∂θ`` at 0.

    Args:
        family: any residual family.
        z: ``(n, *shape)`` probe site tensors.
        layout: the site layout.
    """
    z64 = z.detach().to(torch.float64)
    p = family.param_dim(tuple(z.shape[1:]))
    theta0 = torch.zeros(p, dtype=torch.float64, device=z.device)
    jac = torch.func.jacrev(lambda th: family.functional(th, z64, layout))(theta0)
    return jac.reshape(-1, p).cpu().numpy()


def dense_saturation(family: ResidualFamily, z: Tensor, g: Tensor, layout: str, rcond: float | None = None) -> dict:
    """Reference ``s``, ``b``, ``rank K`` and ``Π g`` from the dense Jacobian.

    ``Π g = A x`` with ``x = argmin ‖A x − g‖`` (``numpy.linalg.lstsq``, SVD based);
    ``s = ‖Π g‖ / sqrt(n)`` in the probe's empirical measure; ``b = Aᵀ g / n``.

    Returns:
        dict with ``score`` (float), ``gradient`` (``(p,)``), ``rank`` (int),
        ``projection`` (``(n, *shape)`` float64 numpy) and ``jacobian``.
    """
    n = z.shape[0]
    a = dense_jacobian(family, z, layout)
    gv = g.detach().to(torch.float64).reshape(-1).cpu().numpy()
    if rcond is None:
        rcond = max(a.shape) * np.finfo(np.float64).eps
    x, _, rank, _ = np.linalg.lstsq(a, gv, rcond=rcond)
    proj = a @ x
    return {
        "score": math.sqrt(float(proj @ proj) / n),
        "gradient": a.T @ gv / n,
        "rank": int(rank),
        "projection": proj.reshape(tuple(z.shape)),
        "jacobian": a,
    }
