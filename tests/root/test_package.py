"""The package root: a cheap import, a small lazy public API that IDEs and type checkers see."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest
from _support import ROOT
from _support.events import HANG_S

import bloggap_plugin

PUBLIC = ["GapCallback", "GapConfig", "GapGRPOTrainer", "GapMixin", "load_model", "load_recipe", "make_plan",
          "token_logprobs"]


def _modules_after(statement: str) -> set[str]:
    """Top-level names in ``sys.modules`` after running ``statement`` in a fresh interpreter on this checkout."""
    code = f"import sys, json; {statement}; print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=HANG_S,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr
    return set(json.loads(run.stdout.strip().splitlines()[-1]))


def test_import_bloggap_plugin_imports_neither_trl_nor_verl_nor_transformers(spawns):
    loaded = _modules_after("import bloggap_plugin; bloggap_plugin.__version__")
    assert "bloggap_plugin" in loaded
    heavy = loaded & {"trl", "verl", "transformers", "vllm", "torch"}
    assert not heavy, sorted(heavy)


def test_the_check_sees_a_heavy_import(spawns):
    """The subprocess check above can fail: asking for a public name imports its module (and torch) then."""
    loaded = _modules_after("import bloggap_plugin; bloggap_plugin.token_logprobs")
    assert {"torch", "bloggap_plugin"} <= loaded and "trl" not in loaded


def test_public_api_is_the_small_user_set_and_every_name_resolves():
    assert bloggap_plugin.__all__ == sorted(PUBLIC) + ["__version__"]
    assert sorted(bloggap_plugin._LAZY) == sorted(PUBLIC)
    for name in PUBLIC:
        value = getattr(bloggap_plugin, name)
        assert value.__name__ == name, name
    with pytest.raises(AttributeError, match="no attribute 'oob_fraction'"):
        bloggap_plugin.oob_fraction  # noqa: B018 - metric helpers live in bloggap_plugin.core.metrics
    from bloggap_plugin.core.metrics import oob_fraction, wilson_interval

    assert callable(oob_fraction) and callable(wilson_interval)


def test_type_checking_block_imports_every_public_name_from_where_the_lazy_table_points():
    """IDEs and type checkers read the ``if TYPE_CHECKING:`` imports; they must match the runtime table."""
    tree = ast.parse((ROOT / "bloggap_plugin" / "__init__.py").read_text())
    seen = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom), ast.dump(stmt)
                seen.update({alias.name: stmt.module for alias in stmt.names})
    assert seen == bloggap_plugin._LAZY
