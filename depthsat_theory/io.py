"""Atomic file writes: a crash never leaves a half-written result that looks complete."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import IO


def atomic_write(path: str | os.PathLike, write: Callable[[IO], object], *, binary: bool = False) -> None:
    """Write ``path`` through ``write(fh)`` on a temporary file in the same folder, then
    fsync and ``os.replace`` it into place.

    Raises:
        OSError: if the folder does not exist or is not writable (no partial file is left).
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".depthsat-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb" if binary else "w") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
