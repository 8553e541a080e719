"""Every link in README.md, BENCHMARKS.md and docs/**/*.md leads somewhere: the file exists, and an anchor
(`#...`) is a heading of the target page (GitHub's slug) or an `<a id="...">` in it (issue 48 item 1)."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest
from _support import ROOT

_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ID = re.compile(r"""<a\s[^>]*\b(?:id|name)\s*=\s*["']([^"']+)["']""", re.I)
_EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.I)


def _prose_lines(text: str) -> list[str]:
    """The lines of a Markdown text outside fenced code blocks, inline code blanked (neither holds links)."""
    lines, fenced = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else _INLINE_CODE.sub("", line))
    return lines


def heading_slug(heading: str) -> str:
    """GitHub's anchor of a heading's text: link markup reduced to its text, lowercased, every character but letters,
    digits, ``_``, ``-`` and spaces dropped, spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors_of(text: str) -> set[str]:
    """The anchors a Markdown page offers: each heading's slug (a repeated one with GitHub's ``-1``, ``-2``, ...
    suffix) and each ``<a id="...">``/``name``."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    fenced = False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        found.update(_HTML_ID.findall(line))
        match = _HEADING.match(line)
        if match:
            slug = heading_slug(match.group(2))
            found.add(slug if slug not in counts else f"{slug}-{counts[slug]}")
            counts[slug] = counts.get(slug, 0) + 1
    return found


def broken_links(page: Path, text: str, read=lambda p: p.read_text(encoding="utf-8")) -> list[str]:
    """``"line: target (why)"`` for each link of ``page`` (its ``text``) whose file or anchor does not exist."""
    broken = []
    for number, line in enumerate(_prose_lines(text), 1):
        for target in _LINK.findall(line):
            if _EXTERNAL.match(target):
                continue
            path_part, _, anchor = target.partition("#")
            destination = (page.parent / unquote(path_part)).resolve() if path_part else page
            if not destination.exists():
                broken.append(f"{number}: {target} (no file {destination})")
            elif anchor and destination.suffix == ".md":
                if unquote(anchor) not in anchors_of(text if destination == page else read(destination)):
                    broken.append(f"{number}: {target} (no heading or anchor #{anchor} in {destination.name})")
    return broken


def _pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_leads_to_a_file_and_anchor_that_exist(page):
    broken = broken_links(page, page.read_text(encoding="utf-8"))
    assert not broken, (f"{page.relative_to(ROOT)}: links to a file or anchor that does not exist (BENCHMARKS.md's "
                        "anchors are <device>/<file>.json, stable; a doc section's is its heading's slug):\n"
                        + "\n".join(broken))


def test_the_check_finds_a_missing_file_a_missing_anchor_and_a_moved_heading(tmp_path):
    target = tmp_path / "B.md"
    target.write_text('# Benchmarks\n\n<a id="h200/trl_arms.json"></a>\n### trl_arms.json\n\n## Which `arm`? (T12)\n'
                      "## Which `arm`? (T12)\n```\n# not a heading\n```\n")
    page = tmp_path / "README.md"
    page.write_text("\n".join([
        "[ok](B.md#h200/trl_arms.json) [ok](B.md#which-arm-t12-1) [ok](#top) [ok](https://example.org/x#y)",
        "[file](C.md) [anchor](B.md#arm_i_live-9) [code](B.md#not-a-heading) `[in code](D.md)`",
        "# Top", "```", "[in a block](E.md)", "```"]))
    broken = broken_links(page, page.read_text())
    assert [b.split(" (")[0] for b in broken] == ["2: C.md", "2: B.md#arm_i_live-9", "2: B.md#not-a-heading"]
    assert anchors_of(target.read_text()) == {"benchmarks", "h200/trl_arms.json", "trl_armsjson", "which-arm-t12",
                                              "which-arm-t12-1"}
