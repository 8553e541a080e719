"""`bloggap train` as a user runs it, in its own process on the tiny model: stdout is the summary alone, Ctrl-C
keeps the summary of what finished, a run without --max-steps says how long it will take, reporting integrations
write offline, beta > 0 needs no hub, and the hub flag is set before huggingface_hub reads it. Each run is shared
by the tests that check it (a module fixture); a subprocess is waited on by event (see ``_support.events``)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from _support import ROOT
from _support.cli import RECIPES
from _support.events import HANG_S, complete_lines, restore_sigint, wait_for
from _support.forked_cases import run_forked

ARM_A = str(RECIPES / "arm_A.yaml")
TINY = ("--model", "tiny-random-llama")


def _train(folder: Path, *extra: str, env: dict | None = None, stderr=subprocess.PIPE) -> subprocess.Popen:
    """``bloggap train`` on the tiny model in a subprocess that Ctrl-C stops (see :func:`restore_sigint`)."""
    env = env or {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    return subprocess.Popen([sys.executable, "-m", "bloggap_plugin.cli", "train", ARM_A, *TINY, "--output-dir",
                             str(folder / "o"), *extra], cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=stderr, text=True, preexec_fn=restore_sigint)


def _finish(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, spawns):
    """Two steps with beta 0.04, a step log and, where both are installed, ``--report-to wandb tensorboard`` (no
    wandb key, no login, WANDB_MODE unset): the run's stdout, stderr, logged records, folder and whether it
    reported. One run serves the tests of the summary, the reference model, the positions and the integrations."""
    import importlib.util

    folder = tmp_path_factory.mktemp("two_steps")
    log = folder / "run.jsonl"
    reported = all(importlib.util.find_spec(name) for name in ("wandb", "tensorboard"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HF_HUB_OFFLINE="1", WANDB_DIR=str(folder), HOME=str(folder))  # no netrc login either
    report = ("--report-to", "wandb", "tensorboard") if reported else ()
    proc = _train(folder, "--max-steps", "2", "--beta", "0.04", "--log-jsonl", str(log), *report, env=env)
    out, err = _finish(proc)
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
    return SimpleNamespace(out=out, err=err, records=[json.loads(line) for line in complete_lines(log)],
                           folder=folder, reported=reported)


def test_stdout_is_the_summary_json_alone(two_steps):
    summary = json.loads(two_steps.out)
    assert summary["steps"] == 2 and summary["interrupted"] is False and "loss" in two_steps.err  # logs on stderr


def test_beta_with_a_built_in_model_takes_the_reference_from_the_policy_offline(two_steps):
    """beta > 0: TRL 1.16 rebuilds the reference model from the policy's name as a hub id (an OSError offline, for a
    built-in or local model); bloggap train gives it a frozen copy of the policy as loaded instead, so the KL term
    runs offline and starts at 0 (policy and reference equal before the first update)."""
    records = two_steps.records
    assert len(records) == 2 and records[0]["kl"] == 0.0 and all(math.isfinite(r["kl"]) for r in records)


def test_a_tiny_model_run_of_the_default_task_stays_within_its_positions(two_steps):
    """The tiny models' character tokenizer makes the task's chat prompts long: prompt plus completion must fit the
    model's positions, so transformers' "exceeded the model's predefined maximum length" reminder never fires."""
    assert "predefined maximum length" not in two_steps.err, two_steps.err[-3000:]


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory, spawns):
    """A run without --max-steps (the recipe's epochs: thousands of steps), stopped by Ctrl-C once it has logged two
    steps: its exit code, stdout, stderr and logged records."""
    folder = tmp_path_factory.mktemp("interrupted")
    log, err_path = folder / "run.jsonl", folder / "stderr.txt"
    with err_path.open("w") as stderr:
        proc = _train(folder, "--log-jsonl", str(log), stderr=stderr)
        try:
            wait_for(lambda: len(complete_lines(log)) >= 2, proc, "two logged steps")
            proc.send_signal(signal.SIGINT)
        finally:
            out, _ = _finish(proc)
    return SimpleNamespace(code=proc.returncode, out=out, err=err_path.read_text(),
                           records=[json.loads(line) for line in complete_lines(log)])


def _planned_steps(err: str) -> int:
    planned = [line for line in err.splitlines() if "optimizer steps (no --max-steps" in line]
    assert len(planned) == 1, err[-2000:]
    return int(planned[0].split("bloggap train: ")[1].split()[0])


def test_an_interrupted_train_prints_the_summary_of_what_finished(interrupted):
    err = interrupted.err
    assert interrupted.code == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    summary = json.loads(interrupted.out)
    assert summary["interrupted"] is True and 1 <= summary["steps"] < _planned_steps(err)
    assert summary["steps"] >= max(r["step"] for r in interrupted.records)
    assert math.isfinite(summary["train_loss"]) if summary["train_loss"] is not None else True
    assert "interrupted" in err.strip().splitlines()[-1]


def test_leaving_out_max_steps_says_how_many_steps_and_how_long(interrupted):
    """Without --max-steps the recipe (arm_A: no max_steps) trains for its epochs over the task's prompts, thousands
    of steps: the run says how many, and after the first step about how long, on stderr; Ctrl-C still summarises."""
    err = interrupted.err
    assert interrupted.code == 130, err[-3000:]
    assert _planned_steps(err) > 100
    assert sum("the first step took" in line for line in err.splitlines()) == 1
    assert json.loads(interrupted.out)["interrupted"] is True


def test_report_to_wandb_without_an_api_key_runs_offline(two_steps):
    """The README's wandb command with no key and WANDB_MODE unset: offline by default (the project's promise), not
    wandb's UsageError after the model loaded."""
    if not two_steps.reported:
        pytest.skip("wandb or tensorboard is not installed")
    assert list(two_steps.folder.glob("wandb/offline-run-*")), "no offline wandb run was written"


def test_report_to_two_integrations_writes_both_offline(two_steps):
    """`--report-to wandb tensorboard` with no wandb key: one run, a wandb offline run and tensorboard events."""
    if not two_steps.reported:
        pytest.skip("wandb or tensorboard is not installed")
    assert list(two_steps.folder.glob("wandb/offline-run-*")), "no offline wandb run was written"
    assert list((two_steps.folder / "o").rglob("events.out.tfevents.*")), "no tensorboard events were written"


_HUB_FLAG_SETUP = ("import pandas, scipy.optimize, torch, torch._dynamo\n"
                   "from bloggap_plugin import cli")
"""What every case's TRL import loads that reads no hub flag: loaded once, before the cases' processes fork."""
_HUB_FLAG_PROBE = ("rc = cli.main({argv!r}); import huggingface_hub.constants as c; "
                   "print('offline', c.HF_HUB_OFFLINE, rc)")
"""Runs ``bloggap ARGV`` (refused: --max-steps=0) and prints whether huggingface_hub came up offline."""

_ARGV_CASES = [(), ("--model", "someorg/somemodel")]
"""Extra ``bloggap train`` arguments of the command-line cases."""
_CONFIG_CASES = [("someorg/somemodel", (), "False"), ("tiny-random-llama", (), "True"),
                 ("someorg/somemodel", ("--model", "tiny-random-llama"), "True")]
"""``--config`` file cases: the file's model, extra arguments, the hub library's expected HF_HUB_OFFLINE."""


@pytest.fixture(scope="module")
def hub_flags(tmp_path_factory, spawns) -> SimpleNamespace:
    """``"offline <flag> <exit>"`` of every case (``argv``: by its extra arguments; ``config``: by its index in
    :data:`_CONFIG_CASES`), or its stderr tail when it printed nothing. Each case runs in a process forked before
    the hub library loaded (:func:`run_forked`), so each reads the flag as ``bloggap train`` left it."""
    folder = tmp_path_factory.mktemp("hub_flags")
    extras = list(_ARGV_CASES)
    for number, (config_model, flags, _) in enumerate(_CONFIG_CASES):
        config = folder / f"c{number}.yaml"
        config.write_text(f"model: {config_model}\n")
        extras.append(("--config", str(config), *flags))
    env = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE")}
    cases = [({}, _HUB_FLAG_PROBE.format(argv=["train", ARM_A, *extra, "--max-steps=0"])) for extra in extras]
    runs = run_forked(folder, _HUB_FLAG_SETUP, cases, not_loaded=("huggingface_hub",), env=env)
    lines = [run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:] for run in runs]
    return SimpleNamespace(argv=dict(zip(_ARGV_CASES, lines)), config=lines[len(_ARGV_CASES):])


def test_train_is_offline_before_the_hub_library_reads_its_flag(hub_flags):
    """huggingface_hub reads HF_HUB_OFFLINE once, when it is imported, which building train's parser does (TRL's
    flags): the CLI must set it first, unless the user names a hub model."""
    assert hub_flags.argv[()] == "offline True 2"
    assert hub_flags.argv[("--model", "someorg/somemodel")] == "offline False 2"


@pytest.mark.parametrize("number", range(len(_CONFIG_CASES)),
                         ids=[f"{model}-{'-'.join(flags) or 'no flags'}-{offline}" for model, flags, offline in _CONFIG_CASES])
def test_a_config_file_naming_a_hub_model_gets_the_hub_as_model_does(hub_flags, number):
    """Offline was decided from argv's --model only: a --config file naming a hub model ran offline (and failed to
    find it), one naming a built-in model is offline; the command line's --model wins over the file's, as for
    every field."""
    offline = _CONFIG_CASES[number][2]
    assert hub_flags.config[number] == f"offline {offline} 2"
