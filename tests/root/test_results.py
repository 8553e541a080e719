"""bloggap_plugin.results: the one result document, sanitiser and text-table printer every producer uses."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import pytest

from bloggap_plugin.results import (
    SCHEMA_VERSION,
    ResultDocument,
    ResultError,
    format_text_table,
    jsonable,
    text_table,
)


def _table(**kw) -> dict:
    table = {"id": "T1", "title": "t", "columns": ["arm", "OOB %"], "rows": [["A", 1.5], ["B", None]],
             "notes": "n", "reference": None, "random_init": False}
    table.update(kw)
    return table


def _document(**kw) -> ResultDocument:
    fields = {"benchmark": "demo", "env": {"cpu": "x86_64"}, "params": {"seed": 3}, "results": {"oob": 0.25},
              "tables": [_table()]}
    fields.update(kw)
    return ResultDocument(**fields)


def test_jsonable_nonfinite_to_null_and_containers():
    value = {"a": float("nan"), "b": (1, float("inf"), -float("inf")), 3: [Path("x/y"), 2.5], "c": Decimal("1.25"),
             "d": True, "e": None}
    assert jsonable(value) == {"a": None, "b": [1, None, None], 3: ["x/y", 2.5], "c": 1.25, "d": True, "e": None}
    assert jsonable(object.__new__(type("Thing", (), {"__str__": lambda self: "thing"}))) == "thing"


def test_jsonable_numpy_and_torch_scalars_become_python_numbers():
    torch = pytest.importorskip("torch")
    out = jsonable({"i": torch.tensor(7), "f": torch.tensor(0.5), "nan": torch.tensor(float("nan")),
                     "v": torch.tensor([[1.5, float("inf")]])})
    assert out == {"i": 7, "f": 0.5, "nan": None, "v": [[1.5, None]]}
    assert type(out["i"]) is int and type(out["f"]) is float
    np = pytest.importorskip("numpy")
    out = jsonable([np.int64(3), np.float32(0.25), np.float64("inf"), np.bool_(True)])
    assert out == [3, 0.25, None, True] and type(out[0]) is int and type(out[3]) is bool


def test_write_read_round_trip(tmp_path):
    document = _document(results={"oob": float("nan"), "per_seed": {0: 0.5}}, extra={"cells": [1, 2]})
    path = document.write(tmp_path / "sub" / "demo.json")
    raw = json.loads(path.read_text())
    assert list(raw) == ["benchmark", "schema_version", "env", "params", "results", "tables", "cells"]
    assert raw["schema_version"] == SCHEMA_VERSION == 1
    assert raw["results"] == {"oob": None, "per_seed": {"0": 0.5}}
    assert path.read_text().endswith("}\n") and "NaN" not in path.read_text()
    back = ResultDocument.read(path)
    assert back.benchmark == "demo" and back.extra == {"cells": [1, 2]}
    assert back.tables[0]["rows"] == [["A", Decimal("1.5")], ["B", None]]


def test_write_refuses_an_invalid_document_and_keeps_the_old_file(tmp_path):
    path = _document().write(tmp_path / "demo.json")
    before = path.read_text()
    with pytest.raises(ResultError, match=r"demo\.json: tables\[0\] \(T1\): rows\[0\] has 1 cells for 2 columns"):
        _document(tables=[_table(rows=[["A"]])]).write(path)
    with pytest.raises(ResultError, match=r"'tables' is empty"):
        _document(tables=[]).write(path)
    with pytest.raises(ResultError, match=r"extra repeats the schema key\(s\) \['env'\]"):
        _document(extra={"env": {}}).write(path)
    assert path.read_text() == before


def test_read_refuses_nan_and_unsupported_versions(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"benchmark": "x", "results": {"a": [1, NaN]}}')
    with pytest.raises(ResultError, match=r"bad\.json: results\.a\[1\] is NaN, which JSON does not allow"):
        ResultDocument.read(path)
    path.write_text(json.dumps({**_document().to_dict(), "schema_version": 7}))
    with pytest.raises(ResultError, match=r"schema_version 7 is not supported \(expected 1\)"):
        ResultDocument.read(path)


def test_text_table_pads_columns_and_prints_none_as_dash():
    assert text_table(["arm", "OOB %"], [["A", 1.5], ["long name", None]]) == [
        "arm       | OOB %",
        "A         | 1.5",
        "long name | -",
    ]
    assert text_table(["a", "bb"], [["xyz", 1]], rule=True) == ["a   | bb", "----+---", "xyz | 1"]
    assert format_text_table(_table()) == "T1: t\narm | OOB %\nA   | 1.5\nB   | -"
