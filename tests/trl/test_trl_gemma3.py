"""Gemma 3 (issue 50) in TRL's GRPO on CPU, on tiny-random-gemma3 (Gemma 3's text decoder at toy size): the arms
that keep TRL's forward or a precision plan train on it; arms I and J, which compute Llama-family decoders the way
vLLM does, refuse it at attach, naming the pieces Gemma's decoder needs that they lack."""

from __future__ import annotations

import math
import warnings

import pytest
from _support.trl_runs import logs_of, make

from bloggap_plugin.core.plans.vllm_shadow import FAMILY_PIECES_MISSING, check_vllm_form_supported
from bloggap_plugin.models import load_model
from bloggap_plugin.recipes import GapConfig, RecipeError
from bloggap_plugin.trl import GapCallback

GEMMA = "tiny-random-gemma3"


def test_the_vllm_form_check_names_gemmas_missing_pieces_and_passes_llama():
    gemma, _ = load_model(GEMMA)
    with pytest.raises(ValueError) as info:
        check_vllm_form_supported(gemma)
    text = str(info.value)
    assert "Gemma3ForCausalLM has model_type 'gemma3_text'" in text and text.endswith("use another arm (A-H) for "
                                                                                       "this model")
    for piece in FAMILY_PIECES_MISSING["gemma3_text"]:
        assert piece in text
    check_vllm_form_supported(load_model("tiny-random-llama")[0])  # no error
    with pytest.raises(ValueError, match=r"model_type 'gpt_neox' \(supported: llama, qwen2\)"):
        check_vllm_form_supported(load_model("tiny-random-gpt_neox")[0])


@pytest.mark.parametrize("arm", ["I", "J"])
def test_arms_i_and_j_refuse_gemma3_at_attach(tmp_path, arm):
    """Refused when the callback attaches (before any generation), one line naming the arm, the pieces and the fix;
    nothing of the plugin is left on the trainer."""
    trainer = make(tmp_path, mode="plain", model_name=GEMMA, gradient_checkpointing=False)
    with warnings.catch_warnings(), pytest.raises(RecipeError) as info:
        warnings.simplefilter("ignore")
        GapCallback(trainer, gap=GapConfig(arm=arm, i_pieces="torch", positions="mask", probe_rows=0))
    text = str(info.value)
    assert text.startswith(f"arm {arm}: arms I and J compute Llama-family decoders the way vLLM does")
    assert "the GELU-tanh gated MLP" in text and "\n" not in text
    assert not [name for name in trainer.__dict__ if name.startswith("_gap")]


@pytest.mark.parametrize("arm", ["A", "B"])
def test_gemma3_trains_with_the_gap_metrics(tmp_path, arm, trains):
    """Arm A (metrics only) and arm B (an fp32 shadow of the policy) on Gemma 3's decoder: two steps, the gap metrics
    at the first iteration; arm B's fp32 old log-probs against an fp32 policy leave no out-of-band ratio."""
    trainer = make(tmp_path, GapConfig(arm=arm, probe_rows=2, probe_every=1), model_name=GEMMA)
    trainer.train()
    logs = logs_of(trainer)
    assert len(logs) == 2 and all(math.isfinite(log["loss"]) for log in logs)
    first = logs[0]
    assert 0.0 <= first["gap/ratio/oob_frac"] <= 1.0 and 0.0 <= first["gap/ratio/exact_frac"] <= 1.0
    if arm == "B":
        assert first["gap/ratio/oob_frac"] == 0.0
