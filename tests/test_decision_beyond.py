"""The stationarity score, the score beyond training and the depth decision (theory/decision.md).

Truth: exact rational arithmetic (``fractions.Fraction``) on dyadic linear residual models, through the Schur
form of ``prop-beyond-training`` (2) and the influence noise moment of ``prop-beyond-noise-test`` — an
independent route from the engine, which projects on an orthonormal complement of SVD bases.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from depthsat_theory.decision import DepthDecision, beyond_training
from depthsat_theory.statistics import StatisticsError
from depthsat_theory.vocabulary import Verdict
from proofs_checks.t8_numerics import solve_rational

F = Fraction


def hadamard(n: int) -> np.ndarray:
    """Sylvester Hadamard matrix ``(n, n)`` of ±1 (``n`` a power of two); column 0 is all ones."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def solve(a: list[list[Fraction]], b: list[list[Fraction]]) -> list[list[Fraction]]:
    """A solution ``x`` of ``a x = b`` in rationals (dependent columns get ``x = 0``): every quadratic form
    ``bᵀ x`` below is the same for every solution, because ``b``'s columns lie in the range of the PSD ``a``."""
    return solve_rational(a, b)


def mat(rows) -> list[list[Fraction]]:
    return [[F(float(v)) for v in r] for r in rows]


def matmul(a, b):
    return [[sum((a[i][t] * b[t][j] for t in range(len(b))), F(0)) for j in range(len(b[0]))] for i in range(len(a))]


def transpose(a):
    return [list(c) for c in zip(*a, strict=True)]


def mean_outer(x, y, n):
    """``(1/n) Σ_i x_i y_iᵀ`` for row lists ``x`` ``(n, p)``, ``y`` ``(n, q)``."""
    return [[v / n for v in row] for row in matmul(transpose(x), y)]


def quad(gm, sigma):
    """``tr(G Σ⁻¹ Gᵀ)``."""
    return sum(
        (
            a * b
            for ra, rb in zip(gm, transpose(solve(sigma, transpose(gm))), strict=True)
            for a, b in zip(ra, rb, strict=True)
        ),
        F(0),
    )


def exact_scores(psi: np.ndarray, phi: np.ndarray, g: np.ndarray) -> dict[str, Fraction]:
    """``s²_old``, ``s²_joint``, ``s²_beyond`` (Schur form) and ``v̂_old``, ``v̂_⊥`` (influence) in rationals."""
    n = len(g)
    p, f, gg = mat(psi), mat(phi), mat(g)
    j = [a + b for a, b in zip(p, f, strict=True)]
    s_oo, s_no, s_nn = mean_outer(p, p, n), mean_outer(f, p, n), mean_outer(f, f, n)
    g_o = mean_outer(gg, p, n)
    out = {"old": quad(g_o, s_oo)}
    out["joint"] = quad(mean_outer(gg, j, n), mean_outer(j, j, n))
    b = transpose(solve(s_oo, transpose(s_no)))  # B = Σ_no Σ_oo⁻¹  (k_n, k_o)
    perp = [
        [fi - sum((b[a][c] * pi[c] for c in range(len(pi))), F(0)) for a, fi in enumerate(fr)]
        for fr, pi in zip(f, p, strict=True)
    ]
    s_perp = [
        [s_nn[a][c] - sum((b[a][t] * s_no[c][t] for t in range(len(p[0]))), F(0)) for c in range(len(f[0]))]
        for a in range(len(f[0]))
    ]
    g_perp = mean_outer(gg, perp, n)
    out["beyond"] = quad(g_perp, s_perp)
    a_o = transpose(solve(s_oo, transpose(g_o)))  # A_o = G_o Σ_oo⁻¹  (d, k_o)
    resid = [
        [gi[r] - sum((a_o[r][c] * pi[c] for c in range(len(pi))), F(0)) for r in range(len(gi))]
        for gi, pi in zip(gg, p, strict=True)
    ]

    def vhat(rows_g, rows_f, sigma):
        sol = transpose(solve(sigma, transpose(rows_f)))  # Σ⁺ φ_x for every example x
        tot = F(0)
        for gi, fi, xi in zip(rows_g, rows_f, sol, strict=True):
            lev = sum((u * v for u, v in zip(fi, xi, strict=True)), F(0))
            tot += sum((v * v for v in gi), F(0)) * lev
        return tot / n

    out["v_old"] = vhat(gg, p, s_oo)
    out["v_beyond"] = vhat(resid, perp, s_perp)
    return out


def residual_model(z_in: np.ndarray, psi: np.ndarray, w_o: np.ndarray, y: np.ndarray):
    """``z_out = z_in + ψ W_oᵀ``, loss ``½‖z_out − y‖²`` per example: ``(z_out, g = ∂ℓ/∂z_out)`` by autograd."""
    z_out = torch.tensor(z_in) + torch.tensor(psi) @ torch.tensor(w_o).T
    z_out.requires_grad_(True)
    loss = 0.5 * ((z_out - torch.tensor(y)) ** 2).sum()
    (g,) = torch.autograd.grad(loss, z_out)
    return z_out.detach().numpy(), g.numpy()


def _dyadic(rng, shape, scale=4):
    return rng.integers(-8, 9, size=shape) / scale


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scores_match_the_rational_schur_form(seed):
    """Random dyadic linear residual model: every score and both noise moments match the exact Schur form."""
    rng = np.random.default_rng(seed)
    n = 12
    psi = np.c_[_dyadic(rng, (n, 2)), np.ones(n)]  # existing last map's inputs, with its bias
    z_in, y = _dyadic(rng, (n, 2)), _dyadic(rng, (n, 2))
    z_out, g = residual_model(z_in, psi, _dyadic(rng, (2, 3)), y)
    phi = np.c_[z_out, np.ones(n)]  # the linear family at the site
    res = beyond_training(psi, phi, g)
    ex = exact_scores(psi, phi, g)
    for key, r in (("old", res.old), ("joint", res.joint), ("beyond", res.beyond)):
        assert r.score**2 == pytest.approx(float(ex[key]), rel=1e-9, abs=1e-12), key
    assert res.old.noise_variance == pytest.approx(float(ex["v_old"]), rel=1e-9)
    assert res.beyond.noise_variance == pytest.approx(float(ex["v_beyond"]), rel=1e-9)
    assert float(ex["joint"]) == float(ex["old"] + ex["beyond"])  # Pythagoras, exactly


def _orthogonal_probe(n: int = 32):
    h = hadamard(n)
    psi = h[:, :4]  # Σ_oo = I exactly; column 0 is the bias
    z_in = 0.5 * h[:, 5] + 0.25 * h[:, 1]  # a component (H₅) outside the existing tangent
    return h, psi, z_in[:, None]


def test_under_trained_model_says_train_longer_first():
    """W_o = 0 and a target the existing map can fit: s_old > 0, nothing beyond training (exactly)."""
    h, psi, z_in = _orthogonal_probe()
    y = (0.5 * h[:, 5] + h[:, 1] + 0.5 * h[:, 2])[:, None]  # z_in's outside part is in y: g ∈ span ψ
    z_out, g = residual_model(z_in, psi, np.zeros((1, 4)), y)
    res = beyond_training(psi, np.c_[z_out, np.ones(len(y))], g)
    ex = exact_scores(psi, np.c_[z_out, np.ones(len(y))], g)
    # g = z_in − y = −(3/4) H₁ − (1/2) H₂ ∈ span ψ: ‖Π_old g‖² = E g² = 9/16 + 1/4
    assert ex["beyond"] == 0 and ex["old"] == F(13, 16)
    assert res.old.score**2 == pytest.approx(float(ex["old"]), rel=1e-12)
    assert res.old.verdict is Verdict.IMPROVABLE  # n ŝ²/v̂ = 32/4 = 8 > 3.84
    assert res.old.noise_ratio == pytest.approx(8.0, rel=1e-12)
    assert res.beyond.verdict is Verdict.SATURATED
    assert res.decision is DepthDecision.TRAIN_LONGER


def test_stationary_model_with_a_missing_block_says_add_depth_here():
    """W_o at its least-squares optimum (exactly, Σ_oo = I): s_old = 0, s_beyond = 3/2 exactly."""
    h, psi, z_in = _orthogonal_probe()
    y = (-h[:, 5] + h[:, 1])[:, None]
    w_o = (((y - z_in) * psi).mean(0))[None, :]  # E[(y − z_in) ψᵀ] Σ_oo⁻¹, dyadic
    z_out, g = residual_model(z_in, psi, w_o, y)
    phi = np.c_[z_out, np.ones(len(y))]
    ex = exact_scores(psi, phi, g)
    assert ex["old"] == 0 and ex["beyond"] == F(9, 4) and ex["v_beyond"] == F(9, 4)
    res = beyond_training(psi, phi, g)
    assert res.old.verdict is Verdict.SATURATED
    assert res.beyond.score == pytest.approx(1.5, rel=1e-12)
    assert res.beyond.noise_ratio == pytest.approx(32.0, rel=1e-12)  # n ŝ²/v̂ = n
    assert res.decision is DepthDecision.ADD_DEPTH


def test_new_family_inside_the_existing_tangent_is_enough_depth():
    """φ̃ ∈ span ψ̃ and W_o stationary: no direction beyond training, s_old = 0: enough depth."""
    h, psi, _ = _orthogonal_probe()
    y = (h[:, 1] - 0.5 * h[:, 7])[:, None]
    z_in = np.zeros((len(y), 1))
    w_o = ((y * psi).mean(0))[None, :]
    z_out, g = residual_model(z_in, psi, w_o, y)  # z_out = W_o ψ ∈ span ψ
    res = beyond_training(psi, np.c_[z_out, np.ones(len(y))], g)
    assert res.beyond.tangent_rank == 0 and res.beyond.verdict is Verdict.DEGENERATE
    assert res.old.verdict is Verdict.SATURATED
    assert res.decision is DepthDecision.ENOUGH_DEPTH


def test_one_example_and_bad_shapes_are_refused():
    with pytest.raises(StatisticsError, match="at least 2"):
        beyond_training(np.ones((1, 2)), np.ones((1, 2)), np.ones((1, 1)))
    with pytest.raises(StatisticsError, match="differ in examples"):
        beyond_training(np.ones((3, 2)), np.ones((4, 2)), np.ones((3, 1)))
    with pytest.raises(StatisticsError, match="NaN"):
        beyond_training(np.full((3, 2), math.nan), np.ones((3, 2)), np.ones((3, 1)))


def test_beyond_noise_test_level_on_pure_noise_with_a_non_stationary_map():
    """Monte Carlo: s_beyond = 0 in the population while s_old > 0; the influence noise test holds its level.

    The new feature is ``x₂`` and ``g = a·ψ-part + ε`` with ``ε`` independent of both, so
    ``E[g φ_⊥] = 0``; the plain ``v̂`` of ``X Lᵀ`` (not residualised) would ignore ``B̂``'s fluctuation.
    """
    rng = np.random.default_rng(7)
    reps, n, rejections = 300, 200, 0
    for _ in range(reps):
        x = rng.normal(size=(n, 2))
        psi = np.c_[x[:, :1], np.ones(n)]
        phi = (x[:, 1:] + 0.8 * x[:, :1]) * 1.0
        g = 1.5 * x[:, :1] + rng.normal(size=(n, 1))
        res = beyond_training(psi, phi, g)
        rejections += res.beyond.verdict is Verdict.IMPROVABLE
    # one-sided binomial bound: 0.05 + 3 sd at 300 draws
    assert rejections / reps <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / reps)
