"""The numbers and strings of a JSON document, for the tests that hold figures against the committed result files
(``tests/root/test_report.py``, ``tests/root/test_doc_figures.py``)."""

from __future__ import annotations

import json
from decimal import Decimal


class JsonNumber(str):
    """A number of a JSON document as its text (``json.loads`` parse_int/parse_float): the distinct texts are few,
    and each is converted to ``Decimal`` once by the test that reads it."""


def load_number_texts(text: str):
    """The JSON document ``text`` with every number kept as its :class:`JsonNumber` text."""
    return json.loads(text, parse_int=JsonNumber, parse_float=JsonNumber)


def numbers_and_strings(document) -> tuple[set, set[str]]:
    """``(numbers, strings)`` of ``document``, each distinct value once: the numbers (int, float, ``Decimal``,
    :class:`JsonNumber`; booleans are not numbers) and the strings, keys included."""
    numbers: set = set()
    strings: set[str] = set()
    stack = [document]
    while stack:
        value = stack.pop()
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, (int, float, Decimal, JsonNumber)):
            numbers.add(value)
        elif isinstance(value, str):
            strings.add(value)
        elif isinstance(value, dict):
            stack.extend(value)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return numbers, strings
