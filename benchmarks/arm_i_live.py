"""Arm I on the path users run: TRL 1.16 GRPO with vLLM colocate, through the product's own entry points.

``run`` (GPU machine, vLLM installed) trains each requested run as a subprocess and writes its per-step JSONL log and
console log under ``--out``; after each run it rewrites ``--out/arm_i_live.json`` (table ``T16-armI-live``), so a
time limit keeps what finished. ``document`` rebuilds that document from the JSONL logs (here, from a packed copy).

Runs (``--runs``, comma-separated ``LABEL``; each is ``ENTRY_ARM_ni<K>[_b<N>][_graphs|_eager]``):

- entry ``train``: ``bloggap train recipes/arm_<ARM>.yaml --use_vllm --vllm_mode colocate`` (``GapGRPOTrainer``
  builds the engine with the arm's settings);
- entry ``callback``: a plain ``GRPOTrainer`` built inside ``vllm_colocate_engine(**engine_kwargs_for(gap))``, then
  ``GapCallback`` (the user's own script);
- ``ni<K>``: ``num_iterations`` K (1: TRL computes no old log-probs; 2: the arm's old log-probs drive the ratio);
- ``b<N>`` (optional): ``per_device_train_batch_size`` N (the recipe's 8 otherwise; with its gradient accumulation 2
  a generation holds 2N completions, and 32 completions of the arithmetic task's prompts exceed TRL's 4096 tokens
  per engine step);
- ``graphs`` / ``eager`` (optional, arms I and J): ``gap.vllm_launch`` ``decode_graphs`` / ``eager``; neither: the
  recipe's default (decode graphs for arms I and J; in documents written before that default, the eager engine).

What a row reports, from the JSONL (``gap/*`` metrics are logged on generating steps, or every step for the ratio):
sampler out-of-band share and bit-identical share (``gap/sampler/oob_frac``, ``gap/sampler/exact_frac``) over the
generations after the first, as the mean over generations and the worst generation;
``gap/ratio/oob_frac`` on the first iteration of each generation; the plugin's share of a generating step
(``gap/time/overhead_frac``) without step 1 (set-up) and step 1's apart; the median generating-step time.
Where the runs include arm J and arm A, a second table (``T16-armJ-live``, :func:`onpolicy_table`) compares them:
``gap/ratio/exact_frac`` per iteration, step times as a multiple of arm A's, reward and grad_norm.

Environment for arm I (its pieces call vLLM's batch-invariant matmuls): ``VLLM_BATCH_INVARIANT=1`` and
``TRITON_F32_DEFAULT=ieee``; ``run`` sets both for arm I and J ``callback`` runs (the user's own script) and for no
other run: ``bloggap train`` sets them itself for the arms that need them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from benchmarks._lib.paths import ROOT
from bloggap_plugin._io import atomic_write_text

TABLE_ID = "T16-armI-live"
RESULT_NAME = "arm_i_live.json"
COLUMNS = ["run", "entry", "arm", "num_iterations", "steps", "generations", "sampler oob % (mean)",
           "sampler oob % (worst generation)", "sampler max |dlogp| (all generations)",
           "sampler bit-identical % (mean)", "ratio oob % (first iteration, mean)",
           "plugin % of a generating step (median, step 1 apart)", "plugin % at step 1", "generating step s (median)",
           "old pass in place of TRL's, % of a generating step (median)"]
ONPOLICY_TABLE_ID = "T16-armJ-live"
ONPOLICY_COLUMNS = ["run", "arm", "steps", "sampler oob % (mean)", "sampler bit-identical % (mean)",
                    "ratio exact_frac, first iteration (min)", "ratio exact_frac, first iteration (mean)",
                    "ratio exact_frac, second iteration (mean)", "step s (median, after step 1)", "step x arm A",
                    "step s (mean, after step 1)", "mean step x arm A", "generating step s (median)",
                    "generating step x arm A", "other step s (median)", "other step x arm A", "reward (mean)",
                    "reward (mean, last 20 steps)", "grad_norm (median)"]
ARM_I_ENV = {"VLLM_BATCH_INVARIANT": "1", "TRITON_F32_DEFAULT": "ieee"}


LAUNCH_SUFFIXES = {"graphs": "decode_graphs", "eager": "eager"}
"""Run label suffix -> ``gap.vllm_launch`` (arms I and J)."""


def parse_label(label: str) -> dict:
    """``{"entry", "arm", "num_iterations"[, "per_device_train_batch_size"][, "vllm_launch"]}`` from
    ``ENTRY_ARM_ni<K>[_b<N>][_graphs|_eager]`` (e.g. ``train_I_ni2``; ``_b16``: per_device_train_batch_size 16
    instead of the recipe's; ``_graphs``: ``gap.vllm_launch: decode_graphs``; ``_eager``: ``gap.vllm_launch:
    eager``; neither: the recipe's default, ``auto``, which for arms I and J is decode graphs).

    Arm I and J labels without a launch suffix in result documents written before ``auto`` became the default
    (e.g. ``callback_I_ni2`` in ``results/h200/arm_i_live.json``, ``train_J_ni2`` in ``arm_j_live_eager.json``) ran
    the eager engine, the default then; those documents keep their labels."""
    parts = label.split("_")
    options = parts[3:]
    batch = options.pop(0) if options and options[0].startswith("b") else None
    launch = LAUNCH_SUFFIXES.get(options.pop(0)) if options else None
    if (len(parts) < 3 or parts[0] not in ("train", "callback") or not parts[2].startswith("ni")
            or not parts[2][2:].isdigit() or (batch is not None and not batch[1:].isdigit()) or options
            or (len(parts) > 3 + (batch is not None) + (launch is not None))):
        raise ValueError(f"run label {label!r}: expected ENTRY_ARM_ni<K>[_b<N>][_graphs|_eager], ENTRY train or "
                         "callback (e.g. train_I_ni2, train_I_ni2_b16, train_J_ni2_eager; no launch suffix: the "
                         "recipe's default, decode graphs for arms I and J)")
    spec = {"entry": parts[0], "arm": parts[1].upper(), "num_iterations": int(parts[2][2:])}
    if batch is not None:
        spec["per_device_train_batch_size"] = int(batch[1:])
    if launch is not None:
        if spec["arm"] not in ("I", "J"):
            raise ValueError(f"run label {label!r}: a launch suffix (_graphs, _eager) is only for arms I and J "
                             f"(gap.vllm_launch), arm {spec['arm']} runs TRL's engine: drop the suffix")
        spec["vllm_launch"] = launch
    return spec


def train_argv(label: str, model: str, steps: int, log_jsonl: Path, memory: float,
               profile_steps: str | None = None, profile_shapes: bool = False) -> list[str]:
    """The command line of one run (``python -m ...``); ``profile_steps`` (``FIRST-LAST``): a callback run also
    writes a torch profile of those steps beside its log (``LABEL.profile.txt``; train runs take none), with
    ``profile_shapes`` its matmuls by input shape too."""
    spec = parse_label(label)
    common = ["--model", model, "--max_steps", str(steps), "--log_jsonl", str(log_jsonl),
              "--num_iterations", str(spec["num_iterations"])]
    if "per_device_train_batch_size" in spec:
        common += ["--per_device_train_batch_size", str(spec["per_device_train_batch_size"])]
    recipe = f"recipes/arm_{spec['arm']}.yaml"
    if spec["entry"] == "train":
        launch = ["--gap_overrides", f"{{vllm_launch: {spec['vllm_launch']}}}"] if "vllm_launch" in spec else []
        return [sys.executable, "-m", "bloggap_plugin.cli", "train", recipe, *common, *launch, "--use_vllm", "true",
                "--vllm_mode", "colocate", "--vllm_gpu_memory_utilization", str(memory)]
    launch = ["--vllm_launch", spec["vllm_launch"]] if "vllm_launch" in spec else []
    if profile_steps:
        launch += ["--profile", str(log_jsonl.with_suffix(".profile.txt")), "--profile-steps", profile_steps]
        launch += ["--profile-shapes"] if profile_shapes else []
    return [sys.executable, "-m", "benchmarks.arm_i_live", "callback", recipe, *common, *launch, "--memory",
            str(memory)]


def callback_main(args: argparse.Namespace) -> int:
    """The user's own script: a plain GRPOTrainer (engine built with the arm's settings), then GapCallback."""
    import warnings

    from trl import GRPOTrainer

    from bloggap_plugin.models import load_model
    from bloggap_plugin.tasks import get_task
    from bloggap_plugin.trl import GapCallback, engine_kwargs_for, vllm_colocate_engine
    from bloggap_plugin.trl.run import JsonlLogger, prepare_run

    overrides = {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": args.memory,
                 "num_iterations": args.num_iterations}
    if args.learning_rate is not None:
        overrides["learning_rate"] = args.learning_rate
    if args.per_device_train_batch_size is not None:
        overrides["per_device_train_batch_size"] = args.per_device_train_batch_size
    plan = prepare_run(args.recipe, model=args.model, max_steps=args.max_steps, log_jsonl=args.log_jsonl,
                       extra_overrides=overrides,
                       gap_overrides={"vllm_launch": args.vllm_launch} if args.vllm_launch else None)
    policy, tokenizer = load_model(args.model, dtype=plan.dtype, device=plan.device)
    policy.train()
    dataset, rewards = get_task("arith", tokenizer, seed=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*activation_checkpointing.*")
        with vllm_colocate_engine(**engine_kwargs_for(plan.gap)):
            trainer = GRPOTrainer(model=policy, reward_funcs=rewards, args=plan.args, train_dataset=dataset,
                                  processing_class=tokenizer, callbacks=[JsonlLogger(args.log_jsonl)])
    trainer.add_callback(GapCallback(trainer, gap=plan.gap))
    if args.profile:
        from benchmarks._lib.profile import StepProfiler

        first, last = _step_range(args.profile_steps)
        trainer.add_callback(StepProfiler(args.profile, first, last, shapes=args.profile_shapes))
    if args.dump:
        _dump_generations(trainer, args.dump, args.dump_generations)
    trainer.train()
    return 0


def _step_range(text: str) -> tuple[int, int]:
    """``(first, last)`` from ``FIRST-LAST`` (or one step ``N``)."""
    first, _, last = str(text).partition("-")
    try:
        return int(first), int(last or first)
    except ValueError:
        raise ValueError(f"--profile-steps {text!r}: expected FIRST-LAST, e.g. 10-11") from None


def _dump_generations(trainer, path: str, limit: int) -> None:
    """Save the first ``limit`` generation batches (CPU tensors the loss reads) and the engine's settings to
    ``path`` (a ``torch.save`` dict), for locating where arm I and the sampler differ."""
    import torch

    from bloggap_plugin.trl.colocate_reads import colocate_engine_setting

    saved: dict = {"engine": {name: colocate_engine_setting(trainer, name)
                              for name in ("enforce_eager", "enable_prefix_caching", "dtype", "max_num_seqs",
                                           "max_num_batched_tokens", "max_model_len")},
                   "batches": []}
    saved["engine"] = {k: str(v) for k, v in saved["engine"].items()}
    original = trainer._generate_and_score_completions

    def spy(inputs):
        output = original(inputs)
        if len(saved["batches"]) < limit:
            saved["batches"].append({k: v.detach().cpu() for k, v in output.items() if torch.is_tensor(v)})
            torch.save(saved, path)
        return output

    trainer._generate_and_score_completions = spy


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _pct(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(100 * value, digits)


def _values(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records if isinstance(r.get(key), (int, float))]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _update_values(records: list[dict], statistic: str) -> list[float]:
    """The update's ratio ``statistic`` on steps after an optimizer step: ``gap/update/<statistic>``, or in logs
    written before the plugin split the ratio, ``gap/ratio/<statistic>`` (then logged on every step)."""
    values = [r.get(f"gap/update/{statistic}", r.get(f"gap/ratio/{statistic}")) for r in records]
    return [v for v in values if isinstance(v, (int, float))]


def generating_records(records: list[dict]) -> list[dict]:
    """A run's records of the optimizer steps that generated (they carry ``gap/sampler/*``), in order."""
    return [r for r in records if r.get("gap/sampler/oob_frac") is not None]


def summarize(label: str, records: list[dict]) -> dict:
    """One row's numbers from a run's JSONL records (see the module docstring)."""
    spec = parse_label(label)
    generating = generating_records(records)
    others = [r for r in records[1:] if r.get("gap/sampler/oob_frac") is None]
    ratio_exact_first = _values(generating, "gap/ratio/exact_frac")
    later = generating[1:] if len(generating) > 1 else generating
    sampler = [r["gap/sampler/oob_frac"] for r in later]
    exact = [r["gap/sampler/exact_frac"] for r in later if r.get("gap/sampler/exact_frac") is not None]
    ratio = [r["gap/ratio/oob_frac"] for r in generating if r.get("gap/ratio/oob_frac") is not None]
    overhead = [r["gap/time/overhead_frac"] for r in generating[1:] if r.get("gap/time/overhead_frac") is not None]
    step_time = [r["step_time"] for r in generating[1:] if isinstance(r.get("step_time"), (int, float))]
    old_pass = [r["gap/time/old_pass_s"] / r["step_time"] for r in generating[1:]
                if r.get("gap/time/old_pass_s") is not None and r.get("step_time")]
    first = generating[0] if generating else {}
    return {
        **spec,
        "steps": len(records),
        "generations": len(generating),
        "sampler_oob_mean": statistics.fmean(sampler) if sampler else None,
        "sampler_oob_max": max(sampler) if sampler else None,
        "sampler_exact_mean": statistics.fmean(exact) if exact else None,
        "sampler_abs_dlogp_max": max((r["gap/sampler/abs_dlogp_max"] for r in generating
                                      if r.get("gap/sampler/abs_dlogp_max") is not None), default=None),
        "sampler_oob_first_generation": first.get("gap/sampler/oob_frac"),
        "ratio_oob_first_iteration_mean": statistics.fmean(ratio) if ratio else None,
        "overhead_median": statistics.median(overhead) if overhead else None,
        "overhead_step1": first.get("gap/time/overhead_frac"),
        "generating_step_s_median": statistics.median(step_time) if step_time else None,
        "old_pass_median": statistics.median(old_pass) if old_pass else None,
        "ratio_exact_first_iteration_min": min(ratio_exact_first) if ratio_exact_first else None,
        "ratio_exact_first_iteration_mean": _mean(ratio_exact_first),
        "ratio_exact_later_iterations_mean": _mean(_update_values(others, "exact_frac")),
        "step_s_median": _median(_values(records[1:], "step_time")),
        "step_s_mean": _mean(_values(records[1:], "step_time")),
        "other_step_s_median": _median(_values(others, "step_time")),
        "reward_mean": _mean(_values(records, "reward")),
        "reward_last20_mean": _mean(_values(records[-20:], "reward")),
        "grad_norm_median": _median(_values(records, "grad_norm")),
        "per_generation": [{k: r.get(k) for k in ("step", "gap/sampler/oob_frac", "gap/sampler/exact_frac",
                                                   "gap/ratio/oob_frac", "gap/time/overhead_frac", "step_time")}
                           for r in generating],
    }


def table(rows: dict) -> dict:
    body = []
    for label, row in rows.items():
        if "error" in row:
            body.append([label, *[None] * (len(COLUMNS) - 1)])
            continue
        body.append([label, row["entry"], row["arm"], row["num_iterations"], row["steps"], row["generations"],
                     _pct(row["sampler_oob_mean"]), _pct(row["sampler_oob_max"]),
                     None if row.get("sampler_abs_dlogp_max") is None else float(f"{row['sampler_abs_dlogp_max']:.3g}"),
                     _pct(row["sampler_exact_mean"], 2),
                     _pct(row["ratio_oob_first_iteration_mean"]), _pct(row["overhead_median"], 2),
                     _pct(row["overhead_step1"], 1),
                     None if row["generating_step_s_median"] is None else round(row["generating_step_s_median"], 3),
                     _pct(row.get("old_pass_median"), 2)])
    return {"id": TABLE_ID, "title": "Arm I live: TRL 1.16 GRPO, vLLM 0.26 colocate, through bloggap train / GapCallback",
            "columns": COLUMNS, "rows": body, "reference": None, "random_init": False,
            "notes": "Sampler columns over the generations after the first (the first is in per_generation); ratio "
                    "out-of-band on the first iteration of each generation (num_iterations 1: the ratio is new/new). "
                    "Plugin share of a generating step: gap/time/overhead_frac, steps after the first. Old pass in "
                    "place of TRL's: gap/time/old_pass_s over the step time, where the arm replaces TRL's own "
                    "old-logprob pass (TRL's cost, outside the plugin's share; empty where it ran both)."
                    + "".join(f" {label}: {row['note']}." for label, row in rows.items() if row.get("note"))}


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _times(value: float | None, reference: float | None) -> float | None:
    return None if value is None or not reference else round(value / reference, 3)


def onpolicy_table(rows: dict) -> dict | None:
    """``T16-armJ-live``: arm J (the exactly on-policy arm) against arm A on the same runs' JSONL, one row per arm A
    or J run; step times also as a multiple of the first arm A row's: the generating step's for every row, the
    median over all steps only for a row with the arm A row's ``num_iterations`` (with 1 every step generates, so its
    median is a generating step's, not comparable with a median that mixes both kinds). Without an arm A row the
    multiples are empty (arm J's own numbers stand). ``None`` unless ``rows`` hold an arm J row that ran."""
    ran = {label: row for label, row in rows.items() if "error" not in row and row.get("arm") in ("A", "J")}
    reference = next(((label, row) for label, row in ran.items() if row["arm"] == "A"), None)
    if not any(row["arm"] == "J" for row in ran.values()):
        return None
    base = {} if reference is None else reference[1]
    body = []
    for label, row in ran.items():
        comparable = row.get("num_iterations") == base.get("num_iterations")
        body.append([label, row["arm"], row["steps"], _pct(row["sampler_oob_mean"]), _pct(row["sampler_exact_mean"], 2),
                     _round(row.get("ratio_exact_first_iteration_min"), 4),
                     _round(row.get("ratio_exact_first_iteration_mean"), 4),
                     _round(row.get("ratio_exact_later_iterations_mean"), 4),
                     _round(row.get("step_s_median"), 3),
                     _times(row.get("step_s_median") if comparable else None, base.get("step_s_median")),
                     _round(row.get("step_s_mean"), 3),
                     _times(row.get("step_s_mean") if comparable else None, base.get("step_s_mean")),
                     _round(row["generating_step_s_median"], 3),
                     _times(row["generating_step_s_median"], base.get("generating_step_s_median")),
                     _round(row.get("other_step_s_median"), 3),
                     _times(row.get("other_step_s_median"), base.get("other_step_s_median")),
                     _round(row.get("reward_mean"), 4), _round(row.get("reward_last20_mean"), 4),
                     _round(row.get("grad_norm_median"), 3)])
    return {"id": ONPOLICY_TABLE_ID,
            "title": "Arm J live (training forward in vLLM's numbers) against arm A: exact ratio, step time, reward",
            "columns": ONPOLICY_COLUMNS, "rows": body, "reference": None, "random_init": False,
            "plot": False if reference is None else {
                "kind": "bar", "x": "run", "y": ["step x arm A", "generating step x arm A", "other step x arm A"],
                "title": "Step time as a multiple of arm A's", "ylabel": "x arm A"},
            "notes": "From each run's JSONL. Sampler columns over the generations after the first. ratio exact_frac: "
                     "gap/ratio/exact_frac (share of completion tokens whose new log-prob equals the old one bit "
                     "for bit), on the first iteration of each generation (the generating steps) and on the steps "
                     "that do not generate (num_iterations 2: the second iteration, after an optimizer step). Step "
                     "times: medians of step_time over every step after step 1, over the generating steps after "
                     "step 1 and over the other steps, and the mean over every step after step 1 (the run's time "
                     "for those steps over their number: its cost; with num_iterations 2 the steps take two sizes "
                     "and the median over all of them can fall anywhere between the two); 'x arm A': divided by "
                     + (f"the same statistic of {reference[0]}; 'step x arm A' and 'mean step x arm A' only for a "
                        "run with its num_iterations (with 1 every step generates)." if reference is not None else
                        "the same statistic of an arm A run of the same file: there is none here, so no multiple.")
                     + " Reward: the generating steps' reward, over the whole run and over its last 20 "
                     "steps (compare runs of the same length). grad_norm: median over all steps."}


def document(rows: dict, params: dict, env: dict) -> dict:
    """The result document: ``T16-armI-live`` over every row, and ``T16-armJ-live`` where the rows hold arm J and
    arm A runs (:func:`onpolicy_table`)."""
    from bloggap_plugin.results import SCHEMA_VERSION

    onpolicy = onpolicy_table(rows)
    return {"benchmark": "arm_i_live", "schema_version": SCHEMA_VERSION, "env": env, "params": params, "results": rows,
            "tables": [table(rows)] + ([onpolicy] if onpolicy is not None else [])}


def _env() -> dict:
    from bloggap_plugin.envinfo import environment_record

    try:
        import vllm

        version = vllm.__version__
    except ImportError:
        version = None
    return environment_record("cuda", vllm=version, **{k: os.environ.get(k) for k in ARM_I_ENV})


def run_env(label: str, environ: dict) -> dict:
    """The environment of run ``label``: ``environ`` without :data:`ARM_I_ENV`, to which a ``callback`` run (the
    user's own script) of an arm whose plan computes vLLM's numbers (I, J) adds it, as its user would export it; a
    ``train`` run gets neither, since ``bloggap train`` sets what its arm needs itself."""
    from bloggap_plugin.core.arms import get_arm
    from bloggap_plugin.core.plans import arm_plan_entry

    spec = parse_label(label)
    env = {k: v for k, v in environ.items() if k not in ARM_I_ENV}
    entry = arm_plan_entry(get_arm(spec["arm"]))
    if spec["entry"] == "callback" and entry is not None and entry.takes_pieces:
        env.update(ARM_I_ENV)
    return env


def run_main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: dict = {}
    params = {"model": "SmolLM2-135M-Instruct", "steps": args.steps, "runs": args.runs, "memory": args.memory}
    env = _env()
    for label in args.runs.split(","):
        spec = parse_label(label)
        log_jsonl = out / f"{label}.jsonl"
        argv = train_argv(label, args.model, args.steps, log_jsonl, args.memory, args.profile_steps, args.profile_shapes)
        child_env = run_env(label, os.environ)
        started = time.perf_counter()
        with open(out / f"{label}.log", "w") as console:
            code = subprocess.call(argv, cwd=ROOT, env=child_env, stdout=console, stderr=subprocess.STDOUT)
        seconds = time.perf_counter() - started
        if code != 0 or not log_jsonl.exists():
            rows[label] = {**spec, "error": f"exit {code}", "seconds": seconds,
                           "log_tail": (out / f"{label}.log").read_text()[-3000:]}
        else:
            rows[label] = {**summarize(label, _records(log_jsonl)), "seconds": seconds, "argv": argv[1:]}
        atomic_write_text(out / RESULT_NAME, json.dumps(document(rows, params, env), indent=1))
        print(label, "exit", code, f"{seconds:.0f} s", {k: v for k, v in rows[label].items()
                                                        if k not in ("per_generation", "log_tail", "argv")}, flush=True)
    return 0


def document_main(args: argparse.Namespace) -> int:
    """Rebuild the rows from the JSONL logs in ``--logs`` (a folder or a ``.tar.xz``), keeping params, env and the
    document's keys beyond the schema (``superseded_by``)."""
    old = json.loads(Path(args.result).read_text())
    logs = {}
    if str(args.logs).endswith(".tar.xz"):
        with tarfile.open(args.logs, "r:xz") as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.endswith(".jsonl"):
                    text = tar.extractfile(member).read().decode()
                    logs[Path(member.name).stem] = [json.loads(x) for x in text.splitlines() if x.strip()]
    else:
        logs = {p.stem: _records(p) for p in sorted(Path(args.logs).glob("*.jsonl"))}
    rows = {}
    for label, row in old["results"].items():
        if label in logs:
            rows[label] = {**summarize(label, logs[label]),
                           **{k: row[k] for k in ("seconds", "argv", "note") if k in row}}
        else:
            rows[label] = row
    rebuilt = document(rows, old["params"], old["env"])
    rebuilt.update({k: v for k, v in old.items() if k not in rebuilt})  # the file's own keys (superseded_by)
    atomic_write_text(Path(args.result), json.dumps(rebuilt, indent=1) + "\n")
    return 0


def _collect_rows(folders: list[Path], fallback: dict, notes: dict) -> dict:
    """Rows from every ``LABEL.jsonl`` under ``folders`` (a later folder's run replaces an earlier one's), then the
    rows of ``fallback`` (a ``run`` document's results) for labels without a log; ``notes`` (label -> text) added."""
    rows = {}
    for folder in folders:
        for path in sorted(folder.glob("*.jsonl")):
            rows[path.stem] = summarize(path.stem, _records(path))
    for label, row in fallback.items():
        rows.setdefault(label, {**row, "note": "JSONL not kept: row as the run's own document wrote it"})
    for label, text in notes.items():
        rows[label]["note"] = "; ".join(x for x in (rows[label].get("note"), text) if x)
    return rows


def _pack_logs(folders: list[Path], labels: list[str], pack: Path, model_path: str) -> None:
    """``LABEL.jsonl`` and ``LABEL.log`` of ``labels`` into ``pack`` (tar.xz), machine paths replaced and console
    logs without progress bars. A later folder's file replaces an earlier one's of the same name, as its run
    replaces the row (:func:`_collect_rows`): the pack holds the logs of the rows, each name once."""
    from benchmarks._lib.publish import pack_text_files

    files = {path.name: path for folder in folders for path in sorted(folder.iterdir())
             if path.stem in labels and path.suffix in (".jsonl", ".log")}
    pack_text_files(files.values(), pack, model_path, "<SmolLM2 dense folder>")


def collect_main(args: argparse.Namespace) -> int:
    """One result document from the run folders of several device calls (``--runs``, in order), with the env of a
    ``run`` document written on that machine (``--env``), the code revision that ran (``--revision``), and the logs
    packed beside it (``--pack``)."""
    from benchmarks._lib.publish import strip_paths

    folders = [Path(f) for f in args.runs]
    source = json.loads(Path(args.env).read_text())
    fallback = {k: v for k, v in source.get("results", {}).items() if not any((f / f"{k}.jsonl").exists()
                                                                                for f in folders)}
    notes = dict(note.split("=", 1) for note in args.note)
    rows = _collect_rows(folders, fallback if args.keep_unlogged else {}, notes)
    params = {"model": "SmolLM2-135M-Instruct", "steps": args.steps, "runs": ",".join(rows),
              "memory": source.get("params", {}).get("memory"), "revision": args.revision}
    document_text = json.dumps(document(rows, params, source["env"]), indent=1) + "\n"
    atomic_write_text(Path(args.result), strip_paths(document_text, args.model_path, "<SmolLM2 dense folder>"))
    if args.pack:
        _pack_logs(folders, list(rows), Path(args.pack), args.model_path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train each run (GPU, vLLM) and write the document")
    run.add_argument("--model", required=True)
    run.add_argument("--out", required=True)
    run.add_argument("--steps", type=int, default=30)
    run.add_argument("--runs", default="train_I_ni2,train_I_ni1,train_A_ni2")
    run.add_argument("--memory", type=float, default=0.25)
    run.add_argument("--profile-steps", default=None, help="FIRST-LAST: callback runs write LABEL.profile.txt")
    run.add_argument("--profile-shapes", action="store_true", help="the profiles also list the matmuls by input shape")
    cb = sub.add_parser("callback", help="one GapCallback run (what run starts for callback_* labels)")
    cb.add_argument("recipe")
    cb.add_argument("--model", required=True)
    cb.add_argument("--max_steps", type=int, required=True)
    cb.add_argument("--log_jsonl", required=True)
    cb.add_argument("--num_iterations", type=int, required=True)
    cb.add_argument("--memory", type=float, default=0.25)
    cb.add_argument("--learning_rate", type=float, default=None)
    cb.add_argument("--per_device_train_batch_size", type=int, default=None)
    cb.add_argument("--vllm_launch", default=None, help="gap.vllm_launch (arms I and J)")
    cb.add_argument("--profile", default=None, help="write a torch profile of --profile-steps here")
    cb.add_argument("--profile-steps", default="10-11", help="FIRST-LAST (optimizer steps, 1-based)")
    cb.add_argument("--profile-shapes", action="store_true", help="also the matmuls by input shape (record_shapes)")
    cb.add_argument("--dump", default=None, help="save the first generation batches here (torch.save)")
    cb.add_argument("--dump_generations", type=int, default=6)
    doc = sub.add_parser("document", help="rebuild the rows from JSONL logs")
    doc.add_argument("result")
    doc.add_argument("--logs", required=True)
    col = sub.add_parser("collect", help="one document from the run folders of several device calls")
    col.add_argument("result")
    col.add_argument("--runs", action="append", required=True, help="a folder of LABEL.jsonl / LABEL.log (repeat)")
    col.add_argument("--env", required=True, help="a run document written on the machine that ran them")
    col.add_argument("--revision", required=True, help="the commit the runs ran")
    col.add_argument("--steps", type=int, default=30, help="steps each run was started with")
    col.add_argument("--note", action="append", default=[], help="LABEL=TEXT added to that row (repeat)")
    col.add_argument("--keep-unlogged", action="store_true",
                     help="keep --env's rows for runs whose JSONL did not come back")
    col.add_argument("--pack", default=None, help="tar.xz for the runs' logs")
    col.add_argument("--model-path", default="/tmp/vx/smollm2", help="the model folder on the GPU machine")
    args = parser.parse_args(argv)
    return {"run": run_main, "callback": callback_main, "document": document_main,
            "collect": collect_main}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
