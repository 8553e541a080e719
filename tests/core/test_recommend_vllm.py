"""The doctor's recommendation with the vLLM sampler column (issue 49 item 3), from hand-made cells: the arm is the
batch-shape one, and a finding reports the sampler-vs-trainer gap of the arm's trainer dtype."""

from __future__ import annotations

import pytest

from bloggap_plugin.core.recommend import recommend

SAFE = {"nonfinite_logprobs": 0, "max_abs_hidden": 100.0}


def _cell(dtype, comparison, oob, n=1000, attn="sdpa", **extra):
    return {"dtype": dtype, "attn": attn, "comparison": comparison, "oob": oob, "oob_count": round(oob * n), "n": n,
            **extra}


def _timed(dtype, seconds):
    return _cell(dtype, "b1_vs_b8_left_mask", 0.0, seconds=seconds, tokens_forwarded=1000)


def _column(*cells, engine_dtype="bfloat16"):
    return {"cells": list(cells), "sampler": {"vllm": "0.26.0", "engine_dtype": engine_dtype}}


def _sampler(dtype, oob, exact, attn="sdpa", n=1000):
    return _cell(dtype, "sampler_vs_b1", oob, n=n, attn=attn, exact_count=exact)


NO_GAP = [_cell(d, c, 0.0) for d in ("bf16", "fp32") for c in ("b1_vs_b8_left_arange", "b1_vs_b8_right")]
FP32_REMOVES = [_cell("bf16", "b1_vs_b8_left_arange", 0.02), _timed("bf16", 1.0),
                _cell("fp32", "b1_vs_b8_left_arange", 0.0), _timed("fp32", 2.0)]


def test_arm_a_reports_the_bf16_gap_to_vllm_the_worst_attention_and_that_it_exceeds_the_batch_shape_gap():
    column = _column(_sampler("bf16", 0.01, 500), _sampler("bf16", 0.03, 250, attn="eager"),
                     _sampler("fp32", 0.004, 0))
    rec = recommend(NO_GAP, None, "cuda", (), column)
    assert rec["arm"] == "A"  # the column does not change the arm: the batch-shape arms do not remove a sampler gap
    line = rec["text"].splitlines()[-1]
    assert line == (
        "  - With vLLM (TRL's colocate engine, vLLM 0.26.0, engine dtype bfloat16), its processed log-probs vs each "
        "scoring at batch 1: bf16 3.00% out of band, 25.00% bitwise (1000 tokens, eager); fp32 0.40% out of band, "
        "0.00% bitwise (1000 tokens, sdpa). arm A scores old log-probs in bf16: 3.00% of tokens out of band against "
        "the sampler: the gap you train with; the batch-shape arms do not remove it (TRL's "
        "vllm_importance_sampling_correction reweights it; arm I scores old log-probs in vLLM's form, docs/arm_i.md), "
        "and it is larger than bf16's batch-shape gap (0.00%).")
    assert rec["basis"]["vllm_sampler"] == {"oob": {"bf16": 0.03, "fp32": 0.004}, "exact": {"bf16": 0.25, "fp32": 0.0},
                                            "trainer_dtype": "bf16"}


def test_arm_b_reads_the_fp32_row_and_a_bitwise_row_says_the_ratio_starts_at_1():
    rec = recommend(FP32_REMOVES, None, "cuda", (), _column(_sampler("bf16", 0.05, 10), _sampler("fp32", 0.0, 1000)))
    assert rec["arm"] == "B"
    assert rec["text"].endswith("arm B scores old log-probs in fp32: bit for bit equal to the sampler, the ratio "
                                "starts at 1.")
    assert rec["basis"]["vllm_sampler"]["trainer_dtype"] == "fp32"


def test_a_gap_below_the_batch_shape_gap_is_reported_without_the_comparison():
    rec = recommend(FP32_REMOVES, None, "cuda", (), _column(_sampler("fp32", 0.01, 0)))
    assert rec["text"].endswith("1.00% of tokens out of band against the sampler: the gap you train with; the "
                                "batch-shape arms do not remove it (TRL's vllm_importance_sampling_correction "
                                "reweights it; arm I scores old log-probs in vLLM's form, docs/arm_i.md).")


def test_the_arms_dtype_unmeasured_and_arm_h_against_a_bf16_engine_are_said():
    rec = recommend(FP32_REMOVES, None, "cuda", (), _column(_sampler("bf16", 0.05, 10)))
    assert rec["text"].endswith("The fp32 scoring the arm trains with was not measured.")
    arm_h = [_cell("bf16", "b1_vs_b8_left_arange", 0.08), _timed("bf16", 1.0),
             _cell("fp16", "b1_vs_b8_left_arange", 0.0), _timed("fp16", 1.0)]
    rec = recommend(arm_h, SAFE, "cuda", (), _column(_sampler("fp16", 0.2, 0)))
    assert rec["arm"] == "H"
    assert ("arm H scores old log-probs in fp16: arm H builds an fp16 engine, and this column's engine ran in bfloat16, "
            "so its fp16 row is not arm H's sampler gap: 20.00% of tokens") in rec["text"]


@pytest.mark.parametrize("column", [None, {"absent": "turned off (--no-vllm)"}, _column(),
                                    _column({**_sampler("bf16", 0.0, 0), "oob": None, "skipped": "failed"})])
def test_without_measured_cells_the_advice_is_the_one_without_vllm(column):
    assert recommend(FP32_REMOVES, None, "cuda", (), column) == recommend(FP32_REMOVES, None, "cuda")


def test_arm_is_form_is_told_beside_the_scorings():
    column = _column(_sampler("bf16", 0.02, 100))
    column["arm_i"] = {"pieces": "all", "cell": {**_sampler("bf16", 0.0, 1000), "attn": "vllm_form"}}
    rec = recommend(NO_GAP, None, "cuda", (), column)
    assert ("bf16 2.00% out of band, 10.00% bitwise (1000 tokens, sdpa); arm I's form (pieces all, one batch) 0.00% "
            "out of band, 100.00% bitwise.") in rec["text"]
    assert rec["basis"]["vllm_sampler"]["arm_i"] == {"oob": 0.0, "exact": 1.0}
    assert rec["basis"]["vllm_sampler"]["oob"] == {"bf16": 0.02}  # arm I's cell is not a bf16 scoring's


@pytest.mark.parametrize("batch_invariant", [False, True, None])
def test_arm_is_form_says_when_the_engine_was_not_arm_is_batch_invariant_one(batch_invariant):
    """Arm I's engine runs vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1); TRL's default engine does not, and
    arm I's form scored against that engine is not arm I's sampler gap."""
    column = _column(_sampler("bf16", 0.02, 100))
    if batch_invariant is not None:
        column["sampler"]["batch_invariant"] = batch_invariant
    column["arm_i"] = {"pieces": "all", "cell": {**_sampler("bf16", 0.1, 2), "attn": "vllm_form"}}
    text = recommend(NO_GAP, None, "cuda", (), column)["text"]
    said = ("arm I's form (pieces all, one batch) 10.00% out of band, 0.20% bitwise, against an engine without vLLM's "
            "batch-invariant mode, which arm I's own engine runs (VLLM_BATCH_INVARIANT=1): not arm I's sampler gap")
    assert (said in text) is (batch_invariant is False)
    assert "arm I's form (pieces all, one batch) 10.00% out of band, 0.20% bitwise" in text
