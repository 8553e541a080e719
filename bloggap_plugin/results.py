"""The benchmark result document: one schema, one JSON sanitiser, one plain-text table printer.

Every producer (``bloggap compare``/``doctor``/``attribute``/``ladder`` and ``benchmarks/*.py``) writes, and
``bloggap report`` reads, one JSON object::

    {"benchmark": str, "schema_version": 1, "env": {...}, "params": {...}, "results": {...},
     "tables": [{"id", "title", "columns", "rows", "notes", "reference": "T1" | null, "random_init": bool,
                 "plot": optional hint}]}

plus, for some producers, further top-level keys of their own (the doctor's ``cells``, ``recommendation``, ...:
:attr:`ResultDocument.extra`), and optionally ``"superseded_by": "<file name>.json"``: the result file beside this
one that replaces it (``bloggap report`` then lists this one in its archive section). Build one with :class:`ResultDocument`, check it with
:meth:`ResultDocument.validate`, write it with :meth:`ResultDocument.write` (sanitised by :func:`jsonable`,
validated, then written atomically through :func:`bloggap_plugin._io.atomic_write_text`: a failed write leaves the
previous file whole) and read it back with :meth:`ResultDocument.read` (strict JSON: floats parsed as
``Decimal`` so a reader sees each number exactly as written; ``NaN``/``Infinity`` refused, naming where).

Sanitiser (:func:`jsonable`): a non-finite float (NaN, +-Infinity) becomes ``null``, because RFC 8259 JSON has no
such values and ``null`` is what a table renders as "no value" (``–``); tuples become lists; numpy and torch
scalars become Python numbers (ints stay ints) and arrays or tensors nested lists; paths become strings; any other object becomes ``str(object)``.

Table printer (:func:`text_table`, :func:`format_text_table`): columns padded to their widest cell, ``" | "``
between cells, ``None`` printed as ``-``, trailing spaces stripped; for consoles and logs (BENCHMARKS.md uses the
Markdown renderer of :mod:`bloggap_plugin.report_builder`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from bloggap_plugin._io import atomic_write_text
from bloggap_plugin.core.errors import UsageError

__all__ = [
    "SCHEMA_VERSION",
    "SUPERSEDED_BY",
    "SUPPORTED_SCHEMA_VERSIONS",
    "ResultDocument",
    "ResultError",
    "jsonable",
    "dumps",
    "load_json",
    "validate_result",
    "validate_table",
    "text_table",
    "format_text_table",
    "is_number",
    "is_missing",
    "numeric_column",
]

SCHEMA_VERSION = 1
"""The version producers write. Bump it where a field moves, and keep reading the older versions."""
SUPPORTED_SCHEMA_VERSIONS = (1,)
"""The versions :func:`validate_result` (and so ``bloggap report``) reads."""

_TOP_KEYS = {"benchmark": str, "schema_version": int, "env": dict, "params": dict, "results": dict, "tables": list}
SUPERSEDED_BY = "superseded_by"
"""Optional top-level key: the name of the result file in the same folder that replaces this one."""
_TABLE_KEYS = {"id": str, "title": str, "columns": list, "rows": list, "notes": str, "random_init": bool}
_PLACEHOLDERS = {"", "-", "–", "—", "n/a", "na", "nan", "skipped"}


class ResultError(UsageError):
    """A result document is missing or malformed (the message names the file and the problem)."""


# --------------------------------------------------------------------------------------------- sanitiser


def _key(key):
    return key if key is None or isinstance(key, (str, int, float, bool)) else str(key)


def jsonable(value: Any) -> Any:
    """``value`` as strict JSON data: non-finite floats -> ``None``, tuples -> lists, numpy/torch scalars ->
    Python numbers (arrays and tensors -> nested lists), paths -> strings, other objects -> ``str(value)``; dicts
    and lists are converted throughout."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, Decimal):
        return float(value) if value.is_finite() else None
    if isinstance(value, dict):
        return {_key(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if callable(getattr(value, "tolist", None)):
        return jsonable(value.tolist())  # numpy scalar or array, torch tensor: Python numbers, nested lists
    return str(value)


def dumps(value: Any, indent: int | None = 1) -> str:
    """``json.dumps`` of ``jsonable(value)``, strict (no NaN/Infinity can get through)."""
    return json.dumps(jsonable(value), indent=indent, allow_nan=False)


# --------------------------------------------------------------------------------------------- reading


class _NonFinite(str):
    """What ``NaN``, ``Infinity`` or ``-Infinity`` parse to, so that :func:`load_json` can say where it is."""


def _find_non_finite(value, where: str = "") -> tuple[str, str] | None:
    """``(JSON path, constant)`` of the first NaN/Infinity in ``value`` (as parsed by :func:`load_json`)."""
    if isinstance(value, _NonFinite):
        return where or "the top level", str(value)
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _find_non_finite(item, f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else key)
        if found:
            return found
    return None


def load_json(path: str | os.PathLike):
    """Parse ``path`` as strict JSON, floats as ``Decimal``, through the bounded reader
    (:func:`~bloggap_plugin._input_files.load_json_file`); :class:`ResultError` names the file and the problem
    (too large, unreadable, not UTF-8, not JSON, or a NaN/Infinity and where it is)."""
    from bloggap_plugin._input_files import display_name, load_json_file

    path = Path(path)
    constants: list[_NonFinite] = []

    def non_finite(text: str) -> _NonFinite:
        constants.append(_NonFinite(text))
        return constants[-1]

    document = load_json_file(path, display_name(path), "remove it from the results folder", ResultError,
                              "a bloggap result document", parse_float=Decimal, parse_constant=non_finite)
    found = _find_non_finite(document) if constants else None  # walked only when the parser met one
    if found:
        raise ResultError(f"{path}: {found[0]} is {found[1]}, which JSON does not allow; write null for a value that "
                          "does not exist (rendered '–') or fix the benchmark that produced it")
    return document


# --------------------------------------------------------------------------------------------- validation


def is_number(value) -> bool:
    """A JSON number (``int``, ``float`` or ``Decimal``), not a boolean."""
    return isinstance(value, (int, float, Decimal)) and not isinstance(value, bool)


def is_missing(value) -> bool:
    """A cell that stands for "no value": null or a placeholder string such as ``"-"``."""
    return value is None or (isinstance(value, str) and value.strip().lower() in _PLACEHOLDERS)


def numeric_column(rows: list, index: int) -> bool:
    """Numbers in every row of column ``index``, except placeholders, and at least one number."""
    cells = [r[index] for r in rows]
    return any(is_number(c) for c in cells) and all(is_number(c) or is_missing(c) for c in cells)


def _check_table_keys(table, where: str, reference: bool) -> None:
    if not isinstance(table, dict):
        raise ResultError(f"{where}: a table must be an object, got {type(table).__name__}")
    keys = dict(_TABLE_KEYS)
    if reference:
        keys.pop("random_init")
    for key, kind in keys.items():
        if key not in table:
            raise ResultError(f"{where}: table lacks the key {key!r} (needs {sorted(keys)})")
        if not isinstance(table[key], kind):
            raise ResultError(f"{where}: table key {key!r} must be {kind.__name__}, got {type(table[key]).__name__}")


def _check_rows(table: dict, where: str) -> None:
    columns = table["columns"]
    if not columns or not all(isinstance(c, str) for c in columns):
        raise ResultError(f"{where}: 'columns' must be a non-empty list of strings")
    for number, row in enumerate(table["rows"]):
        if not isinstance(row, list):
            raise ResultError(f"{where}: rows[{number}] must be a list, got {type(row).__name__}")
        if len(row) != len(columns):
            raise ResultError(f"{where}: rows[{number}] has {len(row)} cells for {len(columns)} columns")
        for cell in row:
            if cell is not None and not isinstance(cell, (str, bool)) and not is_number(cell):
                raise ResultError(f"{where}: rows[{number}] holds a {type(cell).__name__}; cells must be text, "
                                  "numbers, booleans or null")


def validate_table(table, where: str, reference_ids=None, reference: bool = False) -> None:
    """Raise :class:`ResultError` (prefixed ``where``) unless ``table`` follows the table schema.

    ``reference_ids``: the reference study's table ids a ``reference`` may name (``None``: any string);
    ``reference=True``: a table of the reference study itself (no ``reference``/``random_init`` keys).
    """
    _check_table_keys(table, where, reference)
    where = f"{where} ({table['id']})"
    if not reference:
        if "reference" not in table:
            raise ResultError(f"{where}: table lacks the key 'reference' (a reference-study id like 'T1', or null)")
        ref = table["reference"]
        if ref is not None and (not isinstance(ref, str) or (reference_ids is not None and ref not in reference_ids)):
            raise ResultError(
                f"{where}: reference {ref!r} is not a table of the reference study; use one of "
                f"{', '.join(sorted(reference_ids or []))} or null"
            )
    _check_rows(table, where)
    if "plot" in table and table["plot"] is not False:
        _validate_plot(table, where)


def _validate_plot(table: dict, where: str) -> None:
    hint = table["plot"]
    if not isinstance(hint, dict):
        raise ResultError(f"{where}: 'plot' must be an object or false")
    if hint.get("kind") not in ("bar", "line"):
        raise ResultError(f"{where}: plot kind must be 'bar' or 'line', got {hint.get('kind')!r}")
    columns = table["columns"]
    if hint.get("x") not in columns:
        raise ResultError(f"{where}: plot x {hint.get('x')!r} is not a column ({columns})")
    ys = hint.get("y")
    if not isinstance(ys, list) or not ys or any(y not in columns for y in ys):
        raise ResultError(f"{where}: plot y must be a non-empty list of columns from {columns}, got {ys!r}")
    if "series" in hint and hint["series"] not in columns:
        raise ResultError(f"{where}: plot series {hint['series']!r} is not a column ({columns})")
    for y in ys:
        if not numeric_column(table["rows"], columns.index(y)):
            raise ResultError(f"{where}: plot column {y!r} must hold numbers (or null / '-') in every row")
    if hint["kind"] == "line":
        index = columns.index(hint["x"])
        if any(not is_number(row[index]) for row in table["rows"]):
            raise ResultError(f"{where}: a line plot needs numbers in its x column {hint['x']!r}")


def validate_result(document, path: str | os.PathLike, reference_ids=None) -> None:
    """Raise :class:`ResultError` naming ``path`` and the problem unless ``document`` follows the result schema."""
    if not isinstance(document, dict):
        raise ResultError(f"{path}: expected a JSON object at the top, got {type(document).__name__}")
    if "benchmark" not in document and isinstance(document.get("command"), str):
        command = document["command"]
        raise ResultError(f"{path}: the output of `bloggap {command} --json`, a measurement of one model, not a "
                          f"benchmark result document (benchmark, schema_version, env, params, results, tables): move "
                          f"it out of the results folder, or run the benchmark that records {command} "
                          "(BENCHMARKS.md names each)")
    for key, kind in _TOP_KEYS.items():
        if key not in document:
            raise ResultError(f"{path}: missing key {key!r} (a result needs {', '.join(_TOP_KEYS)})")
        if not isinstance(document[key], kind) or isinstance(document[key], bool):
            raise ResultError(f"{path}: key {key!r} must be {kind.__name__}, got {type(document[key]).__name__}")
    if document["schema_version"] not in SUPPORTED_SCHEMA_VERSIONS:
        supported = " or ".join(map(str, SUPPORTED_SCHEMA_VERSIONS))
        raise ResultError(f"{path}: schema_version {document['schema_version']} is not supported (expected {supported})")
    _check_superseded_by(document, path)
    if not document["tables"]:
        raise ResultError(f"{path}: 'tables' is empty; a result must carry at least one table")
    ids = [t.get("id") if isinstance(t, dict) else None for t in document["tables"]]
    for index, table in enumerate(document["tables"]):
        validate_table(table, f"{path}: tables[{index}]", reference_ids)
    duplicates = sorted({i for i in ids if ids.count(i) > 1 and i is not None})
    if duplicates:
        raise ResultError(f"{path}: table ids must be unique within a file; repeated: {duplicates}")


def _check_superseded_by(document: dict, path: str | os.PathLike) -> None:
    """``superseded_by``, where present, is a plain ``.json`` file name other than the document's own."""
    if SUPERSEDED_BY not in document:
        return
    name = document[SUPERSEDED_BY]
    if (not isinstance(name, str) or not name.endswith(".json") or "/" in name or "\\" in name
            or name == Path(path).name):
        raise ResultError(f"{path}: {SUPERSEDED_BY!r} must be the name of the result file beside this one that "
                          f"replaces it, such as \"arm_i_live.json\" (got {name!r})")


# --------------------------------------------------------------------------------------------- document


@dataclass
class ResultDocument:
    """One benchmark result (see the module docstring for the schema)."""

    benchmark: str
    """Name of the producer, also the file stem under ``benchmarks/results/<device>/`` (``"compare"``, ...)."""
    env: dict
    """Machine and library versions (:func:`bloggap_plugin.envinfo.environment_record`)."""
    params: dict
    """The settings the producer ran with."""
    results: dict
    """Raw numbers behind the tables."""
    tables: list[dict]
    """Tables for ``bloggap report`` (at least one; ids unique within the document)."""
    schema_version: int = SCHEMA_VERSION
    """Schema version; producers leave the default."""
    extra: dict = field(default_factory=dict)
    """Further top-level keys of this producer (written after the six schema keys)."""

    def to_dict(self) -> dict:
        """The document as one JSON object: the six schema keys in schema order, then :attr:`extra`."""
        clash = sorted(set(self.extra) & set(_TOP_KEYS))
        if clash:
            raise ResultError(f"ResultDocument.extra repeats the schema key(s) {clash}; set the field instead")
        return {"benchmark": self.benchmark, "schema_version": self.schema_version, "env": self.env,
                "params": self.params, "results": self.results, "tables": self.tables, **self.extra}

    @classmethod
    def from_dict(cls, data: dict, path: str | os.PathLike = "<document>", reference_ids=None) -> ResultDocument:
        """Validate ``data`` (:func:`validate_result`, errors naming ``path``) and wrap it."""
        validate_result(data, path, reference_ids)
        extra = {k: v for k, v in data.items() if k not in _TOP_KEYS}
        return cls(**{k: data[k] for k in _TOP_KEYS}, extra=extra)

    def validate(self, path: str | os.PathLike = "<document>", reference_ids=None) -> None:
        """Raise :class:`ResultError` unless the sanitised document follows the schema."""
        validate_result(jsonable(self.to_dict()), path, reference_ids)

    def write(self, path: str | os.PathLike) -> Path:
        """Sanitise (:func:`jsonable`), validate, then write ``path`` atomically (``indent=1``, final newline),
        creating its folder; returns the path. A failed write raises ``OSError`` and leaves the old file whole."""
        path = Path(path)
        data = jsonable(self.to_dict())
        validate_result(data, path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return atomic_write_text(path, json.dumps(data, indent=1, allow_nan=False) + "\n")

    @classmethod
    def read(cls, path: str | os.PathLike, reference_ids=None) -> ResultDocument:
        """Load (:func:`load_json`: numbers as ``Decimal``) and validate ``path``; any supported schema version."""
        return cls.from_dict(load_json(path), path, reference_ids)


# --------------------------------------------------------------------------------------------- text tables


def text_table(columns: Sequence, rows: Sequence[Sequence], rule: bool = False) -> list[str]:
    """Lines of an aligned plain-text table: each column padded to its widest cell, ``" | "`` between cells,
    ``None`` as ``-``, trailing spaces stripped; ``rule`` adds a ``-+-`` line under the header."""
    cells = [[str(c) for c in columns]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    if rule:
        lines.insert(1, "-+-".join("-" * w for w in widths))
    return lines


def format_text_table(table: dict) -> str:
    """A result table (``id``, ``title``, ``columns``, ``rows``) as aligned plain text for a console; ``None`` -> ``-``."""
    return f"{table['id']}: {table['title']}\n" + "\n".join(text_table(table["columns"], table["rows"]))
