"""Streaming statistics for the finite-sample bound: ``Σ̂``, ``Ĝ`` plus the moments T7 needs."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from depthsat_theory.bounds.core import ProbeMoments, ScoreInterval, interval_from_moments
from depthsat_theory.families import FeatureFamily, to_rows
from depthsat_theory.statistics import FeatureStatistics, StatisticsError, default_rtol

__all__ = ["BoundStatistics"]


class BoundStatistics(FeatureStatistics):
    """:class:`~depthsat_theory.statistics.tangent.FeatureStatistics` plus what the bound needs.

    Streams, besides ``Σ̂`` and ``Ĝ``, the ``k × k`` sum of ``G_xᵀ G_x`` and the maxima
    ``max ‖g(x)‖_F`` and ``max Σ_t ‖φ̃_t‖²`` (memory ``O(dk + k²)``).  With
    ``keep_probe=True`` it also keeps every example's ``φ̃`` and ``g`` rows (memory
    ``O(n · units · (d + k))``), needed by the bootstrap and for the exact probe maximum
    of the leverage.

    Args:
        family: a zero-output feature family.
        shape, layout: the site (see :class:`FeatureStatistics`).
        keep_probe: keep the rows in memory.
        pool_ties, device: as for :class:`FeatureStatistics`.

    Raises:
        FamilyError: if ``family`` is not a feature family or does not fit the site.
    """

    def __init__(
        self,
        family: FeatureFamily,
        shape,
        layout: str,
        *,
        keep_probe: bool = False,
        pool_ties: bool = False,
        device=None,
    ):
        super().__init__(family, shape, layout, pool_ties=pool_ties, device=device)
        self.keep_probe = keep_probe
        self.q_sum = np.zeros((self.k, self.k))
        self.feat_sq_max = 0.0
        self._rows: list[tuple[np.ndarray, np.ndarray]] = []

    def update(self, z: Tensor, g: Tensor, mask: Tensor | None = None) -> None:
        """Add a batch ``z``, ``g`` of shape ``(B, *shape)``, optionally with a padding ``mask``
        ``(B, T)`` (see :meth:`FeatureStatistics.update`): padded rows enter no moment."""
        super().update(z, g, mask)
        with torch.no_grad():
            phi = self._features(z)
            if mask is not None:  # validated by the parent; zero rows drop out of every moment
                phi = phi * torch.as_tensor(mask, device=phi.device)[..., None].to(phi.dtype)
            phi = phi.reshape(z.shape[0], -1, self.k).cpu().numpy()
        rows_g = to_rows(g.detach().to(torch.float64), self.layout).reshape(z.shape[0], -1, self.d)
        rows_g = rows_g.cpu().numpy()
        if phi.shape[1] == 1:
            gsq = (rows_g[:, 0] ** 2).sum(1)
            self.q_sum += (phi[:, 0] * gsq[:, None]).T @ phi[:, 0]
        else:
            gx = np.einsum("ird,irk->idk", rows_g, phi, optimize=True)
            self.q_sum += np.einsum("idk,idl->kl", gx, gx, optimize=True)
        self.feat_sq_max = max(self.feat_sq_max, float((phi**2).sum((1, 2)).max()))
        if self.keep_probe:
            self._rows.append((phi, rows_g))

    def merge(self, other: BoundStatistics) -> BoundStatistics:
        """Add another shard's sums (and kept rows); returns self."""
        super().merge(other)
        self.q_sum += other.q_sum
        self.feat_sq_max = max(self.feat_sq_max, other.feat_sq_max)
        self._rows.extend(other._rows)
        self.keep_probe = self.keep_probe and other.keep_probe
        return self

    def moments(self, *, rtol: float | None = None) -> ProbeMoments:
        """The probe's :class:`ProbeMoments` (rows included when kept).

        Raises:
            StatisticsError: if no examples were accumulated.
        """
        if self.n == 0:
            raise StatisticsError("no examples were accumulated: the probe is empty")
        rtol = default_rtol(self.dtype or torch.float64, self.k) if rtol is None else float(rtol)
        phi = g = None
        if self.keep_probe and self._rows:
            phi = np.concatenate([p for p, _ in self._rows])
            g = np.concatenate([q for _, q in self._rows])
        return ProbeMoments(
            n=self.n,
            sigma=self.feature_gram(),
            cross=self.cross_gradient(),
            q=self.q_sum / self.n,
            g_sq=self.g_sq / self.n,
            g_max=self.g_max,
            feat_sq_max=self.feat_sq_max,
            rtol=rtol,
            phi=phi,
            g=g,
        )

    def interval(self, delta: float, **kwargs) -> ScoreInterval:
        """:func:`interval_from_moments` on this probe (keyword arguments passed on)."""
        return interval_from_moments(self.moments(), delta, **kwargs)
