"""bloggap report: BENCHMARKS.md from result JSON alone; every number in it comes from a committed JSON file."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
from decimal import Decimal
from pathlib import Path

import pytest
from _support import ROOT
from _support.events import HANG_S
from _support.json_values import load_number_texts, numbers_and_strings

from bloggap_plugin.report_builder import REFERENCE_PATH, ReportError, build_report, load_reference

# The reference study's text, where the workplace keeps it beside the repository (../shared); not part of the repo.
REFERENCE_MD = Path(os.environ.get("BLOGGAP_REFERENCE_MD", ROOT.parent / "shared" / "reference" / "reference_study.md"))
# A number as a reader sees it: not part of a word or path component (T1, h200, sm_89 are names, not numbers).
_NUMBER = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w])")


def _numbers_in_text(text: str) -> set[Decimal]:
    return {Decimal(m.replace(",", "")) for m in _NUMBER.findall(text)}


def _numbers_in_json(value) -> set[Decimal]:
    numbers, texts = numbers_and_strings(value)  # each distinct string (keys repeat in every row) is searched once
    return {Decimal(str(n)) for n in numbers}.union(*map(_numbers_in_text, texts))


@functools.cache
def _document_numbers(text: str) -> frozenset[Decimal]:
    """Magnitudes of the numbers of a JSON document's text; once per distinct text in the session (the committed
    results are read by several tests)."""
    document = load_number_texts(text)
    return frozenset(abs(n).normalize() for n in _numbers_in_json(document))


def _json_numbers(paths) -> set[Decimal]:
    # the Markdown's numbers are read without their sign ("-0.0147" is found as 0.0147): compare magnitudes
    numbers: set[Decimal] = set()
    for path in paths:
        numbers |= _document_numbers(Path(path).read_text())
        numbers |= {abs(n).normalize() for n in _numbers_in_text(Path(path).as_posix())}
    return numbers


def _assert_numbers_sourced(markdown: str, json_paths) -> None:
    sources = _json_numbers(json_paths)
    missing = sorted({str(n) for n in _numbers_in_text(markdown) if n.normalize() not in sources})
    assert not missing, f"numbers in the Markdown that no JSON source holds: {missing[:20]}"


def _table(**kw):
    table = {"id": "T1", "title": "dtype x batch OOB%", "columns": ["model", "bf16 b1v8", "fp16 b1v8", "tokens"],
             "rows": [["SmolLM2-135M", 4.07, 0.01, 3512], ["tiny", 17.25, None, 96]], "notes": "n = 3512 tokens, band 0.1",
             "reference": "T1", "random_init": False}
    table.update(kw)
    return table


def _result(**kw):
    document = {
        "benchmark": "tables",
        "schema_version": 1,
        "env": {"gpu": "NVIDIA H200", "sm_count": 132, "compute_capability": "9.0", "torch": "2.11.0+cu130",
                "transformers": "5.17.0", "trl": None},
        "params": {"model": "smollm2", "seed": 1234},
        "results": {"oob": {"bf16": 143}},
        "tables": [
            _table(),
            {"id": "ladder", "title": "OOB vs fp32 share", "columns": ["fp32 share %", "OOB %", "arm"],
             "rows": [[0, 8.5, "bf16"], [22.5, 2.72, "head"], [100, 0.0, "all"]], "notes": "", "reference": "T7",
             "random_init": True, "plot": {"kind": "line", "x": "fp32 share %", "y": ["OOB %"]}},
            {"id": "cost", "title": "cost", "columns": ["plan", "rel. time"], "rows": [["fp16", 1.03]], "notes": "x",
             "reference": None, "random_init": False, "plot": False},
        ],
    }
    document.update(kw)
    return document


def _write(root: Path, device: str, name: str, document) -> Path:
    path = root / device / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(document if isinstance(document, str) else json.dumps(document, indent=1))
    return path


def test_report_from_constructed_results(tmp_path):
    pytest.importorskip("matplotlib")
    results = tmp_path / "results"
    source = _write(results, "h200", "tables", _result())
    other = _write(results, "cpu", "tables", _result(env={"cpu": "x86_64", "torch": "2.13.0+cpu", "transformers": "5.10.4"}))
    output = tmp_path / "BENCHMARKS.md"
    written = build_report(results, output, tmp_path / "plots")
    md = output.read_text()
    assert written["devices"] == ["cpu", "h200"]
    assert "## h200" in md and "GPU: NVIDIA H200; SMs: 132; compute capability: 9.0" in md
    assert "torch: 2.11.0+cu130; transformers: 5.17.0" in md
    assert "| SmolLM2-135M | 4.07 | 0.01 | 3512 |" in md and "| tiny | 17.25 | – | 96 |" in md
    assert "random-init weights" in md
    # The reference study's table beside ours, exactly as transcribed (trailing zeros kept).
    assert "Reference study, T1 (RTX 4090)" in md
    assert "| pythia-160m (3,883) | 60.03 | 22.02 | 0.00 | 0.00 | 59.70 |" in md
    assert "Reference study, T7 (RTX 4090)" in md
    # Plots: bar for T1 (automatic), line for the ladder (hint), none for cost (plot: false); per device.
    pngs = sorted(Path(p).name for p in written["plots"])
    assert pngs == ["tables_T1.png", "tables_T1.png", "tables_ladder.png", "tables_ladder.png"]
    for p in written["plots"]:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "](plots/h200/tables_T1.png)" in md
    _assert_numbers_sourced(md, [source, other, REFERENCE_PATH])


def test_number_check_catches_an_unsourced_number(tmp_path):
    results = tmp_path / "results"
    source = _write(results, "h200", "tables", _result())
    output = tmp_path / "B.md"
    build_report(results, output, None)
    doctored = output.read_text().replace("| 4.07 |", "| 4.08 |")
    with pytest.raises(AssertionError, match=r"4\.08"):
        _assert_numbers_sourced(doctored, [source, REFERENCE_PATH])


@pytest.mark.parametrize(
    "content, problem",
    [
        ("{not json", r"bad\.json: not valid JSON \(line 1"),
        ([1, 2], r"bad\.json: expected a JSON object"),
        (_result(tables=[]), r"bad\.json: 'tables' is empty"),
        ({k: v for k, v in _result().items() if k != "env"}, r"bad\.json: missing key 'env'"),
        (_result(schema_version=2), r"bad\.json: schema_version 2 is not supported"),
        (_result(tables=[_table(rows=[["a", 1.0]])]), r"bad\.json: tables\[0\] \(T1\): rows\[0\] has 2 cells for 4 columns"),
        (_result(tables=[_table(reference="T99")]), r"bad\.json: tables\[0\] \(T1\): reference 'T99' is not a table"),
        (_result(tables=[{k: v for k, v in _table().items() if k != "notes"}]), r"tables\[0\]: table lacks the key 'notes'"),
        (_result(tables=[_table(random_init="no")]), r"table key 'random_init' must be bool"),
        (_result(tables=[_table(plot={"kind": "pie", "x": "model", "y": ["tokens"]})]), r"plot kind must be 'bar' or 'line'"),
        (_result(tables=[_table(plot={"kind": "bar", "x": "model", "y": ["nope"]})]), r"plot y must be a non-empty list"),
        (_result(tables=[_table(plot={"kind": "line", "x": "model", "y": ["tokens"]})]), r"line plot needs numbers in its x"),
        (_result(tables=[_table(rows=[["a", {"x": 1}, 1, 2]])]), r"rows\[0\] holds a dict"),
        (_result(tables=[_table(), _table()]), r"table ids must be unique"),
    ],
)
def test_malformed_results_fail_naming_file_and_problem(tmp_path, content, problem):
    results = tmp_path / "results"
    _write(results, "h200", "good", _result())
    _write(results, "h200", "bad", content)
    with pytest.raises(ReportError, match=problem):
        build_report(results, tmp_path / "B.md", None)
    assert not (tmp_path / "B.md").exists()


def test_missing_results_fail(tmp_path):
    with pytest.raises(ReportError, match="results folder does not exist"):
        build_report(tmp_path / "nowhere", tmp_path / "B.md", None)
    (tmp_path / "empty" / "h200").mkdir(parents=True)
    with pytest.raises(ReportError, match="no result JSON files"):
        build_report(tmp_path / "empty", tmp_path / "B.md", None)
    _write(tmp_path / "r", "h200", "tables", _result())
    with pytest.raises(ReportError, match=r"h200: missing result file\(s\) for ladder"):
        build_report(tmp_path / "r", tmp_path / "B.md", None, require=["tables", "ladder"])


def test_cli_reports_errors_without_a_traceback(tmp_path, spawns):
    import sys

    _write(tmp_path / "r", "h200", "x", "{")
    done = subprocess.run([sys.executable, "-m", "bloggap_plugin.cli", "report", "--results", str(tmp_path / "r"),
                           "--output", str(tmp_path / "B.md"), "--no-plots"], capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 2 and "x.json: not valid JSON" in done.stderr and "Traceback" not in done.stderr


def test_reference_data_has_every_table():
    reference = load_reference()
    assert list(reference) == ["T1", "T1b", "T2", "T3", "T4", "T5", "T6", "T7", "T7b", "T8", "T9", "T10", "T11"]
    assert all(t["source"] for t in reference.values())
    assert reference["T10"]["rows"][0][2] == Decimal("0.657")
    assert str(reference["T1"]["rows"][0][3]) == "0.00"  # literal text kept


@pytest.mark.skipif(not REFERENCE_MD.is_file(), reason="the reference study's text is not on this machine")
def test_reference_data_matches_the_study_cell_by_cell():
    from bloggap_plugin.report_builder import format_cell

    text = REFERENCE_MD.read_text()
    section = text[text.index("## 3. Tables"):text.index("## 4. ")]
    parts = re.split(r"^### (T\d+b?) ", section, flags=re.M)
    reference = load_reference()
    seen = []
    for tid, body in zip(parts[1::2], parts[2::2]):
        lines = body.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("|"))
        block = []
        for line in lines[start:]:
            if not line.startswith("|"):
                break
            block.append(line)
        rows = [[c.strip().replace("**", "") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]] for line in block]
        table = reference[tid]
        if tid == "T9":  # the study's own header has an unescaped '|' in "max |hidden|"
            assert rows[0][:4] == table["columns"][:4] and table["columns"][4] == "max |hidden|"
        else:
            assert rows[0] == table["columns"], tid
        assert rows[2:] == [[format_cell(c).replace("\\|", "|") for c in row] for row in table["rows"]], tid
        seen.append(tid)
    assert seen == list(reference)


def _committed(paths) -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "--", *map(str, paths)], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return []
    return [ROOT / p for p in listed]


def test_repository_benchmarks_numbers_come_from_committed_json(tmp_path):
    results_dir = ROOT / "benchmarks" / "results"
    committed = [p for p in _committed([results_dir]) if p.suffix == ".json"]
    if not committed:
        pytest.skip("no committed benchmark results yet")
    sources = committed + [REFERENCE_PATH]
    output = tmp_path / "BENCHMARKS.md"
    build_report(results_dir, output, None)
    _assert_numbers_sourced(output.read_text(), sources)
    shipped = ROOT / "BENCHMARKS.md"
    if shipped.is_file():
        _assert_numbers_sourced(shipped.read_text(), sources)


def test_committed_benchmarks_md_is_what_report_generates(tmp_path, monkeypatch):
    """BENCHMARKS.md is generated (its sections, anchors and archive are what README and docs link to): edit a result
    file, then run `bloggap report`. The plots are not drawn here; their links are compared."""
    import bloggap_plugin.report_builder as report_builder

    monkeypatch.setattr(report_builder, "_plot_table", lambda table, spec, path: None)
    output = tmp_path / "BENCHMARKS.md"
    build_report(ROOT / "benchmarks" / "results", output, tmp_path / "benchmarks" / "plots")
    expected = output.read_text().replace(str(ROOT / "benchmarks" / "results"), "benchmarks/results")
    assert (ROOT / "BENCHMARKS.md").read_text() == expected, "BENCHMARKS.md drifted from the results: run `bloggap report`"


def test_automatic_plot_picks_one_scale():
    from bloggap_plugin.report_builder import table_plot_spec

    ladder = {"id": "T7", "title": "t", "columns": ["plan", "fp32 params %", "OOB %", "CI low %", "tokens"],
              "rows": [["bf16", 0.0, 4.5, 3.9, 3512], ["fp16", "-", "-", "-", 0], ["fp32", 100.0, 0.0, 0.0, 3512]],
              "notes": "", "reference": None, "random_init": False}
    assert table_plot_spec(ladder) == {"kind": "bar", "x": ["plan"], "y": ["OOB %"]}
    mixed = dict(ladder, columns=["plan", "a", "b", "c", "d"])
    assert table_plot_spec(mixed)["y"] == ["a"]  # 0-100 next to 3512: one column only
    assert table_plot_spec(dict(ladder, plot=False)) is None
    assert table_plot_spec(dict(ladder, rows=[[1, 2, 3, 4, 5]])) is None  # no text label column


# --------------------------------------------------------------------------------------------- bad input, atomic writes


def test_a_binary_result_file_fails_naming_it(tmp_path):
    results = tmp_path / "results"
    _write(results, "h200", "good", _result())
    (results / "h200" / "blob.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe binary")
    with pytest.raises(ReportError, match=r"blob\.json: not a text file \(not UTF-8 at byte 0\)"):
        build_report(results, tmp_path / "B.md", None)
    assert not (tmp_path / "B.md").exists()


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_or_inf_in_a_result_is_refused_naming_where(tmp_path, constant):
    # NaN/Infinity are not JSON (RFC 8259); a table cell without a value is null (rendered "–").
    results = tmp_path / "results"
    text = json.dumps(_result(), indent=1).replace("17.25", constant)
    _write(results, "h200", "bad", text)
    with pytest.raises(ReportError, match=rf"bad\.json: tables\[0\]\.rows\[1\]\[1\] is {constant}, .*null"):
        build_report(results, tmp_path / "B.md", None)
    params = json.dumps(_result(), indent=1).replace('"seed": 1234', f'"seed": {constant}')
    _write(results, "h200", "bad", params)
    with pytest.raises(ReportError, match=rf"bad\.json: params\.seed is {constant}"):
        build_report(results, tmp_path / "B.md", None)


def test_an_output_that_is_a_directory_or_in_no_folder_fails_before_reading_results(tmp_path):
    (tmp_path / "out.md").mkdir()
    with pytest.raises(ReportError, match=r"--output .*out\.md is a directory; give a file path"):
        build_report(tmp_path / "nowhere", tmp_path / "out.md", None)  # results are not even looked at
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ReportError, match=r"--output .*afile/B\.md: .*afile"):
        build_report(tmp_path / "nowhere", tmp_path / "afile" / "B.md", None)
    with pytest.raises(ReportError, match=r"--plots .*afile is not a folder"):
        build_report(tmp_path / "nowhere", tmp_path / "B.md", tmp_path / "afile")


def test_a_failed_write_keeps_the_previous_report(tmp_path, monkeypatch):
    import errno
    import os

    results = tmp_path / "results"
    _write(results, "h200", "tables", _result())
    output = tmp_path / "B.md"
    previous = "# Benchmarks\n\nGenerated by `bloggap report` (the previous good report)\n"
    output.write_text(previous)

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(ReportError, match=r"B\.md: cannot write \(No space left on device\)"):
        build_report(results, output, None)
    assert output.read_text() == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["B.md", "results"]  # no temporary file left


def test_cli_bad_output_and_binary_input_fail_in_one_line(tmp_path, spawns):
    import sys

    _write(tmp_path / "r", "h200", "tables", _result())
    (tmp_path / "dir.md").mkdir()
    done = subprocess.run([sys.executable, "-m", "bloggap_plugin.cli", "report", "--results", str(tmp_path / "r"),
                           "--output", str(tmp_path / "dir.md"), "--no-plots"], capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().count("\n") == 0 and "is a directory" in done.stderr
    (tmp_path / "r" / "h200" / "b.json").write_bytes(b"\xff\xfe\x00")
    done = subprocess.run([sys.executable, "-m", "bloggap_plugin.cli", "report", "--results", str(tmp_path / "r"),
                           "--output", str(tmp_path / "B.md"), "--no-plots"], capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "b.json: not a text file (not UTF-8" in done.stderr


def test_cli_config_file_sets_report_fields_and_the_command_line_wins(tmp_path, capsys):
    from bloggap_plugin.cli import main

    _write(tmp_path / "r", "h200", "tables", _result())
    config = tmp_path / "report.yaml"
    config.write_text(f"results: {tmp_path / 'r'}\noutput: {tmp_path / 'from_file.md'}\nno_plots: true\n"
                      "require: [tables, ladder]\n")
    assert main(["report", "--config", str(config)]) == 2
    assert "h200: missing result file(s) for ladder" in capsys.readouterr().err
    assert main(["report", "--config", str(config), "--require", "tables", "--output", str(tmp_path / "cli.md")]) == 0
    assert (tmp_path / "cli.md").is_file() and not (tmp_path / "from_file.md").exists()
    assert "; 0 plot(s)" in capsys.readouterr().out  # no_plots from the file
    assert main(["report", "--config", str(config), "--require"]) == 0 and (tmp_path / "from_file.md").is_file()


def test_cli_report_help_lists_every_field(capsys):
    import dataclasses

    from bloggap_plugin.cli import build_parser
    from bloggap_plugin.commands.report import ReportConfig

    with pytest.raises(SystemExit):
        build_parser().parse_args(["report", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for item in dataclasses.fields(ReportConfig):
        assert f"--{item.name}" in text and " ".join(item.metadata["help"].split()) in text


def test_two_files_of_one_benchmark_get_a_plot_each(tmp_path, monkeypatch):
    """Two result files of the same benchmark and table ids (a re-run under another setting, e.g. arm_i.json and
    arm_i_triton_ieee.json) must not write one plot over the other: each is named after its file, whatever the
    order the files are read in. The drawing is recorded, not done (test_report_from_constructed_results draws these
    tables): what matters here is the path each plot goes to."""
    import bloggap_plugin.report_builder as report_builder

    drawn: list[str] = []
    monkeypatch.setattr(report_builder, "_plot_table", lambda table, spec, path: drawn.append(str(path)))
    results = tmp_path / "results"
    _write(results, "h200", "a_first", _result())  # read before tables.json, whose stem is the benchmark's name
    _write(results, "h200", "tables", _result())
    _write(results, "h200", "tables_rerun", _result())
    output = tmp_path / "BENCHMARKS.md"
    written = build_report(results, output, tmp_path / "plots")
    assert sorted(Path(p).name for p in written["plots"]) == [
        "a_first_T1.png", "a_first_ladder.png", "tables_T1.png", "tables_ladder.png", "tables_rerun_T1.png",
        "tables_rerun_ladder.png"]
    assert sorted(drawn) == sorted(written["plots"]) and len(set(drawn)) == 6  # each drawn once, none over another
    md = output.read_text()
    assert "](plots/h200/tables_T1.png)" in md and "](plots/h200/tables_rerun_T1.png)" in md


# --------------------------------------------------------------------------------------------- README headline block

README = ROOT / "README.md"
HEADLINE_SPEC = ROOT / "docs" / "headline.yaml"
_SPEC_ROW = {"situation": "fp16 is safe", "arm": "H", "says": "out of band:", "result": "h200/tables.json",
             "table": "T1", "row": "SmolLM2-135M", "column": "bf16 b1v8", "unit": "%"}


def _readme_block(text: str) -> list[str]:
    from bloggap_plugin.report_builder import HEADLINE_MARKERS

    lines = text.split("\n")
    return lines[lines.index(HEADLINE_MARKERS[0]) + 1:lines.index(HEADLINE_MARKERS[1])]


def _write_spec(path: Path, rows) -> Path:
    import yaml

    path.write_text(yaml.safe_dump({"rows": rows}))
    return path


def test_readme_headline_block_is_what_report_generates():
    """README's decision table is generated: edit docs/headline.yaml or a result file, then run `bloggap report`."""
    from bloggap_plugin.report_builder import load_headline_spec, load_results, render_headline

    results = load_results(ROOT / "benchmarks" / "results", set(load_reference()))
    expected = render_headline(load_headline_spec(HEADLINE_SPEC), results, "BENCHMARKS.md")
    assert _readme_block(README.read_text()) == expected, "README's headline block drifted: run `bloggap report`"
    committed = [p for p in _committed([ROOT / "benchmarks" / "results"]) if p.suffix == ".json"]
    if committed:  # every number in the block, the settings named in the spec included, is in a committed result
        _assert_numbers_sourced("\n".join(expected), committed)


def test_headline_block_is_replaced_from_the_json_and_the_rest_kept(tmp_path):
    results = tmp_path / "results"
    _write(results, "h200", "tables", _result())
    spec = _write_spec(tmp_path / "headline.yaml", [_SPEC_ROW])
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\nbefore\n<!-- bloggap:headline:start -->\nstale | 9.99 |\n<!-- bloggap:headline:end -->\nafter\n")
    written = build_report(results, tmp_path / "B.md", None, readme=readme, headline=spec)
    text = readme.read_text()
    assert written["readme"] == str(readme) and "9.99" not in text
    assert text.startswith("# x\n\nbefore\n<!-- bloggap:headline:start -->\n| situation | arm | headline number | table |")
    assert "| fp16 is safe | H | out of band: **4.07%** | [T1](B.md#h200/tables.json) |" in text
    assert text.endswith("<!-- bloggap:headline:end -->\nafter\n")
    build_report(results, tmp_path / "B.md", None, readme=readme, headline=spec)
    assert readme.read_text() == text  # regenerating changes nothing
    # a re-measured number changes the JSON alone; the README follows on the next report
    _write(results, "h200", "tables", _result(tables=[_table(rows=[["SmolLM2-135M", 3.5, 0.01, 3512]])]))
    build_report(results, tmp_path / "B.md", None, readme=readme, headline=spec)
    assert "out of band: **3.5%**" in readme.read_text()


def test_report_rewrites_the_metric_tables_of_the_docs_beside_the_readme(tmp_path):
    """With docs/trl.md beside the README, `bloggap report` regenerates the gap/* metric tables of docs/trl.md and
    docs/verl.md from the metric registry, and docs/trl.md's gap: field table from GapConfig's field help, between
    their markers, and leaves the rest of each page."""
    from bloggap_plugin.core.metric_specs import metric_table, metric_table_markers
    from bloggap_plugin.recipes import GAP_FIELD_TABLE_MARKERS, gap_field_table

    results = tmp_path / "results"
    _write(results, "h200", "tables", _result())
    spec = _write_spec(tmp_path / "headline.yaml", [_SPEC_ROW])
    readme = tmp_path / "README.md"
    readme.write_text("<!-- bloggap:headline:start -->\n<!-- bloggap:headline:end -->\n")
    (tmp_path / "docs").mkdir()
    fields_start, fields_end = GAP_FIELD_TABLE_MARKERS
    pages = {}
    for framework in ("trl", "verl"):
        start, end = metric_table_markers(framework)
        pages[framework] = tmp_path / "docs" / f"{framework}.md"
        fields = f"{fields_start}\n| stale |\n{fields_end}\n" if framework == "trl" else ""
        pages[framework].write_text(f"# {framework}\n{start}\n| stale |\n{end}\nafter\n{fields}")
    written = build_report(results, tmp_path / "B.md", None, readme=readme, headline=spec)
    assert sorted(written["docs"]) == sorted(str(p) for p in pages.values())
    for framework, page in pages.items():
        start, end = metric_table_markers(framework)
        fields = [fields_start, *gap_field_table(), fields_end] if framework == "trl" else []
        assert page.read_text() == "\n".join([f"# {framework}", start, *metric_table(framework), end, "after",
                                              *fields, ""])


def test_each_result_file_has_its_own_section_anchored_by_its_file_name(tmp_path):
    """Two files of one benchmark get a section each, headed by the file name and anchored by device and file name;
    the README links there, and a file added before them moves neither anchor."""
    results = tmp_path / "results"
    _write(results, "h200", "tables", _result())
    _write(results, "h200", "tables_rerun", _result())
    spec = _write_spec(tmp_path / "h.yaml", [_SPEC_ROW, dict(_SPEC_ROW, result="h200/tables_rerun.json")])
    readme = tmp_path / "README.md"
    readme.write_text("<!-- bloggap:headline:start -->\n<!-- bloggap:headline:end -->\n")
    build_report(results, tmp_path / "docs" / "B.md", None, readme=readme, headline=spec)
    links = re.findall(r"\]\((docs/B\.md#[^)]+)\)", readme.read_text())
    assert links == ["docs/B.md#h200/tables.json", "docs/B.md#h200/tables_rerun.json"]
    text = (tmp_path / "docs" / "B.md").read_text()
    headings = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    assert headings == ["Benchmarks", "h200", "tables.json", "tables_rerun.json"]
    anchors = re.findall(r'<a id="([^"]+)"></a>', text)
    assert anchors[:2] == ["h200/tables.json", "reference-T1"] and "h200/tables_rerun.json" in anchors
    _write(results, "cpu", "aaa", _result())
    _write(results, "h200", "a_first", _result())
    build_report(results, tmp_path / "docs" / "B.md", None, readme=readme, headline=spec)
    assert re.findall(r"\]\((docs/B\.md#[^)]+)\)", readme.read_text()) == links


def test_superseded_files_fold_into_the_archive_and_each_reference_table_is_rendered_once(tmp_path):
    """A file whose document names ``superseded_by`` goes after every current file, under the archive heading,
    linked both ways; the reference study's T1, reproduced by all three files, is rendered once and linked after."""
    results = tmp_path / "results"
    _write(results, "h200", "a_old", _result(superseded_by="tables.json"))
    _write(results, "h200", "tables", _result())
    _write(results, "h200", "z_other", _result())
    output = tmp_path / "B.md"
    build_report(results, output, None)
    text = output.read_text()
    headings = [line for line in text.splitlines() if line.startswith("#")]
    assert headings == ["# Benchmarks", "## h200", "### tables.json", "### z_other.json",
                        "## Archive: superseded result files", "### h200", "#### a_old.json"]
    assert "Superseded by [h200/tables.json](#h200/tables.json)." in text
    assert "Earlier files it replaces, in the archive: [h200/a_old.json](#h200/a_old.json)." in text
    assert text.count("Reference study, T1 (RTX 4090)") == 1 and text.count("Reference study, T7 (RTX 4090)") == 1
    assert text.index("Reference study, T1 (RTX 4090)") < text.index("### z_other.json")
    assert text.count("Reference study, T1: [shown above](#reference-T1).") == 2
    assert "- [Archive: superseded result files](#archive-superseded-result-files): 1 file(s)" in text


@pytest.mark.parametrize("value", ["missing.json", "tables.json"])
def test_superseded_by_must_name_another_file_beside_it(tmp_path, value):
    results = tmp_path / "results"
    _write(results, "h200", "tables", _result(superseded_by=value))
    with pytest.raises(ReportError, match=r"tables\.json.*superseded_by"):
        build_report(results, tmp_path / "B.md", None)


@pytest.mark.parametrize("value", [3, "h200/tables.json", "tables"])
def test_superseded_by_that_is_not_a_file_name_is_refused_naming_the_fix(tmp_path, value):
    results = tmp_path / "results"
    _write(results, "h200", "old", _result(superseded_by=value))
    _write(results, "h200", "tables", _result())
    with pytest.raises(ReportError, match=r"old\.json: 'superseded_by' must be the name of the result file beside"):
        build_report(results, tmp_path / "B.md", None)


def test_headline_cost_cells_make_a_column_of_cited_multiples(tmp_path):
    """A row's ``cost`` cells (e.g. a step multiple at each model size) render as one more column, read from the
    JSON like the headline number; a row without cost cells shows a dash."""
    results = tmp_path / "results"
    _write(results, "h200", "tables", _result())
    cost = [dict(label="135M", result="h200/tables.json", table="T1", row="SmolLM2-135M", column="fp16 b1v8"),
            dict(label="1.5B", result="h200/tables.json", table="T1", row="SmolLM2-135M", column="bf16 b1v8")]
    spec = _write_spec(tmp_path / "h.yaml", [dict(_SPEC_ROW, cost=cost), _SPEC_ROW])
    readme = tmp_path / "README.md"
    readme.write_text("<!-- bloggap:headline:start -->\n<!-- bloggap:headline:end -->\n")
    build_report(results, tmp_path / "B.md", None, readme=readme, headline=spec)
    lines = readme.read_text().splitlines()
    assert lines[1] == "| situation | arm | headline number | table | step x arm A |"
    assert lines[3] == "| fp16 is safe | H | out of band: **4.07%** | [T1](B.md#h200/tables.json) | 135M 0.01x, 1.5B 4.07x ([T1](B.md#h200/tables.json)) |"
    assert lines[4].endswith("| [T1](B.md#h200/tables.json) | – |")


def _headline_with_step_multiples(tmp_path, runs_of_j: int) -> tuple[Path, Path, Path]:
    """A results folder whose T19 quotes arm J's step multiple from ``runs_of_j`` runs, a headline spec citing it with
    its spread and runs columns, and an empty README block: (results, spec, readme)."""
    table = {"id": "T19", "title": "steps", "columns": ["arm @ model", "runs", "mean step x arm A",
                                                       "mean x A, runs (min-max)"],
             "rows": [["A @ m", 3, 1.0, "0.90-1.10"], ["J @ m", runs_of_j, 1.85, "1.75-2.02"]], "notes": "x",
             "reference": None, "random_init": True, "plot": False}
    results = tmp_path / "results"
    _write(results, "h200", "tables", _result(tables=[_table(), table]))
    cell = dict(label="1.56B", result="h200/tables.json", table="T19", row="J @ m", column="mean step x arm A",
                spread="mean x A, runs (min-max)", runs="runs")
    spec = _write_spec(tmp_path / "headline.yaml", [dict(_SPEC_ROW, cost=[cell])])
    readme = tmp_path / "README.md"
    readme.write_text("<!-- bloggap:headline:start -->\n<!-- bloggap:headline:end -->\n")
    return results, spec, readme


def test_a_cost_cell_with_its_spread_and_runs_says_both(tmp_path):
    """A step multiple is quoted with its spread over runs and how many runs (issue 46 item 3)."""
    results, spec, readme = _headline_with_step_multiples(tmp_path, 3)
    build_report(results, tmp_path / "B.md", None, readme=readme, headline=spec)
    assert readme.read_text().splitlines()[3].endswith(
        "| 1.56B 1.85x (runs 1.75-2.02, 3 runs) ([T19](B.md#h200/tables.json)) |")


def test_a_cost_cell_from_fewer_than_three_runs_is_refused(tmp_path):
    results, spec, readme = _headline_with_step_multiples(tmp_path, 2)
    with pytest.raises(ReportError, match=r"rows\[0\]: cost\[0\]: table T19, row 'J @ m': 2 runs; a step multiple is "
                                          r"quoted from at least 3 interleaved runs"):
        build_report(results, tmp_path / "B.md", None, readme=readme, headline=spec)


@pytest.mark.parametrize("cost", [[], "T19", [{"label": "x"}], [dict(label="x", result="h200/tables.json", table="T1",
                                                                    row="SmolLM2-135M", column="bf16 b1v8", unit="x")]])
def test_a_bad_cost_cell_is_refused_naming_the_row(tmp_path, cost):
    results = tmp_path / "results"
    _write(results, "h200", "tables", _result())
    spec = _write_spec(tmp_path / "headline.yaml", [dict(_SPEC_ROW, cost=cost)])
    readme = tmp_path / "README.md"
    readme.write_text("<!-- bloggap:headline:start -->\n<!-- bloggap:headline:end -->\n")
    with pytest.raises(ReportError, match=r"headline.yaml: rows\[0\]: cost"):
        build_report(results, tmp_path / "B.md", None, readme=readme, headline=spec)


@pytest.mark.parametrize(
    "change, problem",
    [
        (dict(result="h200/nope.json"), r"rows\[0\]: result h200/nope.json is not among the results"),
        (dict(table="T99"), r"rows\[0\]: h200/tables.json has no table T99"),
        (dict(row="nobody"), r"rows\[0\]: table T1 has 0 rows whose first cell is 'nobody'"),
        (dict(column="fp8 b1v8"), r"rows\[0\]: table T1 has no column 'fp8 b1v8'"),
        (dict(row="tiny", column="fp16 b1v8"), r"row 'tiny', column 'fp16 b1v8' holds '–', not a number"),
        (dict(says=""), r"headline.yaml: rows\[0\]: missing or empty text key\(s\) says"),
        (dict(value=4.07), r"headline.yaml: rows\[0\]: unknown key\(s\) value"),
    ],
)
def test_a_bad_headline_spec_fails_naming_the_row_and_writes_nothing(tmp_path, change, problem):
    results = tmp_path / "results"
    _write(results, "h200", "tables", _result())
    spec = _write_spec(tmp_path / "headline.yaml", [dict(_SPEC_ROW, **change)])
    readme = tmp_path / "README.md"
    readme.write_text("<!-- bloggap:headline:start -->\n<!-- bloggap:headline:end -->\n")
    with pytest.raises(ReportError, match=problem):
        build_report(results, tmp_path / "B.md", None, readme=readme, headline=spec)
    assert not (tmp_path / "B.md").exists()
    assert readme.read_text() == "<!-- bloggap:headline:start -->\n<!-- bloggap:headline:end -->\n"


@pytest.mark.parametrize("text", ["no markers\n", "<!-- bloggap:headline:end -->\n<!-- bloggap:headline:start -->\n",
                                  "<!-- bloggap:headline:start -->\n" * 2 + "<!-- bloggap:headline:end -->\n"])
def test_readme_markers_must_be_there_once_and_in_order(tmp_path, text):
    from bloggap_plugin.report_builder import replace_headline_block

    with pytest.raises(ReportError, match=r"README.md: expected the line <!-- bloggap:headline:start --> once"):
        replace_headline_block(text, ["| x |"], "README.md")


def test_cli_report_updates_the_readme_beside_the_output_only(tmp_path, capsys):
    from bloggap_plugin.cli import main

    _write(tmp_path / "r", "h200", "tables", _result())
    (tmp_path / "site").mkdir()
    assert main(["report", "--results", str(tmp_path / "r"), "--output", str(tmp_path / "site" / "B.md"),
                 "--no-plots"]) == 0  # no README.md beside the output: none is touched
    assert "headline" not in capsys.readouterr().out
    (tmp_path / "site" / "docs").mkdir()
    _write_spec(tmp_path / "site" / "docs" / "headline.yaml", [_SPEC_ROW])
    (tmp_path / "site" / "README.md").write_text("<!-- bloggap:headline:start -->\n<!-- bloggap:headline:end -->\n")
    assert main(["report", "--results", str(tmp_path / "r"), "--output", str(tmp_path / "site" / "B.md"),
                 "--no-plots"]) == 0
    assert "the headline table in" in capsys.readouterr().out
    assert "**4.07%**" in (tmp_path / "site" / "README.md").read_text()
    (tmp_path / "site" / "README.md").write_text("<!-- bloggap:headline:start -->\n<!-- bloggap:headline:end -->\n")
    assert main(["report", "--results", str(tmp_path / "r"), "--output", str(tmp_path / "site" / "B.md"),
                 "--no-plots", "--readme", "none"]) == 0
    assert "4.07" not in (tmp_path / "site" / "README.md").read_text()
