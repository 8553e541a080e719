"""bloggap compare's held-out evaluation (issue 15 item 4) and per-call time budget, with stand-in training and
evaluation functions whose numbers are closed forms of (arm, seed), so the expected table is known beforehand."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from _support import ROOT, python3_shim
from _support.compare_runs import compare_cli, install_fake_train, write_recipes
from _support.events import HANG_S

from bloggap_plugin.compare import CompareConfig, CompareError, run_compare

# Saves a "policy" (its arm and seed) where it is told to; the evaluation reads it back. Held-out accuracy:
# A 0.5 + 0.05 seed, B 0.6 + 0.1 seed. FAKE_EVAL_CRASH=<run id> makes that run's evaluation raise
# (FAKE_EVAL_CRASH_ONCE=<run id>: its first evaluation only).
FAKE_SAVING = '''
import json, os, yaml
from fake_train import run_training as _train

def run_training(recipe_path, *, model, task, max_steps, output_dir, report_to="none", seed, log_jsonl,
                 extra_overrides, task_kwargs=None, save_final=None, heldout=None):
    if heldout is not None:
        with open(os.environ["FAKE_CALLS"], "a") as f:
            f.write(json.dumps({"heldout_arg": heldout}) + "\\n")
    return run_training_narrow(recipe_path, model=model, task=task, max_steps=max_steps, output_dir=output_dir,
                               seed=seed, log_jsonl=log_jsonl, extra_overrides=extra_overrides,
                               task_kwargs=task_kwargs, save_final=save_final)

def run_training_narrow(recipe_path, *, model, task, max_steps, output_dir, report_to="none", seed, log_jsonl,
                        extra_overrides, task_kwargs=None, save_final=None):
    kwargs = dict(model=model, task=task, max_steps=max_steps, output_dir=output_dir, report_to=report_to, seed=seed,
                  log_jsonl=log_jsonl, extra_overrides=extra_overrides, task_kwargs=task_kwargs)
    result = _train(recipe_path, **kwargs)
    arm = yaml.safe_load(open(recipe_path))["gap"]["arm"]
    with open(os.environ["FAKE_CALLS"], "a") as f:
        f.write(json.dumps({"train_pid": [f"{arm}_s{seed}", os.getpid()]}) + "\\n")
    if save_final is not None:
        os.makedirs(save_final, exist_ok=True)
        with open(os.path.join(save_final, "policy.json"), "w") as handle:
            json.dump({"arm": arm, "seed": kwargs["seed"]}, handle)
    return result

def evaluate(model_dir, *, task, task_kwargs, seed, heldout_n, max_tokens, batch_size):
    policy = json.load(open(os.path.join(model_dir, "policy.json")))
    run_id = f"{policy['arm']}_s{policy['seed']}"
    with open(os.environ["FAKE_CALLS"], "a") as f:
        f.write(json.dumps({"eval": run_id, "n": heldout_n, "max_tokens": max_tokens, "batch": batch_size,
                            "eval_pid": [run_id, os.getpid()]}) + "\\n")
    if os.environ.get("FAKE_EVAL_CRASH") == run_id:
        raise RuntimeError("fake evaluation crash")
    if os.environ.get("FAKE_EVAL_CRASH_ONCE") == run_id and not os.path.exists(os.environ["FAKE_CALLS"] + ".eval_crashed"):
        open(os.environ["FAKE_CALLS"] + ".eval_crashed", "w").close()
        raise RuntimeError("fake evaluation crash, once")
    accuracy = {"A": 0.5 + 0.05 * seed, "B": 0.6 + 0.1 * seed}[policy["arm"]]
    return {"n": heldout_n, "correct": round(accuracy * heldout_n), "accuracy": accuracy, "seconds": 0.01}
'''


@pytest.fixture
def fake(tmp_path, monkeypatch):
    return install_fake_train(tmp_path, monkeypatch, fake_saving=FAKE_SAVING)


def _calls(fake, key: str) -> list:
    if not fake["calls"].exists():
        return []
    return [entry[key] for entry in map(json.loads, fake["calls"].read_text().splitlines()) if key in entry]


def _config(tmp_path, fake, **kw) -> CompareConfig:
    base = dict(recipes=write_recipes(tmp_path), seeds=[0, 1], task="arith", max_steps=4, model="tiny-random-llama",
                output_dir=str(tmp_path / "out"), parallel=2, last_n=2, run_fn="fake_saving:run_training",
                heldout_fn="fake_saving:evaluate", heldout_n=40, pythonpath=[fake["dir"]], poll_s=0.1)
    base.update(kw)
    return CompareConfig(**base)


def test_heldout_apart_evaluates_each_policy_in_a_fresh_process_with_the_same_results(tmp_path, fake, spawns):
    """``heldout_apart``: a run's evaluation starts in its own process once its training process has ended (whose
    GPU memory, vLLM's engine among it, is then free), and gives what the evaluation in the training process gives."""
    together = run_compare(_config(tmp_path, fake, output_dir=str(tmp_path / "together")), echo=lambda m: None)
    train_pids, eval_pids = dict(_calls(fake, "train_pid")), dict(_calls(fake, "eval_pid"))
    assert sorted(eval_pids) == ["A_s0", "A_s1", "B_s0", "B_s1"] and eval_pids == train_pids  # the default: in-process
    fake["calls"].unlink()
    messages = []
    apart = run_compare(_config(tmp_path, fake, output_dir=str(tmp_path / "apart"), heldout_apart=True),
                        echo=messages.append)
    assert apart["failed"] == {}
    train_pids, eval_pids = dict(_calls(fake, "train_pid")), dict(_calls(fake, "eval_pid"))
    assert sorted(eval_pids) == sorted(train_pids) == ["A_s0", "A_s1", "B_s0", "B_s1"]
    assert all(eval_pids[run] != train_pids[run] for run in eval_pids)
    assert sum(m.endswith(": evaluating") for m in messages) == 4
    assert apart["heldout"] == together["heldout"]
    assert not list((tmp_path / "apart").glob("trainer/*/final"))  # deleted once evaluated
    for run in ("A_s0", "B_s1"):
        stored = json.loads((tmp_path / "apart" / "runs" / f"{run}.heldout.json").read_text())
        marker = json.loads((tmp_path / "apart" / "runs" / f"{run}.jsonl").read_text().splitlines()[-1])
        assert stored["attempt"] == marker["attempt"]


def test_the_time_budgets_estimate_counts_an_apart_evaluation_with_its_training():
    """The next run's estimated length is the longest whole run of the call: training alone in-process, training
    plus evaluation apart (only once the evaluation has ended), never an evaluation of a run trained earlier."""
    from bloggap_plugin.compare.sweep import _RunClock

    clock = _RunClock()
    assert clock.estimate(None) is None and clock.estimate(7.0) == 7.0  # nothing ended: what earlier calls recorded
    clock.ended("A_s0", "train", 30.0, apart=True)
    assert clock.estimate(7.0) == 7.0  # its evaluation has not ended
    clock.ended("B_s0", "evaluate", 50.0, apart=True)  # trained in an earlier call: not a whole run of this one
    assert clock.estimate(7.0) == 7.0
    clock.ended("A_s0", "evaluate", 12.0, apart=True)
    assert clock.estimate(7.0) == 42.0
    clock.ended("C_s0", "train", 40.0, apart=False)  # evaluated in its training process: all in one
    assert clock.estimate(None) == 42.0 and clock.whole == [42.0, 40.0]


def test_heldout_accuracy_per_arm_with_paired_intervals_and_no_second_evaluation(tmp_path, fake, spawns):
    pytest.importorskip("matplotlib")
    config = _config(tmp_path, fake, seeds=[0, 1, 2])
    res = run_compare(config, echo=lambda m: None)
    assert res["failed"] == {}
    assert sorted(_calls(fake, "eval")) == ["A_s0", "A_s1", "A_s2", "B_s0", "B_s1", "B_s2"]
    assert set(_calls(fake, "n")) == {40} and set(_calls(fake, "max_tokens")) == {256}  # recipe has none: TRL's 256
    held = res["heldout"]["arms"]
    assert held["A"]["accuracy_per_seed"] == {0: pytest.approx(0.5), 1: pytest.approx(0.55), 2: pytest.approx(0.6)}
    assert held["B"]["delta_vs_base"] == {0: pytest.approx(0.1), 1: pytest.approx(0.15), 2: pytest.approx(0.2)}
    interval = held["B"]["delta_interval"]
    # three seeds, one arm compared: mean 0.15, sd 0.05, half-width t(0.975, 2) = 4.302653 (tables) x 0.05 / sqrt(3);
    # t = 0.15 / (0.05 / sqrt(3)) = 5.196 with 2 df; every sign positive: exact sign-flip p = 2 / 2^3
    assert interval["mean"] == pytest.approx(0.15)
    assert interval["half_width"] == pytest.approx(4.302653 * 0.05 / math.sqrt(3), rel=1e-6)
    assert interval["t"] == pytest.approx(3 * math.sqrt(3)) and interval["p_sign_flip"] == pytest.approx(0.25)
    out = Path(config.output_dir)
    table = {t["id"]: t for t in json.loads((out / "compare.json").read_text())["tables"]}["T10-heldout"]
    assert table["rows"][0][:3] == ["A", 3, 0.55] and table["rows"][1][:4] == ["B", 3, 0.7, "+0.100 / +0.150 / +0.200"]
    assert table["rows"][1][4].startswith("+0.150 [+0.0") and table["rows"][1][6] == 0.25 and table["rows"][1][7] == "40"
    assert "T10-heldout" in (out / "compare.md").read_text()
    assert not list(out.glob("trainer/*/final"))  # deleted once evaluated
    stored = json.loads((out / "runs" / "A_s0.heldout.json").read_text())
    trained = [json.loads(line) for line in (out / "runs" / "A_s0.jsonl").read_text().splitlines()][-1]
    assert stored["attempt"] == trained["attempt"] and stored["settings"]["n"] == 40
    messages = []
    again = run_compare(config, echo=messages.append)  # resume: nothing trains, nothing is evaluated again
    assert len(_calls(fake, "eval")) == 6 and len(_calls(fake, "run")) == 6
    assert again["heldout"] == res["heldout"]
    # A larger held-out set is another result, but the saved policies are gone: named, not trained again
    messages.clear()
    bigger = run_compare(dataclasses.replace(config, heldout_n=80), echo=messages.append)
    assert len(_calls(fake, "run")) == 6 and bigger["heldout"] is None
    assert sum("saved policy is gone" in m for m in messages) == 6


@pytest.mark.parametrize("apart", [False, True], ids=["in-process", "apart"])
def test_retries_evaluate_a_failed_evaluation_again_from_the_saved_policy_without_training(tmp_path, fake, monkeypatch,
                                                                                         spawns, apart):
    """``retries`` 1: a run whose evaluation failed once (in its training process, or apart) is evaluated again in
    the same call from the policy its training saved, and is not trained again."""
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("FAKE_EVAL_CRASH_ONCE", "B_s0")
    config = _config(tmp_path, fake, seeds=[0], parallel=1, retries=1, heldout_apart=apart)
    messages = []
    res = run_compare(config, echo=messages.append)
    assert sorted(_calls(fake, "run")) == ["A_s0", "B_s0"]  # neither trained again
    assert _calls(fake, "eval") == ["A_s0", "B_s0", "B_s0"]
    assert res["failed"] == {} and list(res["retried"]) == ["B_s0"]
    assert res["heldout"]["arms"]["B"]["delta_vs_base"] == {0: pytest.approx(0.1)}
    assert any(m.startswith("[compare] B_s0: retry 1 of 1 (its evaluation)") for m in messages)
    assert "fake evaluation crash, once" in (tmp_path / "out" / "runs" / "B_s0.out.failed").read_text()


def test_a_run_trained_but_not_evaluated_is_evaluated_on_resume_without_training_again(tmp_path, fake, monkeypatch, spawns):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("FAKE_EVAL_CRASH", "B_s0")
    config = _config(tmp_path, fake, seeds=[0])
    res = run_compare(config, echo=lambda m: None)
    assert list(res["failed"]) == ["B_s0"] and list(res["heldout"]["arms"]["B"]["accuracy_per_seed"]) == []
    assert res["runs"]["B_s0"]["done"]  # its training finished
    monkeypatch.delenv("FAKE_EVAL_CRASH")
    messages = []
    res = run_compare(config, echo=messages.append)
    assert sorted(_calls(fake, "run")) == ["A_s0", "B_s0"]  # neither trained again
    assert _calls(fake, "eval")[-1] == "B_s0" and len(_calls(fake, "eval")) == 3
    assert any("B_s0: trained earlier, its held-out evaluation is missing" in m for m in messages)
    assert res["failed"] == {} and res["heldout"]["arms"]["B"]["delta_vs_base"] == {0: pytest.approx(0.1)}


def test_time_budget_stops_runs_in_flight_and_starts_none_that_would_not_finish(tmp_path, fake, monkeypatch, capsys, spawns):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("FAKE_SLOW", "A_s0")  # 0.5 s per step: 2 s for 4 steps
    config = _config(tmp_path, fake, seeds=[0], parallel=1, heldout_n=0, time_budget_s=0.6)
    res = run_compare(config, echo=lambda m: None)
    assert res["time_budget"]["stopped"] == ["A_s0"] and res["time_budget"]["not_started"] == ["B_s0"]
    assert res["runs"] == {} and (Path(config.output_dir) / "compare.json").exists()
    monkeypatch.delenv("FAKE_SLOW")
    res = run_compare(dataclasses.replace(config, time_budget_s=None), echo=lambda m: None)
    assert sorted(res["runs"]) == ["A_s0", "B_s0"] and res["time_budget"]["stopped"] == []
    # The longest finished run (its marker's wall_s, here made 1000 s) does not fit a budget of 100 s: no run starts.
    log = Path(config.output_dir) / "runs" / "A_s0.jsonl"
    lines = log.read_text().splitlines()
    marker = json.loads(lines[-1])
    log.write_text("\n".join([*lines[:-1], json.dumps({**marker, "wall_s": 1000.0})]) + "\n")
    out = str(Path(config.output_dir))
    code, stdout, stderr = compare_cli([*config.recipes, "--seeds", "0", "1", "--max-steps", "4", "--output-dir", out, "--model", "tiny-random-llama",
                                 "--run-fn", "fake_saving:run_training", "--pythonpath", fake["dir"], "--heldout-n",
                                 "0", "--last-n", "2", "--time-budget-s", "100"], capsys)
    assert code == 3 and "2 not started" in stdout, (stdout, stderr)
    # A_s0 (stopped at 0.6 s: recorded only if its process got that far), A_s0, B_s0; nothing of seed 1
    assert sorted(set(_calls(fake, "run"))) == ["A_s0", "B_s0"] and len(_calls(fake, "run")) in (2, 3)


def test_time_budget_starts_the_next_run_when_one_finishes_and_the_next_fits(tmp_path, fake, spawns):
    """One at a time under a budget that fits every run: when the run in flight ends, the next one starts. Found on
    the H200: with --parallel 1 the sweep stopped 'for the budget' 70 s into 280 s, right after the first run ended,
    because the budget check ran before the launcher had a turn."""
    pytest.importorskip("matplotlib")
    config = _config(tmp_path, fake, seeds=[0, 1], parallel=1, heldout_n=0, time_budget_s=600)
    res = run_compare(config, echo=lambda m: None)
    assert sorted(res["runs"]) == ["A_s0", "A_s1", "B_s0", "B_s1"]
    assert res["time_budget"]["stopped"] == [] and res["time_budget"]["not_started"] == []


@pytest.mark.parametrize(
    "args, problem",
    [
        (["--run-fn", "fake_train:run_training", "--heldout-n", "8"],
         "--heldout-n 8: --run-fn fake_train:run_training takes no save_final"),
        (["--heldout-every", "2", "--run-fn", "fake_saving:run_training_narrow"],
         "--heldout-every 2: --run-fn fake_saving:run_training_narrow takes no heldout"),
        (["--heldout-n", "-1"], "--heldout-n -1: must be >= 0"),
        (["--heldout-batch-size", "0"], "--heldout-batch-size 0: must be >= 1"),
        (["--heldout-n", "0", "--heldout-every", "3"], "--heldout-every 3 needs the held-out evaluation on"),
        (["--time-budget-s", "0"], "--time-budget-s 0.0: must be > 0"),
        (["--heldout-fn", "nowhere:evaluate"], "--heldout-fn nowhere:evaluate: cannot load it"),
    ],
)
def test_bad_heldout_input_fails_in_one_line_before_anything_runs(tmp_path, fake, capsys, args, problem):
    out = tmp_path / "out"
    code, _, stderr = compare_cli([*write_recipes(tmp_path), "--seeds", "0", "--max-steps", "2", "--output-dir", str(out),
                            "--run-fn", "fake_saving:run_training", "--pythonpath", fake["dir"], *args], capsys)
    assert code == 2 and stderr.startswith((f"bloggap compare: {problem}", f"bloggap: error: {problem}")), stderr
    assert len(stderr.strip().splitlines()) == 1 and not out.exists() and _calls(fake, "run") == []


def test_gsm8k_from_one_file_has_no_test_split_to_hold_out(tmp_path, fake, capsys):
    from bloggap_plugin.tasks.gsm8k import SAMPLE_PATH

    code, _, stderr = compare_cli([*write_recipes(tmp_path), "--seeds", "0", "--output-dir", str(tmp_path / "out"), "--task",
                            "gsm8k", "--data", str(SAMPLE_PATH), "--run-fn", "fake_saving:run_training",
                            "--pythonpath", fake["dir"]], capsys)
    assert code == 2 and "held-out evaluation: GSM8K data" in stderr and "is one file" in stderr, stderr
    assert "--heldout-n 0" in stderr and len(stderr.strip().splitlines()) == 1


def test_heldout_every_reaches_the_training_function_and_its_records_make_a_curve(tmp_path, fake, spawns):
    from bloggap_plugin.compare import summarize_run

    pytest.importorskip("matplotlib")
    config = _config(tmp_path, fake, seeds=[0], heldout_every=2, heldout_max_tokens=12, heldout_batch_size=5)
    run_compare(config, echo=lambda m: None)
    assert _calls(fake, "heldout_arg") == [{"every": 2, "n": 40, "max_tokens": 12, "batch_size": 5}] * 2
    assert set(_calls(fake, "max_tokens")) == {12} and set(_calls(fake, "batch")) == {5}
    records = [{"step": 1, "reward": 0.5}, {"step": 2, "heldout/accuracy": 0.25, "heldout/n": 4}, {"step": 2, "reward": 1.0}]
    summary = summarize_run(records, None, last_n=2)
    assert summary["heldout_curve"] == [[2, 0.25]] and summary["rewards"] == [0.5, 1.0] and summary["steps"] == 2


def test_the_decisive_sweep_config_meets_the_issue_and_passes_every_check_but_the_gpu(tmp_path, capsys):
    """benchmarks/compare_sweep.yaml: arms A B E F G H, >= 4 seeds, >= 200 steps with a reward on every generation,
    vLLM, arithmetic level 2, held-out evaluation, a time budget under the 10-minute call; every setting passes the
    sweep's checks with the real training function (vLLM aside, which this CPU machine lacks: refused in one line)."""
    from bloggap_plugin.cli import _apply_config_file, build_parser
    from bloggap_plugin.commands._config import config_from_args
    from bloggap_plugin.compare import validate_config

    root = ROOT
    recipes = [str(root / "recipes" / f"arm_{arm}.yaml") for arm in "ABEFGH"]
    argv = ["compare", "--config", str(root / "benchmarks" / "compare_sweep.yaml"), *recipes]
    parser = build_parser(argv)
    _apply_config_file(parser, argv)
    config = config_from_args(CompareConfig, parser.parse_args(argv))
    assert len(config.seeds) >= 4 and config.max_steps >= 200 and config.use_vllm and config.task == "arith"
    assert config.difficulty == 2 and config.heldout_n >= 256 and 0 < config.time_budget_s <= 540
    assert config.extra_overrides["logging_steps"] == 1 and config.extra_overrides["num_iterations"] == 2
    assert config.last_n <= config.max_steps // config.extra_overrides["num_iterations"]
    runs = validate_config(dataclasses.replace(config, use_vllm=False, output_dir=str(tmp_path / "out")))
    assert sorted({run.arm for run in runs}) == list("ABEFGH") and len(runs) == 6 * len(config.seeds)
    code, _, stderr = compare_cli(["--config", str(root / "benchmarks" / "compare_sweep.yaml"), "--output-dir",
                            str(tmp_path / "out"), *recipes], capsys)
    if stderr:  # this machine has no CUDA or no vLLM: the one line names it, before anything runs
        assert code == 2 and stderr.startswith("bloggap compare: --use-vllm: ") and not (tmp_path / "out").exists()


@pytest.mark.parametrize("env", [{"SMOKE": "1"}, {"SEEDS": "0 1"}, {}], ids=["smoke", "seeds", "full"])
def test_the_sweep_script_builds_a_command_that_passes_every_check_up_to_vllm(tmp_path, env, spawns):
    """benchmarks/compare_sweep.sh on a machine without vLLM: the command it builds parses and passes every check
    but the last (vLLM), so it fails in that one line, not in argparse (as it did with --seeds before the recipes)."""
    import importlib.util
    import os
    import shutil
    import subprocess

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the script would start the sweep")
    root = ROOT
    bindir = python3_shim(tmp_path / "bin")
    environ = {**os.environ, **env, "PATH": f"{bindir}:{os.environ['PATH']}", "PYTHONPATH": str(root)}
    environ.pop("OUT", None)
    done = subprocess.run(["bash", str(root / "benchmarks" / "compare_sweep.sh")], cwd=root, env=environ,
                          capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 2 and done.stderr.startswith("bloggap compare: --use-vllm: "), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and shutil.which("bash")


def test_the_gsm8k_demonstration_config_reads_the_real_data_and_passes_every_check_but_the_gpu(tmp_path, capsys):
    """benchmarks/gsm8k_demo.yaml (issue 15 item 2, the real task shown running): GSM8K from a local folder with
    both splits, the 1-2 step subset, 256 new tokens for training and the held-out evaluation, vLLM; with the real
    GSM8K beside the repository every setting passes the sweep's checks (vLLM aside, refused in one line here)."""
    from bloggap_plugin.cli import _apply_config_file, build_parser
    from bloggap_plugin.commands._config import config_from_args
    from bloggap_plugin.compare import validate_config

    root = ROOT
    real = root.parent / "shared" / "data" / "gsm8k"
    if not (real / "test.jsonl").exists():
        pytest.skip("the real GSM8K is not beside the repository")
    recipes = [str(root / "recipes" / f"arm_{arm}.yaml") for arm in "AH"]
    argv = ["compare", "--config", str(root / "benchmarks" / "gsm8k_demo.yaml"), *recipes, "--data", str(real)]
    parser = build_parser(argv)
    _apply_config_file(parser, argv)
    config = config_from_args(CompareConfig, parser.parse_args(argv))
    assert config.task == "gsm8k" and config.calc_steps == "1-2" and config.use_vllm and config.data == str(real)
    assert config.extra_overrides["max_completion_length"] == config.heldout_max_tokens == 256
    assert 0 < config.time_budget_s <= 540 and config.max_steps // config.extra_overrides["num_iterations"] >= config.last_n
    runs = validate_config(dataclasses.replace(config, use_vllm=False, output_dir=str(tmp_path / "out")))
    assert [run.arm for run in runs] == ["A", "H"]
    code, _, stderr = compare_cli(["--config", str(root / "benchmarks" / "gsm8k_demo.yaml"), "--data", str(real),
                            "--output-dir", str(tmp_path / "out"), *recipes], capsys)
    if stderr:  # no CUDA or no vLLM here: one line names it (no datasets bars while reading GSM8K), nothing ran
        assert code == 2 and stderr.startswith("bloggap compare: --use-vllm: ") and not (tmp_path / "out").exists()
        assert len(stderr.strip().splitlines()) == 1, stderr


def test_the_gsm8k_call_script_runs_both_steps_to_their_vllm_check(tmp_path, spawns):
    """benchmarks/gpu/gsm8k_call.sh on a machine without vLLM, with the real GSM8K: the baseline and the
    demonstration each get past argument parsing and the data checks and stop at the vLLM check in one line; the
    script says both exits and fails; its time limits fit one 10-minute device call."""
    import importlib.util
    import os
    import re
    import subprocess

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the script would run")
    root = ROOT
    real = root.parent / "shared" / "data" / "gsm8k"
    if not (real / "test.jsonl").exists():
        pytest.skip("the real GSM8K is not beside the repository")
    script = root / "benchmarks" / "gpu" / "gsm8k_call.sh"
    limits = [int(x) for x in re.findall(r"_S:-(\d+)", script.read_text())]
    assert len(limits) == 2 and sum(limits) <= 590
    bindir = python3_shim(tmp_path / "bin")
    environ = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"), "DATA": str(real)}
    done = subprocess.run(["bash", str(script)], cwd=root, env=environ, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 1 and done.stdout.strip().endswith("gsm8k_call: baseline exit 2, demo exit 2")
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2, done.stderr
    assert lines[0].startswith("gsm8k_baseline: vLLM is not installed here")
    assert lines[1].startswith("bloggap compare: --use-vllm: vLLM is not installed here")


def test_a_budget_shorter_than_a_stopped_run_is_refused_instead_of_restarting_it_forever(tmp_path, fake, monkeypatch, spawns):
    """A run stopped unfinished by the budget records how long it ran. Calling again with a budget no longer than
    that would stop it at the same point and restart it from zero on every call: refused before anything starts,
    naming the run, the seconds and the fix. A longer budget lets it continue (and finish)."""
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("FAKE_SLOW", "A_s0")  # 0.5 s per step: 2 s for 4 steps
    config = _config(tmp_path, fake, seeds=[0], parallel=1, heldout_n=0, time_budget_s=1.0)
    res = run_compare(config, echo=lambda m: None)
    assert res["time_budget"]["stopped"] == ["A_s0"]
    calls = len(_calls(fake, "run"))
    with pytest.raises(CompareError, match=r"--time-budget-s 1: run A_s0 was stopped unfinished after \d+(\.\d+)? s"):
        run_compare(config, echo=lambda m: None)
    assert len(_calls(fake, "run")) == calls  # nothing started
    res = run_compare(dataclasses.replace(config, time_budget_s=float(HANG_S)), echo=lambda m: None)
    assert sorted(res["runs"]) == ["A_s0", "B_s0"] and res["time_budget"]["stopped"] == []
    assert not list((Path(config.output_dir) / "runs").glob("*.stopped.json"))  # finished: the record is gone


def test_a_run_stopped_at_the_calls_deadline_counts_the_whole_budget_it_had(tmp_path, fake, spawns):
    """A run launched when the call started and stopped at its deadline had the whole budget, though it ran a little
    less (its launch took part of it): the same budget again would stop it at the same point, so it is refused even
    where the run's own seconds are below the budget (under load the launch takes longer). A run that waited for a
    slot had less than the budget: only its own seconds bound a budget that can make no progress."""
    config = _config(tmp_path, fake, seeds=[0], parallel=1, heldout_n=0, time_budget_s=1.0)
    runs = Path(config.output_dir) / "runs"
    runs.mkdir(parents=True)
    stopped = runs / "A_s0.stopped.json"
    stopped.write_text(json.dumps({"seconds": 0.7, "call_seconds": 1.05, "budget_s": 1.0}))
    with pytest.raises(CompareError, match=r"--time-budget-s 1: run A_s0 was stopped unfinished after 1 s"):
        run_compare(config, echo=lambda m: None)
    assert _calls(fake, "run") == []  # nothing started
    stopped.write_text(json.dumps({"seconds": 0.7, "budget_s": 1.0}))  # it waited for a slot: 0.7 s of the budget
    res = run_compare(dataclasses.replace(config, time_budget_s=float(HANG_S)), echo=lambda m: None)
    assert sorted(res["runs"]) == ["A_s0", "B_s0"]


def _gsm8k_compare_config(argv):
    from bloggap_plugin.cli import _apply_config_file, build_parser
    from bloggap_plugin.commands._config import config_from_args

    parser = build_parser(argv)
    _apply_config_file(parser, argv)
    return config_from_args(CompareConfig, parser.parse_args(argv))


def test_the_gsm8k_comparison_plan_is_the_declared_one_and_passes_every_check_but_the_gpu(tmp_path, gsm8k_dir):
    """benchmarks/gsm8k_compare.yaml (issue 45): 5 planned seeds, primary held-out accuracy on all 1,319 test rows
    (greedy, 256 tokens), secondary the final-window and whole-run reward, baseline A, alpha 0.05 over the four
    arms; prompts from train_minus_validation; the call script's arms are A B F H J. With the real GSM8K every setting
    passes the sweep's checks with the real training function (vLLM aside)."""
    import re

    from bloggap_plugin.compare import validate_config
    from bloggap_plugin.compare.sweep_config import run_task_kwargs
    from bloggap_plugin.tasks import get_heldout, get_task, gsm8k

    script = (ROOT / "benchmarks" / "gpu" / "gsm8k_compare_call.sh").read_text()
    arms = re.search(r'ARMS=\$\{ARMS:-"([A-Z ]+)"\}', script).group(1).split()
    assert arms == ["A", "B", "F", "H", "J"]
    recipes = [str(ROOT / "recipes" / f"arm_{arm}.yaml") for arm in arms]
    argv = ["compare", "--config", str(ROOT / "benchmarks" / "gsm8k_compare.yaml"), *recipes, "--data",
            str(gsm8k_dir), "--model", "tiny-random-llama"]
    config = _gsm8k_compare_config(argv)
    assert config.seeds == config.planned_seeds == [0, 1, 2, 3, 4] and config.baseline == "A" and config.alpha == 0.05
    assert config.primary == "heldout" and config.secondary == ["reward_last", "reward_mean"]
    assert config.heldout_n == 1319 and config.heldout_max_tokens == config.extra_overrides["max_completion_length"]
    assert config.heldout_batch_size == 256 and config.heldout_apart  # set for time and memory before any seed ended
    assert config.task == "gsm8k" and config.train_split == "train_minus_validation" and config.use_vllm
    assert config.calc_steps is None and 0 < config.time_budget_s <= 540 and config.parallel == len(arms)
    assert config.max_steps // config.extra_overrides["num_iterations"] >= config.last_n
    runs = validate_config(dataclasses.replace(config, use_vllm=False, output_dir=str(tmp_path / "out")))
    assert [run.arm for run in runs[:5]] == arms and len(runs) == 25  # seed-major: a wave of 5 is one seed
    heldout, _ = get_heldout("gsm8k", None, seed=0, heldout_n=config.heldout_n, **run_task_kwargs(config))
    assert len(heldout) == 1319  # the whole test split
    train, _ = get_task("gsm8k", None, seed=0, **{**run_task_kwargs(config), "n": None})
    validation = set(gsm8k.column(gsm8k.load_gsm8k(gsm8k_dir, split="validation"), "question"))
    assert len(train) == 7473 - 500 and not {p[-1]["content"] for p in gsm8k.column(train, "prompt")} & validation


def test_the_gsm8k_compare_call_script_needs_a_selection_and_reaches_the_vllm_check(tmp_path, gsm8k_dir, spawns):
    """benchmarks/gpu/gsm8k_compare_call.sh without vLLM: with no checkpoint and no SELECTION it stops in one line;
    with a checkpoint folder it builds a compare command that parses and stops at the vLLM check."""
    import importlib.util
    import os
    import subprocess

    from _support.trl_runs import saved_model_dir

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the script would run")
    bindir = python3_shim(tmp_path / "bin")
    environ = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "DATA": str(gsm8k_dir),
               "OUT": str(tmp_path / "out"), "SWEEP": str(tmp_path / "sweep"), "CKPT": str(tmp_path / "none"),
               "CKPT_T": str(tmp_path / "no_carry")}  # not the checkout's .dev/ckpt/t, should a developer have one

    def run(**extra):
        return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "gsm8k_compare_call.sh")], cwd=ROOT,
                              env={**environ, **extra}, capture_output=True, text=True, timeout=HANG_S)

    done = run()
    assert done.returncode == 2 and "no checkpoint in" in done.stderr and "set SELECTION" in done.stderr
    done = run(CKPT=saved_model_dir(tmp_path))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("bloggap compare: --use-vllm: "), done.stderr
    assert "gsm8k_compare_call: compare exit 2" in done.stdout


def test_the_gsm8k_compare_call_script_restores_a_carried_checkpoint_instead_of_building_one(tmp_path, gsm8k_dir,
                                                                                             spawns):
    """With a checkpoint carried to the machine (ckpt_out.sh's parts, ckpt_parts.sh's chunks, CKPT_T carried), the
    script restores it with ckpt_join.sh and goes on to the compare command, which needs no SELECTION (no warm start
    is built); with the chunks missing it stops with ckpt_join.sh's exit 3."""
    import importlib.util
    import os
    import shutil
    import subprocess

    from _support.trl_runs import saved_model_dir

    from bloggap_plugin.checkpoint import checkpoint_sha256

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the script would run")
    bindir = python3_shim(tmp_path / "bin")
    source = saved_model_dir(tmp_path)
    environ = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}

    def script(name, *args, **extra):
        return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / name), *args], cwd=ROOT,
                              env={**environ, **extra}, capture_output=True, text=True, timeout=HANG_S)

    brought = script("ckpt_out.sh", "0", CKPT=str(source), STAGE=str(tmp_path / "stage"), OUT=str(tmp_path / "back"))
    assert brought.returncode == 0 and "all parts brought" in brought.stdout, brought.stderr
    parted = script("ckpt_parts.sh", str(tmp_path / "back"), DEST=str(tmp_path / "dest"), CHUNK="1000000")
    assert parted.returncode == 0, parted.stderr
    device = tmp_path / "device"
    call = {"DATA": str(gsm8k_dir), "OUT": str(tmp_path / "out"), "SWEEP": str(tmp_path / "sweep"),
            "CKPT": str(tmp_path / "restored"), "CKPT_T": str(tmp_path / "dest" / "t"), "CKPT_DIR": str(device)}
    device.mkdir()
    missing = script("gsm8k_compare_call.sh", **call)
    assert missing.returncode == 3 and "ckpt_join.sh: 0 of" in missing.stderr
    for part in (tmp_path / "dest").glob("p*/part_*"):
        shutil.copy(part, device)
    done = script("gsm8k_compare_call.sh", **call)
    sha = checkpoint_sha256(source)
    assert f"ckpt_join.sh: checkpoint {sha[:12]} in {tmp_path / 'restored'}" in done.stdout, done.stdout + done.stderr
    assert checkpoint_sha256(tmp_path / "restored") == sha and not (tmp_path / "out" / "warmstart").exists()
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith("bloggap compare: --use-vllm: ")


FAKE_PYTHON3 = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
exit "$CODE"
"""


@pytest.mark.parametrize(("retries", "code"), [(None, 0), (None, 1), ("0", 1), ("2", 3)])
def test_the_gsm8k_compare_call_script_retries_a_failed_run_inside_the_sweep(tmp_path, spawns, retries, code):
    """One compare call with ``--retries RETRIES`` (default 1: a failed evaluation is redone while its saved policy
    is still on the machine), whose exit code is the script's."""
    import os
    import subprocess

    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").write_text(FAKE_PYTHON3)
    (bindir / "python3").chmod(0o755)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    calls = tmp_path / "calls"
    environ = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "CALLS": str(calls), "CODE": str(code),
               "OUT": str(tmp_path / "out"), "SWEEP": str(tmp_path / "sweep"), "CKPT": str(ckpt),
               "CKPT_T": str(tmp_path / "no_carry")}
    if retries is not None:
        environ["RETRIES"] = retries
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "gsm8k_compare_call.sh")], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=HANG_S)
    [line] = calls.read_text().splitlines()
    assert line.startswith("-m bloggap_plugin.cli compare ")
    assert line.split()[-2:] == ["--retries", retries or "1"]
    assert done.returncode == code and f"gsm8k_compare_call: compare exit {code}," in done.stdout
