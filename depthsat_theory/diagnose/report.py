"""Diagnosis results: one :class:`SiteDiagnosis` per site, the :class:`Diagnosis` with its table and plot."""

from __future__ import annotations

import functools
import json
import math
import os
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from depthsat_theory.decision.beyond import DepthDecision
from depthsat_theory.io import atomic_write
from depthsat_theory.statistics import SaturationResult
from depthsat_theory.statistics.decrease import guaranteed_decrease
from depthsat_theory.statistics.secondorder import SaddleResult
from depthsat_theory.vocabulary import Layout, Verdict

if TYPE_CHECKING:
    from depthsat_theory.bounds import ScoreInterval
    from depthsat_theory.capture.curvature import FieldCurvature, StepCheck
    from depthsat_theory.diagnose.stream import SiteStream

__all__ = ["Diagnosis", "SiteDiagnosis"]


@dataclass
class SiteDiagnosis:
    """The diagnosis of one site.

    Attributes:
        site: module name.
        depth: position in depth order (0 = first site).
        layout: ``"vector"``, ``"sequence"`` or ``"image"``; ``shape``: per-example shape.
        result: the :class:`~depthsat_theory.statistics.SaturationResult` (``score`` =
            ``s``, ``relative_score`` = ``s / AG_rms``, ``raw_score`` = ``r̂``,
            ``realizability_defect`` = ``ρ̂``, ``ag_rms``, ``ag_max``, ``tangent_rank``…;
            nats per example per unit function-space step).
        interval: the ``(1 − δ)`` :class:`~depthsat_theory.bounds.ScoreInterval`, or ``None``.
        saddle: the :class:`~depthsat_theory.statistics.secondorder.SaddleResult` (``second_order=True``), or ``None``.
        beta: the smoothness ``β`` given for this site (``None``: not given).
        curvature: the measured curvature along ``Πg`` (``curvature=True``), or ``None``.
        beta_check: the loss change of the step ``−Πg/β`` measured on the probe
            (``cor-beta-refuted``), or ``None`` when it could not be run (a streamed probe, a
            non-feature family, per-batch losses).
        stream: what the anytime noise test says when the probe was streamed until decided
            (``until_decided=True``; theory/decision.md, ``thm-anytime-noise-test``), else ``None``; then the
            verdict is the streamed one (:func:`~depthsat_theory.diagnose.stream.stream_verdict`).
        decision: "add depth here" / "train longer first" / "enough depth" / "undetermined"
            (:class:`~depthsat_theory.decision.beyond.DepthDecision`, theory/decision.md ``def-depth-decision``;
            ``decision=True``), or ``None`` when not requested.
        decision_reason: one line: why, and what would decide an undetermined site (``None`` when not requested).
        stationarity: the stationarity score's result (the existing last map's tangent, ``def-stationarity-score``),
            or ``None`` when not computed.
        beyond_training: the score beyond training's result (``prop-beyond-training``), or ``None``.
    """

    site: str
    depth: int
    layout: Layout
    shape: tuple
    result: SaturationResult
    interval: ScoreInterval | None = None
    saddle: SaddleResult | None = None
    beta: float | None = None
    curvature: FieldCurvature | None = None
    beta_check: StepCheck | None = None
    stream: SiteStream | None = None
    decision: DepthDecision | None = None
    decision_reason: str | None = None
    stationarity: SaturationResult | None = None
    beyond_training: SaturationResult | None = None

    @property
    def examples_used(self) -> int | None:
        """Examples the streamed verdict rests on (up to the decision, or all read); ``None`` when not streamed."""
        return None if self.stream is None else self.stream.examples_used

    @property
    def decided_at(self) -> int | None:
        """The example at which the anytime test decided (``None``: not streamed, or not decided)."""
        return None if self.stream is None else self.stream.decided_at

    @property
    def beta_status(self) -> str | None:
        """What the probe says of this site's ``β`` (``None`` without one).

        ``"refuted"`` when the step ``−Πg/β`` removed less than ``s²/(2β)`` on the probe by more than
        the rounding of the two loss evaluations (so ``β`` is *not* a smoothness constant here,
        ``cor-beta-refuted``), ``"consistent"`` when it removed at least that by more than the
        rounding, ``"within rounding"`` when the difference is below the rounding (the promise is
        too small to test), ``"unchecked"`` when the step was not run.
        """
        if self.beta is None:
            return None
        if self.beta_check is None:
            return "unchecked"
        promised = guaranteed_decrease(self.result.score, self.beta)
        gap, tol = self.beta_check.decrease - promised, self.beta_check.tolerance
        return "refuted" if gap < -tol else "consistent" if gap >= tol else "within rounding"

    @property
    def guaranteed_decrease(self) -> float | None:
        """``s²/(2β)`` in loss units per example (``thm-guaranteed-decrease``).

        ``None`` without ``β`` and when the probe refutes ``β`` (``cor-beta-refuted``): a number
        that the real step contradicts is never reported as guaranteed.
        """
        if self.beta is None or self.beta_status == "refuted":
            return None
        return guaranteed_decrease(self.result.score, self.beta)

    @property
    def verdict(self) -> str:
        """``degenerate``, ``saturated (rounding)``, ``undetermined: …``, the certificate, or ``improvable``."""
        if self.stream is not None:
            return _streamed_detail(self.stream, self.result)
        v = self.result.verdict
        if v is Verdict.DEGENERATE:
            return "degenerate (T = {0})"
        if v is Verdict.SATURATED:
            return "saturated (within rounding)"
        if self.interval is not None:
            return self.interval.certificate
        if v is Verdict.UNDETERMINED:
            return f"undetermined: {self.result.verdict_reason}"
        return "improvable"

    @property
    def verdict_kind(self) -> Verdict:
        """:attr:`verdict` in the shared vocabulary (:class:`~depthsat_theory.vocabulary.Verdict`).

        The result's four-outcome verdict (theory/numerics.md) without an interval; with one,
        ``DEGENERATE``/``SATURATED`` as the result says, else the certificate: ``IMPROVABLE``
        when certified improvable, ``SATURATED`` when certified ε-saturated, ``UNDETERMINED``
        when it certifies neither.
        """
        if self.stream is not None:  # streamed until decided: the anytime test's verdict (no interval then)
            from depthsat_theory.diagnose.stream import stream_verdict

            return stream_verdict(self.stream, self.result)[0]
        v = self.result.verdict
        if v in (Verdict.DEGENERATE, Verdict.SATURATED) or self.interval is None:
            return v
        return _CERTIFICATES.get(self.interval.certificate, Verdict.UNDETERMINED)

    def to_dict(self) -> dict:
        """JSON-ready dictionary.

        Returns:
            The site's fields merged with :meth:`SaturationResult.to_dict`, ``verdict`` as its kind, and
            ``interval``/``saddle``/``curvature`` as dictionaries or ``None``.
        """
        return {
            "site": self.site,
            "depth": self.depth,
            "layout": self.layout,
            "shape": list(self.shape),
            **self.result.to_dict(),
            "verdict": self.verdict_kind.value,
            "verdict_detail": self.verdict,
            "interval": None if self.interval is None else self.interval.to_dict(),
            "beta": self.beta,
            "guaranteed_decrease": self.guaranteed_decrease,
            "beta_status": self.beta_status,
            "beta_step_decrease": None if self.beta_check is None else self.beta_check.decrease,
            "saddle": None if self.saddle is None else self.saddle.to_dict(),
            "curvature": None if self.curvature is None else _finite_dict(asdict(self.curvature)),
            "examples_used": self.examples_used,
            "decided_at": self.decided_at,
            "anytime": None if self.stream is None else self.stream.to_dict(),
            **_decision_dict(self),
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
        products: dtype of the per-batch products, ``"float64"`` or the opt-in ``"float32"`` (whose
            wider rounding bound is in every site's ``score_error``, theory/numerics.md ``thm-score-error``).
        until_decided: whether the probe was streamed until decided (each site's ``stream``);
            ``max_examples``: its budget in examples (``None``: the whole probe).
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
    products: str = "float64"
    until_decided: bool = False
    max_examples: int | None = None

    @property
    def joint_score(self) -> float:
        """``(Σ_l s_l²)^{1/2}``: the score of inserting a block at every site at once (``prop-joint``)."""
        return math.sqrt(sum(sd.result.score**2 for sd in self.sites))

    def __getitem__(self, site: str) -> SiteDiagnosis:
        for s in self.sites:
            if s.site == site:
                return s
        raise KeyError(site)

    def to_dict(self) -> dict:
        """JSON-ready dictionary (``nan`` becomes ``None``).

        Returns:
            The run's fields and ``sites`` (each :meth:`SiteDiagnosis.to_dict`), non-finite loss and joint
            score as ``None``.
        """
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
            "products": self.products,
            "until_decided": self.until_decided,
            "max_examples": self.max_examples,
            "notes": list(self.notes),
            "joint_score": _finite(self.joint_score),
            "sites": [s.to_dict() for s in self.sites],
        }

    def write_json(self, path: str | os.PathLike) -> None:
        """Write :meth:`to_dict` as JSON atomically (temp file, fsync, rename).

        Args:
            path: the JSON file to write.

        Raises:
            OSError: if the folder is not writable (no partial file is left).
        """
        data = json.dumps(self.to_dict(), indent=1, ensure_ascii=False, allow_nan=False).encode()
        atomic_write(Path(path), lambda fh: fh.write(data), binary=True)

    def table(self):
        """A :class:`rich.table.Table` of the per-site quantities.

        Returns:
            The ``rich.table.Table``, one row per site.
        """
        from rich.table import Table

        t = Table(
            title=f"depthsat diagnose: {self.description or 'model'}, family {self.family}, "
            f"n = {self.n}, J = {self.loss:.4g} ({self.loss_units}); joint score (Σ s²)^½ = {self.joint_score:.3g}"
        )
        extra = _extra_columns(self.sites)
        cols = ["#", "site", "shape", "s", "± rounding", "s/AG_rms", "AG_rms", "AG_max", "rank/p", *extra]
        if self.realizability:
            cols += ["r̂", "ρ̂"]
        if self.delta is not None:
            cols += [f"{1 - self.delta:g} interval"]
        cols += ["verdict"]
        noisy = [sd for sd in self.sites if sd.result.verdict is Verdict.UNDETERMINED and sd.stream is None]
        if noisy:
            cols += ["n to decide"]
        streamed = any(sd.stream is not None for sd in self.sites)
        if streamed:
            cols += _STREAM_COLUMNS
        uncertified = [sd for sd in self.sites if sd.interval is not None and sd.interval.score_lower == 0]
        if uncertified:
            cols += ["n to certify"]
        for c in cols:
            t.add_column(c, justify="left" if c in ("site", "verdict") else "right", no_wrap=c != "verdict")
        for sd in self.sites:
            t.add_row(
                *self._row(sd, extra, noisy=bool(noisy), uncertified=bool(uncertified)), *_stream_cells(sd, streamed)
            )
        return t

    def _row(self, sd, extra: list[str], *, noisy: bool, uncertified: bool) -> list[str]:
        """One site's cells of :meth:`table`, in its column order."""
        r = sd.result
        row = [
            str(sd.depth),
            sd.site,
            "×".join(map(str, sd.shape)),
            _g(r.score),
            _g(r.score_error),
            _g(r.relative_score),
            _g(r.ag_rms),
            _g(r.ag_max),
            f"{r.tangent_rank}/{r.tangent_dim}",
            *_extra_cells(sd, extra),
        ]
        if self.realizability:
            row += [_g(r.raw_score), _g(r.realizability_defect)]
        if self.delta is not None:
            iv = sd.interval
            row += ["—" if iv is None else f"[{_g(iv.score_lower)}, {_g(iv.score_upper)}]"]
        row += [_SHORT.get(sd.verdict, "undetermined" if sd.verdict.startswith("undetermined") else sd.verdict)]
        if noisy:
            need = r.examples_needed if r.verdict is Verdict.UNDETERMINED else None
            row += ["—" if need is None else str(need)]
        if uncertified:
            iv = sd.interval
            plan = None if iv is None or iv.score_lower > 0 else iv.n_to_certify
            row += ["—" if plan is None else str(plan)]
        return row

    def plot(self, path: str | os.PathLike) -> list[Path]:
        """Plot ``s`` (with the interval when present) and ``s / AG_rms`` against depth.

        Writes ``<path>.png`` and ``<path>.svg`` (a ``.png``/``.svg`` suffix of
        ``path`` is replaced) with matplotlib's Agg canvas (no display needed).

        Args:
            path: the output path, without suffix (or with ``.png``/``.svg``).

        Returns:
            The two paths written.

        Raises:
            MissingExtraError: if matplotlib is not installed (``pip install 'depthsat[plot]'``).
        """
        from depthsat_theory.extras import require

        Figure = require("matplotlib.figure", extra="plot", purpose="the diagnose plot").Figure
        agg = require("matplotlib.backends.backend_agg", extra="plot", purpose="the diagnose plot")
        FigureCanvasAgg = agg.FigureCanvasAgg

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
            ax1.fill_between(xs, lo, hi, alpha=0.2, label=f"{1 - (self.delta or 0.0):g} interval (non-vacuous)")
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
            atomic_write(target, functools.partial(_save_figure, fig, ext[1:]), binary=True)
            out.append(target)
        return out


#: The columns of a run streamed until decided (``until_decided``): examples the verdict rests on, the example
#: (and probe batch) of the anytime decision, and the anytime forecast of an undecided site.
_STREAM_COLUMNS = ["examples used", "decided at", "n to decide (anytime)"]


def _stream_cells(sd: SiteDiagnosis, streamed: bool) -> list[str]:
    """A site's cells of :data:`_STREAM_COLUMNS` (none when the run was not streamed)."""
    if not streamed:
        return []
    st = sd.stream
    if st is None:
        return ["—"] * len(_STREAM_COLUMNS)
    at = "—" if st.decided_at is None else f"{st.decided_at} (batch {st.decided_batch})"
    return [str(st.examples_used), at, "—" if st.examples_needed is None else str(st.examples_needed)]


def _streamed_detail(stream: SiteStream, result: SaturationResult) -> str:
    """The verdict text of a streamed site: the verdict and the test it comes from."""
    from depthsat_theory.diagnose.stream import stream_verdict

    verdict, reason = stream_verdict(stream, result)
    if verdict is Verdict.IMPROVABLE:
        return "improvable (anytime test)"
    if verdict is Verdict.DEGENERATE:
        return "degenerate (T = {0})"
    if verdict is Verdict.SATURATED:
        return "saturated (within rounding)"
    return f"undetermined: {reason}"


_SHORT = {
    "certified improvable": "cert. improvable",
    "certified ε-saturated": "cert. ε-saturated",
    "not certified": "not certified",
    "degenerate (T = {0})": "degenerate",
    "saturated (within rounding)": "saturated",
    "improvable": "improvable",
    "improvable (anytime test)": "improvable (anytime)",
}


_CERTIFICATES = {
    "certified improvable": Verdict.IMPROVABLE,
    "certified ε-saturated": Verdict.SATURATED,
    "degenerate (T = {0})": Verdict.DEGENERATE,
}


def _decision_dict(sd: SiteDiagnosis) -> dict:
    """The decision's JSON keys (``decision``, ``decision_reason``, ``stationarity``, ``beyond_training``)."""
    return {
        "decision": None if sd.decision is None else sd.decision.value,
        "decision_reason": sd.decision_reason,
        "stationarity": None if sd.stationarity is None else sd.stationarity.to_dict(),
        "beyond_training": None if sd.beyond_training is None else sd.beyond_training.to_dict(),
    }


def _extra_columns(sites: list[SiteDiagnosis]) -> list[str]:
    """Columns beyond first order that some site has: ``s²/2β``, the saddle score, kink ties."""
    cols = []
    if any(sd.beta is not None for sd in sites):
        cols.append("s²/2β")
    if any(sd.curvature is not None for sd in sites):
        cols.append("s²/2κ (local)")
    if any(sd.saddle is not None for sd in sites):
        cols.append("saddle σ")
    if any(sd.result.kink_ties for sd in sites):
        cols.append("kink ties")
    if any(sd.decision is not None for sd in sites):
        cols += ["s_old/AG_rms", "s_beyond/AG_rms", "decision"]
    return cols


def _extra_cells(sd: SiteDiagnosis, cols: list[str]) -> list[str]:
    cells = {
        "s²/2β": _beta_cell(sd),
        "saddle σ": "—" if sd.saddle is None else _g(sd.saddle.saddle_score),
        "s²/2κ (local)": "—" if sd.curvature is None else _g(sd.curvature.local_decrease),
        "kink ties": "—" if sd.result.kink_ties is None else str(sd.result.kink_ties),
        "s_old/AG_rms": "—" if sd.stationarity is None else _g(sd.stationarity.relative_score),
        "s_beyond/AG_rms": "—" if sd.beyond_training is None else _g(sd.beyond_training.relative_score),
        "decision": "—" if sd.decision is None else sd.decision.value,
    }
    return [cells[c] for c in cols]


def _beta_cell(sd: SiteDiagnosis) -> str:
    """``s²/(2β)``; ``refuted: removed x < y`` when the step contradicts it; ``?`` when unchecked or within rounding."""
    status = sd.beta_status
    if status is None:
        return "—"
    if status == "refuted":
        promised = guaranteed_decrease(sd.result.score, sd.beta)  # type: ignore[arg-type]
        return f"refuted: removed {sd.beta_check.decrease:.3g} < {promised:.3g}"  # type: ignore[union-attr]
    return _g(sd.guaranteed_decrease) + ("" if status == "consistent" else "?")


def _save_figure(fig, fmt: str, fh) -> None:
    fig.savefig(fh, format=fmt)


def _g(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    return f"{v:.3g}"


def _finite_dict(d: dict) -> dict:
    return {k: _finite(v) for k, v in d.items()}


def _finite(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v
