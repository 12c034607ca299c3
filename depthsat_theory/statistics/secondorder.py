r"""Second order at the origin of a zero-output family: the cross block and the saddle score.

For ``h(u) = W φ_ψ(u) + c`` at ``W = 0, c = 0`` the Hessian of ``J`` in ``(W, c, ψ)`` has a zero
``ψψ`` block and the cross block

.. math::

    C[\delta W, \delta\psi] = \mathbb E \sum_t g_t^\top \delta W\, \partial_\psi\varphi(u_t)\,\delta\psi
    = \langle \delta W, \partial_\psi G\,[\delta\psi] \rangle_F ,

the derivative of the cross-gradient ``G(ψ) = E Σ_t g_t φ̃_ψ(u_t)ᵀ`` in the feature parameters
(theory/second-order.md, ``thm-strict-saddle``).  When ``G = 0`` and ``C ≠ 0`` the origin is a
strict saddle: a block can still lower the loss, at second order.  The *saddle score* is the
operator norm of ``C`` with ``δW`` measured in function space (``‖δW φ̃‖ = ‖δW Σ^{1/2}‖_F``) and
``δψ`` in the Euclidean norm of the feature parameters,

.. math::

    \sigma = \sup_{\delta\psi \ne 0} \frac{\lVert \partial_\psi G[\delta\psi]\, \Sigma^{+1/2}\rVert_F}
    {\lVert\delta\psi\rVert} ,

so ``−σ`` is the most negative eigenvalue of the Hessian's cross part ``[[0, C], [Cᵀ, 0]]`` in those
coordinates (nats per example per unit function-space step per unit feature-parameter step).

:class:`CrossBlockStatistics` streams ``∂_ψ G`` for the random-feature families
``relu:K``, ``gelu:K``, ``tanh:K`` (``φ_j(u) = σ(a_jᵀ u + β_j)``, ``ψ_j = (a_j, β_j)``), whose
cross block is block-diagonal over features: ``∂_ψ G[δψ]`` has column ``j`` equal to
``C_j δψ_j`` with ``C_j = E Σ_t g_t σ'(a_jᵀu_t + β_j) (u_t, 1)ᵀ ∈ R^{d×(d+1)}``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse.linalg as spla
import torch
from torch import Tensor

from depthsat_theory.families import FamilyError, FeatureFamily, to_rows
from depthsat_theory.statistics.result import StatisticsError

__all__ = ["CROSS_BLOCK_MAX_ELEMENTS", "CrossBlockStatistics", "SaddleResult", "saddle_score_from_blocks"]

#: Largest ``K·d·(d+1)`` (entries of the stored cross block) streamed per site.
CROSS_BLOCK_MAX_ELEMENTS = 1 << 23


@dataclass(frozen=True)
class SaddleResult:
    """The second-order quantities of one site (theory/second-order.md).

    Attributes:
        saddle_score: ``σ``, the operator norm of the cross block ``C`` (``δW`` in function space,
            ``δψ`` Euclidean); ``−σ`` is the most negative eigenvalue of ``[[0, C], [Cᵀ, 0]]``.
            Units: loss units per example per unit function-space step per unit ``ψ`` step.
        cross_block_norm: the Frobenius norm of ``∂_ψ G`` (unwhitened ``δW``).
        feature_parameters: ``q``, the number of feature parameters ``ψ``.
        feature_ties: units whose pre-activation is exactly at a kink of the activation
            (``relu`` at ``0``): ``C`` is then a one-sided convention there.
        n: probe examples.
    """

    saddle_score: float
    cross_block_norm: float
    feature_parameters: int
    feature_ties: int
    n: int

    def to_dict(self) -> dict:
        """JSON-ready dictionary.

        Returns:
            A ``dict`` with ``saddle_score``, ``cross_block_norm``, ``feature_parameters`` and ``feature_ties``.
        """
        return {
            "saddle_score": self.saddle_score,
            "cross_block_norm": self.cross_block_norm,
            "feature_parameters": self.feature_parameters,
            "feature_ties": self.feature_ties,
        }


def _pinv_psd(sigma: np.ndarray, rtol: float) -> np.ndarray:
    w, v = np.linalg.eigh((sigma + sigma.T) / 2)
    cut = rtol * max(float(w.max()), 0.0)
    keep = w > cut
    return (v[:, keep] / w[keep]) @ v[:, keep].T


def saddle_score_from_blocks(blocks: np.ndarray, sigma: np.ndarray, *, rtol: float = 1e-10) -> float:
    """``σ = sup ‖X(δψ) Σ^{+1/2}‖_F / ‖δψ‖`` for a block-diagonal cross block.

    Args:
        blocks: ``(K, d, e)`` float64, ``C_j`` (``e`` parameters per feature).
        sigma: ``(k̃, k̃)`` float64 feature Gram ``Σ = E Σ_t φ̃ φ̃ᵀ`` with ``k̃ ≥ K`` (features
            first, then the constant when the block has an output bias).
        rtol: relative eigenvalue cutoff of ``Σ⁺``.

    Returns:
        ``σ ≥ 0`` (``X(δψ)`` has column ``j`` equal to ``C_j δψ_j`` and zero constant column).

    Raises:
        StatisticsError: if the shapes do not fit.
    """
    kf, _, e = blocks.shape
    if sigma.shape[0] < kf or sigma.shape[0] != sigma.shape[1]:
        raise StatisticsError(f"sigma of shape {sigma.shape} does not fit {kf} feature blocks")
    sp = _pinv_psd(sigma, rtol)[:kf, :kf]
    q = kf * e
    if q == 0 or not np.any(blocks):
        return 0.0

    def gram(v: np.ndarray) -> np.ndarray:
        x = np.einsum("jde,je->dj", blocks, v.reshape(kf, e))  # δG's feature columns
        return np.einsum("jde,dj->je", blocks, x @ sp).reshape(-1)

    if q <= 256:
        dense = np.stack([gram(col) for col in np.eye(q)], axis=1)
        top = float(np.linalg.eigvalsh((dense + dense.T) / 2)[-1])
    else:
        op = spla.LinearOperator((q, q), matvec=gram, dtype=np.float64)
        v0 = np.random.default_rng(0).standard_normal(q)
        top = float(spla.eigsh(op, k=1, which="LA", v0=v0, tol=1e-10, return_eigenvectors=False)[0])
    return float(np.sqrt(max(top, 0.0)))


class CrossBlockStatistics:
    """Streams the cross block ``∂_ψ G`` and ``Σ`` of a random-feature family at one site.

    Args:
        family: a ``relu:K``, ``gelu:K`` or ``tanh:K`` family (feature map ``σ(a_jᵀu + β_j)``).
        shape: per-example site shape; layout: ``"vector"``, ``"sequence"`` or ``"image"``.

    Raises:
        FamilyError: another family (no elementwise feature parameters), or a cross block
            above :data:`CROSS_BLOCK_MAX_ELEMENTS` entries.
    """

    def __init__(self, family: FeatureFamily, shape: tuple, layout: str):
        fmap = family.feature_map(tuple(shape), layout)
        proj, act = getattr(fmap, "proj", None), getattr(fmap, "act", None)
        if proj is None or act is None or getattr(fmap, "norm", None) is not None:
            raise FamilyError(
                f"the saddle score needs an elementwise random-feature family (relu:K, gelu:K, tanh:K); "
                f"{family.spec!r} has no such feature parameters (use e.g. relu:64)"
            )
        k, d = proj.weight.shape
        if k * d * (d + 1) > CROSS_BLOCK_MAX_ELEMENTS:
            raise FamilyError(
                f"the cross block of {family.spec!r} at a site of width {d} has {k * d * (d + 1)} entries "
                f"(more than {CROSS_BLOCK_MAX_ELEMENTS}): use fewer features"
            )
        self.family, self.layout, self.shape = family, layout, tuple(shape)
        self.weight = proj.weight.detach().to(torch.float64)
        self.bias = proj.bias.detach().to(torch.float64)
        self.act = act
        self.k, self.d = int(k), int(d)
        kt = self.k + (1 if family.bias else 0)
        self.blocks = torch.zeros(self.k, self.d, self.d + 1, dtype=torch.float64)
        self.sigma = torch.zeros(kt, kt, dtype=torch.float64)
        self.n = 0
        self.feature_ties = 0

    def update(self, z: Tensor, g: Tensor, mask: Tensor | None = None) -> None:
        """Add a batch ``z``, ``g`` ``(B, *shape)`` (``g``: per-example activation gradients).

        Args:
            z: site tensors; sequences may have any length.
            g: the per-example activation gradients, same shape.
            mask: optional ``(B, T)`` bool padding mask of a sequence site (``True`` at real
                tokens): padded rows are left out.

        Raises:
            StatisticsError: on a shape mismatch (rows of another width) or non-finite values.
        """
        if z.shape != g.shape or z.shape[-1] != self.d or z.dim() != len(self.shape) + 1:
            raise StatisticsError(f"z {tuple(z.shape)} and g {tuple(g.shape)} do not fit the site shape {self.shape}")
        u = to_rows(z.detach().to(torch.float64).cpu(), self.layout).reshape(-1, self.d)
        gr = to_rows(g.detach().to(torch.float64).cpu(), self.layout).reshape(-1, self.d)
        if mask is not None:
            keep = mask.detach().cpu().bool().reshape(-1)
            if keep.numel() != u.shape[0]:
                raise StatisticsError(f"mask {tuple(mask.shape)} does not fit the {u.shape[0]} rows of z")
            u, gr = u[keep], gr[keep]
        if not (torch.isfinite(u).all() and torch.isfinite(gr).all()):
            raise StatisticsError("z or g has NaN/Inf values")
        pre = (u @ self.weight.T + self.bias).requires_grad_(True)
        with torch.enable_grad():
            phi = _activation(self.act)(pre)
            slope = torch.autograd.grad(phi.sum(), pre)[0]
        phi = phi.detach()
        if self.act == "relu":
            self.feature_ties += int((pre.detach() == 0).sum())
        ut = torch.cat([u, torch.ones(u.shape[0], 1, dtype=u.dtype)], dim=1)
        self.blocks += torch.einsum("nd,nj,ne->jde", gr, slope, ut)
        pt = torch.cat([phi, torch.ones(u.shape[0], 1, dtype=u.dtype)], dim=1) if self.family.bias else phi
        self.sigma += pt.T @ pt
        self.n += int(z.shape[0])

    def cross_block(self) -> np.ndarray:
        """``(K, d, d+1)`` float64: ``C_j`` of the probe measure (sums divided by ``n``).

        Returns:
            ``C_j`` for the ``K`` features, ``(K, d, d+1)`` float64 (zeros before any example).
        """
        return (self.blocks / max(self.n, 1)).numpy()

    def feature_gram(self) -> np.ndarray:
        """``Σ = E Σ_t φ̃ φ̃ᵀ`` of the probe measure, float64.

        Returns:
            ``Σ``, ``(k̃, k̃)`` float64 (``k̃ = K + bias``; zeros before any example).
        """
        return (self.sigma / max(self.n, 1)).numpy()

    def result(self) -> SaddleResult:
        """The :class:`SaddleResult` of the probe.

        Returns:
            The probe's :class:`SaddleResult`.

        Raises:
            StatisticsError: on an empty probe.
        """
        if self.n == 0:
            raise StatisticsError("the saddle score of an empty probe is undefined (no examples)")
        blocks = self.cross_block()
        return SaddleResult(
            saddle_score=saddle_score_from_blocks(blocks, self.feature_gram()),
            cross_block_norm=float(np.linalg.norm(blocks)),
            feature_parameters=self.k * (self.d + 1),
            feature_ties=self.feature_ties,
            n=self.n,
        )


def _activation(name: str):
    from depthsat_theory.families.builtin import ACTIVATIONS

    return ACTIVATIONS[name]
