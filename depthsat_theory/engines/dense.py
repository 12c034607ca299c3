"""Dense reference implementation (for tests and cross-checks only).

Builds the full tangent Jacobian ``A`` of shape ``(n·|z|, p)`` with
``torch.func.jacrev`` and projects the activation gradient by SVD least squares,
independently of the streaming statistics in :mod:`depthsat_theory.statistics`.
Cost ``O(n |z| p²)`` time and ``O(n |z| p)`` memory: use at small sizes.

:class:`DenseSaturation` uses the field names of
:class:`depthsat_theory.statistics.SaturationResult` (``score``, ``gradient``,
``tangent_rank``, ``tangent_dim``, ``degenerate``, ``saturated``, ``tol``, ``ag_rms``,
``ag_max``, ``relative_score``, ``n``) so the numeric, dense and symbolic engines can be
compared field by field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from depthsat_theory.families import ResidualFamily
from depthsat_theory.statistics import default_tol
from depthsat_theory.vocabulary import Layout, Verdict

__all__ = [
    "DenseSaturation",
    "dense_jacobian",
    "dense_saturation",
]


def dense_jacobian(family: ResidualFamily, z: Tensor, layout: Layout | str) -> np.ndarray:
    """``A`` stacked over the probe: ``(n·|z|, p)`` float64, ``A[i] = ∂h_θ(z)_i/∂θ`` at 0.

    Args:
        family: any residual family.
        z: ``(n, *shape)`` probe site tensors (any floating dtype and device; the
            Jacobian is taken in float64 on ``z``'s device).
        layout: the site layout (:class:`~depthsat_theory.vocabulary.Layout` or its string).

    Returns:
        The float64 numpy array ``A`` of shape ``(n·|z|, p)`` with ``|z| = prod(shape)``.
    """
    z64 = z.detach().to(torch.float64)
    p = family.param_dim(tuple(z.shape[1:]))
    theta0 = torch.zeros(p, dtype=torch.float64, device=z.device)
    with torch.no_grad():  # build (and cache) lazily created feature modules outside the transform
        family.functional(theta0, z64, str(layout))
    jac = torch.func.jacrev(lambda th: family.functional(th, z64, str(layout)))(theta0)
    return jac.reshape(-1, p).cpu().numpy()


@dataclass
class DenseSaturation:
    """Saturation quantities from the dense Jacobian (theory/definitions.md).

    Field names are those of :class:`depthsat_theory.statistics.SaturationResult`; norms
    use the probe's empirical measure (loss units per unit function-space step).

    Attributes:
        score: ``s = ‖Π g‖ = sqrt(‖A x*‖² / n)`` with ``x* = argmin ‖A x − g‖``.
        ag_rms: ``sqrt(E ‖g‖_F²)`` over whole site tensors.
        ag_max: ``max_x ‖g(x)‖_F`` over the probe.
        relative_score: ``s / ag_rms`` (``nan`` if ``ag_rms = 0``).
        tangent_rank: numerical rank of ``A`` (``= rank K``, SVD with cutoff ``rcond``).
        tangent_dim: ``p``, the number of tangent coordinates.
        degenerate: ``tangent_rank == 0`` (``T = {0}``): never saturated.
        saturated: ``score <= tol`` and not degenerate.
        tol: the saturation threshold used.
        n: number of probe examples.
        gradient: ``b = Aᵀ g / n``, float64 ``(p,)`` (``vec_row(G)`` for feature families).
        projection: ``Π g = A x*``, float64 numpy of shape ``(n, *shape)``.
        jacobian: ``A``, float64 numpy of shape ``(n·|z|, p)``.
    """

    score: float
    ag_rms: float
    ag_max: float
    relative_score: float
    tangent_rank: int
    tangent_dim: int
    degenerate: bool
    saturated: bool
    tol: float
    n: int
    gradient: np.ndarray = field(repr=False)
    projection: np.ndarray = field(repr=False)
    jacobian: np.ndarray = field(repr=False)

    @property
    def probe_verdict(self) -> Verdict:
        """The verdict on this measure itself, equal to :attr:`verdict` (no sampling to test)."""
        return self.verdict

    @property
    def verdict(self) -> Verdict:
        """:attr:`Verdict.DEGENERATE`, :attr:`Verdict.SATURATED` or :attr:`Verdict.IMPROVABLE`."""
        if self.degenerate:
            return Verdict.DEGENERATE
        return Verdict.SATURATED if self.saturated else Verdict.IMPROVABLE


def dense_saturation(
    family: ResidualFamily,
    z: Tensor,
    g: Tensor,
    layout: Layout | str,
    rcond: float | None = None,
    tol: float | None = None,
) -> DenseSaturation:
    """Reference ``s``, ``b``, ``rank K`` and ``Π g`` from the dense Jacobian.

    ``Π g = A x`` with ``x = argmin ‖A x − g‖`` (``numpy.linalg.lstsq``, SVD based);
    ``s = ‖Π g‖ / sqrt(n)`` in the probe's empirical measure; ``b = Aᵀ g / n``
    (theory/definitions.md; thm-gradient T1, thm-iff T2).

    Args:
        family: any residual family.
        z: ``(n, *shape)`` probe site tensors.
        g: ``(n, *shape)`` activation gradients (same shape as ``z``).
        layout: the site layout.
        rcond: SVD cutoff relative to the largest singular value (default
            ``max(A.shape) · eps(float64)``).
        tol: saturation threshold (default
            :func:`depthsat_theory.statistics.default_tol` for float64 and this ``ag_rms``).

    Returns:
        A :class:`DenseSaturation`.
    """
    n = z.shape[0]
    a = dense_jacobian(family, z, layout)
    g64 = g.detach().to(torch.float64).reshape(n, -1).cpu().numpy()
    gv = g64.reshape(-1)
    if rcond is None:
        rcond = max(a.shape) * np.finfo(np.float64).eps
    x, _, rank, _ = np.linalg.lstsq(a, gv, rcond=rcond)
    proj = a @ x
    score = math.sqrt(float(proj @ proj) / n)
    ag_rms = math.sqrt(float(gv @ gv) / n)
    tol = default_tol(torch.float64, ag_rms) if tol is None else float(tol)
    degenerate = int(rank) == 0
    return DenseSaturation(
        score=score,
        ag_rms=ag_rms,
        ag_max=float(np.sqrt((g64**2).sum(axis=1)).max()),
        relative_score=score / ag_rms if ag_rms > 0 else math.nan,
        tangent_rank=int(rank),
        tangent_dim=a.shape[1],
        degenerate=degenerate,
        saturated=(not degenerate) and score <= tol,
        tol=tol,
        n=n,
        gradient=a.T @ gv / n,
        projection=proj.reshape(tuple(z.shape)),
        jacobian=a,
    )
