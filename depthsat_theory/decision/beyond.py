"""Depth or more training: the stationarity score, the score beyond training and the decision at a site.

theory/decision.md: ``def-stationarity-score``, ``prop-beyond-training``, ``prop-beyond-noise-test``,
``def-depth-decision``.  Computed from the probe's rows in the kernel form of ``thm-unit-gram``: with
``U`` an orthonormal basis (over the probe's units) of a tangent space, ``ŝ² = ‖Uᵀ g‖²/n`` and
``v̂ = Σ_x ‖Σ_{r∈x} g_r U_r‖²``; the score beyond training projects on ``T_joint ⊖ T_old`` and its noise
moment uses the residual gradient ``g − Π_old g`` (the influence cross-gradient of ``prop-beyond-noise-test``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np
import torch

from depthsat_theory.statistics.linalg import NOISE_ALPHA, Spectrum, noise_threshold, resolve_spectrum, score_error
from depthsat_theory.statistics.result import SaturationResult, StatisticsError
from depthsat_theory.vocabulary import Verdict

__all__ = ["BeyondTraining", "DepthDecision", "beyond_training", "decide"]


class DepthDecision(str, Enum):
    """The decision at a site (theory/decision.md, ``def-depth-decision``).

    - ``ADD_DEPTH``: the score beyond training is improvable;
    - ``TRAIN_LONGER``: the existing parameters are not stationary and explain the gain;
    - ``ENOUGH_DEPTH``: the score beyond training is saturated and the existing parameters are not improvable;
    - ``UNDETERMINED``: the probe or the arithmetic cannot decide.
    """

    ADD_DEPTH = "add depth here"
    TRAIN_LONGER = "train longer first"
    ENOUGH_DEPTH = "enough depth"
    UNDETERMINED = "undetermined"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class BeyondTraining:
    """The three scores of a site with an existing last linear map (``prop-beyond-training``).

    Attributes:
        old: the stationarity score's result (tangent of the existing last map, features ``ψ̃``).
        joint: the result of the joint family (features ``(ψ̃, φ̃)``).
        beyond: the score beyond training (``T_joint ⊖ T_old``), with the noise test of
            ``prop-beyond-noise-test``; ``score² = joint.score² − old.score²`` up to rounding.
        decision: the :class:`DepthDecision`.
        reason: one line: why, and what would decide an undetermined site.
    """

    old: SaturationResult
    joint: SaturationResult
    beyond: SaturationResult
    decision: DepthDecision
    reason: str


def _rows(t, name: str) -> np.ndarray:
    a = np.asarray(torch.as_tensor(t).detach().to(torch.float64).cpu().numpy())
    if a.ndim == 2:
        a = a[:, None, :]
    if a.ndim != 3:
        raise StatisticsError(f"{name} has shape {a.shape}: expected (n, k) or (n, R, k) (examples, units, columns)")
    if not np.isfinite(a).all():
        raise StatisticsError(f"{name} has NaN or Inf entries")
    return a


@dataclass
class _Basis:
    """An orthonormal basis ``U`` ``(N, r)`` of a tangent space over the probe's units, and its spectrum."""

    u: np.ndarray
    spec: Spectrum


def _basis(rows: np.ndarray, n: int, dtype: torch.dtype) -> _Basis:
    """``U`` from the feature rows ``(N, k)``: the factor path of ``resolve_spectrum`` on ``M = Φ̃ / sqrt(n)``."""
    m = rows / math.sqrt(n)
    diag = (m * m).sum(0)
    spec = resolve_spectrum(None, factor=m, diag=diag, dtype=dtype)
    if spec.rank == 0:
        return _Basis(np.zeros((rows.shape[0], 0)), spec)
    return _Basis((m * spec.scale) @ spec.vectors / np.sqrt(spec.values), spec)


@dataclass(frozen=True)
class _Probe:
    """What every score of one site shares: the gradient rows and the probe's constants."""

    g: np.ndarray  # (N, d) activation-gradient rows
    shape: tuple[int, int]  # (examples, units per example)
    ag_rms: float
    ag_max: float
    alpha: float
    dtype: torch.dtype


def _per_example(u: np.ndarray, g: np.ndarray, shape: tuple[int, int]) -> float:
    """``Σ_x ‖Σ_{r∈x} g_r U_r‖²_F`` (the kernel form of ``v̂``)."""
    n, units = shape
    prod = np.einsum("xrd,xrj->xdj", g.reshape(n, units, -1), u.reshape(n, units, -1))
    return float((prod * prod).sum())


def _result(
    probe: _Probe,
    *,
    name: str,
    u: np.ndarray,
    g_noise: np.ndarray,
    err: float,
    spec: Spectrum,
    k: int,
    noise_error: float = 0.0,
) -> SaturationResult:
    """A :class:`SaturationResult` for the projection on ``range(U)`` (kernel form of ``thm-unit-gram``).

    ``noise_error`` bounds ``‖δ‖_F`` of the rounding in the rows ``g_noise`` (a computed residual); then
    ``v̂_up = (√v̂ + ‖δ‖_F max_x ‖U_x‖₂)²`` bounds the exact ``v̂`` (triangle inequality over examples) and the
    noise test uses it, so a residual that is all rounding never reads as signal.
    """
    shape, ag_rms, alpha = probe.shape, probe.ag_rms, probe.alpha
    n = shape[0]
    d = probe.g.shape[1]
    proj = u.T @ probe.g  # (r, d)
    score = min(math.sqrt(float((proj * proj).sum()) / n), ag_rms)
    v = _per_example(u, g_noise, shape)
    rank = u.shape[1]
    noise: dict[str, Any] = {"noise_variance": v, "alpha": alpha, "noise_threshold": noise_threshold(alpha)}
    v_test = v
    if noise_error > 0 and rank:
        u_max = float(np.sqrt((u.reshape(n, shape[1], -1) ** 2).sum((1, 2)).max()))
        v_test = (math.sqrt(v) + noise_error * u_max) ** 2
        noise["noise_variance_upper"] = v_test
    if v > 0 and n >= 2:
        s2u = (n * score * score - v) / (n - 1)
        noise.update(
            noise_ratio=n * score * score / v_test,
            score_squared_unbiased=s2u,
            score_squared_se=math.sqrt(4 * v * max(s2u, 0.0) / n + 2 * v * v / (n * (n - 1))),
        )
    elif n >= 2:
        noise.update(noise_ratio=math.inf if score > 0 else 0.0)
    degenerate = rank == 0
    res = SaturationResult(
        score=score,
        raw_score=math.nan,
        ag_rms=ag_rms,
        ag_max=probe.ag_max,
        realizability_defect=math.nan,
        relative_score=score / ag_rms if ag_rms > 0 else math.nan,
        activation_scaled_score=math.nan,
        tangent_rank=d * rank,
        tangent_dim=d * k,
        degenerate=degenerate,
        saturated=False,
        tol=err,
        cutoff=float(spec.cutoff),
        rtol=float(spec.rtol),
        n=n,
        units=n * shape[1],
        family=name,
        unit="row",
        dtype=str(probe.dtype).removeprefix("torch."),
        gradient=(proj.T.reshape(-1) / math.sqrt(n)),
        score_error=err,
        unresolved=int(spec.unresolved),
        **noise,
    )
    res.saturated = res.verdict is Verdict.SATURATED
    return res


def _complement(u_joint: np.ndarray, u_old: np.ndarray) -> np.ndarray:
    """An orthonormal basis of ``range(U_joint) ⊖ range(U_old)``: the top ``r_j − r_o`` directions of the residual."""
    extra = u_joint.shape[1] - u_old.shape[1]
    if extra <= 0:
        return np.zeros((u_joint.shape[0], 0))
    resid = u_joint - u_old @ (u_old.T @ u_joint)
    left, _, _ = np.linalg.svd(resid, full_matrices=False)
    return left[:, :extra]


def decide(old: SaturationResult, beyond: SaturationResult) -> tuple[DepthDecision, str]:
    """The decision at a site from the stationarity score and the score beyond training (``def-depth-decision``).

    Args:
        old: the stationarity score's result.
        beyond: the result of the score beyond training.

    Returns:
        ``(decision, reason)``.
    """
    vb, vo = beyond.verdict, old.verdict
    if vb is Verdict.IMPROVABLE:
        also = " (the existing map is not stationary either)" if vo is Verdict.IMPROVABLE else ""
        return DepthDecision.ADD_DEPTH, f"beyond training: {beyond.verdict_reason}{also}"
    if vo is Verdict.IMPROVABLE:
        return DepthDecision.TRAIN_LONGER, (
            f"the existing last map is not stationary ({old.verdict_reason}); the score beyond training is "
            f"{vb.value}: train the existing parameters, then decide again"
        )
    if vb in (Verdict.SATURATED, Verdict.DEGENERATE):
        why = "no direction beyond the existing tangent" if vb is Verdict.DEGENERATE else beyond.verdict_reason
        return DepthDecision.ENOUGH_DEPTH, f"beyond training: {why}; existing map: {vo.value}"
    return DepthDecision.UNDETERMINED, f"beyond training: {beyond.verdict_reason}"


def beyond_training(psi, phi, g, *, alpha: float = NOISE_ALPHA, dtype: torch.dtype = torch.float64) -> BeyondTraining:
    """Stationarity score, joint score and score beyond training of a site, and the decision.

    Args:
        psi: ``(n, k_o)`` or ``(n, R, k_o)`` the inputs ``ψ̃`` of the existing block's last linear map at each
            unit (append a constant column when that map has a bias): its tangent is ``T_old``.
        phi: ``(n, k_n)`` or ``(n, R, k_n)`` the new block family's features ``φ̃`` at the same units.
        g: ``(n, d)`` or ``(n, R, d)`` the activation gradients of the per-example losses at the site
            (the output of the existing block), in loss units (e.g. nats per example).
        alpha: level of the noise tests.
        dtype: the dtype of the forward pass that produced the rows (sets the resolution and the rounding bound).

    Returns:
        The :class:`BeyondTraining`; scores in loss units per unit function-space step.

    Raises:
        StatisticsError: for mismatched shapes, NaN/Inf, or fewer than 2 examples.
    """
    psi_r, phi_r, g_r = _rows(psi, "psi"), _rows(phi, "phi"), _rows(g, "g")
    if not (psi_r.shape[:2] == phi_r.shape[:2] == g_r.shape[:2]):
        raise StatisticsError(f"psi {psi_r.shape}, phi {phi_r.shape} and g {g_r.shape} differ in examples or units")
    n, units = g_r.shape[:2]
    if n < 2:
        raise StatisticsError(f"{n} example(s): the noise tests need at least 2")
    shape = (n, units)
    flat = lambda a: a.reshape(n * units, -1)  # noqa: E731
    gg = flat(g_r)
    per_ex = (g_r * g_r).sum((1, 2))
    ag_rms, ag_max = math.sqrt(float(per_ex.mean())), math.sqrt(float(per_ex.max()))
    b_old = _basis(flat(psi_r), n, dtype)
    b_joint = _basis(np.concatenate([flat(psi_r), flat(phi_r)], 1), n, dtype)
    u_perp = _complement(b_joint.u, b_old.u)
    probe = _Probe(g=gg, shape=shape, ag_rms=ag_rms, ag_max=ag_max, alpha=alpha, dtype=dtype)
    err = {}
    for key, basis in (("old", b_old), ("joint", b_joint)):
        proj = basis.u.T @ gg
        s = math.sqrt(float((proj * proj).sum()) / n)
        err[key] = score_error(basis.spec, score=s, ag_rms=ag_rms, dtype=dtype, summands=n * units + 1)
    k_old, k_new = psi_r.shape[2], phi_r.shape[2]
    old = _result(probe, name="existing", u=b_old.u, g_noise=gg, err=err["old"], spec=b_old.spec, k=k_old)
    joint = _result(probe, name="joint", u=b_joint.u, g_noise=gg, err=err["joint"], spec=b_joint.spec, k=k_old + k_new)
    residual = gg - b_old.u @ (b_old.u.T @ gg)  # g − Π_old g: the influence of prop-beyond-noise-test
    # |ŝ_beyond − s_beyond| ≤ ‖(Π̂_joint − Π_joint) g‖ + ‖(Π̂_old − Π_old) g‖: the two bounds of thm-score-error
    # its rows' rounding: ‖(Π̂_old − Π_old) g‖_F ≤ √n e_old (thm-score-error), plus the subtraction's u‖g‖_F
    noise_error = math.sqrt(n) * (err["old"] + float(torch.finfo(torch.float64).eps) * ag_rms)
    beyond = _result(
        probe,
        name="beyond",
        u=u_perp,
        g_noise=residual,
        err=err["old"] + err["joint"],
        spec=b_joint.spec,
        k=k_new,
        noise_error=noise_error,
    )
    decision, reason = decide(old, beyond)
    return BeyondTraining(old=old, joint=joint, beyond=beyond, decision=decision, reason=reason)
