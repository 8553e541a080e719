"""benchmarks.demo_timing: `/usr/bin/time -v`'s report parsed, and the result document built from a doctor JSON's
phases (a constructed one: no model runs here)."""

from __future__ import annotations

import pytest

from benchmarks import demo_timing

TIME_V = """\tCommand being timed: "python -m bloggap_plugin.cli doctor"
\tUser time (seconds): 150.25
\tSystem time (seconds): 2.75
\tPercent of CPU this job got: 98%
\tElapsed (wall clock) time (h:mm:ss or m:ss): 2:35.50
\tMaximum resident set size (kbytes): 1609412
\tExit status: 0
"""


def _doctor(loads: list[float]) -> dict:
    phases = [{"phase": f"p{i}", "wall_s": 10.0, "cpu_s": 9.5, "load_1min": load} for i, load in enumerate(loads)]
    return {"model": "smollm2", "rows": 8, "max_new_tokens": 16, "recommendation": {"arm": "B"},
            "params": {"sample_dtype": "fp32", "scaled_down": ["8 rollouts (GPU 64)"],
                       "cpu_bf16": {"native": False, "from": "x"}},
            "timings": {"wall_s": 10.0 * len(loads), "cpu_s": 9.5 * len(loads), "cpus": 2, "load_1min_start": 0.5,
                        "load_1min_end": loads[-1], "phases": phases}}


def test_time_v_fields_in_seconds_kib_and_percent():
    assert demo_timing.parse_time_v(TIME_V) == {"wall_s": 155.5, "user_s": 150.25, "system_s": 2.75,
                                               "max_rss_kib": 1609412.0, "cpu_percent": 98.0}
    assert demo_timing.parse_time_v(TIME_V.replace("2:35.50", "1:02:35.50"))["wall_s"] == 3755.5
    with pytest.raises(ValueError, match="reported no user_s"):
        demo_timing.parse_time_v(TIME_V.replace("User time", "Usr time"))


@pytest.mark.parametrize("loads, loaded", [([0.4, 1.2, 2.5], False), ([0.4, 3.1, 1.0], True)])
def test_the_document_says_whether_the_run_was_loaded(loads, loaded):
    process = demo_timing.parse_time_v(TIME_V)
    doc = demo_timing.document(process, _doctor(loads), {"before": 0.3, "after": 1.0}, [], 2.5).to_dict()
    results = doc["results"]
    assert results["loaded"] is loaded and results["load_1min_max"] == max(loads)
    assert results["within_180_s"] is True and results["recommendation_arm"] == "B"
    (table,) = doc["tables"]
    assert table["id"] == "DEMO-TIME" and [row[0] for row in table["rows"]] == [
        "p0", "p1", "p2", "doctor total", "process (time -v: wall, user + system)"]
    assert table["rows"][-1][1:3] == [155.5, 153.0] and table["rows"][-2][1:3] == [30.0, 28.5]
    assert ("loaded: the 1-minute load average reached" in table["notes"]) is loaded
    assert "Scaled down: 8 rollouts (GPU 64)." in table["notes"]
    assert table["notes"].startswith("`bloggap doctor` once under /usr/bin/time -v, 156 s wall in all (within the")
