"""Monitor during training: the Hugging Face and Lightning callbacks in real training runs.

Each test trains a tiny model on CPU for a few steps with the callback, copies the weights at the
measured steps (a second callback), and checks that the logged headline, verdict, noise ratio, plug-in and ``AG_max``
equal ``diagnose`` of a fresh model loaded with that copy (an independent object, with a loss
written here), and that the trained weights are bitwise those of the same run without the callback.
"""

from __future__ import annotations

import copy
import csv
import math

import pytest
import torch
import torch.nn.functional as F
from tiny_hf import VERSES, char_tokenizer, tiny_causal_lm
from torch import nn

from depthsat_theory.decision import headline
from depthsat_theory.diagnose import diagnose
from depthsat_theory.integrations import METRICS, SaturationMonitor, saturation_metrics

_CODES = {"improvable": 1.0, "undetermined": 0.5, "saturated": 0.0, "degenerate": -1.0}


def _site_expected(sd) -> dict:
    """The logged metrics from the site's result, by the formulas of theory/decision.md (not the monitor's code)."""
    r = sd.result
    s_u = math.sqrt(max(0.0, (r.n * r.score**2 - r.noise_variance) / (r.n - 1)))  # def-bias-corrected-score
    h = headline(r)
    return {
        "s_u": s_u,
        "s_u_over_ag_rms": s_u / r.ag_rms,
        "s_u_low": h.low,
        "s_u_high": h.high,
        "verdict": _CODES[r.verdict.value],
        "noise_ratio": r.noise_ratio,
        "plugin_s_over_ag_rms": r.relative_score,
        "chance_over_ag_rms": math.sqrt(r.noise_variance / r.n) / r.ag_rms,  # prop-plugin-chance-level
        "s": r.score,
        "s_over_ag_rms": r.relative_score,
        "ag_max": r.ag_max,
    }


def _logged(row: dict, site: str, prefix="depthsat") -> dict:
    return {m: float(row[f"{prefix}/{site}/{m}"]) for m in METRICS}


def _expected(model, loss, batches, sites) -> dict:
    d = diagnose(model.eval(), loss, batches, sites=sites)
    return {s.site: _site_expected(s) for s in d.sites}


# ----------------------------------------------------------------------------- Hugging Face Trainer
def _windows(tok, length=12):
    text = "\n".join(VERSES)
    ids = torch.tensor(tok(text)["input_ids"])
    return [ids[i : i + length] for i in range(0, ids.shape[0] - length, length)]


def _shift_loss(output, labels):
    """Mean next-token cross-entropy per example; the labels' last column (-100) predicts nothing."""
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.transpose(1, 2), labels[:, :-1], reduction="none").mean(dim=1)


def _hf_run(tmp_path, with_monitor: bool, snap_steps=(2, 4)):
    import transformers

    from depthsat_theory.integrations.huggingface import TrainerSaturationCallback

    tok = char_tokenizer()
    wins = _windows(tok)
    train = [{"input_ids": w, "labels": w} for w in wins[:16]]
    probe = []
    for i in (16, 19):
        ids = torch.stack(wins[i : i + 3])
        labels = torch.full_like(ids, -100)
        labels[:, :-1] = ids[:, 1:]
        probe.append(({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, labels))

    snaps: dict[int, dict] = {}

    class Snapshot(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step in snap_steps:
                snaps[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    model = tiny_causal_lm("llama")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=3e-2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=train, callbacks=[Snapshot()])
    cb = TrainerSaturationCallback(probe, every=2).attach(trainer) if with_monitor else None
    trainer.train()
    return trainer, model, probe, snaps, cb


def test_hf_trainer_callback_logs_the_diagnosis_at_each_measured_step(tmp_path):
    trainer, model, probe, snaps, cb = _hf_run(tmp_path, with_monitor=True)
    sites = ["model.layers.0", "model.layers.1"]
    rows = {r["step"]: r for r in trainer.state.log_history if "depthsat/model.layers.0/s" in r}
    assert sorted(rows) == [2, 4] and cb.monitor.sites == sites
    for step in (2, 4):
        fresh = tiny_causal_lm("llama", seed=1)
        fresh.load_state_dict(snaps[step])
        want = _expected(fresh, _shift_loss, probe, sites)
        for site in sites:
            got = _logged(rows[step], site)
            for m in METRICS:
                assert got[m] == pytest.approx(want[site][m], rel=1e-6, abs=1e-12), (step, site, m)
    assert rows[2]["depthsat/model.layers.0/s"] != rows[4]["depthsat/model.layers.0/s"]  # measured anew
    assert model.training  # the Trainer's mode is restored after each measurement

    plain_trainer, plain, _, plain_snaps, _ = _hf_run(tmp_path, with_monitor=False)
    for k, v in plain.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k  # bitwise: the monitor does not touch training
    assert all(torch.equal(plain_snaps[2][k], snaps[2][k]) for k in snaps[2])
    # the Trainer's own logging is kept at the measured steps (trainer.log clears control.should_log):
    # the same training-loss rows as the run without the monitor, at every logging step
    losses = {r["step"]: r["loss"] for r in trainer.state.log_history if "loss" in r}
    plain_losses = {r["step"]: r["loss"] for r in plain_trainer.state.log_history if "loss" in r}
    assert sorted(plain_losses) == [1, 2, 3, 4]
    assert losses == plain_losses


def test_hf_callback_must_be_attached(tmp_path):
    import transformers

    from depthsat_theory.integrations.huggingface import TrainerSaturationCallback

    ids = torch.arange(8).view(2, 4) % 5 + 2
    cb = TrainerSaturationCallback([({"input_ids": ids}, ids)], every=1)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True
    )
    trainer = transformers.Trainer(
        model=tiny_causal_lm("llama", layers=1),
        args=args,
        train_dataset=[{"input_ids": ids[0], "labels": ids[0]}],
        callbacks=[cb],
    )
    with pytest.raises(RuntimeError, match=r"call callback.attach\(trainer\)"):
        trainer.train()


# ----------------------------------------------------------------------------- Lightning
class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.f = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d))

    def forward(self, h):
        return h + self.f(h)


def _lit_module():
    import lightning.pytorch as pl

    class ResidualMLP(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(3, 8)
            self.blocks = nn.ModuleList([_Block(8), _Block(8)])
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            h = self.embed(x)
            for b in self.blocks:
                h = b(h)
            return self.head(h)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    return ResidualMLP()


def _per_example_ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


def _lightning_run(tmp_path, with_monitor: bool, snap_steps=(3, 6)):
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from depthsat_theory.integrations.lightning import LightningSaturationCallback

    pl.seed_everything(0, verbose=False)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(80, 3, generator=gen)
    y = (x[:, 0] * x[:, 1] > 0).long()
    probe = [(x[64:72], y[64:72]), (x[72:], y[72:])]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:64], y[:64]), batch_size=8, shuffle=True)
    snaps: dict[int, dict] = {}

    class Snapshot(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step in snap_steps:
                snaps[trainer.global_step] = {k: v.detach().clone() for k, v in module.state_dict().items()}

    module = _lit_module()
    callbacks: list = [Snapshot()]
    if with_monitor:
        callbacks.append(LightningSaturationCallback(probe, _per_example_ce, every=3))
    logger = CSVLogger(str(tmp_path / ("with" if with_monitor else "without")), name="run")
    trainer = pl.Trainer(
        max_steps=6,
        accelerator="cpu",
        devices=1,
        logger=logger,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    trainer.fit(module, loader)
    return trainer, module, probe, snaps, logger


def test_lightning_callback_logs_to_csv_the_diagnosis_at_each_measured_step(tmp_path):
    _, module, probe, snaps, logger = _lightning_run(tmp_path, with_monitor=True)
    with open(f"{logger.log_dir}/metrics.csv", newline="") as fh:
        rows = {int(r["step"]): r for r in csv.DictReader(fh) if r.get("depthsat/blocks.0/s")}
    assert sorted(rows) == [3, 6]
    for step in (3, 6):
        fresh = _lit_module()
        fresh.load_state_dict(snaps[step])
        want = _expected(fresh, _per_example_ce, probe, ["blocks.0", "blocks.1"])
        for site in ("blocks.0", "blocks.1"):
            got = _logged(rows[step], site)
            for m in METRICS:
                assert got[m] == pytest.approx(want[site][m], rel=1e-6, abs=1e-12), (step, site, m)
    assert rows[3]["depthsat/blocks.1/s"] != rows[6]["depthsat/blocks.1/s"]

    _, plain, _, plain_snaps, _ = _lightning_run(tmp_path, with_monitor=False)
    for k, v in plain.state_dict().items():
        assert torch.equal(v, module.state_dict()[k]), k  # bitwise: the monitor does not touch training
    assert all(torch.equal(plain_snaps[3][k], snaps[3][k]) for k in snaps[3])


# ----------------------------------------------------------------------------- the monitor itself
def test_monitor_schedule_mode_rng_device_and_errors(device):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), _Block(4), nn.Linear(4, 2)).train()
    x, y = torch.randn(10, 3), torch.randint(0, 2, (10,))
    want = _expected(copy.deepcopy(net), _per_example_ce, [(x, y)], ["1"])["1"]
    net.to(device)
    mon = SaturationMonitor([(x, y)], _per_example_ce, every=5, sites=["1"])  # the probe stays on the CPU here
    assert [s for s in range(1, 16) if mon.due(s)] == [5, 10, 15] and not mon.due(0)
    state = torch.random.get_rng_state()
    metrics = mon.measure(net, 5)
    assert torch.equal(state, torch.random.get_rng_state()) and net.training and not mon.due(5)
    assert all(p.grad is None for p in net.parameters())  # no parameter gradient formed
    assert metrics == saturation_metrics(mon.diagnosis) and set(metrics) == {f"depthsat/1/{m}" for m in METRICS}
    for m in METRICS:  # the same numbers as on the CPU (the CPU reference was taken before the move)
        assert metrics[f"depthsat/1/{m}"] == pytest.approx(want[m], rel=1e-5), m
    with pytest.raises(ValueError, match="every must be >= 1"):
        SaturationMonitor([(x, y)], _per_example_ce, every=0)
    with pytest.raises(ValueError, match="batches is empty"):
        SaturationMonitor([], _per_example_ce, every=1)
    with pytest.raises(ValueError, match="checkpoint do not apply"):
        SaturationMonitor([(x, y)], _per_example_ce, every=1, checkpoint="x")


def test_monitor_restores_each_submodule_mode_and_the_trajectory():
    """A submodule frozen in eval mode inside a training model (a frozen dropout/BatchNorm) stays so.

    Independent truth: the modes recorded before the measurement, and the training steps of a
    deep copy run without the monitor (dropout ``p = 0.5`` would change the next step's output if
    the frozen dropout came back in train mode).
    """
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), _Block(4), nn.Linear(4, 2)).train()
    net[1].eval()  # the user froze this dropout
    before = [m.training for m in net.modules()]
    twin = copy.deepcopy(net)
    x, y = torch.randn(10, 3), torch.randint(0, 2, (10,))
    mon = SaturationMonitor([(x, y)], _per_example_ce, every=1, sites=["2"])
    mon.measure(net, 1)
    assert [m.training for m in net.modules()] == before
    torch.manual_seed(1)
    out = net(x)
    torch.manual_seed(1)
    assert torch.equal(out, twin(x))
