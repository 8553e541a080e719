"""Hostile input: every YAML a user hands in is bounded (size, nesting, aliases, expansion), a file name read from a
file is confined to the folder the user named, every output stays under the folder asked for, result-document text
cannot break out of the generated Markdown, and no work-folder file is unpickled."""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest
from _support import ROOT
from _support.cli import RECIPES, assert_one_line_error

ARM_A = (RECIPES / "arm_A.yaml").read_text()


def _alias_bomb(levels: int = 6, width: int = 10) -> str:
    """A YAML flow list whose last item expands to ``width ** levels`` values through aliases."""
    items = [f"&l0 [{', '.join(['x'] * width)}]"]
    items += [f"&l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels + 1)]
    return "[" + ", ".join(items) + "]"


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# Deep enough that PyYAML's recursive composer (two frames a level) would exceed the recursion limit without the
# bound (it fails near 500 levels under the default limit of 1000), and no deeper: the scanner's cost grows with it.
DEEP = sys.getrecursionlimit() * 3 // 5


@pytest.mark.parametrize("value", [_alias_bomb(), "&a [*a]", _nested(DEEP)], ids=["aliases", "recursive", "deep"])
def test_config_file_yaml_is_bounded(bloggap, tmp_path, value):
    """--config: an alias bomb, a self-reference and deep nesting are refused in one short line that quotes none
    of the value (before: the bomb's repr in the error, the deep list a RecursionError traceback)."""
    path = tmp_path / "doctor.yaml"
    path.write_text(f"num_seqs: {value}\n")
    line = assert_one_line_error(bloggap("doctor", "--config", path), str(path))
    assert len(line) < 400 and "'x'" not in line


def test_recipe_yaml_is_bounded(bloggap, tmp_path):
    recipe = tmp_path / "bomb.yaml"
    recipe.write_text(ARM_A.replace("learning_rate: 2.0e-6", f"learning_rate: {_alias_bomb()}"))
    line = assert_one_line_error(bloggap("train", recipe, "--model", "tiny-random-llama", "--device", "cpu",
                                         "--output-dir", tmp_path / "out"), "aliases")
    assert len(line) < 400


def test_inline_mapping_yaml_is_bounded(bloggap, tmp_path):
    """--gap-overrides and the other YAML mapping flags go through the same loader."""
    bomb = "{band: " + _alias_bomb() + "}"
    code, out, err = bloggap("train", RECIPES / "arm_A.yaml", "--model", "tiny-random-llama", "--device", "cpu",
                             "--output-dir", tmp_path / "out", "--gap-overrides", bomb)
    assert code == 2 and "Traceback" not in err and "aliases" in err and len(err) < 1200, err


def test_bounded_loader_reads_ordinary_yaml_and_a_few_aliases():
    from bloggap_plugin._input_files import load_yaml

    assert load_yaml("base: &b {lr: 1.0e-6}\nrun: *b\nlist: [1, 2]\n", "x") == {
        "base": {"lr": 1.0e-6}, "run": {"lr": 1.0e-6}, "list": [1, 2]}
    assert load_yaml("", "x") is None


# --- bloggap patch: paths read from the patch stay under --root ----------------------------------------------------

OUTSIDE_PATCH = """escape
--- a/../outside.py
+++ b/../outside.py
@@ -1,1 +1,1 @@
-old = 1
+new = 2
"""


@pytest.mark.parametrize("name", ["../outside.py", "/ABS/outside.py", "link/outside.py"])
def test_patch_apply_never_writes_outside_root(tmp_path, capsys, name):
    """A ``+++ b/../x.py`` (or absolute, or through a link out of the root) path is refused and the file outside
    is untouched (before: rewritten)."""
    from bloggap_plugin.cli import main

    root, patches = tmp_path / "site", tmp_path / "patches"
    root.mkdir()
    patches.mkdir()
    outside = tmp_path / "outside.py"
    outside.write_text("old = 1\n")
    (root / "link").symlink_to(tmp_path)
    target = name.replace("/ABS", str(tmp_path))
    (patches / "support_size_replay.patch").write_text(OUTSIDE_PATCH.replace("../outside.py", target))
    code = main(["patch", "verl", "--apply", "--root", str(root), "--patch-dir", str(patches)])
    err = capsys.readouterr().err
    assert code != 0 and "outside --root" in err, err
    assert outside.read_text() == "old = 1\n"


# --- outputs stay under --output-dir ---------------------------------------------------------------------------


def test_report_to_wandb_writes_under_output_dir(tmp_path, monkeypatch, trains):
    """The trainer's wandb folder goes under --output-dir (WANDB_DIR), not into the current folder; a WANDB_DIR the
    user set is kept; nothing is left set after the run."""
    pytest.importorskip("wandb")
    from bloggap_plugin.trl import run as run_module

    seen = []
    monkeypatch.setattr(run_module, "_train", lambda plan: seen.append(os.environ.get("WANDB_DIR")) or {})
    monkeypatch.delenv("WANDB_DIR", raising=False)
    out = tmp_path / "out"
    run_module.run_training(RECIPES / "arm_A.yaml", model="tiny-random-llama", device="cpu", output_dir=str(out),
                            report_to=["wandb"])
    assert seen == [str(out.resolve())] and "WANDB_DIR" not in os.environ
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "mine"))
    run_module.run_training(RECIPES / "arm_A.yaml", model="tiny-random-llama", device="cpu", output_dir=str(out),
                            report_to=["wandb"])
    assert seen[-1] == str(tmp_path / "mine")


# --- generated Markdown ----------------------------------------------------------------------------------------


HOSTILE = "T\n# Injected heading\n<script>alert(1)</script> | x"


def test_report_markdown_escapes_result_text(tmp_path):
    """A title, cell, note, column or benchmark name holding newlines, HTML or a pipe stays inline text in
    BENCHMARKS.md: no new heading, no raw HTML, no extra table column."""
    import json

    from bloggap_plugin.report_builder import build_report

    table = {"id": "T1", "title": HOSTILE, "columns": ["name", HOSTILE], "rows": [[HOSTILE, 1.5]], "notes": HOSTILE,
             "reference": None, "random_init": False, "plot": False}
    document = {"benchmark": "tables", "schema_version": 1, "env": {"gpu": HOSTILE}, "params": {}, "results": {},
                "tables": [table]}
    (tmp_path / "results" / "dev").mkdir(parents=True)
    (tmp_path / "results" / "dev" / "tables.json").write_text(json.dumps(document))
    output = tmp_path / "B.md"
    build_report(tmp_path / "results", output, None)
    text = output.read_text()
    assert "<script>" not in text and "&lt;script&gt;" in text
    assert not any(line.startswith("# Injected") for line in text.splitlines())
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows and all(line.replace("\\|", "").count("|") == 3 for line in rows), rows


# --- no unpickling of files from a work folder -----------------------------------------------------------------


def test_every_torch_load_refuses_pickled_objects():
    """Each ``torch.load`` in the package and the benchmark scripts passes ``weights_only=True`` (a work folder's
    ``.pt`` file must not run code when read)."""
    offenders, calls = [], 0
    for path in sorted([*(ROOT / "bloggap_plugin").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]):
        text = path.read_text()
        # A torch.load call spells the names torch and load; an ASCII file without both strings holds none and is not
        # parsed (a file that is not ASCII always is: Python folds some other characters into these names).
        if text.isascii() and ("torch" not in text or "load" not in text):
            continue
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
                calls += 1
                flag = next((k.value for k in node.keywords if k.arg == "weights_only"), None)
                if not (isinstance(flag, ast.Constant) and flag.value is True):
                    offenders.append(f"{Path(path).relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders
    assert calls > 0, "no torch.load found: has the screen above dropped the files that call it?"
