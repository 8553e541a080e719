"""Per-run summaries, per-arm aggregates, paired deltas with t intervals, and the sweep's resolution (pure Python)."""

from __future__ import annotations

import math

from bloggap_plugin.compare.heldout import read_heldout
from bloggap_plugin.compare.inference import POWER, arm_statistics, compare_with_baseline
from bloggap_plugin.compare.logs import (
    MODEL_SHA256_KEY,
    checkpoint_mismatches,
    finished_checkpoints,
    run_verdict,
)
from bloggap_plugin.compare.outputs import compare_tables
from bloggap_plugin.compare.sweep_config import CompareConfig, RunSpec
from bloggap_plugin.run_timing import plugin_time_share

__all__ = [
    "summarize_run",
    "build_results",
    "paired_interval",
    "heldout_by_arm",
    "declared_analysis",
]


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def _sd(values: list[float]) -> float | None:
    """Sample standard deviation (n - 1); ``None`` for fewer than two values."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def paired_interval(deltas: list[float], confidence: float = 0.95) -> dict:
    """Mean of paired differences and its two-sided t interval: ``{n, mean, sd, low, high, half_width}``, computed
    by :mod:`bloggap_plugin.compare.inference` (one arm, level ``1 - confidence``). With fewer than
    :data:`~bloggap_plugin.compare.inference.MIN_SEEDS` differences only ``n`` and ``mean`` are set (a t interval from
    2 values has 1 df and means little)."""
    row = arm_statistics(list(deltas), 1.0 - confidence)
    return {key: row[key] for key in ("n", "mean", "sd", "low", "high", "half_width")}


def _key_mean(records: list[dict], key: str) -> float | None:
    return _mean([r[key] for r in records if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)])


def summarize_run(records: list[dict], marker: dict | None, last_n: int = 30) -> dict:
    """Per-run numbers from its log records: rewards, last-k and overall means, clip, gap/* means, s/step.

    Rewards come from the records that carry ``reward`` (with ``num_iterations > 1`` TRL logs a reward only on
    steps that generate); clip, ``gap/*`` and ``step_time`` are averaged over every record that carries them;
    ``heldout_curve`` lists ``[step, accuracy]`` of the records of a periodic held-out evaluation.
    """
    reward_steps = [r for r in records if isinstance(r.get("reward"), (int, float))]
    rewards = [float(r["reward"]) for r in reward_steps]
    k = min(last_n, len(rewards))
    gap_keys = sorted({key for r in records for key in r if key.startswith("gap/")})
    step_times = [r["step_time"] for r in records if isinstance(r.get("step_time"), (int, float))]
    steps_logged = max([int(r["step"]) for r in records if isinstance(r.get("step"), (int, float))], default=len(records))
    wall_s = marker.get("wall_s") if marker else None
    if step_times:
        s_per_step, s_source = _mean(step_times), "step_time"
    elif wall_s is not None and steps_logged:
        s_per_step, s_source = wall_s / steps_logged, "wall"
    else:
        s_per_step, s_source = None, None
    result = (marker or {}).get("result")
    return {
        "arm_not_in_effect": result.get("arm_not_in_effect") if isinstance(result, dict) else None,
        "steps": steps_logged,
        "reward_steps": len(rewards),
        "reward_step_ids": [r.get("step", i + 1) for i, r in enumerate(reward_steps)],
        "rewards": rewards,
        "last_k": k,
        "reward_last": _mean(rewards[-k:]) if k else None,
        "reward_mean": _mean(rewards),
        "reward_sd_steps": _sd(rewards),
        "reward_sd_last": _sd(rewards[-k:]) if k else None,
        "clip": _key_mean(records, "clip_ratio/region_mean"),
        "sampling_dlogp": _key_mean(records, "sampling/sampling_logp_difference/mean"),
        "gap": {key: _key_mean(records, key) for key in gap_keys},
        "s_per_step": s_per_step,
        "s_per_step_source": s_source,
        "plugin_share": plugin_time_share(records),
        "heldout_curve": [[r["step"], r["heldout/accuracy"]] for r in records
                          if isinstance(r.get("heldout/accuracy"), (int, float))],
        "wall_s": wall_s,
        "done": marker is not None,
    }


def _baseline(config: CompareConfig, arms: list[str]) -> str:
    if config.baseline is not None:
        if config.baseline not in arms:
            raise ValueError(f"baseline arm {config.baseline!r} is not among the arms {arms}")
        return config.baseline
    return "A" if "A" in arms else arms[0]


def build_results(config: CompareConfig, runs: list[RunSpec]) -> dict:
    """Per-run summaries, per-arm aggregates, deltas vs the baseline, resolution and the tables (JSON-ready).

    Runs whose log is unfinished are left out; runs whose log is corrupt or was trained with other settings are
    left out and listed in ``set_aside`` (run id -> why, naming the file and line or the settings), and so are all
    runs of a seed whose runs started from different checkpoints (``checkpoints``: each finished run's recorded
    model sha256 by seed, and the seeds set aside for it).
    """
    arms = list(dict.fromkeys(r.arm for r in runs))
    base = _baseline(config, arms)
    per_run, set_aside = {}, {}
    verdicts = [run_verdict(config, run) for run in runs]  # each log read once: state, why, records, marker
    checkpoints = finished_checkpoints(runs, [(state, marker) for state, _, _, marker in verdicts])
    mismatched = checkpoint_mismatches(checkpoints)
    for run, (state, why, records, marker) in zip(runs, verdicts):
        if state in ("corrupt", "changed"):
            set_aside[run.run_id] = why
            continue
        if state != "done":
            continue  # unfinished: left out of the table
        if run.seed in mismatched:  # no comparison pairs runs that started from different weights
            set_aside[run.run_id] = mismatched[run.seed]
            continue
        summary = summarize_run(records, marker, config.last_n)
        summary[MODEL_SHA256_KEY] = (marker or {}).get(MODEL_SHA256_KEY)
        summary.update(arm=run.arm, seed=run.seed, recipe=run.recipe,
                       heldout=read_heldout(config, run, (marker or {}).get("attempt")))
        per_run[run.run_id] = summary
    by_arm: dict[str, dict[int, dict]] = {label: {} for label in arms}
    for summary in per_run.values():
        by_arm[summary["arm"]][summary["seed"]] = summary
    all_k = [s["last_k"] for s in per_run.values() if s["reward_steps"]]
    k = min(all_k) if all_k else 0
    if k:  # one window for every run, so last-k values compare like with like
        for s in per_run.values():
            s["last_k"] = k
            s["reward_last"] = _mean(s["rewards"][-k:])
            s["reward_sd_last"] = _sd(s["rewards"][-k:])
    arm_rows = {}
    for label in arms:
        seeds = by_arm[label]
        deltas = {}
        for seed, s in seeds.items():
            b = by_arm[base].get(seed)
            if label != base and b is not None and s["reward_last"] is not None and b["reward_last"] is not None:
                deltas[seed] = s["reward_last"] - b["reward_last"]
        gap_keys = sorted({key for s in seeds.values() for key in s["gap"]})
        arm_rows[label] = {
            "seeds": sorted(seeds),
            "reward_last": _mean([s["reward_last"] for s in seeds.values()]),
            "reward_mean": _mean([s["reward_mean"] for s in seeds.values()]),
            "reward_last_per_seed": {seed: seeds[seed]["reward_last"] for seed in sorted(seeds)},
            "reward_mean_per_seed": {seed: seeds[seed]["reward_mean"] for seed in sorted(seeds)},
            "seed_sd_last": _sd([s["reward_last"] for s in seeds.values()]),
            "delta_vs_base": {seed: deltas[seed] for seed in sorted(deltas)},
            "delta_interval": None,  # filled from the declared analysis below
            "clip": _mean([s["clip"] for s in seeds.values() if s["clip"] is not None]),
            "sampling_dlogp": _mean([s["sampling_dlogp"] for s in seeds.values() if s["sampling_dlogp"] is not None]),
            "gap": {key: _mean([s["gap"].get(key) for s in seeds.values()]) for key in gap_keys},
            "s_per_step": _mean([s["s_per_step"] for s in seeds.values() if s["s_per_step"] is not None]),
            "plugin_share": _mean([s["plugin_share"] for s in seeds.values() if s.get("plugin_share") is not None]),
        }
    analysis = declared_analysis(config, by_arm, base)
    primary = analysis["metrics"].get(config.primary)
    for label, row in arm_rows.items():
        row["delta_interval"] = primary["arms"].get(label) if primary is not None and label != base else None
    heldout = heldout_by_arm(per_run, arms, base)
    if heldout is not None:
        held = analysis["metrics"].get("heldout")
        for label, row in heldout["arms"].items():
            row["delta_interval"] = held["arms"].get(label) if held is not None and label != base else None
    resolution = _resolution(per_run, arm_rows, k, analysis)
    results = {"baseline": base, "arms": arm_rows, "runs": per_run, "set_aside": set_aside, "last_k": k,
               "resolution": resolution, "heldout": heldout, "analysis": analysis,
               "checkpoints": {"by_seed": checkpoints, "mismatched_seeds": sorted(mismatched)}}
    results["tables"] = compare_tables(config, results)
    return results


def heldout_by_arm(per_run: dict, arms: list[str], base: str) -> dict | None:
    """Held-out accuracy per arm: mean over seeds, per seed, the per-seed difference to the baseline arm with its
    paired t interval (as for the reward), the prompts per run; ``None`` when no run has a held-out result."""
    by_arm: dict[str, dict] = {label: {} for label in arms}
    for summary in per_run.values():
        if summary.get("heldout") and summary["heldout"].get("accuracy") is not None:
            by_arm[summary["arm"]][summary["seed"]] = summary["heldout"]
    if not any(by_arm.values()):
        return None
    rows = {}
    for label in arms:
        seeds = by_arm[label]
        deltas = {seed: seeds[seed]["accuracy"] - by_arm[base][seed]["accuracy"]
                  for seed in sorted(seeds) if label != base and seed in by_arm[base]}
        rows[label] = {
            "seeds": sorted(seeds),
            "accuracy": _mean([h["accuracy"] for h in seeds.values()]),
            "accuracy_per_seed": {seed: seeds[seed]["accuracy"] for seed in sorted(seeds)},
            "n_per_run": sorted({int(h["n"]) for h in seeds.values() if h.get("n") is not None}),
            "delta_vs_base": deltas,
            "delta_interval": None,  # the declared analysis' row for heldout, set by build_results
        }
    return {"baseline": base, "arms": rows}


def _metric_value(summary: dict, metric: str) -> float | None:
    if metric == "heldout":
        held = summary.get("heldout") or {}
        return held.get("accuracy")
    return summary.get(metric)


def declared_analysis(config: CompareConfig, by_arm: dict[str, dict[int, dict]], base: str) -> dict:
    """The sweep's declared analysis (``config.primary``, ``secondary``, ``alpha``, ``planned_seeds``) over the
    finished runs ``by_arm`` (arm -> seed -> run summary).

    ``status`` is ``final`` when every arm has a value of every declared metric it is tested on for every planned
    seed; the metrics are then compared with :func:`~bloggap_plugin.compare.inference.compare_with_baseline` on the
    planned seeds only. Otherwise ``interim``: each arm's mean per-seed difference over the seeds it shares with the
    baseline, and nothing else (no interval, no p-value). A metric no run has (heldout without evaluation) is left
    out."""
    planned = list(config.planned_seeds or config.seeds)
    declared = {"primary": config.primary, "secondary": list(config.secondary), "baseline": base,
                "alpha": config.alpha, "planned_seeds": planned, "power": POWER}
    compared = [arm for arm in by_arm if arm != base]
    finished = {arm: sorted(seeds) for arm, seeds in by_arm.items()}
    values = {}
    for metric in [config.primary, *config.secondary]:
        table = {arm: {seed: _metric_value(s, metric) for seed, s in seeds.items()} for arm, seeds in by_arm.items()}
        if any(v is not None for seeds in table.values() for v in seeds.values()):
            values[metric] = table  # a metric no run has (heldout without evaluation) is left out
    complete = bool(values) and all(table[arm].get(seed) is not None for table in values.values()
                                    for arm in by_arm for seed in planned)
    metrics = {}
    for metric, table in values.items():
        differences = {arm: [table[arm][seed] - table[base][seed] for seed in (planned if complete else sorted(table[arm]))
                             if table[arm].get(seed) is not None and table[base].get(seed) is not None]
                       for arm in compared}
        if complete:
            metrics[metric] = compare_with_baseline(differences, config.alpha)
        else:
            metrics[metric] = {"alpha": config.alpha, "family": len(compared), "arms": {
                arm: {"n": len(d), "mean": math.fsum(d) / len(d) if d else None} for arm, d in differences.items()}}
    status = "final" if complete else "interim"
    done = min((sum(seed in finished[arm] for seed in planned) for arm in by_arm), default=0)
    return {"declared": declared, "status": status, "finished_seeds": finished,
            "planned_done": done, "planned_total": len(planned), "metrics": metrics}


def _resolution(per_run: dict, arm_rows: dict, k: int, analysis: dict) -> dict:
    """Per-step reward noise and the smallest arm difference this sweep could detect, at the declared family's
    level: from step noise alone (a lower bound) and, when the analysis is final, per arm from its own paired
    differences of the primary metric (its own df, no pooling across arms)."""
    from scipy import stats

    variances_last = [s["reward_sd_last"] ** 2 for s in per_run.values() if s["reward_sd_last"] is not None]
    variances_all = [s["reward_sd_steps"] ** 2 for s in per_run.values() if s["reward_sd_steps"] is not None]
    step_sd_last = math.sqrt(sum(variances_last) / len(variances_last)) if variances_last else None
    step_sd_all = math.sqrt(sum(variances_all) / len(variances_all)) if variances_all else None
    seed_sds = [row["seed_sd_last"] for row in arm_rows.values() if row["seed_sd_last"] is not None]
    declared = analysis["declared"]
    n_seeds = len(declared["planned_seeds"])
    family = max(1, len(arm_rows) - 1)
    level = declared["alpha"] / family
    out = {
        "n_seeds": n_seeds,
        "last_k": k,
        "step_sd_last": step_sd_last,
        "step_sd_all": step_sd_all,
        "seed_sd_last": _mean(seed_sds),
        "se_last_mean": step_sd_last / math.sqrt(k) if step_sd_last is not None and k else None,
        "alpha": declared["alpha"],
        "family": family,
        "level_per_arm": level,
        "power": declared["power"],
        "mdd_step_noise": None,
        "detectable_per_arm": None,
    }
    if step_sd_last is not None and k:
        # Two arms, n seeds each, k steps per mean, steps independent: SE of the difference = sd * sqrt(2 / (k n)).
        z = float(stats.norm.ppf(1 - level / 2) + stats.norm.ppf(declared["power"]))
        out["mdd_step_noise"] = z * step_sd_last * math.sqrt(2.0 / (k * n_seeds))
    primary = analysis["metrics"].get(declared["primary"])
    if analysis["status"] == "final" and primary is not None:
        out["detectable_per_arm"] = {arm: row["detectable"] for arm, row in primary["arms"].items()}
    return out
