"""Where to grow an LLM: does a site score predict the held-out gain of a layer copy placed there?

For every position ``p`` of a pretrained causal LM (SmolLM2-135M for ``full``; a tiny random Llama for
``tiny``), one zero-output copy of layer ``p`` inserted right after it
(:func:`~depthsat_theory.grow.expand_layers`, LLaMA-Pro's block expansion) is trained alone for the
same small budget of ``S`` steps (old layers frozen, :func:`~depthsat_theory.experiments.expand.train_copies`),
and its **held-out gain** is measured: held-out loss before − after, nats per token, on the same
held-out windows for every position (paired).  Three site scores are read off one probe before any
training:

* the **criterion**: the copy's own tangent score (:func:`~depthsat_theory.grow.copyscore.copy_scores`,
  how ``depthsat grow`` ranks copies), its bias-corrected headline ``s_U / AG_rms`` with its interval
  (``def-bias-corrected-score``), the plug-in ``ŝ / AG_rms``, its chance level and the verdict;
* **block influence** (ShortGPT): ``1 − cos(h_in, h_out)`` of layer ``p``, averaged over real tokens
  (:func:`block_influence`);
* the **depth index** ``p``.

Each score is read as "higher: place the copy here".  The readings (:func:`readings`): per seed and pooled
(mean over seeds), Spearman's ρ of each score with the gain, with 95 % percentile intervals from a
bootstrap over held-out windows (and over probe windows for block influence; the criterion's probe
noise shows in the spread over seeds, whose probes are disjoint, and in ``score_agreement_between_seeds``).
First, whether the gains are resolved at all: the split-half reliability of the gain ranking (ρ between
the gains measured on two halves of the held-out windows).  The verdict rule (:func:`placement_verdict`)
is stated in code.

Then ``k`` copies (``k`` in ``ks``) placed four ways (:func:`arm_positions`) with the same ``S`` steps and
trainable parameters, paired by seed.

Data (King James verses): the verse list is cut into consecutive windows of ``verses_per_window``
verses; a seed shuffles them and deals disjoint sets (:func:`window_sets`) for training, probe and
held-out, so every set is spread across the whole text and each seed has its own probe.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from depthsat_theory.experiments.record import (
    ExperimentError,
    ResumeFile,
    config_tag,
    default_folder,
    provenance,
    summarize,
    write_results,
)

__all__ = [
    "ARMS",
    "CONFIGS",
    "SCORES",
    "PlacementConfig",
    "arm_positions",
    "block_influence",
    "bootstrap_spearman",
    "paired_window_interval",
    "placement_verdict",
    "readings",
    "run_placement",
    "spearman",
    "window_sets",
]

ARMS: tuple[str, ...] = ("criterion", "even", "random", "block_influence")
"""The placements of ``k`` copies, in table order."""

SCORES: tuple[str, ...] = ("criterion", "block_influence", "depth")
"""The site scores whose rank correlation with the held-out gain is read."""

CLAIM = "LLM placement"


@dataclass(frozen=True)
class PlacementConfig:
    """One size of the experiment.

    Attributes:
        name: ``tiny`` or ``full``.
        model: ``"smollm2"`` or ``"tiny-llama"`` (as :mod:`~depthsat_theory.experiments.expand`).
        seeds: the seeds (window sets, training order, random arm).
        steps: ``S``, optimizer steps of every trained copy (one training batch per step).
        batch_size: training windows per step.
        max_tokens: tokens per training window at most.
        verses_per_window: consecutive verses per window.
        probe_windows: probe windows.
        heldout_windows: held-out windows (two halves for the split-half reliability).
        eval_batch_size: windows per forward pass of the probe and held-out passes.
        lr: Adam's learning rate (constant).
        probe_tokens: tokens per probe window at most.
        heldout_tokens: tokens per held-out window at most.
        ks: copies placed together in the arms' runs (empty: no arms).
        bootstrap: bootstrap replicates.
    """

    name: str
    model: str
    seeds: tuple[int, ...]
    steps: int
    batch_size: int
    max_tokens: int
    verses_per_window: int
    probe_windows: int
    heldout_windows: int
    eval_batch_size: int
    lr: float
    probe_tokens: int
    heldout_tokens: int
    ks: tuple[int, ...] = (2, 4)
    bootstrap: int = 2000

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (tuples as lists).

        Returns:
            The configuration as a ``dict``.
        """
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


CONFIGS: dict[str, PlacementConfig] = {
    "tiny": PlacementConfig("tiny", "tiny-llama", (0, 1, 2), 2, 2, 24, 1, 16, 8, 8, 1e-3, 24, 24, (2,), 200),
    "full": PlacementConfig("full", "smollm2", (0, 1, 2), 8, 4, 64, 3, 128, 48, 8, 2e-4, 32, 32, (2, 4), 2000),
}
"""``tiny``: CI (seconds); ``full``: the committed CPU run (experiments/README.md has its budget)."""


# ----------------------------------------------------------------------------- data
def window_sets(n_lines: int, verses_per_window: int, sizes: dict[str, int], seed: int) -> dict[str, list[int]]:
    """Disjoint window sets spread across the whole text: start lines of consecutive, non-overlapping windows.

    The lines are cut into windows ``[j v, (j + 1) v)`` (``v = verses_per_window``); ``random.Random(seed)``
    shuffles the windows and deals them to the sets in the order of ``sizes``.

    Args:
        n_lines: lines of the text.
        verses_per_window: lines per window, ``≥ 1``.
        sizes: ``{set name: windows}``.
        seed: the shuffle's seed.

    Returns:
        ``{set name: start lines}``, in the dealt order; no line is in two windows.

    Raises:
        ExperimentError: the text has fewer windows than the sets need, or a size below 1.
    """
    if verses_per_window < 1:
        raise ExperimentError(f"verses_per_window = {verses_per_window}: give at least 1")
    if any(n < 1 for n in sizes.values()):
        raise ExperimentError(f"window set sizes {sizes}: every set needs at least one window")
    starts = list(range(0, n_lines - verses_per_window + 1, verses_per_window))
    need = sum(sizes.values())
    if need > len(starts):
        raise ExperimentError(
            f"{n_lines} lines make {len(starts)} windows of {verses_per_window} lines, fewer than the {need} needed"
        )
    random.Random(seed).shuffle(starts)
    out, at = {}, 0
    for name, n in sizes.items():
        out[name] = starts[at : at + n]
        at += n
    return out


def _seed_windows(tok: Any, lines: list[str], cfg: PlacementConfig, seed: int, dev: Any) -> dict[str, Any]:
    from depthsat_theory.tasks.custom import to_device
    from depthsat_theory.tasks.zoo import window_batches

    sizes = {"train": cfg.steps * cfg.batch_size, "probe": cfg.probe_windows, "heldout": cfg.heldout_windows}
    sets = window_sets(len(lines), cfg.verses_per_window, sizes, seed)
    bs = {"train": cfg.batch_size, "probe": cfg.eval_batch_size, "heldout": cfg.eval_batch_size}
    tokens = {"train": cfg.max_tokens, "probe": cfg.probe_tokens, "heldout": cfg.heldout_tokens}
    out: dict[str, Any] = {"starts": sets}
    for name, starts in sets.items():
        batches = window_batches(tok, lines, starts, bs[name], cfg.verses_per_window, tokens[name])
        out[name] = to_device(batches, dev)
    return out


# ----------------------------------------------------------------------------- scores
def _layers(model: nn.Module) -> Any:
    inner: Any = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers"):
        raise ExperimentError(f"{type(model).__name__}: no model.layers (a Llama-style causal LM is needed)")
    return inner.layers


@torch.no_grad()
def block_influence(model: nn.Module, batches: Sequence) -> np.ndarray:
    """ShortGPT's block influence per layer and window: ``1 − cos(h_in, h_out)`` averaged over real tokens.

    ``h_in`` is the residual stream entering decoder layer ``p`` and ``h_out`` the stream it returns
    (Men et al. 2024, "ShortGPT", eq. 1); padding tokens (``attention_mask = 0``) are left out.

    Args:
        model: a Llama-style causal LM (``model.model.layers``).
        batches: ``[({"input_ids": (B, T), "attention_mask": (B, T)}, labels)]`` windows.

    Returns:
        ``(L, W, 2)`` float64: for layer ``p`` and window ``w``, the sum over the window's real tokens of
        ``1 − cos`` and their count (the score of layer ``p`` is ``sum[p, :, 0].sum() / sum[p, :, 1].sum()``).

    Raises:
        ExperimentError: the model has no ``model.layers``.
    """
    from depthsat_theory.capture.probe import call_model, unpack_batch

    layers = _layers(model)
    seen: dict[int, list] = {}

    def hook(i: int) -> Callable:
        def fn(_mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            h_in = args[0] if args else kwargs["hidden_states"]
            h_out = out[0] if isinstance(out, tuple) else out
            seen[i] = [h_in.detach().to(torch.float64), h_out.detach().to(torch.float64)]

        return fn

    handles = [layer.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    rows: list[np.ndarray] = []
    try:
        for batch in batches:
            x, _, _ = unpack_batch(batch)
            call_model(model, x)
            mask = x["attention_mask"].to(torch.float64) if isinstance(x, dict) else None
            per = []
            for i in range(len(layers)):
                h_in, h_out = seen[i]
                d = 1 - torch.nn.functional.cosine_similarity(h_in, h_out, dim=-1)
                m = torch.ones_like(d) if mask is None else mask
                per.append(torch.stack([(d * m).sum(-1), m.sum(-1)], dim=-1))
            rows.append(torch.stack(per).cpu().numpy())
    finally:
        for h in handles:
            h.remove()
    return np.concatenate(rows, axis=1)


def _criterion(base: nn.Module, loss_fn: Callable, probe: list, positions: list[int]) -> tuple[list, float]:
    """The copy score of every position on the probe: all copies inserted at once, one probe pass.

    Each copy adds exactly zero, so each sees the original stream and activation gradient
    (:func:`~depthsat_theory.grow.copyscore.copy_scores`, as ``depthsat grow`` ranks copies).
    """
    from depthsat_theory.capture.probe import unpack_batch
    from depthsat_theory.grow import expand_layers
    from depthsat_theory.grow.copyscore import copy_statistics

    t = time.process_time()
    exp = expand_layers(base, positions, probe=unpack_batch(probe[0])[0])
    stats = copy_statistics(exp, loss_fn, probe)
    rows: list[dict] = []
    for p in positions:
        site = f"model.layers.{p}"
        rows.append({"position": p, **_score_fields(stats.pop(site).result())})
    return rows, time.process_time() - t


def _score_fields(r: Any) -> dict[str, Any]:
    """The criterion's numbers of one copy: headline ``s_U/AG_rms`` and its interval, plug-in, chance, verdict."""
    from depthsat_theory.diagnose.report import headline_or_none

    h = headline_or_none(r)
    ag = r.ag_rms
    nan = math.nan
    low, high, level, chance, head = nan, nan, nan, nan, nan
    if h is not None:
        head, level, chance = h.relative_score, h.level, h.relative_chance
        if ag > 0:
            low, high = h.low / ag, h.high / ag
    return {
        "criterion": head,
        "criterion_low": low,
        "criterion_high": high,
        "criterion_level": level,
        "plugin": r.relative_score,
        "chance": chance,
        "noise_ratio": r.noise_ratio,
        "verdict": r.verdict.value,
        "ag_rms": ag,
        "probe_windows": r.n,
    }


# ----------------------------------------------------------------------------- statistics
def spearman(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> float:
    """Spearman's rank correlation (average ranks for ties; ``nan`` when either side is constant).

    Args:
        x: scores, one per position.
        y: the same positions' gains.

    Returns:
        ρ in ``[−1, 1]``, or ``nan``.
    """
    from scipy.stats import rankdata

    rx, ry = rankdata(np.asarray(x, dtype=float)), rankdata(np.asarray(y, dtype=float))
    if np.ptp(rx) == 0 or np.ptp(ry) == 0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])


def _rank_rows(a: np.ndarray) -> np.ndarray:
    """Average ranks along the last axis of ``(R, n)``."""
    from scipy.stats import rankdata

    return rankdata(a, axis=-1)


def _rho_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman's ρ row by row of ``(R, n)`` arrays (``nan`` where a row is constant)."""
    rx, ry = _rank_rows(x), _rank_rows(y)
    rx = rx - rx.mean(-1, keepdims=True)
    ry = ry - ry.mean(-1, keepdims=True)
    den = np.sqrt((rx**2).sum(-1) * (ry**2).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (rx * ry).sum(-1) / np.where(den > 0, den, 1), np.nan)


def bootstrap_spearman(
    score_windows: np.ndarray | None,
    score: np.ndarray | None,
    gain_windows: np.ndarray,
    replicates: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """Bootstrap replicates of Spearman's ρ between a site score and the held-out gain.

    Held-out windows are resampled with replacement (the same draw for every position: paired); when
    ``score_windows`` is given, the probe windows are resampled too (independently).

    Args:
        score_windows: ``(P, W_probe, 2)`` per-window (sum, count) of the score, or ``None`` (fixed ``score``).
        score: ``(P,)`` fixed score (when ``score_windows`` is ``None``).
        gain_windows: ``(P, W_heldout)`` per-window gains (nats per token).
        replicates: bootstrap replicates ``R``.
        rng: the generator.

    Returns:
        ``(R,)`` replicates of ρ (``nan`` where a replicate is constant).
    """
    n_pos, n_held = gain_windows.shape
    idx = rng.integers(0, n_held, size=(replicates, n_held))
    gains = gain_windows[:, idx].mean(-1).T  # (R, P)
    if score_windows is not None:
        n_probe = score_windows.shape[1]
        jdx = rng.integers(0, n_probe, size=(replicates, n_probe))
        s = score_windows[:, jdx, :].sum(-2)  # (P, R, 2)
        scores = (s[..., 0] / s[..., 1]).T
    else:
        scores = np.broadcast_to(np.asarray(score, dtype=float), (replicates, n_pos))
    return _rho_rows(scores, gains)


def _interval(reps: np.ndarray) -> tuple[float, float]:
    good = reps[np.isfinite(reps)]
    if good.size == 0:
        return math.nan, math.nan
    lo, hi = np.quantile(good, [0.025, 0.975])
    return float(lo), float(hi)


def placement_verdict(reliability_low: float, criterion_low: float, seeds: int = 2) -> str:
    """The claim's verdict, by a rule stated in code.

    Args:
        reliability_low: lower end of the 95 % interval of the pooled split-half reliability of the gain
            ranking (Spearman's ρ between the gains on two halves of the held-out windows).
        criterion_low: lower end of the 95 % interval of the criterion's pooled ρ with the gain.
        seeds: seeds (independent probes) pooled.

    Returns:
        ``"untestable here"`` when the gain ranking is not resolved above noise (``reliability_low ≤ 0`` or
        not finite) or fewer than 2 probes were pooled (the bootstrap over held-out windows holds no probe
        noise, so one probe cannot decide); else ``"holds"`` when ``criterion_low > 0``; else ``"fails"``.
    """
    if not (math.isfinite(reliability_low) and reliability_low > 0) or seeds < 2:
        return "untestable here"
    if math.isfinite(criterion_low) and criterion_low > 0:
        return "holds"
    return "fails"


def _score_matrix(probes: list[dict], name: str) -> list[np.ndarray]:
    if name == "block_influence":
        return [np.asarray(p["bi_windows"], dtype=float) for p in probes]
    if name == "depth":
        return [np.asarray(p["positions"], dtype=float) for p in probes]
    return [np.asarray([r["criterion"] for r in p["criterion"]], dtype=float) for p in probes]


def _point(name: str, mat: np.ndarray) -> np.ndarray:
    if name == "block_influence":
        s = mat.sum(1)
        return s[:, 0] / s[:, 1]
    return mat


def readings(probes: list[dict], gains: list[np.ndarray], replicates: int, seed: int = 0) -> dict[str, Any]:
    """Rank correlations of each site score with the held-out gain, per seed and pooled, with bootstrap intervals.

    Args:
        probes: per seed, ``{"positions": [P], "criterion": [rows with "criterion"], "bi_windows": (P, W_probe, 2)}``.
        gains: per seed, ``(P, W_heldout)`` per-window held-out gains (nats per token), rows in ``positions`` order.
        replicates: bootstrap replicates.
        seed: the bootstrap generator's seed.

    Returns:
        ``{"reliability", "rho": {score: ...}, "difference": {score: ...}, "verdict"}``: point values per
        seed, the pooled value (mean over seeds) and its 95 % percentile interval (``low``, ``high``); the
        bootstrap resamples each seed's windows independently.
    """
    rng = np.random.default_rng(seed)
    n_seeds = len(gains)
    rel_reps, rel_point = [], []
    for g in gains:
        half = g.shape[1] // 2
        a, b = g[:, :half], g[:, half:]
        rel_point.append(spearman(a.mean(1), b.mean(1)))
        ia = rng.integers(0, a.shape[1], size=(replicates, a.shape[1]))
        ib = rng.integers(0, b.shape[1], size=(replicates, b.shape[1]))
        rel_reps.append(_rho_rows(a[:, ia].mean(-1).T, b[:, ib].mean(-1).T))
    rel = _pooled(rel_point, rel_reps)
    rho: dict[str, Any] = {}
    reps: dict[str, list[np.ndarray]] = {}
    draw = [int(x) for x in rng.integers(0, 2**31, size=len(gains))]  # one held-out resample per seed, every score
    for name in SCORES:
        mats = _score_matrix(probes, name)
        point = [spearman(_point(name, m), g.mean(1)) for m, g in zip(mats, gains, strict=True)]
        reps[name] = [
            bootstrap_spearman(
                m if name == "block_influence" else None, _point(name, m), g, replicates, np.random.default_rng(d)
            )
            for m, g, d in zip(mats, gains, draw, strict=True)
        ]
        rho[name] = _pooled(point, reps[name])
    diff = {}
    for other in ("block_influence", "depth"):  # against the better orientation of the other score: |rho|
        point = [c - abs(o) for c, o in zip(rho["criterion"]["per_seed"], rho[other]["per_seed"], strict=True)]
        diff[other] = _pooled(point, [c - np.abs(o) for c, o in zip(reps["criterion"], reps[other], strict=True)])
    partial = _partial_given_depth(probes, rho, reps)
    verdict = placement_verdict(rel["low"], rho["criterion"]["low"], n_seeds)
    verdict = placement_verdict(rel["low"], rho["criterion"]["low"], n_seeds)
    return {
        "seeds": n_seeds,
        "reliability": rel,
        "rho": rho,
        "difference": diff,
        "partial_given_depth": partial,
        "verdict": verdict,
    }


def _partial_given_depth(probes: list[dict], rho: dict, reps: dict) -> dict[str, Any]:
    """Spearman partial correlation of the criterion with the gain given the depth index, per seed and pooled.

    ``(ρ_cg − ρ_cd ρ_dg) / sqrt((1 − ρ_cd²)(1 − ρ_dg²))`` with ``ρ_cd`` fixed per seed (both scores are read
    off the probe) and ``ρ_cg``, ``ρ_dg`` from the same held-out resamples.
    """
    points, rep_list = [], []
    for i, p in enumerate(probes):
        r_cd = spearman([r["criterion"] for r in p["criterion"]], p["positions"])
        c, d = rho["criterion"]["per_seed"][i], rho["depth"]["per_seed"][i]
        points.append((c - r_cd * d) / math.sqrt(max((1 - r_cd**2) * (1 - d**2), 1e-300)))
        rc, rd = reps["criterion"][i], reps["depth"][i]
        with np.errstate(invalid="ignore", divide="ignore"):
            rep_list.append((rc - r_cd * rd) / np.sqrt((1 - r_cd**2) * (1 - rd**2)))
    return _pooled(points, rep_list)


def _pooled(point: list[float], reps: list[np.ndarray]) -> dict[str, Any]:
    pooled_reps = np.mean(np.stack(reps), axis=0)
    lo, hi = _interval(pooled_reps)
    per_lo_hi = [_interval(r) for r in reps]
    return {
        "per_seed": point,
        "per_seed_low": [x[0] for x in per_lo_hi],
        "per_seed_high": [x[1] for x in per_lo_hi],
        "pooled": float(np.mean(point)),
        "low": lo,
        "high": hi,
    }


# ----------------------------------------------------------------------------- k copies
def arm_positions(arm: str, n_layers: int, k: int, *, seed: int, criterion: Sequence[float] = (), bi=()) -> list[int]:
    """The layers after which an arm inserts its ``k`` copies (ascending).

    Args:
        arm: ``criterion`` (the ``k`` highest headlines ``s_U/AG_rms`` of this seed's probe, ties to the
            shallower), ``even`` (LLaMA-Pro, :func:`~depthsat_theory.grow.ranking.even_positions`), ``random``
            (``random.Random(1000 k + seed).sample``: a different draw per seed and ``k``) or ``block_influence``
            (the ``k`` layers of highest block influence: the layers that change the stream most, ShortGPT's
            "most important").
        n_layers: ``L``.
        k: copies, ``1 ≤ k ≤ L``.
        seed: the seed.
        criterion: per layer, the criterion's headline (criterion arm).
        bi: per layer, the block influence (block-influence arm).

    Returns:
        ``k`` distinct layer indices, ascending.

    Raises:
        ExperimentError: an unknown arm, ``k`` outside ``1..L``, or scores of the wrong length.
    """
    from depthsat_theory.grow.ranking import even_positions

    if not 1 <= k <= n_layers:
        raise ExperimentError(f"k = {k}: the model has {n_layers} layers (give 1..{n_layers})")
    if arm == "even":
        return even_positions(n_layers, k)
    if arm == "random":
        return sorted(random.Random(1000 * k + seed).sample(range(n_layers), k))
    if arm in ("criterion", "block_influence"):
        vals = list(criterion if arm == "criterion" else bi)
        if len(vals) != n_layers:
            raise ExperimentError(f"the {arm} arm needs one score per layer ({n_layers}), got {len(vals)}")
        key = [v if math.isfinite(v) else -math.inf for v in vals]
        order = sorted(range(n_layers), key=lambda i: (-key[i], i))
        return sorted(order[:k])
    raise ExperimentError(f"unknown arm {arm!r}; the arms are {', '.join(ARMS)}")


# ----------------------------------------------------------------------------- runs
def _window_losses(model: nn.Module, loss_fn: Callable, batches: Sequence) -> list[float]:
    from depthsat_theory.capture.probe import call_model, unpack_batch

    out: list[float] = []
    with torch.no_grad():
        for batch in batches:
            x, y, _ = unpack_batch(batch)
            out.extend(float(v) for v in loss_fn(call_model(model, x), y))
    return out


def _train_unit(base, loss_fn, positions, win, cfg, seed, before) -> dict[str, Any]:
    from depthsat_theory.capture.probe import unpack_batch
    from depthsat_theory.experiments.expand import train_copies

    c, w = time.process_time(), time.perf_counter()
    exp, losses, _, _ = train_copies(
        base,
        loss_fn,
        positions,
        win["train"],
        steps=cfg.steps,
        lr=cfg.lr,
        seed=seed,
        probe_inputs=unpack_batch(win["heldout"][0])[0],
    )
    train_cpu = time.process_time() - c
    after = _window_losses(exp.model, loss_fn, win["heldout"])
    gain = [b - a for b, a in zip(before, after, strict=True)]
    return {
        "positions": positions,
        "gain": float(np.mean(gain)),
        "gain_windows": gain,
        "loss_after": float(np.mean(after)),
        "train_losses": losses,
        "new_parameters": _new_parameters(exp),
        "train_cpu_s": round(train_cpu, 2),
        "cpu_s": round(time.process_time() - c, 2),
        "wall_s": round(time.perf_counter() - w, 1),
    }


def _probe_unit(base, loss_fn, win, positions) -> dict[str, Any]:
    c = time.process_time()
    before = _window_losses(base, loss_fn, win["heldout"])
    before_cpu = time.process_time() - c
    c = time.process_time()
    bi = block_influence(base, win["probe"])
    bi_cpu = time.process_time() - c
    rows, crit_cpu = _criterion(base, loss_fn, win["probe"], positions)
    return {
        "positions": positions,
        "heldout_before": before,
        "bi_windows": bi[positions].tolist(),
        "criterion": rows,
        "criterion_cpu_s": round(crit_cpu, 1),
        "block_influence_cpu_s": round(bi_cpu, 1),
        "heldout_eval_cpu_s": round(before_cpu, 1),
        "starts": win["starts"],
    }


def _new_parameters(exp: Any) -> int:
    from depthsat_theory.grow.optim import flat_params

    return sum(p.numel() for p in flat_params(exp.new_params))


# ----------------------------------------------------------------------------- the experiment
class _Resume(ResumeFile):
    """Finished units (a seed's probe, one position's copy, one arm's run) keyed by configuration and unit."""

    def __init__(self, path: Any, cfg: PlacementConfig):
        super().__init__(path, "finished-unit")
        self.tag = config_tag(cfg.to_dict(), ("name", "seeds", "ks", "bootstrap"))

    def key(self, seed: int, unit: str) -> str:
        return f"{self.tag}/seed{seed}/{unit}"


def _seed_block(
    base: nn.Module, tok: Any, lines: list[str], cfg: PlacementConfig, seed: int, resume: _Resume, dev: Any, say
) -> tuple[dict, list[dict]]:
    """One seed's probe and its per-position copies (recorded unit by unit)."""
    from depthsat_theory.tasks.zoo import token_loss_masked

    n_layers = len(_layers(base))
    positions = list(range(n_layers))
    win = _seed_windows(tok, lines, cfg, seed, dev)
    key = resume.key(seed, "probe")
    probe = resume.done.get(key)
    if probe is None:
        probe = _probe_unit(base, token_loss_masked, win, positions)
        resume.add(key, probe)
        say(
            f"seed {seed}: probe done (criterion {probe['criterion_cpu_s']} CPU-s, block influence "
            f"{probe['block_influence_cpu_s']} CPU-s)"
        )
    units = []
    for p in positions:
        key = resume.key(seed, f"position{p}")
        unit = resume.done.get(key)
        if unit is None:
            unit = _train_unit(base, token_loss_masked, [p], win, cfg, seed, probe["heldout_before"])
            resume.add(key, unit)
            say(f"seed {seed} position {p}: gain {unit['gain']:+.4f} nats/token ({unit['cpu_s']} CPU-s)")
        units.append(unit)
    return probe, units


def _arm_block(base, tok, lines, cfg, seed, probe, resume, dev, say) -> list[dict]:
    from depthsat_theory.tasks.zoo import token_loss_masked

    n_layers = len(_layers(base))
    win = _seed_windows(tok, lines, cfg, seed, dev)
    crit = [r["criterion"] for r in probe["criterion"]]
    bi = _point("block_influence", np.asarray(probe["bi_windows"], dtype=float)).tolist()
    rows: list[dict] = []
    for k in cfg.ks:
        for arm in ARMS:
            pos = arm_positions(arm, n_layers, k, seed=seed, criterion=crit, bi=bi)
            key = resume.key(seed, f"k{k}/{arm}")
            unit = resume.done.get(key)
            if unit is None:
                unit = _train_unit(base, token_loss_masked, pos, win, cfg, seed, probe["heldout_before"])
                resume.add(key, unit)
                say(f"seed {seed} k={k} {arm:15s} {pos}: gain {unit['gain']:+.4f} ({unit['cpu_s']} CPU-s)")
            rows.append({"seed": seed, "k": k, "arm": arm, **unit})
    return rows


def run_placement(
    config: str | PlacementConfig = "tiny",
    *,
    out: str | Path | None = None,
    seeds: Sequence[int] | None = None,
    resume: str | Path | None = None,
    recorded_only: bool = False,
    device: str = "cpu",
    log: Callable[[str], None] | None = None,
) -> Path:
    """Run the placement experiment and write its tables, figure and ``summary.json`` (with ``claims``).

    Args:
        config: a name of :data:`CONFIGS` or a :class:`PlacementConfig`.
        out: the result folder (default ``experiments/results/placement`` for ``full``, a temporary one otherwise).
        seeds: override the configuration's seeds.
        resume: a JSON-lines file of finished units: reused when present, appended as units finish.
        recorded_only: train nothing; aggregate the units recorded in ``resume`` (what is missing is listed).
        device: ``cpu``, ``cuda`` or ``auto``.
        log: called with a one-line message after each unit.

    Returns:
        The folder written.

    Raises:
        ExperimentError: an unknown config, bad sizes, a copy that is not function-preserving, an old layer
            that moved, ``recorded_only`` without ``resume``, or no seed with every position recorded.
    """
    from depthsat_theory.tasks.custom import resolve_device
    from depthsat_theory.tasks.zoo import kjv_verses

    started = time.time()
    cfg = _config(config, seeds)
    say = log or (lambda msg: None)
    if recorded_only and resume is None:
        raise ExperimentError("--recorded-only needs --resume FILE (the units to aggregate)")
    rec = _Resume(resume, cfg)
    dev = resolve_device(device)
    work: tuple | None = None
    load_cpu: float | None = None
    model_text = _MODEL_TEXT[cfg.model]
    if not recorded_only:
        from depthsat_theory.experiments.expand import load_model

        t = time.process_time()
        base, tok, model_text = load_model(cfg.model)
        load_cpu = time.process_time() - t
        work = (base.to(dev), tok, kjv_verses(), dev, say)
    probes, gains, unit_rows, arm_rows, missing = _gather(cfg, rec, work)
    result = readings(probes, gains, cfg.bootstrap)
    folder = Path(out) if out is not None else default_folder("placement", cfg.name)
    summary, tables = _summarize(cfg, probes, unit_rows, arm_rows, result, model_text, load_cpu, missing)
    from depthsat_theory.experiments.placement_report import claims, figure

    fig = figure(tables["positions"], cfg)
    meta = provenance(seeds=[p["seed"] for p in probes], config={**cfg.to_dict(), "device": str(dev)}, started=started)
    write_results(
        folder, tables=tables, summary=summary, figures={"placement": fig}, meta=meta, claims=claims(summary, cfg)
    )
    import matplotlib.pyplot as plt

    plt.close(fig)
    return folder


_MODEL_TEXT = {
    "smollm2": "SmolLM2-135M-Instruct (Q4_1 GGUF de-quantized to float32, 30 pre-LN Llama layers x 576)",
    "tiny-llama": "a random LlamaForCausalLM (4 layers x 16, seed 0) over KJV characters",
}


def _gather(cfg: PlacementConfig, rec: _Resume, work: tuple | None) -> tuple[list, list, list, list, list[str]]:
    """Every seed's probe, per-position units and arms, run or read from the resume file.

    ``work`` is ``(model, tokenizer, lines, device, log)``, or ``None`` for ``--recorded-only`` (what is
    missing is listed).
    """
    probes: list[dict] = []
    gains: list[np.ndarray] = []
    unit_rows: list[dict] = []
    arm_rows: list[dict] = []
    missing: list[str] = []
    for seed in cfg.seeds:
        if work is None:
            got = _recorded_seed(rec, seed)
        else:
            base, tok, lines, dev, say = work
            got = _seed_block(base, tok, lines, cfg, seed, rec, dev, say)
        if got is None:
            missing.append(f"seed {seed}: probe or positions not all recorded")
            continue
        probe, units = got
        probes.append({"seed": seed, **probe})
        gains.append(np.asarray([u["gain_windows"] for u in units], dtype=float))
        unit_rows.extend({"seed": seed, "position": u["positions"][0], **u} for u in units)
    if not probes:
        raise ExperimentError("no seed has its probe and every position recorded: nothing to aggregate")
    for probe in probes:
        if work is None:
            arm_rows.extend(_recorded_arms(rec, cfg, probe["seed"], missing))
        else:
            base, tok, lines, dev, say = work
            arm_rows.extend(_arm_block(base, tok, lines, cfg, probe["seed"], probe, rec, dev, say))
    return probes, gains, unit_rows, arm_rows, missing


def _recorded_seed(rec: _Resume, seed: int) -> tuple[dict, list[dict]] | None:
    probe = rec.done.get(rec.key(seed, "probe"))
    if probe is None:
        return None
    units = [rec.done.get(rec.key(seed, f"position{p}")) for p in probe["positions"]]
    if any(u is None for u in units):
        return None
    return probe, [u for u in units if u is not None]


def _recorded_arms(rec: _Resume, cfg: PlacementConfig, seed: int, missing: list[str]) -> list[dict]:
    rows: list[dict] = []
    for k in cfg.ks:
        for arm in ARMS:
            unit = rec.done.get(rec.key(seed, f"k{k}/{arm}"))
            if unit is None:
                missing.append(f"seed {seed}: k={k} {arm} not recorded")
            else:
                rows.append({"seed": seed, "k": k, "arm": arm, **unit})
    return rows


def _config(config: str | PlacementConfig, seeds: Sequence[int] | None) -> PlacementConfig:
    if isinstance(config, PlacementConfig):
        cfg = config
    elif config in CONFIGS:
        cfg = CONFIGS[config]
    else:
        raise ExperimentError(f"--config {config!r}: give one of {', '.join(CONFIGS)}")
    if seeds is not None:
        cfg = replace(cfg, seeds=tuple(seeds))
    if not cfg.seeds or len(set(cfg.seeds)) != len(cfg.seeds):
        raise ExperimentError(f"--seeds {list(cfg.seeds)}: give distinct seeds")
    if cfg.steps < 1 or cfg.batch_size < 1 or cfg.bootstrap < 10:
        raise ExperimentError("steps and batch size must be >= 1 and bootstrap >= 10")
    if cfg.probe_windows < 4 or cfg.heldout_windows < 4:
        raise ExperimentError("the probe and the held-out set need at least 4 windows each (two halves of 2)")
    if min(cfg.max_tokens, cfg.probe_tokens, cfg.heldout_tokens) < 2 or not cfg.lr > 0:
        raise ExperimentError(f"tokens per window (>= 2) or lr {cfg.lr} (> 0) out of range")
    return cfg


def _position_rows(probes: list[dict], unit_rows: list[dict]) -> list[dict]:
    by = {(u["seed"], u["position"]): u for u in unit_rows}
    rows: list[dict] = []
    for probe in probes:
        seed = probe["seed"]
        bi = _point("block_influence", np.asarray(probe["bi_windows"], dtype=float))
        for j, crit in enumerate(probe["criterion"]):
            p = crit["position"]
            u = by[(seed, p)]
            g = np.asarray(u["gain_windows"], dtype=float)
            st = summarize(g.tolist())
            rows.append(
                {
                    "seed": seed,
                    "position": p,
                    "gain": u["gain"],
                    "gain_low": st["ci_low"],
                    "gain_high": st["ci_high"],
                    "loss_after": u["loss_after"],
                    **{k: v for k, v in crit.items() if k != "position"},
                    "windows_to_decide": _windows_to_decide(crit),
                    "block_influence": float(bi[j]),
                    "train_cpu_s": u["train_cpu_s"],
                    "cpu_s": u["cpu_s"],
                }
            )
    return rows


def _windows_to_decide(crit: dict) -> float:
    """Probe windows at which the noise test would reject ``s = 0`` if ``s² = ŝ²_U`` (``nan``: ``ŝ²_U ≤ 0``).

    ``χ²_{1,0.95} v̂ / ŝ²_U`` with ``v̂ = n · chance²`` and ``ŝ²_U = criterion²`` in units of ``AG_rms²``
    (as :attr:`~depthsat_theory.statistics.SaturationResult.examples_needed`).
    """
    from scipy.stats import chi2

    c, ch, n = crit["criterion"], crit["chance"], crit["probe_windows"]
    if not (math.isfinite(c) and c > 0 and math.isfinite(ch)):
        return math.nan
    return float(math.ceil(chi2.ppf(0.95, 1) * n * ch * ch / (c * c)))


def _rho_rows_table(result: dict) -> list[dict]:
    rows: list[dict] = []
    for what, block in [("reliability", result["reliability"])] + [(f"rho_{k}", v) for k, v in result["rho"].items()]:
        rows.extend(
            {"reading": what, "seed": i, "value": v, "low": lo, "high": hi}
            for i, (v, lo, hi) in enumerate(
                zip(block["per_seed"], block["per_seed_low"], block["per_seed_high"], strict=True)
            )
        )
        rows.append(
            {"reading": what, "seed": "pooled", "value": block["pooled"], "low": block["low"], "high": block["high"]}
        )
    for other, block in result["difference"].items():
        rows.append(
            {
                "reading": f"rho_criterion - rho_{other}",
                "seed": "pooled",
                "value": block["pooled"],
                "low": block["low"],
                "high": block["high"],
            }
        )
    return rows


def paired_window_interval(pairs: list[tuple[Sequence[float], Sequence[float]]], replicates: int, seed: int = 0):
    """Mean over seeds of the paired gain difference, with a 95 % bootstrap interval over held-out windows.

    Each seed's windows are resampled with replacement (the same draw for both arms: paired); the interval
    covers the held-out sample only, not the training order or the probe (those vary by seed).

    Args:
        pairs: per seed, ``(gain windows of arm a, gain windows of arm b)`` over the same held-out windows.
        replicates: bootstrap replicates.
        seed: the generator's seed.

    Returns:
        ``{"mean", "low", "high", "seeds"}`` (nats per token).
    """
    rng = np.random.default_rng(seed)
    diffs = [np.asarray(a, dtype=float) - np.asarray(b, dtype=float) for a, b in pairs]
    reps = np.zeros(replicates)
    for d in diffs:
        reps += d[rng.integers(0, d.size, size=(replicates, d.size))].mean(1)
    lo, hi = _interval(reps / len(diffs))
    return {"mean": float(np.mean([d.mean() for d in diffs])), "low": lo, "high": hi, "seeds": len(diffs)}


def _arm_summary(arm_rows: list[dict], replicates: int) -> tuple[list[dict], dict[str, Any]]:
    paired: list[dict] = []
    out: dict[str, dict[str, Any]] = {}
    for k in sorted({r["k"] for r in arm_rows}):
        by = {(r["arm"], r["seed"]): r for r in arm_rows if r["k"] == k}
        seeds = sorted({s for (a, s) in by if a == "criterion"})
        out[f"k{k}"] = {"gain": {a: [by[(a, s)]["gain"] for s in seeds if (a, s) in by] for a in ARMS}}
        for other in ARMS[1:]:
            both = [s for s in seeds if (other, s) in by]
            if not both:
                continue
            diffs = [by[("criterion", s)]["gain"] - by[(other, s)]["gain"] for s in both]
            paired.extend(
                {"k": k, "comparison": f"criterion - {other}", "seed": s, "gain_difference": d}
                for s, d in zip(both, diffs, strict=True)
            )
            out[f"k{k}"][f"criterion_minus_{other}"] = {
                "over_seeds": summarize(diffs),
                "over_heldout_windows": paired_window_interval(
                    [(by[("criterion", s)]["gain_windows"], by[(other, s)]["gain_windows"]) for s in both],
                    replicates,
                ),
            }
    return paired, out


def _costs(cfg: PlacementConfig, probes: list[dict], unit_rows: list[dict], load_cpu: float | None) -> dict[str, Any]:
    train = float(np.mean([u["train_cpu_s"] for u in unit_rows]))
    step = train / cfg.steps
    evals = float(np.mean([u["cpu_s"] - u["train_cpu_s"] for u in unit_rows]))
    crit = float(np.mean([p["criterion_cpu_s"] for p in probes]))
    tokens = cfg.batch_size * cfg.max_tokens
    long_steps, long_tokens = 500, 16 * 256  # expand's "large": 500 steps of 16 x 256 tokens per copy
    long_unit_h = step * long_steps * long_tokens / tokens / 3600
    return {
        "load_cpu_s": None if load_cpu is None else round(load_cpu, 1),  # None: an aggregation (--recorded-only)
        "train_cpu_s_per_unit": round(train, 2),
        "cpu_s_per_step": round(step, 3),
        "tokens_per_step": tokens,
        "heldout_eval_cpu_s_per_unit": round(evals, 2),
        "criterion_probe_cpu_s_per_seed": round(crit, 1),
        "block_influence_cpu_s_per_seed": round(float(np.mean([p["block_influence_cpu_s"] for p in probes])), 1),
        "criterion_probe_in_training_steps": round(crit / step, 1),
        "criterion_probe_cpu_s_per_window": round(crit / cfg.probe_windows, 2),
        "long_budget_unit": f"{long_steps} steps of 16x256 tokens (expand's 'large' configuration)",
        "long_budget_cpu_hours_per_copy": round(long_unit_h, 2),
        "long_budget_cpu_hours_30_positions_3_seeds": round(90 * long_unit_h, 1),
        "scaling": "CPU-seconds per step measured here (one thread, old layers frozen), scaled linearly in tokens "
        "per step and in steps; held-out evaluation and probes not included",
    }


def _criterion_summary(probes: list[dict]) -> dict[str, Any]:
    rows = [r for p in probes for r in p["criterion"]]
    return {
        "criterion_improvable": {
            str(p["seed"]): sum(r["verdict"] == "improvable" for r in p["criterion"]) for p in probes
        },
        "criterion_noise_ratio_range": [min(r["noise_ratio"] for r in rows), max(r["noise_ratio"] for r in rows)],
        "criterion_windows_to_decide_median": float(np.nanmedian([_windows_to_decide(r) for r in rows])),
    }


def _summarize(
    cfg: PlacementConfig,
    probes: list[dict],
    unit_rows: list[dict],
    arm_rows: list[dict],
    result: dict,
    model_text: str,
    load_cpu: float | None,
    missing: list[str],
) -> tuple[dict[str, Any], dict[str, list[dict]]]:
    from depthsat_theory.experiments.placement_report import beats_text

    positions = _position_rows(probes, unit_rows)
    paired, arms = _arm_summary(arm_rows, cfg.bootstrap)
    crit_by_seed = [[r["criterion"] for r in p["criterion"]] for p in probes]
    bi_by_seed = [_point("block_influence", np.asarray(p["bi_windows"], dtype=float)).tolist() for p in probes]
    agree = {
        name: [spearman(a[i], a[j]) for i in range(len(a)) for j in range(i + 1, len(a))]
        for name, a in (("criterion", crit_by_seed), ("block_influence", bi_by_seed))
    }
    summary = {
        "question": "does a site score read off one probe (the copy's own tangent score; block influence; depth) "
        "rank positions by the held-out gain of a zero-output layer copy trained there for a short budget?",
        "model": model_text,
        "model_short": "SmolLM2-135M" if cfg.model == "smollm2" else "a tiny random Llama",
        "positions": len(probes[0]["criterion"]),
        "loss_units": "nats per token (mean over a window's predicted tokens, then over windows)",
        "gain": "held-out loss before - after (positive: the copy helped), the same held-out windows for every "
        "position and arm of a seed",
        "short_budget": f"{cfg.steps} steps: the short-horizon gain, which a first-order criterion predicts; "
        "whether the ranking holds after a long continued pretraining is a GPU run (costs below)",
        "verdict_rule": "untestable here if the pooled split-half reliability interval of the gain ranking reaches 0 "
        "or fewer than 2 seeds (probes) are pooled; else holds if the criterion's pooled rho interval is above 0, "
        "fails otherwise (placement_verdict)",
        "readings": result,
        "verdict": result["verdict"],
        "criterion_vs": {o: beats_text(result["difference"][o], o) for o in ("block_influence", "depth")},
        "score_agreement_between_seeds": agree,
        **_criterion_summary(probes),
        "arms": arms,
        "arm_rules": {
            "criterion": "the k highest s_U/AG_rms of the seed's probe",
            "even": "LLaMA-Pro: after layers ceil((j+1)L/k)-1",
            "random": "random.Random(1000 k + seed).sample(range(L), k)",
            "block_influence": "the k highest block influences of the seed's probe (ShortGPT's most important)",
            "matched": "same steps, batches and trainable parameters (k layer copies) in every arm; the backward "
            "pass reaches the lowest copy, so its FLOPs differ by arm by at most the layers below it",
        },
        "costs": _costs(cfg, probes, unit_rows, load_cpu),
        "left_out": missing,
    }
    tables = {
        "positions": positions,
        "readings": _rho_rows_table(result),
        "arms": [
            {k: (" ".join(map(str, v)) if k == "positions" else v) for k, v in r.items() if k not in _BULKY}
            for r in arm_rows
        ],
        "paired": paired,
    }
    return summary, tables


_BULKY = ("gain_windows", "train_losses")
