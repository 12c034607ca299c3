r"""Diagnose a whole network: the saturation score at every residual-stream site in one pass.

:func:`diagnose` streams, for every insertion site of a model at once, the float64
tangent statistics of one residual family (theory/definitions.md) over a probe, with **one
forward and one backward pass per probe batch for all sites**
(:class:`~depthsat_theory.capture.sites.SiteRecorder`), and reports per site

- ``s = ‖Π g‖`` (``def-score``; ``s² = tr(G Σ⁺ Gᵀ)`` for zero-output feature
  families, ``thm-cross-gradient``), the scale-free ``s / AG_rms ∈ [0, 1]``;
- the raw quantities ``AG_rms = sqrt(E‖g‖_F²)``, ``AG_max = max_x ‖g(x)‖_F`` and, on
  request (``realizability=True``), ``r̂ = ‖m̂‖`` and ``ρ̂ = ‖m̂ − Π m̂‖/‖m̂‖`` with ties
  pooled exactly (exact on finite/discrete populations, biased upward for continuous
  units: ``r̂ → AG_rms``);
- the numerical tangent rank (``rank K``; ``0``: *degenerate*, never "saturated");
- with ``delta``: the ``(1 − δ)`` interval of :mod:`depthsat_theory.bounds.core`
  (``thm-finite-sample``), union-bounded over the sites compared (``candidates`` =
  number of sites), with plug-in constants from the probe unless given.

Units: ``g`` is the gradient of the *per-example* loss (nats per example; for token
models the example's mean over its own tokens, theory/definitions.md, def-setting), so every score is in nats
per example per unit function-space step.  Scores are not comparable across sites
(theory label ``def-score``): compare ``s / AG_rms`` or ``s · z_rms``.

Memory per site is ``O(d k̃ + k̃²)`` (``O(p²)`` for general families) whatever the
probe size; only tie pooling grows with the number of distinct units.

Long runs: ``checkpoint=PATH`` saves the partial sums atomically (safetensors, no
pickle; its JSON header holds the configuration and the number of batches consumed)
every ``checkpoint_every`` batches; rerunning with the same path resumes after the
last saved batch and returns the same numbers as an uninterrupted run (the sums are
restored bit for bit and the remaining batches are added in the same order).
Under ``torchrun`` the probe is sharded and the sums all-reduced
(:mod:`depthsat_theory.diagnose.distributed`).
"""

from __future__ import annotations

import json
import math
import os
import re
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from depthsat_theory.capture import REDUCTIONS, SiteError, SiteRecorder, reduce_losses, update_statistics
from depthsat_theory.diagnose import distributed as _dist
from depthsat_theory.families import FamilyError, FeatureFamily, ResidualFamily, parse_family
from depthsat_theory.io import atomic_write
from depthsat_theory.statistics import SaturationResult, StatisticsError, statistics_for

__all__ = [
    "SITE_PATTERNS",
    "CheckpointError",
    "DiagnoseError",
    "Diagnosis",
    "SiteDiagnosis",
    "diagnose",
    "discover_sites",
    "infer_layout",
    "read_checkpoint",
]

CHECKPOINT_VERSION = 1

#: Module-name patterns of residual-stream sites (searched in ``named_modules()``), in
#: the order they are tried; a model with ``site_names()`` (ours) uses that instead.
SITE_PATTERNS: dict[str, str] = {
    "torchvision ResNet block (layerN.M)": r"(?:^|\.)layer\d+\.\d+$",
    "ResNet stage (layerN)": r"(?:^|\.)layer\d+$",
    "GPT-2 style (transformer.h.N)": r"(?:^|\.)h\.\d+$",
    "Llama style (model.layers.N)": r"(?:^|\.)layers\.\d+$",
    "BERT style (encoder.layer.N)": r"(?:^|\.)encoder\.layer\.\d+$",
    "blocks.N": r"(?:^|\.)blocks\.\d+$",
}
_RESNET_BLOCKS = ("BasicBlock", "Bottleneck")


class DiagnoseError(ValueError):
    """Bad input to :func:`diagnose` (no sites, empty probe, NaN loss, family misfit)."""


class CheckpointError(DiagnoseError):
    """A checkpoint cannot be read or belongs to another configuration."""


# ----------------------------------------------------------------------------- sites
def infer_layout(shape: Sequence[int]) -> str:
    """Layout of a site from its per-example shape: ``(d,)`` vector, ``(T, d)`` sequence,
    ``(C, H, W)`` image.

    Raises:
        DiagnoseError: for other ranks.
    """
    layouts = {1: "vector", 2: "sequence", 3: "image"}
    if len(shape) not in layouts:
        raise DiagnoseError(
            f"cannot infer a site layout from per-example shape {tuple(shape)}; expected (d,), (T, d) or (C, H, W)"
        )
    return layouts[len(shape)]


def _first_tensor(obj):
    if isinstance(obj, Tensor):
        return obj
    if isinstance(obj, (tuple, list)) and obj and isinstance(obj[0], Tensor):
        return obj[0]
    for key in ("last_hidden_state", "hidden_states"):
        val = getattr(obj, key, None)
        if isinstance(val, Tensor):
            return val
    return None


def _call(model: nn.Module, x):
    return model(**x) if isinstance(x, Mapping) else model(x)


def discover_sites(model: nn.Module, example=None) -> list[str]:
    """Residual-stream sites of a model, in depth (execution) order.

    Rules, first match wins:

    1. ``model.site_names()`` when the model has it (:mod:`depthsat_theory.tasks.models`).
    2. Module names matching :data:`SITE_PATTERNS`: torchvision ResNet blocks
       ``layerN.M`` of type ``BasicBlock``/``Bottleneck`` (else the stages ``layerN``),
       GPT-style ``transformer.h.N``, Llama ``model.layers.N``, BERT
       ``encoder.layer.N``, ``blocks.N``.  With ``example`` (one probe input batch),
       one no-grad forward checks that each candidate runs exactly once and outputs
       a floating ``(B, *shape)`` tensor (tuple outputs: the first element) of the
       residual-stream shape: for transformer-style names the output must have the
       shape of the block's input; ResNet blocks/stages may change the shape.
       Candidates failing the check are dropped and the rest are ordered by
       execution.

    Args:
        model: any ``nn.Module``.
        example: optional probe inputs (a tensor, a tuple whose first element is
            the input, or a dict of keyword inputs) for the shape check.

    Returns:
        Site names usable with :class:`~depthsat_theory.capture.sites.SiteRecorder`.

    Raises:
        DiagnoseError: if no site is found.
    """
    if callable(getattr(model, "site_names", None)):
        names = list(model.site_names())
        if names:
            return names
    mods = dict(model.named_modules())
    found: list[str] = []
    kinds: dict[str, str] = {}
    blocks = [
        n
        for n in mods
        if re.search(SITE_PATTERNS["torchvision ResNet block (layerN.M)"], n)
        and type(mods[n]).__name__ in _RESNET_BLOCKS
    ]
    if blocks:
        found, kinds = blocks, dict.fromkeys(blocks, "resnet")
    else:
        stages = [n for n in mods if re.search(SITE_PATTERNS["ResNet stage (layerN)"], n)]
        if stages:
            found, kinds = stages, dict.fromkeys(stages, "resnet")
        for label, pat in SITE_PATTERNS.items():
            if "ResNet" in label:
                continue
            for n in mods:
                if n not in kinds and re.search(pat, n):
                    found.append(n)
                    kinds[n] = "stream"
    # drop candidates nested inside another candidate (e.g. blocks.0.h.1)
    found = [n for n in found if not any(n != o and n.startswith(o + ".") for o in found)]
    if example is not None and found:
        found = _check_shapes(model, found, kinds, example)
    if not found:
        raise DiagnoseError(
            f"no residual-stream sites found in {type(model).__name__}: no module named like "
            f"{', '.join(SITE_PATTERNS)} with a residual-stream output; pass the module names "
            f"explicitly (sites=[...] / --sites a,b)"
        )
    return found


def _check_shapes(model: nn.Module, names: list[str], kinds: dict, example) -> list[str]:
    mods = dict(model.named_modules())
    seen: dict[str, list] = {n: [] for n in names}
    order: list[str] = []
    x = example[0] if isinstance(example, (tuple, list)) else example

    def make(name):
        def hook(module, args, kwargs, output):
            inp = next((a for a in chain(args, kwargs.values()) if isinstance(a, Tensor)), None)
            out = _first_tensor(output)
            seen[name].append(
                (
                    None if inp is None else tuple(inp.shape),
                    None if out is None or not out.is_floating_point() else tuple(out.shape),
                )
            )
            if name not in order:
                order.append(name)

        return hook

    handles = [mods[n].register_forward_hook(make(n), with_kwargs=True) for n in names]
    try:
        with torch.no_grad():
            _call(model, x)
    finally:
        for h in handles:
            h.remove()
    batch = _batch_size(x)
    keep = []
    for n in order:
        if len(seen[n]) != 1:
            continue
        inp, out = seen[n][0]
        if out is None or len(out) < 2 or len(out) > 4 or out[0] != batch:
            continue
        if kinds[n] == "stream" and inp != out:
            continue
        keep.append(n)
    return keep


def _adapt_length(acc, site: str, z: Tensor, index: int) -> None:
    """Let a row-wise family's accumulator take a sequence site of another length ``T``.

    Probes padded per batch have a different ``T`` in every batch.  The statistics of a
    row-wise family (``unit = "row"``) are sums over rows and do not depend on ``T``, so
    only the accumulator's shape check is moved; anything else is an error.
    """
    new = tuple(int(v) for v in z.shape[1:])
    if acc.layout == "sequence" and acc.family.unit == "row" and len(new) == 2 and new[-1] == acc.shape[-1]:
        acc.shape = new
        return
    raise DiagnoseError(
        f"probe batch {index}: site {site!r} has per-example shape {new}, earlier batches had "
        f"{acc.shape}; only row-wise families at sequence sites accept a length that changes "
        f"between batches (family {acc.family.spec!r}, layout {acc.layout!r}): pad the probe "
        f"to one shape"
    )


def _unpack(batch, mask_fn):
    """``(inputs, targets, mask or None)`` from a probe batch."""
    if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
        raise DiagnoseError(
            f"a probe batch must be (inputs, targets) or (inputs, targets, mask), got "
            f"{type(batch).__name__}" + (f" of length {len(batch)}" if hasattr(batch, "__len__") else "")
        )
    x, y = batch[0], batch[1]
    mask = batch[2] if len(batch) == 3 else (mask_fn(x, y) if mask_fn is not None else None)
    if mask is None and isinstance(x, Mapping) and isinstance(x.get("attention_mask"), Tensor):
        mask = x[
            "attention_mask"
        ]  # Hugging Face keyword inputs: padding is excluded (theory/definitions.md, def-setting)
    if mask is not None:
        mask = torch.as_tensor(mask).bool()
        if mask.dim() != 2:
            raise DiagnoseError(f"the padding mask must be (B, T) bool, got shape {tuple(mask.shape)}")
    return x, y, mask


def _batch_size(x) -> int:
    if isinstance(x, Tensor):
        return int(x.shape[0])
    if isinstance(x, dict):
        return _batch_size(next(iter(x.values())))
    return _batch_size(x[0])


# ----------------------------------------------------------------------------- results
@dataclass
class SiteDiagnosis:
    """The diagnosis of one site.

    Attributes:
        site: module name.
        depth: position in depth order (0 = first site).
        layout: ``"vector"``, ``"sequence"`` or ``"image"``; ``shape``: per-example shape.
        result: the :class:`~depthsat_theory.statistics.tangent.SaturationResult` (``score`` =
            ``s``, ``relative_score`` = ``s / AG_rms``, ``raw_score`` = ``r̂``,
            ``realizability_defect`` = ``ρ̂``, ``ag_rms``, ``ag_max``, ``tangent_rank``…;
            nats per example per unit function-space step).
        interval: the ``(1 − δ)`` :class:`~depthsat_theory.bounds.core.ScoreInterval`, or ``None``.
    """

    site: str
    depth: int
    layout: str
    shape: tuple
    result: SaturationResult
    interval: object | None = None

    @property
    def verdict(self) -> str:
        """``degenerate``, ``saturated (rounding)``, the interval's certificate, or ``improvable``."""
        if self.result.degenerate:
            return "degenerate (T = {0})"
        if self.result.saturated:
            return "saturated (within rounding)"
        if self.interval is not None:
            return self.interval.certificate
        return "s > 0 (improvable on the probe)"

    def to_dict(self) -> dict:
        """JSON-ready dictionary."""
        return {
            "site": self.site,
            "depth": self.depth,
            "layout": self.layout,
            "shape": list(self.shape),
            "verdict": self.verdict,
            **self.result.to_dict(),
            "interval": None if self.interval is None else self.interval.to_dict(),
        }


@dataclass
class Diagnosis:
    """The diagnosis of a network: one :class:`SiteDiagnosis` per site, in depth order.

    Attributes:
        sites: per-site results.
        family: family spec.
        n: probe examples; ``batches``: probe batches consumed (all ranks).
        loss: mean probe loss ``J`` (nats per example).
        delta: ``δ`` of the intervals (``None``: none).
        realizability: whether ``r̂`` and ``ρ̂`` were computed (tie pooling).
        world_size: processes that shared the probe.
        resumed_from: batches restored from a checkpoint (``0``: fresh run).
        description: free text (model name, probe).
        notes: caveats printed with the table.
    """

    sites: list[SiteDiagnosis]
    family: str
    n: int
    batches: int
    loss: float
    delta: float | None = None
    realizability: bool = False
    world_size: int = 1
    resumed_from: int = 0
    description: str = ""
    notes: list[str] = field(default_factory=list)
    loss_units: str = "nats per example"

    def __getitem__(self, site: str) -> SiteDiagnosis:
        for s in self.sites:
            if s.site == site:
                return s
        raise KeyError(site)

    def to_dict(self) -> dict:
        """JSON-ready dictionary (``nan`` becomes ``None``)."""
        return {
            "description": self.description,
            "family": self.family,
            "n": self.n,
            "batches": self.batches,
            "loss": _finite(self.loss),
            "loss_units": self.loss_units,
            "score_units": f"{self.loss_units} per unit function-space step",
            "delta": self.delta,
            "realizability": self.realizability,
            "world_size": self.world_size,
            "resumed_from": self.resumed_from,
            "notes": list(self.notes),
            "sites": [s.to_dict() for s in self.sites],
        }

    def write_json(self, path: str | os.PathLike) -> None:
        """Write :meth:`to_dict` as JSON atomically (temp file, fsync, rename).

        Raises:
            OSError: if the folder is not writable (no partial file is left).
        """
        data = json.dumps(self.to_dict(), indent=1, ensure_ascii=False, allow_nan=False).encode()
        atomic_write(Path(path), lambda fh: fh.write(data), binary=True)

    def table(self):
        """A :class:`rich.table.Table` of the per-site quantities."""
        from rich.table import Table

        t = Table(
            title=f"depthsat diagnose: {self.description or 'model'}, family {self.family}, "
            f"n = {self.n}, J = {self.loss:.4g} ({self.loss_units})"
        )
        cols = ["#", "site", "shape", "s", "s/AG_rms", "AG_rms", "AG_max", "rank/p"]
        if self.realizability:
            cols += ["r̂", "ρ̂"]
        if self.delta is not None:
            cols += [f"{1 - self.delta:g} interval"]
        cols += ["verdict"]
        for c in cols:
            t.add_column(c, justify="left" if c in ("site", "verdict") else "right", no_wrap=c != "verdict")
        for sd in self.sites:
            r = sd.result
            row = [
                str(sd.depth),
                sd.site,
                "×".join(map(str, sd.shape)),
                _g(r.score),
                _g(r.relative_score),
                _g(r.ag_rms),
                _g(r.ag_max),
                f"{r.tangent_rank}/{r.tangent_dim}",
            ]
            if self.realizability:
                row += [_g(r.raw_score), _g(r.realizability_defect)]
            if self.delta is not None:
                iv = sd.interval
                row += ["—" if iv is None else f"[{_g(iv.score_lower)}, {_g(iv.score_upper)}]"]
            row += [_SHORT.get(sd.verdict, sd.verdict)]
            t.add_row(*row)
        return t

    def plot(self, path: str | os.PathLike) -> list[Path]:
        """Plot ``s`` (with the interval when present) and ``s / AG_rms`` against depth.

        Writes ``<path>.png`` and ``<path>.svg`` (a ``.png``/``.svg`` suffix of
        ``path`` is replaced) with matplotlib's Agg canvas (no display needed).

        Returns:
            The two paths written.
        """
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        base = Path(path)
        if base.suffix.lower() in (".png", ".svg"):
            base = base.with_suffix("")
        xs = np.arange(len(self.sites))
        s = np.array([sd.result.score for sd in self.sites])
        rel = np.array([sd.result.relative_score for sd in self.sites])
        rms = np.array([sd.result.ag_rms for sd in self.sites])
        fig = Figure(figsize=(max(6.0, 0.5 * len(xs) + 3), 6.5))
        FigureCanvasAgg(fig)
        ax1, ax2 = fig.subplots(2, 1, sharex=True)
        ax1.plot(xs, s, "o-", label="s = ‖Πg‖")
        ax1.plot(xs, rms, "s--", alpha=0.6, label="AG_rms (upper bound of s)")
        ivs = [sd.interval for sd in self.sites]
        if any(iv is not None and not iv.vacuous for iv in ivs):  # vacuous ones are [0, γ]: not drawn
            lo = np.array([np.nan if iv is None or iv.vacuous else iv.score_lower for iv in ivs])
            hi = np.array([np.nan if iv is None or iv.vacuous else iv.score_upper for iv in ivs])
            ax1.fill_between(xs, lo, hi, alpha=0.2, label=f"{1 - self.delta:g} interval (non-vacuous)")
        ax1.set_ylabel("score s", fontsize=9)
        width = max(60, int(fig.get_figwidth() * 11))  # characters per title line at 9 pt
        title = (
            f"{self.description or 'model'}: family {self.family}, n = {self.n}; "
            f"s in {self.loss_units} per unit function-space step"
        )
        ax1.set_title(textwrap.fill(title, width), fontsize=9)
        ax1.legend(fontsize=8)
        ax2.plot(xs, rel, "o-", color="C2")
        ax2.set_ylim(0, 1.05)
        ax2.set_ylabel("s / AG_rms (scale-free)")
        ax2.set_xlabel("site (depth order)")
        ax2.set_xticks(xs)
        ax2.set_xticklabels([sd.site for sd in self.sites], rotation=45, ha="right", fontsize=8)
        fig.tight_layout()
        out = []
        for ext in (".png", ".svg"):
            target = base.with_name(base.name + ext)
            atomic_write(target, lambda fh, e=ext: fig.savefig(fh, format=e[1:]), binary=True)
            out.append(target)
        return out


_SHORT = {
    "certified improvable": "cert. improvable",
    "certified ε-saturated": "cert. ε-saturated",
    "not certified": "not certified",
    "degenerate (T = {0})": "degenerate",
    "saturated (within rounding)": "saturated",
    "s > 0 (improvable on the probe)": "s > 0",
}


def _g(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    return f"{v:.3g}"


def _finite(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


# ----------------------------------------------------------------------------- state
_SUM_TENSORS = ("sigma", "cross", "k_mat", "b")
_SUM_SCALARS = ("n", "units", "g_sq", "z_sq")
_MAX_SCALARS = ("g_max", "feat_sq_max")
_DTYPES = {None: 0, torch.float64: 1, torch.float32: 2}
_DTYPES_INV = {v: k for k, v in _DTYPES.items()}


def _sum_parts(acc) -> list[tuple[str, Tensor]]:
    parts = [(k, getattr(acc, k).detach().to("cpu", torch.float64)) for k in _SUM_TENSORS if hasattr(acc, k)]
    if hasattr(acc, "q_sum"):
        parts.append(("q_sum", torch.from_numpy(np.asarray(acc.q_sum, dtype=np.float64))))
    parts += [(k, torch.tensor([float(getattr(acc, k))], dtype=torch.float64)) for k in _SUM_SCALARS]
    return parts


def _max_parts(acc) -> list[tuple[str, Tensor]]:
    parts = [(k, torch.tensor([float(getattr(acc, k))], dtype=torch.float64)) for k in _MAX_SCALARS if hasattr(acc, k)]
    parts.append(("dtype", torch.tensor([float(_DTYPES[acc.dtype])], dtype=torch.float64)))
    return parts


def _set_part(acc, key: str, val: Tensor) -> None:
    if key in _SUM_TENSORS:
        old = getattr(acc, key)
        setattr(acc, key, val.reshape(old.shape).to(old.device, torch.float64).clone())
    elif key == "q_sum":
        acc.q_sum = val.reshape(acc.q_sum.shape).numpy().copy()
    elif key in ("n", "units"):
        setattr(acc, key, round(float(val.reshape(-1)[0])))
    elif key == "dtype":
        acc.dtype = _DTYPES_INV[round(float(val.reshape(-1)[0]))]
    else:
        setattr(acc, key, float(val.reshape(-1)[0]))


def _ties_state(acc) -> dict[str, Tensor]:
    if not acc._ties:
        return {}
    vals = list(acc._ties.values())
    return {
        "ties.sums": torch.stack([s for s, _, _ in vals]).contiguous(),
        "ties.counts": torch.tensor([c for _, c, _ in vals], dtype=torch.int64),
        "ties.units": torch.stack([u for _, _, u in vals]).contiguous(),
    }


def _add_ties(acc, sums: Tensor, counts: Tensor, units: Tensor) -> None:
    for j in range(units.shape[0]):
        key = (units[j] + 0.0).numpy().tobytes()
        slot = acc._ties.get(key)
        if slot is None:
            acc._ties[key] = [sums[j].clone(), int(counts[j].item()), units[j].clone()]
        else:
            slot[0] += sums[j]
            slot[1] += int(counts[j].item())


# ----------------------------------------------------------------------------- checkpoints
def _model_fingerprint(model: nn.Module) -> dict:
    with torch.no_grad():
        params = list(model.parameters())
        total = sum(float(p.detach().to(torch.float64).abs().sum()) for p in params)
    return {
        "class": type(model).__name__,
        "parameters": int(sum(p.numel() for p in params)),
        "abs_sum": f"{total:.12e}",
    }


def read_checkpoint(path: str | os.PathLike) -> tuple[dict, dict[str, Tensor]]:
    """Read a diagnose checkpoint: its JSON header and its tensors.

    The header has ``config`` (what must match to resume), ``batches`` (global batch
    index of the next batch to process: batches ``< batches`` are in the sums),
    ``examples`` (this rank's examples in the sums), ``shapes`` and ``complete``.

    Raises:
        CheckpointError: if the file is not a readable diagnose checkpoint.
    """
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    try:
        with safe_open(os.fspath(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: not a readable safetensors file ({exc})") from None
    if "depthsat_diagnose" not in meta:
        raise CheckpointError(f"checkpoint {path}: not a depthsat diagnose checkpoint")
    return json.loads(meta["depthsat_diagnose"]), tensors


def _write_checkpoint(path: Path, header: dict, stats: dict, loss: list) -> None:
    from safetensors.torch import save

    tensors: dict[str, Tensor] = {"loss": torch.tensor(loss, dtype=torch.float64)}
    for site, acc in stats.items():
        for k, v in _sum_parts(acc) + _max_parts(acc):
            tensors[f"{site}/{k}"] = v.contiguous()
        for k, v in _ties_state(acc).items():
            tensors[f"{site}/{k}"] = v
    blob = save(tensors, metadata={"depthsat_diagnose": json.dumps(header, sort_keys=True)})
    atomic_write(path, lambda fh: fh.write(blob), binary=True)


def _restore(stats: dict, tensors: dict[str, Tensor]) -> None:
    for site, acc in stats.items():
        for k, _ in _sum_parts(acc) + _max_parts(acc):
            _set_part(acc, k, tensors[f"{site}/{k}"])
        if f"{site}/ties.units" in tensors:
            _add_ties(acc, tensors[f"{site}/ties.sums"], tensors[f"{site}/ties.counts"], tensors[f"{site}/ties.units"])


def _config_diff(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


# ----------------------------------------------------------------------------- diagnose
def diagnose(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    batches: Iterable[tuple],
    *,
    sites: Sequence[str] | None = None,
    family: str | ResidualFamily = "linear",
    delta: float | None = None,
    realizability: bool = False,
    progress: Callable[[int, int | None], None] | None = None,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int = 1,
    layout: str | dict | None = None,
    total: int | None = None,
    config: dict | None = None,
    description: str = "",
    bound_kwargs: dict | None = None,
    reduction: str = "none",
    mask_fn: Callable | None = None,
    output_key=None,
    batchnorm: str = "error",
    loss_units: str = "nats per example",
) -> Diagnosis:
    """Saturation diagnosis of every site of ``model`` on a probe, in one pass per batch.

    For each batch ``(x, y)`` the model runs forward once with every site hooked
    (:class:`~depthsat_theory.capture.sites.SiteRecorder`), the per-example losses
    ``loss_fn(model(x), y)`` (shape ``(B,)``, nats per example) are summed and
    backpropagated once to all sites, and each site's float64 accumulator
    (:func:`~depthsat_theory.statistics.tangent.statistics_for`, or
    :class:`~depthsat_theory.bounds.core.BoundStatistics` with ``delta``) adds the batch.
    No parameter gradients are formed.

    Args:
        model: the reference network (put BatchNorm models in eval mode).
        loss_fn: per-example losses ``(B,)``; a batch-mean reduction would rescale
            ``g`` by ``1/B`` (theory/definitions.md, def-setting), so it is rejected by the shape check.
        batches: iterable of ``(inputs, targets)`` in a fixed order (resuming and
            sharding address batches by their index).  Inputs may be a tensor or a
            dict of keyword tensors.
        sites: module names; default :func:`discover_sites` (shape check on the
            first batch: one extra no-grad forward, only when the model has no
            ``site_names()``).
        family: a :class:`~depthsat_theory.families.base.ResidualFamily` or a spec string
            (:func:`~depthsat_theory.families.base.parse_family`), the same at every site.
        delta: ``δ ∈ (0, 1)``: add the ``(1 − δ)`` interval (zero-output feature
            families only), union-bounded over the sites (``candidates = len(sites)``).
        realizability: pool exactly equal units to report ``r̂`` and ``ρ̂``
            (memory grows with the number of distinct units).
        progress: called after each processed batch with ``(batches done on this
            rank, total or None)``.
        checkpoint: path of a checkpoint file (see :func:`read_checkpoint`); resumed
            from when it exists and matches, rewritten atomically every
            ``checkpoint_every`` batches and at the end.  Under ``torchrun`` each rank
            uses ``<path>.rank<r>-of-<N>``.
        checkpoint_every: batches between checkpoint writes.
        layout: a layout for all sites, or ``{site: layout}``; default: the model's
            ``layout`` attribute, else inferred from the site tensor's rank.
        total: the number of batches (for ``progress``; default ``len(batches)`` when
            available).
        config: extra JSON-serialisable configuration that must match to resume
            (e.g. the CLI's model name and batch size).
        description: free text stored in the result.
        bound_kwargs: passed to :meth:`~depthsat_theory.bounds.core.BoundStatistics.interval`
            (``grad_max``, ``leverage_max``, ``epsilon``, …).
        reduction: how ``loss_fn`` reduces (:data:`~depthsat_theory.capture.sites.REDUCTIONS`):
            ``"none"`` per-example ``(B,)``; ``"sum"``/``"mean"`` a scalar over the batch
            (``mean`` is multiplied by ``B``); ``"token_mean"`` per-token ``(B, T)``
            losses averaged over each example's own non-padded tokens.  ``g`` is always
            the gradient of each example's own loss (as in
            :func:`~depthsat_theory.capture.sites.accumulate`).
        mask_fn: ``mask_fn(inputs, targets) -> (B, T)`` bool padding mask (``True`` at
            real tokens) for batches without one; batches may also be
            ``(inputs, targets, mask)``.  Padded rows are dropped from the statistics of
            sequence sites and must have ``g = 0``.  Default for dict (Hugging Face)
            inputs: their ``attention_mask``.
        output_key, batchnorm: as in :class:`~depthsat_theory.capture.sites.SiteRecorder`.
        loss_units: units of the per-example loss, for the outputs (scores are in
            these units per unit function-space step).

    Returns:
        A :class:`Diagnosis` (the same on every rank under ``torchrun``).

    Raises:
        DiagnoseError: no discoverable sites, an empty probe, a NaN/Inf loss, losses of
            the wrong shape, a site the family does not fit, ``delta`` with a
            non-feature family.
        CheckpointError: a checkpoint of another configuration or an unreadable one.
        SiteError: an unknown site name, or a site that runs other than once.
    """
    from depthsat_theory.bounds import BoundStatistics, check_delta

    fam = parse_family(family) if isinstance(family, str) else family
    if delta is not None:
        delta = check_delta(delta)
        if not isinstance(fam, FeatureFamily):
            raise DiagnoseError(
                f"--delta needs a zero-output feature family; {fam.spec!r} is a general family (no finite-sample bound)"
            )
    if reduction not in REDUCTIONS:
        raise DiagnoseError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    if checkpoint_every < 1:
        raise DiagnoseError("checkpoint_every must be >= 1")
    rank, world = _dist.world()
    if total is None and hasattr(batches, "__len__"):
        total = len(batches)
    it = iter(batches)
    try:
        first = next(it)
    except StopIteration:
        raise DiagnoseError("the probe is empty (no batches)") from None
    it = chain([first], it)
    if sites is None:
        sites = discover_sites(model, _unpack(first, None)[0])
    sites = list(sites)
    if not sites:
        raise DiagnoseError("no sites to diagnose (an empty site list)")
    if len(set(sites)) != len(sites):
        raise DiagnoseError(f"duplicate site names in {sites}")
    for s in sites:  # unknown names fail before any work
        SiteRecorder(model, [s])
    model_layout = getattr(model, "layout", None)
    if not (isinstance(model_layout, str) and model_layout in ("vector", "sequence", "image")):
        model_layout = None
    layouts = dict(layout) if isinstance(layout, dict) else dict.fromkeys(sites, layout or model_layout)
    cfg = {
        "version": CHECKPOINT_VERSION,
        "sites": sites,
        "family": fam.spec,
        "delta": delta,
        "realizability": bool(realizability),
        "reduction": reduction,
        "world_size": world,
        "rank": rank,
        "layouts": {s: layouts.get(s) for s in sites},
        "model": _model_fingerprint(model) if checkpoint is not None else None,
        "user": config or {},
    }
    ckpt = None
    if checkpoint is not None:
        ckpt = Path(checkpoint)
        if world > 1:
            ckpt = ckpt.with_name(f"{ckpt.name}.rank{rank}-of-{world}")
        if ckpt.is_dir():
            raise CheckpointError(f"checkpoint {ckpt} is a directory; give a file path")
        if not ckpt.resolve().parent.is_dir():
            raise CheckpointError(f"checkpoint folder {ckpt.resolve().parent} does not exist")

    stats: dict = {}
    shapes: dict[str, tuple] = {}

    def make_stats(shape_map: dict) -> None:
        for s in sites:
            shp = tuple(shape_map[s])
            lay = layouts.get(s) or infer_layout(shp)
            layouts[s] = lay
            try:
                if delta is not None:
                    stats[s] = BoundStatistics(fam, shp, lay, pool_ties=realizability)
                else:
                    stats[s] = statistics_for(fam, shp, lay, pool_ties=realizability)
            except FamilyError as exc:
                raise DiagnoseError(f"site {s!r} ({lay}, per-example shape {shp}): {exc}") from None
            shapes[s] = shp

    loss = [0.0, 0.0]  # sum of per-example losses, number of examples (this rank)
    start = 0
    if ckpt is not None and ckpt.exists():
        header, tensors = read_checkpoint(ckpt)
        diff = _config_diff(header.get("config", {}), json.loads(json.dumps(cfg)))
        if diff:
            raise CheckpointError(
                f"checkpoint {ckpt} was written for another configuration (differs in: "
                f"{', '.join(diff)}); delete it or pass another --checkpoint path"
            )
        start = int(header["batches"])
        if header.get("shapes"):
            make_stats(header["shapes"])
            _restore(stats, tensors)
            loss = [float(v) for v in tensors["loss"]]
    resumed_from = start
    todo = None if total is None else sum(1 for i in range(start, total) if i % world == rank)
    done = 0
    index = -1
    since = 0

    def save(complete: bool) -> None:
        if ckpt is None:
            return
        header = {
            "config": cfg,
            "batches": index + 1 if index >= start else start,
            "examples": int(loss[1]),
            "complete": complete,
            "shapes": {s: list(v) for s, v in shapes.items()},
        }
        _write_checkpoint(ckpt, header, stats, loss)

    with SiteRecorder(model, sites, output_key=output_key, batchnorm=batchnorm) as rec:
        for index, batch in enumerate(it):
            if index < start or index % world != rank:
                continue
            x, y, mask = _unpack(batch, mask_fn)
            bsz = _batch_size(x)
            rec.reset()
            raw = loss_fn(_call(model, x), y)
            if reduction == "none":
                if not isinstance(raw, Tensor) or raw.dim() != 1 or raw.shape[0] != bsz:
                    shp = tuple(raw.shape) if isinstance(raw, Tensor) else type(raw).__name__
                    raise DiagnoseError(
                        f"loss_fn must return per-example losses of shape (B,) = ({bsz},), got {shp} "
                        f"(a mean over the batch rescales g by 1/B: pass reduction='mean')"
                    )
                if not torch.isfinite(raw.detach()).all():
                    bad = int((~torch.isfinite(raw.detach())).sum())
                    raise DiagnoseError(
                        f"the loss is NaN or Inf for {bad} example(s) of probe batch {index}; "
                        f"cannot take gradients (check the inputs and the model's dtype)"
                    )
                scalar, batch_total = raw.sum(), float(raw.detach().to(torch.float64).sum())
            else:
                try:
                    scalar, batch_total = reduce_losses(raw, reduction, bsz, mask)
                except ValueError as exc:
                    raise DiagnoseError(f"probe batch {index}: {exc}") from None
            rec.backward(scalar)
            if not stats:
                make_stats({s: tuple(rec.z[s].shape[1:]) for s in sites})
            try:
                for s in sites:
                    if tuple(rec.z[s].shape[1:]) != stats[s].shape:
                        _adapt_length(stats[s], s, rec.z[s], index)
                        shapes[s] = tuple(max(a, b) for a, b in zip(shapes[s], stats[s].shape, strict=False))
                    update_statistics(stats[s], rec.z[s], rec.g[s], mask, s)
            except (StatisticsError, SiteError) as exc:
                raise DiagnoseError(f"probe batch {index}: {exc}") from None
            loss[0] += batch_total
            loss[1] += float(bsz)
            done += 1
            since += 1
            if since >= checkpoint_every:
                save(False)
                since = 0
            if progress is not None:
                progress(done, todo)
    n_batches = index + 1
    if start > n_batches:
        raise CheckpointError(
            f"checkpoint {ckpt} already holds {start} batches but this probe has only "
            f"{n_batches}; pass the same probe (e.g. the same --batches) or another path"
        )
    if stats:
        save(True)

    # ---- distributed reduction (a no-op in one process)
    if world > 1:
        metas = _dist.all_gather_objects({s: list(v) for s, v in shapes.items()} if stats else None)
        meta = next((m for m in metas if m), None)
        if meta is None:
            raise DiagnoseError("the probe is empty (no examples on any rank)")
        if not stats:
            make_stats(meta)
        sum_parts = [(s, k, v) for s in sites for k, v in _sum_parts(stats[s])]
        max_parts = [(s, k, v) for s in sites for k, v in _max_parts(stats[s])]
        svec = torch.cat([v.reshape(-1) for _, _, v in sum_parts] + [torch.tensor(loss, dtype=torch.float64)])
        mvec = torch.cat([v.reshape(-1) for _, _, v in max_parts])
        svec, mvec = _dist.allreduce(svec, mvec)
        for parts, vec in ((sum_parts, svec), (max_parts, mvec)):
            off = 0
            for s, k, v in parts:
                _set_part(stats[s], k, vec[off : off + v.numel()])
                off += v.numel()
        loss = [float(svec[-2]), float(svec[-1])]
        if realizability:
            gathered = _dist.all_gather_objects({s: _ties_state(stats[s]) for s in sites})
            for s in sites:
                stats[s]._ties = {}
                for per_rank in gathered:
                    if per_rank[s]:
                        _add_ties(
                            stats[s], per_rank[s]["ties.sums"], per_rank[s]["ties.counts"], per_rank[s]["ties.units"]
                        )
    if not stats or loss[1] == 0:
        raise DiagnoseError("the probe is empty (no examples)")

    out: list[SiteDiagnosis] = []
    bk = dict(bound_kwargs or {})
    bk.setdefault("candidates", len(sites))
    for depth, s in enumerate(sites):
        res = stats[s].result()
        iv = stats[s].interval(delta, **bk) if delta is not None else None
        out.append(SiteDiagnosis(s, depth, layouts[s], shapes[s], res, iv))
    notes = [(f"scores in {loss_units} per unit function-space step; not comparable across sites (compare s/AG_rms)")]
    if realizability:
        notes.append(
            "r̂ and ρ̂ pool exactly equal units only: exact on finite/discrete populations, "
            "biased upward for continuous units (r̂ → AG_rms)"
        )
    if delta is not None:
        notes.append(
            f"intervals union-bounded over {bk['candidates']} sites; constants not given are "
            f"probe plug-ins (lower bounds of the essential suprema), so the coverage is not "
            f"guaranteed unless they were supplied"
        )
    return Diagnosis(
        sites=out,
        family=fam.spec,
        n=int(loss[1]),
        batches=n_batches,
        loss=loss[0] / loss[1],
        delta=delta,
        realizability=bool(realizability),
        world_size=world,
        resumed_from=resumed_from,
        description=description,
        notes=notes,
        loss_units=loss_units,
    )
