"""The ``gap:`` field table of docs/trl.md is what ``GapConfig``'s fields and their help render
(:func:`bloggap_plugin.recipes.gap_field_table`, written by ``bloggap report``): a field added to GapConfig, or a
help text changed, without the doc regenerated fails here."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from _support import ROOT

from bloggap_plugin.recipes import GAP_FIELD_TABLE_MARKERS, GapConfig, gap_field_table
from bloggap_plugin.report_builder import GAP_FIELDS_DOC, ReportError, generated_docs_texts

PAGE = ROOT / "docs" / GAP_FIELDS_DOC


def _block(text: str) -> list[str]:
    start, end = GAP_FIELD_TABLE_MARKERS
    lines = text.split("\n")
    assert lines.count(start) == 1 and lines.count(end) == 1, f"{PAGE.name} needs the lines {start} and {end} once"
    return lines[lines.index(start) + 1: lines.index(end)]


def _cells(line: str) -> list[str]:
    """The cells of one table row (``\\|`` inside a cell is a literal bar)."""
    return [c.strip().replace("\0", "|") for c in line.replace("\\|", "\0").strip()[1:-1].split("|")]


def test_the_docs_gap_field_table_is_what_gapconfig_renders():
    """Edit GapConfig's field help in bloggap_plugin/recipes.py, then run `bloggap report` (it rewrites the table)."""
    block = _block(PAGE.read_text(encoding="utf-8"))
    assert block == gap_field_table(), f"{PAGE.name}'s gap: field table drifted: run `bloggap report`"


def test_every_gapconfig_field_is_a_row_of_the_docs_table_with_its_default_and_help():
    rows = {cells[0]: cells for cells in map(_cells, _block(PAGE.read_text(encoding="utf-8"))[2:])}
    fields = dataclasses.fields(GapConfig)
    assert list(rows) == [f"`{f.name}`" for f in fields]  # score_rows included; one row each, in field order
    defaults = GapConfig()
    for f in fields:
        name, annotation, default, meaning = rows[f"`{f.name}`"]
        assert annotation == f"`{f.type}`"
        assert yaml.safe_load(default.strip("`")) == getattr(defaults, f.name), f.name  # as a recipe would read it
        assert meaning == " ".join(f.metadata["help"].split()), f.name
    assert rows["`score_rows`"][2] == "`0`" and rows["`tf32`"][1] == "`bool | str`"


def test_a_field_added_to_the_config_is_a_row_and_one_without_help_is_refused():
    @dataclasses.dataclass
    class Extended(GapConfig):
        new_knob: int = dataclasses.field(default=3, metadata={"help": "A knob | with a bar."})

    table = gap_field_table(Extended)
    assert table[:-1] == gap_field_table()  # the new field is one more row, after GapConfig's
    assert table[-1] == "| `new_knob` | `int` | `3` | A knob \\| with a bar. |"
    assert table != _block(PAGE.read_text(encoding="utf-8"))  # so the drift test above would fail until regenerated

    @dataclasses.dataclass
    class Undocumented(GapConfig):
        bare: bool = False

    with pytest.raises(ValueError, match=r"Undocumented\.bare has no help text: give it field\(\.\.\., metadata="):
        gap_field_table(Undocumented)


def test_regenerating_writes_the_gap_field_table_between_its_markers_and_nothing_else(tmp_path):
    from bloggap_plugin.core.metric_specs import metric_table_markers

    start, end = GAP_FIELD_TABLE_MARKERS
    metric = "\n".join(metric_table_markers("trl"))
    (tmp_path / "trl.md").write_text(f"# trl\n{metric}\nbetween\n{start}\n| stale |\n{end}\nafter\n")
    (tmp_path / "verl.md").write_text("\n".join(metric_table_markers("verl")) + "\n")
    text = generated_docs_texts(tmp_path)[tmp_path / "trl.md"]
    assert text.endswith("\n".join(["between", start, *gap_field_table(), end, "after", ""]))
    (tmp_path / "trl.md").write_text(f"# trl\n{metric}\nno field table\n")
    with pytest.raises(ReportError, match=r"trl\.md: expected the line <!-- bloggap:gap-fields:start --> once"):
        generated_docs_texts(tmp_path)
