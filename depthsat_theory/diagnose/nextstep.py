"""What would decide an undetermined site, and the command that does it (:func:`next_step`).

The causes are those of :attr:`~depthsat_theory.statistics.SaturationResult.verdict_reason`, in its order:
ties at kinks, a Gram too ill-conditioned for the rounding bound, a rounding bound that says nothing, dropped
directions, a signal below the probe dtype's resolution, a noise moment the arithmetic cannot resolve, and the
noise test (probe size, float32 products, or no evidence of signal). Probe sizes come from
:attr:`~depthsat_theory.statistics.SaturationResult.examples_needed` (fixed probe, ``thm-noise-test``) and
:func:`~depthsat_theory.decision.sequential_examples_needed` (the anytime test, ``thm-anytime-noise-test``).
"""

from __future__ import annotations

import math

from depthsat_theory.decision.sequential import sequential_examples_needed
from depthsat_theory.statistics import SaturationResult
from depthsat_theory.vocabulary import Verdict

__all__ = ["next_step"]

#: The command every suggestion extends (``...``: the options of the run being read).
COMMAND = "depthsat diagnose ..."

_FINER = {"bfloat16": "float32", "float16": "float32", "float32": "float64"}

_FEWER = "fewer or better-conditioned features (a smaller family, e.g. --family linear or relu:K with a smaller K)"


def next_step(result: SaturationResult) -> str | None:
    """What would decide an undetermined verdict, and the ``depthsat diagnose`` options that do it.

    Args:
        result: a site's :class:`~depthsat_theory.statistics.SaturationResult`.

    Returns:
        One line starting ``to decide:`` (``None`` unless :attr:`~SaturationResult.verdict` is
        ``UNDETERMINED``).
    """
    if result.verdict is not Verdict.UNDETERMINED:
        return None
    return "to decide: " + _step(result)


def _precision(r: SaturationResult) -> str:
    """A finer arithmetic: the model in a finer dtype, float64 products."""
    finer = _FINER.get(r.dtype)
    dtype = f"run the model in {finer} (the probe was {r.dtype})" if finer else "keep the model in float64"
    return f"{dtype}, with float64 products (`{COMMAND} --products float64`)"


def _step(r: SaturationResult) -> str:
    """The suggestion for the cause that :attr:`SaturationResult.verdict_reason` names."""
    if r.kink_ties:
        return (
            f"a probe without exact ties at kinks (`{COMMAND} --seed S` with another probe draw), or the one-sided "
            f"derivatives along ±Πg (thm-directional)"
        )
    if not math.isfinite(r.tol):
        return f"{_FEWER}: `{COMMAND} --family linear`; or {_precision(r)}"
    if r.probe_verdict is Verdict.UNDETERMINED and not r.unresolved:
        return f"precision: {_precision(r)}; or {_FEWER}"
    if r.probe_verdict is Verdict.UNDETERMINED:
        return (
            f"resolve the {r.unresolved} dropped direction(s): `{COMMAND} --gram units` (float64, more than 1024 "
            f"features), or {_FEWER}, or {_precision(r)}"
        )
    if r.probe_verdict is Verdict.SATURATED:
        return f"precision (the signal is below the rounding bound): {_precision(r)}"
    if r.noise_unusable:
        return f"precision: {_precision(r)}; or {_FEWER}"
    return _noise_step(r)


def _noise_step(r: SaturationResult) -> str:
    """The noise test's suggestion: probe size (fixed and anytime), float64 products, or no signal to chase."""
    need = r.examples_needed
    s2u, v = r.score_squared_unbiased, r.noise_variance
    if need:
        seq = sequential_examples_needed(s2u, v, alpha=r.alpha)
        anytime = (
            ""
            if seq is None
            else f", or stream until decided (`{COMMAND} --until-decided --max-examples {max(seq, need)}`)"
        )
        return (
            f"about {need} examples (`{COMMAND} --max-examples {need}`){anytime}; or fewer features (a smaller "
            f"family: v̂ grows with the tangent rank {r.tangent_rank})"
        )
    if v > 0 and s2u > 1e-8 * v / r.n:
        return f"float64 products: `{COMMAND} --products float64` (this probe size suffices for s² ≈ {s2u:.3g})"
    return (
        f"nothing in sight: ŝ²_U ≤ 0 shows no signal, and a larger probe only narrows the headline's upper end "
        f"(∝ 1/√n; `{COMMAND} --max-examples {4 * r.n}` halves it); a bound on s needs --delta"
    )
