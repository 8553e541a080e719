"""Starting a benchmark module in a child process (a phase with its own process-wide settings)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from benchmarks._lib.paths import ROOT


def module_command(module: str, *args: str) -> list[str]:
    """``python -m module args...`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def repo_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with the repository root first on ``PYTHONPATH``, so a child
    started in any folder imports ``benchmarks`` and ``bloggap_plugin`` from this checkout."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def run_logged(argv: list[str], log_path: Path, env: Mapping[str, str], deadline: float) -> int | str:
    """Run ``argv`` with its output into ``log_path`` until the wall-clock ``deadline`` (``time.time()``); its exit
    code, or ``"timeout"`` when it was killed at the deadline."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=dict(env))
        try:
            return proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            return "timeout"
