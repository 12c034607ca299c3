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
from torch import nn

from depthsat_theory.capture.probe import call_model, unpack_batch
from depthsat_theory.grow.blocks import insert_blocks
from depthsat_theory.grow.errors import GrowError
from depthsat_theory.grow.hf import expand_layers, resolve_architecture
from depthsat_theory.grow.optim import flat_params, preview_first_step, zero_state_param_groups
from depthsat_theory.grow.ranking import even_positions, rank_sites
from depthsat_theory.io import atomic_write

__all__ = ["GrowReport", "grow", "parse_positions", "write_grown"]

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
        loss_before, loss_after: mean probe loss before growth and after training (``None`` without training).
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
    keep = ("site", "depth", "score", "relative_score", "ag_rms", "ag_max", "verdict", "verdict_detail")
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
def _probe_loss(model: nn.Module, loss_fn: Callable, batches: Sequence) -> float:
    tot, n = 0.0, 0
    for batch in batches:
        x, y, _ = unpack_batch(batch)
        ell = loss_fn(call_model(model, x), y)
        tot += float(ell.sum())
        n += int(ell.shape[0])
    return tot / n


def _optimizer(model: nn.Module, new_params: dict, lr: float, freeze_old: bool) -> torch.optim.Optimizer:
    """Adam from zero state: the old trainable parameters in one group (unless frozen), the new ones in another."""
    new_ids = {id(p) for p in flat_params(new_params)}
    old = [p for p in model.parameters() if id(p) not in new_ids and p.requires_grad]
    opt = torch.optim.Adam(old if old else [torch.zeros(0, requires_grad=True)], lr=lr)
    zero_state_param_groups(opt, new_params, freeze_old=freeze_old)
    return opt


def _plain_loop(
    model: nn.Module, loss_fn: Callable, batches: Sequence, opt: torch.optim.Optimizer, steps: int
) -> list[float]:
    losses = []
    for step in range(steps):
        x, y, _ = unpack_batch(batches[step % len(batches)])
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(call_model(model, x), y).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    opt.zero_grad(set_to_none=True)
    return losses


class _BatchList(torch.utils.data.Dataset):
    """The probe batches as a dataset of whole batches (one item = one padded Hugging Face batch)."""

    def __init__(self, batches: Sequence) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict:
        x, y, _ = unpack_batch(self.batches[i])
        return {**x, "labels": y}


def _trainer_loop(
    model: nn.Module,
    loss_fn: Callable,
    batches: Sequence,
    opt: torch.optim.Optimizer,
    steps: int,
    *,
    seed: int = 42,
    sampling: str = "random",
) -> list[float]:
    """``transformers.Trainer``: constant learning rate, no clipping, our zero-state optimizer, our per-example loss.

    ``seed`` is the Trainer's seed (its batch order under ``sampling="random"``); ``sampling="sequential"``
    takes the batches in the order given (one per step, cycling).
    """
    import transformers

    lr = opt.param_groups[-1]["lr"]
    with tempfile.TemporaryDirectory(prefix="depthsat-trainer-") as tmp:
        args = transformers.TrainingArguments(
            output_dir=tmp,
            max_steps=steps,
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
            seed=seed,
            train_sampling_strategy=sampling,
        )
        trainer = transformers.Trainer(
            model=model,
            args=args,
            train_dataset=_BatchList(batches),
            data_collator=lambda items: items[0],
            optimizers=(opt, None),
            compute_loss_func=lambda outputs, labels, num_items_in_batch=None: loss_fn(outputs, labels).mean(),
        )
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # the report has the losses
        trainer.train()
    model.eval()
    return [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]


def _train(
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
) -> list[float]:
    """Train ``steps`` Adam steps from zero state; the requires_grad flags are restored afterwards.

    ``seed`` and ``sampling`` apply to the Trainer (:func:`_trainer_loop`); the plain loop takes the
    batches in order.
    """
    flags = [(p, p.requires_grad) for p in model.parameters()]
    opt = _optimizer(model, new_params, lr, freeze_old)
    try:
        if trainer:
            return _trainer_loop(model, loss_fn, batches, opt, steps, seed=seed, sampling=sampling)
        return _plain_loop(model, loss_fn, batches, opt, steps)
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
        diagnose_kwargs: further keyword arguments of :func:`~depthsat_theory.diagnose.diagnose`.
        description: one line about the model and probe.

    Returns:
        A :class:`GrowReport` with the grown model.

    Raises:
        GrowError: bad ``blocks``/``positions``/``train_steps``/``lr``, or a growth that fails.
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
    pos = parse_positions(positions, sites, blocks)
    diag_family = family or "linear"
    kw = dict(diagnose_kwargs or {})
    clock = [time.perf_counter()]
    seconds: dict[str, float] = {}

    def lap(name: str) -> None:
        clock.append(time.perf_counter())
        seconds[name] = round(clock[-1] - clock[-2], 3)

    diagnosis = diagnose(model, loss_fn, batches, sites=sites, family=diag_family, layout=layout, **kw)
    lap("diagnose")
    ranking = rank_sites(diagnosis)
    chosen = _pick(ranking, sites, pos, blocks)
    probe = unpack_batch(batches[0])[0]
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
        notes=_notes(method, family),
    )
    if train_steps:
        hf = method == "expand_layers"
        report.trainer = "transformers.Trainer" if hf else "plain loop"
        report.train_losses = _train(grown, loss_fn, batches, res.new_params, train_steps, lr, freeze_old, trainer=hf)
        report.loss_after = _probe_loss(grown, loss_fn, batches)
        lap("train")
    return report


def _notes(method: str, family: str | None) -> list[str]:
    notes = [
        "first_step: one Adam step from zero state on the new parameters only, on the first probe batch; "
        "predicted_change = -lr <b, P(b)> (first order), observed_change = J(lr) - J(0)",
        "loss_before/loss_after: mean loss over the probe batches, which are also the training batches",
    ]
    if method == "expand_layers":
        notes.append(
            "sites were ranked with the linear family on the residual stream; the zero-output layer copy's "
            "tangent space (its zeroed output projections) differs from it"
        )
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
