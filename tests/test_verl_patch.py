"""`bloggap patch verl`: the support-size diff applies to the installed verl 0.9.1 (checked, never applied there)."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from bloggap_plugin.cli import main
from bloggap_plugin.commands.patch import package_root, patch_files

pytest.importorskip("verl")
if shutil.which("patch") is None:
    pytest.skip("the patch program is not installed", allow_module_level=True)

FILES = (
    "verl/workers/rollout/vllm_rollout/vllm_async_server.py",
    "verl/experimental/agent_loop/single_turn_agent_loop.py",
    "verl/trainer/ppo/v1/agent_loop_tq.py",
)


def _digest(root):
    return {f: hashlib.sha256(open(os.path.join(root, f), "rb").read()).hexdigest() for f in FILES}


def test_check_succeeds_against_installed_verl_and_modifies_nothing(capsys):
    root = package_root("verl")
    before = _digest(root)
    assert main(["patch", "verl", "--check"]) == 0
    assert "applies cleanly" in capsys.readouterr().out
    assert _digest(root) == before


def test_apply_on_a_copy_then_check_reports_applied(tmp_path, capsys):
    root = package_root("verl")
    for f in FILES:
        os.makedirs(tmp_path / os.path.dirname(f), exist_ok=True)
        shutil.copy(os.path.join(root, f), tmp_path / f)
    assert main(["patch", "verl", "--apply", "--root", str(tmp_path)]) == 0
    text = (tmp_path / FILES[2]).read_text()
    assert 'field["rollout_support_size"] = rollout_support_size' in text
    assert 'extra_fields["support_sizes"]' in (tmp_path / FILES[0]).read_text()
    compile((tmp_path / FILES[0]).read_text(), FILES[0], "exec")  # still valid Python
    compile(text, FILES[2], "exec")
    assert main(["patch", "verl", "--check", "--root", str(tmp_path)]) == 0
    assert "already applied" in capsys.readouterr().out
    # a file that does not match fails loudly
    (tmp_path / FILES[1]).write_text("# not verl\n")
    shutil.copy(os.path.join(root, FILES[0]), tmp_path / FILES[0])
    assert main(["patch", "verl", "--check", "--root", str(tmp_path)]) == 1
    assert len(patch_files("verl")) == 1
