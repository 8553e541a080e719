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


def stored_doctor_json() -> dict:
    """A ``bloggap doctor --json`` document as ``--from-json`` reads it (a few cells)."""
    def cell(dtype, comparison, oob, **extra):
        return {"dtype": dtype, "attn": "sdpa", "comparison": comparison, "oob": oob, "oob_count": round(oob * 1000),
                "n": 1000, "abs_dlogp_mean": 0.0, "abs_dlogp_max": 0.0, "bitwise_equal": oob == 0, **extra}

    cells = [cell(d, "b1_vs_b8_left_arange", oob) for d, oob in (("bf16", 0.08), ("fp16", 0.0))]
    cells += [cell(d, "b1_vs_b8_left_mask", 0.0, seconds=1.0, tokens_forwarded=1000) for d in ("bf16", "fp16")]
    return {
        "benchmark": "doctor", "schema_version": 1, "model": "m", "device": "h200", "rows": 8, "max_new_tokens": 4, "tokens": 1000,
        "band": 0.1, "params": {"dtypes": ["bf16", "fp16"], "attn": ["sdpa"], "sample_dtype": "bf16", "seed": 1},
        "cells": cells, "paired_cells": [], "fp16_check": {"nonfinite_logprobs": 0, "max_abs_hidden": 1.0,
                                                           "rows": 8, "attn": "sdpa", "n": 1000, "ok": True},
        "recommendation": {"arm": "F", "text": "old text"},
        "tables": [{"id": "DOCTOR", "notes": "cells... Recommendation: old text"}],
    }
