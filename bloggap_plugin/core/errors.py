"""The one error type for bad user input: the ``bloggap`` CLI prints it as ``bloggap: error: <message>`` and exits 2.

Validators raise :class:`UsageError` (or a subclass: ``RecipeError``, ``ModelSpecError``, ``GSM8KDataError``)
with a message that names the problem and the fix, before any model loads or any run trains.
"""

from __future__ import annotations

__all__ = ["UsageError", "one_line", "check_positive", "short_repr", "SEED_MAX"]

SEED_MAX = 2**32 - 1
"""The largest seed numpy's legacy seeding (and so transformers' ``set_seed``) accepts."""


class UsageError(ValueError):
    """Bad input (an option, a recipe, a model or data path): the message names the problem and the fix."""


def one_line(err: BaseException) -> str:
    """``str(err)`` on one line (runs of whitespace, newlines included, collapsed to one space)."""
    return " ".join(str(err).split()) or type(err).__name__


def check_positive(option: str, value: int | None) -> None:
    """Raise :class:`UsageError` if ``value`` (an integer option; ``None`` = its default) is below 1."""
    if value is not None and value < 1:
        raise UsageError(f"{option} must be >= 1, got {value}; leave it out for the default")


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)`` for an error message, at most about ``limit`` characters: a long or deeply nested value (a
    YAML document's expansion, a pasted blob) is cut with ``...`` instead of printed whole."""
    import reprlib

    shorter = reprlib.Repr()
    shorter.maxstring = shorter.maxother = shorter.maxlong = limit
    shorter.maxlist = shorter.maxtuple = shorter.maxdict = shorter.maxset = 8
    shorter.maxlevel = 3
    text = shorter.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
