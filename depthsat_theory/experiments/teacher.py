"""A depth benchmark with a known answer: students of depth 1 … 2L* fitted to a residual teacher of depth L*.

Data are drawn i.i.d. from a residual *teacher*: a :class:`~depthsat_theory.tasks.models.ResidualMLP`
of ``L*`` blocks (the students' own block type, input size and width), inputs ``x ~ N(0, I)``, labels
``y ~ softmax(f*(x))`` with the teacher's logits divided by a stated temperature ``T`` (folded into its
head).  The Bayes loss is the mean entropy of the teacher's label distribution, known per input in
closed form, so each student's *excess* loss ``E_x KL(p*(·|x) ‖ q(·|x))`` is measured without label
noise on a fresh test sample.  A student of depth ``≥ L*`` can represent the teacher exactly (the
teacher plus zero-output blocks, :func:`embed_teacher`); whether shallower students fall short is
measured, not assumed (the "depth pays up to L*" precondition, reported per seed).

Each student is trained with one fixed recipe (:class:`~depthsat_theory.experiments.recipe.BudgetRecipe`:
Adam, a cosine schedule, the same number of steps at every depth), then

* **diagnosed** (:func:`~depthsat_theory.experiments.sweep.site_rows`, family ``linear``) on a
  held-out probe drawn from the teacher and, for C1's training-split reading, on as many training
  examples: per site ``s``, ``s/AG_rms``, ``s·z_rms``, ``AG_max``, ``AG_rms``, the bias-corrected
  ``ŝ²_U = (n ŝ² − v̂)/(n − 1)``, the noise-test verdict and ``examples_needed``;
* **probed by cross-fitted insertion** (C3): at every site the steepest zero-output block step of
  size ``t = step_fraction · z_rms`` is fitted on one half of the probe and its loss change measured
  on that half (in-sample), on the other half and on the test sample (held out).

:func:`run_teacher` writes ``runs.csv``, ``sites.csv``, ``crossfit.csv``, ``curves.csv``,
``transitions.csv``, ``summary.json`` (the claims read off these) and a figure.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from depthsat_theory.experiments import recipe as R
from depthsat_theory.experiments.record import (
    ExperimentError,
    ResumeFile,
    config_tag,
    default_folder,
    metric_curves,
    provenance,
    summarize,
    write_results,
)
from depthsat_theory.experiments.teacher_claims import claims
from depthsat_theory.tasks.models import ResidualMLP, classification_loss

__all__ = [
    "CONFIGS",
    "PAPER_AG_THRESHOLD",
    "TeacherConfig",
    "TeacherSample",
    "bayes_loss",
    "build_teacher",
    "draw",
    "embed_teacher",
    "excess_loss",
    "label_distribution",
    "run_teacher",
    "site_summary",
    "verdict_transition_depth",
]

#: The paper's "low-signal" level of ``AG_max`` (its activation gradient of the batch-mean loss).
PAPER_AG_THRESHOLD = 5e-3


@dataclass(frozen=True)
class TeacherConfig:
    """A size of the known-depth benchmark.

    Attributes:
        name: ``"tiny"`` or ``"full"``.
        teacher_depths: the teachers' depths ``L*`` (students of depth ``1 … 2L*`` each).
        seeds: seeds; each seed draws its own teacher, data and student initialisations.
        in_dim, width, n_classes: input size, stream width (hidden ``2·width``) and classes, shared
            by teacher and students.
        block_gain: the teacher's residual output layers (``W2`` weight and bias) are multiplied by it
            after PyTorch's default initialisation, so that each teacher block changes the stream.
        temperature: ``T``; the teacher's label distribution is ``softmax(logits / T)``.
        n_train, n_probe, n_test: fresh examples for training, the held-out probe and the test.
        budget: the training recipe (fixed steps, cosine schedule).
        delta: ``δ`` of the score intervals (union-bounded over each model's sites).
        step_fraction: the steepest insertion step's size as a fraction of the site's ``z_rms``.
        probe_batch: batch size of the diagnosis.
        block_family: the students' own block type as a residual family (pre-LN GELU MLP of hidden
            width ``2·width``, random feature weights), diagnosed and cross-fitted next to ``linear``.
    """

    name: str
    teacher_depths: tuple[int, ...]
    seeds: tuple[int, ...]
    in_dim: int = 8
    width: int = 8
    n_classes: int = 8
    block_gain: float = 4.0
    temperature: float = 0.1
    n_train: int = 131072
    n_probe: int = 4096
    n_test: int = 32768
    budget: R.BudgetRecipe = dataclasses.field(default_factory=lambda: R.BudgetRecipe(steps=6000))
    delta: float = 0.05
    step_fraction: float = 0.01
    probe_batch: int = 1024
    block_family: str = "preln:16"

    def depths(self, teacher_depth: int) -> tuple[int, ...]:
        """The students' depths for a teacher of depth ``L*``: ``1 … 2L*``."""
        return tuple(range(1, 2 * teacher_depth + 1))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary.

        Returns:
            Every field (the budget expanded), with the label rule and the block type spelled out.
        """
        d = dataclasses.asdict(self)
        d["budget"] = self.budget.to_dict()
        d["teacher"] = (
            "ResidualMLP(in_dim, width, L*, n_classes), PyTorch default init from seed 1000*L* + seed, "
            "W2 of every block times block_gain, head divided by temperature; x ~ N(0, I); y ~ softmax(logits)"
        )
        d["families"] = ["linear", self.block_family]
        return d


CONFIGS: dict[str, TeacherConfig] = {
    "tiny": TeacherConfig(
        name="tiny",
        teacher_depths=(1,),
        seeds=(0, 1),
        in_dim=4,
        width=4,
        n_classes=3,
        n_train=2048,
        n_probe=256,
        n_test=1024,
        budget=R.BudgetRecipe(steps=60, batch_size=64),
        probe_batch=256,
        block_family="preln:8",
    ),
    "full": TeacherConfig(name="full", teacher_depths=(2, 4), seeds=(0, 1, 2)),
}


# ----------------------------------------------------------------------------
# Teacher, data, Bayes loss
# ----------------------------------------------------------------------------


@dataclass
class TeacherSample:
    """Examples drawn from a teacher.

    Attributes:
        x: float32 inputs ``(n, in_dim)``, i.i.d. ``N(0, I)``.
        y: long labels ``(n,)`` drawn from ``p``.
        p: float64 ``(n, n_classes)``: the teacher's label distribution at each input.
    """

    x: Tensor
    y: Tensor
    p: Tensor

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def subset(self, idx: Tensor | slice) -> TeacherSample:
        """The examples at ``idx``.

        Args:
            idx: indices or a slice.

        Returns:
            A :class:`TeacherSample` of those rows.
        """
        return TeacherSample(self.x[idx], self.y[idx], self.p[idx])


def _out_layer(block: nn.Module) -> nn.Linear:
    """A residual block's output layer ``W2`` (zero output when it is zero)."""
    layer = block.W2
    assert isinstance(layer, nn.Linear)
    return layer


def build_teacher(cfg: TeacherConfig, depth: int, seed: int) -> ResidualMLP:
    """The teacher of depth ``L*`` for ``seed``: a scaled :class:`ResidualMLP` (float32, eval mode).

    Args:
        cfg: the configuration (sizes, ``block_gain``, ``temperature``).
        depth: ``L* >= 1`` residual blocks.
        seed: the seed (the initialisation uses ``1000·L* + seed``; the global RNG is untouched).

    Returns:
        The teacher; its logits are already divided by ``T``.

    Raises:
        ValueError: ``depth < 1`` or a non-positive temperature.
    """
    if depth < 1:
        raise ValueError(f"teacher depth must be >= 1 block, got {depth}")
    if not cfg.temperature > 0:
        raise ValueError(f"temperature must be > 0, got {cfg.temperature}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1000 * int(depth) + int(seed))
        teacher = ResidualMLP(cfg.in_dim, cfg.width, depth, cfg.n_classes)
    with torch.no_grad():
        for layer in map(_out_layer, teacher.blocks):
            layer.weight.mul_(cfg.block_gain)
            layer.bias.mul_(cfg.block_gain)
        teacher.head.weight.div_(cfg.temperature)
        teacher.head.bias.div_(cfg.temperature)
    return teacher.eval()


@torch.no_grad()
def label_distribution(teacher: nn.Module, x: Tensor) -> Tensor:
    """``p*(·|x) = softmax(f*(x))`` in float64 (the teacher run in float64).

    Args:
        teacher: the teacher (any dtype; a float64 copy is run).
        x: inputs ``(n, in_dim)``.

    Returns:
        float64 ``(n, n_classes)`` rows summing to 1.
    """
    t64 = copy.deepcopy(teacher).double().eval()
    return torch.softmax(t64(x.double()), dim=-1)


def draw(teacher: nn.Module, n: int, generator: torch.Generator, in_dim: int) -> TeacherSample:
    """``n`` fresh examples from the teacher: ``x ~ N(0, I)``, ``y ~ p*(·|x)``.

    Args:
        teacher: the teacher.
        n: examples.
        generator: the source of randomness (inputs, then labels).
        in_dim: input size.

    Returns:
        A :class:`TeacherSample`.
    """
    x = torch.randn(n, in_dim, generator=generator)
    p = label_distribution(teacher, x)
    y = torch.multinomial(p, 1, generator=generator).squeeze(1)
    return TeacherSample(x, y, p)


def bayes_loss(p: Tensor) -> float:
    """The Bayes cross-entropy of labels drawn from ``p``: the mean entropy ``E_x H(p(·|x))`` in nats.

    Args:
        p: float64 ``(n, C)`` label distributions (zeros allowed).

    Returns:
        ``mean_i −Σ_c p_ic log p_ic`` (nats per example).
    """
    logp = torch.where(p > 0, p.log(), torch.zeros_like(p))
    return float(-(p * logp).sum(dim=1).mean())


@torch.no_grad()
def excess_loss(model: nn.Module, sample: TeacherSample, batch_size: int = 8192) -> dict[str, float]:
    """A model's expected cross-entropy against the teacher's labels, and its excess over Bayes.

    Args:
        model: the student (a float64 copy is run).
        sample: inputs with their label distributions ``p``.
        batch_size: evaluation batch size (no effect on the numbers).

    Returns:
        ``{"expected": E_x −Σ p log q, "bayes": E_x H(p), "excess": their difference = E_x KL(p‖q) ≥ 0,
        "hard": the mean cross-entropy on the sampled labels}`` in nats per example.
    """
    m64 = copy.deepcopy(model).double().eval()
    expected, hard = 0.0, 0.0
    for i in range(0, len(sample), batch_size):
        logq = torch.log_softmax(m64(sample.x[i : i + batch_size].double()), dim=-1)
        p = sample.p[i : i + batch_size]
        expected += float(-(p * logq).sum())
        hard += float(-logq.gather(1, sample.y[i : i + batch_size, None]).sum())
    n = len(sample)
    bayes = bayes_loss(sample.p)
    return {"expected": expected / n, "bayes": bayes, "excess": expected / n - bayes, "hard": hard / n}


def embed_teacher(teacher: ResidualMLP, depth: int) -> ResidualMLP:
    """The student of depth ``depth >= L*`` that computes the teacher: its blocks, then zero-output blocks.

    The extra blocks have ``W2 = 0`` (weight and bias), so they add exactly zero to the stream.

    Args:
        teacher: the teacher (``L*`` blocks).
        depth: the student's depth, at least ``L*``.

    Returns:
        A new :class:`ResidualMLP` with the teacher's weights and ``depth − L*`` zero-output blocks.

    Raises:
        ValueError: ``depth < L*``.
    """
    lstar = len(teacher.blocks)
    if depth < lstar:
        raise ValueError(f"a student of depth {depth} cannot hold a teacher of depth {lstar}")
    d, k = teacher.embed.in_features, teacher.head.out_features
    student = ResidualMLP(d, teacher.embed.out_features, depth, k)
    own = student.state_dict()
    own.update({n: v for n, v in teacher.state_dict().items() if n in own})
    student.load_state_dict(own)
    with torch.no_grad():
        for layer in map(_out_layer, student.blocks[lstar:]):
            layer.weight.zero_()
            layer.bias.zero_()
    return student.eval()


# ----------------------------------------------------------------------------
# Reading the verdicts
# ----------------------------------------------------------------------------


def verdict_transition_depth(depths: Sequence[int], improvable: Sequence[bool]) -> int | None:
    """The smallest depth from which no deeper model is called improvable.

    Args:
        depths: the students' depths.
        improvable: whether the criterion called each student improvable (at the site read).

    Returns:
        The transition depth (the first depth when no student is improvable); ``None`` when the
        deepest student is still improvable (no transition within the depths run).

    Raises:
        ValueError: empty or mismatched input.
    """
    if not depths or len(depths) != len(improvable):
        raise ValueError(
            f"depths and improvable must be non-empty and of one length, got {len(depths)}, {len(improvable)}"
        )
    pairs = sorted(zip(depths, improvable, strict=True))
    if pairs[-1][1]:
        return None
    first = pairs[-1][0]
    for d, imp in reversed(pairs):
        if imp:
            break
        first = d
    return int(first)


# ----------------------------------------------------------------------------
# One student
# ----------------------------------------------------------------------------


def _generators(seed: int, lstar: int) -> dict[str, torch.Generator]:
    base = 7_919 * int(seed) + 104_729 * int(lstar)
    return {k: torch.Generator().manual_seed(base + i) for i, k in enumerate(("train", "probe", "test"))}


def _data(cfg: TeacherConfig, lstar: int, seed: int) -> tuple[ResidualMLP, dict[str, TeacherSample]]:
    teacher = build_teacher(cfg, lstar, seed)
    gens = _generators(seed, lstar)
    sizes = {"train": cfg.n_train, "probe": cfg.n_probe, "test": cfg.n_test}
    return teacher, {k: draw(teacher, sizes[k], gens[k], cfg.in_dim) for k in sizes}


def _as_splits(data: dict[str, TeacherSample], probe: TeacherSample, cfg: TeacherConfig) -> R.Splits:
    def split(s: TeacherSample) -> R.Split:
        return R.Split(s.x, s.y)

    return R.Splits(
        name="teacher",
        seed=0,
        train=split(data["train"]),
        val=split(probe.subset(slice(0, 0))),
        probe=split(probe),
        test=split(data["test"]),
        n_classes=cfg.n_classes,
        image_shape=None,
        kind="vector",
        loss_units="nats per example",
        source="residual teacher",
    )


def _crossfit_rows(
    model: nn.Module,
    data: dict[str, TeacherSample],
    sites: list[dict[str, Any]],
    cfg: TeacherConfig,
    family: str = "linear",
) -> list[dict[str, Any]]:
    """C3 cross-fitted: per site, the steepest step fitted on probe half A, measured on A, B and the test."""
    from depthsat_theory.experiments.sweep import crossfit_rows

    half = len(data["probe"]) // 2

    def batches(s: TeacherSample) -> list[tuple[Tensor, Tensor]]:
        x = s.x.double()
        return [(x[i : i + cfg.probe_batch], s.y[i : i + cfg.probe_batch]) for i in range(0, len(s), cfg.probe_batch)]

    parts = {
        "a": batches(data["probe"].subset(slice(0, half))),
        "b": batches(data["probe"].subset(slice(half, 2 * half))),
        "test": batches(data["test"]),
    }
    return crossfit_rows(
        model, parts, sites, loss_fn=classification_loss, step_fraction=cfg.step_fraction, family=family
    )


def site_summary(sites: list[dict[str, Any]], tag: str, batch: int) -> dict[str, Any]:
    """Per-model columns of one diagnosis: the all-site maxima and the deepest site's readings.

    Args:
        sites: :func:`~depthsat_theory.experiments.sweep.site_rows` rows of one model.
        tag: the columns' prefix (e.g. ``probe``, ``train``, ``probe_block``).
        batch: the training batch size ``B``: the batch-mean convention divides a per-example
            activation-gradient norm by ``B`` (the paper's ``5·10⁻³`` is in that convention).

    Returns:
        ``{tag}_ag_max`` (all sites), ``{tag}_ag_max_last`` (deepest), their ``_batchmean`` forms,
        ``AG_rms``, ``AG_max·z_rms``, ``s``, ``s·z_rms``, ``s/AG_rms``, ``ŝ²_U``, the headline
        ``s_U``, ``s_U/AG_rms`` and the plug-in's chance level ``/AG_rms`` (``nan`` when absent), the
        noise verdict, ``examples_needed`` and the number of improvable sites.
    """
    last = max(sites, key=lambda r: r["site_index"])
    z = last["z_rms"] if math.isfinite(last["z_rms"]) else math.nan
    return {
        f"{tag}_ag_max": max(r["ag_max"] for r in sites),
        f"{tag}_ag_max_last": last["ag_max"],
        f"{tag}_ag_max_last_batchmean": last["ag_max"] / batch,
        f"{tag}_ag_max_batchmean": max(r["ag_max"] for r in sites) / batch,
        f"{tag}_ag_rms_last": last["ag_rms"],
        f"{tag}_ag_max_last_z": last["ag_max"] * z,
        f"{tag}_ag_rms_last_z": last["ag_rms"] * z,
        f"{tag}_s_last": last["s"],
        f"{tag}_s_z_last": last["s"] * z,
        f"{tag}_rel_last": last["s_over_ag_rms"],
        f"{tag}_s2u_last": last["s2_unbiased"],
        f"{tag}_s_u_last": last.get("s_u", math.nan),
        f"{tag}_rel_u_last": last.get("rel_u", math.nan),
        f"{tag}_rel_chance_last": last.get("rel_chance", math.nan),
        f"{tag}_z_rms_last": z,
        f"{tag}_noise_ratio_last": last["noise_ratio"],
        f"{tag}_verdict_last": last["noise_verdict"],
        f"{tag}_examples_needed_last": last["examples_needed"],
        f"{tag}_n_improvable": sum(r["noise_verdict"] == "improvable" for r in sites),
        f"{tag}_n_sites": len(sites),
    }


def _one_student(cfg: TeacherConfig, lstar: int, depth: int, seed: int, data: dict[str, TeacherSample]) -> dict:
    """Train, diagnose (probe and training split) and cross-fit one student."""
    from depthsat_theory.experiments.sweep import site_rows

    t0 = time.time()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(50_000 + 97 * int(seed) + int(depth))
        student = ResidualMLP(cfg.in_dim, cfg.width, depth, cfg.n_classes)
    fit = R.train_budget(
        student, data["train"].x, data["train"].y, classification_loss, seed=seed + 1, recipe=cfg.budget
    )
    train_sub = data["train"].subset(slice(0, cfg.n_probe))
    diag: dict[str, list[dict[str, Any]]] = {}
    cross = []
    for fam, suffix in (("linear", ""), (cfg.block_family, "_block")):
        for split, probe in (("probe", data["probe"]), ("train", train_sub)):
            splits = _as_splits(data, probe, cfg)
            rows = site_rows(student, splits, delta=cfg.delta, probe_batch=cfg.probe_batch, family=fam)
            diag[split + suffix] = [{"split": split, "family": fam, **r} for r in rows]
        cross += _crossfit_rows(student, data, diag["probe" + suffix], cfg, fam)
    test, train = excess_loss(student, data["test"]), excess_loss(student, data["train"])
    key = {"teacher_depth": lstar, "depth": depth, "seed": seed}
    run = {
        **key,
        "train_loss": train["hard"],
        "train_excess": train["excess"],
        "test_loss": test["hard"],
        "test_expected": test["expected"],
        "test_excess": test["excess"],
        "bayes_test": test["bayes"],
        "final_running_loss": fit["final_running_loss"],
        "train_wall_s": round(fit["wall_s"], 2),
        **{k: v for tag, rows in diag.items() for k, v in site_summary(rows, tag, cfg.budget.batch_size).items()},
        "model_wall_s": round(time.time() - t0, 2),
    }
    return {
        "runs": [run],
        "sites": [{**key, **r} for rows in diag.values() for r in rows],
        "crossfit": [{**key, **r} for r in cross],
    }


# ----------------------------------------------------------------------------
# Resume file
# ----------------------------------------------------------------------------


class _Resume(ResumeFile):
    """Finished students, keyed by the configuration's hash (minus name, seeds and teacher depths)."""

    def __init__(self, path: str | Path | None, cfg: TeacherConfig):
        super().__init__(path, "finished-student")
        self.tag = config_tag(cfg.to_dict(), ("name", "seeds", "teacher_depths"))

    def key(self, lstar: int, depth: int, seed: int) -> str:
        return f"{self.tag}/{lstar}/{depth}/{seed}"


# ----------------------------------------------------------------------------
# Aggregation
# ----------------------------------------------------------------------------

#: per-model metrics summarised over seeds in curves.csv, with whether lower is better
CURVE_METRICS: tuple[str, ...] = (
    "test_excess",
    "train_excess",
    "train_loss",
    "probe_ag_max",
    "probe_ag_max_last",
    "probe_ag_max_last_batchmean",
    "probe_ag_rms_last",
    "probe_ag_max_last_z",
    "probe_s_last",
    "probe_s_z_last",
    "probe_rel_last",
    "probe_s2u_last",
    "probe_z_rms_last",
    "probe_n_improvable",
    "train_ag_max",
    "train_ag_max_last",
    "train_ag_max_last_batchmean",
    "train_ag_rms_last",
    "train_ag_max_last_z",
    "train_s_last",
    "train_rel_last",
    "train_s2u_last",
    "probe_block_s_last",
    "probe_block_s_z_last",
    "probe_block_rel_last",
    "probe_block_s2u_last",
    "probe_block_n_improvable",
    "train_block_rel_last",
    "train_block_s2u_last",
)


def _curves(runs: list[dict[str, Any]], crossfit: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for lstar in sorted({r["teacher_depth"] for r in runs}):
        rows.extend(metric_curves([r for r in runs if r["teacher_depth"] == lstar], CURVE_METRICS, teacher_depth=lstar))
        rows.extend(_crossfit_curves(lstar, [r for r in crossfit if r["teacher_depth"] == lstar]))
    return rows


def _crossfit_curves(lstar: int, cross: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per depth, over seeds: the deepest site's predicted and measured (A, B, test) steepest-step changes."""
    rows = []
    for depth in sorted({r["depth"] for r in cross}):
        per: dict[str, list[float]] = {}
        for seed in sorted({r["seed"] for r in cross if r["depth"] == depth}):
            for fam in sorted({r["family"] for r in cross}):
                rs = [r for r in cross if r["depth"] == depth and r["seed"] == seed and r["family"] == fam]
                last = max(rs, key=lambda r: r["site_index"])
                tag = "crossfit_last" if fam == "linear" else "crossfit_block_last"
                for k in ("predicted", "measured_a", "measured_b", "measured_test"):
                    per.setdefault(f"{tag}_{k}", []).append(last[k])
                    if last["step_size"] > 0:
                        per.setdefault(f"{tag}_{k}_per_step", []).append(last[k] / last["step_size"])
        for k, vals in per.items():
            rows.append({"teacher_depth": lstar, "metric": k, "depth": depth, **summarize(vals)})
    return rows


def _transitions(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per teacher and seed: where test excess plateaus and where the verdicts stop saying improvable."""
    rows = []
    for lstar in sorted({r["teacher_depth"] for r in runs}):
        for seed in sorted({r["seed"] for r in runs if r["teacher_depth"] == lstar}):
            mine = [r for r in runs if r["teacher_depth"] == lstar and r["seed"] == seed]
            rows.append(_transition_row(lstar, seed, sorted(mine, key=lambda r: r["depth"])))
    return rows


def _transition_row(lstar: int, seed: int, mine: list[dict[str, Any]]) -> dict[str, Any]:
    from depthsat_theory.experiments.sweep import plateau_depth

    depths = [r["depth"] for r in mine]
    at = {r["depth"]: r for r in mine}
    row: dict[str, Any] = {"teacher_depth": lstar, "seed": seed, "depths": " ".join(map(str, depths))}
    row["test_excess_plateau"] = plateau_depth(depths, [r["test_excess"] for r in mine])
    row["train_loss_plateau"] = plateau_depth(depths, [r["train_loss"] for r in mine])
    for tag in [t for t in ("probe", "train", "probe_block", "train_block") if f"{t}_verdict_last" in mine[0]]:
        last = [r[f"{tag}_verdict_last"] == "improvable" for r in mine]
        row[f"{tag}_transition_last"] = verdict_transition_depth(depths, last)
        row[f"{tag}_transition_any"] = verdict_transition_depth(depths, [r[f"{tag}_n_improvable"] > 0 for r in mine])
        row[f"{tag}_verdicts_last"] = " ".join(r[f"{tag}_verdict_last"][:3] for r in mine)
        row[f"{tag}_examples_needed_last"] = " ".join(str(r.get(f"{tag}_examples_needed_last")) for r in mine)
    row["excess_at_lstar"] = at[lstar]["test_excess"] if lstar in at else None
    row["excess_at_1"] = at[depths[0]]["test_excess"]
    row["excess_deepest"] = at[depths[-1]]["test_excess"]
    return row


def _figure(curves_rows: list[dict[str, Any]], lstars: list[int]):
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.fonttype"] = "none"
    import matplotlib.pyplot as plt

    panels = [
        (("test_excess", "train_excess"), "excess loss over Bayes (nats)", True),
        (("probe_rel_last", "train_rel_last", "probe_block_rel_last"), "s / AG_rms, deepest site", False),
        (
            ("probe_ag_max_last", "probe_ag_max_last_z", "probe_s_z_last"),
            "AG_max, AG_max·z_rms, s·z_rms (deepest)",
            True,
        ),
        (
            ("crossfit_last_predicted", "crossfit_last_measured_a", "crossfit_last_measured_b"),
            "steepest step ΔJ (nats)",
            False,
        ),
    ]
    fig, axes = plt.subplots(len(panels), len(lstars), figsize=(3.2 * len(lstars) + 1, 9), squeeze=False)
    for j, lstar in enumerate(lstars):
        for i, (metrics, label, log) in enumerate(panels):
            ax = axes[i][j]
            for metric in metrics:
                pts = [c for c in curves_rows if c["teacher_depth"] == lstar and c["metric"] == metric]
                if pts:
                    ax.errorbar(
                        [c["depth"] for c in pts],
                        [c["mean"] for c in pts],
                        yerr=[0.0 if math.isnan(c["std"]) else c["std"] for c in pts],
                        marker="o",
                        ms=3,
                        capsize=2,
                        label=metric,
                    )
            ax.axvline(lstar, color="k", ls=":", lw=1)
            if log:
                ax.set_yscale("log")
            ax.set_ylabel(label, fontsize=7)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=5)
            ax.tick_params(labelsize=7)
        axes[0][j].set_title(f"teacher depth L* = {lstar}", fontsize=9)
        axes[-1][j].set_xlabel("student depth (blocks)", fontsize=8)
    fig.suptitle("Known-depth benchmark: mean ± std over seeds (dotted: L*)", fontsize=10)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------
# The experiment
# ----------------------------------------------------------------------------


def run_teacher(
    config: str | TeacherConfig = "tiny",
    *,
    out: str | Path | None = None,
    seeds: Sequence[int] | None = None,
    teacher_depths: Sequence[int] | None = None,
    resume: str | Path | None = None,
    recorded_only: bool = False,
    probe_size: int | None = None,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Run the known-depth benchmark and write its results atomically.

    Args:
        config: ``"tiny"``, ``"full"`` (``CONFIGS``) or a :class:`TeacherConfig`.
        out: the result folder (default: ``experiments/results/teacher`` for ``full``, else a new
            temporary folder).
        seeds: seeds (default: the configuration's).
        teacher_depths: teacher depths ``L*`` (default: the configuration's).
        resume: a JSON-lines file of finished students, reused and appended to.
        probe_size: the held-out probe's size (and the training-split diagnosis's) instead of the
            configuration's ``n_probe``; the students are the same (their data do not depend on it).
        recorded_only: train nothing: aggregate the teacher/seed pairs whose every depth is in
            ``resume``; the others are left out and listed in the summary (``left_out``).
        log: called with one line after each student.

    Returns:
        The result folder.

    Raises:
        ExperimentError: an unknown configuration, no or repeated seeds, a teacher depth below 1, or
            ``recorded_only`` with nothing complete in ``resume``.
    """
    started = time.time()
    cfg = _resolve(config)
    seeds = tuple(cfg.seeds if seeds is None else seeds)
    lstars = tuple(cfg.teacher_depths if teacher_depths is None else teacher_depths)
    if not seeds or len(set(seeds)) != len(seeds):
        raise ExperimentError(f"--seeds: give distinct seeds, got {list(seeds)}")
    if not lstars or min(lstars) < 1:
        raise ExperimentError(f"--teacher-depth: give depths >= 1, got {list(lstars)}")
    if probe_size is not None and probe_size < 4:
        raise ExperimentError(f"--probe-size {probe_size}: give at least 4 examples (two halves of two)")
    cfg = dataclasses.replace(cfg, seeds=seeds, teacher_depths=lstars, n_probe=probe_size or cfg.n_probe)
    done = _Resume(resume, cfg)
    runs: list[dict] = []
    sites: list[dict] = []
    cross: list[dict] = []
    oracle: list[dict] = []
    left_out: list[dict[str, Any]] = []
    for lstar in lstars:
        for seed in seeds:
            missing = [d for d in cfg.depths(lstar) if done.key(lstar, d, seed) not in done.done]
            if recorded_only and missing:
                left_out.append({"teacher_depth": lstar, "seed": seed, "missing_depths": missing})
                continue
            teacher, data = _data(cfg, lstar, seed)
            embedded = excess_loss(embed_teacher(teacher, 2 * lstar), data["test"])
            oracle.append({"teacher_depth": lstar, "seed": seed, **embedded})
            for depth in cfg.depths(lstar):
                record = _student_record(cfg, done, lstar, depth, seed, data)
                runs.extend(record["runs"])
                sites.extend(record["sites"])
                cross.extend(record["crossfit"])
                if log:
                    _log_student(log, record["runs"][0])
    if not runs:
        raise ExperimentError(f"--recorded-only: no teacher/seed has every depth in {resume}; left out {left_out}")
    curves_rows = _curves(runs, cross)
    trans = _transitions(runs)
    summary = {
        "left_out": left_out,
        "oracle": oracle,
        "claims": claims(runs, curves_rows, trans, cross),
        "transitions": trans,
    }
    folder = Path(out) if out is not None else default_folder("teacher", cfg.name)
    return write_results(
        folder,
        tables={"runs": runs, "sites": sites, "crossfit": cross, "curves": curves_rows, "transitions": trans},
        summary=summary,
        figures={"teacher": _figure(curves_rows, list(lstars))},
        meta=provenance(seeds=seeds, config=cfg.to_dict(), started=started),
    )


def _student_record(
    cfg: TeacherConfig, done: _Resume, lstar: int, depth: int, seed: int, data: dict[str, TeacherSample]
) -> dict:
    key = done.key(lstar, depth, seed)
    record = done.done.get(key)
    if record is None:
        record = _one_student(cfg, lstar, depth, seed, data)
        done.add(key, record)
    return record


def _log_student(log: Callable[[str], None], r: dict[str, Any]) -> None:
    log(
        f"L*={r['teacher_depth']} depth {r['depth']} seed {r['seed']}: excess {r['test_excess']:.4f} nats, "
        f"deepest site {r['probe_verdict_last']} (s/AG_rms {r['probe_rel_last']:.3g}), {r['model_wall_s']:.1f} s"
    )


def _resolve(config: str | TeacherConfig) -> TeacherConfig:
    if isinstance(config, TeacherConfig):
        return config
    if config not in CONFIGS:
        raise ExperimentError(f"--config {config!r}: choose one of {', '.join(CONFIGS)}")
    return CONFIGS[config]
