"""Matrix-free streaming statistics of general families ``h(θ, u)`` (``torch.func``; ``K``, ``b``)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from depthsat_theory.families import GeneralFamily, to_rows
from depthsat_theory.statistics.linalg import NOISE_ALPHA, resolve_spectrum
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
        self.add_state("q_sum", torch.zeros(self.p, self.p, dtype=torch.float64), Reduction.SUM)

    @property
    def k_mat(self) -> Tensor:
        """The raw sum ``Σ_x Σ_u A(u)ᵀ A(u)`` (float64 ``(p, p)``; :meth:`tangent_gram` is the mean)."""
        return self.states["k_mat"]

    @property
    def b(self) -> Tensor:
        """The raw sum ``Σ_x Σ_u A(u)ᵀ g(u)`` (float64 ``(p,)``; :meth:`gradient` is the mean)."""
        return self.states["b"]

    def update(self, z: Tensor, g: Tensor, mask: Tensor | None = None) -> None:
        """Add a batch (see :meth:`FeatureStatistics.update`, including ``mask``).

        Args:
            z: ``(B, *shape)`` activations.
            g: ``(B, *shape)`` gradients of the per-example losses w.r.t. ``z``.
            mask: optional padding mask, bool ``(B, T)``, ``True`` at real tokens.

        Raises:
            StatisticsError: as :meth:`FeatureStatistics.update`, or if the tangent map is NaN/Inf on this batch.
        """
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
        per_ex = self._per_example_gradients(z, g, mask)  # b_x per example: b and the noise moment
        b_sum = self.states["b"].to(z.device) + per_ex.sum(0)

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
        self.states["q_sum"] = self.states["q_sum"].to(z.device) + per_ex.T @ per_ex
        if mask is not None:
            self._count_units(int(mask.sum()))
        else:
            rows = to_rows(z, self.layout).shape[1] if self.family.unit == "row" else 1
            self._count_units(int(z.shape[0]) * rows)

    def _per_example_gradients(self, z: Tensor, g: Tensor, mask: Tensor | None) -> Tensor:
        """``b_x = Σ_u A(u)ᵀ g(u)`` for every example ``(B, p)`` (padded rows left out)."""
        z64, g64 = z.detach().to(torch.float64), g.detach().to(torch.float64)
        theta0 = torch.zeros(self.p, dtype=torch.float64, device=z.device)
        if mask is not None:  # row-wise family: one vector per kept row, summed per example
            owner = torch.arange(z.shape[0], device=z.device)[:, None].expand(mask.shape)[mask]
            zr, gr, layout = z64[mask], g64[mask], Layout.VECTOR
        else:
            owner, zr, gr, layout = None, z64, g64, self.layout

        def one(zi: Tensor, gi: Tensor) -> Tensor:
            return torch.func.vjp(lambda th: self.family.functional(th, zi[None], layout), theta0)[1](gi[None])[0]

        rows = torch.func.vmap(one)(zr, gr)
        if owner is None:
            return rows
        return torch.zeros(z.shape[0], self.p, dtype=torch.float64, device=z.device).index_add_(0, owner, rows)

    def noise_moment(self) -> np.ndarray:
        """``E[b_x b_xᵀ]`` over examples ``(p, p)`` float64 (the noise test's ``v̂ = tr(K⁻ E[b_x b_xᵀ])``).

        Returns:
            ``E[b_x b_xᵀ]``, ``(p, p)`` float64.

        Raises:
            StatisticsError: if no examples were accumulated.
        """
        self._require_examples()
        return (self.states["q_sum"] / self.n).cpu().numpy()

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

    def result(
        self, *, rtol: float | None = None, tol: float | None = None, alpha: float = NOISE_ALPHA
    ) -> SaturationResult:
        """Compute ``s² = bᵀ K⁺ b``, its rounding bound and the noise test (see :meth:`FeatureStatistics.result`).

        Args:
            rtol: an explicit relative eigenvalue cutoff for the unit-diagonal ``K̃``.
            tol: an explicit saturation threshold (default: the rounding bound).
            alpha: level of the noise test (``thm-noise-test``), in ``(0, 0.215]``.

        Returns:
            The site's :class:`SaturationResult`.

        Raises:
            StatisticsError: if no examples were accumulated or the sums overflowed.
        """
        self._require_examples()
        kmat, b = self.tangent_gram(), self.gradient()
        self._check_finite(kmat, b)
        spec = resolve_spectrum(kmat, dtype=self._features_dtype(), rtol=rtol)
        inv = spec.pinv()
        self._coef = torch.from_numpy(inv @ b)  # Π g (u) = A(u) K⁻ b
        moment = self.noise_moment()
        q_trace = float(np.sum(inv * moment))
        return self._finish(
            spec,
            spec.quadratic(b[None, :]),
            b,
            self.p,
            tol,
            q_trace=q_trace,
            alpha=alpha,
            grad_rows=b[None, :],
            noise_moment=moment,
        )

    def _project_units(self, units: Tensor) -> Tensor:
        theta0 = torch.zeros(self.p, dtype=torch.float64)
        if self.family.unit == "row":
            site, layout = units.to(torch.float64), Layout.VECTOR
        else:
            site, layout = units.reshape(units.shape[0], *self.shape).to(torch.float64), self.layout
        out = torch.func.jvp(lambda th: self.family.functional(th, site, layout), (theta0,), (self._coef,))[1]
        return out.reshape(units.shape[0], -1)
