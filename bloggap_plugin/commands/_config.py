"""Command settings as dataclasses: every field is a flag with its help, a YAML file can set any of them.

Each command declares its settings once, as a dataclass whose fields carry ``metadata={"help": ...}`` (as TRL's
``GRPOConfig`` does), and ``configure(parser)`` calls :func:`add_config_arguments`. The flags are made by
``transformers.HfArgumentParser``'s field parser (``--num_seqs`` and ``--num-seqs``; ``list[X]`` fields take several values); ``bool`` fields are switches
that take no value (``--flag``, and ``--no-flag`` where the default is True), so positional arguments may follow. Extra ``metadata`` keys understood here:

- ``"aliases"``: more flag names, e.g. ``["--json"]`` (HfArgumentParser's own key);
- ``"parse"``: a function ``str -> value`` used instead of the annotated type (e.g. a comma list checker);
- ``"positional"``: the field is a positional argument; its value is ``"?"``, ``"*"``, ``"+"`` or ``None``
  (argparse's ``nargs``);
- ``"metavar"``, ``"choices"``: passed to argparse;
- ``"deprecated"``: old flag names still taken (a warning names the current one), on the command line and, without
  the dashes, in a ``--config`` file;
- ``"min"`` / ``"max"`` (inclusive) and ``"above"`` / ``"below"`` (exclusive): the valid range of a number field (or of each
  number of a list field), checked by :func:`check_values` before anything loads. Every number field of a command
  declares its range (``tests/cli/test_checked_first.py`` holds them to it).

``--config FILE.yaml`` (added to every such command) sets fields by name; the command line wins over the file,
the file over the dataclass default; an unknown name is an error naming the valid ones. Positional fields come
from the command line only.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

from bloggap_plugin._fields import RANGE_KEYS, check_values, range_text  # noqa: F401 - the flags' checks, re-exported
from bloggap_plugin.core.errors import UsageError, short_repr

_OWN_KEYS = ("parse", "positional", "deprecated", *RANGE_KEYS)
CONFIG_FLAG = "--config"


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr, ``PROG: error: PROBLEM (PROG --help lists the
    flags)``, exit 2, without the usage block (``bloggap train``'s usage alone is hundreds of lines)."""

    def error(self, message: str):  # noqa: D102 - argparse's
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the flags)\n")


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's ``(default: ...)`` after each flag's help, except where the help already names its default or
    there is none to show (``None``, a switch that is off, an empty list or mapping)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        nothing = any(action.default is value for value in (None, False, argparse.SUPPRESS)) or action.default in ([], {})
        if "default" in text.lower() or nothing or not action.option_strings:
            return text
        return super()._get_help_string(action)


def _fields(config_type: type) -> list[dataclasses.Field]:
    """The ``init`` fields of ``config_type`` with their annotations resolved (``field.type`` is a type)."""
    hints = typing.get_type_hints(config_type)
    resolved = []
    for field in dataclasses.fields(config_type):
        if field.init:
            field = _copy_field(field, type=hints[field.name])
            resolved.append(field)
    return resolved


def _copy_field(field: dataclasses.Field, **changes) -> dataclasses.Field:
    import copy

    clone = copy.copy(field)
    for key, value in changes.items():
        setattr(clone, key, value)
    return clone


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _add_positional(parser: argparse.ArgumentParser, field: dataclasses.Field) -> None:
    nargs = field.metadata["positional"]
    kwargs: dict[str, Any] = {"help": field.metadata.get("help")}
    if nargs is not None:
        kwargs["nargs"] = nargs
    default = _default(field)
    if default is not dataclasses.MISSING and nargs in ("?", "*"):
        kwargs["default"] = default
    for key in ("metavar", "choices"):
        if key in field.metadata:
            kwargs[key] = field.metadata[key]
    element = typing.get_args(field.type)[0] if typing.get_origin(field.type) is list else field.type
    parse = field.metadata.get("parse")
    if parse is not None or element in (int, float):
        kwargs["type"] = parse or element
    parser.add_argument(field.name, **kwargs)


def _add_switch(parser: argparse.ArgumentParser, field: dataclasses.Field) -> None:
    """A ``bool`` field as a switch that takes no value (``--flag``; ``--no-flag`` too when the default is True), so
    a positional argument may follow it; a ``--config`` file sets it with ``true``/``false``."""
    names = [f"--{field.name}"] + ([f"--{field.name.replace('_', '-')}"] if "_" in field.name else [])
    aliases = field.metadata.get("aliases", [])
    names += [aliases] if isinstance(aliases, str) else list(aliases)
    default = bool(_default(field)) if _default(field) is not dataclasses.MISSING else False
    parser.add_argument(*names, action="store_true", default=default, help=field.metadata.get("help"))
    if default:
        parser.add_argument(f"--no_{field.name}", f"--no-{field.name.replace('_', '-')}", action="store_false",
                            dest=field.name, help=f"turn off --{field.name.replace('_', '-')}")


class _Deprecated(argparse.Action):
    """An old flag name: stores as the current flag does, and says once on stderr which name to use."""

    def __init__(self, option_strings, dest, current: str = "", **kwargs):
        self.current = current
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        import sys

        print(f"{parser.prog}: warning: {option_string} is deprecated; use {self.current}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _add_deprecated(parser: argparse.ArgumentParser, field: dataclasses.Field) -> None:
    """The ``"deprecated"`` names of ``field`` as flags that act as its current flag (a warning says to use it)."""
    old = field.metadata.get("deprecated")
    if not old:
        return
    current = next(a for a in parser._actions if a.dest == field.name and a.option_strings)
    parser.add_argument(*old, dest=field.name, action=_Deprecated, current=current.option_strings[-1],
                        type=current.type, choices=current.choices, nargs=current.nargs, default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)


def deprecated_names(config_types: tuple[type, ...]) -> dict[str, str]:
    """``{old field name: current field name}`` of the ``"deprecated"`` flags of ``config_types``."""
    return {old.lstrip("-").replace("-", "_"): f.name for config_type in config_types for f in _fields(config_type)
            for old in f.metadata.get("deprecated", ())}


def add_config_arguments(parser: argparse.ArgumentParser, *config_types: type) -> None:
    """One argument per field of each of ``config_types`` on ``parser``, plus ``--config FILE.yaml``."""
    from transformers import HfArgumentParser

    for config_type in config_types:
        for field in _fields(config_type):
            if "positional" in field.metadata:
                _add_positional(parser, field)
                continue
            if field.type is bool:
                _add_switch(parser, field)
                continue
            metadata = {k: v for k, v in field.metadata.items() if k not in _OWN_KEYS}
            origin = typing.get_origin(field.type)
            if origin is typing.Union or isinstance(field.type, types.UnionType):
                if type(None) in typing.get_args(field.type) and _default(field) is None:
                    metadata.setdefault("metavar", field.name.upper())
            HfArgumentParser._parse_dataclass_field(parser, _copy_field(field, metadata=metadata))
            parse = field.metadata.get("parse")
            if parse is not None:
                for action in parser._actions:
                    if action.dest == field.name and action.option_strings and not action.option_strings[0].startswith("--no"):
                        action.type = parse
            _add_deprecated(parser, field)
    parser.formatter_class = DefaultsFormatter  # each flag's help shows its default
    if not any(CONFIG_FLAG in action.option_strings for action in parser._actions):
        parser.add_argument(CONFIG_FLAG, dest="_config_file", default=None, metavar="FILE.yaml",
                            help="YAML file setting any of these fields by name (the command line wins)")
    parser.set_defaults(_config_types=config_types)


def config_from_args(config_type: type, args: argparse.Namespace):
    """An instance of ``config_type`` from the parsed ``args`` (fields the namespace lacks keep their default),
    its values checked against the fields' types (:func:`check_values`)."""
    values = {f.name: getattr(args, f.name) for f in _fields(config_type) if hasattr(args, f.name)}
    config = config_type(**values)
    check_values(config)
    return config


def config_file_path(argv: list[str]) -> str | None:
    """The value of ``--config PATH`` / ``--config=PATH`` in ``argv``, or None."""
    for index, token in enumerate(argv):
        if token == CONFIG_FLAG:
            if index + 1 >= len(argv):
                raise UsageError(f"{CONFIG_FLAG} needs a YAML file path, e.g. {CONFIG_FLAG} doctor.yaml")
            return argv[index + 1]
        if token.startswith(CONFIG_FLAG + "="):
            return token.split("=", 1)[1]
    return None


def apply_config_file(parser: argparse.ArgumentParser, config_types: tuple[type, ...], path: str) -> dict:
    """Read ``path`` (YAML mapping of field names) and make its values ``parser``'s defaults; returns them."""
    from bloggap_plugin._input_files import display_name, load_yaml_file

    file = Path(path)
    what = f"{CONFIG_FLAG} {display_name(path)}"
    if not file.is_file():
        raise UsageError(f"{what}: no such file; give a YAML file of field: value lines")
    values = load_yaml_file(file, what, "give a YAML file of field: value lines") or {}
    if not isinstance(values, dict):
        raise UsageError(f"{what}: expected a mapping of field: value lines, got {type(values).__name__}")
    odd = [key for key in values if not isinstance(key, str)]
    if odd:
        raise UsageError(f"{what}: field name {short_repr(odd[0])} is a {type(odd[0]).__name__}, not a name; write "
                         "field names as text (e.g. num_seqs: 8)")
    fields = {f.name: f for config_type in config_types for f in _fields(config_type)}
    renamed = deprecated_names(config_types)
    for old in [key for key in values if key in renamed and renamed[key] not in values]:
        import sys

        print(f"bloggap: warning: {CONFIG_FLAG} {path}: {old} is deprecated; use {renamed[old]}", file=sys.stderr)
        values[renamed[old]] = values.pop(old)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise UsageError(f"{what}: unknown field(s) {', '.join(map(str, unknown))}; valid: "
                         f"{', '.join(sorted(n for n, f in fields.items() if 'positional' not in f.metadata))}")
    positional = sorted(n for n in values if "positional" in fields[n].metadata)
    if positional:
        raise UsageError(f"{what}: {', '.join(positional)} is given on the command line, not in the file")
    parser.set_defaults(**values)
    return values
