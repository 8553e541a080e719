"""The batch-shape probe (bloggap_plugin.core.probe), its comparisons table and the recommendation (the doctor's
CLI: tests/cli/test_cli.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from bloggap_plugin.core.comparisons import COMPARISONS
from bloggap_plugin.core.probe import (
    Row,
    build_rows,
    builtin_prompts,
    compare,
    probe_model,
    score_layout,
)
from bloggap_plugin.core.recommend import recommend
from bloggap_plugin.measure.rollouts import sample_rollouts
from bloggap_plugin.models import load_model


@pytest.fixture(scope="module")
def tiny_rollouts(tiny):
    model, tokenizer = tiny
    return sample_rollouts(model, tokenizer, num_seqs=10, max_new_tokens=6, seed=3, batch_size=4)


# ---------------------------------------------------------------- rollouts and rows


def test_builtin_prompts_grid():
    prompts = builtin_prompts(66)
    assert prompts[0] == "Explain in two sentences why the ocean."
    assert prompts[8] == "List three facts about the ocean."
    assert prompts[63] == "State the main idea of vaccination."
    assert prompts[64] == prompts[0]  # cycles past the 8 x 8 grid
    assert len(set(prompts[:64])) == 64


def test_sample_rollouts_forced_length_seeded_and_rng_neutral(tiny, tiny_rollouts):
    model, tokenizer = tiny
    assert len(tiny_rollouts.rows) == 10 and tiny_rollouts.tokens == 60
    assert all(len(r.completion) == 6 for r in tiny_rollouts.rows)
    # chat template applied: the prompt ends with the assistant generation prompt
    assert tokenizer.decode(list(tiny_rollouts.rows[0].prompt)).endswith("<|im_start|>assistant\n")
    # forced length suppresses end-of-sequence (min_new_tokens), as in the reference protocol
    assert all(tokenizer.eos_token_id not in r.completion for r in tiny_rollouts.rows)
    state = torch.random.get_rng_state()
    again = sample_rollouts(model, tokenizer, num_seqs=10, max_new_tokens=6, seed=3, batch_size=4)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert again.rows == tiny_rollouts.rows
    assert torch.equal(again.sampler_logprobs, tiny_rollouts.sampler_logprobs)
    other = sample_rollouts(model, tokenizer, num_seqs=10, max_new_tokens=6, seed=4, batch_size=4)
    assert other.rows != tiny_rollouts.rows


def test_sampler_logprobs_match_teacher_forcing_in_fp32(tiny, tiny_rollouts):
    model, _ = tiny
    scored = score_layout(model, tiny_rollouts.rows, "left", 1, "mask", tiny_rollouts.pad_token_id)
    torch.testing.assert_close(scored.logprobs, tiny_rollouts.sampler_logprobs, rtol=0, atol=1e-4)


def test_build_rows_equal_length():
    rows = [Row((1, 2, 3, 4), (9, 8, 7)), Row((5, 6), (4, 3, 2, 1)), Row((7, 8, 9), (6, 5, 4))]
    equal = build_rows(rows, "equal_length")
    assert equal == [Row((3, 4), (9, 8, 7)), Row((5, 6), (4, 3, 2)), Row((8, 9), (6, 5, 4))]
    assert build_rows(rows) == rows
    with pytest.raises(ValueError, match="kind"):
        build_rows(rows, "packed")


def test_layouts_and_order_score_the_same_tokens(tiny, tiny_rollouts):
    """Left, right, chunked and permuted layouts score the same tokens: fp32 values agree closely and the
    row order is restored."""
    model, _ = tiny
    rows, pad = tiny_rollouts.rows, tiny_rollouts.pad_token_id
    alone = score_layout(model, rows, "left", 1, "mask", pad)
    for layout, size, positions in [("left", 4, "mask"), ("left", 10, "arange"), ("right", 3, "mask")]:
        other = score_layout(model, rows, layout, size, positions, pad)
        assert torch.equal(other.mask, alone.mask)
        torch.testing.assert_close(other.logprobs, alone.logprobs, rtol=0, atol=1e-4)
    reversed_order = score_layout(model, rows, "left", 1, "mask", pad, order=list(range(len(rows)))[::-1])
    assert torch.equal(reversed_order.logprobs, alone.logprobs)
    with pytest.raises(ValueError, match="permutation"):
        score_layout(model, rows, "left", 1, "mask", pad, order=[0, 0, 1])
    with pytest.raises(ValueError, match="layout"):
        score_layout(model, rows, "middle", 1, "mask", pad)


# ---------------------------------------------------------------- cells and recommendation


def test_compare_cell_hand_computed():
    ref = torch.zeros(2, 3, dtype=torch.float64)
    other = torch.tensor([[0.0, 0.2, -0.05], [float("nan"), 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    cell = compare(ref, other, mask, comparison="x", dtype="bf16")
    # out of band: 0.2 (ratio 1.22) and nan -> 2 of 5
    assert (cell["oob_count"], cell["n"], cell["oob"]) == (2, 5, 0.4)
    assert cell["nonfinite"] == 1 and cell["bitwise_equal"] is False
    # bit for bit equal: the masked 0.0s (row 0 col 0, row 1 col 1); the unmasked one and nan do not count
    assert cell["exact_count"] == 2
    assert cell["comparison"] == "x" and cell["dtype"] == "bf16"
    assert cell["ci_low"] < 0.4 < cell["ci_high"]
    same = compare(ref, ref.clone())
    assert same["oob"] == 0.0 and same["abs_dlogp_max"] == 0.0 and same["bitwise_equal"] is True
    assert same["exact_count"] == same["n"] == 6


def _cell(dtype, comparison, oob, n=1000, attn="sdpa", **extra):
    return {"dtype": dtype, "attn": attn, "comparison": comparison, "oob": oob, "oob_count": round(oob * n),
            "n": n, "abs_dlogp_mean": 0.0, "abs_dlogp_max": 0.0, "bitwise_equal": oob == 0, **extra}


def _timed(dtype, seconds):
    return _cell(dtype, "b1_vs_b8_left_mask", 0.0, seconds=seconds, tokens_forwarded=1000)


def test_recommend_arm_h_when_fp16_removes_the_gap():
    cells = [
        _cell("bf16", "b1_vs_b8_left_arange", 0.08), _timed("bf16", 1.0), _cell("bf16", "rerun_b1", 0.0),
        _cell("fp16", "b1_vs_b8_left_arange", 0.002), _timed("fp16", 1.1),
        _cell("fp32", "b1_vs_b8_left_arange", 0.0), _timed("fp32", 3.0),
    ]
    rec = recommend(cells, {"nonfinite_logprobs": 0, "max_abs_hidden": 100.0}, "cuda")
    # fp16 at both ends of the ratio (H), not fp16 old log-probs against a bf16 training forward (F)
    assert rec["arm"] == "H"
    assert "Arm F (fp16 old log-probs only)" in rec["text"] and "gap/ratio/oob_frac" in rec["text"]
    assert "fp16 removes 7.80 of 8.00 pp" in rec["text"]
    assert "1.10x" in rec["text"]
    assert rec["basis"]["fp32_cost_vs_bf16"] == pytest.approx(3.0)


def test_recommend_arm_b_when_fp16_unsafe_and_a_when_no_gap():
    cells = [
        _cell("bf16", "b1_vs_b8_left_arange", 0.05), _timed("bf16", 1.0),
        _cell("fp16", "b1_vs_b8_left_arange", 0.0), _timed("fp16", 1.0),
        _cell("fp32", "b1_vs_b8_left_arange", 0.0), _timed("fp32", 2.5),
    ]
    rec = recommend(cells, {"nonfinite_logprobs": 3, "max_abs_hidden": 70000.0}, "cuda")
    assert rec["arm"] == "B" and "not safe" in rec["text"] and "2.50x" in rec["text"]
    quiet = [_cell(d, c, 0.0) for d in ("bf16", "fp32") for c in ("b1_vs_b8_left_arange", "b1_vs_b8_right")]
    assert recommend(quiet, None, "cpu")["arm"] == "A"


def test_recommend_reports_nondeterminism_positions_and_membership():
    cells = [
        _cell("bf16", "rerun_b1", 0.01), _cell("bf16", "b1_vs_b8_left_arange", 0.08),
        _cell("bf16", "b1_vs_b8_left_mask", 0.02), _cell("bf16", "two_groupings_b8", 0.1),
        _cell("fp32", "b1_vs_b8_left_arange", 0.0),
    ]
    text = recommend(cells, None, "cpu")["text"]
    assert "nondeterministic" in text and "bf16/sdpa" in text
    assert "from 8.00% to 2.00%" in text and "gap.positions: mask" in text
    assert "arm G" in text


# ---------------------------------------------------------------- the probe on models


def test_rerun_control_is_exactly_zero(tiny, tiny_rollouts):
    model, _ = tiny
    cells, _ = probe_model(model, tiny_rollouts, ["rerun_b1"])
    (cell,) = cells
    assert cell["oob"] == 0.0 and cell["abs_dlogp_max"] == 0.0 and cell["bitwise_equal"] is True
    assert cell["n"] == tiny_rollouts.tokens


def test_probe_model_all_comparisons_on_tiny(tiny, tiny_rollouts):
    model, _ = tiny
    ticks = []
    cells, extras = probe_model(model, tiny_rollouts, hidden_check=True, progress=ticks.append)
    by_name = {c["comparison"]: c for c in cells}
    assert set(by_name) == set(COMPARISONS)
    n = tiny_rollouts.tokens
    for name, cell in by_name.items():
        expected_n = 6 if name == "copy8_vs_alone" else n
        assert cell["n"] == expected_n, name
        assert cell["oob"] == 0.0, name  # fp32 tiny random model: far inside the band
    assert by_name["b1_vs_b32_left_mask"]["batch_size"] == 10  # only 10 rows
    assert by_name["copy8_vs_alone"]["copies_identical"] in (True, False)
    assert extras["hidden_check"]["nonfinite_logprobs"] == 0 and extras["hidden_check"]["max_abs_hidden"] > 0
    # one tick per scoring pass: batch 1, the equal-length batch 8, and each comparison but the sampler's
    assert ticks[0] == "b1" and "equal b8" in ticks and len(ticks) == 2 + len(COMPARISONS) - 1
    from bloggap_plugin.core.comparisons import scoring_passes as _passes

    assert _passes(list(COMPARISONS)) == len(ticks)  # the doctor's progress-bar total
    with pytest.raises(ValueError, match="unknown comparison"):
        probe_model(model, tiny_rollouts, ["b1_vs_b64"])


@pytest.fixture(scope="module")
def real_rollouts(smollm2_fp32):
    """8 x 16 tokens sampled by the real model in fp32 (a fraction of bf16's time on a CPU without bf16
    instructions): the bf16 test's claim is about bf16 scoring of the real model's rollouts, not bf16 sampling."""
    model, tokenizer = smollm2_fp32
    return sample_rollouts(model, tokenizer, num_seqs=8, max_new_tokens=16, seed=1234, batch_size=8)


def test_real_model_bf16_left_padding_shows_the_gap(smollm2_bf16, real_rollouts):
    """On the first 4 of the 8 rollouts: bf16 scoring is slow on a CPU without bf16 instructions (each row is scored
    twice at batch 1), and 4 rows left-padded into one batch already put tokens out of band."""
    model, _ = smollm2_bf16
    cells, _ = probe_model(model, real_rollouts.subset(4), ["rerun_b1", "b1_vs_b8_left_arange"])
    rerun, left = cells
    assert rerun["oob"] == 0.0 and rerun["bitwise_equal"]
    assert left["n"] == 64
    assert left["oob_count"] > 0 and left["abs_dlogp_max"] > 0.0953  # at least one ratio above 1.1 or below 0.9


def test_real_model_fp32_has_no_gap(smollm2_fp32, real_rollouts):
    model, _ = smollm2_fp32
    cells, _ = probe_model(model, real_rollouts, ["rerun_b1", "b1_vs_b8_left_arange"])
    rerun, left = cells
    assert rerun["bitwise_equal"]
    assert left["n"] == 128 and left["oob"] == 0.0
    assert left["abs_dlogp_max"] < 1e-3


def test_recommend_compares_a_scaled_down_dtype_on_the_same_rows():
    full = [
        _cell("bf16", "b1_vs_b8_left_arange", 0.09, n=768, rows=32), _timed("bf16", 1.0),
        _cell("fp16", "b1_vs_b8_left_arange", 0.0, n=192, rows=8), _timed("fp16", 1.0),
        _cell("fp32", "b1_vs_b8_left_arange", 0.0, n=768, rows=32), _timed("fp32", 2.0),
    ]
    # bf16 on the same 8 rows shows the gap: fp16 is credited with removing it there
    paired = [_cell("bf16", "b1_vs_b8_left_arange", 0.078, n=192, rows=8)]
    rec = recommend(full, {"nonfinite_logprobs": 0, "max_abs_hidden": 1.0}, "cuda", paired)
    assert rec["arm"] == "H" and "removes 7.80 of 7.80 pp on the 8 rows" in rec["text"]
    # the same cells on a CPU: arm H cannot take effect there (no fp16 autocast), fp32 decides, fp16 is named
    rec = recommend(full, {"nonfinite_logprobs": 0, "max_abs_hidden": 1.0}, "cpu", paired)
    assert rec["arm"] == "B" and "fp16 would remove it" in rec["text"] and "CUDA" in rec["text"]
    # one sentence: what holds on this CPU follows the clause that names it
    assert "choose arm H; on this CPU, fp32 removes 9.00 of 9.00 pp" in rec["text"], rec["text"]
    # bf16 shows nothing on those 8 rows: fp16 is not shown to help, fp32 (all rows) decides
    quiet_pair = [_cell("bf16", "b1_vs_b8_left_arange", 0.0, n=192, rows=8)]
    rec = recommend(full, {"nonfinite_logprobs": 0, "max_abs_hidden": 1.0}, "cpu", quiet_pair)
    assert rec["arm"] == "B" and "not shown to help" in rec["text"] and "bf16: false" in rec["text"]
    # without any bf16 cell on the fp16 rows, fp16 cannot be credited either
    assert recommend(full, None, "cpu")["arm"] == "B"


def test_tables_benchmark_quick_on_tiny_model(tmp_path, capsys):
    from benchmarks import tables as module

    assert module.main(["--out", str(tmp_path), "--quick", "--device", "cpu", "--model", "tiny-random-llama"]) == 0
    result = json.loads((tmp_path / "tables.json").read_text())
    from bloggap_plugin.report_builder import validate_result

    validate_result(result, tmp_path / "tables.json")  # what `bloggap report` will load
    assert result["benchmark"] == "tables" and result["schema_version"] == 1
    assert result["env"]["torch"] == torch.__version__ and result["params"]["quick"] is True
    assert result["params"]["complete"] is True
    ids = [t["id"] for t in result["tables"]]
    assert ids == ["T1", "T2", "T3", "T4", "T5", "T6", "POS", "HW"]
    refs = {t["id"]: t["reference"] for t in result["tables"]}
    assert refs == {"T1": "T1", "T2": "T2", "T3": "T3", "T4": "T4", "T5": "T5", "T6": "T6", "POS": None,
                    "HW": "T1b"}
    for t in result["tables"]:
        assert t["random_init"] is True and "RANDOM-INIT" in t["notes"]
        assert all(len(row) == len(t["columns"]) for row in t["rows"]), t["id"]
    t3 = result["results"]["T3"]
    assert t3["sanity_ok"] is True  # padded-1 vs packed-1 in fp32
    t4 = result["results"]["T4"]
    assert t4["flex_attention"]["skipped"].startswith("--quick on CPU")
    assert t4["sdpa"]["n"] == sum(v["n"] for v in t4["sdpa"]["per_seed"].values())
    hw = next(t for t in result["tables"] if t["id"] == "HW")
    assert any(row[0] == "RTX 4090" for row in hw["rows"])  # the reference cards beside this device
    assert "HW:" in capsys.readouterr().out  # the short tables are printed last


def test_stop_at_eos_gives_ragged_rows_ending_at_eos(tiny):
    model, tokenizer = tiny
    eos = tokenizer.eos_token_id
    # make eos likely: scale up the eos row of the head of a copy (the fixture stays untouched)
    import copy

    biased = copy.deepcopy(model)
    with torch.no_grad():
        biased.lm_head.weight[eos] += 0.5 * biased.lm_head.weight.abs().max()
    rollouts = sample_rollouts(biased, tokenizer, num_seqs=8, max_new_tokens=12, seed=0, batch_size=4,
                               stop_at_eos=True)
    lengths = [len(r.completion) for r in rollouts.rows]
    assert any(n < 12 for n in lengths)  # some ended early
    for row, n in zip(rollouts.rows, lengths):
        assert eos not in row.completion[:-1]
        assert row.completion[-1] == eos or n == 12
    assert rollouts.sampler_mask.sum(1).tolist() == lengths and rollouts.tokens == sum(lengths)
    # ragged rows score under the TRL layout (completions right-padded) like alone
    alone = score_layout(biased, rollouts.rows, "left", 1, "mask", rollouts.pad_token_id)
    batched = score_layout(biased, rollouts.rows, "left", 8, "mask", rollouts.pad_token_id)
    assert torch.equal(alone.mask, batched.mask) and alone.mask.sum().item() == sum(lengths)
    torch.testing.assert_close(batched.logprobs[alone.mask], alone.logprobs[alone.mask], rtol=0, atol=1e-4)
    torch.testing.assert_close(rollouts.sampler_logprobs[alone.mask], alone.logprobs[alone.mask], rtol=0, atol=1e-4)


def test_fp16_check_sees_overflow_and_json_stays_strict(tiny_rollouts):
    from bloggap_plugin.results import jsonable as json_safe

    model, _ = load_model("tiny-random-llama", dtype="fp16")
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(2e6)  # embeddings of order 4e4..2e5: beyond fp16s 65,504
    cells, extras = probe_model(model, tiny_rollouts, ["rerun_b1"], hidden_check=True)
    check = extras["hidden_check"]
    assert check["max_abs_hidden"] > 30000 or check["nonfinite_hidden"] > 0
    # NaN twice is still a deterministic rerun; the NaNs count out of band
    (rerun,) = cells
    assert rerun["bitwise_equal"] is True
    assert rerun["nonfinite"] == check["nonfinite_logprobs"] and rerun["oob_count"] >= rerun["nonfinite"]
    assert check["n"] == tiny_rollouts.tokens
    verdict = recommend(
        [_cell("bf16", "b1_vs_b8_left_arange", 0.05), _cell("fp16", "b1_vs_b8_left_arange", 0.0),
         _cell("fp32", "b1_vs_b8_left_arange", 0.0)],
        check,
        "cuda",
    )
    assert verdict["arm"] == "B" and "fp16 check failed" in verdict["text"]
    assert json_safe({"x": [float("nan"), float("inf"), 1.5], "y": "z"}) == {"x": [None, None, 1.5], "y": "z"}
    json.dumps(json_safe(cells), allow_nan=False)


# ---------------------------------------------------------------- the comparisons table and the recommendation record


def test_comparisons_table_fields_and_derived_sets():
    from bloggap_plugin.core.comparisons import (
        BATCH_SHAPE_COMPARISONS,
        CPU_FP16_COMPARISONS,
        PAIRABLE,
        comparison,
        scoring_passes,
    )

    assert list(COMPARISONS) == [
        "rerun_b1", "b1_vs_b8_left_arange", "b1_vs_b8_left_mask", "b1_vs_b32_left_arange", "b1_vs_b32_left_mask",
        "b1_vs_b8_right", "b1_vs_b8_equal_nopad", "copy8_vs_alone", "two_groupings_b8", "sampler_vs_b1",
    ]  # the doctor's table order
    assert CPU_FP16_COMPARISONS == ("rerun_b1", "b1_vs_b8_left_arange", "b1_vs_b8_left_mask", "sampler_vs_b1")
    assert PAIRABLE == ("rerun_b1", "b1_vs_b8_left_arange", "b1_vs_b8_left_mask", "b1_vs_b8_right")
    assert BATCH_SHAPE_COMPARISONS == tuple(list(COMPARISONS)[1:-1])
    spec = comparison("b1_vs_b32_left_arange")
    assert (spec.layout, spec.batch_size, spec.positions, spec.min_rows) == ("left", 32, "arange", 32)
    assert comparison("b1_vs_b8_right").scoring_layout == "right"
    assert comparison("copy8_vs_alone").scoring_layout == "left"  # rows without padding are laid out left
    with pytest.raises(ValueError, match="unknown comparison 'b1_vs_b64'"):
        comparison("b1_vs_b64")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.batch_size = 16
    # batch 1, one pass per comparison but the sampler's, the shared equal-length batch 8 once
    assert scoring_passes(["sampler_vs_b1"]) == 1
    assert scoring_passes(["b1_vs_b8_equal_nopad", "two_groupings_b8"]) == 4
    assert scoring_passes(list(COMPARISONS)) == 11


def test_probe_cells_record_the_tables_layout_positions_and_batch(tiny, tiny_rollouts):
    model, _ = tiny
    cells, _ = probe_model(model, tiny_rollouts)  # 10 rows sampled in generate batches of 4
    recorded = {c["comparison"]: (c["layout"], c["positions"], c["batch_size"], c["rows"]) for c in cells}
    assert recorded == {
        "rerun_b1": ("left", "mask", 1, 10),
        "b1_vs_b8_left_arange": ("left", "arange", 8, 10),
        "b1_vs_b8_left_mask": ("left", "mask", 8, 10),
        "b1_vs_b32_left_arange": ("left", "arange", 10, 10),
        "b1_vs_b32_left_mask": ("left", "mask", 10, 10),
        "b1_vs_b8_right": ("right", "mask", 8, 10),
        "b1_vs_b8_equal_nopad": ("none", "mask", 8, 10),
        "copy8_vs_alone": ("none", "mask", 8, 1),
        "two_groupings_b8": ("none", "mask", 8, 10),
        "sampler_vs_b1": ("generate", "mask", 4, 10),
    }


def test_recommendation_is_a_record_that_one_renderer_turns_into_the_text():
    from bloggap_plugin.core.recommend import Recommendation, decide, render

    cells = [
        _cell("bf16", "b1_vs_b8_left_arange", 0.08), _timed("bf16", 1.0), _cell("bf16", "rerun_b1", 0.01),
        _cell("fp16", "b1_vs_b8_left_arange", 0.002), _timed("fp16", 1.1),
        _cell("bf16", "two_groupings_b8", 0.1),
    ]
    decision = decide(cells, {"nonfinite_logprobs": 0, "max_abs_hidden": 100.0}, "cuda")
    assert isinstance(decision, Recommendation) and decision.arm == "H"
    assert [r.kind for r in decision.reasons] == ["nondeterministic", "gap", "arm_h", "positions_mask", "membership"]
    arm_h = decision.reasons[2]
    assert (arm_h.cells["cell"].oob, arm_h.cells["ref"].oob, arm_h.numbers["dtype"]) == (0.002, 0.08, "fp16")
    assert arm_h.numbers["cost"] == pytest.approx(1.1)
    assert decision.basis["bf16_headline"] == 0.08 and decision.basis["fp16_safe"] is True
    text = render(decision)
    assert text == recommend(cells, {"nonfinite_logprobs": 0, "max_abs_hidden": 100.0}, "cuda")["text"]
    lead, first = text.splitlines()[:2]  # the arm and its reason first, then one line per finding
    assert lead.startswith("arm H (fp16 everywhere: fp16: true): fp16 takes bf16's 8.00% out of band to 0.20%")
    assert first.startswith("  - The forward is nondeterministic on this device (batch-1 rerun differs for bf16/sdpa)")
    assert "fp16 removes 7.80 of 8.00 pp (bf16 8.00% (80/1000 tokens, sdpa), fp16 0.20% (2/1000 tokens, sdpa))" in text
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.arm = "A"
    assert decide([], None).reasons[0].kind == "no_bf16" and decide([], None).arm is None


def test_on_a_cpu_the_recommendation_is_not_arm_h():
    """Arm H needs fp16 autocast, which accelerate runs on CUDA only: on a CPU the same cells recommend the fp32 fix
    (arm B) and say that fp16 would remove the gap on a GPU (arm H); with no fp32 cell, no arm, and the same note."""
    cells = [
        _cell("bf16", "b1_vs_b8_left_arange", 0.08), _timed("bf16", 1.0), _cell("bf16", "rerun_b1", 0.0),
        _cell("fp16", "b1_vs_b8_left_arange", 0.002), _timed("fp16", 40.0),
        _cell("fp32", "b1_vs_b8_left_arange", 0.0), _timed("fp32", 3.0),
    ]
    check = {"nonfinite_logprobs": 0, "max_abs_hidden": 100.0}
    rec = recommend(cells, check, "cpu")
    assert rec["arm"] == "B" and "arm H" in rec["text"] and "CUDA" in rec["text"]
    no_fp32 = recommend([c for c in cells if c["dtype"] != "fp32"], check, "cpu")
    assert no_fp32["arm"] is None and "CUDA" in no_fp32["text"]
    assert recommend(cells, check, "cuda")["arm"] == "H"
