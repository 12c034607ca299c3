"""The built-in residual families: feature modules and the factories behind the spec strings.

Every factory returns a :class:`~depthsat_theory.families.FeatureFamily` (zero-output
feature families, theory/definitions.md) except :func:`product`, a degenerate
:class:`~depthsat_theory.families.GeneralFamily` (theory label thm-reparameterization).
Their spec strings (``relu:128:0``, ``poly:2``, ``powers:3``, …) are parsed by
:func:`depthsat_theory.families.specs.parse_family`.  Feature weights are float64 and
deterministic in the family's seed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor, nn

from depthsat_theory.families.base import FamilyError, FeatureFamily, GeneralFamily, place_block, to_rows
from depthsat_theory.vocabulary import Layout

__all__ = [
    "ACTIVATIONS",
    "EVEN_KINDS",
    "MAX_DEGREE",
    "MAX_POLY_FEATURES",
    "MAX_WIDTH",
    "causal_attention",
    "conv1x1",
    "conv3x3",
    "even_features",
    "linear",
    "monomial_exponents",
    "polynomial",
    "powers",
    "preln_mlp",
    "product",
    "random_features",
]

#: Largest polynomial degree and feature width accepted by the factories.
MAX_DEGREE = 16
MAX_WIDTH = 1 << 16

#: Largest number of monomial features ``C(d + D, D) − 1`` of ``poly:D`` (``Σ`` is ``k̃ × k̃``).
MAX_POLY_FEATURES = 4096


def _check_width(width: int) -> None:
    if not 1 <= width <= MAX_WIDTH:
        raise FamilyError(f"feature width must be in 1..{MAX_WIDTH}, got {width}")


def _generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed))
    return g


class _Conv1x1Block(nn.Module):
    """A zero-initialized ``1×1`` convolution ``z ↦ W z + c`` (image sites)."""

    def __init__(self, c: int, features: _Conv3x3Features | None, k: int, bias: bool):
        super().__init__()
        self.out = nn.Conv2d(k, c, kernel_size=1, bias=bias)
        nn.init.zeros_(self.out.weight)
        if self.out.bias is not None:
            nn.init.zeros_(self.out.bias)
        self.features = features

    def forward(self, z: Tensor) -> Tensor:
        x = z if self.features is None else self.features.image(z)
        return self.out(x)


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


def monomial_exponents(d: int, degree: int) -> list[tuple[int, ...]]:
    """The monomials of total degree ``1..D`` in ``d`` variables, as index tuples, in feature order.

    By degree, then lexicographically (``itertools.combinations_with_replacement``): for
    ``d = 2, D = 2`` that is ``u1, u2, u1², u1 u2, u2²``.  There are ``C(d + D, D) − 1``.

    Args:
        d: number of variables.
        degree: the largest total degree ``D``.

    Returns:
        Sorted tuples of 0-based variable indices, one per monomial (``(0, 1)`` is ``u1 u2``).
    """
    return [c for q in range(1, degree + 1) for c in itertools.combinations_with_replacement(range(d), q)]


class _Monomials(_Rows):
    """All monomials of total degree ``1..D`` of each row (:func:`monomial_exponents` order)."""

    def __init__(self, layout: str, d: int, degree: int):
        super().__init__(layout)
        by_degree: dict[int, list[tuple[int, ...]]] = {}
        for c in monomial_exponents(d, degree):
            by_degree.setdefault(len(c), []).append(c)
        self.index = [torch.tensor(v, dtype=torch.long) for _, v in sorted(by_degree.items())]

    def forward(self, z: Tensor) -> Tensor:
        r = to_rows(z, self.layout)
        return torch.cat([r[..., idx.to(r.device)].prod(-1) for idx in self.index], dim=-1)


def _poly_features(d: int, degree: int) -> int:
    """``C(d + D, D) − 1`` monomials, refused above :data:`MAX_POLY_FEATURES`.

    Raises:
        FamilyError: when the count exceeds :data:`MAX_POLY_FEATURES`.
    """
    k = math.comb(d + degree, degree) - 1
    if k > MAX_POLY_FEATURES:
        raise FamilyError(
            f"family 'poly:{degree}' at a site of width d = {d} has C(d + D, D) - 1 = {k} monomial "
            f"features, above the limit {MAX_POLY_FEATURES}; use a lower degree, 'powers:{degree}' "
            f"(elementwise powers, {degree * d} features) or random features 'relu:K'"
        )
    return k


class _Even(_Rows):
    def __init__(self, layout: str, kind: str):
        super().__init__(layout)
        self.kind = kind

    def forward(self, z: Tensor) -> Tensor:
        r = to_rows(z, self.layout)
        return r.abs() if self.kind == "abs" else r * r


#: Activations of :func:`random_features` by name.
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
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
        return ACTIVATIONS[self.act](self.proj(r))


class _Conv3x3Features(nn.Module):
    def __init__(self, c: int, k: int, seed: int):
        super().__init__()
        gen = _generator(seed)
        self.conv = nn.Conv2d(c, k, kernel_size=3, padding=1, dtype=torch.float64)
        with torch.no_grad():
            self.conv.weight.copy_(torch.randn(k, c, 3, 3, generator=gen, dtype=torch.float64) / math.sqrt(9 * c))
            self.conv.get_parameter("bias").copy_(torch.randn(k, generator=gen, dtype=torch.float64) * 0.5)

    def image(self, z: Tensor) -> Tensor:
        return torch.relu(self.conv(z))

    def forward(self, z: Tensor) -> Tensor:
        return to_rows(self.image(z), Layout.IMAGE)


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

    def forward(self, z: Tensor, mask: Tensor | None = None) -> Tensor:
        """Head outputs ``(B, T, k)`` of site tensors ``z`` ``(B, T, d)``.

        Args:
            z: the sequence site tensors.
            mask: optional padding mask ``(B, T)`` bool, ``True`` at real tokens: padded
                keys are excluded from every query's attention and padded rows are zero, so
                the real rows equal those of the unpadded sequence (no positional term).
        """
        b, t, _ = z.shape
        x = self.norm(z)
        h = self.heads

        def split(y: Tensor) -> Tensor:
            return y.view(b, t, h, -1).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        allowed = torch.ones(t, t, dtype=torch.bool, device=z.device).tril()[None, None]
        if mask is not None:
            real = mask.to(device=z.device, dtype=torch.bool)
            # a padded query keeps its own key only (a row of -inf has no softmax); it is zeroed below
            allowed = (allowed & real[:, None, None, :]) | torch.eye(t, dtype=torch.bool, device=z.device)
        out = (att.masked_fill(~allowed, float("-inf")).softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, -1)
        return out if mask is None else out * real[..., None].to(out.dtype)


class _SimpleFeatureFamily(FeatureFamily):
    def __init__(self, spec, make, kdim, *, bias=True, unit="row", layouts=tuple(Layout), copies_input=False):
        super().__init__(spec, bias=bias, unit=unit, layouts=layouts)
        self._make = make
        self._kdim = kdim
        self.copies_input = copies_input

    def feature_dim(self, shape, layout):
        return int(self._kdim(self.site_dim(shape, layout)))

    def _make_feature_map(self, shape, layout):
        return self._make(self.site_dim(shape, layout), layout)


class _Conv1x1Family(_SimpleFeatureFamily):
    def block(self, shape, layout, *, dtype=None, device=None):
        self.check_site(shape, layout)
        return place_block(_Conv1x1Block(int(shape[0]), None, int(shape[0]), self.bias), dtype, device)


class _Conv3x3Family(_SimpleFeatureFamily):
    def block(self, shape, layout, *, dtype=None, device=None):
        self.check_site(shape, layout)
        fmap = self.feature_map(shape, layout, dtype=dtype, device=device)
        blk = _Conv1x1Block(int(shape[0]), cast(_Conv3x3Features, fmap), self.feature_dim(shape, layout), self.bias)
        return place_block(blk, dtype, device)


# -- constructors (public)
def linear(*, bias: bool = True) -> FeatureFamily:
    """Linear family ``h(u) = W u (+ c)`` on rows: ``φ(u) = u``, ``k = d``.

    Args:
        bias: include the output bias ``c``.

    Returns:
        The family ``"linear"`` (``"linear-nobias"``).
    """
    return _SimpleFeatureFamily(
        "linear" if bias else "linear-nobias", lambda d, lay: _Rows(lay), lambda d: d, bias=bias, copies_input=True
    )


def _check_degree(degree: int) -> None:
    if not 1 <= degree <= MAX_DEGREE:
        raise FamilyError(f"polynomial degree must be in 1..{MAX_DEGREE}, got {degree}")


def polynomial(degree: int, *, bias: bool = True) -> FeatureFamily:
    """Polynomial features: every monomial of total degree ``1..D`` of the row ``u`` (spec ``poly:D``).

    ``φ(u) = (u_{i1} ⋯ u_{iq})`` over ``1 ≤ q ≤ D``, ``i1 ≤ … ≤ iq`` (order of
    :func:`monomial_exponents`), ``k = C(d + D, D) − 1`` (the constant is the output bias
    ``c``), so ``T`` is every polynomial map of degree ``≤ D`` (without ``c``: vanishing at 0).

    Args:
        degree: the largest total degree ``D``.
        bias: include the output bias ``c``.

    Returns:
        The family ``"poly:<degree>"``.

    Raises:
        FamilyError: if ``degree`` is not in ``1..MAX_DEGREE``; at a site, if ``k`` exceeds
            :data:`MAX_POLY_FEATURES`.
    """
    _check_degree(degree)
    return _SimpleFeatureFamily(
        f"poly:{degree}",
        lambda d, lay: _Monomials(lay, d, degree),
        lambda d: _poly_features(d, degree),
        bias=bias,
    )


def powers(degree: int, *, bias: bool = True) -> FeatureFamily:
    """Elementwise powers ``φ(u) = (u, u², …, u^D)`` (spec ``powers:D``), ``k = D d``.

    Feature ``(q − 1) d + j`` is ``u_j^q``; no cross terms (compare :func:`polynomial`).

    Args:
        degree: the largest power ``D``.
        bias: include the output bias ``c``.

    Returns:
        The family ``"powers:<degree>"``.

    Raises:
        FamilyError: if ``degree`` is not in ``1..MAX_DEGREE``.
    """
    _check_degree(degree)
    return _SimpleFeatureFamily(
        f"powers:{degree}", lambda d, lay: _Powers(lay, degree), lambda d: degree * d, bias=bias
    )


def random_features(width: int, activation: str = "relu", seed: int = 0) -> FeatureFamily:
    """Random-feature block ``φ(u) = act(Ω u + β)``, ``Ω ~ N(0, 1/d)``, ``β ~ N(0, 1/4)``.

    The feature seed ``ψ_0`` is part of the family (``T`` is random through it,
    theory label thm-reparameterization).  ``activation`` is ``relu``, ``gelu`` or ``tanh``.

    Args:
        width: number of features ``k`` (``1..MAX_WIDTH``).
        activation: ``"relu"``, ``"gelu"`` or ``"tanh"``.
        seed: the feature seed ``ψ_0``.

    Returns:
        The family ``"<activation>:<width>:<seed>"``.

    Raises:
        FamilyError: on an unknown activation or ``width < 1``.
    """
    if activation not in ACTIVATIONS:
        raise FamilyError(f"unknown activation {activation!r}; use one of {sorted(ACTIVATIONS)}")
    _check_width(width)
    return _SimpleFeatureFamily(
        f"{activation}:{width}:{seed}",
        lambda d, lay: _RandomFeatures(lay, d, width, activation, seed, layernorm=False),
        lambda d: width,
    )


#: The kinds of :func:`even_features`.
EVEN_KINDS = ("abs", "square")


def even_features(kind: str = "abs") -> FeatureFamily:
    """Even elementwise features ``|u|`` or ``u²`` (used by the odd construction, theory label ex-saturated).

    Args:
        kind: ``"abs"`` or ``"square"``.

    Returns:
        The family ``"even:<kind>"``, ``k = d``.

    Raises:
        FamilyError: on another ``kind``.
    """
    if kind not in EVEN_KINDS:
        raise FamilyError(f"even features are 'abs' or 'square', got {kind!r}")
    return _SimpleFeatureFamily(f"even:{kind}", lambda d, lay: _Even(lay, kind), lambda d: d)


def preln_mlp(width: int, seed: int = 0) -> FeatureFamily:
    """Pre-LN MLP block: LayerNorm → Linear(d, k) → GELU → zero Linear(k, d) (with bias).

    Args:
        width: hidden width ``k`` (``1..MAX_WIDTH``).
        seed: the feature weights' seed.

    Returns:
        The family ``"preln:<width>:<seed>"``.

    Raises:
        FamilyError: on a width outside ``1..MAX_WIDTH``.
    """
    _check_width(width)
    return _SimpleFeatureFamily(
        f"preln:{width}:{seed}",
        lambda d, lay: _RandomFeatures(lay, d, width, "gelu", seed, layernorm=True),
        lambda d: width,
    )


def conv1x1(*, bias: bool = True) -> FeatureFamily:
    """A zero ``1×1`` convolution on image sites (the linear family on pixel rows).

    Args:
        bias: include the output bias ``c``.

    Returns:
        The family ``"conv1x1"`` (image sites only), ``k = C``.
    """
    return _Conv1x1Family(
        "conv1x1", lambda d, lay: _Rows(lay), lambda d: d, bias=bias, layouts=(Layout.IMAGE,), copies_input=True
    )


def conv3x3(width: int, seed: int = 0) -> FeatureFamily:
    """Conv3×3(C, k) → ReLU → zero Conv1×1(k, C): unit is the whole image.

    Args:
        width: number of hidden channels ``k`` (``1..MAX_WIDTH``).
        seed: the feature weights' seed.

    Returns:
        The family ``"conv3x3:<width>:<seed>"`` (image sites only).

    Raises:
        FamilyError: on a width outside ``1..MAX_WIDTH``.
    """
    _check_width(width)
    return _Conv3x3Family(
        f"conv3x3:{width}:{seed}",
        lambda d, lay: _Conv3x3Features(d, width, seed),
        lambda d: width,
        unit="tensor",
        layouts=(Layout.IMAGE,),
    )


def causal_attention(width: int, heads: int = 4, seed: int = 0) -> FeatureFamily:
    """Pre-LN causal self-attention with a zero output projection (sequence sites).

    Features are the concatenated head outputs ``(B, T, k)``; the unit is the whole
    sequence.  The feature map honours a padding mask (``masks_padding``): padded keys are
    excluded and padded rows are dropped from the statistics, so a padded batch scores as
    its unpadded sequences; the inserted block reads the ``attention_mask`` of each forward pass of
    the model (:func:`~depthsat_theory.capture.insert_block`), so its real rows are those of the
    unpadded sequences under left or right padding.  Implemented explicitly (``nn.MultiheadAttention`` would bypass
    ``out_proj``'s hooks, theory/definitions.md).

    Args:
        width: feature width ``k`` (``1..MAX_WIDTH``).
        heads: number of attention heads (``≥ 1``).
        seed: the feature weights' seed.

    Returns:
        The family ``"attention:<width>:<seed>"`` (sequence sites only).

    Raises:
        FamilyError: on a width outside ``1..MAX_WIDTH`` or ``heads < 1``.
    """
    _check_width(width)
    if heads < 1:
        raise FamilyError(f"attention heads must be >= 1, got {heads}")
    fam = _SimpleFeatureFamily(
        f"attention:{width}:{seed}",
        lambda d, lay: _CausalAttentionFeatures(d, width, heads, seed),
        lambda d: width,
        unit="tensor",
        layouts=(Layout.SEQUENCE,),
    )
    fam.masks_padding = True
    return fam


def product(rank: int) -> GeneralFamily:
    """Degenerate product family ``h(u) = U V u`` with ``U ∈ R^{d×R}``, ``V ∈ R^{R×d}`` both zero.

    Its tangent map vanishes at the origin (``A ≡ 0``), so ``T = {0}``: the family is
    *degenerate* and must never be reported as saturated (theory label thm-reparameterization).

    Args:
        rank: inner dimension ``R ≥ 1``.

    Returns:
        The :class:`GeneralFamily` ``"product:<rank>"`` with ``p = 2 d R``, ``θ = (vec_row(U), vec_row(V))``.

    Raises:
        FamilyError: if ``rank < 1``.
    """
    if rank < 1:
        raise FamilyError(f"product rank must be >= 1, got {rank}")

    def fn(theta: Tensor, u: Tensor) -> Tensor:
        d = u.shape[-1]
        big_u = theta[: d * rank].reshape(d, rank)
        big_v = theta[d * rank :].reshape(rank, d)
        return u @ big_v.T @ big_u.T

    return GeneralFamily(fn, lambda d: 2 * d * rank, name=f"product:{rank}")
