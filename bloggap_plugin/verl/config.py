"""Plugin settings for verl: environment variables, overridden by a top-level ``bloggap`` Hydra node.

verl's trainer config is struct-mode OmegaConf, and its sub-nodes become typed dataclasses that reject unknown
fields, so the plugin keeps its settings in a node of its own, added with ``+``::

    +bloggap.guard=raise +bloggap.fp32_head=true

Only the trainer process (TaskRunner) sees that node. Workers (engine, policy loss) read the environment
(``BLOGGAP_VERL_<FIELD>``, e.g. ``BLOGGAP_VERL_BAND=0.05``), and the trainer forwards what the engine needs per
call through the batch's ``extra_info`` (``bloggap_*`` keys), so the Hydra node is enough for a normal run.

This module is the only place that reads ``BLOGGAP_VERL_*`` variables (:func:`read_environment`). Registration
(the ``verl.plugins`` entry point) validates all of them at once, so a bad value stops the process with a one-line
message naming the variable before verl builds anything. An empty value counts as unset.

Every setting is one field of :class:`BloggapVerlConfig`: its annotation is its type, its ``metadata`` its help text
and allowed values. The environment, the Hydra node (recipes' ``+bloggap.*`` overrides) and direct construction all
parse a value with that field's :func:`setting_parser`, so each source accepts the same values and rejects a bad one
with the same one-line message.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bloggap_plugin.core.errors import short_repr

KEPT_SOURCES = ("auto", "support_size", "retruncate", "off")
GUARD_MODES = ("warn", "raise", "off")
ENV_PREFIX = "BLOGGAP_VERL_"
DISABLE_ENV = "BLOGGAP_VERL_DISABLE"
DUMP_ENV = "BLOGGAP_VERL_DUMP_LOGPROBS"  # evidence hook of verl/engine.py (a path prefix), not a setting
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
_NONE_WORDS = ("none", "null")


class SettingsError(ValueError):
    """A bad plugin setting; the message is one line naming the setting, its value and the allowed values."""


def setting(default: Any, help: str, *, choices: tuple[str, ...] = (), low: float | None = None,
            high: float | None = None, open_low: bool = False, open_high: bool = False, note: str = "") -> Any:
    """A settings field: ``default``, its ``help`` text and the constraints its annotation's parser checks
    (``choices`` for ``str``; ``low``/``high`` bounds, open or closed, for ``float`` and ``int``; ``note``: words
    appended to the allowed values in error messages)."""
    bounds = {"low": low, "high": high, "open_low": open_low, "open_high": open_high}
    return field(default=default, metadata={"help": help, "choices": choices, "note": note, **bounds})


@dataclass
class BloggapVerlConfig:
    """Settings of the verl integration (``+bloggap.<field>=...`` or ``BLOGGAP_VERL_<FIELD>``).

    Each field's type is its annotation: :func:`setting_parser` turns a raw value (a string from the environment,
    anything from the Hydra node) into that type within the field's metadata constraints.
    """

    fix_truncation: bool = setting(True, help=(
        "Lift the rollout log-probs by the log kept mass before verl's IS/RS (only acts when the batch carries "
        "log_kept_mass, which the engine override computes when the rollout samples with top_p/top_k/min_p)."))
    kept_source: str = setting("auto", choices=KEPT_SOURCES, help=(
        "Where the kept mass comes from: support_size (the rollout's per-token kept-set sizes, needs "
        "patches/verl; exact up to boundary ties), retruncate (the actor re-applies top_p/top_k/min_p to its own "
        "logits; approximate at the boundary), auto (support_size when "
        "actor_rollout_ref.rollout.engine_kwargs.vllm.return_sampling_mask is set, else retruncate), off."))
    guard: str = setting("warn", choices=GUARD_MODES, help=(
        "What to do when a step's rejection sampling removes every sequence or every sequence IS weight sits at "
        "the safety floor: warn (log gap/verl/all_rejected = 1 and a warning), raise (stop the run), off."))
    fp32_head: bool = setting(False, help=(
        "Arm E: compute the LM head and log-softmax in fp32 in the old-log-prob pass only (engine override)."))
    band: float = setting(0.1, low=0.0, high=1.0, open_low=True, open_high=True, help=(
        "Half-width b of the ratio band [1-b, 1+b] used by gap/ratio/oob_frac."))
    top_p: float | None = setting(None, low=0.0, high=1.0, open_low=True, help=(
        "Override of the rollout's top_p used for re-truncation (default: actor_rollout_ref.rollout.top_p)."))
    top_k: int | None = setting(None, low=-1, note="(-1 or 0 = no top-k)", help=(
        "Override of the rollout's top_k (default: actor_rollout_ref.rollout.top_k; -1/0 = off)."))
    min_p: float | None = setting(None, low=0.0, high=1.0, open_high=True, help=(
        "Override of the rollout's min_p (default: actor_rollout_ref.rollout.min_p if present, else 0)."))
    fp16_doctor: Path | None = setting(None, help=(
        "A `bloggap doctor --json` result of the actor's model: with an fp16 actor or rollout (arm H, F), the "
        "trainer's constructor refuses the run where its fp16 check failed (bloggap_plugin.verl.fp16)."))

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            setattr(self, item.name, _parse_setting(item.name, getattr(self, item.name), f"bloggap.{item.name}"))


def _bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in TRUE_WORDS:
        return True
    if text in FALSE_WORDS:
        return False
    raise ValueError(raw)


def _in_bounds(value: float, raw: Any, meta: Mapping[str, Any]) -> None:
    low, high = meta["low"], meta["high"]
    above = low is None or (value > low if meta["open_low"] else value >= low)
    below = high is None or (value < high if meta["open_high"] else value <= high)
    if not (above and below):  # also rejects nan
        raise ValueError(raw)


def _number(raw: Any, meta: Mapping[str, Any]) -> float:
    if isinstance(raw, bool):
        raise ValueError(raw)
    value = float(raw.strip() if isinstance(raw, str) else raw)
    _in_bounds(value, raw, meta)
    return value


def _integer(raw: Any, meta: Mapping[str, Any]) -> int:
    if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
        raise ValueError(raw)
    value = int(raw.strip() if isinstance(raw, str) else raw)
    _in_bounds(value, raw, meta)
    return value


def _choice(raw: Any, meta: Mapping[str, Any]) -> str:
    text = str(raw).strip().lower()
    if text not in meta["choices"]:
        raise ValueError(raw)
    return text


def _path(raw: Any, meta: Mapping[str, Any]) -> Path:  # noqa: ARG001 - the parsers' signature
    if not isinstance(raw, (str, os.PathLike)) or not str(raw).strip():
        raise ValueError(raw)
    return Path(str(raw).strip())


_BOOL_WORDS = ", ".join(w for pair in zip(TRUE_WORDS, FALSE_WORDS) for w in pair)
# annotation's base type -> parser of a raw value (environment string or Hydra node value) under the field's metadata
_TYPE_PARSERS: dict[type, Callable[[Any, Mapping[str, Any]], Any]] = {
    bool: lambda raw, meta: _bool(raw), str: _choice, float: _number, int: _integer, Path: _path,
}


def _field_type(name: str) -> tuple[type, bool]:
    """``(base type, optional)`` of the field ``name`` from its annotation (``float | None`` -> ``(float, True)``)."""
    hint = typing.get_type_hints(BloggapVerlConfig)[name]
    args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return (args[0], True) if args else (hint, False)


def _allowed(item: dataclasses.Field) -> str:
    """The allowed values of a field, in words, from its annotation and metadata."""
    base, optional = _field_type(item.name)
    meta = item.metadata
    if base is bool:
        words = f"one of {_BOOL_WORDS}"
    elif base is Path:
        words = "a file path"
    elif base is str:
        words = f"one of {', '.join(meta['choices'])}"
    elif base is int and meta["high"] is None:
        words = f"an integer >= {meta['low']}"
    else:
        words = (f"a number in {'(' if meta['open_low'] else '['}{meta['low']:g}, {meta['high']:g}"
                 f"{')' if meta['open_high'] else ']'}")
        if item.default is not None:
            words += f", e.g. {item.default}"
    if meta["note"]:
        words += f" {meta['note']}"
    return f"{words}, or none" if optional else words


def setting_parser(name: str) -> Callable[[Any], Any]:
    """The parser of setting ``name``: raw value -> value of the field's annotated type (``None`` for none/null
    when the annotation allows it); raises ``ValueError`` or ``TypeError`` when the value is not allowed."""
    base, optional = _field_type(name)
    meta = _FIELDS[name].metadata
    parse = _TYPE_PARSERS[base]

    def parse_setting(raw: Any) -> Any:
        if optional and (raw is None or (isinstance(raw, str) and raw.strip().lower() in _NONE_WORDS)):
            return None
        return parse(raw, meta)

    return parse_setting


_FIELDS = {item.name: item for item in dataclasses.fields(BloggapVerlConfig)}
ALLOWED = {name: _allowed(item) for name, item in _FIELDS.items()}
DISABLE_ALLOWED = f"one of {_BOOL_WORDS}"


def _parse_setting(name: str, raw: Any, source: str) -> Any:
    """The typed value of setting ``name`` from ``raw``; a one-line :class:`SettingsError` naming ``source``
    (``BLOGGAP_VERL_BAND`` or ``bloggap.band``), the value and the allowed values when ``raw`` is not allowed."""
    try:
        return setting_parser(name)(raw)
    except (TypeError, ValueError):
        raise SettingsError(f"{source}={short_repr(raw)} is not valid: expected {ALLOWED[name]}") from None


def env_name(field_name: str) -> str:
    """The environment variable of a setting: ``band`` -> ``BLOGGAP_VERL_BAND``."""
    return f"{ENV_PREFIX}{field_name.upper()}"


def dump_path() -> str | None:
    """The path prefix in ``BLOGGAP_VERL_DUMP_LOGPROBS`` (the engine's evidence hook), or None when unset/empty."""
    return os.environ.get(DUMP_ENV) or None


def environment_variables() -> tuple[str, ...]:
    """Every ``BLOGGAP_VERL_*`` variable the plugin reads."""
    return (DISABLE_ENV, DUMP_ENV, *(env_name(f.name) for f in dataclasses.fields(BloggapVerlConfig)))


def read_environment(environ: dict | None = None) -> tuple[bool, dict[str, Any]]:
    """``(disabled, {field: value})`` from the ``BLOGGAP_VERL_*`` variables of ``environ`` (default ``os.environ``).

    The only reader of these variables. Empty values count as unset. Raises :class:`SettingsError` (one line,
    naming the variable, its value and the allowed values) on a bad value or an unknown ``BLOGGAP_VERL_*`` name.
    """
    environ = os.environ if environ is None else environ
    known = environment_variables()
    for name in sorted(environ):
        if name.startswith(ENV_PREFIX) and name not in known:
            raise SettingsError(f"unknown environment variable {name}; unset it or use one of {', '.join(known)}")
    disabled = False
    raw = environ.get(DISABLE_ENV, "")
    if raw.strip():
        try:
            disabled = _bool(raw)
        except ValueError:
            raise SettingsError(f"{DISABLE_ENV}={raw!r} is not valid: expected {DISABLE_ALLOWED}") from None
    values: dict[str, Any] = {}
    for item in dataclasses.fields(BloggapVerlConfig):
        raw = environ.get(env_name(item.name), "")
        if raw.strip():
            values[item.name] = _parse_setting(item.name, raw, env_name(item.name))
    return disabled, values


def load_settings(node: Any = None, environ: dict | None = None) -> BloggapVerlConfig:
    """Settings from ``BLOGGAP_VERL_*`` environment variables, then the ``bloggap`` config node (wins)."""
    _, values = read_environment(environ)
    if node is not None:
        if not callable(getattr(node, "items", None)):  # +bloggap=5, +bloggap=[...]: a value, not settings
            raise SettingsError(f"bloggap={short_repr(node)} is not a group of settings: give each one as "
                                "+bloggap.<setting>=<value> (e.g. +bloggap.band=0.05)")
        items = dict(node.items())
        names = [f.name for f in dataclasses.fields(BloggapVerlConfig)]
        unknown = sorted(set(items) - set(names), key=str)
        if unknown:
            raise SettingsError(f"unknown bloggap setting(s) {unknown}; valid: {sorted(names)}")
        for name, raw in items.items():
            values[name] = _parse_setting(name, raw, f"bloggap.{name}")
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
