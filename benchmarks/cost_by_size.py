"""Step cost by model size: arms A, H, I, J through ``bloggap train`` with TRL's colocate vLLM, as a user runs them.

``shape NAME --tokenizer DIR --out DIR`` (GPU machine): a random-init model folder of shape ``NAME``
(``benchmarks/_lib/shapes.py``, the ``-v49k`` shapes: SmolLM2's vocabulary) with the tokenizer of ``DIR`` (the SmolLM2
folder), bf16 safetensors, eos = pad as in that folder. Random init is for time and exactness, not for gap rates.

``run --model LABEL=DIR ... --arms A,I,J --repeats 3 --steps 30 --out OUT`` (GPU machine, vLLM installed): per model
in the order given, ``repeats`` rounds over the arms (A I J A I J ...), each run a subprocess
``bloggap train recipes/arm_X.yaml --use_vllm true --vllm_mode colocate`` with ``num_iterations`` 2 and the arith
task's length reward (non-zero advantages on a random-init model, so the backward does a real step's work); its
JSONL and console log go under ``OUT/LABEL/``, and ``OUT/cost_by_size.json`` is rewritten after each run, so a time
limit keeps what finished. Nothing is exported for arms I and J: ``bloggap train`` sets what they need. An arm
written ``I:process`` runs arm I with ``BLOGGAP_VLLM_BATCH_INVARIANCE=process`` (vLLM's batch-invariant mode left on
for the whole process, as before the plugin confined it): the route's before; ``J:tiles`` runs arm J with the tile
table of ``--matmul-tiles FILE`` (``bloggap tiles`` writes one) named by the recipe field, ``--gap_overrides
'{matmul_tiles: FILE}'``, as a user names it (:mod:`bloggap_plugin.core.vllm.tile_table`); ``J:dense_attention``
runs arm J with ``BLOGGAP_ATTENTION_GRADIENT=dense`` (the attention gradient's dense closed form for every call: the
by-entry route's before). ``--budget-s``: the call stops at the first run whose expected length (the last run of
that arm and model, else the longest so far)
exceeds the time left, so the runs keep their interleaved order; ``params.skipped`` lists the runs left for the next
call. A ``run`` into an ``OUT`` that holds a document keeps its finished runs and starts only the others.

``collect OUT ... --out FILE --revision R``: the result document, table ``T19-cost-by-size`` (:func:`size_table`);
``--real LABEL`` (a model with real weights, e.g. ``smollm2-135m``) adds the live per-arm table of that model
(:func:`live_arms_table`: sampler gap, first-iteration ratio gap, step multiple, and with ``--sweep FILE`` the
reward verdict of a ``bloggap compare`` sweep's declared analysis).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import time
from pathlib import Path

from benchmarks import arm_i_live
from benchmarks._lib.paths import ROOT
from benchmarks.arm_i_live import _round, _times
from bloggap_plugin._io import atomic_write_text
from bloggap_plugin.core.vllm.autograd import ATTENTION_GRADIENT_ENV
from bloggap_plugin.core.vllm.tile_table import TILES_ENV

TABLE_ID = "T19-cost-by-size"
RESULT_NAME = "cost_by_size.json"
SCOPE_ENV = "BLOGGAP_VLLM_BATCH_INVARIANCE"
COLUMNS = ["arm @ model", "runs", "steps per run", "step 1 s (mean)", "step s (median)", "median step x arm A",
           "median x A, runs (min-max)", "step s (mean)", "mean step x arm A", "mean x A, runs (min-max)",
           "generating step x arm A (median)", "training-only step x arm A (median)",
           "sampler bit-identical % (least run)", "ratio exact_frac, first iteration (least)",
           "training-only step s (median)", "generation s (median)", "old pass s (median)"]


VLLM_WORKSPACES = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}
"""The cuBLAS(Lt) workspace sizes vLLM 0.26's batch-invariant start-up sets on Hopper (``enable_batch_invariant_mode``):
a run written ``ARM:vllm_workspaces`` exports them, so that torch sizes every cuBLAS matmul of the run with them (a
harness variant: what arm I's trainer matmuls ran with before the plugin fixed the trainer's sizes first)."""


SCOPES = ("process", "engine", "vllm_workspaces", "tiles", "dense_attention")
"""What an ``ARM:SCOPE`` run changes (:func:`parse_arm`); scopes join with ``+`` (``J:tiles+dense_attention``)."""


def parse_arm(text: str) -> tuple[str, str | None]:
    """``"I"`` -> ``("I", None)``; ``"I:process"`` -> ``("I", "process")`` (the batch-invariance scope to run with);
    ``"A:vllm_workspaces"`` -> ``("A", "vllm_workspaces")`` (:data:`VLLM_WORKSPACES` exported); ``"J:tiles"`` ->
    ``("J", "tiles")`` (the ``--matmul-tiles`` table installed, :data:`TILES_ENV`); ``"J:tiles+dense_attention"`` ->
    ``("J", "tiles+dense_attention")`` (both; :data:`SCOPES`, each at most once, at most one of process and
    engine)."""
    arm, _, scope = text.partition(":")
    parts = scope.split("+") if scope else []
    if (arm not in ("A", "B", "C", "D", "E", "F", "G", "H", "I", "J") or any(p not in SCOPES for p in parts)
            or len(set(parts)) != len(parts) or {"process", "engine"} <= set(parts)):
        raise ValueError(f"arm {text!r}: expected a letter A-J, optionally :SCOPE with SCOPE one of "
                         f"{', '.join(SCOPES)} or several joined by + (e.g. I:process, J:tiles+dense_attention)")
    return arm, scope or None


def arm_scopes(arm_text: str) -> set[str]:
    """The scopes of an arm's text (:func:`parse_arm`): ``"J:tiles+dense_attention"`` -> ``{"tiles",
    "dense_attention"}``."""
    scope = parse_arm(arm_text)[1]
    return set(scope.split("+")) if scope else set()


def run_label(arm_text: str, repeat: int) -> str:
    """The file stem of one run: ``J-2``, ``I_process-1``, ``J_tiles_dense_attention-1``."""
    return f"{arm_text.replace(':', '_').replace('+', '_')}-{repeat}"


def run_argv(arm_text: str, model: str, steps: int, log_jsonl: Path, memory: float,
             tiles: str | None = None) -> list[str]:
    """``bloggap train`` for one run (:func:`benchmarks.arm_i_live.train_argv` of ``train_ARM_ni2``, which passes no
    ``--gap_overrides``, plus the length reward); an ``ARM:tiles`` run names the tile table ``tiles`` (made absolute:
    runs start in the checkout) with ``--gap_overrides '{matmul_tiles: FILE}'``, as a user names it."""
    arm, _ = parse_arm(arm_text)
    argv = arm_i_live.train_argv(f"train_{arm}_ni2", model, steps, log_jsonl, memory)
    table = run_tiles(arm_text, tiles)
    if table is not None:
        argv += ["--gap_overrides", json.dumps({"matmul_tiles": table})]
    return argv + ["--task_kwargs", "{reward: length}"]


def run_tiles(arm_text: str, tiles: str | None) -> str | None:
    """The absolute path of the tile table an ``ARM:tiles`` run names (``tiles``, required there), else ``None``."""
    if "tiles" not in arm_scopes(arm_text):
        return None
    if not tiles:
        raise ValueError(f"arm {arm_text!r} runs with a tile table: give its file with --matmul-tiles "
                         "(bloggap tiles --model MODEL --out FILE writes one)")
    return str(Path(tiles).resolve())


def run_environment(arm_text: str, environ: dict) -> dict:
    """``environ`` without vLLM's batch-invariance variables (``bloggap train`` sets them), cuBLAS workspace
    variables, a tile table's variable (an ``ARM:tiles`` run names its table in :func:`run_argv`) or the attention
    gradient's; for ``ARM:vllm_workspaces`` with :data:`VLLM_WORKSPACES`, for ``ARM:dense_attention`` with
    ``ATTENTION_GRADIENT_ENV=dense``, for another ``ARM:SCOPE`` but ``tiles`` with :data:`SCOPE_ENV` set to
    ``SCOPE``."""
    scopes = arm_scopes(arm_text)
    drop = (*arm_i_live.ARM_I_ENV, SCOPE_ENV, *VLLM_WORKSPACES, TILES_ENV, ATTENTION_GRADIENT_ENV)
    env = {k: v for k, v in environ.items() if k not in drop}
    if "vllm_workspaces" in scopes:
        env.update(VLLM_WORKSPACES)
    if "dense_attention" in scopes:
        env[ATTENTION_GRADIENT_ENV] = "dense"
    for scope in scopes & {"process", "engine"}:
        env[SCOPE_ENV] = scope
    return env


def summarize_run(arm_text: str, records: list[dict]) -> dict:
    """One run's numbers from its JSONL records (step 1 apart)."""
    arm, _ = parse_arm(arm_text)
    row = arm_i_live.summarize(f"train_{arm}_ni2", records)
    first = records[0].get("step_time") if records else None
    keep = ("steps", "generations", "step_s_median", "step_s_mean", "generating_step_s_median",
            "other_step_s_median", "sampler_exact_mean", "sampler_abs_dlogp_max", "ratio_exact_first_iteration_min",
            "ratio_exact_first_iteration_mean", "reward_mean", "grad_norm_median", "sampler_oob_mean",
            "ratio_oob_first_iteration_mean")
    later = arm_i_live.generating_records(records)[1:]  # the generating steps after the first, as for the step time
    seconds = {f"{name}_s_median": arm_i_live._median(arm_i_live._values(later, f"gap/time/{name}_s"))
               for name in ("generate", "old_pass")}
    return {"arm": arm_text, **{k: row.get(k) for k in keep}, **seconds, "step1_s": first}


def _ratio_stats(values: list[float], reference: float | None) -> tuple:
    if not values or not reference:
        return None, None
    ratios = [v / reference for v in values]
    return round(statistics.fmean(values) / reference, 3), f"{min(ratios):.2f}-{max(ratios):.2f}"


def _mean_of(runs: list[dict], key: str) -> float | None:
    return arm_i_live._mean(arm_i_live._values(runs, key))


_EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception)): (.*)$")


def failure_cause(log_tail: str) -> str | None:
    """The last exception line of a failed run's console tail as ``Type: message``, the message cut after its first
    sentence (``torch.OutOfMemoryError: CUDA out of memory``); ``None`` where the tail names no exception."""
    for line in reversed(log_tail.splitlines()):
        match = _EXCEPTION_LINE.match(line.strip())
        if match:
            return f"{match.group(1)}: {match.group(2).split('. ')[0].rstrip('.')}"
    return None


def size_table(models: dict, table_id: str = TABLE_ID) -> dict:
    """``table_id`` (``T19-cost-by-size``): per model and arm, the mean over its runs of each statistic and its multiple of arm A's
    mean over arm A's runs of the same model (interleaved with them), the spread as each run's value over that mean."""
    body = []
    for model, runs in models.items():
        ran = [r for r in runs.values() if "error" not in r]
        base = {key: _mean_of([r for r in ran if r["arm"] == "A"], key)
                for key in ("step_s_median", "step_s_mean", "generating_step_s_median", "other_step_s_median")}
        for arm in dict.fromkeys(r["arm"] for r in runs.values()):
            mine = [r for r in ran if r["arm"] == arm]
            failed = [label for label, r in runs.items() if r["arm"] == arm and "error" in r]
            if not mine:
                causes = dict.fromkeys(cause for cause in (failure_cause(runs[label].get("log_tail", ""))
                                                           for label in failed) if cause)
                why = f" ({'; '.join(causes)})" if causes else ""
                body.append([f"{arm} @ {model}", 0, None, None, None, None, f"failed: {', '.join(failed)}{why}",
                             *[None] * (len(COLUMNS) - 7)])
                continue
            medians = [r["step_s_median"] for r in mine if r.get("step_s_median") is not None]
            means = [r["step_s_mean"] for r in mine if r.get("step_s_mean") is not None]
            median_x, median_spread = _ratio_stats(medians, base["step_s_median"])
            mean_x, mean_spread = _ratio_stats(means, base["step_s_mean"])
            gen = _mean_of(mine, "generating_step_s_median")
            other = _mean_of(mine, "other_step_s_median")
            exact = [r["sampler_exact_mean"] for r in mine if r.get("sampler_exact_mean") is not None]
            ratio_exact = [r["ratio_exact_first_iteration_min"] for r in mine
                           if r.get("ratio_exact_first_iteration_min") is not None]
            body.append([f"{arm} @ {model}", len(mine), max(r["steps"] for r in mine),
                         _round(_mean_of(mine, "step1_s"), 2),
                         _round(statistics.fmean(medians), 3) if medians else None, median_x, median_spread,
                         _round(statistics.fmean(means), 3) if means else None, mean_x, mean_spread,
                         _times(gen, base["generating_step_s_median"]), _times(other, base["other_step_s_median"]),
                         None if not exact else round(100 * min(exact), 2),
                         None if not ratio_exact else round(min(ratio_exact), 4), _round(other, 3),
                         _round(_mean_of(mine, "generate_s_median"), 3), _round(_mean_of(mine, "old_pass_s_median"), 3)])
    return {"id": table_id, "title": "Step time x arm A by model size: bloggap train, TRL 1.16 colocate vLLM, one GPU",
            "columns": COLUMNS, "rows": body, "reference": None, "random_init": True,
            "plot": {"kind": "bar", "x": "arm @ model", "y": ["mean step x arm A", "median step x arm A"],
                     "title": "Step time as a multiple of arm A's, by model size", "ylabel": "x arm A"},
            "notes": "Each run: bloggap train recipes/arm_X.yaml --use_vllm true --vllm_mode colocate, num_iterations "
                     "2, the arith task's length reward; runs of one model interleaved (A I J A I J ...) on one "
                     "machine. Step statistics after step 1 (step 1 apart: set-up); per run the median and the mean "
                     "of step_time, the median of the generating steps and of the others (training-only: the second "
                     "iteration), and of the generating steps' generation (gap/time/generate_s: the sampler's seconds) and old "
                     "pass (gap/time/old_pass_s, arms whose pass replaces TRL's); a row is the mean over its runs, 'x arm A' that mean over the mean of the same "
                     "model's arm A runs, '(min-max)' each run's value over that same arm A mean. ARM_process: vLLM's "
                     "batch-invariant mode left on process-wide (BLOGGAP_VLLM_BATCH_INVARIANCE=process); ARM_vllm_workspaces: "
                     "vLLM's cuBLAS(Lt) workspace sizes exported (CUBLAS_WORKSPACE_CONFIG=:16:8, "
                     "CUBLASLT_WORKSPACE_SIZE=1), so torch sizes the run's cuBLAS matmuls with them. ARM_tiles: "
                     "the tile table in params.matmul_tiles installed (named by gap.matmul_tiles; in T27's runs by "
                     "BLOGGAP_VLLM_MATMUL_TILES). ARM_dense_attention: the attention gradient's dense closed form "
                     "for every call (BLOGGAP_ATTENTION_GRADIENT=dense). MODEL-setN: "
                     "the runs of the Nth device call, an interleaved set of its own, each arm over that set's arm "
                     "A. Random-init "
                     "weights except SmolLM2-135M: exactness columns hold, gap rates would not."}


LIVE_TABLE_ID = "T23-live-arms"
LIVE_COLUMNS = ["arm", "runs", "sampler tokens out of band % (mean)", "sampler bit-identical % (least run)",
                "ratio out of band at a first iteration % (mean)", "ratio exact_frac, first iteration (least)",
                "mean step x arm A", "mean x A, runs (min-max)", "reward vs arm A (sweep)"]


def sweep_verdicts(sweep: dict, name: str) -> dict[str, str]:
    """Per arm, what a ``bloggap compare`` document's declared analysis (``results.analysis``, status ``final``)
    says of its primary metric against the baseline: ``higher``/``lower than A`` where the simultaneous interval
    excludes 0 and both Holm-adjusted p-values (t-test, exact sign-flip) are under alpha, else ``not distinguishable
    from A``; the difference, interval and Holm p follow, then ``name`` (the sweep's table id). Empty when the
    analysis is not final."""
    analysis = sweep.get("results", {}).get("analysis") or {}
    if analysis.get("status") != "final":
        return {}
    declared = analysis["declared"]
    metric, baseline = declared["primary"], declared["baseline"]
    block = analysis["metrics"][metric]
    alpha = block.get("alpha", declared["alpha"])
    verdicts = {baseline: f"baseline of {name}"}
    for arm, row in block["arms"].items():
        apart = (row["low"] > 0 or row["high"] < 0) and max(row["p_t_holm"], row["p_sign_flip_holm"]) < alpha
        said = (f"{'higher' if row['mean'] > 0 else 'lower'} than {baseline}" if apart
                else f"not distinguishable from {baseline}")
        verdicts[arm] = (f"{said}: {metric} {row['mean']:+.3f} [{row['low']:+.3f}, {row['high']:+.3f}], "
                         f"Holm p {row['p_t_holm']:.3g} (t) / {row['p_sign_flip_holm']:.3g} (sign-flip), {name}")
    return verdicts


def live_arms_table(model: str, sets: dict[str, dict], verdicts: dict[str, str], table_id: str = LIVE_TABLE_ID) -> dict:
    """``table_id``: the live per-arm decision table of one real-weights model's interleaved runs, ``sets`` (set name
    -> runs: one set, or several made on separate calls, each with its own arm A runs): per arm the mean over its
    runs of the sampler's out-of-band share (generations after the first) and of the first-iteration ratio's, the
    least run's bit-identical shares, the mean over its runs of each run's mean step over the mean of its own set's
    arm A runs (with one set, the mean step's multiple of arm A's) with each run's spread, and the sweep's verdict
    (``verdicts``, :func:`sweep_verdicts`; arms it did not compare say so)."""
    ran: list[dict] = []
    multiples: dict[str, list[float]] = {}
    for runs in sets.values():
        mine = [r for r in runs.values() if "error" not in r and ":" not in r["arm"]]
        ran += mine
        base = _mean_of([r for r in mine if r["arm"] == "A"], "step_s_mean")
        for r in mine:
            if base and r.get("step_s_mean") is not None:
                multiples.setdefault(r["arm"], []).append(r["step_s_mean"] / base)
    body = []
    for arm in sorted(dict.fromkeys(r["arm"] for r in ran)):
        mine = [r for r in ran if r["arm"] == arm]
        sampler, ratio = _mean_of(mine, "sampler_oob_mean"), _mean_of(mine, "ratio_oob_first_iteration_mean")
        exact = [r["sampler_exact_mean"] for r in mine if r.get("sampler_exact_mean") is not None]
        ratio_exact = [r["ratio_exact_first_iteration_min"] for r in mine
                       if r.get("ratio_exact_first_iteration_min") is not None]
        mean_x, spread = _ratio_stats(multiples.get(arm, []), 1.0)
        body.append([arm, len(mine), None if sampler is None else round(100 * sampler, 3),
                     None if not exact else round(100 * min(exact), 2), None if ratio is None else round(100 * ratio, 3),
                     None if not ratio_exact else round(min(ratio_exact), 4), mean_x, spread,
                     verdicts.get(arm, "not in the sweep" if verdicts else "no sweep given")])
    runs_said = ("One set of interleaved runs (A B ... J A B ... J ...)" if len(sets) == 1 else
                 f"{len(sets)} interleaved sets of runs (each A B ... A B ..., on its own device machine, with its own "
                 "arm A runs)")
    return {"id": table_id, "title": f"Every arm live on {model}: the gap it leaves and its price (bloggap train, "
                                     "TRL 1.16 colocate vLLM, one GPU)",
            "columns": LIVE_COLUMNS, "rows": body, "reference": None, "random_init": False,
            "notes": f"{runs_said} through bloggap train recipes/arm_X.yaml "
                     "--use_vllm true --vllm_mode colocate, num_iterations 2, the arith task's length reward. Sampler: "
                     "gap/sampler/oob_frac (exp of the sampler's minus the old log-prob outside the clip band) over "
                     "the generations after the first; ratio: gap/ratio/oob_frac at each generation's first "
                     "iteration (no optimizer step between old and new log-probs: the gap, not the update); "
                     "bit-identical: gap/sampler/exact_frac and gap/ratio/exact_frac. Mean step x arm A: the mean "
                     "over the arm's runs of each run's mean step over the mean of its own set's arm A runs, with "
                     "each run's multiple as the spread. Reward verdict: the compare sweep's declared, "
                     "Holm-corrected analysis of its primary metric (a difference not established is said to be "
                     "not distinguishable)."}


def document(models: dict, params: dict, env: dict, table_id: str = TABLE_ID, real: tuple[str, ...] = (),
             verdicts: dict[str, str] | None = None, live_table_id: str = LIVE_TABLE_ID,
             labels: dict[str, str] | None = None) -> dict:
    """The result document of ``models`` (key -> runs); ``real``: model labels that get a live table over every key
    ``labels`` (key -> model label, as :func:`_join_calls` returns it; a key is its own label where absent) maps to
    them, one per interleaved set."""
    from bloggap_plugin.results import SCHEMA_VERSION

    tables = [size_table(models, table_id)]
    for model in real:
        suffix = "" if len(real) == 1 else f"-{model}"
        sets = {key: runs for key, runs in models.items() if (labels or {}).get(key, key) == model}
        tables.append(live_arms_table(model, sets, verdicts or {}, live_table_id + suffix))
    return {"benchmark": "cost_by_size", "schema_version": SCHEMA_VERSION, "env": env, "params": params,
            "results": models, "tables": tables}


def _expected_s(done: dict, model: str, arm_text: str) -> float:
    same = [r["seconds"] for r in done.get(model, {}).values() if r["arm"] == arm_text]
    every = [r["seconds"] for runs in done.values() for r in runs.values()]
    return same[-1] if same else max(every, default=0.0)


def run_main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models: dict = {}
    if (out / RESULT_NAME).exists():  # a later call on the same machine: keep the runs that finished
        models = {model: {name: row for name, row in runs.items() if "error" not in row}
                  for model, runs in json.loads((out / RESULT_NAME).read_text())["results"].items()}
    for arm_text in args.arms.split(","):  # refuse a bad arm or a :tiles arm without its table before any run
        run_environment(arm_text, {})
        run_tiles(arm_text, args.matmul_tiles)
    params = {"steps": args.steps, "arms": args.arms, "repeats": args.repeats, "memory": args.memory,
              "models": args.model, "skipped": []}
    if args.matmul_tiles:
        params["matmul_tiles"] = json.loads(Path(args.matmul_tiles).read_text())
    env = arm_i_live._env()
    deadline = time.monotonic() + args.budget_s

    def save() -> None:  # after each run, so a time limit keeps what finished; and at the end, for params' skipped
        atomic_write_text(out / RESULT_NAME, json.dumps(document(models, params, env), indent=1))

    out_of_time = False  # once a run does not fit, none after it starts: the next call resumes at that run
    for spec in args.model:
        label, _, path = spec.partition("=")
        folder = out / label
        folder.mkdir(exist_ok=True)
        models.setdefault(label, {})
        for repeat in range(1, args.repeats + 1):
            for arm_text in args.arms.split(","):
                name = run_label(arm_text, repeat)
                if name in models[label]:
                    continue
                out_of_time = out_of_time or time.monotonic() + _expected_s(models, label, arm_text) > deadline
                if out_of_time:
                    params["skipped"].append(f"{label}/{name}")
                    continue
                log_jsonl = folder / f"{name}.jsonl"
                argv = run_argv(arm_text, path, args.steps, log_jsonl, args.memory, args.matmul_tiles)
                started = time.perf_counter()
                with open(folder / f"{name}.log", "w") as console:
                    code = subprocess.call(argv, cwd=ROOT, env=run_environment(arm_text, dict(os.environ)),
                                           stdout=console, stderr=subprocess.STDOUT)
                seconds = time.perf_counter() - started
                if code != 0 or not log_jsonl.exists():
                    row = {"arm": arm_text, "error": f"exit {code}",
                           "log_tail": (folder / f"{name}.log").read_text()[-3000:]}
                else:
                    row = summarize_run(arm_text, arm_i_live._records(log_jsonl))
                models[label][name] = {**row, "seconds": round(seconds, 1)}
                save()
                print(label, name, "exit", code, f"{seconds:.0f} s", {k: v for k, v in row.items()
                                                                      if k != "log_tail"}, flush=True)
    save()
    return 0


def shape_main(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from benchmarks._lib.shapes import build_shape

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    model = build_shape(args.name, torch.device(args.device), dtype=torch.bfloat16, seed=args.seed)
    for config in (model.config, model.generation_config):
        config.eos_token_id = tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print("saved", args.out, args.name, f"{sum(p.numel() for p in model.parameters()) / 1e9:.3f}B parameters")
    return 0


def _join_calls(folders: list[Path], interleaved_sets: bool) -> tuple[dict, list, dict | None, dict, dict]:
    """The runs, params, env and log files of several ``run`` folders. A later folder resumes an earlier one: its run
    of a label replaces a failed or identical one; a different finished run of the same label is another interleaved
    set, refused unless ``interleaved_sets``, which labels each folder's model ``MODEL-setN`` (N from 1, in order)
    where the model is in more than one folder, so every arm is compared with arm A of its own call. Returns the
    runs by model key, each call's params, the first env, the log files by model key and each key's model label."""
    sources = [json.loads((folder / RESULT_NAME).read_text()) for folder in folders]
    gpus = [(source.get("env") or {}).get("gpu") for source in sources]
    for folder, gpu in zip(folders[1:], gpus[1:]):
        if gpu != gpus[0]:
            raise SystemExit(f"cost_by_size collect: {folders[0]} ran on {gpus[0]} and {folder} on {gpu}: a step "
                             "multiple compares arms on one card; collect each card's folders into a document of "
                             "its own")
    seen = [model for source in sources for model in source["results"]]
    models: dict = {}
    origin: dict = {}
    logs: dict = {}
    labels: dict = {}
    for number, (folder, source) in enumerate(zip(folders, sources), start=1):
        for model, runs in source["results"].items():
            key = f"{model}-set{number}" if interleaved_sets and seen.count(model) > 1 else model
            for label, run in runs.items():
                earlier = models.get(key, {}).get(label)
                if earlier is not None and "error" not in earlier and earlier != run:
                    raise SystemExit(f"cost_by_size collect: {model}/{label} differs between {origin[key, label]} "
                                     f"and {folder}: these are separate interleaved sets, not one resumed; pass "
                                     "--interleaved-sets to compare each with arm A of its own call")
                origin[key, label] = folder
            models.setdefault(key, {}).update(runs)
            labels[key] = model
            for path in sorted((folder / model).glob("*")):
                if path.suffix in (".jsonl", ".log") and path.stem in runs:
                    logs.setdefault(key, {})[path.name] = path
    return models, [source["params"] for source in sources], sources[0]["env"] if sources else None, logs, labels


def collect_main(args: argparse.Namespace) -> int:
    """One document from the ``run`` folders of several device calls: their models' runs joined as ``_join_calls``
    says (resumed, or ``--interleaved-sets``), the env of the first, ``--revision`` in the params; with
    ``--pack-dir`` each model's JSONL and console logs packed as ``runs_LABEL.tar.xz`` (the later folder's file of a
    name kept). ``--model-path LABEL=PATH``: the model's folder on the machine, written ``<LABEL folder>``;
    ``--run-path PATH``: a ``run --out`` folder on the machine, written ``<run folder>`` in the packed logs."""
    from benchmarks._lib.publish import pack_text_files, strip_paths

    models, calls, env, logs, labels = _join_calls([Path(run) for run in args.runs], args.interleaved_sets)
    paths = dict(spec.split("=", 1) for spec in args.model_path)
    unknown = [label for label in args.real if label not in labels.values()]
    if unknown:
        raise SystemExit(f"cost_by_size collect: --real {', '.join(unknown)}: no runs of that model in "
                         f"{', '.join(args.runs)} (models: {', '.join(sorted(models))})")
    verdicts = {}
    if args.sweep:
        sweep = json.loads(Path(args.sweep).read_text())
        name = next((t["id"] for t in sweep.get("tables", []) if t["id"].endswith("-analysis")), Path(args.sweep).stem)
        verdicts = sweep_verdicts(sweep, name.removesuffix("-analysis"))
    params = {"revision": args.revision, "models": sorted(models), "calls": calls, "real": list(args.real),
              "sweep": args.sweep, "interleaved_sets": args.interleaved_sets}
    text = json.dumps(document(models, params, env, table_id=args.table_id, real=tuple(args.real),
                               verdicts=verdicts, live_table_id=args.live_table_id, labels=labels), indent=1) + "\n"
    for label, path in paths.items():
        text = strip_paths(text, path, f"<{label} folder>")
    atomic_write_text(Path(args.out), text)
    if args.pack_dir:
        Path(args.pack_dir).mkdir(parents=True, exist_ok=True)
        for model, files in logs.items():
            pack_text_files(files.values(), Path(args.pack_dir) / f"runs_{model}.tar.xz",
                            paths.get(labels[model], "<no model path>"), f"<{labels[model]} folder>",
                            replace={f"{path.rstrip('/')}/": "<run folder>/" for path in args.run_path})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    shape = sub.add_parser("shape", help="write a random-init model folder of a named shape")
    shape.add_argument("name")
    shape.add_argument("--tokenizer", required=True)
    shape.add_argument("--out", required=True)
    shape.add_argument("--device", default="cuda")
    shape.add_argument("--seed", type=int, default=0)
    run = sub.add_parser("run", help="interleaved runs through bloggap train (GPU, vLLM)")
    run.add_argument("--model", action="append", required=True, help="LABEL=FOLDER (repeat; run in this order)")
    run.add_argument("--arms", default="A,I,J")
    run.add_argument("--repeats", type=int, default=3)
    run.add_argument("--steps", type=int, default=30)
    run.add_argument("--memory", type=float, default=0.3)
    run.add_argument("--budget-s", type=float, default=540.0)
    run.add_argument("--out", required=True)
    run.add_argument("--matmul-tiles", default=None, help="the tile table ARM:tiles runs install "
                     "(gap.matmul_tiles; bloggap tiles --model MODEL --out FILE writes one)")
    col = sub.add_parser("collect", help="one document from the run folders of several device calls")
    col.add_argument("runs", nargs="+")
    col.add_argument("--out", required=True)
    col.add_argument("--revision", required=True)
    col.add_argument("--table-id", default=TABLE_ID, help=f"the table's id (default {TABLE_ID}); a new id for a "
                     "document beside an earlier one at another revision")
    col.add_argument("--model-path", action="append", default=[], help="LABEL=PATH: a model's folder (repeat)")
    col.add_argument("--pack-dir", default=None, help="pack each model's logs here (runs_LABEL.tar.xz)")
    col.add_argument("--run-path", action="append", default=[],
                     help="a run's --out folder on the machine, written <run folder> in the packed logs (repeat)")
    col.add_argument("--real", action="append", default=[],
                     help="LABEL of a model with real weights: add its live per-arm table (repeat)")
    col.add_argument("--sweep", default=None,
                     help="a bloggap compare result document (e.g. benchmarks/results/h200/compare_sweep.json): its "
                          "declared analysis gives the live table's reward verdicts")
    col.add_argument("--interleaved-sets", action="store_true",
                     help="each folder is its own interleaved set (not a resumed one): a model in several folders "
                          "becomes MODEL-setN, each arm compared with arm A of its own call")
    col.add_argument("--live-table-id", default=LIVE_TABLE_ID, help=f"the live table's id (default {LIVE_TABLE_ID})")
    args = parser.parse_args(argv)
    return {"shape": shape_main, "run": run_main, "collect": collect_main}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
