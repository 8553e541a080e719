"""The one error type for bad user input: the ``bloggap`` CLI prints it as ``bloggap: error: <message>`` and exits 2.

Validators raise :class:`UsageError` (or a subclass: ``RecipeError``, ``ModelSpecError``, ``GSM8KDataError``)
with a message that names the problem and the fix, before any model loads or any run trains.
"""

from __future__ import annotations

__all__ = ["UsageError", "one_line"]


class UsageError(ValueError):
    """Bad input (an option, a recipe, a model or data path): the message names the problem and the fix."""


def one_line(err: BaseException) -> str:
    """``str(err)`` on one line (runs of whitespace, newlines included, collapsed to one space)."""
    return " ".join(str(err).split()) or type(err).__name__
