"""Depth or more training, per site, in :func:`~depthsat_theory.diagnose.diagnose` (``decision=True``).

At each site the **existing last maps** are the linear maps of the model (``nn.Linear``, a Hugging Face
``Conv1D``, a ``1×1`` ``nn.Conv2d``) whose output reaches the site tensor with the identity Jacobian:
the site is ``z_out = z_in + W_o ψ(x) + c_o`` with ``z_in`` not depending on ``(W_o, c_o)`` to first
order (theory/decision.md, ``def-stationarity-score``).  They are found from the model on the probe's
first batch (:func:`find_last_maps`): a forward pass adds a zero tensor ``t`` to every candidate's output,
and a candidate is a last map of site ``s`` iff the vector–Jacobian product of ``z_s`` with a random
cotangent ``v`` is **exactly** ``v`` at ``t`` (the backward of an addition passes ``v`` bit for bit;
any other path through the candidate changes it).  Their inputs ``ψ`` (with a constant when the map has a
bias) are the features of the existing tangent ``T_old``; the diagnosed family's features ``φ̃`` give
``T_new``; :func:`~depthsat_theory.decision.beyond.beyond_training` then computes the stationarity score,
the score beyond training and the :class:`~depthsat_theory.decision.beyond.DepthDecision`.

Memory: the residualised noise moment of ``prop-beyond-noise-test`` needs the final ``Â_o``, so it is not
a one-pass sum; the rows ``(ψ̃, φ̃, g)`` of every site are held in float64 up to
:data:`DECISION_MAX_BYTES` for the whole run.  A probe whose rows exceed it gets ``undetermined`` at every
site, with the size it would need (diagnose fewer sites, or a smaller probe).  Rows are not checkpointed
or sharded: a resumed run or one under ``torchrun`` reports ``undetermined`` and says why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

from depthsat_theory.capture.probe import call_model, unpack_batch
from depthsat_theory.capture.sites import parse_site, resolve_module, split_output
from depthsat_theory.decision.beyond import DepthDecision, beyond_training
from depthsat_theory.families import FeatureFamily
from depthsat_theory.families.base import to_rows
from depthsat_theory.statistics import StatisticsError
from depthsat_theory.vocabulary import Layout

__all__ = ["DECISION_MAX_BYTES", "SiteDecisions", "find_last_maps"]

#: Largest total size of the float64 rows ``(ψ̃, φ̃, g)`` held for the decision, all sites together (bytes).
DECISION_MAX_BYTES = 1 << 30


def _is_linear_map(mod: nn.Module) -> bool:
    """``nn.Linear``, a Hugging Face ``Conv1D`` (``x @ W + b``) or a ``1×1`` stride-1 ungrouped ``nn.Conv2d``."""
    if isinstance(mod, nn.Linear):
        return True
    weight = getattr(mod, "weight", None)
    if type(mod).__name__ == "Conv1D" and hasattr(mod, "nf") and isinstance(weight, Tensor):
        return weight.dim() == 2
    if isinstance(mod, nn.Conv2d):
        return (
            tuple(mod.kernel_size) == (1, 1)
            and tuple(mod.stride) == (1, 1)
            and tuple(mod.dilation) == (1, 1)
            and mod.groups == 1
            and mod.padding in ((0, 0), "valid")
        )
    return False


def _site_key(output_key, base: str):
    return output_key.get(base) if isinstance(output_key, Mapping) else output_key


def find_last_maps(
    model: nn.Module, sites: Sequence[str], batch, *, output_key=None, mask_fn=None, seed: int = 0
) -> tuple[dict[str, list[str]], dict[str, str]]:
    """The existing last linear maps of every site: those whose output reaches it with the identity Jacobian.

    One forward pass on ``batch`` adds a zero tensor ``t_m`` (requiring grad) to the output of every linear
    map ``m`` (``nn.Linear``, ``Conv1D``, ``1×1`` ``Conv2d``) that runs once; for each site, one backward of
    ``⟨z_s, v⟩`` with ``v`` standard normal (seeded).  ``m`` is a last map of ``s`` iff ``∂⟨z_s, v⟩/∂t_m``
    equals ``v`` exactly (same shape, bit for bit).

    Args:
        model: the model (eval mode).
        sites: the site names.
        batch: one probe batch (``(inputs, targets[, mask])`` or a mapping), as :func:`diagnose` takes.
        output_key: where the site tensor is in a structured output (as :func:`diagnose`).
        mask_fn: as :func:`diagnose` (only to unpack the batch).
        seed: seed of the random cotangents.

    Returns:
        ``(maps, reasons)``: ``{site: [module names]}`` for the sites where maps were found, and
        ``{site: reason}`` (one line) for the others.
    """
    x = unpack_batch(batch, mask_fn)[0]
    candidates = [(n, m) for n, m in model.named_modules() if _is_linear_map(m)]
    taps: dict[str, list[Tensor]] = {}
    outs: dict[str, list[Tensor]] = {}

    def tap(name):
        def hook(_mod, _inp, out):
            if not isinstance(out, Tensor) or not out.is_floating_point():
                return None
            t = torch.zeros_like(out, requires_grad=True)
            taps.setdefault(name, []).append(t)
            return out + t

        return hook

    def grab(site, base):
        def hook(_mod, _inp, out):
            outs.setdefault(site, []).append(split_output(out, _site_key(output_key, base), f"site {site!r}")[0])

        return hook

    reasons: dict[str, str] = {}
    plain = []
    handles = [m.register_forward_hook(tap(n)) for n, m in candidates]  # first: a site module's own tap is seen
    try:
        for s in sites:
            base, occ = parse_site(s)
            if occ is not None:
                reasons[s] = f"site {s!r} is one call of a module that runs several times: its last map is not located"
                continue
            plain.append(s)
            handles.append(resolve_module(model, base).register_forward_hook(grab(s, base)))
        with torch.enable_grad():
            call_model(model, x)
    finally:
        for h in handles:
            h.remove()
    once = {n: ts[0] for n, ts in taps.items() if len(ts) == 1}
    gen = torch.Generator().manual_seed(seed)
    maps: dict[str, list[str]] = {}
    for s in plain:
        z = outs.get(s, [])
        if len(z) != 1 or not z[0].requires_grad:
            reasons[s] = f"site {s!r} ran {len(z)} time(s) or does not depend on any parameter: no last map located"
            continue
        found = _identity_maps(z[0], once, gen)
        if found:
            maps[s] = found
        else:
            reasons[s] = (
                "no linear map (nn.Linear, Conv1D, 1×1 Conv2d) writes into the stream at this site with the "
                "identity Jacobian: the existing parameters feeding it are not located"
            )
    return maps, reasons


def _identity_maps(z: Tensor, taps: Mapping[str, Tensor], gen: torch.Generator) -> list[str]:
    """Names of the taps ``t`` with ``∂⟨z, v⟩/∂t = v`` exactly (same shape as ``z``)."""
    same = [(n, t) for n, t in taps.items() if t.shape == z.shape]
    if not same:
        return []
    v = torch.randn(z.shape, generator=gen, dtype=torch.float64).to(dtype=z.dtype, device=z.device)
    grads = torch.autograd.grad(z, [t for _, t in same], grad_outputs=v, retain_graph=True, allow_unused=True)
    return [n for (n, _), gr in zip(same, grads, strict=True) if gr is not None and torch.equal(gr, v)]


@dataclass
class _SiteRows:
    """The float64 rows of one site, batch by batch: ``ψ̃`` ``(B, R, k_o)``, ``φ̃`` ``(B, R, k_n)``, ``g``."""

    psi: list[Tensor] = field(default_factory=list)
    phi: list[Tensor] = field(default_factory=list)
    g: list[Tensor] = field(default_factory=list)
    dtype: torch.dtype = torch.float64


class SiteDecisions:
    """The rows of every site's existing last maps and new family, held for the decision (``decision=True``).

    Args:
        model: the diagnosed model.
        maps: ``{site: [last map names]}`` (:func:`find_last_maps`).
        reasons: ``{site: reason}`` for the sites without located maps.
        family: the diagnosed family (a :class:`FeatureFamily`: its ``φ̃`` spans ``T_new``).
        alpha: level of the noise tests.
        max_bytes: the budget of held rows in bytes (default :data:`DECISION_MAX_BYTES`).
    """

    def __init__(
        self,
        model: nn.Module,
        maps: Mapping[str, list[str]],
        reasons: Mapping[str, str],
        family: FeatureFamily,
        *,
        alpha: float | None = None,
        max_bytes: int | None = None,
    ):
        self.model = model
        self.maps = dict(maps)
        self.reasons = dict(reasons)
        self.family = family
        self.alpha = alpha
        self.max_bytes = DECISION_MAX_BYTES if max_bytes is None else max_bytes
        self.rows: dict[str, _SiteRows] = {s: _SiteRows() for s in self.maps}
        self.inputs: dict[str, Tensor] = {}
        self.bytes = 0
        self.needed = 0
        self._fmaps: dict = {}

    @contextlib.contextmanager
    def context(self):
        """Hooks that keep the input of every last map of the current forward pass (detached)."""
        names = {n for ns in self.maps.values() for n in ns}
        mods = dict(self.model.named_modules())

        def keep(name):
            def hook(_mod, inp, _out):
                self.inputs[name] = inp[0].detach()

            return hook

        handles = [mods[n].register_forward_hook(keep(n)) for n in sorted(names)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def _features(self, site: str, z: Tensor, layout: str) -> Tensor:
        key = (site, tuple(z.shape[1:]), layout)
        if key not in self._fmaps:
            self._fmaps[key] = self.family.frozen_feature_map(tuple(z.shape[1:]), layout, dtype=torch.float64)
        with torch.no_grad():
            return self.family.augmented_features(self._fmaps[key], z.detach().to(torch.float64).cpu())

    def _psi(self, site: str, layout: str) -> Tensor:
        """``ψ̃`` rows ``(B, R, k_o)``: the inputs of the site's last maps, a constant for each with a bias."""
        mods = dict(self.model.named_modules())
        parts = []
        for name in self.maps[site]:
            rows = to_rows(self.inputs[name].to(torch.float64).cpu(), layout)
            parts.append(rows)
            if getattr(mods[name], "bias", None) is not None:
                parts.append(rows.new_ones((*rows.shape[:-1], 1)))
        return torch.cat(parts, dim=-1)

    def add(self, pb, layouts: Mapping[str, str]) -> None:
        """Hold one probe batch's rows at every site with located maps (padded rows zeroed).

        Args:
            pb: the :class:`~depthsat_theory.capture.probe.ProbeBatch`.
            layouts: the layout of each site.
        """
        for s in list(self.rows):
            lay = layouts[s]
            z, g = pb.z[s], pb.g[s]
            if lay == Layout.IMAGE and z.dim() == 3:
                z, g = z.unsqueeze(2), g.unsqueeze(2)
            try:
                psi, phi = self._psi(s, lay), self._features(s, z, lay)
                grow = to_rows(g.to(torch.float64).cpu(), lay)
            except (KeyError, ValueError, RuntimeError) as exc:
                self._drop(s, f"the last maps' inputs do not fit the site's rows ({type(exc).__name__}: {exc})")
                continue
            if not psi.shape[:2] == phi.shape[:2] == grow.shape[:2]:
                self._drop(
                    s,
                    f"the last maps' input rows {tuple(psi.shape[:2])} differ from the site's {tuple(grow.shape[:2])}",
                )
                continue
            if pb.mask is not None and lay == Layout.SEQUENCE:
                keep = pb.mask.to(torch.float64).cpu().unsqueeze(-1)
                psi, phi, grow = psi * keep, phi * keep, grow * keep
            size = 8 * (psi.numel() + phi.numel() + grow.numel())
            self.needed += size
            if self.bytes + size > self.max_bytes:
                self._over_budget()
                return
            self.bytes += size
            r = self.rows[s]
            r.psi.append(psi)
            r.phi.append(phi)
            r.g.append(grow)
            r.dtype = z.dtype
        self.inputs.clear()

    def _drop(self, site: str, reason: str) -> None:
        self.reasons[site] = reason
        self.rows.pop(site, None)

    def _over_budget(self) -> None:
        self.inputs.clear()
        for s in list(self.rows):
            self._drop(
                s,
                f"the decision's rows exceed its budget of {self.max_bytes / 2**20:.3g} MiB (DECISION_MAX_BYTES) "
                f"for all sites together (this probe needs at least {self.needed / 2**20:.3g} MiB): diagnose fewer "
                "sites (--sites) or a smaller probe",
            )

    def finish(self, site_results: list, *, whole_probe: bool, world: int) -> None:
        """Set ``decision``, ``decision_reason``, ``stationarity`` and ``beyond_training`` on every site.

        Args:
            site_results: the :class:`~depthsat_theory.diagnose.report.SiteDiagnosis` list, changed in place.
            whole_probe: whether this run streamed the whole probe (not resumed from a checkpoint).
            world: the number of processes (rows are not sharded).
        """
        for sd in site_results:
            reason = self._not_available(sd.site, whole_probe, world)
            if reason is not None:
                sd.decision, sd.decision_reason = DepthDecision.UNDETERMINED, reason
                continue
            r = self.rows[sd.site]
            kw = {} if self.alpha is None else {"alpha": self.alpha}
            try:
                bt = beyond_training(_stack(r.psi), _stack(r.phi), _stack(r.g), dtype=r.dtype, **kw)
            except (StatisticsError, np.linalg.LinAlgError) as exc:
                sd.decision, sd.decision_reason = DepthDecision.UNDETERMINED, f"not computed: {exc}"
                continue
            sd.stationarity, sd.beyond_training = bt.old, bt.beyond
            maps = ", ".join(self.maps[sd.site])
            sd.decision, sd.decision_reason = bt.decision, f"{bt.reason} (existing last map: {maps})"
        self.rows.clear()

    def _not_available(self, site: str, whole_probe: bool, world: int) -> str | None:
        if site in self.reasons:
            return self.reasons[site]
        if world > 1:
            return "the decision's rows are not sharded: run it in one process"
        if not whole_probe:
            return "the decision's rows are not checkpointed: rerun without resuming"
        if not self.rows.get(site, _SiteRows()).g:
            return "no probe rows reached this site"
        return None


def _stack(parts: list[Tensor]) -> Tensor:
    """Batches of rows ``(B_i, R_i, k)`` as one ``(n, max R, k)`` (shorter rows zero-padded: they add nothing)."""
    width = max(int(p.shape[1]) for p in parts)
    padded = [torch.nn.functional.pad(p, (0, 0, 0, width - int(p.shape[1]))) for p in parts]
    return torch.cat(padded)
