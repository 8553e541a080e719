"""What a sweep writes: the T10 tables, the resolution paragraph, the reward-curve plot, ``compare.json`` (a
:class:`bloggap_plugin.results.ResultDocument`) and ``compare.md``."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from bloggap_plugin._io import atomic_write_text
from bloggap_plugin.compare.inference import MIN_SEEDS, POWER
from bloggap_plugin.compare.sweep_config import ANALYSIS_METRICS, CompareConfig, CompareError
from bloggap_plugin.results import ResultDocument

__all__ = [
    "resolution_statement",
    "plot_reward_curves",
    "write_outputs",
    "print_table",
]


_HEADLINE_GAP_KEYS = ("gap/ratio/oob_frac", "gap/sampler/oob_frac", "gap/clip/flip_frac")


def _r(value: float | None, digits: int = 4):
    return None if value is None else round(float(value), digits)


def _signed(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:+.{digits}f}"


def _interval_cell(interval: dict | None, is_base: bool, interim: bool = False) -> str:
    """``"+0.012 [-0.003, +0.027]"``: a paired mean difference with its simultaneous interval, as a table cell;
    an interim table or too few seeds gives the mean and says why there is no interval."""
    if is_base:
        return "baseline"
    if interval is None or interval["n"] == 0:
        return "-"
    if interim:
        return f"{_signed(interval['mean'])} (interim: no interval)"
    if interval.get("half_width") is None:
        return f"{_signed(interval['mean'])} (n={interval['n']}: too few seeds for an interval, need {MIN_SEEDS})"
    return f"{_signed(interval['mean'])} [{_signed(interval['low'])}, {_signed(interval['high'])}]"


def _p_cell(interval: dict | None, key: str):
    return None if interval is None or interval.get(key) is None else _r(interval[key], 4)


def _analysis_words(results: dict) -> tuple[str, str, bool]:
    """``(interval column label, a sentence on the analysis, interim?)`` from ``results["analysis"]``."""
    analysis = results["analysis"]
    declared = analysis["declared"]
    interim = analysis["status"] != "final"
    family = results["resolution"]["family"]
    confidence = f"{100 * (1 - declared['alpha']):g}%"
    label = f"mean [simultaneous {confidence} CI]"
    planned = ", ".join(map(str, declared["planned_seeds"]))
    if interim:
        sentence = (f"INTERIM: {analysis['planned_done']} of {analysis['planned_total']} planned seeds ({planned}) "
                    "finished for every arm; the declared analysis (primary "
                    f"{declared['primary']}, secondary {', '.join(declared['secondary']) or 'none'}, baseline "
                    f"{declared['baseline']}, alpha {declared['alpha']:g}) reports intervals and p-values only when "
                    "all planned seeds have finished, so this table claims none.")
    else:
        sentence = (f"Declared before the run: primary {declared['primary']}, secondary "
                    f"{', '.join(declared['secondary']) or 'none'}, baseline {declared['baseline']}, seeds {planned}, "
                    f"alpha {declared['alpha']:g} over the {family} arm(s) compared: each interval is a paired t "
                    f"interval at {100 * (1 - declared['alpha'] / family):.4g}% (Bonferroni), so all of them hold "
                    f"together at {confidence}; p t: paired t-test, Holm-adjusted; p sign-flip: exact sign-flip "
                    "permutation test of the mean, Holm-adjusted (raw values in the JSON).")
    return label, sentence, interim


def _heldout_table(config: CompareConfig, heldout: dict, results: dict) -> dict:
    """Table T10-heldout: greedy held-out accuracy per arm, paired differences to the baseline arm."""
    base = heldout["baseline"]
    label_ci, sentence, interim = _analysis_words(results)
    rows = []
    for label, row in heldout["arms"].items():
        per_seed = " / ".join(_signed(d) for d in row["delta_vs_base"].values()) if label != base else "-"
        interval = row["delta_interval"]
        rows.append([label, len(row["seeds"]), _r(row["accuracy"]), per_seed,
                     _interval_cell(interval, label == base, interim), _p_cell(interval, "p_t_holm"),
                     _p_cell(interval, "p_sign_flip_holm"), ", ".join(map(str, row["n_per_run"])) or None])
    held = "the test split" + (f" ({config.calc_steps} calculation steps)" if config.calc_steps is not None else "") \
        if config.task == "gsm8k" else "questions from a held-out generator seed, none in the run's training set"
    return {
        "id": "T10-heldout",
        "title": f"Held-out accuracy by arm ({config.task}, {config.model})",
        "columns": ["arm", "seeds", "held-out accuracy", f"vs {base} per seed", f"vs {base}: {label_ci}",
                    "p t (Holm)", "p sign-flip (Holm)", "prompts per run"],
        "rows": rows,
        "notes": (f"Greedy accuracy of each run's final policy on held-out prompts ({held}), HF generate in fp32 "
                  f"(the same for every arm), the training reward as the score, mean over seeds. vs {base}: per-seed "
                  f"difference against the baseline arm (same prompts). {sentence}"),
        "reference": None,
        "random_init": config.model.startswith("tiny-random"),
    }


def compare_tables(config: CompareConfig, results: dict) -> list[dict]:
    """The result document's tables, in order: T10 (reward by arm), T10-heldout (when evaluated), the declared
    analysis, T10-gap and T10-cost (when logged), T10-resolution."""
    arms = results["arms"]
    tables = [_reward_table(config, results)]
    if results.get("heldout"):
        tables.append(_heldout_table(config, results["heldout"], results))
    tables.append(_analysis_table(config, results))
    gap_keys = sorted({key for row in arms.values() for key in row["gap"]})
    if gap_keys:
        tables.append(_gap_table(config, arms, gap_keys))
    if any(row.get("plugin_share") is not None for row in arms.values()):
        tables.append(_cost_table(config, arms))
    tables.append(_resolution_table(config, results))
    return tables


def _reward_table(config: CompareConfig, results: dict) -> dict:
    """Table T10: reward by arm, paired differences to the baseline arm, clip, the headline gap/* columns, s/step."""
    base, k = results["baseline"], results["last_k"]
    arms = results["arms"]
    headline = [key for key in _HEADLINE_GAP_KEYS if any(key in row["gap"] for row in arms.values())]
    label_ci, sentence, interim = _analysis_words(results)
    primary = results["analysis"]["declared"]["primary"]
    primary_label = ANALYSIS_METRICS[primary].replace("-k", f"-{k}")
    columns = ["arm", "seeds", f"reward last-{k}", "reward mean", f"vs {base} per seed (reward last-{k})",
               f"vs {base}: {primary_label} {label_ci}", "p t (Holm)", "p sign-flip (Holm)",
               "clip", *[f"{key} %" for key in headline], "s/step"]
    rows = []
    for label, row in arms.items():
        is_base = label == base
        per_seed = " / ".join(_signed(row["delta_vs_base"][s]) for s in row["delta_vs_base"]) if not is_base else "-"
        interval = row["delta_interval"]
        ci = _interval_cell(interval, is_base, interim)
        gap_cells = [_r(100 * row["gap"][key], 2) if row["gap"].get(key) is not None else None for key in headline]
        rows.append([label, len(row["seeds"]), _r(row["reward_last"]), _r(row["reward_mean"]), per_seed, ci,
                     _p_cell(interval, "p_t_holm"), _p_cell(interval, "p_sign_flip_holm"),
                     _r(row["clip"]), *gap_cells, _r(row["s_per_step"], 3)])
    generation = "vLLM colocate (TRL)" if config.use_vllm else "HF generate"
    task = config.task + (f" ({config.calc_steps} calculation steps)" if config.calc_steps is not None else "")
    notes = (
        _not_in_effect_words(results) +
        f"{task}, {config.model}, {config.max_steps} steps, seeds {', '.join(map(str, config.seeds))}, "
        f"generation: {generation}. "
        f"reward last-{k}: mean of the logged reward over the final {k} steps that logged one (with num_iterations > 1 "
        f"only generating steps do), averaged over seeds; reward mean: over all of them. vs {base}: per-seed difference "
        f"against arm {base} (same seed: same prompts and sampling seeds). {_window_words(results)}{sentence} "
        "clip: mean clip_ratio/region_mean. gap/* columns: mean over steps, in percent. s/step: mean step_time."
    )
    return {
        "id": "T10",
        "title": ("Interim: " if interim else "") + f"Reward by old-logprob arm ({config.task}, {config.model})",
        "columns": columns,
        "rows": rows,
        "notes": notes,
        "reference": "T10",
        "random_init": config.model.startswith("tiny-random"),
    }


def _not_in_effect_words(results: dict) -> str:
    """A first sentence naming the runs whose arm did not take effect (their summary's ``arm_not_in_effect``, e.g.
    arm H on a CPU, where it trains as arm A), or ``""``."""
    why = {run_id: s["arm_not_in_effect"] for run_id, s in results["runs"].items() if s.get("arm_not_in_effect")}
    if not why:
        return ""
    reasons = "; ".join(sorted(set(why.values())))
    return f"NOT IN EFFECT in run(s) {', '.join(sorted(why))}: {reasons}; their rows do not measure the arm. "


def _gap_table(config: CompareConfig, arms: dict, gap_keys: list[str]) -> dict:
    """Table T10-gap: every logged gap/* metric by arm (fractions)."""
    return {
        "id": "T10-gap",
        "title": "gap/* metrics by arm (mean over steps and seeds)",
        "columns": ["arm", *gap_keys],
        "rows": [[arm, *[_r(row["gap"].get(key), 6) for key in gap_keys]] for arm, row in arms.items()],
        "notes": "Plugin metrics as logged (fractions, not percent); definitions in docs/trl.md (Live metrics).",
        "reference": None,
        "random_init": config.model.startswith("tiny-random"),
    }


def _cost_table(config: CompareConfig, arms: dict) -> dict:
    """Table T10-cost: the plugin's time-weighted share of training time by arm."""
    return {
        "id": "T10-cost",
        "title": "The plugin's share of training time by arm",
        "columns": ["arm", "plugin time %", "mean of per-step overhead_frac %", "s/step"],
        "rows": [[arm, _r(100 * row["plugin_share"], 2) if row.get("plugin_share") is not None else None,
                  _r(100 * row["gap"]["gap/time/overhead_frac"], 2)
                  if row["gap"].get("gap/time/overhead_frac") is not None else None,
                  _r(row["s_per_step"], 3)] for arm, row in arms.items()],
        "notes": ("plugin time %: sum of gap/time/scoring_s over sum of step_time, per run, mean over seeds: the "
                  "share of training time the plugin took. The mean of the per-step gap/time/overhead_frac "
                  "weighs a rare long step (a probe generation) like a short one and so reads lower."),
        "reference": None,
        "random_init": config.model.startswith("tiny-random"),
    }


def _resolution_table(config: CompareConfig, results: dict) -> dict:
    """Table T10-resolution: step noise, seed-to-seed spread and the smallest detectable differences."""
    res, k = results["resolution"], results["last_k"]
    return {
        "id": "T10-resolution",
        "title": "Resolution of this comparison",
        "columns": ["quantity", "value"],
        "rows": [
            ["per-step reward sd (last-k window, pooled over runs)", _r(res["step_sd_last"])],
            ["per-step reward sd (all steps, pooled over runs)", _r(res["step_sd_all"])],
            [f"SE of a last-{k} mean from step noise", _r(res["se_last_mean"])],
            ["seed-to-seed sd of last-k (mean over arms)", _r(res["seed_sd_last"])],
            [f"smallest detectable difference, step noise only ({_level(res)} two-sided, {res['power']:.0%} power)",
             _r(res["mdd_step_noise"])],
            *[[f"smallest detectable difference, arm {arm} (its paired differences, {_level(res)} two-sided, "
               f"{res['power']:.0%} power)", _r(value)] for arm, value in (res["detectable_per_arm"] or {}).items()],
        ],
        "notes": resolution_statement(results),
        "reference": None,
        "random_init": config.model.startswith("tiny-random"),
    }


def _window_words(results: dict) -> str:
    """A sentence when the last-k window is every reward step of the runs (then it is no final window)."""
    steps = [run["reward_steps"] for run in results["runs"].values() if run.get("reward_steps")]
    k = results["last_k"]
    if steps and k and k >= max(steps):
        return (f"The last-{k} window covers every reward step of these runs, so reward last-{k} is the whole-run "
                "mean, not a final window. ")
    return ""


def _level(res: dict) -> str:
    return f"{100 * res['level_per_arm']:.3g}%"


def _analysis_table(config: CompareConfig, results: dict) -> dict:
    """Table T10-analysis: every declared metric, per arm against the baseline (the primary first)."""
    analysis = results["analysis"]
    label_ci, sentence, interim = _analysis_words(results)
    rows = []
    for metric, block in analysis["metrics"].items():
        role = "primary" if metric == analysis["declared"]["primary"] else "secondary"
        for arm, row in block["arms"].items():
            rows.append([metric, role, arm, row["n"], _r(row["mean"]),
                         None if interim or row.get("low") is None else _r(row["low"]),
                         None if interim or row.get("high") is None else _r(row["high"]),
                         _p_cell(row, "p_t"), _p_cell(row, "p_t_holm"), _p_cell(row, "p_sign_flip"),
                         _p_cell(row, "p_sign_flip_holm"), _r(row.get("detectable"))])
    return {
        "id": "T10-analysis",
        "title": ("Interim: " if interim else "") + f"Declared analysis: each arm against {results['baseline']}",
        "columns": ["metric", "role", "arm", "seeds", "mean difference", "CI low", "CI high", "p t", "p t (Holm)",
                    "p sign-flip", "p sign-flip (Holm)", "detectable difference"],
        "rows": rows,
        "notes": (f"{sentence} CI: simultaneous ({label_ci.split('[')[1].rstrip(']')}). detectable difference: "
                  f"(t at the per-arm level + t at {POWER:.0%} power) x the arm's sd of differences / sqrt(seeds), "
                  f"its own df (no pooling across arms). An arm with fewer than {MIN_SEEDS} seeds gets no interval "
                  "or p-value."),
        "reference": None,
        "random_init": config.model.startswith("tiny-random"),
        "plot": False,
    }


def resolution_statement(results: dict) -> str:
    """One paragraph: the per-step noise and the smallest difference this sweep could detect."""
    res, k = results["resolution"], results["last_k"]
    n = res["n_seeds"]
    if res["step_sd_last"] is None:
        return "Too few steps to estimate the per-step reward noise."
    text = (
        f"Per-step reward sd is {res['step_sd_last']:.3f} over the last-{k} window, so a {k}-step mean has a "
        f"standard error of about {res['se_last_mean']:.3f} (if steps were independent). With {n} planned seed(s) "
        f"per arm, a difference between two arms smaller than about {res['mdd_step_noise']:.3f} is below what step "
        f"noise alone lets this sweep detect ({_level(res)} two-sided per arm: alpha {res['alpha']:g} over "
        f"{res['family']} arm(s); {res['power']:.0%} power); that is a lower bound, because runs also differ "
        "seed to seed"
    )
    if res["seed_sd_last"] is not None:
        text += f" (seed-to-seed sd of one arm's last-{k} reward: {res['seed_sd_last']:.3f})"
    text += ". "
    if res["detectable_per_arm"]:
        values = ", ".join(f"{arm} {value:.3f}" for arm, value in res["detectable_per_arm"].items() if value is not None)
        text += f"From each arm's own paired per-seed differences (its own df) the smallest detectable difference is: {values}."
    else:
        text += (f"Per-arm detectable differences come with the final analysis (all planned seeds, at least "
                 f"{MIN_SEEDS}).")
    return text


def _rolling(values: list[float], window: int) -> list[float]:
    if window <= 1:
        return list(values)
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_reward_curves(results: dict, path: str | os.PathLike, smooth: int = 5, title: str = "") -> str:
    """PNG of reward per step: one line per arm (mean over seeds), band = min..max over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bloggap_plugin.report_builder import plot_text, save_figure

    fig, ax = plt.subplots(figsize=(8, 4.5))
    by_arm: dict[str, list[dict]] = {}
    for summary in results["runs"].values():
        by_arm.setdefault(summary["arm"], []).append(summary)
    for label in results["arms"]:
        runs = by_arm.get(label, [])
        if not runs:
            continue
        length = min(len(r["rewards"]) for r in runs)
        if length == 0:
            continue
        curves = [_rolling(r["rewards"][:length], smooth) for r in runs]
        steps = list(range(1, length + 1))
        mean = [sum(c[i] for c in curves) / len(curves) for i in range(length)]
        marker = "o" if length <= 20 else None  # a curve of one point is no line: show the points of short runs
        (line,) = ax.plot(steps, mean, marker=marker, label=plot_text(f"{label} ({len(runs)} seed{'s' if len(runs) > 1 else ''})"))
        if len(curves) > 1:
            low = [min(c[i] for c in curves) for i in range(length)]
            high = [max(c[i] for c in curves) for i in range(length)]
            ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.15)
    ax.set_xlabel("reward step (the steps that logged a reward: generating steps with num_iterations > 1)")
    ax.set_ylabel("reward" + (f" (rolling mean, {smooth} steps)" if smooth > 1 else ""))
    ax.set_title(plot_text(title) if title else "Reward by arm: mean over seeds, band = per-seed range")
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
    return str(path)


def write_outputs(config: CompareConfig, results: dict) -> dict[str, str]:
    """Write ``compare.json``, ``compare.md`` and ``reward_curves.png`` into ``config.output_dir``, each atomically.

    A failed write (full disk, permissions) raises :class:`CompareError` and leaves the previous file unchanged;
    non-finite numbers are written as ``null``.
    """
    from bloggap_plugin.envinfo import environment_record
    from bloggap_plugin.report_builder import markdown_text, render_table

    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = {k: v for k, v in dataclasses.asdict(config).items() if k not in ("poll_s", "pythonpath", "lock_wait_s")}
    document = ResultDocument(
        benchmark="compare",
        env=environment_record("cpu" if not _cuda_available() else None, model=config.model),
        params=params,
        results={k: v for k, v in results.items() if k != "tables"},
        tables=results["tables"],
    )
    paths = {"json": str(out / "compare.json"), "markdown": str(out / "compare.md"), "plot": str(out / "reward_curves.png")}
    lines = [f"# Reward comparison: {markdown_text(config.task)}, {markdown_text(config.model)}", ""]
    lines += [f"Recipes: {markdown_text(', '.join(config.recipes))}; seeds {', '.join(map(str, config.seeds))}; "
              f"{config.max_steps} steps per run.", ""]
    for table in results["tables"]:
        lines += render_table(table) + [""]
    lines += ["![reward curves](reward_curves.png)", ""]
    current = paths["json"]
    try:
        document.write(current)
        current = paths["plot"]
        plot_reward_curves(results, current, smooth=config.smooth,
                           title=f"{config.task}, {config.model}: reward by arm (mean over seeds, band = seed range)")
        current = paths["markdown"]
        atomic_write_text(current, "\n".join(lines))
    except OSError as err:
        raise CompareError(f"{current}: cannot write ({err.strerror or err}); the previous file is unchanged and the "
                           "run logs are kept: fix that and re-run the command with --table-only") from None
    return paths


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def print_table(results: dict, echo=print) -> None:
    """Print the T10 table as Markdown."""
    from bloggap_plugin.report_builder import render_table

    for line in render_table(results["tables"][0]):
        echo(line)
    echo("")
    echo(resolution_statement(results))
    for table in results["tables"]:
        if table["id"] == "T10-heldout":
            echo("")
            for line in render_table(table):
                echo(line)
