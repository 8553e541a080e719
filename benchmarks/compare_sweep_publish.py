"""Publish a finished ``bloggap compare`` sweep from the GPU machine as a committed result (issue 15 item 5).

    python -m benchmarks.compare_sweep_publish SWEEP_DIR --out benchmarks/results/h200 \\
        --model-name SmolLM2-135M-Instruct --call-logs CALL1.log CALL2.log ...

``SWEEP_DIR`` is the sweep's output folder as it came back (``compare_sweep.tgz`` from
``benchmarks/compare_sweep.sh``, unpacked): ``compare.json`` plus ``runs/``. Writes, under ``--out``:

- ``<name>.json``: the sweep's own ``compare.json`` (benchmark schema, its tables T10, T10-heldout, T10-gap,
  T10-resolution as the sweep computed them), renamed to benchmark ``<name>``, with the model's path on the GPU
  machine replaced by ``--model-name`` everywhere, plot specs for the report, and a ``start`` table: the reward of
  the first generation of every run (the untrained policy, sampled as in training);
- ``<name>_reward_curves.png``: the reward curves re-plotted from that JSON;
- ``<name>/runs.tar.xz``: ``runs/`` with each run's JSONL log, held-out result and console output (progress bars
  and the log lines the JSONL already holds removed), machine paths replaced; packed because every device call
  carries the tracked tree within its 64 MiB (7.5 MB unpacked, 0.8 MB packed for 30 runs of 200 steps);
- ``logs/<name>.log``: the sweep's console output of each device call, in order (``--call-logs``).

Nothing is recomputed from the logs here: the numbers are the sweep's (``bloggap compare --table-only`` rebuilds
them from ``runs/`` if needed).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tarfile
from pathlib import Path

from benchmarks._lib.paths import RESULTS
from benchmarks._lib.publish import MACHINE_PATHS, console_lines, strip_paths  # noqa: F401 - re-exported
from bloggap_plugin.compare.sweep import FAILED_CONSOLE


def starting_reward_table(results: dict) -> dict:
    """Table ``start``: per arm, the mean reward of every run's first generation (the untrained policy, sampled at
    the training temperature; all arms start from the same weights)."""
    rows, firsts = [], []
    for arm in results["arms"]:
        values = [run["rewards"][0] for run in results["runs"].values() if run["arm"] == arm and run.get("rewards")]
        firsts += values
        rows.append([arm, len(values), round(statistics.fmean(values), 4) if values else None])
    rows.append(["all", len(firsts), round(statistics.fmean(firsts), 4) if firsts else None])
    return {
        "id": "start",
        "title": "Reward of the first generation (the untrained policy, sampled as in training)",
        "columns": ["arm", "runs", "reward at the first generation"],
        "rows": rows,
        "notes": "Each run's first logged reward: 32 completions (4 prompts x 8) of the untrained policy, sampled at "
                 "temperature 1 by the run's vLLM engine. Runs of one seed whose engines compute alike sample alike, "
                 "so arms can share their first completions; 'all' is the mean over runs. The issue asks for a start "
                 "between 20 and 50 percent.",
        "reference": None,
        "random_init": False,
        "plot": False,
    }


ANALYSIS_PARAMS = ("baseline", "primary", "secondary", "alpha", "planned_seeds")
"""The declared analysis' settings: the fields a tables-only rebuild takes from the sweep config."""


def publish(sweep_dir: Path, out: Path, name: str, model_name: str, call_logs: list[Path],
            keep_runs: bool = False) -> Path:
    """Write the committed files (see the module docstring); returns the JSON's path. ``keep_runs``: the JSON and
    the plot only (tables rebuilt from the committed runs with ``bloggap compare --table-only``; the packed runs
    and console logs stay as committed)."""
    from bloggap_plugin.compare.outputs import plot_reward_curves
    from bloggap_plugin.results import ResultDocument

    document = json.loads((sweep_dir / "compare.json").read_text())
    model_path = document["params"]["model"]
    document = json.loads(strip_paths(json.dumps(document), model_path, model_name))
    document["benchmark"] = name
    document["params"]["model_path_on_gpu_machine"] = "<model>: dense fp32 folder written by mk_smollm2.py"
    tables = []
    for table in document["tables"]:
        table = dict(table)
        if table["id"] == "T10":
            table["plot"] = {"kind": "bar", "x": "arm", "y": [table["columns"][2], "reward mean"]}
        elif table["id"] == "T10-heldout":
            table["plot"] = {"kind": "bar", "x": "arm", "y": ["held-out accuracy"]}
        else:
            table["plot"] = False
        tables.append(table)
    document["tables"] = [starting_reward_table(document["results"]), *tables]
    committed = out / f"{name}.json"
    if keep_runs and committed.is_file():  # the runs ran on the GPU machine: its env and run settings stay
        before, rebuilt = json.loads(committed.read_text()), document["env"]
        document["env"] = {**before["env"],
                           "tables_rebuilt": {k: rebuilt.get(k) for k in ("date", "python", "torch", "device_type")}}
        document["params"] = {**before["params"], **{k: document["params"].get(k) for k in ANALYSIS_PARAMS}}
    out.mkdir(parents=True, exist_ok=True)
    path = ResultDocument.from_dict(document, sweep_dir / "compare.json").write(out / f"{name}.json")
    title = f"{document['params']['task']}, {model_name}: reward by arm (mean over seeds, band = seed range)"
    plot_reward_curves(document["results"], out / f"{name}_reward_curves.png", smooth=document["params"].get("smooth", 5),
                       title=title)

    if keep_runs:
        return path
    runs_out = out / name / "runs"
    if runs_out.exists():
        shutil.rmtree(runs_out)
    runs_out.mkdir(parents=True)
    _copy_runs(sweep_dir / "runs", runs_out, model_path, model_name)
    with tarfile.open(out / name / "runs.tar.xz", "w:xz") as archive:
        archive.add(runs_out, arcname="runs")
    shutil.rmtree(runs_out)
    if call_logs:
        logs = out / "logs"
        logs.mkdir(exist_ok=True)
        parts = [f"==> device call {i}: {log.name} <==\n" + strip_paths(log.read_text(errors="replace"), model_path,
                                                                       model_name) for i, log in enumerate(call_logs, 1)]
        (logs / f"{name}.log").write_text("\n".join(parts))
    return path


_FAILED_CONSOLE = re.compile(FAILED_CONSOLE + "$")


def _copy_runs(source_dir: Path, runs_out: Path, model_path: str, model_name: str) -> None:
    """Each run's JSONL log, held-out result and trimmed console output (and a failed attempt's, ``.out.failed``:
    ``bloggap compare --retries``), machine paths replaced."""
    for source in sorted(source_dir.iterdir()):
        if source.suffix == ".jsonl" or source.name.endswith(".heldout.json"):
            runs_out.joinpath(source.name).write_text(strip_paths(source.read_text(), model_path, model_name))
        elif source.suffix == ".out" or _FAILED_CONSOLE.search(source.name):
            text = console_lines(source.read_text(errors="replace"))
            runs_out.joinpath(source.name).write_text(strip_paths(text, model_path, model_name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep_dir", type=Path, help="the sweep's output folder (compare.json + runs/)")
    parser.add_argument("--out", type=Path, default=RESULTS / "h200")
    parser.add_argument("--name", default="compare_sweep", help="benchmark name: <out>/<name>.json (default compare_sweep)")
    parser.add_argument("--model-name", required=True, help="what the committed files call the model")
    parser.add_argument("--call-logs", type=Path, nargs="*", default=[], help="the sweep's console output per device call")
    parser.add_argument("--keep-runs", action="store_true",
                        help="rewrite the JSON and plot only (after --table-only over the committed runs)")
    args = parser.parse_args(argv)
    if not (args.sweep_dir / "compare.json").is_file() or not (args.sweep_dir / "runs").is_dir():
        parser.error(f"{args.sweep_dir}: no compare.json and runs/ there; unpack compare_sweep.tgz and pass its "
                     "compare_sweep folder")
    path = publish(args.sweep_dir, args.out, args.name, args.model_name, args.call_logs, keep_runs=args.keep_runs)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
