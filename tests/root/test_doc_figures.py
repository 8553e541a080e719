"""Every figure in README.md and docs/**/*.md is held by a committed result file (issue 46 item 4).

A figure is a number in prose: a percentage, a multiple (2.6x), a time, a count. Each must equal, after the rounding
the document prints, a number of the results its paragraph cites (a table id such as T12: every file holding that
table, and the reference study's; a file name `NAME.json`), or, where the paragraph cites none, a number in any JSON
file under benchmarks/results/ or in BENCHMARKS.md (generated from them). Or it sits in a phrase of
`doc_figures_allowed.yaml`, which gives the reason (a definition, a version, a setting).
Skipped: inline code, link targets, identifiers (T12, fp16, commit ids), the README's generated headline block
(test_report.py checks it) and the command part of command lines in code blocks (their `# ...` comments count).
"""

from __future__ import annotations

import bisect
import re
import subprocess
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import pytest
import yaml
from _support import ROOT
from _support.json_values import load_number_texts, numbers_and_strings

RESULTS = ROOT / "benchmarks" / "results"
ALLOWED = Path(__file__).with_name("doc_figures_allowed.yaml")
HEADLINE_START, HEADLINE_END = "<!-- bloggap:headline:start -->", "<!-- bloggap:headline:end -->"

# A number as a reader sees it: not part of a word, path or version (T12, h200, fp16, 0.26.0 are names), optionally
# a multiple (2.6x). Dates are removed before (`_strip`).
_FIGURE = re.compile(r"(?<![\w./\\])(\d+(?:,\d{3})*(?:\.\d+)?)(x|×|%)?(?![\w]|\.\d|/\w)")
_DATE = re.compile(r"\b\d{4}-\d\d-\d\d(?:[T ]\d\d:\d\d(?::\d\d)?)?")
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK_TARGET = re.compile(r"\]\([^)\s]*\)")
_HTML_COMMENT = re.compile(r"<!--.*?-->", re.S)
_LIST_MARKER = re.compile(r"^(\s*)\d+\.\s", re.M)
# Command lines in code blocks: the command is no figure, its trailing `# comment` is prose.
_COMMAND = re.compile(r"^\s*(?:\$ )?(?:[A-Z][A-Z0-9_]*=|bloggap|pip|make|python\S*|torchrun|git|cd|export|HF_\w+=|CUDA_\w+=|"
                      r"BLOGGAP_\w+=|VLLM_\w+=|uv|bash|sh|ls|cat|\.ci/|pytest|ruff|from |import |[\w.]+\s*=|"
                      r"[\w.]+\(|def |return |\)|#)")
_COMMIT = re.compile(r"^\d{7,40}$")


@dataclass(frozen=True)
class Figure:
    doc: str
    line: int
    text: str  # as printed, without the thousands separators
    unit: str  # "%", "x" or ""
    context: str

    def value(self) -> Decimal:
        return Decimal(self.text)

    def tolerance(self) -> Decimal:
        """Half the last printed digit: 3.58 stands for [3.575, 3.585]."""
        exponent = self.value().as_tuple().exponent
        return Decimal(5) * Decimal(10) ** (exponent - 1)


def _blank(match: re.Match) -> str:
    return re.sub(r"[^\n]", " ", match.group(0))


def _strip(text: str) -> str:
    """The prose of a Markdown file with what holds no figure blanked out (line numbers kept)."""
    start, end = text.find(HEADLINE_START), text.find(HEADLINE_END)
    if start >= 0 and end > start:
        text = text[:start] + re.sub(r"[^\n]", " ", text[start:end]) + text[end:]
    text = _HTML_COMMENT.sub(_blank, text)
    lines, in_code, continued = [], False, False
    for line in text.split("\n"):
        kept = line
        if line.lstrip().startswith("```"):
            in_code, continued, kept = not in_code, False, ""
        elif in_code and (continued or _COMMAND.match(line)):
            continued = line.rstrip().endswith("\\")
            comment = line.find("#") if line.lstrip().startswith("#") else line.find(" # ")
            kept = line[comment:] if comment >= 0 else ""
        lines.append(kept.rjust(len(line)))  # blanked, not removed: offsets stay the raw text's
    text = "\n".join(lines)
    for pattern in (_INLINE_CODE, _LINK_TARGET, _DATE):
        text = pattern.sub(_blank, text)
    return _LIST_MARKER.sub(lambda m: m.group(1) + "   ", text)


def _entry_regex(entry: dict) -> re.Pattern:
    return re.compile(entry["pattern"] if "pattern" in entry else re.escape(entry["phrase"]))


def _allowed_spans(text: str, doc: str, allowed: list[dict]) -> list[tuple[int, int]]:
    return [(m.start(), m.end()) for entry in allowed if entry["doc"] in (doc, "*")
            for m in _entry_regex(entry).finditer(text)]


def figures_in(raw: str, doc: str, allowed: list[dict]) -> list[Figure]:
    """The figures of one Markdown text (`doc`: its path from the repository root) that no allowed phrase covers."""
    text = _strip(raw)
    spans = _allowed_spans(raw, doc, allowed)
    found = []
    for match in _FIGURE.finditer(text):
        number = match.group(1).replace(",", "")
        if any(a <= match.start(1) and match.end(1) <= b for a, b in spans):
            continue
        if _COMMIT.match(number) and _is_commit(number):
            continue
        line = text.count("\n", 0, match.start()) + 1
        context = raw.split("\n")[line - 1].strip()
        found.append(Figure(doc, line, number, {"×": "x"}.get(match.group(2), match.group(2) or ""), context))
    return found


_DIGITS = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")


def _numbers_of(document) -> list[Decimal]:
    """The magnitudes of the numbers (int, ``Decimal``, JSON number text) and of the digit runs of the strings, keys
    included, in ``document``: sorted, each value once."""
    numbers, texts = numbers_and_strings(document)
    found = {abs(Decimal(n)) for n in numbers}
    for text in texts:
        found.update(Decimal(m.replace(",", "")) for m in _DIGITS.findall(text))
    return sorted(found)


def _numbers_in_text(text: str) -> list[Decimal]:
    return sorted({Decimal(m.replace(",", "")) for m in _DIGITS.findall(text)})


class Sources:
    """Numbers of the committed results: all of them, or those of the files a passage cites (by a table id: every
    file holding that table, and the reference study's table of that id; or by a file name, `NAME.json`)."""

    def __init__(self) -> None:
        from bloggap_plugin.report_builder import load_reference

        documents = {p: load_number_texts(p.read_text())
                     for p in sorted(RESULTS.rglob("*.json"))}
        self.files = {p: _numbers_of(d) for p, d in documents.items()}
        self.by_table: dict[str, set[Path]] = {}
        for path, document in documents.items():
            for table in document.get("tables", []) if isinstance(document, dict) else []:
                self.by_table.setdefault(table["id"], set()).add(path)
        self.reference = {k: _numbers_of(v) for k, v in load_reference().items()}
        self.everything = sorted(set().union(*self.files.values(),
                                             _numbers_in_text((ROOT / "BENCHMARKS.md").read_text())))
        # an id that is a plain lowercase word (``start``) is cited by its file's name, not by the word in prose
        ids = sorted((i for i in set(self.by_table) | set(self.reference) if not i.islower()), key=len, reverse=True)
        self._table = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, ids)) + r")(?![\w]|-\w)")
        self._file = re.compile(r"([\w.-]+)\.json")
        self._cited: dict[str, list[Decimal] | None] = {}
        self._union: dict[tuple[frozenset, frozenset], list[Decimal]] = {}

    def cited(self, passage: str) -> list[Decimal] | None:
        """The numbers of the results `passage` cites, or None when it cites none (worked out once per passage:
        every figure of a paragraph asks for the same)."""
        if passage not in self._cited:
            self._cited[passage] = self._numbers_cited(passage)
        return self._cited[passage]

    def _numbers_cited(self, passage: str) -> list[Decimal] | None:
        tables = set(self._table.findall(passage))
        paths = {p for t in tables for p in self.by_table.get(t, ())}
        for stem in self._file.findall(passage):
            paths |= {p for p in self.files if stem in (p.stem, p.parent.name)}
        if not tables and not paths:
            return None
        key = (frozenset(paths), frozenset(tables))  # passages citing the same results share their numbers
        if key not in self._union:
            self._union[key] = sorted(set().union(*(self.files[p] for p in paths),
                                                  *(self.reference.get(t, []) for t in tables)))
        return self._union[key]


def _held(target: Decimal, tolerance: Decimal, numbers: list[Decimal]) -> bool:
    i = bisect.bisect_left(numbers, target - tolerance)
    return i < len(numbers) and numbers[i] <= target + tolerance


def is_held(figure: Figure, numbers: list[Decimal]) -> bool:
    """Whether a number of the sorted `numbers` prints as the figure (a percentage may be stored as a share)."""
    value, tolerance = figure.value(), figure.tolerance()
    if _held(value, tolerance, numbers):
        return True
    return figure.unit == "%" and _held(value / 100, tolerance / 100, numbers)


def _allowed() -> list[dict]:
    return yaml.safe_load(ALLOWED.read_text())["allowed"]


def _docs() -> list[Path]:
    """README.md and every page under docs/, the history under docs/history/ included."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _is_commit(text: str) -> bool:
    return subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{text}^{{commit}}"],
                          capture_output=True).returncode == 0


def _paragraphs(raw: str) -> list[str]:
    """Each line's paragraph (the lines between blank lines around it)."""
    blocks, current, out = [], [], []
    for line in raw.split("\n"):
        if not line.strip():
            blocks.append(current)
            current = []
        current.append(line)
    blocks.append(current)
    for block in blocks:
        out += ["\n".join(block)] * len(block)
    return out


@pytest.fixture(scope="module")
def sources() -> Sources:
    """The committed results' numbers, read once for the tests of this file."""
    return Sources()


def unheld_figures(sources: Sources) -> list[Figure]:
    """Figures no result holds: in a paragraph that cites results, the cited ones; elsewhere, any committed one."""
    allowed, unheld = _allowed(), []
    for path in _docs():
        raw = path.read_text()
        paragraphs = _paragraphs(raw)
        for figure in figures_in(raw, path.relative_to(ROOT).as_posix(), allowed):
            cited = sources.cited(paragraphs[figure.line - 1])
            if not is_held(figure, sources.everything if cited is None else cited):
                unheld.append(figure)
    return unheld


def test_every_figure_in_the_docs_is_held_by_a_result_file(sources):
    unheld = unheld_figures(sources)
    listing = "\n".join(f"{f.doc}:{f.line}: {f.text}{f.unit} in: {f.context[:120]}" for f in unheld)
    assert not unheld, (f"{len(unheld)} figure(s) in README/docs that no result file under benchmarks/results/ (nor "
                        f"BENCHMARKS.md) holds: cite the result, put it into one, or describe the mechanism "
                        f"without it (a definition goes into {ALLOWED.name} with its reason):\n{listing}")


def test_every_allowed_phrase_is_in_its_document_and_says_why():
    texts = {p.relative_to(ROOT).as_posix(): p.read_text() for p in _docs()}
    for entry in _allowed():
        assert set(entry) <= {"doc", "phrase", "pattern", "reason"} and len(entry.get("reason", "")) >= 10, entry
        where = list(texts.values()) if entry["doc"] == "*" else [texts[entry["doc"]]]
        assert any(_entry_regex(entry).search(t) for t in where), f"stale allow-list entry: {entry}"


def test_the_check_finds_unheld_figures_after_the_printed_rounding():
    numbers = sorted({Decimal("0.035812"), Decimal("2.083"), Decimal("945")})
    text = "\n".join([
        "Arm A 3.58% and 3.6% out of band; J at 2.08x, A at 2.1x; 946 s.",  # 946: unheld
        "Out of band: 3.5%, and 2.0x.",  # both unheld: 3.58 rounds to 3.6, 2.083 to 2.1
        "`--max-steps 31` and [T7](BENCHMARKS.md#ladder-77) and fp16, T12, 2026-12-03, 0.26.0 are no figures.",
        "```", "bloggap train x.yaml --seed 1234 --max-steps 77   # took 945 s, then 17.5 s", "17.25% out of band",
        "```", HEADLINE_START, "| 99.9% |", HEADLINE_END, "Band 0.1 by definition."])
    allowed = [{"doc": "x.md", "phrase": "Band 0.1", "reason": "a setting"}]
    unheld = [(f.line, f.text + f.unit) for f in figures_in(text, "x.md", allowed) if not is_held(f, numbers)]
    assert unheld == [(1, "946"), (2, "3.5%"), (2, "2.0x"), (5, "17.5"), (6, "17.25%")]



def test_a_paragraph_that_cites_results_is_checked_against_those(sources):
    """Arm A's median step of the 656713e pair is in its file; the 616bb98 file's is not, though some file holds it."""
    pair, earlier = Figure("x.md", 1, "0.371", "", ""), Figure("x.md", 1, "0.292", "", "")
    cited = sources.cited("arm A's step in `arm_j_live_656713e.json`")
    assert is_held(pair, cited) and not is_held(earlier, cited) and is_held(earlier, sources.everything)
    assert is_held(earlier, sources.cited("the arm A rows of T16-armJ-live"))  # the table id names every file of it
    assert sources.cited("no citation here, only T99 and fp16") is None


def test_an_ordinary_word_that_is_also_a_table_id_cites_nothing(sources):
    """Some result files name a table with a plain word (``start``: the reward of the first generation); a paragraph
    that says "warm start" cites no table by it, so its figures are checked against every result file."""
    assert "start" in sources.by_table
    assert sources.cited("a setting's warm start took 173-197 s") is None
    assert sources.cited("the `start` table of gsm8k_demo") is None  # a word id is cited by its file name instead
    assert sources.cited("T15-baseline at the start") is not None  # an id of the T-form still cites
