"""Arm H (and F) in verl: an fp16 actor or rollout checked against the doctor's fp16 check of the model.

fp16's range ends at 65,504; a model whose activations pass it gives non-finite log-probs (``bloggap doctor``'s fp16
check measures that on the model). With ``+bloggap.fp16_doctor=FILE`` (a ``bloggap doctor --json`` result) the
trainer's constructor refuses an fp16 actor (``actor.fsdp_config.mixed_precision.param_dtype``) or rollout
(``rollout.dtype``) where that check failed, before any worker or model starts; without the setting it warns once,
naming the command that would check.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from bloggap_plugin._input_files import load_json_file
from bloggap_plugin.core.recommend import fp16_safe
from bloggap_plugin.verl.config import BloggapVerlConfig, SettingsError

__all__ = ["FP16_NAMES", "fp16_parts", "check_fp16"]

FP16_NAMES = ("fp16", "float16", "half")
"""The dtype names verl's config takes for fp16 (param_dtype, rollout dtype)."""


def _select(config: Any, dotted: str) -> Any:
    node = config
    for key in dotted.split("."):
        getter = getattr(node, "get", None)
        if getter is None:
            return None
        node = getter(key, None)
        if node is None:
            return None
    return node


def fp16_parts(config: Any) -> list[str]:
    """The config keys of ``config`` (a verl trainer config) that put the actor or the rollout in fp16."""
    keys = ("actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype", "actor_rollout_ref.rollout.dtype")
    values = {key: _select(config, key) for key in keys}
    return [f"{key}={value}" for key, value in values.items() if str(value).lower() in FP16_NAMES]


def check_fp16(config: Any, settings: BloggapVerlConfig) -> None:
    """For a config with an fp16 actor or rollout (:func:`fp16_parts`): read ``settings.fp16_doctor`` and raise
    :class:`SettingsError` (one line) where its fp16 check failed, was skipped or is absent; warn when no doctor
    result is given. Nothing for a config without fp16."""
    parts = fp16_parts(config)
    if not parts:
        return
    model = _select(config, "actor_rollout_ref.model.path") or "<model>"
    if settings.fp16_doctor is None:
        warnings.warn(f"bloggap: {' and '.join(parts)} without a doctor check: run `bloggap doctor --model {model} "
                      "--json doctor.json` and add +bloggap.fp16_doctor=doctor.json to refuse fp16 where it overflows",
                      stacklevel=2)
        return
    path = Path(settings.fp16_doctor)
    fix = "give the JSON file `bloggap doctor --model <actor model> --json FILE` wrote"
    document = load_json_file(path, f"bloggap.fp16_doctor={path}", fix, SettingsError, "a bloggap doctor result")
    check = document.get("fp16_check") if isinstance(document, dict) else None
    if not isinstance(check, dict):
        raise SettingsError(f"bloggap.fp16_doctor={path}: not a bloggap doctor result (no fp16_check); {fix}")
    measured = (document.get("params") or {}).get("model", "its model")
    safe = fp16_safe(check)
    if safe is None:
        raise SettingsError(f"bloggap.fp16_doctor={path}: the doctor skipped its fp16 check on {measured} "
                            f"({check.get('skipped', 'no result')}): run it where fp16 is measured, or drop "
                            f"{' and '.join(parts)}")
    if not safe:
        raise SettingsError(
            f"bloggap.fp16_doctor={path}: the doctor's fp16 check failed on {measured} "
            f"({check.get('nonfinite_logprobs')} of {check.get('n')} log-probs non-finite, largest |hidden| "
            f"{check.get('max_abs_hidden')} against fp16's 65,504): fp16 is not safe for this model; drop "
            f"{' and '.join(parts)} (arm A, E or B instead of H or F)")
