"""Batched HF generation and held-out accuracy: the greedy evaluation of a trained policy on prompts it never saw.

:func:`generate_texts` is the one batched ``generate`` of the project's evaluations (left-padded batches of token-id
prompts, greedy or sampled, a fixed number of new tokens); :func:`heldout_accuracy` scores its completions with a
task's reward function (:func:`bloggap_plugin.tasks.get_heldout` gives the prompts). Neither changes the model's
weights, its train/eval mode or any random number generator's state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

__all__ = ["generate_texts", "heldout_accuracy"]


def generate_texts(
    model,
    tokenizer,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    batch_size: int = 64,
    sample_kwargs: dict | None = None,
    seed: int | None = None,
) -> list[str]:
    """One completion (decoded text, special tokens dropped) per prompt of ``prompt_ids`` (token-id lists).

    Left-padded batches of ``batch_size`` prompts on the model's device, at most ``max_new_tokens`` new tokens each.
    Greedy when ``sample_kwargs`` is ``None``; else ``generate(do_sample=True, **sample_kwargs)`` after
    ``torch.manual_seed(seed)`` before each batch (the RNG state is restored afterwards). The model is put in eval
    mode for the call and left in the mode it had.
    """
    from bloggap_plugin.core.probe import left_pad

    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens and batch_size must be >= 1, got {max_new_tokens} and {batch_size}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    kwargs = {"do_sample": False} if sample_kwargs is None else {"do_sample": True, **sample_kwargs}
    was_training = model.training
    texts: list[str] = []
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        model.eval()
        try:
            for start in range(0, len(prompt_ids), batch_size):
                input_ids, mask = (t.to(device) for t in left_pad(prompt_ids[start:start + batch_size], pad))
                if sample_kwargs is not None and seed is not None:
                    torch.manual_seed(seed)
                out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                     pad_token_id=pad, use_cache=True, **kwargs)
                texts += tokenizer.batch_decode(out[:, input_ids.shape[1]:], skip_special_tokens=True)
        finally:
            model.train(was_training)
    return texts


def heldout_accuracy(model, tokenizer, dataset, reward_fn: Callable, max_new_tokens: int, batch_size: int = 64) -> dict:
    """Greedy accuracy of ``model`` on ``dataset`` (``prompt`` and ``answer`` columns, as
    :func:`bloggap_plugin.tasks.get_heldout` returns): ``{n, correct, accuracy, ci95: [low, high], max_tokens,
    batch_size, seconds}``; correct = ``reward_fn`` gives 1.0 (the training reward); ``ci95`` is the Wilson interval
    (fractions); ``batch_size`` is the prompts per ``generate`` call (left padding makes a batch's shape part of the
    arithmetic)."""
    from bloggap_plugin.core.metrics import wilson_interval
    from bloggap_plugin.tasks import prompt_token_ids

    start = time.perf_counter()
    prompt_ids = [prompt_token_ids(prompt, tokenizer) for prompt in dataset["prompt"]]
    texts = generate_texts(model, tokenizer, prompt_ids, max_new_tokens, batch_size)
    rewards = reward_fn(texts, answer=list(dataset["answer"]))
    n, correct = len(rewards), int(sum(1 for r in rewards if r == 1.0))
    low, high = wilson_interval(correct, n) if n else (None, None)
    return {"n": n, "correct": correct, "accuracy": correct / n if n else None, "ci95": [low, high],
            "max_tokens": int(max_new_tokens), "batch_size": int(batch_size),
            "seconds": round(time.perf_counter() - start, 3)}
