"""Diagnosis results: one :class:`SiteDiagnosis` per site, the :class:`Diagnosis` with its table and plot."""

from __future__ import annotations

import functools
import json
import math
import os
import textwrap
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from depthsat_theory.decision.beyond import DepthDecision
from depthsat_theory.decision.headline import Headline, headline
from depthsat_theory.diagnose.nextstep import next_step
from depthsat_theory.io import atomic_write
from depthsat_theory.statistics import SaturationResult
from depthsat_theory.statistics.decrease import guaranteed_decrease
from depthsat_theory.statistics.secondorder import SaddleResult
from depthsat_theory.vocabulary import Certificate, Layout, Verdict

if TYPE_CHECKING:
    from depthsat_theory.bounds import ScoreInterval
    from depthsat_theory.capture.curvature import FieldCurvature, StepCheck
    from depthsat_theory.diagnose.stream import SiteStream

__all__ = ["Diagnosis", "SiteDiagnosis", "headline_or_none"]


def headline_or_none(result: SaturationResult) -> Headline | None:
    """:func:`depthsat_theory.decision.headline` of a result, or ``None`` when it has none to give.

    Args:
        result: a site's :class:`~depthsat_theory.statistics.SaturationResult`.

    Returns:
        The :class:`~depthsat_theory.decision.Headline`; ``None`` when ``n < 2`` or ``v̂``, ``ŝ`` or ``AG_rms``
        is not a finite number ``≥ 0`` (``v̂`` not streamed: no bias correction is possible).
    """
    r = result
    if r.n < 2 or not all(math.isfinite(x) and x >= 0 for x in (r.noise_variance, r.score, r.ag_rms)):
        return None
    return headline(r)


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
    def verdict(self) -> Verdict:
        """The site's one verdict (:class:`~depthsat_theory.vocabulary.Verdict`): the result's four outcomes.

        ``improvable`` / ``saturated`` / ``undetermined`` / ``degenerate`` as theory/numerics.md and the noise
        test decide them (:attr:`SaturationResult.verdict`); for a probe streamed until decided, the anytime
        test's (:func:`~depthsat_theory.diagnose.stream.stream_verdict`, ``thm-anytime-noise-test``). The
        finite-sample certificate of ``--delta`` is the separate :attr:`certificate`: it never replaces the verdict.
        """
        if self.stream is not None:
            from depthsat_theory.diagnose.stream import stream_verdict

            return stream_verdict(self.stream, self.result)[0]
        return self.result.verdict

    @property
    def verdict_kind(self) -> Verdict:
        """Deprecated alias of :attr:`verdict` (which is now the shared-vocabulary verdict itself)."""
        warnings.warn("SiteDiagnosis.verdict_kind is deprecated: use .verdict", DeprecationWarning, stacklevel=2)
        return self.verdict

    @property
    def certificate(self) -> Certificate | None:
        """The finite-sample certificate of the ``(1 − δ)`` interval (``--delta``), separate from the verdict.

        ``certified improvable``, ``certified ε-saturated`` or ``not certified``
        (:class:`~depthsat_theory.vocabulary.Certificate`, theory/finite-sample.md); ``None`` without an interval
        and for a degenerate family (whose verdict already says ``degenerate``).
        """
        if self.interval is None or not isinstance(self.interval.certificate, Certificate):
            return None
        return self.interval.certificate

    @property
    def headline(self) -> Headline | None:
        """The bias-corrected ``s_U`` and ``s_U/AG_rms`` with its interval, the plug-in and its chance level.

        theory/decision.md, ``def-bias-corrected-score``, ``prop-plugin-chance-level``, ``prop-headline-interval``;
        :func:`depthsat_theory.decision.headline`. ``None`` when the noise moment ``v̂`` was not streamed or
        ``n < 2`` (no bias correction is possible).
        """
        return headline_or_none(self.result)

    @property
    def next_step(self) -> str | None:
        """For an undetermined site, what would decide it and the command that does it (``None`` otherwise).

        See :func:`depthsat_theory.diagnose.nextstep.next_step`.
        """
        if self.stream is not None:  # the anytime test's reason already gives its forecast
            return None
        return next_step(self.result)

    @property
    def verdict_reason(self) -> str:
        """One line saying why :attr:`verdict` is what it is; for an undetermined site, also what would decide it."""
        if self.stream is not None:
            from depthsat_theory.diagnose.stream import stream_verdict

            return stream_verdict(self.stream, self.result)[1]
        step = self.next_step
        return self.result.verdict_reason + ("" if step is None else f"; {step}")

    def to_dict(self) -> dict:
        """JSON-ready dictionary.

        Returns:
            ``site``, ``depth``, ``layout``, ``shape``, then the ``headline``
            (:meth:`~depthsat_theory.decision.Headline.to_dict` or ``None``), the ``verdict`` (its string),
            ``verdict_reason``, ``next_step`` and ``certificate`` (string or ``None``), then the fields of
            :meth:`SaturationResult.to_dict` (the plug-in ``score`` and ``relative_score`` among them), and
            ``interval``/``saddle``/``curvature`` as dictionaries or ``None``; ``decision`` when the site has one.
        """
        head = self.headline
        out = {
            "site": self.site,
            "depth": self.depth,
            "layout": self.layout,
            "shape": list(self.shape),
            "headline": None if head is None else head.to_dict(),
            "verdict": self.verdict.value,
            "verdict_reason": self.verdict_reason,
            "next_step": self.next_step,
            "certificate": None if self.certificate is None else self.certificate.value,
        }
        result = self.result.to_dict()
        for key in ("verdict", "verdict_reason"):
            result.pop(key)
        out.update(result)
        out.update(
            {
                "interval": None if self.interval is None else self.interval.to_dict(),
                "beta": self.beta,
                "guaranteed_decrease": self.guaranteed_decrease,
                "beta_status": self.beta_status,
                "beta_step_decrease": None if self.beta_check is None else self.beta_check.decrease,
                "saddle": None if self.saddle is None else self.saddle.to_dict(),
                "curvature": None if self.curvature is None else _finite_dict(asdict(self.curvature)),
            }
        )
        out.update(
            {
                "examples_used": self.examples_used,
                "decided_at": self.decided_at,
                "anytime": None if self.stream is None else self.stream.to_dict(),
                **_decision_dict(self),
            }
        )
        return out


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

    @property
    def joint_score_unbiased(self) -> float:
        """``(max(0, Σ_l ŝ²_U,l))^{1/2}``: the bias-corrected joint score (``def-bias-corrected-score``).

        A sum of unbiased estimates of ``s_l²`` is unbiased for ``Σ_l s_l²``; ``nan`` when a site has no ``v̂``.
        """
        total = sum(sd.result.score_squared_unbiased for sd in self.sites)
        return math.sqrt(max(0.0, total)) if math.isfinite(total) else math.nan

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
            "joint_score_unbiased": _finite(self.joint_score_unbiased),
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

    def table(self, *, compact: bool = False):
        """A :class:`rich.table.Table` of the per-site quantities, led by the headline and the verdict.

        Columns: the bias-corrected ``s_U`` and ``s_U/AG_rms`` with its interval (``def-bias-corrected-score``,
        ``prop-headline-interval``), the verdict, then the plug-in ``ŝ/AG_rms`` beside its chance level
        ``sqrt(v̂/n)/AG_rms`` (``prop-plugin-chance-level``), the rounding bound of ``ŝ``, ``AG_rms``, ``AG_max``,
        the tangent rank, and the optional columns (``--beta``, ``--rho``, ``--delta``: interval and certificate,
        "n to decide", "n to certify", the depth decision).

        Args:
            compact: only the columns that decide (depth, site, ``s_U/AG_rms`` and its interval, the verdict,
                the certificate, the forecasts, the depth decision), for a terminal too narrow for the whole
                table (the CLI switches to it and says so; the JSON and :meth:`markdown` keep every column).

        Returns:
            The ``rich.table.Table``, one row per site.
        """
        from rich.table import Table

        t = Table(
            title=f"depthsat diagnose: {self.description or 'model'}, family {self.family}, "
            f"n = {self.n}, J = {self.loss:.4g} ({self.loss_units}); joint s_U = {_g(self.joint_score_unbiased)} "
            f"(plug-in (Σ ŝ²)^½ = {self.joint_score:.3g})"
        )
        cols = self.columns()
        if compact:
            cols = [c for c in cols if c in _COMPACT or (c.endswith(" interval") and "(δ)" not in c)]
        rows = [self._row(sd, cols) for sd in self.sites]
        for i, c in enumerate(cols):
            # the site, its depth and its verdict are never squeezed away in a narrow terminal
            keep = max([len(c), *(len(row[i]) for row in rows)]) if c in ("#", "site", "verdict") else None
            t.add_column(c, justify="left" if c in _LEFT else "right", no_wrap=c not in _LEFT, min_width=keep)
        for row in rows:
            t.add_row(*row)
        return t

    def columns(self) -> list[str]:
        """The column names of :meth:`table` (and of the markdown table), in order."""
        level = next((h.level for h in (sd.headline for sd in self.sites) if h is not None), 0.95)
        cols = ["#", "site", "shape", "s_U", "s_U/AG_rms", f"{level:g} interval", "verdict"]
        cols += ["plug-in ŝ/AG_rms", "chance", "± rounding", "AG_rms", "AG_max", "rank/p"]
        cols += _extra_columns(self.sites)
        if self.realizability:
            cols += ["r̂", "ρ̂"]
        if self.delta is not None:
            cols += [f"{1 - self.delta:g} interval of s (δ)", "certificate"]
        if any(sd.verdict is Verdict.UNDETERMINED and sd.stream is None for sd in self.sites):
            cols += ["n to decide"]
        if any(sd.stream is not None for sd in self.sites):
            cols += _STREAM_COLUMNS
        if any(sd.interval is not None and sd.interval.score_lower == 0 for sd in self.sites):
            cols += ["n to certify"]
        if any(sd.decision is not None for sd in self.sites):
            cols += ["decision"]
        return cols

    def _row(self, sd: SiteDiagnosis, cols: list[str]) -> list[str]:
        """One site's cells of :meth:`table`, in the order of ``cols``."""
        r, head, iv = sd.result, sd.headline, sd.interval
        cells = {
            "#": str(sd.depth),
            "site": sd.site,
            "shape": "×".join(map(str, sd.shape)),
            "verdict": sd.verdict.value,
            "± rounding": _g(r.score_error),
            "AG_rms": _g(r.ag_rms),
            "AG_max": _g(r.ag_max),
            "rank/p": f"{r.tangent_rank}/{r.tangent_dim}",
            "r̂": _g(r.raw_score),
            "ρ̂": _g(r.realizability_defect),
            "certificate": "—" if sd.certificate is None else sd.certificate.value,
            "n to decide": _opt(r.examples_needed if sd.verdict is Verdict.UNDETERMINED else None),
            **_stream_cells(sd),
            "decision": "—" if sd.decision is None else sd.decision.value,
            "n to certify": _opt(None if iv is None or iv.score_lower > 0 else iv.n_to_certify),
            **_headline_cells(head, r),
            **dict(zip(_extra_columns([sd]), _extra_cells(sd, _extra_columns([sd])), strict=True)),
        }
        for c in cols:
            if c.endswith("interval of s (δ)"):
                cells[c] = "—" if iv is None else f"[{_g(iv.score_lower)}, {_g(iv.score_upper)}]"
            elif c.endswith(" interval"):
                cells[c] = "—" if head is None else f"[{_g(_rel(head.low, head))}, {_g(_rel(head.high, head))}]"
        return [cells.get(c, "—") for c in cols]

    def markdown(self) -> str:
        """The table of :meth:`table` as a GitHub-flavoured markdown table, then the reasons of undetermined sites.

        Returns:
            The markdown text (a title line, the table, one line per undetermined site).
        """
        cols = self.columns()
        lines = [
            f"depthsat diagnose: {self.description or 'model'}, family {self.family}, n = {self.n}, "
            f"J = {self.loss:.4g} ({self.loss_units}); joint s_U = {_g(self.joint_score_unbiased)}",
            "",
            "| " + " | ".join(cols) + " |",
            "|" + "|".join("---" if c in _LEFT else "---:" for c in cols) + "|",
        ]
        lines += ["| " + " | ".join(self._row(sd, cols)) + " |" for sd in self.sites]
        lines += [f"- {sd.site}: {sd.verdict_reason}" for sd in self.sites if sd.verdict is Verdict.UNDETERMINED]
        return "\n".join(lines) + "\n"

    def plot(self, path: str | os.PathLike) -> list[Path]:
        """Plot the headline ``s_U`` with its interval and the verdict per site, and ``s_U / AG_rms``, against depth.

        Top panel: ``s_U`` with its interval (``prop-headline-interval``) as error bars, one marker per verdict
        (improvable, saturated, undetermined, degenerate, named in the legend and above each site), the
        plug-in ``ŝ`` and its chance level ``sqrt(v̂/n)`` (``prop-plugin-chance-level``) dashed, ``AG_rms``, and
        the ``(1 − δ)`` interval of ``--delta`` when non-vacuous. Bottom panel: the same in the scale-free
        ``/AG_rms``. Writes ``<path>.png`` and ``<path>.svg`` (a ``.png``/``.svg`` suffix of ``path`` is
        replaced) with matplotlib's Agg canvas (no display needed).

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

        base = Path(path)
        if base.suffix.lower() in (".png", ".svg"):
            base = base.with_suffix("")
        xs = np.arange(len(self.sites))
        fig = Figure(figsize=(max(6.0, 0.5 * len(xs) + 3), 7.0))
        agg.FigureCanvasAgg(fig)
        ax1, ax2 = fig.subplots(2, 1, sharex=True)
        rms = np.array([sd.result.ag_rms for sd in self.sites])
        for ax, scale in ((ax1, np.ones_like(rms)), (ax2, np.where(rms > 0, rms, np.nan))):
            _plot_panel(ax, self.sites, xs, scale)
        ax1.plot(xs, rms, "s:", color="C9", alpha=0.6, label="AG_rms (upper bound of s)")
        ivs = [sd.interval for sd in self.sites]
        if any(iv is not None and not iv.vacuous for iv in ivs):  # vacuous ones are [0, γ]: not drawn
            lo = np.array([np.nan if iv is None or iv.vacuous else iv.score_lower for iv in ivs])
            hi = np.array([np.nan if iv is None or iv.vacuous else iv.score_upper for iv in ivs])
            ax1.fill_between(
                xs, lo, hi, alpha=0.15, color="C4", label=f"{1 - (self.delta or 0.0):g} finite-sample interval"
            )
        for sd, x in zip(self.sites, xs, strict=True):
            ax1.annotate(
                sd.verdict.value,
                (x, 1.0),
                xycoords=("data", "axes fraction"),
                fontsize=7,
                ha="center",
                va="bottom",
                rotation=30,
                color=_VERDICT_STYLE[sd.verdict][1],
            )
        ax1.set_ylabel("s_U (bias-corrected)", fontsize=9)
        width = max(60, int(fig.get_figwidth() * 11))  # characters per title line at 9 pt
        title = (
            f"{self.description or 'model'}: family {self.family}, n = {self.n}; "
            f"s in {self.loss_units} per unit function-space step"
        )
        ax1.set_title(textwrap.fill(title, width), fontsize=9, pad=28)
        ax1.legend(fontsize=7)
        ax2.set_ylim(0, 1.05)
        ax2.set_ylabel("s_U / AG_rms (scale-free)")
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


def _stream_cells(sd: SiteDiagnosis) -> dict[str, str]:
    """A site's cells of :data:`_STREAM_COLUMNS` ("—" when the site was not streamed)."""
    st = sd.stream
    if st is None:
        return dict.fromkeys(_STREAM_COLUMNS, "—")
    at = "—" if st.decided_at is None else f"{st.decided_at} (batch {st.decided_batch})"
    return dict(
        zip(
            _STREAM_COLUMNS,
            [str(st.examples_used), at, "—" if st.examples_needed is None else str(st.examples_needed)],
            strict=True,
        )
    )


#: Marker and colour of each verdict in :meth:`Diagnosis.plot`.
_VERDICT_STYLE = {
    Verdict.IMPROVABLE: ("o", "C3"),
    Verdict.SATURATED: ("s", "C2"),
    Verdict.UNDETERMINED: ("D", "C1"),
    Verdict.DEGENERATE: ("x", "0.4"),
}


def _plot_panel(ax, sites: list[SiteDiagnosis], xs: np.ndarray, scale: np.ndarray) -> None:
    """One panel of :meth:`Diagnosis.plot`: ``s_U`` with its interval per verdict, the plug-in and its chance level."""
    heads = [sd.headline for sd in sites]
    nan = math.nan
    su = np.array([nan if h is None else h.score for h in heads]) / scale
    lo = np.array([nan if h is None else h.low for h in heads]) / scale
    hi = np.array([nan if h is None else h.high for h in heads]) / scale
    plug = np.array([sd.result.score for sd in sites]) / scale
    chance = np.array([nan if h is None else h.chance for h in heads]) / scale
    ax.plot(xs, su, "-", color="C0", alpha=0.5)
    for verdict, (marker, color) in _VERDICT_STYLE.items():
        idx = np.array([sd.verdict is verdict for sd in sites])
        if idx.any():
            err = np.vstack([su[idx] - lo[idx], hi[idx] - su[idx]])
            ax.errorbar(
                xs[idx],
                su[idx],
                yerr=np.nan_to_num(err),
                fmt=marker,
                color=color,
                capsize=3,
                label=f"s_U and its interval: {verdict.value}",
            )
    ax.plot(xs, plug, "^--", color="C7", alpha=0.7, markersize=4, label="plug-in ŝ (biased up)")
    ax.plot(xs, chance, ":", color="C7", alpha=0.7, label="chance level of ŝ, sqrt(v̂/n)")


_LEFT = ("site", "verdict", "certificate", "decision")
#: The columns of :meth:`Diagnosis.table` with ``compact=True`` (besides the headline's interval).
_COMPACT = ("#", "site", "s_U/AG_rms", "verdict", "certificate", "n to decide", "n to decide (anytime)", "decision")


def _rel(value: float, head: Headline) -> float:
    return value / head.ag_rms if head.ag_rms > 0 else math.nan


def _headline_cells(head: Headline | None, r: SaturationResult) -> dict[str, str]:
    """The headline's cells: ``s_U``, ``s_U/AG_rms``, the plug-in ``ŝ/AG_rms`` and its chance level."""
    if head is None:
        return {"s_U": "—", "s_U/AG_rms": "—", "plug-in ŝ/AG_rms": _g(r.relative_score), "chance": "—"}
    return {
        "s_U": _g(head.score),
        "s_U/AG_rms": _g(head.relative_score),
        "plug-in ŝ/AG_rms": _g(head.relative_plugin),
        "chance": _g(head.relative_chance),
    }


def _opt(v: int | None) -> str:
    return "—" if v is None else str(v)


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
        cols += ["s_old/AG_rms", "s_beyond/AG_rms"]
    return cols


def _extra_cells(sd: SiteDiagnosis, cols: list[str]) -> list[str]:
    cells = {
        "s²/2β": _beta_cell(sd),
        "saddle σ": "—" if sd.saddle is None else _g(sd.saddle.saddle_score),
        "s²/2κ (local)": "—" if sd.curvature is None else _g(sd.curvature.local_decrease),
        "kink ties": "—" if sd.result.kink_ties is None else str(sd.result.kink_ties),
        "s_old/AG_rms": "—" if sd.stationarity is None else _g(sd.stationarity.relative_score),
        "s_beyond/AG_rms": "—" if sd.beyond_training is None else _g(sd.beyond_training.relative_score),
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
