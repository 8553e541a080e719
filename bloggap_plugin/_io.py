"""Atomic file writes: a result file is either the old good one or the complete new one, never truncated."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write_bytes", "atomic_write_text", "check_writable_dir", "check_writable_file", "confined_path",
           "foreign_file_problem", "write_output_text", "json_of", "OWN_FILE_MAX_BYTES"]

OWN_FILE_MAX_BYTES = 64 << 20
"""Largest existing file an output flag reads to tell whether the command wrote it (larger: not its own)."""


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


def json_of(text: str):
    """``text`` parsed as JSON, or None when it is not JSON (for the ``owned`` tests of :func:`write_output_text`)."""
    import json

    try:
        return json.loads(text)
    except ValueError:
        return None


def foreign_file_problem(path: str | os.PathLike, what: str, owned: Callable[[str], bool]) -> str | None:
    """A one-line refusal when ``path`` holds a file this command did not write, else None. ``owned(text)`` says
    whether an existing file's text is the command's own output (then it may be replaced); a missing or empty
    file is free; a file that is not UTF-8 text, or larger than :data:`OWN_FILE_MAX_BYTES`, is not its own."""
    path = Path(path)
    try:
        if not path.is_file() or path.stat().st_size == 0:
            return None
        text = path.read_bytes().decode("utf-8") if path.stat().st_size <= OWN_FILE_MAX_BYTES else None
    except (OSError, UnicodeDecodeError):
        text = None
    if text is not None and owned(text):
        return None
    return (f"{what} {os.fsencode(path).decode('utf-8', 'replace')}: that file exists and is not output of this "
            "command, so it is not replaced; give a new path, or move the file away first")


def write_output_text(path: str | os.PathLike, text: str, what: str, owned: Callable[[str], bool],
                      error: type[Exception] | None = None) -> Path:
    """The one writer of an output flag's file (``--json``, ``--output``): refuses (``error``, default
    ``UsageError``) to replace a file :func:`foreign_file_problem` finds is not the command's own, writes through
    :func:`atomic_write_text`, and turns a failed write (full disk, permissions) into one line saying the previous
    file is unchanged."""
    from bloggap_plugin.core.errors import UsageError

    error = error or UsageError
    problem = foreign_file_problem(path, what, owned)
    if problem:
        raise error(problem)
    try:
        return atomic_write_text(path, text)
    except OSError as err:
        raise error(f"{what} {os.fsencode(path).decode('utf-8', 'replace')}: cannot write "
                    f"({err.strerror or err}); the previous file is unchanged: free space or choose another "
                    "path") from None


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
