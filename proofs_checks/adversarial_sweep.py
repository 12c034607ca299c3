"""Adversarial verdict sweep against exact truth: near thresholds, wide float64 sites, low precision, padding, resume.

Every probe is built from Walsh (Sylvester–Hadamard) columns, so the truth is exact on the *stored* arrays:

* the features ``z`` are Walsh columns ``h₁ … h_d``, and each planted pair replaces a column by ``h_q + ε h_w`` (``ε`` a
  power of two, stored exactly), so the span of the linear family's features (with the constant) is exactly the span of
  the Walsh columns ``S``; a pair is a direction of amplitude :func:`~proofs_checks.t8_numerics.planted_amplitude`
  ``(ε) ≈ ε/√2`` on the unit-diagonal Gram (a graded set of pairs gives an LLM-like spread of amplitudes);
* the activation gradient's first coordinate is ``Σ_j a_j h_{w_j} + b h_junk`` rounded to the probe's dtype, the rest
  zero; the exact score of the stored values is ``s² = Σ_{j∈S} c_j² / (N n)`` with ``c = Hᵀg`` the Walsh coefficients
  of the stored column, computed in rational arithmetic (:func:`exact_score`);
* every unit row of a Walsh span has leverage ``|S|/N``, so on one unit per example the noise test's
  ``v = tr(Σ⁺ E[XᵀX]) = |S| AG_rms²`` exactly and its exact ratio is ``n s²/v`` (:func:`exact_noise_ratio`).

A verdict is **wrong** when it contradicts that truth: *saturated* with ``s > tol + e`` (``tol + e`` is what
"saturated" promises), *improvable* with ``s < ŝ − e`` (``s = 0`` included), or *improvable* while the exact-arithmetic
noise test on the stored values does not reject (``n s²/v ≤ χ²``: the arithmetic, not the data, passed the test).
A planted direction of amplitude at most the features' rounding ``ε_M = 4 √k̃ u`` is outside the resolvable tangent
space (theory/numerics.md, ``def-resolution``): where a verdict is wrong only against the stored values and right
against the score without that direction, it is counted as *sub-resolution*, not as wrong.

``python -m proofs_checks.adversarial_sweep`` runs the sweep and prints the table (family × precision × k̃ ×
conditioning: instances, wrong verdicts, sub-resolution, resumed runs that differ); ``--quick``: small sites only.
"""

from __future__ import annotations

import argparse
import collections
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
import safetensors.torch
import torch
from scipy.linalg import hadamard

from depthsat_theory import parse_family
from depthsat_theory.statistics import SaturationResult, statistics_for
from depthsat_theory.statistics.linalg import noise_threshold, unit_roundoff

from .t8_numerics import planted_amplitude

DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: The smallest planted ``ε = 2^-m`` whose column ``h_q + ε h_w`` each dtype stores exactly.
SMALLEST_EPS_EXP = {"float64": 45, "float32": 22, "float16": 9, "bfloat16": 6}


@dataclass
class WalshProbe:
    """A probe whose exact score is known: see the module docstring.

    Attributes:
        z: site tensors, ``(n, d)`` (vector) or ``(n, T, d)`` (sequence), in the probe's dtype.
        g: activation gradients, same shape and dtype.
        span: indices of the Walsh columns spanning the features (with the constant, column 0).
        rows: the unit rows (``N``) in Walsh order: ``z``'s real rows are ``H[:, 1:d+1]`` with the pairs planted.
        amplitudes: the planted directions' amplitudes on the unit-diagonal Gram.
        mask: ``(n, T)`` bool for a padded sequence probe (``True`` at real tokens), else ``None``.
    """

    z: torch.Tensor
    g: torch.Tensor
    span: frozenset[int]
    rows: int
    amplitudes: tuple[float, ...]
    mask: torch.Tensor | None = None
    planted: dict[int, float] = field(default_factory=dict)  # Walsh column of each pair → its amplitude

    @property
    def n(self) -> int:
        """Number of examples."""
        return int(self.z.shape[0])

    def real_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """``(z, g)`` of the real unit rows as stored, float64 ``(N, d)`` (padding left out)."""
        z, g = self.z.double().numpy(), self.g.double().numpy()
        if self.mask is None:
            return z.reshape(-1, z.shape[-1]), g.reshape(-1, g.shape[-1])
        keep = self.mask.numpy()
        return z[keep], g[keep]


def walsh_rows(
    rows: int, d: int, eps: Sequence[float], coefs: Sequence[float], junk: float
) -> tuple[np.ndarray, np.ndarray, frozenset[int], dict[int, float]]:
    """Float64 unit rows ``(z, g)`` ``(rows, d)`` of a Walsh probe with planted pairs (exact in float64).

    Pair ``j`` sets column ``2j+1`` (0-based) of ``z`` to ``h_{2j+1} + ε_j h_{d+1+j}``; ``g[:, 0] = Σ_j a_j h_{d+1+j} +
    junk · h_{d+1+m}`` (``m`` pairs).

    Returns:
        ``(z, g, span, planted)``: the rows, the spanning Walsh columns, and ``{w_j: amplitude_j}``.

    Raises:
        ValueError: when the Walsh matrix has too few columns.
    """
    if d + 2 + len(eps) > rows or 2 * len(eps) > d:
        raise ValueError(f"{rows} Walsh rows cannot hold d = {d} features and {len(eps)} planted pairs")
    h = hadamard(rows).astype(np.float64)
    z = h[:, 1 : d + 1].copy()
    g = np.zeros((rows, d))
    span = set(range(d + 1))
    planted = {}
    for j, (e, a) in enumerate(zip(eps, coefs, strict=True)):
        p, q, w = 2 * j + 2, 2 * j + 1, d + 1 + j
        z[:, p - 1] = h[:, q] + e * h[:, w]
        span.discard(p)
        span.add(w)
        planted[w] = planted_amplitude(e)
        g[:, 0] += a * h[:, w]
    g[:, 0] += junk * h[:, d + 1 + len(eps)]
    return z, g, frozenset(span), planted


def vector_probe(n: int, d: int, eps: Sequence[float], coefs: Sequence[float], junk: float, dtype: str) -> WalshProbe:
    """A vector-site Walsh probe (one unit per example) in ``dtype`` (``z`` exact; ``g`` rounded, truth from it).

    Raises:
        AssertionError: when ``dtype`` cannot store ``z`` exactly.
    """
    z, g, span, planted = walsh_rows(n, d, eps, coefs, junk)
    zt, gt = torch.from_numpy(z).to(DTYPES[dtype]), torch.from_numpy(g).to(DTYPES[dtype])
    assert np.array_equal(zt.double().numpy(), z), f"{dtype} does not store the planted features exactly"
    return WalshProbe(zt, gt, span, n, tuple(planted.values()), None, planted)


def padded_probe(
    rows: int, d: int, eps: Sequence[float], coefs: Sequence[float], junk: float, dtype: str, *, pad: float, seed=0
) -> WalshProbe:
    """A padded sequence probe: the Walsh rows spread over sequences of ``T = 8`` tokens of uneven lengths.

    Padded positions hold random ``z`` of scale ``pad`` (e.g. ``10³⁰``: what a model computes there must not matter) and
    ``g = 0`` (a nonzero gradient at a padded position is refused: the loss reads padding); each real token's ``g`` is
    divided by its sequence's length, as ``reduction="token_mean"`` gives (lengths 1–8; the powers of two divide
    exactly).  Units are tokens (rows).
    """
    z_rows, g_rows, span, planted = walsh_rows(rows, d, eps, coefs, junk)
    pattern = (8, 4, 2, 1, 8, 3, 5, 8)
    lens: list[int] = []
    while sum(lens) < rows:
        lens.append(min(pattern[len(lens) % len(pattern)], rows - sum(lens)))
    rng = np.random.default_rng(seed)
    n, T = len(lens), max(pattern)
    z = rng.standard_normal((n, T, d)) * pad
    g = np.zeros((n, T, d))
    mask = np.zeros((n, T), dtype=bool)
    at = 0
    for i, L in enumerate(lens):
        z[i, :L], g[i, :L], mask[i, :L] = z_rows[at : at + L], g_rows[at : at + L] / L, True
        at += L
    zt, gt = torch.from_numpy(z).to(DTYPES[dtype]), torch.from_numpy(g).to(DTYPES[dtype])
    assert np.array_equal(zt.double().numpy()[mask], z_rows), f"{dtype} does not store the planted features exactly"
    return WalshProbe(zt, gt, span, rows, tuple(planted.values()), torch.from_numpy(mask), planted)


def _walsh_coefficients(col: list[Fraction]) -> list[Fraction]:
    """``Hᵀ col`` exactly: the fast Walsh–Hadamard transform in rationals (Sylvester order, as ``scipy``'s)."""
    a, h = list(col), 1
    while h < len(a):
        for i in range(0, len(a), 2 * h):
            for j in range(i, i + h):
                a[j], a[j + h] = a[j] + a[j + h], a[j] - a[j + h]
        h *= 2
    return a


def exact_score(probe: WalshProbe, *, drop: frozenset[int] = frozenset()) -> tuple[Fraction, Fraction]:
    """``(s², AG_rms²)`` of the stored probe, exactly (the Walsh columns ``drop`` left out of the span).

    ``s² = ‖P g‖²/n`` with ``P`` the projector on the span of the real rows' features: ``‖Pg‖² = Σ_{j∈S} c_j²/N``.
    """
    _, g = probe.real_rows()
    s2 = a2 = Fraction(0)
    for col in g.T:
        if not col.any():
            continue
        q = [Fraction(float(x)) for x in col]
        c = _walsh_coefficients(q)
        s2 += sum((c[j] * c[j] for j in probe.span - drop), Fraction(0)) / probe.rows
        a2 += sum((x * x for x in q), Fraction(0))
    return s2 / probe.n, a2 / probe.n


def exact_noise_ratio(probe: WalshProbe) -> Fraction:
    """``n s² / v`` of the stored vector probe exactly: every unit has leverage ``|S|/n``, so ``v = |S| AG_rms²``."""
    s2, a2 = exact_score(probe)
    return probe.n * s2 / (len(probe.span) * a2) if a2 else Fraction(0)


def stream(probe: WalshProbe, batch: int, *, stop: int | None = None, products: str = "float64", gram: str = "auto"):
    """The engine's statistics (linear family) over the probe in batches of ``batch`` examples.

    ``stop``: interrupt after that many batches, serialise the state as ``--checkpoint`` does (safetensors), load it
    into a fresh statistic and stream the rest.
    """
    layout = "vector" if probe.mask is None else "sequence"
    kw: dict[str, Any] = dict(products=products, gram=gram)
    fam = parse_family("linear")
    stats = statistics_for(fam, tuple(probe.z.shape[1:]), layout, **kw)
    for b, i in enumerate(range(0, probe.n, batch)):
        if b == stop:  # the checkpoint's serialisation: the state dict through safetensors
            saved = {k: v.contiguous() for k, v in stats.state_dict().items()}  # as write_checkpoint stores them
            state = safetensors.torch.load(safetensors.torch.save(saved))
            stats = statistics_for(fam, tuple(probe.z.shape[1:]), layout, **kw)
            stats.load_state_dict(state)
        m = None if probe.mask is None else probe.mask[i : i + batch]
        stats.update(probe.z[i : i + batch], probe.g[i : i + batch], mask=m)
    return stats


def same_result(a: SaturationResult, b: SaturationResult) -> bool:
    """Whether two results agree in verdict, reason and every reported number (NaN equal to NaN)."""
    x, y = a.to_dict(), b.to_dict()
    return x == y


def feature_rounding(probe: WalshProbe, products: str) -> float:
    """``ε_M = 4 √k̃ u`` of the probe's features (float32 at least with float32 products)."""
    u = unit_roundoff(probe.z.dtype)
    if products == "float32":
        u = max(u, unit_roundoff(torch.float32))
    return 4 * math.sqrt(probe.z.shape[-1] + 1) * u


@dataclass
class Judgement:
    """A verdict against the exact truth (see the module docstring)."""

    verdict: str
    score: float
    exact: float
    error: float
    wrong: bool
    sub_resolution: bool


def judge(probe: WalshProbe, res: SaturationResult, products: str = "float64") -> Judgement:
    """Compare ``res`` with the exact truth of ``probe`` (and with the resolvable truth for sub-resolution pairs)."""
    s2, _ = exact_score(probe)
    vector = probe.mask is None
    ratio = exact_noise_ratio(probe) if vector else None

    def wrong_for(s2x: Fraction) -> bool:
        s = math.sqrt(s2x)
        if res.verdict.value == "saturated":
            return s > res.tol + res.score_error
        if res.verdict.value == "improvable":
            below = s2x == 0 or s < res.score - res.score_error
            return below or (ratio is not None and ratio <= Fraction(noise_threshold(res.alpha)))
        return False

    wrong = wrong_for(s2)
    sub = frozenset(w for w, amp in probe.planted.items() if amp <= feature_rounding(probe, products))
    sub_resolution = wrong and bool(sub) and not wrong_for(exact_score(probe, drop=sub)[0])
    return Judgement(
        res.verdict.value, res.score, math.sqrt(s2), res.score_error, wrong and not sub_resolution, sub_resolution
    )


# ------------------------------------------------------------------------------------------------ the sweep
def _signals(e: float, n: int, k: int) -> Iterator[tuple[float, float, str]]:
    """``(a, b, what)``: signal on the planted direction and junk, around both thresholds."""
    yield 0.0, 1.0, "s = 0"
    yield 1.0, 0.0, "s = AG_rms"
    yield 0.25, 1.0, "s = 1/4"
    for f in (0.5, 0.9, 1.1, 2.0, 4.0):
        yield min(e * f, 4.0), 1.0, f"s ≈ {f}e"
    q = noise_threshold(0.05) * k / n  # a²/(a² + b²) where the exact noise ratio is at the threshold
    if q < 1:
        for r in (-1e-2, -1e-4, 1e-4, 1e-2):
            yield 0.25, 0.25 * math.sqrt(1 / q - 1) * (1 + r), f"noise ratio ≈ χ²(1 {'+' if r < 0 else '-'} {abs(r):g})"


@dataclass
class Cell:
    """One row of the table."""

    instances: int = 0
    wrong: int = 0
    sub_resolution: int = 0
    resume_differs: int = 0
    verdicts: collections.Counter = field(default_factory=collections.Counter)


def _run_one(table, key, probe: WalshProbe, batch: int, products: str, *, resume: bool = True) -> None:
    res = stream(probe, batch, products=products).result()
    cell = table[key]
    jd = judge(probe, res, products)
    cell.instances += 1
    cell.wrong += jd.wrong
    cell.sub_resolution += jd.sub_resolution
    cell.verdicts[jd.verdict] += 1
    if resume:
        nb = -(-probe.n // batch)
        cell.resume_differs += not same_result(res, stream(probe, batch, stop=nb // 2, products=products).result())
    if jd.wrong:
        print(f"WRONG {key}: {jd}")


def sweep(quick: bool = False) -> dict[tuple, Cell]:
    """Run the sweep; returns ``{(family, dtype, products, k̃, conditioning): Cell}``."""
    table: dict[tuple, Cell] = collections.defaultdict(Cell)
    for dtype in DTYPES:
        for products in ("float64", "float32"):
            for d in (8, 32):
                m = SMALLEST_EPS_EXP[dtype]
                for ex in sorted({1, (m + 1) // 2, m}):
                    eps = 2.0**-ex
                    pilot = stream(vector_probe(256, d, [eps], [0.0], 1.0, dtype), 64).result()
                    e = pilot.score_error if math.isfinite(pilot.score_error) else 0.1
                    for a, b, _ in _signals(e, 256, d + 1):
                        key = ("walsh-planted", dtype, products, d + 1, f"ε = 2^-{ex}")
                        _run_one(table, key, vector_probe(256, d, [eps], [a], b, dtype), 64, products)
                    big = 6e4 if dtype == "float16" else 1e30
                    for a, b, pad in (
                        (0.0, 1.0, 1.0),
                        (1.0, 0.0, big),
                        (0.25, 1.0, big),
                        (e, 1.0, 1.0),
                        (4 * e, 1.0, big),
                    ):
                        key = ("padded-token-mean", dtype, products, d + 1, f"ε = 2^-{ex}")
                        probe = padded_probe(256, d, [eps], [a], b, dtype, pad=pad)
                        _run_one(table, key, probe, 16, products)
    if quick:
        return table
    for rows, d in ((2048, 1099), (4096, 2099)):
        for dtype in ("float64", "float32"):
            for ex in (1, 20, 30) if dtype == "float64" else (1, 12):
                graded = [2.0**-ex * 2.0 ** (-2 * j) for j in range(3)] if ex > 1 else [0.5] * 3
                for coefs, junk in (([0, 0, 0], 1.0), ([2.0**-10, 0, 0], 1.0), ([0, 0, 0.375], 1.0), ([0.25] * 3, 0.5)):
                    key = ("walsh-graded", dtype, "float64", d + 1, f"ε = 2^-{ex}…2^-{ex + 4}")
                    probe = vector_probe(rows, d, graded, coefs, junk, dtype)
                    _run_one(table, key, probe, 512, "float64", resume=coefs[0] > 0)
    return table


def render(table: dict[tuple, Cell]) -> str:
    """The sweep's table as markdown."""
    out = [
        "| probe | dtype | products | k̃ | conditioning | instances | wrong | sub-resolution | resume differs "
        "| verdicts |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (fam, dt, prod, k, cond), c in table.items():
        verdicts = ", ".join(f"{v} {c.verdicts[v]}" for v in sorted(c.verdicts))
        out.append(
            f"| {fam} | {dt} | {prod} | {k} | {cond} | {c.instances} | {c.wrong} | {c.sub_resolution} | "
            f"{c.resume_differs} | {verdicts} |"
        )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep and print its table; exit 1 if a verdict is wrong or a resumed run differs."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sites only (no k̃ > 1024)")
    args = ap.parse_args(argv)
    table = sweep(quick=args.quick)
    print(render(table))
    return int(any(c.wrong or c.resume_differs for c in table.values()))


if __name__ == "__main__":
    raise SystemExit(main())
