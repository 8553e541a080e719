"""Waiting on a subprocess by event, never by speed: a test waits for what it needs (a line in a file, a process
ending); the one time limit, :data:`HANG_S`, only stops a hang, so a slow or loaded machine never decides a verdict."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

HANG_S = 900
"""Seconds after which a wait counts as a hang (any test's subprocess or event): far beyond a loaded machine's pace."""


def restore_sigint() -> None:
    """``preexec_fn`` for a child that is sent Ctrl-C: SIGINT's default action, as in a terminal. A test session
    started in the background (a CI job, ``cmd &``) inherits SIGINT ignored, and so would the child."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for(condition: Callable[[], bool], proc: subprocess.Popen | None = None, what: str = "the event",
             poll_s: float = 0.1) -> None:
    """Poll ``condition()`` until it holds. Fails at once if ``proc`` ends first (naming its exit code), and after
    :data:`HANG_S` (a hang: the process is killed)."""
    deadline = time.monotonic() + HANG_S
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process ended (exit {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            if proc is not None:
                proc.kill()
            raise AssertionError(f"hung: no {what} after {HANG_S} s")
        time.sleep(poll_s)


def complete_lines(path: Path) -> list[str]:
    """The complete lines of ``path`` (a line still being written is left out); none while it does not exist."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return text.splitlines()[: text.count("\n")]
