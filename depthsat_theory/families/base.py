r"""Residual families: parameterized blocks ``h_θ`` with ``h_0 ≡ 0``.

A *residual family* at an *insertion site* is a map ``(θ, z) ↦ h_θ(z)`` with
``θ ∈ R^p`` and the function-preservation property ``h_0(z) = 0`` for every site
tensor ``z`` (theory/definitions.md, def-setting; theory label ``def-family``).  Inserting it turns the site
``z ↦ z + h_θ(z)``.  Its *tangent map* at the origin is ``A(z) = ∂_θ h_θ(z)|_{θ=0}``
and its *tangent space* is ``T = {z ↦ A(z) v : v ∈ R^p}``.

Site tensors come in three layouts (per example, the batch dimension ``B`` first):

============ ================ ====================================================
layout       site tensor      rows (positions) used by row-wise families
============ ================ ====================================================
``vector``   ``(B, d)``       one row of ``d`` per example
``sequence`` ``(B, T, d)``    ``T`` rows (tokens) of ``d``
``image``    ``(B, C, H, W)`` ``H·W`` rows (pixels) of ``C``
============ ================ ====================================================

Most practical blocks are *zero-output feature families* (theory/definitions.md)

.. math::

    h_{W,c,ψ}(z)_r = W\,φ_ψ(z)_r + c, \qquad W = 0,\ c = 0 \text{ at the origin},

whose zero factor is the block's final linear map.  Their tangent space is
``{V φ̃}`` with ``φ̃ = (φ, 1)`` when the block has an output bias, and the feature
parameters ``ψ`` have exactly zero gradient at the origin.  Each family states its
*unit*: ``"row"`` when ``φ(z)_r`` depends on row ``r`` of ``z`` only (token-/pixel-wise
blocks), ``"tensor"`` when it depends on the whole example (attention, 3×3 conv).

Families are dimension-agnostic descriptions; concrete weights (for example the
seeded random features) are built for a site from its per-example shape.  The built-in
families live in :mod:`depthsat_theory.families.builtin`, their spec strings in
:mod:`depthsat_theory.families.specs`.
"""

from __future__ import annotations

import abc
import copy
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from depthsat_theory.vocabulary import Layout

__all__ = [
    "FamilyError",
    "FeatureFamily",
    "GeneralFamily",
    "ResidualFamily",
    "follows_site",
    "from_rows",
    "place_block",
    "to_rows",
]

#: Dimensions of a batch of site tensors (batch first) by layout.
_NDIM: dict[str, int] = {Layout.VECTOR: 2, Layout.SEQUENCE: 3, Layout.IMAGE: 4}


class FamilyError(ValueError):
    """A residual family was misspecified or does not fit a site."""


# ----------------------------------------------------------------------------- layouts
def to_rows(t: Tensor, layout: str) -> Tensor:
    """Reshape a batch of site tensors into rows (positions).

    Args:
        t: site tensor, ``(B, d)``, ``(B, T, d)`` or ``(B, C, H, W)`` by ``layout``.
        layout: a :class:`~depthsat_theory.vocabulary.Layout` (or its string value).

    Returns:
        ``(B, R, d)`` with ``R = 1``, ``T`` or ``H·W`` (a view where possible).

    Raises:
        FamilyError: if ``t`` has the wrong number of dimensions for ``layout``.
    """
    _check_layout_tensor(t, layout)
    if layout == Layout.VECTOR:
        return t.unsqueeze(1)
    if layout == Layout.SEQUENCE:
        return t
    return t.flatten(2).transpose(1, 2)


def from_rows(rows: Tensor, layout: str, shape: Sequence[int]) -> Tensor:
    """Inverse of :func:`to_rows`: ``(B, R, d)`` rows back to site tensors of ``shape``.

    Args:
        rows: ``(B, R, d)`` rows.
        layout: a :class:`~depthsat_theory.vocabulary.Layout` (or its string value).
        shape: the batched site tensor's shape (``z.shape``; only used for image sites, ``(B, C, H, W)``).

    Returns:
        ``(B, d)``, ``(B, T, d)`` or ``(B, C, H, W)`` by ``layout`` (a view where possible).
    """
    if layout == Layout.VECTOR:
        return rows.squeeze(1)
    if layout == Layout.SEQUENCE:
        return rows
    b = rows.shape[0]
    return rows.transpose(1, 2).reshape(b, *shape[1:])


def _check_layout_tensor(t: Tensor, layout: str) -> None:
    ndim = _NDIM.get(layout)
    if ndim is None:
        raise FamilyError(f"unknown layout {layout!r}; expected one of {tuple(lay.value for lay in Layout)}")
    if t.dim() != ndim:
        raise FamilyError(
            f"a {str(layout)!r} site tensor must have {ndim} dimensions (batch first), got shape {tuple(t.shape)}"
        )


# ----------------------------------------------------------------------------- placement
def _follow_site(module: nn.Module, args: tuple) -> None:
    """Forward pre-hook: move a block to its site tensor's dtype/device (the aspects not pinned)."""
    z = args[0] if args else None
    if not isinstance(z, Tensor) or not z.is_floating_point():
        return
    ref = next(iter(module.parameters()), None)
    if ref is None:
        return
    dtype = z.dtype if getattr(module, "_depthsat_follow_dtype", False) else ref.dtype
    device = z.device if getattr(module, "_depthsat_follow_device", False) else ref.device
    if ref.dtype != dtype or ref.device != device:
        module.to(dtype=dtype, device=device)


def place_block(block: nn.Module, dtype=None, device=None) -> nn.Module:
    """Put a freshly built block in ``dtype`` on ``device``; ``None`` means *the site's*.

    A block built with ``dtype=None`` (or ``device=None``) starts in float64 (on the CPU) and
    moves itself to the dtype (device) of the site tensor it receives, on the first forward
    where they differ (:func:`depthsat_theory.capture.insert_block` also moves it to the
    site module's parameters at insertion).  Its parameters stay the same ``nn.Parameter``
    objects (``Module.to`` converts them in place), so an optimizer built on them stays valid.

    Args:
        block: the block.
        dtype: a floating dtype to pin, or ``None`` to follow the site.
        device: a device to pin, or ``None`` to follow the site.

    Returns:
        ``block``, converted, with the following aspects recorded (:func:`follows_site`).
    """
    block.to(dtype=dtype or torch.float64, device=device)
    block._depthsat_follow_dtype = dtype is None  # type: ignore[assignment]
    block._depthsat_follow_device = device is None  # type: ignore[assignment]
    if dtype is None or device is None:
        block.register_forward_pre_hook(_follow_site)
    return block


def follows_site(block: nn.Module) -> tuple[bool, bool]:
    """Whether a block follows its site's ``(dtype, device)`` (built with ``None`` for them).

    Args:
        block: a block (from :func:`place_block`).

    Returns:
        ``(follows_dtype, follows_device)``.
    """
    return bool(getattr(block, "_depthsat_follow_dtype", False)), bool(getattr(block, "_depthsat_follow_device", False))


# ----------------------------------------------------------------------------- base
class ResidualFamily(abc.ABC):
    """A residual family ``h_θ`` with ``h_0 ≡ 0`` (theory label ``def-family``).

    Attributes:
        spec: canonical spec string (e.g. ``"relu:128:0"``), usable with
            :func:`parse_family`.
        unit: ``"row"`` or ``"tensor"`` (see the module docstring).
        layouts: site layouts this family fits.
        masks_padding: whether the feature map takes a padding mask (``fmap(z, mask=m)``,
            ``m`` bool ``(B, T)``, ``True`` at real tokens) and ignores padded positions, so
            that padded rows can be dropped from the statistics of a sequence-level family.
    """

    spec: str = ""
    unit: str = "row"
    layouts: tuple[str, ...] = tuple(Layout)
    masks_padding: bool = False

    def check_site(self, shape: Sequence[int], layout: str) -> None:
        """Raise :class:`FamilyError` if the family does not fit a site.

        Args:
            shape: per-example site shape (without the batch dimension).
            layout: the site's layout.

        Raises:
            FamilyError: an unknown layout, a layout the family does not fit, or a shape with the wrong
                number of dimensions for the layout.
        """
        if layout not in tuple(Layout):
            raise FamilyError(f"unknown site layout {str(layout)!r}: use one of {', '.join(Layout)}")
        if layout not in self.layouts:
            raise FamilyError(
                f"family {self.spec!r} does not fit a {str(layout)!r} site "
                f"(it fits {', '.join(self.layouts)} sites); choose another family"
            )
        want = _NDIM[layout] - 1
        if len(shape) != want:
            raise FamilyError(f"a {str(layout)!r} site has per-example shape of {want} dims, got {tuple(shape)}")

    @abc.abstractmethod
    def param_dim(self, shape: Sequence[int]) -> int:
        """Dimension ``p`` of the tangent coordinates ``θ`` at a site of this shape.

        Args:
            shape: per-example site shape (without the batch dimension).

        Returns:
            ``p``.
        """

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

        Args:
            shape: per-example site shape (without the batch dimension).
            layout: the site's layout.
            dtype: the block's dtype; ``None`` (default): the dtype of the site tensor it
                receives (:func:`place_block`), so it runs inside a float32 model.
            device: the block's device; ``None`` (default): the site tensor's.

        Returns:
            The block module, mapping ``(B, *shape)`` site tensors to ``(B, *shape)``.

        Raises:
            FamilyError: if the family does not fit the site.
        """

    def tangent_parameters(self, block: nn.Module) -> list[nn.Parameter]:
        """The block's parameters that form ``θ`` (in the order of :meth:`functional`).

        Args:
            block: a block built by :meth:`block`.

        Returns:
            The parameters forming ``θ``; here all of ``block.parameters()``.
        """
        return list(block.parameters())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"


# ----------------------------------------------------------------------------- features
class _FeatureBlock(nn.Module):
    """``z ↦ from_rows(out(features(z)))`` with a zero final linear map ``out``.

    A block whose feature map takes a padding mask (``masks_padding``) reads it from
    :attr:`padding_mask` (``(B, T)`` bool, ``True`` at real tokens; ``None``: no padding), which
    :func:`~depthsat_theory.capture.insert_block` keeps equal to the ``attention_mask`` of the
    current forward pass of the model it is inserted in.
    """

    def __init__(self, features: nn.Module, k: int, d: int, bias: bool, layout: str, masks_padding: bool = False):
        super().__init__()
        self.layout = layout
        self.out = nn.Linear(k, d, bias=bias)
        nn.init.zeros_(self.out.weight)
        if bias:
            nn.init.zeros_(self.out.bias)
        self.features = features
        self.masks_padding = masks_padding
        self.padding_mask: Tensor | None = None

    def forward(self, z: Tensor) -> Tensor:
        mask = self.padding_mask if self.masks_padding else None
        if mask is not None and tuple(mask.shape) != tuple(z.shape[:2]):
            raise FamilyError(
                f"the attention_mask {tuple(mask.shape)} does not fit the site tensor {tuple(z.shape)}: the "
                f"inserted attention block needs the whole sequence in each forward pass (no KV-cached steps)"
            )
        rows = self.out(self.features(z) if mask is None else self.features(z, mask=mask))
        return from_rows(rows, self.layout, z.shape)


class FeatureFamily(ResidualFamily):
    """Zero-output feature family ``h(z)_r = W φ_ψ(z)_r + c`` (theory/definitions.md).

    Subclasses implement :meth:`feature_map`, an ``nn.Module`` mapping site tensors
    ``(B, *shape)`` to feature rows ``(B, R, k)``.  The tangent coordinates are
    ``θ = (vec_row(W), c)`` with ``W ∈ R^{d×k}`` (``c`` only when ``bias``), so
    ``p = d (k + bias)``; feature weights ``ψ`` are not tangent coordinates (their
    tangent columns are exactly zero).

    Statistics for these families use the cross-gradient
    ``G = E[Σ_r g_r φ̃_rᵀ]`` and ``Σ = E[Σ_r φ̃_r φ̃_rᵀ]`` and never build the
    ``(units·d) × p`` Jacobian (see :mod:`depthsat_theory.statistics`).

    Attributes:
        copies_input: whether ``φ`` only copies entries of the site tensor (no arithmetic: ``linear``,
            ``conv1x1``), so that features computed in the site's own dtype are exact; the float32 products
            of :class:`~depthsat_theory.statistics.FeatureStatistics` then skip the float64 features.
            ``False`` (the safe default) for every other family.
    """

    bias: bool = True
    copies_input: bool = False

    def __init__(self, spec: str, *, bias: bool = True, unit: str = "row", layouts: tuple[str, ...] = tuple(Layout)):
        self.spec = spec
        self.bias = bias
        self.unit = unit
        self.layouts = layouts
        self._cache: dict = {}

    # -- to implement
    @abc.abstractmethod
    def feature_dim(self, shape: Sequence[int], layout: str) -> int:
        """Number ``k`` of features per row, without the constant.

        Args:
            shape: per-example site shape (without the batch dimension).
            layout: the site's layout.

        Returns:
            ``k``.
        """

    @abc.abstractmethod
    def _make_feature_map(self, shape: Sequence[int], layout: str) -> nn.Module:
        """A float64 CPU module mapping ``(B, *shape)`` to rows ``(B, R, k)``."""

    # -- derived
    def feature_map(self, shape: Sequence[int], layout: str, *, dtype=None, device=None) -> nn.Module:
        """The feature module ``φ_ψ`` at a site (deterministic in the family's seed).

        Args:
            shape: per-example site shape (without the batch dimension).
            layout: the site's layout.
            dtype: the module's dtype (default float64).
            device: the module's device (default CPU).

        Returns:
            A module mapping ``(B, *shape)`` site tensors to ``(B, R, k)`` rows, in
            ``dtype`` (default float64) on ``device``, with ``requires_grad`` on.

        Raises:
            FamilyError: if the family does not fit the site (:meth:`check_site`).
        """
        key = (tuple(shape), layout)
        if key not in self._cache:  # the float64 CPU master copy
            self.check_site(shape, layout)
            self._cache[key] = self._make_feature_map(shape, layout)
        mod = copy.deepcopy(self._cache[key])
        if (dtype or torch.float64) == torch.float64 and (device is None or torch.device(device).type == "cpu"):
            return mod  # already there (and Module.to would fail inside a torch.func transform)
        return mod.to(dtype=dtype or torch.float64, device=device)

    def site_dim(self, shape: Sequence[int], layout: str) -> int:
        """Row dimension ``d`` (``C`` for image sites).

        Args:
            shape: per-example site shape (without the batch dimension).
            layout: the site's layout.

        Returns:
            ``d``: ``shape[0]`` for image sites, else ``shape[-1]``.
        """
        return int(shape[0] if layout == Layout.IMAGE else shape[-1])

    def augmented_dim(self, shape: Sequence[int], layout: str) -> int:
        """``k̃ = k + bias``: the length of ``φ̃``.

        Args:
            shape: per-example site shape (without the batch dimension).
            layout: the site's layout.

        Returns:
            ``k̃ = k + bias``.
        """
        return self.feature_dim(shape, layout) + int(self.bias)

    def param_dim(self, shape: Sequence[int]) -> int:
        """``p = d (k + bias)``: the number of entries of ``θ = (vec_row(W), c)`` at a site of this shape.

        Args:
            shape: per-example site shape (without the batch dimension).

        Returns:
            ``p = d (k + bias)``.
        """
        layout = _layout_of(shape)
        return self.site_dim(shape, layout) * self.augmented_dim(shape, layout)

    def augmented_features(self, fmap: nn.Module, z: Tensor, mask: Tensor | None = None) -> Tensor:
        """``φ̃(z)`` rows: ``(B, R, k̃)``, the constant column last when ``bias``.

        Args:
            fmap: the feature map (:meth:`feature_map`).
            z: site tensors ``(B, *shape)``.
            mask: optional padding mask ``(B, T)`` bool (``True`` at real tokens), passed to
                ``fmap`` for families with ``masks_padding``; ignored by the others (their
                padded rows are dropped by the statistics).

        Returns:
            ``φ̃`` rows ``(B, R, k̃)`` in ``fmap``'s dtype, with a column of ones last when ``bias``.
        """
        phi = fmap(z, mask=mask) if mask is not None and self.masks_padding else fmap(z)
        if self.bias:
            phi = torch.cat([phi, phi.new_ones((*phi.shape[:-1], 1))], dim=-1)
        return phi

    def frozen_feature_map(self, shape: Sequence[int], layout: str, *, dtype=None, device=None) -> nn.Module:
        """A cached copy of :meth:`feature_map` with gradients off (statistics, ``functional``).

        Args:
            shape: per-example site shape (without the batch dimension).
            layout: the site's layout.
            dtype: the module's dtype (default float64).
            device: the module's device (default CPU).

        Returns:
            The feature module (``(B, *shape)`` → ``(B, R, k)``), shared between calls with the same
            arguments: do not modify it.

        Raises:
            FamilyError: if the family does not fit the site (:meth:`check_site`).
        """
        key = ("frozen", tuple(shape), layout, dtype or torch.float64, str(device))
        if key not in self._cache:
            fmap = self.feature_map(shape, layout, dtype=dtype, device=device)
            for prm in fmap.parameters():
                prm.requires_grad_(False)
            self._cache[key] = fmap
        return self._cache[key]

    def split_theta(self, theta: Tensor, d: int, k: int) -> tuple[Tensor, Tensor | None]:
        """``θ = (vec_row(W), c)`` ↦ ``(W (d, k), c (d,) or None)``.

        Args:
            theta: the flat tangent coordinates ``(d (k + bias),)``.
            d: row dimension.
            k: number of features (without the constant).

        Returns:
            ``(W, c)``: views of ``theta``, ``W`` of shape ``(d, k)`` and ``c`` of shape ``(d,)``
            (``None`` without ``bias``).
        """
        w = theta[: d * k].reshape(d, k)
        return w, (theta[d * k :] if self.bias else None)

    def functional(self, theta: Tensor, z: Tensor, layout: str) -> Tensor:
        """Evaluate ``h_θ(z)_r = W φ(z)_r + c`` as a pure function of ``θ`` (for ``torch.func``).

        The feature map is the frozen one (:meth:`frozen_feature_map`, in ``z``'s dtype and device).

        Args:
            theta: ``(p,)`` tangent coordinates ``(vec_row(W), c)``, same dtype as ``z``.
            z: site tensors ``(B, *shape)``.
            layout: the site's layout.

        Returns:
            ``(B, *shape)``: the block's output (zero when ``theta`` is zero).

        Raises:
            FamilyError: if ``theta`` does not have ``p = d (k + bias)`` entries.
        """
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
        """Build the insertable block at the origin: the feature map followed by a zero linear map ``out``.

        The parameters of ``out`` (``W`` of shape ``(d, k)``, then ``c`` of shape ``(d,)`` when
        ``bias``) are the tangent coordinates; the feature weights ``ψ`` follow.  The block is in
        ``dtype`` on ``device``; ``None`` for either follows the site tensor (:func:`place_block`).

        Args:
            shape: per-example site shape (without the batch dimension).
            layout: the site's layout.
            dtype: the block's dtype; ``None``: the site tensor's.
            device: the block's device; ``None``: the site tensor's.

        Returns:
            The block module, mapping ``(B, *shape)`` site tensors to ``(B, *shape)``; zero at insertion.

        Raises:
            FamilyError: if the family does not fit the site (:meth:`check_site`).
        """
        self.check_site(shape, layout)
        fmap = self.feature_map(shape, layout, dtype=dtype, device=device)
        k = self.feature_dim(shape, layout)
        d = self.site_dim(shape, layout)
        return place_block(_FeatureBlock(fmap, k, d, self.bias, layout, self.masks_padding), dtype, device)

    def tangent_parameters(self, block: nn.Module) -> list[nn.Parameter]:
        """The weight ``W`` and (when ``bias``) the bias ``c`` of the block's final linear map ``out``.

        Args:
            block: a block built by :meth:`block`.

        Returns:
            ``[W]`` or ``[W, c]``: the parameters of the submodule ``out``.
        """
        out = block.get_submodule("out")
        return [out.get_parameter("weight")] + ([out.get_parameter("bias")] if self.bias else [])


def _layout_of(shape: Sequence[int]) -> Layout:
    return {1: Layout.VECTOR, 2: Layout.SEQUENCE, 3: Layout.IMAGE}[len(shape)]


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

    Function preservation is *not* assumed: :func:`depthsat_theory.capture.check_function_preserving`
    measures ``max |h(0, z)|`` on a probe and raises if it is not zero.
    """

    def __init__(
        self,
        fn: Callable[[Tensor, Tensor], Tensor],
        param_dim: int | Callable[[int], int],
        *,
        name: str = "general",
        unit: str = "row",
        layouts: tuple[str, ...] = tuple(Layout),
    ):
        if unit not in ("row", "tensor"):
            raise FamilyError(f"unit must be 'row' or 'tensor', got {unit!r}")
        self.fn = fn
        self._p = param_dim
        self.spec = name
        self.unit = unit
        self.layouts = layouts

    def param_dim(self, shape: Sequence[int]) -> int:
        """Dimension ``p`` of ``θ`` at a site of this shape (``param_dim`` of the row dimension ``d``).

        Args:
            shape: per-example site shape (without the batch dimension).

        Returns:
            ``p`` (the fixed count, or ``param_dim(d)`` when it was given as a function).

        Raises:
            FamilyError: if ``p < 1``.
        """
        layout = _layout_of(shape)
        d = int(shape[0] if layout == Layout.IMAGE else shape[-1])
        p = self._p(d) if callable(self._p) else self._p
        if int(p) < 1:
            raise FamilyError(f"family {self.spec!r} has param_dim {p}; need >= 1")
        return int(p)

    def functional(self, theta: Tensor, z: Tensor, layout: str) -> Tensor:
        """Evaluate ``h(θ, u)`` on the site tensors ``z`` as a pure function (for ``torch.func``).

        For ``unit="row"`` the function is applied to the ``(N, d)`` rows of ``z`` and the result
        reshaped back; for ``unit="tensor"`` it is applied to ``z`` itself.

        Args:
            theta: ``(p,)`` tangent coordinates, same dtype as ``z``.
            z: site tensors ``(B, *shape)``.
            layout: the site's layout.

        Returns:
            ``(B, *shape)``: the block's output.

        Raises:
            FamilyError: if a row-wise function does not return rows of the input's shape.
        """
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
        """Build the insertable block: one parameter ``θ`` of shape ``(p,)``, zero.

        In ``dtype`` on ``device``; ``None`` for either follows the site tensor (:func:`place_block`).

        Args:
            shape: per-example site shape (without the batch dimension).
            layout: the site's layout.
            dtype: the block's dtype; ``None``: the site tensor's.
            device: the block's device; ``None``: the site tensor's.

        Returns:
            The block module, mapping ``(B, *shape)`` site tensors to ``(B, *shape)``; zero at insertion.

        Raises:
            FamilyError: if the family does not fit the site (:meth:`check_site`) or ``p < 1``.
        """
        self.check_site(shape, layout)
        return place_block(_GeneralBlock(self, self.param_dim(shape), layout), dtype, device)
