"""Rollouts sampled from the model itself with ``generate``, and the prompt sets they are sampled on.

The built-in prompts are the reference study's 8 x 8 grid (:func:`bloggap_plugin.core.probe.builtin_prompts`):
the first 48 are the *evaluation* prompts (``bloggap ladder``), the last 16 the *calibration* prompts
(``bloggap attribute``, the ladder's guided layer choice), so the two never overlap.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from bloggap_plugin.core.probe import Rollouts, Row, builtin_prompts, left_pad

__all__ = [
    "N_EVAL_PROMPTS",
    "eval_prompts",
    "calibration_prompts",
    "encode_prompts",
    "sample_rollouts",
    "rollout_rows",
]

# The probe's 8 x 8 prompt grid: evaluation prompts come first, calibration prompts are the last 16.
N_EVAL_PROMPTS = 48


def eval_prompts() -> list[str]:
    """The evaluation prompts (first 48 of the 8 x 8 grid)."""
    return builtin_prompts(64)[:N_EVAL_PROMPTS]


def calibration_prompts() -> list[str]:
    """The calibration prompts (last 16 of the grid): disjoint from :func:`eval_prompts`."""
    return builtin_prompts(64)[N_EVAL_PROMPTS:]


def encode_prompts(tokenizer, prompts: Sequence[str], chat_template: bool | None = None) -> list[list[int]]:
    """Token ids of each prompt; with the tokenizer's chat template (user turn + generation prompt) when it
    has one (``chat_template=None``), or as plain text (``False``)."""
    use_template = bool(getattr(tokenizer, "chat_template", None)) if chat_template is None else chat_template
    encoded = []
    for prompt in prompts:
        if use_template:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(prompt)["input_ids"]
        if not ids:
            raise ValueError(f"prompt {prompt!r} encodes to no tokens")
        encoded.append(list(ids))
    return encoded




def _generation_config(model, max_new_tokens: int, pad_id: int, eos_id: int | None, stop_at_eos: bool):
    """Plain sampling (temperature 1, no top-k/top-p) with the raw per-step logits returned."""
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        # Forced length as in the reference protocol: min_new_tokens = max_new_tokens. eos_token_id=None alone is
        # not enough: transformers >= 5.1x fills None fields from the model's generation config.
        min_new_tokens=None if stop_at_eos else max_new_tokens,
        eos_token_id=eos_id if stop_at_eos else None,
        pad_token_id=pad_id,
        bos_token_id=getattr(model.generation_config, "bos_token_id", None),
        output_logits=True,
        return_dict_in_generate=True,
    )


def _sample_chunk(model, chunk: list[list[int]], config, pad_id: int, eos_id: int | None, stop_at_eos: bool):
    """Generate from one left-padded chunk of prompts: ``[(Row, sampler log-probs [c] fp32)]``."""
    device = next(model.parameters()).device
    ids, mask = left_pad(chunk, pad_id)
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
    new = out.sequences[:, ids.shape[1] :].cpu()
    if not stop_at_eos and new.shape[1] != config.max_new_tokens:
        raise RuntimeError(
            f"generate returned {new.shape[1]} new tokens instead of {config.max_new_tokens}: a stopping "
            "criterion of this model's generation config ended sampling early"
        )
    logits = torch.stack([s.float() for s in out.logits], dim=1).cpu()  # [b, C, V] raw
    # The sampler's full-vocabulary log-prob from the raw logits (what a trainer scores); the processed
    # scores can differ only by the min-length processor's EOS mask when length is forced.
    sampled = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
    out_rows = []
    for prompt_ids, completion, values in zip(chunk, new.tolist(), sampled):
        if stop_at_eos and eos_id in completion:
            completion = completion[: completion.index(eos_id) + 1]
        out_rows.append((Row(tuple(prompt_ids), tuple(completion)), values[: len(completion)]))
    return out_rows


@torch.no_grad()
def sample_rollouts(
    model: torch.nn.Module,
    tokenizer,
    num_seqs: int = 32,
    max_new_tokens: int = 32,
    seed: int = 1234,
    prompts: Sequence[str] | None = None,
    batch_size: int = 8,
    chat_template: bool | None = None,
    progress: Callable[[int], object] | None = None,
    stop_at_eos: bool = False,
) -> Rollouts:
    """Sample ``num_seqs`` completions of ``max_new_tokens`` tokens from ``model`` itself.

    Plain sampling (temperature 1, no top-k/top-p), prompts left-padded in generation batches of
    ``batch_size`` (generate derives positions from the mask). By default end-of-sequence is disabled so
    every completion has exactly ``max_new_tokens`` tokens (the reference study's T2-T6 protocol);
    ``stop_at_eos=True`` ends each completion at its first eos token, inclusive (ragged, as T1 and TRL).
    The sampler's log-prob of each emitted token is ``log_softmax`` (fp32) of generate's raw per-step logits
    (``output_logits``): full-vocabulary, like the trainer's scoring. The global RNG state is restored afterwards; ``seed`` alone fixes the samples.
    """
    if num_seqs < 1 or max_new_tokens < 1 or batch_size < 1:
        raise ValueError(
            f"num_seqs, max_new_tokens and batch_size must be >= 1, got {num_seqs}, {max_new_tokens}, {batch_size}"
        )
    prompts = list(prompts) if prompts is not None else builtin_prompts(num_seqs)
    if len(prompts) < num_seqs:
        prompts = [prompts[i % len(prompts)] for i in range(num_seqs)]
    prompts = prompts[:num_seqs]
    encoded = encode_prompts(tokenizer, prompts, chat_template)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token; set tokenizer.pad_token")
    eos_id = tokenizer.eos_token_id
    if stop_at_eos and eos_id is None:
        raise ValueError("stop_at_eos=True needs tokenizer.eos_token_id")
    config = _generation_config(model, max_new_tokens, pad_id, eos_id, stop_at_eos)
    device = next(model.parameters()).device
    sampled: list[tuple[Row, torch.Tensor]] = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        for start in range(0, num_seqs, batch_size):
            chunk = encoded[start : start + batch_size]
            sampled += _sample_chunk(model, chunk, config, pad_id, eos_id, stop_at_eos)
            if progress is not None:
                progress(len(chunk))
    width = max(len(values) for _, values in sampled)
    sampler_logprobs = torch.zeros((len(sampled), width), dtype=torch.float32)
    sampler_mask = torch.zeros((len(sampled), width), dtype=torch.bool)
    for i, (_, values) in enumerate(sampled):
        sampler_logprobs[i, : len(values)] = values
        sampler_mask[i, : len(values)] = True
    record = {
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "attn": getattr(model.config, "_attn_implementation", None),
        "batch_size": batch_size,
        "seed": seed,
        "max_new_tokens": max_new_tokens,
        "stop_at_eos": stop_at_eos,
        "temperature": 1.0,
        "sampler_logprobs_from": "raw logits (output_logits), full vocabulary",
    }
    return Rollouts([row for row, _ in sampled], sampler_logprobs, sampler_mask, int(pad_id), prompts, record)


def rollout_rows(
    model, tokenizer, prompts: Sequence[str], rows: int, new_tokens: int, seed: int, gen_batch: int = 8
):
    """Sample ``rows`` completions of exactly ``new_tokens`` tokens (prompts cycled) and lay them out
    left-padded as TRL does. Returns ``(input_ids [N, L], attention_mask [N, L], prompt texts)`` on CPU."""
    cycled = [prompts[i % len(prompts)] for i in range(rows)]
    rollouts = sample_rollouts(
        model,
        tokenizer,
        num_seqs=rows,
        max_new_tokens=new_tokens,
        seed=seed,
        prompts=cycled,
        batch_size=gen_batch,
    )
    seqs = [list(r.prompt) + list(r.completion) for r in rollouts.rows]
    ids, mask = left_pad(seqs, rollouts.pad_token_id)
    return ids, mask, cycled
