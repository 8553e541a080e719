"""What a sweep writes: the T10 tables, the resolution paragraph, the reward-curve plot, ``compare.json`` (a
:class:`bloggap_plugin.results.ResultDocument`) and ``compare.md``."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from bloggap_plugin._io import atomic_write_text
from bloggap_plugin.compare.config import CompareConfig, CompareError
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


def _interval_cell(interval: dict | None, is_base: bool) -> str:
    """``"+0.012 [-0.003, +0.027]"``: a paired mean difference with its 95% interval, as a table cell."""
    if is_base:
        return "baseline"
    if interval is None or interval["n"] == 0:
        return "-"
    if interval["half_width"] is None:
        return f"{_signed(interval['mean'])} (n={interval['n']}: too small for an interval)"
    return f"{_signed(interval['mean'])} [{_signed(interval['low'])}, {_signed(interval['high'])}]"


def _heldout_table(config: CompareConfig, heldout: dict) -> dict:
    """Table T10-heldout: greedy held-out accuracy per arm, paired differences to the baseline arm."""
    base = heldout["baseline"]
    rows = []
    for label, row in heldout["arms"].items():
        per_seed = " / ".join(_signed(d) for d in row["delta_vs_base"].values()) if label != base else "-"
        rows.append([label, len(row["seeds"]), _r(row["accuracy"]), per_seed,
                     _interval_cell(row["delta_interval"], label == base),
                     ", ".join(map(str, row["n_per_run"])) or None])
    held = "the test split" + (f" ({config.calc_steps} calculation steps)" if config.calc_steps is not None else "") \
        if config.task == "gsm8k" else "questions from a held-out generator seed, none in the run's training set"
    return {
        "id": "T10-heldout",
        "title": f"Held-out accuracy by arm ({config.task}, {config.model})",
        "columns": ["arm", "seeds", "held-out accuracy", f"vs {base} per seed", f"vs {base}: mean [95% CI]",
                    "prompts per run"],
        "rows": rows,
        "notes": (f"Greedy accuracy of each run's final policy on held-out prompts ({held}), HF generate in fp32 "
                  f"(the same for every arm), the training reward as the score, mean over seeds. vs {base}: per-seed "
                  "difference against the baseline arm (same prompts); interval: paired t over seeds."),
        "reference": None,
        "random_init": config.model.startswith("tiny-random"),
    }


def _tables(config: CompareConfig, results: dict) -> list[dict]:
    base, k = results["baseline"], results["last_k"]
    arms = results["arms"]
    headline = [key for key in _HEADLINE_GAP_KEYS if any(key in row["gap"] for row in arms.values())]
    columns = ["arm", "seeds", f"reward last-{k}", "reward mean", f"vs {base} per seed", f"vs {base}: mean [95% CI]",
               "clip", *[f"{key} %" for key in headline], "s/step"]
    rows = []
    for label, row in arms.items():
        is_base = label == base
        per_seed = " / ".join(_signed(row["delta_vs_base"][s]) for s in row["delta_vs_base"]) if not is_base else "-"
        ci = _interval_cell(row["delta_interval"], is_base)
        gap_cells = [_r(100 * row["gap"][key], 2) if row["gap"].get(key) is not None else None for key in headline]
        rows.append([label, len(row["seeds"]), _r(row["reward_last"]), _r(row["reward_mean"]), per_seed, ci,
                     _r(row["clip"]), *gap_cells, _r(row["s_per_step"], 3)])
    res = results["resolution"]
    generation = "vLLM colocate (TRL)" if config.use_vllm else "HF generate"
    task = config.task + (f" ({config.calc_steps} calculation steps)" if config.calc_steps is not None else "")
    notes = (
        f"{task}, {config.model}, {config.max_steps} steps, seeds {', '.join(map(str, config.seeds))}, "
        f"generation: {generation}. "
        f"reward last-{k}: mean of the logged reward over the final {k} steps that logged one (with num_iterations > 1 "
        f"only generating steps do), averaged over seeds; reward mean: over all of them. vs {base}: per-seed difference of last-{k} against arm {base}; interval: paired t over seeds. "
        "clip: mean clip_ratio/region_mean. gap/* columns: mean over steps, in percent. s/step: mean step_time."
    )
    main = {
        "id": "T10",
        "title": f"Reward by old-logprob arm ({config.task}, {config.model})",
        "columns": columns,
        "rows": rows,
        "notes": notes,
        "reference": "T10",
        "random_init": config.model.startswith("tiny-random"),
    }
    tables = [main]
    if results.get("heldout"):
        tables.append(_heldout_table(config, results["heldout"]))
    gap_keys = sorted({key for row in arms.values() for key in row["gap"]})
    if gap_keys:
        tables.append({
            "id": "T10-gap",
            "title": "gap/* metrics by arm (mean over steps and seeds)",
            "columns": ["arm", *gap_keys],
            "rows": [[arm, *[_r(row["gap"].get(key), 6) for key in gap_keys]] for arm, row in arms.items()],
            "notes": "Plugin metrics as logged (fractions, not percent); definitions in docs/trl.md (Live metrics).",
            "reference": None,
            "random_init": config.model.startswith("tiny-random"),
        })
    if any(row.get("plugin_share") is not None for row in arms.values()):
        tables.append({
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
        })
    tables.append({
        "id": "T10-resolution",
        "title": "Resolution of this comparison",
        "columns": ["quantity", "value"],
        "rows": [
            ["per-step reward sd (last-k window, pooled over runs)", _r(res["step_sd_last"])],
            ["per-step reward sd (all steps, pooled over runs)", _r(res["step_sd_all"])],
            [f"SE of a last-{k} mean from step noise", _r(res["se_last_mean"])],
            ["seed-to-seed sd of last-k (mean over arms)", _r(res["seed_sd_last"])],
            ["smallest detectable difference, step noise only (5% two-sided, 80% power)", _r(res["mdd_step_noise"])],
            ["sd of paired deltas vs baseline (pooled over arms)", _r(res["delta_sd_pooled"])],
            ["smallest detectable difference from paired deltas (t, pooled df)", _r(res["mdd_paired"])],
        ],
        "notes": resolution_statement(results),
        "reference": None,
        "random_init": config.model.startswith("tiny-random"),
    })
    return tables


def resolution_statement(results: dict) -> str:
    """One paragraph: the per-step noise and the smallest difference this sweep could detect."""
    res, k = results["resolution"], results["last_k"]
    n = res["n_seeds"]
    if res["step_sd_last"] is None:
        return "Too few steps to estimate the per-step reward noise."
    text = (
        f"Per-step reward sd is {res['step_sd_last']:.3f} over the last-{k} window, so a {k}-step mean has a "
        f"standard error of about {res['se_last_mean']:.3f} (if steps were independent). With {n} seed(s) per arm, "
        f"a difference between two arms smaller than about {res['mdd_step_noise']:.3f} is below what step noise "
        "alone lets this sweep detect (5% two-sided, 80% power); that is a lower bound, because runs also differ "
        "seed to seed"
    )
    if res["seed_sd_last"] is not None:
        text += f" (seed-to-seed sd of one arm's last-{k} reward: {res['seed_sd_last']:.3f})"
    text += ". "
    if res["mdd_paired"] is not None:
        text += (
            f"From the paired per-seed deltas themselves (sd {res['delta_sd_pooled']:.3f}, {res['delta_df']} df "
            f"pooled over arms) the smallest detectable difference is about {res['mdd_paired']:.3f}."
        )
    else:
        text += "With fewer than two seeds per arm there is no paired interval: n is too small."
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

    from bloggap_plugin.report import save_figure

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
        (line,) = ax.plot(steps, mean, label=f"{label} ({len(runs)} seed{'s' if len(runs) > 1 else ''})")
        if len(curves) > 1:
            low = [min(c[i] for c in curves) for i in range(length)]
            high = [max(c[i] for c in curves) for i in range(length)]
            ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.15)
    ax.set_xlabel("step")
    ax.set_ylabel("reward" + (f" (rolling mean, {smooth} steps)" if smooth > 1 else ""))
    ax.set_title(title or "Reward by arm: mean over seeds, band = per-seed range")
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
    from bloggap_plugin.report import render_table

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
    lines = [f"# Reward comparison: {config.task}, {config.model}", ""]
    lines += [f"Recipes: {', '.join(config.recipes)}; seeds {', '.join(map(str, config.seeds))}; "
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
    from bloggap_plugin.report import render_table

    for line in render_table(results["tables"][0]):
        echo(line)
    echo("")
    echo(resolution_statement(results))
    for table in results["tables"]:
        if table["id"] == "T10-heldout":
            echo("")
            for line in render_table(table):
                echo(line)
