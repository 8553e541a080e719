"""The reward comparison across arms: run every recipe x seed, then the T10 table, a plot and the resolution.

Every arm runs with the same seeds, so for one seed all arms see the same prompts in the same order and the
same sampling seeds; they differ only in what the recipe changes (the old-logprob pass). Each run is a
subprocess (``python -m bloggap_plugin.compare --worker SPEC``) that calls the training function
(default :func:`bloggap_plugin.trl.train.run_training`), which writes one JSONL record per logged step into a
log of its own (``runs/<run>.<attempt>.part.jsonl``). When the function returns, the worker appends a
completion marker ``{"_compare": "done", "attempt": ..., "settings": {...}, ...}`` and renames that log to
``runs/<run>.jsonl``: the run's log exists only complete, and only one process ever writes a given file.

Every setting is checked before anything trains (:func:`validate_config`, :class:`CompareError`).

Resume: a run whose log carries the marker and the same settings (:func:`run_settings`: training function,
recipe content, model, task and its options (GSM8K: the data path in effect, ``--data`` or ``$BLOGGAP_GSM8K_DATA``),
steps, seed, overrides, ``--use-vllm``) is skipped; one trained with other settings, or whose log
is corrupt, is trained again, its old log kept as ``<run>.jsonl.stale`` / ``.corrupt``; the log of an attempt
that never completed is kept as ``<run>.jsonl.partial``. A crashed run does not stop the sweep: the table is
built from the runs that finished and the command exits non-zero naming the others.

Stopping: runs die with the sweep (``PR_SET_PDEATHSIG`` on Linux and a parent-watch thread, so also on SIGKILL
or an OOM kill of the sweep); SIGTERM, SIGHUP and Ctrl-C stop every run before the sweep exits. The runs
inherit the folder's lock, so no other sweep uses the folder while any of them lives.

Outputs in ``output_dir``: ``runs/<arm>_s<seed>.jsonl`` (+ ``.out`` with the run's console output),
``compare.json`` (benchmark schema: params, raw per-run results, tables), ``compare.md`` and
``reward_curves.png``, each written atomically.

Table definitions (as in the reference study's T10):

- reward last-k: mean of the per-step ``reward`` over the final k logged steps (k = ``last_n``, default 30,
  or all steps when a run logged fewer);
- reward mean: mean over all logged steps;
- vs A per seed: last-k of the arm minus last-k of the baseline arm with the same seed; mean delta with a
  95% paired t interval over seeds (needs >= 2 seeds);
- clip: mean over steps of TRL's ``clip_ratio/region_mean``; ``gap/*``: mean over steps of each plugin metric;
- s/step: mean of TRL's ``step_time`` where logged, else wall time / steps.

Generation: HF ``generate`` by default; ``use_vllm`` (``--use-vllm``) gives every run TRL's colocated vLLM engine
(``use_vllm=True, vllm_mode="colocate"``) with ``vllm_gpu_memory_utilization`` = :data:`VLLM_GPU_SHARE` / ``parallel``
(the GPU divided among the runs in flight; an ``--override`` of it wins). With the default training function the
sweep refuses it up front on a machine without vLLM or CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import importlib
import inspect
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bloggap_plugin._io import atomic_write_text

__all__ = [
    "CompareConfig",
    "CompareError",
    "SweepStopped",
    "VLLM_GPU_SHARE",
    "vllm_unavailable_reason",
    "effective_overrides",
    "RunSpec",
    "DONE_KEY",
    "plan_runs",
    "validate_config",
    "run_settings",
    "read_log",
    "run_is_done",
    "run_compare",
    "summarize_run",
    "build_results",
    "t_quantile",
    "paired_interval",
    "write_outputs",
    "plot_reward_curves",
]

DONE_KEY = "_compare"
DEFAULT_RUN_FN = "bloggap_plugin.trl.train:run_training"
_HEADLINE_GAP_KEYS = ("gap/ratio/oob_frac", "gap/sampler/oob_frac", "gap/clip/flip_frac")
VLLM_GPU_SHARE = 0.75
"""Fraction of the GPU's memory the vLLM engines of a ``--use-vllm`` sweep take together (each run's engine gets
``VLLM_GPU_SHARE / parallel``); the rest is for the runs' training (weights, optimizer, activations)."""


class CompareError(ValueError):
    """Settings or folder state that stop a sweep before it starts; the message names the problem and the fix."""


@dataclass
class CompareConfig:
    """Settings of one comparison sweep."""

    recipes: list[str]
    """Recipe files, one per arm (e.g. ``recipes/arm_A.yaml``)."""
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    """Seeds; every arm runs once per seed, arms with the same seed see the same prompts and sampling seeds."""
    task: str = "arith"
    """``"arith"`` or ``"gsm8k"`` (see :mod:`bloggap_plugin.tasks`)."""
    max_steps: int = 60
    """Optimizer steps per run."""
    model: str = "smollm2"
    """Model spec for :func:`bloggap_plugin.models.load_model`."""
    output_dir: str = "compare_out"
    """Folder for logs, table, JSON and plot."""
    parallel: int = 1
    """Runs in flight at once (separate processes)."""
    difficulty: int | None = None
    """Arithmetic task level (1-5); ``None``: the task's default."""
    n: int | None = None
    """Number of prompts in the training set; ``None``: the task's default."""
    data: str | None = None
    """GSM8K only: a local file or folder in GSM8K format (``None``: ``$BLOGGAP_GSM8K_DATA``, else the hub)."""
    calc_steps: str | None = None
    """GSM8K only: problems with this many ``<<...>>`` calculation steps, ``"1"`` or a range ``"1-2"``."""
    use_vllm: bool = False
    """Generate with TRL's colocated vLLM engine (``use_vllm=True, vllm_mode="colocate"``) instead of HF generate."""
    last_n: int = 30
    """Steps in the "reward last-k" window."""
    baseline: str | None = None
    """Arm the deltas are taken against; default arm ``A`` if present, else the first recipe."""
    extra_overrides: dict = field(default_factory=dict)
    """GRPOConfig overrides applied to every arm (e.g. ``{"num_iterations": 2}``)."""
    run_fn: str = DEFAULT_RUN_FN
    """``module:function`` that trains one run (signature of ``run_training``)."""
    pythonpath: list[str] = field(default_factory=list)
    """Extra import paths for the run function's module (used by tests)."""
    smooth: int = 5
    """Rolling-mean window (steps) of the reward curves in the plot (1 = raw)."""
    poll_s: float = 2.0
    """Seconds between progress checks."""
    lock_wait_s: float = 2.0
    """Seconds to wait for the folder's lock (runs of a sweep that was just killed take a moment to end)."""


@dataclass
class RunSpec:
    """One arm x seed run."""

    arm: str
    """Arm label (the recipe's ``gap.arm``, else the file stem)."""
    recipe: str
    """Recipe file."""
    seed: int
    """Seed of this run."""
    run_id: str
    """``<arm>_s<seed>``: the log's file stem."""
    log_jsonl: str
    """Path of the run's JSONL log."""
    output_dir: str
    """Trainer output folder of this run."""


# --------------------------------------------------------------------------------------------- planning


def _arm_label(recipe: Path) -> str:
    import yaml

    if not recipe.is_file():
        raise FileNotFoundError(f"recipe {recipe} does not exist")
    try:
        content = yaml.safe_load(recipe.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"recipe {recipe} is not valid YAML: {err}") from err
    gap = content.get("gap") if isinstance(content, dict) else None
    arm = gap.get("arm") if isinstance(gap, dict) else None
    return str(arm) if arm else recipe.stem


def plan_runs(config: CompareConfig) -> list[RunSpec]:
    """Every arm x seed, in seed-major order (all arms of seed 0 first), with unique arm labels."""
    if not config.recipes:
        raise ValueError("compare needs at least one recipe")
    if not config.seeds:
        raise ValueError("compare needs at least one seed")
    if len(set(config.seeds)) != len(config.seeds):
        raise ValueError(f"seeds must be distinct, got {config.seeds}")
    labels = [_arm_label(Path(r)) for r in config.recipes]
    if len(set(labels)) != len(labels):  # two recipes with the same gap.arm: fall back to file stems
        labels = [Path(r).stem for r in config.recipes]
    if len(set(labels)) != len(labels):
        raise ValueError(f"recipes must have distinct file names or gap.arm values: {config.recipes}")
    out = Path(config.output_dir)
    runs = []
    for seed in config.seeds:
        for label, recipe in zip(labels, config.recipes):
            run_id = f"{label}_s{seed}"
            runs.append(
                RunSpec(
                    arm=label,
                    recipe=str(recipe),
                    seed=int(seed),
                    run_id=run_id,
                    log_jsonl=str(out / "runs" / f"{run_id}.jsonl"),
                    output_dir=str(out / "trainer" / run_id),
                )
            )
    return runs


def validate_config(config: CompareConfig, training: bool = True) -> list[RunSpec]:
    """Check every setting before any model loads or any run trains; return the planned runs.

    Raises :class:`CompareError` naming the option and the fix. ``training=False`` (``--table-only``) checks only
    what the table needs. With the default training function the recipes and ``extra_overrides`` are checked by
    building each arm's ``GRPOConfig`` (as :func:`bloggap_plugin.trl.train.run_training` does on CPU), and the task
    settings by building one prompt of the task.
    """
    if not config.recipes:
        raise CompareError("give at least one recipe file, e.g. recipes/arm_A.yaml recipes/arm_F.yaml")
    if not config.seeds:
        raise CompareError("--seeds: give at least one seed, e.g. --seeds 0 1")
    repeated = sorted({seed for seed in config.seeds if config.seeds.count(seed) > 1})
    if repeated:
        raise CompareError(f"--seeds {' '.join(map(str, config.seeds))}: seed {', '.join(map(str, repeated))} is "
                           "repeated; give each seed once")
    for option, value in (("--parallel", config.parallel), ("--max-steps", config.max_steps),
                          ("--last-n", config.last_n), ("--smooth", config.smooth)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CompareError(f"{option} {value}: must be a whole number >= 1")
    if config.n is not None and config.n < 1:
        raise CompareError(f"--n {config.n}: must be >= 1 prompts (or leave it out for the task's default)")
    try:
        runs = plan_runs(config)
    except (OSError, ValueError) as err:
        raise CompareError(str(err).splitlines()[0]) from None
    arms = list(dict.fromkeys(run.arm for run in runs))
    if config.baseline is not None and config.baseline not in arms:
        raise CompareError(f"--baseline {config.baseline} names no arm; the arms are {', '.join(arms)} "
                           "(each recipe's gap.arm, else its file name)")
    if training:
        _check_vllm(config)
        _check_task(config)
        if config.run_fn == DEFAULT_RUN_FN:
            _check_grpo_settings(config, runs)
        else:
            _check_run_fn(config)
    return runs


def _check_task(config: CompareConfig) -> None:
    """Build one prompt of the task with the sweep's settings (level, data), so a bad one fails here, once."""
    from bloggap_plugin.tasks import TASKS, get_task

    if config.task not in TASKS:
        raise CompareError(f"--task {config.task}: unknown task; choose one of {', '.join(TASKS)}")
    kwargs = _task_kwargs(config)
    if config.task != "gsm8k" and all(kwargs.get(key) is None for key in ("difficulty", "data", "calc_steps")):
        return
    try:
        get_task(config.task, None, seed=config.seeds[0], **{**kwargs, "n": 1})
    except Exception as err:  # noqa: BLE001 - any failure here would fail every run: report it once
        message = str(err).splitlines()[0]
        if config.difficulty is not None and "difficulty" in message:
            option = "--difficulty"
        elif config.calc_steps is not None and "calc_steps" in message:
            option = "--calc-steps"
        elif config.data is not None and "--data" in message:
            option = "--data"
        else:
            option = "--task"
        raise CompareError(f"{option}: {message}") from None


def _task_kwargs(config: CompareConfig) -> dict:
    """The task options every run gets: ``difficulty``, ``n``, ``data`` (GSM8K: the local path in effect, absolute,
    from ``--data`` or ``$BLOGGAP_GSM8K_DATA``; ``None`` = the hub) and, when set, ``calc_steps``."""
    data = config.data
    if config.task == "gsm8k":
        from bloggap_plugin.tasks.gsm8k import resolve_data

        data = resolve_data(data)
        data = None if data is None else str(Path(data).absolute())
    kwargs: dict = {"difficulty": config.difficulty, "n": config.n, "data": data}
    if config.calc_steps is not None:  # only when set: logs of sweeps from before the option keep their settings
        kwargs["calc_steps"] = str(config.calc_steps)
    return kwargs


def vllm_unavailable_reason() -> str | None:
    """Why TRL's colocated vLLM engine cannot run here (``"vLLM is not installed here"``, ``"CUDA is not
    available here ..."``), or ``None`` when it can."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed here"
    import torch

    if not torch.cuda.is_available():
        return f"CUDA is not available here (torch {torch.__version__})"
    return None


def effective_overrides(config: CompareConfig) -> dict:
    """The GRPOConfig overrides each run gets: ``--override``, plus for ``--use-vllm`` ``use_vllm=True``,
    ``vllm_mode="colocate"`` and ``vllm_gpu_memory_utilization = VLLM_GPU_SHARE / parallel`` (an ``--override``
    of a field wins)."""
    if not config.use_vllm:
        return dict(config.extra_overrides)
    vllm = {"use_vllm": True, "vllm_mode": "colocate",
            "vllm_gpu_memory_utilization": round(VLLM_GPU_SHARE / max(1, int(config.parallel)), 4)}
    return {**vllm, **config.extra_overrides}


def _check_vllm(config: CompareConfig) -> None:
    """``--use-vllm``: no ``--override`` contradicting it and, with the default training function, vLLM and CUDA
    here (a custom ``--run-fn`` gets the overrides and decides)."""
    if not config.use_vllm:
        return
    overrides = config.extra_overrides
    if "use_vllm" in overrides and overrides["use_vllm"] is not True:
        raise CompareError(f"--use-vllm with --override use_vllm={json.dumps(overrides['use_vllm'])}: drop one of them")
    if overrides.get("vllm_mode", "colocate") != "colocate":
        raise CompareError(f"--use-vllm runs TRL's colocated engine, but --override sets vllm_mode="
                           f"{json.dumps(overrides['vllm_mode'])}: drop --use-vllm and pass the vLLM fields in --override")
    share = effective_overrides(config)["vllm_gpu_memory_utilization"]
    if not isinstance(share, (int, float)) or isinstance(share, bool) or not 0 < share <= 1:
        raise CompareError(f"--override vllm_gpu_memory_utilization={json.dumps(share)}: must be a fraction in (0, 1]")
    if config.run_fn == DEFAULT_RUN_FN:
        problem = vllm_unavailable_reason()
        if problem:
            raise CompareError(f"--use-vllm: {problem}; run the sweep on a machine with a CUDA GPU and vLLM "
                               "(TRL 1.16 takes vLLM 0.22-0.31), or drop --use-vllm to generate with HF generate")


def _check_grpo_settings(config: CompareConfig, runs: list[RunSpec]) -> None:
    """Each recipe and ``--override`` must make a valid ``GRPOConfig`` (the fields run_training sets on CPU)."""
    from bloggap_plugin.recipes import (
        RecipeError,
        _grpo_field_names,
        _unknown_key_error,
        load_recipe,
        merge_grpo_config,
    )

    valid = _grpo_field_names()
    if valid is not None:
        for key in config.extra_overrides:
            if key not in valid:
                raise CompareError(str(_unknown_key_error(key, valid, "--override")))
    overrides = json.dumps(config.extra_overrides)
    effective = effective_overrides(config)
    for run in {run.recipe: run for run in runs}.values():
        try:
            grpo_kwargs, _ = load_recipe(run.recipe)
        except RecipeError as err:
            raise CompareError(str(err).splitlines()[0]) from None
        fields = {"output_dir": run.output_dir, "report_to": "none", "seed": run.seed, "save_strategy": "no",
                  "logging_steps": 1, "max_steps": config.max_steps, "use_cpu": True, "bf16": False,
                  "fp16": bool(grpo_kwargs.get("fp16", False)), **effective}
        try:
            merge_grpo_config(grpo_kwargs, None, **fields)
        except Exception as err:  # noqa: BLE001 - TRL/transformers raise ValueError, TypeError, ...
            where = f"{run.recipe} with --override {overrides}" if config.extra_overrides else run.recipe
            raise CompareError(f"{where}: GRPOConfig rejects it: {str(err).strip().splitlines()[0]}") from None


def _check_run_fn(config: CompareConfig) -> None:
    """A custom training function must import, and take ``task_kwargs`` when the task settings need them."""
    added = [extra for extra in config.pythonpath if extra not in sys.path]
    sys.path[:0] = added
    try:
        run_fn = _resolve(config.run_fn)
    except Exception as err:  # noqa: BLE001
        raise CompareError(f"--run-fn {config.run_fn}: cannot load it ({err}); give module:function") from None
    finally:
        for extra in added:
            sys.path.remove(extra)
    task_kwargs = sorted(k for k, v in _task_kwargs(config).items() if v is not None)
    if task_kwargs:
        params = inspect.signature(run_fn).parameters
        if "task_kwargs" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            raise CompareError(f"--run-fn {config.run_fn} takes no task_kwargs, so {task_kwargs} cannot reach the task; "
                               "drop --difficulty/--n/--data/--calc-steps or use a training function that accepts "
                               "task_kwargs")


# --------------------------------------------------------------------------------------------- logs


def read_log(path: str | os.PathLike) -> tuple[list[dict], dict | None]:
    """``(step records, completion marker or None)`` of a run's JSONL log.

    A last line cut off mid-write (killed run) is ignored; a malformed line elsewhere raises ``ValueError``
    naming the file and line.
    """
    path = Path(path)
    if not path.is_file():
        return [], None
    lines = path.read_text().splitlines()
    records, marker = [], None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):
                break  # truncated final line of a killed run
            raise ValueError(f"{path}:{number}: not a JSON line ({err.msg})") from err
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        if record.get(DONE_KEY) == "done":
            marker = record
        else:
            records.append(record)
    return records, marker


def run_is_done(path: str | os.PathLike) -> bool:
    """True when the run's log carries the completion marker."""
    return read_log(path)[1] is not None


def _settings_changes(stored: dict, current: dict) -> str:
    """``"max_steps 4 -> 6, model ..."``: the settings that differ, for a message."""
    parts = []
    for key in sorted(set(stored) | set(current)):
        if stored.get(key) != current.get(key):
            if key == "recipe_sha256":
                parts.append("the recipe file's content")
            else:
                parts.append(f"{key} {json.dumps(stored.get(key))} -> {json.dumps(current.get(key))}")
    return ", ".join(parts)


def run_state(config: CompareConfig, run: RunSpec) -> tuple[str, str]:
    """``(state, why)`` of ``run``'s log: ``done`` (complete, same settings), ``missing``, ``unfinished`` (no
    completion marker), ``corrupt`` (a line that is not JSON; ``why`` names file and line) or ``changed`` (trained
    with other settings; ``why`` lists them)."""
    log = Path(run.log_jsonl)
    if not log.exists():
        return "missing", ""
    try:
        _, marker = read_log(log)
    except ValueError as err:
        return "corrupt", str(err)
    if marker is None:
        return "unfinished", f"{log} has no completion marker"
    stored = marker.get("settings")
    if not isinstance(stored, dict):
        return "changed", f"{log} records no settings (written by an older bloggap)"
    changes = _settings_changes(stored, run_settings(config, run))
    if changes:
        return "changed", f"{log} was trained with other settings ({changes})"
    return "done", ""


def _steps_logged(path: str | os.PathLike) -> int:
    try:
        records, _ = read_log(path)
    except ValueError:
        return 0
    return max([int(r["step"]) for r in records if isinstance(r.get("step"), (int, float))], default=len(records))


# --------------------------------------------------------------------------------------------- worker


def _resolve(run_fn: str):
    module_name, _, attr = run_fn.partition(":")
    if not attr:
        raise ValueError(f"run function must be 'module:function', got {run_fn!r}")
    return getattr(importlib.import_module(module_name), attr)


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        if isinstance(value, dict):
            return {str(k): _jsonable(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [_jsonable(v) for v in value]
        return repr(value)


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """End this process as soon as the sweep process ``parent_pid`` is gone, however it ended (SIGKILL, OOM kill).

    Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``; everywhere: a daemon thread that checks the parent every second
    (the fallback, and the cover for a parent that died before the request took effect).
    """
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):  # pragma: no cover - no prctl: the watchdog below does the job
            pass
    if os.getppid() != parent_pid:
        os._exit(1)

    def watchdog() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watchdog, name="bloggap-compare-parent-watchdog", daemon=True).start()


def _worker(spec_path: str) -> int:
    """Subprocess entry: run one arm x seed into this attempt's own log, then append the completion marker and
    rename that log to the run's log (so the run's log only ever exists complete)."""
    spec = json.loads(Path(spec_path).read_text())
    _die_with_parent(int(spec["parent_pid"]))
    for extra in spec.get("pythonpath", []):
        sys.path.insert(0, extra)
    run_fn = _resolve(spec["run_fn"])
    part = Path(spec["part_jsonl"])
    kwargs = dict(
        model=spec["model"],
        task=spec["task"],
        max_steps=spec["max_steps"],
        output_dir=spec["output_dir"],
        report_to="none",
        seed=spec["seed"],
        log_jsonl=str(part),
        extra_overrides=spec["extra_overrides"],
    )
    task_kwargs = {k: v for k, v in spec["task_kwargs"].items() if v is not None}
    if task_kwargs:  # the sweep checked that run_fn takes them
        kwargs["task_kwargs"] = task_kwargs
    part.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    result = run_fn(spec["recipe"], **kwargs)
    wall_s = time.perf_counter() - start
    marker = {DONE_KEY: "done", "arm": spec["arm"], "seed": spec["seed"], "attempt": spec["attempt"],
              "settings": spec["settings"], "wall_s": wall_s, "result": _jsonable(result)}
    with open(part, "a") as handle:
        handle.write(json.dumps(marker) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(part, spec["log_jsonl"])
    return 0


# --------------------------------------------------------------------------------------------- sweep


class SweepStopped(Exception):
    """The sweep process got SIGTERM or SIGHUP; its runs were stopped (``signum`` says which signal)."""

    def __init__(self, signum: int, stopped: int = 0) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.stopped = stopped


def run_settings(config: CompareConfig, run: RunSpec) -> dict:
    """What decides a run's result (JSON-ready): the training function, the recipe's content, model, task and its
    options (GSM8K: the data path in effect), steps, seed, overrides and ``use_vllm``; stored with its log so that a
    resume with other settings does not reuse it. ``use_vllm`` appears only when set (and the vLLM fields it
    derives, which depend on ``--parallel``, not at all), so logs of sweeps from before the option stay valid."""
    settings = {
        "run_fn": config.run_fn,
        "arm": run.arm,
        "recipe_sha256": hashlib.sha256(Path(run.recipe).read_bytes()).hexdigest(),
        "model": config.model,
        "task": config.task,
        "task_kwargs": _task_kwargs(config),
        "max_steps": config.max_steps,
        "seed": run.seed,
        "extra_overrides": dict(config.extra_overrides),
    }
    if config.use_vllm:
        settings["use_vllm"] = True
    return json.loads(json.dumps(settings, sort_keys=True, default=str))


def _spec_for(config: CompareConfig, run: RunSpec, attempt: str, part: Path) -> dict:
    return {
        "run_fn": config.run_fn,
        "pythonpath": list(config.pythonpath),
        "arm": run.arm,
        "recipe": run.recipe,
        "model": config.model,
        "task": config.task,
        "task_kwargs": _task_kwargs(config),
        "max_steps": config.max_steps,
        "output_dir": run.output_dir,
        "seed": run.seed,
        "log_jsonl": run.log_jsonl,
        "part_jsonl": str(part),
        "attempt": attempt,
        "parent_pid": os.getpid(),
        "settings": run_settings(config, run),
        "extra_overrides": effective_overrides(config),
    }


def _part_logs(run: RunSpec) -> list[Path]:
    """Logs of earlier attempts of ``run`` that never completed (``runs/<run>.<attempt>.part.jsonl``)."""
    log = Path(run.log_jsonl)
    return sorted(log.parent.glob(f"{glob.escape(run.run_id)}.*.part.jsonl"), key=lambda p: p.stat().st_mtime)


def _worker_environment(config: CompareConfig, environ: dict | None = None) -> dict:
    """A run's environment: the sweep's, plus a fixed vLLM KV cache (``BLOGGAP_VLLM_KV_CACHE_GIB`` = 2, unless set)
    when several runs each start a colocated vLLM engine on one GPU: vLLM's free-memory profiling fails when a
    neighbour frees memory while an engine starts (seen on the H200)."""
    from bloggap_plugin.trl.vllm_colocate import KV_CACHE_ENV

    env = dict(os.environ if environ is None else environ)
    if config.use_vllm and int(config.parallel) > 1:
        env.setdefault(KV_CACHE_ENV, "2")
    return env


def _launch(config: CompareConfig, run: RunSpec, lock_fd: int):
    """Start one attempt of ``run``: a fresh log only it writes, its console output, and the lock inherited, so that
    no other sweep can use the folder while the attempt lives (even if this process dies first)."""
    log = Path(run.log_jsonl)
    log.parent.mkdir(parents=True, exist_ok=True)
    for old in _part_logs(run):  # attempts of a sweep that was killed: no process writes them (we hold the lock)
        os.replace(old, log.with_name(log.name + ".partial"))
    attempt = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{time.monotonic_ns() % 10**6:06d}"
    part = log.with_name(f"{run.run_id}.{attempt}.part.jsonl")
    spec_path = log.with_name(f"{run.run_id}.spec.json")
    atomic_write_text(spec_path, json.dumps(_spec_for(config, run, attempt, part), indent=1))
    console_path = log.with_name(f"{run.run_id}.out")
    fresh = console_path.with_name(f".{run.run_id}.{attempt}.out")
    console = open(fresh, "w")  # noqa: SIM115 - closed when the process ends
    os.replace(fresh, console_path)  # a new file: nothing else holds it open
    process = subprocess.Popen(
        [sys.executable, "-m", "bloggap_plugin.compare", "--worker", str(spec_path)],
        stdout=console,
        stderr=subprocess.STDOUT,
        pass_fds=(lock_fd,),
        env=_worker_environment(config),
    )
    return process, console, time.perf_counter(), attempt, part


def _stop_all(processes: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    """SIGTERM every process, wait up to ``timeout_s`` in all, then SIGKILL what is left."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _lock(output_dir: Path, wait_s: float):
    """Hold ``output_dir/.compare.lock`` for the sweep (its runs inherit it): a second sweep on the same folder is
    refused while this one or any run it started lives. Waits up to ``wait_s`` for runs of a sweep that just died."""
    import fcntl

    handle = open(output_dir / ".compare.lock", "w")  # noqa: SIM115 - held until the sweep ends
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except OSError:
            if time.monotonic() >= deadline:
                handle.close()
                raise CompareError(f"another bloggap compare (or a run it started) is using {output_dir}; "
                                   "wait for it to finish or use another --output-dir") from None
            time.sleep(0.1)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


def _raise_stopped(signum, frame):
    raise SweepStopped(signum)


def run_compare(config: CompareConfig, echo=print) -> dict:
    """Run (or resume) the sweep, then write the outputs; returns the results dict (see :func:`build_results`).

    SIGTERM and SIGHUP (when called from the main thread) and Ctrl-C stop every run before this returns by raising
    :class:`SweepStopped` or ``KeyboardInterrupt``; a SIGKILL of this process ends the runs too (see
    :func:`_die_with_parent`).
    """
    runs = validate_config(config)
    out = Path(config.output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CompareError(f"--output-dir {out}: cannot create it ({err.strerror or err}); choose another folder") from None
    lock = _lock(out, config.lock_wait_s)
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers[signal.SIGINT] = signal.getsignal(signal.SIGINT)
        for signum in (signal.SIGTERM, signal.SIGHUP):
            handlers[signum] = signal.signal(signum, _raise_stopped)
    try:
        return _sweep(config, runs, echo, lock.fileno())
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        lock.close()


def _sweep(config: CompareConfig, runs: list[RunSpec], echo, lock_fd: int) -> dict:
    pending = []
    for run in runs:
        log = Path(run.log_jsonl)
        state, why = run_state(config, run)
        if state == "done":
            echo(f"[compare] {run.run_id}: finished earlier, skipped")
            continue
        suffix = {"unfinished": ".partial", "corrupt": ".corrupt", "changed": ".stale"}.get(state)
        if suffix:  # keep the old log aside under a name no run reads, and train the run again
            os.replace(log, log.with_name(log.name + suffix))
            echo(f"[compare] {run.run_id}: {why}; kept as {log.name + suffix}, running it again")
        pending.append(run)
    total, failed = len(runs), {}
    running: dict[str, tuple] = {}  # run_id -> (run, process, console file, start time, attempt, part log)
    last_report, sweep_start = 0.0, time.perf_counter()
    try:
        while pending or running:
            while pending and len(running) < config.parallel:
                run = pending.pop(0)
                running[run.run_id] = (run, *_launch(config, run, lock_fd))
                echo(f"[compare] {run.run_id}: started ({run.recipe}, seed {run.seed})")
            for run_id, (run, process, console, started, attempt, _) in list(running.items()):
                code = process.poll()
                if code is None:
                    continue
                console.close()
                del running[run_id]
                elapsed = time.perf_counter() - started
                marker = _marker_or_none(run.log_jsonl)
                if code == 0 and marker is not None and marker.get("attempt") == attempt:
                    finished = total - len(pending) - len(running) - len(failed)
                    echo(f"[compare] {run_id}: done in {elapsed:.0f} s ({finished}/{total} finished)")
                else:
                    failed[run_id] = code
                    echo(f"[compare] {run_id}: FAILED (exit {code}); last output:\n{_tail(Path(run.log_jsonl).with_suffix('.out'))}")
            now = time.perf_counter()
            if running and now - last_report >= max(10.0, config.poll_s):
                states = ", ".join(f"{rid} step {_steps_logged(part)}/{config.max_steps}"
                                   for rid, (*_, part) in running.items())
                echo(f"[compare] {now - sweep_start:.0f} s: running {states}; {len(pending)} waiting")
                last_report = now
            if running:
                time.sleep(config.poll_s)
    except BaseException as err:
        _ignore_stop_signals()  # a second Ctrl-C or SIGTERM must not cut the clean-up short
        in_flight = [process for _, process, *_ in running.values() if process.poll() is None]
        _stop_all(in_flight)
        for _, _, console, *_ in running.values():
            console.close()
        if isinstance(err, SweepStopped):
            err.stopped = len(in_flight)
        elif isinstance(err, KeyboardInterrupt):
            err.args = (len(in_flight),)
        raise
    results = build_results(config, runs)
    write_outputs(config, results)
    for run_id, why in results["set_aside"].items():
        echo(f"[compare] {run_id}: set aside: {why}")
    results["failed"] = failed
    if failed:
        echo(f"[compare] {len(failed)} run(s) failed: {', '.join(sorted(failed))}; see runs/<run>.out. "
             "Re-run the same command to retry them (finished runs are kept).")
    return results


def _ignore_stop_signals() -> None:
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)


def _marker_or_none(path: str | os.PathLike) -> dict | None:
    try:
        return read_log(path)[1]
    except ValueError:
        return None


# --------------------------------------------------------------------------------------------- statistics


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


def _t_pdf(x: float, df: float) -> float:
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(log_c - (df + 1) / 2 * math.log1p(x * x / df))


def _t_cdf(x: float, df: float) -> float:
    # Student t CDF: 0.5 + integral of the pdf over [0, x] (composite Simpson on the substitution x = tan u,
    # which maps the heavy tail to a finite interval).
    if x == 0:
        return 0.5
    upper = math.atan(abs(x))
    steps = 2000
    h = upper / steps
    total = 0.0
    for i in range(steps + 1):
        u = i * h
        weight = 1 if i in (0, steps) else (4 if i % 2 else 2)
        total += weight * _t_pdf(math.tan(u), df) / math.cos(u) ** 2
    area = total * h / 3
    return 0.5 + area if x > 0 else 0.5 - area


def t_quantile(p: float, df: float) -> float:
    """Quantile of Student's t with ``df`` degrees of freedom (``0 < p < 1``), by bisection on the CDF."""
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if df <= 0:
        raise ValueError(f"df must be > 0, got {df}")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    low, high = 0.0, 1.0
    while _t_cdf(high, df) < p:
        high *= 2
    for _ in range(60):
        mid = (low + high) / 2
        if _t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def paired_interval(deltas: list[float], confidence: float = 0.95) -> dict:
    """Mean of paired differences and its two-sided t interval: ``{n, mean, sd, low, high, half_width}``.

    With fewer than two differences ``sd``/``low``/``high``/``half_width`` are ``None`` (n too small).
    """
    n = len(deltas)
    mean = _mean(deltas)
    sd = _sd(deltas)
    if sd is None:
        return {"n": n, "mean": mean, "sd": None, "low": None, "high": None, "half_width": None}
    half = t_quantile(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "low": mean - half, "high": mean + half, "half_width": half}


def _key_mean(records: list[dict], key: str) -> float | None:
    return _mean([r[key] for r in records if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)])


def summarize_run(records: list[dict], marker: dict | None, last_n: int = 30) -> dict:
    """Per-run numbers from its log records: rewards, last-k and overall means, clip, gap/* means, s/step.

    Rewards come from the records that carry ``reward`` (with ``num_iterations > 1`` TRL logs a reward only on
    steps that generate); clip, ``gap/*`` and ``step_time`` are averaged over every record that carries them.
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
    return {
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
    left out and listed in ``set_aside`` (run id -> why, naming the file and line or the settings).
    """
    arms = list(dict.fromkeys(r.arm for r in runs))
    base = _baseline(config, arms)
    per_run, set_aside = {}, {}
    for run in runs:
        state, why = run_state(config, run)
        if state in ("corrupt", "changed"):
            set_aside[run.run_id] = why
            continue
        if state != "done":
            continue  # unfinished: left out of the table
        records, marker = read_log(run.log_jsonl)
        summary = summarize_run(records, marker, config.last_n)
        summary.update(arm=run.arm, seed=run.seed, recipe=run.recipe)
        per_run[run.run_id] = summary
    by_arm: dict[str, dict[int, dict]] = {arm: {} for arm in arms}
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
    for arm in arms:
        seeds = by_arm[arm]
        deltas = {}
        for seed, s in seeds.items():
            b = by_arm[base].get(seed)
            if arm != base and b is not None and s["reward_last"] is not None and b["reward_last"] is not None:
                deltas[seed] = s["reward_last"] - b["reward_last"]
        gap_keys = sorted({key for s in seeds.values() for key in s["gap"]})
        arm_rows[arm] = {
            "seeds": sorted(seeds),
            "reward_last": _mean([s["reward_last"] for s in seeds.values()]),
            "reward_mean": _mean([s["reward_mean"] for s in seeds.values()]),
            "reward_last_per_seed": {seed: seeds[seed]["reward_last"] for seed in sorted(seeds)},
            "reward_mean_per_seed": {seed: seeds[seed]["reward_mean"] for seed in sorted(seeds)},
            "seed_sd_last": _sd([s["reward_last"] for s in seeds.values()]),
            "delta_vs_base": {seed: deltas[seed] for seed in sorted(deltas)},
            "delta_interval": paired_interval([deltas[s] for s in sorted(deltas)]) if arm != base else None,
            "clip": _mean([s["clip"] for s in seeds.values() if s["clip"] is not None]),
            "sampling_dlogp": _mean([s["sampling_dlogp"] for s in seeds.values() if s["sampling_dlogp"] is not None]),
            "gap": {key: _mean([s["gap"].get(key) for s in seeds.values()]) for key in gap_keys},
            "s_per_step": _mean([s["s_per_step"] for s in seeds.values() if s["s_per_step"] is not None]),
        }
    resolution = _resolution(per_run, arm_rows, base, k, len(config.seeds))
    results = {"baseline": base, "arms": arm_rows, "runs": per_run, "set_aside": set_aside, "last_k": k,
               "resolution": resolution}
    results["tables"] = _tables(config, results)
    return results


def _resolution(per_run: dict, arm_rows: dict, base: str, k: int, n_seeds: int) -> dict:
    """Per-step reward noise and the smallest arm difference this sweep could detect."""
    variances_last = [s["reward_sd_last"] ** 2 for s in per_run.values() if s["reward_sd_last"] is not None]
    variances_all = [s["reward_sd_steps"] ** 2 for s in per_run.values() if s["reward_sd_steps"] is not None]
    step_sd_last = math.sqrt(sum(variances_last) / len(variances_last)) if variances_last else None
    step_sd_all = math.sqrt(sum(variances_all) / len(variances_all)) if variances_all else None
    seed_sds = [row["seed_sd_last"] for row in arm_rows.values() if row["seed_sd_last"] is not None]
    out = {
        "n_seeds": n_seeds,
        "last_k": k,
        "step_sd_last": step_sd_last,
        "step_sd_all": step_sd_all,
        "seed_sd_last": _mean(seed_sds),
        "se_last_mean": step_sd_last / math.sqrt(k) if step_sd_last is not None and k else None,
        "mdd_step_noise": None,
        "delta_sd_pooled": None,
        "delta_df": 0,
        "mdd_paired": None,
    }
    z = 1.959964 + 0.841621  # two-sided 5% test, 80% power
    if step_sd_last is not None and k:
        # Two arms, n seeds each, k steps per mean, steps independent: SE of the difference = sd * sqrt(2 / (k n)).
        out["mdd_step_noise"] = z * step_sd_last * math.sqrt(2.0 / (k * n_seeds))
    squares, df = 0.0, 0
    for arm, row in arm_rows.items():
        values = list(row["delta_vs_base"].values())
        if arm == base or len(values) < 2:
            continue
        mean = sum(values) / len(values)
        squares += sum((v - mean) ** 2 for v in values)
        df += len(values) - 1
    if df:
        sd = math.sqrt(squares / df)
        out["delta_sd_pooled"] = sd
        out["delta_df"] = df
        out["mdd_paired"] = (t_quantile(0.975, df) + t_quantile(0.80, df)) * sd / math.sqrt(n_seeds)
    return out


# --------------------------------------------------------------------------------------------- tables


def _r(value: float | None, digits: int = 4):
    return None if value is None else round(float(value), digits)


def _signed(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:+.{digits}f}"


def _tables(config: CompareConfig, results: dict) -> list[dict]:
    base, k = results["baseline"], results["last_k"]
    arms = results["arms"]
    headline = [key for key in _HEADLINE_GAP_KEYS if any(key in row["gap"] for row in arms.values())]
    columns = ["arm", "seeds", f"reward last-{k}", "reward mean", f"vs {base} per seed", f"vs {base}: mean [95% CI]",
               "clip", *[f"{key} %" for key in headline], "s/step"]
    rows = []
    for arm, row in arms.items():
        per_seed = " / ".join(_signed(row["delta_vs_base"][s]) for s in row["delta_vs_base"]) if arm != base else "-"
        interval = row["delta_interval"]
        if arm == base:
            ci = "baseline"
        elif interval is None or interval["n"] == 0:
            ci = "-"
        elif interval["half_width"] is None:
            ci = f"{_signed(interval['mean'])} (n={interval['n']}: too small for an interval)"
        else:
            ci = f"{_signed(interval['mean'])} [{_signed(interval['low'])}, {_signed(interval['high'])}]"
        gap_cells = [_r(100 * row["gap"][key], 2) if row["gap"].get(key) is not None else None for key in headline]
        rows.append([arm, len(row["seeds"]), _r(row["reward_last"]), _r(row["reward_mean"]), per_seed, ci,
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
    gap_keys = sorted({key for row in arms.values() for key in row["gap"]})
    if gap_keys:
        tables.append({
            "id": "T10-gap",
            "title": "gap/* metrics by arm (mean over steps and seeds)",
            "columns": ["arm", *gap_keys],
            "rows": [[arm, *[_r(row["gap"].get(key), 6) for key in gap_keys]] for arm, row in arms.items()],
            "notes": "Plugin metrics as logged (fractions, not percent); definitions in DESIGN.md.",
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


# --------------------------------------------------------------------------------------------- outputs


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
    for arm in results["arms"]:
        runs = by_arm.get(arm, [])
        if not runs:
            continue
        length = min(len(r["rewards"]) for r in runs)
        if length == 0:
            continue
        curves = [_rolling(r["rewards"][:length], smooth) for r in runs]
        steps = list(range(1, length + 1))
        mean = [sum(c[i] for c in curves) / len(curves) for i in range(length)]
        (line,) = ax.plot(steps, mean, label=f"{arm} ({len(runs)} seed{'s' if len(runs) > 1 else ''})")
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
    document = {
        "benchmark": "compare",
        "schema_version": 1,
        "env": environment_record("cpu" if not _cuda_available() else None, model=config.model),
        "params": params,
        "results": {k: v for k, v in results.items() if k != "tables"},
        "tables": results["tables"],
    }
    paths = {"json": str(out / "compare.json"), "markdown": str(out / "compare.md"), "plot": str(out / "reward_curves.png")}
    lines = [f"# Reward comparison: {config.task}, {config.model}", ""]
    lines += [f"Recipes: {', '.join(config.recipes)}; seeds {', '.join(map(str, config.seeds))}; "
              f"{config.max_steps} steps per run.", ""]
    for table in results["tables"]:
        lines += render_table(table) + [""]
    lines += ["![reward curves](reward_curves.png)", ""]
    current = paths["json"]
    try:
        atomic_write_text(current, json.dumps(_finite(document), indent=1, default=str, allow_nan=False) + "\n")
        current = paths["plot"]
        plot_reward_curves(results, current, smooth=config.smooth,
                           title=f"{config.task}, {config.model}: reward by arm (mean over seeds, band = seed range)")
        current = paths["markdown"]
        atomic_write_text(current, "\n".join(lines))
    except OSError as err:
        raise CompareError(f"{current}: cannot write ({err.strerror or err}); the previous file is unchanged and the "
                           "run logs are kept: fix that and re-run the command with --table-only") from None
    return paths


def _finite(value):
    """``value`` with every NaN/Inf float replaced by ``None`` (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


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


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="bloggap compare worker (internal)")
    parser.add_argument("--worker", required=True, help="run spec JSON written by run_compare")
    args = parser.parse_args(argv)
    return _worker(args.worker)


if __name__ == "__main__":
    sys.exit(_main())
