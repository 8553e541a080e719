"""Starting a benchmark module in a child process (a phase with its own process-wide settings), and running several
runs of a script in one start-up of it (a scenario plan)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from benchmarks._lib.paths import ROOT

Result = TypeVar("Result")
SCENARIOS_FLAG = "--scenarios"


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


def write_scenario_plan(plan: Path, scenarios: list[list[str]]) -> list[str]:
    """Write ``scenarios`` (each the arguments of one run of a script, exactly what would follow its name on a command
    line) to ``plan`` as JSON; the arguments that run them all in one start-up: ``["--scenarios", "PLAN"]``."""
    Path(plan).write_text(json.dumps([[str(arg) for arg in scenario] for scenario in scenarios], indent=1))
    return [SCENARIOS_FLAG, str(plan)]


def run_scenarios(argv: list[str], run_one: Callable[[list[str]], Result]) -> list[Result]:
    """``[run_one(argv)]``; for ``argv = ["--scenarios", "PLAN"]`` (:func:`write_scenario_plan`) ``run_one`` on each
    of PLAN's argument lists in turn, each named on stdout first (a launch's output then says which one failed)."""
    if argv[:1] != [SCENARIOS_FLAG]:
        return [run_one(argv)]
    results = []
    for scenario in json.loads(Path(argv[1]).read_text()):
        print(f"scenario: {' '.join(scenario)}", flush=True)
        results.append(run_one(scenario))
    return results
