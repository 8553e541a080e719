"""`bloggap patch verl`: exact (no fuzz), all-or-nothing apply and revert, on copies of verl's files (the installed
verl is only ever checked, never modified)."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat

import pytest

from bloggap_plugin.cli import main
from bloggap_plugin.commands import patch as patch_cmd
from bloggap_plugin.commands.patch import package_root, patch_files

pytest.importorskip("verl")

FILES = (
    "verl/workers/rollout/vllm_rollout/vllm_async_server.py",
    "verl/experimental/agent_loop/single_turn_agent_loop.py",
    "verl/trainer/ppo/v1/agent_loop_tq.py",
)


def _digest(root):
    return {f: hashlib.sha256(open(os.path.join(root, f), "rb").read()).hexdigest() for f in FILES}


def _tree(root):
    """Every file under ``root`` with its bytes and mode (catches edits, .orig/.rej and temporary files)."""
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            out[os.path.relpath(path, root)] = (open(path, "rb").read(), stat.S_IMODE(os.stat(path).st_mode))
    return out


@pytest.fixture
def copy_root(tmp_path):
    """A folder holding copies of the three verl 0.9.1 files the patch touches (pristine)."""
    root = package_root("verl")
    for f in FILES:
        os.makedirs(tmp_path / os.path.dirname(f), exist_ok=True)
        shutil.copy(os.path.join(root, f), tmp_path / f)
    return tmp_path


def _cli(*args, root):
    return main(["patch", "verl", *args, "--root", str(root)])


def test_check_succeeds_against_installed_verl_and_modifies_nothing(capsys):
    root = package_root("verl")
    before = _digest(root)
    assert main(["patch", "verl", "--check"]) == 0
    assert "applies cleanly" in capsys.readouterr().out
    assert _digest(root) == before


def test_apply_then_revert_restores_the_original_bytes(copy_root, capsys):
    original = _tree(copy_root)
    assert _cli("--check", root=copy_root) == 0
    assert "applies cleanly" in capsys.readouterr().out
    assert _cli("--apply", root=copy_root) == 0
    patched = _tree(copy_root)
    assert sorted(patched) == sorted(original)  # no .orig, .rej or temporary file
    text = (copy_root / FILES[2]).read_text()
    assert 'field["rollout_support_size"] = rollout_support_size' in text
    assert 'extra_fields["support_sizes"]' in (copy_root / FILES[0]).read_text()
    for f in FILES:
        compile((copy_root / f).read_text(), f, "exec")  # still valid Python
        assert patched[f][1] == original[f][1]  # mode kept
    capsys.readouterr()
    # already applied: --check says so and is not clean, --apply is a no-op
    assert _cli("--check", root=copy_root) == 1
    out = capsys.readouterr()
    assert "already applied" in out.out + out.err and "applies cleanly" not in out.out
    assert _cli("--apply", root=copy_root) == 0
    assert _tree(copy_root) == patched
    # revert: bytes identical to the original
    assert _cli("--revert", root=copy_root) == 0
    assert _tree(copy_root) == original
    assert _cli("--revert", root=copy_root) == 0  # nothing to revert
    assert _tree(copy_root) == original


def test_read_only_target_changes_nothing(copy_root, capsys):
    os.chmod(copy_root / FILES[1], 0o444)
    before = _tree(copy_root)
    assert _cli("--apply", root=copy_root) == 1
    err = capsys.readouterr().err
    assert FILES[1] in err and "read-only" in err and "nothing changed" in err, err
    assert _tree(copy_root) == before
    assert _cli("--check", root=copy_root) == 1  # --apply would refuse, so --check is not clean
    # revert is all or nothing too
    os.chmod(copy_root / FILES[1], 0o644)
    assert _cli("--apply", root=copy_root) == 0
    os.chmod(copy_root / FILES[0], 0o444)
    patched = _tree(copy_root)
    assert _cli("--revert", root=copy_root) == 1
    assert _tree(copy_root) == patched


def test_failure_while_writing_rolls_back_every_file(copy_root, monkeypatch, capsys):
    before = _tree(copy_root)
    real_write = patch_cmd.atomic_write_bytes
    calls = []

    def failing_write(path, data):
        calls.append(str(path))
        if len(calls) == 3:  # the third target: disk full
            raise OSError(28, "No space left on device")
        return real_write(path, data)

    monkeypatch.setattr(patch_cmd, "atomic_write_bytes", failing_write)
    assert _cli("--apply", root=copy_root) == 1
    err = capsys.readouterr().err
    assert "No space left on device" in err and "rolled back" in err, err
    assert _tree(copy_root) == before
    assert len(calls) == 3 + 2  # three writes attempted, then the two written files restored


def test_locally_edited_target_is_not_clean_and_apply_refuses(copy_root, capsys):
    path = copy_root / FILES[1]
    text = path.read_text()
    # an edit inside the hunk's context: GNU patch applies this with fuzz 1 and leaves a .orig file
    edited = text.replace("# keeping the schema consistent with tool_agent_loop", "# keep the schema like tool_agent_loop")
    assert edited != text
    path.write_text(edited)
    before = _tree(copy_root)
    assert _cli("--check", root=copy_root) == 1
    out = capsys.readouterr()
    assert "applies cleanly" not in out.out
    assert FILES[1] in out.err and "locally edited" in out.err, out.err
    assert _cli("--apply", root=copy_root) == 1
    assert _tree(copy_root) == before
    # an edit that shifts the lines (GNU patch: "succeeded with offset")
    path.write_text("# local note\n" + text)
    assert _cli("--check", root=copy_root) == 1
    assert _cli("--apply", root=copy_root) == 1
    assert path.read_text() == "# local note\n" + text


def test_half_patched_tree_is_refused_and_revert_brings_it_back(copy_root, capsys):
    original = _tree(copy_root)
    assert _cli("--apply", root=copy_root) == 0
    patched_one = (copy_root / FILES[2]).read_bytes()
    for f in FILES:  # back to pristine, except one file: what the old --apply left when another was read-only
        (copy_root / f).write_bytes(original[f][0])
    (copy_root / FILES[2]).write_bytes(patched_one)
    half = _tree(copy_root)
    capsys.readouterr()
    assert _cli("--check", root=copy_root) == 1
    assert "half" in capsys.readouterr().err
    assert _cli("--apply", root=copy_root) == 1
    assert _tree(copy_root) == half
    assert _cli("--revert", root=copy_root) == 0
    assert _tree(copy_root) == original


def test_missing_target_is_one_line(copy_root, capsys):
    os.remove(copy_root / FILES[0])
    assert _cli("--check", root=copy_root) == 1
    err = capsys.readouterr().err.strip()
    assert FILES[0] in err and "not found" in err and len(err.splitlines()) == 1, err


def test_one_patch_file_ships():
    assert [os.path.basename(p) for p in patch_files("verl")] == ["support_size_replay.patch"]


def test_hunks_apply_exactly_and_keep_other_bytes():
    from bloggap_plugin.commands.patch import apply_hunks, parse_unified_diff

    diff = "--- a/x.py\n+++ b/x.py\n@@ -2,2 +2,3 @@\n b = 2\n+c = 3\n d = 4\n"
    (file_patch,) = parse_unified_diff(diff, "t.patch")
    original = b"a = '\x0c\xe2\x80\xa8'\nb = 2\nd = 4\ne = 5"  # form feed, U+2028, no final newline
    patched = apply_hunks(original, file_patch.hunks)
    assert patched == b"a = '\x0c\xe2\x80\xa8'\nb = 2\nc = 3\nd = 4\ne = 5"
    assert apply_hunks(patched, [h.reversed() for h in file_patch.hunks]) == original
    assert apply_hunks(patched, file_patch.hunks) is None  # already applied: the context no longer matches
    assert apply_hunks(b"a\nb = 2\r\nd = 4\n", file_patch.hunks) is None  # CRLF line: not an exact match
    assert apply_hunks(b"z\n" + original, file_patch.hunks) is None  # shifted by a line: no offset
