"""run_training / bloggap train / the benchmark in quick mode / wandb offline receiving gap/* keys."""

from __future__ import annotations

import dataclasses
import json

import pytest
from _support import ROOT

SMALL = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=8)


def test_run_training_writes_jsonl_with_gap_keys(tmp_path, trains):
    from bloggap_plugin.trl.run import run_training

    log = tmp_path / "log.jsonl"
    summary = run_training(ROOT / "recipes" / "arm_G.yaml", model="tiny-random-llama", max_steps=2,
                           output_dir=tmp_path / "out", log_jsonl=log, extra_overrides=SMALL)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert "gap/ratio/oob_frac" in records[0] and "reward" in records[0] and "step_time" in records[0]
    assert summary["arm"] == "G" and summary["steps"] == 2
    assert summary["mean/gap/ratio/exact_frac"] == 1.0  # matched arm: old == training forward, bit for bit


def test_run_training_checks_and_builds_each_input_once(tmp_path, monkeypatch, trains):
    """prepare_run checks every input and builds what the run needs (settings, recipe, GRPOConfig, device, task data,
    held-out set, model spec); the training after it uses that plan and does none of that work again."""
    import sys

    import bloggap_plugin.models as models
    import bloggap_plugin.recipes as recipes
    import bloggap_plugin.tasks as tasks
    import bloggap_plugin.trl.run as run

    calls: dict[str, list[str]] = {}

    def spy(module, name):
        original = getattr(module, name)

        def counted(*args, **kwargs):
            calls.setdefault(name, []).append(sys._getframe(1).f_globals["__name__"])
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)

    for module, names in ((run, ("train_config", "check_heldout_spec", "_check_report_to")),
                          (recipes, ("load_recipe", "merge_grpo_config")),
                          (models, ("resolve_device", "check_model_spec", "load_model")),
                          (tasks, ("get_task", "get_heldout"))):
        for name in names:
            spy(module, name)
    summary = run.run_training(ROOT / "recipes" / "arm_A.yaml", model="tiny-random-llama", max_steps=1,
                                 output_dir=tmp_path / "out", extra_overrides=SMALL, heldout={"every": 1, "n": 2})
    assert summary["steps"] == 1 and [r["heldout/n"] for r in summary["heldout"]] == [2]
    by_run = {name: callers.count("bloggap_plugin.trl.run") for name, callers in calls.items()}
    assert by_run == {name: 1 for name in ("train_config", "check_heldout_spec", "_check_report_to", "load_recipe",
                                             "merge_grpo_config", "resolve_device", "check_model_spec", "load_model",
                                             "get_task", "get_heldout")}
    assert calls["check_model_spec"] == ["bloggap_plugin.trl.run"]  # load_model does not check the spec again
    plan = run.prepare_run(ROOT / "recipes" / "arm_A.yaml", model="tiny-random-llama", output_dir=tmp_path / "o")
    with pytest.raises(TypeError, match=r"give settings \['seed'\] to prepare_run"):
        run.run_training(plan, seed=1)


def test_train_command_reports_bad_recipe(tmp_path, capsys):
    from bloggap_plugin.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("gap:\n  arm: B\n  bnad: 0.1\n")
    assert main(["train", str(bad), "--model", "tiny-random-llama", "--output-dir", str(tmp_path / "out")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("bloggap: error: ") and "unknown key 'bnad'" in err  # on stderr


def test_benchmark_quick(tmp_path, trains):
    from benchmarks import trl_arms

    assert trl_arms.main(["--quick", "--arms", "A,G", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "trl_arms.json").read_text())
    assert payload["benchmark"] == "trl_arms" and payload["schema_version"] == 1
    table = payload["tables"][0]
    assert [row[0] for row in table["rows"]] == ["A", "G"] and table["random_init"] is True
    assert all(len(row) == len(table["columns"]) for row in table["rows"])
    assert table["rows"][1][table["columns"].index("exact ratio %")] == 100.0  # G: matched, bit-exact
    old_pass = table["columns"].index("G old pass s/step")
    assert table["rows"][0][old_pass] is None and table["rows"][1][old_pass] > 0  # G's pass in place of TRL's
    for row, arm in zip(table["rows"], "AG"):  # the plugin's time over the steps' time, not a mean of fractions
        history = [h for h in payload["results"][arm]["history"] if "gap/time/scoring_s" in h]
        share = sum(h["gap/time/scoring_s"] for h in history) / sum(h["step_time"] for h in history)
        assert row[table["columns"].index("plugin time %")] == round(100 * share, 2)
    # the runs' logs live in a temporary folder that is gone after the benchmark: the result names each log file
    # without the machine's path (a committed result must not hold one)
    assert [payload["results"][arm]["log_jsonl"] for arm in "AG"] == ["A.jsonl", "G.jsonl"]
    # nor the checkout's (a clone under /tmp wrote "/tmp/.../recipes/arm_A.yaml"): recipes relative to the repo
    assert [payload["results"][arm]["recipe"] for arm in "AG"] == ["recipes/arm_A.yaml", "recipes/arm_G.yaml"]
    assert str(tmp_path) not in json.dumps(payload["results"]) and "/tmp" not in json.dumps(payload["results"])


def test_wandb_offline_run_contains_gap_keys(tmp_path, monkeypatch, trains):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    from wandb.sdk import wandb_run

    from bloggap_plugin.trl.run import run_training

    logged: list[dict] = []
    original = wandb_run.Run.log

    def spy(self, data, *args, **kwargs):  # what the reporter (transformers' WandbCallback) hands to wandb
        logged.append(dict(data))
        return original(self, data, *args, **kwargs)

    monkeypatch.setattr(wandb_run.Run, "log", spy)
    run_training(ROOT / "recipes" / "arm_A.yaml", model="tiny-random-llama", max_steps=1,
                 output_dir=tmp_path / "out", report_to="wandb", extra_overrides=SMALL)
    wandb.finish()
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb")), "no offline wandb run written"
    keys = {key for data in logged for key in data}
    assert {"train/gap/ratio/oob_frac", "train/gap/sampler/oob_frac", "train/gap/time/overhead_frac"} <= keys


def test_train_flags_are_train_config_fields_plus_grpo_config_overrides(tmp_path):
    """``bloggap train``: TrainConfig's fields and every GRPOConfig field are flags (help included); a GRPOConfig
    flag overrides the recipe, one left out keeps the recipe's value; run_training's keyword call still works."""
    from bloggap_plugin.cli import build_parser
    from bloggap_plugin.commands.train import train_config_from_args
    from bloggap_plugin.trl.run import TrainConfig, prepare_run, train_config

    parser = build_parser()
    command = parser.get_default("_subparsers")["train"]
    text = command.format_help()
    assert "--learning_rate" not in text.split("GRPOConfig overrides:")[0]  # --help shows train's own flags
    command._show_all = True  # what --help-all prints: every GRPOConfig field too
    text = command.format_help()
    for flag, help_text in (("--max_steps", "optimizer steps"), ("--log_jsonl", "one JSON line per logged step"),
                            ("--gap_overrides", "gap: section"), ("--learning_rate", "learning rate"),
                            ("--beta", "KL coefficient"), ("--num_iterations", "iterations")):
        assert flag in text and help_text in text, flag
    recipe = ROOT / "recipes" / "arm_B.yaml"
    args = parser.parse_args(["train", str(recipe), "--model", "tiny-random-llama", "--device", "cpu", "--max-steps",
                              "3", "--output-dir", str(tmp_path / "out"), "--beta", "0.04", "--gap_overrides",
                              "{band: 0.2}", "--calc-steps", "2"])
    config = train_config_from_args(args)
    assert config == TrainConfig(recipe=str(recipe), model="tiny-random-llama", device="cpu", max_steps=3,
                                 output_dir=str(tmp_path / "out"), extra_overrides={"beta": 0.04},
                                 gap_overrides={"band": 0.2}, calc_steps="2")
    assert config.task_options() == {"calc_steps": "2"}
    plan = prepare_run(dataclasses.replace(config, calc_steps=None))
    recipe_only = prepare_run(recipe, model="tiny-random-llama", device="cpu", output_dir=str(tmp_path / "out"))
    assert (plan.args.beta, plan.args.max_steps, plan.gap.band, plan.gap.arm) == (0.04, 3, 0.2, "B")
    assert plan.args.learning_rate == recipe_only.args.learning_rate  # not given: the recipe's
    assert recipe_only.args.beta != 0.04
    assert train_config(config, seed=5).seed == 5
    with pytest.raises(TypeError, match="max_step"):
        prepare_run(recipe, max_step=3)


def test_train_from_a_folder_records_the_sha256_of_its_weights_once(tmp_path, capsys, monkeypatch, trains):
    """``bloggap train --model FOLDER``: the summary on stdout carries the folder's checkpoint_sha256 (an
    independent sha256 of config.json and the weights, as its definition says), hashed once per run; a tiny model
    spec records None; a folder without safetensors weights is refused in one line before any model loads."""
    import hashlib
    from pathlib import Path

    from _support.trl_runs import saved_model_dir

    import bloggap_plugin.checkpoint as checkpoint
    from bloggap_plugin.cli import main

    folder = Path(saved_model_dir(tmp_path))
    digest = hashlib.sha256()
    for name in sorted(["config.json", *(p.name for p in folder.glob("*.safetensors"))]):
        data = (folder / name).read_bytes()
        digest.update(name.encode() + b"\x00" + len(data).to_bytes(8, "big") + data)
    calls = []
    real = checkpoint.checkpoint_sha256
    monkeypatch.setattr(checkpoint, "checkpoint_sha256", lambda f: calls.append(f) or real(f))
    flags = ["--max-steps", "1", "--device", "cpu", "--per_device_train_batch_size", "4", "--num_generations", "4",
             "--max_completion_length", "4"]
    assert main(["train", str(ROOT / "recipes" / "arm_A.yaml"), "--model", str(folder), "--output-dir",
                 str(tmp_path / "out"), *flags]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[out.index("\n{") + 1:] if not out.startswith("{") else out)
    assert summary["model_sha256"] == digest.hexdigest() and len(calls) == 1
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    assert main(["train", str(ROOT / "recipes" / "arm_A.yaml"), "--model", str(folder), "--output-dir",
                 str(tmp_path / "out2"), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the folder holds no config.json and *.safetensors weights to hash" in err[0], err
