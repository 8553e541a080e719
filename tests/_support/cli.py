"""What the CLI tests share: the recipes folder, and the check that a refusal is one line naming the problem."""

from __future__ import annotations

from _support import ROOT

RECIPES = ROOT / "recipes"
"""The repository's recipes (``arm_X.yaml``)."""


def assert_one_line_error(result, *needles: str) -> str:
    code, out, err = result
    assert code == 2, (code, out, err)
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("bloggap: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]
