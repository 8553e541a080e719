"""Settings of a comparison sweep (:class:`CompareConfig`), its planned runs (:class:`RunSpec`) and every check made
before anything trains (:func:`validate_config`, :class:`CompareError`)."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bloggap_plugin.core.errors import SEED_MAX, UsageError
from bloggap_plugin.core.vllm.versions import vllm_unavailable_reason

__all__ = [
    "CompareConfig",
    "CompareError",
    "RunSpec",
    "DONE_KEY",
    "DEFAULT_RUN_FN",
    "RENAMED_RUN_FNS",
    "DEFAULT_HELDOUT_FN",
    "heldout_count",
    "VLLM_GPU_SHARE",
    "plan_runs",
    "validate_config",
    "vllm_unavailable_reason",
    "effective_overrides",
]


DONE_KEY = "_compare"


DEFAULT_RUN_FN = "bloggap_plugin.trl.run:run_training"


RENAMED_RUN_FNS = {"bloggap_plugin.trl.train:run_training": DEFAULT_RUN_FN}
"""Training functions whose module was renamed: the ``module:function`` that run logs, specs and result files
recorded -> the current one. :func:`resolve_function` loads the current function for a recorded name, and a resume
counts a log recorded under the old name as trained with the same function (:func:`current_run_fn`)."""


DEFAULT_HELDOUT_FN = "bloggap_plugin.compare.heldout:evaluate_saved"


VLLM_GPU_SHARE = 0.75
"""Fraction of the GPU's memory the vLLM engines of a ``--use-vllm`` sweep take together (each run's engine gets
``VLLM_GPU_SHARE / parallel``); the rest is for the runs' training (weights, optimizer, activations)."""


ANALYSIS_METRICS = {"reward_last": "reward last-k", "reward_mean": "reward mean", "heldout": "held-out accuracy"}
"""The metrics a sweep's analysis may declare (name -> label in tables)."""


class CompareError(UsageError):
    """Settings or folder state that stop a sweep before it starts; the message names the problem and the fix."""


@dataclass
class CompareConfig:
    """Settings of one comparison sweep (each field is a ``bloggap compare`` flag with the help text below)."""

    recipes: list[str] = field(metadata={"help": "Recipe files, one per arm (e.g. recipes/arm_*.yaml).",
                                         "positional": "+"})
    seeds: list[int] = field(default_factory=lambda: [0, 1], metadata={"min": 0, "max": SEED_MAX,
        "help": "Seeds; every arm runs once per seed, and arms with the same seed see the same prompts and sampling "
                "seeds."})
    task: str = field(default="arith", metadata={"help": "Training task: 'arith' or 'gsm8k'.",
                                                 "choices": ["arith", "gsm8k"]})
    max_steps: int = field(default=60, metadata={"min": 1, "help": "Optimizer steps per run."})
    model: str = field(default="smollm2", metadata={"help": "Model spec for bloggap_plugin.models.load_model."})
    output_dir: str = field(default="compare_out", metadata={"help": "Folder for logs, table, JSON and plot."})
    parallel: int = field(default=1, metadata={"min": 1, "help": "Runs in flight at once, each its own process."})
    difficulty: int | None = field(default=None, metadata={"min": 1, "max": 5,
        "help": "Arithmetic task level 1-5 (default: the task's default)."})
    n: int | None = field(default=None, metadata={"min": 1,
        "help": "Number of prompts in the training set (default: the task's default)."})
    data: str | None = field(default=None, metadata={
        "help": "GSM8K only: a local file or folder in GSM8K format (.jsonl, .json, .parquet), e.g. "
                "../shared/data/gsm8k (default: $BLOGGAP_GSM8K_DATA, else openai/gsm8k from the hub or its cache).",
        "metavar": "PATH"})
    calc_steps: str | None = field(default=None, metadata={
        "help": "GSM8K only: only problems with N (or LOW-HIGH) <<...>> calculation steps, e.g. 1 or 1-2.",
        "metavar": "N|LOW-HIGH"})
    train_split: str | None = field(default=None, metadata={
        "help": "GSM8K only: the split the training prompts come from: train (the default: every row) or "
                "train_minus_validation (train without the fixed validation rows a warm start is chosen on).",
        "choices": ["train", "train_minus_validation"]})
    use_vllm: bool = field(default=False, metadata={
        "help": "Generate with TRL's colocated vLLM engine (use_vllm=True, vllm_mode='colocate') instead of HF "
                "generate; needs CUDA and vLLM, and the GPU's memory is divided among the parallel runs."})
    heldout_n: int | None = field(default=None, metadata={"min": 0,
        "help": "Held-out prompts evaluated greedily at the end of each run (GSM8K: the test split's first N with "
                "the calc_steps filter; arith: questions no training set of the run holds); 0 = no held out "
                "evaluation. Default: 512 with the default training function, 0 with a custom run_fn that takes no "
                "save_final."})
    heldout_every: int = field(default=0, metadata={"min": 0, "metavar": "K", "help": (
        "Also evaluate the held-out prompts every K optimizer steps during training (0 = only at the end; needs the "
        "default training function).")})
    heldout_max_tokens: int | None = field(default=None, metadata={"min": 1, "metavar": "T", "help": (
        "New tokens per held-out completion (default: the run's max_completion_length).")})
    heldout_batch_size: int = field(default=64, metadata={"min": 1, "help": "Held-out prompts per generate call."})
    heldout_apart: bool = field(default=False, metadata={"help": (
        "Evaluate each run's saved policy in a process of its own, started once the run's training process has "
        "ended, instead of in the training process: the training's GPU memory (vLLM's engine among it) is free "
        "for the evaluation and the runs beside it, for one more process start per run. The result is the same: "
        "either way the evaluation loads the saved policy.")})
    heldout_fn: str = field(default=DEFAULT_HELDOUT_FN, metadata={"metavar": "MODULE:FUNCTION", "help": (
        "Function that evaluates a run's saved policy (signature of bloggap_plugin.compare.heldout.evaluate_saved).")})
    time_budget_s: float | None = field(default=None, metadata={"above": 0, "metavar": "S", "help": (
        "Seconds this call may take: no run starts that would not finish in time (its duration estimated from the "
        "runs finished so far), and at the limit the runs in flight are stopped and the outputs written (exit 3; run "
        "the command again to continue). Default: no limit.")})
    retries: int = field(default=0, metadata={"min": 0, "metavar": "N", "help": (
        "Times a run whose process failed is started again in the same call, after the runs waiting and within the "
        "time budget: a failed training from zero (its partial log kept aside), a failed held-out evaluation from the "
        "policy its training saved (which a later call on a fresh machine would no longer have). The failed "
        "attempt's console is kept as runs/<run>.out.failed. Default 0: a failed run waits for the next call.")})
    last_n: int = field(default=30, metadata={"min": 1, "help": "Steps in the 'reward last-k' window."})
    baseline: str | None = field(default=None, metadata={
        "help": "Arm the deltas are taken against (default: arm A if present, else the first recipe)."})
    primary: str = field(default="reward_last", metadata={"choices": list(ANALYSIS_METRICS), "help": (
        "The declared primary metric, compared per arm with the baseline on the planned seeds: reward_last (mean "
        "reward of the final --last-n reward steps), reward_mean (over the whole run) or heldout (held-out "
        "accuracy).")})
    secondary: list[str] = field(default_factory=lambda: ["reward_mean", "heldout"], metadata={"help": (
        "Declared secondary metrics (same choices as --primary), each tested with the same correction; heldout is "
        "skipped when no run evaluates held-out prompts.")})
    alpha: float = field(default=0.05, metadata={"above": 0, "max": 0.5, "help": (
        "Family-wise error rate over the arms compared with the baseline: intervals are simultaneous (Bonferroni, "
        "1 - alpha/m each for m arms) and p-values Holm-adjusted.")})
    planned_seeds: list[int] = field(default_factory=list, metadata={"min": 0, "max": SEED_MAX, "help": (
        "Seeds declared before the sweep for its analysis (default: --seeds). Until every arm has finished all of "
        "them the tables are interim: means and per-seed differences, no interval or p-value, so a conclusion "
        "cannot depend on when someone looked.")})
    extra_overrides: dict = field(default_factory=dict, metadata={
        "help": "GRPOConfig overrides applied to every arm: a YAML (or JSON) mapping, e.g. '{num_iterations: 2}', as "
                "train's --extra-overrides (in a --config file: a mapping).", "aliases": ["--override"], "parse": str,
        "metavar": "YAML"})
    run_fn: str = field(default=DEFAULT_RUN_FN, metadata={
        "help": "module:function that trains one run (signature of bloggap_plugin.trl.run.run_training)."})
    pythonpath: list[str] = field(default_factory=list, metadata={
        "help": "Extra import paths for the run function's module (used by tests)."})
    smooth: int = field(default=5, metadata={"min": 1,
        "help": "Rolling-mean window (steps) of the reward curves in the plot (1 = raw)."})
    poll_s: float = field(default=2.0, metadata={"above": 0, "help": "Seconds between progress checks."})
    lock_wait_s: float = field(default=2.0, metadata={"min": 0,
        "help": "Seconds to wait for the folder's lock (runs of a sweep that was just killed take a moment to end)."})

    def __post_init__(self) -> None:
        self.run_fn = current_run_fn(self.run_fn)  # a recorded old name is the function it was renamed to


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


def _arm_label(recipe: Path) -> str:
    """The arm label of ``recipe``: its ``gap.arm``, else its file stem (the full recipe check comes later)."""
    from bloggap_plugin._input_files import display_name, load_yaml_file
    from bloggap_plugin.recipes import check_recipe_path

    check_recipe_path(recipe)
    gap = _mapping(load_yaml_file(recipe, f"recipe {display_name(recipe)}", "give a YAML recipe such as "
                                  "recipes/arm_A.yaml", error=CompareError)).get("gap")
    arm = _mapping(gap).get("arm")
    return str(arm) if arm else recipe.stem


def _mapping(value) -> dict:
    return value if isinstance(value, dict) else {}


def _check_analysis(config: CompareConfig) -> None:
    """The declared analysis: known metrics, the primary not repeated as secondary, alpha in (0, 0.5], planned seeds
    distinct and including every seed that runs."""
    for option, name in (("--primary", config.primary), *(("--secondary", m) for m in config.secondary)):
        if name not in ANALYSIS_METRICS:
            raise CompareError(f"{option} {name}: not a metric; use one of {', '.join(ANALYSIS_METRICS)}")
    if config.primary in config.secondary:
        raise CompareError(f"--secondary lists the primary metric {config.primary}; drop it there")
    if len(set(config.secondary)) != len(config.secondary):
        raise CompareError(f"--secondary {' '.join(config.secondary)}: a metric is repeated; give each once")
    alpha = config.alpha
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 0.5:
        raise CompareError(f"--alpha {alpha}: must be a number in (0, 0.5], e.g. 0.05")
    planned = config.planned_seeds
    if planned:
        if len(set(planned)) != len(planned):
            raise CompareError(f"--planned-seeds {' '.join(map(str, planned))}: a seed is repeated; give each once")
        extra = [seed for seed in config.seeds if seed not in planned]
        if extra:
            raise CompareError(f"--seeds {' '.join(map(str, extra))}: not among --planned-seeds "
                               f"{' '.join(map(str, planned))}; declare every seed before the sweep runs it")


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
    building each arm's ``GRPOConfig`` (as :func:`bloggap_plugin.trl.run.run_training` does on CPU), and the task
    settings by building one prompt of the task.
    """
    from bloggap_plugin._fields import check_values

    if not config.recipes:
        raise CompareError("give at least one recipe file, e.g. recipes/arm_A.yaml recipes/arm_F.yaml")
    try:
        check_values(config)  # each number in its field's range (the Python API gets the flags' checks)
    except UsageError as err:
        raise CompareError(str(err)) from None
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
    except (OSError, ValueError) as err:  # a RecipeError is a ValueError
        raise CompareError(str(err).splitlines()[0]) from None
    arms = list(dict.fromkeys(run.arm for run in runs))
    _check_analysis(config)
    if config.baseline is not None and config.baseline not in arms:
        raise CompareError(f"--baseline {config.baseline} names no arm; the arms are {', '.join(arms)} "
                           "(each recipe's gap.arm, else its file name)")
    for option, value, low in (("--heldout-n", config.heldout_n, 0), ("--heldout-every", config.heldout_every, 0),
                               ("--heldout-max-tokens", config.heldout_max_tokens, 1),
                               ("--heldout-batch-size", config.heldout_batch_size, 1)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise CompareError(f"{option} {value}: must be a whole number >= {low}")
    if config.time_budget_s is not None and not (isinstance(config.time_budget_s, (int, float)) and config.time_budget_s > 0):
        raise CompareError(f"--time-budget-s {config.time_budget_s}: must be a number of seconds > 0 (or leave it out)")
    if training:
        if config.run_fn == DEFAULT_RUN_FN:  # the model loads in every run: check it once, before any starts
            from bloggap_plugin.models import check_model_spec

            try:
                check_model_spec(config.model)
            except UsageError as err:
                raise CompareError(f"--model {config.model}: {err}") from None
        _check_override_conflicts(config)
        _check_vllm(config)
        _check_task(config)
        _check_heldout(config)
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
    kwargs = run_task_kwargs(config)
    if config.task != "gsm8k" and all(kwargs.get(key) is None for key in ("difficulty", "data", "calc_steps", "train_split")):
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
        elif config.train_split is not None and "train_split" in message:
            option = "--train-split"
        else:
            option = "--task"
        raise CompareError(f"{option}: {message}") from None


def run_task_kwargs(config: CompareConfig) -> dict:
    """The task options every run gets: ``difficulty``, ``n``, ``data`` (GSM8K: the local path in effect, absolute,
    from ``--data`` or ``$BLOGGAP_GSM8K_DATA``; ``None`` = the hub) and, when set, ``calc_steps`` and
    ``train_split``."""
    data = config.data
    if config.task == "gsm8k":
        from bloggap_plugin.tasks.gsm8k import resolve_data

        data = resolve_data(data)
        data = None if data is None else str(Path(data).absolute())
    kwargs: dict = {"difficulty": config.difficulty, "n": config.n, "data": data}
    if config.calc_steps is not None:  # only when set: logs of sweeps from before the option keep their settings
        kwargs["calc_steps"] = str(config.calc_steps)
    if config.train_split is not None:  # likewise
        kwargs["train_split"] = config.train_split
    return kwargs


def _resolve_with_path(config: CompareConfig, function_path: str):
    """``module:function`` imported, its top-level module looked up first in the sweep's extra import paths
    (``config.pythonpath``, which the workers get through ``PYTHONPATH``), without changing ``sys.path``."""
    top = current_run_fn(function_path).partition(":")[0].split(".")[0]
    if config.pythonpath and top and top not in sys.modules:
        spec = importlib.machinery.PathFinder.find_spec(top, [str(extra) for extra in config.pythonpath])
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            sys.modules[top] = module  # as an import registers it: submodules and re-imports find it
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[top]
                raise
    return resolve_function(function_path)


def _accepts(function_path: str, config: CompareConfig, name: str) -> bool:
    """Whether the function ``module:function`` takes keyword ``name`` (or ``**kwargs``); False if it cannot load."""
    try:
        params = inspect.signature(_resolve_with_path(config, function_path)).parameters
    except Exception:  # noqa: BLE001 - reported by the run-function check
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def heldout_count(config: CompareConfig) -> int:
    """Held-out prompts per run: ``heldout_n``, or when it is ``None`` the default
    (:data:`bloggap_plugin.tasks.HELDOUT_DEFAULT_N`) if the training function can save its policy (takes
    ``save_final``), else 0 (no held-out evaluation)."""
    if config.heldout_n is not None:
        return int(config.heldout_n)
    from bloggap_plugin.tasks import HELDOUT_DEFAULT_N

    return HELDOUT_DEFAULT_N if _accepts(config.run_fn, config, "save_final") else 0


def _check_heldout(config: CompareConfig) -> None:
    """With a held-out evaluation: a training function that saves its policy, an evaluation function that loads, and
    (default evaluation function) held-out prompts the task can build (GSM8K: a test split distinct from train)."""
    if heldout_count(config) == 0:
        if config.heldout_every:
            raise CompareError(f"--heldout-every {config.heldout_every} needs the held-out evaluation on: drop "
                               "--heldout-n 0")
        return
    if not _accepts(config.run_fn, config, "save_final"):
        raise CompareError(f"--heldout-n {config.heldout_n}: --run-fn {config.run_fn} takes no save_final, so no "
                           "trained policy is left to evaluate; use --heldout-n 0 or a training function that saves it")
    if config.heldout_every and not _accepts(config.run_fn, config, "heldout"):
        raise CompareError(f"--heldout-every {config.heldout_every}: --run-fn {config.run_fn} takes no heldout; "
                           "use the default training function or drop --heldout-every")
    try:
        _resolve_with_path(config, config.heldout_fn)
    except Exception as err:  # noqa: BLE001
        raise CompareError(f"--heldout-fn {config.heldout_fn}: cannot load it ({err}); give module:function") from None
    if config.heldout_fn != DEFAULT_HELDOUT_FN:
        return
    from bloggap_plugin.tasks import get_heldout

    try:
        get_heldout(config.task, None, seed=config.seeds[0], heldout_n=1, **run_task_kwargs(config))
    except Exception as err:  # noqa: BLE001 - it would fail every run's evaluation: report it once
        raise CompareError(f"held-out evaluation: {str(err).splitlines()[0]}") from None


def effective_overrides(config: CompareConfig) -> dict:
    """The GRPOConfig overrides each run gets: ``--override``, plus for ``--use-vllm`` ``use_vllm=True``,
    ``vllm_mode="colocate"`` and ``vllm_gpu_memory_utilization = VLLM_GPU_SHARE / parallel`` (an ``--override``
    of a field wins)."""
    if not config.use_vllm:
        return dict(config.extra_overrides)
    vllm = {"use_vllm": True, "vllm_mode": "colocate",
            "vllm_gpu_memory_utilization": round(VLLM_GPU_SHARE / max(1, int(config.parallel)), 4)}
    return {**vllm, **config.extra_overrides}


SWEEP_FIELDS = {"max_steps": "--max-steps", "seed": "--seeds", "output_dir": "--output-dir", "report_to": None,
                "data_seed": "--seeds"}
"""GRPOConfig fields each run takes from the sweep (the flag that sets each; ``None``: fixed, each run logs to its JSONL;
``data_seed`` follows the run's seed when unset):
an ``--override`` of one would train what the tables do not report, so it is refused."""


def _check_override_conflicts(config: CompareConfig) -> None:
    """Refuse an ``--override`` of a field the sweep sets per run (:data:`SWEEP_FIELDS`)."""
    for key, flag in SWEEP_FIELDS.items():
        if key in config.extra_overrides:
            fix = f"use {flag}" if flag else "each run logs to its own JSONL under --output-dir"
            raise CompareError(f"--override {key}: each run's {key} comes from the sweep ({fix}); drop it from "
                               "--override")


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
        from bloggap_plugin.core.vllm.versions import supported_text

        problem = vllm_unavailable_reason()
        if problem:
            raise CompareError(f"--use-vllm: {problem}; run the sweep on a machine with a CUDA GPU and "
                               f"{supported_text()}, or drop --use-vllm to generate with HF generate")


def _check_grpo_settings(config: CompareConfig, runs: list[RunSpec]) -> None:
    """Each recipe and ``--override`` must make a valid ``GRPOConfig`` (the fields run_training sets on CPU)."""
    from bloggap_plugin.recipes import (
        RecipeError,
        grpo_field_names,
        load_recipe,
        merge_grpo_config,
        unknown_key_error,
    )
    from bloggap_plugin.trl.run import run_overrides

    valid = grpo_field_names()
    if valid is not None:
        for key in config.extra_overrides:
            if key not in valid:
                raise CompareError(str(unknown_key_error(key, valid, "--override")))
    overrides = json.dumps(config.extra_overrides)
    effective = effective_overrides(config)
    for run in {run.recipe: run for run in runs}.values():
        try:
            grpo_kwargs, _ = load_recipe(run.recipe)
        except RecipeError as err:
            raise CompareError(str(err).splitlines()[0]) from None
        fields = {**run_overrides(grpo_kwargs, output_dir=run.output_dir, report_to="none", seed=run.seed,
                                  max_steps=config.max_steps, on_cpu=True), **effective}
        try:
            merge_grpo_config(grpo_kwargs, None, **fields)
        except Exception as err:  # noqa: BLE001 - TRL/transformers raise ValueError, TypeError, ...
            where = f"{run.recipe} with --override {overrides}" if config.extra_overrides else run.recipe
            raise CompareError(f"{where}: GRPOConfig rejects it: {str(err).strip().splitlines()[0]}") from None


def current_run_fn(run_fn: str) -> str:
    """The current name of the ``module:function`` a log or result file recorded (:data:`RENAMED_RUN_FNS`)."""
    return RENAMED_RUN_FNS.get(run_fn, run_fn)


def resolve_function(run_fn: str) -> Callable:
    """The function a ``module:function`` string names (imported on the current ``sys.path``); a recorded name of
    a renamed function loads the function under its current name."""
    module_name, _, attr = current_run_fn(run_fn).partition(":")
    if not attr:
        raise ValueError(f"run function must be 'module:function', got {run_fn!r}")
    return getattr(importlib.import_module(module_name), attr)


def _check_run_fn(config: CompareConfig) -> None:
    """A custom training function must import, and take ``task_kwargs`` when the task settings need them."""
    try:
        run_fn = _resolve_with_path(config, config.run_fn)
    except Exception as err:  # noqa: BLE001
        raise CompareError(f"--run-fn {config.run_fn}: cannot load it ({err}); give module:function") from None
    task_kwargs = sorted(k for k, v in run_task_kwargs(config).items() if v is not None)
    if task_kwargs:
        params = inspect.signature(run_fn).parameters
        if "task_kwargs" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            raise CompareError(f"--run-fn {config.run_fn} takes no task_kwargs, so {task_kwargs} cannot reach the task; "
                               "drop --difficulty/--n/--data/--calc-steps or use a training function that accepts "
                               "task_kwargs")
