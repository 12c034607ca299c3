r"""Small figures that show the criterion's geometry (the README picture, the book's chapters).

The picture of ``ch-setting``: a site with two probe units, so that a unit field is a vector of
:math:`\mathbb R^2` with the probe's inner product :math:`\langle f, f' \rangle = \sum_i m_i f(u_i) f'(u_i)`;
a one-parameter family with tangent field :math:`A` spans the line :math:`T`, and the saturation
score is :math:`s = \lVert \Pi g \rVert = |b| / \sqrt K` with :math:`b = \langle A, g \rangle`,
:math:`K = \langle A, A \rangle` (``def-score``, ``thm-iff``).

Needs matplotlib (the ``plot`` extra); importing this module does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from depthsat_theory.extras import require

__all__ = ["criterion_figure", "projection_picture"]


def projection_picture(
    ax: Any,
    g: Sequence[float],
    tangent: Sequence[float],
    *,
    mass: Sequence[float] = (0.5, 0.5),
    title: str | None = None,
) -> float:
    r"""Draw the activation gradient ``g``, the tangent line ``T`` and the projection ``Πg`` on ``ax``.

    Coordinates are scaled by :math:`\sqrt{m_i}` so that the plane's Euclidean geometry is the
    probe's inner product.

    Args:
        ax: a matplotlib ``Axes``.
        g: the activation gradient at the two probe units, shape ``(2,)``.
        tangent: the tangent field ``A`` at the two units, shape ``(2,)``, not zero.
        mass: the probe's masses ``m_i`` (positive), shape ``(2,)``.
        title: the panel's title (default: ``s = ‖Πg‖ = …``).

    Returns:
        The saturation score :math:`s = |b| / \sqrt K` (``def-score``).

    Raises:
        ValueError: a shape other than ``(2,)``, a zero tangent or a non-positive mass.
    """
    g_, a, m = (np.asarray(v, dtype=float) for v in (g, tangent, mass))
    if g_.shape != (2,) or a.shape != (2,) or m.shape != (2,):
        raise ValueError("projection_picture: g, tangent and mass must each have 2 entries (two probe units)")
    if not np.any(a) or np.any(m <= 0):
        raise ValueError("projection_picture: the tangent must be nonzero and the masses positive")
    b, k = float(np.sum(m * a * g_)), float(np.sum(m * a * a))
    pi_g, s = a * b / k, abs(b) / np.sqrt(k)
    w = np.sqrt(m)
    reach = 1.3 * max(float(np.linalg.norm(g_ * w)), 1.0)
    line = np.outer([-reach, reach], a * w / np.linalg.norm(a * w))
    ax.plot(line[:, 0], line[:, 1], color="0.6", lw=2, label="tangent space $T$")
    for vec, colour in ((g_ * w, "C3"), (pi_g * w, "C0")):
        ax.annotate("", xy=tuple(vec), xytext=(0, 0), arrowprops={"arrowstyle": "->", "color": colour, "lw": 2})
    ax.plot(*np.c_[g_ * w, pi_g * w], ls=":", color="k")
    ax.text(*(g_ * w * 1.08), "$g$", color="C3", fontsize=14)
    label = r"$\Pi g$" if s > 1e-12 * float(np.linalg.norm(g_)) else r"$\Pi g = 0$"
    ax.text(*(pi_g * w * 1.1 + [0.08, -0.12]), label, color="C0", fontsize=14)
    ax.set_aspect("equal")
    ax.axhline(0, color="0.9", zorder=0)
    ax.axvline(0, color="0.9", zorder=0)
    ax.set_xlim(-reach, reach)
    ax.set_ylim(-reach, reach)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title if title is not None else f"s = ‖Πg‖ = {s:.3g}")
    return float(s)


def criterion_figure() -> Any:
    """The criterion in one picture: an improvable site (``Πg ≠ 0``) beside a saturated one (``g ⟂ T``).

    Both panels use the probe units ``u = (1, 3)`` with mass ½ each and the family ``h_θ(u) = θu``
    (tangent ``A(u) = u``): ``g = (2, 1)`` has ``s = √5/2``; ``g = (3, −1)`` is orthogonal to ``T``,
    so ``s = 0`` although ``g ≠ 0`` (``ch-setting``).

    Returns:
        A matplotlib ``Figure`` with two panels.
    """
    plt = require("matplotlib.pyplot", extra="plot", purpose="the criterion figure")

    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 4), layout="constrained")
    s = projection_picture(left, (2.0, 1.0), (1.0, 3.0), title="")
    left.set_title(f"improvable: $\\Pi g \\neq 0$ (s = {s:.3f})\na new block lowers the loss", fontsize=11)
    projection_picture(right, (3.0, -1.0), (1.0, 3.0), title="")
    right.set_title("saturated: g orthogonal to $T$ (s = 0)\nno block of this family helps at first order", fontsize=11)
    left.legend(loc="lower left", fontsize=9)
    return fig
