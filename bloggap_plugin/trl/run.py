"""One GRPO run from a recipe: the engine behind ``bloggap train`` and ``bloggap compare``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["run_training", "prepare_run", "summarize_history", "TrainConfig", "train_config", "RunPlan", "JsonlLogger",
           "HeldoutCallback", "HELDOUT_KEYS", "check_heldout_spec", "SEED_MAX", "reference_from_policy",
           "StepsAnnouncer", "STOP_SIGNALS", "stop_signals_interrupt"]


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def JsonlLogger(path: str | Path):  # noqa: N802 - a factory that returns a TrainerCallback
    """A ``TrainerCallback`` appending one JSON line per logged step (every logged key, incl. ``gap/*``)."""
    from transformers import TrainerCallback

    class _JsonlLogger(TrainerCallback):
        def __init__(self) -> None:
            self.path = Path(path)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.records: list[dict] = []
            self.failed = False

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "train_runtime" in logs:
                return
            record = {"step": state.global_step, **{k: _jsonable(v) for k, v in logs.items()}}
            self.records.append(record)
            if self.failed:
                return
            try:
                with open(self.path, "a") as handle:
                    handle.write(json.dumps(record) + "\n")
            except OSError as err:  # a full disk must not end the training: say so once, keep the records
                self.failed = True
                warnings.warn(f"bloggap: cannot write the step log {self.path} ({err.strerror or err}); training goes "
                              "on, and the steps from here are not written there (they are in the run's summary)",
                              stacklevel=2)

    return _JsonlLogger()


def StepsAnnouncer():  # noqa: N802 - a factory that returns a TrainerCallback
    """A ``TrainerCallback`` for runs without ``--max-steps``: says on stderr how many optimizer steps the run will
    take (known when training begins) and, after the first step, about how long they will take."""
    import sys

    from transformers import TrainerCallback

    class _StepsAnnouncer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()
            print(f"bloggap train: {state.max_steps} optimizer steps (no --max-steps: the recipe's max_steps, else its "
                  "num_train_epochs over the task's prompts); Ctrl-C stops with the summary of the steps done",
                  file=sys.stderr, flush=True)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                took = time.perf_counter() - self.started
                print(f"bloggap train: the first step took {took:.1f} s; all {state.max_steps} would take about "
                      f"{took * state.max_steps / 60:.0f} min at that rate", file=sys.stderr, flush=True)

    return _StepsAnnouncer()


HELDOUT_KEYS = ("every", "n", "max_tokens", "batch_size")
"""Keys of ``TrainConfig.heldout``."""


def check_heldout_spec(spec: dict | None, option: str = "--heldout") -> None:
    """Raise ``UsageError`` unless ``spec`` is ``None`` or a mapping of :data:`HELDOUT_KEYS` to whole numbers >= 1,
    with ``every``."""
    from bloggap_plugin.core.errors import UsageError

    if spec is None:
        return
    if not isinstance(spec, dict):
        raise UsageError(f"{option}: expected a mapping such as '{{every: 20, n: 256}}', got {spec!r}")
    unknown = sorted(set(spec) - set(HELDOUT_KEYS))
    if unknown:
        raise UsageError(f"{option}: unknown key(s) {', '.join(unknown)}; the keys are {', '.join(HELDOUT_KEYS)}")
    if "every" not in spec:
        raise UsageError(f"{option}: give 'every' (evaluate every K optimizer steps), e.g. '{{every: 20}}'")
    for key, value in spec.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{option}: {key} {value!r} must be a whole number >= 1")


def HeldoutCallback(tokenizer, config: TrainConfig, log_jsonl: str | Path | None, max_tokens: int,  # noqa: N802
                    heldout_set: tuple | None = None):
    """A ``TrainerCallback`` that measures greedy accuracy on the task's held-out prompts
    (:func:`bloggap_plugin.tasks.get_heldout`) every ``config.heldout["every"]`` optimizer steps, with the policy as it
    is (no weights, mode or RNG state changed), and appends ``{"step", "heldout/accuracy", "heldout/correct",
    "heldout/n", "heldout/seconds"}`` to ``log_jsonl`` (and to its ``records``). ``heldout_set``: those prompts
    already built (:attr:`RunPlan.heldout`); ``None`` builds them here."""
    from transformers import TrainerCallback

    from bloggap_plugin.heldout_accuracy import heldout_accuracy
    from bloggap_plugin.tasks import for_tokenizer

    spec = config.heldout
    dataset, (reward,) = _heldout_set(config) if heldout_set is None else heldout_set
    dataset = for_tokenizer(dataset, tokenizer)

    class _HeldoutCallback(TrainerCallback):
        def __init__(self) -> None:
            self.records: list[dict] = []

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if model is None or state.global_step % spec["every"]:
                return
            result = heldout_accuracy(model, tokenizer, dataset, reward, spec.get("max_tokens", max_tokens),
                                      spec.get("batch_size", 64))
            record = {"step": state.global_step, "heldout/accuracy": result["accuracy"],
                      "heldout/correct": result["correct"], "heldout/n": result["n"], "heldout/seconds": result["seconds"]}
            self.records.append(record)
            if log_jsonl is not None:
                with open(log_jsonl, "a") as handle:
                    handle.write(json.dumps(record) + "\n")

    return _HeldoutCallback()


def _heldout_set(config: TrainConfig) -> tuple:
    """``(dataset, reward_funcs)`` of the run's held-out prompts (``config.heldout["n"]`` of them), before the
    tokenizer."""
    from bloggap_plugin.tasks import HELDOUT_DEFAULT_N, get_heldout

    return get_heldout(config.task, None, seed=config.seed, heldout_n=config.heldout.get("n", HELDOUT_DEFAULT_N),
                       **(config.task_options() or {}))


def _mapping(text: str) -> dict:
    """A YAML/JSON mapping given on the command line, e.g. ``'{beta: 0.04}'``."""
    import argparse

    from bloggap_plugin._input_files import load_yaml
    from bloggap_plugin.core.errors import UsageError, short_repr

    try:
        value = load_yaml(text, "the mapping")
    except UsageError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a YAML mapping such as '{{key: value}}', got {short_repr(text)}")
    return value


def _help(text: str, **more: Any) -> dict:
    return {"help": text, **more}


@dataclass
class TrainConfig:
    """One GRPO run from a recipe: what :func:`prepare_run` checks and :func:`run_training` trains (the flags of
    ``bloggap train``; each field's ``metadata["help"]`` says what it does)."""

    recipe: str = field(metadata=_help("recipe YAML: GRPOConfig fields plus a gap: section", positional=None))
    model: str = field(default="smollm2", metadata=_help("model spec (default smollm2, offline)"))
    task: str = field(default="arith", metadata=_help("task: arith (default) or gsm8k"))
    data: str | None = field(default=None, metadata=_help(
        "gsm8k: the data as a local .jsonl/.json/.parquet file or folder, e.g. ../shared/data/gsm8k (default: "
        "$BLOGGAP_GSM8K_DATA, else openai/gsm8k from the Hugging Face hub or its cache)", metavar="PATH"))
    calc_steps: str | None = field(default=None, metadata=_help(
        "gsm8k: train on the problems with N (or LOW-HIGH) <<...>> calculation steps", metavar="N|LOW-HIGH"))
    max_steps: int | None = field(default=None, metadata=_help("optimizer steps, >= 1 (default: the recipe's)", min=1))
    output_dir: str = field(default="bloggap-runs/train", metadata=_help("trainer output folder"))
    # None: not given (the annotation leaves None out: HfArgumentParser takes no three-way union)
    report_to: str | list[str] = field(default=None, metadata=_help(
        "where to log, one or more (as GRPOConfig.report_to): none, wandb, tensorboard, trackio ... (default: the "
        "recipe's report_to, else none)", metavar="NAME"))
    seed: int | None = field(default=None, metadata=_help(
        "seed of the run (GRPOConfig.seed and the task's data; default: the recipe's seed, else 0)", min=0,
        max=2**32 - 1))
    log_jsonl: str | None = field(default=None, metadata=_help("also write one JSON line per logged step here"))
    device: str | None = field(default=None, metadata=_help("cpu or cuda (default: cuda if available)"))
    extra_overrides: dict | None = field(default=None, metadata=_help(
        "GRPOConfig fields applied after the recipe, as a YAML mapping, e.g. '{beta: 0.04}'", parse=_mapping))
    gap_overrides: dict | None = field(default=None, metadata=_help(
        "fields of the recipe's gap: section replaced (validated), as a YAML mapping, e.g. '{band: 0.2}'",
        parse=_mapping))
    task_kwargs: dict | None = field(default=None, metadata=_help(
        "more options of the task, as a YAML mapping (data and calc_steps are added to them)", parse=_mapping))
    save_final: str | None = field(default=None, metadata=_help(
        "save the trained policy and its tokenizer into this folder when training ends (e.g. for a held-out "
        "evaluation)", metavar="DIR"))
    heldout: dict | None = field(default=None, metadata=_help(
        "greedy accuracy on the task's held-out prompts during training, as a YAML mapping {every: K, n: N, "
        "max_tokens: T, batch_size: B}: every K optimizer steps one JSON line {step, heldout/accuracy, ...} in "
        "--log-jsonl", parse=_mapping))

    def task_options(self) -> dict | None:
        """``task_kwargs`` plus ``data`` / ``calc_steps`` where given; ``None`` when there are none."""
        options = dict(self.task_kwargs or {})
        options.update({key: value for key, value in (("data", self.data), ("calc_steps", self.calc_steps))
                        if value is not None})
        return options or None


def train_config(recipe: str | Path | TrainConfig, **settings: Any) -> TrainConfig:
    """A :class:`TrainConfig` from a recipe path and keyword settings (its field names), or from a TrainConfig with
    ``settings`` replacing some of its fields; an unknown setting is a ``TypeError`` naming it."""
    if isinstance(recipe, TrainConfig):
        return dataclasses.replace(recipe, **settings)
    return TrainConfig(recipe=recipe, **settings)


@dataclass(frozen=True)
class RunPlan:
    """What :func:`prepare_run` checked and built: everything :func:`run_training` needs before the model loads.
    Nothing in it is checked or built again; the model's own checks (positions, weights) come once it loads."""

    config: TrainConfig
    """The run's settings, each checked (numbers, paths writable, model spec, task and its options)."""
    args: Any
    """TRL's ``GRPOConfig``: the recipe's fields, the run's (output_dir, report_to, seed, max_steps, CPU settings),
    then ``extra_overrides``; TRL's checks and the ``report_to`` integrations passed."""
    gap: Any
    """The recipe's ``GapConfig`` with ``gap_overrides`` applied, validated."""
    device: str
    """Where the policy trains: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``, present on this machine."""
    dtype: str
    """The policy's weight dtype as loaded: ``"bf16"`` on CPU (``"fp32"`` for an arm that trains in fp16),
    ``"fp32"`` on CUDA (master weights under the recipe's autocast)."""
    train_dataset: Any
    """The task's training set (``datasets.Dataset``: ``prompt`` as chat messages, ``answer``), built without a
    tokenizer; :func:`~bloggap_plugin.tasks.for_tokenizer` fits it to the loaded one."""
    reward_funcs: list
    """The task's reward functions, TRL's signature."""
    heldout: tuple | None
    """``(dataset, reward_funcs)`` of the held-out prompts (``config.heldout["n"]`` of them, built like
    ``train_dataset``), or ``None`` without ``heldout``."""
    model_sha256: str | None = None
    """:func:`~bloggap_plugin.checkpoint.model_sha256` of ``config.model``: the weights a folder holds, hashed once
    before the model loads (``None`` for a named or tiny model)."""


def prepare_run(recipe: str | Path | TrainConfig, **settings: Any) -> RunPlan:
    """Check every input of :func:`run_training` without loading a model; raise
    :class:`~bloggap_plugin.core.errors.UsageError` (or a subclass) naming the problem and the fix.

    ``recipe``: a recipe path (then ``settings`` are :class:`TrainConfig` fields) or a :class:`TrainConfig`.
    Checked: ``max_steps`` (>= 1 or None), the recipe (text, YAML, no duplicate keys, known keys and types), the
    ``gap`` overrides, the device, the output folder and JSONL path (writable), the ``GRPOConfig`` the recipe and
    overrides build (TRL's own checks, e.g. num_generations dividing the generation batch, plus value ranges
    the optimizer or ``generate`` would reject later), the task and its data, and the model spec.
    """
    from bloggap_plugin._io import check_writable_dir, check_writable_file
    from bloggap_plugin.checkpoint import model_sha256
    from bloggap_plugin.core.errors import UsageError
    from bloggap_plugin.models import check_model_spec, resolve_device
    from bloggap_plugin.recipes import RecipeError, load_recipe, merge_grpo_config, replace_gap
    from bloggap_plugin.tasks import get_task

    config = train_config(recipe, **settings)
    max_steps, log_jsonl = config.max_steps, config.log_jsonl
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
        raise UsageError(f"--max-steps must be an integer >= 1, got {max_steps!r}; leave it out to use the "
                         "recipe's max_steps")
    seed = config.seed
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX):
        raise UsageError(f"--seed {seed!r}: must be a whole number in [0, {SEED_MAX}] (numpy's seed range)")
    grpo_kwargs, gap = load_recipe(config.recipe)
    # a setting left out keeps the recipe's value (the command line wins only when given)
    config = dataclasses.replace(config, seed=int(grpo_kwargs.get("seed", 0)) if seed is None else seed,
                                 report_to=grpo_kwargs.get("report_to", "none") if config.report_to is None
                                 else config.report_to)
    if config.gap_overrides:
        gap = replace_gap(gap, config.gap_overrides)
    _check_override_names(config.extra_overrides)
    device = resolve_device(config.device)
    check_heldout_spec(config.heldout)
    for problem in (check_writable_dir(config.output_dir, "--output-dir"),
                    None if config.save_final is None else (check_writable_dir(config.save_final, "--save-final")
                                                            or foreign_save_problem(config.save_final)),
                    None if log_jsonl is None else check_writable_file(log_jsonl, "--log-jsonl", create_parents=True)):
        if problem:
            raise UsageError(problem)
    on_cpu = device.startswith("cpu")
    dtype = "fp32" if not on_cpu or gap.arm_spec.needs_fp16_training else "bf16"
    overrides = run_overrides(grpo_kwargs, output_dir=config.output_dir, report_to=config.report_to,
                              seed=config.seed, max_steps=max_steps, on_cpu=on_cpu)
    overrides.update(config.extra_overrides or {})
    try:
        args = merge_grpo_config(grpo_kwargs, None, **overrides)
    except RecipeError as err:
        raise RecipeError(f"{config.recipe}: {err}") from None
    _check_report_to(args.report_to)
    _check_matmul_tiles(gap, args)
    _check_vllm(args)
    train_dataset, reward_funcs = get_task(config.task, None, seed=config.seed,  # name, options, data: before the model
                                           **(config.task_options() or {}))
    heldout = _heldout_set(config) if config.heldout else None
    check_model_spec(config.model)
    return RunPlan(config=config, args=args, gap=gap, device=device, dtype=dtype, train_dataset=train_dataset,
                   reward_funcs=reward_funcs, heldout=heldout, model_sha256=model_sha256(config.model))


from bloggap_plugin.core.errors import SEED_MAX  # noqa: E402 - re-exported: the range of --seed

RUN_DEFAULTS = {"save_strategy": "no", "logging_steps": 1}
"""GRPOConfig fields a run sets when the recipe does not: no checkpoints, a log line per step."""


def run_overrides(grpo_kwargs: dict, *, output_dir: str | Path, report_to: str | list[str], seed: int,
                  max_steps: int | None, on_cpu: bool) -> dict:
    """The GRPOConfig fields a run sets over the recipe's ``grpo_kwargs``: where it writes and logs, its seed and
    steps (``max_steps`` None: the recipe's), :data:`RUN_DEFAULTS` where the recipe leaves them out (a recipe's
    ``save_steps`` keeps its ``save_strategy``), and on CPU no bf16 autocast."""
    fields: dict = {"output_dir": str(output_dir), "report_to": report_to, "seed": int(seed)}
    saves = {"save_strategy", "save_steps"} & set(grpo_kwargs)
    fields.update({key: value for key, value in RUN_DEFAULTS.items()
                   if key not in grpo_kwargs and not (key == "save_strategy" and saves)})
    if max_steps is not None:
        fields["max_steps"] = int(max_steps)
    if on_cpu:
        fields.update(use_cpu=True, bf16=False, fp16=bool(grpo_kwargs.get("fp16", False)))
    return fields


def _check_override_names(overrides: dict | None) -> None:
    """Refuse an ``--extra-overrides`` key that is no GRPOConfig field, naming the closest one (as recipes do)."""
    from bloggap_plugin.recipes import grpo_field_names, unknown_key_error

    valid = grpo_field_names()
    for key in overrides or {}:
        if valid is not None and key not in valid:
            raise unknown_key_error(key, valid, "--extra-overrides")


def _check_matmul_tiles(gap: Any, args: Any) -> None:
    """``gap.matmul_tiles`` with no colocate engine to install it in, or a table that cannot be read: refused before
    the model loads (the engine would find the second only after it)."""
    from bloggap_plugin.trl.vllm_colocate import check_matmul_tiles_file, refuse_matmul_tiles_without_colocate

    refuse_matmul_tiles_without_colocate(gap, getattr(args, "use_vllm", False), getattr(args, "vllm_mode", None))
    check_matmul_tiles_file(gap)


def _check_vllm(args: Any) -> None:
    """Raise ``UsageError`` for ``use_vllm`` where TRL's vLLM engine cannot run (the trainer would fail on it only
    after the model loaded); the check ``bloggap compare --use-vllm`` makes."""
    from bloggap_plugin.core.errors import UsageError
    from bloggap_plugin.core.vllm.versions import vllm_unavailable_reason

    problem = vllm_unavailable_reason() if getattr(args, "use_vllm", False) else None
    if problem:
        raise UsageError(f"use_vllm: {problem}; run on a machine with a CUDA GPU and vLLM (TRL 1.16 takes vLLM "
                         "0.22-0.31), or drop use_vllm to generate with HF generate")


def _check_report_to(report_to: list[str] | None) -> None:
    """Raise ``UsageError`` for a ``--report-to`` integration transformers does not know or cannot import here
    (the Trainer would fail on it only after the model loaded)."""
    from transformers.integrations import INTEGRATION_TO_CALLBACK, get_available_reporting_integrations

    from bloggap_plugin.core.errors import UsageError

    available = set(get_available_reporting_integrations())
    alone = [name for name in ("none", "all") if name in (report_to or [])]
    if alone and len(report_to) > 1:
        raise UsageError(f"--report-to {' '.join(report_to)}: {alone[0]} goes alone; give it, or the integrations "
                         "to log to")
    for name in report_to or []:
        if name in ("none", "all"):
            continue
        if name not in INTEGRATION_TO_CALLBACK:
            raise UsageError(f"--report-to {name}: unknown; use none or one of {', '.join(INTEGRATION_TO_CALLBACK)}")
        if name not in available:
            raise UsageError(f"--report-to {name}: the {name} package is not installed here; install it or use "
                             "--report-to none")


def _check_positions(policy: Any, args: Any, config: TrainConfig) -> None:
    """Raise ``UsageError`` when ``max_completion_length`` reaches the model's ``max_position_embeddings`` (known only
    once the model's config is read): every completion would run past the positions the model was trained on."""
    from bloggap_plugin.core.errors import UsageError

    limit = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
    length = args.max_completion_length
    if isinstance(limit, int) and isinstance(length, int) and length >= limit:
        raise UsageError(f"max_completion_length {length} reaches the model's max_position_embeddings {limit} "
                         f"({config.model}), with the prompt still to come: give a shorter --max_completion_length")


def summarize_history(history: list[dict]) -> dict:
    """Means of the logged ``gap/*``, reward, step-time and clip values over the steps where they are finite, and
    ``non_finite_steps``: per logged key, how many steps held inf or NaN (a mean over the finite steps alone would
    hide them)."""
    keys = sorted({k for h in history for k in h if k.startswith(("gap/", "reward", "step_time", "clip_ratio"))})
    summary: dict = {}
    for key in keys:
        values = [h[key] for h in history if isinstance(h.get(key), (int, float)) and math.isfinite(h[key])]
        summary[f"mean/{key}"] = sum(values) / len(values) if values else None
    counts: dict[str, int] = {}
    for record in history:
        for key, value in record.items():
            if isinstance(value, float) and not math.isfinite(value):
                counts[key] = counts.get(key, 0) + 1
    summary["non_finite_steps"] = dict(sorted(counts.items()))
    return summary


@contextlib.contextmanager
def reference_from_policy(policy: Any, enabled: bool = True):
    """While active (``enabled``), TRL's ``GRPOTrainer`` builds its reference model (``beta > 0``) as a frozen copy of
    ``policy`` as it is now, instead of reloading the policy's name as a hub id: a built-in or local model has no hub
    id, and offline there is no hub. The copy is the weights the policy was loaded with, what TRL's reload would
    give for a hub model."""
    if not enabled:
        yield
        return
    import copy

    from trl.trainer import grpo_trainer

    original = grpo_trainer.create_model_from_path

    def copy_of_policy(path, **kwargs):  # noqa: ARG001 - TRL's signature; the copy has the policy's dtype
        reference = copy.deepcopy(policy)
        reference.requires_grad_(False)
        return reference.eval()

    grpo_trainer.create_model_from_path = copy_of_policy
    try:
        yield
    finally:
        grpo_trainer.create_model_from_path = original


def run_training(recipe: str | Path | TrainConfig | RunPlan, **settings: Any) -> dict:
    """Train GRPO with the recipe's GRPOConfig fields and ``gap:`` section; return a summary dict.

    ``recipe``: a recipe path (then ``settings`` are :class:`TrainConfig` fields, e.g. ``model=``, ``max_steps=``)
    or a :class:`TrainConfig`, or the :class:`RunPlan` that :func:`prepare_run` made of them. Offline: the model comes from :func:`bloggap_plugin.models.load_model` (default
    SmolLM2-135M-Instruct), the data and rewards from :func:`bloggap_plugin.tasks.get_task`. On CPU the run uses
    ``use_cpu``, no autocast, and bf16 weights (fp32 for arm H, whose fp16 autocast accelerate enables on CUDA
    only); on CUDA, fp32 master weights with the recipe's ``bf16``/``fp16`` autocast. ``extra_overrides`` are
    GRPOConfig fields applied last; ``gap_overrides`` replace fields of the recipe's ``gap:`` section (validated).
    Each logged step goes to ``log_jsonl`` as one JSON line. Every input is checked by :func:`prepare_run`
    before the model loads; two runs into one ``output_dir`` at once are refused.

    Stopping: Ctrl-C (``KeyboardInterrupt``) during training ends it and returns the summary of the finished steps
    (``interrupted`` true, no final save). This function installs no signal handler (a library must not replace its
    caller's), so SIGTERM and SIGHUP keep the caller's handling (Python's default: the process ends, no summary).
    ``bloggap train`` runs it inside :func:`stop_signals_interrupt`, which makes them act as Ctrl-C; a Python caller
    may do the same: ``with stop_signals_interrupt(): summary = run_training(...)``.
    """
    if isinstance(recipe, RunPlan):
        if settings:
            raise TypeError(f"run_training: a RunPlan is already checked; give settings {sorted(settings)} to prepare_run")
        plan = recipe
    else:
        plan = prepare_run(recipe, **settings)
    lock = _lock_output_dir(plan.config.output_dir)
    save_lock = None
    try:
        if plan.config.save_final is not None:
            save_lock = _lock_folder(plan.config.save_final, "--save-final", "saves", ".bloggap-save.lock")
        with _integrations_under(plan.config.output_dir):
            return _train(plan)
    finally:
        lock.close()
        if save_lock is not None:
            save_lock.close()


STOP_SIGNALS = ("SIGTERM", "SIGHUP")
"""What job schedulers and closed terminals send: handled as Ctrl-C (SIGINT) inside :func:`stop_signals_interrupt`."""


@contextlib.contextmanager
def stop_signals_interrupt(received: list[int] | None = None):
    """While active (main thread only; elsewhere it does nothing), :data:`STOP_SIGNALS` raise ``KeyboardInterrupt``
    as SIGINT does, so :func:`run_training` stops the same way (the summary of the finished steps); each signal's
    number is appended to ``received``. The previous handlers are restored on exit."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):  # noqa: ARG001 - signal's handler signature
        if received is not None:
            received.append(signum)
        raise KeyboardInterrupt

    numbers = [getattr(signal, name) for name in STOP_SIGNALS if hasattr(signal, name)]
    previous = {number: signal.signal(number, interrupt) for number in numbers}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


SAVE_MARKER = ".bloggap-save-final"
"""The file :func:`save_final` writes last into a ``--save-final`` folder: the folder holds a complete save of a
bloggap run (so a later run may replace it). Names starting with ``.bloggap`` are bloggap's own bookkeeping."""


def foreign_save_problem(folder: str | Path) -> str | None:
    """A one-line refusal when ``folder`` holds files that are not a bloggap save (a user's model, its
    ``config.json``): a final save would overwrite them. An empty folder, or one holding a previous save, is free."""
    folder = Path(folder)
    if not folder.is_dir() or (folder / SAVE_MARKER).is_file():
        return None
    others = sorted(item.name for item in folder.iterdir() if not item.name.startswith(".bloggap"))
    if not others:
        return None
    return (f"--save-final {folder}: the folder holds files a bloggap run did not save ({', '.join(others[:3])}"
            f"{', ...' if len(others) > 3 else ''}); the final save would overwrite them: give a new or empty folder")


def save_final(trainer: Any, folder: str | Path) -> str | None:
    """Save the trained policy and tokenizer into ``folder`` whole or not at all: written into a temporary folder
    inside it, then each file moved into place, then :data:`SAVE_MARKER`. Returns None, or the one-line reason the
    save failed (full disk, permissions): then ``folder`` holds what it held before and no partial file."""
    import shutil
    import tempfile

    folder = Path(folder)
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".bloggap-saving-", dir=folder))
        trainer.save_model(str(tmp))
        for item in sorted(tmp.iterdir()):
            if (folder / item.name).is_dir():
                shutil.rmtree(folder / item.name)
            os.replace(item, folder / item.name)
        (folder / SAVE_MARKER).write_text("a complete final save of a bloggap train run\n")
    except OSError as err:
        return (f"--save-final {folder}: the final save failed ({err.strerror or err}); nothing partial was left "
                "there: free space or give another folder, and train again")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return None


@contextlib.contextmanager
def _integrations_under(output_dir: str | Path):
    """While active, a logging integration that writes its own folder (wandb's ``./wandb/``) writes it under
    ``output_dir`` instead of the current folder (``WANDB_DIR``), unless the user set that variable."""
    if os.environ.get("WANDB_DIR"):
        yield
        return
    os.environ["WANDB_DIR"] = str(Path(output_dir).resolve())
    try:
        yield
    finally:
        os.environ.pop("WANDB_DIR", None)


def _lock_output_dir(output_dir: str | Path):
    """Hold ``output_dir/.bloggap-train.lock`` for the run, or raise ``UsageError``: two trains into one folder
    would interleave their logs and checkpoints, and the last final save would win."""
    return _lock_folder(output_dir, "--output-dir", "logs and final saves", ".bloggap-train.lock")


def _lock_folder(folder: str | Path, option: str, what: str, name: str):
    """Hold ``folder/NAME`` (the folder created), or raise ``UsageError`` naming ``option`` when another bloggap
    train holds it (its ``what`` would interleave)."""
    from bloggap_plugin._io import try_lock
    from bloggap_plugin.core.errors import UsageError

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    handle = try_lock(folder / name)
    if handle is None:
        raise UsageError(f"{option} {folder}: another bloggap train is writing into it ({what} would interleave); "
                         f"wait for it to finish or give another {option}")
    return handle


def _train(plan: RunPlan) -> dict:
    """:func:`run_training` once the inputs are checked (``plan``) and the output folder is held."""
    from bloggap_plugin.models import load_model
    from bloggap_plugin.run_timing import plugin_time_share
    from bloggap_plugin.tasks import for_tokenizer
    from bloggap_plugin.trl.attach import arm_not_in_effect
    from bloggap_plugin.trl.callback import GapGRPOTrainer
    from bloggap_plugin.trl.vllm_colocate import installed_tile_table, own_batch_invariance_env

    config, args, gap, device = plan.config, plan.args, plan.gap, plan.device
    model, seed, log_jsonl = config.model, config.seed, config.log_jsonl
    own_batch_invariance_env(gap, args)  # this process owns the run: arms I and J need nothing exported by hand
    policy, tokenizer = load_model(model, dtype=plan.dtype, device=device, checked=True)
    _check_positions(policy, args, config)
    policy.train()
    train_dataset, reward_funcs = for_tokenizer(plan.train_dataset, tokenizer), plan.reward_funcs
    callbacks = [] if config.max_steps is not None else [StepsAnnouncer()]
    logger = None
    if log_jsonl is not None:
        logger = JsonlLogger(log_jsonl)
        callbacks.append(logger)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*activation_checkpointing.*")
        with reference_from_policy(policy, enabled=args.beta != 0.0):
            trainer = GapGRPOTrainer(model=policy, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                                     processing_class=tokenizer, callbacks=callbacks, gap=gap)
    heldout = None
    if config.heldout:
        heldout = HeldoutCallback(tokenizer, config, log_jsonl, args.max_completion_length, heldout_set=plan.heldout)
        trainer.add_callback(heldout)
    start = time.perf_counter()
    interrupted = False
    try:
        output = trainer.train()
    except KeyboardInterrupt:  # Ctrl-C: keep what finished (its log lines are written), summarise it
        interrupted, output = True, None
    wall = time.perf_counter() - start
    trainer._gap_close()
    save_error = None
    if config.save_final is not None and not interrupted:
        save_error = save_final(trainer, config.save_final)
    history = [h for h in trainer.state.log_history if "loss" in h]
    summary: dict = {
        "recipe": str(config.recipe),
        "arm": gap.arm,
        "model": model,
        "model_sha256": plan.model_sha256,
        "task": config.task,
        "seed": seed,
        "device": str(device),
        "steps": trainer.state.global_step,
        "wall_s": wall,
        "train_loss": _jsonable(output.training_loss) if output is not None else None,
        "interrupted": interrupted,
        "log_jsonl": str(log_jsonl) if log_jsonl is not None else None,
    }
    if save_error is not None:
        summary["save_final_error"] = save_error
    summary.update(summarize_history(history))
    summary["plugin_share"] = plugin_time_share(history)  # time-weighted, not the mean of per-step fractions
    rewards = [h["reward"] for h in history if isinstance(h.get("reward"), (int, float))]
    summary["reward_first"] = rewards[0] if rewards else None
    summary["reward_last"] = rewards[-1] if rewards else None
    if heldout is not None:
        summary["heldout"] = heldout.records
    summary["arm_not_in_effect"] = arm_not_in_effect(trainer, gap)  # e.g. arm H on a CPU: stated with the result
    summary["matmul_tiles"] = installed_tile_table(trainer)  # the tile table arms I and J ran with, if any
    return summary
