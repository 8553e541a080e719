"""README.md's commands, run as written (extracted from its code blocks, so the README and this test cannot drift):
the quick ones in full on the CPU, the long ones (`bloggap train`, `bloggap compare`) up to the point where their
input is checked and the model would load."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
from _support import ROOT
from _support.events import HANG_S

README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```", README, flags=re.S | re.M)


def _commands(prefix: str) -> list[list[str]]:
    """The README's shell lines starting with ``prefix``, comments and an output redirect removed, as argv."""
    lines = [line.split("#", 1)[0].split(">", 1)[0].strip() for lang, block in BLOCKS if lang == ""
             for line in block.splitlines()]
    return [shlex.split(line)[1:] for line in lines if line.startswith(prefix + " ")]


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}


def test_the_readme_names_the_commands_this_test_runs():
    doctor, train, compare = (_commands(f"bloggap {name}") for name in ("doctor", "train", "compare"))
    assert ["doctor", "--from-json", "benchmarks/results/h200/doctor.json"] in doctor
    assert train and compare
    assert [lang for lang, _ in BLOCKS].count("python") == 1


def test_the_readmes_stored_doctor_command_runs_as_written(spawns):
    (argv,) = [a for a in _commands("bloggap doctor") if "--from-json" in a]
    proc = subprocess.run([sys.executable, "-m", "bloggap_plugin.cli", *argv], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "recommend" in proc.stdout.lower(), proc.stdout[-2000:]


@pytest.mark.parametrize("argv", _commands("bloggap train") + _commands("bloggap compare"),
                         ids=lambda argv: argv[0])
def test_the_readmes_train_and_compare_commands_pass_their_checks(bloggap, tmp_path, monkeypatch, argv):
    """Every flag is known and every value accepted: the command gets as far as loading the model (train) or
    starting its runs (compare), which the test stops."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    if argv[0] == "compare":
        import bloggap_plugin.compare.sweep as sweep

        def stop(*args, **kwargs):
            raise AssertionError("a model was loaded")

        monkeypatch.setattr(sweep, "_launch", stop)
    with pytest.raises(AssertionError, match="a model was loaded"):
        bloggap(*argv)


def test_the_readmes_callback_snippet_runs_as_written(tmp_path, spawns):
    """The Python block, verbatim, in a fresh folder holding the recipes: two steps on the tiny offline model."""
    (snippet,) = [block for lang, block in BLOCKS if lang == "python"]
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    (tmp_path / "snippet.py").write_text(snippet)
    proc = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "gap/ratio/" in proc.stdout + proc.stderr
