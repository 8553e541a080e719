"""Held-out evaluation: batched greedy generation against a hand-written greedy loop, accuracy and its interval,
no side effects on the model or the RNG."""

from __future__ import annotations

import math

import pytest
import torch

from bloggap_plugin.heldout import generate_texts, heldout_accuracy


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
