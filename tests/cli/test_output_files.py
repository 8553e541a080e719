"""No data loss: an output flag never replaces a file its command did not write, a --save-final folder is locked and
written whole or not at all, SIGTERM stops `train` as Ctrl-C does, and an interrupted compare keeps every earlier
partial log."""

from __future__ import annotations

import errno
import json
import os
import signal
import time

import pytest
from _support.cli import RECIPES, assert_one_line_error, stored_doctor_json

USER_TEXT = "learning_rate: 1.0e-6  # the user's own recipe\n"


@pytest.mark.parametrize("command", [
    ("doctor", "--model", "tiny-random-llama", "--device", "cpu", "--no-progress", "--json"),
    ("ladder", "--model", "tiny-random-llama", "--device", "cpu", "--json"),
    ("attribute", "--model", "tiny-random-llama", "--device", "cpu", "--json"),
], ids=["doctor", "ladder", "attribute"])
def test_json_flag_never_replaces_a_file_it_did_not_write(bloggap, tmp_path, command):
    """Refused before anything loads, naming the file and the fix; the file is untouched."""
    target = tmp_path / "mine.yaml"
    target.write_text(USER_TEXT)
    assert_one_line_error(bloggap(*command, target), str(target), "not output of this command", "give a new path")
    assert target.read_text() == USER_TEXT


def test_doctor_json_replaces_its_own_earlier_file(tmp_path, capsys):
    from bloggap_plugin.cli import main

    source, target = tmp_path / "old.json", tmp_path / "new.json"
    source.write_text(json.dumps(stored_doctor_json()))
    assert main(["doctor", "--from-json", str(source), "--json", str(target)]) == 0
    assert main(["doctor", "--from-json", str(source), "--json", str(target)]) == 0  # its own file: replaced
    assert json.loads(target.read_text())["benchmark"] == "doctor"
    target.write_text(USER_TEXT)
    code = main(["doctor", "--from-json", str(source), "--json", str(target)])
    assert code == 2 and target.read_text() == USER_TEXT
    capsys.readouterr()


def test_report_output_never_replaces_a_file_it_did_not_write(tmp_path, capsys):
    from bloggap_plugin.cli import main

    device = tmp_path / "results" / "dev"
    device.mkdir(parents=True)
    table = {"id": "T1", "title": "t", "columns": ["a", "b"], "rows": [["x", 1]], "notes": "", "reference": None,
             "random_init": False, "plot": False}
    (device / "tables.json").write_text(json.dumps({"benchmark": "tables", "schema_version": 1, "env": {},
                                                    "params": {}, "results": {}, "tables": [table]}))
    target = tmp_path / "recipe.yaml"
    target.write_text(USER_TEXT)
    args = ["report", "--results", str(tmp_path / "results"), "--no-plots", "--readme", "none", "--output"]
    code = main([*args, str(target)])
    err = capsys.readouterr().err
    assert code == 2 and "not output of this command" in err and str(target) in err, err
    assert target.read_text() == USER_TEXT
    own = tmp_path / "B.md"
    assert main([*args, str(own)]) == 0 and main([*args, str(own)]) == 0  # its own report: replaced


# --- --save-final ----------------------------------------------------------------------------------------------


def _train(bloggap, tmp_path, *extra):
    return bloggap("train", RECIPES / "arm_A.yaml", "--model", "tiny-random-llama", "--device", "cpu",
                   "--output-dir", tmp_path / "out", *extra)


def test_save_final_refuses_a_folder_holding_other_files(bloggap, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"user": true}')
    assert_one_line_error(_train(bloggap, tmp_path, "--save-final", folder), str(folder), "config.json",
                          "new or empty folder")
    assert (folder / "config.json").read_text() == '{"user": true}'


def test_save_final_folder_is_locked_against_a_second_train(tmp_path, monkeypatch, trains):
    from bloggap_plugin._io import try_lock
    from bloggap_plugin.core.errors import UsageError
    from bloggap_plugin.trl import run as run_module

    monkeypatch.setattr(run_module, "_train", lambda plan: {"trained": True})
    folder = tmp_path / "final"
    settings = {"model": "tiny-random-llama", "device": "cpu", "save_final": str(folder)}
    assert run_module.run_training(RECIPES / "arm_A.yaml", output_dir=str(tmp_path / "a"), **settings) == {
        "trained": True}
    folder.mkdir(exist_ok=True)
    holder = try_lock(folder / ".bloggap-save.lock")  # what a first train holds while it runs
    try:
        with pytest.raises(UsageError, match=r"--save-final .*final: another bloggap train is writing into it"):
            run_module.run_training(RECIPES / "arm_A.yaml", output_dir=str(tmp_path / "b"), **settings)
    finally:
        holder.close()


class _Trainer:
    """A trainer whose ``save_model`` writes the files a save writes, the disk filling up at ``fail_at``."""

    def __init__(self, fail_at: str | None):
        self.fail_at = fail_at

    def save_model(self, folder: str) -> None:
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            with open(os.path.join(folder, name), "w") as handle:
                if name == self.fail_at:
                    raise OSError(errno.ENOSPC, "No space left on device")
                handle.write(f"{name} of the new save")


def test_save_final_is_whole_or_nothing(tmp_path):
    """A full disk mid-save leaves no 0-byte config.json and the previous save as it was; a good save replaces
    it whole."""
    from bloggap_plugin.trl.run import save_final

    folder = tmp_path / "final"
    assert save_final(_Trainer(None), folder) is None
    before = {p.name: p.read_text() for p in folder.iterdir()}
    for fail_at in ("config.json", "tokenizer.json"):
        problem = save_final(_Trainer(fail_at), folder)
        assert problem is not None and "No space left on device" in problem and str(folder) in problem
        assert {p.name: p.read_text() for p in folder.iterdir()} == before
    empty = tmp_path / "fresh"
    assert save_final(_Trainer("config.json"), empty) is not None
    assert list(empty.iterdir()) == []  # no 0-byte config.json, no temporary folder


# --- signals -----------------------------------------------------------------------------------------------------


class _Killed(Exception):
    """What SIGTERM raises in this test process outside ``bloggap train`` (instead of ending the test session)."""


def test_sigterm_stops_train_as_ctrl_c_does(bloggap, tmp_path, monkeypatch, capsys):
    """SIGTERM (what job schedulers send) mid-training: the summary of the finished steps on stdout, a line saying
    what stopped it, exit 143, and the previous SIGTERM handler back afterwards (before: the process was killed with
    nothing printed; here the test's own handler raises instead)."""
    from bloggap_plugin.trl import run as run_module

    def killed(signum, frame):
        raise _Killed

    def run_training(config):  # stands in for training: the signal arrives mid-run
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 60  # guards a hang only: the signal ends the wait
            while time.monotonic() < deadline:
                time.sleep(0.01)
        except KeyboardInterrupt:
            return {"steps": 3, "interrupted": True}
        return {"steps": 9, "interrupted": False}

    monkeypatch.setattr(run_module, "run_training", run_training)
    capsys.readouterr()  # what importing TRL printed ("[INFO] Running in WANDB offline mode"): not the command's
    previous = signal.signal(signal.SIGTERM, killed)
    try:
        code, out, err = _train(bloggap, tmp_path)
        assert signal.getsignal(signal.SIGTERM) is killed
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 143, (code, err)
    assert json.loads(out) == {"steps": 3, "interrupted": True}
    assert "stopped by SIGTERM after 3 optimizer step(s)" in err


# --- compare -----------------------------------------------------------------------------------------------------


def test_compare_keeps_every_partial_log(tmp_path, monkeypatch, spawns):
    """Two killed attempts of one run, then a resume: both unfinished logs are kept (before: the second
    `.partial` replaced the first)."""
    pytest.importorskip("matplotlib")
    from _support.compare_runs import FAKE_TRAIN, write_recipes

    from bloggap_plugin.compare import CompareConfig, run_compare

    module_dir = tmp_path / "fake_pkg"
    module_dir.mkdir()
    (module_dir / "fake_train.py").write_text(FAKE_TRAIN)
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls.jsonl"))
    monkeypatch.syspath_prepend(str(module_dir))
    for name in ("FAKE_HANG", "FAKE_CRASH", "FAKE_SLOW"):
        monkeypatch.delenv(name, raising=False)
    runs = tmp_path / "out" / "runs"
    runs.mkdir(parents=True)
    (runs / "A_s0.jsonl.partial").write_text('{"step": 1, "first": true}\n')
    (runs / "A_s0.20260101T000000-1-000001.part.jsonl").write_text('{"step": 1, "second": true}\n')
    config = CompareConfig(recipes=write_recipes(tmp_path, ("A",)), seeds=[0], max_steps=2, model="tiny-random-llama",
                           output_dir=str(tmp_path / "out"), run_fn="fake_train:run_training",
                           pythonpath=[str(module_dir)], poll_s=0.1)
    run_compare(config, echo=lambda line: None)
    kept = sorted(p.read_text() for p in runs.glob("A_s0.jsonl.partial*"))
    assert kept == ['{"step": 1, "first": true}\n', '{"step": 1, "second": true}\n']
