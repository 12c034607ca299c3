"""The measured curvature of the loss along the best first-order field (theory/decrease.md).

For a zero-output family with fixed features, the loss of the network with the block is a function
``F(f)`` of the added field ``f ∈ T`` (``def-field-loss``).  Along the steepest field ``f_t = t Πg``,
``F(f_t) = J − t s² + ½ t² κ s² + o(t²)`` with the *measured curvature*
``κ = D²F(0)[Πg, Πg] / s²``; the quadratic model's best step along ``−Πg`` removes ``s²/(2κ)``.
This is a local (second-order) figure, not the global guarantee of ``thm-guaranteed-decrease``:
``κ ≤ β`` for every smoothness constant ``β`` on ``T``, so ``s²/(2κ) ≥ s²/(2β)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from depthsat_theory.capture.probe import call_model, unpack_batch
from depthsat_theory.capture.sites import resolve_module, split_output
from depthsat_theory.families import FeatureFamily

__all__ = ["FieldCurvature", "StepCheck", "field_curvature", "steepest_field_coefficients", "step_decrease"]


@dataclass(frozen=True)
class FieldCurvature:
    """``J'`` and ``J''`` along ``f_t = t Πg`` (per example, loss units).

    Attributes:
        slope: ``dJ/dt`` at ``0`` (equals ``s²``: a consistency check of ``Πg``).
        second: ``d²J/dt²`` at ``0``, ``= κ s²``.
        curvature: ``κ = second / s²`` (``nan`` when ``s = 0``).
        local_decrease: ``s²/(2κ)`` when ``κ > 0`` (else ``inf``: the quadratic model is unbounded below).
        n: probe examples.
    """

    slope: float
    second: float
    curvature: float
    local_decrease: float
    n: int


def steepest_field_coefficients(cross: np.ndarray, sigma: np.ndarray, *, rtol: float = 1e-12) -> np.ndarray:
    """``θ* = vec(G Σ⁺)`` in the block's ``(vec_row(W), c)`` order: the field ``Πg = G Σ⁺ φ̃``.

    Args:
        cross: ``G`` ``(d, k̃)`` float64 (constant column last when the block has an output bias).
        sigma: ``Σ`` ``(k̃, k̃)`` float64.
        rtol: relative eigenvalue cutoff of ``Σ⁺``.

    Returns:
        ``θ*`` ``(d k̃,)`` float64: the rows of ``G Σ⁺`` concatenated.
    """
    w, v = np.linalg.eigh((sigma + sigma.T) / 2)
    keep = w > rtol * max(float(w.max()), 0.0)
    coef = cross @ ((v[:, keep] / w[keep]) @ v[:, keep].T)
    return coef.reshape(-1)


def _flat_to_theta(coef: np.ndarray, d: int, bias: bool) -> np.ndarray:
    mat = coef.reshape(d, -1)
    return np.concatenate([mat[:, :-1].reshape(-1), mat[:, -1]]) if bias else mat.reshape(-1)


def _second_order_attention():
    """Scaled dot-product attention by its math kernel, which has the double backward ``J''`` needs.

    The fused kernels (flash, memory-efficient) compute the same function but have no double backward.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def _field(family: FeatureFamily, theta: Tensor, z: Tensor, layout: str) -> Tensor:
    """The block's field ``h_θ(z)``; a channel-first 1-D image site ``(B, C, L)`` is read as ``(B, C, 1, L)``."""
    if layout == "image" and z.dim() == 3:
        return family.functional(theta, z.unsqueeze(2), layout).squeeze(2)
    return family.functional(theta, z, layout)


def field_curvature(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    batches: Iterable,
    site: str,
    family: FeatureFamily,
    cross: np.ndarray,
    sigma: np.ndarray,
    *,
    layout: str,
    score: float,
) -> FieldCurvature:
    """``J'(0)`` and ``J''(0)`` along ``f_t = t Πg`` at ``site``, by double backward through the model.

    The field acts on every row of the site tensor (one vector, every token of a sequence site, every pixel
    of an image site), as the inserted block would; ``J`` is the mean per-example loss.

    Args:
        model: the reference network.
        loss_fn: per-example losses ``(B,)`` (nats per example).
        batches: the probe (iterated once), ``(inputs, targets)`` batches.
        site: a module name (its output is the site tensor, as for :class:`SiteRecorder`).
        family: the zero-output family whose statistics gave ``cross`` (``G``) and ``sigma`` (``Σ``).
        cross: the probe's ``G`` ``(d, k̃)`` float64.
        sigma: the probe's ``Σ`` ``(k̃, k̃)`` float64.
        layout: the site's layout.
        score: ``s`` of the same statistics.

    Returns:
        A :class:`FieldCurvature`.

    Raises:
        ValueError: an empty probe or losses that are not ``(B,)``.
    """
    d = cross.shape[0]
    theta_np = _flat_to_theta(steepest_field_coefficients(cross, sigma), d, family.bias)
    t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    module = resolve_module(model, site)

    def hook(_m, _a, out):
        z, rebuild = split_output(out, None, site)
        theta = torch.as_tensor(theta_np, dtype=z.dtype, device=z.device)
        return rebuild(z + _field(family, t.to(z.dtype) * theta, z, layout))

    slope = second = 0.0
    n = 0
    handle = module.register_forward_hook(hook)
    try:
        with _second_order_attention():
            for batch in batches:
                x, y, _ = unpack_batch(batch)
                losses = loss_fn(call_model(model, x), y)
                if losses.dim() != 1:
                    raise ValueError(f"loss_fn must return per-example losses (B,), got shape {tuple(losses.shape)}")
                (d1,) = torch.autograd.grad(losses.sum(), t, create_graph=True)
                (d2,) = torch.autograd.grad(d1, t)
                slope, second, n = slope + float(d1.detach()), second + float(d2), n + int(losses.shape[0])
    finally:
        handle.remove()
    if n == 0:
        raise ValueError("the probe is empty (no examples)")
    slope, second = slope / n, second / n
    s2 = score * score
    kappa = second / s2 if s2 > 0 else float("nan")
    local = s2 / (2 * kappa) if kappa > 0 else float("inf")
    return FieldCurvature(slope=slope, second=second, curvature=kappa, local_decrease=local, n=n)


@dataclass(frozen=True)
class StepCheck:
    """The loss change of the finite step ``f = t Πg`` on the probe (``cor-beta-refuted``).

    Attributes:
        step: ``t`` (``−1/β`` for the step of ``thm-guaranteed-decrease``).
        loss_before: ``J(0)``, mean probe loss (loss units per example).
        decrease: ``J(0) − J(t Πg)`` measured on the probe (negative: the step raised the loss).
        tolerance: rounding allowance of the two loss evaluations (``64 u max(1, |J|)``, ``u`` of
            the model's dtype).
        n: probe examples.
    """

    step: float
    loss_before: float
    decrease: float
    tolerance: float
    n: int


def step_decrease(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    batches: Iterable,
    site: str,
    family: FeatureFamily,
    cross: np.ndarray,
    sigma: np.ndarray,
    *,
    layout: str,
    step: float,
) -> StepCheck:
    """``J(0) − J(t Πg)``: insert the block whose field is ``t Πg`` at ``site`` and evaluate the probe.

    Args:
        model: the reference network.
        loss_fn: per-example losses ``(B,)`` (loss units per example).
        batches: the probe (iterated once), ``(inputs, targets)`` batches.
        site: a module name.
        family: the zero-output family whose statistics gave ``cross`` and ``sigma``.
        cross: the probe's ``G`` ``(d, k̃)`` float64.
        sigma: the probe's ``Σ`` ``(k̃, k̃)`` float64.
        layout: the site's layout.
        step: ``t`` (finite).

    Returns:
        A :class:`StepCheck`.

    Raises:
        ValueError: an empty probe, losses that are not ``(B,)``, or a non-finite step.
    """
    if not np.isfinite(step):
        raise ValueError(f"step must be finite, got {step}")
    d = cross.shape[0]
    theta_np = _flat_to_theta(steepest_field_coefficients(cross, sigma), d, family.bias)
    module = resolve_module(model, site)
    scale = {"t": 0.0}

    def hook(_m, _a, out):
        z, rebuild = split_output(out, None, site)
        theta = torch.as_tensor(theta_np * scale["t"], dtype=z.dtype, device=z.device)
        return rebuild(z + _field(family, theta, z, layout))

    totals = {0.0: 0.0, float(step): 0.0}
    n, eps = 0, 0.0
    handle = module.register_forward_hook(hook)
    try:
        with torch.no_grad():
            for batch in batches:
                x, y, _ = unpack_batch(batch)
                for t in totals:
                    scale["t"] = t
                    losses = loss_fn(call_model(model, x), y)
                    if losses.dim() != 1:
                        raise ValueError(f"loss_fn must return per-example losses (B,), got {tuple(losses.shape)}")
                    totals[t] += float(losses.to(torch.float64).sum())
                    eps = max(eps, float(torch.finfo(losses.dtype).eps))
                n += int(losses.shape[0])
    finally:
        handle.remove()
    if n == 0:
        raise ValueError("the probe is empty (no examples)")
    before, after = totals[0.0] / n, totals[float(step)] / n
    return StepCheck(
        step=float(step),
        loss_before=before,
        decrease=before - after,
        tolerance=64 * eps * max(1.0, abs(before), abs(after)),
        n=n,
    )
