"""The known-depth benchmark (``depthsat experiment teacher``): its pieces against independent computations.

* the Bayes loss: ``ln C`` for a teacher whose head is zero, the closed-form entropy of dyadic
  distributions, and the mean negative log-likelihood of sampled labels (a second estimator);
* the excess loss against ``scipy.special.rel_entr`` (the KL divergence computed elsewhere);
* a student of depth ``2L*`` initialised at the teacher computes the teacher's outputs bit for bit
  (its extra blocks add an exact zero) and has zero excess loss;
* the fixed-budget cosine recipe: on a linear loss Adam moves each step by the step's learning rate,
  so the total move is the sum of the cosine schedule, computed here in closed form;
* the cross-fitted steepest step: its loss change matches ``−t·s`` to first order on the half it
  was fitted on;
* the transition reading on hand-made verdict sequences, and the claims on hand-made runs;
* the tiny configuration end to end through the CLI.
"""

from __future__ import annotations

import csv
import json
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from depthsat_theory.cli import app
from depthsat_theory.experiments import recipe as R
from depthsat_theory.experiments import teacher as T
from depthsat_theory.experiments.teacher_claims import claims

runner = CliRunner()
CFG = T.CONFIGS["tiny"]


def _rows(path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


# ----------------------------------------------------------------------------- Bayes loss
def test_bayes_loss_of_a_teacher_with_zero_head_is_log_of_the_class_count():
    teacher = T.build_teacher(CFG, 2, seed=0)
    with torch.no_grad():
        teacher.head.weight.zero_()
        teacher.head.bias.zero_()
    sample = T.draw(teacher, 64, torch.Generator().manual_seed(0), CFG.in_dim)
    assert T.bayes_loss(sample.p) == pytest.approx(math.log(CFG.n_classes), rel=1e-15)


def test_bayes_loss_is_the_entropy_of_dyadic_distributions_in_closed_form():
    # H(1/2, 1/4, 1/4) = 3/2 ln 2, H(1, 0, 0) = 0, H(1/4, 1/4, 1/2) = 3/2 ln 2: mean = ln 2
    p = torch.tensor([[0.5, 0.25, 0.25], [1.0, 0.0, 0.0], [0.25, 0.25, 0.5]], dtype=torch.float64)
    expected = float(Fraction(3, 2) + 0 + Fraction(3, 2)) / 3 * math.log(2)
    assert T.bayes_loss(p) == pytest.approx(expected, rel=1e-15)


def test_sampled_labels_follow_the_teacher_distribution():
    cfg = T.TeacherConfig(name="t", teacher_depths=(2,), seeds=(0,), in_dim=4, width=4, n_classes=3, temperature=1.0)
    teacher = T.build_teacher(cfg, 2, seed=3)
    s = T.draw(teacher, 40_000, torch.Generator().manual_seed(11), cfg.in_dim)
    # a second estimator of the Bayes loss: the sampled labels' mean negative log-likelihood
    nll = -torch.log(s.p.gather(1, s.y[:, None]).squeeze(1))
    se = float(nll.std()) / math.sqrt(len(s))
    assert abs(float(nll.mean()) - T.bayes_loss(s.p)) < 4 * se
    # label frequencies against the mean label distribution (each within 4 binomial standard errors)
    freq = torch.bincount(s.y, minlength=3).double() / len(s)
    mean_p = s.p.mean(0)
    assert torch.all((freq - mean_p).abs() < 4 * torch.sqrt(mean_p * (1 - mean_p) / len(s)))


def test_inputs_are_standard_normal_and_draws_are_reproducible():
    teacher = T.build_teacher(CFG, 1, seed=0)
    a = T.draw(teacher, 2000, torch.Generator().manual_seed(5), CFG.in_dim)
    b = T.draw(teacher, 2000, torch.Generator().manual_seed(5), CFG.in_dim)
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert abs(float(a.x.mean())) < 4 / math.sqrt(a.x.numel())
    assert abs(float(a.x.var()) - 1) < 0.1


# ----------------------------------------------------------------------------- excess loss
def test_excess_loss_is_the_kl_divergence_computed_by_scipy():
    from scipy.special import rel_entr

    teacher = T.build_teacher(CFG, 2, seed=1)
    sample = T.draw(teacher, 300, torch.Generator().manual_seed(2), CFG.in_dim)
    torch.manual_seed(9)
    student = T.ResidualMLP(CFG.in_dim, CFG.width, 1, CFG.n_classes).eval()
    with torch.no_grad():
        q = torch.softmax(student.double()(sample.x.double()), -1).numpy()
    kl = rel_entr(sample.p.numpy(), q).sum(axis=1).mean()
    res = T.excess_loss(student.float(), sample)
    assert res["excess"] == pytest.approx(kl, rel=1e-10)
    assert res["excess"] > 0
    hard = -np.log(q[np.arange(len(sample)), sample.y.numpy()]).mean()
    assert res["hard"] == pytest.approx(hard, rel=1e-10)


@pytest.mark.parametrize("lstar", [1, 3])
def test_student_initialised_at_the_teacher_computes_it_exactly_and_reaches_the_bayes_loss(lstar):
    teacher = T.build_teacher(CFG, lstar, seed=4)
    student = T.embed_teacher(teacher, 2 * lstar)
    assert len(student.blocks) == 2 * lstar
    x = torch.randn(257, CFG.in_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(student(x), teacher(x))  # the extra blocks add an exact zero
        for block in student.blocks[lstar:]:
            z = torch.randn(5, CFG.width)
            assert torch.count_nonzero(block(z) - z) == 0
    sample = T.draw(teacher, 1000, torch.Generator().manual_seed(1), CFG.in_dim)
    assert abs(T.excess_loss(student, sample)["excess"]) < 1e-12


def test_embed_teacher_refuses_a_student_too_shallow_for_the_teacher():
    with pytest.raises(ValueError, match="cannot hold a teacher of depth 3"):
        T.embed_teacher(T.build_teacher(CFG, 3, seed=0), 2)


def test_teacher_rejects_bad_depth_and_temperature():
    with pytest.raises(ValueError, match="depth must be >= 1"):
        T.build_teacher(CFG, 0, seed=0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        T.build_teacher(T.TeacherConfig(name="t", teacher_depths=(1,), seeds=(0,), temperature=0.0), 1, seed=0)


# ----------------------------------------------------------------------------- the fixed-budget recipe
def test_budget_recipe_moves_adam_by_the_sum_of_the_cosine_schedule():
    # loss = w·1 per example: the gradient is 1 at every step, so Adam's bias-corrected update is
    # lr_k · 1/(1 + eps) exactly, and w moves by the sum of the cosine schedule lr_k = lr (1 + cos(π k/T))/2
    steps, lr = 37, 0.01
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.5)
    x, y = torch.ones(10, 1), torch.zeros(10)
    res = R.train_budget(
        model, x, y, lambda out, _y: out.squeeze(1), seed=0, recipe=R.BudgetRecipe(lr=lr, batch_size=4, steps=steps)
    )
    total = sum(lr * (1 + math.cos(math.pi * k / steps)) / 2 for k in range(steps))
    assert float(model.weight.detach()) == pytest.approx(0.5 - total / (1 + 1e-8), abs=1e-6)
    assert res["steps"] == steps and res["examples_seen"] == steps * 4


def test_budget_recipe_rejects_a_zero_budget():
    with pytest.raises(ValueError, match="steps >= 1"):
        R.BudgetRecipe(steps=0)


# ----------------------------------------------------------------------------- cross-fitted steepest step
def test_crossfit_steepest_step_matches_first_order_prediction_in_sample():
    _teacher, data = T._data(CFG, 2, seed=0)
    torch.manual_seed(0)
    student = T.ResidualMLP(CFG.in_dim, CFG.width, 2, CFG.n_classes).eval()
    from depthsat_theory.experiments.sweep import site_rows

    sites = site_rows(student, T._as_splits(data, data["probe"].subset(slice(0, 128)), CFG), delta=0.05)
    cfg = T.TeacherConfig(**{**CFG.__dict__, "step_fraction": 1e-5})
    rows = T._crossfit_rows(student, data, sites, cfg)
    assert [r["site"] for r in rows] == [r["site"] for r in sites]
    for r in rows:
        # first order on the fitting half: J(θ_t) − J(0) = −t s + O(t²)
        assert r["measured_a"] == pytest.approx(r["predicted"], rel=1e-3)
        assert r["predicted"] < 0


# ----------------------------------------------------------------------------- reading the verdicts
@pytest.mark.parametrize(
    ("improvable", "expected"),
    [
        ([True, True, False, False], 3),
        ([True, False, True, False], 4),  # a later improvable student moves the transition
        ([False, False, False, False], 1),
        ([True, True, True, True], None),  # still improvable at the deepest depth
    ],
)
def test_verdict_transition_depth_on_hand_made_sequences(improvable, expected):
    assert T.verdict_transition_depth([1, 2, 3, 4], improvable) == expected


def test_verdict_transition_depth_sorts_by_depth_and_rejects_mismatched_input():
    assert T.verdict_transition_depth([4, 1, 3, 2], [False, True, False, True]) == 3
    with pytest.raises(ValueError, match="one length"):
        T.verdict_transition_depth([1, 2], [True])


def _hand_runs(excess: list[float], improvable_until: int, lstar: int = 2) -> list[dict]:
    runs = []
    for seed, jitter in enumerate((0.0, 0.001, -0.001)):
        for depth, ex in enumerate(excess, 1):
            verdict = "improvable" if depth < improvable_until else "undetermined"
            runs.append(
                {
                    "teacher_depth": lstar,
                    "depth": depth,
                    "seed": seed,
                    "test_excess": ex + jitter,
                    "train_loss": 1 + ex + jitter,
                    "probe_verdict_last": verdict,
                    "train_verdict_last": verdict,
                    "probe_n_improvable": int(verdict == "improvable"),
                    "train_n_improvable": int(verdict == "improvable"),
                    "probe_examples_needed_last": None,
                    "probe_ag_max_last": 1.0 / depth if depth <= lstar else 1.0 / lstar,
                }
            )
    return runs


@pytest.mark.parametrize(
    ("excess", "until", "verdict"),
    [
        ([0.10, 0.02, 0.02, 0.02], 2, "holds"),
        ([0.10, 0.02, 0.02, 0.02], 4, "fails"),
        ([0.02, 0.02, 0.02, 0.02], 2, "untestable here"),
    ],
)
def test_claims_on_hand_made_runs(excess, until, verdict):
    runs = _hand_runs(excess, until)
    got = claims(runs, T._curves(runs, []), T._transitions(runs), [])["L*=2"]
    assert got["transition"]["verdict"].startswith(verdict)
    if verdict == "holds":
        assert got["transition"]["probe_last_per_seed"] == [2, 2, 2]
        assert got["c1"]["probe_ag_max_last"]["verdict"] == "holds"
    if verdict == "untestable here":
        assert got["c1"]["probe_ag_max_last"]["verdict"] == "untestable here"


# ----------------------------------------------------------------------------- the tiny run, through the CLI
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("teacher") / "teacher"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = runner.invoke(app, ["experiment", "teacher", "--config", "tiny", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert res.exit_code == 0, res.output
    return out


def test_tiny_teacher_writes_tables_figure_and_provenance(tiny):
    for name in ("runs", "sites", "crossfit", "curves", "transitions"):
        assert (tiny / f"{name}.csv").is_file(), name
    assert (tiny / "teacher.png").stat().st_size > 1000
    data = json.loads((tiny / "summary.json").read_text())
    assert data["meta"]["config"]["name"] == "tiny" and data["meta"]["commit"]
    for o in data["summary"]["oracle"]:
        assert abs(o["excess"]) < 1e-12  # the teacher embedded in the deepest student
    runs = _rows(tiny / "runs.csv")
    assert len(runs) == len(CFG.seeds) * sum(len(CFG.depths(d)) for d in CFG.teacher_depths)
    for r in runs:
        assert float(r["test_excess"]) > 0
        assert float(r["test_expected"]) == pytest.approx(float(r["bayes_test"]) + float(r["test_excess"]), rel=1e-12)
    sites = _rows(tiny / "sites.csv")
    assert {r["split"] for r in sites} == {"probe", "train"}
    for r in sites:
        # ŝ²_U = (n ŝ² − v̂)/(n − 1) with n the probe size, from the recorded ŝ and v̂
        n = CFG.n_probe
        s2u = (n * float(r["s"]) ** 2 - float(r["noise_variance"])) / (n - 1)
        assert float(r["s2_unbiased"]) == pytest.approx(s2u, rel=1e-9, abs=1e-15)
        assert float(r["s"]) <= float(r["ag_rms"]) * (1 + 1e-12) <= float(r["ag_max"]) * (1 + 1e-9)


def test_tiny_teacher_resume_retrains_nothing(tmp_path):
    log = tmp_path / "done.jsonl"
    args = ["experiment", "teacher", "--config", "tiny", "--seeds", "0", "--resume", str(log)]
    first = runner.invoke(app, [*args, "--out", str(tmp_path / "a")])
    assert first.exit_code == 0, first.output
    lines = log.read_text().splitlines()
    second = runner.invoke(app, [*args, "--out", str(tmp_path / "b")])
    assert second.exit_code == 0, second.output
    assert log.read_text().splitlines() == lines  # nothing appended: every student was reused
    assert _rows(tmp_path / "a" / "runs.csv") == _rows(tmp_path / "b" / "runs.csv")
    # --recorded-only trains nothing: seed 1 is not in the file, so it is left out and listed
    third = runner.invoke(
        app,
        [*args[:4], "--seeds", "0,1", "--resume", str(log), "--recorded-only", "--out", str(tmp_path / "c")],
    )
    assert third.exit_code == 0, third.output
    assert log.read_text().splitlines() == lines
    assert _rows(tmp_path / "c" / "runs.csv") == _rows(tmp_path / "a" / "runs.csv")
    left = json.loads((tmp_path / "c" / "summary.json").read_text())["summary"]["left_out"]
    assert left == [{"teacher_depth": 1, "seed": 1, "missing_depths": [1, 2]}]


def test_teacher_bad_input_is_one_line_error(tmp_path):
    res = runner.invoke(app, ["experiment", "teacher", "--config", "huge", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "choose one of" in res.output
    (tmp_path / "notes.txt").write_text("hello\n")
    res = runner.invoke(
        app,
        [
            "experiment",
            "teacher",
            "--config",
            "tiny",
            "--resume",
            str(tmp_path / "notes.txt"),
            "--out",
            str(tmp_path / "y"),
        ],
    )
    assert res.exit_code == 2 and "not a finished-student record" in res.output


def test_probe_size_changes_the_probe_not_the_students(tiny, tmp_path):
    out = tmp_path / "big"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the `tiny` fixture trained: bitwise equality needs the same thread count
    try:
        argv = ["experiment", "teacher", "--config", "tiny", "--probe-size", "512", "--out", str(out)]
        res = runner.invoke(app, argv)
    finally:
        torch.set_num_threads(threads)
    assert res.exit_code == 0, res.output
    a, b = _rows(tiny / "runs.csv"), _rows(out / "runs.csv")
    for ra, rb in zip(a, b, strict=True):  # the same students: bit-identical test and training losses
        assert (ra["test_excess"], ra["train_loss"]) == (rb["test_excess"], rb["train_loss"])
    assert json.loads((out / "summary.json").read_text())["meta"]["config"]["n_probe"] == 512
    bad = runner.invoke(
        app, ["experiment", "teacher", "--config", "tiny", "--probe-size", "2", "--out", str(tmp_path / "x")]
    )
    assert bad.exit_code == 2 and "--probe-size 2" in bad.output
