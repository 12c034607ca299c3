"""Argument validation and exact float arithmetic shared by the optimizer modules.

The checks raise :class:`ValueError` naming the Python argument; :func:`exact_dot` and
:func:`inner_sign` decide inner products of float vectors without rounding surprises;
:func:`threshold` zeroes gradient entries below a rounding bound (for predictions of
sign-like first steps).
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction
from typing import Any

import numpy as np
import torch

__all__ = [
    "check_beta",
    "check_lr",
    "check_nonneg",
    "check_tau",
    "check_vector",
    "exact_dot",
    "inner_sign",
    "rotate",
    "threshold",
]

_F64_TINY = float(np.finfo(np.float64).tiny)  # smallest normal float64


def check_vector(b: Any, argname: str = "b") -> torch.Tensor:
    """Validate a flat, finite, floating-point vector; return it unchanged.

    Args:
        b: the vector.
        argname: its name in the error message.

    Returns:
        ``b`` itself.

    Raises:
        ValueError: naming ``argname`` if ``b`` is not a finite 1-D floating tensor.
    """
    if not isinstance(b, torch.Tensor):
        raise ValueError(f"{argname} must be a torch.Tensor, got {type(b).__name__}")
    if b.dim() != 1:
        raise ValueError(f"{argname} must be a 1-D (flat) tensor, got shape {tuple(b.shape)}")
    if not b.is_floating_point():
        raise ValueError(f"{argname} must have a real floating dtype, got {b.dtype}")
    if not bool(torch.isfinite(b).all()):
        raise ValueError(f"{argname} must be finite (contains NaN or inf)")
    return b


def check_tau(tau: Any) -> float:
    """Validate a rounding bound ``tau >= 0`` (finite or ``inf``).

    Args:
        tau: the rounding bound (an ``int`` or ``float``, not a ``bool``).

    Returns:
        ``tau`` as a float.

    Raises:
        ValueError: if ``tau`` is not a real number, or is negative or NaN.
    """
    if isinstance(tau, bool) or not isinstance(tau, (int, float)):
        raise ValueError(f"tau must be a real number, got {type(tau).__name__}")
    tau = float(tau)
    if not tau >= 0.0:  # also rejects NaN
        raise ValueError(f"tau must be >= 0, got {tau}")
    return tau


def check_lr(lr: Any) -> float:
    """Validate a learning rate: a finite real number ``>= 0``.

    Args:
        lr: the learning rate (an ``int`` or ``float``, not a ``bool``).

    Returns:
        ``lr`` as a float.

    Raises:
        ValueError: if ``lr`` is not a real number, or is negative, NaN or infinite.
    """
    if isinstance(lr, bool) or not isinstance(lr, (int, float)):
        raise ValueError(f"lr must be a real number, got {type(lr).__name__}")
    lr = float(lr)
    if not (math.isfinite(lr) and lr >= 0.0):
        raise ValueError(f"lr must be finite and >= 0, got {lr}")
    return lr


def check_beta(beta: Any, argname: str) -> float:
    """Validate a decay rate in ``[0, 1)``; return it as a float.

    Args:
        beta: the decay rate.
        argname: its name in the error message.

    Returns:
        ``beta`` as a float.

    Raises:
        ValueError: naming ``argname`` if ``beta`` is outside ``[0, 1)``.
    """
    beta = float(beta)
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"{argname} must be in [0, 1), got {beta}")
    return beta


def check_nonneg(x: Any, argname: str) -> float:
    """Validate a finite number ``>= 0``; return it as a float.

    Args:
        x: the value.
        argname: its name in the error message.

    Returns:
        ``x`` as a float.

    Raises:
        ValueError: naming ``argname`` if ``x`` is negative, NaN or infinite.
    """
    x = float(x)
    if not (math.isfinite(x) and x >= 0.0):
        raise ValueError(f"{argname} must be finite and >= 0, got {x}")
    return x


def exact_dot(b: torch.Tensor, p: torch.Tensor) -> float:
    r"""Return :math:`\langle b, p\rangle` in float64 with an exactly rounded sum.

    The elementwise products are formed in float64 and summed with
    :func:`math.fsum`, so cancellations (e.g. the rotation map, where the
    products come in exact :math:`\pm` pairs) give exactly ``0.0`` regardless
    of summation order.

    Args:
        b: a tensor (any floating dtype and device).
        p: a tensor with as many elements.

    Returns:
        The inner product as a Python float (float64).
    """
    prods = b.detach().to(torch.float64) * p.detach().to(torch.float64)
    prods = prods.cpu()
    chunks = (c.tolist() for c in prods.split(1 << 20))
    return math.fsum(itertools.chain.from_iterable(chunks))


def inner_sign(b: torch.Tensor, p: torch.Tensor) -> int:
    r"""Exact sign of :math:`\langle b, p\rangle` (as real numbers).

    Fast path: if every nonzero product :math:`b_i p_i` is a normal, finite
    float64, the products carry relative error :math:`\le u = 2^{-53}`, and
    :func:`math.fsum` sums them exactly before one final rounding; the sign
    is certified when :math:`|s| > 4u \sum_i |b_i p_i|`. Otherwise (under- or
    overflow, near or exact cancellation) the inner product is evaluated
    exactly in rational arithmetic (:class:`fractions.Fraction`).

    Args:
        b: a tensor (converted to float64 on the CPU).
        p: a tensor of the same shape.

    Returns:
        ``1``, ``0`` or ``-1``.
    """
    x = b.detach().to("cpu", torch.float64).numpy()
    y = p.detach().to("cpu", torch.float64).numpy()
    nz = (x != 0.0) & (y != 0.0)
    x, y = x[nz], y[nz]
    if x.size == 0:
        return 0
    with np.errstate(all="ignore"):
        t = x * y
    at = np.abs(t)
    if bool(np.all(np.isfinite(at))) and float(at.min()) >= _F64_TINY:
        s = math.fsum(t.tolist())
        if abs(s) > 4.0 * 2.0**-53 * math.fsum(at.tolist()):
            return 1 if s > 0.0 else -1
    exact = sum(
        (Fraction(u) * Fraction(v) for u, v in zip(x.tolist(), y.tolist(), strict=False)),
        Fraction(0),
    )
    return (exact > 0) - (exact < 0)


def rotate(b: torch.Tensor) -> torch.Tensor:
    """Pairwise quarter turn ``(x, y) -> (-y, x)``; odd trailing entry -> 0.

    Args:
        b: a flat tensor ``(n,)``.

    Returns:
        A new tensor like ``b``: entries ``2i, 2i+1`` are ``(-b[2i+1], b[2i])``; the last is ``0`` for odd ``n``.
    """
    out = torch.zeros_like(b)
    m = (b.numel() // 2) * 2
    out[0:m:2] = -b[1:m:2]
    out[1:m:2] = b[0:m:2]
    return out


def threshold(b: torch.Tensor, tau: float) -> torch.Tensor:
    r"""Zero the entries of ``b`` that are not resolvable above a rounding bound.

    Sign-like first-step maps jump at :math:`b_i = 0`, so a gradient entry
    whose magnitude is within the caller's rounding bound :math:`\tau` has an
    undetermined sign. For predictions such entries are set to zero before
    :math:`P` is applied:

    .. math::

        \operatorname{threshold}(b, \tau)_i =
        \begin{cases} 0 & |b_i| \le \tau \\ b_i & |b_i| > \tau \end{cases}

    Args:
        b: Flat gradient vector, shape ``(d,)``, real floating dtype, finite.
        tau: Rounding bound, a real number ``>= 0`` (``float('inf')`` zeroes
            everything). ``tau = 0`` only normalizes ``-0.0`` to ``+0.0``.

    Returns:
        Tensor of shape ``(d,)`` with ``b``'s dtype and device; entries with
        ``|b_i| > tau`` are bitwise copies of ``b_i``, the others are ``+0.0``.

    Raises:
        ValueError: If ``b`` is not a finite 1-D floating tensor, or if
            ``tau`` is negative, NaN or not a real number.
    """
    check_vector(b, "b")
    tau = check_tau(tau)
    return torch.where(b.abs() <= tau, torch.zeros_like(b), b)
