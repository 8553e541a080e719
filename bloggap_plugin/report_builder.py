"""``bloggap report``: BENCHMARKS.md and PNG plots from the result JSON files alone.

Input: ``<results>/<device>/*.json`` (default ``benchmarks/results``), each a result document
(:class:`bloggap_plugin.results.ResultDocument`: benchmark, schema_version, env, params, results, tables; read and
validated by :meth:`ResultDocument.read`).

Every table is rendered as Markdown; a table whose ``reference`` names a table of the reference study
(``bloggap_plugin/data/reference_study.json``) is followed by that table. Numbers are printed exactly as they
are written in the JSON (floats are parsed as ``Decimal``), so every number in BENCHMARKS.md is in a JSON file. ``NaN`` and
``Infinity`` are not JSON (RFC 8259): a file holding one is refused, naming where it is; a value that does not
exist is written ``null`` (rendered ``–``). The Markdown and every PNG are written atomically (a failed write
leaves the previous file as it was).

Plot hint (optional, per table)::

    "plot": {"kind": "bar" | "line", "x": "<column>", "y": ["<column>", ...], "title": "...", "ylabel": "..."}

``bar``: one group of bars per row (labelled by column ``x``), one bar per ``y`` column. ``line``: ``x`` must be
numeric; one line per ``y`` column, or, with ``"series": "<column>"``, one line per distinct value of that
column. ``"plot": false`` turns plotting off for the table. Without a hint a table is plotted as bars when it
has a text label column and at least one column that is numeric in every row: the columns whose name contains
"oob", else those with "%" (not CI bounds), else all numeric columns if their scales are within 100x, else the
first; otherwise it is not plotted.

README headline block: with ``readme``, the lines between ``<!-- bloggap:headline:start -->`` and
``<!-- bloggap:headline:end -->`` are replaced by the decision table that ``headline`` (a YAML file, default
``docs/headline.yaml`` beside the README) specifies: per row a situation, an arm and the one result cell it cites
(result file, table id, first-column value, column). The number itself is read from the result JSON, never from the
specification, and the row links to the cited file's section of the Markdown report (:func:`result_anchor`).

Sections: one per result file, in file order per device, headed by the file name and anchored ``<device>/<file>``;
a document whose ``superseded_by`` names the file beside it that replaces it is rendered after every current file,
in the archive section. A reference study table is rendered under the first table that reproduces it, and linked
from the later ones.

Generated doc tables: with a README whose ``docs/trl.md`` exists beside it, the lines between
``<!-- bloggap:metrics:<framework>:start -->`` and ``...:end -->`` of ``docs/trl.md`` and ``docs/verl.md`` are
replaced by the adapter's ``gap/*`` metric table rendered from :mod:`bloggap_plugin.core.metric_specs`, and those
between ``<!-- bloggap:gap-fields:start -->`` and ``...:end -->`` of ``docs/trl.md`` by the ``gap:`` field table
rendered from ``GapConfig``'s field help (:func:`bloggap_plugin.recipes.gap_field_table`).
"""

from __future__ import annotations

import os
import re
from decimal import Decimal
from pathlib import Path

from bloggap_plugin._io import (
    atomic_write_bytes,
    atomic_write_text,
    check_writable_file,
    foreign_file_problem,
    write_output_text,
)
from bloggap_plugin.results import (
    ResultDocument,
    ResultError,
    format_text_table,
    is_number,
    load_json,
    numeric_column,
    validate_result,
    validate_table,
)

__all__ = [
    "ReportError",
    "format_text_table",
    "REFERENCE_PATH",
    "load_reference",
    "load_result",
    "load_results",
    "validate_result",
    "render_table",
    "format_cell",
    "markdown_text",
    "plot_text",
    "build_report",
    "table_plot_spec",
    "save_figure",
    "HEADLINE_MARKERS",
    "METRIC_DOCS",
    "GAP_FIELDS_DOC",
    "generated_docs_texts",
    "load_headline_spec",
    "render_headline",
    "result_anchor",
    "split_superseded",
    "replace_headline_block",
]

_REPORT_HEADING = "# Benchmarks"
REFERENCE_PATH = Path(__file__).resolve().parent / "data" / "reference_study.json"
_ENV_FIELDS = (
    ("gpu", "GPU"),
    ("sm_count", "SMs"),
    ("compute_capability", "compute capability"),
    ("gpu_memory_gib", "memory GiB"),
    ("driver", "driver"),
    ("cuda", "CUDA"),
    ("torch", "torch"),
    ("transformers", "transformers"),
    ("trl", "TRL"),
    ("cpu", "CPU"),
)

ReportError = ResultError
"""A result file is missing or malformed, or an output cannot be written (the message names the file and the
problem); the same class as :class:`bloggap_plugin.results.ResultError`."""


# --------------------------------------------------------------------------------------------- reference


def load_reference(path: str | os.PathLike | None = None) -> dict[str, dict]:
    """The reference study's tables by id (``T1``, ``T1b``, ..., ``T11``)."""
    path = Path(path) if path is not None else REFERENCE_PATH
    if not path.is_file():
        raise ReportError(f"{path}: reference data is missing (it ships with the package as data/reference_study.json)")
    document = load_json(path)
    tables = document.get("tables") if isinstance(document, dict) else None
    if not isinstance(tables, list):
        raise ReportError(f"{path}: expected an object with a 'tables' list")
    out = {}
    for index, table in enumerate(tables):
        validate_table(table, f"{path}: tables[{index}]", reference_ids=None, reference=True)
        out[table["id"]] = table
    return out


# --------------------------------------------------------------------------------------------- loading


def load_result(path: str | os.PathLike, reference_ids=None) -> dict:
    """Load and validate one result file."""
    return ResultDocument.read(path, reference_ids).to_dict()


def load_results(results_dir: str | os.PathLike, reference_ids=None, require: list[str] | None = None) -> dict:
    """``{device: [(path, document), ...]}`` for ``<results_dir>/<device>/*.json``, validated; a ``bloggap compare``
    output folder (``compare.json`` beside ``runs/``) is read as one result under the folder's name.

    ``require``: benchmark names that must be present for every device (a missing one is an error).
    """
    root = Path(results_dir)
    if not root.is_dir():
        raise ReportError(f"{root}: results folder does not exist (benchmark scripts write <results>/<device>/<name>.json)")
    out: dict[str, list] = {}
    if (root / "compare.json").is_file():  # a bloggap compare output folder: its compare.json is the one result
        return {root.name: [(root / "compare.json", load_result(root / "compare.json", reference_ids))]}
    for device_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        files = sorted(device_dir.glob("*.json"))
        if files:
            out[device_dir.name] = [(path, load_result(path, reference_ids)) for path in files]
    if not out:
        raise ReportError(f"{root}: no result JSON files found under <device>/ folders")
    for device, entries in out.items():
        names = {doc["benchmark"] for _, doc in entries}
        missing = [name for name in require or [] if name not in names]
        if missing:
            raise ReportError(f"{root / device}: missing result file(s) for {', '.join(missing)} (have {', '.join(sorted(names))})")
    return out


# --------------------------------------------------------------------------------------------- markdown


def markdown_text(value) -> str:
    """Text read from a result file or a name, as inline Markdown that stays where it is put: one line (newlines
    and runs of whitespace collapsed), HTML's ``< > &`` escaped, ``|`` escaped (a table cell), bytes of a file
    name that are not UTF-8 shown as U+FFFD. Every text the generated Markdown takes from
    a document or a file name goes through this."""
    import html

    from bloggap_plugin._input_files import display_name

    text = " ".join(display_name(str(value)).split())
    return html.escape(text, quote=False).replace("|", "\\|")


def format_cell(value) -> str:
    """A table cell as Markdown text; numbers exactly as written in the JSON."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    return markdown_text(value)


def render_table(table: dict) -> list[str]:
    """Markdown lines of one table: bold title, the table, then its notes."""
    title = f"**{markdown_text(table['id'])}: {markdown_text(table['title'])}**"
    if table.get("random_init"):
        title += " *(random-init weights: timing/shape only, not a measurement of a trained model)*"
    lines = [title, ""]
    lines.append("| " + " | ".join(format_cell(c) for c in table["columns"]) + " |")
    lines.append("|" + "---|" * len(table["columns"]))
    for row in table["rows"]:
        lines.append("| " + " | ".join(format_cell(c) for c in row) + " |")
    if table.get("notes"):
        lines += ["", markdown_text(table["notes"])]
    return lines


def _render_reference(table: dict) -> list[str]:
    source = markdown_text(table.get("source", ""))
    lines = [f"<details><summary>Reference study, {markdown_text(table['id'])} ({source})</summary>", ""]
    body = render_table(table)
    lines += body
    lines += ["", "</details>"]
    return lines


def _env_lines(entries: list) -> list[str]:
    parts = []
    for key, label in _ENV_FIELDS:
        values = []
        for _, document in entries:
            value = document["env"].get(key)
            if value is not None and format_cell(value) not in values:
                values.append(format_cell(value))
        if values:
            parts.append(f"{label}: {' / '.join(values)}")
    return ["; ".join(parts) + "." if parts else "No environment recorded."]


# --------------------------------------------------------------------------------------------- plots


def _float(value) -> float | None:
    return float(value) if is_number(value) else None


def table_plot_spec(table: dict) -> dict | None:
    """The plot for ``table``: its hint, or an automatic bar chart when it has a recognisable shape, or None."""
    if table.get("plot") is False:
        return None
    if isinstance(table.get("plot"), dict):
        return table["plot"]
    rows, columns = table["rows"], table["columns"]
    if len(rows) < 1 or len(rows) > 40:
        return None
    numeric = [c for i, c in enumerate(columns) if numeric_column(rows, i)]
    labels = [c for i, c in enumerate(columns) if c not in numeric and all(isinstance(r[i], str) for r in rows)]
    if not numeric or not labels:
        return None
    # One scale per plot: out-of-band columns if any, else percent columns (not CI bounds), else the numeric
    # columns when their magnitudes are comparable, else the first numeric column alone.
    oob = [c for c in numeric if "oob" in c.lower()]
    percent = [c for c in numeric if "%" in c and not c.lower().startswith("ci")]
    ys = oob or percent or numeric
    if ys is numeric and len(numeric) > 1:
        peaks = [max(abs(float(r[columns.index(c)])) for r in rows if is_number(r[columns.index(c)])) for c in numeric]
        if max(peaks) > 100 * max(min(peaks), 1e-12):
            ys = numeric[:1]
    return {"kind": "bar", "x": labels, "y": ys}


def plot_text(value) -> str:
    """Text from a result file or a name as a matplotlib label drawn as written: bytes of a file name that are not
    UTF-8 shown as U+FFFD (the font renderer refuses them), ``$`` escaped (else mathtext parses it and may fail),
    a leading ``_`` kept visible (matplotlib hides such legend labels)."""
    from bloggap_plugin._input_files import display_name

    text = " ".join(display_name(str(value)).split()).replace("$", r"\$")
    return "\u200b" + text if text.startswith("_") else text


def _short(value, width: int = 28) -> str:
    text = plot_text(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def _plot_table(table: dict, spec: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns, rows = table["columns"], table["rows"]
    ys = spec["y"]
    fig, ax = plt.subplots(figsize=(max(6.0, min(14.0, 0.6 * len(rows) * max(1, len(ys)))), 4.2))
    if spec["kind"] == "bar":
        xs = spec["x"] if isinstance(spec["x"], list) else [spec["x"]]
        labels = [" / ".join(_short(r[columns.index(x)]) for x in xs) for r in rows]
        width = 0.8 / len(ys)
        for j, y in enumerate(ys):
            values = [_float(r[columns.index(y)]) for r in rows]
            positions = [i + (j - (len(ys) - 1) / 2) * width for i in range(len(rows))]
            ax.bar(positions, [v if v is not None else 0.0 for v in values], width=width, label=plot_text(y))
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, rotation=30 if len(rows) > 3 else 0, ha="right" if len(rows) > 3 else "center", fontsize=8)
    else:
        x_index = columns.index(spec["x"])
        series_col = spec.get("series")
        if series_col is None:
            groups = {None: rows}
        else:
            groups = {}
            for r in rows:
                groups.setdefault(r[columns.index(series_col)], []).append(r)
        for name, group in groups.items():
            group = sorted(group, key=lambda r: float(r[x_index]))
            for y in ys:
                points = [(float(r[x_index]), _float(r[columns.index(y)])) for r in group]
                points = [(x, v) for x, v in points if v is not None]
                label = plot_text(y if name is None else (f"{name}" if len(ys) == 1 else f"{name}: {y}"))
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        ax.set_xlabel(plot_text(spec["x"]))
    ax.set_ylabel(plot_text(spec.get("ylabel", ys[0] if len(ys) == 1 else "value")))
    ax.set_title(plot_text(spec.get("title", f"{table['id']}: {table['title']}")), fontsize=9)
    ax.grid(alpha=0.3)
    if len(ys) > 1 or spec.get("series"):
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def save_figure(fig, path: str | os.PathLike, dpi: int) -> None:
    """Render the matplotlib figure ``fig`` as PNG in memory, then write it to ``path`` atomically."""
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    atomic_write_bytes(path, buffer.getvalue())


# --------------------------------------------------------------------------------------------- report


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "table"


def build_report(
    results_dir: str | os.PathLike = "benchmarks/results",
    output: str | os.PathLike = "BENCHMARKS.md",
    plots_dir: str | os.PathLike | None = "benchmarks/plots",
    reference_path: str | os.PathLike | None = None,
    require: list[str] | None = None,
    readme: str | os.PathLike | None = None,
    headline: str | os.PathLike | None = None,
) -> dict:
    """Write ``output`` (Markdown) and PNGs under ``plots_dir`` (``None``: no plots); returns what was written.

    One section per result file, headed by its file name and anchored by :func:`result_anchor`; files whose
    document names a ``superseded_by`` go into the archive section at the end. Each reference study table is
    rendered once, under the first table that reproduces it; later ones link to it.

    ``readme``: also replace that file's headline block with the decision table specified by ``headline``
    (default ``docs/headline.yaml`` beside the README), and, where ``docs/trl.md`` is beside it, the generated
    tables of the docs (:func:`generated_docs_texts`: the ``gap/*`` metric tables, the ``gap:`` field table); the
    new README text is built, and every cited cell found, before anything is written. Where the output goes is
    checked before any result is read; every file is written atomically.
    """
    output = Path(output)
    plots_root = Path(plots_dir) if plots_dir is not None else None
    _check_destinations(output, plots_root)
    reference = load_reference(reference_path)
    results = load_results(results_dir, set(reference), require)
    current, archived = split_superseded(results)
    readme_text, docs_texts = None, {}
    if readme is not None:
        readme = Path(readme)
        if (readme.parent / "docs" / METRIC_DOCS["trl"]).exists():  # the repository's README: its docs beside it
            docs_texts = generated_docs_texts(readme.parent / "docs")
        spec_path = Path(headline) if headline is not None else readme.parent / "docs" / "headline.yaml"
        link = Path(os.path.relpath(output, readme.parent if str(readme.parent) else ".")).as_posix()
        block = render_headline(load_headline_spec(spec_path), results, link)
        readme_text = replace_headline_block(_read_text(readme), block, readme)
    lines = [
        _REPORT_HEADING,
        "",
        "Generated by `bloggap report` from the result files under the results folder and the reference study's "
        "tables (`bloggap_plugin/data/reference_study.json`); do not edit by hand. One section per result file, "
        "anchored by its device and file name (`#h200/trl_arms.json`); result files that a later one replaces "
        "(`superseded_by` in the file) are in the archive at the end. The reference study's table a table "
        "reproduces follows it the first time (folded), later ones link to it.",
        "",
        *_contents_lines(current, archived),
    ]
    renderer = _SectionRenderer(output, plots_root, reference, archived)
    for device, entries in current.items():
        lines += [f"## {markdown_text(device)}", "", *_env_lines(entries), ""]
        for path, document in entries:
            lines += renderer.section(device, path, document, "###")
    if archived:
        lines += [f"## {_ARCHIVE_HEADING}", "",
                  "Result files that a later file replaces (each names it in `superseded_by`): kept as measured, "
                  "for the history the docs under docs/history/ tell.", ""]
        for device, entries in archived.items():
            lines += [f"### {markdown_text(device)}", "", *_env_lines(entries), ""]
            for path, document in entries:
                lines += renderer.section(device, path, document, "####")
    write_output_text(output, "\n".join(lines).rstrip() + "\n", "--output", is_report_markdown, ReportError)
    if readme_text is not None:
        _write_text(readme, readme_text)
    for page, text in docs_texts.items():
        _write_text(page, text)
    return {"markdown": str(output), "plots": renderer.plots, "devices": list(results),
            "files": [str(p) for e in results.values() for p, _ in e], "readme": str(readme) if readme else None,
            "docs": [str(page) for page in docs_texts]}


_ARCHIVE_HEADING = "Archive: superseded result files"


def result_anchor(device: str, path: str | os.PathLike) -> str:
    """The anchor of a result file's section in the report: ``<device>/<file name>`` (``h200/trl_arms.json``),
    which does not move when other files are added; bytes of the name that are not UTF-8 shown as U+FFFD."""
    from bloggap_plugin._input_files import display_name

    return f"{device}/{display_name(Path(path).name)}"


def _anchor_tag(anchor: str) -> str:
    import html

    return f'<a id="{html.escape(anchor, quote=True)}"></a>'


def split_superseded(results: dict) -> tuple[dict, dict]:
    """``(current, archived)``: :func:`load_results`' mapping split by each document's ``superseded_by``, which must
    name another result file of the same device folder (else :class:`ReportError` naming both)."""
    from bloggap_plugin.results import SUPERSEDED_BY

    current: dict[str, list] = {}
    archived: dict[str, list] = {}
    for device, entries in results.items():
        names = {path.name for path, _ in entries}
        for path, document in entries:
            replacement = document.get(SUPERSEDED_BY)
            if replacement is not None and replacement not in names:
                raise ReportError(f"{path}: {SUPERSEDED_BY} names {replacement}, which is not a result file beside it "
                                  f"(have {', '.join(sorted(names))}); name the file that replaces it")
            (archived if replacement is not None else current).setdefault(device, []).append((path, document))
    return current, archived


def _contents_lines(current: dict, archived: dict) -> list[str]:
    """A list of the sections: each current file linked with its table ids, then the archive's count."""
    lines = ["Contents:", ""]
    for device, entries in current.items():
        for path, document in entries:
            ids = ", ".join(markdown_text(t["id"]) for t in document["tables"])
            anchor = result_anchor(device, path)
            lines.append(f"- [{markdown_text(anchor)}](#{markdown_text(anchor)}): {ids}")
    count = sum(len(entries) for entries in archived.values())
    if count:
        slug = re.sub(r"[^\w\- ]", "", _ARCHIVE_HEADING.lower()).replace(" ", "-")
        lines.append(f"- [{_ARCHIVE_HEADING}](#{slug}): {count} file(s)")
    return lines + [""]


class _SectionRenderer:
    """Renders result files' sections, each reference table once, and writes their plots."""

    def __init__(self, output: Path, plots_root: Path | None, reference: dict, archived: dict) -> None:
        from bloggap_plugin.results import SUPERSEDED_BY

        self.output, self.plots_root, self.reference = output, plots_root, reference
        self.plots: list[str] = []
        self.shown_references: set[str] = set()
        self.earlier = {(device, document[SUPERSEDED_BY]): [] for device, entries in archived.items()
                        for _, document in entries}
        for device, entries in archived.items():
            for path, document in entries:
                self.earlier[device, document[SUPERSEDED_BY]].append(result_anchor(device, path))

    def section(self, device: str, path: Path, document: dict, level: str) -> list[str]:
        """The lines of one result file's section, its heading at ``level`` (``###``)."""
        from bloggap_plugin.results import SUPERSEDED_BY

        anchor = result_anchor(device, path)
        lines = [_anchor_tag(anchor), f"{level} {markdown_text(path.name)}", "",
                 f"Source: `{markdown_text(path.as_posix())}` (benchmark `{markdown_text(document['benchmark'])}`)."]
        replacement = document.get(SUPERSEDED_BY)
        if replacement is not None:
            target = result_anchor(device, replacement)
            lines.append(f"Superseded by [{markdown_text(target)}](#{markdown_text(target)}).")
        earlier = self.earlier.get((device, path.name), [])
        if earlier:
            lines.append("Earlier files it replaces, in the archive: "
                         + ", ".join(f"[{markdown_text(a)}](#{markdown_text(a)})" for a in earlier) + ".")
        lines.append("")
        for table in document["tables"]:
            lines += render_table(table) + [""]
            lines += self._plot(device, path, table)
            if table.get("reference"):
                lines += self._reference(table["reference"]) + [""]
        return lines

    def _reference(self, table_id: str) -> list[str]:
        anchor = f"reference-{table_id}"
        if table_id in self.shown_references:
            return [f"Reference study, {markdown_text(table_id)}: [shown above](#{markdown_text(anchor)})."]
        self.shown_references.add(table_id)
        return [_anchor_tag(anchor), *_render_reference(self.reference[table_id])]

    def _plot(self, device: str, path: Path, table: dict) -> list[str]:
        spec = table_plot_spec(table)
        if spec is None or self.plots_root is None:
            return []
        # Named after the file, as its section is: unique in the device's folder, and the same whatever else is there.
        plot_path = self.plots_root / device / f"{_slug(path.stem)}_{_slug(table['id'])}.png"
        try:
            plot_path.parent.mkdir(parents=True, exist_ok=True)
            _plot_table(table, spec, plot_path)
        except OSError as err:
            raise ReportError(f"{plot_path}: cannot write ({err.strerror or err})") from None
        self.plots.append(str(plot_path))
        link = os.path.relpath(plot_path, self.output.parent if str(self.output.parent) else ".")
        return [f"![{_slug(table['id'])}]({Path(link).as_posix()})", ""]


def is_report_markdown(text: str) -> bool:
    """True when ``text`` is a report this module wrote (the only file ``--output`` may replace)."""
    return text.startswith(_REPORT_HEADING) and "Generated by `bloggap report`" in text[:1000]


def _write_text(path: Path, text: str) -> None:
    try:
        atomic_write_text(path, text)
    except OSError as err:
        raise ReportError(f"{path}: cannot write ({err.strerror or err}); the previous file is unchanged") from None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ReportError(f"{path}: cannot read ({getattr(err, 'strerror', None) or err})") from None


# --------------------------------------------------------------------------------------------- README headline

HEADLINE_MARKERS = ("<!-- bloggap:headline:start -->", "<!-- bloggap:headline:end -->")
_HEADLINE_KEYS = ("situation", "arm", "result", "table", "row", "column", "says")


def load_headline_spec(path: str | os.PathLike) -> list[dict]:
    """The rows of the README's decision table from the YAML file ``path``: a mapping with ``rows``, each row a
    mapping with the text keys ``situation``, ``arm``, ``says`` (what the number is) and the cell it cites:
    ``result`` (``<device>/<file>.json`` under the results folder), ``table`` (table id), ``row`` (the value of
    the table's first column) and ``column`` (column name); optional ``unit`` follows the number."""
    from bloggap_plugin._input_files import load_yaml

    path = Path(path)
    document = load_yaml(_read_text(path), str(path), error=ReportError)
    rows = document.get("rows") if isinstance(document, dict) else None
    if not isinstance(rows, list) or not rows:
        raise ReportError(f"{path}: expected a mapping with a non-empty 'rows' list")
    for index, row in enumerate(rows):
        where = f"{path}: rows[{index}]"
        if not isinstance(row, dict):
            raise ReportError(f"{where}: expected a mapping")
        missing = [key for key in _HEADLINE_KEYS if not isinstance(row.get(key), str) or not row[key].strip()]
        if missing:
            raise ReportError(f"{where}: missing or empty text key(s) {', '.join(missing)}")
        unknown = sorted(set(row) - set(_HEADLINE_KEYS) - {"unit", "cost"})
        if unknown:
            raise ReportError(f"{where}: unknown key(s) {', '.join(unknown)}")
        _check_cost_cells(row.get("cost"), f"{where}: cost")
    return rows


_COST_KEYS = ("label", "result", "table", "row", "column")
_COST_OPTIONAL_KEYS = ("spread", "runs")
"""A cost cell's optional columns of the same row: its spread over runs (text) and how many runs (a number)."""
MIN_RUNS = 3
"""The fewest interleaved runs a quoted step multiple may come from (a cost cell naming its ``runs`` column)."""


def _check_cost_cells(cells, where: str) -> None:
    """A row's optional ``cost``: a list of cited cells, each a mapping with the text keys :data:`_COST_KEYS` and
    optionally :data:`_COST_OPTIONAL_KEYS`."""
    if cells is None:
        return
    if not isinstance(cells, list) or not cells:
        raise ReportError(f"{where}: expected a non-empty list of cited cells")
    for index, cell in enumerate(cells):
        if not isinstance(cell, dict) or not set(_COST_KEYS) <= set(cell) <= {*_COST_KEYS, *_COST_OPTIONAL_KEYS} \
                or not all(isinstance(value, str) and value.strip() for value in cell.values()):
            raise ReportError(f"{where}[{index}]: expected a mapping with the text keys {', '.join(_COST_KEYS)} "
                              f"(and optionally {', '.join(_COST_OPTIONAL_KEYS)})")


def _cited_row(row: dict, results: dict, where: str):
    """``(result path, table, table row)`` that a headline or cost cell ``row`` names (``ReportError`` otherwise)."""
    device, _, name = row["result"].partition("/")
    path, document = next(((p, doc) for p, doc in results.get(device, []) if p.name == name), (None, None))
    if document is None:
        raise ReportError(f"{where}: result {row['result']} is not among the results")
    table = next((t for t in document["tables"] if t["id"] == row["table"]), None)
    if table is None:
        raise ReportError(f"{where}: {row['result']} has no table {row['table']}")
    if row["column"] not in table["columns"]:
        raise ReportError(f"{where}: table {row['table']} has no column {row['column']!r}")
    matches = [r for r in table["rows"] if format_cell(r[0]) == row["row"]]
    if len(matches) != 1:
        raise ReportError(f"{where}: table {row['table']} has {len(matches)} rows whose first cell is {row['row']!r}")
    return path, table, matches[0]


def _cited_cell(row: dict, results: dict, where: str):
    """``(result path, the number, table, table row)`` of the cell ``row`` names (``ReportError`` if not a number)."""
    path, table, found = _cited_row(row, results, where)
    value = found[table["columns"].index(row["column"])]
    if not is_number(value):
        raise ReportError(f"{where}: table {row['table']}, row {row['row']!r}, column {row['column']!r} holds "
                          f"{format_cell(value)!r}, not a number")
    return path, value, table, found


def render_headline(spec: list[dict], results: dict, benchmarks_link: str = "BENCHMARKS.md") -> list[str]:
    """The decision table's Markdown lines: situation, arm, the cited number, and the table id linked to its
    result file's section of the report at ``benchmarks_link``; where any row has ``cost`` cells, a column of them
    (``label value x``, the table id linked), ``–`` in a row without. ``results`` is :func:`load_results`' mapping."""
    anchors = _section_anchors(results)
    with_cost = any("cost" in row for row in spec)
    lines = ["| situation | arm | headline number | table |" + (" step x arm A |" if with_cost else ""),
             "|---|---|---|---|" + ("---|" if with_cost else "")]
    for index, row in enumerate(spec):
        path, value, _, _ = _cited_cell(row, results, f"headline rows[{index}]")
        number = f"**{format_cell(value)}{markdown_text(row.get('unit', ''))}**"
        cited = f"[{markdown_text(row['table'])}]({benchmarks_link}#{anchors[path]})"
        cells = [markdown_text(row["situation"]), markdown_text(row["arm"]), f"{markdown_text(row['says'])} {number}",
                 cited]
        if with_cost:
            cells.append(_cost_cell(row.get("cost"), results, anchors, benchmarks_link, f"headline rows[{index}]"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _cost_cell(cells: list | None, results: dict, anchors: dict, benchmarks_link: str, where: str) -> str:
    """``label value x, ... ([table](link))`` of a row's ``cost`` cells, each with ``(runs SPREAD, N runs)`` where it
    names those columns, or ``–`` without. A multiple from fewer than :data:`MIN_RUNS` runs is refused."""
    if not cells:
        return "–"
    parts, links = [], {}
    for index, cell in enumerate(cells):
        path, value, table, found = _cited_cell(cell, results, f"{where}: cost[{index}]")
        parts.append(f"{markdown_text(cell['label'])} {format_cell(value)}x"
                     + _runs_text(cell, table, found, f"{where}: cost[{index}]"))
        links.setdefault(cell["table"], f"[{markdown_text(cell['table'])}]({benchmarks_link}#{anchors[path]})")
    return f"{', '.join(parts)} ({', '.join(links.values())})"


def _runs_text(cell: dict, table: dict, found: list, where: str) -> str:
    """`` (runs SPREAD, N runs)`` from the cell's ``spread`` and ``runs`` columns of its table row ``found`` (either
    alone: that part); ``""`` where it names neither."""
    said = []
    for key in ("spread", "runs"):
        if key in cell and cell[key] not in table["columns"]:
            raise ReportError(f"{where}: table {cell['table']} has no column {cell[key]!r} (its {key})")
    if "spread" in cell:
        said.append(f"runs {format_cell(found[table['columns'].index(cell['spread'])])}")
    if "runs" in cell:
        runs = found[table["columns"].index(cell["runs"])]
        if not is_number(runs) or runs < MIN_RUNS:
            raise ReportError(f"{where}: table {cell['table']}, row {cell['row']!r}: {format_cell(runs)} runs; a step "
                              f"multiple is quoted from at least {MIN_RUNS} interleaved runs (cite a table that has "
                              "them, or leave the cell out)")
        said.append(f"{format_cell(runs)} runs")
    return f" ({', '.join(said)})" if said else ""


def _section_anchors(results: dict) -> dict:
    """``{result path: anchor}`` of each result file's section in the report :func:`build_report` writes."""
    return {path: result_anchor(device, path) for device, entries in results.items() for path, _ in entries}


def replace_headline_block(text: str, block: list[str], where: str | os.PathLike = "README",
                           markers: tuple[str, str] = HEADLINE_MARKERS) -> str:
    """``text`` with the lines between ``markers`` (default: the headline's) replaced by ``block`` (markers kept,
    everything else unchanged). Each marker must stand alone on one line, once, start before end."""
    lines = text.split("\n")
    found = [[i for i, line in enumerate(lines) if line.strip() == marker] for marker in markers]
    if [len(f) for f in found] != [1, 1] or found[0][0] > found[1][0]:
        raise ReportError(f"{where}: expected the line {markers[0]} once, then the line {markers[1]} "
                          f"once (found {len(found[0])} and {len(found[1])})")
    start, end = found[0][0], found[1][0]
    return "\n".join(lines[: start + 1] + block + lines[end:])


METRIC_DOCS = {"trl": "trl.md", "verl": "verl.md"}
"""The doc page (under the docs folder) that holds each adapter's generated ``gap/*`` metric table."""
GAP_FIELDS_DOC = "trl.md"
"""The doc page (under the docs folder) that holds the generated ``gap:`` field table."""


def generated_docs_texts(docs_dir: str | os.PathLike) -> dict[Path, str]:
    """``{page: its text with every generated table between its markers regenerated}`` for the pages under
    ``docs_dir``: each of :data:`METRIC_DOCS` (:func:`bloggap_plugin.core.metric_specs.metric_table`) and
    :data:`GAP_FIELDS_DOC` (:func:`bloggap_plugin.recipes.gap_field_table`, from ``GapConfig``'s field help)."""
    from bloggap_plugin.core.metric_specs import metric_table, metric_table_markers
    from bloggap_plugin.recipes import GAP_FIELD_TABLE_MARKERS, gap_field_table

    blocks = [(name, metric_table(framework), metric_table_markers(framework))
              for framework, name in METRIC_DOCS.items()]
    blocks.append((GAP_FIELDS_DOC, gap_field_table(), GAP_FIELD_TABLE_MARKERS))
    out: dict[Path, str] = {}
    for name, table, markers in blocks:
        page = Path(docs_dir) / name
        out[page] = replace_headline_block(out[page] if page in out else _read_text(page), table, page, markers)
    return out


def _check_destinations(output: Path, plots_root: Path | None) -> None:
    """Raise :class:`ReportError` unless ``output`` can be written as a file and ``plots_root`` is (or can be) a
    folder; creates the output's missing folders as writing it would."""
    problem = check_writable_file(output, "--output")
    if problem and not output.parent.exists():
        try:
            output.parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # an ancestor is a file, or not writable: the check below says so
        problem = check_writable_file(output, "--output")
    problem = problem or foreign_file_problem(output, "--output", is_report_markdown)
    if problem:
        raise ReportError(problem)
    if plots_root is not None:
        existing = next((p for p in (plots_root, *plots_root.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():
            raise ReportError(f"--plots {plots_root}: {existing} is not a folder; give a folder path")
