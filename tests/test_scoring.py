"""bloggap_plugin.core.scoring.token_logprobs against a plain forward computed here, independently."""

from __future__ import annotations

import pytest
import torch

from bloggap_plugin.core.scoring import position_ids_from_mask, token_logprobs
from bloggap_plugin.models import load_model


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model("tiny-random-llama", dtype="fp32")
    return model, tokenizer


def left_padded_batch(tokenizer, completion_len: int = 5):
    """Three rows of different prompt lengths (two left-padded) plus equal-length completions."""
    prompts = ["a much longer prompt here", "short", "mid prompt"]
    completions = ["xyzzy", "hello", "abcde"]
    rows = [tokenizer(p)["input_ids"] + tokenizer(c)["input_ids"][:completion_len] for p, c in zip(prompts, completions)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask, completion_len


def reference_logprobs(model, ids, mask, keep, position_ids):
    """Plain forward over the whole sequence, fp32 log_softmax, gather: the definition, no shortcuts."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    width = ids.shape[1]
    out = torch.empty(ids.shape[0], keep)
    for row in range(ids.shape[0]):
        for k in range(keep):
            pos = width - keep + k  # token being scored; predicted from position pos - 1
            out[row, k] = logprobs[row, pos - 1, ids[row, pos]]
    return out


def explicit_mask_positions(mask):
    """Positions counted by hand: 0, 1, 2, ... over the real tokens of each row, 0 on padding."""
    positions = torch.zeros_like(mask)
    for row in range(mask.shape[0]):
        count = 0
        for col in range(mask.shape[1]):
            if mask[row, col]:
                positions[row, col] = count
                count += 1
    return positions


@pytest.mark.parametrize("batch_size", [None, 1, 2])
def test_mask_positions_equal_plain_forward(tiny, batch_size):
    model, tokenizer = tiny
    ids, mask, keep = left_padded_batch(tokenizer)
    positions = explicit_mask_positions(mask)
    expected = torch.cat(
        [
            reference_logprobs(model, ids[s : s + (batch_size or 3)], mask[s : s + (batch_size or 3)], keep,
                               positions[s : s + (batch_size or 3)])
            for s in range(0, 3, batch_size or 3)
        ]
    )
    with torch.no_grad():
        got = token_logprobs(model, ids, mask, keep, batch_size=batch_size, positions="mask")
    assert got.dtype == torch.float32 and got.shape == (3, keep)
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)
    assert torch.isfinite(got).all() and (got <= 0).all()


@pytest.mark.parametrize("batch_size", [None, 1])
def test_arange_positions_equal_plain_forward(tiny, batch_size):
    model, tokenizer = tiny
    ids, mask, keep = left_padded_batch(tokenizer)
    arange = torch.arange(ids.shape[1]).expand_as(ids)
    expected = torch.cat(
        [
            reference_logprobs(model, ids[s : s + (batch_size or 3)], mask[s : s + (batch_size or 3)], keep,
                               arange[s : s + (batch_size or 3)])
            for s in range(0, 3, batch_size or 3)
        ]
    )
    with torch.no_grad():
        got = token_logprobs(model, ids, mask, keep, batch_size=batch_size, positions="arange")
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)


def test_arange_passes_no_position_ids_and_mask_passes_generates(tiny):
    model, tokenizer = tiny
    ids, mask, keep = left_padded_batch(tokenizer)
    seen = []
    hook = model.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(dict(kwargs)), with_kwargs=True)
    try:
        with torch.no_grad():
            token_logprobs(model, ids, mask, keep, positions="arange")
            token_logprobs(model, ids, mask, keep, positions="mask")
    finally:
        hook.remove()
    assert seen[0].get("position_ids") is None
    assert torch.equal(seen[1]["position_ids"], explicit_mask_positions(mask))


def test_mask_positions_equal_generates_position_ids(tiny):
    """What generate passes to the model on its prefill step is exactly position_ids_from_mask."""
    model, tokenizer = tiny
    ids, mask, _ = left_padded_batch(tokenizer)
    seen = []
    hook = model.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(kwargs.get("position_ids")), with_kwargs=True
    )
    try:
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    finally:
        hook.remove()
    assert seen[0] is not None
    assert torch.equal(seen[0], position_ids_from_mask(mask))
    # and the decode step continues from the last real position of each row
    assert torch.equal(seen[1].reshape(-1), position_ids_from_mask(mask)[:, -1] + 1)


def test_mask_positions_reproduce_generates_first_token_logprob(tiny):
    """Scoring [prompt, first generated token] with positions="mask" reproduces generate's own score."""
    model, tokenizer = tiny
    ids, mask, _ = left_padded_batch(tokenizer)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False, output_scores=True,
            return_dict_in_generate=True,
        )
        first = out.sequences[:, -1]
        sampler = torch.log_softmax(out.scores[0].float(), -1).gather(-1, first[:, None]).squeeze(-1)
        scored = token_logprobs(
            model, out.sequences, torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1), 1, positions="mask"
        )
    torch.testing.assert_close(scored.squeeze(-1), sampler, rtol=0, atol=2e-5)


def test_rows_without_padding_agree_across_position_modes(tiny):
    model, tokenizer = tiny
    ids, mask, keep = left_padded_batch(tokenizer)
    assert mask[0].all()  # the longest row has no padding
    with torch.no_grad():
        by_mask = token_logprobs(model, ids, mask, keep, positions="mask")
        by_arange = token_logprobs(model, ids, mask, keep, positions="arange")
    assert torch.equal(by_mask[0], by_arange[0])


def test_temperature_reduce_and_forward_hooks(tiny):
    model, tokenizer = tiny
    ids, mask, keep = left_padded_batch(tokenizer)
    positions = explicit_mask_positions(mask)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -keep - 1 : -1].float()
        hot = token_logprobs(model, ids, mask, keep, temperature=2.0)
    expected = torch.log_softmax(logits / 2.0, -1).gather(-1, ids[:, -keep:, None]).squeeze(-1)
    torch.testing.assert_close(hot, expected, rtol=0, atol=2e-5)

    calls = []

    def reduce(chunk_logits, targets, rows):
        calls.append((rows, chunk_logits.dtype, tuple(chunk_logits.shape), targets.clone()))
        return torch.full(targets.shape, -1.0)

    with torch.no_grad():
        got = token_logprobs(model, ids, mask, keep, batch_size=2, reduce=reduce)
    assert torch.equal(got, torch.full((3, keep), -1.0))
    assert [c[0] for c in calls] == [slice(0, 2), slice(2, 3)]
    assert all(c[1] == torch.float32 for c in calls)
    assert calls[0][2][:2] == (2, keep) and torch.equal(calls[1][3], ids[2:, -keep:])

    forwarded = []

    def forward(**kwargs):
        forwarded.append(kwargs["input_ids"].shape)
        return model(**kwargs)

    with torch.no_grad():
        via_forward = token_logprobs(model, ids, mask, keep, batch_size=2, forward=forward)
        direct = token_logprobs(model, ids, mask, keep, batch_size=2)
    assert forwarded == [torch.Size([2, ids.shape[1]]), torch.Size([1, ids.shape[1]])]
    assert torch.equal(via_forward, direct)


def test_scoring_leaves_weights_and_grads_untouched():
    model, tokenizer = load_model("tiny-random-qwen2", dtype="fp32")  # tied embeddings
    ids, mask, keep = left_padded_batch(tokenizer)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        token_logprobs(model, ids, mask, keep, batch_size=2)
    assert all(p.grad is None for p in model.parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_bad_arguments_raise(tiny):
    model, tokenizer = tiny
    ids, mask, keep = left_padded_batch(tokenizer)
    with pytest.raises(ValueError, match="positions must be one of"):
        token_logprobs(model, ids, mask, keep, positions="cumsum")
    with pytest.raises(ValueError, match="differ"):
        token_logprobs(model, ids, mask[:, 1:], keep)
    with pytest.raises(ValueError, match="logits_to_keep"):
        token_logprobs(model, ids, mask, 0)
    with pytest.raises(ValueError, match="logits_to_keep"):
        token_logprobs(model, ids, mask, ids.shape[1])
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(model, ids, mask, keep, temperature=0.0)
    with pytest.raises(ValueError, match="batch_size"):
        token_logprobs(model, ids, mask, keep, batch_size=0)
