"""Output files: atomic writes of regular files, direct writes to stdout (``-``) and special files.

A crash never leaves a half-written result that looks complete: a regular path is written to a temporary
file in its folder and renamed into place.  ``-`` means stdout, and an existing special file (``/dev/stdout``,
``/dev/null``, a FIFO, a terminal) is opened and written directly: renaming over it would replace the device
or the symlink to it by a regular file.  A symlink to a regular file stays a symlink (its target is replaced).
:func:`check_output` refuses, before any work, an output that could not be written at the end.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile
from collections.abc import Callable
from typing import IO

__all__ = ["STDOUT", "atomic_write", "check_output", "is_special", "is_stdout", "unwritable_reason"]

#: The path that means "write to stdout".
STDOUT = "-"


def is_stdout(path: str | os.PathLike) -> bool:
    """Whether ``path`` is ``-`` (stdout).

    Args:
        path: an output path.

    Returns:
        ``True`` for ``-``.
    """
    return os.fspath(path) == STDOUT


def is_special(path: str | os.PathLike) -> bool:
    """Whether ``path`` exists and is not a regular file or a folder after following symlinks.

    Character devices (``/dev/stdout`` of a terminal, ``/dev/null``), FIFOs and sockets (``/dev/stdout`` of
    a pipe) are special: they are written directly, never replaced.

    Args:
        path: an output path.

    Returns:
        ``True`` for an existing special file.
    """
    try:
        mode = os.stat(path).st_mode  # follows symlinks, /proc/self/fd/N included
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def _is_standard_stream(path: str | os.PathLike) -> bool:
    """Whether ``path`` is the file open as this process's stdout or stderr (``/dev/stdout`` redirected to a file).

    Renaming a new file over it would leave the stream writing to the unlinked old one.
    """
    try:
        st = os.stat(path)
    except OSError:
        return False
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            if os.path.samestat(st, os.fstat(fd)):
                return True
    return False


def atomic_write(path: str | os.PathLike, write: Callable[[IO], object], *, binary: bool = False) -> None:
    """Write ``path`` atomically, so readers see the old file or the whole new one.

    ``write(fh)`` fills a temporary file in the same folder, which is then fsynced and moved into
    place with ``os.replace`` (at a symlink's target, so the symlink stays).  ``-`` writes to stdout, and an
    existing special file (:func:`is_special`) or the file this process's stdout or stderr writes to
    (``/dev/stdout`` redirected to a file) is written directly, in place.

    Args:
        path: the file to (over)write; its folder must exist.  ``-``: stdout.
        write: called once with the open temporary file (text, or bytes when ``binary``).
        binary: open the temporary file in binary mode.

    Raises:
        OSError: if the folder does not exist or is not writable (no partial file is left).
        Exception: whatever ``write`` raises (the temporary file is removed, ``path`` is untouched).
    """
    if is_stdout(path):
        sys.stdout.flush()  # what was printed before goes first
        out: IO = sys.stdout.buffer if binary else sys.stdout
        write(out)
        out.flush()
        return
    if is_special(path) or _is_standard_stream(path):
        with open(path, "wb" if binary else "w") as fh:
            write(fh)
        return
    path = os.path.realpath(path)  # a symlink to a regular file: replace the target, keep the link
    folder = os.path.dirname(path)
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


def unwritable_reason(folder: str | os.PathLike) -> str | None:
    """Why no file can be created in ``folder``, or ``None`` when one can.

    Tried by creating and removing an empty temporary file, not inferred from the mode bits (root ignores
    them; a read-only mount or an ACL does not).

    Args:
        folder: an existing folder.

    Returns:
        ``None``, or the operating system's reason (e.g. ``"Permission denied"``).
    """
    try:
        fd, tmp = tempfile.mkstemp(prefix=".depthsat-probe-", dir=folder)
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    os.close(fd)
    os.unlink(tmp)
    return None


def check_output(flag: str, path: str | os.PathLike, *, stdout: bool = True, folder: bool = False) -> None:
    """Refuse, before any work, an output that could not be written at the end.

    Args:
        flag: the option's name for the message, e.g. ``"--json"``.
        path: the output: a file path (``folder=False``) or a folder that is new or empty (``folder=True``).
        stdout: whether ``-`` (stdout) is accepted.
        folder: ``path`` names a folder to be created next to its siblings (``grow --out``, ``--root``).

    Raises:
        ValueError: one line naming ``flag``: ``-`` where stdout is not accepted, a folder given for a file,
            a missing parent folder, or a parent folder where no file can be created.
    """
    text = os.fspath(path)
    if is_stdout(text):
        if stdout and not folder:
            return
        raise ValueError(f"{flag} -: this output cannot go to stdout; give a {'folder' if folder else 'file'} path")
    if is_special(text):
        if folder or not stdout:
            raise ValueError(f"{flag} {text} is a special file; give a regular {'folder' if folder else 'file'} path")
        if not os.access(text, os.W_OK):
            raise ValueError(f"{flag} {text} is not writable")
        return
    if not folder and os.path.isdir(text):
        raise ValueError(f"{flag} {text} is a folder; give a file path")
    parent = os.path.dirname(os.path.realpath(text))
    if not os.path.isdir(parent):
        why = "is not a folder" if os.path.exists(parent) else "does not exist"
        raise ValueError(f"{flag} {text}: the folder {parent} {why}")
    reason = unwritable_reason(parent)
    if reason is not None:
        raise ValueError(f"{flag} {text}: the folder {parent} is not writable ({reason})")
