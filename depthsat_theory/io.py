"""Atomic file writes: a crash never leaves a half-written result that looks complete."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import IO


def atomic_write(path: str | os.PathLike, write: Callable[[IO], object], *, binary: bool = False) -> None:
    """Write ``path`` atomically, so readers see the old file or the whole new one.

    ``write(fh)`` fills a temporary file in the same folder, which is then fsynced and moved into
    place with ``os.replace``.

    Args:
        path: the file to (over)write; its folder must exist.
        write: called once with the open temporary file (text, or bytes when ``binary``).
        binary: open the temporary file in binary mode.

    Raises:
        OSError: if the folder does not exist or is not writable (no partial file is left).
        Exception: whatever ``write`` raises (the temporary file is removed, ``path`` is untouched).
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
