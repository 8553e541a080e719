"""Recipe loading and validation: every shipped recipe loads; bad keys, types and values name the problem."""

from __future__ import annotations

import pytest
from _support import ROOT

from bloggap_plugin.recipes import (
    ARMS,
    GapConfig,
    RecipeError,
    config_differences,
    load_recipe,
    merge_grpo_config,
    parse_recipe,
)

RECIPES = ROOT / "recipes"


@pytest.mark.parametrize("arm", ARMS)
def test_shipped_arm_recipes_load(arm):
    grpo_kwargs, gap = load_recipe(RECIPES / f"arm_{arm}.yaml")
    assert gap.arm == arm
    assert grpo_kwargs["num_iterations"] == 2  # old log-probs drive the loss
    config = merge_grpo_config(grpo_kwargs, output_dir="/tmp/bloggap-test", use_cpu=True, bf16=False, fp16=False)
    assert config.num_iterations == 2
    if arm == "H":
        assert grpo_kwargs["fp16"] is True and grpo_kwargs["bf16"] is False


def test_trunc_recipe_renormalizes_at_top_p_08():
    grpo_kwargs, gap = load_recipe(RECIPES / "trunc_top_p08.yaml")
    assert grpo_kwargs["top_p"] == 0.8
    assert gap.kept == "renormalize" and gap.sampler


def test_unknown_gap_key_names_it_and_suggests(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("gap:\n  arm: B\n  probe_row: 4\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    message = str(err.value)
    assert "'probe_row'" in message and "did you mean 'probe_rows'" in message
    assert "force_old_logprobs" in message  # lists the valid keys


def test_unknown_grpo_key_names_it_and_suggests():
    with pytest.raises(RecipeError, match=r"unknown key 'learning_rat'.*did you mean 'learning_rate'"):
        parse_recipe({"learning_rat": 1e-6})


@pytest.mark.parametrize(
    ("section", "pattern"),
    [
        ({"band": "wide"}, r"gap\.band must be float"),
        ({"sampler": 1}, r"gap\.sampler must be bool"),
        ({"probe_rows": True}, r"gap\.probe_rows must be int"),
        ({"arm": "Z"}, r"gap\.arm: unknown arm 'Z'"),
        ({"band": 1.5}, r"gap\.band must be in \(0, 1\)"),
        ({"positions": "left"}, r"gap\.positions must be one of mask, arange"),
        ({"kept": "renorm"}, r"gap\.kept must be one of renormalize, measure, off"),
        ({"arm": "B", "layers": [1]}, r"gap\.layers only applies to arm D"),
        ({"arm": "D", "layers": [1, "x"]}, r"gap\.layers must be a list of integer layer ids"),
        ({"kept": "renormalize", "sampler": False}, r"renormalize needs a kept-set source"),
        ({"score_chunk_tokens": -1}, r"gap\.score_chunk_tokens must be >= 0 .*0 = untiled"),
        ({"score_chunk_tokens": 512.0}, r"gap\.score_chunk_tokens must be int"),
        ({"tf32": "on"}, r"gap\.tf32 must be true, false or auto, got 'on'"),
        ({"tf32": 1}, r"gap\.tf32 must be bool or str"),
        ({"arm": "A", "matmul_tiles": "t.json"}, r"gap\.matmul_tiles only applies to arms I and J .*arm is A: drop it"),
        ({"arm": "J", "i_pieces": "all,batch_invariant=false", "matmul_tiles": "t.json"},
         r"gap\.matmul_tiles only applies .*gap\.i_pieces 'all,batch_invariant=false' turns them off: drop it"),
        ({"arm": "J", "matmul_tiles": " "}, r"gap\.matmul_tiles is empty: give the path of a tile table"),
        ({"arm": "J", "matmul_tiles": 3}, r"gap\.matmul_tiles must be str, got int 3"),
    ],
)
def test_bad_values_name_the_field(section, pattern):
    with pytest.raises(RecipeError, match=pattern):
        parse_recipe({"gap": section})


def test_arm_aliases_and_layer_check():
    assert GapConfig(arm="fp16").arm == "F"
    assert GapConfig(arm="matched").arm == "G"
    gap = GapConfig(arm="D", layers=[0, 29])
    gap.check_layers(30)
    with pytest.raises(RecipeError, match=r"\[29\] out of range; this model has 2 decoder layers"):
        gap.check_layers(2)


def test_not_a_mapping_and_missing_file(tmp_path):
    with pytest.raises(RecipeError, match="must be a mapping"):
        parse_recipe(["arm"])
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")


def test_merge_and_differences():
    from trl import GRPOConfig

    base = GRPOConfig(output_dir="/tmp/bloggap-test", use_cpu=True, bf16=False, learning_rate=3e-6)
    merged = merge_grpo_config({"num_iterations": 2}, base, max_steps=5)
    assert (merged.learning_rate, merged.num_iterations, merged.max_steps) == (3e-6, 2, 5)
    diffs = config_differences({"num_iterations": 2, "learning_rate": 3e-6}, base)
    assert diffs == {"num_iterations": (2, 1)}


def test_score_chunk_tokens_default_is_the_scorings():
    from bloggap_plugin.core.scoring import DEFAULT_CHUNK_TOKENS

    assert GapConfig().score_chunk_tokens == DEFAULT_CHUNK_TOKENS
    assert parse_recipe({"gap": {"score_chunk_tokens": 0}})[1].score_chunk_tokens == 0  # untiled


def test_tf32_values():
    assert GapConfig().tf32 is False  # IEEE fp32 whatever the process-wide flag says
    for value in (True, False, "auto"):
        assert parse_recipe({"gap": {"tf32": value}})[1].tf32 == value


def test_arm_registry_is_the_one_vocabulary():
    """One record per arm: recipes (GapConfig), make_plan and the adapters read the same fields."""
    from bloggap_plugin.core.arms import ARMS as RECORDS
    from bloggap_plugin.core.arms import PLAN_NAMES, get_arm, plan_name

    assert tuple(RECORDS) == ARMS == ("A", "B", "C", "D", "E", "F", "G", "H", "I", "J")
    plans = {"A": None, "B": "fp32", "C": "bf16", "D": "guided", "E": "fp32_head", "F": "fp16", "G": None, "H": None,
             "I": "vllm", "J": "vllm"}
    assert {letter: arm.plan for letter, arm in RECORDS.items()} == plans
    assert {letter for letter, arm in RECORDS.items() if arm.keeps_trl_forward} == {"A", "H"}
    assert {letter for letter, arm in RECORDS.items() if arm.scores_after_shuffle} == {"G"}
    assert {letter for letter, arm in RECORDS.items() if arm.needs_fp16_training} == {"H"}
    assert {letter for letter, arm in RECORDS.items() if arm.takes_layers} == {"D"}
    assert {letter for letter, arm in RECORDS.items() if arm.onpolicy_forward} == {"J"}
    assert RECORDS["J"].vllm_engine == RECORDS["I"].vllm_engine and RECORDS["J"].prefill_in_one_step
    for alias, letter in (("bf16", "C"), ("FP32", "B"), ("fp16", "F"), ("fp32_head", "E"), ("guided", "D"),
                          ("matched", "G"), ("default", "A"), ("h", "H"), ("vllm", "I"), ("onpolicy", "J")):
        assert get_arm(alias).letter == letter == GapConfig(arm=alias).arm
        assert GapConfig(arm=alias).plan_arm == plans[letter]
    # make_plan's vocabulary: plan names, planned letters, and A for the policy as called
    assert [plan_name(p) for p in PLAN_NAMES] == list(PLAN_NAMES)
    assert {letter: plan_name(letter) for letter in "ABCDEFI"} == {"A": "bf16", **{k: plans[k] for k in "BCDEFI"}}
    with pytest.raises(ValueError, match=r"unknown arm 'Q'; use one of A, B, C, D, E, F, G, H, I, J \(or an alias: "):
        get_arm("Q")
    for letter in "GH":
        with pytest.raises(ValueError, match="unknown scoring arm"):
            plan_name(letter)
