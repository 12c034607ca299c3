"""Insert a residual block after an insertion site; check it (function preservation, T1, first step).

- :func:`insert_block` / :class:`ResidualInsertion`: a deep copy of a model with ``z ↦ z + h(z)``
  after a site;
- :func:`check_function_preserving`: the model output is unchanged at the origin (``def-family``);
- :class:`Insertion`: one family inserted at one site of a model on a probe batch, with the
  T1 gradient check (autograd's gradient of the inserted block against the statistics' ``b``,
  theory label ``thm-gradient``) and the first-step slope of a zero-state update measured by
  Richardson extrapolation (``thm-iff``, ``thm-update-invariance``).  Shared by the theorem checker
  (:mod:`depthsat_theory.check`), :func:`depthsat_theory.audit.audit_model` and ``proofs_checks``.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from depthsat_theory.capture.sites import (
    NotFunctionPreservingError,
    SiteError,
    parse_site,
    resolve_module,
    split_output,
)
from depthsat_theory.families import ResidualFamily
from depthsat_theory.families.base import follows_site
from depthsat_theory.optimizers import ZeroStateUpdate, threshold
from depthsat_theory.statistics import FeatureStatistics, GeneralStatistics, default_tol, unit_roundoff
from depthsat_theory.statistics.linalg import ACCUMULATION_FACTOR

__all__ = [
    "FirstStepSlope",
    "Insertion",
    "ResidualInsertion",
    "check_function_preserving",
    "first_output",
    "insert_block",
    "insert_block_in_place",
    "output_deviation",
]


class ResidualInsertion(nn.Module):
    """Wraps a site module ``f`` as ``x ↦ f(x) + h(f(x))``.

    Structured outputs (tuples, mappings, ``ModelOutput``): the block acts on the site
    tensor (index 0 / first key, or ``output_key``) and the result is put back in place.
    With ``occurrence = k`` the block acts only on the ``k``-th call of ``f`` in a
    forward pass of the root model (the counter is reset by a forward pre-hook on the
    root that :func:`insert_block` installs); other calls pass through unchanged.
    """

    def __init__(self, site: nn.Module, block: nn.Module, *, occurrence: int | None = None, output_key=None):
        super().__init__()
        self.site = site
        self.block = block
        self.occurrence = occurrence
        self.output_key = output_key
        self.calls = 0

    def reset_calls(self, *args) -> None:
        """Reset the occurrence counter (a forward pre-hook of the root model).

        Args:
            *args: the hook's ``(module, inputs)``, ignored.
        """
        self.calls = 0

    def forward(self, *args, **kwargs):
        """Run the site module, then add the block's output to the site tensor (on the selected call only).

        Args:
            *args: the site module's positional arguments.
            **kwargs: its keyword arguments.

        Returns:
            The site module's output, with the site tensor ``t`` replaced by ``t + block(t)`` (same
            container type); unchanged on calls other than the ``occurrence``-th.

        Raises:
            SiteError: if ``output_key`` does not select a tensor in the site module's output.
        """
        out = self.site(*args, **kwargs)
        k = self.calls
        self.calls += 1
        if self.occurrence is not None and k != self.occurrence:
            return out
        t, rebuild = split_output(out, self.output_key, "the wrapped site")
        return rebuild(t + self.block(t))


def detached_deepcopy_memo(model: nn.Module) -> dict[int, Any]:
    """A :func:`copy.deepcopy` memo copying each non-leaf tensor attribute of ``model``'s modules detached."""
    memo: dict[int, Any] = {}
    for mod in model.modules():
        for value in vars(mod).values():
            if isinstance(value, Tensor) and not value.is_leaf and id(value) not in memo:
                memo[id(value)] = value.detach().clone()
    return memo


def insert_block(model: nn.Module, site: str, block: nn.Module, *, output_key=None) -> tuple[nn.Module, nn.Module]:
    """Insert ``block`` after ``site`` in a deep copy of ``model``.

    Args:
        model: the reference model (not modified).
        site: a module name; ``"name#k"`` inserts after the ``k``-th call only of a module
            run several times per forward (a bare name inserts after every call, sharing
            the block's parameters between the calls).
        block: the residual block ``h`` (``z ↦ z + h(z)``).
        output_key: where the site tensor is in a structured output (as in
            :class:`SiteRecorder`).

    A block built with ``dtype=None`` / ``device=None``
    (:func:`~depthsat_theory.families.base.place_block`) is moved to the dtype / device of
    the site module's first floating parameter (else the model's) here, and follows the
    site tensor at run time in any case; a block built with an explicit dtype keeps it.

    Returns:
        ``(new_model, block)`` where ``block`` is the inserted module inside the copy
        (its parameters are the new block's parameters).

    Tensors that a forward pass left as plain attributes of a module (``self.cache = w * 2``:
    non-leaf tensors, which :func:`copy.deepcopy` refuses) are copied detached (a leaf copy of
    the same values, no autograd history); the copy's next forward recomputes them.

    Raises:
        SiteError: if ``site`` does not exist or is the model itself.
    """
    base, _ = parse_site(site)
    resolve_module(model, base)
    if base == "":
        raise SiteError("cannot insert after the whole model; name a submodule")
    new = copy.deepcopy(model, detached_deepcopy_memo(model))
    return new, insert_block_in_place(new, site, block, output_key=output_key)


def insert_block_in_place(model: nn.Module, site: str, block: nn.Module, *, output_key=None) -> nn.Module:
    """Insert ``block`` after ``site`` in ``model`` itself (as :func:`insert_block`, without the copy).

    Args:
        model: the model to modify.
        site: a module name, or ``"name#k"`` (as for :func:`insert_block`).
        block: the residual block ``h`` (``z ↦ z + h(z)``).
        output_key: where the site tensor is in a structured output (as in :class:`SiteRecorder`).

    Returns:
        The inserted block.

    Raises:
        SiteError: if ``site`` does not exist or is the model itself.
    """
    new = model
    base, occ = parse_site(site)
    resolve_module(new, base)
    if base == "":
        raise SiteError("cannot insert after the whole model; name a submodule")
    parent_name, _, child = base.rpartition(".")
    parent = resolve_module(new, parent_name) if parent_name else new
    old = parent.get_submodule(child)
    _match_site(block, old, new)
    wrapped = ResidualInsertion(old, block, occurrence=occ, output_key=output_key)
    if child.isdigit() and isinstance(parent, (nn.ModuleList, nn.Sequential)):
        parent[int(child)] = wrapped
    else:
        setattr(parent, child, wrapped)
    if occ is not None:
        new.register_forward_pre_hook(wrapped.reset_calls)
    if getattr(block, "masks_padding", False):
        new.register_forward_pre_hook(functools.partial(_share_attention_mask, block), with_kwargs=True)
    return wrapped.block


def _share_attention_mask(block: nn.Module, _module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of the root model: the block's ``padding_mask`` is this pass's ``attention_mask``.

    The mask is read from the keyword ``attention_mask`` or from a mapping passed as the first
    positional argument (``model({"input_ids": …, "attention_mask": …})``); a pass without one
    clears it, so a mask never leaks into a later unpadded pass.
    """
    mask = kwargs.get("attention_mask")
    if mask is None and args and isinstance(args[0], Mapping):
        mask = args[0].get("attention_mask")
    block.__dict__["padding_mask"] = mask.bool() if isinstance(mask, Tensor) else None


def _match_site(block: nn.Module, site: nn.Module, model: nn.Module) -> None:
    """Move a block that follows its site (``dtype``/``device`` left ``None``) to the site's parameters."""
    follow_dtype, follow_device = follows_site(block)
    ref = next((p for m in (site, model) for p in m.parameters() if p.is_floating_point()), None)
    if ref is None or not (follow_dtype or follow_device):
        return
    own = next(iter(block.parameters()), None)
    if own is None:
        return
    block.to(dtype=ref.dtype if follow_dtype else own.dtype, device=ref.device if follow_device else own.device)


def check_function_preserving(
    model: nn.Module | Tensor, new_model: nn.Module, inputs, *, atol: float | None = None
) -> float:
    """Verify that an inserted block preserves the model's function at the origin.

    Args:
        model: the reference model, or its precomputed output on ``inputs``.
        new_model: the model with the block inserted.
        inputs: a probe batch accepted by both models.
        atol: allowed max absolute deviation of outputs (default: ``0`` for blocks
            whose output is an exact zero; pass a rounding bound otherwise).

    Returns:
        The max absolute deviation of the outputs (tuple outputs: the first element;
        mappings/``ModelOutput``: ``logits`` if present, else the first value).

    Raises:
        NotFunctionPreservingError: if the deviation exceeds ``atol`` or is NaN.
    """
    dev = output_deviation(model, new_model, inputs)
    limit = 0.0 if atol is None else atol
    if not dev <= limit:
        raise NotFunctionPreservingError(
            f"the inserted block changes the model's output by {dev:.3g} (> {limit:.3g}) at the "
            f"origin: the family is not function-preserving (h(0, z) must be 0)"
        )
    return dev


def output_deviation(model: nn.Module | Tensor, new_model: nn.Module, inputs) -> float:
    """``max |f(x) − f_new(x)|`` over a probe batch (``nan`` if either output is NaN).

    Args:
        model: the reference model, or its precomputed output on ``inputs``.
        new_model: the model with a block inserted.
        inputs: a probe batch accepted by both models.

    Returns:
        The max absolute deviation of the primary outputs (:func:`first_output`); ``0.0``
        for empty outputs.
    """
    with torch.no_grad():
        a = model if isinstance(model, Tensor) else first_output(model(inputs))
        b = first_output(new_model(inputs))
    return float((a - b).abs().max()) if a.numel() else 0.0


def first_output(out):
    """The primary tensor of a model output (tuple: first item; mapping/``ModelOutput``: ``logits``).

    Args:
        out: a model output: a tensor, tuple/list, mapping or ``ModelOutput``.

    Returns:
        The first item of a tuple/list; a mapping's ``logits`` (else its first value); an object's
        ``logits`` attribute; otherwise ``out`` itself.
    """
    if isinstance(out, (tuple, list)):
        return out[0]
    if isinstance(out, Mapping):
        return out["logits"] if "logits" in out else next(iter(out.values()))
    if hasattr(out, "logits"):
        return out.logits
    return out


Statistics = FeatureStatistics | GeneralStatistics


@dataclass(frozen=True)
class FirstStepSlope:
    """The first-order coefficient of ``ΔJ(η) = J(−η P(b)) − J(0)`` for one zero-state update.

    Attributes:
        predicted_slope: ``−⟨b, P(b̃)⟩`` with ``b̃`` the thresholded autograd gradient
            (loss units per unit of ``η``).
        observed_slope: Richardson's ``â_j = (4 ΔJ(η_j/2) − ΔJ(η_j)) / η_j`` at the ``j``
            with the smallest error bar.
        slope_error: its error bar (spread against smaller steps plus rounding noise of ``J``).
        ratio: ``ΔJ(η_j) / ΔJ(η_j/2)`` at that ``j`` (2 for a first-order change, 4 for a
            second-order one; ``nan`` if ``ΔJ(η_j/2) = 0``).
        etas: the step sizes ``η_j = η_0 4^{-j}``.
        delta_j, delta_j_half: ``ΔJ(η_j)`` and ``ΔJ(η_j / 2)``.
        observed_decrease: ``observed_slope < −3 · slope_error``.
        direction_norm: ``‖P(b)‖`` of the real optimizer's step (smallest ``η``), tangent
            coordinates only.
    """

    predicted_slope: float
    observed_slope: float
    slope_error: float
    ratio: float
    etas: list[float]
    delta_j: list[float]
    delta_j_half: list[float]
    observed_decrease: bool
    direction_norm: float


class Insertion:
    """A family's zero block inserted after a site of a copy of a model, on a probe batch.

    On construction the block is built (float64) and inserted with :func:`insert_block`, and
    the deviation of the model output at the origin is measured (``def-family``).  The rest
    is computed on first use: autograd's gradient of the mean probe loss with respect to the
    block (T1, theory label ``thm-gradient``: it equals the statistics' ``b = E[Aᵀ g]``, and
    the feature parameters ``ψ`` of a feature family have zero gradient), and the real
    optimizer's first step from zero state (:meth:`first_step_slope`).

    Args:
        model: the reference model (not modified), float64.
        site: module name of the site (as for :func:`insert_block`).
        family: the residual family.
        stats: the family's statistics at ``site`` (:func:`~depthsat_theory.statistics.statistics_for`),
            accumulated on the same probe before the first use of a statistics-derived
            attribute (``result``, ``gradient_error``, ``a_norm``, …); its ``shape`` and
            ``layout`` define the block.
        inputs, targets: the probe batch.
        loss: per-example loss ``loss(model(inputs), targets) -> (B,)``.
        block: the block to insert (default: ``family.block(stats.shape, stats.layout)`` in float64).
        reference_output: ``model(inputs)`` if already computed.
        atol: allowed output deviation at the origin; ``None`` measures without raising.

    Attributes:
        model: the copy with the block inserted; ``block``: the inserted block.
        deviation: ``max |f(x) − f_new(x)|`` on the probe (``inf`` when NaN).
        params: the block's parameters; ``initial``: their values at the origin.

    Raises:
        NotFunctionPreservingError: if the deviation exceeds ``atol`` (or is NaN).
        SiteError: if ``site`` does not exist.
    """

    def __init__(
        self,
        model: nn.Module,
        site: str,
        family: ResidualFamily,
        stats: Statistics,
        inputs: Any,
        targets: Any,
        loss: Callable[[Tensor, Tensor], Tensor],
        *,
        block: nn.Module | None = None,
        reference_output: Tensor | None = None,
        atol: float | None = 0.0,
    ):
        self.site = site
        self.family = family
        self.stats = stats
        self.inputs, self.targets, self.loss = inputs, targets, loss
        if block is None:
            block = family.block(stats.shape, stats.layout, dtype=torch.float64)
        self.model, self.block = insert_block(model, site, block)
        ref = model if reference_output is None else reference_output
        if atol is None:
            dev = output_deviation(ref, self.model, inputs)
        else:
            dev = check_function_preserving(ref, self.model, inputs, atol=atol)
        self.deviation = math.inf if math.isnan(dev) else dev
        self.params = list(self.block.parameters())
        self.initial = [p.detach().clone() for p in self.params]

    @functools.cached_property
    def tangent_params(self) -> list[nn.Parameter]:
        """The block's parameters forming ``θ`` (:meth:`ResidualFamily.tangent_parameters`)."""
        return self.family.tangent_parameters(self.block)

    # -- T1: autograd's gradient of the inserted block
    @functools.cached_property
    def _backward(self) -> tuple[list[Tensor], float, float]:
        losses0 = self.loss(self.model(self.inputs), self.targets)
        loss0 = losses0.mean()
        grads = torch.autograd.grad(loss0, self.params, allow_unused=True)
        full = [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(self.params, grads, strict=True)]
        return full, float(loss0.detach()), float(losses0.detach().abs().mean())

    @property
    def grads(self) -> list[Tensor]:
        """Autograd's gradients of the mean probe loss, one per entry of ``params`` (zeros if unused)."""
        return self._backward[0]

    @property
    def j0(self) -> float:
        """The mean probe loss ``J(0)`` of the inserted model."""
        return self._backward[1]

    @property
    def loss_scale(self) -> float:
        """``mean |ℓ|`` over the probe (the scale of the rounding noise of ``J``)."""
        return self._backward[2]

    @functools.cached_property
    def b(self) -> Tensor:
        """Autograd's ``b = ∇_θ J(0)``: float64 ``(p,)`` in the order of ``tangent_params``."""
        by_id = {id(p): g for p, g in zip(self.params, self.grads, strict=True)}
        flat = [by_id[id(p)].reshape(-1) for p in self.tangent_params]
        return torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64)

    @functools.cached_property
    def feature_grad_max(self) -> float:
        """``max |∂J/∂ψ|`` over the block's non-tangent parameters (0 by T1 / T5)."""
        tid = {id(p) for p in self.tangent_params}
        return max(
            [float(g.abs().max()) for p, g in zip(self.params, self.grads, strict=True) if id(p) not in tid] + [0.0]
        )

    # -- statistics-derived scales
    @functools.cached_property
    def result(self):
        """The statistics' :class:`~depthsat_theory.statistics.SaturationResult`."""
        return self.stats.result()

    @functools.cached_property
    def _gram_scales(self) -> tuple[float, float]:
        # for feature families K = I_d ⊗ Σ has the eigenvalues and the diagonal of Σ
        stats = self.stats
        kmat = stats.feature_gram() if isinstance(stats, FeatureStatistics) else stats.tangent_gram()
        if not kmat.size:
            return 0.0, 0.0
        lam = np.linalg.eigvalsh(0.5 * (kmat + kmat.T))
        return math.sqrt(max(float(lam.max()), 0.0)), math.sqrt(max(float(np.max(np.diag(kmat))), 0.0))

    @property
    def a_norm(self) -> float:
        """``‖A‖ = sqrt(λ_max K)``: the scale of the tangent map."""
        return self._gram_scales[0]

    @property
    def a_diag(self) -> float:
        """``sqrt(max_i K_ii)``."""
        return self._gram_scales[1]

    @property
    def z_rms(self) -> float:
        """``sqrt(E ‖z‖_F²)`` of the site tensors on the probe."""
        return math.sqrt(self.stats.z_sq / self.stats.n)

    @property
    def tau(self) -> float:
        """Rounding bound of ``b``: ``(C_g + C_acc sqrt(N)) · u64 · AG_rms · sqrt(max K_ii)`` (thm-score-error).

        The gradient's own rounding plus the float64 accumulation over the probe's ``N`` units.
        """
        acc = ACCUMULATION_FACTOR * math.sqrt(max(self.result.units, 1)) * unit_roundoff(torch.float64)
        return (default_tol(torch.float64, self.result.ag_rms) + acc * self.result.ag_rms) * self.a_diag

    @functools.cached_property
    def _b_statistics(self) -> Tensor:
        return torch.from_numpy(self.result.gradient)

    @property
    def gradient_error(self) -> float:
        """``max |b_autograd − b_statistics|`` (T1)."""
        return float((self.b - self._b_statistics).abs().max()) if self.b.numel() else 0.0

    @property
    def gradient_tol(self) -> float:
        """Allowed ``gradient_error``: ``tau + 1e-9 · max |b_statistics|``."""
        bs = self._b_statistics
        return self.tau + 1e-9 * float(bs.abs().max() if bs.numel() else 0.0)

    def relative_gradient_error(self) -> float | None:
        """``max |b_autograd − b_statistics| / max(|b|)`` (T1, scale-free).

        Returns:
            The relative error, ``0.0`` for ``p = 0``, ``None`` if the two gradients have
            different lengths (a family whose block does not match its ``θ``).
        """
        b_auto, b_stat = self.b.numpy(), self.result.gradient
        if b_auto.shape != b_stat.shape:
            return None
        if not b_auto.size:
            return 0.0
        scale = max(float(np.abs(b_stat).max()), float(np.abs(b_auto).max()), 1e-300)
        return float(np.abs(b_auto - b_stat).max()) / scale

    # -- the first step of a real optimizer
    def step_loss(self, update: ZeroStateUpdate, lr: float) -> tuple[float, Tensor]:
        """Take the real optimizer's first step from zero state with step size ``lr``.

        Args:
            update: the zero-state update (its optimizer sees only the block's parameters).
            lr: the step size ``η > 0``.

        Returns:
            ``(J(η), P)``: the mean probe loss after the step and the step direction
            ``−(θ_1 − θ_0) / η`` in tangent coordinates.
        """
        with torch.no_grad():
            for p, p0, g in zip(self.params, self.initial, self.grads, strict=True):
                p.copy_(p0)
                p.grad = g.clone()
        update.make_optimizer(self.params, lr).step()
        tid = {id(p) for p in self.tangent_params}
        with torch.no_grad():
            j = float(self.loss(self.model(self.inputs), self.targets).mean())
            moved = [
                (p.detach() - p0).reshape(-1) for p, p0 in zip(self.params, self.initial, strict=True) if id(p) in tid
            ]
            direction = torch.cat(moved) / (-lr)
        return j, direction

    def first_step_eta(self, update: ZeroStateUpdate, step_scale: float) -> float:
        """The largest step ``η_0``: it moves the block output by about ``step_scale · z_rms``.

        Args:
            update: the optimizer's zero-state update (its first step from the thresholded gradient).
            step_scale: the target output move, as a fraction of ``z_rms``.

        Returns:
            ``η_0 > 0``; ``1.0`` when there is no gradient, the first step is zero, or the value is not finite.
        """
        if not self.b.numel():
            return 1.0
        pn = float(update.first_step(threshold(self.b, self.tau)).norm())
        if pn == 0.0:
            pn = float(update.first_step(self.b).norm())
        eta0 = (step_scale * self.z_rms / (pn * max(self.a_norm, 1e-300))) if pn > 0 else 1.0
        return eta0 if math.isfinite(eta0) and eta0 > 0 else 1.0

    def first_step_slope(self, update: ZeroStateUpdate, *, step_scale: float = 1e-3, steps: int = 6) -> FirstStepSlope:
        """Measure the first-order coefficient of ``ΔJ(η)`` along the real optimizer's first step.

        Steps ``η_j = η_0 4^{-j}`` and ``η_j / 2`` (``j < steps``, :meth:`first_step_eta`);
        Richardson's ``(4 ΔJ(η/2) − ΔJ(η)) / η = a + O(η²)`` for ``ΔJ = aη + cη² + …``.
        The error bar of ``â_j`` is its spread against every smaller step (``J`` is only
        piecewise smooth for ReLU networks) plus the rounding noise ``64 eps64 max(|J|, mean|ℓ|)``.

        Args:
            update: the zero-state update.
            step_scale: function-space size of the largest step relative to ``z_rms``.
            steps: number of step sizes (``>= 2``).

        Returns:
            A :class:`FirstStepSlope`.
        """
        predicted = update.predicted_change_rate(self.b, self.tau) if self.b.numel() else 0.0
        eta0 = self.first_step_eta(update, step_scale)
        etas = [eta0 * 4.0**-j for j in range(steps)]
        dj_full, dj_half = [], []
        direction = self.b
        for lr in etas:
            j_full, direction = self.step_loss(update, lr)
            j_half, _ = self.step_loss(update, lr / 2)
            dj_full.append(j_full - self.j0)
            dj_half.append(j_half - self.j0)
        noise = 64 * torch.finfo(torch.float64).eps * max(abs(self.j0), self.loss_scale, 1e-300)
        rich = [(4 * h - f) / lr for f, h, lr in zip(dj_full, dj_half, etas, strict=True)]
        last = len(rich) - 1
        errs = [
            max(abs(rich[i] - rich[j]) for j in range(i + 1, last + 1)) + 6 * noise / etas[i] + 6 * noise / etas[last]
            for i in range(last)
        ]
        best = int(np.argmin(errs))
        a_obs, err = rich[best], errs[best]
        return FirstStepSlope(
            predicted_slope=predicted,
            observed_slope=a_obs,
            slope_error=err,
            ratio=dj_full[best] / dj_half[best] if dj_half[best] != 0 else float("nan"),
            etas=etas,
            delta_j=dj_full,
            delta_j_half=dj_half,
            observed_decrease=bool(a_obs < -3 * err),
            direction_norm=float(direction.norm()),
        )
