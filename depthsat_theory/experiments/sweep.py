"""Depth sweep: claims C1 and C3 of the paper on small real data.

For each curve (data set × architecture), each depth and each seed, a model is built and trained
with the one recipe of :mod:`depthsat_theory.experiments.recipe` (early stopping on ``val``), then

* **diagnosed** on the held-out ``probe`` split with :func:`depthsat_theory.diagnose.diagnose`
  (family ``linear``, ``(1 − δ)`` intervals union-bounded over the model's sites): per site the
  saturation score ``s``, ``s/AG_rms``, ``AG_rms``, ``AG_max``, the interval, ``n_to_certify``,
  the certificate and the noise-test verdict (C1);
* **probed by local insertion** at every site (C3): a zero-output ``linear`` block is inserted
  (:func:`depthsat_theory.grow.insert_blocks`, function preservation checked) and two first steps
  are compared with what the criterion predicts for them, on the probe:

  - the *steepest* step, the block matched to the negative projected activation gradient,
    ``h = −t Πg/‖Πg‖`` of function-space size ``t = step_fraction · z_rms``: predicted change
    ``−t·s`` (first order, ``thm-iff``), measured ``J(θ_t) − J(0)``; its coordinates are
    ``θ = −(t/s) G Σ⁺`` with ``G`` the block's autograd gradient and ``Σ`` the feature Gram
    of the probe, so ``s_direct = tr(G Σ⁺ Gᵀ)^{1/2}`` re-derives ``s`` independently of ``diagnose``;
  - one real Adam step from zero state at the recipe's learning rate
    (:func:`depthsat_theory.grow.preview_first_step`): predicted ``−η⟨b, P(b)⟩``, measured.

Each curve's depth where it plateaus is found by :func:`plateau_depth` (one rule for every curve).
``run_sweep`` writes ``runs.csv``, ``sites.csv``, ``curves.csv``, ``plateaus.csv``,
``insertion.csv``, ``insertion_curves.csv``, ``summary.json`` and the figures with
:func:`~depthsat_theory.experiments.record.write_results`.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from depthsat_theory.experiments import recipe as R
from depthsat_theory.experiments.record import (
    ExperimentError,
    ResumeFile,
    default_folder,
    provenance,
    summarize,
    write_results,
)
from depthsat_theory.vocabulary import Certificate, Verdict

__all__ = [
    "CONFIGS",
    "PLATEAU_TOLERANCE",
    "Curve",
    "SweepConfig",
    "crossfit_rows",
    "insertion_rows",
    "plateau_depth",
    "run_sweep",
    "site_rows",
    "steepest_fit",
    "step_change",
]

#: The plateau rule's tolerance, as a fraction of the curve's range (see :func:`plateau_depth`).
PLATEAU_TOLERANCE = 0.1


def plateau_depth(
    depths: Sequence[int], values: Sequence[float], *, lower_is_better: bool = True, tol: float = PLATEAU_TOLERANCE
) -> int | None:
    """The depth where a curve plateaus: no deeper depth improves on it by more than ``tol`` of the range.

    With the curve oriented so that lower is better (accuracy is negated), ``R = max v − min v``
    over all depths, the plateau starts at the smallest depth ``d_i`` with
    ``v_i − min_{j ≥ i} v_j ≤ tol · R``: going deeper than ``d_i`` never buys more than ``tol``
    of what depth bought over the whole sweep.  A flat curve (``R = 0``) plateaus at the first
    depth.  The deepest depth satisfies the inequality trivially, so it is no evidence of a
    plateau: when no shallower depth qualifies the curve is **still falling** at its deepest depth
    (its last step bought more than ``tol · R``) and the plateau is *not reached* (``None``); so is
    a curve of one depth.

    Args:
        depths: the depths (any order; they are sorted with their values).
        values: the curve's value at each depth (e.g. a mean over seeds).
        lower_is_better: ``False`` for curves that improve upward (accuracy).
        tol: the fraction of the range, ``0 <= tol < 1``.

    Returns:
        The plateau depth (one of ``depths`` other than the deepest), or ``None``: not reached within
        the depths given.

    Raises:
        ValueError: empty or mismatched input, a non-finite value, or ``tol`` outside ``[0, 1)``.
    """
    if len(depths) != len(values) or not depths:
        raise ValueError(f"depths and values must be non-empty and of one length, got {len(depths)} and {len(values)}")
    if not 0 <= tol < 1:
        raise ValueError(f"tol must be in [0, 1), got {tol}")
    pairs = sorted(zip(depths, values, strict=True))
    v = [float(x) if lower_is_better else -float(x) for _, x in pairs]
    if not all(math.isfinite(x) for x in v):
        raise ValueError(f"plateau_depth: non-finite value in {values}")
    spread = max(v) - min(v)
    for i, (d, _) in enumerate(pairs[:-1]):
        if v[i] - min(v[i:]) <= tol * spread:
            return int(d)
    return None  # only the deepest depth qualifies (or there is one depth): still falling, not reached


# ----------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Curve:
    """One curve of the sweep: a data set, an architecture, the depths and the width."""

    dataset: str
    arch: str
    depths: tuple[int, ...]
    width: int = 32

    @property
    def name(self) -> str:
        """``dataset/arch``."""
        return f"{self.dataset}/{self.arch}"


@dataclass(frozen=True)
class SweepConfig:
    """A size of the sweep.

    Attributes:
        name: ``"tiny"`` or ``"full"``.
        curves: the curves.
        seeds: default seeds.
        sizes: split sizes per data set (:class:`~depthsat_theory.experiments.recipe.Sizes`).
        recipe: the training recipe.
        delta: ``δ`` of the score intervals (union-bounded over each model's sites).
        step_fraction: the steepest insertion step's size as a fraction of the site's ``z_rms``.
        probe_batch: probe batch size of the diagnosis.
    """

    name: str
    curves: tuple[Curve, ...]
    seeds: tuple[int, ...]
    sizes: dict[str, R.Sizes]
    recipe: R.Recipe = R.RECIPE
    delta: float = 0.05
    step_fraction: float = 0.01
    probe_batch: int = 256

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary.

        Returns:
            The configuration (curves, seeds, sizes, recipe, δ, …) with the plateau rule spelled out.
        """
        return {
            "name": self.name,
            "curves": [dataclasses.asdict(c) for c in self.curves],
            "seeds": list(self.seeds),
            "sizes": {k: dataclasses.asdict(v) for k, v in self.sizes.items()},
            "recipe": self.recipe.to_dict(),
            "delta": self.delta,
            "family": "linear",
            "step_fraction": self.step_fraction,
            "probe_batch": self.probe_batch,
            "plateau_rule": f"first depth d_i short of the deepest with v_i - min_(j>=i) v_j <= {PLATEAU_TOLERANCE} "
            "(max v - min v); none such: not reached (still falling at the deepest depth)",
        }


_TINY_SIZES = R.Sizes(train=200, val=80, probe=96, test=96, seq_len=16)
_FULL_IMAGE = R.Sizes(train=800, val=200, probe=256, test=500)

#: ``tiny``: what CI runs (seconds); ``full``: the committed results (sized for one thread of a
#: shared 2-core machine: experiments/README.md gives its wall time).
CONFIGS: dict[str, SweepConfig] = {
    "tiny": SweepConfig(
        name="tiny",
        curves=(
            Curve("digits", "mlp", (1, 2), 16),
            Curve("digits", "cnn", (1, 2), 4),
            Curve("kjv", "gpt", (1, 2), 16),
        ),
        seeds=(0, 1),
        sizes={"digits": _TINY_SIZES, "kjv": _TINY_SIZES},
        recipe=dataclasses.replace(R.RECIPE, max_epochs=2, patience=1),
    ),
    "full": SweepConfig(
        name="full",
        curves=(
            Curve("digits", "mlp", (1, 2, 4, 8, 16, 32), 32),
            Curve("mnist5k", "mlp", (1, 2, 4, 8, 16, 32), 32),
            Curve("fashion", "mlp", (1, 2, 4, 8, 16, 32), 32),
            Curve("digits", "cnn", (1, 2, 4, 8, 16), 8),
            Curve("mnist5k", "cnn", (1, 2, 4, 8, 16), 8),
            Curve("fashion", "cnn", (1, 2, 4, 8, 16), 8),
            Curve("kjv", "gpt", (1, 2, 4, 8), 32),
        ),
        seeds=(0, 1, 2),
        sizes={
            "digits": R.Sizes(train=None, val=200, probe=256, test=300),
            "mnist5k": _FULL_IMAGE,
            "fashion": _FULL_IMAGE,
            "kjv": R.Sizes(train=768, val=256, probe=256, test=512, seq_len=32),
        },
        recipe=R.RECIPE,
    ),
}


# ----------------------------------------------------------------------------
# One model: diagnosis and insertion
# ----------------------------------------------------------------------------


def site_rows(
    model: nn.Module, splits: R.Splits, *, delta: float, probe_batch: int = 256, family: str = "linear"
) -> list[dict[str, Any]]:
    """Diagnose a trained model on the probe: one row per site (float64 copy, ``linear`` family by default).

    Args:
        model: the trained model (not modified).
        splits: its data (the probe split is used).
        delta: ``δ`` of the intervals (union-bounded over the sites).
        probe_batch: probe batch size.
        family: the residual family spec (e.g. ``"linear"``, ``"preln:16"``).

    Returns:
        Rows with ``site``, ``site_index``, ``s``, ``s_over_ag_rms``, ``ag_rms``, ``ag_max``,
        ``s_lower``/``s_upper`` (the interval), ``rel_lower``/``rel_upper`` (divided by the probe's
        ``AG_rms``), ``vacuous``, ``n_to_certify``, ``verdict`` (certificate with the interval),
        ``noise_verdict`` (the probe verdict with the noise test), ``examples_needed``,
        ``noise_ratio``, ``s2_unbiased`` (ŝ²_U), ``noise_variance`` (v̂),
        ``kink_ties``, ``z_rms`` (``activation_scaled_score / s``), ``probe_loss``;
        scores in the loss's units (nats per example or per character) per unit function-space step.
    """
    from depthsat_theory.diagnose import diagnose

    md = copy.deepcopy(model).double().eval()
    diag = diagnose(
        md,
        R.loss_function(splits),
        R.probe_batches(splits, probe_batch),
        family=family,
        delta=delta,
        loss_units=splits.loss_units,
    )
    rows = []
    for sd in diag.sites:
        res, iv = sd.result, sd.interval
        assert iv is not None
        rms = res.ag_rms
        rows.append(
            {
                "site": sd.site,
                "site_index": sd.depth,
                "s": res.score,
                "s_over_ag_rms": res.relative_score,
                "ag_rms": rms,
                "ag_max": res.ag_max,
                "s_lower": iv.score_lower,
                "s_upper": iv.score_upper,
                "rel_lower": iv.score_lower / rms if rms > 0 else math.nan,
                "rel_upper": iv.score_upper / rms if rms > 0 else math.nan,
                "vacuous": bool(iv.vacuous),
                "n_to_certify": iv.n_to_certify,
                "verdict": _certificate_reading(sd),
                "noise_verdict": res.verdict.value,
                "examples_needed": res.examples_needed,
                "noise_ratio": res.noise_ratio,
                "s2_unbiased": res.score_squared_unbiased,
                "noise_variance": res.noise_variance,
                "kink_ties": res.kink_ties,
                "z_rms": res.activation_scaled_score / res.score if res.score > 0 else math.nan,
                "probe_loss": diag.loss,
                **_headline_columns(res),
            }
        )
    return rows


def _certificate_reading(sd: Any) -> str:
    """The sweep's ``verdict`` column: the certificate read in the verdict vocabulary (the stored CSVs' meaning).

    ``degenerate``/``saturated`` as the site's verdict says; otherwise ``improvable`` when certified improvable,
    ``saturated`` when certified ε-saturated, ``undetermined`` when not certified. The site's own verdict (the
    noise test) is the ``noise_verdict`` column.
    """
    v = sd.verdict
    if v in (Verdict.DEGENERATE, Verdict.SATURATED) or sd.certificate is None:
        return v.value
    return {Certificate.IMPROVABLE: "improvable", Certificate.SATURATED: "saturated"}.get(
        sd.certificate, "undetermined"
    )


def _headline_columns(res: Any) -> dict[str, float]:
    """The bias-corrected headline of a site (``decision.headline``): ``s_U``, ``s_U/AG_rms``, its interval, chance."""
    from depthsat_theory.decision.headline import headline
    from depthsat_theory.statistics.result import StatisticsError

    try:
        hl = headline(res)
    except StatisticsError:  # v̂ not streamed or n < 2: no headline, said as NaN
        return dict.fromkeys(("s_u", "rel_u", "s_u_low", "s_u_high", "rel_chance"), math.nan)
    return {
        "s_u": hl.score,
        "rel_u": hl.relative_score,
        "s_u_low": hl.low,
        "s_u_high": hl.high,
        "rel_chance": hl.relative_chance,
    }


def _probe_mean_loss(model: nn.Module, loss_fn: Callable, batches: Sequence[tuple]) -> Tensor:
    total = sum(loss_fn(model(x), y).sum() for x, y in batches)
    return total / sum(int(x.shape[0]) for x, _ in batches)


def _feature_gram(growth: Any, site: str, model: nn.Module, batches: Sequence[tuple]) -> Tensor:
    """``Σ = E_x Σ_rows φ̃ φ̃ᵀ`` of the inserted block's features on the probe (float64)."""
    fam, block = growth.families[site], growth.blocks[site]
    seen: list[Tensor] = []
    handle = block.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            for x, _ in batches:
                model(x)
    finally:
        handle.remove()
    fmap = fam.frozen_feature_map(growth.shapes[site], growth.layouts[site], dtype=torch.float64)
    gram = None
    n = 0
    for z in seen:
        phi = fam.augmented_features(fmap, z).reshape(-1, fam.augmented_dim(growth.shapes[site], growth.layouts[site]))
        g = phi.T @ phi
        gram = g if gram is None else gram + g
        n += z.shape[0]
    assert gram is not None
    return gram / n


def steepest_fit(growth: Any, site: str, loss_fn: Callable, batches: Sequence[tuple]) -> dict[str, Any]:
    """The steepest direction of the block inserted at ``site``, fitted on ``batches``.

    ``G`` is the block's autograd gradient of the mean loss over ``batches`` and ``Σ`` its feature
    Gram there; the steepest unit step in function space has coordinates ``−G Σ⁺ / s`` with
    ``s = tr(G Σ⁺ Gᵀ)^{1/2}`` (``thm-iff``), re-derived here independently of ``diagnose``.

    Args:
        growth: a :class:`~depthsat_theory.grow.Growth` with a ``linear``-type block at ``site``
            (float64 model).
        site: the insertion site.
        loss_fn: per-example loss ``(output, targets) -> (B,)``.
        batches: the ``(x, y)`` batches the direction is fitted on.

    Returns:
        ``{"s_direct": s, "j0": the mean loss on batches, "direction": G Σ⁺ (float64 (d, k̃))}``.
    """
    model = growth.model
    params = growth.families[site].tangent_parameters(growth.blocks[site])
    j0 = _probe_mean_loss(model, loss_fn, batches)
    grads = torch.autograd.grad(j0, params, allow_unused=True)
    w_grad = grads[0] if grads[0] is not None else torch.zeros_like(params[0])
    cols = [w_grad.reshape(w_grad.shape[0], -1)]
    if len(params) > 1:
        c_grad = grads[1] if grads[1] is not None else torch.zeros_like(params[1])
        cols.append(c_grad.reshape(-1, 1))
    g = torch.cat(cols, dim=1).double()  # (d, k̃): G = E[Σ_rows g φ̃ᵀ]
    sigma = _feature_gram(growth, site, model, batches)
    sig_pinv = torch.linalg.pinv(sigma, hermitian=True, rtol=1e-10)
    s_direct = float(torch.sqrt(torch.clamp(torch.trace(g @ sig_pinv @ g.T), min=0.0)))
    return {"s_direct": s_direct, "j0": float(j0.detach()), "direction": g @ sig_pinv}


def step_change(growth: Any, site: str, coords: Tensor, loss_fn: Callable, batches: Sequence[tuple]) -> float:
    """``J(θ) − J(0)`` on ``batches`` with the block at ``site`` set to ``coords`` (then reset to zero).

    Args:
        growth: the grown model (:class:`~depthsat_theory.grow.Growth`).
        site: the insertion site.
        coords: ``θ`` as a float64 ``(d, k̃)`` matrix (weight columns, then the bias column).
        loss_fn: per-example loss.
        batches: the ``(x, y)`` batches the change is measured on.

    Returns:
        The change of the mean loss (nats per example, per character for text).
    """
    model = growth.model
    params = growth.families[site].tangent_parameters(growth.blocks[site])
    k = params[0].reshape(params[0].shape[0], -1).shape[1]
    with torch.no_grad():
        j0 = float(_probe_mean_loss(model, loss_fn, batches))
        params[0].copy_(coords[:, :k].reshape(params[0].shape))
        if len(params) > 1:
            params[1].copy_(coords[:, k].reshape(params[1].shape))
        j1 = float(_probe_mean_loss(model, loss_fn, batches))
        for p in params:
            p.zero_()
    return j1 - j0


def crossfit_rows(
    model: nn.Module,
    parts: Mapping[str, Sequence[tuple]],
    sites: Sequence[dict[str, Any]],
    *,
    loss_fn: Callable,
    step_fraction: float,
    family: str = "linear",
) -> list[dict[str, Any]]:
    """C3 cross-fitted: per site, the steepest block step fitted on ``parts["a"]`` and measured on every part.

    At each site a zero-output block of ``family`` is inserted (function preserved), its steepest
    direction fitted on probe half ``a`` (:func:`steepest_fit`: ``θ = −(t/s_a) G Σ⁺``) with
    ``t = step_fraction · z_rms``, and ``J(θ) − J(0)`` measured on each part (:func:`step_change`):
    on ``a`` it is the in-sample figure, on the other parts (a held-out half, the test set) the
    cross-fitted one. The prediction is ``−t·s_a``.

    Args:
        model: the trained model (not modified; a float64 copy is used).
        parts: named lists of ``(x, y)`` batches; ``"a"`` (the fitting half) is required.
        sites: :func:`site_rows` rows (``site``, ``site_index``, ``z_rms``).
        loss_fn: per-example loss ``(output, targets) -> (B,)`` in nats.
        step_fraction: the step size as a fraction of the site's ``z_rms``.
        family: the inserted block's residual family spec.

    Returns:
        One row per site: ``family``, ``site``, ``site_index``, ``step_size`` (``t``), ``s_fit``
        (``s`` on ``a``), ``predicted`` (``−t s_fit``) and ``measured_<part>`` per part (nats per
        example; 0 where ``s_fit = 0`` or ``t = 0``).

    Raises:
        KeyError: ``parts`` has no ``"a"``.
    """
    from depthsat_theory.grow import insert_blocks

    md = copy.deepcopy(model).double().eval()
    for p in md.parameters():
        p.requires_grad_(False)
    fitting = parts["a"]
    rows = []
    for row in sites:
        site = row["site"]
        growth = insert_blocks(md, {site: family}, seed=0, probe=fitting[0][0])
        growth.model.eval()
        fit = steepest_fit(growth, site, loss_fn, fitting)
        t = step_fraction * (row["z_rms"] if math.isfinite(row["z_rms"]) else 0.0)
        out = {"family": family, "site": site, "site_index": row["site_index"], "step_size": t}
        out["s_fit"] = fit["s_direct"]
        out["predicted"] = -t * fit["s_direct"]
        for name, bs in parts.items():
            change = 0.0
            if fit["s_direct"] > 0 and t > 0:
                change = step_change(growth, site, -(t / fit["s_direct"]) * fit["direction"], loss_fn, bs)
            out[f"measured_{name}"] = change
        rows.append(out)
    return rows


def _steepest_step(growth: Any, site: str, loss_fn: Callable, batches: Sequence[tuple], t: float) -> dict[str, float]:
    """Predicted ``−t s`` and measured change of the probe loss for the steepest step of size ``t`` at ``site``."""
    fit = steepest_fit(growth, site, loss_fn, batches)
    s_direct = fit["s_direct"]
    out = {"s_direct": s_direct, "j0": fit["j0"], "step_size": t, "predicted": -t * s_direct}
    if s_direct == 0.0:
        return {**out, "measured": 0.0}
    return {**out, "measured": step_change(growth, site, -(t / s_direct) * fit["direction"], loss_fn, batches)}


def insertion_rows(
    model: nn.Module,
    splits: R.Splits,
    sites: Sequence[dict[str, Any]],
    *,
    step_fraction: float,
    adam_lr: float,
    probe_batch: int = 256,
) -> list[dict[str, Any]]:
    """Local insertion at every site (C3): predicted against measured first-step changes of the probe loss.

    Args:
        model: the trained model (not modified; a float64 copy is grown per site).
        splits: its data (the probe split is used).
        sites: the rows of :func:`site_rows` (site names, ``s`` and ``z_rms``).
        step_fraction: the steepest step's function-space size as a fraction of the site's ``z_rms``.
        adam_lr: the learning rate of the real Adam step.
        probe_batch: probe batch size.

    Returns:
        One row per site: ``s`` (diagnose), ``s_direct`` (re-derived from the block's gradient and
        feature Gram), ``step_size``, ``predicted``/``measured`` (steepest step, nats per example
        or per character), ``adam_predicted``/``adam_measured``/``adam_ratio`` (one Adam step),
        ``deviation`` (function preservation on the probe's first batch) — losses on the probe.

    Raises:
        NotFunctionPreservingError: if an inserted block changed the function.
    """
    from depthsat_theory.grow import insert_blocks, preview_first_step

    md = copy.deepcopy(model).double().eval()
    for p in md.parameters():
        p.requires_grad_(False)
    batches = R.probe_batches(splits, probe_batch)
    loss_fn = R.loss_function(splits)
    rows = []
    for row in sites:
        site = row["site"]
        growth = insert_blocks(md, {site: "linear"}, seed=0, probe=batches[0][0])
        growth.model.eval()
        z_rms = row["z_rms"] if math.isfinite(row["z_rms"]) else 0.0
        steep = _steepest_step(growth, site, loss_fn, batches, step_fraction * z_rms)
        adam = preview_first_step(
            growth.model, loss_fn, _concat(batches), growth.new_params[site], update="adam", lr=adam_lr
        )
        rows.append(
            {
                "site": site,
                "site_index": row["site_index"],
                "s": row["s"],
                **steep,
                "ratio": steep["measured"] / steep["predicted"] if steep["predicted"] else math.nan,
                "adam_lr": adam_lr,
                "adam_predicted": adam.predicted_change,
                "adam_measured": adam.observed_change,
                "adam_ratio": adam.ratio,
                "deviation": growth.deviation,
            }
        )
    return rows


def _concat(batches: Sequence[tuple]) -> tuple[Tensor, Tensor]:
    return torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])


# ----------------------------------------------------------------------------
# The sweep
# ----------------------------------------------------------------------------


@dataclass
class _Collected:
    runs: list[dict[str, Any]] = field(default_factory=list)
    sites: list[dict[str, Any]] = field(default_factory=list)
    insertion: list[dict[str, Any]] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def _run_row(curve: Curve, depth: int, seed: int, result: R.TrainResult, sites: list[dict]) -> dict[str, Any]:
    m = result.metrics
    last = sites[-1]
    row: dict[str, Any] = {"dataset": curve.dataset, "arch": curve.arch, "depth": depth, "seed": seed}
    for split in ("train", "val", "test"):
        for key, val in m[split].items():
            row[f"{split}_{key}"] = val
    row.update(
        {
            "epochs": result.epochs,
            "best_epoch": result.best_epoch,
            "examples_seen": result.examples_seen,
            "train_wall_s": round(result.wall_s, 2),
            "ag_max": max(r["ag_max"] for r in sites),
            "ag_max_last": last["ag_max"],
            "ag_rms_max": max(r["ag_rms"] for r in sites),
            "ag_rms_last": last["ag_rms"],
            "s_max": max(r["s"] for r in sites),
            "s_last": last["s"],
            "rel_max": max(r["s_over_ag_rms"] for r in sites),
            "rel_last": last["s_over_ag_rms"],
            "n_sites": len(sites),
            "n_improvable": sum(r["verdict"] == "improvable" for r in sites),
            "n_saturated": sum(r["verdict"] == "saturated" for r in sites),
            "n_undetermined": sum(r["verdict"] == "undetermined" for r in sites),
            "n_noise_improvable": sum(r["noise_verdict"] == "improvable" for r in sites),
            "n_to_certify_min": min((r["n_to_certify"] for r in sites if r["n_to_certify"]), default=None),
        }
    )
    return row


def _one_model(cfg: SweepConfig, curve: Curve, depth: int, seed: int, splits: R.Splits) -> dict[str, list[dict]]:
    """Train, diagnose and probe one model: ``{"runs": [row], "sites": rows, "insertion": rows}``."""
    t0 = time.time()
    model = R.build_model(curve.arch, depth, splits, seed=seed, width=curve.width)
    result = R.train(model, splits, seed=seed, recipe=cfg.recipe)
    sites = site_rows(result.model, splits, delta=cfg.delta, probe_batch=cfg.probe_batch)
    key = {"dataset": curve.dataset, "arch": curve.arch, "depth": depth, "seed": seed}
    ins = insertion_rows(
        result.model, splits, sites, step_fraction=cfg.step_fraction, adam_lr=cfg.recipe.lr, probe_batch=cfg.probe_batch
    )
    run = {**_run_row(curve, depth, seed, result, sites), "model_wall_s": round(time.time() - t0, 2)}
    return {"runs": [run], "sites": [{**key, **r} for r in sites], "insertion": [{**key, **r} for r in ins]}


class _Resume(ResumeFile):
    """A JSON-lines file of finished models (one record per line), so that a stopped sweep resumes.

    A record is reused only for the same model: data set and its split sizes, architecture, width,
    depth, seed, recipe, ``δ``, step fraction and probe batch (hashed into its key), so that changing
    one curve or the list of depths keeps the other models.
    """

    def __init__(self, path: str | Path | None, cfg: SweepConfig):
        super().__init__(path, "finished-model")
        self.cfg = cfg

    def key(self, curve: Curve, depth: int, seed: int) -> str:
        sizes = self.cfg.sizes.get(curve.dataset)
        what = {
            "dataset": curve.dataset,
            "sizes": None if sizes is None else dataclasses.asdict(sizes),
            "arch": curve.arch,
            "width": curve.width,
            "recipe": self.cfg.recipe.to_dict(),
            "delta": self.cfg.delta,
            "step_fraction": self.cfg.step_fraction,
            "probe_batch": self.cfg.probe_batch,
        }
        tag = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
        return f"{tag}/{curve.name}/{depth}/{seed}"


#: the per-run metrics summarised over seeds (curves.csv) and given a plateau depth (plateaus.csv),
#: with whether lower is better
CURVE_METRICS: dict[str, bool] = {
    "test_loss": True,
    "test_accuracy": False,
    "test_bpc": True,
    "ag_max": True,
    "ag_max_last": True,
    "ag_rms_max": True,
    "ag_rms_last": True,
    "s_max": True,
    "rel_max": True,
    "rel_last": True,
}


def _curve_rows(runs: list[dict[str, Any]], curve: Curve) -> list[dict[str, Any]]:
    rows = []
    mine = [r for r in runs if r["dataset"] == curve.dataset and r["arch"] == curve.arch]
    for metric in CURVE_METRICS:
        for depth in sorted({r["depth"] for r in mine}):
            vals = [r[metric] for r in mine if r["depth"] == depth and r.get(metric) is not None]
            if vals:
                stats = summarize(vals)
                rows.append({"dataset": curve.dataset, "arch": curve.arch, "metric": metric, "depth": depth, **stats})
    return rows


def _per_seed_plateaus(mine: list[dict[str, Any]], metric: str, lower: bool) -> list[int | None]:
    out = []
    for seed in sorted({r["seed"] for r in mine}):
        sr = sorted((r["depth"], r[metric]) for r in mine if r["seed"] == seed and r.get(metric) is not None)
        if sr:
            out.append(plateau_depth([d for d, _ in sr], [v for _, v in sr], lower_is_better=lower))
    return out


def _plateau_rows(runs: list[dict[str, Any]], curves_rows: list[dict[str, Any]], curve: Curve) -> list[dict[str, Any]]:
    rows = []
    mine = [r for r in runs if r["dataset"] == curve.dataset and r["arch"] == curve.arch]
    for metric, lower in CURVE_METRICS.items():
        key = (curve.dataset, curve.arch, metric)
        pts = [c for c in curves_rows if (c["dataset"], c["arch"], c["metric"]) == key]
        if not pts:
            continue
        at_mean = plateau_depth([c["depth"] for c in pts], [c["mean"] for c in pts], lower_is_better=lower)
        per_seed = _per_seed_plateaus(mine, metric, lower)
        reached = [d for d in per_seed if d is not None]
        spread = summarize(reached) if reached else {}
        rows.append(
            {
                "dataset": curve.dataset,
                "arch": curve.arch,
                "metric": metric,
                "plateau_depth": at_mean,
                "per_seed": " ".join(map(str, per_seed)),  # None: still falling at the deepest depth
                "per_seed_mean": spread.get("mean"),
                "per_seed_std": spread.get("std"),
                "per_seed_not_reached": len(per_seed) - len(reached),
            }
        )
    return rows


def _insertion_curves(ins: list[dict[str, Any]], curve: Curve) -> list[dict[str, Any]]:
    """Per depth: over seeds, the largest measured/predicted steepest decrease over the sites and at the last site."""
    rows = []
    mine = [r for r in ins if r["dataset"] == curve.dataset and r["arch"] == curve.arch]
    for depth in sorted({r["depth"] for r in mine}):
        at = [r for r in mine if r["depth"] == depth]
        per_seed: dict[str, list[float]] = {}
        for seed in sorted({r["seed"] for r in at}):
            rs = [r for r in at if r["seed"] == seed]
            best = min(rs, key=lambda r: r["predicted"])
            last = max(rs, key=lambda r: r["site_index"])
            for k, v in {
                "best_predicted": best["predicted"],
                "best_measured": best["measured"],
                "last_predicted": last["predicted"],
                "last_measured": last["measured"],
                "adam_best_measured": min(r["adam_measured"] for r in rs),
                "adam_last_measured": last["adam_measured"],
                "adam_last_predicted": last["adam_predicted"],
                "median_ratio": sorted(r["ratio"] for r in rs)[len(rs) // 2],
            }.items():
                per_seed.setdefault(k, []).append(v)
        for k, vals in per_seed.items():
            rows.append({"dataset": curve.dataset, "arch": curve.arch, "metric": k, "depth": depth, **summarize(vals)})
    return rows


def _c1_for(metric: str, pl: dict, curves_rows: list[dict[str, Any]], curve: Curve, perf_depth: Any) -> dict:
    """C1 for one activation-gradient curve: does it fall, where does it plateau, and does that match performance."""
    ag = [c for c in curves_rows if c["dataset"] == curve.dataset and c["arch"] == curve.arch and c["metric"] == metric]
    if not ag:
        return {}
    depths = [c["depth"] for c in ag]
    ag_depth = pl.get(metric, {}).get("plateau_depth")
    falls = ag[-1]["mean"] < ag[0]["mean"]
    near = (
        ag_depth is not None and perf_depth is not None and abs(depths.index(ag_depth) - depths.index(perf_depth)) <= 1
    )
    return {
        f"{metric}_first": ag[0]["mean"],
        f"{metric}_deepest": ag[-1]["mean"],
        f"{metric}_falls": falls,
        f"{metric}_plateau_depth": ag_depth,
        f"{metric}_plateau_matches_performance": ag_depth == perf_depth,
        f"{metric}_plateau_within_one_depth_step": near,
        # C1 needs both parts: the curve falls AND its plateau is where performance stops improving
        f"c1_holds_{metric}": bool(falls and near),
    }


def _check_claims(plateaus: list[dict[str, Any]], curves_rows: list[dict[str, Any]], curve: Curve) -> dict[str, Any]:
    """C1's two parts for one curve, for ``AG_max`` over all sites and at the deepest site, as numbers.

    ``c1_holds_<metric>`` is true only when the curve falls from the shallowest to the deepest model
    *and* its plateau depth is within one depth step of the test loss's (bpc for text); a rising
    curve whose "plateau" is the first depth is not C1 even when that is where performance peaks.
    """
    pl = {p["metric"]: p for p in plateaus if p["dataset"] == curve.dataset and p["arch"] == curve.arch}
    perf = "test_bpc" if curve.dataset == "kjv" else "test_loss"
    perf_depth = pl.get(perf, {}).get("plateau_depth")
    return {
        "performance_metric": perf,
        "performance_plateau_depth": perf_depth,
        "accuracy_plateau_depth": pl.get("test_accuracy", {}).get("plateau_depth"),
        **_c1_for("ag_max", pl, curves_rows, curve, perf_depth),
        **_c1_for("ag_max_last", pl, curves_rows, curve, perf_depth),
    }


def _figures(cfg: SweepConfig, curves: list[Curve], curves_rows: list, plateaus: list, ins_rows: list) -> dict:
    from depthsat_theory.experiments import sweep_plots

    return sweep_plots.figures(curves, curves_rows, plateaus, ins_rows)


def _curve_seed(
    cfg: SweepConfig, curve: Curve, seed: int, col: _Collected, done: _Resume, progress: Callable[[str], None] | None
) -> None:
    """Every depth of one curve at one seed (models already in ``done`` are reused)."""
    splits = None
    for depth in curve.depths:
        key = done.key(curve, depth, seed)
        record = done.done.get(key)
        if record is None:
            splits = splits or R.load_splits(curve.dataset, seed, cfg.sizes.get(curve.dataset))
            record = _one_model(cfg, curve, depth, seed, splits)
            done.add(key, record)
        for name in ("runs", "sites", "insertion"):
            getattr(col, name).extend(record[name])
        if progress:
            r = record["runs"][0]
            progress(
                f"{curve.name} depth {depth} seed {seed}: test loss {r['test_loss']:.4f}, "
                f"AG_max {r['ag_max']:.4g}, {r['model_wall_s']:.1f} s"
            )


def run_sweep(
    config: str | SweepConfig = "tiny",
    *,
    out: str | Path | None = None,
    seeds: Sequence[int] | None = None,
    progress: Callable[[str], None] | None = None,
    resume: str | Path | None = None,
    curves: Sequence[str] | None = None,
) -> Path:
    """Run the depth sweep (C1) with local insertion (C3) and write its results atomically.

    Args:
        config: ``"tiny"``, ``"full"`` (:data:`CONFIGS`) or a :class:`SweepConfig`.
        out: the result folder (default :func:`~.record.default_folder`: ``experiments/results/sweep``
            for ``full``, a new temporary folder otherwise).
        seeds: seeds to run (default: the configuration's); at least 2 for a spread.
        progress: called with one line after each trained model.
        resume: a JSON-lines file of finished models: models recorded there (same configuration)
            are not retrained, and each newly finished model is appended (default: none).
        curves: run only these curves of the configuration, by name (``"digits/mlp"``; default:
            all). With one ``resume`` file per subset, several processes can share a sweep; a
            final run over all curves with the concatenated files aggregates without retraining.

    Returns:
        The result folder.

    Raises:
        ExperimentError: an unknown configuration, fewer than one seed, a curve name the
            configuration does not have, or no curve whose data is available (nothing is written
            then).
    """
    started = time.time()
    cfg = _only_curves(_resolve(config), curves)
    seeds = tuple(cfg.seeds if seeds is None else seeds)
    if not seeds or len(set(seeds)) != len(seeds):
        raise ExperimentError(f"--seeds: give distinct seeds, got {list(seeds)}")
    col = _Collected()
    done = _Resume(resume, cfg)
    ran: list[Curve] = []
    for curve in cfg.curves:
        reason = R.dataset_unavailable(curve.dataset)
        if reason:
            col.skipped[curve.name] = reason
            continue
        ran.append(curve)
        for seed in seeds:
            _curve_seed(cfg, curve, seed, col, done, progress)
    if not ran:
        raise ExperimentError(f"no data set available: {col.skipped}")
    curves_rows = [row for c in ran for row in _curve_rows(col.runs, c)]
    plateaus = [row for c in ran for row in _plateau_rows(col.runs, curves_rows, c)]
    ins_curves = [row for c in ran for row in _insertion_curves(col.insertion, c)]
    summary = {
        "skipped": col.skipped,
        "claims_c1": {c.name: _check_claims(plateaus, curves_rows, c) for c in ran},
        "plateaus": plateaus,
        "insertion": ins_curves,
    }
    folder = Path(out) if out is not None else default_folder("sweep", cfg.name)
    return write_results(
        folder,
        tables={
            "runs": col.runs,
            "sites": col.sites,
            "curves": curves_rows,
            "plateaus": plateaus,
            "insertion": col.insertion,
            "insertion_curves": ins_curves,
        },
        summary=summary,
        figures=_figures(cfg, ran, curves_rows, plateaus, ins_curves),
        meta=provenance(seeds=seeds, config=cfg.to_dict(), started=started),
    )


def _only_curves(cfg: SweepConfig, curves: Sequence[str] | None) -> SweepConfig:
    if curves is None:
        return cfg
    known = {c.name: c for c in cfg.curves}
    unknown = [name for name in curves if name not in known]
    if unknown or not curves:
        raise ExperimentError(
            f"--curve {unknown or list(curves)}: the {cfg.name!r} configuration has {', '.join(known)}"
        )
    return dataclasses.replace(cfg, curves=tuple(known[name] for name in dict.fromkeys(curves)))


def _resolve(config: str | SweepConfig) -> SweepConfig:
    if isinstance(config, SweepConfig):
        return config
    if config not in CONFIGS:
        raise ExperimentError(f"--config {config!r}: choose one of {', '.join(CONFIGS)}")
    return CONFIGS[config]
