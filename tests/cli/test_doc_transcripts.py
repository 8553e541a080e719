"""The console transcripts in docs/*.md are what their commands print: each block marked
``<!-- transcript: bloggap ARGS -->`` lists lines that the command prints, in that order (``...`` skips lines)."""

from __future__ import annotations

import re
import shlex

import pytest
from _support import ROOT

_MARKED = re.compile(r"<!-- transcript: bloggap (.+?) -->\n```\n(.*?)\n```", re.S)


def transcripts() -> list[tuple[str, list[str], list[str]]]:
    """``(page, argv, lines)`` of every marked block under docs/."""
    return [(page.name, shlex.split(match.group(1)), match.group(2).split("\n"))
            for page in sorted((ROOT / "docs").glob("*.md"))
            for match in _MARKED.finditer(page.read_text(encoding="utf-8"))]


def missing_lines(expected: list[str], printed: str) -> list[str]:
    """The lines of ``expected`` (``...`` aside) not found in ``printed`` in order, each after the one before."""
    lines, position, missing = printed.split("\n"), 0, []
    for line in (x.rstrip() for x in expected if x.strip() != "..."):
        found = next((i for i in range(position, len(lines)) if lines[i].rstrip() == line), None)
        if found is None:
            missing.append(line)
        else:
            position = found + 1
    return missing


def test_doctor_md_has_a_checked_transcript():
    assert any(page == "doctor.md" and argv[:2] == ["doctor", "--from-json"] for page, argv, _ in transcripts())


@pytest.mark.parametrize("page,argv,lines", transcripts(), ids=lambda x: x if isinstance(x, str) else None)
def test_each_transcript_is_what_its_command_prints(page, argv, lines, capsys, monkeypatch):
    from bloggap_plugin.cli import main

    monkeypatch.chdir(ROOT)
    assert main(argv) == 0
    missing = missing_lines(lines, capsys.readouterr().out)
    assert not missing, f"docs/{page}: transcript lines that `bloggap {shlex.join(argv)}` no longer prints: {missing}"


def test_the_check_finds_a_changed_line_and_a_changed_order():
    printed = "header\nrow a\nrow b\nfooter"
    assert missing_lines(["header", "...", "row b", "footer"], printed) == []
    assert missing_lines(["header", "row c"], printed) == ["row c"]
    assert missing_lines(["row b", "row a"], printed) == ["row a"]
