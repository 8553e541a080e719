"""The doctor's advice where fp16 overflows (issue 50): no sentence of it may point to fp16 (arm H).

Read from the committed CPU doctor run on Gemma 3 270M, whose fp16 check failed (every fp16 log-prob non-finite)
while the bf16 sampler stayed out of band against every scorer precision."""

from __future__ import annotations

import copy
import json

from _support import ROOT

from bloggap_plugin.core.recommend import recommend

GEMMA_DOCTOR = ROOT / "benchmarks" / "results" / "cpu" / "doctor_gemma3-270m.json"


def _advice(result: dict) -> dict:
    return recommend(result["cells"], result["fp16_check"], "cpu", result.get("paired_cells", []))


def test_a_failed_fp16_check_keeps_arm_h_out_of_every_sentence():
    result = json.loads(GEMMA_DOCTOR.read_text())
    assert result["fp16_check"]["ok"] is False and result["fp16_check"]["nonfinite_logprobs"] > 0
    advice = _advice(result)
    assert advice["arm"] == "B"
    assert "arm H" not in advice["text"] and "fp16 everywhere" not in advice["text"]
    assert "No scorer precision removes it" in advice["text"]  # the sampler finding itself is still told
    assert "but not to fp16: the fp16 check failed" in advice["text"]


def test_with_a_safe_fp16_check_the_sampler_finding_still_points_to_arm_h():
    result = copy.deepcopy(json.loads(GEMMA_DOCTOR.read_text()))
    result["fp16_check"].update(ok=True, nonfinite_logprobs=0, max_abs_hidden=100.0)
    assert "the sampler must change too (arm H, fp16 everywhere)" in _advice(result)["text"]
