"""Writing an experiment's results: tables, summary, figures and provenance, atomically.

A result folder is built in a temporary sibling folder and moved into place with one rename, so
readers see the previous complete results or the new complete results, never a mix.
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CLAIM_KEYS",
    "CLAIM_VERDICTS",
    "ExperimentError",
    "ResumeFile",
    "config_tag",
    "default_folder",
    "metric_curves",
    "provenance",
    "summarize",
    "write_results",
]

#: where ``depthsat experiment`` writes by default (relative to the working directory)
DEFAULT_RESULTS_ROOT = Path("experiments") / "results"


class ExperimentError(ValueError):
    """A bad experiment configuration or output folder (the CLI prints it in one line, exit 2)."""


class ResumeFile:
    """A JSON-lines file of finished models (``{"key": …, "record": …}`` per line), so a stopped run resumes.

    Records are read when the file exists and appended (flushed and synced) as models finish; a
    last line cut by a crash is skipped.

    Args:
        path: the file (``None``: remember nothing).
        what: what a record is, for error messages (e.g. ``"finished-model"``).

    Raises:
        ExperimentError: ``path`` is a folder, or a line is neither a record nor a cut record.
    """

    def __init__(self, path: str | os.PathLike | None, what: str = "finished-model"):
        self.path = None if path is None else Path(path)
        self.done: dict[str, dict] = {}
        if self.path is not None and self.path.exists() and not self.path.is_file():
            raise ExperimentError(f"--resume {self.path}: not a file; name a JSON-lines file")
        if self.path is None or not self.path.is_file():
            return
        for i, line in enumerate(self.path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                if line.startswith('{"key": '):
                    continue  # a line cut by a crash
                rec = None
            if not isinstance(rec, dict) or not isinstance(rec.get("record"), dict) or "key" not in rec:
                raise ExperimentError(
                    f"--resume {self.path}: line {i} is not a {what} record; "
                    "name a file written by --resume (nothing was appended)"
                )
            self.done[rec["key"]] = rec["record"]

    def add(self, key: str, record: dict) -> None:
        """Append one finished model's record (nothing when there is no file).

        Args:
            key: the model's key.
            record: its JSON-serialisable rows.
        """
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as fh:
            fh.write(json.dumps({"key": key, "record": record}) + "\n")
            fh.flush()
            os.fsync(fh.fileno())


def config_tag(config: Mapping[str, Any], drop: Sequence[str] = ()) -> str:
    """A short hash of a configuration, for resume keys: equal exactly when the fields kept are equal.

    Args:
        config: a JSON-ready configuration (e.g. ``cfg.to_dict()``).
        drop: fields left out (those that choose which models run, not how each is made: name, seeds, …).

    Returns:
        The first 16 hex digits of the SHA-256 of the sorted JSON of the kept fields.
    """
    import hashlib

    what = {k: v for k, v in config.items() if k not in drop}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def default_folder(name: str, config: str) -> Path:
    """Where an experiment writes when no ``--out`` is given.

    Only the committed configuration (``"full"``) writes into ``experiments/results/<name>``; any
    other (``tiny``, ``large``) gets a new temporary folder, so a quick run never replaces the
    committed results.

    Args:
        name: the experiment (``"sweep"``, ``"growth"``, …).
        config: the configuration's name.

    Returns:
        ``experiments/results/<name>`` for ``full``; otherwise ``<new temporary folder>/<name>``
        (not yet existing: :func:`write_results` creates it atomically).
    """
    if config == "full":
        return DEFAULT_RESULTS_ROOT / name
    return Path(tempfile.mkdtemp(prefix=f"depthsat-{config}-")) / name


def _git_commit() -> dict[str, Any]:
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=here,
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout.strip()
        )
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}


#: The checkout when this module was first imported (an experiment imports it before it trains):
#: a commit or an edit made while an experiment runs must not be recorded as what made it.
_AT_START: dict[str, Any] = _git_commit()


def provenance(*, seeds: Sequence[int], config: Mapping[str, Any], started: float | None = None) -> dict[str, Any]:
    """What made a result: command line, commit, seeds, configuration, software and machine.

    Args:
        seeds: the seeds the experiment ran.
        config: the experiment's full configuration (JSON-serialisable values).
        started: ``time.time()`` at the start, to record the wall time in seconds.

    Returns:
        A JSON-serialisable dict (``command``, ``commit``, ``dirty``, ``seeds``, ``config``, ``versions``,
        ``machine``, ``finished``, ``wall_s``). ``commit`` is the checkout when the experiment started
        (when this module was imported); ``dirty`` is true when the working tree had uncommitted changes
        at the start or at the end, or when ``HEAD`` moved during the run (then ``commit_at_end`` is
        added).
    """
    versions: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("depthsat", "numpy", "scipy", "transformers", "matplotlib"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    now = time.time()
    argv = ["depthsat", *sys.argv[1:]] if sys.argv and sys.argv[0].endswith("depthsat") else list(sys.argv)
    return {
        "command": " ".join(argv),
        **_checkout(),
        "seeds": list(seeds),
        "config": dict(config),
        "versions": versions,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "loadavg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        },
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "wall_s": None if started is None else round(now - started, 1),
    }


def _checkout() -> dict[str, Any]:
    end = _git_commit()
    if end["commit"] != _AT_START["commit"]:
        return {"commit": _AT_START["commit"], "dirty": True, "commit_at_end": end["commit"]}
    dirty = None if end["dirty"] is None else bool(end["dirty"] or _AT_START["dirty"])
    return {"commit": end["commit"], "dirty": dirty}


def summarize(values: Sequence[float], *, confidence: float = 0.95) -> dict[str, float]:
    """Mean, sample standard deviation and a Student-t confidence interval of the mean.

    Args:
        values: one value per seed (NaN values are an error: a failed run must not average away).
        confidence: the interval's coverage.

    Returns:
        ``{"mean", "std", "n", "ci_low", "ci_high"}``; with one value the spread and interval are NaN.

    Raises:
        ExperimentError: if ``values`` is empty or holds a NaN/Inf.
    """
    from scipy import stats

    xs = [float(v) for v in values]
    if not xs:
        raise ExperimentError("summarize: no values (no seed finished)")
    if not all(math.isfinite(x) for x in xs):
        raise ExperimentError(f"summarize: non-finite value among {xs} (a run diverged; see its row)")
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return {"mean": mean, "std": math.nan, "n": n, "ci_low": math.nan, "ci_high": math.nan}
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * std / math.sqrt(n)
    return {"mean": mean, "std": std, "n": n, "ci_low": mean - half, "ci_high": mean + half}


def metric_curves(runs: Sequence[dict], metrics: Sequence[str], **labels: Any) -> list[dict[str, Any]]:
    """Per metric and depth, the seeds' :func:`summarize` of the finite values (curves.csv rows).

    Args:
        runs: one record per trained model, with ``depth`` and the metrics (missing or ``None``: skipped).
        metrics: the metric keys, in the order of the rows.
        **labels: fixed columns put first in every row (e.g. ``teacher_depth=2``).

    Returns:
        ``{**labels, "metric", "depth", "mean", "std", "n", "ci_low", "ci_high"}`` rows, metric-major, depths
        ascending; a (metric, depth) with no finite value has no row.
    """
    rows = []
    depths = sorted({r["depth"] for r in runs})
    for metric in metrics:
        for depth in depths:
            vals = [r[metric] for r in runs if r["depth"] == depth and r.get(metric) is not None]
            vals = [v for v in vals if math.isfinite(v)]
            if vals:
                rows.append({**labels, "metric": metric, "depth": depth, **summarize(vals)})
    return rows


def json_ready(obj: Any) -> Any:
    """``obj`` as plain JSON values, so that ``json.dump`` never writes ``NaN``.

    Keys become strings, tuples and tensors lists, numpy scalars Python scalars, and non-finite floats
    ``None`` (NaN) or ``"inf"``/``"-inf"``.
    """
    if isinstance(obj, Mapping):
        return {str(k): json_ready(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_ready(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return json_ready(obj.tolist())
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        return obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    return obj


def _write_csv(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    fields: list[str] = []
    for row in rows:
        fields.extend(k for k in row if k not in fields)
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: json_ready(v) for k, v in row.items()})


#: The keys of a claims row (``summary.json → claims``), in order.
CLAIM_KEYS: tuple[str, ...] = ("claim", "setting", "verdict", "qualifier", "interval", "reason")
#: The verdicts a claims row may carry.
CLAIM_VERDICTS: tuple[str, ...] = ("holds", "fails", "untestable here")


def write_results(
    folder: str | os.PathLike,
    *,
    tables: Mapping[str, Sequence[Mapping[str, Any]]],
    summary: Mapping[str, Any],
    figures: Mapping[str, Any] | None = None,
    meta: Mapping[str, Any],
    claims: Sequence[Mapping[str, str]] | None = None,
) -> Path:
    """Write one experiment's results into ``folder``, replacing what was there in one rename.

    Args:
        folder: the result folder (e.g. ``experiments/results/sweep``); its parent is created.
        tables: ``{name: rows}``; each becomes ``name.csv`` (columns: the union of the rows' keys).
        summary: the headline numbers; written with ``meta`` into ``summary.json``.
        figures: ``{name: matplotlib Figure}``; each is saved as ``name.png`` and ``name.svg``.
        meta: :func:`provenance` of the run.
        claims: the claims rows the experiment reads (``summary.json → claims``, next to ``meta`` and
            ``summary``): each a dict with exactly the keys of :data:`CLAIM_KEYS`, ``verdict`` one of
            :data:`CLAIM_VERDICTS`; ``None``: no ``claims`` key.

    Returns:
        The folder written.

    Raises:
        ExperimentError: if ``folder`` exists and is not a directory, or a claims row is malformed.
        OSError: if the parent is not writable (nothing is left behind).
    """
    target = Path(folder)
    if target.exists() and not target.is_dir():
        raise ExperimentError(f"--out {target}: exists and is not a folder; name a folder")
    for row in claims or ():
        if set(row) != set(CLAIM_KEYS) or row["verdict"] not in CLAIM_VERDICTS:
            raise ExperimentError(
                f"claims row {dict(row)}: needs exactly the keys {CLAIM_KEYS} and a verdict in {CLAIM_VERDICTS}"
            )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        for name, rows in tables.items():
            _write_csv(tmp / f"{name}.csv", rows)
        for name, fig in (figures or {}).items():
            fig.savefig(tmp / f"{name}.png", dpi=120, bbox_inches="tight")
            fig.savefig(tmp / f"{name}.svg", bbox_inches="tight", metadata={"Date": None})
        with open(tmp / "summary.json", "w") as fh:
            top = {"meta": meta, "summary": summary, **({"claims": list(claims)} if claims is not None else {})}
            json.dump(json_ready(top), fh, indent=1, sort_keys=False)
            fh.write("\n")
        old = None
        if target.exists():
            old = target.with_name(f".{target.name}-old-{os.getpid()}")
            os.replace(target, old)
        os.replace(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
