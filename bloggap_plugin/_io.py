"""Atomic file writes: a result file is either the old good one or the complete new one, never truncated."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["atomic_write_text", "atomic_write_bytes", "check_writable_file"]


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file in the same folder, then ``os.replace`` it into
    place.

    On any failure (full disk, permission) the previous file at ``path`` is left unchanged and the temporary file
    is removed; the error propagates.
    """
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """:func:`atomic_write_text` for bytes (e.g. a PNG rendered into memory)."""
    path = Path(path)
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o777)
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def check_writable_file(path: str | os.PathLike, what: str) -> str | None:
    """Return a one-line problem if ``path`` cannot be written as a file (a directory, a missing or read-only
    folder), else ``None``. ``what`` names the option in the message (e.g. ``"--json"``)."""
    path = Path(path)
    if path.is_dir():
        return f"{what} {path} is a directory; give a file path"
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        return f"{what} {path}: folder {parent} does not exist; create it or choose another path"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{what} {path}: folder {parent} is not writable; choose another path"
    if path.exists() and not os.access(path, os.W_OK):
        return f"{what} {path} is not writable; choose another path"
    return None
