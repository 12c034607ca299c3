"""The theorem checker behind ``depthsat check`` (theory label thm-iff, with T1, T3, T5, T6).

For each randomly drawn *instance* — a model on its probe, an insertion site, a
residual family and a zero-state update — the checker

1. predicts from the probe's statistics alone: the saturation score ``s`` (cross-
   gradient or matrix-free path), *improvable* iff ``s > tol``, *degenerate* iff
   ``rank K = 0``;
2. independently inserts the family's zero block into a copy of the model, verifies
   function preservation, takes the gradient ``b`` of the probe loss with respect to
   the block (checked against the statistics: T1), and performs the real
   optimizer's first step from zero state with only the block's parameters in the
   optimizer, for step sizes ``η_j = η_0 4^{-j}`` and ``η_j / 2``, measuring
   ``ΔJ(η) = J(η) − J(0)``;
3. estimates the first-order coefficient by Richardson extrapolation
   ``â_j = (4 ΔJ(η_j/2) − ΔJ(η_j)) / η_j`` (exact for ``aη + cη²``), with an error
   bar from its convergence (``max_{i>j} |â_i − â_j|``) plus the rounding noise of
   ``J``, at the ``j`` with the smallest error bar;
4. compares: improvable ⇒ a significant first-order *decrease* whose slope matches
   ``−⟨b, P(b)⟩``; saturated ⇒ a first-order coefficient consistent with zero
   (``|â| ≤ tol · ‖A‖ · ‖P(b)‖``).  "J did not decrease" is never used as evidence.

Verdicts (:class:`Agreement`): ``agree``, ``counterexample`` (with the reason), ``undecided``
(the measurement could not resolve the predicted effect; the reason says why) and
``degenerate`` (``T = {0}``: no first-order change is possible, reported apart from
saturation).  The insertion, the T1 gradient check and the first-step slope are
:class:`depthsat_theory.capture.Insertion`'s; this module draws the instances and judges them.

The trained models are named only through :data:`KIND_LAYOUTS` (kinds of
:data:`depthsat_theory.tasks.KINDS`) and the construction contexts :data:`LSQ_CONTEXT` and
:data:`ODD_CONTEXT`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor

from depthsat_theory.capture import FirstStepSlope, Insertion, accumulate
from depthsat_theory.families import GeneralFamily, ResidualFamily, parse_family
from depthsat_theory.io import atomic_write
from depthsat_theory.optimizers import DESCENT_COMPATIBLE, ZeroStateUpdate, get_update
from depthsat_theory.statistics import SaturationResult, statistics_for
from depthsat_theory.tasks import (
    KINDS,
    LSQ_FAMILIES,
    ODD_FAMILIES,
    Task,
    lsq_readout,
    model_entry,
    odd_network,
    trained_task,
)
from depthsat_theory.vocabulary import Layout, Verdict

__all__ = [
    "FAMILY_POOLS",
    "KIND_LAYOUTS",
    "LSQ_BASE",
    "LSQ_CONTEXT",
    "ODD_CONTEXT",
    "Agreement",
    "CheckConfig",
    "CheckContext",
    "evaluate",
    "insert_on_probe",
    "pool_family",
    "probe_statistics",
    "run_check",
    "site_shapes",
    "summarize",
    "task_batches",
    "write_report_atomic",
]

#: Site layout of each trained model kind the checker draws (the kinds of
#: :data:`depthsat_theory.tasks.KINDS`): the one place the checker names models.
KIND_LAYOUTS: dict[str, Layout] = {kind: model_entry(kind).layout for kind in KINDS}
#: The contexts of the exact constructions (theory label ``ex-saturated``): the least-squares
#: readout on the trained kind :data:`LSQ_BASE`, and the odd network on synthetic data.
LSQ_CONTEXT, ODD_CONTEXT, LSQ_BASE = "mlp-lsq", "mlp-odd", "mlp"


def _diag_general(theta: Tensor, u: Tensor) -> Tensor:
    d = u.shape[-1]
    return theta[:d] * torch.tanh(u) + theta[d:] * u * u


#: Residual families drawn for each site layout (``product:R`` is degenerate; the
#: general family ``diag-general`` exercises the matrix-free ``torch.func`` path).
FAMILY_POOLS: dict[str, tuple[str, ...]] = {
    Layout.VECTOR: (
        "linear",
        "linear-nobias",
        "powers:2",
        "powers:3",
        "poly:2",
        "relu:128",
        "gelu:64",
        "tanh:64",
        "even:abs",
        "even:square",
        "preln:64",
        "product:4",
        "diag-general",
    ),
    Layout.IMAGE: ("conv1x1", "conv3x3:16", "relu:32", "even:square", "product:2"),
    Layout.SEQUENCE: ("linear", "relu:128", "gelu:64", "attention:32", "preln:64", "product:4"),
}


def pool_family(spec: str) -> ResidualFamily:
    """A family of :data:`FAMILY_POOLS` from its spec.

    ``spec`` is a built-in spec (:func:`~depthsat_theory.families.parse_family`) or ``diag-general``,
    the general family ``h(θ, u) = θ₁ ⊙ tanh(u) + θ₂ ⊙ u²`` (``p = 2d``).

    Args:
        spec: a built-in family spec or ``"diag-general"``.

    Returns:
        The family.

    Raises:
        FamilyError: on a spec that is neither.
    """
    if spec == "diag-general":
        return GeneralFamily(_diag_general, lambda d: 2 * d, name="diag-general")
    return parse_family(spec)


@dataclass
class CheckConfig:
    """Settings of a check run.

    Attributes:
        instances: number of instances ``N``.
        seed: seed of the instance draw and of the models' training.
        construction_fraction: share of instances drawn from the exact saturated
            constructions (half least-squares readout on digits, half odd network
            on synthetic data), the rest from models trained on real data.
        kinds: trained model kinds to draw from (``mlp``, ``cnn``, ``gpt``).
        optimizers: zero-state update names to draw from (``rotation``, which is
            not descent-compatible, is planted only when named here).
        steps: number of step sizes ``η_j = η_0 4^{-j}`` (each also evaluated at ``η_j/2``).
        step_scale: function-space size of the largest step relative to ``z_rms``.
        cache_dir: where trained weights are cached (``None``: no cache).
        cnn_probe_size: the CNN's probe is its first ``cnn_probe_size`` probe images
            (float64 convolutions dominate the run time on CPU).
        device: where the models and probes run (``cpu``, ``cuda``, ``cuda:N``, ``auto``:
            :func:`~depthsat_theory.tasks.custom.resolve_device`); the models are trained (and
            cached) on the CPU whatever the device.
    """

    instances: int = 300
    seed: int = 0
    construction_fraction: float = 0.25
    kinds: tuple[str, ...] = tuple(KIND_LAYOUTS)
    optimizers: tuple[str, ...] = DESCENT_COMPATIBLE
    steps: int = 6
    step_scale: float = 1e-3
    cache_dir: str | None = None
    cnn_probe_size: int = 128
    device: str = "cpu"

    def validate(self) -> None:
        """Raise ``ValueError`` with a specific message on bad settings.

        Raises:
            ValueError: an unknown or unavailable device, ``instances < 1``, ``seed < 0``, a
                ``construction_fraction`` outside ``[0, 1]``, ``steps < 3``, no or an unknown optimizer,
                or no or an unknown model kind.
        """
        from depthsat_theory.tasks.custom import resolve_device

        resolve_device(self.device)  # a ModelSpecError (a ValueError) naming device
        if self.instances < 1:
            raise ValueError(f"instances must be >= 1, got {self.instances}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if not 0.0 <= self.construction_fraction <= 1.0:
            raise ValueError(f"construction_fraction must be in [0, 1], got {self.construction_fraction}")
        if self.steps < 3:
            raise ValueError(f"steps must be >= 3, got {self.steps}")
        if not self.optimizers:
            raise ValueError("optimizers must name at least one zero-state update")
        for name in self.optimizers:
            get_update(name)
        known = [k for k in KINDS if k in KIND_LAYOUTS]
        if not self.kinds:
            raise ValueError(f"kinds must name at least one of {', '.join(known)}")
        for k in self.kinds:
            if k not in known:
                raise ValueError(f"unknown model kind {k!r} in kinds; use {', '.join(known)}")


@dataclass
class CheckContext:
    """One model of a check run on its probe, with the sites and family pools drawn from.

    Attributes:
        name: ``"mlp"``, ``"cnn"``, ``"gpt"``, ``"mlp-lsq"`` or ``"mlp-odd"``.
        task: the model, probe and loss.
        sites: the site names drawn from.
        families: family pool per site.
        construction: ``"lsq-readout"``, ``"odd"`` or ``None`` (a trained model).
        reference_output: ``task.model(task.inputs)``, once computed.
        probe_loss: mean probe loss from the statistics pass.
    """

    name: str
    task: Task
    sites: list[str]
    families: dict[str, tuple[str, ...]] = field(default_factory=dict)  # site -> pool
    construction: str | None = None
    reference_output: Tensor | None = None
    probe_loss: float = float("nan")


@dataclass
class _Instance:
    index: int
    context: str
    site_u: float
    family: str
    optimizer: str
    site: str = ""


def _on_device(task: Task, device: torch.device) -> Task:
    """``task`` with its model (in place) and probe tensors on ``device``."""
    task.model.to(device)
    return dataclasses.replace(task, inputs=task.inputs.to(device), targets=task.targets.to(device))


def _contexts(cfg: CheckConfig, needed: set[str]) -> dict[str, CheckContext]:
    from depthsat_theory.tasks.custom import resolve_device

    dev = resolve_device(cfg.device)
    out: dict[str, CheckContext] = {}
    for kind in cfg.kinds:
        if kind in needed or (kind == LSQ_BASE and LSQ_CONTEXT in needed):
            task = _on_device(trained_task(kind, cfg.seed, cache_dir=cfg.cache_dir), dev)
            if KIND_LAYOUTS[kind] == Layout.IMAGE:  # float64 convolutions dominate the run time
                task = dataclasses.replace(
                    task, inputs=task.inputs[: cfg.cnn_probe_size], targets=task.targets[: cfg.cnn_probe_size]
                )
            sites = cast(Any, task.model).site_names()
            out[kind] = CheckContext(kind, task, sites, dict.fromkeys(sites, FAMILY_POOLS[task.layout]))
    if LSQ_CONTEXT in needed:
        base = out[LSQ_BASE].task if LSQ_BASE in out else trained_task(LSQ_BASE, cfg.seed, cache_dir=cfg.cache_dir)
        task, sites = lsq_readout(base)
        task = _on_device(task, dev)
        out[LSQ_CONTEXT] = CheckContext(
            LSQ_CONTEXT, task, sites, dict.fromkeys(sites, LSQ_FAMILIES), construction="lsq-readout"
        )
    if ODD_CONTEXT in needed:
        task, sites = odd_network(cfg.seed)
        task = _on_device(task, dev)
        out[ODD_CONTEXT] = CheckContext(
            ODD_CONTEXT, task, sites, dict.fromkeys(sites, ODD_FAMILIES), construction="odd"
        )
    return out


def _draw(cfg: CheckConfig) -> list[_Instance]:
    """The instance list: a pure function of the config (same seed, same draw)."""
    rng = np.random.default_rng(cfg.seed)
    out = []
    for i in range(cfg.instances):
        pool: tuple[str, ...]
        if rng.random() < cfg.construction_fraction:
            ctx = LSQ_CONTEXT if rng.random() < 0.5 else ODD_CONTEXT
            pool = LSQ_FAMILIES if ctx == LSQ_CONTEXT else ODD_FAMILIES
        else:
            ctx = cfg.kinds[int(rng.integers(len(cfg.kinds)))]
            pool = FAMILY_POOLS[KIND_LAYOUTS[ctx]]
        site_u = float(rng.random())  # resolved to a site once the model's sites are known
        fam = pool[int(rng.integers(len(pool)))]
        opt = cfg.optimizers[int(rng.integers(len(cfg.optimizers)))]
        out.append(_Instance(i, ctx, site_u, fam, opt))
    return out


class Agreement(str, Enum):
    """How one instance's measurement compares with the prediction (the checker's outcome).

    - ``AGREE``: the measured first-order behaviour is the predicted one;
    - ``COUNTEREXAMPLE``: it is not (the record's ``reason`` says how);
    - ``UNDECIDED``: the measurement could not resolve the predicted effect;
    - ``DEGENERATE``: ``T = {0}`` and no first-order change, as predicted
      (:attr:`depthsat_theory.vocabulary.Verdict.DEGENERATE`, reported apart from saturation).
    """

    AGREE = "agree"
    COUNTEREXAMPLE = "counterexample"
    UNDECIDED = "undecided"
    DEGENERATE = Verdict.DEGENERATE.value

    def __str__(self) -> str:
        return self.value


def evaluate(ins: Insertion, update: ZeroStateUpdate, cfg: CheckConfig) -> dict:
    """Measure one zero-state update on an insertion and compare with the prediction.

    Args:
        ins: the inserted block (:class:`~depthsat_theory.capture.Insertion`), its statistics
            accumulated on the probe.
        update: the zero-state update whose real optimizer takes the first step.
        cfg: the settings (``steps``, ``step_scale``).

    Returns:
        A dict with ``predicted_slope``, ``observed_slope``, ``slope_error``, ``ratio``,
        ``etas``, ``delta_j``, ``delta_j_half``, ``observed_decrease`` (see
        :class:`~depthsat_theory.capture.FirstStepSlope`), ``agreement`` (an
        :class:`Agreement`), ``reason`` (a short category) and ``detail`` (the numbers).
    """
    res = ins.result
    m = ins.first_step_slope(update, step_scale=cfg.step_scale, steps=cfg.steps)
    agreement, reason, detail = _agreement(ins, res, m)
    return {
        "predicted_slope": m.predicted_slope,
        "observed_slope": m.observed_slope,
        "slope_error": m.slope_error,
        "ratio": m.ratio,
        "etas": m.etas,
        "delta_j": m.delta_j,
        "delta_j_half": m.delta_j_half,
        "observed_decrease": m.observed_decrease,
        "agreement": agreement,
        "reason": reason,
        "detail": detail,
    }


def _insertion_failure(ins: Insertion) -> tuple[Agreement, str, str] | None:
    """A counterexample found before any step: function preservation, T1, ``∂J/∂ψ = 0``."""
    if ins.deviation != 0.0:
        return Agreement.COUNTEREXAMPLE, "inserted block is not function-preserving", f"max |Δf| = {ins.deviation:.3g}"
    if ins.gradient_error > ins.gradient_tol:
        return (
            Agreement.COUNTEREXAMPLE,
            "T1: autograd gradient differs from the statistics' b",
            f"max |Δb| = {ins.gradient_error:.3g} > {ins.gradient_tol:.3g}",
        )
    if ins.feature_grad_max != 0.0:
        return (
            Agreement.COUNTEREXAMPLE,
            "feature parameters have a nonzero gradient at the origin",
            f"max |∂J/∂ψ| = {ins.feature_grad_max:.3g}",
        )
    return None


def _improvable_agreement(res: SaturationResult, m: FirstStepSlope, max_rate: float) -> tuple[Agreement, str, str]:
    err3 = 3 * m.slope_error
    if err3 > 1e-2 * max_rate:
        return (
            Agreement.UNDECIDED,
            "slope resolution too coarse for the largest possible rate",
            f"resolution {err3:.2g} vs s·‖A‖·‖P(b)‖ = {max_rate:.2g}",
        )
    if not m.observed_decrease:
        return (
            Agreement.COUNTEREXAMPLE,
            "s > tol but no first-order decrease",
            f"s = {res.score:.3g}; observed slope {m.observed_slope:.3g} ± {err3:.2g}",
        )
    if abs(m.observed_slope - m.predicted_slope) > 1e-3 * abs(m.predicted_slope) + err3:
        return (
            Agreement.COUNTEREXAMPLE,
            "first-order decrease, but its slope is not −⟨b, P(b)⟩",
            f"observed {m.observed_slope:.6g}, predicted {m.predicted_slope:.6g}",
        )
    return Agreement.AGREE, "first-order decrease with the predicted slope", ""


def _agreement(ins: Insertion, res: SaturationResult, m: FirstStepSlope) -> tuple[Agreement, str, str]:
    """``(agreement, reason, detail)``: ``reason`` is a short category, ``detail`` the numbers."""
    failure = _insertion_failure(ins)
    if failure is not None:
        return failure
    a_obs, err = m.observed_slope, m.slope_error
    if res.degenerate:
        if abs(a_obs) <= 3 * err and not m.observed_decrease:
            return Agreement.DEGENERATE, "rank K = 0: T = {0}, no first-order change (not 'saturated')", ""
        return Agreement.COUNTEREXAMPLE, "degenerate family moved J at first order", f"slope {a_obs:.3g}"
    if res.probe_verdict is Verdict.UNDETERMINED:
        return Agreement.UNDECIDED, "the probe verdict is undetermined (theory/numerics.md)", res.verdict_reason
    if res.score > res.tol:
        # |⟨b, v⟩| ≤ s ‖A v‖ ≤ s ‖A‖ ‖v‖ along the real optimizer's direction v
        return _improvable_agreement(res, m, res.score * ins.a_norm * m.direction_norm)
    if abs(a_obs) <= 3 * err + res.tol * ins.a_norm * m.direction_norm:
        return Agreement.AGREE, "no first-order term (Richardson slope consistent with 0)", ""
    return (
        Agreement.COUNTEREXAMPLE,
        "s ≤ tol but a first-order change",
        f"s = {res.score:.3g}; slope {a_obs:.3g} ± {3 * err:.2g}",
    )


def run_check(cfg: CheckConfig, *, progress=None) -> dict:
    """Run the theorem check and return the report (a JSON-ready dict).

    Args:
        cfg: the settings.
        progress: optional callable ``progress(advance: int, description: str)``.

    Returns:
        A dict with keys ``instances``, ``agree``, ``counterexamples``, ``undecided``,
        ``degenerate``, ``seed``, ``config``, ``summary``, ``records``; each record has
        ``model``, ``data``, ``site``, ``family``, ``optimizer``, ``score``, ``tol``,
        ``predicted_improvable``, ``observed_decrease``, ``verdict`` and more.

    Raises:
        ValueError: on bad settings (:meth:`CheckConfig.validate`).
    """
    cfg.validate()
    draws = _draw(cfg)
    ctxs = _contexts(cfg, {d.context for d in draws})
    records: list[dict | None] = [None] * len(draws)
    by_ctx: dict[str, list[_Instance]] = defaultdict(list)
    for d in draws:
        by_ctx[d.context].append(d)
    for cname, items in by_ctx.items():
        for rec in _run_context(ctxs[cname], items, cfg, progress):
            records[rec["index"]] = rec
    recs = [r for r in records if r is not None]
    counts = Counter(r["agreement"] for r in recs)
    return {
        "instances": len(recs),
        "agree": counts.get(Agreement.AGREE, 0),
        "counterexamples": counts.get(Agreement.COUNTEREXAMPLE, 0),
        "undecided": counts.get(Agreement.UNDECIDED, 0),
        "degenerate": counts.get(Agreement.DEGENERATE, 0),
        "seed": cfg.seed,
        "config": {
            "instances": cfg.instances,
            "construction_fraction": cfg.construction_fraction,
            "kinds": list(cfg.kinds),
            "optimizers": list(cfg.optimizers),
            "steps": cfg.steps,
            "step_scale": cfg.step_scale,
            "tol_rule": "tol = score_error, the rounding bound of theory/numerics.md (thm-score-error)",
            "dtype": "float64",
            "device": cfg.device,
        },
        "models": {
            c.name: {
                "data": c.task.data,
                "probe_size": int(c.task.inputs.shape[0]),
                "probe_loss": c.probe_loss,
                "sites": c.sites,
                "construction": c.construction,
            }
            for c in ctxs.values()
        },
        "summary": summarize(recs),
        "records": recs,
    }


def _run_context(ctx: CheckContext, items: list[_Instance], cfg: CheckConfig, progress) -> list[dict]:
    """The records of one context's instances (one statistics pass over its probe)."""
    task = ctx.task
    for it in items:
        it.site = ctx.sites[int(it.site_u * len(ctx.sites))]
    with torch.no_grad():
        ctx.reference_output = task.model(task.inputs)
    keys = sorted({(it.site, it.family) for it in items})
    fams = {f: pool_family(f) for _, f in keys}
    stats, ctx.probe_loss = probe_statistics(task, [(site, fams[f]) for site, f in keys])
    out = []
    for key, acc in zip(keys, stats, strict=True):
        ins = Insertion(
            task.model,
            key[0],
            fams[key[1]],
            acc,
            task.inputs,
            task.targets,
            task.loss,
            reference_output=ctx.reference_output,
        )
        for it in items:
            if (it.site, it.family) != key:
                continue
            out.append(_record(ctx, it, ins, cfg))
            if progress is not None:
                progress(1, f"{task.kind} {it.site} {it.family}")
    return out


def _record(ctx: CheckContext, it: _Instance, ins: Insertion, cfg: CheckConfig) -> dict:
    upd = get_update(it.optimizer)
    ev = evaluate(ins, upd, cfg)
    res = ins.result
    return {
        "index": it.index,
        "model": ctx.task.kind,
        "data": ctx.task.data,
        "construction": ctx.construction,
        "site": it.site,
        "family": it.family,
        "unit": res.unit,
        "optimizer": it.optimizer,
        "descent_compatible": bool(upd.descent_compatible),
        "score": res.score,
        "relative_score": _nan_none(res.relative_score),
        "tol": res.tol,
        "ag_rms": res.ag_rms,
        "ag_max": res.ag_max,
        "tangent_rank": res.tangent_rank,
        "tangent_dim": res.tangent_dim,
        "degenerate": res.degenerate,
        "predicted_improvable": res.probe_verdict == Verdict.IMPROVABLE,
        "score_error": res.score_error,
        "gradient_error": ins.gradient_error,
        "function_deviation": ins.deviation,
        **ev,
    }


def probe_statistics(
    task: Task, pairs: list[tuple[str, ResidualFamily]], *, pool_ties: bool = False
) -> tuple[list, float]:
    """Stream the statistics of every ``(site, family)`` pair in one pass over a task's probe.

    Args:
        task: the model, probe and per-example loss.
        pairs: ``(site, family)`` pairs (a site may repeat with several families).
        pool_ties: pool exactly equal units (realizability defect, T6).

    Returns:
        ``(statistics, probe_loss)``: one accumulated statistics object per pair (in order)
        and the mean probe loss.

    Raises:
        SiteError, FamilyError, StatisticsError: as :func:`~depthsat_theory.capture.accumulate`.
    """
    shapes = site_shapes(task, sorted({site for site, _ in pairs}))
    stats = [statistics_for(fam, shapes[site], task.layout, pool_ties=pool_ties) for site, fam in pairs]
    per_site: dict[str, list] = defaultdict(list)
    for (site, _fam), acc in zip(pairs, stats, strict=True):
        per_site[site].append(acc)
    loss = accumulate(task.model, list(per_site), task_batches(task), task.loss, per_site)
    return stats, loss


def insert_on_probe(task: Task, site: str, family: ResidualFamily, *, pool_ties: bool = False) -> Insertion:
    """One ``(task, site, family)`` as the checker does it: statistics on the probe, then the insertion.

    Args:
        task: the model (float64), probe and per-example loss.
        site: the insertion site.
        family: the residual family.
        pool_ties: pool exactly equal units in the statistics.

    Returns:
        The :class:`~depthsat_theory.capture.Insertion` (its ``stats`` accumulated on the whole probe).

    Raises:
        NotFunctionPreservingError: if the inserted block changes the model output.
    """
    with torch.no_grad():
        ref = task.model(task.inputs)
    (stats,), _ = probe_statistics(task, [(site, family)], pool_ties=pool_ties)
    return Insertion(task.model, site, family, stats, task.inputs, task.targets, task.loss, reference_output=ref)


def _nan_none(x: float):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def site_shapes(task: Task, sites: list[str]) -> dict[str, tuple[int, ...]]:
    """Per-example shapes of the site tensors (tuple outputs: the first item), from two probe examples.

    Args:
        task: the model and probe.
        sites: module names.

    Returns:
        ``{site: shape without the batch dimension}``.

    Raises:
        KeyError: on a site that is not a module of the model.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    mods = dict(task.model.named_modules())
    hs = [
        mods[s].register_forward_hook(
            lambda m, i, o, s=s: shapes.__setitem__(s, tuple((o[0] if isinstance(o, tuple) else o).shape[1:]))
        )
        for s in sites
    ]
    with torch.no_grad():
        task.model(task.inputs[:2])
    for h in hs:
        h.remove()
    return shapes


def task_batches(task: Task, size: int = 256) -> Iterator[tuple[Tensor, Tensor]]:
    """The probe as consecutive ``(inputs, targets)`` batches of ``size`` examples.

    Args:
        task: the task whose probe (``inputs``, ``targets``) is split.
        size: examples per batch (the last batch may be smaller).

    Yields:
        ``(inputs, targets)`` slices (views) of the probe.
    """
    n = task.inputs.shape[0]
    for i in range(0, n, size):
        yield task.inputs[i : i + size], task.targets[i : i + size]


def summarize(records: list[dict]) -> dict:
    """Verdict counts grouped by model, data, construction, family and optimizer.

    Each group also counts the prediction (``predicted_improvable`` / ``predicted_saturated``,
    degenerate instances in neither), so that "agree" can be read both ways.  The
    reasons of undecided and counterexample instances are counted by category, split
    into those of planted non-descent-compatible updates (expected: T2 assumes descent
    compatibility) and the others.

    Args:
        records: the per-instance records of the check.

    Returns:
        ``{"model" | "data" | "construction" | "family" | "optimizer": {value: counts}}`` plus
        ``reasons``, ``planted_reasons`` (``{"agreement: reason": count}``, most common first) and
        ``planted_counterexamples`` (an ``int``).
    """
    out: dict[str, Any] = {}
    for key in ("model", "data", "construction", "family", "optimizer"):
        table: dict[str, Counter] = defaultdict(Counter)
        for r in records:
            row = table[str(r[key])]
            row[r["agreement"]] += 1
            if not r["degenerate"]:
                row["predicted_improvable" if r["predicted_improvable"] else "predicted_saturated"] += 1
        out[key] = {k: dict(v) for k, v in sorted(table.items())}
    bad = [r for r in records if r["agreement"] in (Agreement.UNDECIDED, Agreement.COUNTEREXAMPLE)]
    out["reasons"] = dict(
        Counter(f"{r['agreement']}: {r['reason']}" for r in bad if r["descent_compatible"]).most_common()
    )
    out["planted_reasons"] = dict(
        Counter(f"{r['agreement']}: {r['reason']}" for r in bad if not r["descent_compatible"]).most_common()
    )
    out["planted_counterexamples"] = sum(
        1 for r in bad if r["agreement"] == Agreement.COUNTEREXAMPLE and not r["descent_compatible"]
    )
    return out


def write_report_atomic(report: dict, path: str | os.PathLike) -> None:
    """Write JSON to ``path`` atomically (temp file in the same folder, fsync, rename).

    Args:
        report: the report (non-finite floats are written as ``null``).
        path: the JSON file.

    Raises:
        OSError: if the folder is not writable (no partial file is left behind).
    """
    atomic_write(path, lambda fh: json.dump(_finite(report), fh, indent=1, allow_nan=False, default=_json_default))


def _finite(o):
    """Replace NaN/Inf floats by ``None`` (strict JSON)."""
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return o


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
