"""Matrix-free streaming statistics of general families ``h(θ, u)`` (``torch.func``; ``K``, ``b``)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from depthsat_theory.families import GeneralFamily, to_rows
from depthsat_theory.statistics.linalg import default_rtol, pinv_quadratic
from depthsat_theory.statistics.protocol import Reduction
from depthsat_theory.statistics.result import SaturationResult, StatisticsError
from depthsat_theory.statistics.tangent import TangentStatistics
from depthsat_theory.vocabulary import Layout

__all__ = ["GeneralStatistics"]


#: Elements of site tensors held at once by the vmapped Gram products of GeneralStatistics.
_CHUNK_ELEMENTS = 1 << 22


class GeneralStatistics(TangentStatistics):
    """Matrix-free statistics for a :class:`GeneralFamily` (any ``h(θ, u)``).

    Per batch, ``b += Σ A(u)ᵀ g(u)`` is one ``torch.func.vjp`` and the Gram matrix
    ``K += Σ A(u)ᵀ A(u)`` is formed column by column as ``Aᵀ(A e_i)`` (a ``jvp``
    followed by a ``vjp``, vmapped in chunks), so no Jacobian is stored; memory is
    ``O(p² + chunk · |batch|)``, time ``p`` jvp+vjp pairs per batch.

    Raises:
        FamilyError: if the family does not fit the site.
    """

    def __init__(self, family: GeneralFamily, shape, layout: str, *, pool_ties: bool = False):
        super().__init__(family, shape, layout, pool_ties=pool_ties)
        self.p = family.param_dim(self.shape)
        self.add_state("k_mat", torch.zeros(self.p, self.p, dtype=torch.float64), Reduction.SUM)
        self.add_state("b", torch.zeros(self.p, dtype=torch.float64), Reduction.SUM)

    @property
    def k_mat(self) -> Tensor:
        """The raw sum ``Σ_x Σ_u A(u)ᵀ A(u)`` (float64 ``(p, p)``; :meth:`tangent_gram` is the mean)."""
        return self.states["k_mat"]

    @property
    def b(self) -> Tensor:
        """The raw sum ``Σ_x Σ_u A(u)ᵀ g(u)`` (float64 ``(p,)``; :meth:`gradient` is the mean)."""
        return self.states["b"]

    def update(self, z: Tensor, g: Tensor, mask: Tensor | None = None) -> None:
        """Add a batch (see :meth:`FeatureStatistics.update`, including ``mask``)."""
        mask = self._row_mask(z, g, mask)
        self._common(z, g, mask)
        z64 = z.detach().to(torch.float64)
        g64 = g.detach().to(torch.float64)
        layout = self.layout
        if mask is not None:  # row-wise family: the kept rows as a batch of vectors
            z64, g64, layout = z64[mask], g64[mask], Layout.VECTOR
        theta0 = torch.zeros(self.p, dtype=torch.float64, device=z.device)

        def h(theta):
            return self.family.functional(theta, z64, layout)

        vjp_fn = torch.func.vjp(h, theta0)[1]
        b_sum = self.states["b"].to(z.device) + vjp_fn(g64)[0]

        def gram_column(v: Tensor) -> Tensor:  # Aᵀ(A v): one jvp and one vjp
            return vjp_fn(torch.func.jvp(h, (theta0,), (v,))[1])[0]

        eye = torch.eye(self.p, dtype=torch.float64, device=z.device)
        chunk = max(1, min(self.p, _CHUNK_ELEMENTS // max(z.numel(), 1)))
        cols = torch.func.vmap(gram_column, chunk_size=chunk)(eye)
        if not (bool(torch.isfinite(cols).all()) and bool(torch.isfinite(b_sum).all())):
            raise StatisticsError(
                f"the tangent map ∂θ h(θ, u) at θ = 0 of family {self.family.spec!r} is NaN or Inf "
                f"on this batch: the family is not differentiable at the origin (theory label "
                f"asm-differentiable; e.g. sqrt(θ) or u**θ), or its tangent overflows float64"
            )
        self.states["b"] = b_sum
        self.states["k_mat"] = self.states["k_mat"].to(z.device) + 0.5 * (cols + cols.T)
        if mask is not None:
            self.states["units"] += int(mask.sum())
        else:
            rows = to_rows(z, self.layout).shape[1] if self.family.unit == "row" else 1
            self.states["units"] += int(z.shape[0]) * rows

    def tangent_gram(self) -> np.ndarray:
        """``K = E[Σ_u A(u)ᵀ A(u)]``, the per-example mean tangent Gram (def-score).

        Returns:
            float64 numpy array ``(p, p)``, ``p`` the family's number of tangent parameters.

        Raises:
            StatisticsError: if no examples were accumulated.
        """
        self._require_examples()
        return (self.k_mat / self.n).cpu().numpy()

    def gradient(self) -> np.ndarray:
        """``b = E[Σ_u A(u)ᵀ g(u)]``, equal to autograd's gradient of the mean loss at ``θ = 0``.

        Returns:
            float64 numpy vector ``(p,)`` in (loss units) per example per unit of ``θ``.

        Raises:
            StatisticsError: if no examples were accumulated.
        """
        self._require_examples()
        return (self.b / self.n).cpu().numpy()

    def result(self, *, rtol: float | None = None, tol: float | None = None) -> SaturationResult:
        """Compute ``s² = bᵀ K⁺ b`` (eigh with a relative cutoff) and the other quantities."""
        if self.n == 0:
            raise StatisticsError("no examples were accumulated: the probe is empty")
        rtol = default_rtol(self.dtype or torch.float64, self.p) if rtol is None else float(rtol)
        kmat, b = self.tangent_gram(), self.gradient()
        self._check_finite(kmat, b)
        s2, rank, cutoff, inv = pinv_quadratic(kmat, b[None, :], rtol)
        self._coef = torch.from_numpy(inv @ b)  # Π g (u) = A(u) K⁻ b
        return self._finish(s2, b, rank, self.p, cutoff, rtol, tol)

    def _project_units(self, units: Tensor) -> Tensor:
        theta0 = torch.zeros(self.p, dtype=torch.float64)
        if self.family.unit == "row":
            site, layout = units.to(torch.float64), Layout.VECTOR
        else:
            site, layout = units.reshape(units.shape[0], *self.shape).to(torch.float64), self.layout
        out = torch.func.jvp(lambda th: self.family.functional(th, site, layout), (theta0,), (self._coef,))[1]
        return out.reshape(units.shape[0], -1)
