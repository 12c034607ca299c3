"""The headline at the output level, and what an undetermined site says to do next.

- Pure noise: ``diagnose()`` on a model whose activation gradient is independent of the features by
  construction reads the headline ``s_U`` at 0 inside its interval, while the plug-in ``ŝ/AG_rms`` reads its
  chance level ``sqrt(k̃/n)`` (theory/decision.md, ``prop-plugin-chance-level``): in the API, the JSON, the table.
- Every cause of an undetermined verdict gets a ``to decide:`` line naming the command (``next_step``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from depthsat_theory.diagnose import diagnose
from depthsat_theory.diagnose.nextstep import next_step
from depthsat_theory.statistics import SaturationResult
from depthsat_theory.vocabulary import Verdict


class _Identity(nn.Module):
    """``model(x) = x`` through a named site: the site tensor ``z`` is the input itself."""

    def __init__(self) -> None:
        super().__init__()
        self.site = nn.Identity()

    def forward(self, x):
        return self.site(x)


def _inner_loss(out, t):
    """``ℓ(x) = ⟨t, z⟩``: the activation gradient at the site is ``g = t``, whatever ``z`` is."""
    return (out * t).sum(-1)


_G_LAWS = {
    "rademacher": lambda gen, shape: torch.randint(0, 2, shape, generator=gen, dtype=torch.float64) * 2 - 1,
    "gaussian": lambda gen, shape: torch.randn(shape, generator=gen, dtype=torch.float64),
    "centred exponential": lambda gen, shape: -torch.log(torch.rand(shape, generator=gen, dtype=torch.float64)) - 1,
}
_Z_LAWS = {
    "gaussian": lambda gen, shape: torch.randn(shape, generator=gen, dtype=torch.float64),
    "uniform ≥ 0": lambda gen, shape: torch.rand(shape, generator=gen, dtype=torch.float64),
}

D, N, BATCH, REPEATS = 6, 192, 64, 12
K_TILDE = D + 1  # the linear family's features (z, 1): rank Σ = d + 1 for these continuous laws


def _noise_probe(g_law: str, z_law: str, seed: int) -> list[tuple]:
    gen = torch.Generator().manual_seed(seed)
    z = _Z_LAWS[z_law](gen, (N, D))
    t = _G_LAWS[g_law](gen, (N, D))  # drawn independently of z: E[g φ̃ᵀ] = E[g] E[φ̃]ᵀ = 0, so s = 0
    return [(z[i : i + BATCH], t[i : i + BATCH]) for i in range(0, N, BATCH)]


@pytest.mark.parametrize("z_law", list(_Z_LAWS))
@pytest.mark.parametrize("g_law", list(_G_LAWS))
def test_pure_noise_reads_zero_headline_and_chance_level_plugin(g_law, z_law):
    model = _Identity()
    heads, plug2, u2, covers = [], [], [], []
    for seed in range(REPEATS):
        d = diagnose(model, _inner_loss, _noise_probe(g_law, z_law, seed), sites=["site"], family="linear")
        sd = d.sites[0]
        h = sd.headline
        assert h is not None and sd.result.tangent_rank == D * K_TILDE and d.n == N
        assert 0.0 <= h.low <= h.score <= h.high
        covers.append(h.low == 0.0)  # the interval of s contains the population value 0
        # the JSON leads with the same headline, the table's first score columns show it
        js = sd.to_dict()
        assert list(js)[:5] == ["site", "depth", "layout", "shape", "headline"]
        assert js["headline"]["score"] == h.score and js["headline"]["relative_plugin"] == h.relative_plugin
        cols = d.columns()
        row = d._row(sd, cols)
        assert cols.index("s_U/AG_rms") < cols.index("plug-in ŝ/AG_rms")
        assert row[cols.index("s_U/AG_rms")] == f"{h.relative_score:.3g}"
        heads.append(sd.verdict)
        plug2.append(h.relative_plugin**2)
        u2.append(sd.result.score_squared_unbiased / sd.result.ag_rms**2)
        if g_law == "rademacher":  # ‖g‖² = d exactly, so v̂ = d · mean leverage = AG_rms² k̃ exactly
            assert h.relative_chance == pytest.approx(math.sqrt(K_TILDE / N), rel=1e-9)
    chance2 = K_TILDE / N  # prop-plugin-chance-level (3): E ŝ²/A² = k̃/n on pure noise
    # the plug-in sits at its chance level: mean of REPEATS probes within 25 % (its relative sd is about 0.06)
    assert np.mean(plug2) == pytest.approx(chance2, rel=0.25)
    # the bias-corrected square is centred at 0: its mean within 4 standard errors of 0, which is far below the
    # plug-in's chance level (the plug-in's mean is more than 8 of those standard errors away from 0)
    se = np.std(u2, ddof=1) / math.sqrt(REPEATS)
    assert abs(np.mean(u2)) < 4 * se < 0.5 * chance2
    # a level-α test: at most 2 of 12 probes improvable, or with an interval above 0 (binomial P(≥ 3) ≈ 0.02)
    assert sum(v is Verdict.IMPROVABLE for v in heads) <= 2 and sum(not c for c in covers) <= 2


# ----------------------------------------------------------------------------- next step
def _bare(**kw) -> SaturationResult:
    fields = dict(
        score=1.0,
        raw_score=float("nan"),
        ag_rms=4.0,
        ag_max=3.0,
        realizability_defect=float("nan"),
        relative_score=0.25,
        activation_scaled_score=1.0,
        tangent_rank=4,
        tangent_dim=4,
        degenerate=False,
        saturated=False,
        tol=0.5,
        cutoff=0.0,
        rtol=0.0,
        n=100,
        units=100,
        family="linear",
        unit="row",
        dtype="float64",
        gradient=np.zeros(4),
        noise_threshold=3.841458820694124,
    )
    fields.update(kw)
    return SaturationResult(**fields)


def _noise(score: float, v: float, n: int = 100, **kw) -> SaturationResult:
    """A result whose noise moments are ``ŝ``, ``v̂`` on ``n`` examples (``ŝ²_U = (n ŝ² − v̂)/(n − 1)``)."""
    return _bare(
        score=score,
        n=n,
        noise_variance=v,
        noise_ratio=n * score * score / v,
        score_squared_unbiased=(n * score * score - v) / (n - 1),
        **kw,
    )


def test_next_step_of_a_probe_too_small_names_the_probe_size_and_the_command():
    # n ŝ²/v̂ = 100 · 1 / 50 = 2 ≤ 3.84; ŝ²_U = (100 − 50)/99; n = ⌈3.8414588 · 50 · 99 / 50⌉ = ⌈380.3⌉ = 381
    res = _noise(1.0, 50.0)
    assert res.verdict is Verdict.UNDETERMINED
    step = next_step(res)
    assert step.startswith("to decide: about 381 examples")
    assert "depthsat diagnose ... --max-examples 381" in step and "--until-decided --max-examples" in step
    assert "smaller family" in step


def test_next_step_without_signal_says_more_examples_only_narrow_the_bound():
    res = _noise(0.5, 50.0, tol=0.1)  # ŝ²_U = (25 − 50)/99 < 0
    step = next_step(res)
    assert "no signal" in step and "--max-examples 400" in step and "--delta" in step


def test_next_step_held_back_by_float32_products():
    # ŝ²_U = (100 · 4 − 50)/99 > 0 and the fixed-size forecast ⌈3.84 · 50 · 99/350⌉ = 55 ≤ n: size is not missing
    res = _noise(2.0, 50.0, noise_variance_upper=200.0)
    res.noise_ratio = 100 * 4 / 200  # the test ran against the float32 upper bound of v̂: 2 ≤ 3.84
    assert res.verdict is Verdict.UNDETERMINED and res.examples_needed is None
    assert "--products float64" in next_step(res)


@pytest.mark.parametrize(
    ("kw", "expect"),
    [
        (dict(kink_ties=3), ["--seed", "thm-directional"]),
        (dict(tol=math.inf, score=5.0), ["--family linear", "fewer or better-conditioned features"]),
        (dict(score=1.0, tol=3.0), ["precision", "--products float64", "fewer or better-conditioned"]),  # 2e ≥ AG
        (dict(score=0.25, tol=0.5, unresolved=2), ["2 dropped direction(s)", "--gram units"]),
        (dict(score=0.25, tol=0.5, dtype="float32", noise_ratio=9.0), ["run the model in float64", "precision"]),
        (dict(score=1.0, noise_variance=-1.0, noise_ratio=5.0), ["precision", "--products float64"]),
    ],
)
def test_next_step_names_the_command_for_each_cause(kw, expect):
    res = _bare(**kw)
    assert res.verdict is Verdict.UNDETERMINED
    step = next_step(res)
    assert step.startswith("to decide: ") and "depthsat diagnose ..." in step
    for word in expect:
        assert word in step


@pytest.mark.parametrize("kw", [dict(score=2.0), dict(score=0.25), dict(degenerate=True, tangent_rank=0)])
def test_no_next_step_for_a_decided_site(kw):
    res = _bare(**kw)
    assert res.verdict is not Verdict.UNDETERMINED and next_step(res) is None


def test_a_depth_decision_gets_its_own_column_and_key_beside_the_verdict():
    from depthsat_theory.decision import DepthDecision

    d = diagnose(_Identity(), _inner_loss, _noise_probe("gaussian", "gaussian", 0), sites=["site"], family="linear")
    sd = d.sites[0]
    assert "decision" not in d.columns() and sd.to_dict()["decision"] is None
    sd.decision = DepthDecision.TRAIN_LONGER  # what the depth decision sets (def-depth-decision)
    sd.decision_reason = "the existing last map is not stationary"
    cols = d.columns()
    assert cols[-1] == "decision" and d._row(sd, cols)[-1] == "train longer first"
    assert d._row(sd, cols)[cols.index("verdict")] == sd.verdict.value  # the verdict stays
    js = sd.to_dict()
    assert js["decision"] == "train longer first" and js["decision_reason"] == sd.decision_reason
    assert js["verdict"] == sd.verdict.value
    md = d.markdown()
    assert "| decision |" in md and "train longer first" in md


@pytest.mark.parametrize("width", [60, 80, 120])
def test_compact_table_keeps_site_and_verdict_whole_in_a_narrow_terminal(width):
    """The compact table (what the CLI prints when the whole one does not fit) keeps depth, site and verdict whole."""
    from rich.console import Console

    d = diagnose(
        _Identity(), _inner_loss, _noise_probe("gaussian", "gaussian", 1), sites=["site"], family="linear", delta=0.1
    )
    full = Console(width=100_000).measure(d.table()).maximum
    assert full > 120  # the whole table does not fit these widths: the case the compact one is for
    console = Console(width=width, record=True)
    console.print(d.table(compact=True))
    cells = [c.strip() for c in next(x for x in console.export_text().splitlines() if "│ site" in x).split("│")]
    assert cells[1:3] == ["0", "site"] and d.sites[0].verdict.value in cells
    if width >= 120:  # room for the certificate too
        assert d.sites[0].certificate.value in cells
