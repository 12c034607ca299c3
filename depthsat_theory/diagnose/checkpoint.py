"""Diagnose checkpoints: the statistics' state dicts in one safetensors file with a JSON header.

A checkpoint holds, for every statistic ``key`` (a site, or :data:`LOSS_KEY` for the
loss total), the tensors of
:meth:`~depthsat_theory.statistics.StreamingStatistic.state_dict` under ``"<key>/<name>"``,
and a JSON header (metadata key ``depthsat_diagnose``) with the configuration that must
match to resume, the number of batches consumed, the site shapes and a completion flag.
Files are written atomically (no pickle).

The header also holds a fingerprint of the probe stream consumed so far
(:class:`ProbeStream`: the number of batches, the size and a cheap digest of the first and
last of them, and a digest chained over all of them), so that resuming with another
batching or another probe is refused instead of silently counting examples twice.

Every field read back is validated (:func:`validate_header`, :func:`restore_statistics`):
a damaged or tampered file (bad JSON, a missing, extra, misshapen, mistyped or non-finite
tensor, counts that disagree, a truncated file) is a one-line :class:`CheckpointError`
naming the field.

The header also holds everything else a verdict depends on that is not a statistic's state: the
kink tie counts of the batches in the sums (``kink_ties``, ``{site: count}``, ``null`` when kinks are
not counted), so a resumed run counts them over the whole probe and reaches the verdict of an
uninterrupted one (a positive count makes it ``undetermined``, ``thm-gradient``).

Format versions: ``1`` (before the statistics protocol: hand-listed fields, a ``dtype``
code), ``2`` (no probe fingerprint) and ``3`` (no kink tie counts: a resumed run would miss the
ties of the restored batches and could call *improvable* what is *undetermined*) are refused with
a one-line :class:`CheckpointError`; ``4`` is the current one.

A run streamed until decided (``until_decided``) also stores its anytime tests' state under
``"@anytime:<site>/<name>"`` and the probe batch of each decision in the header field ``anytime``
(:func:`restore_anytime`); its configuration carries an ``until_decided`` object, so such a checkpoint
and one of a whole-probe run never resume each other (the format version is unchanged: version-4
files of whole-probe runs stay valid).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from depthsat_theory.diagnose.errors import CheckpointError
from depthsat_theory.io import atomic_write
from depthsat_theory.statistics import StreamingStatistic, TangentStatistics, TiePool

__all__ = [
    "CHECKPOINT_VERSION",
    "LOSS_KEY",
    "ProbeStream",
    "batch_digest",
    "check_version",
    "config_diff",
    "model_fingerprint",
    "read_checkpoint",
    "restore_anytime",
    "restore_statistics",
    "validate_header",
    "write_checkpoint",
]

#: Version of the checkpoint format written by :func:`write_checkpoint`.
CHECKPOINT_VERSION = 4

#: Key of the loss-total statistic in a checkpoint (``@`` cannot start a module name).
LOSS_KEY = "@loss"


def model_fingerprint(model: nn.Module) -> dict:
    """Class name, parameter count and ``Σ|θ|`` (12 digits) of a model, to refuse resuming another one.

    Args:
        model: the model.

    Returns:
        ``{"class", "parameters", "abs_sum"}`` (``abs_sum`` a string, float64 sum in ``%.12e``).
    """
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

    The header has ``config`` (what must match to resume, including ``version``),
    ``batches`` (global batch index of the next batch to process: batches ``< batches``
    are in the sums), ``examples`` (this rank's examples in the sums), ``shapes`` and
    ``complete``.

    Args:
        path: the safetensors file.

    Returns:
        ``(header, tensors)``: the parsed header and ``{"<site>/<field>": tensor}``.

    Raises:
        CheckpointError: if the file is not a readable diagnose checkpoint.
    """
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    again = "; delete it or pass another checkpoint path to start over"
    try:
        with safe_open(os.fspath(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(
            f"checkpoint {path} is damaged or incompatible: not a readable safetensors file ({first}){again}"
        ) from None
    if "depthsat_diagnose" not in meta:
        raise CheckpointError(
            f"checkpoint {path} is not a depthsat diagnose checkpoint (no 'depthsat_diagnose' header){again}"
        )
    try:
        header = json.loads(meta["depthsat_diagnose"])
    except json.JSONDecodeError as exc:
        raise CheckpointError(
            f"checkpoint {path} is damaged or incompatible: its header is not valid JSON ({exc}){again}"
        ) from None
    if (
        not isinstance(header, dict)
        or not isinstance(header.get("config"), dict)
        or not isinstance(header.get("batches"), int)
        or not isinstance(header.get("shapes", {}), dict)
    ):
        raise CheckpointError(
            f"checkpoint {path} is damaged or incompatible: malformed header (needs a 'config' object, "
            f"an integer 'batches' and a 'shapes' object){again}"
        )
    return header, tensors


def check_version(path: str | os.PathLike, header: dict) -> None:
    """Refuse a checkpoint of another format version with a one-line :class:`CheckpointError`.

    Args:
        path: the checkpoint path (for the message).
        header: the header read by :func:`read_checkpoint`.

    Raises:
        CheckpointError: if ``header["config"]["version"]`` is not :data:`CHECKPOINT_VERSION`.
    """
    version = header.get("config", {}).get("version")
    if version != CHECKPOINT_VERSION:
        why = _OLD_FORMATS.get(version, "") if isinstance(version, int) else ""
        raise CheckpointError(
            f"checkpoint {path} has format version {version}, this depthsat reads version "
            f"{CHECKPOINT_VERSION} only{why}; delete it or pass another checkpoint path to start over"
        )


#: Why an old format cannot be resumed, for :func:`check_version`'s message.
_OLD_FORMATS = {3: " (version 3 does not carry the kink tie counts the verdict needs)"}


def write_checkpoint(path: Path, header: dict, stats: Mapping[str, StreamingStatistic]) -> None:
    """Write ``stats`` (key → statistic) and ``header`` atomically to ``path``.

    Args:
        path: the file to write (replaced atomically).
        header: the JSON header (stored as safetensors metadata).
        stats: the statistics; each state tensor is stored as ``"<key>/<field>"``.
    """
    from safetensors.torch import save

    tensors = {f"{key}/{name}": v.contiguous() for key, st in stats.items() for name, v in st.state_dict().items()}
    blob = save(tensors, metadata={"depthsat_diagnose": json.dumps(header, sort_keys=True)})
    atomic_write(path, lambda fh: fh.write(blob), binary=True)


def _damaged(path, field: str, what: str) -> CheckpointError:
    """The one-line error for a damaged or tampered checkpoint, naming the field."""
    return CheckpointError(
        f"checkpoint {path} is damaged or incompatible: {field} {what}; delete it or pass "
        f"another checkpoint path to start over"
    )


def _is_int(v: Any, low: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def validate_header(path: str | os.PathLike, header: dict, sites: list[str]) -> None:
    """Check the types of the header fields a resume reads (after :func:`check_version`).

    Args:
        path: the checkpoint, for messages.
        header: the header of :func:`read_checkpoint`.
        sites: the sites of this run (each must have a stored shape once batches were consumed).

    Raises:
        CheckpointError: naming the first field of the wrong type or value.
    """
    if not _is_int(header.get("batches")):
        raise _damaged(path, "header field 'batches'", f"is {header.get('batches')!r}, not an integer >= 0")
    if not _is_int(header.get("examples")):
        raise _damaged(path, "header field 'examples'", f"is {header.get('examples')!r}, not an integer >= 0")
    if not isinstance(header.get("complete"), bool):
        raise _damaged(path, "header field 'complete'", f"is {header.get('complete')!r}, not true/false")
    shapes = header.get("shapes", {})
    if header["batches"] > 0:
        for site in sites:
            shp = shapes.get(site)
            if not (isinstance(shp, list) and shp and all(_is_int(v, 1) for v in shp)):
                raise _damaged(path, f"header field 'shapes.{site}'", f"is {shp!r}, not a list of positive integers")
    ProbeStream.check_header(path, header.get("probe"))
    ties = header.get("kink_ties")
    if ties is not None and not (
        isinstance(ties, dict) and set(ties) == set(sites) and all(map(_is_int, ties.values()))
    ):
        raise _damaged(path, "header field 'kink_ties'", f"is {ties!r}, not a count >= 0 for each of the sites {sites}")


def _expected_tensors(key: str, st: StreamingStatistic) -> tuple[dict[str, Tensor], list[str]]:
    """``({tensor name: template}, [tie-pool prefixes])`` of one statistic's checkpoint entries."""
    fixed = {f"{key}/{name}": v for name, v in st.state_dict().items() if name in st.reductions()}
    pools = []
    for cname, child in st.variable_size_children().items():
        if isinstance(child, TiePool):
            pools.append(f"{key}/{cname}.")
        else:  # a child merged by gathering whose tensors still have fixed shapes (the TSQR factor)
            fixed.update({f"{key}/{cname}.{name}": v for name, v in child.state_dict().items()})
    return fixed, pools


def _check_tensor(path, name: str, val: Tensor, dtype: torch.dtype, shape: tuple | None) -> None:
    if val.dtype != dtype:
        raise _damaged(
            path,
            f"tensor {name!r}",
            f"has dtype {str(val.dtype).replace('torch.', '')}, expected {str(dtype).replace('torch.', '')}",
        )
    if shape is not None and tuple(val.shape) != shape:
        raise _damaged(path, f"tensor {name!r}", f"has shape {tuple(val.shape)}, expected {shape}")
    if val.is_floating_point() and not bool(torch.isfinite(val).all()):
        raise _damaged(path, f"tensor {name!r}", "holds NaN or Inf")


def _unit_width(st: StreamingStatistic) -> int | None:
    """Width of a tie-pooled unit: the row dimension, or the whole per-example tensor (``None``: unknown)."""
    if not isinstance(st, TangentStatistics):
        return None
    if st.family.unit == "tensor":
        return math.prod(st.shape)
    return int(st.shape[0] if st.layout == "image" else st.shape[-1])


def _check_pool(path, prefix: str, st: StreamingStatistic, tensors: Mapping[str, Tensor]) -> None:
    """A tie pool's ``units`` ``(M, a)``, ``sums`` ``(M, a)`` float64 and ``counts`` ``(M,)`` int64 ≥ 1."""
    names = [f"{prefix}{n}" for n in ("units", "sums", "counts")]
    present = [n in tensors for n in names]
    if not any(present):
        return
    if not all(present):
        raise _damaged(path, f"tensor {names[present.index(False)]!r}", "is missing")
    units, sums, counts = (tensors[n] for n in names)
    if units.dim() != 2:
        raise _damaged(path, f"tensor {names[0]!r}", f"has shape {tuple(units.shape)}, expected (units, width)")
    m, width = int(units.shape[0]), _unit_width(st)
    _check_tensor(path, names[0], units, torch.float64, (m, units.shape[1] if width is None else width))
    _check_tensor(path, names[1], sums, torch.float64, (m, units.shape[1]))
    _check_tensor(path, names[2], counts, torch.int64, (m,))
    if bool((counts < 1).any()):
        raise _damaged(path, f"tensor {names[2]!r}", "holds counts below 1")


def restore_statistics(
    stats: Mapping[str, StreamingStatistic], tensors: Mapping[str, Tensor], path: str | os.PathLike = "(checkpoint)"
) -> None:
    """Load every statistic's state from the tensors of :func:`read_checkpoint`, validating each.

    Every declared state tensor must be present with the dtype and shape of the fresh
    statistic's and be finite; tie pools must be consistent; no other tensor may be present.

    Args:
        stats: key → a fresh statistic of this run's configuration.
        tensors: name → tensor, as read.
        path: the checkpoint, for messages.

    Raises:
        CheckpointError: naming the missing, extra, misshapen, mistyped or non-finite tensor.
    """
    known: set[str] = set()
    for key, st in stats.items():
        fixed, pools = _expected_tensors(key, st)
        for name, tmpl in fixed.items():
            if name not in tensors:
                raise _damaged(path, f"tensor {name!r}", "is missing")
            _check_tensor(path, name, tensors[name], tmpl.dtype, tuple(tmpl.shape))
        for prefix in pools:
            _check_pool(path, prefix, st, tensors)
            known.update(f"{prefix}{n}" for n in ("units", "sums", "counts"))
        known.update(fixed)
    extra = sorted(set(tensors) - known)
    if extra:
        raise _damaged(path, f"tensor {extra[0]!r}", f"is not a state of this configuration ({len(extra)} such)")
    for key, st in stats.items():
        prefix = f"{key}/"
        try:
            st.load_state_dict({k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)})
        except (KeyError, ValueError, RuntimeError) as exc:
            raise _damaged(path, f"the state of {key!r}", f"is incomplete or malformed ({exc})") from None


def check_counts(path: str | os.PathLike, header: dict, stats: Mapping[str, StreamingStatistic], examples: int) -> None:
    """Cross-check the restored example counts: the header's, the loss total's and every site's ``n``.

    Raises:
        CheckpointError: naming the count that disagrees.
    """
    if examples != header["examples"]:
        raise _damaged(
            path, f"tensor '{LOSS_KEY}/examples'", f"holds {examples} examples, the header {header['examples']}"
        )
    for key, st in stats.items():
        n = st.states.get("n")
        if n is not None and (not math.isfinite(float(n)) or round(float(n)) != examples):
            raise _damaged(path, f"tensor '{key}/n'", f"holds {float(n):g} examples, the header {examples}")


def _digest_parts(obj: Any, h) -> None:
    """Feed a cheap, deterministic description of ``obj`` (nested tensors, mappings, sequences) to ``h``."""
    if isinstance(obj, Tensor):
        t = obj.detach()
        flat = t.reshape(-1)
        step = max(1, flat.numel() // _DIGEST_SAMPLES)
        sample = flat[::step][:_DIGEST_SAMPLES].cpu()
        sample = sample.to(torch.float64) if sample.is_floating_point() else sample.to(torch.int64)
        h.update(f"T{tuple(t.shape)}{t.dtype}".encode())
        h.update(sample.numpy().tobytes())
    elif isinstance(obj, Mapping):
        for k in sorted(obj, key=str):
            h.update(f"K{k}".encode())
            _digest_parts(obj[k], h)
    elif isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)}".encode())
        for v in obj:
            _digest_parts(v, h)
    elif isinstance(obj, (int, float, str, bool)) or obj is None:
        h.update(f"V{obj!r}".encode())
    else:
        h.update(f"O{type(obj).__name__}".encode())


#: Elements of each tensor that enter :func:`batch_digest` (evenly strided).
_DIGEST_SAMPLES = 1024


def batch_digest(batch: Any) -> str:
    """A cheap digest of a probe batch: shapes, dtypes and ≤ 1024 evenly strided values per tensor.

    Deterministic across processes (no floating-point reductions); hex, 16 characters.

    Args:
        batch: a tensor, or a mapping/sequence nesting tensors and plain values.

    Returns:
        The 16-character hex digest.
    """
    h = hashlib.sha256()
    _digest_parts(batch, h)
    return h.hexdigest()[:16]


class ProbeStream:
    """Fingerprint of the probe batches a run has consumed (stored in the checkpoint header).

    Holds the number of batches, ``(index, size, digest)`` of the first and the last of them
    and a digest chained over all of them in order (:func:`batch_digest`).
    """

    def __init__(self) -> None:
        self.batches = 0
        self.first: list | None = None
        self.last: list | None = None
        self.chain = ""

    def add(self, index: int, size: int, batch: Any) -> None:
        """Add batch ``index`` of ``size`` examples.

        Args:
            index: the global batch index.
            size: the number of examples in the batch.
            batch: the batch (inputs and targets, see :func:`batch_digest`).
        """
        digest = batch_digest(batch)
        entry = [int(index), int(size), digest]
        self.first = self.first or entry
        self.last = entry
        self.batches += 1
        self.chain = hashlib.sha256(f"{self.chain}|{index}|{size}|{digest}".encode()).hexdigest()[:16]

    def to_header(self) -> dict:
        """The JSON-serialisable fingerprint.

        Returns:
            ``{"batches", "first", "last", "chain"}``; ``first``/``last`` are ``[index, size, digest]`` or ``None``.
        """
        return {"batches": self.batches, "first": self.first, "last": self.last, "chain": self.chain}

    @staticmethod
    def check_header(path, stored: Any) -> None:
        """Raise a :class:`CheckpointError` if a stored fingerprint is not of the form of :meth:`to_header`.

        Args:
            path: the checkpoint path (for the message).
            stored: the header's ``probe`` field.

        Raises:
            CheckpointError: if ``stored`` is malformed.
        """
        ok = (
            isinstance(stored, dict)
            and _is_int(stored.get("batches"))
            and isinstance(stored.get("chain"), str)
            and all(
                stored.get(k) is None
                or (
                    isinstance(stored[k], list)
                    and len(stored[k]) == 3
                    and _is_int(stored[k][0])
                    and isinstance(stored[k][2], str)
                )
                for k in ("first", "last")
            )
        )
        if not ok:
            raise _damaged(path, "header field 'probe'", "is not a probe fingerprint {batches, first, last, chain}")

    def mismatch(self, stored: dict) -> str | None:
        """What differs between this stream and a stored fingerprint (``None``: the same batches).

        Args:
            stored: a fingerprint written by :meth:`to_header` (checked by :meth:`check_header`).

        Returns:
            A one-line reason, or ``None`` when the batch counts, first/last batches and chain hash agree.
        """
        for which in ("first", "last"):
            mine, theirs = getattr(self, which), stored.get(which)
            if mine is None or theirs is None:
                continue
            if mine[1] != theirs[1]:
                return f"batch {mine[0]} has {mine[1]} examples here but {theirs[1]} in the checkpoint"
            if mine[2] != theirs[2]:
                return f"batch {mine[0]} holds other inputs or targets than in the checkpoint"
        if self.batches != stored["batches"]:
            return f"{self.batches} batches precede the resume point here, {stored['batches']} in the checkpoint"
        if self.chain != stored["chain"]:
            return "the batches before the resume point differ from those in the checkpoint (other data or order)"
        return None


def config_diff(a: dict, b: dict) -> list[str]:
    """The keys on which two configurations differ, sorted; nested objects as ``key.subkey``.

    Args:
        a: a configuration.
        b: another configuration.

    Returns:
        The sorted keys whose values differ (missing counts as ``None``).
    """
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if va == vb:
            continue
        if isinstance(va, dict) and isinstance(vb, dict):
            out += [f"{k}.{sub}" for sub in config_diff(va, vb)]
        else:
            out.append(k)
    return out


def restore_anytime(path: str | os.PathLike, header: dict, tensors: Mapping[str, Tensor], streams: Any) -> None:
    """Load the anytime tests of a streamed run (``"@anytime:<site>/…"`` tensors, header ``anytime``), validated.

    Args:
        path: the checkpoint, for messages.
        header: the header of :func:`read_checkpoint` (its ``examples`` must equal every test's ``n``).
        tensors: the ``"@anytime:"`` tensors, as read.
        streams: the run's :class:`~depthsat_theory.diagnose.stream.AnytimeStreams`, its tests made.

    Raises:
        CheckpointError: naming the missing, extra, mistyped, misshapen or inconsistent tensor or field.
    """
    from depthsat_theory.diagnose.stream import ANYTIME_PREFIX

    batches = header.get("anytime")
    if not (isinstance(batches, dict) and set(batches) == set(streams.sites)):
        raise _damaged(path, "header field 'anytime'", f"is {batches!r}, not a batch index or null for each site")
    known: set[str] = set()
    for site in streams.sites:
        pre = f"{ANYTIME_PREFIX}{site}/"
        state = {k[len(pre) :]: v for k, v in tensors.items() if k.startswith(pre)}
        known.update(pre + k for k in state)
        _check_anytime_state(path, pre, state, header["examples"])
        at = batches[site]
        if (at is None) != (int(state["decided_at"]) < 0) or not (at is None or _is_int(at)):
            raise _damaged(path, f"header field 'anytime.{site}'", f"is {at!r}, inconsistent with the test's decision")
        streams.tests[site].load_state_dict(state)
        streams.decided_batch[site] = at
    extra = sorted(set(tensors) - known)
    if extra:
        raise _damaged(path, f"tensor {extra[0]!r}", "is not a state of this configuration")


def _check_anytime_state(path, pre: str, state: Mapping[str, Tensor], examples: int) -> None:
    """One anytime test's tensors: int64 counts, float64 sums, square Grams, counts that agree with the header."""
    for name, dtype, shape in (
        ("n", torch.int64, ()),
        ("weighted", torch.int64, ()),
        ("decided_at", torch.int64, ()),
        ("sums", torch.float64, (3,)),
    ):
        if name not in state:
            raise _damaged(path, f"tensor {pre + name!r}", "is missing")
        _check_tensor(path, pre + name, state[name], dtype, shape)
    n, weighted, at = int(state["n"]), int(state["weighted"]), int(state["decided_at"])
    if n != examples or not 0 <= weighted <= n or not (at == -1 or 1 <= at <= n):
        raise _damaged(
            path, f"tensors {pre}n/weighted/decided_at", f"hold {n}/{weighted}/{at}, the header {examples} examples"
        )
    if n == 0:
        return
    for name in ("sigma", "cross", "q"):
        if name not in state:
            raise _damaged(path, f"tensor {pre + name!r}", "is missing")
    k = int(state["sigma"].shape[-1]) if state["sigma"].dim() == 2 else -1
    _check_tensor(path, pre + "sigma", state["sigma"], torch.float64, (k, k))
    _check_tensor(path, pre + "q", state["q"], torch.float64, (k, k))
    _check_tensor(path, pre + "cross", state["cross"], torch.float64, None)
    if state["cross"].dim() != 2 or int(state["cross"].shape[1]) != k:
        raise _damaged(path, f"tensor {pre + 'cross'!r}", f"has shape {tuple(state['cross'].shape)}, expected (d, {k})")
