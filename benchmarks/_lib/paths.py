"""Where the repository's inputs and outputs are, independent of the working directory."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root
RESULTS = ROOT / "benchmarks" / "results"  # result documents, one folder per device tag
RECIPES = ROOT / "recipes"


def arm_recipe(arm: str) -> Path:
    """The recipe file of arm letter ``arm`` (``recipes/arm_<arm>.yaml``)."""
    return RECIPES / f"arm_{arm}.yaml"
