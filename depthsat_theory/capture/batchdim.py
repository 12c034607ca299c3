"""Which dimension of a site tensor is the batch: batch-first ``(B, …)`` or sequence-first ``(T, B, d)``.

The statistics read every site tensor batch-first, ``(B, *shape)``.  Some modules keep the
sequence first (``nn.TransformerEncoderLayer(batch_first=False)``, ``nn.MultiheadAttention``,
``nn.GRU``/``nn.LSTM`` without ``batch_first``): their site tensor is ``(T, B, d)``.  Read as
batch-first it would count ``T`` examples and split each token across examples (a wrong
``n`` and a score off by ``sqrt(B / T)``).  :class:`BatchDims` decides, once per site, which
dimension holds the ``B`` examples of the per-example losses, and :func:`batch_first` moves it
to the front.  The decision, in order:

1. an explicit declaration ``batch_dim`` (``0`` batch-first, ``1`` sequence-first, or
   ``{site: dim}``);
2. the shapes: the one dimension among the first two whose size is ``B``, the number of
   per-example losses (3-D site tensors; other ranks must be batch-first);
3. when both have size ``B`` (``T = B``), the module's own declaration: a ``batch_first``
   attribute on the site module or, failing that, on its first ``nn.MultiheadAttention``/RNN
   submodule; modules of ``depthsat_theory`` and of Hugging Face ``transformers`` are
   batch-first;
4. still undecided, a measurement on the first batch (:func:`support_batch_dim`): the
   gradient of the first example's own loss ``ℓ_0`` is zero outside that example's slice of
   the site tensor, ``z[0]`` when batch-first, ``z[:, 0]`` when sequence-first.  One extra
   backward pass, only then, only with per-example (or per-token) losses.  When the support
   fits both slices or neither (``ℓ_0`` reaches one token only, or nothing, or other examples
   through batch statistics), or the losses are batch-reduced, the site is ambiguous and a
   declaration is required (:class:`~depthsat_theory.capture.sites.SiteError`): never guessed.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, nn

from depthsat_theory.capture.sites import SiteError, parse_site, resolve_module

__all__ = ["BatchDims", "batch_first", "module_batch_dim", "support_batch_dim"]

_BATCH_FIRST_PACKAGES = ("depthsat_theory.", "transformers.")


def module_batch_dim(module: nn.Module) -> int | None:
    """The batch dimension a module declares for its output: ``0``, ``1`` or ``None`` (no declaration).

    Args:
        module: the site module.

    Returns:
        ``0`` if its (or its first attention/RNN submodule's) ``batch_first`` is true or it
        comes from ``depthsat_theory``/``transformers``, ``1`` if ``batch_first`` is false,
        else ``None``.
    """
    flag = getattr(module, "batch_first", None)
    if isinstance(flag, bool):
        return 0 if flag else 1
    if type(module).__module__.startswith(_BATCH_FIRST_PACKAGES):
        return 0
    for sub in module.modules():
        if isinstance(sub, (nn.MultiheadAttention, nn.RNNBase)):
            return 0 if sub.batch_first else 1
    return None


def _ambiguous(site: str, shape: tuple[int, ...], batch: int, why: str) -> SiteError:
    return SiteError(
        f"site {site!r} has tensors of shape {shape} with {batch} examples: both (B, T, d) and (T, B, d) fit "
        f"({why}); declare the batch dimension with batch_dim=0 (batch-first) or batch_dim=1 (sequence-first), "
        f"or batch_dim={{{site!r}: …}}"
    )


def _shape_batch_dim(site: str, shape: tuple[int, ...], batch: int, module: nn.Module | None) -> int | None:
    """The batch dimension read from the shape, then the module; ``None`` when both fit (``T = B``)."""
    first = len(shape) > 0 and shape[0] == batch
    second = len(shape) == 3 and shape[1] == batch
    if first and second:
        return None if module is None else module_batch_dim(module)
    if first:
        return 0
    if second:
        return 1
    raise SiteError(
        f"site {site!r} has tensors of shape {shape}, with no batch dimension of size {batch} (the number of "
        f"examples) first or, for (T, B, d), second; choose a site whose output holds the batch, or pass "
        f"batch_dim=0|1"
    )


def support_batch_dim(g0: Tensor) -> int | None:
    """The batch dimension of a 3-D site from ``g0 = ∂ℓ_0/∂z``, the gradient of the first example's loss.

    Args:
        g0: ``(N0, N1, d)``, the site's shape.

    Returns:
        ``0`` if ``g0`` vanishes outside ``g0[0]`` but not outside ``g0[:, 0]``, ``1`` the other way
        round, ``None`` when both or neither hold.
    """
    nz = g0.detach() != 0
    in_first = not bool(nz[1:].any())
    in_second = not bool(nz[:, 1:].any())
    if in_first == in_second:
        return None
    return 0 if in_first else 1


class BatchDims:
    """The batch dimension of each site, decided on its first batch and kept for the probe.

    Args:
        model: the probed model (its site modules may declare their batch dimension).
        batch_dim: ``None`` (decide per site), ``0``/``1`` for every site, or ``{site: dim}``
            (keys: site names, or module names for every occurrence of the module).

    Raises:
        ValueError: a ``batch_dim`` other than ``0``/``1`` (or ``None``).
    """

    def __init__(self, model: nn.Module, batch_dim: int | Mapping[str, int] | None = None):
        values = batch_dim.values() if isinstance(batch_dim, Mapping) else [batch_dim]
        if any(v not in (None, 0, 1) for v in values):
            raise ValueError(
                f"batch_dim must be 0 (batch-first), 1 (sequence-first), None or {{site: 0|1}}, got {batch_dim!r}"
            )
        self.model = model
        self.batch_dim = batch_dim
        self.dims: dict[str, int] = {}

    def _declared(self, key: str) -> int | None:
        if isinstance(self.batch_dim, Mapping):
            base = key.partition("#")[0]
            return self.batch_dim.get(key, self.batch_dim.get(base))
        return self.batch_dim

    def undecided(self, key: str, shape: tuple[int, ...], batch: int) -> bool:
        """Decide site ``key`` from its declaration, shape and module if not yet done; ``True`` if that cannot.

        Args:
            key: the site key.
            shape: the site tensor's shape.
            batch: the number of examples ``B``.

        Returns:
            ``True`` if the batch dimension is still open (it must be measured), ``False`` once recorded.

        Raises:
            SiteError: no dimension among the first two has size ``batch``.
        """
        if key not in self.dims:
            dim = self._declared(key)
            if dim is None:
                dim = _shape_batch_dim(key, shape, batch, resolve_module(self.model, parse_site(key)[0]))
            if dim is None:
                return True
            self.dims[key] = dim
        return False

    def measure(self, key: str, g0: Tensor | None, batch: int) -> None:
        """Decide an undecided site from ``g0 = ∂ℓ_0/∂z`` (:func:`support_batch_dim`; ``None``: no per-example loss).

        Args:
            key: the site key.
            g0: the gradient of the first example's loss w.r.t. the site tensor, or ``None``.
            batch: the number of examples ``B``.

        Raises:
            SiteError: the measurement cannot decide (a declaration is needed).
        """
        shape = tuple(g0.shape) if g0 is not None else ()
        dim = None if g0 is None else support_batch_dim(g0)
        if dim is None:
            why = (
                "the losses are batch-reduced, so the examples cannot be told apart"
                if g0 is None
                else "the first example's loss gradient does not single out one of them"
            )
            raise _ambiguous(key, shape, batch, why)
        self.dims[key] = dim

    def dim(self, key: str, shape: tuple[int, ...], batch: int) -> int:
        """The batch dimension of site ``key`` whose tensor has ``shape`` on a batch of ``batch`` examples.

        Args:
            key: the site key.
            shape: the site tensor's shape.
            batch: the number of examples ``B`` (per-example losses).

        Returns:
            The batch dimension, ``0`` (batch-first) or ``1`` (sequence-first).

        Raises:
            SiteError: the declared dimension does not have size ``batch``, no dimension has
                size ``batch``, or an ambiguous site (``T = B``) was neither declared nor measured.
        """
        if self.undecided(key, shape, batch):
            raise _ambiguous(key, shape, batch, "no declaration")
        dim = self.dims[key]
        if len(shape) <= dim or shape[dim] != batch:
            raise SiteError(
                f"site {key!r} has tensors of shape {shape}; its batch dimension {dim} "
                f"({'sequence' if dim else 'batch'}-first) should have size {batch} (the number of per-example "
                f"losses): pass batch_dim=0 or 1 to declare where the batch is"
            )
        return dim


def batch_first(t: Tensor, dim: int) -> Tensor:
    """``t`` with its batch dimension ``dim`` moved to the front (``(T, B, d) → (B, T, d)`` for ``dim = 1``).

    Args:
        t: a site tensor.
        dim: its batch dimension (``0`` or ``1``).

    Returns:
        ``t`` itself for ``dim = 0``, else a contiguous transposed copy.
    """
    return t if dim == 0 else t.transpose(0, dim).contiguous()
