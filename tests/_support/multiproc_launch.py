"""Launching ``tests/_support/helpers_trl_multiproc.py`` as one process or under ``accelerate launch`` (gloo, CPU), for the
multi-process TRL tests (test_trl_multiproc, test_trl_fsdp): the environment, a free port, the run itself with a
time limit, and the per-rank JSON records it writes (``OUT`` for rank 0, ``OUT.rankN`` for the others). Several
runs share one launch (:func:`run_helper_plan`); a one-process run can train in the test's own process
(:func:`run_helper_here`)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _support import ROOT, SUPPORT
from _support.events import HANG_S

HELPER = SUPPORT / "helpers_trl_multiproc.py"


def require_gloo() -> None:
    """Skip the calling test where torch.distributed has no gloo backend."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for accelerate's ``--main_process_port``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def accelerate_launch(processes: int, *options: str) -> list[str]:
    """``python -m accelerate.commands.launch --num_processes N OPTIONS --main_process_port PORT``."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes), *options,
            "--main_process_port", str(free_port())]


def run_helper(prefix: list[str], out: Path, *helper_args: str) -> None:
    """Run the helper as ``PREFIX HELPER OUT ARGS`` (``PREFIX``: ``[sys.executable]`` or :func:`accelerate_launch`)
    offline with one thread per process; fails the test on a non-zero exit, and names a hang (a collective taken by
    one process only leaves the other waiting) when the time limit passes."""
    _run([*prefix, str(HELPER), str(out), *helper_args])


def run_helper_plan(prefix: list[str], plan: Path, scenarios: list[list[str]]) -> None:
    """Run the helper once for several scenarios: ``PREFIX HELPER --scenarios PLAN`` with ``PLAN`` (written here)
    holding ``scenarios``, each the ``OUT ARGS`` of one :func:`run_helper` call; one start-up of the processes
    instead of one per scenario, each scenario writing its own records. Fails and names a hang as run_helper."""
    from benchmarks._lib.launch import write_scenario_plan

    _run([*prefix, str(HELPER), *write_scenario_plan(plan, scenarios)])


def run_helper_here(out: Path, *helper_args: str) -> None:
    """The helper's ``OUT ARGS`` run in this (the test's) process: one process as ``run_helper([sys.executable],
    OUT, ARGS)``, without starting Python, torch and the trainer stack again. It trains: the caller requests
    ``trains``."""
    from _support import helpers_trl_multiproc

    helpers_trl_multiproc.main([str(out), *map(str, helper_args)])


def _run(cmd: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", CI="true", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{' '.join(cmd)} hung for {HANG_S} s (a forward or reduction taken by one process only?)\n"
                    f"{(err.stderr or b'')[-3000:]!r}")
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def read_records(out: Path, processes: int = 2) -> dict[int, dict]:
    """``{rank: record}`` of the JSON files a helper run wrote."""
    records = {0: json.loads(Path(out).read_text())}
    for rank in range(1, processes):
        records[rank] = json.loads(Path(f"{out}.rank{rank}").read_text())
    return records
