"""Bad input to the ``bloggap`` commands: one line on stderr naming the problem and the fix, exit code 2, no
traceback, and no model loaded (every check runs before the model loads)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from _support.cli import RECIPES, assert_one_line_error
from _support.fixtures import _no_model, cli_runner

ARM_A = (RECIPES / "arm_A.yaml").read_text()


def _unwritable_folder() -> Path | None:
    """A folder this process cannot create files in (root writes anywhere else), or None."""
    for candidate in (Path("/sys"), Path("/proc")):
        if candidate.is_dir():
            try:
                (candidate / ".bloggap-write-test").touch()
            except OSError:
                return candidate
            (candidate / ".bloggap-write-test").unlink()
    return None


def _recipe(tmp_path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _train(bloggap, tmp_path, recipe, *extra):
    return bloggap("train", recipe, "--model", "tiny-random-llama", "--device", "cpu",
                   "--output-dir", tmp_path / "out", *extra)


# --- bloggap train: recipes -------------------------------------------------------------------------------------


def test_train_num_generations_not_an_integer(bloggap, tmp_path):
    recipe = _recipe(tmp_path, ARM_A.replace("num_generations: 8", 'num_generations: "eight"'))
    assert_one_line_error(_train(bloggap, tmp_path, recipe), "num_generations must be an integer", "'eight'")


def test_train_num_generations_not_dividing_the_batch(bloggap, tmp_path):
    recipe = _recipe(tmp_path, ARM_A.replace("num_generations: 8", "num_generations: 3"))
    line = assert_one_line_error(_train(bloggap, tmp_path, recipe), "generation_batch_size (16)",
                                  "num_generations (3)")
    assert "one of 2, 4, 8, 16" in line  # 8 rows x 2 accumulation steps: the divisors of 16


def test_train_negative_learning_rate(bloggap, tmp_path):
    recipe = _recipe(tmp_path, ARM_A.replace("learning_rate: 2.0e-6", "learning_rate: -1"))
    assert_one_line_error(_train(bloggap, tmp_path, recipe), "learning_rate", "must be >= 0", "got -1")


def test_train_zero_temperature(bloggap, tmp_path):
    recipe = _recipe(tmp_path, ARM_A.replace("temperature: 1.0", "temperature: 0"))
    assert_one_line_error(_train(bloggap, tmp_path, recipe), "temperature", "must be > 0")


def test_recipe_float_written_without_a_dot_is_a_number(tmp_path):
    from bloggap_plugin.recipes import load_recipe

    grpo_kwargs, _ = load_recipe(_recipe(tmp_path, ARM_A.replace("learning_rate: 2.0e-6", "learning_rate: 2e-6")))
    assert grpo_kwargs["learning_rate"] == 2e-6  # PyYAML reads 2e-6 as the string '2e-6'


def test_train_binary_recipe(bloggap, tmp_path):
    recipe = tmp_path / "binary.yaml"
    recipe.write_bytes(bytes(range(256)) * 4)
    assert_one_line_error(_train(bloggap, tmp_path, recipe), "not a text file")


def test_train_empty_recipe_is_refused(bloggap, tmp_path):
    for text in ("", "# only a comment\n", "{}\n"):
        recipe = _recipe(tmp_path, text)
        assert_one_line_error(_train(bloggap, tmp_path, recipe), "is empty", "recipes/arm_A.yaml")


def test_recipe_without_gap_section_warns_arm_a(tmp_path):
    from bloggap_plugin.recipes import load_recipe

    with pytest.warns(UserWarning, match="no 'gap:' section: running arm A"):
        _, gap = load_recipe(_recipe(tmp_path, "learning_rate: 1.0e-6\n"))
    assert gap.arm == "A"


def test_train_duplicate_gap_sections(bloggap, tmp_path):
    recipe = _recipe(tmp_path, ARM_A + "gap:\n  arm: B\n")
    line = assert_one_line_error(_train(bloggap, tmp_path, recipe), "'gap' appears twice")
    lines = ARM_A.splitlines()
    assert f"lines {lines.index('gap:') + 1} and {len(lines) + 1}" in line  # both places named


def test_duplicate_key_inside_gap_section(tmp_path):
    from bloggap_plugin.recipes import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=r"key 'arm' appears twice \(lines 2 and 3\)"):
        load_recipe(_recipe(tmp_path, "gap:\n  arm: B\n  arm: C\n"))


# --- bloggap train: options -------------------------------------------------------------------------------------


def test_train_missing_model_path(bloggap, tmp_path):
    result = bloggap("train", RECIPES / "arm_A.yaml", "--model", tmp_path / "no-such-model", "--device", "cpu",
                     "--output-dir", tmp_path / "out")
    assert_one_line_error(result, "no-such-model", "no such file or folder")


def test_train_hub_id_offline(bloggap, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = bloggap("train", RECIPES / "arm_A.yaml", "--model", "bloggap-nobody/no-such-model", "--device", "cpu",
                     "--output-dir", tmp_path / "out")
    assert_one_line_error(result, "'bloggap-nobody/no-such-model' is not in the local Hugging Face cache",
                           "HF_HUB_OFFLINE")


def test_train_unknown_task(bloggap, tmp_path):
    assert_one_line_error(_train(bloggap, tmp_path, RECIPES / "arm_A.yaml", "--task", "foo"),
                           "unknown task 'foo'", "gsm8k, arith")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_train_cuda_without_cuda(bloggap, tmp_path):
    result = bloggap("train", RECIPES / "arm_A.yaml", "--model", "tiny-random-llama", "--device", "cuda",
                     "--output-dir", tmp_path / "out")
    assert_one_line_error(result, "--device cuda but CUDA is not available", "--device cpu")


def test_train_bad_device_name(bloggap, tmp_path):
    result = bloggap("train", RECIPES / "arm_A.yaml", "--model", "tiny-random-llama", "--device", "gpu0",
                     "--output-dir", tmp_path / "out")
    assert_one_line_error(result, "--device 'gpu0' is not a device")


def test_train_log_jsonl_is_a_directory(bloggap, tmp_path):
    assert_one_line_error(_train(bloggap, tmp_path, RECIPES / "arm_A.yaml", "--log-jsonl", tmp_path),
                           "--log-jsonl", "is a directory")


def test_train_output_dir_is_a_file(bloggap, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    result = bloggap("train", RECIPES / "arm_A.yaml", "--model", "tiny-random-llama", "--device", "cpu",
                     "--output-dir", a_file)
    assert_one_line_error(result, "--output-dir", "is a file, not a folder")


def test_train_outputs_not_writable(bloggap, tmp_path):
    folder = _unwritable_folder()
    if folder is None:
        pytest.skip("no unwritable folder on this machine")
    result = bloggap("train", RECIPES / "arm_A.yaml", "--model", "tiny-random-llama", "--device", "cpu",
                     "--output-dir", folder / "runs")
    assert_one_line_error(result, "--output-dir", "is not writable")
    assert_one_line_error(_train(bloggap, tmp_path, RECIPES / "arm_A.yaml", "--log-jsonl", folder / "log.jsonl"),
                           "--log-jsonl", "is not writable")


@pytest.mark.parametrize("steps", ["0", "-1"])
def test_train_max_steps_not_positive(bloggap, tmp_path, steps):
    assert_one_line_error(_train(bloggap, tmp_path, RECIPES / "arm_A.yaml", "--max-steps", steps),
                           f"--max-steps {steps}: must be >= 1")


def test_train_gsm8k_offline_names_the_data_option(bloggap, tmp_path, monkeypatch):
    import datasets

    monkeypatch.delenv("BLOGGAP_GSM8K_DATA", raising=False)

    real_load = datasets.load_dataset

    def offline_load(path, *args, **kwargs):  # as offline without openai/gsm8k in the cache, whatever this machine has
        if path == "openai/gsm8k":
            raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", offline_load)
    assert_one_line_error(_train(bloggap, tmp_path, RECIPES / "arm_A.yaml", "--task", "gsm8k"),
                           "openai/gsm8k", "--data PATH")
    assert_one_line_error(_train(bloggap, tmp_path, RECIPES / "arm_A.yaml", "--task", "gsm8k", "--data",
                                  tmp_path / "absent.jsonl"), "absent.jsonl does not exist")


def test_prepare_run_accepts_local_gsm8k_data(tmp_path, monkeypatch):
    import bloggap_plugin.models as models
    from bloggap_plugin.tasks.gsm8k import SAMPLE_PATH
    from bloggap_plugin.trl.run import prepare_run

    monkeypatch.setattr(models, "load_model", _no_model)
    plan = prepare_run(RECIPES / "arm_A.yaml", model="tiny-random-llama", task="gsm8k", max_steps=3,
                       output_dir=tmp_path / "out", device="cpu", task_kwargs={"data": str(SAMPLE_PATH)})
    assert plan.args.max_steps == 3 and plan.args.num_generations == 8
    assert plan.device == "cpu" and plan.dtype == "bf16" and plan.gap.arm == "A"


def test_train_gsm8k_data_from_the_environment_variable(bloggap, gsm8k_dir, tmp_path, monkeypatch):
    """$BLOGGAP_GSM8K_DATA stands in for --data: a cut copy is refused in one line naming the variable, before the
    model loads; the real folder is accepted (with --calc-steps) by the same checks."""
    import bloggap_plugin.models as models
    from bloggap_plugin.trl.run import prepare_run

    short = tmp_path / "short"
    short.mkdir()
    (short / "train.jsonl").write_text("".join((gsm8k_dir / "train.jsonl").read_text().splitlines(keepends=True)[:-2]))
    monkeypatch.setenv("BLOGGAP_GSM8K_DATA", str(short))
    assert_one_line_error(_train(bloggap, tmp_path, RECIPES / "arm_A.yaml", "--task", "gsm8k"),
                           f"{short / 'train.jsonl'} has 7,471 rows", "point $BLOGGAP_GSM8K_DATA at another copy")
    assert_one_line_error(_train(bloggap, tmp_path, RECIPES / "arm_A.yaml", "--task", "gsm8k", "--data", gsm8k_dir,
                                  "--calc-steps", "2-1"), "calc_steps '2-1'")
    monkeypatch.setenv("BLOGGAP_GSM8K_DATA", str(gsm8k_dir))
    monkeypatch.setattr(models, "load_model", _no_model)
    plan = prepare_run(RECIPES / "arm_A.yaml", model="tiny-random-llama", task="gsm8k", max_steps=2,
                       output_dir=tmp_path / "out", device="cpu", task_kwargs={"calc_steps": "1"})
    assert plan.args.max_steps == 2


# --- corrupt model files (doctor, train, ladder, attribute) --------------------------------------------------------


def _bad_models(tmp_path) -> dict[str, tuple[Path, str]]:
    """Model specs whose files are broken, each with the phrase its error must contain."""
    not_gguf = tmp_path / "not_really.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(60))
    bad_json = tmp_path / "bad_json_model"
    bad_json.mkdir()
    (bad_json / "config.json").write_text('{"model_type": "llama", ')
    no_type = tmp_path / "no_type_model"
    no_type.mkdir()
    (no_type / "config.json").write_text('["not", "a", "config"]')
    return {
        "gguf": (not_gguf, "is not a GGUF file"),
        "json": (bad_json, "config.json: not valid JSON"),
        "type": (no_type, "is not a transformers model config"),
    }


@pytest.mark.parametrize("command", ["train", "doctor", "ladder", "attribute"])
def test_corrupt_model_files_are_one_line_errors(bloggap, tmp_path, command):
    for spec, phrase in _bad_models(tmp_path).values():
        if command == "train":
            argv = ("train", RECIPES / "arm_A.yaml", "--output-dir", tmp_path / "out")
        else:
            argv = (command,)
        assert_one_line_error(bloggap(*argv, "--model", spec, "--device", "cpu"), str(spec), phrase)


@pytest.fixture
def bloggap_measuring_fails(monkeypatch, capsys):
    """Run ``bloggap ARGS`` with real model loading; fail if any rollout is sampled (measuring started)."""
    import bloggap_plugin.measure.rollouts as attribute
    import bloggap_plugin.measure.rollouts as probe

    def no_sampling(*args, **kwargs):
        raise AssertionError("measuring started before the bad input was reported")

    monkeypatch.setattr(probe, "sample_rollouts", no_sampling)
    monkeypatch.setattr(attribute, "rollout_rows", no_sampling)
    return cli_runner(capsys)


def test_unreadable_model_files_fail_at_load_as_one_line(bloggap_measuring_fails, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00\x01\x02")  # right magic, then nothing readable
    unknown = tmp_path / "unknown_arch"
    unknown.mkdir()
    (unknown / "config.json").write_text('{"model_type": "no_such_architecture"}')
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 100,
    }))
    for spec, what in ((truncated, "cannot load GGUF file"), (unknown, "cannot load model folder"),
                       (no_weights, "cannot load model folder")):
        line = assert_one_line_error(bloggap_measuring_fails("attribute", "--model", spec, "--device", "cpu"),
                                      f"{what} {spec}", "re-download them or choose another --model")
        assert len(line) < 500


# --- bloggap doctor ---------------------------------------------------------------------------------------------


def _doctor(bloggap, *extra):
    return bloggap("doctor", "--model", "tiny-random-llama", "--device", "cpu", "--no-progress", *extra)


def test_doctor_json_to_a_directory_is_refused_before_measuring(bloggap, tmp_path):
    assert_one_line_error(_doctor(bloggap, "--json", tmp_path), "--json", "is a directory")


def test_doctor_json_to_an_unwritable_folder_is_refused_before_measuring(bloggap, tmp_path):
    folder = _unwritable_folder()
    if folder is None:
        pytest.skip("no unwritable folder on this machine")
    assert_one_line_error(_doctor(bloggap, "--json", folder / "doctor.json"), "--json", "is not writable")


@pytest.mark.parametrize("band", ["2", "1", "0", "-0.1", "nan"])
def test_doctor_band_outside_0_1(bloggap, band):
    assert_one_line_error(_doctor(bloggap, "--band", band), "--band ", "must be in (0, 1)")


@pytest.mark.parametrize("option", ["--rows", "--new-tokens", "--gen-batch-size", "--fp16-rows"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_doctor_non_positive_counts(bloggap, option, value):
    assert_one_line_error(_doctor(bloggap, option, value), f"{option} {value}: must be >= 1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_doctor_cuda_without_cuda(bloggap):
    result = bloggap("doctor", "--model", "tiny-random-llama", "--device", "cuda", "--no-progress")
    assert_one_line_error(result, "--device cuda but CUDA is not available")


def test_doctor_json_write_failure_keeps_the_previous_file(tmp_path, monkeypatch):
    from bloggap_plugin.commands.doctor import _write_json
    from bloggap_plugin.core.errors import UsageError

    path = tmp_path / "doctor.json"
    previous = '{"benchmark": "doctor", "recommendation": {"arm": "F"}}\n'  # an earlier doctor --json
    path.write_text(previous)

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(UsageError, match="No space left on device.*the previous file is unchanged"):
        _write_json({"new": list(range(1000))}, str(path))
    assert path.read_text() == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doctor.json"]  # no temporary file left behind


# --- bloggap ladder / attribute ---------------------------------------------------------------------------------


def test_ladder_non_positive_k_is_refused_before_loading(bloggap):
    assert_one_line_error(bloggap("ladder", "--model", "tiny-random-llama", "--device", "cpu", "--k", "0", "99"),
                           "--k 0", ">= 1")


def test_ladder_k_beyond_the_layers_is_refused_before_measuring(bloggap_measuring_fails):
    result = bloggap_measuring_fails("ladder", "--model", "tiny-random-llama", "--device", "cpu", "--k", "1", "99")
    assert_one_line_error(result, "--k 99 out of range", "2 decoder layers", "1..2")


def test_ladder_default_k_is_capped_at_the_layers():
    from bloggap_plugin.measure.precision_ladder import default_ks
    from bloggap_plugin.models import load_model

    model, _ = load_model("tiny-random-llama")
    assert default_ks(model, gpu=False) == [2] and default_ks(model, gpu=True) == [2]


def test_attribute_k_beyond_the_layers_is_refused_before_measuring(bloggap_measuring_fails):
    result = bloggap_measuring_fails("attribute", "--model", "tiny-random-llama", "--device", "cpu", "--k", "3")
    assert_one_line_error(result, "--k 3 is out of range", "2 decoder layers", "1..2")


@pytest.mark.parametrize("command", ["ladder", "attribute"])
def test_ladder_attribute_bad_options_before_loading(bloggap, tmp_path, command):
    base = (command, "--model", "tiny-random-llama", "--device", "cpu")
    assert_one_line_error(bloggap(*base, "--json", tmp_path), "--json", "is a directory")
    assert_one_line_error(bloggap(*base, "--rows", "0"), "--rows 0: must be >= ")
    assert_one_line_error(bloggap(*base, "--new-tokens", "-1"), "--new-tokens -1: must be >= 1")
    assert_one_line_error(bloggap(*base, "--device", "cuda:99" if torch.cuda.is_available() else "cuda"),
                           "--device cuda")


def test_train_report_to_unknown_or_missing(bloggap, tmp_path, monkeypatch):
    import transformers.integrations as integrations

    assert_one_line_error(_train(bloggap, tmp_path, RECIPES / "arm_A.yaml", "--report-to", "wandbb"),
                           "--report-to wandbb: unknown", "tensorboard")
    monkeypatch.setattr(integrations, "get_available_reporting_integrations", lambda: [])  # as if not installed
    assert_one_line_error(_train(bloggap, tmp_path, RECIPES / "arm_A.yaml", "--report-to", "tensorboard"),
                           "--report-to tensorboard: the tensorboard package is not installed")
