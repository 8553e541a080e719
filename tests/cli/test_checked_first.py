"""Checked first (issue 47, class 2): every number and fixed-vocabulary field of every command and of the GRPOConfig a
recipe builds is range-checked before anything loads: one line on stderr, exit 2, no model loaded."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import typing

import pytest
from _support.cli import RECIPES, assert_one_line_error

ARM_A = str(RECIPES / "arm_A.yaml")
TINY = ("--model", "tiny-random-qwen2")
COMMAND_CONFIGS = (
    ("bloggap_plugin.commands.doctor", "DoctorConfig"),
    ("bloggap_plugin.commands.attribute", "AttributeConfig"),
    ("bloggap_plugin.commands.ladder", "LadderConfig"),
    ("bloggap_plugin.commands.report", "ReportConfig"),
    ("bloggap_plugin.compare.sweep_config", "CompareConfig"),
    ("bloggap_plugin.trl.run", "TrainConfig"),
)


def refused(result, *needles: str) -> str:
    """A one-line refusal (``bloggap[ COMMAND]: error: ...``, argparse's own or the command's), exit 2."""
    code, out, err = result
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in out, (code, out, err)
    assert lines[0].startswith("bloggap") and "error: " in lines[0], lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def _numeric(hint) -> bool:
    args = typing.get_args(hint) or (hint,)
    return any(a in (int, float) or (typing.get_origin(a) is list and typing.get_args(a)[0] in (int, float))
               for a in args) and bool not in args


@pytest.mark.parametrize("module, name", COMMAND_CONFIGS)
def test_every_number_field_of_every_command_declares_its_range(module, name):
    from bloggap_plugin.commands._config import RANGE_KEYS

    config_type = getattr(importlib.import_module(module), name)
    hints = typing.get_type_hints(config_type)
    unbounded = [f.name for f in dataclasses.fields(config_type)
                 if _numeric(hints[f.name]) and not set(RANGE_KEYS) & set(f.metadata)]
    assert unbounded == []


@pytest.mark.parametrize("argv, needles", [
    (("doctor", "--rows", "0"), ("--rows 0", ">= 1")),
    (("doctor", "--seed", "-1"), ("--seed -1", "4294967295")),
    (("doctor", "--band", "1.5"), ("--band 1.5", "(0, 1)")),
    (("attribute", "--attn", "bogus"), ("bogus",)),
    (("ladder", "--attn", "bogus"), ("bogus",)),
    (("attribute", "--rows", "1"), ("--rows 1",)),
    (("attribute", "--rows", "4", "--batch-size", "8"), ("--batch-size 8", "--rows 4")),  # the default caps at --rows
    (("attribute", "--batch-size", "99"), ("--batch-size 99", "--rows 32")),
    (("attribute", "--new-tokens", "0"), ("--new-tokens 0",)),
    (("ladder", "--rows", "1"), ("--rows 1", ">= 8")),
    (("ladder", "--calibration-rows", "2"), ("--calibration-rows 2",)),
    (("ladder", "--k", "4", "0"), ("--k 4 0",)),
    (("compare", ARM_A, "--poll-s", "-1"), ("--poll-s -1",)),
    (("compare", ARM_A, "--seeds", "-1"), ("--seeds -1",)),
    (("compare", ARM_A, "--lock-wait-s", "-1"), ("--lock-wait-s -1",)),
    (("compare", ARM_A, "--difficulty", "9"), ("--difficulty 9",)),
    (("train", ARM_A, "--seed", "-1"), ("--seed -1",)),
])
def test_a_number_out_of_its_range_is_refused_before_anything_loads(bloggap, tmp_path, argv, needles):
    refused(bloggap(*argv, *TINY, "--device", "cpu") if argv[0] in ("attribute", "ladder", "doctor")
            else bloggap(*argv, *TINY, "--output-dir", tmp_path / "o"), *needles)


@pytest.mark.parametrize("field, value", [
    ("repetition_penalty", 0), ("beta", -0.1), ("epsilon", -0.2), ("epsilon_high", -1), ("top_k", -1),
    ("num_train_epochs", 0), ("max_steps", 0), ("warmup_ratio", 2.0), ("logging_steps", 0), ("save_steps", -5),
    ("vllm_gpu_memory_utilization", 1.5), ("top_entropy_quantile", 1.5), ("seed", -3), ("delta", 0),
    ("loss_type", "bogus"), ("importance_sampling_level", "word"), ("scale_rewards", "always"),
    ("vllm_mode", "remote"), ("vllm_importance_sampling_mode", "clip"),
])
def test_grpo_fields_out_of_range_are_refused_where_the_recipe_is_merged(tmp_path, field, value):
    from bloggap_plugin.recipes import RecipeError, merge_grpo_config

    with pytest.raises(RecipeError, match=field):
        merge_grpo_config({field: value}, None, output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False)


def test_grpo_defaults_and_every_shipped_recipe_pass_the_range_table(tmp_path):
    from bloggap_plugin.recipes import load_recipe, merge_grpo_config

    merge_grpo_config({}, None, output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False)
    for recipe in sorted(RECIPES.glob("*.yaml")):
        grpo_kwargs, _ = load_recipe(recipe)
        merge_grpo_config(grpo_kwargs, None, output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
                          fp16=bool(grpo_kwargs.get("fp16")), use_vllm=False)


def test_a_grpo_flag_out_of_range_stops_train_before_the_model_loads(bloggap, tmp_path):
    assert_one_line_error(bloggap("train", ARM_A, *TINY, "--output-dir", tmp_path, "--repetition_penalty", "0"),
                          "repetition_penalty", "> 0")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_train_use_vllm_without_vllm_is_one_line(bloggap, tmp_path):
    assert_one_line_error(bloggap("train", ARM_A, *TINY, "--output-dir", tmp_path, "--use_vllm", "true"),
                          "use_vllm", "vLLM is not installed")


def test_report_to_none_beside_an_integration_is_refused(bloggap, tmp_path):
    assert_one_line_error(bloggap("train", ARM_A, *TINY, "--output-dir", tmp_path, "--report-to", "none", "wandb"),
                          "--report-to none wandb", "alone")
