"""The plugin's share of training time in committed H200 results, over the whole run and from step 2 on.

The first optimizer step of a run carries one-time costs (CUDA and cuBLAS set-up of the scoring plans, the first
probe's warm-up); over a short benchmark run they weigh far more than over a real one, so this prints both:

    python -m benchmarks.overhead_share benchmarks/results/h200/trl_overhead_budget.json \
        benchmarks/results/h200/trl_overhead_vllm_alone/runs.tar.xz benchmarks/results/h200/trl_overhead_vllm_budget/runs.tar.xz

Inputs: a ``trl_arms.py`` result JSON (each row's ``history``) or a sweep's packed run logs (``runs/*.jsonl`` in a
``.tar.xz``). The share is :func:`bloggap_plugin.compare.plugin_time_share` (summed ``gap/time/scoring_s`` over
summed ``step_time``), the same one T10-cost and trl_arms' ``plugin time %`` report.
"""

from __future__ import annotations

import argparse
import json
import tarfile
from pathlib import Path

from bloggap_plugin.compare import plugin_time_share, timed_steps


def run_histories(path: Path) -> dict[str, list[dict]]:
    """Run label -> its logged records (in step order) from a trl_arms JSON or a ``.tar.xz`` of ``*.jsonl`` logs."""
    if path.name.endswith(".tar.xz"):
        runs = {}
        with tarfile.open(path, "r:xz") as tar:
            for member in sorted(tar.getmembers(), key=lambda m: m.name):
                if member.isfile() and member.name.endswith(".jsonl"):
                    text = tar.extractfile(member).read().decode()
                    runs[Path(member.name).stem] = [json.loads(line) for line in text.splitlines() if line.strip()]
        return runs
    results = json.loads(path.read_text())["results"]
    return {label: row["history"] for label, row in results.items() if isinstance(row, dict) and "history" in row}


def shares(records: list[dict]) -> dict:
    """``{"all": share, "from_step_2": share, "steps": n}`` over the records that carry both timings."""
    timed = timed_steps(records)
    return {"all": plugin_time_share(timed), "from_step_2": plugin_time_share(timed[1:]), "steps": len(timed)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", type=Path, nargs="+")
    args = parser.parse_args(argv)
    print("file | run | steps | plugin time % | from step 2 %")
    for path in args.paths:
        for label, records in run_histories(path).items():
            s = shares(records)
            pct = lambda v: "-" if v is None else f"{100 * v:.2f}"  # noqa: E731
            print(f"{path.name if path.suffix == '.json' else path.parent.name} | {label} | {s['steps']} | "
                  f"{pct(s['all'])} | {pct(s['from_step_2'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
