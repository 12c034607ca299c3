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

Verdicts: ``agree``, ``counterexample`` (with the reason), ``undecided`` (the
measurement could not resolve the predicted effect; the reason says why) and
``degenerate`` (``T = {0}``: no first-order change is possible, reported apart from
saturation).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from depthsat_theory.capture import accumulate, check_function_preserving, insert_block
from depthsat_theory.families import GeneralFamily, ResidualFamily, parse_family
from depthsat_theory.io import atomic_write
from depthsat_theory.optimizers import DESCENT_COMPATIBLE, ZeroStateUpdate, get_update, threshold
from depthsat_theory.statistics import TOL_FACTOR, FeatureStatistics, statistics_for
from depthsat_theory.tasks import LSQ_FAMILIES, ODD_FAMILIES, Task, lsq_readout, odd_network, trained_task

__all__ = [
    "FAMILY_POOLS",
    "CheckConfig",
    "run_check",
    "summarize",
    "write_report_atomic",
]


def _diag_general(theta: Tensor, u: Tensor) -> Tensor:
    d = u.shape[-1]
    return theta[:d] * torch.tanh(u) + theta[d:] * u * u


#: Residual families drawn for each site layout (``product:R`` is degenerate; the
#: general family ``diag-general`` exercises the matrix-free ``torch.func`` path).
FAMILY_POOLS: dict[str, tuple[str, ...]] = {
    "vector": (
        "linear",
        "linear-nobias",
        "poly:2",
        "poly:3",
        "relu:128",
        "gelu:64",
        "tanh:64",
        "even:abs",
        "even:square",
        "preln:64",
        "product:4",
        "diag-general",
    ),
    "image": ("conv1x1", "conv3x3:16", "relu:32", "even:square", "product:2"),
    "sequence": ("linear", "relu:128", "gelu:64", "attention:32", "preln:64", "product:4"),
}


def _family(spec: str) -> ResidualFamily:
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
    """

    instances: int = 300
    seed: int = 0
    construction_fraction: float = 0.25
    kinds: tuple[str, ...] = ("mlp", "cnn", "gpt")
    optimizers: tuple[str, ...] = DESCENT_COMPATIBLE
    steps: int = 6
    step_scale: float = 1e-3
    cache_dir: str | None = None
    cnn_probe_size: int = 128

    def validate(self) -> None:
        """Raise ``ValueError`` with a specific message on bad settings."""
        if self.instances < 1:
            raise ValueError(f"instances (--instances) must be >= 1, got {self.instances}")
        if not 0.0 <= self.construction_fraction <= 1.0:
            raise ValueError(
                f"construction_fraction (--construction-fraction) must be in [0, 1], got {self.construction_fraction}"
            )
        if self.steps < 3:
            raise ValueError(f"steps must be >= 3, got {self.steps}")
        if not self.optimizers:
            raise ValueError("optimizers (--optimizers) must name at least one zero-state update")
        for name in self.optimizers:
            get_update(name)
        if not self.kinds:
            raise ValueError("kinds (--models) must name at least one of mlp, cnn, gpt")
        for k in self.kinds:
            if k not in ("mlp", "cnn", "gpt"):
                raise ValueError(f"unknown model kind {k!r} (--models); use mlp, cnn, gpt")


@dataclass
class _Context:
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


def _contexts(cfg: CheckConfig, needed: set[str]) -> dict[str, _Context]:
    out: dict[str, _Context] = {}
    for kind in cfg.kinds:
        if kind in needed or (kind == "mlp" and "mlp-lsq" in needed):
            task = trained_task(kind, cfg.seed, cache_dir=cfg.cache_dir)
            if kind == "cnn":
                task = dataclasses.replace(
                    task, inputs=task.inputs[: cfg.cnn_probe_size], targets=task.targets[: cfg.cnn_probe_size]
                )
            sites = task.model.site_names()
            out[kind] = _Context(kind, task, sites, dict.fromkeys(sites, FAMILY_POOLS[task.layout]))
    if "mlp-lsq" in needed:
        base = out["mlp"].task if "mlp" in out else trained_task("mlp", cfg.seed, cache_dir=cfg.cache_dir)
        task, sites = lsq_readout(base)
        out["mlp-lsq"] = _Context(
            "mlp-lsq", task, sites, dict.fromkeys(sites, LSQ_FAMILIES), construction="lsq-readout"
        )
    if "mlp-odd" in needed:
        task, sites = odd_network(cfg.seed)
        out["mlp-odd"] = _Context("mlp-odd", task, sites, dict.fromkeys(sites, ODD_FAMILIES), construction="odd")
    return out


def _draw(cfg: CheckConfig) -> list[_Instance]:
    """The instance list: a pure function of the config (same seed, same draw)."""
    rng = np.random.default_rng(cfg.seed)
    out = []
    for i in range(cfg.instances):
        if rng.random() < cfg.construction_fraction:
            ctx = "mlp-lsq" if rng.random() < 0.5 else "mlp-odd"
            pool = LSQ_FAMILIES if ctx == "mlp-lsq" else ODD_FAMILIES
        else:
            ctx = cfg.kinds[int(rng.integers(len(cfg.kinds)))]
            layout = {"mlp": "vector", "cnn": "image", "gpt": "sequence"}[ctx]
            pool = FAMILY_POOLS[layout]
        site_u = float(rng.random())  # resolved to a site once the model's sites are known
        fam = pool[int(rng.integers(len(pool)))]
        opt = cfg.optimizers[int(rng.integers(len(cfg.optimizers)))]
        out.append(_Instance(i, ctx, site_u, fam, opt))
    return out


class _Insertion:
    """One (context, site, family): the inserted model, its gradient and statistics."""

    def __init__(self, ctx: _Context, site: str, family: ResidualFamily, stats):
        self.ctx = ctx
        self.site = site
        self.family = family
        self.result = stats.result()
        task = ctx.task
        shape = stats.shape
        new, blk = insert_block(task.model, site, family.block(shape, stats.layout, dtype=torch.float64))
        self.model = new
        self.deviation = check_function_preserving(ctx.reference_output, new, task.inputs)
        self.params = list(blk.parameters())
        self.tparams = family.tangent_parameters(blk)
        self.initial = [p.detach().clone() for p in self.params]
        losses0 = task.loss(new(task.inputs), task.targets)
        loss0 = losses0.mean()
        grads = torch.autograd.grad(loss0, self.params, allow_unused=True)
        self.grads = [
            torch.zeros_like(p) if g is None else g.detach() for p, g in zip(self.params, grads, strict=False)
        ]
        self.j0 = float(loss0.detach())
        self.loss_scale = float(losses0.detach().abs().mean())
        tid = {id(p) for p in self.tparams}
        self.b = torch.cat([g.reshape(-1) for p, g in zip(self.params, self.grads, strict=False) if id(p) in tid])
        self.feature_grad_max = max(
            [float(g.abs().max()) for p, g in zip(self.params, self.grads, strict=False) if id(p) not in tid] + [0.0]
        )
        # scale of the tangent map: sqrt(λ_max K) and sqrt(max diag K)
        if isinstance(stats, FeatureStatistics):
            kmat = stats.feature_gram()
        else:
            kmat = (stats.k_mat / stats.n).cpu().numpy()
        lam = np.linalg.eigvalsh(0.5 * (kmat + kmat.T)) if kmat.size else np.zeros(1)
        self.a_norm = math.sqrt(max(float(lam.max()), 0.0))
        self.a_diag = math.sqrt(max(float(np.max(np.diag(kmat))), 0.0)) if kmat.size else 0.0
        self.z_rms = math.sqrt(stats.z_sq / stats.n)
        eps = torch.finfo(torch.float64).eps
        self.tau = TOL_FACTOR * eps * self.result.ag_rms * self.a_diag
        b_stats = torch.from_numpy(self.result.gradient)
        self.gradient_error = float((self.b - b_stats).abs().max()) if self.b.numel() else 0.0
        self.gradient_tol = self.tau + 1e-9 * float(b_stats.abs().max() if b_stats.numel() else 0.0)

    def _step_loss(self, update: ZeroStateUpdate, lr: float) -> tuple[float, Tensor]:
        with torch.no_grad():
            for p, p0, g in zip(self.params, self.initial, self.grads, strict=False):
                p.copy_(p0)
                p.grad = g.clone()
        opt = update.make_optimizer(self.params, lr)
        opt.step()
        task = self.ctx.task
        with torch.no_grad():
            j = float(task.loss(self.model(task.inputs), task.targets).mean())
            direction = torch.cat(
                [
                    (p.detach() - p0).reshape(-1)
                    for p, p0 in zip(self.params, self.initial, strict=False)
                    if any(p is t for t in self.tparams)
                ]
            ) / (-lr)
        return j, direction

    def evaluate(self, update: ZeroStateUpdate, cfg: CheckConfig) -> dict:
        res = self.result
        tol = res.tol
        a_pred = update.predicted_change_rate(self.b, self.tau) if self.b.numel() else 0.0
        # step sizes: the largest step moves the block output by ~ step_scale * z_rms
        pb = update.first_step(threshold(self.b, self.tau)) if self.b.numel() else self.b
        pn = float(pb.norm()) if pb.numel() else 0.0
        if pn == 0.0:
            pn = float(update.first_step(self.b).norm()) if self.b.numel() else 0.0
        eta0 = (cfg.step_scale * self.z_rms / (pn * max(self.a_norm, 1e-300))) if pn > 0 else 1.0
        if not math.isfinite(eta0) or eta0 <= 0:
            eta0 = 1.0
        etas = [eta0 * 4.0**-j for j in range(cfg.steps)]
        dj_full, dj_half = [], []
        for lr in etas:
            j_full, direction = self._step_loss(update, lr)
            j_half, _ = self._step_loss(update, lr / 2)
            dj_full.append(j_full - self.j0)
            dj_half.append(j_half - self.j0)
        dir_norm = float(direction.norm())  # the real optimizer's step direction (smallest η)
        eps = torch.finfo(torch.float64).eps
        noise = 64 * eps * max(abs(self.j0), self.loss_scale, 1e-300)
        # Richardson: (4 ΔJ(η/2) − ΔJ(η)) / η = a + O(η²) for ΔJ = aη + cη² + …
        rich = [(4 * h - f) / lr for f, h, lr in zip(dj_full, dj_half, etas, strict=False)]
        # error bar of â_j: its spread against every smaller step (J is only piecewise smooth
        # for ReLU networks, so a single neighbour can agree by chance) plus rounding noise
        last = len(rich) - 1
        errs = [
            max(abs(rich[i] - rich[j]) for j in range(i + 1, last + 1)) + 6 * noise / etas[i] + 6 * noise / etas[last]
            for i in range(last)
        ]
        best = int(np.argmin(errs))
        a_obs, err = rich[best], errs[best]
        ratio = dj_full[best] / dj_half[best] if dj_half[best] != 0 else float("nan")
        decrease = a_obs < -3 * err
        max_rate = res.score * self.a_norm * dir_norm  # |⟨b, v⟩| ≤ s ‖A v‖ ≤ s ‖A‖ ‖v‖
        slope_tol = tol * self.a_norm * dir_norm
        verdict, reason, detail = self._verdict(res, a_pred, a_obs, err, decrease, max_rate, slope_tol)
        return {
            "predicted_slope": a_pred,
            "observed_slope": a_obs,
            "slope_error": err,
            "ratio": ratio,
            "etas": etas,
            "delta_j": dj_full,
            "delta_j_half": dj_half,
            "observed_decrease": bool(decrease),
            "verdict": verdict,
            "reason": reason,
            "detail": detail,
        }

    def _verdict(self, res, a_pred, a_obs, err, decrease, max_rate, slope_tol):
        """``(verdict, reason, detail)``: ``reason`` is a short category, ``detail`` the numbers."""
        if self.deviation != 0.0:
            return "counterexample", "inserted block is not function-preserving", f"max |Δf| = {self.deviation:.3g}"
        if self.gradient_error > self.gradient_tol:
            return (
                "counterexample",
                "T1: autograd gradient differs from the statistics' b",
                (f"max |Δb| = {self.gradient_error:.3g} > {self.gradient_tol:.3g}"),
            )
        if self.feature_grad_max != 0.0:
            return (
                "counterexample",
                "feature parameters have a nonzero gradient at the origin",
                (f"max |∂J/∂ψ| = {self.feature_grad_max:.3g}"),
            )
        if res.degenerate:
            if abs(a_obs) <= 3 * err and not decrease:
                return "degenerate", "rank K = 0: T = {0}, no first-order change (not 'saturated')", ""
            return "counterexample", "degenerate family moved J at first order", f"slope {a_obs:.3g}"
        if res.score > res.tol:
            if 3 * err > 1e-2 * max_rate:
                return (
                    "undecided",
                    "slope resolution too coarse for the largest possible rate",
                    (f"resolution {3 * err:.2g} vs s·‖A‖·‖P(b)‖ = {max_rate:.2g}"),
                )
            if not decrease:
                return (
                    "counterexample",
                    "s > tol but no first-order decrease",
                    (f"s = {res.score:.3g}; observed slope {a_obs:.3g} ± {3 * err:.2g}"),
                )
            if abs(a_obs - a_pred) > 1e-3 * abs(a_pred) + 3 * err:
                return (
                    "counterexample",
                    "first-order decrease, but its slope is not −⟨b, P(b)⟩",
                    (f"observed {a_obs:.6g}, predicted {a_pred:.6g}"),
                )
            return "agree", "first-order decrease with the predicted slope", ""
        if abs(a_obs) <= 3 * err + slope_tol:
            return "agree", "no first-order term (Richardson slope consistent with 0)", ""
        return (
            "counterexample",
            "s ≤ tol but a first-order change",
            (f"s = {res.score:.3g}; slope {a_obs:.3g} ± {3 * err:.2g}"),
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
    """
    cfg.validate()
    draws = _draw(cfg)
    ctxs = _contexts(cfg, {d.context for d in draws})
    records: list[dict | None] = [None] * len(draws)
    by_ctx: dict[str, list[_Instance]] = defaultdict(list)
    for d in draws:
        by_ctx[d.context].append(d)
    for cname, items in by_ctx.items():
        ctx = ctxs[cname]
        task = ctx.task
        for it in items:
            it.site = ctx.sites[int(it.site_u * len(ctx.sites))]
        with torch.no_grad():
            ctx.reference_output = task.model(task.inputs)
        # one forward+backward pass over the probe for every (site, family) of this context
        keys = sorted({(it.site, it.family) for it in items})
        shapes = _site_shapes(task, sorted({k[0] for k in keys}))
        fams = {f: _family(f) for _, f in keys}
        stats = {k: statistics_for(fams[k[1]], shapes[k[0]], task.layout) for k in keys}
        per_site: dict[str, list] = defaultdict(list)
        for (s, _fam), acc in stats.items():
            per_site[s].append(acc)
        ctx.probe_loss = accumulate(task.model, list(per_site), _batches(task), task.loss, per_site)
        for key in keys:
            ins = _Insertion(ctx, key[0], fams[key[1]], stats[key])
            for it in items:
                if (it.site, it.family) != key:
                    continue
                upd = get_update(it.optimizer)
                ev = ins.evaluate(upd, cfg)
                res = ins.result
                records[it.index] = {
                    "index": it.index,
                    "model": task.kind,
                    "data": task.data,
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
                    "predicted_improvable": bool(res.score > res.tol and not res.degenerate),
                    "gradient_error": ins.gradient_error,
                    "function_deviation": ins.deviation,
                    **ev,
                }
                if progress is not None:
                    progress(1, f"{task.kind} {it.site} {it.family}")
    recs = [r for r in records if r is not None]
    counts = Counter(r["verdict"] for r in recs)
    report = {
        "instances": len(recs),
        "agree": counts.get("agree", 0),
        "counterexamples": counts.get("counterexample", 0),
        "undecided": counts.get("undecided", 0),
        "degenerate": counts.get("degenerate", 0),
        "seed": cfg.seed,
        "config": {
            "instances": cfg.instances,
            "construction_fraction": cfg.construction_fraction,
            "kinds": list(cfg.kinds),
            "optimizers": list(cfg.optimizers),
            "steps": cfg.steps,
            "step_scale": cfg.step_scale,
            "tol_rule": f"tol = {TOL_FACTOR:g} * eps(float64) * AG_rms",
            "dtype": "float64",
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
    return report


def _nan_none(x: float):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def _site_shapes(task: Task, sites: list[str]) -> dict[str, tuple[int, ...]]:
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


def _batches(task: Task, size: int = 256):
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
    """
    out: dict[str, dict] = {}
    for key in ("model", "data", "construction", "family", "optimizer"):
        table: dict[str, Counter] = defaultdict(Counter)
        for r in records:
            row = table[str(r[key])]
            row[r["verdict"]] += 1
            if not r["degenerate"]:
                row["predicted_improvable" if r["predicted_improvable"] else "predicted_saturated"] += 1
        out[key] = {k: dict(v) for k, v in sorted(table.items())}
    bad = [r for r in records if r["verdict"] in ("undecided", "counterexample")]
    out["reasons"] = dict(
        Counter(f"{r['verdict']}: {r['reason']}" for r in bad if r["descent_compatible"]).most_common()
    )
    out["planted_reasons"] = dict(
        Counter(f"{r['verdict']}: {r['reason']}" for r in bad if not r["descent_compatible"]).most_common()
    )
    out["planted_counterexamples"] = sum(
        1 for r in bad if r["verdict"] == "counterexample" and not r["descent_compatible"]
    )
    return out


def write_report_atomic(report: dict, path: str | os.PathLike) -> None:
    """Write JSON to ``path`` atomically (temp file in the same folder, fsync, rename).

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
