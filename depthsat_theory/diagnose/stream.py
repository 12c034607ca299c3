"""Stream until decided: :func:`~depthsat_theory.diagnose.diagnose` with ``until_decided=True``.

One :class:`~depthsat_theory.decision.AnytimeSiteTest` per site is fed every probe batch, beside the site's
statistics (the same forward and backward pass).  Before each batch the stream asks :meth:`AnytimeStreams.stop`:
it stops once every site's test has decided (``M_n ≥ 1/α``), or when the next batch would take the examples
read above ``max_examples``; else it reads on until the probe ends.

The stopping rule reads the anytime tests only, never the fixed-size noise test, so the level of the
*improvable* verdicts it gives holds whatever the stopping (theory/decision.md, ``thm-anytime-noise-test``:
under sign-symmetric cross-gradients, ``P(some site's test ever decides) ≤ α`` per site).  The verdict of a
site in such a run (:func:`stream_verdict`):

- decided by the anytime test: *improvable* (the reason says "anytime noise test", the example and batch of
  the decision), unless the probe's arithmetic says otherwise (degenerate, kink ties, below resolution);
- not decided: *undetermined*, with what a decision would still need (the anytime forecast
  ``examples_needed``), even where the fixed-size noise test on the same examples would reject (its level
  does not hold after stopping on the data); *saturated (within rounding)* and *degenerate* stand, as they
  are statements on the probe's own measure and arithmetic, not tests.

The tests' state (:meth:`~depthsat_theory.decision.AnytimeNoiseTest.state_dict`) is saved in the diagnose
checkpoint under ``"@anytime:<site>/<name>"`` with the batch of each decision in the header field
``anytime`` (:func:`~depthsat_theory.diagnose.checkpoint.restore_anytime`), so that a resumed run equals an
uninterrupted one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from torch import Tensor

from depthsat_theory.decision.sequential import PRIOR_EXAMPLES, AnytimeSiteTest
from depthsat_theory.families import FeatureFamily
from depthsat_theory.statistics import SaturationResult
from depthsat_theory.statistics.linalg import NOISE_ALPHA
from depthsat_theory.vocabulary import Verdict

__all__ = ["ANYTIME_PREFIX", "AnytimeStreams", "SiteStream", "stream_verdict"]

#: Prefix of the anytime tests' tensors in a diagnose checkpoint (``@`` cannot start a module name).
ANYTIME_PREFIX = "@anytime:"


@dataclass
class SiteStream:
    """What the anytime noise test says at one site after a streamed probe (``thm-anytime-noise-test``).

    Attributes:
        examples_used: the examples the site's verdict rests on: those read up to the decision for a decided
            site, else every example read.
        decided_at: the example (1-based count over the probe) at which ``M_n`` first reached ``1/α``;
            ``None``: not decided.
        decided_batch: the probe batch (0-based global index) of that look; ``None``: not decided.
        e_value: ``M_n`` at the last example used (dimensionless; ``≥ 1/α`` once decided).
        examples_needed: forecast of the total examples at which the test would decide if ``s² = ŝ²_U``
            (:func:`~depthsat_theory.decision.sequential_examples_needed`); ``None`` when decided or without
            signal.
        alpha: the level ``α``.
        stopped: why reading stopped: ``"decided"`` (every site decided), ``"budget"`` (``max_examples``) or
            ``"probe"`` (the probe ended).
    """

    examples_used: int
    decided_at: int | None
    decided_batch: int | None
    e_value: float
    examples_needed: int | None
    alpha: float
    stopped: str

    @property
    def decided(self) -> bool:
        """Whether the anytime test decided (the site is improvable at level ``α`` whatever the stopping)."""
        return self.decided_at is not None

    @property
    def reason(self) -> str:
        """The decision in one line, or why there is none and what would decide it."""
        if self.decided:
            return (
                f"anytime noise test: M = {self.e_value:.3g} >= 1/alpha = {1 / self.alpha:.3g} at example "
                f"{self.decided_at} (probe batch {self.decided_batch}); level {self.alpha:g} whatever the stopping "
                f"(thm-anytime-noise-test)"
            )
        why = {"budget": "the budget (max_examples) is spent", "probe": "the probe ended"}.get(self.stopped, "")
        need = (
            f"about {self.examples_needed} examples would decide if s² ≈ ŝ²_U (rerun with --max-examples "
            f"{self.examples_needed} or a larger probe)"
            if self.examples_needed
            else "no evidence of signal yet"
        )
        return (
            f"the anytime noise test did not decide in {self.examples_used} examples (M = {self.e_value:.3g} < "
            f"{1 / self.alpha:.3g}; {why}); {need}"
        )

    def to_dict(self) -> dict:
        """JSON-ready dictionary (``e_value`` ``None`` when not finite).

        Returns:
            The fields, ``decided`` and ``reason``.
        """
        return {
            "examples_used": self.examples_used,
            "decided_at": self.decided_at,
            "decided_batch": self.decided_batch,
            "e_value": self.e_value if math.isfinite(self.e_value) else None,
            "examples_needed": self.examples_needed,
            "alpha": self.alpha,
            "stopped": self.stopped,
            "decided": self.decided,
            "reason": self.reason,
        }


def stream_verdict(stream: SiteStream, result: SaturationResult) -> tuple[Verdict, str]:
    """The verdict of a site in a streamed run and its one-line reason (module docstring).

    Args:
        stream: the site's anytime outcome.
        result: the site's fixed-size statistics over every example read.

    Returns:
        ``(verdict, reason)``; the reason names the test the verdict comes from.
    """
    pv = result.probe_verdict
    if stream.decided:
        if pv is Verdict.IMPROVABLE:
            return Verdict.IMPROVABLE, stream.reason
        if pv is Verdict.DEGENERATE:
            return Verdict.DEGENERATE, "degenerate (T = {0}) on the probe's arithmetic"
        return Verdict.UNDETERMINED, f"{stream.reason}; but on the probe's arithmetic: {result.verdict_reason}"
    if result.verdict in (Verdict.DEGENERATE, Verdict.SATURATED):
        return result.verdict, (
            f"{result.verdict_reason} (the probe's arithmetic over the {stream.examples_used} examples read, not a "
            f"test; {stream.reason})"
        )
    return Verdict.UNDETERMINED, stream.reason


class AnytimeStreams:
    """The anytime noise tests of a streamed :func:`~depthsat_theory.diagnose.diagnose` run, one per site.

    Args:
        family: the residual family (a zero-output feature family).
        sites: the site names.
        max_examples: the budget in examples (``None``: the whole probe).
        alpha: level ``α`` (default :data:`~depthsat_theory.statistics.linalg.NOISE_ALPHA`).
        prior_examples: ``ρ`` of the normal mixture, in examples.
    """

    def __init__(
        self,
        family: FeatureFamily,
        sites: list[str],
        max_examples: int | None,
        *,
        alpha: float = NOISE_ALPHA,
        prior_examples: float = PRIOR_EXAMPLES,
    ) -> None:
        self.family, self.sites, self.max_examples = family, list(sites), max_examples
        self.alpha, self.prior_examples = float(alpha), float(prior_examples)
        self.tests: dict[str, AnytimeSiteTest] = {}
        self.decided_batch: dict[str, int | None] = dict.fromkeys(self.sites)
        self.stopped = "probe"

    def make(self, shapes: Mapping[str, tuple], layouts: Mapping[str, str]) -> None:
        """Create one test per site for these per-example shapes and layouts (before the first batch)."""
        for s in self.sites:
            self.tests[s] = AnytimeSiteTest(
                self.family, shapes[s], str(layouts[s]), alpha=self.alpha, prior_examples=self.prior_examples
            )

    def update(self, index: int, z: Mapping[str, Tensor], g: Mapping[str, Tensor], mask: Tensor | None) -> None:
        """Feed probe batch ``index`` (site tensors ``z``, activation gradients ``g``) to every test.

        Args:
            index: the batch's global index (recorded as the look of a decision).
            z: ``{site: (B, *shape)}`` site tensors.
            g: ``{site: (B, *shape)}`` activation gradients of the per-example losses.
            mask: ``(B, T)`` padding mask of sequence sites, or ``None``.

        Raises:
            StatisticsError: for NaN/Inf or shapes that change between batches.
        """
        for s in self.sites:
            test = self.tests[s]
            was = test.decided
            use_mask = mask if mask is not None and z[s].dim() == 3 else None
            test.update_site(z[s], g[s], use_mask)
            if test.decided and not was:
                self.decided_batch[s] = index

    @property
    def all_decided(self) -> bool:
        """Whether every site's test has decided."""
        return bool(self.tests) and all(t.decided for t in self.tests.values())

    def stop(self, examples: int, next_size: int | None) -> bool:
        """Whether to stop before the next batch (``next_size`` examples; ``None``: not yet fetched).

        Args:
            examples: examples read so far.
            next_size: the next batch's size once fetched, else ``None``.

        Returns:
            ``True`` when every site is decided, or when the next batch would exceed ``max_examples``.
        """
        if self.all_decided:
            self.stopped = "decided"
            return True
        if self.max_examples is not None and next_size is not None and examples + max(next_size, 0) > self.max_examples:
            self.stopped = "budget"
            return True
        return False

    def outcomes(self, examples: int) -> dict[str, SiteStream]:
        """Every site's :class:`SiteStream` after ``examples`` examples were read."""
        out = {}
        for s in self.sites:
            t = self.tests[s]
            out[s] = SiteStream(
                examples_used=t.decided_at if t.decided_at is not None else examples,
                decided_at=t.decided_at,
                decided_batch=self.decided_batch[s],
                e_value=t.e_value,
                examples_needed=t.examples_needed,
                alpha=self.alpha,
                stopped=self.stopped,
            )
        return out

    def note(self, examples: int) -> str:
        """The run's note for the table and JSON: which test the verdicts come from, and why reading stopped."""
        decided = sum(t.decided for t in self.tests.values())
        why = {
            "decided": "every site was decided",
            "budget": f"the budget of {self.max_examples} examples was reached",
            "probe": "the probe ended",
        }[self.stopped]
        return (
            f"streamed until decided (level {self.alpha:g}, thm-anytime-noise-test): {decided} of {len(self.sites)} "
            f"sites decided after {examples} examples; stopped because {why}. Verdicts are the anytime test's "
            f"(improvable) or undetermined; the fixed-size noise test is not used for them (its level does not hold "
            f"after stopping on the data); saturated/degenerate are the probe's arithmetic"
        )
