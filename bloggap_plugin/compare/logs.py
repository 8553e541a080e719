"""A run's JSONL log: its step records, its completion marker, the settings it was trained with (resume decisions)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from bloggap_plugin.compare.sweep_config import (
    DONE_KEY,
    CompareConfig,
    CompareError,
    RunSpec,
    current_run_fn,
    run_task_kwargs,
)

__all__ = [
    "read_log",
    "run_is_done",
    "run_state",
    "run_verdict",
    "run_settings",
    "read_marker",
    "count_logged_steps",
    "MODEL_SHA256_KEY",
    "finished_checkpoints",
    "checkpoint_mismatches",
    "check_resume_checkpoint",
]

MODEL_SHA256_KEY = "model_sha256"
"""Key of a run's completion marker holding the sha256 of the model folder it started from
(:func:`bloggap_plugin.checkpoint.model_sha256`; ``None``, or absent in older logs, for a named or tiny model)."""


def read_log(path: str | os.PathLike) -> tuple[list[dict], dict | None]:
    """``(step records, completion marker or None)`` of a run's JSONL log.

    A last line cut off mid-write (killed run) is ignored; a malformed line elsewhere raises ``ValueError``
    naming the file and line.
    """
    from bloggap_plugin._input_files import MAX_JSON_BYTES, check_file_size

    path = Path(path)
    if not path.is_file():
        return [], None
    check_file_size(path, str(path), "move it out of the output folder", ValueError, MAX_JSON_BYTES, "a run log")
    lines = path.read_bytes().splitlines()  # each line decoded on its own: a bad byte names its line
    records, marker = [], None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            if number == len(lines):
                break  # truncated final line of a killed run
            reason = err.msg if isinstance(err, json.JSONDecodeError) else f"not UTF-8 at byte {err.start}"
            raise ValueError(f"{path}:{number}: not a JSON line ({reason})") from None
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
    state, why, _, _ = run_verdict(config, run)
    return state, why


def run_verdict(config: CompareConfig, run: RunSpec) -> tuple[str, str, list[dict], dict | None]:
    """``(state, why, records, marker)``: :func:`run_state` of ``run`` with the step records and completion marker
    of the log it read (:func:`read_log`; none where the log is missing or corrupt), from one reading of the log."""
    log = Path(run.log_jsonl)
    if not log.exists():
        return "missing", "", [], None
    try:
        records, marker = read_log(log)
    except ValueError as err:
        return "corrupt", str(err), [], None
    if marker is None:
        return "unfinished", f"{log} has no completion marker", records, None
    stored = marker.get("settings")
    if not isinstance(stored, dict):
        return "changed", f"{log} records no settings (written by an older bloggap)", records, marker
    if isinstance(stored.get("run_fn"), str):  # a renamed training function is the same function
        stored = {**stored, "run_fn": current_run_fn(stored["run_fn"])}
    changes = _settings_changes(stored, run_settings(config, run))
    if changes:
        return "changed", f"{log} was trained with other settings ({changes})", records, marker
    return "done", "", records, marker


def count_logged_steps(path: str | os.PathLike) -> int:
    """The highest ``step`` logged at ``path`` (the record count where none carries one; 0 if it does not parse)."""
    try:
        records, _ = read_log(path)
    except ValueError:
        return 0
    return max([int(r["step"]) for r in records if isinstance(r.get("step"), (int, float))], default=len(records))


def run_settings(config: CompareConfig, run: RunSpec) -> dict:
    """What decides a run's result (JSON-ready): the training function, the recipe's content, model, task and its
    options (GSM8K: the data path in effect), steps, seed, overrides and ``use_vllm``; stored with its log so that a
    resume with other settings does not reuse it. ``use_vllm`` appears only when set (and the vLLM fields it
    derives, which depend on ``--parallel``, not at all), so logs of sweeps from before the option stay valid."""
    settings = {
        "run_fn": current_run_fn(config.run_fn),
        "arm": run.arm,
        "recipe_sha256": hashlib.sha256(Path(run.recipe).read_bytes()).hexdigest(),
        "model": config.model,
        "task": config.task,
        "task_kwargs": run_task_kwargs(config),
        "max_steps": config.max_steps,
        "seed": run.seed,
        "extra_overrides": dict(config.extra_overrides),
    }
    if config.use_vllm:
        settings["use_vllm"] = True
    return json.loads(json.dumps(settings, sort_keys=True, default=str))


def read_marker(path: str | os.PathLike) -> dict | None:
    """The completion marker of the log at ``path``, or ``None`` (no marker, or a log that does not parse)."""
    try:
        return read_log(path)[1]
    except ValueError:
        return None


def finished_checkpoints(runs: list[RunSpec], states: list[tuple[str, dict | None]]) -> dict[int, dict[str, str | None]]:
    """``{seed: {run id: model sha256}}`` of the finished runs (log complete, same settings), from their markers;
    ``states``: ``(state, marker)`` of each of ``runs`` in order, as :func:`run_verdict` reads them."""
    found: dict[int, dict[str, str | None]] = {}
    for run, (state, marker) in zip(runs, states, strict=True):
        if state == "done":
            found.setdefault(run.seed, {})[run.run_id] = marker.get(MODEL_SHA256_KEY)
    return found


def _short(sha: str | None) -> str:
    return "no recorded hash" if sha is None else f"{sha[:12]}..."


def checkpoint_mismatches(by_seed: dict[int, dict[str, str | None]]) -> dict[int, str]:
    """``{seed: why}`` for each seed whose runs started from different checkpoints (``by_seed`` as
    :func:`finished_checkpoints` gives it): no comparison may pair them."""
    out = {}
    for seed, hashes in sorted(by_seed.items()):
        if len(set(hashes.values())) > 1:
            runs = ", ".join(f"{run_id} {_short(sha)}" for run_id, sha in sorted(hashes.items()))
            out[seed] = (f"seed {seed}: its runs started from different checkpoints ({runs}), so they are not compared; "
                         "move the logs of one checkpoint's runs aside and run them again from the other (--model its "
                         "folder)")
    return out


def check_resume_checkpoint(config: CompareConfig, runs: list[RunSpec], model_sha: str | None) -> None:
    """Refuse (:class:`CompareError`) to start runs of a seed whose finished runs started from another checkpoint
    than ``model_sha`` (``--model``'s): the seed's arms would not be comparable. Seeds with every run finished, or
    none, are free."""
    states = [(state, marker) for state, _, _, marker in (run_verdict(config, run) for run in runs)]
    pending = {run.seed for run, (state, _) in zip(runs, states) if state != "done"}
    for seed, hashes in sorted(finished_checkpoints(runs, states).items()):
        other = sorted(run_id for run_id, sha in hashes.items() if sha != model_sha)
        if seed in pending and other:
            raise CompareError(f"--model {config.model} ({_short(model_sha)}): seed {seed}'s finished run(s) "
                               f"{', '.join(other)} started from another checkpoint ({_short(hashes[other[0]])}), so "
                               f"its runs left would not be comparable with them; give --model the checkpoint they "
                               f"started from, or move runs/{other[0]}.jsonl (and the seed's other finished logs) aside "
                               "to run the whole seed from this one")
