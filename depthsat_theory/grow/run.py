"""Diagnose, pick sites, grow, train, report: the pipeline behind ``depthsat grow`` (:func:`grow`).

The report (:class:`GrowReport`, written by :func:`write_grown`) holds the sites chosen and why
(the ranking and each chosen site's diagnosis), the output deviation at insertion, the first
step's predicted and observed loss change (:func:`~depthsat_theory.grow.preview_first_step`),
the probe loss before and after training, and the versions used.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from depthsat_theory.capture.probe import call_model, unpack_batch
from depthsat_theory.grow.blocks import insert_blocks
from depthsat_theory.grow.errors import GrowError
from depthsat_theory.grow.hf import expand_layers, resolve_architecture
from depthsat_theory.grow.optim import flat_params, preview_first_step, zero_state_param_groups
from depthsat_theory.grow.ranking import even_positions, rank_sites
from depthsat_theory.grow.resume import TrainCheckpoint, batch_schedule
from depthsat_theory.io import atomic_write

__all__ = ["GrowReport", "grow", "held_out_batches", "interrupted_message", "parse_positions", "write_grown"]

REPORT_NAME = "grow-report.json"


@dataclass
class GrowReport:
    """What :func:`grow` did, JSON-ready (:meth:`to_dict`).

    Attributes:
        model: the grown model (not serialised by :meth:`to_dict`).
        method: ``"expand_layers"`` (zero-output layer copies) or ``"insert_blocks"`` (family blocks).
        family: the family of the inserted blocks (``expand_layers``: ``"zero-output layer copy"``).
        diagnosis_family: the family the sites were diagnosed with.
        positions: ``"auto"``, ``"even"`` or the explicit indices, as given.
        chosen: the chosen sites, in depth order, each with its diagnosis row and why it was chosen.
        ranking: :meth:`SiteRanking.to_dict` of the diagnosis.
        new_sites: where the new blocks are in the grown model: ``expand_layers``, the new layers'
            (renumbered) module names; ``insert_blocks``, the insertion sites, each now a wrapper
            module whose ``.site`` is the old module and ``.block`` the new block.
        new_parameters: number of new scalar parameters.
        deviation, tolerance: output deviation at insertion on the first probe batch, and its tolerance.
        first_step: :meth:`FirstStepPreview.to_dict` (predicted and observed change of the first step).
        loss_before, loss_after: mean probe loss before growth and after training (``None`` without training);
            the probe batches are the training batches, so a fall there alone can be memorisation.
        eval_loss_before, eval_loss_after: mean loss on the held-out batches (``eval_batches``, never
            trained on) before growth and after training; ``None`` without held-out batches.
        train_steps, checkpoint: the steps asked for, and the training checkpoint file (``None``: none).
        train_losses: the training loss of each step (on the step's batch, before its update).
        trainer: ``"transformers.Trainer"`` (Hugging Face models grown by ``expand_layers``: constant
            learning rate, no gradient clipping) or ``"plain loop"``; ``None`` without training.
        loss_units: the loss's units; ``versions``: package versions; ``notes``: caveats.
    """

    model: nn.Module
    method: str
    family: str
    diagnosis_family: str
    positions: str
    chosen: list[dict]
    ranking: dict
    new_sites: list[str]
    new_parameters: int
    deviation: float
    tolerance: float
    first_step: dict
    loss_before: float
    loss_after: float | None = None
    train_losses: list[float] = field(default_factory=list)
    eval_loss_before: float | None = None
    eval_loss_after: float | None = None
    train_steps: int = 0
    checkpoint: str | None = None
    trainer: str | None = None
    freeze_old: bool = False
    lr: float = 0.0
    loss_units: str = "nats per example"
    description: str = ""
    versions: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready dictionary (``nan`` becomes ``None``).

        Returns:
            The fields except ``model`` as a ``dict`` (nested; non-finite floats as ``None``).
        """
        keys = [k for k in self.__dataclass_fields__ if k != "model"]
        return {k: _clean(getattr(self, k)) for k in keys}


def _clean(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def parse_positions(text: str, sites: Sequence[str], blocks: int) -> list[int] | str:
    """Read ``--positions``: ``auto``, ``even`` or comma-separated site indices ``i,j``.

    Args:
        text: the option's value.
        sites: the model's sites in depth order (indices refer to this list).
        blocks: ``--blocks K``.

    Returns:
        ``"auto"``, or the site indices (ascending) for ``even`` and explicit lists.

    Raises:
        GrowError: ``K`` outside ``1..len(sites)``, an index that is not an integer or is outside the
            site list, a repeated index, or a list whose length is not ``K``.
    """
    n = len(sites)
    if not 1 <= blocks <= n:
        raise GrowError(f"--blocks {blocks}: the model has {n} sites (give 1..{n})")
    word = text.strip().lower()
    if word == "auto":
        return "auto"
    if word == "even":
        return even_positions(n, blocks)
    try:
        idx = [int(t) for t in word.split(",") if t.strip()]
    except ValueError:
        raise GrowError(f"--positions {text!r}: give auto, even or comma-separated site indices like 3,7") from None
    bad = [i for i in idx if not 0 <= i < n]
    if bad:
        raise GrowError(f"--positions {bad[0]} is outside the site list: valid indices are 0..{n - 1}")
    if len(set(idx)) != len(idx):
        raise GrowError(f"--positions {text!r} repeats an index")
    if len(idx) != blocks:
        raise GrowError(f"--positions lists {len(idx)} sites but --blocks is {blocks}; make them agree")
    return sorted(idx)


def _expandable(model: nn.Module, sites: list[str], probe: Any = None) -> tuple[str, list[int]] | None:
    """The layer list and indices when ``model`` is an HF model :func:`expand_layers` grows function-preservingly."""
    if getattr(model, "config", None) is None:
        return None
    try:
        arch, path = resolve_architecture(model, probe)
    except GrowError:
        return None
    prefix = path + "."
    if arch.is_post_ln(model.config) or not all(s.startswith(prefix) and s[len(prefix) :].isdigit() for s in sites):
        return None
    return path, [int(s[len(prefix) :]) for s in sites]


def _mode(positions: str) -> str:
    word = positions.strip().lower()
    return word if word in ("auto", "even") else "explicit"


_WHY = {"even": "evenly spaced (LLaMA-Pro's placement)", "explicit": "given by --positions"}


def _chosen_rows(diagnosis: Any, ranking: Any, chosen: list[str], mode: str) -> list[dict]:
    rank = {r.site: i for i, r in enumerate(ranking.sites)}
    keep: tuple[str, ...] = (
        "site",
        "depth",
        "headline",
        "verdict",
        "verdict_reason",
        "certificate",
        "score",
        "relative_score",
        "ag_rms",
        "ag_max",
    )
    keep += ("examples_used", "decided_at") if getattr(diagnosis, "until_decided", False) else ()
    rows = []
    for site in chosen:
        d = diagnosis[site].to_dict()
        row = {k: d.get(k) for k in keep}
        row["rank"] = rank[site] + 1
        row["why"] = f"rank {rank[site] + 1} by the {ranking.by}" if mode == "auto" else _WHY[mode]
        rows.append(row)
    return rows


def _versions() -> dict:
    from importlib import metadata

    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("depthsat", "transformers", "safetensors"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


@torch.no_grad()
def mean_probe_loss(model: nn.Module, loss_fn: Callable, batches: Sequence, progress: Any = None) -> float:
    """Mean per-example loss of ``model`` over ``batches`` (no gradients).

    Returns:
        The loss in the loss function's units per example (nats per example for cross-entropy).
    """
    tot, n = 0.0, 0
    for i, batch in enumerate(batches):
        x, y, _ = unpack_batch(batch)
        ell = loss_fn(call_model(model, x), y)
        tot += float(ell.sum())
        n += int(ell.shape[0])
        if progress is not None:
            progress("eval", i + 1, len(batches))
    return tot / n


def _optimizer(model: nn.Module, new_params: dict, lr: float, freeze_old: bool) -> torch.optim.Optimizer:
    """Adam from zero state: the old trainable parameters in one group (unless frozen), the new ones in another."""
    new_ids = {id(p) for p in flat_params(new_params)}
    old = [p for p in model.parameters() if id(p) not in new_ids and p.requires_grad]
    opt = torch.optim.Adam(old if old else [torch.zeros(0, requires_grad=True)], lr=lr)
    zero_state_param_groups(opt, new_params, freeze_old=freeze_old)
    return opt


Progress = Callable[[str, int, "int | None"], None]
"""``progress(phase, done, total)``: phase ``"probe"`` (diagnosis batches), ``"train"`` (steps) or ``"eval"``."""


@dataclass
class _Run:
    """What a training run reports after each step: progress, and the checkpoint every ``every`` steps."""

    total: int
    checkpoint: TrainCheckpoint | None = None
    every: int = 1
    progress: Progress | None = None
    rng: Tensor | None = None  # the torch RNG state to restore when training (re)starts
    seed: int = 42
    losses: list[float] = field(default_factory=list)

    def after_step(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        done = len(self.losses)
        if self.checkpoint is not None and (done % self.every == 0 or done == self.total):
            self.checkpoint.save(model, opt, done, self.losses)
        if self.progress is not None:
            self.progress("train", done, self.total)


def _plain_loop(
    model: nn.Module, loss_fn: Callable, batches: Sequence, opt: torch.optim.Optimizer, order: list[int], run: _Run
) -> list[float]:
    if run.rng is not None:
        torch.set_rng_state(run.rng)
    for step in range(len(run.losses), len(order)):
        x, y, _ = unpack_batch(batches[order[step]])
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(call_model(model, x), y).mean()
        loss.backward()
        opt.step()
        run.losses.append(float(loss.detach()))
        run.after_step(model, opt)
    opt.zero_grad(set_to_none=True)
    return run.losses


class _BatchList(torch.utils.data.Dataset):
    """The probe batches as a dataset of whole batches (one item = one padded Hugging Face batch)."""

    def __init__(self, batches: Sequence) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict:
        x, y, _ = unpack_batch(self.batches[i])
        return {**x, "labels": y}


def _step_callback(run: _Run, model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    """A ``TrainerCallback``: restore the RNG at the start, record each step's loss, checkpoint, report progress."""
    import transformers

    class StepCallback(transformers.TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if run.rng is not None:  # after the Trainer's set_seed: the interrupted run's RNG state
                torch.set_rng_state(run.rng)

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                run.losses.append(float(logs["loss"]))
                run.after_step(model, opt)

    return StepCallback()


def _trainer_loop(
    model: nn.Module, loss_fn: Callable, batches: Sequence, opt: torch.optim.Optimizer, order: list[int], run: _Run
) -> list[float]:
    """``transformers.Trainer``: constant learning rate, no clipping, our zero-state optimizer, our per-example loss.

    The Trainer takes the remaining steps' batches in the fixed order ``order`` (one batch per step).
    """
    import transformers

    todo = [batches[i] for i in order[len(run.losses) :]]
    if not todo:
        return run.losses
    lr = opt.param_groups[-1]["lr"]
    with tempfile.TemporaryDirectory(prefix="depthsat-trainer-") as tmp:
        args = transformers.TrainingArguments(
            output_dir=tmp,
            max_steps=len(todo),
            per_device_train_batch_size=1,
            learning_rate=lr,
            lr_scheduler_type="constant",
            max_grad_norm=0.0,
            weight_decay=0.0,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            use_cpu=next(model.parameters()).device.type == "cpu",
            remove_unused_columns=False,
            dataloader_num_workers=0,
            train_sampling_strategy="sequential",
            seed=run.seed,
        )
        trainer = transformers.Trainer(
            model=model,
            args=args,
            train_dataset=_BatchList(todo),
            data_collator=lambda items: items[0],
            optimizers=(opt, None),
            compute_loss_func=lambda outputs, labels, num_items_in_batch=None: loss_fn(outputs, labels).mean(),
            callbacks=[_step_callback(run, model, opt)],
        )
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # the report has the losses
        trainer.train()
    model.eval()
    return run.losses


def train_new_blocks(
    model: nn.Module,
    loss_fn: Callable,
    batches: Sequence,
    new_params: dict,
    steps: int,
    lr: float,
    freeze_old: bool,
    *,
    trainer: bool,
    seed: int = 42,
    sampling: str = "random",
    checkpoint: TrainCheckpoint | None = None,
    every: int = 1,
    progress: Progress | None = None,
) -> list[float]:
    """Train ``steps`` Adam steps from zero state; the requires_grad flags are restored afterwards.

    The batches are taken in :func:`~depthsat_theory.grow.resume.batch_schedule` order (``seed``,
    ``sampling``); with ``checkpoint``, a saved run is continued from its last step and the state is
    saved every ``every`` steps and after the last.
    """
    flags = [(p, p.requires_grad) for p in model.parameters()]
    opt = _optimizer(model, new_params, lr, freeze_old)
    order = batch_schedule(steps, len(batches), seed, sampling)
    run = _Run(steps, checkpoint, max(1, every), progress, seed=seed)
    if checkpoint is not None and checkpoint.restore(model, opt):
        run.losses, run.rng = list(checkpoint.losses), torch.get_rng_state()
    try:
        if trainer:
            return _trainer_loop(model, loss_fn, batches, opt, order, run)
        return _plain_loop(model, loss_fn, batches, opt, order, run)
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def _pick(ranking: Any, sites: list[str], positions: list[int] | str, blocks: int) -> list[str]:
    if positions == "auto":
        top = set(ranking.top(blocks))
        return [s for s in sites if s in top]
    assert isinstance(positions, list)
    return [sites[i] for i in positions]


def _grow_model(
    model: nn.Module, chosen: list[str], family: str | None, probe: Any, layout: Any
) -> tuple[str, str, Any]:
    expand = _expandable(model, chosen, probe) if family is None else None
    if expand is not None:
        exp = expand_layers(model, expand[1], probe=probe)
        return "expand_layers", "zero-output layer copy", exp
    spec = family or "linear"
    growth = insert_blocks(model, dict.fromkeys(chosen, spec), probe=probe, layout=layout)
    return "insert_blocks", spec, growth


def grow(
    model: nn.Module,
    loss_fn: Callable,
    batches: Sequence,
    *,
    sites: list[str] | None,
    blocks: int,
    family: str | None = None,
    positions: str = "auto",
    train_steps: int = 0,
    freeze_old: bool = False,
    lr: float = 1e-4,
    layout: Any = None,
    diagnose_kwargs: dict | None = None,
    description: str = "",
    eval_batches: Sequence | None = None,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int = 1,
    progress: Progress | None = None,
    seed: int = 42,
) -> GrowReport:
    """Diagnose ``model``'s sites, pick ``blocks`` of them, grow there, preview the first step, train.

    Hugging Face models that :func:`~depthsat_theory.grow.expand_layers` grows function-preservingly
    (Llama-like, GPT-2), with no ``family`` given, get zero-output copies of the chosen layers;
    every other model (and any model with ``family``) gets zero-output blocks of ``family``
    (default ``linear``) by :func:`~depthsat_theory.grow.insert_blocks`.

    Args:
        model: the network (not modified; the grown copy is in the report).
        loss_fn: per-example loss ``loss_fn(output, targets) -> (B,)``.
        batches: probe batches (``(inputs, targets)`` or Hugging Face mappings); the first is the
            function-preservation and preview batch, and training cycles through them.
        sites: the candidate sites in depth order (``None``: :func:`~depthsat_theory.diagnose.discover_sites`).
        blocks: how many blocks to insert (``K``).
        family: the inserted family's spec (``None``: layer copies where possible, else ``linear``).
        positions: ``auto`` (ranked, :func:`~depthsat_theory.grow.rank_sites`), ``even`` or ``i,j``.
        train_steps: Adam steps after growth (0: none), from zero optimizer state, constant ``lr``,
            on the probe batches (in turn; the Trainer samples them at random): ``transformers.Trainer``
            runs them for Hugging Face models grown by ``expand_layers`` (so the job runs under
            ``accelerate``/``torchrun`` like any Trainer job), a plain loop otherwise.
        freeze_old: train only the new parameters.
        lr: the learning rate of the preview step and of training.
        layout: the sites' layout (as for :func:`~depthsat_theory.diagnose.diagnose`).
        diagnose_kwargs: further keyword arguments of :func:`~depthsat_theory.diagnose.diagnose` (fields of
            :class:`~depthsat_theory.diagnose.DiagnoseOptions`); with ``until_decided=True`` the probe is streamed
            until decided and ``positions="auto"`` puts the sites the anytime test decided first
            (:data:`~depthsat_theory.grow.ranking.BY_DECIDED`); the chosen rows then carry ``examples_used`` and
            ``decided_at``.
        description: one line about the model and probe.
        eval_batches: held-out batches (same form as ``batches``, never trained on): the report
            gives their mean loss before growth and after training.
        checkpoint: a training checkpoint file (:class:`~depthsat_theory.grow.resume.TrainCheckpoint`):
            written every ``checkpoint_every`` steps and after the last; when it exists, training
            continues from it (same options required), bitwise as an uninterrupted run on CPU.
        checkpoint_every: steps between checkpoint writes.
        progress: ``progress(phase, done, total)`` after each probe batch (``"probe"``), training
            step (``"train"``) and evaluation batch (``"eval"``).
        seed: the seed of the training batch order.

    Returns:
        A :class:`GrowReport` with the grown model.

    Raises:
        GrowError: bad ``blocks``/``positions``/``train_steps``/``lr``/``checkpoint_every``, a
            checkpoint written by another run, or a growth that fails.
        FamilyError: a family that does not fit a chosen site.
        NotFunctionPreservingError: the growth moved the output.
    """
    from depthsat_theory.diagnose import diagnose, discover_sites

    if sites is None:
        sites = discover_sites(model, unpack_batch(batches[0])[0])
    if train_steps < 0:
        raise GrowError(f"--train-steps must be >= 0, got {train_steps}")
    if not lr > 0:
        raise GrowError(f"--lr must be > 0, got {lr}")
    if checkpoint_every < 1:
        raise GrowError(f"--checkpoint-every must be >= 1, got {checkpoint_every}")
    pos = parse_positions(positions, sites, blocks)
    diag_family = family or "linear"
    kw = dict(diagnose_kwargs or {})
    clock = [time.perf_counter()]
    seconds: dict[str, float] = {}

    def lap(name: str) -> None:
        clock.append(time.perf_counter())
        seconds[name] = round(clock[-1] - clock[-2], 3)

    if progress is not None:
        kw.setdefault("progress", lambda k, tot: progress("probe", k, tot))
    diagnosis = diagnose(model, loss_fn, batches, sites=sites, family=diag_family, layout=layout, **kw)
    eval_before = mean_probe_loss(model, loss_fn, eval_batches, progress) if eval_batches else None
    lap("diagnose")
    probe = unpack_batch(batches[0])[0]
    # streamed until decided: the anytime decisions drive the choice (rank_sites), not the copy scores
    by_copy = family is None and pos == "auto" and not diagnosis.until_decided
    ranking, copy_note = _copy_ranking(model, loss_fn, batches, sites, probe) if by_copy else (None, None)
    ranking = ranking or rank_sites(diagnosis)
    chosen = _pick(ranking, sites, pos, blocks)
    method, fam_name, res = _grow_model(model, chosen, family, probe, layout)
    grown = res.model
    lap("grow")
    preview = preview_first_step(grown, loss_fn, batches[0], res.new_params, update="adam", lr=lr)
    lap("preview")
    report = GrowReport(
        model=grown,
        method=method,
        family=fam_name,
        diagnosis_family=diag_family,
        positions=positions,
        chosen=_chosen_rows(diagnosis, ranking, chosen, _mode(positions)),
        ranking=ranking.to_dict(),
        new_sites=list(res.new_params),
        new_parameters=sum(p.numel() for p in flat_params(res.new_params)),
        deviation=res.deviation,
        tolerance=res.tolerance,
        first_step=preview.to_dict(),
        loss_before=diagnosis.loss,
        freeze_old=freeze_old,
        lr=lr,
        loss_units=diagnosis.loss_units,
        description=description or diagnosis.description,
        versions=_versions(),
        seconds=seconds,
        notes=_notes(method, family, bool(eval_batches), copy_note),
        eval_loss_before=eval_before,
        train_steps=train_steps,
        checkpoint=None if checkpoint is None else str(checkpoint),
    )
    if train_steps:
        hf = method == "expand_layers"
        report.trainer = "transformers.Trainer" if hf else "plain loop"
        ckpt = None
        if checkpoint is not None:
            fp = TrainCheckpoint.fingerprint_of(
                steps=train_steps,
                lr=lr,
                freeze_old=freeze_old,
                seed=seed,
                method=method,
                new_sites=report.new_sites,
                n_batches=len(batches),
                trainer=report.trainer,
            )
            ckpt = TrainCheckpoint(Path(checkpoint), fp)
        report.train_losses = train_new_blocks(
            grown,
            loss_fn,
            batches,
            res.new_params,
            train_steps,
            lr,
            freeze_old,
            trainer=hf,
            seed=seed,
            checkpoint=ckpt,
            every=checkpoint_every,
            progress=progress,
        )
        report.loss_after = mean_probe_loss(grown, loss_fn, batches, progress)
        if eval_batches:
            report.eval_loss_after = mean_probe_loss(grown, loss_fn, eval_batches, progress)
        lap("train")
    return report


def held_out_batches(
    tokenizer: Any, path: str | os.PathLike, n: int, batch_size: int, *, seed: int = 0, device: Any = "cpu"
) -> list:
    """Held-out batches of a causal language model from a text file (``--eval-text``).

    Windows of 4 consecutive non-empty lines (at most 128 tokens), as the ``hf:`` probe
    (:func:`~depthsat_theory.tasks.zoo.causal_lm_batches`), drawn with ``seed``.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        path: a UTF-8 text file the model was not trained on here.
        n: examples wanted (fewer when the file is short: as many windows as it has).
        batch_size: examples per batch.
        seed: the seed of the window draw.
        device: where the tensors go.

    Returns:
        ``[({"input_ids", "attention_mask"}, labels)]`` on ``device``.

    Raises:
        GrowError: no tokenizer (not a language model), an unreadable file, or fewer than 5 non-empty lines.
    """
    from depthsat_theory.tasks.custom import to_device
    from depthsat_theory.tasks.zoo import causal_lm_batches

    if tokenizer is None:
        raise GrowError("--eval-text is for language models with a tokenizer (hf:PATH, smollm2)")
    try:
        lines = [ln for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise GrowError(f"--eval-text {path}: not a readable UTF-8 file ({type(exc).__name__})") from None
    if len(lines) < 5:
        raise GrowError(f"--eval-text {path}: {len(lines)} non-empty lines; give at least 5 (windows of 4 lines)")
    n = min(n, len(lines) - 4)
    try:
        batches = causal_lm_batches(tokenizer, lines, n, batch_size, seed, 4, 128)
    except ValueError as exc:
        raise GrowError(f"--eval-text {path}: {exc}") from None
    return to_device(batches, device)


def interrupted_message(checkpoint: str | os.PathLike | None) -> str:
    """What an interrupted ``depthsat grow`` kept, and how to resume (one line).

    Args:
        checkpoint: ``--checkpoint`` (``None``: none given).

    Returns:
        The message: the checkpoint's step and the rerun to continue, or that nothing was kept.
    """
    if checkpoint is None:
        return (
            "interrupted: nothing was kept (no --checkpoint); rerun with --checkpoint PATH to make training resumable"
        )
    path = Path(checkpoint)
    if not path.is_file():
        return f"interrupted before the first training checkpoint: nothing in {path} yet; rerun the same command"
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        meta = json.loads((fh.metadata() or {}).get("depthsat", "{}"))
    total = meta.get("fingerprint", {}).get("steps")
    return (
        f"interrupted: {path} keeps training step {meta.get('step')} of {total} (weights, optimizer state, RNG); "
        f"rerun the same command to resume from it"
    )


def _copy_ranking(
    model: nn.Module, loss_fn: Callable, batches: Sequence, sites: list[str], probe: Any
) -> tuple[Any, str | None]:
    """The sites ranked by the zero-output layer copy's own tangent, when ``model``'s layers are copied.

    Returns ``(ranking, note)``; ``(None, note)`` when the copies are not a feature family to score
    (the linear diagnosis ranks then), ``(None, None)`` when the model is not grown by layer copies.
    """
    from depthsat_theory.grow.copyscore import copy_scores
    from depthsat_theory.grow.ranking import BY_HEADLINE, RankedSite, SiteRanking, headline_key

    expand = _expandable(model, sites, probe)
    if expand is None:
        return None, None
    try:
        scores = copy_scores(expand_layers(model, expand[1], probe=probe), loss_fn, batches)
    except GrowError as exc:
        return None, f"sites ranked with the linear family: the layer copies cannot be scored ({exc})"
    ranked = []
    for depth, site in enumerate(sites):
        r = scores[site]
        key = headline_key(r)
        head = key if math.isfinite(key) else None
        ranked.append(RankedSite(site, depth, float(key), float(r.relative_score), None, r.verdict.value, head))
    ranked.sort(key=lambda r: (-r.key, r.depth))
    by = f"{BY_HEADLINE} of the zero-output layer copy (its own tangent: the zeroed projections' features)"
    note = "sites ranked with the inserted family: the zero-output layer copy's own tangent (ranking.sites)"
    return SiteRanking(ranked, by, "the inserted family's own score (copy_scores)"), note


def _notes(method: str, family: str | None, held_out: bool, copy_note: str | None = None) -> list[str]:
    notes = [
        "first_step: one Adam step from zero state on the new parameters only, on the first probe batch; "
        "predicted_change = -lr <b, P(b)> (first order), observed_change = J(lr) - J(0)",
        "loss_before/loss_after: mean loss over the probe batches, which are also the training batches: "
        "a fall there is a fall on training data (it can be memorisation), not a held-out improvement",
    ]
    if held_out:
        notes.append("eval_loss_before/eval_loss_after: mean loss over the held-out batches, never trained on")
    if copy_note is not None:
        notes.append(copy_note + "; the chosen rows' score and verdict are the linear family's diagnosis")
    return notes


def write_grown(report: GrowReport, out: str | os.PathLike, *, tokenizer: Any = None) -> list[Path]:
    """Write the grown model and ``grow-report.json`` into the folder ``out``, all or nothing.

    Hugging Face models grown by ``expand_layers`` are written with ``save_pretrained`` (reload with
    :func:`~depthsat_theory.grow.load_grown`); others as ``model.safetensors`` (the state dict of
    the grown module; rebuild it with :func:`~depthsat_theory.grow.insert_blocks` and the report's
    sites and family, then ``safetensors.torch.load_model``).  Everything is written to a temporary
    sibling folder first, then renamed to ``out``.  With the source model's ``tokenizer``, the
    folder of a Hugging Face model is complete: config, weights, generation config (from the
    model's own ``generation_config``) and tokenizer, so ``--model hf:OUT`` reads it back.

    Args:
        report: the :class:`GrowReport`.
        out: a folder that does not exist yet, or an empty one.
        tokenizer: the source model's Hugging Face tokenizer (written with ``save_pretrained``), or ``None``.

    Returns:
        The paths written.

    Raises:
        GrowError: ``out`` is a file or a non-empty folder, or its parent does not exist.
    """
    folder = Path(out)
    check_out_dir(folder)
    tmp = Path(tempfile.mkdtemp(prefix=".depthsat-grow-", dir=folder.resolve().parent))
    try:
        if report.method == "expand_layers" and hasattr(report.model, "save_pretrained"):
            _save_pretrained(report.model, tmp)
        else:
            from safetensors.torch import save_model

            save_model(report.model, str(tmp / "model.safetensors"))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        data = json.dumps(report.to_dict(), indent=1, ensure_ascii=False, allow_nan=False)
        atomic_write(tmp / REPORT_NAME, lambda fh: fh.write(data))
        if folder.is_dir():
            folder.rmdir()
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(folder.iterdir())


def _save_pretrained(model: nn.Module, folder: Path) -> None:
    """``model.save_pretrained(folder)`` without transformers' progress bar."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        save: Any = model.save_pretrained
        save(str(folder))
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def check_out_dir(folder: Path) -> None:
    """Refuse an output folder that cannot take the grown model.

    Raises:
        GrowError: ``folder`` is a file or a non-empty folder, or its parent folder does not exist.
    """
    if folder.exists() and not folder.is_dir():
        raise GrowError(f"--out {folder} is a file; give a new or empty folder")
    if folder.is_dir() and any(folder.iterdir()):
        raise GrowError(f"--out {folder} is not empty; give a new or empty folder")
    if not folder.resolve().parent.is_dir():
        raise GrowError(f"--out {folder}: the parent folder {folder.resolve().parent} does not exist")
