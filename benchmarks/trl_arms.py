"""GRPO arms A-H in TRL 1.16 with SmolLM2 on the arithmetic task: the live gap/* metrics per arm (issue 4 item 8).

Per arm: ``num_iterations 2`` (old log-probs drive the PPO ratio), STEPS optimizer steps; reports
gap/ratio/oob_frac, gap/sampler/oob_frac, clip flips, clipped share, s/step and plugin overhead.

    python -m benchmarks.trl_arms --out benchmarks/results/h200            # GPU, ~3-5 min
    python -m benchmarks.trl_arms --quick --out /tmp/trl_arms               # CPU, tiny model, < 60 s
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path

from benchmarks._lib.paths import ROOT, arm_recipe

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("CI", "true")

NAME = "trl_arms"
ARMS = ("A", "B", "C", "D", "E", "F", "G", "H")
COLUMNS = [
    "arm", "ratio OOB %", "gap: ratio OOB % (first iterations)", "update: ratio OOB % (later iterations)",
    "sampler OOB %", "clip flips %", "clipped %", "probe b1 vs bN OOB %", "exact ratio %",
    "s/step", "plugin s/step", "plugin time %", "mean per-step overhead %", "G old pass s/step", "reward first",
    "reward last",
]


def _pct(value):
    return None if value is None else round(100.0 * value, 2)


def _num(value, digits=3):
    return None if value is None or (isinstance(value, float) and not math.isfinite(value)) else round(value, digits)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/h200", help="output folder (writes trl_arms.json)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per arm")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma list of arms")
    parser.add_argument("--batch", type=int, default=8, help="per-device micro-batch rows (= num_generations)")
    parser.add_argument("--completion", type=int, default=32, help="max_completion_length")
    parser.add_argument("--probe-every", type=int, nargs="+", default=[None],
                        help="gap.probe_every values to run per arm (default: the recipe's); several values give "
                             "one row per arm and value, measured in the same run")
    parser.add_argument("--probe-budget", type=float, nargs="+", default=[None],
                        help="gap.probe_budget values (default: the recipe's); rows for every probe_every x budget")
    parser.add_argument("--name", default=NAME, help="result name: writes <out>/<name>.json")
    parser.add_argument("--quick", action="store_true", help="tiny random model, 2 steps, CPU-sized (< 60 s)")
    parser.add_argument("--rebuild", default=None, metavar="FILE",
                        help="rewrite FILE's tables from its own results (no runs)")
    return parser


def gap_and_update(history: list[dict]) -> tuple[float | None, float | None]:
    """The mean out-of-band share of the ratio new/old over the passes with no optimizer step since the old
    log-probs (the gap) and over the others (the update), from a run's logged steps. Logs that split them carry
    ``gap/update/*``; in older logs, where ``gap/ratio/*`` holds both, a generation's first iteration is a step that
    logged the sampler's metrics (``gap/sampler/oob_frac``)."""
    split = any("gap/update/oob_frac" in record for record in history)
    gap, update = [], []
    for record in history:
        ratio = record.get("gap/ratio/oob_frac")
        if split:
            gap += [ratio] if ratio is not None else []
            update += [record["gap/update/oob_frac"]] if record.get("gap/update/oob_frac") is not None else []
        elif ratio is not None:
            (gap if record.get("gap/sampler/oob_frac") is not None else update).append(ratio)
    mean = lambda values: sum(values) / len(values) if values else None  # noqa: E731
    return mean(gap), mean(update)


def table_row(label: str, summary: dict) -> list:
    """One arm's row of ``COLUMNS`` from its training summary (means over logged steps)."""
    m = lambda key, s=summary: s.get(f"mean/{key}")  # noqa: E731
    gap, update = gap_and_update(summary.get("history") or [])
    return [
        label, _pct(m("gap/ratio/oob_frac")), _pct(gap), _pct(update), _pct(m("gap/sampler/oob_frac")), _pct(m("gap/clip/flip_frac")),
        _pct(m("gap/clip/clipped_frac")), _pct(m("gap/probe/oob_b1_vs_bN")), _pct(m("gap/ratio/exact_frac")),
        _num(m("step_time")), _num(m("gap/time/scoring_s")), _pct(summary.get("plugin_share")),
        _pct(m("gap/time/overhead_frac")),
        _num(m("gap/time/old_pass_s"), 4), _num(summary.get("reward_first")), _num(summary.get("reward_last")),
    ]


def arm_recipe_for(arm: str, quick: bool, tmp: str) -> Path:
    """The arm's recipe; with ``quick`` arm D gets a temporary copy naming one layer (the tiny model has 2)."""
    recipe = arm_recipe(arm)
    if arm == "D" and quick:
        recipe = Path(tmp) / "arm_D.yaml"  # tiny model: 2 layers, so pick one layer explicitly
        recipe.write_text(arm_recipe("D").read_text().replace("  k: 8\n", "  layers: [1]\n"))
    return recipe


def train_arm(arm: str, settings: dict, run: dict, tmp: str) -> dict:
    """Train one arm with the gap ``settings`` for ``run["steps"]`` steps and return its summary with the
    per-step records (``history``) and wall seconds; raises what training raises."""
    from bloggap_plugin.trl.run import run_training

    slug = arm + "".join(f"_{key.split('_')[1]}{value}" for key, value in settings.items())  # A_every8
    recipe = arm_recipe_for(arm, run["quick"], tmp)
    print(f"[{NAME}] arm {arm}: {run['steps']} steps of GRPO on {run['model']} ({run['device']})", flush=True)
    start = time.perf_counter()
    summary = run_training(recipe, model=run["model"], task="arith", max_steps=run["steps"],
                           output_dir=f"{tmp}/{slug}", seed=0, log_jsonl=f"{tmp}/{slug}.jsonl",
                           extra_overrides=run["overrides"], gap_overrides=settings or None, device=run["device"])
    history = [json.loads(line) for line in Path(summary["log_jsonl"]).read_text().splitlines()]
    summary["log_jsonl"] = f"{slug}.jsonl"  # its folder is temporary: the records are in "history"
    # no machine path in a result: the recipe relative to the repo (--quick's arm D: its temporary copy)
    summary["recipe"] = (recipe.relative_to(ROOT).as_posix() if recipe.is_relative_to(ROOT)
                         else f"{recipe.name} (recipes/arm_D.yaml with layers: [1])")
    summary["history"] = history
    summary["bench_wall_s"] = time.perf_counter() - start
    return summary


def t12_table(name: str, run: dict, rows: list[list]) -> dict:
    """T12 (``T12-<name>`` for another result name): the live gap metrics per arm."""
    return {
        "id": "T12" if name == NAME else f"T12-{name}",
        "title": (f"GRPO arms in TRL 1.16 ({run['model']}, arithmetic, {run['steps']} steps, num_iterations 2, "
                  f"batch {run['batch']})"),
        "columns": COLUMNS,
        "rows": rows,
        "notes": (
            "Means over logged steps. ratio OOB: arm's old log-probs vs the training forward outside [0.9, 1.1], "
            "over every logged step; split into the gap (first iterations: no optimizer step since the old "
            "log-probs) and the update (later iterations: PPO's own movement after an optimizer step); "
            "sampler OOB: old log-probs vs HF generate's own (recorded) log-probs; clip flips: PPO clip status "
            "under the arm vs an fp32 batch-1 reference on probe rows; plugin time: the sum of the plugin's time "
            "over the sum of step times (what the plugin costs the run); mean per-step overhead: the mean of the "
            "logged gap/time/overhead_frac, which weighs a rare long probe step like a short one and reads lower "
            "(both include the fp32 reference and probe scorings; arm G's matched old-logprob pass replaces TRL's own "
            "and is not counted: it is 'G old pass s/step', averaged over steps, 0 on steps reusing a generation)."
        ),
        "reference": None,
        "random_init": run["model"].startswith("tiny-random"),
    }


SPLIT_COLUMNS = COLUMNS[2:4]
"""The gap and update columns (:func:`gap_and_update`), added after ``ratio OOB %``."""


def rebuild(path: str | Path) -> None:
    """Add :data:`SPLIT_COLUMNS` to the T12 table of the result document at ``path``, computed from each arm's
    logged steps in its ``results``, every other cell as the document has it (documents written before the split)."""
    import json

    from bloggap_plugin.results import ResultDocument

    data = json.loads(Path(path).read_text())
    for table in data["tables"]:
        if SPLIT_COLUMNS[0] in table["columns"]:
            continue
        at = table["columns"].index("ratio OOB %") + 1
        table["columns"][at:at] = SPLIT_COLUMNS
        for row in table["rows"]:
            gap, update = gap_and_update(data["results"].get(row[0], {}).get("history") or [])
            row[at:at] = [_pct(gap), _pct(update)]
        table["notes"] += (" gap / update: the ratio's out-of-band share over the first iterations (no optimizer "
                           "step since the old log-probs) and over the later iterations (after one), from the logged "
                           "steps (added after the runs).")
    ResultDocument.from_dict(data, path).write(path)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.rebuild:
        rebuild(args.rebuild)
        return 0

    import torch

    torch.set_num_threads(1) if args.quick else None
    from bloggap_plugin.envinfo import environment_record
    from bloggap_plugin.results import ResultDocument, format_text_table

    batch = 4 if args.quick else args.batch
    run = {"device": args.device or ("cuda" if torch.cuda.is_available() else "cpu"),
           "model": "tiny-random-llama" if args.quick else args.model, "steps": 2 if args.quick else args.steps,
           "batch": batch, "quick": args.quick,
           "overrides": dict(per_device_train_batch_size=batch, num_generations=batch,
                             max_completion_length=8 if args.quick else args.completion,
                             gradient_accumulation_steps=2, num_iterations=2, learning_rate=2e-6)}
    arms = [a.strip().upper() for a in args.arms.split(",") if a.strip()]
    results = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arm, probe_every, budget in [(a, p, b) for a in arms for p in args.probe_every for b in args.probe_budget]:
            settings = {key: value for key, value in (("probe_every", probe_every), ("probe_budget", budget))
                        if value is not None}
            label = arm if not settings else f"{arm} ({', '.join(f'{k} {v}' for k, v in settings.items())})"
            try:
                summary = train_arm(arm, settings, run, tmp)
            except Exception as err:  # one arm failing must not lose the others
                print(f"[{NAME}] arm {arm} failed: {err!r}", flush=True)
                results[label] = {"error": repr(err)}
                rows.append([label] + [None] * (len(COLUMNS) - 1))
                continue
            summary["gap_probe_every"] = probe_every
            summary["gap_probe_budget"] = budget
            results[label] = summary
            rows.append(table_row(label, summary))
            print(f"[{NAME}] arm {arm} done in {summary['bench_wall_s']:.1f} s", flush=True)
    table = t12_table(args.name, run, rows)
    document = ResultDocument(
        benchmark=NAME,
        env=environment_record(run["device"]),
        params={"model": run["model"], "steps": run["steps"], "arms": arms, "quick": args.quick,
                "probe_every": args.probe_every, "probe_budget": args.probe_budget, **run["overrides"]},
        results=results,
        tables=[table],
    )
    path = document.write(Path(args.out) / f"{args.name}.json")
    print(f"wrote {path}")
    print(format_text_table(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
