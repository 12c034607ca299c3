"""Streaming statistics of zero-output feature families (``Σ``, ``G``; ``s² = tr(G Σ⁺ Gᵀ)``) and the projector ``Π``."""

from __future__ import annotations

import contextlib
import itertools
import math

import numpy as np
import scipy.sparse.linalg as spla
import torch
from torch import Tensor, nn

from depthsat_theory.families import FamilyError, FeatureFamily, from_rows, to_rows
from depthsat_theory.statistics.linalg import (
    FEATURE_ROUNDING_FACTOR,
    NOISE_ALPHA,
    RESOLUTION_FACTOR,
    gram_error,
    resolve_spectrum,
    scaled_gram,
    unit_roundoff,
)
from depthsat_theory.statistics.protocol import Reduction, StreamingStatistic
from depthsat_theory.statistics.result import SaturationResult, StatisticsError
from depthsat_theory.statistics.tangent import TANGENT_GRAM_MAX_ELEMENTS, TangentStatistics

__all__ = [
    "GRAM_MODES",
    "PRODUCT_CHUNK_ROWS",
    "PRODUCT_DTYPES",
    "TRIANGULAR_FACTOR_MAX_K",
    "UNIT_GRAM_MAX_FRACTION",
    "UNIT_GRAM_MIN_K",
    "FeatureStatistics",
    "TangentProjector",
    "TriangularFactor",
]

#: The per-batch product dtypes of :class:`FeatureStatistics` (``products=``).
#: :meta hide-value:
PRODUCT_DTYPES = {"float64": torch.float64, "float32": torch.float32}
_PRODUCT_DTYPES = PRODUCT_DTYPES

#: Largest ``k̃`` for which float64 forward passes also stream the triangular factor of ``Φ̃``.
TRIANGULAR_FACTOR_MAX_K = 1024


class TriangularFactor(StreamingStatistic):
    """A streamed triangular factor ``R`` with ``Rᵀ R = Σ_x Σ_r φ̃_r φ̃_rᵀ`` (TSQR).

    Each batch updates ``R ← qr([R; Φ̃_batch]).R`` (Householder, backward stable), so the
    singular values of ``R`` resolve feature amplitudes down to ``≈ k̃ u64`` of the largest,
    where a float64 Gram resolves only ``≈ sqrt(k̃ u64)`` (theory/numerics.md,
    ``def-resolution``).  Two shards merge by one more QR; ``fixed_size = False``, so it is
    reduced across processes by gathering and merging.  State: ``r`` ``(k̃, k̃)`` and ``rows``.
    """

    fixed_size = False

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = int(k)
        self._r: Tensor | None = None  # allocated by the first update: most sites never stream a factor
        self.rows = 0

    @property
    def r(self) -> Tensor:
        """The factor ``(k̃, k̃)`` float64 (zeros before any row)."""
        return torch.zeros(self.k, self.k, dtype=torch.float64) if self._r is None else self._r

    @r.setter
    def r(self, value: Tensor) -> None:
        self._r = value

    def update(self, rows: Tensor, count: int | None = None) -> None:
        """Add feature rows ``(N, k̃)`` float64.

        Args:
            rows: feature rows ``(N, k̃)`` (converted to float64).
            count: what ``rows`` counts for them (default ``N``; the noise factor counts examples).
        """
        stacked = torch.cat([self.r.to(rows.device), rows.to(torch.float64)])
        self.r = torch.linalg.qr(stacked, mode="r").R[: self.k].cpu()
        self.rows += int(rows.shape[0]) if count is None else int(count)

    def merge(self, other: TriangularFactor) -> TriangularFactor:
        """Combine with another shard's factor; returns ``self``.

        Args:
            other: another :class:`TriangularFactor` of the same width ``k``.

        Returns:
            ``self``, with ``R`` the triangular factor of both shards' rows.

        Raises:
            ValueError: for another type or width.
        """
        if not isinstance(other, TriangularFactor) or other.k != self.k:
            raise ValueError(f"cannot merge a {type(other).__name__} into a TriangularFactor of width {self.k}")
        self.r = torch.linalg.qr(torch.cat([self.r, other.r]), mode="r").R[: self.k]
        self.rows += other.rows
        return self

    def reset(self) -> None:
        """Forget every row."""
        self._r = None
        self.rows = 0

    def state_dict(self) -> dict[str, Tensor]:
        """``{"r", "rows"}``.

        Returns:
            ``{"r": R (k, k) float64, "rows": int64 scalar}`` (copies).
        """
        return {"r": self.r.clone(), "rows": torch.tensor(self.rows, dtype=torch.int64)}

    def load_state_dict(self, state, *, strict: bool = True) -> None:
        """Replace the factor (missing keys: an empty factor).

        Args:
            state: ``{"r", "rows"}`` as written by :meth:`state_dict` (or without ``"r"``: empty).
            strict: unused (accepted for the :class:`StreamingStatistic` interface).
        """
        self.reset()
        if "r" in state:
            self.r = state["r"].detach().to(torch.float64).reshape(self.k, self.k).clone()
            self.rows = int(state["rows"])


#: Rows per chunk of the float32 products with ``products="float32"``: each batch is multiplied chunk by chunk,
#: the chunk products are accumulated in float32 and the batch's sum is added once to the float64 sums, so every
#: float32 entry is a blocked sum of length ``L_32 = c + ⌈B/c⌉ − 1`` (:func:`product_sum_length`, Higham's bound
#: for blocked summation) whatever the order inside a chunk (theory/numerics.md, ``thm-score-error``,
#: ``γ_acc = C_acc(L u64 + L_32 u32)``).
PRODUCT_CHUNK_ROWS = 128


def product_sum_length(rows: int) -> int:
    """Length ``L_32`` of the float32 sums of a batch of ``rows`` rows (``0`` for an empty batch).

    Chunks of ``c = min(rows,`` :data:`PRODUCT_CHUNK_ROWS` ``)`` rows, ``m = ⌈rows / c⌉`` chunks accumulated in
    float32: every product passes through at most ``c − 1`` additions inside its chunk and ``m − 1`` across chunks
    (any summation order), hence ``L_32 = c + m − 1`` (e.g. ``135`` for ``1024`` rows, ``255`` for ``2¹⁴``).
    """
    if rows <= 0:
        return 0
    c = min(int(rows), PRODUCT_CHUNK_ROWS)
    return c + math.ceil(rows / c) - 1


#: Number of column blocks of the block-triangular Gram update (:func:`_add_gram`).
GRAM_BLOCKS = 4
#: Smallest ``k̃`` for which the Gram update is split into column blocks (below it one product is cheaper).
GRAM_BLOCK_MIN_K = 128


def _add_gram(out: Tensor, x: Tensor) -> None:
    """``out += xᵀ x`` for rows ``x`` ``(N, k̃)``, computing only the block lower triangle.

    The columns are split into :data:`GRAM_BLOCKS` blocks; block ``j`` multiplies
    ``x[:, j0:]ᵀ x[:, j0:j1]`` (the diagonal block and everything below it) and mirrors the
    part below the diagonal block, so the multiply-adds are ``N k̃² (m + 1)/(2m)`` (``5/8`` of a
    full product for ``m = 4``) and every entry is the same sum of the same products as in
    ``xᵀ x`` (same rounding).  ``out`` stays exactly symmetric (the diagonal blocks mirror their lower
    triangle: a GEMM need not return a symmetric ``xᵀx``).  Rows in a lower precision than ``out`` are
    multiplied by :func:`_lowp_gram` and the batch's Gram is added to ``out`` once.
    """
    if x.dtype != out.dtype:
        out += _lowp_gram(x)
        return
    k = x.shape[1]
    if k < GRAM_BLOCK_MIN_K:
        out += _mirror_lower((x.T @ x).to(out.dtype))
        return
    for j0, j1 in _column_blocks(k):
        blk = (x[:, j0:].T @ x[:, j0:j1]).to(out.dtype)
        blk[: j1 - j0] = _mirror_lower(blk[: j1 - j0])
        out[j0:, j0:j1] += blk
        out[j0:j1, j1:] += blk[j1 - j0 :].T


def _column_blocks(k: int) -> list[tuple[int, int]]:
    """The :data:`GRAM_BLOCKS` column ranges of the block-triangular Gram of ``k`` columns."""
    return list(itertools.pairwise([round(i * k / GRAM_BLOCKS) for i in range(GRAM_BLOCKS + 1)]))


def _lowp_gram(x: Tensor) -> Tensor:
    """``xᵀ x`` ``(k̃, k̃)`` in ``x``'s (lower) precision, exactly symmetric (block lower triangle, :func:`_lowp_sum`)."""
    k = x.shape[1]
    if k < GRAM_BLOCK_MIN_K:
        return _mirror_lower(_lowp_sum(x, x))
    buf = x.new_empty(k, k)  # only the lower blocks are written and read
    for j0, j1 in _column_blocks(k):
        buf[j0:, j0:j1] = _lowp_sum(x[:, j0:], x[:, j0:j1])
    return _mirror_lower(buf)


#: Largest ``chunks · m · n`` for which the chunk products of :func:`_lowp_sum` are formed in one batched call
#: and then summed (a float32 buffer of at most 16 MiB: many small products, where per-call overhead dominates);
#: larger ones are formed chunk by chunk.
CHUNK_BATCH_MAX_ELEMENTS = 1 << 22


def _lowp_sum(a: Tensor, b: Tensor) -> Tensor:
    """``Σ_chunks a_cᵀ b_c`` for rows ``a`` ``(N, m)``, ``b`` ``(N, n)``, accumulated in their own (lower) precision.

    Chunks of :data:`PRODUCT_CHUNK_ROWS` rows; each chunk's product is formed on its own (a sum of at most that
    many products, from zero: one batched ``bmm`` for all chunks when small, else one ``mm`` per chunk) and the
    chunk products are then summed, so each entry is a float32 sum of length :func:`product_sum_length` ``(N)``
    whatever the order.  ``addmm_`` would not do: a BLAS may accumulate the products straight into the running
    sum, one long float32 sum (seen with ``k̃ = 2``: 1.8e-4 relative over 2¹⁴ rows).
    Returns ``(m, n)`` in ``a``'s dtype; the caller adds it to the float64 sums once.
    """
    rows, c = a.shape[0], PRODUCT_CHUNK_ROWS
    if rows <= c:
        return a.T @ b
    full = (rows // c) * c
    nc = full // c
    if nc * a.shape[1] * b.shape[1] <= CHUNK_BATCH_MAX_ELEMENTS:
        acc = torch.bmm(a[:full].reshape(nc, c, -1).transpose(1, 2), b[:full].reshape(nc, c, -1)).sum(0)
    else:
        acc = a[:c].T @ b[:c]
        tmp = torch.empty_like(acc)
        for r0 in range(c, full, c):
            acc += torch.mm(a[r0 : r0 + c].T, b[r0 : r0 + c], out=tmp)
    if full < rows:
        acc += a[full:].T @ b[full:]
    return acc


@contextlib.contextmanager
def _ieee_float32_matmul():
    """Float32 products in IEEE float32 while inside (restored after).

    ``torch.set_float32_matmul_precision("high"|"medium")``, common in training scripts, lets float32 matmuls run
    in TF32 or bfloat16 (relative error ``≈ 2⁻¹¹`` or ``2⁻⁸``), far outside the float32 products' bound.
    """
    before = torch.get_float32_matmul_precision()
    if before == "highest":
        yield
        return
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _pow2_scale(amax: Tensor) -> Tensor:
    """Powers of two ``s`` (float64) with ``amax · s ∈ [1/2, 1)`` (``1`` where ``amax`` is ``0``)."""
    _, exp = torch.frexp(amax.to(torch.float64))
    return torch.ldexp(torch.ones_like(amax, dtype=torch.float64), -exp)


def _scaled(t: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``t · scale`` rounded to ``dtype`` (powers of two: exact but for entries far below the largest)."""
    if t.dtype == dtype and bool(((scale >= 2.0**-100) & (scale <= 2.0**100)).all()):
        return t * scale.to(dtype)
    return (t.to(torch.float64) * scale).to(dtype)


#: Feature columns are left unscaled when every column's power-of-two scale lies within ``2^±16`` (their largest
#: entries between ``2⁻¹⁶`` and ``2¹⁶``): no product that matters can then underflow or overflow float32.
UNSCALED_WINDOW = 2.0**16


def _lowp_inputs(phi: Tensor, g: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """``φ̃`` ``(..., k̃)`` and ``g`` ``(..., d)`` scaled by powers of two and rounded to ``dtype`` for the products.

    Feature columns are scaled so that each one's largest entry in the batch lies in ``[1/2, 1)`` (unless every
    scale is within :data:`UNSCALED_WINDOW`), and ``g`` by one factor likewise, so no product of the float32 path
    underflows or overflows where it matters: a column of size ``2⁻⁷⁸`` has float32 squares below ``2⁻¹⁴⁹`` (zero),
    which dropped its direction from ``T`` unseen (a wrong *saturated*, found by an adversarial probe).  Entries
    below ``2⁻¹⁴⁹`` of their column's largest still round to zero: an absolute error ``≤ L 2⁻¹⁴⁸`` on the
    unit-diagonal Gram, far inside ``C_res u64``.  The scaling is undone exactly in float64 (:func:`_unscale`).

    Returns:
        ``(φ̃ scaled, g scaled, 1/scale of φ̃ (k̃,) float64 or None when unscaled, 1/scale of g () float64)``.
    """
    sphi = _pow2_scale(torch.linalg.vector_norm(phi.reshape(-1, phi.shape[-1]), ord=math.inf, dim=0))
    sg = _pow2_scale(torch.linalg.vector_norm(g, ord=math.inf))
    g_s = _scaled(g, sg, dtype)
    if bool(((sphi >= 1 / UNSCALED_WINDOW) & (sphi <= UNSCALED_WINDOW)).all()):
        return phi.to(dtype), g_s, None, 1.0 / sg
    return _scaled(phi, sphi, dtype), g_s, 1.0 / sphi, 1.0 / sg


def _unscale(m: Tensor, inv_rows: Tensor | None, inv_cols: Tensor | None) -> Tensor:
    """``m`` (float64) with rows times ``inv_rows`` and columns times ``inv_cols`` (powers of two: exact), in place.

    ``None``: that side was not scaled.
    """
    if inv_rows is not None:
        m.mul_(inv_rows.reshape(-1, 1))
    if inv_cols is not None:
        m.mul_(inv_cols.reshape(1, -1))
    return m


def _add_lowp_grams(
    sigma: Tensor,
    q_sum: Tensor,
    rows_s: Tensor,
    phi_s: Tensor,
    g_s: Tensor,
    g_norm2: Tensor | None,
    inv_phi: Tensor | None,
    inv_g: Tensor,
) -> None:
    """Add one batch's ``Σ`` and noise moment from the scaled lower-precision inputs of :func:`_lowp_inputs`.

    ``rows_s`` ``(N, k̃)`` are the real rows of ``phi_s`` ``(B, R, k̃)``; ``g_s`` ``(B, R, d)``; ``g_norm2``
    ``(B,)`` float64, unscaled, when unmasked.  Both sums are unscaled exactly in float64 before they are added.
    """
    sigma += _unscale(_lowp_gram(rows_s).to(torch.float64), inv_phi, inv_phi)
    q = torch.zeros_like(q_sum)
    _noise_moment(q, phi_s, g_s, None if g_norm2 is None else g_norm2 / (inv_g * inv_g))
    q_sum += _unscale(q, inv_phi, inv_phi).mul_(inv_g * inv_g)


def _check_columns_float64(phi2: Tensor) -> None:
    """Raise when a feature column is nonzero but entirely below ``2⁻⁴⁸⁰`` (its float64 squares underflow)."""
    cmax = phi2.abs().amax(0) if phi2.shape[0] else phi2.new_zeros(phi2.shape[1])
    tiny = (cmax > 0) & (cmax < 2.0**-480)
    if bool(tiny.any()):
        j = int(tiny.nonzero()[0])
        raise StatisticsError(
            f"feature column {j} of this site is nonzero but no entry exceeds 2^-480 ≈ 1e-145 in magnitude "
            f"(largest {float(cmax[j]):.3g}): its squares underflow float64 and its direction would vanish from the "
            f"tangent space unseen; rescale the site tensors (s is unchanged by rescaling z for the linear family)"
        )


def _noise_rows(phi: Tensor, rows_g: Tensor, g_norm2: Tensor | None = None) -> Tensor:
    """Rows ``Y`` ``(B m, k̃)`` with ``YᵀY = Σ_x X_xᵀ X_x``, ``X_x = Σ_r g_r φ̃_rᵀ`` (``m = min(R, d)`` per example).

    ``phi`` ``(B, R, k̃)``, ``rows_g`` ``(B, R, d)`` float64.  ``X_xᵀX_x = Φ_xᵀ (g_x g_xᵀ) Φ_x`` and ``g_x g_xᵀ =
    R_xᵀR_x`` with ``R_x`` the triangular factor of ``g_xᵀ`` (``R = 1``: ``±‖g_x‖``), so ``Y_x = R_x Φ_x``: the noise
    moment as the Gram of rows, for the triangular factor (theory/numerics.md, ``thm-noise-factor``).
    """
    if phi.shape[1] == 1:
        norms = rows_g[:, 0].pow(2).sum(1).sqrt() if g_norm2 is None else g_norm2.sqrt().to(phi.dtype)
        return phi[:, 0] * norms[:, None]
    r_g = torch.linalg.qr(rows_g.transpose(1, 2), mode="r").R  # (B, m, R): g_x g_xᵀ = R_gᵀ R_g
    return torch.bmm(r_g, phi).reshape(-1, phi.shape[-1])


def _mirror_lower(square: Tensor) -> Tensor:
    """``square`` with its strict upper triangle replaced by the transposed lower one.

    A BLAS product ``xᵀ x`` need not be exactly symmetric (the kernel may sum entry ``(a, b)`` and
    ``(b, a)`` in different orders; seen with OpenBLAS on AMD EPYC): each kept entry is still a
    computed entry of ``xᵀ x``, so the rounding bound is unchanged and the Gram is exactly symmetric.
    """
    return torch.tril(square) + torch.tril(square, -1).T


def _noise_moment(out: Tensor, phi: Tensor, rows_g: Tensor, g_norm2: Tensor | None = None) -> None:
    """``out += Σ_x X_xᵀ X_x`` with ``X_x = Σ_r g_r φ̃_rᵀ`` for ``phi`` ``(B, R, k̃)``, ``rows_g`` ``(B, R, d)``.

    ``g_norm2`` (optional, ``(B,)``): ``‖g_x‖²`` when already computed (used when ``R = 1``).
    """
    r, k = phi.shape[1:]
    d = rows_g.shape[2]
    if r == 1:  # X_xᵀ X_x = ‖g_x‖² φ̃_x φ̃_xᵀ: the Gram of the rows ‖g_x‖ φ̃_x
        norms = rows_g[:, 0].pow(2).sum(1).sqrt() if g_norm2 is None else g_norm2.sqrt().to(phi.dtype)
        _add_gram(out, phi[:, 0] * norms[:, None])
        return
    step = max(1, PRODUCT_CHUNK_ROWS // r)
    if phi.dtype != out.dtype and phi.shape[0] > step:  # lower-precision products: chunks of examples
        for b0 in range(0, phi.shape[0], step):
            _noise_moment(out, phi[b0 : b0 + step], rows_g[b0 : b0 + step])
        return
    if r * r * (d + k) + r * k * k <= r * d * k + d * k * k:
        y = torch.bmm(torch.bmm(rows_g, rows_g.transpose(1, 2)), phi)  # (g gᵀ) Φ̃ per example
        out += (phi.reshape(-1, k).T @ y.reshape(-1, k)).to(out.dtype)
        return
    x = torch.bmm(rows_g.transpose(1, 2), phi)  # (B, d, k̃)
    out += torch.einsum("bdk,bdl->kl", x, x).to(out.dtype)


#: The Grams a :class:`FeatureStatistics` may use (``gram=``), ``"features"`` (the ``k̃ × k̃`` Gram ``Σ``
#: streamed batch by batch), ``"units"`` (the scaled feature rows kept and factored at the end, the unit
#: path of theory/numerics.md ``thm-unit-gram``) and ``"auto"`` (units while they are few, see below).
GRAM_MODES = ("auto", "features", "units")
_GRAM_MODES = GRAM_MODES
#: ``gram="auto"`` keeps the feature rows (no ``k̃²`` work per batch) only at sites with ``k̃`` above this ...
UNIT_GRAM_MIN_K = 1025
#: ... and only while the rows seen are at most this fraction of ``k̃`` (then the kept rows use at most
#: half the memory of ``Σ``); past it the kept batches are replayed into ``Σ`` in their order.
UNIT_GRAM_MAX_FRACTION = 0.5


class _KeptBatch:
    """One batch kept by the unit path: the rows as the dense path would have multiplied them.

    ``phi_x`` ``(B, R, k̃)`` and ``g_x`` ``(B, R, d)`` float64 (padded rows zero), ``keep`` the flat
    ``(B R,)`` mask of real rows (``None``: all), ``g_norm2`` ``‖g_x‖²`` ``(B,)`` when unmasked,
    ``factor`` whether the dense path streams these rows into the triangular factor.
    """

    __slots__ = ("factor", "g_norm2", "g_x", "keep", "phi_x")

    def __init__(self, phi_x: Tensor, g_x: Tensor, keep: Tensor | None, g_norm2: Tensor | None, factor: bool):
        self.phi_x, self.g_x, self.keep, self.g_norm2, self.factor = phi_x, g_x, keep, g_norm2, factor

    def rows(self) -> tuple[Tensor, Tensor]:
        """The real rows ``(φ̃ (N_b, k̃), g (N_b, d))``."""
        phi2, rows2 = self.phi_x.reshape(-1, self.phi_x.shape[-1]), self.g_x.reshape(-1, self.g_x.shape[-1])
        if self.keep is None:
            return phi2, rows2
        return phi2[self.keep], rows2[self.keep]


def _example_gram_sum(batches: list[_KeptBatch], w: Tensor) -> float:
    """``Σ_x ‖Σ_{r∈x} g_r w_rᵀ‖_F²`` over the kept batches, ``w`` ``(N, m)`` one row per real row (in order).

    Computed as ``Σ_x Σ_{r,r'} (g_r·g_r')(w_r·w_r')`` per example (``O(B R² (d + m))``).
    """
    total, off = 0.0, 0
    for kb in batches:
        b, r = kb.phi_x.shape[:2]
        wx = torch.zeros(b * r, w.shape[1], dtype=w.dtype, device=w.device)
        count = b * r if kb.keep is None else int(kb.keep.sum())
        if kb.keep is None:
            wx = w[off : off + count]
        else:
            wx[kb.keep] = w[off : off + count]
        off += count
        wx = wx.reshape(b, r, -1)
        gx = kb.g_x.to(w.device)
        if r == 1:
            total += float((gx[:, 0].pow(2).sum(1) * wx[:, 0].pow(2).sum(1)).sum())
        else:
            total += float((torch.bmm(gx, gx.transpose(1, 2)) * torch.bmm(wx, wx.transpose(1, 2))).sum())
    return total


class _UnitNoiseMoment:
    """``E[XᵀX]`` as an operator over the kept batches: ``self @ u`` for ``u`` ``(k̃, m)`` (numpy).

    ``X_x = Σ_r g_r φ̃_rᵀ``, so ``E[XᵀX] u = (1/n) Σ_x Φ_xᵀ (g_x g_xᵀ) (Φ_x u)`` without the ``k̃ × k̃`` moment.
    """

    def __init__(self, batches: list[_KeptBatch], n: int):
        self.batches, self.n = batches, n

    def __matmul__(self, u: np.ndarray) -> np.ndarray:
        dev = self.batches[0].phi_x.device
        ut = torch.from_numpy(np.ascontiguousarray(u, dtype=np.float64)).to(dev)
        out = torch.zeros(ut.shape, dtype=torch.float64, device=dev)
        for kb in self.batches:
            t = kb.phi_x @ ut  # (B, R, m)
            y = torch.bmm(kb.g_x, torch.bmm(kb.g_x.transpose(1, 2), t))  # (g_x g_xᵀ) Φ_x u
            out += torch.einsum("brk,brm->km", kb.phi_x, y)
        return (out / self.n).cpu().numpy()


def _rows_as_site(rows: Tensor, layout: str) -> Tensor:
    """Pack unit rows ``(N, d)`` into one site tensor so row-wise maps see each row once."""
    if layout == "vector":
        return rows
    if layout == "sequence":
        return rows.unsqueeze(0)
    return rows.T.reshape(1, rows.shape[1], rows.shape[0], 1)


class FeatureStatistics(TangentStatistics):
    """Streaming cross-gradient statistics for a :class:`FeatureFamily` at one site.

    Accumulates, in float64, ``Σ = Σ_x Σ_r φ̃_r φ̃_rᵀ`` (``k̃ × k̃``) and
    ``G = Σ_x Σ_r g_r φ̃_rᵀ`` (``d × k̃``), plus counts and norms; divides by ``n`` at
    the end.  Cost per batch ``O(units · (d k̃ + k̃²))`` on the Gram path, ``O(units · d k̃)`` on the unit
    path (``gram`` below), which keeps the rows and factors them once in :meth:`result`.

    Args:
        family: the feature family.
        shape: per-example site shape.
        layout: site layout.
        pool_ties: also pool exactly equal units to report ``r̂`` and ``ρ̂``
            (memory grows with the number of distinct units).
        device: where features are computed (default: the device of the first batch).
        products: dtype of the per-batch products ``Φ̃ᵀΦ̃``, ``gᵀΦ̃`` (always summed across
            batches in float64): ``"float64"`` (default), or ``"float32"`` (the features and ``g``
            rounded to float32, each batch multiplied over chunks of :data:`PRODUCT_CHUNK_ROWS` rows
            accumulated in float32 and added to the float64 sums once; the rounding bound gains
            ``C_acc · L_32 · u32`` with ``L_32`` = :func:`product_sum_length` of the largest batch,
            ``135`` at ``1024`` rows, the Gram's eigenvalues below ``2η`` are dropped and count as
            unresolved, and the noise test uses ``ŝ − e`` and an upper bound on ``v̂``, theory/numerics.md
            ``thm-score-error``: an opt-in for well-conditioned sites; features and ``g`` are scaled by powers
            of two before the products, so nothing underflows float32).
            Families that copy the site's entries (``copies_input``) compute float32 features directly.
            Only the block lower triangle of ``Σ`` is multiplied either way.
        gram: ``"features"``: stream the ``k̃ × k̃`` Gram ``Σ`` (and the noise moment) batch by
            batch, ``O(k̃²)`` per row; ``"units"``: keep the scaled feature rows instead (memory
            ``O(N k̃)`` for ``N`` rows) and factor them once in :meth:`result` (a thin SVD,
            ``O(N² k̃)``; theory/numerics.md ``thm-unit-gram``: the same ``ŝ`` with the factored
            rounding bound); ``"auto"`` (default): units at sites with ``k̃ ≥`` :data:`UNIT_GRAM_MIN_K`
            while the rows seen are at most :data:`UNIT_GRAM_MAX_FRACTION` ``· k̃``, then the kept
            batches are replayed into ``Σ`` in their order (the features path from then on).
            :meth:`state_dict`, :meth:`merge` and every accessor of ``Σ`` replay them too.

    Raises:
        FamilyError: if the family does not fit the site.
        StatisticsError: for an unknown ``products`` or ``gram``.
    """

    family: FeatureFamily

    def __init__(
        self,
        family: FeatureFamily,
        shape,
        layout: str,
        *,
        pool_ties: bool = False,
        device=None,
        products: str = "float64",
        gram: str = "auto",
    ):
        if not isinstance(family, FeatureFamily):
            raise FamilyError(f"{family!r} is not a feature family; use GeneralStatistics")
        super().__init__(family, shape, layout, pool_ties=pool_ties)
        self.d = family.site_dim(self.shape, layout)
        self.k = family.augmented_dim(self.shape, layout)
        self.add_state("sigma", torch.zeros(self.k, self.k, dtype=torch.float64), Reduction.SUM)
        self.add_state("cross", torch.zeros(self.d, self.k, dtype=torch.float64), Reduction.SUM)
        self.add_state("q_sum", torch.zeros(self.k, self.k, dtype=torch.float64), Reduction.SUM)
        if products not in _PRODUCT_DTYPES:
            raise StatisticsError(
                f"products={products!r}: the per-batch products are 'float64' (default) or 'float32' "
                f"(float32 batch products summed in float64, with the wider rounding bound of thm-score-error)"
            )
        self.products = products
        self._product_dtype = _PRODUCT_DTYPES[products]
        if products != "float64":  # the largest batch multiplied in float32, for the rounding bound
            self.add_state("product_units_max", torch.zeros((), dtype=torch.float64), Reduction.MAX)
        self.factor = TriangularFactor(self.k)
        self.add_child("factor", self.factor)
        self.noise_factor = TriangularFactor(self.k)  # rows: examples (v̂ from the factor, thm-noise-factor)
        self.add_child("noise_factor", self.noise_factor)
        self._fmap: nn.Module | None = None
        self._device = device
        self._last: tuple[Tensor, Tensor] | None = None  # (z, φ̃) of the batch of the last update
        if gram not in _GRAM_MODES:
            raise StatisticsError(
                f"gram={gram!r}: use 'auto' (default), 'features' (stream Σ) or 'units' (keep the feature rows)"
            )
        self.gram = gram
        unit_path = gram == "units" or (gram == "auto" and self.k >= UNIT_GRAM_MIN_K)
        self._kept: list[_KeptBatch] | None = [] if unit_path else None  # None: the features path
        self._kept_rows = 0
        if unit_path:
            self._defer_grams()

    def _features(self, z: Tensor, mask: Tensor | None = None, dtype: torch.dtype = torch.float64) -> Tensor:
        """``φ̃`` rows ``(B, R, k̃)`` of ``z`` (in ``dtype``, float64 by default), computed with the padding ``mask``.

        The float64 features of the last :meth:`update`'s batch are reused when called again with that
        batch (so subclasses see the features computed with that batch's mask).
        """
        if dtype == torch.float64 and mask is None and self._last is not None and self._last[0] is z:
            return self._last[1]
        if self._fmap is None:
            dev = self._device if self._device is not None else z.device
            self._fmap = self.family.frozen_feature_map(self.shape, self.layout, dtype=torch.float64, device=dev)
            for name in ("sigma", "cross", "q_sum"):
                self.states[name] = self.states[name].to(dev)
        fmap = self._fmap
        if dtype != torch.float64:
            dev = self.states["cross"].device
            fmap = self.family.frozen_feature_map(self.shape, self.layout, dtype=dtype, device=dev)
        with torch.no_grad():
            return self.family.augmented_features(fmap, z.detach().to(dtype), mask=mask)

    def update(self, z: Tensor, g: Tensor, mask: Tensor | None = None) -> None:
        """Add a batch of site tensors ``z`` and activation gradients ``g``.

        Args:
            z: ``(B, *shape)`` activations (float16, bfloat16, float32 or float64: the rounding bound uses that dtype).
            g: ``(B, *shape)`` gradients of the *per-example* losses w.r.t. ``z``.
            mask: optional padding mask, bool ``(B, T)``, ``True`` at real tokens, for
                sequence sites of row-wise families and of families that mask padding
                (``attention``: padded keys are excluded from the attention): padded rows are
                left out of every sum (theory/definitions.md, def-setting, padding excluded);
                ``n`` still counts examples.

        Raises:
            StatisticsError: on shape mismatch, NaN/Inf, an empty batch, or a mask of the
                wrong shape/dtype/site, or with ``g ≠ 0`` at a padded position.
        """
        mask = self._row_mask(z, g, mask)
        if self._product_dtype != torch.float64 and self._kept is None:
            self._update_lowp(z, g, mask)
            return
        g64, g_norm2 = self._common(z, g, mask)
        self._last = None
        phi = self._features(z, mask if getattr(self.family, "masks_padding", False) else None)
        self._last = (z, phi)
        rows_g = to_rows(g64, self.layout).to(phi.device)
        phi_x, g_x = phi.reshape(z.shape[0], -1, self.k), rows_g.reshape(z.shape[0], -1, self.d)
        keep = None
        if mask is not None:
            keep = mask.to(phi.device).reshape(-1)
            weight = keep.reshape(z.shape[0], -1, 1).to(phi.dtype)
            phi_x, g_x = phi_x * weight, g_x * weight
        kept = _KeptBatch(phi_x, g_x, keep, None if mask is not None else g_norm2, False)
        kept.factor = z.dtype == self._product_dtype == torch.float64 and self.k <= TRIANGULAR_FACTOR_MAX_K
        phi2, rows2 = kept.rows()
        if self._product_dtype != torch.float64:  # the unit path: G in float32 (the kept rows stay float64)
            self._note_product_sum(phi2.shape[0])
            phi_s, g_s, inv_phi, inv_g = _lowp_inputs(phi2, rows2, self._product_dtype)
            with _ieee_float32_matmul():
                self.states["cross"] += _unscale(_lowp_sum(g_s, phi_s).to(torch.float64), inv_g, inv_phi)
        else:
            _check_columns_float64(phi2)
            self.states["cross"] += (rows2.T @ phi2).to(torch.float64)
        self._count_units(phi2.shape[0])
        if self._kept is not None:
            self._kept_rows += int(phi_x.shape[0] * phi_x.shape[1])
            self._kept.append(kept)
            if self.gram == "auto" and self._kept_rows > UNIT_GRAM_MAX_FRACTION * self.k:
                self._flush()
            return
        self._add_dense(kept)

    def _note_product_sum(self, rows: int) -> None:
        """Keep the longest float32 sum (:func:`product_sum_length` of a batch of ``rows`` rows)."""
        length = float(product_sum_length(rows))
        self.states["product_units_max"] = torch.clamp_min(self.states["product_units_max"], length)

    def _update_lowp(self, z: Tensor, g: Tensor, mask: Tensor | None) -> None:
        """:meth:`update` on the features path with float32 products: nothing of size ``B k̃`` in float64.

        ``g`` stays in its dtype; the features are computed in float64, except for families whose features copy the
        site's entries (:attr:`~depthsat_theory.families.FeatureFamily.copies_input`), computed directly in float32
        (exact).  Both are scaled by powers of two and only then rounded to float32 (:func:`_lowp_inputs`: a float64
        feature below float32's range would otherwise round to zero), and unscaled exactly after the products.
        """
        prod = self._product_dtype
        g_in, g_norm2 = self._common(z, g, mask, to_float64=False)
        self._last = None
        if self.family.copies_input and torch.finfo(z.dtype).bits <= torch.finfo(prod).bits:
            phi = self._features(z, dtype=prod)
        else:
            phi = self._features(z, mask if getattr(self.family, "masks_padding", False) else None)
            self._last = (z, phi)  # float64: rounded to float32 only after the scaling (_lowp_inputs)
        b = z.shape[0]
        phi_x = phi.reshape(b, -1, self.k)
        g_x = to_rows(g_in, self.layout).to(phi.device).reshape(b, -1, self.d)
        if mask is not None:
            weight = mask.to(phi.device).reshape(b, -1, 1)
            phi_x, g_x = phi_x * weight.to(phi_x.dtype), g_x * weight.to(g_x.dtype)
        phi_x, g_x, inv_phi, inv_g = _lowp_inputs(phi_x, g_x, prod)
        if mask is not None:
            keep = mask.to(phi.device).reshape(-1)
            phi2, rows2 = phi_x.reshape(-1, self.k)[keep], g_x.reshape(-1, self.d)[keep]
        else:
            phi2, rows2 = phi_x.reshape(-1, self.k), g_x.reshape(-1, self.d)
        self._note_product_sum(phi2.shape[0])
        self._count_units(phi2.shape[0])
        st = self.states
        with _ieee_float32_matmul():
            st["cross"] += _unscale(_lowp_sum(rows2, phi2).to(torch.float64), inv_g, inv_phi)
            g_norm = None if mask is not None else g_norm2
            _add_lowp_grams(st["sigma"], st["q_sum"], phi2, phi_x, g_x, g_norm, inv_phi, inv_g)

    def _summands(self) -> int:
        """Length ``L`` of the float64 sums; with float32 products also one term per chunk of rows.

        (The noise moment of multi-row sites adds its float32 chunks to the float64 sum one by one.)
        """
        base = super()._summands()
        if self._product_summands():
            base += math.ceil(self.units / PRODUCT_CHUNK_ROWS)
        return base

    def _defer_grams(self) -> None:
        """Hold ``Σ`` and the noise moment as zero views (no memory) until the Gram path first adds to them."""
        for name in ("sigma", "q_sum"):
            t = self.states[name]
            self.states[name] = torch.zeros((1, 1), dtype=t.dtype, device=t.device).expand(self.k, self.k)

    def _add_dense(self, kb: _KeptBatch) -> None:
        """The features path for one batch: ``Σ``, the noise moment and the triangular factor."""
        for name in ("sigma", "q_sum"):
            t = self.states[name]
            if t.stride() == (0, 0):  # a deferred zero view: allocate it now
                self.states[name] = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
        phi2, _ = kb.rows()
        phi_x, g_x = kb.phi_x, kb.g_x
        if self._product_dtype != torch.float64:
            phi_s, g_s, inv_phi, inv_g = _lowp_inputs(phi_x, g_x, self._product_dtype)
            rows_s = phi_s.reshape(-1, self.k) if kb.keep is None else phi_s.reshape(-1, self.k)[kb.keep]
            with _ieee_float32_matmul():
                _add_lowp_grams(
                    self.states["sigma"], self.states["q_sum"], rows_s, phi_s, g_s, kb.g_norm2, inv_phi, inv_g
                )
            return
        _add_gram(self.states["sigma"], phi2)
        _noise_moment(self.states["q_sum"], phi_x, g_x, kb.g_norm2)
        if kb.factor:
            self.factor.update(phi2)
            self.noise_factor.update(_noise_rows(phi_x, g_x, kb.g_norm2), count=phi_x.shape[0])

    def _flush(self) -> None:
        """Replay the batches kept by the unit path into ``Σ`` (in their order) and stay on the features path."""
        kept, self._kept = self._kept, None
        for kb in kept or ():
            self._add_dense(kb)

    def state_dict(self) -> dict[str, Tensor]:
        """The state (kept unit-path batches are first replayed into ``Σ``: see ``gram``).

        Returns:
            The state as in :meth:`StreamingStatistic.state_dict` (detached CPU tensors by field name).
        """
        self._flush()
        return super().state_dict()

    def merge(self, other):
        """Add another shard's state (both sides' kept batches are first replayed into ``Σ``); returns ``self``.

        Args:
            other: a statistic of the same type and configuration.

        Returns:
            ``self``.

        Raises:
            TypeError, ValueError, StatisticsError: from ``check_compatible`` (the two configurations differ).
        """
        self._flush()
        if isinstance(other, FeatureStatistics):
            other._flush()
        return super().merge(other)

    def load_state_dict(self, state, *, strict: bool = True) -> None:
        """Replace the state (the loaded ``Σ`` is a features-path state: nothing stays kept).

        Args:
            state: name → tensor, as written by :meth:`state_dict`.
            strict: see :meth:`StreamingStatistic.load_state_dict`.

        Raises:
            KeyError, ValueError: as :meth:`StreamingStatistic.load_state_dict`.
        """
        self._flush()
        super().load_state_dict(state, strict=strict)

    def reset(self) -> None:
        """Forget every example (and return to the unit path where ``gram`` allows it)."""
        super().reset()
        unit_path = self.gram == "units" or (self.gram == "auto" and self.k >= UNIT_GRAM_MIN_K)
        self._kept = [] if unit_path else None
        self._kept_rows = 0
        if unit_path:
            self._defer_grams()

    @property
    def sigma(self) -> Tensor:
        """The raw sum ``Σ_x Σ_r φ̃_r φ̃_rᵀ`` (float64 ``(k̃, k̃)``; :meth:`feature_gram` is the mean)."""
        self._flush()
        return self.states["sigma"]

    @property
    def cross(self) -> Tensor:
        """The raw sum ``Σ_x Σ_r g_r φ̃_rᵀ`` (float64 ``(d, k̃)``; :meth:`cross_gradient` is the mean)."""
        return self.states["cross"]

    def feature_gram(self) -> np.ndarray:
        """``Σ = E[Σ_r φ̃_r φ̃_rᵀ]``: the per-example mean feature Gram.

        Returns:
            float64 numpy array ``(k̃, k̃)`` (``k̃`` the augmented feature dimension),
            in (feature units)² per example (theory label ``thm-cross-gradient``).

        Raises:
            StatisticsError: if no examples were accumulated.
        """
        self._require_examples()
        return (self.sigma / self.n).cpu().numpy()

    def cross_gradient(self) -> np.ndarray:
        """``G = E[Σ_r g_r φ̃_rᵀ]``: the per-example mean cross-gradient, equal to ``∂J/∂(W, c)``.

        Returns:
            float64 numpy array ``(d, k̃)`` in (loss units)·(feature units) per example
            (theory label ``thm-cross-gradient``).

        Raises:
            StatisticsError: if no examples were accumulated.
        """
        self._require_examples()
        return (self.cross / self.n).cpu().numpy()

    def gradient(self) -> np.ndarray:
        """``b = E[Aᵀ g] = vec(G)`` in the tangent-coordinate order ``(vec_row(W), c)``.

        Returns:
            float64 numpy vector ``(p,)`` with ``p = d · k̃`` (:meth:`theta_vector` of :meth:`cross_gradient`).

        Raises:
            StatisticsError: if no examples were accumulated.
        """
        return self.theta_vector(self.cross_gradient())

    def tangent_gram(self, *, max_elements: int = TANGENT_GRAM_MAX_ELEMENTS) -> np.ndarray:
        """``K = E[AᵀA] = I_d ⊗ Σ`` formed explicitly, in the order of :meth:`gradient`.

        For feature families ``K`` is block diagonal with ``d`` copies of ``Σ``; it has
        ``p² = (d k̃)²`` entries, so it is formed only for small sites (scores never
        need it: ``s² = tr(G Σ⁺ Gᵀ)``, theory label ``thm-cross-gradient``).

        Args:
            max_elements: refuse to form ``K`` with more entries than this
                (default :data:`TANGENT_GRAM_MAX_ELEMENTS`, 128 MiB of float64).

        Returns:
            float64 numpy array ``(p, p)``, ``p = d · k̃``.

        Raises:
            StatisticsError: if no examples were accumulated, or ``p² > max_elements``.
        """
        p = self.d * self.k
        if p * p > max_elements:
            raise StatisticsError(
                f"the tangent Gram K = I_d ⊗ Σ would have p² = {p}² = {p * p} entries, above "
                f"max_elements = {max_elements}; use feature_gram() (Σ, {self.k}×{self.k}) instead"
            )
        kron = np.kron(np.eye(self.d), self.feature_gram())
        order = self.theta_vector(np.arange(p).reshape(self.d, self.k))
        return kron[np.ix_(order, order)]

    def noise_moment(self) -> np.ndarray:
        """``E[Xᵀ X]`` with ``X = Σ_r g_r φ̃_rᵀ`` an example's cross-gradient ``(k̃, k̃)`` float64.

        ``v̂ = tr(Σ⁻ E[XᵀX])`` is the plug-in bias ``n E[ŝ²] − n s²`` of the score and the
        scale of the noise test (theory/numerics.md, ``thm-noise-test``; MATH T7's ``v``).

        Returns:
            ``E[XᵀX]``, ``(k̃, k̃)`` float64.

        Raises:
            StatisticsError: if no examples were accumulated.
        """
        self._require_examples()
        self._flush()
        return (self.states["q_sum"] / self.n).cpu().numpy()

    def spectrum(self, *, rtol: float | None = None, eig: tuple[np.ndarray, np.ndarray] | None = None):
        """The resolved spectrum of ``Σ`` (:func:`~depthsat_theory.statistics.resolve_spectrum`).

        Uses the streamed triangular factor when every batch was float64 (amplitudes resolved
        to ``≈ k̃ u64``), else the float64 Gram (``def-resolution``).  With ``products="float32"`` the
        Gram carries the error ``η`` of :func:`~depthsat_theory.statistics.linalg.gram_error` (``L_32`` =
        the chunk length), and eigenvalues ``λ̃ ≤ 2η`` are dropped as unresolvable (``thm-score-error``).
        ``eig``: the eigendecomposition of :meth:`eigh_input` when already computed (ignored with the factor).

        Args:
            rtol: an explicit relative eigenvalue cutoff (default: the resolution cutoffs, ``def-resolution``).
            eig: ``(λ̃, Q)`` of :meth:`eigh_input` when already computed (ignored with the factor).

        Returns:
            The :class:`~depthsat_theory.statistics.linalg.Spectrum` of ``Σ`` (``k̃ × k̃``).
        """
        self._flush()
        factor = self.factor.r.numpy() / np.sqrt(self.n) if self._factored() else None
        _, summands, fast = self._rounding_inputs()
        eta = gram_error(k=self.k, summands=summands, product_summands=fast) if fast and factor is None else 0.0
        return resolve_spectrum(
            self.feature_gram(),
            dtype=self._features_dtype(),
            rtol=rtol,
            factor=factor,
            device=self.states["sigma"].device,
            gram_error=eta,
            eig=eig if factor is None else None,
        )

    def _factored(self) -> bool:
        """Whether :meth:`spectrum` uses the streamed triangular factor (every batch's ``z`` float64)."""
        return self.factor.rows == self.units and self.factor.rows > 0 and self.feature_dtype == torch.float64

    def eigh_input(self) -> np.ndarray | None:
        """The unit-diagonal Gram ``Σ̃`` that :meth:`result` would eigendecompose, for :func:`eigh_batched`.

        ``None`` when :meth:`result` needs no Gram eigensolve (the triangular factor or the unit path is
        used), before any example, or when the sums overflowed (``result`` then names the fault).

        Returns:
            ``Σ̃`` ``(k̃, k̃)`` float64 (:func:`scaled_gram` of :meth:`feature_gram`), or ``None``.
        """
        if self.n == 0 or self._kept:
            return None
        self._flush()
        if self._factored():
            return None
        sig = self.feature_gram()
        return scaled_gram(sig) if np.isfinite(sig).all() else None

    def result(
        self,
        *,
        rtol: float | None = None,
        tol: float | None = None,
        alpha: float = NOISE_ALPHA,
        eig: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> SaturationResult:
        """Compute ``s² = tr(G Σ⁺ Gᵀ)``, its rounding bound, the noise test and the other quantities.

        Args:
            rtol: an explicit relative eigenvalue cutoff for the unit-diagonal ``Σ̃`` (default:
                the resolution cutoffs of theory/numerics.md, ``def-resolution``).
            tol: an explicit saturation threshold (default: the rounding bound
                :func:`~depthsat_theory.statistics.score_error`).
            alpha: level of the noise test (``thm-noise-test``), in ``(0, 0.215]``.
            eig: ``(λ̃, Q)`` of :meth:`eigh_input` when already computed (e.g. by
                :func:`~depthsat_theory.statistics.linalg.eigh_batched` over the sites of a diagnosis).

        Returns:
            The site's :class:`SaturationResult`.

        Raises:
            StatisticsError: if no examples were accumulated or the sums overflowed.
        """
        self._require_examples()
        if self._kept:
            return self._unit_result(rtol=rtol, tol=tol, alpha=alpha)
        sig, big_g = self.feature_gram(), self.cross_gradient()
        self._check_finite(sig, big_g)
        spec = self.spectrum(rtol=rtol, eig=eig)
        self._spec_g = (spec, big_g)  # Π g (u) = G Σ⁻ φ̃(u), formed only if the tie pool asks (_project_units)
        moment = self.noise_moment()
        q_trace, q_upper = self._noise_trace(spec, moment)
        return self._finish(
            spec,
            spec.quadratic(big_g),
            self.theta_vector(big_g),
            self.d * self.k,
            tol,
            rank=self.d * spec.rank,
            q_trace=q_trace,
            alpha=alpha,
            grad_rows=big_g,
            noise_moment=moment,
            q_trace_upper=q_upper,
        )

    def _noise_trace(self, spec, moment: np.ndarray) -> tuple[float, float | None]:
        """``v̂ = tr(Σ⁻ E[XᵀX])`` and an upper bound on its exact-arithmetic value (theory/numerics.md).

        With the triangular factor of ``Σ`` and the noise factor (every batch float64, ``k̃ ≤ 1024``) ``v̂`` is
        ``tr(R_q Σ⁻ R_qᵀ)/n``, backward stable in the data (``thm-noise-factor``); otherwise it is read from the
        float64 Gram of the noise moment, whose error :meth:`_noise_trace_upper` bounds.
        """
        if spec.factored and self.noise_factor.rows == self.n:
            r_q = self.noise_factor.r.numpy() / math.sqrt(self.n)
            q_trace = spec.quadratic(r_q)
            return q_trace, self._factored_noise_upper(spec, r_q, q_trace)
        q_trace = spec.trace_product(moment)  # v̂ = tr(Σ⁻ E[XᵀX]) without forming Σ⁻
        return q_trace, self._noise_trace_upper(spec, moment, q_trace)

    def _rows_per_example(self) -> int:
        """``R``, the rows of an example at this site (``1`` for whole-tensor units)."""
        return max(1, math.prod(self.shape) // self.d) if self.family.unit == "row" else 1

    def _factored_noise_upper(self, spec, r_q: np.ndarray, q_trace: float) -> float:
        """``v̂_up`` of ``thm-noise-factor``: ``(√v̂ + (g_max ε + ε_q (tr Q̃)^{1/2})/σ̂)² + n A² ε/(σ̂ − ε)``.

        ``ε = C_φ u_in √k̃ + C_res √k̃ u64`` is the factor's backward error in the scaled data (as in
        :func:`~depthsat_theory.statistics.linalg.score_error`), ``ε_q = (C_res √k̃ + d + 2R) u64`` that of the noise
        rows relative to their Frobenius norm ``(tr Q̃)^{1/2}``, ``σ̂`` the smallest kept amplitude; ``∞`` when
        ``ε ≥ σ̂/2`` (the score's bound is infinite there too).
        """
        if not spec.rank:
            return q_trace
        dtype = self.dtype or torch.float64
        u64, sqrt_k = unit_roundoff(torch.float64), math.sqrt(self.k)
        eps = FEATURE_ROUNDING_FACTOR * unit_roundoff(dtype) * sqrt_k + RESOLUTION_FACTOR * sqrt_k * u64
        sig = math.sqrt(spec.lam_min)
        if eps >= 0.5 * sig:
            return math.inf
        eps_q = (RESOLUTION_FACTOR * sqrt_k + self.d + 2 * self._rows_per_example()) * u64
        tr_q = float(np.sum((r_q * spec.scale[None, :]) ** 2))
        root = math.sqrt(max(q_trace, 0.0)) + (self.g_max * eps + eps_q * math.sqrt(tr_q)) / sig
        return root * root + self.g_sq * eps / (sig - eps)

    def _noise_trace_upper(self, spec, moment: np.ndarray, q_trace: float) -> float | None:
        """An upper bound on the exact-arithmetic ``v̂`` read from the Gram of the noise moment (no noise factor).

        With ``‖δΣ̃‖₂ ≤ η`` and kept eigenvalues ``λ̃ ≥ λ_min > 2η``, the kept inverse ``S = Σ̃⁻`` grows by at
        most ``κ = λ_min/(λ_min − η) < 2``; the noise moment's entrywise error ``|δQ̃_ab| ≤ γ M_ab`` with
        ``M = |W̃|ᵀ|W̃|`` (``M_aa = Q̃_aa``, ``Q̃ = D^{-1/2} E[XᵀX] D^{-1/2}``) moves ``tr(S Q̃)`` by at most
        ``γ Σ_ab |S_ab| M_ab ≤ γ (Σ_a (S_aa Q̃_aa)^{1/2})²`` (Cauchy–Schwarz on both PSD matrices).  Hence
        ``v̂_up = κ (v̂ + γ (Σ_a (S_aa Q̃_aa)^{1/2})²)``, ``γ = γ_acc + C_res u64`` (theory/numerics.md, "Float32
        products"), with ``L_32`` grown by ``128 d + d + R`` at sites of ``R > 1`` rows per example (the moment's
        float32 sums run over ``g gᵀ``, the rows and up to 128 rows times ``d``).  With float64 products the same
        bound holds with ``L_32 = 0`` and ``L`` grown by ``2d + 4`` (the norms ``‖g_x‖``) or, at ``R > 1``, by
        ``(d + 1) B_max + d + R`` (the float64 sums over ``g gᵀ``, the rows and the batch's rows times ``d``).
        """
        _, summands, fast = self._rounding_inputs()
        if not spec.rank or not math.isfinite(q_trace):
            return None
        eta = gram_error(k=self.k, summands=summands, product_summands=fast)
        lam = spec.lam_min
        if lam <= eta:
            return math.inf
        rows = self._rows_per_example()
        if fast and rows > 1:  # multi-row noise moment: float32 sums over g gᵀ (d), the rows (R) and ≤ 128 rows · d
            fast += PRODUCT_CHUNK_ROWS * self.d + self.d + rows
        elif not fast:
            batch = round(float(self.states["batch_units_max"]))
            summands += (self.d + 1) * batch + self.d + rows if rows > 1 else 2 * self.d + 4
        gamma = gram_error(k=1, summands=summands, product_summands=fast)
        s_diag = (spec.vectors**2 / spec.values).sum(1)
        q_diag = np.clip(np.diag(moment) * spec.scale**2, 0.0, None)
        return lam / (lam - eta) * (q_trace + gamma * float(np.sum(np.sqrt(s_diag * q_diag))) ** 2)

    def _unit_result(self, *, rtol: float | None, tol: float | None, alpha: float) -> SaturationResult:
        """:meth:`result` on the unit path (theory/numerics.md, ``thm-unit-gram``).

        The scaled feature rows ``M = n^{-1/2} Φ̃ D^{-1/2}`` (``N × k̃``, ``D = diag Σ``) are factored by
        a thin SVD ``M = U S Vᵀ`` (backward stable in the data, like the triangular factor): the
        spectrum of ``Σ̃ = MᵀM`` is ``S²`` with eigenvectors ``V``, ``ŝ² = tr(G Σ⁻ Gᵀ)`` uses the
        streamed ``G`` exactly as the features path does, and ``v̂ = tr(Σ⁻ E[XᵀX]) = Σ_x ‖g_xᵀ U_x‖²``
        over the kept directions needs no ``k̃ × k̃`` moment.
        """
        kept = self._kept or []
        phi = torch.cat([kb.rows()[0] for kb in kept])
        diag = phi.pow(2).sum(0) / self.n
        big_g = self.cross_gradient()
        self._check_finite(big_g, diag.cpu().numpy())
        spec = resolve_spectrum(
            None,
            dtype=self._features_dtype(),
            rtol=rtol,
            factor=(phi / math.sqrt(self.n)).cpu().numpy(),
            diag=diag.cpu().numpy(),
            device=phi.device,
        )
        self._spec_g = (spec, big_g)
        if spec.rank:
            whiten = spec.vectors * (spec.scale[:, None] / np.sqrt(spec.values))  # D^{-1/2} V S^{-1}
            u_kept = (phi @ torch.from_numpy(whiten).to(phi.device)) / math.sqrt(self.n)  # U over the kept directions
            q_trace = _example_gram_sum(kept, u_kept)
        else:
            q_trace = 0.0
        return self._finish(
            spec,
            spec.quadratic(big_g),
            self.theta_vector(big_g),
            self.d * self.k,
            tol,
            rank=self.d * spec.rank,
            q_trace=q_trace,
            alpha=alpha,
            grad_rows=big_g,
            noise_moment=_UnitNoiseMoment(kept, self.n),  # type: ignore[arg-type]
        )

    def _project_units(self, units: Tensor) -> Tensor:
        spec, big_g = self._spec_g
        coef = torch.from_numpy(big_g @ spec.pinv())
        if self.family.unit == "row":
            site = _rows_as_site(units.to(torch.float64), self.layout)
            phi = self._features(site.to(self.states["sigma"].device)).reshape(units.shape[0], -1, self.k).cpu()
            return (phi @ coef.T).reshape(units.shape[0], -1)
        site = units.reshape(units.shape[0], *self.shape)
        phi = self._features(site.to(self.states["sigma"].device)).cpu()
        return from_rows(phi @ coef.T, self.layout, site.shape).reshape(units.shape[0], -1)

    def theta_vector(self, mat: np.ndarray) -> np.ndarray:
        """Flatten a ``(d, k̃)`` matrix in the tangent-coordinate order ``(vec_row(W), c)``.

        Args:
            mat: a ``(d, k̃)`` matrix (e.g. ``G``), the constant column last when ``bias``.

        Returns:
            A new ``(d k̃,)`` array: the rows of ``mat[:, :k]``, then the constant column when ``bias``.
        """
        if self.family.bias:
            return np.concatenate([mat[:, :-1].reshape(-1), mat[:, -1]])
        return mat.reshape(-1).copy()

    def projector(self, *, rtol: float | None = None) -> TangentProjector:
        """The orthogonal projector onto ``T`` on this probe's units (see :class:`TangentProjector`).

        Args:
            rtol: relative eigenvalue cutoff (see :meth:`spectrum`).

        Returns:
            A :class:`TangentProjector` with ``Σ⁺`` and the rank of :meth:`spectrum`; call :meth:`TangentProjector.on`
            before applying it.
        """
        spec = self.spectrum(rtol=rtol)
        return TangentProjector(self, spec.pinv(), spec.rank)


class TangentProjector:
    r"""Orthogonal projector ``Π`` onto the tangent space of a feature family on a probe.

    Acts on functions sampled at the probe's rows: an array ``m`` of shape
    ``(N, d)`` (one row per unit row ``u_i`` of the probe, ``N`` = number of rows, in
    the order of :func:`~depthsat_theory.families.base.to_rows` over the probe) maps to

    .. math::

        (Π m)(u_i) = M Σ^+ φ̃(u_i), \qquad M = \tfrac1n \textstyle\sum_j m(u_j) φ̃(u_j)^T,

    the least-squares fit of ``m`` by ``V φ̃`` in ``⟨·,·⟩`` (self-adjoint and
    idempotent in that inner product, and in the Euclidean one on ``R^{N d}``).
    Built by :meth:`FeatureStatistics.projector`; ``phi`` (the probe's ``φ̃`` rows) is
    set with :meth:`on`.
    """

    def __init__(self, stats: FeatureStatistics, sigma_pinv: np.ndarray, rank: int):
        self.stats = stats
        self.sigma_pinv = sigma_pinv
        self.rank = rank
        self.phi: np.ndarray | None = None

    def on(self, z: Tensor) -> TangentProjector:
        """Fix the probe's rows: ``z`` are the probe's site tensors ``(n, *shape)``.

        Args:
            z: the probe's site tensors ``(n, *shape)``.

        Returns:
            ``self``, with ``phi`` the ``(N, k̃)`` float64 feature rows (``N = n R``) and ``n`` set.
        """
        phi = self.stats._features(z)
        self.phi = phi.reshape(-1, phi.shape[-1]).cpu().numpy()
        self.n = int(z.shape[0])
        return self

    def __call__(self, m: np.ndarray) -> np.ndarray:
        """Apply ``Π`` to ``m`` of shape ``(N, d)``; returns ``(N, d)`` float64."""
        if self.phi is None:
            raise StatisticsError("call .on(z) with the probe's site tensors first")
        m = np.asarray(m, dtype=np.float64)
        if m.shape != (self.phi.shape[0], self.stats.d):
            raise StatisticsError(f"m must have shape {(self.phi.shape[0], self.stats.d)}, got {m.shape}")
        big_m = m.T @ self.phi / self.n
        return self.phi @ (big_m @ self.sigma_pinv).T

    def to_scipy(self) -> spla.LinearOperator:
        """The projector as a :class:`scipy.sparse.linalg.LinearOperator` on ``R^{N d}``.

        Returns:
            A symmetric float64 ``LinearOperator`` of size ``(N d, N d)`` acting on flattened ``(N, d)`` arrays.

        Raises:
            StatisticsError: if :meth:`on` was not called.
        """
        if self.phi is None:
            raise StatisticsError("call .on(z) with the probe's site tensors first")
        size = self.phi.shape[0] * self.stats.d
        shape = (self.phi.shape[0], self.stats.d)

        def mv(v):
            return self(np.asarray(v).reshape(shape)).reshape(-1)

        return spla.LinearOperator((size, size), matvec=mv, rmatvec=mv, dtype=np.float64)
