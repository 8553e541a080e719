"""What the tests share, kept out of the test folders: the repository's root, stand-in engines (``fake_vllm``),
launch helpers for multi-process runs (``multiproc_launch`` and the scripts it starts), waits on a subprocess by
event with one hang guard (``events``), and the fixtures and test tiers (``fixtures``, loaded by
``tests/conftest.py``). Importable as ``_support`` (pyproject's ``pythonpath`` names
``tests``)."""

from __future__ import annotations

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
"""This folder: the helper scripts that tests start in a subprocess live here."""
ROOT = SUPPORT.parents[1]
"""The repository root (``bloggap_plugin/``, ``recipes/``, ``benchmarks/``)."""


def python3_shim(bindir: Path) -> Path:
    """``bindir/python3``: a script that runs this test interpreter (for a shell script that calls ``python3``, with
    ``bindir`` put first on its PATH). Creates ``bindir``; returns it."""
    import sys

    bindir.mkdir()
    (bindir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bindir / "python3").chmod(0o755)
    return bindir


def tracked_tree_bytes() -> int:
    """Bytes of the repository's tracked files: what every device call carries besides its chunk."""
    import subprocess

    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    return sum((ROOT / name).stat().st_size for name in names.decode().split("\0") if name and (ROOT / name).is_file())
