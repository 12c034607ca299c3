"""Stream until decided: an anytime-valid noise test of ``s = 0`` (theory/decision.md, ``thm-anytime-noise-test``).

Per example ``W_i = ⟨X_i, H_i⟩ / c_i`` with ``H_i = Ĝ Σ̂⁻`` and ``c_i = sqrt(ŝ² v̂)`` from the batches
completed before ``i``'s (predictable), and the normal-mixture martingale
``M_n = sqrt(ρ/(ρ + V_n)) exp(S_n²/(2(ρ + V_n)))`` of ``S_n = Σ W_i``, ``V_n = Σ W_i²``.  Under
sign-symmetric cross-gradients ``P(sup_n M_n ≥ 1/α) ≤ α``, so the site may be called improvable at the
first look with ``M_n ≥ 1/α`` whatever the stopping rule (``rem-anytime-laws`` says for which laws).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from depthsat_theory.families import FamilyError, FeatureFamily, to_rows
from depthsat_theory.statistics.linalg import NOISE_ALPHA, resolve_spectrum
from depthsat_theory.statistics.result import StatisticsError
from depthsat_theory.vocabulary import Verdict

__all__ = ["AnytimeNoiseTest", "AnytimeSiteTest", "sequential_examples_needed"]

#: Default prior scale ``ρ`` of the mixture, in examples: the boundary is tightest for decisions near it.
PRIOR_EXAMPLES = 100.0


def _boundary(n: float, alpha: float, rho: float) -> float:
    """``2 ln(1/α) + ln(1 + n/ρ)``: ``S²/(ρ + V)`` above it rejects when ``V = n``."""
    return 2.0 * math.log(1.0 / alpha) + math.log1p(n / rho)


def sequential_examples_needed(
    score_squared: float, noise_variance: float, *, alpha: float = NOISE_ALPHA, prior_examples: float = PRIOR_EXAMPLES
) -> int | None:
    """Forecast of the examples the anytime test needs once its weights are set (``thm-anytime-noise-test``).

    With ``μ = sqrt(s²/v)`` the mean and ``1`` the (Cauchy–Schwarz) second moment of ``W``, the smallest
    ``n`` with ``(n μ)² / (ρ + n) ≥ 2 ln(1/α) + ln(1 + n/ρ)``; add the first batch, which only sets the
    weights.

    Args:
        score_squared: ``s²`` (e.g. ``ŝ²_U``), in (loss units)² per example.
        noise_variance: ``v`` (e.g. ``v̂``), same units.
        alpha: level ``α ∈ (0, 1)``.
        prior_examples: ``ρ > 0``.

    Returns:
        The forecast (examples), or ``None`` when ``s² ≤ 0`` or ``v ≤ 0`` (no signal to forecast).
    """
    if not (score_squared > 0 and noise_variance > 0):
        return None
    mu2 = score_squared / noise_variance
    ok = lambda n: (n * n * mu2) / (prior_examples + n) >= _boundary(n, alpha, prior_examples)  # noqa: E731
    hi = 1
    while not ok(hi):
        hi *= 2
        if hi > 2**62:
            return None
    lo = hi // 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def _as_rows(t, name: str) -> Tensor:
    """A float64 tensor ``(B, R, c)`` from ``(B, c)`` or ``(B, R, c)``."""
    t = torch.as_tensor(t).detach().to(torch.float64)
    if t.dim() == 2:
        t = t[:, None, :]
    if t.dim() != 3:
        raise StatisticsError(
            f"{name} has shape {tuple(t.shape)}: expected (B, k) or (B, R, k) (examples, units, columns)"
        )
    if not torch.isfinite(t).all():
        raise StatisticsError(f"{name} has NaN or Inf entries")
    return t


class AnytimeNoiseTest:
    """Anytime-valid test of ``s = 0`` from per-example feature rows and activation gradients.

    Feed batches with :meth:`update`; after any batch :attr:`decided` says whether ``M_n ≥ 1/α`` was
    reached at some example so far (then :attr:`verdict` is ``IMPROVABLE`` for good), and
    :attr:`budget_spent` whether ``max_examples`` were read.  Under sign-symmetric cross-gradients
    (``thm-anytime-noise-test``) the probability of ever deciding is at most ``α``, whatever the
    batch sizes or the rule that stops feeding.  The test never concludes "saturated": that is the
    rounding verdict of the final statistics (``rem-anytime-laws``).

    Args:
        alpha: level ``α ∈ (0, 1)``.
        prior_examples: ``ρ > 0`` of the normal mixture, in examples (default 100).
        max_examples: the budget (``None``: unbounded).
        rtol: explicit relative cutoff for ``Σ̂``'s pseudo-inverse in the weights (default: the
            resolution cutoffs of ``def-resolution``); affects power only.

    Raises:
        StatisticsError: for ``α`` outside ``(0, 1)``, ``ρ ≤ 0`` or ``max_examples < 1``.
    """

    def __init__(
        self,
        *,
        alpha: float = NOISE_ALPHA,
        prior_examples: float = PRIOR_EXAMPLES,
        max_examples: int | None = None,
        rtol: float | None = None,
    ) -> None:
        if not 0.0 < alpha < 1.0:
            raise StatisticsError(f"alpha = {alpha!r}: the level must lie in (0, 1)")
        if not prior_examples > 0:
            raise StatisticsError(f"prior_examples = {prior_examples!r}: must be > 0")
        if max_examples is not None and int(max_examples) < 1:
            raise StatisticsError(f"max_examples = {max_examples!r}: must be >= 1 (or None for no budget)")
        self.alpha = float(alpha)
        self.prior_examples = float(prior_examples)
        self.max_examples = None if max_examples is None else int(max_examples)
        self.rtol = rtol
        self.n = 0
        self.weighted = 0  # examples whose weight W_i was set (after the first batch)
        self.s_sum = 0.0
        self.v_sum = 0.0
        self.log_e = 0.0
        self.decided_at: int | None = None
        self._sigma: Tensor | None = None
        self._cross: Tensor | None = None
        self._q: Tensor | None = None

    # -- streaming -------------------------------------------------------------------------------------------------

    def _moments(self):
        """``(spectrum of Σ̂, Ĝ, ŝ², v̂)`` over the examples read so far (``None`` before any)."""
        if self.n == 0 or self._sigma is None or self._cross is None or self._q is None:
            return None
        spec = resolve_spectrum((self._sigma / self.n).numpy(), rtol=self.rtol)
        big_g = (self._cross / self.n).numpy()
        return spec, big_g, spec.quadratic(big_g), spec.trace_product((self._q / self.n).numpy())

    def _weights(self) -> tuple[Tensor, float] | None:
        """``(H, c) = (Ĝ Σ̂⁻, sqrt(ŝ² v̂))`` from the batches seen so far (``None``: no direction yet)."""
        moments = self._moments()
        if moments is None:
            return None
        spec, big_g, s2, v = moments
        if spec.rank == 0 or not (s2 > 0 and v > 0 and math.isfinite(s2 * v)):
            return None
        return torch.from_numpy(big_g @ spec.pinv()), math.sqrt(s2 * v)

    def update(self, phi, g) -> None:
        """Add a batch: feature rows ``φ̃`` and activation gradients ``g`` of its examples.

        Args:
            phi: ``(B, k̃)`` or ``(B, R, k̃)`` feature rows (``R`` units per example; padded units as zero rows),
                array-like, converted to float64.
            g: ``(B, d)`` or ``(B, R, d)`` activation gradients of the per-example losses at the same units.

        Raises:
            StatisticsError: for mismatched shapes, NaN/Inf, or a width different from earlier batches.
        """
        phi, g = _as_rows(phi, "phi"), _as_rows(g, "g")
        if phi.shape[:2] != g.shape[:2]:
            raise StatisticsError(f"phi {tuple(phi.shape)} and g {tuple(g.shape)} differ in examples or units")
        x = torch.einsum("brd,brk->bdk", g, phi)  # per-example cross-gradients X_i
        self._add(x, torch.einsum("brk,brl->kl", phi, phi))

    def update_cross(self, x, gram_sum) -> None:
        """Add a batch given per-example cross-gradients and the batch's feature Gram sum.

        Args:
            x: ``(B, d, k̃)`` per-example cross-gradients ``X_i = Σ_r g_r φ̃_rᵀ`` (float64).
            gram_sum: ``(k̃, k̃)`` the batch's ``Σ_i Σ_r φ̃_r φ̃_rᵀ``.

        Raises:
            StatisticsError: for mismatched shapes or NaN/Inf.
        """
        x = torch.as_tensor(x).detach().to(torch.float64)
        gram_sum = torch.as_tensor(gram_sum).detach().to(torch.float64)
        if x.dim() != 3 or gram_sum.shape != (x.shape[2], x.shape[2]):
            raise StatisticsError(f"x {tuple(x.shape)} must be (B, d, k) and gram_sum {tuple(gram_sum.shape)} (k, k)")
        if not (torch.isfinite(x).all() and torch.isfinite(gram_sum).all()):
            raise StatisticsError("x or gram_sum has NaN or Inf entries")
        self._add(x, gram_sum)

    def _add(self, x: Tensor, gram_sum: Tensor) -> None:
        if self._cross is not None and self._cross.shape != x.shape[1:]:
            raise StatisticsError(
                f"this batch's cross-gradients are {tuple(x.shape[1:])}, earlier ones {tuple(self._cross.shape)}"
            )
        weights = self._weights()
        if weights is not None and self.decided_at is None:
            h, c = weights
            self._advance(torch.einsum("bdk,dk->b", x, h) / c)
        self.n += int(x.shape[0])
        if self._sigma is None or self._cross is None or self._q is None:
            self._sigma, self._cross, self._q = gram_sum.clone(), x.sum(0), torch.einsum("bdk,bdl->kl", x, x)
            return
        self._sigma += gram_sum
        self._cross += x.sum(0)
        self._q += torch.einsum("bdk,bdl->kl", x, x)

    def _advance(self, w: Tensor) -> None:
        """Add the batch's ``W_i`` in order, checking ``M_n ≥ 1/α`` after each example."""
        s = self.s_sum + torch.cumsum(w, 0)
        v = self.v_sum + torch.cumsum(w * w, 0)
        log_m = 0.5 * torch.log(self.prior_examples / (self.prior_examples + v)) + s * s / (
            2 * (self.prior_examples + v)
        )
        hit = torch.nonzero(log_m >= math.log(1.0 / self.alpha))
        if hit.numel():
            i = int(hit[0])
            self.decided_at = self.n + i + 1
            s, v, log_m, w = s[: i + 1], v[: i + 1], log_m[: i + 1], w[: i + 1]
        self.s_sum, self.v_sum, self.log_e = float(s[-1]), float(v[-1]), float(log_m[-1])
        self.weighted += int(w.shape[0])

    # -- state -----------------------------------------------------------------------------------------------------

    @property
    def e_value(self) -> float:
        """``M_n`` at the last example used (``1/α`` or more once decided)."""
        return math.exp(self.log_e)

    @property
    def decided(self) -> bool:
        """Whether ``M_n ≥ 1/α`` at some example so far (the site is then improvable at level ``α``)."""
        return self.decided_at is not None

    @property
    def budget_spent(self) -> bool:
        """Whether ``max_examples`` have been read."""
        return self.max_examples is not None and self.n >= self.max_examples

    @property
    def done(self) -> bool:
        """Whether to stop feeding (decided, or the budget is spent)."""
        return self.decided or self.budget_spent

    @property
    def score_squared_unbiased(self) -> float:
        """``ŝ²_U = (n ŝ² − v̂)/(n − 1)`` over every example read (``nan`` before two examples)."""
        moments = self._moments()
        if moments is None or self.n < 2:
            return math.nan
        return (self.n * moments[2] - moments[3]) / (self.n - 1)

    @property
    def examples_needed(self) -> int | None:
        """Forecast of the total examples at which the test decides if ``s² = ŝ²_U`` (``None``: no signal yet).

        :func:`sequential_examples_needed` plus the examples read before the weights were set.
        """
        moments = self._moments()
        if self.decided or self.n < 2 or moments is None:
            return None
        need = sequential_examples_needed(
            self.score_squared_unbiased, moments[3], alpha=self.alpha, prior_examples=self.prior_examples
        )
        return None if need is None else need + (self.n - self.weighted)

    @property
    def verdict(self) -> Verdict:
        """``IMPROVABLE`` once decided, else ``UNDETERMINED`` (never ``SATURATED``: ``rem-anytime-laws``)."""
        return Verdict.IMPROVABLE if self.decided else Verdict.UNDETERMINED

    @property
    def reason(self) -> str:
        """Why the verdict is what it is, and what would decide an undetermined one (one line)."""
        if self.decided:
            return (
                f"the anytime noise test reached M = {self.e_value:.3g} >= 1/alpha = {1 / self.alpha:.3g} at example "
                f"{self.decided_at} (level {self.alpha:g} under optional stopping for sign-symmetric cross-gradients: "
                f"thm-anytime-noise-test)"
            )
        need = self.examples_needed
        more = f"about {need} examples would decide if s² ≈ ŝ²_U" if need else "no evidence of signal yet"
        head = "budget spent" if self.budget_spent else "still reading"
        return f"{head}: M = {self.e_value:.3g} < {1 / self.alpha:.3g} after {self.n} examples; {more}"

    def state_dict(self) -> dict[str, Tensor]:
        """The test's state, to resume a stream (``load_state_dict``).

        Returns:
            float64/int64 tensors: the raw sums ``Σ``, ``G``, ``E[XᵀX]``, ``n``, ``S``, ``V``, ``log M``
            and ``decided_at``.
        """
        out = {
            "n": torch.tensor(self.n, dtype=torch.int64),
            "weighted": torch.tensor(self.weighted, dtype=torch.int64),
            "sums": torch.tensor([self.s_sum, self.v_sum, self.log_e], dtype=torch.float64),
            "decided_at": torch.tensor(-1 if self.decided_at is None else self.decided_at, dtype=torch.int64),
        }
        if self._cross is not None:
            out.update(sigma=self._sigma.clone(), cross=self._cross.clone(), q=self._q.clone())  # type: ignore[union-attr]
        return out

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore a state written by :meth:`state_dict`.

        Args:
            state: the dictionary of :meth:`state_dict`.

        Raises:
            StatisticsError: when a key is missing.
        """
        try:
            self.n, self.weighted = int(state["n"]), int(state["weighted"])
            self.s_sum, self.v_sum, self.log_e = (float(x) for x in state["sums"])
            at = int(state["decided_at"])
        except KeyError as err:
            raise StatisticsError(
                f"the state has no {err.args[0]!r}: not written by AnytimeNoiseTest.state_dict"
            ) from err
        self.decided_at = None if at < 0 else at
        self._sigma, self._cross, self._q = (
            (state["sigma"].clone(), state["cross"].clone(), state["q"].clone())
            if "cross" in state
            else (None, None, None)
        )


class AnytimeSiteTest(AnytimeNoiseTest):
    """:class:`AnytimeNoiseTest` fed with site tensors, through a feature family's features ``φ̃``.

    The same features as :class:`~depthsat_theory.statistics.FeatureStatistics` (``augmented_features`` of
    the family's frozen float64 feature map), activation gradients as rows (``to_rows``), padded rows left
    out of every sum.

    Args:
        family: the block family (a :class:`~depthsat_theory.families.FeatureFamily`).
        shape: per-example site shape.
        layout: the site's layout.
        **kwargs: passed to :class:`AnytimeNoiseTest` (``alpha``, ``prior_examples``, ``max_examples``, ``rtol``).

    Raises:
        FamilyError: if ``family`` is not a feature family.
        StatisticsError: for a bad level, prior or budget.
    """

    def __init__(self, family: FeatureFamily, shape, layout: str, **kwargs) -> None:
        if not isinstance(family, FeatureFamily):
            raise FamilyError(f"{family!r} is not a feature family: the anytime test needs its features φ̃")
        super().__init__(**kwargs)
        self.family, self.shape, self.layout = family, tuple(shape), layout
        self._fmap = family.frozen_feature_map(self.shape, layout, dtype=torch.float64)

    def update_site(self, z: Tensor, g: Tensor, mask: Tensor | None = None) -> None:
        """Add a batch of site tensors and activation gradients.

        Args:
            z: ``(B, *shape)`` site tensors (any float dtype; the features are computed in float64).
            g: ``(B, *shape)`` activation gradients of the per-example losses.
            mask: optional ``(B, T)`` bool padding mask of a sequence site (``True`` at real tokens).

        Raises:
            StatisticsError: for mismatched shapes or NaN/Inf.
        """
        if z.shape != g.shape:
            raise StatisticsError(f"z {tuple(z.shape)} and g {tuple(g.shape)} differ: both are (B, *shape)")
        use_mask = mask if getattr(self.family, "masks_padding", False) else None
        with torch.no_grad():
            phi = self.family.augmented_features(self._fmap, z.detach().to(torch.float64), mask=use_mask)
        rows = to_rows(g.detach().to(torch.float64), self.layout)
        phi = phi.reshape(z.shape[0], -1, phi.shape[-1])
        if mask is not None:
            weight = mask.reshape(z.shape[0], -1, 1).to(torch.float64)
            phi, rows = phi * weight, rows * weight
        self.update(phi, rows)
