"""One GRPO run from a recipe: the engine behind ``bloggap train`` and ``bloggap compare``."""

from __future__ import annotations

import json
import math
import time
import warnings
from pathlib import Path
from typing import Any

__all__ = ["run_training", "JsonlLogger"]


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

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "train_runtime" in logs:
                return
            record = {"step": state.global_step, **{k: _jsonable(v) for k, v in logs.items()}}
            self.records.append(record)
            with open(self.path, "a") as handle:
                handle.write(json.dumps(record) + "\n")

    return _JsonlLogger()


def run_training(
    recipe_path: str | Path,
    *,
    model: str = "smollm2",
    task: str = "arith",
    max_steps: int | None = None,
    output_dir: str | Path = "bloggap-runs/train",
    report_to: str = "none",
    seed: int = 0,
    log_jsonl: str | Path | None = None,
    extra_overrides: dict | None = None,
    gap_overrides: dict | None = None,
    task_kwargs: dict | None = None,
    device: str | None = None,
) -> dict:
    """Train GRPO with the recipe's GRPOConfig fields and ``gap:`` section; return a summary dict.

    Offline: the model comes from :func:`bloggap_plugin.models.load_model` (default SmolLM2-135M-Instruct),
    the data and rewards from :func:`bloggap_plugin.tasks.get_task`. On CPU the run uses ``use_cpu``, no
    autocast, and bf16 weights (fp32 for arm H, whose fp16 autocast accelerate enables on CUDA only); on
    CUDA, fp32 master weights with the recipe's ``bf16``/``fp16`` autocast. ``extra_overrides`` are GRPOConfig
    fields applied last; ``gap_overrides`` replace fields of the recipe's ``gap:`` section (validated).
    Each logged step goes to ``log_jsonl`` as one JSON line.
    """
    import torch

    from bloggap_plugin.models import load_model
    from bloggap_plugin.recipes import load_recipe, merge_grpo_config
    from bloggap_plugin.tasks import get_task
    from bloggap_plugin.trl.callback import GapGRPOTrainer

    grpo_kwargs, gap = load_recipe(recipe_path)
    if gap_overrides:
        import dataclasses

        gap = dataclasses.replace(gap, **gap_overrides)  # __post_init__ validates the new values
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    on_cpu = str(device).startswith("cpu")
    overrides: dict = {"output_dir": str(output_dir), "report_to": report_to, "seed": int(seed),
                       "save_strategy": "no", "logging_steps": 1}
    if max_steps is not None:
        overrides["max_steps"] = int(max_steps)
    if on_cpu:
        overrides.update(use_cpu=True, bf16=False, fp16=bool(grpo_kwargs.get("fp16", False)))
        dtype = "fp32" if gap.arm == "H" else "bf16"
    else:
        dtype = "fp32"
    overrides.update(extra_overrides or {})
    args = merge_grpo_config(grpo_kwargs, None, **overrides)
    policy, tokenizer = load_model(model, dtype=dtype, device=device)
    policy.train()
    train_dataset, reward_funcs = get_task(task, tokenizer, seed=seed, **(task_kwargs or {}))
    callbacks = []
    logger = None
    if log_jsonl is not None:
        logger = JsonlLogger(log_jsonl)
        callbacks.append(logger)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*activation_checkpointing.*")
        trainer = GapGRPOTrainer(model=policy, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                                 processing_class=tokenizer, callbacks=callbacks, gap=gap)
    start = time.perf_counter()
    output = trainer.train()
    wall = time.perf_counter() - start
    trainer._gap_close()
    history = [h for h in trainer.state.log_history if "loss" in h]
    summary: dict = {
        "recipe": str(recipe_path),
        "arm": gap.arm,
        "model": model,
        "task": task,
        "seed": seed,
        "device": str(device),
        "steps": trainer.state.global_step,
        "wall_s": wall,
        "train_loss": _jsonable(output.training_loss),
        "log_jsonl": str(log_jsonl) if log_jsonl is not None else None,
    }
    keys = sorted({k for h in history for k in h if k.startswith(("gap/", "reward", "step_time", "clip_ratio"))})
    for key in keys:
        values = [h[key] for h in history if isinstance(h.get(key), (int, float)) and math.isfinite(h[key])]
        summary[f"mean/{key}"] = sum(values) / len(values) if values else None
    rewards = [h["reward"] for h in history if isinstance(h.get("reward"), (int, float))]
    summary["reward_first"] = rewards[0] if rewards else None
    summary["reward_last"] = rewards[-1] if rewards else None
    return summary
