"""The held-out evaluation of a sweep's runs: where each run's saved policy and result live, what decides a result
(resume), the default evaluation (:func:`evaluate_saved`) and the per-arm paired comparison.

A run with the evaluation on trains with ``save_final = trainer/<run>/final`` (the policy and tokenizer), writes its
log's completion marker, and the worker then evaluates that folder into ``runs/<run>.heldout.json``
(``{"attempt", "settings", "result"}``, written atomically; ``attempt`` is the training attempt it evaluated) and
deletes the folder. A run whose training finished but whose evaluation did not (killed, failed, or evaluated with
other settings) is evaluated again on resume from the folder, which records its attempt in :data:`ATTEMPT_FILE`;
training is not repeated. Without that folder (a fresh machine) the run keeps no held-out result and is named.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from bloggap_plugin.compare.sweep_config import CompareConfig, RunSpec, heldout_count

__all__ = [
    "ATTEMPT_FILE",
    "heldout_path",
    "final_dir",
    "heldout_settings",
    "heldout_spec",
    "heldout_state",
    "read_heldout",
    "read_record",
    "evaluate_saved",
    "evaluate_run",
    "stamp_final",
    "heldout_max_tokens",
]

ATTEMPT_FILE = ".bloggap_attempt"
"""File in a run's saved-policy folder naming the training attempt that saved it."""


def heldout_path(run: RunSpec) -> Path:
    """``runs/<run>.heldout.json``: the run's held-out result."""
    log = Path(run.log_jsonl)
    return log.with_name(f"{run.run_id}.heldout.json")


def final_dir(run: RunSpec) -> Path:
    """``trainer/<run>/final``: the run's policy as training left it, kept until its evaluation is written."""
    return Path(run.output_dir) / "final"


def heldout_max_tokens(config: CompareConfig, run: RunSpec) -> int:
    """New tokens per held-out completion: ``heldout_max_tokens``, else the run's ``max_completion_length`` (recipe,
    then ``--override``), else TRL's default 256."""
    if config.heldout_max_tokens is not None:
        return int(config.heldout_max_tokens)
    if "max_completion_length" in config.extra_overrides:
        return int(config.extra_overrides["max_completion_length"])
    from bloggap_plugin._input_files import load_yaml_file
    from bloggap_plugin.core.errors import UsageError

    try:
        recipe = load_yaml_file(run.recipe, f"recipe {run.recipe}", "") or {}
    except UsageError:  # the recipe's own check (load_recipe) says what is wrong with it
        recipe = {}
    value = recipe.get("max_completion_length") if isinstance(recipe, dict) else None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 256


def heldout_settings(config: CompareConfig, run: RunSpec) -> dict:
    """What decides a run's held-out result beyond its training: the evaluation function, the number of prompts and
    the new tokens per completion. The batch size is recorded with each result but is no key: a sweep keeps one
    for all its runs (its plan's ``heldout_batch_size``), and a changed one does not evaluate finished runs again."""
    return {"heldout_fn": config.heldout_fn, "n": heldout_count(config), "max_tokens": heldout_max_tokens(config, run)}


def heldout_spec(config: CompareConfig, run: RunSpec) -> dict | None:
    """The worker's instructions for the evaluation (``None`` when it is off)."""
    if heldout_count(config) == 0:
        return None
    return {"settings": heldout_settings(config, run), "fn": config.heldout_fn, "batch_size": config.heldout_batch_size,
            "every": config.heldout_every, "apart": config.heldout_apart, "final_dir": str(final_dir(run)),
            "path": str(heldout_path(run))}


def read_record(path: str | os.PathLike, attempt: str | None) -> dict | None:
    """The held-out record at ``path`` (``{"attempt", "settings", "result"}``, as :func:`evaluate_run` writes it) if
    it evaluated training ``attempt``, else ``None`` (also where it is missing, too large, not UTF-8 or not JSON)."""
    from bloggap_plugin._input_files import load_json_file

    try:
        stored = load_json_file(path, str(path), "evaluate again", ValueError, "a held-out record")
    except ValueError:
        return None
    return stored if isinstance(stored, dict) and stored.get("attempt") == attempt else None


def read_heldout(config: CompareConfig, run: RunSpec, attempt: str | None) -> dict | None:
    """The run's held-out result if it evaluated training ``attempt`` with the current settings, else ``None`` (no
    result: the run is evaluated again)."""
    stored = read_record(heldout_path(run), attempt)
    if stored is None or stored.get("settings") != heldout_settings(config, run):
        return None
    return stored.get("result")


def heldout_state(config: CompareConfig, run: RunSpec, attempt: str | None) -> str:
    """For a run whose training is done (``attempt``): ``off``, ``done``, ``pending`` (its saved policy is there to
    evaluate) or ``lost`` (no result and no saved policy of that attempt)."""
    if heldout_count(config) == 0:
        return "off"
    if read_heldout(config, run, attempt) is not None:
        return "done"
    stamp = final_dir(run) / ATTEMPT_FILE
    try:
        return "pending" if stamp.read_text().strip() == attempt else "lost"
    except OSError:
        return "lost"


def evaluate_saved(model_dir: str | os.PathLike, *, task: str, task_kwargs: dict, seed: int, heldout_n: int,
                   max_tokens: int, batch_size: int = 64) -> dict:
    """Greedy accuracy of the policy saved in ``model_dir`` on the task's held-out prompts
    (:func:`bloggap_plugin.tasks.get_heldout` with the run's task options and seed), with HF ``generate`` in fp32 on
    CUDA when there is one (else CPU), the same for every arm whatever precision it trained in. Returns
    :func:`bloggap_plugin.heldout_accuracy.heldout_accuracy`'s dict plus ``engine``, ``dtype`` and ``device``."""
    import torch

    from bloggap_plugin.heldout_accuracy import heldout_accuracy
    from bloggap_plugin.models import load_model
    from bloggap_plugin.tasks import get_heldout

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_model(str(model_dir), dtype="fp32", device=device)
    options = {k: v for k, v in task_kwargs.items() if v is not None}
    dataset, (reward,) = get_heldout(task, tokenizer, seed=seed, heldout_n=heldout_n, **options)
    result = heldout_accuracy(model, tokenizer, dataset, reward, max_tokens, batch_size)
    return {**result, "engine": "HF generate", "dtype": "fp32", "device": device}


def evaluate_run(spec: dict, attempt: str) -> dict:
    """Worker side: evaluate the run of ``spec`` (the sweep's run spec) from its saved policy, write
    ``runs/<run>.heldout.json`` atomically, then delete the saved policy. Returns the result."""
    import shutil

    from bloggap_plugin._io import atomic_write_text
    from bloggap_plugin.compare.sweep_config import resolve_function
    from bloggap_plugin.results import jsonable

    heldout = spec["heldout"]
    evaluate = resolve_function(heldout["fn"])
    result = evaluate(heldout["final_dir"], task=spec["task"], task_kwargs=spec["task_kwargs"], seed=spec["seed"],
                      heldout_n=heldout["settings"]["n"], max_tokens=heldout["settings"]["max_tokens"],
                      batch_size=heldout["batch_size"])
    record = {"attempt": attempt, "settings": heldout["settings"], "result": jsonable(result)}
    atomic_write_text(heldout["path"], json.dumps(record, indent=1))
    shutil.rmtree(heldout["final_dir"], ignore_errors=True)
    return result


def stamp_final(spec: dict, attempt: str) -> None:
    """Record in the saved-policy folder which training attempt saved it."""
    from bloggap_plugin._io import atomic_write_text

    folder = Path(spec["heldout"]["final_dir"])
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / ATTEMPT_FILE, attempt)

