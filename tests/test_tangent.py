"""Tests for depthsat_theory.statistics (streaming tangent statistics, projector, scores).

Every expected value is derived independently of ``tangent.py``: from dense
Jacobians (``reference.dense_jacobian`` / ``torch.func``), from Jacobians or
feature matrices assembled here in numpy, or from closed forms (ranks of
explicitly rank-deficient designs, ``Mᵀ b`` under a linear reparameterization).
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from depthsat_theory.capture import SiteRecorder
from depthsat_theory.engines import dense_jacobian, dense_saturation
from depthsat_theory.families import FamilyError, GeneralFamily, linear, parse_family
from depthsat_theory.statistics import FeatureStatistics, GeneralStatistics, StatisticsError, statistics_for
from depthsat_theory.tasks import Task, constructions

DT = torch.float64

# per-example site shapes and probe sizes, kept tiny so the dense references are cheap
SHAPES = {"vector": (3,), "sequence": (4, 3), "image": (3, 2, 3)}
PROBE_N = {"vector": 14, "sequence": 4, "image": 3}

ROW_SPECS = ["linear", "linear-nobias", "poly:2", "relu:7", "even:square", "preln:5"]
FEATURE_CASES = [(spec, lay) for spec in ROW_SPECS for lay in ("vector", "sequence", "image")] + [
    ("conv1x1", "image"),
    ("conv3x3:4", "image"),
    ("attention:4", "sequence"),
]


# ----------------------------------------------------------------------------- helpers
def _rand(shape, seed: int, device) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=DT).to(device)


def _probe(layout: str, seed: int, device, n: int | None = None) -> tuple[Tensor, Tensor]:
    n = PROBE_N[layout] if n is None else n
    z = _rand((n, *SHAPES[layout]), seed, device)
    g = _rand((n, *SHAPES[layout]), seed + 1000, device)
    return z, g


def np_rows(t, layout: str) -> np.ndarray:
    """Rows (positions) of site tensors as an ``(N, d)`` numpy array (written here, not ``to_rows``)."""
    a = t.detach().cpu().numpy() if isinstance(t, Tensor) else np.asarray(t)
    if layout == "vector":
        return a.reshape(a.shape[0], -1)
    if layout == "sequence":
        return a.reshape(-1, a.shape[-1])
    return a.transpose(0, 2, 3, 1).reshape(-1, a.shape[1])


def np_unrows(rows: np.ndarray, layout: str, shape) -> np.ndarray:
    """Inverse of :func:`np_rows`, flattened in site-tensor (C-contiguous) order."""
    n = rows.size // int(np.prod(shape))
    if layout in ("vector", "sequence"):
        return rows.reshape(-1)
    c, h, w = shape
    return rows.reshape(n, h, w, c).transpose(0, 3, 1, 2).reshape(-1)


def phi_tilde(family, z: Tensor, layout: str) -> np.ndarray:
    """``φ̃`` rows ``(N, k̃)`` from the family's feature module plus a ones column (numpy)."""
    shape = tuple(z.shape[1:])
    fmap = family.feature_map(shape, layout, dtype=DT, device=z.device)
    with torch.no_grad():
        phi = fmap(z.to(DT))
    phi = phi.reshape(-1, phi.shape[-1]).detach().cpu().numpy()
    if family.bias:
        phi = np.hstack([phi, np.ones((phi.shape[0], 1))])
    return phi


def lstsq_projection(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least-squares fit of ``target`` columns by the columns of ``design`` (numpy SVD)."""
    coef, *_ = np.linalg.lstsq(design, target, rcond=None)
    return design @ coef


def feature_score(phi: np.ndarray, grows: np.ndarray, n: int) -> float:
    """``s = ‖Π g‖ / sqrt(n)`` with ``Π`` the row-wise projection onto span(φ̃)."""
    proj = lstsq_projection(phi, grows)
    return math.sqrt(float(np.sum(proj * proj)) / n)


def feature_gradient(phi: np.ndarray, grows: np.ndarray, n: int, bias: bool) -> np.ndarray:
    """``b = vec(E[Σ_r g_r φ̃_rᵀ])`` in the order ``(vec_row(W), c)``."""
    big_g = grows.T @ phi / n
    if bias:
        return np.concatenate([big_g[:, :-1].reshape(-1), big_g[:, -1]])
    return big_g.reshape(-1)


def linear_jacobian_np(z: np.ndarray, bias: bool) -> np.ndarray:
    """Dense tangent Jacobian of ``h(u) = W u (+ c)`` on vector sites, built by hand.

    Row ``(x, i)`` (example ``x``, output coordinate ``i``) has ``u_x`` in the
    columns of ``W[i, :]`` and a 1 in the column of ``c_i``.
    """
    n, d = z.shape
    eye = np.eye(d)
    blocks = []
    for x in range(n):
        a_w = np.kron(eye, z[x][None, :])  # (d, d*d)
        blocks.append(np.hstack([a_w, eye]) if bias else a_w)
    return np.vstack(blocks)


def general_tanh_sq() -> GeneralFamily:
    """``h(θ, u) = θ[:d] ⊙ tanh(u) + θ[d:] ⊙ u²`` (row unit)."""

    def fn(theta: Tensor, u: Tensor) -> Tensor:
        d = u.shape[-1]
        return theta[:d] * torch.tanh(u) + theta[d:] * u**2

    return GeneralFamily(fn, lambda d: 2 * d, name="tanh-sq")


def general_tanh_sq_expected(z: Tensor, g: Tensor, layout: str):
    """Score, gradient and rank of :func:`general_tanh_sq`, coordinate by coordinate (numpy).

    ``A`` is block diagonal over output coordinates ``i``: coordinate ``i`` of ``h``
    depends only on ``(θ_i, θ_{d+i})`` through the columns ``tanh(u_i)``, ``u_i²``.
    """
    n = z.shape[0]
    u, gr = np_rows(z, layout), np_rows(g, layout)
    d = u.shape[1]
    s2, rank = 0.0, 0
    b = np.zeros(2 * d)
    for i in range(d):
        design = np.stack([np.tanh(u[:, i]), u[:, i] ** 2], axis=1)
        proj = lstsq_projection(design, gr[:, i])
        s2 += float(proj @ proj)
        rank += int(np.linalg.matrix_rank(design))
        b[i] = float(np.tanh(u[:, i]) @ gr[:, i]) / n
        b[d + i] = float((u[:, i] ** 2) @ gr[:, i]) / n
    return math.sqrt(s2 / n), b, rank


def general_tensor_family() -> GeneralFamily:
    """A tensor-unit general family on vector sites: ``θ0·roll(z) + θ1·z²``."""

    def fn(theta: Tensor, z: Tensor) -> Tensor:
        return theta[0] * torch.roll(z, 1, dims=-1) + theta[1] * z * z

    return GeneralFamily(fn, 2, name="roll-sq", unit="tensor", layouts=("vector",))


def gram_condition(phi: np.ndarray) -> float:
    """Condition number of ``Σ = φ̃ᵀφ̃`` on its range (numpy SVD of ``φ̃``)."""
    sv = np.linalg.svd(phi, compute_uv=False)
    sv = sv[sv > 1e-12 * sv.max()] if sv.size and sv.max() > 0 else np.ones(1)
    return float((sv.max() / sv.min()) ** 2)


def stream_slack(phi: np.ndarray) -> float:
    """Relative accuracy to expect from the streaming (normal-equation) path.

    ``s²`` is formed from ``Σ⁺``, whose forward error is ``O(eps · cond Σ)``; allow
    100× that on top of 1e-12.
    """
    return 1e-12 + 100 * np.finfo(np.float64).eps * gram_condition(phi)


def _close(a, b, rtol=1e-9, atol=1e-12) -> bool:
    return bool(np.allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), rtol=rtol, atol=atol))


# ============================================================================ 1. projector
@pytest.mark.parametrize("spec,layout", FEATURE_CASES)
def test_projector_is_orthogonal_projector_onto_tangent_space(spec, layout, device):
    fam = parse_family(spec)
    shape = SHAPES[layout]
    z, g = _probe(layout, seed=11, device=device)
    stats = FeatureStatistics(fam, shape, layout)
    stats.update(z, g)
    proj = stats.projector().on(z)
    op = proj.to_scipy()
    size = op.shape[0]
    n_rows = np_rows(z, layout).shape[0]
    d = fam.site_dim(shape, layout)
    assert size == n_rows * d
    mat = op @ np.eye(size)
    scale = max(1.0, float(np.abs(mat).max()))
    # symmetric and idempotent
    assert np.abs(mat - mat.T).max() <= 1e-10 * scale
    assert np.abs(mat @ mat - mat).max() <= 1e-9 * scale
    # trace = dim T on the probe = d · rank φ̃ (independent: numpy rank of the feature matrix)
    phi = phi_tilde(fam, z, layout)
    assert round(float(np.trace(mat))) == d * int(np.linalg.matrix_rank(phi))

    rng = np.random.default_rng(5)
    # Π fixes T: m = V φ̃ rows for a random V
    v = rng.standard_normal((d, phi.shape[1]))
    m_in = phi @ v.T
    out = proj(m_in)
    assert np.abs(out - m_in).max() <= 1e-9 * max(1.0, np.abs(m_in).max())

    # Π kills T⊥: m − Π m is orthogonal to every column of the dense Jacobian
    jac = dense_jacobian(fam, z, layout)
    m = rng.standard_normal((n_rows, d))
    resid = np_unrows(m - proj(m), layout, shape)
    inner = jac.T @ resid
    assert np.abs(inner).max() <= 1e-9 * np.linalg.norm(jac) * np.linalg.norm(m)
    # and Π m is the Jacobian's least-squares fit of m (independent projection)
    ref = lstsq_projection(jac, np_unrows(m, layout, shape))
    assert np.abs(np_unrows(proj(m), layout, shape) - ref).max() <= 1e-9 * np.abs(m).max()


def test_projector_requires_on_and_checks_shape(device):
    fam = parse_family("linear")
    z, g = _probe("vector", 3, device)
    stats = FeatureStatistics(fam, (3,), "vector")
    stats.update(z, g)
    proj = stats.projector()
    with pytest.raises(StatisticsError):
        proj(np.zeros((z.shape[0], 3)))
    with pytest.raises(StatisticsError):
        proj.to_scipy()
    proj.on(z)
    with pytest.raises(StatisticsError):
        proj(np.zeros((z.shape[0] + 1, 3)))


# ============================================================================ 2. scores
@pytest.mark.parametrize("spec,layout", FEATURE_CASES)
def test_cross_gradient_score_matches_dense_and_numpy(spec, layout, device):
    fam = parse_family(spec)
    shape = SHAPES[layout]
    z, g = _probe(layout, seed=21, device=device)
    stats = statistics_for(fam, shape, layout)
    assert isinstance(stats, FeatureStatistics)
    stats.update(z, g)
    res = stats.result()
    dense = dense_saturation(fam, z, g, layout)
    n = z.shape[0]
    phi = phi_tilde(fam, z, layout)
    grows = np_rows(g, layout)
    s_np = feature_score(phi, grows, n)
    assert res.score > 0.1  # a random g is far from saturated: the comparison is not vacuous
    assert _close(res.score, dense.score, rtol=1e-9)
    assert _close(res.score, s_np, rtol=1e-9)
    assert _close(res.gradient, dense.gradient, rtol=1e-9, atol=1e-12)
    assert _close(res.gradient, feature_gradient(phi, grows, n, fam.bias), rtol=1e-9, atol=1e-12)
    d = fam.site_dim(shape, layout)
    assert res.tangent_rank == dense.tangent_rank == d * np.linalg.matrix_rank(phi)
    assert res.tangent_dim == dense.jacobian.shape[1]
    assert not res.degenerate and not res.saturated
    # raw quantities on the whole site tensor
    gn = g.detach().cpu().numpy().reshape(n, -1)
    assert _close(res.ag_rms, math.sqrt(np.sum(gn**2) / n), rtol=1e-12)
    assert _close(res.ag_max, np.linalg.norm(gn, axis=1).max(), rtol=1e-12)
    zn = z.detach().cpu().numpy().reshape(n, -1)
    assert _close(res.activation_scaled_score, res.score * math.sqrt(np.sum(zn**2) / n), rtol=1e-12)
    assert _close(res.relative_score, s_np / math.sqrt(np.sum(gn**2) / n), rtol=1e-9)
    assert res.units == phi.shape[0] and res.n == n


@pytest.mark.parametrize("bias", [True, False])
def test_linear_family_against_handbuilt_kron_jacobian(bias, device):
    fam = linear(bias=bias)
    z, g = _probe("vector", seed=31, device=device, n=9)
    stats = statistics_for(fam, (3,), "vector")
    stats.update(z, g)
    res = stats.result()
    zn, gn = z.cpu().numpy(), g.cpu().numpy()
    a = linear_jacobian_np(zn, bias)
    # the dense torch.func reference agrees with the hand-built Jacobian
    np.testing.assert_allclose(dense_jacobian(fam, z, "vector"), a, rtol=0, atol=1e-15)
    gv = gn.reshape(-1)
    proj = lstsq_projection(a, gv)
    assert _close(res.score, math.sqrt(proj @ proj / zn.shape[0]), rtol=1e-10)
    assert _close(res.gradient, a.T @ gv / zn.shape[0], rtol=1e-10, atol=1e-14)
    assert res.tangent_rank == np.linalg.matrix_rank(a) == 3 * (3 + int(bias))
    # s = sup_v bᵀv / ‖Av‖ (attained at v = K⁺ b)
    kmat = a.T @ a / zn.shape[0]
    b = a.T @ gv / zn.shape[0]
    v = np.linalg.pinv(kmat) @ b
    assert _close(res.score, (b @ v) / math.sqrt(v @ kmat @ v), rtol=1e-9)


@pytest.mark.parametrize("layout", ["vector", "sequence", "image"])
def test_general_family_matches_dense_and_closed_form(layout, device):
    fam = general_tanh_sq()
    shape = SHAPES[layout]
    z, g = _probe(layout, seed=41, device=device)
    stats = statistics_for(fam, shape, layout)
    assert isinstance(stats, GeneralStatistics)
    stats.update(z, g)
    res = stats.result()
    dense = dense_saturation(fam, z, g, layout)
    s_np, b_np, rank_np = general_tanh_sq_expected(z, g, layout)
    assert res.score > 0.1
    assert _close(res.score, dense.score, rtol=1e-9)
    assert _close(res.score, s_np, rtol=1e-9)
    assert _close(res.gradient, dense.gradient, rtol=1e-9, atol=1e-13)
    assert _close(res.gradient, b_np, rtol=1e-9, atol=1e-13)
    assert res.tangent_rank == dense.tangent_rank == rank_np == 2 * shape[0 if layout == "image" else -1]
    assert res.tangent_dim == 2 * shape[0 if layout == "image" else -1]


def test_general_tensor_unit_family(device):
    fam = general_tensor_family()
    z, g = _probe("vector", seed=43, device=device)
    stats = statistics_for(fam, (3,), "vector")
    stats.update(z, g)
    res = stats.result()
    zn, gn = z.cpu().numpy(), g.cpu().numpy()
    a = np.stack([np.roll(zn, 1, axis=-1).reshape(-1), (zn * zn).reshape(-1)], axis=1)
    proj = lstsq_projection(a, gn.reshape(-1))
    assert _close(res.score, math.sqrt(proj @ proj / zn.shape[0]), rtol=1e-9)
    assert _close(res.gradient, a.T @ gn.reshape(-1) / zn.shape[0], rtol=1e-10, atol=1e-14)
    assert res.tangent_rank == 2
    assert res.units == zn.shape[0]


def _const_column(z: Tensor, col: int, value: float = 0.5) -> Tensor:
    z = z.clone()
    z[:, col] = value
    return z


def test_rank_deficient_constant_column_linear(device):
    """φ̃ = (z, 1) with an all-equal column of z: rank Σ = d, not d + 1."""
    d = 3
    z, g = _probe("vector", seed=51, device=device, n=10)
    z = _const_column(z, 1)
    fam = parse_family("linear")
    stats = statistics_for(fam, (d,), "vector")
    stats.update(z, g)
    res = stats.result()
    dense = dense_saturation(fam, z, g, "vector")
    assert res.tangent_rank == dense.tangent_rank == d * d  # closed form: d · (d + 1 − 1)
    assert res.tangent_dim == d * (d + 1)
    a = linear_jacobian_np(z.cpu().numpy(), True)
    proj = lstsq_projection(a, g.cpu().numpy().reshape(-1))
    assert _close(res.score, math.sqrt(proj @ proj / 10), rtol=1e-9)
    assert _close(res.score, dense.score, rtol=1e-9)
    assert _close(res.gradient, dense.gradient, rtol=1e-9, atol=1e-13)


def test_rank_deficient_duplicate_features(device):
    """linear-nobias with two equal columns of z, and relu features on a repeated probe row."""
    d = 3
    z, g = _probe("vector", seed=53, device=device, n=10)
    z = z.clone()
    z[:, 2] = z[:, 0]
    fam = parse_family("linear-nobias")
    stats = statistics_for(fam, (d,), "vector")
    stats.update(z, g)
    res = stats.result()
    dense = dense_saturation(fam, z, g, "vector")
    assert res.tangent_rank == dense.tangent_rank == d * (d - 1)
    assert _close(res.score, dense.score, rtol=1e-9)
    a = linear_jacobian_np(z.cpu().numpy(), False)
    proj = lstsq_projection(a, g.cpu().numpy().reshape(-1))
    assert _close(res.score, math.sqrt(proj @ proj / 10), rtol=1e-9)

    # relu:7 on a probe with only 3 distinct rows: rank Σ ≤ 3 < k̃ = 8
    base = _rand((3, d), 54, device)
    zr = base[torch.tensor([0, 1, 2, 0, 1, 2, 0, 1], device=device)]
    gr = _rand(zr.shape, 55, device)
    fam = parse_family("relu:7")
    stats = statistics_for(fam, (d,), "vector")
    stats.update(zr, gr)
    res = stats.result()
    dense = dense_saturation(fam, zr, gr, "vector")
    phi = phi_tilde(fam, zr, "vector")
    assert res.tangent_rank == dense.tangent_rank == d * np.linalg.matrix_rank(phi)
    assert res.tangent_rank <= 3 * d
    assert _close(res.score, dense.score, rtol=1e-9)


def test_rank_deficient_general_family(device):
    """tanh(u_1) and u_1² are proportional when column 1 is constant: rank 2d − 1."""
    d = 3
    z, g = _probe("vector", seed=57, device=device, n=10)
    z = _const_column(z, 1)
    fam = general_tanh_sq()
    stats = statistics_for(fam, (d,), "vector")
    stats.update(z, g)
    res = stats.result()
    dense = dense_saturation(fam, z, g, "vector")
    s_np, b_np, rank_np = general_tanh_sq_expected(z, g, "vector")
    assert res.tangent_rank == dense.tangent_rank == rank_np == 2 * d - 1
    assert _close(res.score, s_np, rtol=1e-9)
    assert _close(res.gradient, b_np, rtol=1e-9, atol=1e-13)


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 12),
    d=st.integers(1, 4),
    spec=st.sampled_from(["linear", "linear-nobias", "poly:2", "tanh:5"]),
)
def test_score_matches_numpy_property(seed, n, d, spec, device):
    fam = parse_family(spec)
    z = _rand((n, d), seed, device)
    g = _rand((n, d), seed + 1, device)
    stats = statistics_for(fam, (d,), "vector")
    stats.update(z, g)
    res = stats.result()
    phi = phi_tilde(fam, z, "vector")
    grows = g.cpu().numpy()
    # compare where φ̃ is well conditioned: Σ = φ̃ᵀφ̃ squares the condition number, so
    # the streaming path has error ~eps·cond(φ̃)² (the ill-conditioned regime is
    # covered by test_score_bounded_by_ag_rms_on_nearly_dependent_features)
    sv = np.linalg.svd(phi, compute_uv=False)
    assume(sv.min() >= 1e-3 * sv.max())
    slack = stream_slack(phi)
    assert _close(res.score, feature_score(phi, grows, n), rtol=slack, atol=1e-12)
    assert _close(res.gradient, feature_gradient(phi, grows, n, fam.bias), rtol=1e-10, atol=1e-13)
    assert res.score <= res.ag_rms * (1 + slack)


def test_score_bounded_by_ag_rms_on_nearly_dependent_features(device):
    """``s = ‖Π g‖ ≤ ‖g‖ = AG_rms`` for any orthogonal projector, however ill-conditioned.

    Smooth random features of a scalar input (``d = 1``) are nearly linearly
    dependent; the projection must still be a contraction.  The bound is checked
    to 1e-10 relative (float64 rounding is ~1e-16).
    """
    cases = [("gelu:12", 164, 8), ("tanh:12", 253, 12), ("tanh:5", 138, 5)]
    ratios = []
    for spec, seed, n in cases:
        z, g = _rand((n, 1), seed, device), _rand((n, 1), seed + 1, device)
        stats = statistics_for(parse_family(spec), (1,), "vector", pool_ties=True)
        stats.update(z, g)
        res = stats.result()
        gn = g.cpu().numpy()
        assert _close(res.ag_rms, math.sqrt(float(np.sum(gn**2)) / n), rtol=1e-12)
        ratios.append((spec, res.score / res.ag_rms, res.raw_score / res.ag_rms))
    assert all(s_ratio <= 1 + 1e-10 and s_ratio <= r_ratio + 1e-10 for _, s_ratio, r_ratio in ratios), ratios


# ============================================================================ 3. streaming
def _assert_same_result(a, b):
    for name in (
        "score",
        "raw_score",
        "ag_rms",
        "ag_max",
        "realizability_defect",
        "activation_scaled_score",
        "relative_score",
    ):
        x, y = getattr(a, name), getattr(b, name)
        assert (math.isnan(x) and math.isnan(y)) or abs(x - y) <= 1e-12 * max(1.0, abs(x)), name
    assert np.abs(a.gradient - b.gradient).max() <= 1e-12
    for name in ("tangent_rank", "tangent_dim", "n", "units", "degenerate", "saturated"):
        assert getattr(a, name) == getattr(b, name), name


@pytest.mark.parametrize(
    "spec,layout",
    [
        ("linear", "vector"),
        ("relu:7", "sequence"),
        ("conv3x3:4", "image"),
        ("attention:4", "sequence"),
        ("general", "vector"),
    ],
)
def test_streaming_batches_and_merge(spec, layout, device):
    fam = general_tanh_sq() if spec == "general" else parse_family(spec)
    shape = SHAPES[layout]
    z, g = _probe(layout, seed=61, device=device, n=7)

    def fresh():
        return statistics_for(fam, shape, layout, pool_ties=True)

    one = fresh()
    one.update(z, g)
    ref = one.result()

    many = fresh()
    for lo, hi in ((0, 2), (2, 3), (3, 7)):
        many.update(z[lo:hi], g[lo:hi])
    _assert_same_result(ref, many.result())

    left, right = fresh(), fresh()
    left.update(z[:4], g[:4])
    right.update(z[4:5], g[4:5])
    right.update(z[5:], g[5:])
    _assert_same_result(ref, left.merge(right).result())
    assert ref.n == 7


def test_merge_rejects_different_sites(device):
    a = FeatureStatistics(parse_family("linear"), (3,), "vector")
    b = FeatureStatistics(parse_family("linear"), (4,), "vector")
    a.update(*_probe("vector", 1, device))
    b.update(_rand((5, 4), 2, device), _rand((5, 4), 3, device))
    with pytest.raises(StatisticsError):
        a.merge(b)


# ============================================================================ 4. chain s ≤ r ≤ AG_rms ≤ AG_max
def pooled_raw(z: Tensor, g: Tensor, layout: str, unit: str, phi: np.ndarray | None):
    """``r̂`` (pooling exactly equal units) and ``ρ̂`` computed in numpy by grouping rows."""
    n = z.shape[0]
    if unit == "row":
        zu, gu = np_rows(z, layout), np_rows(g, layout)
    else:
        zu = z.detach().cpu().numpy().reshape(n, -1)
        gu = g.detach().cpu().numpy().reshape(n, -1)
    _, inverse = np.unique(zu, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    m_hat = np.zeros_like(gu)
    for k in np.unique(inverse):
        idx = inverse == k
        m_hat[idx] = gu[idx].mean(axis=0)
    r = math.sqrt(float(np.sum(m_hat**2)) / n)
    rho = float("nan")
    if phi is not None and r > 0:
        # tensor units go back to rows for the row-wise projection
        m_rows = m_hat if unit == "row" else np_rows(m_hat.reshape(z.shape), layout)
        resid = m_rows - lstsq_projection(phi, m_rows)
        rho = math.sqrt(float(np.sum(resid**2)) / n) / r
    return r, rho, len(np.unique(inverse)) < zu.shape[0]


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n_distinct=st.integers(1, 5),
    n=st.integers(1, 12),
    d=st.integers(1, 3),
    layout=st.sampled_from(["vector", "sequence"]),
    spec=st.sampled_from(["linear", "relu:4", "even:abs", "linear-nobias"]),
    noise=st.booleans(),
)
def test_chain_s_le_r_le_agrms_le_agmax(seed, n_distinct, n, d, layout, spec, noise, device):
    rng = np.random.default_rng(seed)
    t = 1 if layout == "vector" else 3
    distinct = rng.standard_normal((n_distinct, d))
    idx = rng.integers(0, n_distinct, size=n * t)
    rows = distinct[idx]
    shape = (d,) if layout == "vector" else (t, d)
    z = torch.from_numpy(rows.reshape(n, *shape).copy()).to(device)
    # g: a function of the unit plus (optionally) noise, so equal units may disagree
    signal = rng.standard_normal((n_distinct, d))[idx]
    gn = signal + (rng.standard_normal(rows.shape) if noise else 0.0)
    g = torch.from_numpy(gn.reshape(n, *shape).copy()).to(device)
    fam = parse_family(spec)
    stats = statistics_for(fam, shape, layout, pool_ties=True)
    stats.update(z, g)
    res = stats.result()
    phi = phi_tilde(fam, z, layout)
    r, rho, has_ties = pooled_raw(z, g, layout, fam.unit, phi)
    s_np = feature_score(phi, np_rows(g, layout), n)
    gflat = gn.reshape(n, -1)
    ag_rms = math.sqrt(float(np.sum(gflat**2)) / n)
    ag_max = float(np.linalg.norm(gflat, axis=1).max())
    eps = 1e-12
    # well-conditioned features only: the ill-conditioned regime is covered by
    # test_score_bounded_by_ag_rms_on_nearly_dependent_features
    assume(gram_condition(phi) <= 1e6)
    slack = stream_slack(phi)
    assert _close(res.score, s_np, rtol=slack, atol=1e-12)
    assert _close(res.raw_score, r, rtol=1e-10, atol=1e-14)
    assert _close(res.ag_rms, ag_rms, rtol=1e-12)
    assert _close(res.ag_max, ag_max, rtol=1e-12)
    assert res.score <= res.raw_score * (1 + slack) + eps
    assert res.raw_score <= res.ag_rms * (1 + eps)
    assert res.ag_rms <= res.ag_max * (1 + eps)
    if r > 1e-8:
        # compared squared: ρ̂² inherits only the (small) error of s; ρ̂ itself loses
        # half the digits near 0 (see test_realizability_defect_exact_when_m_in_tangent_space)
        assert abs(res.realizability_defect**2 - rho**2) <= 10 * slack
    if noise and has_ties:
        # exact duplicates with different gradients: pooling strictly shrinks the norm
        assert res.raw_score < res.ag_rms * (1 - 1e-9)
    if not has_ties:
        assert _close(res.raw_score, res.ag_rms, rtol=1e-12)


def test_chain_strict_with_duplicates_tensor_unit(device):
    """Whole sequences repeated (attention unit = the sequence): r̂ < AG_rms strictly."""
    base = _rand((2, 4, 3), 71, device)
    z = base[torch.tensor([0, 1, 0, 0, 1], device=device)]
    g = _rand(z.shape, 72, device)
    fam = parse_family("attention:4")
    stats = statistics_for(fam, (4, 3), "sequence", pool_ties=True)
    stats.update(z, g)
    res = stats.result()
    r, _, has_ties = pooled_raw(z, g, "sequence", "tensor", None)
    assert has_ties
    assert _close(res.raw_score, r, rtol=1e-12)
    assert res.score <= res.raw_score * (1 + 1e-9)
    assert res.raw_score < res.ag_rms * (1 - 1e-3)
    assert res.ag_rms <= res.ag_max


def test_realizability_defect_exact_when_m_in_tangent_space(device):
    """T6: g = V φ̃(z) is a function of the unit lying in T, so m̂ = Π m̂ and ρ̂ = 0.

    The ground truth ``ρ = 0`` holds by construction; float64 rounding of ``‖m̂ − Π m̂‖``
    is ~1e-16·‖m̂‖, so ``ρ̂`` must be tiny (1e-10 leaves a margin of 10⁶).
    """
    rhos = []
    for seed in range(8):
        rng = np.random.default_rng(seed)
        zn = rng.standard_normal((20, 3))
        v = rng.standard_normal((3, 4))
        gn = np.hstack([zn, np.ones((20, 1))]) @ v.T
        z, g = torch.from_numpy(zn).to(device), torch.from_numpy(gn).to(device)
        stats = statistics_for(parse_family("linear"), (3,), "vector", pool_ties=True)
        stats.update(z, g)
        res = stats.result()
        # independent: the least-squares residual of m̂ = g on (z, 1) is ~0
        resid = gn - lstsq_projection(np.hstack([zn, np.ones((20, 1))]), gn)
        assert np.linalg.norm(resid) <= 1e-12 * np.linalg.norm(gn)
        assert _close(res.score, res.raw_score, rtol=1e-12)
        rhos.append(res.realizability_defect)
    assert max(rhos) <= 1e-10, rhos


def test_raw_score_nan_without_pooling(device):
    stats = statistics_for(parse_family("linear"), (3,), "vector")
    stats.update(*_probe("vector", 73, device))
    res = stats.result()
    assert math.isnan(res.raw_score) and math.isnan(res.realizability_defect)
    assert res.to_dict()["raw_score"] is None


# ============================================================================ 5. reparameterization (T4)
def _reparam_family(m_mat: np.ndarray | None, d: int) -> GeneralFamily:
    lin = linear()
    mt = None if m_mat is None else torch.from_numpy(m_mat)

    def fn(xi: Tensor, u: Tensor) -> Tensor:
        theta = xi * xi if mt is None else mt.to(xi) @ xi + xi * xi
        return lin.functional(theta, u, "vector")

    return GeneralFamily(fn, lambda dd: dd * (dd + 1), name="chi-linear", layouts=("vector",))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reparameterization_invariance(seed, device):
    d, n = 3, 12
    p = d * (d + 1)
    rng = np.random.default_rng(100 + seed)
    m_mat = rng.standard_normal((p, p)) + 2 * np.eye(p)
    assert abs(np.linalg.det(m_mat)) > 1e-3
    z, g = _probe("vector", seed=200 + seed, device=device, n=n)
    lin = statistics_for(linear(), (d,), "vector")
    lin.update(z, g)
    rl = lin.result()
    gen = statistics_for(_reparam_family(m_mat, d), (d,), "vector")
    gen.update(z, g)
    rg = gen.result()
    # independent linear-family quantities
    zn, gn = z.cpu().numpy(), g.cpu().numpy()
    phi = np.hstack([zn, np.ones((n, 1))])
    b_lin = feature_gradient(phi, gn, n, True)
    s_lin = feature_score(phi, gn, n)
    assert _close(rl.score, s_lin, rtol=1e-9)
    assert _close(rg.score, s_lin, rtol=1e-8)
    assert rg.tangent_rank == rl.tangent_rank == p
    # b ↦ Dχ(0)ᵀ b with Dχ(0) = M
    assert _close(rg.gradient, m_mat.T @ b_lin, rtol=1e-9, atol=1e-12)
    assert abs(np.linalg.norm(rg.gradient) - np.linalg.norm(b_lin)) > 1e-3 * np.linalg.norm(b_lin)


def test_degenerate_reparameterization(device):
    d = 3
    z, g = _probe("vector", seed=300, device=device, n=10)
    stats = statistics_for(_reparam_family(None, d), (d,), "vector")
    stats.update(z, g)
    res = stats.result()
    assert res.tangent_rank == 0
    assert res.degenerate is True
    assert res.saturated is False
    assert res.score == 0.0
    assert np.all(res.gradient == 0)
    assert res.ag_rms > 0


# ============================================================================ 6. degenerate product family
@pytest.mark.parametrize("layout", ["vector", "sequence"])
def test_product_family_is_degenerate(layout, device):
    fam = parse_family("product:3")
    shape = SHAPES[layout]
    z, g = _probe(layout, seed=400, device=device)
    stats = statistics_for(fam, shape, layout)
    stats.update(z, g)
    res = stats.result()
    jac = dense_jacobian(fam, z, layout)
    d = shape[-1]
    assert jac.shape == (z.numel(), 2 * d * 3)
    assert np.all(jac == 0.0)
    assert res.tangent_rank == 0
    assert res.degenerate is True
    assert res.saturated is False
    assert res.score == 0.0
    assert res.ag_max > 0


# ============================================================================ 7. exact constructions
def _collect(model: nn.Module, sites, x: Tensor, y: Tensor, loss) -> dict:
    with SiteRecorder(model, sites) as rec:
        losses = loss(model(x), y)
        rec.backward(losses.sum())
        return {s: (rec.z[s], rec.g[s]) for s in sites}


@pytest.fixture(scope="module")
def odd_task():
    # a few float32 Adam steps; one intra-op thread avoids oversubscription on busy CI hosts
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return constructions.odd_network(seed=0, n_half=32, steps=15)
    finally:
        torch.set_num_threads(threads)


def test_odd_network_even_families_exactly_saturated(odd_task, device):
    task, sites = odd_task
    model = copy.deepcopy(task.model).to(device)
    x, y = task.inputs.to(device), task.targets.to(device)
    # the probe is symmetric and the network odd: f(−x) = −f(x) (exactly, independent check)
    half = x.shape[0] // 2
    assert torch.equal(x[half:], -x[:half])
    with torch.no_grad():
        out = model(x)
    assert torch.allclose(out[half:], -out[:half], rtol=0, atol=1e-14)
    zg = _collect(model, sites, x, y, task.loss)
    for site in sites:
        z, g = zg[site]
        for spec in ("even:abs", "even:square"):
            stats = statistics_for(parse_family(spec), tuple(z.shape[1:]), "vector", pool_ties=True)
            stats.update(z, g)
            res = stats.result()
            assert res.score <= 1e-10 * res.ag_rms, (site, spec, res.score)
            assert res.saturated and not res.degenerate
            # T6 converse: g ≠ 0 while s = 0
            assert res.ag_max > 0 and res.raw_score > 0
            assert res.raw_score / res.ag_max > 1e-3
            # independent: G = E[g φ̃ᵀ] with even φ̃ vanishes (numpy)
            phi = phi_tilde(parse_family(spec), z, "vector")
            big_g = g.cpu().numpy().T @ phi / z.shape[0]
            assert np.abs(big_g).max() <= 1e-12 * res.ag_rms
        lin = statistics_for(parse_family("linear"), tuple(z.shape[1:]), "vector")
        lin.update(z, g)
        rl = lin.result()
        assert rl.score > 1e6 * rl.tol, (site, rl.score, rl.tol)
        assert rl.score > 1e-3 * rl.ag_rms
        assert not rl.saturated


def test_odd_network_untrained_is_a_valid_construction(device):
    """``steps=0``: the network is odd at initialization, so the construction still holds."""
    task, sites = constructions.odd_network(seed=1, n_half=8, steps=0)
    model = copy.deepcopy(task.model).to(device)
    x, y = task.inputs.to(device), task.targets.to(device)
    with torch.no_grad():
        out = model(x)
    assert torch.allclose(out[8:], -out[:8], rtol=0, atol=1e-14)
    z, g = _collect(model, sites, x, y, task.loss)[sites[-1]]
    stats = statistics_for(parse_family("even:abs"), tuple(z.shape[1:]), "vector")
    stats.update(z, g)
    res = stats.result()
    assert res.score <= 1e-10 * res.ag_rms and res.ag_rms > 0


class _ReadoutModel(nn.Module):
    layout = "vector"

    def __init__(self, in_dim=5, d=4, n_classes=3):
        super().__init__()
        self.embed = nn.Linear(in_dim, d)
        self.block = nn.Sequential(nn.Linear(d, 8), nn.Tanh(), nn.Linear(8, d))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, n_classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        h = h + self.block(h)
        return self.head(self.ln_f(h))


def _ce(out: Tensor, y: Tensor) -> Tensor:
    return nn.functional.cross_entropy(out, y, reduction="none")


@pytest.fixture(scope="module")
def readout_task():
    torch.manual_seed(0)
    model = _ReadoutModel().to(DT)
    with torch.no_grad():  # a non-trivial LayerNorm affine map
        model.ln_f.weight.copy_(1 + 0.3 * torch.randn(4, dtype=DT))
        model.ln_f.bias.copy_(0.2 * torch.randn(4, dtype=DT))
    x = torch.randn(40, 5, dtype=DT)
    y = torch.randint(0, 3, (40,))
    task = Task(
        kind="mlp",
        data="synthetic",
        model=model.eval(),
        inputs=x,
        targets=y,
        loss=_ce,
        layout="vector",
        train_loss=float("nan"),
        probe_loss=float("nan"),
    )
    return constructions.lsq_readout(task)


def test_lsq_readout_linear_families_exactly_saturated(readout_task, device):
    task, sites = readout_task
    assert sites == ["ln_f"]
    model = copy.deepcopy(task.model).to(device)
    x, y = task.inputs.to(device), task.targets.to(device)
    zg = _collect(model, ["ln_f", "embed"], x, y, task.loss)
    z, g = zg["ln_f"]
    # independent: g = Wᵀ e (squared error, head applied directly), and e ⟂ (z, 1)
    with torch.no_grad():
        e = (model(x) - y).cpu().numpy()
    w = model.head.weight.detach().cpu().numpy()
    np.testing.assert_allclose(g.cpu().numpy(), e @ w, rtol=1e-10, atol=1e-12)
    for spec in ("linear", "linear-nobias"):
        stats = statistics_for(parse_family(spec), (4,), "vector", pool_ties=True)
        stats.update(z, g)
        res = stats.result()
        assert res.score <= 1e-10 * res.ag_rms, (spec, res.score, res.ag_rms)
        assert res.saturated and not res.degenerate
        assert res.ag_max > 0 and res.raw_score > 0  # g ≠ 0 with s = 0
        dense = dense_saturation(parse_family(spec), z, g, "vector")
        assert dense.score <= 1e-10 * res.ag_rms
    # a site before the LayerNorm is not saturated by the linear family
    z0, g0 = zg["embed"]
    stats = statistics_for(parse_family("linear"), (4,), "vector")
    stats.update(z0, g0)
    res0 = stats.result()
    assert res0.score > 1e6 * res0.tol and not res0.saturated


# ============================================================================ 8. bad input
def test_bad_inputs_raise_statistics_error(device):
    for fam in (parse_family("linear"), general_tanh_sq()):
        stats = statistics_for(fam, (3,), "vector")
        with pytest.raises(StatisticsError):
            stats.result()  # no data
        z, g = _probe("vector", 500, device)
        bad = z.clone()
        bad[2, 1] = float("nan")
        with pytest.raises(StatisticsError):
            stats.update(bad, g)
        badg = g.clone()
        badg[0, 0] = float("inf")
        with pytest.raises(StatisticsError):
            stats.update(z, badg)
        with pytest.raises(StatisticsError):
            stats.update(z, g[:-1])  # z/g shape mismatch
        with pytest.raises(StatisticsError):
            stats.update(z[:, :2], g[:, :2])  # wrong per-example shape
        with pytest.raises(StatisticsError):
            stats.update(z[:0], g[:0])  # empty batch
        with pytest.raises(StatisticsError):
            stats.update(z.long(), g.long())  # not floating
        with pytest.raises(StatisticsError):
            stats.result()  # nothing valid was accumulated
        # after the rejected batches, a valid batch gives exactly the one-batch result
        stats.update(z, g)
        fresh = statistics_for(fam, (3,), "vector")
        fresh.update(z, g)
        assert stats.result().score == fresh.result().score
        assert stats.result().n == z.shape[0]


def test_family_on_unfit_layout_raises_family_error():
    with pytest.raises(FamilyError):
        statistics_for(parse_family("attention:4"), (3,), "vector")
    with pytest.raises(FamilyError):
        FeatureStatistics(parse_family("conv3x3:4"), (4, 3), "sequence")
    with pytest.raises(FamilyError):
        statistics_for(parse_family("linear"), (4, 3), "vector")  # shape does not fit layout
    with pytest.raises(FamilyError):
        FeatureStatistics(general_tanh_sq(), (3,), "vector")


@pytest.mark.parametrize("spec", ["linear", "relu:6:1", "product:2"])
def test_padding_mask_drops_rows_like_the_unpadded_examples(spec):
    """A masked (B, T, d) batch gives the sums of its real rows only.

    Independent expectation: each example's real rows fed alone as an unpadded
    (1, T_i, d) sequence (T_i = its length), summed by ``merge``; ``n`` counts the
    examples in both. ``g`` is zero at padded positions, as the per-example loss
    ignores them.
    """
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 2, 4]
    B, T, d = len(lengths), max(lengths), 3
    z = torch.randn(B, T, d, generator=gen, dtype=torch.float64)
    g = torch.randn(B, T, d, generator=gen, dtype=torch.float64)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    g = g * mask[..., None]
    fam = parse_family(spec)
    masked = statistics_for(fam, (T, d), "sequence")
    masked.update(z, g, mask=mask)
    parts = []
    for i, t in enumerate(lengths):
        acc = statistics_for(fam, (t, d), "sequence")
        acc.update(z[i : i + 1, :t], g[i : i + 1, :t])
        parts.append(acc)
    assert masked.units == sum(lengths) and masked.n == B
    # the raw sums: every score is computed from them
    if hasattr(masked, "k_mat"):
        np.testing.assert_allclose(masked.b.numpy(), sum(p.b.numpy() for p in parts), atol=1e-12)
        np.testing.assert_allclose(masked.k_mat.numpy(), sum(p.k_mat.numpy() for p in parts), atol=1e-12)
    else:
        np.testing.assert_allclose(masked.sigma.numpy(), sum(p.sigma.numpy() for p in parts), atol=1e-12)
        np.testing.assert_allclose(masked.cross.numpy(), sum(p.cross.numpy() for p in parts), atol=1e-12)
    assert masked.g_sq == pytest.approx(float((g**2).sum()), rel=1e-12)
    assert masked.z_sq == pytest.approx(float((z[mask] ** 2).sum()), rel=1e-12)


def test_padding_mask_errors():
    fam = parse_family("linear")
    acc = statistics_for(fam, (4, 2), "sequence")
    z = torch.randn(2, 4, 2, dtype=torch.float64)
    g = torch.randn(2, 4, 2, dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    with pytest.raises(StatisticsError, match="nonzero at padded positions"):
        acc.update(z, g, mask=mask)
    with pytest.raises(StatisticsError, match="does not match"):
        acc.update(z, g * 0, mask=mask[:, :3])
    with pytest.raises(StatisticsError, match="must be bool"):
        acc.update(z, g * 0, mask=mask.long())
    # a sequence-level family that does not mask padding itself cannot drop padded rows
    # (attention does: tests/test_diagnose.py::test_attention_statistics_honour_the_padding_mask)
    from depthsat_theory.families import GeneralFamily

    seq = GeneralFamily(lambda th, u: th[0] * u.cumsum(1), 1, name="cumsum", unit="tensor", layouts=("sequence",))
    acc_seq = statistics_for(seq, (4, 2), "sequence")
    with pytest.raises(StatisticsError, match=r"family 'cumsum' \(unit 'tensor'\) cannot drop padded rows"):
        acc_seq.update(z, g * mask[..., None], mask=mask)
    acc_seq.update(z, g, mask=torch.ones(2, 4, dtype=torch.bool))  # nothing to drop: accepted
    assert acc_seq.n == 2


def test_chain_holds_exactly_on_continuous_rows():
    """With no ties r̂ equals AG_rms in exact arithmetic; the reported values keep the
    documented order s ≤ r̂ ≤ AG_rms ≤ AG_max exactly (this probe once gave r̂ one ulp
    above AG_rms)."""
    r = np.random.default_rng(0)
    z = r.standard_normal((2000, 8))
    g = 0.1 * np.tanh(z @ r.standard_normal((8, 8))) + 0.01 * r.standard_normal((2000, 8))
    acc = statistics_for(parse_family("linear"), (8,), "vector", pool_ties=True)
    acc.update(torch.from_numpy(z), torch.from_numpy(g))
    res = acc.result()
    assert res.score <= res.raw_score <= res.ag_rms <= res.ag_max
    assert res.raw_score == pytest.approx(float(np.sqrt((g**2).sum(1).mean())), rel=1e-12)


def test_family_not_differentiable_at_origin_is_named():
    """h(θ, u) = sqrt(θ)·u has an infinite tangent at θ = 0: the error says so instead of
    blaming the probe's scale (asm-differentiable)."""
    fam = GeneralFamily(lambda th, u: torch.sqrt(th[0]) * u, 1, name="sqrt-theta")
    acc = statistics_for(fam, (3,), "vector")
    z = torch.randn(8, 3, dtype=torch.float64)
    with pytest.raises(StatisticsError, match="not differentiable at the origin"):
        acc.update(z, torch.randn(8, 3, dtype=torch.float64))


# ----------------------------------------------------------------------------- public accessors
@pytest.mark.parametrize(("spec", "layout"), [("linear", "vector"), ("poly:2", "sequence"), ("linear-nobias", "image")])
def test_feature_accessors_match_dense_jacobian(spec, layout, device):
    """Σ, G, K = I_d ⊗ Σ and b against the dense Jacobian A (K = AᵀA/n, b = Aᵀg/n)."""
    fam = parse_family(spec)
    z, g = _probe(layout, seed=41, device=device)
    n = z.shape[0]
    stats = statistics_for(fam, SHAPES[layout], layout)
    stats.update(z, g)
    a = dense_jacobian(fam, z, layout)
    gv = g.detach().cpu().to(torch.float64).numpy().reshape(-1)
    np.testing.assert_allclose(stats.tangent_gram(), a.T @ a / n, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(stats.gradient(), a.T @ gv / n, rtol=1e-12, atol=1e-13)
    phi = phi_tilde(fam, z, layout)
    grows = np_rows(g, layout)
    np.testing.assert_allclose(stats.feature_gram(), phi.T @ phi / n, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(stats.cross_gradient(), grows.T @ phi / n, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(stats.gradient(), stats.result().gradient, rtol=0, atol=0)


def test_general_accessors_match_dense_jacobian(device):
    fam = general_tanh_sq()
    z, g = _probe("sequence", seed=43, device=device)
    n = z.shape[0]
    stats = statistics_for(fam, SHAPES["sequence"], "sequence")
    stats.update(z, g)
    a = dense_jacobian(fam, z, "sequence")
    gv = g.detach().cpu().to(torch.float64).numpy().reshape(-1)
    np.testing.assert_allclose(stats.tangent_gram(), a.T @ a / n, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(stats.gradient(), a.T @ gv / n, rtol=1e-12, atol=1e-13)


def test_accessors_refuse_empty_and_oversized(device):
    stats = statistics_for(linear(), (3,), "vector")
    for accessor in (stats.feature_gram, stats.cross_gradient, stats.gradient, stats.tangent_gram):
        with pytest.raises(StatisticsError, match="no examples"):
            accessor()
    z, g = _probe("vector", seed=44, device=device)
    stats.update(z, g)
    assert stats.tangent_gram().shape == (12, 12)
    with pytest.raises(StatisticsError, match="max_elements = 100"):
        stats.tangent_gram(max_elements=100)


# ----------------------------------------------------------------------------- the statistics protocol
def test_state_fields_are_declared_with_their_reductions():
    from depthsat_theory.bounds import BoundStatistics
    from depthsat_theory.statistics import Reduction

    feat = statistics_for(linear(), (3,), "vector", pool_ties=True)
    assert feat.reductions() == {
        "n": Reduction.SUM,
        "units": Reduction.SUM,
        "g_sq": Reduction.SUM,
        "z_sq": Reduction.SUM,
        "g_max": Reduction.MAX,
        "forward_eps": Reduction.MAX,
        "feature_eps": Reduction.MAX,
        "batches": Reduction.SUM,
        "batch_units_max": Reduction.MAX,
        "sigma": Reduction.SUM,
        "cross": Reduction.SUM,
        "q_sum": Reduction.SUM,
    }
    assert sorted(feat.variable_size_children()) == ["factor", "noise_factor", "ties"]
    gen = statistics_for(general_tanh_sq(), (3,), "vector")
    assert {k for k, v in gen.reductions().items() if v == "sum"} >= {"k_mat", "b"}
    bound = BoundStatistics(linear(), (3,), "vector")
    assert bound.reductions()["q_sum"] == "sum" and bound.reductions()["feat_sq_max"] == "max"


@pytest.mark.parametrize("spec", ["linear", "general"])
def test_state_dict_round_trip_and_merge_by_declared_reduction(spec, device):
    """Two shards merged (sums add, maxima take the max) equal one pass; a state dict restores exactly."""

    def make():
        fam = general_tanh_sq() if spec == "general" else linear()
        return statistics_for(fam, (3,), "vector", pool_ties=True)

    z, g = _probe("vector", seed=51, device=device, n=12)
    z[6:9] = z[0:3]  # exact ties across the two shards
    g[8] *= 40.0  # the largest ‖g‖ is in the second shard
    one, a, b = make(), make(), make()
    one.update(z, g)
    a.update(z[:6], g[:6])
    b.update(z[6:], g[6:])
    assert b.g_max > a.g_max
    a.merge(b)
    assert a.n == 12 and a.units == one.units
    assert a.g_max == float(g[8].norm())  # MAX, not a sum
    assert a.g_sq == pytest.approx(float((g**2).sum()), rel=1e-14)
    assert len(a.ties) == 9  # 12 units, 3 tied pairs
    _assert_same_result(a.result(), one.result())
    restored = make()
    restored.load_state_dict(a.state_dict())
    ra, rr = a.result(), restored.result()
    assert rr.score == ra.score and rr.raw_score == ra.raw_score and rr.dtype == ra.dtype
    assert set(restored.state_dict()) == set(a.state_dict()) >= {"ties.units", "ties.sums", "ties.counts"}


def test_load_state_dict_rejects_missing_and_malformed_fields():
    st = statistics_for(linear(), (3,), "vector")
    state = st.state_dict()
    with pytest.raises(KeyError, match="sigma"):
        st.load_state_dict({k: v for k, v in state.items() if k != "sigma"})
    with pytest.raises(ValueError, match="elements"):
        st.load_state_dict({**state, "sigma": torch.zeros(3)})
    st.load_state_dict({"n": torch.tensor(5.0)}, strict=False)
    assert st.n == 5 and st.g_sq == 0.0


def test_forward_dtype_is_a_max_state():
    """float32 wins over float64 when shards of both are merged (the coarser rounding)."""
    z, g = _probe("vector", seed=52, device="cpu", n=6)
    a = statistics_for(linear(), (3,), "vector")
    b = statistics_for(linear(), (3,), "vector")
    assert a.dtype is None
    a.update(z, g)
    b.update(z.float(), g.float())
    assert a.dtype == torch.float64 and b.dtype == torch.float32
    assert a.merge(b).dtype == torch.float32
    assert a.result().dtype == "float32"


def test_tie_pool_pools_exact_ties_only():
    from depthsat_theory.statistics import TiePool

    pool = TiePool()
    units = torch.tensor([[0.0, 1.0], [-0.0, 1.0], [0.0, 1.0 + 1e-15], [2.0, 3.0]], dtype=torch.float64)
    vals = torch.tensor([[1.0], [3.0], [5.0], [7.0]], dtype=torch.float64)
    pool.update(units, vals)
    other = TiePool()
    other.update(units[3:], torch.tensor([[9.0]], dtype=torch.float64))
    pool.merge(other)
    u, means, counts = pool.result()
    got = {tuple(r.tolist()): (float(m), int(c)) for r, m, c in zip(u, means[:, 0], counts, strict=True)}
    assert got == {(0.0, 1.0): (2.0, 2), (0.0, 1.0 + 1e-15): (5.0, 1), (2.0, 3.0): (8.0, 2)}
    copy_ = TiePool()
    copy_.load_state_dict(pool.state_dict())
    assert len(copy_) == 3
    copy_.reset()
    assert len(copy_) == 0 and copy_.state_dict() == {}
    wide = TiePool()
    wide.update(torch.zeros(1, 3, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"widths \(3, 1\) into one of \(2, 1\)"):
        pool.merge(wide)


def test_bound_statistics_merge_into_feature_statistics_adds_the_base_state():
    from depthsat_theory.bounds import BoundStatistics

    z, g = _probe("vector", seed=53, device="cpu", n=8)
    feat, bound, ref = (
        statistics_for(linear(), (3,), "vector"),
        BoundStatistics(linear(), (3,), "vector"),
        statistics_for(linear(), (3,), "vector"),
    )
    feat.update(z[:4], g[:4])
    bound.update(z[4:], g[4:])
    ref.update(z, g)
    _assert_same_result(feat.merge(bound).result(), ref.result())
    with pytest.raises(StatisticsError, match="cannot merge"):
        bound.merge(statistics_for(linear(), (3,), "vector"))


def test_merge_refuses_other_configurations_and_unpooled_shards():
    """Merging shards is exact only for one configuration; tie pooling included (r̂ by hand)."""
    units = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    z = units[[0, 1, 2, 0, 1, 0]]
    g = torch.tensor([[1.0, 2.0], [0.5, -1.0], [3.0, 0.0], [-1.0, 0.0], [1.5, 1.0], [0.0, 4.0]], dtype=torch.float64)
    # r̂² = (1/n) Σ_classes count · |mean g|²: classes {0,3,5}, {1,4}, {2}
    means = [g[[0, 3, 5]].mean(0), g[[1, 4]].mean(0), g[[2]].mean(0)]
    r_true = math.sqrt(sum(c * float(m @ m) for c, m in zip((3, 2, 1), means, strict=True)) / 6)

    def stats(pool: bool, spec: str = "linear"):
        return statistics_for(parse_family(spec), (2,), "vector", pool_ties=pool)

    a, b = stats(True), stats(True)
    a.update(z[:3], g[:3])
    b.update(z[3:], g[3:])
    assert a.merge(b).result().raw_score == pytest.approx(r_true, rel=1e-14)

    pooled, unpooled = stats(True), stats(False)
    pooled.update(z[:3], g[:3])
    unpooled.update(z[3:], g[3:])
    with pytest.raises(StatisticsError, match="pool_ties False != True"):
        pooled.merge(unpooled)
    with pytest.raises(StatisticsError, match="family 'poly:2' != 'linear'"):
        pooled.merge(stats(True, "poly:2"))
    with pytest.raises(StatisticsError, match="cannot merge a int"):
        pooled.merge(3)
    fresh = stats(True)
    fresh.load_state_dict(unpooled.state_dict())
    with pytest.raises(StatisticsError, match="tie pool holds 0 of the 3 units"):
        fresh.result()
