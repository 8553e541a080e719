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
