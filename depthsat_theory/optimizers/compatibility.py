r"""The descent-compatibility predicate, checked numerically (T2, T3).

:math:`P` is descent-compatible iff :math:`P(0) = 0` and
:math:`\langle b, P(b)\rangle > 0` for all :math:`b \ne 0`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from depthsat_theory.optimizers.base import ZeroStateUpdate
from depthsat_theory.optimizers.numerics import inner_sign, threshold
from depthsat_theory.optimizers.updates import resolve_update

__all__ = ["is_descent_compatible", "threshold"]


def _default_samples(dim: int, n: int, seed: int) -> torch.Tensor:
    """Seeded float64 test gradients, shape ``(n + 2*(n//4) + n//4 + 2*dim, dim)``."""
    gen = torch.Generator().manual_seed(seed)
    dt = torch.float64
    gauss = torch.randn(n, dim, generator=gen, dtype=dt)
    k = max(n // 4, 1)
    # Many exact zeros: ~75 % of the entries zeroed, one entry kept nonzero.
    sparse = torch.randn(k, dim, generator=gen, dtype=dt)
    sparse = sparse * (torch.rand(k, dim, generator=gen, dtype=dt) < 0.25)
    keep = torch.randint(0, dim, (k,), generator=gen)
    v = torch.randn(k, generator=gen, dtype=dt)
    sparse[torch.arange(k), keep] = v + torch.where(v >= 0, 1.0, -1.0).to(dt)
    tiny = torch.randn(k, dim, generator=gen, dtype=dt) * 1e-30
    huge = torch.randn(k, dim, generator=gen, dtype=dt) * 1e30
    eye = torch.eye(dim, dtype=dt)
    return torch.cat([gauss, sparse, tiny, huge, eye, -eye])


def is_descent_compatible(
    update: str | ZeroStateUpdate,
    hyper: Mapping[str, Any] | None = None,
    *,
    dim: int | None = None,
    samples: torch.Tensor | None = None,
    n: int = 256,
    seed: int = 0,
) -> bool | None:
    r"""Numerically check that a first-step map is descent-compatible.

    Checks :math:`P(0) = 0` (exactly) and, for every nonzero row :math:`b` of
    ``samples``, that :math:`P(b)` is finite and
    :math:`\langle b, P(b)\rangle > 0`. The sign of the inner product of the
    two floating-point vectors is decided *exactly* (certified float64 fast
    path, rational arithmetic as fallback), so tiny/huge rows neither
    underflow nor overflow, and exact cancellations give exactly 0 (which
    fails). What is checked is the map as computed in the samples' dtype:
    e.g. Adagrad/RMSprop, like their torch steps, compute :math:`b_i^2`, which
    overflows for :math:`|b_i| \gtrsim 10^{154}` in float64 and sends
    :math:`P(b)_i` to 0. Zero rows are skipped (the definition quantifies over
    :math:`b \ne 0`).

    This is evidence, not a proof; the proved property is
    ``update.descent_compatible``.  The symbolic counterpart
    :func:`depthsat_theory.engines.symbolic.is_descent_compatible` takes the same
    ``update``, ``hyper`` and ``dim`` and returns the same type.

    Args:
        update: The map to check: a name in :data:`~depthsat_theory.optimizers.UPDATES`
            or a :class:`ZeroStateUpdate`.
        hyper: Hyperparameter overrides (see
            :func:`~depthsat_theory.optimizers.updates.resolve_update`).
        samples: Test gradients, shape ``(m, d)``, real floating dtype,
            finite, ``d >= 1``. Default: seeded float64 rows of width ``dim``:
            ``n`` standard Gaussian rows, ``max(n // 4, 1)`` rows each of
            mostly exact zeros, of scale 1e-30, and of scale 1e30, and the
            ``2 * dim`` signed basis vectors.
        dim: Width of the default samples (``>= 1``, default 8); ignored if
            ``samples`` is given.
        n: Number of Gaussian default rows (``>= 1``); ignored if ``samples``
            is given.
        seed: Seed of the default samples.

    Returns:
        ``True`` when every check passed (no counterexample among the samples),
        ``False`` on a counterexample (``P(0) ≠ 0``, a non-finite ``P(b)`` or
        ``⟨b, P(b)⟩ ≤ 0``).  The type is ``bool | None`` as in the symbolic engine, where
        ``None`` means undecided; the numeric check always decides.

    Raises:
        TypeError: If ``update`` is neither a name nor a :class:`ZeroStateUpdate`.
        ValueError: On an unknown name or hyperparameter, if ``samples`` is not a
            finite 2-D floating tensor with at least one column, or ``dim``/``n``
            is not a positive integer.
    """
    update = resolve_update(update, hyper)
    if samples is None:
        dim = 8 if dim is None else dim
        for val, argname in ((dim, "dim"), (n, "n")):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{argname} must be a positive int, got {val!r}")
        samples = _default_samples(dim, n, int(seed))
    else:
        if not isinstance(samples, torch.Tensor):
            raise ValueError(f"samples must be a torch.Tensor, got {type(samples).__name__}")
        if samples.dim() != 2 or samples.shape[1] < 1:
            raise ValueError(f"samples must have shape (m, d) with d >= 1, got {tuple(samples.shape)}")
        if not samples.is_floating_point():
            raise ValueError(f"samples must have a real floating dtype, got {samples.dtype}")
        if not bool(torch.isfinite(samples).all()):
            raise ValueError("samples must be finite (contains NaN or inf)")

    zero = torch.zeros(samples.shape[1], dtype=samples.dtype, device=samples.device)
    p0 = update.first_step(zero)
    if not bool((p0 == 0).all()):
        return False
    for row in samples:
        if not bool((row != 0).any()):
            continue
        p = update.first_step(row)
        if not bool(torch.isfinite(p).all()):
            return False
        if inner_sign(row, p) <= 0:
            return False
    return True
