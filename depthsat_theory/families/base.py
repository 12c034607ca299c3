"""Residual families: parameterized blocks ``h_θ`` with ``h_0 ≡ 0``.

A *residual family* at an *insertion site* is a map ``(θ, z) ↦ h_θ(z)`` with
``θ ∈ R^p`` and the function-preservation property ``h_0(z) = 0`` for every site
tensor ``z`` (theory/definitions.md, def-setting; theory label ``def-family``).  Inserting it turns the site
``z ↦ z + h_θ(z)``.  Its *tangent map* at the origin is ``A(z) = ∂_θ h_θ(z)|_{θ=0}``
and its *tangent space* is ``T = {z ↦ A(z) v : v ∈ R^p}``.

Site tensors come in three layouts (per example, the batch dimension ``B`` first):

=========== ================ ====================================================
layout      site tensor      rows (positions) used by row-wise families
=========== ================ ====================================================
``vector``  ``(B, d)``       one row of ``d`` per example
``sequence``  ``(B, T, d)``  ``T`` rows (tokens) of ``d``
``image``   ``(B, C, H, W)`` ``H·W`` rows (pixels) of ``C``
=========== ================ ====================================================

Most practical blocks are *zero-output feature families* (theory/definitions.md)

.. math::

    h_{W,c,ψ}(z)_r = W\\,φ_ψ(z)_r + c, \\qquad W = 0,\\ c = 0 \\text{ at the origin},

whose zero factor is the block's final linear map.  Their tangent space is
``{V φ̃}`` with ``φ̃ = (φ, 1)`` when the block has an output bias, and the feature
parameters ``ψ`` have exactly zero gradient at the origin.  Each family states its
*unit*: ``"row"`` when ``φ(z)_r`` depends on row ``r`` of ``z`` only (token-/pixel-wise
blocks), ``"tensor"`` when it depends on the whole example (attention, 3×3 conv).

Families are dimension-agnostic descriptions; concrete weights (for example the
seeded random features) are built for a site from its per-example shape.
"""

from __future__ import annotations

import abc
import copy
import math
import re
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

__all__ = [
    "LAYOUTS",
    "FamilyError",
    "FeatureFamily",
    "GeneralFamily",
    "ResidualFamily",
    "causal_attention",
    "conv1x1",
    "conv3x3",
    "even_features",
    "family_specs",
    "from_rows",
    "linear",
    "parse_family",
    "polynomial",
    "preln_mlp",
    "product",
    "random_features",
    "to_rows",
]

LAYOUTS = ("vector", "sequence", "image")
#: Largest polynomial degree and feature width accepted from specs.
MAX_DEGREE = 16
MAX_WIDTH = 1 << 16


class FamilyError(ValueError):
    """A residual family was misspecified or does not fit a site."""


# ----------------------------------------------------------------------------- layouts
def to_rows(t: Tensor, layout: str) -> Tensor:
    """Reshape a batch of site tensors into rows (positions).

    Args:
        t: site tensor, ``(B, d)``, ``(B, T, d)`` or ``(B, C, H, W)`` by ``layout``.
        layout: one of :data:`LAYOUTS`.

    Returns:
        ``(B, R, d)`` with ``R = 1``, ``T`` or ``H·W`` (a view where possible).

    Raises:
        FamilyError: if ``t`` has the wrong number of dimensions for ``layout``.
    """
    _check_layout_tensor(t, layout)
    if layout == "vector":
        return t.unsqueeze(1)
    if layout == "sequence":
        return t
    return t.flatten(2).transpose(1, 2)


def from_rows(rows: Tensor, layout: str, shape: Sequence[int]) -> Tensor:
    """Inverse of :func:`to_rows`: ``(B, R, d)`` rows back to site tensors of ``shape``."""
    if layout == "vector":
        return rows.squeeze(1)
    if layout == "sequence":
        return rows
    b = rows.shape[0]
    return rows.transpose(1, 2).reshape(b, *shape[1:])


def _check_layout_tensor(t: Tensor, layout: str) -> None:
    ndim = {"vector": 2, "sequence": 3, "image": 4}.get(layout)
    if ndim is None:
        raise FamilyError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    if t.dim() != ndim:
        raise FamilyError(
            f"a {layout!r} site tensor must have {ndim} dimensions (batch first), got shape {tuple(t.shape)}"
        )


def _check_width(width: int) -> None:
    if not 1 <= width <= MAX_WIDTH:
        raise FamilyError(f"feature width must be in 1..{MAX_WIDTH}, got {width}")


def _generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed))
    return g


# ----------------------------------------------------------------------------- base
class ResidualFamily(abc.ABC):
    """A residual family ``h_θ`` with ``h_0 ≡ 0`` (theory label ``def-family``).

    Attributes:
        spec: canonical spec string (e.g. ``"relu:128:0"``), usable with
            :func:`parse_family`.
        unit: ``"row"`` or ``"tensor"`` (see the module docstring).
        layouts: site layouts this family fits.
    """

    spec: str = ""
    unit: str = "row"
    layouts: tuple[str, ...] = LAYOUTS

    def check_site(self, shape: Sequence[int], layout: str) -> None:
        """Raise :class:`FamilyError` if the family does not fit a site.

        Args:
            shape: per-example site shape (without the batch dimension).
            layout: the site's layout.
        """
        if layout not in self.layouts:
            raise FamilyError(
                f"family {self.spec!r} does not fit a {layout!r} site "
                f"(it fits {', '.join(self.layouts)} sites); choose another family"
            )
        want = {"vector": 1, "sequence": 2, "image": 3}[layout]
        if len(shape) != want:
            raise FamilyError(f"a {layout!r} site has per-example shape of {want} dims, got {tuple(shape)}")

    @abc.abstractmethod
    def param_dim(self, shape: Sequence[int]) -> int:
        """Dimension ``p`` of the tangent coordinates ``θ`` at a site of this shape."""

    @abc.abstractmethod
    def functional(self, theta: Tensor, z: Tensor, layout: str) -> Tensor:
        """Evaluate ``h_θ(z)`` as a pure function (for ``torch.func``).

        Args:
            theta: ``(p,)`` tangent coordinates, same dtype as ``z``.
            z: site tensors ``(B, *shape)``.
            layout: the site's layout.

        Returns:
            ``(B, *shape)``: the block's output (zero when ``theta`` is zero).
        """

    @abc.abstractmethod
    def block(self, shape: Sequence[int], layout: str, *, dtype=None, device=None) -> nn.Module:
        """Build the insertable block at the origin: a module ``z ↦ h_0(z)``.

        Its parameters, flattened in ``named_parameters()`` order with the
        tangent-coordinate parameters first, are the block's ``θ``; parameters not in
        the tangent coordinates (feature weights ``ψ``) follow and have zero
        gradient at the origin.
        """

    def tangent_parameters(self, block: nn.Module) -> list[nn.Parameter]:
        """The block's parameters that form ``θ`` (in the order of :meth:`functional`)."""
        return list(block.parameters())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"


# ----------------------------------------------------------------------------- features
class _FeatureBlock(nn.Module):
    """``z ↦ from_rows(out(features(z)))`` with a zero final linear map ``out``."""

    def __init__(self, features: nn.Module, k: int, d: int, bias: bool, layout: str):
        super().__init__()
        self.layout = layout
        self.out = nn.Linear(k, d, bias=bias)
        nn.init.zeros_(self.out.weight)
        if bias:
            nn.init.zeros_(self.out.bias)
        self.features = features

    def forward(self, z: Tensor) -> Tensor:
        rows = self.out(self.features(z))
        return from_rows(rows, self.layout, z.shape)


class _Conv1x1Block(nn.Module):
    """A zero-initialized ``1×1`` convolution ``z ↦ W z + c`` (image sites)."""

    def __init__(self, c: int, features: nn.Module | None, k: int, bias: bool):
        super().__init__()
        self.out = nn.Conv2d(k, c, kernel_size=1, bias=bias)
        nn.init.zeros_(self.out.weight)
        if bias:
            nn.init.zeros_(self.out.bias)
        self.features = features

    def forward(self, z: Tensor) -> Tensor:
        x = z if self.features is None else self.features.image(z)
        return self.out(x)


class FeatureFamily(ResidualFamily):
    """Zero-output feature family ``h(z)_r = W φ_ψ(z)_r + c`` (theory/definitions.md).

    Subclasses implement :meth:`feature_map`, an ``nn.Module`` mapping site tensors
    ``(B, *shape)`` to feature rows ``(B, R, k)``.  The tangent coordinates are
    ``θ = (vec_row(W), c)`` with ``W ∈ R^{d×k}`` (``c`` only when ``bias``), so
    ``p = d (k + bias)``; feature weights ``ψ`` are not tangent coordinates (their
    tangent columns are exactly zero).

    Statistics for these families use the cross-gradient
    ``G = E[Σ_r g_r φ̃_rᵀ]`` and ``Σ = E[Σ_r φ̃_r φ̃_rᵀ]`` and never build the
    ``(units·d) × p`` Jacobian (see :mod:`depthsat_theory.statistics.tangent`).
    """

    bias: bool = True

    def __init__(self, spec: str, *, bias: bool = True, unit: str = "row", layouts: tuple[str, ...] = LAYOUTS):
        self.spec = spec
        self.bias = bias
        self.unit = unit
        self.layouts = layouts
        self._cache: dict = {}

    # -- to implement
    @abc.abstractmethod
    def feature_dim(self, shape: Sequence[int], layout: str) -> int:
        """Number ``k`` of features per row, without the constant."""

    @abc.abstractmethod
    def _make_feature_map(self, shape: Sequence[int], layout: str) -> nn.Module:
        """A float64 CPU module mapping ``(B, *shape)`` to rows ``(B, R, k)``."""

    # -- derived
    def feature_map(self, shape: Sequence[int], layout: str, *, dtype=None, device=None) -> nn.Module:
        """The feature module ``φ_ψ`` at a site (deterministic in the family's seed).

        Returns:
            A module mapping ``(B, *shape)`` site tensors to ``(B, R, k)`` rows, in
            ``dtype`` (default float64) on ``device``, with ``requires_grad`` on.
        """
        key = (tuple(shape), layout)
        if key not in self._cache:  # the float64 CPU master copy
            self.check_site(shape, layout)
            self._cache[key] = self._make_feature_map(shape, layout)
        mod = copy.deepcopy(self._cache[key])
        return mod.to(dtype=dtype or torch.float64, device=device)

    def site_dim(self, shape: Sequence[int], layout: str) -> int:
        """Row dimension ``d`` (``C`` for image sites)."""
        return int(shape[0] if layout == "image" else shape[-1])

    def augmented_dim(self, shape: Sequence[int], layout: str) -> int:
        """``k̃ = k + bias``: the length of ``φ̃``."""
        return self.feature_dim(shape, layout) + int(self.bias)

    def param_dim(self, shape: Sequence[int]) -> int:
        layout = _layout_of(shape)
        return self.site_dim(shape, layout) * self.augmented_dim(shape, layout)

    def augmented_features(self, fmap: nn.Module, z: Tensor) -> Tensor:
        """``φ̃(z)`` rows: ``(B, R, k̃)``, the constant column last when ``bias``."""
        phi = fmap(z)
        if self.bias:
            phi = torch.cat([phi, phi.new_ones((*phi.shape[:-1], 1))], dim=-1)
        return phi

    def frozen_feature_map(self, shape: Sequence[int], layout: str, *, dtype=None, device=None) -> nn.Module:
        """A cached copy of :meth:`feature_map` with gradients off (statistics, ``functional``)."""
        key = ("frozen", tuple(shape), layout, dtype or torch.float64, str(device))
        if key not in self._cache:
            fmap = self.feature_map(shape, layout, dtype=dtype, device=device)
            for prm in fmap.parameters():
                prm.requires_grad_(False)
            self._cache[key] = fmap
        return self._cache[key]

    def split_theta(self, theta: Tensor, d: int, k: int) -> tuple[Tensor, Tensor | None]:
        """``θ = (vec_row(W), c)`` ↦ ``(W (d, k), c (d,) or None)``."""
        w = theta[: d * k].reshape(d, k)
        return w, (theta[d * k :] if self.bias else None)

    def functional(self, theta: Tensor, z: Tensor, layout: str) -> Tensor:
        shape = tuple(z.shape[1:])
        d = self.site_dim(shape, layout)
        k = self.feature_dim(shape, layout)
        if theta.numel() != d * (k + int(self.bias)):
            raise FamilyError(f"theta has {theta.numel()} entries, family needs {d * (k + int(self.bias))}")
        fmap = self.frozen_feature_map(shape, layout, dtype=z.dtype, device=z.device)
        w, c = self.split_theta(theta, d, k)
        out = fmap(z) @ w.T
        if c is not None:
            out = out + c
        return from_rows(out, layout, z.shape)

    def block(self, shape, layout, *, dtype=None, device=None) -> nn.Module:
        self.check_site(shape, layout)
        fmap = self.feature_map(shape, layout, dtype=dtype, device=device)
        k = self.feature_dim(shape, layout)
        d = self.site_dim(shape, layout)
        blk = _FeatureBlock(fmap, k, d, self.bias, layout)
        return blk.to(dtype=dtype or torch.float64, device=device)

    def tangent_parameters(self, block: nn.Module) -> list[nn.Parameter]:
        out = block.out
        ps = [out.weight] + ([out.bias] if self.bias else [])
        return ps


def _layout_of(shape: Sequence[int]) -> str:
    return {1: "vector", 2: "sequence", 3: "image"}[len(shape)]


# -- concrete feature maps
class _Rows(nn.Module):
    def __init__(self, layout: str):
        super().__init__()
        self.layout = layout

    def forward(self, z: Tensor) -> Tensor:
        return to_rows(z, self.layout)


class _Powers(_Rows):
    def __init__(self, layout: str, degree: int):
        super().__init__(layout)
        self.degree = degree

    def forward(self, z: Tensor) -> Tensor:
        r = to_rows(z, self.layout)
        return torch.cat([r**j for j in range(1, self.degree + 1)], dim=-1)


class _Even(_Rows):
    def __init__(self, layout: str, kind: str):
        super().__init__(layout)
        self.kind = kind

    def forward(self, z: Tensor) -> Tensor:
        r = to_rows(z, self.layout)
        return r.abs() if self.kind == "abs" else r * r


_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": torch.relu,
    "gelu": nn.functional.gelu,
    "tanh": torch.tanh,
}


class _RandomFeatures(_Rows):
    def __init__(self, layout: str, d: int, k: int, act: str, seed: int, layernorm: bool):
        super().__init__(layout)
        gen = _generator(seed)
        self.norm = nn.LayerNorm(d, dtype=torch.float64) if layernorm else None
        self.proj = nn.Linear(d, k, dtype=torch.float64)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(k, d, generator=gen, dtype=torch.float64) / math.sqrt(d))
            self.proj.bias.copy_(torch.randn(k, generator=gen, dtype=torch.float64) * 0.5)
        self.act = act

    def forward(self, z: Tensor) -> Tensor:
        r = to_rows(z, self.layout)
        if self.norm is not None:
            r = self.norm(r)
        return _ACTIVATIONS[self.act](self.proj(r))


class _Conv3x3Features(nn.Module):
    def __init__(self, c: int, k: int, seed: int):
        super().__init__()
        gen = _generator(seed)
        self.conv = nn.Conv2d(c, k, kernel_size=3, padding=1, dtype=torch.float64)
        with torch.no_grad():
            self.conv.weight.copy_(torch.randn(k, c, 3, 3, generator=gen, dtype=torch.float64) / math.sqrt(9 * c))
            self.conv.bias.copy_(torch.randn(k, generator=gen, dtype=torch.float64) * 0.5)

    def image(self, z: Tensor) -> Tensor:
        return torch.relu(self.conv(z))

    def forward(self, z: Tensor) -> Tensor:
        return to_rows(self.image(z), "image")


class _CausalAttentionFeatures(nn.Module):
    """Pre-LN causal self-attention without its output projection: rows ``(B, T, k)``."""

    def __init__(self, d: int, k: int, heads: int, seed: int):
        super().__init__()
        if k % heads:
            raise FamilyError(f"attention width {k} must be a multiple of heads={heads}")
        gen = _generator(seed)
        self.heads = heads
        self.norm = nn.LayerNorm(d, dtype=torch.float64)
        self.q = nn.Linear(d, k, bias=False, dtype=torch.float64)
        self.k = nn.Linear(d, k, bias=False, dtype=torch.float64)
        self.v = nn.Linear(d, k, bias=False, dtype=torch.float64)
        with torch.no_grad():
            for lin in (self.q, self.k, self.v):
                lin.weight.copy_(torch.randn(k, d, generator=gen, dtype=torch.float64) / math.sqrt(d))

    def forward(self, z: Tensor) -> Tensor:
        b, t, _ = z.shape
        x = self.norm(z)
        h = self.heads

        def split(y: Tensor) -> Tensor:
            return y.view(b, t, h, -1).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        mask = torch.ones(t, t, dtype=torch.bool, device=z.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        return (att @ v).transpose(1, 2).reshape(b, t, -1)


class _SimpleFeatureFamily(FeatureFamily):
    def __init__(self, spec, make, kdim, *, bias=True, unit="row", layouts=LAYOUTS):
        super().__init__(spec, bias=bias, unit=unit, layouts=layouts)
        self._make = make
        self._kdim = kdim

    def feature_dim(self, shape, layout):
        return int(self._kdim(self.site_dim(shape, layout)))

    def _make_feature_map(self, shape, layout):
        return self._make(self.site_dim(shape, layout), layout)


class _Conv1x1Family(_SimpleFeatureFamily):
    def block(self, shape, layout, *, dtype=None, device=None):
        self.check_site(shape, layout)
        blk = _Conv1x1Block(int(shape[0]), None, int(shape[0]), self.bias)
        return blk.to(dtype=dtype or torch.float64, device=device)


class _Conv3x3Family(_SimpleFeatureFamily):
    def block(self, shape, layout, *, dtype=None, device=None):
        self.check_site(shape, layout)
        fmap = self.feature_map(shape, layout, dtype=dtype, device=device)
        blk = _Conv1x1Block(int(shape[0]), fmap, self.feature_dim(shape, layout), self.bias)
        return blk.to(dtype=dtype or torch.float64, device=device)


# -- constructors (public)
def linear(*, bias: bool = True) -> FeatureFamily:
    """Linear family ``h(u) = W u (+ c)`` on rows: ``φ(u) = u``, ``k = d``."""
    return _SimpleFeatureFamily(
        "linear" if bias else "linear-nobias", lambda d, lay: _Rows(lay), lambda d: d, bias=bias
    )


def polynomial(degree: int, *, bias: bool = True) -> FeatureFamily:
    """Elementwise polynomial features ``φ(u) = (u, u², …, u^D)``, ``k = D d``.

    Raises:
        FamilyError: if ``degree < 1``.
    """
    if not 1 <= degree <= MAX_DEGREE:
        raise FamilyError(f"polynomial degree must be in 1..{MAX_DEGREE}, got {degree}")
    return _SimpleFeatureFamily(f"poly:{degree}", lambda d, lay: _Powers(lay, degree), lambda d: degree * d, bias=bias)


def random_features(width: int, activation: str = "relu", seed: int = 0) -> FeatureFamily:
    """Random-feature block ``φ(u) = act(Ω u + β)``, ``Ω ~ N(0, 1/d)``, ``β ~ N(0, 1/4)``.

    The feature seed ``ψ_0`` is part of the family (``T`` is random through it,
    theory label thm-reparameterization).  ``activation`` is ``relu``, ``gelu`` or ``tanh``.

    Raises:
        FamilyError: on an unknown activation or ``width < 1``.
    """
    if activation not in _ACTIVATIONS:
        raise FamilyError(f"unknown activation {activation!r}; use one of {sorted(_ACTIVATIONS)}")
    _check_width(width)
    return _SimpleFeatureFamily(
        f"{activation}:{width}:{seed}",
        lambda d, lay: _RandomFeatures(lay, d, width, activation, seed, layernorm=False),
        lambda d: width,
    )


def even_features(kind: str = "abs") -> FeatureFamily:
    """Even elementwise features ``|u|`` or ``u²`` (used by the odd construction, theory label ex-saturated)."""
    if kind not in ("abs", "square"):
        raise FamilyError(f"even features are 'abs' or 'square', got {kind!r}")
    return _SimpleFeatureFamily(f"even:{kind}", lambda d, lay: _Even(lay, kind), lambda d: d)


def preln_mlp(width: int, seed: int = 0) -> FeatureFamily:
    """Pre-LN MLP block: LayerNorm → Linear(d, k) → GELU → zero Linear(k, d) (with bias)."""
    _check_width(width)
    return _SimpleFeatureFamily(
        f"preln:{width}:{seed}",
        lambda d, lay: _RandomFeatures(lay, d, width, "gelu", seed, layernorm=True),
        lambda d: width,
    )


def conv1x1(*, bias: bool = True) -> FeatureFamily:
    """A zero ``1×1`` convolution on image sites (the linear family on pixel rows)."""
    return _Conv1x1Family("conv1x1", lambda d, lay: _Rows(lay), lambda d: d, bias=bias, layouts=("image",))


def conv3x3(width: int, seed: int = 0) -> FeatureFamily:
    """Conv3×3(C, k) → ReLU → zero Conv1×1(k, C): unit is the whole image."""
    _check_width(width)
    return _Conv3x3Family(
        f"conv3x3:{width}:{seed}",
        lambda d, lay: _Conv3x3Features(d, width, seed),
        lambda d: width,
        unit="tensor",
        layouts=("image",),
    )


def causal_attention(width: int, heads: int = 4, seed: int = 0) -> FeatureFamily:
    """Pre-LN causal self-attention with a zero output projection (sequence sites).

    Features are the concatenated head outputs ``(B, T, k)``; the unit is the whole
    sequence.  Implemented explicitly (``nn.MultiheadAttention`` would bypass
    ``out_proj``'s hooks, theory/definitions.md).
    """
    _check_width(width)
    if heads < 1:
        raise FamilyError(f"attention heads must be >= 1, got {heads}")
    return _SimpleFeatureFamily(
        f"attention:{width}:{seed}",
        lambda d, lay: _CausalAttentionFeatures(d, width, heads, seed),
        lambda d: width,
        unit="tensor",
        layouts=("sequence",),
    )


# ----------------------------------------------------------------------------- general
class _GeneralBlock(nn.Module):
    def __init__(self, family: GeneralFamily, p: int, layout: str):
        super().__init__()
        self.theta = nn.Parameter(torch.zeros(p, dtype=torch.float64))
        self.family = family
        self.layout = layout

    def forward(self, z: Tensor) -> Tensor:
        return self.family.functional(self.theta, z, self.layout)


class GeneralFamily(ResidualFamily):
    """Any torch function ``h(θ, u)`` with ``h(0, ·) = 0``; tangent map via ``torch.func``.

    Args:
        fn: ``fn(theta, u) -> Tensor``.  For ``unit="row"``, ``u`` is ``(N, d)`` rows and
            the result ``(N, d)``; for ``unit="tensor"``, ``u`` is ``(B, *shape)`` site
            tensors and the result has the same shape.  Must be differentiable in
            ``theta`` and written with torch operations (``torch.func`` transforms it).
        param_dim: ``p``, an int or a callable ``d ↦ p`` of the row dimension.
        name: spec name used in reports.
        unit: ``"row"`` or ``"tensor"``.
        layouts: site layouts the function accepts.

    Function preservation is *not* assumed: :func:`depthsat_theory.capture.sites.check_function_preserving`
    measures ``max |h(0, z)|`` on a probe and raises if it is not zero.
    """

    def __init__(
        self,
        fn: Callable[[Tensor, Tensor], Tensor],
        param_dim: int | Callable[[int], int],
        *,
        name: str = "general",
        unit: str = "row",
        layouts: tuple[str, ...] = LAYOUTS,
    ):
        if unit not in ("row", "tensor"):
            raise FamilyError(f"unit must be 'row' or 'tensor', got {unit!r}")
        self.fn = fn
        self._p = param_dim
        self.spec = name
        self.unit = unit
        self.layouts = layouts

    def param_dim(self, shape: Sequence[int]) -> int:
        layout = _layout_of(shape)
        d = int(shape[0] if layout == "image" else shape[-1])
        p = self._p(d) if callable(self._p) else self._p
        if int(p) < 1:
            raise FamilyError(f"family {self.spec!r} has param_dim {p}; need >= 1")
        return int(p)

    def functional(self, theta: Tensor, z: Tensor, layout: str) -> Tensor:
        if self.unit == "tensor":
            return self.fn(theta, z)
        rows = to_rows(z, layout)
        flat = rows.reshape(-1, rows.shape[-1])
        out = self.fn(theta, flat)
        if out.shape != flat.shape:
            raise FamilyError(
                f"family {self.spec!r} returned shape {tuple(out.shape)} for rows of shape "
                f"{tuple(flat.shape)}; a residual block must preserve the row shape"
            )
        return from_rows(out.reshape(rows.shape), layout, z.shape)

    def block(self, shape, layout, *, dtype=None, device=None) -> nn.Module:
        self.check_site(shape, layout)
        return _GeneralBlock(self, self.param_dim(shape), layout).to(dtype=dtype or torch.float64, device=device)


def product(rank: int) -> GeneralFamily:
    """Degenerate product family ``h(u) = U V u`` with ``U ∈ R^{d×R}``, ``V ∈ R^{R×d}`` both zero.

    Its tangent map vanishes at the origin (``A ≡ 0``), so ``T = {0}``: the family is
    *degenerate* and must never be reported as saturated (theory label thm-reparameterization).
    """
    if rank < 1:
        raise FamilyError(f"product rank must be >= 1, got {rank}")

    def fn(theta: Tensor, u: Tensor) -> Tensor:
        d = u.shape[-1]
        big_u = theta[: d * rank].reshape(d, rank)
        big_v = theta[d * rank :].reshape(rank, d)
        return u @ big_v.T @ big_u.T

    return GeneralFamily(fn, lambda d: 2 * d * rank, name=f"product:{rank}")


# ----------------------------------------------------------------------------- specs
_SPEC_HELP = (
    "linear, linear-nobias, poly:D, relu:K[:SEED], gelu:K[:SEED], tanh:K[:SEED], "
    "even:abs, even:square, preln:K[:SEED], conv1x1, conv3x3:K[:SEED], "
    "attention:K[:SEED], product:R"
)


def family_specs() -> str:
    """A one-line description of the built-in family spec grammar."""
    return _SPEC_HELP


def parse_family(spec: str) -> ResidualFamily:
    """Build a built-in residual family from a spec string.

    Grammar: ``linear``, ``linear-nobias``, ``poly:D``, ``relu:K[:SEED]``,
    ``gelu:K[:SEED]``, ``tanh:K[:SEED]``, ``even:abs``, ``even:square``,
    ``preln:K[:SEED]``, ``conv1x1``, ``conv3x3:K[:SEED]``, ``attention:K[:SEED]``,
    ``product:R`` (degenerate).  Seeds default to 0.

    Raises:
        FamilyError: on an unknown or malformed spec (the message lists the grammar).
    """
    s = spec.strip().lower()

    def bad(why: str) -> FamilyError:
        return FamilyError(f"bad family spec {spec!r}: {why}; valid specs: {_SPEC_HELP}")

    if s == "linear":
        return linear()
    if s == "linear-nobias":
        return linear(bias=False)
    if s == "conv1x1":
        return conv1x1()
    m = re.fullmatch(r"even:(abs|square)", s)
    if m:
        return even_features(m.group(1))
    m = re.fullmatch(r"([a-z0-9]+):(\d+)(?::(\d+))?", s)
    if not m:
        raise bad("unknown family")
    name, a, seed = m.group(1), int(m.group(2)), int(m.group(3) or 0)
    if name == "poly":
        if m.group(3) is not None:
            raise bad("poly takes no seed")
        return polynomial(a)
    if name in _ACTIVATIONS:
        return random_features(a, name, seed)
    if name == "preln":
        return preln_mlp(a, seed)
    if name == "conv3x3":
        return conv3x3(a, seed)
    if name == "attention":
        return causal_attention(a, heads=_heads_for(a), seed=seed)
    if name == "product":
        return product(a)
    raise bad(f"unknown family {name!r}")


def _heads_for(width: int) -> int:
    for h in (4, 2, 1):
        if width % h == 0:
            return h
    return 1
