r"""Variable-depth against fixed-depth networks, trainability held equal (seed 003).

Seed 003 ("ResNets Are Deeper Than You Think", arXiv 2506.14386) claims that *variable-depth*
networks — residual-like networks, whose input-to-output paths pass through different numbers of
nonlinear layers — generalise better than *fixed-depth* networks, whose every path has the same
nonlinear depth, even when optimisation is controlled for.  Its abstract (all the seed holds) names a
"controlled post-training comparison"; a secondary summary (papernotes.org) describes it as a
post-training *partial linearisation* of trained networks.  Its exact protocol is not reproduced
here.  This module implements a different controlled post-training comparison in the same spirit:
distillation of one trained residual network into two students that differ only in the identity
paths, on the training split only, and a comparison on held-out data.

For each data set, depth ``D`` and seed:

1. **teacher**: a residual MLP (:func:`~depthsat_theory.experiments.recipe.build_model` ``"mlp"``:
   pre-LN GELU blocks ``h ← h + W2·gelu(W1·LN(h))``, width ``w``, hidden ``2w``) trained with the
   shared recipe (:data:`~depthsat_theory.experiments.recipe.RECIPE`, early stopping on ``val``);
2. two **students**, built from one initialisation (the same weights, ``seed + 7919``):

   * ``variable`` — the same residual MLP (the control: its effective depth varies along paths);
   * ``fixed`` — :class:`FixedDepthMLP`: the same modules and parameters with every identity path
     removed, ``h ← W2·gelu(W1·LN(h))``: every path crosses all ``D`` blocks (fixed depth);

3. each student is trained for the same fixed budget (``distill_epochs`` passes over ``train``, no
   early stopping, Adam at the recipe's learning rate and batch size, one batch order for both) to
   minimise the mean per-example ``KL(p_teacher ‖ p_student)`` on the **train split only**, with
   ``p = softmax(logits)`` (temperature 1);
4. reported per arm: the training-output match reached (train KL in nats per example, the fraction of
   train examples whose argmax agrees with the teacher's), and on the held-out ``test`` split the
   cross-entropy against the true labels (nats per example), accuracy, KL to the teacher and agreement
   with the teacher.

Trainability is held equal in two ways, both reported: (a) the same budget, initial weights and
batches; (b) **matched fit**: the two arms compared at the first epoch where each reaches the same
train KL ``τ = max(final train KL of the two arms)`` (selected on the training split, never on test).
The difference ``fixed − variable`` of each test metric is paired by seed (mean, std, 95 % Student-t
interval); 003's direction is a positive test-loss difference.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from depthsat_theory.experiments import recipe as rc
from depthsat_theory.experiments.record import (
    ExperimentError,
    default_folder,
    provenance,
    summarize,
    write_results,
)
from depthsat_theory.tasks.models import MLPBlock, ResidualMLP

__all__ = [
    "ARMS",
    "CONFIGS",
    "METRICS",
    "STUDENT_SEED_OFFSET",
    "DistillResult",
    "FixedDepthBlock",
    "FixedDepthMLP",
    "direction",
    "distill",
    "distillation_loss",
    "evaluate_student",
    "matched_fit",
    "paired_difference",
    "run_fixed_depth",
]

#: The two students, the residual control and the network without identity paths.
ARMS: tuple[str, ...] = ("variable", "fixed")
#: Per-epoch metrics of a student (``train_*`` against the teacher; ``test_loss``/``test_accuracy``
#: against the labels; ``test_kl``/``test_agreement`` against the teacher on held-out data).
METRICS: tuple[str, ...] = (
    "train_kl",
    "train_agreement",
    "test_loss",
    "test_accuracy",
    "test_kl",
    "test_agreement",
)
#: Offset of the students' initialisation seed from the teacher's (they must not start at its init).
STUDENT_SEED_OFFSET = 7919


# ----------------------------------------------------------------------------- the fixed-depth network


class FixedDepthBlock(MLPBlock):
    """:class:`~depthsat_theory.tasks.models.MLPBlock` without its identity path: ``W2(act(W1(LN(x))))``.

    Same parameters (and state-dict keys) as :class:`~depthsat_theory.tasks.models.MLPBlock`; only
    ``forward`` differs: the input is not added to the output.

    Shapes:
        input and output ``(B, width)``.
    """

    def forward(self, x: Tensor) -> Tensor:
        """``residual(x)`` only: ``(B, width)`` in, ``(B, width)`` out.

        Args:
            x: the stream ``(B, width)``.

        Returns:
            ``residual(x)``, ``(B, width)``.
        """
        return self.residual(x)


class FixedDepthMLP(ResidualMLP):
    """:class:`~depthsat_theory.tasks.models.ResidualMLP` with every identity path removed.

    ``embed`` → ``depth`` :class:`FixedDepthBlock` s → ``LayerNorm`` → ``head``: a plain feedforward
    network in which every input-to-output path crosses all ``depth`` nonlinear blocks (seed 003's
    fixed-depth network).  The parameters, their shapes and names are those of the residual MLP of
    the same arguments, so ``load_state_dict`` moves weights between the two exactly.  The residual
    stream's sites (``site_names``) are kept as names only: without identity paths, inserting a
    zero-output block after a site does **not** preserve the function.

    Args:
        in_dim: input features.
        width: stream width ``w``.
        depth: number of blocks ``D``.
        n_classes: output classes.
        activation: block activation (see :class:`~depthsat_theory.tasks.models.MLPBlock`).

    Shapes:
        input ``(B, in_dim)``, logits ``(B, n_classes)``.
    """

    def __init__(
        self, in_dim: int = 64, width: int = 64, depth: int = 4, n_classes: int = 10, activation: str = "gelu"
    ) -> None:
        super().__init__(in_dim, width, depth, n_classes, activation)
        self.blocks = nn.ModuleList(
            FixedDepthBlock(width, hidden=2 * width, activation=activation) for _ in range(depth)
        )

    @classmethod
    def like(cls, model: ResidualMLP) -> FixedDepthMLP:
        """The fixed-depth twin of a residual MLP: same architecture and a copy of its weights.

        Args:
            model: a :class:`~depthsat_theory.tasks.models.ResidualMLP` (not modified).

        Returns:
            A :class:`FixedDepthMLP` in ``model``'s dtype and mode, with its parameters copied.

        Raises:
            TypeError: ``model`` is not a ``ResidualMLP`` (or is already fixed-depth).
        """
        if not isinstance(model, ResidualMLP) or isinstance(model, FixedDepthMLP):
            raise TypeError(f"FixedDepthMLP.like needs a ResidualMLP, got {type(model).__name__}")
        act = model.blocks[0].act if len(model.blocks) else nn.GELU()
        name = {nn.GELU: "gelu", nn.ReLU: "relu", nn.Tanh: "tanh", nn.SiLU: "silu"}[type(act)]
        twin = cls(model.embed.in_features, model.embed.out_features, len(model.blocks), model.head.out_features, name)
        twin = twin.to(next(model.parameters()).dtype)
        twin.load_state_dict(model.state_dict(), strict=True)
        return twin.train(model.training)


# ----------------------------------------------------------------------------- distillation


def distillation_loss(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """Per-example ``KL(softmax(teacher) ‖ softmax(student))`` in nats.

    Args:
        student_logits: ``(B, C)`` floating logits of the student.
        teacher_logits: ``(B, C)`` logits of the teacher (the same dtype; treated as constants).

    Returns:
        ``(B,)`` non-negative divergences in nats (zero exactly when the two softmaxes agree).

    Raises:
        ValueError: the shapes differ or are not ``(B, C)``.
    """
    if student_logits.shape != teacher_logits.shape or student_logits.dim() != 2:
        raise ValueError(
            f"distillation_loss: logits must both be (B, C), got {tuple(student_logits.shape)} "
            f"and {tuple(teacher_logits.shape)}"
        )
    log_q = F.log_softmax(student_logits, dim=-1)
    log_p = F.log_softmax(teacher_logits.detach(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


@torch.no_grad()
def evaluate_student(
    model: nn.Module, splits: rc.Splits, teacher_train: Tensor, teacher_test: Tensor, batch_size: int = 1024
) -> dict[str, float]:
    """A student's match to the teacher on ``train`` and its held-out metrics on ``test``.

    Args:
        model: the student (float32; evaluated in eval mode, its mode restored).
        splits: the data (image data set).
        teacher_train: ``(n_train, C)`` teacher logits on ``splits.train``.
        teacher_test: ``(n_test, C)`` teacher logits on ``splits.test``.
        batch_size: evaluation batch size (no effect on the numbers).

    Returns:
        ``{name: value}`` for every name in :data:`METRICS`: ``train_kl``/``test_kl`` mean KL to the
        teacher in nats per example, ``train_agreement``/``test_agreement`` the fraction of examples
        whose argmax equals the teacher's, ``test_loss`` cross-entropy against the labels in nats per
        example and ``test_accuracy``.
    """
    was = model.training
    model.eval()

    def outputs(x: Tensor) -> Tensor:
        return torch.cat([model(x[i : i + batch_size]) for i in range(0, x.shape[0], batch_size)])

    s_train, s_test = outputs(splits.train.x), outputs(splits.test.x)
    model.train(was)
    y = splits.test.y
    return {
        "train_kl": float(distillation_loss(s_train, teacher_train).double().mean()),
        "train_agreement": float((s_train.argmax(-1) == teacher_train.argmax(-1)).double().mean()),
        "test_loss": float(F.cross_entropy(s_test.double(), y)),
        "test_accuracy": float((s_test.argmax(-1) == y).double().mean()),
        "test_kl": float(distillation_loss(s_test, teacher_test).double().mean()),
        "test_agreement": float((s_test.argmax(-1) == teacher_test.argmax(-1)).double().mean()),
    }


@dataclass
class DistillResult:
    """What :func:`distill` returns.

    Attributes:
        model: the student after the last epoch (eval mode).
        history: one dict per epoch, ``{"epoch", "batch_kl" (running mean of the training objective),
            **METRICS}`` measured after the epoch; epoch 0 is the initial student.
        examples_seen: training examples processed (``epochs · n_train``).
        steps: optimiser steps taken.
        wall_s: wall time in seconds.
    """

    model: nn.Module
    history: list[dict[str, float]] = field(default_factory=list)
    examples_seen: int = 0
    steps: int = 0
    wall_s: float = 0.0

    @property
    def final(self) -> dict[str, float]:
        """The metrics after the last epoch."""
        return self.history[-1]


def distill(
    student: nn.Module,
    splits: rc.Splits,
    teacher_train: Tensor,
    teacher_test: Tensor,
    *,
    epochs: int,
    seed: int,
    recipe: rc.Recipe = rc.RECIPE,
) -> DistillResult:
    """Train ``student`` to match the teacher's outputs on ``splits.train`` for a fixed budget.

    Adam at ``recipe.lr`` on the mean over a batch of :func:`distillation_loss`, batches of
    ``recipe.batch_size`` drawn without replacement each epoch in an order fixed by
    ``torch.Generator().manual_seed(seed)``; exactly ``epochs`` epochs (no early stopping, no
    checkpoint selection: the returned student is the last).  The labels are never used for training.

    Args:
        student: a float32 model for ``splits`` (trained in place).
        splits: the data (image data set).
        teacher_train: ``(n_train, C)`` teacher logits on ``splits.train`` (the targets).
        teacher_test: ``(n_test, C)`` teacher logits on ``splits.test`` (for the held-out match only).
        epochs: passes over ``train``, ``>= 1``.
        seed: seed of the batch order (the global RNG is forked).
        recipe: learning rate and batch size (default :data:`~depthsat_theory.experiments.recipe.RECIPE`).

    Returns:
        A :class:`DistillResult` whose ``history`` has ``epochs + 1`` rows.

    Raises:
        ValueError: ``epochs < 1``, teacher logits that do not match the splits, or a non-finite loss.
    """
    n = len(splits.train)
    if epochs < 1:
        raise ValueError(f"distill: epochs must be >= 1, got {epochs}")
    if teacher_train.shape[0] != n or teacher_test.shape[0] != len(splits.test):
        raise ValueError(
            f"distill: teacher logits for {teacher_train.shape[0]} train / {teacher_test.shape[0]} test examples, "
            f"splits have {n} / {len(splits.test)}"
        )
    t0 = time.perf_counter()
    opt = torch.optim.Adam(student.parameters(), lr=recipe.lr)
    gen = torch.Generator().manual_seed(int(seed))
    x = splits.train.x
    history = [{"epoch": 0, "batch_kl": math.nan, **evaluate_student(student, splits, teacher_train, teacher_test)}]
    seen = steps = 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        for epoch in range(1, epochs + 1):
            student.train()
            perm = torch.randperm(n, generator=gen)
            running = 0.0
            for i in range(0, n, recipe.batch_size):
                idx = perm[i : i + recipe.batch_size]
                loss = distillation_loss(student(x[idx]), teacher_train[idx]).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                running += float(loss.detach()) * idx.numel()
                seen += int(idx.numel())
                steps += 1
            if not math.isfinite(running):
                raise ValueError(f"distillation diverged at epoch {epoch} (non-finite loss); lower the learning rate")
            row = evaluate_student(student, splits, teacher_train, teacher_test)
            history.append({"epoch": epoch, "batch_kl": running / n, **row})
    student.eval()
    return DistillResult(student, history, seen, steps, time.perf_counter() - t0)


def matched_fit(histories: dict[str, list[dict[str, float]]]) -> tuple[float, dict[str, dict[str, float]]]:
    """Each arm at the first epoch where its train KL reaches the looser of the arms' final train KLs.

    Args:
        histories: ``{arm: history}`` as in :attr:`DistillResult.history` (epoch 0 first).

    Returns:
        ``(tau, {arm: row})``: ``tau = max over arms of the last row's train_kl`` and, per arm, the
        first history row with ``train_kl <= tau`` (it exists: the last row qualifies).  The selection
        uses the training split only.

    Raises:
        ValueError: ``histories`` is empty or holds an empty history.
    """
    if not histories or any(not h for h in histories.values()):
        raise ValueError("matched_fit: every arm needs a non-empty history")
    tau = max(h[-1]["train_kl"] for h in histories.values())
    return tau, {arm: next(r for r in h if r["train_kl"] <= tau) for arm, h in histories.items()}


def paired_difference(
    treated: Sequence[float], control: Sequence[float], *, confidence: float = 0.95
) -> dict[str, Any]:
    """Per-seed differences ``treated − control`` with their mean, std and Student-t interval.

    Args:
        treated: one value per seed (e.g. the fixed-depth student's test loss).
        control: the same seeds' values of the other arm, in the same order.
        confidence: coverage of the interval of the mean difference (paired t).

    Returns:
        ``{"per_seed": [...], "mean", "std", "n", "ci_low", "ci_high"}`` in the values' units.

    Raises:
        ExperimentError: the lengths differ, or a value is not finite.
    """
    if len(treated) != len(control):
        raise ExperimentError(f"paired difference: {len(treated)} treated values against {len(control)} controls")
    diffs = [float(t) - float(c) for t, c in zip(treated, control, strict=True)]
    return {"per_seed": diffs, **summarize(diffs, confidence=confidence)}


def direction(diff: dict[str, Any], higher_is_better: bool = False) -> str:
    """In words, which arm the interval of ``fixed − variable`` favours, or that it does not say.

    Args:
        diff: a :func:`paired_difference` result (``ci_low``, ``ci_high``) of ``fixed − variable``.
        higher_is_better: ``True`` for accuracy-like metrics (a negative difference then favours the
            variable-depth arm), ``False`` for losses.

    Returns:
        ``"variable-depth better …"`` or ``"fixed-depth better …"`` when the interval excludes 0,
        ``"undetermined …"`` when it contains 0 or is not finite (fewer than 2 seeds).
    """
    lo, hi = diff["ci_low"], diff["ci_high"]
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "undetermined (fewer than 2 seeds)"
    if higher_is_better:
        lo, hi = -hi, -lo
    if lo > 0:
        return "variable-depth better (003's direction; interval excludes 0)"
    if hi < 0:
        return "fixed-depth better (against 003; interval excludes 0)"
    return "undetermined (interval contains 0)"


# ----------------------------------------------------------------------------- configuration


def _sweep_sizes(datasets: Sequence[str]) -> dict[str, dict[str, Any]]:
    from depthsat_theory.experiments.growth import sweep_sizes

    return sweep_sizes(datasets)


#: ``tiny`` runs in CI in seconds; ``full`` is the committed configuration (experiments/README.md).
#: :meta hide-value:
CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": {
        "datasets": ["digits"],
        "width": 8,
        "depths": [2],
        "distill_epochs": 3,
        "seeds": [0, 1, 2],
        "recipe": {"max_epochs": 3, "patience": 1},
        "sizes": {"digits": {"train": 300, "val": 100, "probe": 50, "test": 200}},
    },
    "full": {
        "datasets": ["digits", "mnist5k"],
        "width": 32,
        # depth 16 is left out: there the fixed-depth student does not train at all with this recipe
        # (its train KL stays at ~1.96 nats, a constant output; experiments/README.md)
        "depths": [4, 8],
        "distill_epochs": 60,
        "seeds": [0, 1, 2, 3, 4],
        # the shared recipe as the depth sweep runs it, and its split sizes (experiments/sweep.py)
        "recipe": {},
        "sizes": _sweep_sizes(["digits", "mnist5k"]),
    },
}


def _config(name: str, seeds: Sequence[int] | None, datasets: Sequence[str] | None) -> dict[str, Any]:
    if name not in CONFIGS:
        raise ExperimentError(f"--config {name!r}: unknown; valid: {', '.join(CONFIGS)}")
    cfg = copy.deepcopy({**CONFIGS[name], "config": name})
    if seeds:
        cfg["seeds"] = [int(s) for s in seeds]
    if datasets:
        bad = [d for d in datasets if d not in rc.DATASETS or d == "kjv"]
        if bad:
            raise ExperimentError(
                f"--dataset {bad[0]!r}: fixed-depth runs on the image data sets {', '.join(rc.DATASETS[:-1])}"
            )
        cfg["datasets"] = list(datasets)
    if len(cfg["seeds"]) < 2 or len(set(cfg["seeds"])) != len(cfg["seeds"]):
        raise ExperimentError("--seeds: give at least 2 distinct seeds (a paired interval needs them)")
    if not cfg["depths"] or any(int(d) < 1 for d in cfg["depths"]) or int(cfg["distill_epochs"]) < 1:
        raise ExperimentError("depths must be >= 1 block and distill_epochs >= 1")
    return cfg


# ----------------------------------------------------------------------------- one data set, depth and seed


@torch.no_grad()
def _logits(model: nn.Module, x: Tensor) -> Tensor:
    return model.eval()(x).detach()


def _one(cfg: dict[str, Any], splits: rc.Splits, depth: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Teacher, then both students, for one data set, depth and seed: result rows and curve rows."""
    recipe = dataclasses.replace(rc.RECIPE, **cfg["recipe"])
    width, epochs = int(cfg["width"]), int(cfg["distill_epochs"])
    teacher = rc.train(rc.build_model("mlp", depth, splits, seed=seed, width=width), splits, seed=seed, recipe=recipe)
    t_train, t_test = _logits(teacher.model, splits.train.x), _logits(teacher.model, splits.test.x)
    init = rc.build_model("mlp", depth, splits, seed=seed + STUDENT_SEED_OFFSET, width=width)
    assert isinstance(init, ResidualMLP)
    students = {"variable": copy.deepcopy(init), "fixed": FixedDepthMLP.like(init)}
    results = {
        arm: distill(m, splits, t_train, t_test, epochs=epochs, seed=seed + 1, recipe=recipe)
        for arm, m in students.items()
    }
    n_params = {arm: sum(p.numel() for p in m.parameters()) for arm, m in students.items()}
    if len(set(n_params.values())) != 1 or len({r.examples_seen for r in results.values()}) != 1:
        raise ExperimentError(f"{splits.name} depth {depth} seed {seed}: the arms' parameters or budgets differ")
    tau, matched = matched_fit({arm: r.history for arm, r in results.items()})
    base = {"dataset": splits.name, "depth": depth, "seed": seed, "width": width, "n_train": len(splits.train)}
    tm = teacher.metrics
    rows = [
        {
            **base,
            "arm": "teacher",
            "n_params": sum(p.numel() for p in teacher.model.parameters()),
            "train_loss": tm["train"]["loss"],
            "test_loss": tm["test"]["loss"],
            "test_accuracy": tm["test"]["accuracy"],
            "examples_seen": teacher.examples_seen,
            "epochs": teacher.epochs,
        }
    ]
    for arm, r in results.items():
        final = {k: r.final[k] for k in METRICS}
        rows.append(
            {
                **base,
                "arm": arm,
                "n_params": n_params[arm],
                **final,
                "examples_seen": r.examples_seen,
                "epochs": epochs,
                "steps": r.steps,
                "matched_tau": tau,
                "matched_epoch": matched[arm]["epoch"],
                **{f"matched_{k}": matched[arm][k] for k in METRICS},
            }
        )
    curves = [{**base, "arm": arm, **h} for arm, r in results.items() for h in r.history]
    return rows, curves


# ----------------------------------------------------------------------------- summary and figure


def _arm_rows(sel: list[dict], arm: str) -> list[dict]:
    return sorted((r for r in sel if r["arm"] == arm), key=lambda r: r["seed"])


def _spreads(rows: list[dict], keys: Sequence[str]) -> dict[str, dict[str, float]]:
    return {k: summarize([r[k] for r in rows]) for k in keys}


def _differences(fx: list[dict], vr: list[dict], prefix: str = "") -> dict[str, dict[str, Any]]:
    return {k: paired_difference([r[prefix + k] for r in fx], [r[prefix + k] for r in vr]) for k in METRICS}


def _cell_summary(sel: list[dict]) -> dict[str, Any]:
    """Summary of one data set and depth: per-arm spreads and paired ``fixed − variable`` differences."""
    fx, vr = _arm_rows(sel, "fixed"), _arm_rows(sel, "variable")
    if [r["seed"] for r in fx] != [r["seed"] for r in vr]:
        raise ExperimentError("fixed-depth summary: the two arms ran different seeds")
    final, matched = _differences(fx, vr), _differences(fx, vr, "matched_")
    return {
        "teacher": _spreads(_arm_rows(sel, "teacher"), ("train_loss", "test_loss", "test_accuracy")),
        "arms": {"variable": _spreads(vr, METRICS), "fixed": _spreads(fx, METRICS)},
        "fixed_minus_variable": final,
        "matched_fit_fixed_minus_variable": matched,
        "matched_tau": summarize([r["matched_tau"] for r in fx]),
        "matched_epochs": {"variable": [r["matched_epoch"] for r in vr], "fixed": [r["matched_epoch"] for r in fx]},
        "verdict_test_loss": direction(final["test_loss"]),
        "verdict_test_accuracy": direction(final["test_accuracy"], higher_is_better=True),
        "verdict_matched_test_loss": direction(matched["test_loss"]),
        "n_params": fx[0]["n_params"],
        "examples_seen_per_arm": fx[0]["examples_seen"],
        "budgets_equal": [a["examples_seen"] for a in fx] == [b["examples_seen"] for b in vr],
    }


def _summary(rows: list[dict], cfg: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for ds in cfg["datasets"]:
        for depth in cfg["depths"]:
            sel = [r for r in rows if r["dataset"] == ds and r["depth"] == depth]
            if sel:
                out[f"{ds}/depth{depth}"] = _cell_summary(sel)
    return out


_COLORS = {"variable": "tab:blue", "fixed": "tab:red"}


def _panel(axes, curves: list[dict], ds: str, depth: int, seeds: Sequence[int]) -> None:
    """Train KL to the teacher (top) and test loss (bottom) per distillation epoch, one line per arm and seed."""
    for arm, col in _COLORS.items():
        for k, seed in enumerate(seeds):
            pts = [c for c in curves if (c["dataset"], c["depth"], c["arm"], c["seed"]) == (ds, depth, arm, seed)]
            pts = [c for c in pts if c["epoch"] > 0]
            label = f"{arm} student" if k == 0 else None
            ep = [c["epoch"] for c in pts]
            axes[0].plot(ep, [c["train_kl"] for c in pts], color=col, alpha=0.6, label=label)
            axes[1].plot(ep, [c["test_loss"] for c in pts], color=col, alpha=0.6, label=label)
    axes[0].set(title=f"{ds}, depth {depth}: train KL to teacher", yscale="log", ylabel="nats per example")
    axes[1].set(title="test loss (labels)", xlabel="distillation epoch", ylabel="nats per example")
    axes[0].legend()


def _figure(curves: list[dict], cfg: dict[str, Any]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = {c["dataset"] for c in curves}
    panels = [(ds, d) for ds in cfg["datasets"] for d in cfg["depths"] if ds in done]
    fig, axes = plt.subplots(2, len(panels), figsize=(4.2 * len(panels), 6.5), squeeze=False)
    for j, (ds, depth) in enumerate(panels):
        _panel([axes[0][j], axes[1][j]], curves, ds, depth, cfg["seeds"])
    fig.tight_layout()
    return fig


def run_fixed_depth(
    config: str = "full",
    *,
    out: str | Path | None = None,
    seeds: Sequence[int] | None = None,
    datasets: Sequence[str] | None = None,
    log=print,
) -> Path:
    """Run variable-depth against fixed-depth distillation and write ``experiments/results/fixed-depth/``.

    Args:
        config: ``"tiny"`` or ``"full"`` (:data:`CONFIGS`).
        out: the result folder (default :func:`~.record.default_folder`: ``experiments/results/fixed-depth``
            for ``full``, a new temporary folder otherwise).
        seeds: override the configuration's seeds (at least 2 distinct).
        datasets: override its data sets (image data sets of :data:`~.recipe.DATASETS`).
        log: called with one line per finished data set, depth and seed.

    Returns:
        The result folder: ``runs.csv`` (one row per data set, depth, seed and arm: teacher, variable,
        fixed), ``curves.csv`` (every student's metrics after every distillation epoch),
        ``summary.json`` (per arm mean ± std, paired ``fixed − variable`` differences with 95 %
        Student-t intervals, final and at matched fit), ``fixed_depth.png``/``.svg``.

    Raises:
        ExperimentError: a bad configuration, or arms whose parameter counts or budgets differ.
    """
    started = time.time()
    cfg = _config(config, seeds, datasets)
    target = Path(out) if out is not None else default_folder("fixed-depth", cfg["config"])
    if target.exists() and not target.is_dir():  # refused before training, not after (write_results checks too)
        raise ExperimentError(f"--out {target}: exists and is not a folder; name a folder")
    rows: list[dict] = []
    curves: list[dict] = []
    skipped: dict[str, str] = {}
    for ds in cfg["datasets"]:
        reason = rc.dataset_unavailable(ds)
        if reason:
            skipped[ds] = reason
            log(f"fixed-depth: skipping {ds}: {reason}")
            continue
        for seed in cfg["seeds"]:
            splits = rc.load_splits(ds, seed, rc.Sizes(**cfg["sizes"].get(ds, {})))
            for depth in cfg["depths"]:
                r, c = _one(cfg, splits, int(depth), int(seed))
                rows += r
                curves += c
                f, v = r[2], r[1]
                log(
                    f"fixed-depth {ds} depth {depth} seed {seed}: test loss variable {v['test_loss']:.4f} "
                    f"fixed {f['test_loss']:.4f}; train KL {v['train_kl']:.4f} / {f['train_kl']:.4f}"
                )
    summary = {
        "results": _summary(rows, cfg),
        "skipped": skipped,
        "recipe": dataclasses.replace(rc.RECIPE, **cfg["recipe"]).to_dict(),
        "distillation": {
            "objective": "mean per-example KL(softmax(teacher) || softmax(student)), temperature 1, train split only",
            "epochs": cfg["distill_epochs"],
            "student_init_seed": f"seed + {STUDENT_SEED_OFFSET} (one initialisation for both students)",
            "batch_order_seed": "seed + 1 (one order for both students)",
            "matched_fit": "each arm at its first epoch with train KL <= max(final train KL of the arms)",
        },
    }
    fig = _figure(curves, cfg) if rows else None
    return write_results(
        target,
        tables={"runs": rows, "curves": curves},
        summary=summary,
        figures={"fixed_depth": fig} if fig is not None else None,
        meta=provenance(seeds=cfg["seeds"], config=cfg, started=started),
    )
