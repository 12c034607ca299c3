"""Insert a residual block after an insertion site, and check function preservation."""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from depthsat_theory.capture.sites import (
    NotFunctionPreservingError,
    SiteError,
    parse_site,
    resolve_module,
    split_output,
)

__all__ = ["ResidualInsertion", "check_function_preserving", "first_output", "insert_block"]


class ResidualInsertion(nn.Module):
    """Wraps a site module ``f`` as ``x ↦ f(x) + h(f(x))``.

    Structured outputs (tuples, mappings, ``ModelOutput``): the block acts on the site
    tensor (index 0 / first key, or ``output_key``) and the result is put back in place.
    With ``occurrence = k`` the block acts only on the ``k``-th call of ``f`` in a
    forward pass of the root model (the counter is reset by a forward pre-hook on the
    root that :func:`insert_block` installs); other calls pass through unchanged.
    """

    def __init__(self, site: nn.Module, block: nn.Module, *, occurrence: int | None = None, output_key=None):
        super().__init__()
        self.site = site
        self.block = block
        self.occurrence = occurrence
        self.output_key = output_key
        self.calls = 0

    def reset_calls(self, *args) -> None:
        """Reset the occurrence counter (a forward pre-hook of the root model)."""
        self.calls = 0

    def forward(self, *args, **kwargs):
        out = self.site(*args, **kwargs)
        k = self.calls
        self.calls += 1
        if self.occurrence is not None and k != self.occurrence:
            return out
        t, rebuild = split_output(out, self.output_key, "the wrapped site")
        return rebuild(t + self.block(t))


def insert_block(model: nn.Module, site: str, block: nn.Module, *, output_key=None) -> tuple[nn.Module, nn.Module]:
    """Insert ``block`` after ``site`` in a deep copy of ``model``.

    Args:
        model: the reference model (not modified).
        site: a module name; ``"name#k"`` inserts after the ``k``-th call only of a module
            run several times per forward (a bare name inserts after every call, sharing
            the block's parameters between the calls).
        block: the residual block ``h`` (``z ↦ z + h(z)``).
        output_key: where the site tensor is in a structured output (as in
            :class:`SiteRecorder`).

    Returns:
        ``(new_model, block)`` where ``block`` is the inserted module inside the copy
        (its parameters are the new block's parameters).

    Raises:
        SiteError: if ``site`` does not exist or is the model itself.
    """
    base, occ = parse_site(site)
    resolve_module(model, base)
    if base == "":
        raise SiteError("cannot insert after the whole model; name a submodule")
    new = copy.deepcopy(model)
    parent_name, _, child = base.rpartition(".")
    parent = resolve_module(new, parent_name) if parent_name else new
    old = getattr(parent, child) if not child.isdigit() else parent[int(child)]
    wrapped = ResidualInsertion(old, block, occurrence=occ, output_key=output_key)
    if child.isdigit() and isinstance(parent, (nn.ModuleList, nn.Sequential)):
        parent[int(child)] = wrapped
    else:
        setattr(parent, child, wrapped)
    if occ is not None:
        new.register_forward_pre_hook(wrapped.reset_calls)
    return new, wrapped.block


def check_function_preserving(
    model: nn.Module | Tensor, new_model: nn.Module, inputs, *, atol: float | None = None
) -> float:
    """Verify that an inserted block preserves the model's function at the origin.

    Args:
        model: the reference model, or its precomputed output on ``inputs``.
        new_model: the model with the block inserted.
        inputs: a probe batch accepted by both models.
        atol: allowed max absolute deviation of outputs (default: ``0`` for blocks
            whose output is an exact zero; pass a rounding bound otherwise).

    Returns:
        The max absolute deviation of the outputs (tuple outputs: the first element;
        mappings/``ModelOutput``: ``logits`` if present, else the first value).

    Raises:
        NotFunctionPreservingError: if the deviation exceeds ``atol`` or is NaN.
    """
    with torch.no_grad():
        a = model if isinstance(model, Tensor) else first_output(model(inputs))
        b = first_output(new_model(inputs))
    dev = float((a - b).abs().max()) if a.numel() else 0.0
    limit = 0.0 if atol is None else atol
    if not dev <= limit:
        raise NotFunctionPreservingError(
            f"the inserted block changes the model's output by {dev:.3g} (> {limit:.3g}) at the "
            f"origin: the family is not function-preserving (h(0, z) must be 0)"
        )
    return dev


def first_output(out):
    """The primary tensor of a model output (tuple: first item; mapping/``ModelOutput``: ``logits``)."""
    if isinstance(out, (tuple, list)):
        return out[0]
    if isinstance(out, Mapping):
        return out["logits"] if "logits" in out else next(iter(out.values()))
    if hasattr(out, "logits"):
        return out.logits
    return out
