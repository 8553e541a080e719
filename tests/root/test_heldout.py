"""Held-out evaluation: batched greedy generation against a hand-written greedy loop, accuracy and its interval,
no side effects on the model or the RNG."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bloggap_plugin.heldout_accuracy import generate_texts, heldout_accuracy


def _greedy_by_hand(model, tokenizer, ids: list[int], steps: int) -> str:
    """Argmax of the next-token logits, one token at a time, no cache, no padding; stops after EOS."""
    tokens = list(ids)
    new = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([tokens])).logits[0, -1]
            token = int(logits.argmax())
            new.append(token)
            tokens.append(token)
            if token == tokenizer.eos_token_id:
                break
    return tokenizer.decode(new, skip_special_tokens=True)


def _prompts(tokenizer) -> list[list[int]]:
    texts = ["Mia has 3 apples.", "x", "How many pencils does Tom have now? Tom has", "1 + 1 =", "a b c d e f g"]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_batched_greedy_equals_one_prompt_at_a_time_by_hand(tiny):
    model, tokenizer = tiny
    prompts = _prompts(tokenizer)
    expected = [_greedy_by_hand(model, tokenizer, ids, 6) for ids in prompts]
    assert generate_texts(model, tokenizer, prompts, max_new_tokens=6, batch_size=2) == expected
    assert generate_texts(model, tokenizer, prompts, max_new_tokens=6, batch_size=5) == expected


def test_generation_leaves_weights_mode_and_rng_as_they_were(tiny_model):
    from bloggap_plugin.models import load_model

    model, tokenizer = load_model("tiny-random-llama")
    model.train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    generate_texts(model, tokenizer, _prompts(tokenizer), max_new_tokens=4, batch_size=2)
    generate_texts(model, tokenizer, _prompts(tokenizer), max_new_tokens=4, batch_size=2,
                   sample_kwargs={"temperature": 1.0, "top_k": 0, "top_p": 1.0}, seed=7)
    assert model.training
    assert torch.equal(torch.get_rng_state(), rng)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
        assert p.grad is None


def test_sampled_generation_is_repeatable_with_its_seed(tiny):
    model, tokenizer = tiny
    kwargs = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    first = generate_texts(model, tokenizer, _prompts(tokenizer), 5, 5, sample_kwargs=kwargs, seed=3)
    assert generate_texts(model, tokenizer, _prompts(tokenizer), 5, 5, sample_kwargs=kwargs, seed=3) == first


def test_heldout_accuracy_counts_the_reward_and_gives_the_wilson_interval(tiny):
    import datasets

    model, tokenizer = tiny
    texts = ["Mia has 3 apples.", "x", "1 + 1 =", "a b c", "ok"]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    greedy = [_greedy_by_hand(model, tokenizer, ids, 3) for ids in prompts]
    # plain-text prompts (no chat template for str prompts); two answers match what greedy writes, three do not
    dataset = datasets.Dataset.from_dict({"prompt": texts, "answer": [greedy[0], greedy[1], "#", "#", "#"]})

    def exact(completions, answer, **kwargs):
        return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]

    result = heldout_accuracy(model, tokenizer, dataset, exact, max_new_tokens=3, batch_size=2)
    assert (result["n"], result["correct"], result["max_tokens"]) == (5, 2, 3)
    assert result["accuracy"] == pytest.approx(0.4)
    z, p, n = 1.96, 0.4, 5
    centre, half = (p + z * z / (2 * n)), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    low, high = result["ci95"]
    assert low == pytest.approx((centre - half) / (1 + z * z / n)) and high == pytest.approx((centre + half) / (1 + z * z / n))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_texts(model, tokenizer, [[1]], 0)


# --------------------------------------------------------------------------------------------- during training


def test_run_training_evaluates_every_k_steps_without_changing_the_run_and_saves_the_final_policy(tmp_path, trains):
    """heldout: {every: 1} adds a held-out record after each step and leaves the training itself (losses, rewards)
    exactly as without it; save_final writes a policy (and tokenizer) that load_model reads back."""
    from _support import ROOT

    from bloggap_plugin.models import load_model
    from bloggap_plugin.trl.run import run_training

    root = ROOT
    small = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=8)
    logs = {}
    for name, extra in (("plain", {}), ("heldout", {"heldout": {"every": 1, "n": 6, "max_tokens": 3},
                                                   "save_final": str(tmp_path / "final")})):
        logs[name] = tmp_path / f"{name}.jsonl"
        summary = run_training(root / "recipes" / "arm_A.yaml", model="tiny-random-llama", max_steps=2, seed=3,
                               output_dir=tmp_path / name, log_jsonl=logs[name], extra_overrides=small, **extra)
    records = {name: [json.loads(line) for line in path.read_text().splitlines()] for name, path in logs.items()}
    held = [r for r in records["heldout"] if "heldout/accuracy" in r]
    assert [(r["step"], r["heldout/n"]) for r in held] == [(1, 6), (2, 6)]
    assert all(0.0 <= r["heldout/accuracy"] <= 1.0 and r["heldout/correct"] == round(6 * r["heldout/accuracy"]) for r in held)
    assert summary["heldout"] == held
    steps = [r for r in records["heldout"] if "heldout/accuracy" not in r]
    keys = ("loss", "reward", "grad_norm", "entropy")
    assert [[r.get(k) for k in keys] for r in steps] == [[r.get(k) for k in keys] for r in records["plain"]]
    model, tokenizer = load_model(str(tmp_path / "final"))
    assert type(model).__name__ == "LlamaForCausalLM" and tokenizer.chat_template


def test_heldout_spec_is_checked_before_the_model_loads(tmp_path):
    from _support import ROOT

    from bloggap_plugin.core.errors import UsageError
    from bloggap_plugin.trl.run import prepare_run

    recipe = ROOT / "recipes" / "arm_A.yaml"
    for spec, problem in (({"n": 4}, "give 'every'"), ({"every": 0}, "every 0 must be"), ({"every": 2, "size": 3},
                                                                                       "unknown key(s) size")):
        with pytest.raises(UsageError, match=problem.replace("(", r"\(").replace(")", r"\)")):
            prepare_run(recipe, model="tiny-random-llama", device="cpu", output_dir=str(tmp_path), heldout=spec)
    from bloggap_plugin.tasks.gsm8k import SAMPLE_PATH

    with pytest.raises(UsageError, match="is one file"):  # no test split to hold out: refused before the model loads
        prepare_run(recipe, model="tiny-random-llama", device="cpu", output_dir=str(tmp_path), task="gsm8k",
                    data=str(SAMPLE_PATH), heldout={"every": 5})
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="--save-final"):
        prepare_run(recipe, model="tiny-random-llama", device="cpu", output_dir=str(tmp_path / "o"),
                    save_final=str(tmp_path / "file"))
