"""The checks a command's settings get from their dataclass fields: each value fits its field's annotation, and each
number lies in the range its field declares in ``metadata`` (``"min"``, ``"max"``, ``"above"``, ``"below"``).

Below ``commands``, so that ``compare``'s Python API gets the flags' checks without importing the command layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from bloggap_plugin.core.errors import UsageError, short_repr

__all__ = ["RANGE_KEYS", "check_values", "range_text"]

RANGE_KEYS = ("min", "max", "above", "below")


def _matches(value, annotation) -> bool:
    """Whether ``value`` fits ``annotation`` (``int``, ``float``, ``str``, ``bool``, ``list[X]``, ``X | None``,
    ``Literal[...]``; other annotations are not checked)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union or isinstance(annotation, types.UnionType):
        return any(_matches(value, arg) for arg in args)
    if origin is typing.Literal:
        return value in args
    if origin is list:
        return isinstance(value, list) and (not args or all(_matches(v, args[0]) for v in value))
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    return True


def _choices(annotation) -> tuple:
    """The values of a ``Literal[...]`` annotation, also as ``Literal[...] | None``; ``()`` for any other."""
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Union or isinstance(annotation, types.UnionType):
        return tuple(value for arg in typing.get_args(annotation) for value in _choices(arg))
    return ()


def range_text(metadata) -> str:
    """A field's declared range in words (``>= 1``, ``> 0``, ``in [0, 4294967295]``), or ``""``."""
    low = (">", metadata["above"]) if "above" in metadata else (">=", metadata["min"]) if "min" in metadata else None
    high = ("<", metadata["below"]) if "below" in metadata else ("<=", metadata["max"]) if "max" in metadata else None
    if low is not None and high is not None:
        return f"in {'(' if low[0] == '>' else '['}{low[1]}, {high[1]}{')' if high[0] == '<' else ']'}"
    return " ".join(map(str, low or high or ()))


def _out_of_range(value, metadata) -> bool:
    numbers = value if isinstance(value, list) else [value]
    for number in numbers:
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            continue
        if ("min" in metadata and number < metadata["min"]) or ("max" in metadata and number > metadata["max"]) or (
                "above" in metadata and number <= metadata["above"]) or ("below" in metadata and number >= metadata["below"]):
            return True
    return False


def check_values(config) -> None:
    """The checks argparse gives a flag, for values that came from ``--config FILE.yaml`` (argparse checks neither
    a default's type nor its choices): each value fits its field's annotation, a ``"parse"`` field's value passes
    its parser; and each number lies in its field's declared range (``"min"``, ``"max"``, ``"above"``). One-line
    ``UsageError`` naming the flag."""
    hints = typing.get_type_hints(type(config))
    for item in dataclasses.fields(config):
        value = getattr(config, item.name)
        if _out_of_range(value, item.metadata):
            shown = " ".join(map(str, value)) if isinstance(value, list) else value
            raise UsageError(f"--{item.name.replace('_', '-')} {shown}: must be {range_text(item.metadata)}"
                             f"{' (each)' if isinstance(value, list) else ''}")
        value, flag = getattr(config, item.name), "--" + item.name.replace("_", "-")
        parse = item.metadata.get("parse")
        if parse is not None:
            if isinstance(value, list):
                try:
                    parse(",".join(map(str, value)))
                except (argparse.ArgumentTypeError, ValueError) as err:
                    raise UsageError(f"{flag}: {err}") from None
            continue
        if value is None and item.default is None:  # a field left unset (None: "not given")
            continue
        if not _matches(value, hints[item.name]):
            choices = _choices(hints[item.name])
            if choices:
                raise UsageError(f"{flag} {short_repr(value)}: choose one of {', '.join(map(str, choices))}")
            raise UsageError(f"{flag} {short_repr(value)}: expected {getattr(hints[item.name], '__name__', hints[item.name])}")
