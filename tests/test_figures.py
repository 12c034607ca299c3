"""The criterion's picture computes the score it draws (``depthsat_theory.figures``, ``def-score``)."""

from __future__ import annotations

from fractions import Fraction

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")


def _axes():
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    return fig, ax


def test_projection_picture_returns_the_exact_score():
    from depthsat_theory.figures import projection_picture

    # units u = (1, 3), mass ½ each, tangent A(u) = u: b = ½(2·1 + 1·3) = 5/2, K = ½(1 + 9) = 5, s² = b²/K = 5/4
    b, k = Fraction(1, 2) * (2 * 1 + 1 * 3), Fraction(1, 2) * (1 + 9)
    _fig, ax = _axes()
    s = projection_picture(ax, (2.0, 1.0), (1.0, 3.0))
    assert s**2 == pytest.approx(float(b * b / k), rel=1e-15)
    # g = (3, −1) is orthogonal to T in the probe's inner product: b = ½(3 − 3) = 0 exactly
    assert projection_picture(ax, (3.0, -1.0), (1.0, 3.0)) == 0.0
    assert ax.get_title() == "s = ‖Πg‖ = 0"


def test_projection_picture_refuses_bad_input():
    from depthsat_theory.figures import projection_picture

    _fig, ax = _axes()
    with pytest.raises(ValueError, match="2 entries"):
        projection_picture(ax, (1.0, 2.0, 3.0), (1.0, 3.0))
    with pytest.raises(ValueError, match="nonzero"):
        projection_picture(ax, (1.0, 2.0), (0.0, 0.0))


def test_criterion_figure_has_two_panels():
    from depthsat_theory.figures import criterion_figure

    fig = criterion_figure()
    assert len(fig.axes) == 2
    assert "improvable" in fig.axes[0].get_title() and "saturated" in fig.axes[1].get_title()
