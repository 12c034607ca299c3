"""The toolkit's shared vocabulary: site layouts, verdicts and certificates (one name per concept).

Both enums derive from :class:`str`, so a member compares equal to its value
(``Verdict.SATURATED == "saturated"``) and serialises to JSON as that string.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["Certificate", "Layout", "Verdict"]


class Layout(str, Enum):
    """How an insertion site's per-example tensor is split into units (theory/definitions.md).

    - ``VECTOR``: ``(d,)``, one unit per example (residual MLP hidden vector);
    - ``SEQUENCE``: ``(T, d)``, one unit per token (transformer residual stream);
    - ``IMAGE``: ``(C, H, W)``, one unit per pixel (ResNet stage output).
    """

    VECTOR = "vector"
    SEQUENCE = "sequence"
    IMAGE = "image"

    def __str__(self) -> str:
        return self.value


class Verdict(str, Enum):
    """The verdict on one (site, family) pair.

    - ``IMPROVABLE``: ``s > tol``: a zero-state step on an inserted block lowers the loss
      to first order (thm-iff);
    - ``SATURATED``: ``s ≤ tol`` with a nonzero tangent space: no first-order decrease;
    - ``DEGENERATE``: ``rank K = 0`` (``T = {0}``), never reported as saturated (T4);
    - ``UNDETERMINED``: the probe or the arithmetic cannot decide.
    """

    IMPROVABLE = "improvable"
    SATURATED = "saturated"
    DEGENERATE = "degenerate"
    UNDETERMINED = "undetermined"

    def __str__(self) -> str:
        return self.value


class Certificate(str, Enum):
    """The finite-sample certificate on one (site, family) pair (theory/finite-sample.md).

    - ``IMPROVABLE``: the ``(1 − δ)`` interval's lower end is ``> 0``
      (``cor-certified-improvable``);
    - ``SATURATED``: the upper end (for the unregularized ``s``) is ``≤ ε``
      (``cor-certified-saturated``);
    - ``NOT_CERTIFIED``: neither.

    A degenerate family (``T = {0}``) gets :attr:`Verdict.DEGENERATE` instead.
    """

    IMPROVABLE = "certified improvable"
    SATURATED = "certified ε-saturated"
    NOT_CERTIFIED = "not certified"

    def __str__(self) -> str:
        return self.value
