"""The gap/* metric registry (bloggap_plugin/core/metric_specs.py): the adapters log only its names, every name the
code writes is in it, and the metric tables of docs/trl.md and docs/verl.md are what it renders (drift test)."""

from __future__ import annotations

import ast
import re

import pytest
from _support import ROOT

from bloggap_plugin.core.metric_specs import (
    FRAMEWORKS,
    METRIC_SPECS,
    NEEDS,
    metric_table,
    metric_table_markers,
    names,
    ratio_name,
    registered,
)
from bloggap_plugin.report_builder import (
    METRIC_DOCS,
    ReportError,
    generated_docs_texts,
    replace_headline_block,
)

# the modules that write gap/* metrics, by adapter
WRITERS = {"trl": ["trl/stats.py", "trl/session.py"], "verl": ["verl/loss.py", "verl/correction.py"]}
KEY = re.compile(r"gap/[a-z0-9_]+/[A-Za-z0-9_]+")


def _block(text: str, framework: str) -> list[str]:
    start, end = metric_table_markers(framework)
    lines = text.split("\n")
    return lines[lines.index(start) + 1: lines.index(end)]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_the_docs_metric_table_is_what_the_registry_renders(framework):
    """Edit bloggap_plugin/core/metric_specs.py, then run `bloggap report` (it rewrites both tables)."""
    page = ROOT / "docs" / METRIC_DOCS[framework]
    block = _block(page.read_text(encoding="utf-8"), framework)
    assert block == metric_table(framework), f"{page.name}'s metric table drifted: run `bloggap report`"
    for name in names(framework):  # every registered key is documented, gap/sampler/is_ratio_* included
        assert sum(f"| `{name}` |" in line for line in block) == 1, name


def test_regenerating_the_docs_changes_nothing_else():
    for page, text in generated_docs_texts(ROOT / "docs").items():
        assert text == page.read_text(encoding="utf-8"), page


def test_a_page_without_its_markers_fails_naming_them(tmp_path):
    (tmp_path / "trl.md").write_text("# no table\n")
    (tmp_path / "verl.md").write_text("x\n")
    with pytest.raises(ReportError, match=r"trl\.md: expected the line <!-- bloggap:metrics:trl:start --> once"):
        generated_docs_texts(tmp_path)
    start, end = metric_table_markers("verl")
    assert replace_headline_block(f"a\n{start}\nold\n{end}\nb", ["new"], "x", (start, end)) == f"a\n{start}\nnew\n{end}\nb"


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_key_the_code_writes_is_registered(framework):
    written = set()
    for relative in WRITERS[framework]:
        tree = ast.parse((ROOT / "bloggap_plugin" / relative).read_text())
        written |= {node.value for node in ast.walk(tree)
                    if isinstance(node, ast.Constant) and isinstance(node.value, str) and KEY.fullmatch(node.value)}
    assert written, framework
    assert written <= set(names(framework)), sorted(written - set(names(framework)))


def test_the_registry_is_consistent():
    keys = [(s.framework, s.name) for s in METRIC_SPECS]
    assert len(keys) == len(set(keys))
    for spec in METRIC_SPECS:
        assert KEY.fullmatch(spec.name) and spec.framework in FRAMEWORKS and spec.definition and spec.logged
        assert spec.needs <= set(NEEDS), spec.name
        assert spec.unit in {"fraction", "nats", "ratio", "tokens", "count", "seconds", "code"}, spec.name
    for framework in FRAMEWORKS:  # the gap and the update carry the same statistics, the update only after a step
        gap = [n.split("/")[-1] for n in names(framework) if n.startswith("gap/ratio/")]
        update = [n.split("/")[-1] for n in names(framework) if n.startswith("gap/update/")]
        assert gap == update and gap
        assert not [n for n in names(framework, needs=set()) if n.startswith("gap/update/")]
    assert ratio_name("oob_frac", True, "trl") == "gap/update/oob_frac"
    assert ratio_name("oob_frac", False, "verl") == "gap/ratio/oob_frac"
    with pytest.raises(KeyError, match="'gap/update/exact_frac' is not a registered verl gap/\\* metric"):
        ratio_name("exact_frac", True, "verl")
    with pytest.raises(ValueError, match="unknown framework 'vllm'"):
        names("vllm")


def test_the_trl_stats_refuse_an_unregistered_name():
    from collections import defaultdict
    from types import SimpleNamespace

    from bloggap_plugin.trl.stats import Stats

    store: dict = defaultdict(list)  # TRL's metric store
    stats = Stats(SimpleNamespace(_metrics={"train": store}), None, None)
    stats.log({"gap/ratio/oob_frac": 0.5})
    assert store == {"gap/ratio/oob_frac": [0.5]}
    with pytest.raises(KeyError, match="'gap/ratio/typo' is not a registered trl"):
        stats.log({"gap/ratio/typo": 1.0})
    assert registered("gap/verl/all_rejected", "verl") == "gap/verl/all_rejected"


def test_the_clip_statistics_split_like_the_ratio():
    """``gap/clip/*`` (no optimizer step since the old log-probs) and ``gap/update_clip/*`` (after one) carry the same
    statistics, the latter only with an optimizer step, in both adapters."""
    from bloggap_plugin.core.metric_specs import clip_name

    for framework in FRAMEWORKS:
        first = [n.split("/")[-1] for n in names(framework) if n.startswith("gap/clip/")]
        later = [n.split("/")[-1] for n in names(framework) if n.startswith("gap/update_clip/")]
        assert first == later and sorted(first) == ["clipped_frac", "flip_frac"]
        for name in names(framework):
            if name.startswith("gap/update_clip/"):
                assert "update" in next(s.needs for s in METRIC_SPECS if s.name == name and s.framework == framework)
    assert clip_name("flip_frac", True, "trl") == "gap/update_clip/flip_frac"
    assert clip_name("clipped_frac", False, "verl") == "gap/clip/clipped_frac"
    with pytest.raises(KeyError, match="'gap/update_clip/typo' is not a registered trl"):
        clip_name("typo", True, "trl")
