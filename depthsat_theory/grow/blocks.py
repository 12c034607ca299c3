r"""Grow any ``nn.Module``: zero-output residual blocks after insertion sites (:func:`insert_blocks`).

Each block is a residual family's block at the origin, :math:`h_0 \equiv 0`
(theory/definitions.md, ``def-family``), inserted as :math:`z \mapsto z + h_\theta(z)` after the
site module (:func:`depthsat_theory.capture.insert_block_in_place`); the feature parameters are
drawn from the family's seed, the tangent coordinates start at zero.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from depthsat_theory.capture.insertion import detached_deepcopy_memo, insert_block_in_place
from depthsat_theory.capture.probe import call_model
from depthsat_theory.capture.sites import SiteError, parse_site, resolve_module, split_output
from depthsat_theory.families import FamilyError, ResidualFamily, parse_family
from depthsat_theory.grow._check import check_preserved, reference_output
from depthsat_theory.grow.errors import GrowError
from depthsat_theory.vocabulary import Layout

__all__ = ["Growth", "insert_blocks"]


@dataclass
class Growth:
    """The result of :func:`insert_blocks`.

    Attributes:
        model: the grown model (a copy unless ``inplace``).
        families: the family inserted at each site.
        blocks: the inserted block modules by site.
        new_params: the new blocks' parameters by site (tangent coordinates ``θ`` first, then the
            feature parameters ``ψ``): what to add to an optimizer.
        shapes, layouts: the per-example site shape and layout the blocks were built for.
        deviation: ``max |f(x) − f_grown(x)|`` on the probe batch (output units).
        tolerance: the allowed deviation (``64 u max(1, max |f(x)|)``, ``u`` the output dtype's unit roundoff).
    """

    model: nn.Module
    families: dict[str, ResidualFamily] = field(default_factory=dict)
    blocks: dict[str, nn.Module] = field(default_factory=dict)
    new_params: dict[str, list[nn.Parameter]] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    layouts: dict[str, Layout] = field(default_factory=dict)
    deviation: float = 0.0
    tolerance: float = 0.0

    @property
    def sites(self) -> list[str]:
        """The insertion sites, in the order given."""
        return list(self.blocks)

    def tangent_params(self) -> dict[str, list[nn.Parameter]]:
        """The blocks' tangent-coordinate parameters ``θ`` by site (zero at insertion).

        Returns:
            ``{site: [parameters]}``: each block's :meth:`ResidualFamily.tangent_parameters`.
        """
        return {s: self.families[s].tangent_parameters(b) for s, b in self.blocks.items()}


def _site_tensors(model: nn.Module, sites: list[str], probe: Any) -> dict[str, Tensor]:
    """One no-grad forward recording each site's output tensor (the ``k``-th call for ``name#k``)."""
    seen: dict[str, Tensor] = {}
    calls: dict[str, int] = {}
    handles = []

    def hook_for(base: str):
        def hook(_mod, _inp, out):
            k = calls.get(base, 0)
            calls[base] = k + 1
            for site in sites:
                b, occ = parse_site(site)
                if b == base and site not in seen and (occ is None or occ == k):
                    seen[site] = split_output(out, None, f"site {site!r}")[0].detach()

        return hook

    for base in {parse_site(s)[0] for s in sites}:
        handles.append(resolve_module(model, base).register_forward_hook(hook_for(base)))
    try:
        with torch.no_grad():
            call_model(model, probe)
    finally:
        for h in handles:
            h.remove()
    missing = [s for s in sites if s not in seen]
    if missing:
        raise SiteError(f"site {missing[0]!r} was not called in a forward pass of the probe batch")
    return seen


def _layout(z: Tensor, model: nn.Module, site: str, given: Any) -> Layout:
    from depthsat_theory.diagnose.discovery import infer_layout
    from depthsat_theory.diagnose.errors import DiagnoseError

    if isinstance(given, Mapping):
        given = given.get(site)
    if given is not None:
        return Layout(given)
    try:
        return infer_layout(tuple(z.shape[1:]), resolve_module(model, parse_site(site)[0]), site)
    except DiagnoseError as exc:
        raise GrowError(str(exc)) from None


def _family(spec: str | ResidualFamily, site: str) -> ResidualFamily:
    if isinstance(spec, ResidualFamily):
        return spec
    if not isinstance(spec, str):
        raise GrowError(
            f"site {site!r}: the family must be a spec string or a ResidualFamily, got {type(spec).__name__}"
        )
    return parse_family(spec)


def _build(fam: ResidualFamily, site: str, shape: tuple[int, ...], layout: Layout, seed: int) -> nn.Module:
    try:
        fam.check_site(shape, layout)
    except FamilyError as exc:
        raise FamilyError(f"site {site!r} (per-example shape {shape}, {layout} layout): {exc}") from None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return fam.block(shape, layout)


def insert_blocks(
    model: nn.Module,
    families: Mapping[str, str | ResidualFamily],
    *,
    seed: int = 0,
    probe: Any = None,
    layout: str | Mapping[str, str] | None = None,
    inplace: bool = False,
) -> Growth:
    r"""Insert a zero-output residual block of a family after each site, and check the function is unchanged.

    After site ``s`` with site tensor :math:`z` the grown model computes :math:`z + h_\theta(z)`
    with :math:`\theta = 0`, so :math:`h_0(z) = 0` and every output is unchanged (``def-family``).
    The gradient of the loss with respect to :math:`\theta` at the origin is the criterion's
    :math:`b = E[A^\top g]` at the site (T1, ``thm-gradient``), the feature parameters get zero
    gradient.

    Args:
        model: any ``nn.Module`` (not modified unless ``inplace``).
        families: ``{site: family}``, a site being a module name (``"blocks.2"``, ``"name#k"``
            for the ``k``-th call) and a family a spec (``"linear"``, ``"relu:64:1"``, …;
            :func:`~depthsat_theory.families.parse_family`) or a
            :class:`~depthsat_theory.families.ResidualFamily`.
        seed: torch seed while each block is built (families with a ``SEED`` argument use it).
        probe: a batch the model accepts (a tensor, or a mapping of keyword tensors): it gives the
            per-example site shapes and checks function preservation.  Required.
        layout: the sites' layout (``"vector"``, ``"sequence"``, ``"image"``, or ``{site: layout}``);
            default: inferred from the site tensor and module (as in ``diagnose``).
        inplace: grow ``model`` itself (its own parameters stay the same objects).

    Returns:
        A :class:`Growth`: the grown model, the new parameters by site, the measured output
        deviation and its tolerance.

    Raises:
        GrowError: no ``probe``, no sites, or a site whose layout cannot be inferred.
        SiteError: an unknown site, or one not called on the probe batch.
        FamilyError: an unknown family spec, or a family that does not fit the site (the message
            names the site, its shape and layout).
        NotFunctionPreservingError: the output moved by more than the dtype-scaled tolerance.
    """
    if probe is None:
        raise GrowError("insert_blocks needs probe=, a batch the model accepts (it gives the site shapes)")
    if not families:
        raise GrowError("no sites given: pass {site: family}, e.g. {'blocks.2': 'linear'}")
    sites = list(families)
    for site in sites:
        if parse_site(site)[0] == "":
            raise SiteError("cannot insert after the whole model; name a submodule")
        resolve_module(model, parse_site(site)[0])
    fams = {s: _family(families[s], s) for s in sites}
    z = _site_tensors(model, sites, probe)
    growth = Growth(model)
    for site in sites:
        growth.shapes[site] = tuple(int(n) for n in z[site].shape[1:])
        growth.layouts[site] = _layout(z[site], model, site, layout)
        growth.families[site] = fams[site]
    built = {s: _build(fams[s], s, growth.shapes[s], growth.layouts[s], seed + i) for i, s in enumerate(sites)}
    ref = reference_output(model, probe)
    grown = model if inplace else copy.deepcopy(model, detached_deepcopy_memo(model))
    for site in sorted(sites, key=lambda s: -parse_site(s)[0].count(".")):  # deeper sites first: paths stay valid
        insert_block_in_place(grown, site, built[site])
    growth.model = grown
    for site in sites:
        growth.blocks[site] = built[site]
        tangent = fams[site].tangent_parameters(built[site])
        tid = {id(p) for p in tangent}
        growth.new_params[site] = tangent + [p for p in built[site].parameters() if id(p) not in tid]
    growth.deviation, growth.tolerance = check_preserved(ref, grown, probe)
    return growth
