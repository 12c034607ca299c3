r"""The ``L_depth`` training penalty: late blocks should change the stream little (seed 002, reconstructed).

Seed 002 (Qi, arXiv 2506.16862) proposes a regularizer ``L_depth`` "that encourages the network
to learn representations amenable to efficient, early exiting", motivated by its theorem: under
*diminishing returns on the residual functions* the expected optimal stopping depth is finite.
The seed file in this project holds only the paper's abstract, and the paper's own formula could
not be read here (no internet; the stored copy shows the abstract only).  What this module
implements is therefore a **reconstruction from the abstract**, chosen to enforce exactly the
condition the theorem needs:

.. math::

    L_{\rm depth}(θ) = \sum_{l=1}^{L} w_l \; \mathbb E_{\rm rows}
        \frac{\lVert f_l(z_{l-1})\rVert^2}{\lVert z_{l-1}\rVert^2 + ε},
    \qquad w_l = \frac{2l}{L(L+1)}

(``f_l(z_{l-1}) = z_l − z_{l-1}``, rows as in :mod:`~depthsat_theory.views.exits`; the weights
grow linearly with depth and sum to 1, so the penalty is a weighted mean of squared relative
updates, comparable across depths).  Training minimises ``J + λ·L_depth``
(:attr:`~depthsat_theory.experiments.recipe.Recipe.depth_reg` is ``λ``).  Departures from the
paper, as far as the abstract lets us tell: the weighting ``w_l ∝ l`` and the relative (scale-
free) form are our choices; there are no auxiliary exit heads in the training loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

from depthsat_theory.views.exits import StreamStates, stream_rows

__all__ = ["DEPTH_REG_EPS", "depth_regularizer", "depth_weights"]

#: ``ε`` of the relative update's denominator (guards an all-zero stream row).
DEPTH_REG_EPS = 1e-12


def depth_weights(n_blocks: int) -> Tensor:
    """The weights ``w_l = 2l / (L(L+1))``, ``l = 1 … L`` (float64 ``(L,)``, sum 1).

    Args:
        n_blocks: ``L ≥ 1``.

    Returns:
        ``w`` ``(L,)`` float64.

    Raises:
        ValueError: ``n_blocks < 1``.
    """
    if n_blocks < 1:
        raise ValueError(f"need at least one block, got {n_blocks}")
    k = torch.arange(1, n_blocks + 1, dtype=torch.float64)
    return 2 * k / (n_blocks * (n_blocks + 1))


def depth_regularizer(states: StreamStates) -> Tensor:
    """``L_depth`` of one forward pass (differentiable when ``states`` carry a graph).

    Args:
        states: the stream, e.g. from :func:`~depthsat_theory.views.exits.capture_stream` with
            ``grad=True``.

    Returns:
        A scalar tensor (the stream's dtype), dimensionless.
    """
    w = depth_weights(states.depth)
    total = None
    for k, (a, b) in enumerate(zip(states.states[:-1], states.states[1:], strict=True)):
        ra, rb = stream_rows(a), stream_rows(b)
        rel = ((rb - ra) ** 2).sum(1) / ((ra**2).sum(1) + DEPTH_REG_EPS)
        term = float(w[k]) * rel.mean()
        total = term if total is None else total + term
    assert total is not None
    return total
