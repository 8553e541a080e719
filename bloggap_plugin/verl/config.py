"""Plugin settings for verl: environment variables, overridden by a top-level ``bloggap`` Hydra node.

verl's trainer config is struct-mode OmegaConf, and its sub-nodes become typed dataclasses that reject unknown
fields, so the plugin keeps its settings in a node of its own, added with ``+``::

    +bloggap.guard=raise +bloggap.fp32_head=true

Only the trainer process (TaskRunner) sees that node. Workers (engine, policy loss) read the environment
(``BLOGGAP_VERL_<FIELD>``, e.g. ``BLOGGAP_VERL_BAND=0.05``), and the trainer forwards what the engine needs per
call through the batch's ``extra_info`` (``bloggap_*`` keys), so the Hydra node is enough for a normal run.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

KEPT_SOURCES = ("auto", "support_size", "retruncate", "off")
GUARD_MODES = ("warn", "raise", "off")


@dataclass
class BloggapVerlConfig:
    """Settings of the verl integration (``+bloggap.<field>=...`` or ``BLOGGAP_VERL_<FIELD>``)."""

    fix_truncation: bool = True
    """Lift the rollout log-probs by the log kept mass before verl's IS/RS (only acts when the batch carries
    ``log_kept_mass``, which the engine override computes when the rollout samples with top_p/top_k/min_p)."""

    kept_source: str = "auto"
    """Where the kept mass comes from: ``support_size`` (the rollout's per-token kept-set sizes, needs
    ``patches/verl``; exact up to boundary ties), ``retruncate`` (the actor re-applies top_p/top_k/min_p to its
    own logits; approximate at the boundary), ``auto`` (support_size when
    ``actor_rollout_ref.rollout.engine_kwargs.vllm.return_sampling_mask`` is set, else retruncate), ``off``."""

    guard: str = "warn"
    """What to do when a step's rejection sampling removes every sequence or every sequence IS weight sits at
    the safety floor: ``warn`` (log ``gap/verl/all_rejected = 1`` and a warning), ``raise`` (stop the run),
    ``off``."""

    fp32_head: bool = False
    """Arm E: compute the LM head and log-softmax in fp32 in the old-log-prob pass only (engine override)."""

    band: float = 0.1
    """Half-width b of the ratio band ``[1-b, 1+b]`` used by ``gap/ratio/oob_frac``."""

    top_p: float | None = None
    """Override of the rollout's top_p used for re-truncation (default: ``actor_rollout_ref.rollout.top_p``)."""

    top_k: int | None = None
    """Override of the rollout's top_k (default: ``actor_rollout_ref.rollout.top_k``; -1/0 = off)."""

    min_p: float | None = None
    """Override of the rollout's min_p (default: ``actor_rollout_ref.rollout.min_p`` if present, else 0)."""

    def __post_init__(self) -> None:
        if self.kept_source not in KEPT_SOURCES:
            raise ValueError(f"bloggap.kept_source must be one of {KEPT_SOURCES}, got {self.kept_source!r}")
        if self.guard not in GUARD_MODES:
            raise ValueError(f"bloggap.guard must be one of {GUARD_MODES}, got {self.guard!r}")
        if not 0.0 < float(self.band) < 1.0:
            raise ValueError(f"bloggap.band must be in (0, 1), got {self.band}")


def _coerce(field: dataclasses.Field, raw: Any) -> Any:
    if raw is None:
        return None
    if field.type in ("bool", bool):
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"bloggap.{field.name} must be a boolean, got {raw!r}")
    if "float" in str(field.type):
        return None if str(raw).lower() in ("none", "null") else float(raw)
    if "int" in str(field.type):
        return None if str(raw).lower() in ("none", "null") else int(raw)
    return str(raw)


def load_settings(node: Any = None, environ: dict | None = None) -> BloggapVerlConfig:
    """Settings from ``BLOGGAP_VERL_*`` environment variables, then the ``bloggap`` config node (wins)."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    names = {f.name: f for f in dataclasses.fields(BloggapVerlConfig)}
    for name, field in names.items():
        raw = environ.get(f"BLOGGAP_VERL_{name.upper()}")
        if raw is not None:
            values[name] = _coerce(field, raw)
    if node is not None:
        items = dict(node.items()) if hasattr(node, "items") else dict(node)
        unknown = sorted(set(items) - set(names))
        if unknown:
            raise ValueError(f"unknown bloggap setting(s) {unknown}; valid: {sorted(names)}")
        for name, raw in items.items():
            values[name] = _coerce(names[name], raw)
    return BloggapVerlConfig(**values)


def settings_from_trainer_config(config: Any) -> BloggapVerlConfig:
    """Settings for a verl trainer config (``config.bloggap`` node if present, else the environment)."""
    node = None
    if config is not None and hasattr(config, "get"):
        node = config.get("bloggap", None)
    return load_settings(node)


def sampling_from_trainer_config(config: Any, settings: BloggapVerlConfig) -> dict:
    """``{"temperature", "top_p", "top_k", "min_p"}`` of the rollout (plugin overrides win)."""
    rollout = {}
    try:
        rollout = config.actor_rollout_ref.rollout
    except Exception:  # noqa: BLE001 - any config without the node: fall back to defaults
        rollout = {}
    get = rollout.get if hasattr(rollout, "get") else (lambda key, default=None: default)
    sampling = {
        "temperature": float(get("temperature", 1.0) or 1.0),
        "top_p": float(get("top_p", 1.0) if get("top_p", 1.0) is not None else 1.0),
        "top_k": int(get("top_k", -1) if get("top_k", -1) is not None else -1),
        "min_p": float(get("min_p", 0.0) or 0.0),
    }
    for name in ("top_p", "top_k", "min_p"):
        value = getattr(settings, name)
        if value is not None:
            sampling[name] = value
    return sampling


def is_truncated(sampling: dict) -> bool:
    """True when the sampling settings keep less than the full vocabulary."""
    return sampling.get("top_p", 1.0) < 1.0 or sampling.get("top_k", -1) > 0 or sampling.get("min_p", 0.0) > 0.0
