"""The placement experiment's claims row and figure (:mod:`~depthsat_theory.experiments.placement`).

The row is written from the readings by the rule of :func:`~depthsat_theory.experiments.placement.placement_verdict`
(the keys of ``record.CLAIM_KEYS``), so a rerun regenerates it.
"""

from __future__ import annotations

import math
from typing import Any

from depthsat_theory.experiments.record import summarize

__all__ = ["beats_text", "claims", "figure"]


def beats_text(diff: dict[str, Any], other: str) -> str:
    """Whether the criterion's ρ beats another score's: both intervals of their difference must agree.

    The bootstrap over held-out windows holds neither probe nor training-order noise, so a difference is
    called only when the Student-t 95 % interval over seeds (independent probes and windows) agrees with it.

    Args:
        diff: ``{"pooled", "low", "high", "per_seed"}`` of ``ρ(criterion) − |ρ(other)|`` (pooled over seeds;
            the other score in its better orientation; ``low``/``high`` from the held-out bootstrap).
        other: the other score's name.

    Returns:
        ``"beats <other>"`` (both intervals above 0), ``"loses to <other>"`` (both below 0), or
        ``"not resolved against <other>"`` with the over-seeds interval when that is what leaves it open.
    """
    lo, hi = diff["low"], diff["high"]
    seeds = summarize(diff.get("per_seed") or [diff["pooled"]])
    t_lo, t_hi = seeds["ci_low"], seeds["ci_high"]
    if math.isfinite(lo) and lo > 0 and math.isfinite(t_lo) and t_lo > 0:
        return f"beats {other}"
    if math.isfinite(hi) and hi < 0 and math.isfinite(t_hi) and t_hi < 0:
        return f"loses to {other}"
    if math.isfinite(t_lo) and (lo > 0 or hi < 0):
        return f"not resolved against {other} over seeds ({seeds['mean']:+.2f} [{t_lo:+.2f}, {t_hi:+.2f}])"
    return f"not resolved against {other}"


def claims(summary: dict[str, Any], cfg: Any) -> list[dict[str, str]]:
    """The ``"LLM placement"`` claims row (the keys of ``record.CLAIM_KEYS``), from the summary's readings.

    Args:
        summary: the experiment's summary (``readings``, ``design``).
        cfg: the :class:`~depthsat_theory.experiments.placement.PlacementConfig` run.

    Returns:
        One row ``{"claim", "setting", "verdict", "qualifier", "interval", "reason"}``.
    """
    r = summary["readings"]
    rho, rel = r["rho"]["criterion"], r["reliability"]
    seeds = r["seeds"]
    n_seeds = f"{seeds} seed" + "s" * (seeds != 1)
    setting = (
        f"{summary['model_short']}, one zero-output copy at each of {summary['positions']} positions trained "
        f"alone {cfg.steps} steps of {cfg.batch_size}x{cfg.max_tokens} tokens (old layers frozen), "
        f"probe {cfg.probe_windows} x {cfg.probe_tokens} and held-out {cfg.heldout_windows} x "
        f"{cfg.heldout_tokens} KJV tokens (windows disjoint, across the text, a new draw per seed), {n_seeds}"
    )
    vs = [beats_text(r["difference"][o], o.replace("_", " ")) for o in ("block_influence", "depth")]
    over = summarize(rho["per_seed"]) if len(rho.get("per_seed", [])) >= 2 else None
    # a rank correlation lies in [-1, 1]: the t-interval is shown cut to that range
    cut = (max(over["ci_low"], -1.0), min(over["ci_high"], 1.0)) if over else None
    rho_seeds = f"; Student-t over seeds [{cut[0]:+.2f}, {cut[1]:+.2f}]" if cut else ""
    interval = (
        f"Spearman rho(criterion s_U/AG_rms, held-out gain) = {rho['pooled']:+.2f} [{rho['low']:+.2f}, "
        f"{rho['high']:+.2f}] (mean over {n_seeds}, 95 % bootstrap over held-out windows{rho_seeds}); gain split-half "
        f"reliability {rel['pooled']:+.2f} [{rel['low']:+.2f}, {rel['high']:+.2f}]"
    )
    verdict = r["verdict"]
    n_imp = sum(summary["criterion_improvable"].values())
    if verdict == "untestable here" and rel["low"] > 0:
        reason = (
            f"one probe only (the run was cut to {seeds} seed): the gain ranking is resolved (reliability lower end "
            f"{rel['low']:+.2f}) and rho's held-out interval is {rho['low']:+.2f} to {rho['high']:+.2f}, but that "
            "interval holds no probe noise" + (", and no copy's noise test rejects s = 0" if n_imp == 0 else "")
        )
    elif verdict == "untestable here":
        reason = (
            f"the gain ranking is not resolved: its split-half reliability interval reaches {rel['low']:+.2f} <= 0, "
            f"so no score can be checked against it at {cfg.steps} steps and {cfg.heldout_windows} held-out windows"
        )
    elif verdict == "holds":
        reason = f"the gain ranking is resolved and the criterion's pooled rho interval is above 0 ({rho['low']:+.2f})"
    else:
        reason = (
            f"the gain ranking is resolved (reliability lower end {rel['low']:+.2f} > 0) but the criterion's pooled "
            f"rho interval reaches {rho['low']:+.2f} <= 0"
        )
    n_sites = summary["positions"] * seeds
    chance = "" if n_imp else f"; the criterion is at its chance level ({n_imp}/{n_sites} copies improvable)"
    part = r["partial_given_depth"]
    partial = f"; partial rho given depth {part['pooled']:+.2f} [{part['low']:+.2f}, {part['high']:+.2f}]"
    one = "; one seed: the interval holds no probe noise" if seeds == 1 else ""
    qualifier = f"short horizon ({cfg.steps} steps); " + ", ".join(vs) + partial + chance + one
    return [
        {
            "claim": "LLM placement",
            "setting": setting,
            "verdict": verdict,
            "qualifier": qualifier,
            "interval": interval,
            "reason": reason,
        }
    ]


def figure(rows: list[dict[str, Any]], cfg: Any) -> Any:
    """Held-out gain by position with the criterion and block influence, one line per seed.

    Args:
        rows: ``positions`` table rows (``seed``, ``position``, ``gain``, ``criterion``, ``criterion_low``,
            ``criterion_high``, ``plugin``, ``chance``, ``block_influence``; the intervals stay in the table).
        cfg: the configuration run.

    Returns:
        A matplotlib Figure (three panels sharing the position axis).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    seeds = sorted({r["seed"] for r in rows})
    for i, s in enumerate(seeds):
        mine = sorted((r for r in rows if r["seed"] == s), key=lambda r: r["position"])
        x = [r["position"] for r in mine]
        c = f"C{i}"
        axes[0].plot(x, [r["gain"] for r in mine], "o-", color=c, ms=3, label=f"seed {s}")
        axes[1].plot(x, [r["criterion"] for r in mine], "o-", color=c, ms=3)
        axes[1].plot(x, [r["plugin"] for r in mine], "--", color=c, lw=1)
        axes[1].plot(x, [r["chance"] for r in mine], ":", color=c, lw=1)
        axes[2].plot(x, [r["block_influence"] for r in mine], "o-", color=c, ms=3)
    axes[0].set_ylabel("held-out gain\n(nats/token)")
    axes[0].set_title(f"one zero-output copy after layer p, trained {cfg.steps} steps (old layers frozen)")
    axes[0].axhline(0, color="0.6", lw=0.8)
    axes[0].legend(fontsize=8)
    axes[1].set_ylabel("criterion s_U/AG_rms (dots)\nplug-in (dashed), its chance (dotted)")
    axes[2].set_ylabel("block influence\n1 - cos(h_in, h_out)")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("position p (copy of layer p inserted after it)")
    fig.tight_layout()
    return fig
