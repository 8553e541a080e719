"""`bloggap doctor --from-json` on a run whose fp16 cells were all non-finite (Gemma 3 270M, CPU, issue 50): the
stored |dlogp| statistics are null (JSON has no NaN), and re-reading the file prints them rather than crashing."""

from __future__ import annotations

import json

from _support import ROOT

GEMMA_DOCTOR = ROOT / "benchmarks" / "results" / "cpu" / "doctor_gemma3-270m.json"


def test_a_stored_run_with_non_finite_fp16_cells_reads_back(bloggap):
    fp16 = [c for c in json.loads(GEMMA_DOCTOR.read_text())["cells"]
            if c["dtype"] == "fp16" and c["comparison"] == "b1_vs_b8_left_arange"]
    assert fp16 and fp16[0]["abs_dlogp_mean"] is None and fp16[0]["oob"] == 1.0
    code, out, err = bloggap("doctor", "--from-json", GEMMA_DOCTOR)
    assert code == 0 and "Traceback" not in err, err[-2000:]
    assert "fp16/sdpa: b1_vs_b8_left_arange not finite / not finite" in out
    assert "fp16 check failed" in out and "recommendation: arm B" in out
