"""Per-layer divergence attribution (core/divergence.py) and the guided-layer choice."""

from __future__ import annotations

import pytest
import torch

from bloggap_plugin.core.divergence import (
    best_window,
    divergence_profile,
    layer_increments,
    quartile_sums,
    strip_padding,
    top_k_layers,
)
from bloggap_plugin.core.model_parts import decoder_layers
from bloggap_plugin.core.plans import make_plan
from bloggap_plugin.models import load_model

TEXTS = ["hello world this is long", "2 + 3 = 5", "abc", "def add(a, b): return a + b", "Zz", "the end of it"]


def _rows(tok, texts=TEXTS):
    enc = tok(texts, padding=True, return_tensors="pt")
    return enc.input_ids, enc.attention_mask


def test_increments_quartiles_topk_window_exact():
    div = [0.0, 0.5, 0.5, 1.5, 1.0, 1.25, 3.25, 3.0, 3.0, 3.5]  # 9 layers
    inc = layer_increments(div)
    assert inc == [0.5, 0.0, 1.0, -0.5, 0.25, 2.0, -0.25, 0.0, 0.5]
    # q = 9 // 4 = 2 layers per quarter, the remaining 3 to Q4
    assert quartile_sums(inc) == [0.5, 0.5, 2.25, 0.25]
    assert top_k_layers(inc, 3) == [5, 2, 0]  # ties (0.5 at 0 and 8): lower id first
    assert top_k_layers(inc, 4) == [5, 2, 0, 8]
    assert top_k_layers(inc, 0) == []
    assert best_window(inc, 1) == [5]
    # window sums of 3 by start: 1.5, 0.5, 0.75, 1.75, 2.0, 1.75, 0.25
    assert best_window(inc, 3) == [4, 5, 6]
    assert best_window(inc, 9) == list(range(9))
    assert best_window([1.0, 0.0, 1.0], 1) == [0]  # earliest on ties


def test_window_sums_are_the_maximum():
    inc = [0.1, -0.3, 0.4, 0.4, -0.1, 0.05, 0.6, -0.2]
    for k in range(1, len(inc) + 1):
        chosen = best_window(inc, k)
        assert chosen == list(range(chosen[0], chosen[0] + k))
        best = max(sum(inc[s : s + k]) for s in range(len(inc) - k + 1))
        assert sum(inc[chosen[0] : chosen[0] + k]) == best


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"k must be an integer in \[0, 3\]"):
        top_k_layers([0.0, 1.0, 2.0], 4)
    with pytest.raises(ValueError, match="k must be an integer"):
        best_window([0.0, 1.0], -1)
    with pytest.raises(ValueError, match="at least 4 layers"):
        quartile_sums([1.0, 2.0])
    with pytest.raises(ValueError, match="not contiguous"):
        strip_padding(torch.tensor([5, 6, 7, 8]), torch.tensor([1, 0, 1, 1]))
    ids, start = strip_padding(torch.tensor([0, 0, 7, 8, 9]), torch.tensor([0, 0, 1, 1, 1]))
    assert ids.tolist() == [[7, 8, 9]] and start == 2
    model, tok = load_model("tiny-random-llama", dtype="bf16")
    ids, mask = _rows(tok)
    with pytest.raises(ValueError, match="need >= 2 rows"):
        divergence_profile(model, ids[:1], mask[:1])


NOISE = 1e-5
"""Kernel noise of the tiny bf16 model between batch shapes on CPU: 0 on some CPUs, 3.1e-6 on an AMD EPYC (CI's
machine); a misalignment of compared positions compares different tokens' states, which differ by order 1."""


def test_batch_invariant_model_gives_only_kernel_noise():
    # the embedding lookup is exact; deeper layers carry at most the CPU kernels' batch-shape noise. Any
    # misalignment of compared positions between the unpadded single rows and the left-padded batch would show
    # as a value of order 1
    model, tok = load_model("tiny-random-llama", dtype="bf16")
    ids, mask = _rows(tok)
    assert (mask == 0).any()  # left padding present
    profile = divergence_profile(model, ids, mask, batch_size=4)
    assert profile.divergence[0] == 0.0 and max(profile.divergence) < NOISE and profile.final_norm_divergence < NOISE
    assert profile.n_tokens == int(mask.sum()) and profile.n_rows == len(TEXTS)
    assert all(abs(x) < NOISE for x in profile.increments)
    k2 = divergence_profile(model, ids, mask, batch_size=4, logits_to_keep=2)
    # the 2 positions scoring the last 2 tokens; "Zz" has only one real position among them
    assert k2.n_tokens == 2 * (len(TEXTS) - 1) + 1 and k2.divergence[0] == 0.0 and max(k2.divergence) < NOISE


def _batch_dependent(layer, scale=1e-2):
    """A forward hook making ``layer`` depend on the batch shape: batches of > 1 row get a shift."""

    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.shape[0] > 1:
            hidden = hidden + scale
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    return layer.register_forward_hook(hook)


def test_divergence_enters_at_the_perturbed_layer_and_auto_picks_it():
    model, tok = load_model("tiny-random-llama", dtype="bf16")
    ids, mask = _rows(tok)
    handle = _batch_dependent(decoder_layers(model)[1])
    try:
        profile = divergence_profile(model, ids, mask, batch_size=3)
        assert profile.divergence[0] == 0.0 and profile.divergence[1] < NOISE
        assert profile.divergence[2] > 1e-3 and profile.final_norm_divergence > 0
        assert profile.top_k(1) == [1] and profile.best_window(1) == [1]
        calibration = _rows(tok, ["a calibration row", "another one here", "xy z", "more text 123"])
        plan = make_plan(model, "D", layers="auto", k=1, calibration=calibration)
        assert plan.layers == [1] and plan.stats()["layers"] == [1]
        assert plan.profile.divergence[2] > 0
    finally:
        handle.remove()
    as_dict = profile.to_dict(k=1)
    assert as_dict["top_k"] == [1] and as_dict["best_window"] == [1] and as_dict["n_layers"] == 2
    assert "quartile_sums" not in as_dict


def test_hooks_removed_and_policy_unchanged():
    model, tok = load_model("tiny-random-qwen2", dtype="bf16")
    before = {n: p.clone() for n, p in model.named_parameters()}
    divergence_profile(model, *_rows(tok), batch_size=4)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_smollm2_bf16_left_padding_divergence(smollm2_bf16):
    model, tok = smollm2_bf16
    texts = [
        "The capital of France is Paris, and the river is the Seine.",
        "2 + 3 = 5",
        "Once upon a time there was a small robot who liked to count stars at night.",
        "def add(a, b): return a + b",
        "Write a poem about the sea.",
        "What is 17 times 23?",
        "List three colours.",
        "Explain gravity to a child in two sentences.",
    ]
    profile = divergence_profile(model, *_rows(tok, texts), batch_size=8)
    assert profile.n_layers == 30 and len(profile.divergence) == 31
    assert profile.divergence[0] == 0.0  # the embedding lookup is batch invariant
    assert profile.divergence[-1] > 1e-3  # the bf16 batch-shape effect is there on CPU with left padding
    assert len(profile.quartile_sums()) == 4
    assert sum(profile.quartile_sums()) == pytest.approx(profile.divergence[-1], rel=1e-9)
    assert len(set(profile.top_k(8))) == 8


# ------------------------------------------------------------------------------------------ the commands


def test_attribute_command_json(tmp_path):
    import json

    from bloggap_plugin.cli import main

    out = tmp_path / "attr.json"
    assert main(["attribute", "--model", "tiny-random-llama", "--rows", "4", "--new-tokens", "4", "--k", "1",
                 "--device", "cpu", "--json", str(out)]) == 0  # fmt: skip
    payload = json.loads(out.read_text())
    profile = payload["results"]["profile"]
    assert payload["command"] == "attribute" and payload["env"]["device_type"] == "cpu"
    assert len(profile["divergence"]) == 3 and len(profile["increments"]) == 2
    assert profile["n_tokens"] == 4 * 4 and profile["k"] == 1 and len(profile["top_k"]) == 1
    assert payload["results"]["logprob_b1_vs_bn"]["n"] == 16


def test_ladder_command_json_on_tiny_model(tmp_path):
    import json

    from bloggap_plugin.cli import main
    from bloggap_plugin.measure.rollouts import calibration_prompts, eval_prompts

    assert not set(calibration_prompts()) & set(eval_prompts())
    out = tmp_path / "ladder.json"
    assert main(["ladder", "--model", "tiny-random-qwen2", "--rows", "8", "--calibration-rows", "8",
                 "--new-tokens", "4", "--k", "1", "--fp16", "on", "--device", "cpu", "--json", str(out)]) == 0  # fmt: skip
    payload = json.loads(out.read_text())
    rungs = {r["name"]: r for r in payload["results"]["rungs"]}
    assert list(rungs) == [
        "bf16", "fp32 head", "first-1 + head", "last-1 + head", "guided-1 + head", "window-1 + head",
        "fp16", "fp16 + guided-1 + head", "all fp32",
    ]  # fmt: skip
    assert rungs["first-1 + head"]["layers"] == [0] and rungs["last-1 + head"]["layers"] == [1]
    assert rungs["all fp32"]["fp32_param_share"] == 1.0 and rungs["bf16"]["fp32_param_share"] == 0.0
    assert rungs["fp16"]["fp32_param_share"] == 0.0 and rungs["fp16"]["base_dtype"] == "bfloat16"
    assert rungs["fp16 + guided-1 + head"]["base_dtype"] == "fp16"
    assert all(r["n"] == 8 * 4 for r in rungs.values())  # rows x new tokens (the batched side needs 8 rows)
    share = [rungs[n]["fp32_param_share"] for n in ("fp32 head", "first-1 + head", "all fp32")]
    assert 0 < share[0] < share[1] < share[2]
    table = payload["tables"][0]
    assert table["id"] == "T7" and table["reference"] == "T7" and table["random_init"] is False
    assert len(table["rows"]) == 9 and all(len(r) == len(table["columns"]) for r in table["rows"])


def test_ladder_scores_a_plan_once_however_many_rungs_name_it(tiny_model, monkeypatch):
    """On 2 layers at k=1 the guided layer is the first or the last one: that rung names a plan already scored.
    Each distinct plan scores the rows once (b1 and b8), and every rung naming it gets its numbers."""
    from bloggap_plugin.measure import precision_ladder

    scored = []
    b1_vs_bn = precision_ladder.b1_vs_bn

    def counting(plan, *args, **kwargs):
        scored.append(plan)
        return b1_vs_bn(plan, *args, **kwargs)

    monkeypatch.setattr(precision_ladder, "b1_vs_bn", counting)
    model, tokenizer = tiny_model("tiny-random-qwen2", "bf16")
    result = precision_ladder.run_ladder(model, tokenizer, rows=8, calibration_rows=8, new_tokens=2, ks=[1],
                                         fp16=False)
    rungs = {r["name"]: r for r in result["rungs"] if r.get("oob") is not None}
    plans = {(r["arm"], tuple(r["layers"] or ()) if r["arm"] == "guided" else None) for r in rungs.values()}
    assert len(rungs) == 7 and len(plans) == len(scored) < len(rungs)
    guided = rungs["guided-1 + head"]
    twin = rungs["first-1 + head" if guided["layers"] == [0] else "last-1 + head"]
    numbers = ("oob", "oob_count", "abs_dlogp_mean", "abs_dlogp_max", "n", "fp32_param_share", "bytes_added")
    assert [guided[key] for key in numbers] == [twin[key] for key in numbers]
    assert guided["name"] != twin["name"] and guided["layers"] == twin["layers"]


def test_ladder_benchmark_quick(tmp_path, real_model):
    import json

    from benchmarks import ladder

    # the structure of the three tables on the real model: 2 rollouts of 4 new tokens each way (quick's 8 x 12 change
    # no field; the b1-vs-b8 values of the real model are test_smollm2_bf16_left_padding_divergence's)
    argv = ["--quick", "--rows", "2", "--calibration-rows", "2", "--new-tokens", "4", "--device", "cpu"]
    assert ladder.main([*argv, "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "ladder.json").read_text())
    assert payload["benchmark"] == "ladder" and payload["schema_version"] == 1
    assert [t["id"] for t in payload["tables"]] == ["T7", "T8", "T9"]
    for table in payload["tables"]:
        assert all(len(row) == len(table["columns"]) for row in table["rows"])
    ladder = payload["results"]["ladder"]
    assert ladder["calibration_disjoint"] and ladder["n_layers"] == 30
    assert (ladder["rows"], ladder["calibration_rows"], ladder["new_tokens"]) == (2, 2, 4)  # quick, but the flags
    assert ladder["rungs"][-1]["name"] == "all fp32" and ladder["rungs"][-1]["fp32_param_share"] == 1.0
    assert payload["tables"][2]["random_init"] is True
