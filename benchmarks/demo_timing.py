"""Where ``make demo``'s time goes on this machine: ``bloggap doctor`` with its defaults (the default model; on a CPU
its scaled-down run), once, under ``/usr/bin/time -v``, with the doctor's phase timings and the load average before
and after:

    python -m benchmarks.demo_timing --out benchmarks/results/cpu/demo_timing.json

Wall seconds on a shared machine grow with the other processes' load; the CPU seconds of the process (user + system)
and the 1-minute load average at each phase's end are recorded beside them, and ``loaded`` says whether the load
passed ``--loaded-above`` at any point of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bloggap_plugin.envinfo import environment_record
from bloggap_plugin.phase_timer import load_average
from bloggap_plugin.results import ResultDocument

from ._lib.output import write_and_show

TIME_FIELDS = {
    "Elapsed (wall clock) time (h:mm:ss or m:ss)": "wall_s",
    "User time (seconds)": "user_s",
    "System time (seconds)": "system_s",
    "Maximum resident set size (kbytes)": "max_rss_kib",
    "Percent of CPU this job got": "cpu_percent",
}


def parse_time_v(text: str) -> dict:
    """The fields of ``/usr/bin/time -v``'s report in ``text`` named in :data:`TIME_FIELDS` (seconds, KiB, %)."""
    found = {}
    for line in text.splitlines():
        key, _, value = line.strip().rpartition(": ")
        name = TIME_FIELDS.get(key)
        if name == "wall_s":
            parts = [float(p) for p in value.split(":")]
            found[name] = sum(p * 60 ** i for i, p in enumerate(reversed(parts)))
        elif name is not None:
            found[name] = float(value.rstrip("%"))
    missing = sorted(set(TIME_FIELDS.values()) - set(found))
    if missing:
        raise ValueError(f"/usr/bin/time -v reported no {', '.join(missing)}")
    return found


def run_demo(doctor_flags: list[str]) -> tuple[dict, dict, dict]:
    """Run ``bloggap doctor --json TMP`` under ``/usr/bin/time -v``: ``(time -v fields, the doctor's JSON, loads)``."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "doctor.json"
        command = ["/usr/bin/time", "-v", sys.executable, "-m", "bloggap_plugin.cli", "doctor", "--no-progress",
                   "--json", str(path), *doctor_flags]
        before = load_average()
        done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        after = load_average()
        if done.returncode != 0:
            raise SystemExit(f"bloggap doctor failed ({done.returncode}):\n{done.stderr[-4000:]}")
        doctor = json.loads(path.read_text())
    return parse_time_v(done.stderr), doctor, {"before": before, "after": after}


def document(process: dict, doctor: dict, loads: dict, flags: list[str], loaded_above: float) -> ResultDocument:
    """The result: the whole process (``time -v``), the doctor's phases, the loads, and whether the run was loaded."""
    timings = doctor["timings"]
    peak = max([v for v in [loads["before"], loads["after"]] + [p["load_1min"] for p in timings["phases"]]
                if v is not None])
    results = {"process": process, "load_1min_before": loads["before"], "load_1min_after": loads["after"],
               "load_1min_max": peak, "loaded": peak > loaded_above, "within_180_s": process["wall_s"] <= 180,
               "timings": timings, "scaled_down": doctor["params"].get("scaled_down", []),
               "sample_dtype": doctor["params"]["sample_dtype"], "rows": doctor["rows"],
               "max_new_tokens": doctor["max_new_tokens"], "recommendation_arm": doctor["recommendation"]["arm"],
               "cpu_bf16": doctor["params"].get("cpu_bf16")}
    rows = [[p["phase"], round(p["wall_s"], 1), round(p["cpu_s"], 1), p["load_1min"]] for p in timings["phases"]]
    rows.append(["doctor total", round(timings["wall_s"], 1), round(timings["cpu_s"], 1), timings["load_1min_end"]])
    rows.append(["process (time -v: wall, user + system)", round(process["wall_s"], 1),
                 round(process["user_s"] + process["system_s"], 1), loads["after"]])
    state = (f"loaded: the 1-minute load average reached {peak} on {timings['cpus']} CPUs (above {loaded_above}), so "
             "wall seconds include waiting for other processes" if results["loaded"] else
             f"quiet: the 1-minute load average stayed at or below {peak} on {timings['cpus']} CPUs")
    table = {
        "id": "DEMO-TIME",
        "title": "make demo (bloggap doctor, default model, CPU defaults): seconds per phase",
        "columns": ["phase", "wall s", "CPU s", "load (1 min)"],
        "rows": rows,
        "notes": (f"`{' '.join(['bloggap', 'doctor', *flags])}` once under /usr/bin/time -v, "
                  f"{process['wall_s']:.0f} s wall in all ({'within' if results['within_180_s'] else 'over'} the "
                  f"180 s aim); {state}. CPU s: user + system "
                  "seconds of the process (all threads); load: the 1-minute load average at the phase's end. "
                  f"Scaled down: {'; '.join(results['scaled_down']) or 'nothing'}."),
        "reference": None,
        "random_init": False,
        "plot": False,
    }
    env = environment_record("cpu", model=doctor["model"], cpu_model=_cpu_model())
    params = {"command": ["bloggap", "doctor", *flags], "loaded_above": loaded_above, "doctor_params": doctor["params"]}
    return ResultDocument(benchmark="demo_timing", env=env, params=params, results=results, tables=[table])


def _cpu_model() -> str | None:
    try:
        match = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        return None
    return match.group(1).strip() if match else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/demo_timing.json"))
    parser.add_argument("--loaded-above", type=float, default=2.5, help="1-minute load average called loaded")
    parser.add_argument("doctor_flags", nargs="*", help="flags for bloggap doctor after -- (default: none)")
    args = parser.parse_args(argv)
    started = time.time()
    process, doctor, loads = run_demo(args.doctor_flags)
    write_and_show(document(process, doctor, loads, args.doctor_flags, args.loaded_above), args.out, print, started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
