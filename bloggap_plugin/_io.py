"""Atomic file writes: a result file is either the old good one or the complete new one, never truncated."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["atomic_write_bytes", "atomic_write_text", "check_writable_dir", "check_writable_file", "confined_path"]


def try_lock(path: str | os.PathLike, wait_s: float = 0.0):
    """An open handle holding an exclusive ``flock`` on ``path`` (created if missing), or ``None`` when another
    process still holds it after ``wait_s`` seconds. The lock lasts until the handle is closed or the process (and
    any child that inherited the handle) ends."""
    import fcntl
    import time

    handle = open(path, "w")  # noqa: SIM115 - returned to the caller, who holds it
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except OSError:
            if time.monotonic() >= deadline:
                handle.close()
                return None
            time.sleep(0.1)


def confined_path(root: str | os.PathLike, relative: str) -> Path | None:
    """``root/relative`` resolved (symbolic links followed), or None when it lands outside ``root``: an absolute
    path, ``..`` parts or a link out of the folder. Every writer given a name read from a file (a patch's ``+++``
    line) goes through this, so it writes only under the folder the user named."""
    base = Path(root).resolve()
    if os.path.isabs(relative):
        return None
    full = (base / relative).resolve()
    return full if base in full.parents else None


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same folder, then ``os.replace`` it into place.

    On any failure (full disk, permission) the previous file at ``path`` is left unchanged and the temporary file
    is removed; the error propagates.
    """
    return _atomic_write(path, text, "w")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """:func:`atomic_write_text` for bytes (written exactly, no encoding or newline translation)."""
    return _atomic_write(path, data, "wb")


def _atomic_write(path: str | os.PathLike, content: str | bytes, mode: str) -> Path:
    path = Path(path)
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(handle, mode) as out:
            out.write(content)
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


def _can_create_in(folder: Path) -> bool:
    """True if a file can be created in ``folder``: tried for real (``os.access`` says yes to root even on a
    read-only mount)."""
    try:
        handle, tmp = tempfile.mkstemp(prefix=".bloggap-probe-", dir=folder)
    except OSError:
        return False
    os.close(handle)
    os.unlink(tmp)
    return True


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable_dir(path: str | os.PathLike, what: str) -> str | None:
    """Return a one-line problem if ``path`` cannot be used as an output folder (it is a file, or it cannot be
    created or written), else ``None``. A missing folder is fine when its nearest existing parent is writable."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        return f"{what} {path} is a file, not a folder; give a folder path"
    base = path if path.is_dir() else _existing_ancestor(path)
    if not base.is_dir():
        return f"{what} {path}: {base} is a file, so the folder cannot be created; choose another path"
    if not _can_create_in(base):
        return f"{what} {path}: folder {base} is not writable; choose another path"
    return None


def check_writable_file(path: str | os.PathLike, what: str, create_parents: bool = False) -> str | None:
    """Return a one-line problem if ``path`` cannot be written as a file (a directory, a missing or read-only
    folder), else ``None``. ``what`` names the option in the message (e.g. ``"--json"``). With
    ``create_parents`` a missing folder is fine when it can be created."""
    path = Path(path)
    if path.is_dir():
        return f"{what} {path} is a directory; give a file path"
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.exists() and create_parents:
        problem = check_writable_dir(parent, what)
        return problem.replace(f"{what} {parent}", f"{what} {path}", 1) if problem else None
    if parent.exists() and not parent.is_dir():
        return f"{what} {path}: {parent} is a file, not a folder; choose another path"
    if not parent.is_dir():
        return f"{what} {path}: folder {parent} does not exist; create it or choose another path"
    if not _can_create_in(parent):
        return f"{what} {path}: folder {parent} is not writable; choose another path"
    if path.exists():
        try:
            with open(path, "a"):
                pass
        except OSError:
            return f"{what} {path} is not writable; choose another path"
    return None
