"""verl_live's run records: what each run is (presets, run kinds, variants), what its console and metrics file say
(verl's console logger, the ``file`` logger's JSON lines, the plugin's "registered" lines, Ray's process prefixes),
one run's record (:func:`summarise`), and the T13v tables built from the records (:func:`result_tables`,
:func:`head_table`). Torch-free, so that ``python -m benchmarks.verl_live document`` rebuilds the result document
anywhere; :mod:`benchmarks.verl_live` runs verl and imports everything here it needs."""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

TOP_P_TRUNCATED = 0.8
PRESETS: dict[str, list[str]] = {
    # RolloutCorrectionConfig.decoupled_geo_rs()
    "geo_rs": ["algorithm.rollout_correction.rollout_is=null", "algorithm.rollout_correction.rollout_rs=seq_mean_k1",
               "algorithm.rollout_correction.rollout_rs_threshold='0.999_1.001'"],
    # RolloutCorrectionConfig.decoupled_seq_is_rs() ("Seq-MIS")
    "seq_mis": ["algorithm.rollout_correction.rollout_is=sequence", "algorithm.rollout_correction.rollout_is_threshold=2.0",
                "algorithm.rollout_correction.rollout_rs=seq_sum_k1",
                "algorithm.rollout_correction.rollout_rs_threshold='0.5_2.0'"],
}
RS_OPTION = {"geo_rs": "seq_mean_k1", "seq_mis": "seq_sum_k1"}
REGISTERED = "bloggap verl plugin registered (pid"
GUARD = "bloggap: rollout correction preset"
_RAY_PREFIX = re.compile(r"^\((?:(?P<actor>[A-Za-z_][\w.:-]*)\s+)?pid=(?P<pid>\d+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run_spec(name: str) -> dict:
    """``{"preset", "truncated", "disable", "recipes", "extra"}`` of run ``name`` (``RUNS``, or ``RUN@VARIANT``:
    a kept repeat of a run under other conditions, ``VARIANTS``)."""
    name, _, variant = name.partition("@")
    if variant and variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} of run {name!r}; choose from {', '.join(VARIANTS)}")
    if name.startswith("arm_") and name[4:] in ("A", "B", "E", "F"):
        return {"preset": "geo_rs", "truncated": False, "disable": False, "recipes": [f"arm_{name[4:]}.yaml"],
                "extra": []}
    preset, _, kind = name.partition("/")
    if preset not in PRESETS or kind not in RUN_KINDS:
        raise ValueError(f"unknown run {name!r}; choose from {', '.join(RUNS)}")
    # nofix runs without the plugin, so without its loss too (verl refuses an unregistered "gap_vanilla")
    recipes = [] if kind == "nofix" else ["arm_A.yaml"] + (["truncation_fix.yaml"] if kind == "fix" else [])
    # guard: the truncation bug with the plugin on but its lift off, so the all-rejected guard meets it live
    extra = ["+bloggap.fix_truncation=false"] if kind == "guard" else []
    return {"preset": preset, "truncated": kind != "control", "disable": kind == "nofix", "recipes": recipes,
            "extra": extra}


RUN_KINDS = ("control", "nofix", "fix", "guard")
# records kept beside a run's main record, ``RUN@VARIANT`` (files ``<tag>@VARIANT.log``): same overrides, other
# conditions, described in T13v's notes
VARIANTS = {
    "trl-visible": "TRL 1.16 importable in every verl process (the other runs hid it, BLOGGAP_HIDE_TRL=1): verl's "
    "FSDP engine imports a value-head class TRL 1.16 no longer has, which the plugin skips",
    "before-log-handler": "before the plugin's logger had its own handler: vLLM's API routers set the root logger "
    "to ERROR in verl's TaskRunner, so the guard fired (gap/verl/all_rejected = 1) and its warning was lost",
}
RUNS = tuple(f"{p}/{k}" for p in PRESETS for k in RUN_KINDS) + ("arm_A", "arm_E", "arm_B", "arm_F")
RUN_EXTRAS = ("parallel", "concurrent_with", "attempts", "gpu_memory_utilization")  # how a run ran (its record)


def run_tag(run: str) -> str:
    """The file-name form of a run name (``geo_rs/fix`` -> ``geo_rs_fix``): its log, metrics, dump and Ray tag."""
    return run.replace("/", "_")


# ------------------------------------------------------------------------------------------------ parsing


def _number(text: str) -> float | None:
    """A value as verl's console logger prints it (``pprint.pformat`` of a number: ``0.5``, ``nan``, ``True``,
    ``np.float64(0.5)``, ``np.int64(3)``)."""
    text = text.strip()
    wrapped = re.fullmatch(r"(?:np|numpy)\.\w+\((.*)\)", text)
    if wrapped:
        text = wrapped.group(1)
    if text in ("True", "False"):
        return float(text == "True")
    try:
        return float(text)
    except ValueError:
        return None


def parse_console(text: str) -> list[dict]:
    """Per-step metrics from verl's console logger lines ``step:N - key:value - key:value ...``
    (``verl.utils.logger.aggregate_logger.concat_dict_to_str``), in order; non-numeric values dropped."""
    rows = []
    for line in text.splitlines():
        start = line.find("step:")
        if start < 0:
            continue
        parts = line[start:].split(" - ")
        head = _number(parts[0][len("step:"):])
        if head is None or not float(head).is_integer():
            continue
        row: dict = {"step": int(head)}
        for part in parts[1:]:
            key, sep, value = part.rpartition(":")
            number = _number(value)
            if sep and key and number is not None:
                row[key] = number
        rows.append(row)
    return rows


def parse_metrics_file(path: str | Path) -> list[dict]:
    """Per-step metrics from verl's ``file`` logger (JSON lines ``{"step": N, "data": {...}}``)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            rows.append({"step": int(record["step"]), **record["data"]})
    return rows


def registered_processes(text: str) -> dict[str, list[int]]:
    """Processes whose "registered" line is in the console text: ``{"driver": [pid], "TaskRunnerV1": [...],
    "WorkerDict": [...], ...}``. Ray prefixes a worker's lines with ``(Actor pid=N)``, or ``(pid=N)`` for lines
    printed before the process became an actor (the plugin registers at import, so most are of that kind): the
    actor's name is then taken from any other line of that pid; a line printed by an actor for a child process
    (``(vLLMHttpServer pid=N) ... registered (pid M)``) counts under that actor; never named: ``ray_worker``."""
    lines = [_ANSI.sub("", line) for line in text.splitlines()]
    names: dict[int, str] = {}
    for line in lines:
        match = _RAY_PREFIX.match(line)
        if match and match.group("actor"):
            names.setdefault(int(match.group("pid")), match.group("actor"))
    found: dict[str, list[int]] = {}
    for line in lines:
        at = line.find(REGISTERED)
        if at < 0:
            continue
        pid = int(re.match(r"\s*(\d+)", line[at + len(REGISTERED):]).group(1))
        match = _RAY_PREFIX.match(line)
        if match is None:
            actor = "driver"
        else:
            actor = names.get(pid) or match.group("actor") or names.get(int(match.group("pid"))) or "ray_worker"
        if pid not in found.setdefault(actor, []):
            found[actor].append(pid)
    return found


def step_table(rows: list[dict], preset: str) -> list[dict]:
    """The per-step quantities issue 13 asks for, from the metric rows of one run."""
    option = RS_OPTION[preset]
    keys = {
        "rejected_seq_frac": f"rollout_corr/rollout_rs_{option}_seq_masked_fraction",
        "all_rejected": "gap/verl/all_rejected",
        "log_kept_mass_mean": "gap/verl/log_kept_mass_mean",
        "kept_source": "gap/verl/kept_source",
        "is_floor_frac": "gap/verl/is_floor_frac",
        "is_weight_mean": "rollout_corr/rollout_is_mean",
        "reward": "critic/score/mean",
        "response_length": "response_length/mean",
        # gap_vanilla's metrics go through verl's actor, which prefixes them with "actor/"
        "oob_frac": "actor/gap/ratio/oob_frac",
        "abs_dlogp_mean": "actor/gap/ratio/abs_dlogp_mean",
        "abs_dlogp_max": "actor/gap/ratio/abs_dlogp_max",
        "clip_flip_frac": "actor/gap/clip/flip_frac",
        "clip_clipped_frac": "actor/gap/clip/clipped_frac",
        "pg_clipfrac": "actor/pg_clipfrac",
        "grad_norm": "actor/grad_norm",
        "rollout_probs_diff_mean": "training/rollout_probs_diff_mean",
        "step_s": "timing_s/step",
        "old_log_prob_s": "timing_s/old_log_prob",
        "update_actor_s": "timing_s/update_actor",
    }
    table = []
    for row in rows:
        entry = {"step": row["step"]}
        for name, key in keys.items():
            value = row.get(key)
            entry[name] = None if value is None or not math.isfinite(value) else value
        if entry["log_kept_mass_mean"] is not None:
            entry["kept_mass_mean_geo"] = math.exp(entry["log_kept_mass_mean"])
        table.append(entry)
    return table


# Ray's re-raises of a worker's error, and its metrics agent's start-up retries (logged, never fatal to a run)
_NOT_ROOT_CAUSES = ("RayTaskError", "ActorDiedError", "RpcError")
_ERROR_LINE = re.compile(r"\b([A-Z]\w*(?:Error|Exception)): (.+)$")


def failure_reason(log_text: str) -> str | None:
    """The first exception a failed run's console names (``Type: message``, Ray's wrappers skipped), cut to 140
    characters: verl prints the root cause (a vLLM engine error, a refused loss mode) before Ray's re-raises."""
    for line in _ANSI.sub("", log_text).splitlines():
        match = _ERROR_LINE.search(line)
        if match and "ray.exceptions" not in line and match.group(1) not in _NOT_ROOT_CAUSES:
            text = f"{match.group(1)}: {match.group(2).strip()}"
            return text if len(text) <= 140 else text[:139] + "…"
    return None


def summarise(run: str, log_text: str, metrics_path: Path, rc: int | None, wall_s: float,
              extra: dict | None = None) -> dict:
    """One run's record: exit code, wall time, registered processes, guard warnings, per-step table; ``extra``
    (how it ran: ``parallel``, ``concurrent_with``, ``attempts``, ``gpu_memory_utilization``) is kept as given."""
    spec = run_spec(run)
    rows = parse_metrics_file(metrics_path) if metrics_path.exists() else parse_console(log_text)
    registered = registered_processes(log_text)
    return {
        "run": run, "rc": rc, "wall_s": round(wall_s, 1), "preset": spec["preset"],
        "top_p": TOP_P_TRUNCATED if spec["truncated"] else 1.0, "plugin_disabled": spec["disable"],
        "recipes": spec["recipes"], "metrics_source": "file" if metrics_path.exists() else "console",
        "registered": registered,
        # the driver, the TaskRunner and at least one more Ray process (worker group, vLLM server, agent loop)
        "registered_in_driver_and_workers": "driver" in registered and len(registered) >= 3
        and any(name.startswith("TaskRunner") for name in registered),
        "guard_warnings": sum(GUARD in line for line in log_text.splitlines()),
        "steps": step_table(rows, spec["preset"]),
        "failure": failure_reason(log_text) if rc else None,
        **(extra or {}),
    }


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _r(value, digits: int = 3):
    return None if value is None else round(float(value), digits)


def resummarise(folder: Path, runs_json: dict) -> dict:
    """Every run of ``runs_json`` rebuilt from its ``<tag>.log`` and ``<tag>.metrics.jsonl`` under ``folder``
    with this version's parsers (keeping the exit code and wall time it recorded)."""
    records = {}
    for run, old in runs_json.get("runs", {}).items():
        tag = run_tag(run)
        log = folder / f"{tag}.log"
        if "rc" not in old or not log.exists():
            records[run] = old
            continue
        extra = {key: old[key] for key in RUN_EXTRAS if key in old}
        records[run] = summarise(run, log.read_text(errors="replace"), folder / f"{tag}.metrics.jsonl", old["rc"],
                                 old["wall_s"], extra)
    return records


def _ran(rec: dict) -> str:
    return "alone" if rec.get("parallel", 1) <= 1 else f"{rec['parallel']} at once"


def _median_after_first(values: list) -> float | None:
    """Median of a per-step time without step 1 (start-up: compilation, first weight sync)."""
    kept = [v for v in values[1:] or values if v is not None]
    return statistics.median(kept) if kept else None


def _all_rejected(step: dict) -> bool:
    """The guard's flag, or (plugin off: no flag) verl's own share of rejected sequences at 1."""
    flag = step.get("all_rejected")
    return bool(flag) if flag is not None else step.get("rejected_seq_frac") == 1.0


def _silent_guard_note(records: dict) -> str:
    """Names the plugin-on runs with more all-rejected steps than guard warnings (the warning was lost)."""
    silent = [run for run, rec in records.items() if not rec.get("plugin_disabled") and rec.get("steps")
              and sum(map(_all_rejected, rec["steps"])) > (rec.get("guard_warnings") or 0)]
    if not silent:
        return ""
    return (f" Guard fired with no warning line in: {', '.join(silent)} (runs before the plugin's own log handler; "
            "see the before-log-handler variant).")


RUN_COLUMNS = ("run", "preset", "rollout top_p", "plugin", "ran", "steps", "rc", "rejected seq share (mean)",
               "steps all rejected", "guard warnings", "IS weight (mean)", "kept mass (geo mean)", "reward step 1",
               "reward last", "gap oob_frac", "grad norm (mean)", "response tokens (mean)", "s/step (median)",
               "plugin registered in / why no step")  # T13v, one row per run record (_run_row)


def _run_row(run: str, rec: dict) -> list:
    guard_run = run.partition("@")[0].endswith("/guard")
    plugin = "off" if rec.get("plugin_disabled") else "on, lift off" if guard_run else "on"
    base = [run, rec.get("preset"), rec.get("top_p"), plugin, _ran(rec)]
    steps = rec.get("steps", [])
    if not steps:
        why = rec.get("skipped") or (f"failed: {rec['failure']}" if rec.get("failure") else "no step logged")
        head = base + [0, rec.get("rc")]
        return head + [None] * (len(RUN_COLUMNS) - len(head) - 1) + [why]
    col = {k: [s.get(k) for s in steps] for k in steps[0]}
    registered = rec.get("registered", {})
    return base + [
        len(steps), rec["rc"], _r(_mean(col["rejected_seq_frac"])), sum(map(_all_rejected, steps)),
        rec.get("guard_warnings"), _r(_mean(col.get("is_weight_mean", [])), 3),
        _r(_mean(col.get("kept_mass_mean_geo", [])), 4), _r(col["reward"][0]), _r(col["reward"][-1]),
        _r(_mean(col["oob_frac"]), 4), _r(_mean(col.get("grad_norm", [])), 3),
        _r(_mean(col.get("response_length", [])), 1), _r(_median_after_first(col["step_s"]), 2),
        "none: plugin disabled" if rec.get("plugin_disabled") else
        f"{sum(len(p) for p in registered.values())} processes: {', '.join(sorted(registered))}"]


STEPS_TABLES = {  # preset -> (table id, what the preset shows per step besides rejection and reward)
    "geo_rs": ("T13v-steps", "Geo-RS", ()),
    "seq_mis": ("T13v-steps-seqmis", "Seq-MIS", (("IS weight", "is_weight_mean", 3),)),
}


def _steps_table(records: dict, preset: str) -> dict | None:
    """Per step, the truncation runs of ``preset`` that logged steps: rejected share, kept mass (fix runs), the
    preset's extra quantities (Seq-MIS: mean IS weight), reward."""
    table_id, label, extras = STEPS_TABLES[preset]
    names = [r for r in RUNS if r.startswith(f"{preset}/") and r in records]
    runs = [r for r in names if records[r].get("steps")]
    if not runs:
        return None
    columns, getters = ["step"], []
    for run in runs:
        columns.append(f"{run} rejected")
        getters.append((run, "rejected_seq_frac", 3))
        if run.endswith("/fix"):
            columns.append(f"{run} kept mass")
            getters.append((run, "kept_mass_mean_geo", 4))
    for title, key, digits in extras:
        for run in runs:
            columns.append(f"{run} {title}")
            getters.append((run, key, digits))
    for run in runs:
        columns.append(f"{run} reward")
        getters.append((run, "reward", 3))
    rows = []
    for number in range(max(len(records[r]["steps"]) for r in runs)):
        row = [number + 1]
        for run, key, digits in getters:
            steps = records[run]["steps"]
            row.append(_r(steps[number].get(key), digits) if number < len(steps) else None)
        rows.append(row)
    missing = [f"{r} ({records[r].get('failure') or records[r].get('skipped') or 'no step logged'})"
               for r in names if not records[r].get("steps")]
    notes = "; ".join(f"{r}: {_ran(records[r])}" for r in runs) + "."
    if missing:
        notes += " Not in this table (no step logged): " + "; ".join(missing) + "."
    plotted = (" rejected", " reward") + tuple(f" {title}" for title, _, _ in extras)
    return {"id": table_id,
            "title": f"{label} per step: untruncated control vs top_p 0.8 without and with the truncation fix "
                     "(verl, H200)",
            "columns": columns, "rows": rows, "notes": notes, "reference": None, "random_init": False,
            "plot": {"kind": "line", "x": "step", "y": [c for c in columns if c.endswith(plotted)]}}


ARM_DTYPES = {"arm_A": "bf16 (verl default)", "arm_E": "bf16, fp32 head in the old-log-prob pass",
              "arm_B": "fp32 actor (param_dtype)", "arm_F": "fp16 actor (param_dtype)"}


def _arms_table(records: dict) -> dict | None:
    arms = [a for a in ARM_DTYPES if records.get(a, {}).get("steps")]
    if "arm_A" not in arms:
        return None
    medians = {}
    rows = []
    for arm in arms:
        steps = records[arm]["steps"]
        col = {k: [s.get(k) for s in steps] for k in steps[0]}
        medians[arm] = _median_after_first(col["step_s"])
        dlogp = [v for v in col["abs_dlogp_max"] if v is not None]
        rows.append([arm, ARM_DTYPES[arm], _ran(records[arm]), len(steps), _r(medians[arm], 2),
                     _r(medians[arm] / medians["arm_A"], 3) if medians[arm] and medians["arm_A"] else None,
                     _r(_median_after_first(col["old_log_prob_s"]), 2), _r(_median_after_first(col["update_actor_s"]), 2),
                     _r(_mean(col["rejected_seq_frac"])), sum(map(_all_rejected, steps)),
                     _r(_mean(col["oob_frac"]), 4), _r(col["abs_dlogp_mean"][0], 4), _r(max(dlogp), 4) if dlogp else None,
                     _r(_mean(col["rollout_probs_diff_mean"]), 4), _r(col["reward"][-1])])
    return {"id": "T13v-arms", "title": "Arms in verl: the actor's precision against arm A (untruncated Geo-RS, H200)",
            "columns": ["run", "actor precision", "ran", "steps", "s/step (median)", "vs arm_A", "old log-prob s",
                        "update s", "rejected seq share (mean)", "steps all rejected", "gap oob_frac (mean)",
                        "gap mean |dlogp| step 1", "gap max |dlogp|", "rollout vs actor |dp| (mean)", "reward last"],
            "rows": rows,
            "notes": "Times are verl's timing_s/* medians without step 1; runs marked 'N at once' shared the GPU, so "
                     "their times compare with each other, not with a run alone. gap oob_frac and max |dlogp|: "
                     "gap_vanilla's ratio of the training forward to the old log-probs (one mini-batch, one epoch): "
                     "0 when both passes compute the same numbers; arm E's old pass has an fp32 head and its "
                     "training forward the bf16 one, so its ratio is not exactly 1: its step-1 mean |dlogp| is what "
                     "the two heads differ by on the same rows (T13v-head, last column). rollout vs actor |dp|: verl's "
                     "training/rollout_probs_diff_mean (vLLM bf16 sampler vs the actor's old log-probs).",
            "reference": None, "random_init": False, "plot": False}


def result_tables(records: dict) -> list[dict]:
    """The issue-13 tables (``bloggap report`` renders them): one row per run, the per-step truncation view, the
    arms."""
    tables = [{
        "id": "T13v", "title": "verl 0.9.1 GRPO on the H200 with the bloggap plugin (vLLM 0.24 rollouts, FSDP actor, "
        "SmolLM2-135M, arithmetic task; rollout correction Geo-RS = seq_mean_k1 0.999_1.001, Seq-MIS = sequence IS "
        "2.0 + seq_sum_k1 0.5_2.0)",
        "columns": list(RUN_COLUMNS),
        "rows": [_run_row(run, rec) for run, rec in records.items()],
        "notes": "rejected seq share: verl's rollout_corr/rollout_rs_<option>_seq_masked_fraction per step (option "
                 "seq_mean_k1 for Geo-RS, seq_sum_k1 for Seq-MIS), mean over steps; steps all rejected: steps with "
                 "gap/verl/all_rejected = 1 (plugin on) or every sequence rejected (plugin off); guard warnings: the "
                 "guard's 'bloggap: rollout correction preset ...' lines in the driver's console; plugin 'on, lift "
                 "off': +bloggap.fix_truncation=false, the bug as verl has it with the guard watching; kept mass: exp of "
                 "gap/verl/log_kept_mass_mean (the fix's re-truncation); gap oob_frac: gap_vanilla's "
                 "actor/gap/ratio/oob_frac (ppo_mini_batch = train batch, one epoch: 0 expected unless the old pass "
                 "differs on purpose, arm E); s/step: timing_s/step without step 1; ran: alone, or N verl runs at "
                 "once on the one GPU (verl_live.py run --parallel N, 0.12 vLLM memory share each)."
                 + " IS weight: rollout_corr/rollout_is_mean, mean over steps (Seq-MIS only: the sequence weight "
                 "after its 2.0 cap; below 1 when the rollout log-probs are too high, as with truncation unlifted)."
                 + " grad norm: verl's actor/grad_norm, mean over steps (0: no sequence left to learn from); "
                 "response tokens: response_length/mean, mean over steps (Seq-MIS's seq_sum_k1 sums the log ratio "
                 "over them, so how far truncation pushes it grows with the length)."
                 + " rc –: killed at its time limit (--run-timeout) after the steps shown."
                 + "".join(f" {run}: {VARIANTS[run.partition('@')[2]]}." for run in records if "@" in run)
                 + _silent_guard_note(records),
        "reference": None, "random_init": False, "plot": False}]
    tables += [t for t in [*(_steps_table(records, preset) for preset in STEPS_TABLES), _arms_table(records)] if t]
    return tables


def head_table(head_check: dict) -> dict:
    """check-head's comparisons, one row per run."""
    rows = []
    for run, rep in head_check.items():
        rows.append([run, "fp32" if all(rep["dump_fp32_head"]) else "bf16", rep.get("scored_on"),
                     rep["vs_fp32_head"]["tokens"], _r(rep["vs_fp32_head"]["mean_abs_dlogp"], 4),
                     _r(rep["vs_bf16_head"]["mean_abs_dlogp"], 4), _r(rep["vs_fp32_head"]["p99_abs_dlogp"], 4),
                     _r(rep["vs_bf16_head"]["p99_abs_dlogp"], 4),
                     _r(rep.get("independent_head_diff", {}).get("mean_abs_dlogp"), 4)])
    return {"id": "T13v-head", "title": "Step 1's old log-probs from verl's engine vs an independent scoring of the "
            "same tokens (same padded layout), fp32 head and bf16 head",
            "columns": ["run", "engine head", "scored on", "tokens", "mean |d| vs fp32 head", "mean |d| vs bf16 head",
                        "p99 |d| vs fp32 head", "p99 |d| vs bf16 head", "fp32 vs bf16 head here (mean |d|)"],
            "rows": rows,
            "notes": "Inconclusive, on the CPU and on the GPU that made the dump alike: the bf16 body differs between "
                     "verl's FSDP forward and this HF forward of the same rows by ~0.02 mean |d|, more than the "
                     "heads differ, so the bf16-head dump (geo_rs/control) also reads 'closer' to the fp32 head. "
                     "The live evidence that arm E's engine override changes the old log-probs by the head is "
                     "T13v-arms: with the same rows and layout, arm A's training forward reproduces its old "
                     "log-probs exactly (gap |dlogp| 0) and arm E's differs by about what the heads differ by "
                     "here (last column: |fp32 head - bf16 head| of this forward, every position of the dumped "
                     "rows; gap_vanilla's covers response tokens only).",
            "reference": None, "random_init": False, "plot": False}
