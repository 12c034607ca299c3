"""``diagnose(until_decided=True)`` / ``depthsat diagnose --until-decided``: stream until decided.

The level under optional stopping is checked through the real ``diagnose`` path on a model whose activation
gradient is pure noise by construction: ``NoiseNet`` passes ``K`` independent blocks of the input through
identity sites and the per-example loss is ``Σ_k ⟨z_k, y_k⟩``, so the activation gradient at site ``k`` is
exactly ``y_k``, drawn independently of the features ``z_k`` (population score ``s = 0``).  The ``K`` sites
are independent trials; each test runs until the budget (the run stops only when every site is decided).

Measured (the slow test, 3 laws × 150 runs × 8 sites = 1200 trials per law, budget 256 examples in batches
of 32): 0/1200 improvable for each of Gaussian, Rademacher and t5 (Clopper–Pearson 95% upper bound 0.0031;
pooled 0/3600) against α = 0.05; the default test (48 trials per law) 0/48 each.  Power over seeds 7–16
(80 sites per signal): a = 0.5, forecast 320 examples, median decision 214, max 335; a = 0.3, forecast 694,
median 363, max 748: 79/80 within the forecast, 80/80 within twice it.  Power: ``y_0 = a z_0 + ε`` at coordinate 0 has
``s² = a²`` and ``v = E‖g‖²‖φ̃‖² = 5a² + 6`` (closed form for ``z ~ N(0, I₂)``, ``ε ~ N(0, I₂)``, linear
family with a bias), so the forecast is ``sequential_examples_needed(a², 5a² + 6)`` plus the first batch.
"""

from __future__ import annotations

import json
import textwrap
from statistics import median

import pytest
import torch
from scipy.stats import binom
from torch import nn
from typer.testing import CliRunner

from depthsat_theory.cli import app
from depthsat_theory.decision import sequential_examples_needed
from depthsat_theory.diagnose import CheckpointError, DiagnoseError, diagnose
from depthsat_theory.statistics.linalg import NOISE_ALPHA
from depthsat_theory.vocabulary import Verdict

K, BATCH, BUDGET = 8, 32, 256
SITES = [f"sites.{i}" for i in range(K)]
runner = CliRunner()


class NoiseNet(nn.Module):
    """``K`` identity sites on the blocks ``x[:, k]`` (``(B, K, 2)`` inputs); the output stacks them."""

    def __init__(self, k: int = K) -> None:
        super().__init__()
        self.sites = nn.ModuleList(nn.Identity() for _ in range(k))

    def forward(self, x):
        return torch.stack([s(x[:, i]) for i, s in enumerate(self.sites)], 1)


def noise_loss(out, y):
    """``Σ_k ⟨z_k, y_k⟩`` per example: the activation gradient at site ``k`` is exactly ``y_k``."""
    return (out * y).sum((1, 2))


def _t5(gen, shape):
    """Student t with 5 degrees of freedom (finite variance 5/3): ``N / sqrt(χ²₅ / 5)``."""
    normal = torch.randn(shape, generator=gen, dtype=torch.float64)
    chi2 = torch.randn((*shape, 5), generator=gen, dtype=torch.float64).pow(2).sum(-1)
    return normal / (chi2 / 5).sqrt()


LAWS = {
    "gaussian": lambda gen, shape: torch.randn(shape, generator=gen, dtype=torch.float64),
    "rademacher": lambda gen, shape: torch.randint(0, 2, shape, generator=gen).to(torch.float64) * 2 - 1,
    "t5": _t5,
}


def probe(seed: int, law: str = "gaussian", signal=0.0, n: int = BUDGET, batch: int = BATCH) -> list:
    """Batches ``(z, y)``: ``z ~ N(0, I)``, ``y`` of the law, plus ``signal[k] · z_k0`` at coordinate 0 of site k."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.as_tensor(signal, dtype=torch.float64).expand(K)
    out = []
    for _ in range(n // batch):
        z = torch.randn(batch, K, 2, generator=gen, dtype=torch.float64)
        y = LAWS[law](gen, (batch, K, 2))
        y[..., 0] += a * z[..., 0]
        out.append((z, y))
    return out


def run(batches, **kw):
    return diagnose(NoiseNet().double(), noise_loss, batches, sites=SITES, until_decided=True, kinks=False, **kw)


def _rejections(law: str, runs: int, seed0: int) -> int:
    """Sites called improvable over ``runs`` pure-noise streams of ``K`` sites each."""
    count = 0
    for r in range(runs):
        d = run(probe(seed0 + r, law))
        assert d.n == BUDGET  # pure noise: every stream runs to the budget unless all K sites decide
        count += sum(sd.verdict is Verdict.IMPROVABLE for sd in d.sites)
    return count


def _consistent_with_level(rejections: int, trials: int) -> bool:
    """Whether ``rejections`` of ``trials`` is consistent with a rate ≤ α (one-sided binomial p-value > 1e-3)."""
    return bool(binom.sf(rejections - 1, trials, NOISE_ALPHA) > 1e-3)


@pytest.mark.parametrize("law", sorted(LAWS))
def test_level_on_pure_noise(law):
    """6 runs × 8 sites per law through diagnose(until_decided=True): the rate of improvable is ≤ α."""
    runs = 6
    rejections = _rejections(law, runs, seed0={"gaussian": 0, "rademacher": 100, "t5": 200}[law])
    assert _consistent_with_level(rejections, runs * K), f"{law}: {rejections}/{runs * K}"


@pytest.mark.slow
def test_level_on_pure_noise_large():
    """150 runs × 8 sites per law (about 3 min).

    The measured counts are in the module docstring.
    """
    for law in LAWS:
        rejections = _rejections(law, 150, seed0=10_000 + 1000 * sorted(LAWS).index(law))
        assert _consistent_with_level(rejections, 150 * K), f"{law}: {rejections}/{150 * K}"


def test_the_consistency_check_can_fail():
    """The binomial check rejects a rate far above α (so the level tests above can fail)."""
    assert not _consistent_with_level(20, 48) and _consistent_with_level(0, 48)


@pytest.mark.parametrize("a", [0.5, 0.3])
def test_planted_signals_decide_within_the_forecast(a):
    """Every site decides within 2× the closed-form forecast; the median within the forecast."""
    need = sequential_examples_needed(a * a, 5 * a * a + 6)
    assert need is not None
    forecast = need + BATCH  # the first batch only sets the weights
    d = run(probe(7, signal=a, n=4 * forecast - 4 * forecast % BATCH))
    ats = [sd.decided_at for sd in d.sites]
    assert all(at is not None and at <= 2 * forecast for at in ats), (forecast, ats)
    assert median(ats) <= forecast, (forecast, ats)
    assert d.n == max(ats) + (-max(ats)) % BATCH  # reading stopped at the batch of the last decision
    for sd in d.sites:
        assert sd.verdict is Verdict.IMPROVABLE and "anytime noise test" in sd.verdict_reason
        assert sd.stream.decided_batch * BATCH < sd.decided_at <= (sd.stream.decided_batch + 1) * BATCH
        assert sd.examples_used == sd.decided_at and "anytime noise test" in sd.stream.reason


def test_budget_is_never_exceeded_and_undecided_sites_say_what_would_decide():
    d = run(probe(3, n=512), max_examples=100)  # 3 batches of 32 fit, the 4th would pass 100
    assert d.n == 96 and d.batches == 3 and d.max_examples == 100 and d.until_decided
    for sd in d.sites:
        assert sd.stream.stopped == "budget" and sd.examples_used == 96 and sd.decided_at is None
        if sd.verdict is Verdict.UNDETERMINED:
            assert "did not decide in 96 examples" in sd.verdict_reason


def test_fixed_size_rejection_is_not_a_streamed_verdict():
    """Fixed-size noise test rejects on the examples read, the anytime test has not decided: undetermined."""
    for seed in range(40):
        d = run(probe(seed, signal=0.35, n=512), max_examples=64)
        both = [sd for sd in d.sites if sd.result.verdict is Verdict.IMPROVABLE and sd.decided_at is None]
        if both:
            sd = both[0]
            assert sd.verdict is Verdict.UNDETERMINED
            assert sd.verdict_reason.startswith("the anytime noise test did not decide")
            assert sd.to_dict()["verdict"] == "undetermined"
            return
    pytest.fail("no probe where the fixed-size test rejects and the anytime test does not: widen the search")


def test_json_and_table_carry_the_streamed_fields(tmp_path):
    d = run(probe(5, signal=[0.8] * 4 + [0.0] * 4, n=512), max_examples=320)
    out = tmp_path / "d.json"
    d.write_json(out)
    got = json.loads(out.read_text())
    assert got["until_decided"] is True and got["max_examples"] == 320
    assert any("streamed until decided" in note for note in got["notes"])
    for sd, js in zip(d.sites, got["sites"], strict=True):
        assert js["examples_used"] == sd.examples_used and js["decided_at"] == sd.decided_at
        assert js["anytime"]["examples_needed"] == sd.stream.examples_needed
    from rich.console import Console

    console = Console(width=300, record=True)
    console.print(d.table())
    text = console.export_text()
    assert "examples used" in text and "decided at" in text and "n to decide (anytime)" in text
    assert "(batch " in text  # the decided-at cell: example and probe batch of the anytime decision


class _Stop(Exception):
    pass


def _interrupt_after(k):
    def progress(done, total):
        if done == k:
            raise _Stop

    return progress


def _comparable(d):
    out = d.to_dict()
    out.pop("resumed_from")
    return out


def test_interrupted_and_resumed_equals_uninterrupted(tmp_path):
    batches = probe(11, signal=[0.9, 0.6, 0.4, 0.0, 0.0, 0.3, 0.7, 0.2], n=1024)
    whole = run(batches, max_examples=800)
    assert any(sd.decided_at for sd in whole.sites) and not all(sd.decided_at for sd in whole.sites)
    ckpt = tmp_path / "c.safetensors"
    with pytest.raises(_Stop):
        run(batches, max_examples=800, checkpoint=ckpt, progress=_interrupt_after(5))
    resumed = run(batches, max_examples=800, checkpoint=ckpt)
    assert resumed.resumed_from == 5
    assert _comparable(resumed) == _comparable(whole)
    again = run(batches, max_examples=800, checkpoint=ckpt)  # a complete checkpoint: no batch is read again
    assert _comparable(again) == _comparable(whole)


def test_checkpoint_of_another_stopping_rule_is_refused_in_one_line(tmp_path):
    batches = probe(12, n=128)
    ckpt = tmp_path / "c.safetensors"
    diagnose(NoiseNet().double(), noise_loss, batches, sites=SITES, kinks=False, checkpoint=ckpt)
    with pytest.raises(CheckpointError, match="differs in: until_decided") as err:
        run(batches, checkpoint=ckpt)
    assert "\n" not in str(err.value)
    ckpt2 = tmp_path / "d.safetensors"
    run(batches, checkpoint=ckpt2, max_examples=64)
    with pytest.raises(CheckpointError, match=r"until_decided\.max_examples"):
        run(batches, checkpoint=ckpt2, max_examples=96)


def test_refusals(monkeypatch):
    batches = probe(13, n=64)
    with pytest.raises(DiagnoseError, match="max_examples = 20 is smaller than the first probe batch"):
        run(batches, max_examples=20)
    with pytest.raises(DiagnoseError, match="until_decided needs a zero-output feature family"):
        run(batches, family="product:1")
    from depthsat_theory.diagnose import distributed

    monkeypatch.setattr(distributed, "world", lambda: (0, 2))
    with pytest.raises(DiagnoseError, match="until_decided runs in one process"):
        run(batches)


FACTORY = textwrap.dedent(
    """
    import torch
    from torch import nn


    class NoiseNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Identity() for _ in range(2))

        def forward(self, x):
            return torch.stack([b(x[:, i]) for i, b in enumerate(self.blocks)], 1)

        def site_names(self):
            return ["blocks.0", "blocks.1"]


    def loss(out, y):
        return (out * y).sum((1, 2))


    def make():
        gen = torch.Generator().manual_seed(0)
        batches = []
        for _ in range(16):
            z = torch.randn(32, 2, 2, generator=gen, dtype=torch.float64)
            y = torch.randn(32, 2, 2, generator=gen, dtype=torch.float64)
            y[:, 0, 0] += 1.0 * z[:, 0, 0]  # a strong signal at blocks.0, pure noise at blocks.1
            batches.append((z, y))
        return NoiseNet().double().eval(), loss, batches
    """
)


def test_cli_until_decided_and_max_examples(tmp_path, monkeypatch):
    (tmp_path / "stream_factory.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    out_json = tmp_path / "d.json"
    argv = ["diagnose", "--model", "stream_factory:make", "--until-decided", "--max-examples", "200", "-q"]
    res = runner.invoke(app, [*argv, "--json", str(out_json)], env={"COLUMNS": "400"})  # the whole table
    assert res.exit_code == 0, res.output
    got = json.loads(out_json.read_text())
    assert got["until_decided"] is True and got["max_examples"] == 200 and got["n"] == 192
    first, second = got["sites"]
    assert first["verdict"] == "improvable" and first["decided_at"] <= 192 and first["anytime"]["decided"]
    assert second["examples_used"] == 192 and second["anytime"]["stopped"] == "budget"
    assert "examples used" in res.output
    bad = runner.invoke(app, ["diagnose", "--model", "stream_factory:make", "--max-examples", "64", "-q"])
    assert bad.exit_code == 2 and "--max-examples needs --until-decided" in bad.output
    bad = runner.invoke(app, ["diagnose", "--model", "stream_factory:make", "--until-decided", "--delta", "0.1"])
    assert bad.exit_code == 2 and "--until-decided with --delta" in bad.output


# ----------------------------------------------------------------------------- grow and the training callbacks
def test_streamed_ranking_puts_decided_sites_first():
    from depthsat_theory.grow.ranking import BY_DECIDED, rank_sites

    d = run(probe(21, signal=[0.0, 0.9, 0.0, 0.7, 0.0, 0.0, 0.0, 0.0], n=1024), max_examples=512)
    ranking = rank_sites(d)
    decided = [sd.site for sd in d.sites if sd.verdict is Verdict.IMPROVABLE]
    assert {"sites.1", "sites.3"} <= set(decided)
    assert ranking.by == BY_DECIDED and [r.site for r in ranking.sites[: len(decided)]] == sorted(
        decided, key=lambda s: -d[s].result.relative_score
    )


def test_grow_cli_until_decided_picks_a_decided_site(tmp_path, model_cache, monkeypatch):
    monkeypatch.setenv("DEPTHSAT_CACHE", model_cache)
    out = tmp_path / "g"
    res = runner.invoke(app, ["grow", "--model", "mlp", "--blocks", "1", "--until-decided", "--out", str(out), "-q"])
    assert res.exit_code == 0, res.output
    rep = json.loads((out / "grow-report.json").read_text())
    assert rep["ranking"]["by"].startswith("anytime decision")
    chosen = rep["chosen"][0]
    assert "examples_used" in chosen and "decided_at" in chosen
    decided = [r["site"] for r in rep["ranking"]["sites"] if r["verdict"] == "improvable"]
    assert chosen["site"] == (decided[0] if decided else rep["ranking"]["sites"][0]["site"])


class _Trainable(NoiseNet):
    """NoiseNet times a trained scalar ``w``: the activation gradient at site k is ``w · y_k``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones((), dtype=torch.float64))

    def forward(self, x):
        return self.w * super().forward(x)


def test_monitor_reports_a_site_decided_once_with_its_step():
    from depthsat_theory.integrations import SaturationMonitor

    batches = probe(31, signal=[1.0] + [0.0] * (K - 1), n=256)
    mon = SaturationMonitor(batches, noise_loss, every=2, sites=SITES, until_decided=True, kinks=False)
    model = _Trainable().double()
    logged = {}
    for step in range(1, 7):
        with torch.no_grad():
            model.w.mul_(0.9)  # a training step
        if mon.due(step):
            logged[step] = mon.measure(model, step)
    assert sorted(logged) == [2, 4, 6]
    assert mon.decided["sites.0"] == 2
    assert logged[2]["depthsat/sites.0/decided_step"] == 2.0
    assert all("depthsat/sites.0/decided_step" not in logged[s] for s in (4, 6))  # reported once
    for s in (2, 4, 6):
        assert 0 < logged[s]["depthsat/sites.0/examples_used"] <= 256


def test_lightning_callback_logs_the_decision_step_once(tmp_path):
    import csv

    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from depthsat_theory.integrations.lightning import LightningSaturationCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _Trainable().double()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            z, y = batch
            return noise_loss(self(z), y).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    pl.seed_everything(0, verbose=False)
    batches = probe(41, signal=[1.0] + [0.0] * (K - 1), n=256)
    train = torch.utils.data.TensorDataset(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    cb = LightningSaturationCallback(
        batches, noise_loss, every=2, sites=[f"net.{s}" for s in SITES], until_decided=True, kinks=False
    )
    logger = CSVLogger(str(tmp_path), name="run")
    trainer = pl.Trainer(
        max_steps=4,
        accelerator="cpu",
        devices=1,
        logger=logger,
        callbacks=[cb],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    trainer.fit(Module(), torch.utils.data.DataLoader(train, batch_size=32))
    with open(f"{logger.log_dir}/metrics.csv", newline="") as fh:
        rows = {int(r["step"]): r for r in csv.DictReader(fh) if r.get("depthsat/net.sites.0/s")}
    assert sorted(rows) == [2, 4]
    assert float(rows[2]["depthsat/net.sites.0/decided_step"]) == 2.0
    assert rows[4].get("depthsat/net.sites.0/decided_step", "") == ""
    assert cb.monitor.decided == {"net.sites.0": 2}


class _TrainerModule(_Trainable):
    """:class:`_Trainable` as a ``transformers.Trainer`` model: ``model(z=…, labels=…)`` returns the loss."""

    def forward(self, z, labels=None):
        out = super().forward(z)
        return out if labels is None else {"loss": noise_loss(out, labels).mean()}


def test_hf_trainer_callback_logs_the_decision_step_once(tmp_path):
    import transformers

    from depthsat_theory.integrations.huggingface import TrainerSaturationCallback

    batches = probe(51, signal=[1.0] + [0.0] * (K - 1), n=256)
    train = [{"z": z[i], "labels": y[i]} for z, y in batches for i in range(z.shape[0])]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=4,
        per_device_train_batch_size=32,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    model = _TrainerModule().double()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=train)
    cb = TrainerSaturationCallback(
        batches, every=2, loss_fn=noise_loss, sites=SITES, until_decided=True, kinks=False
    ).attach(trainer)
    trainer.train()
    rows = {r["step"]: r for r in trainer.state.log_history if "depthsat/sites.0/s" in r}
    assert sorted(rows) == [2, 4]
    assert rows[2]["depthsat/sites.0/decided_step"] == 2 and "depthsat/sites.0/decided_step" not in rows[4]
    assert all(0 < rows[s][f"depthsat/{site}/examples_used"] <= 256 for s in rows for site in SITES)
    assert cb.monitor.decided == {"sites.0": 2}


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda t, h: t.pop("@anytime:sites.0/sums"), r"'@anytime:sites\.0/sums' is missing"),
        (lambda t, h: t.__setitem__("@anytime:sites.1/n", t["@anytime:sites.1/n"] + 1), "n/weighted/decided_at"),
        (lambda t, h: h.__setitem__("anytime", {}), "header field 'anytime'"),
        (
            lambda t, h: t.__setitem__("@anytime:nope/n", t["@anytime:sites.0/n"].clone()),
            "not a state of this configuration",
        ),
    ],
)
def test_damaged_anytime_state_is_refused_in_one_line(tmp_path, damage, match):
    from safetensors.torch import save_file

    from depthsat_theory.diagnose import read_checkpoint

    batches = probe(61, n=128)
    ckpt = tmp_path / "c.safetensors"
    run(batches, checkpoint=ckpt)
    header, tensors = read_checkpoint(ckpt)
    damage(tensors, header)
    save_file(tensors, str(ckpt), metadata={"depthsat_diagnose": json.dumps(header)})
    with pytest.raises(CheckpointError, match=match) as err:
        run(batches, checkpoint=ckpt)
    assert "\n" not in str(err.value)
