"""bloggap_plugin.core.scoring.token_logprobs against a plain forward computed here, independently."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from bloggap_plugin.core.scoring import (
    DEFAULT_CHUNK_TOKENS,
    gather_logprobs,
    join_tiles,
    position_ids_from_mask,
    token_logprobs,
)
from bloggap_plugin.core.truncation import kept_reducer


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
    assert [c[0] for c in calls] == [(slice(0, 2), slice(0, keep)), (slice(2, 3), slice(0, keep))]
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


def test_scoring_leaves_weights_and_grads_untouched(tiny_model):
    model, tokenizer = tiny_model("tiny-random-qwen2")  # tied embeddings
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


# ------------------------------------------------------------------------- tiles of completion positions

def random_rows(vocab: int, n_rows: int = 3, width: int = 20, keep: int = 11, seed: int = 0):
    """``n_rows`` rows of random ids, rows 0 and 2 left-padded; kept ids ``[B, keep, 3]`` (the target and
    two others, some positions unknown) and sizes ``[B, keep]`` aligned with the last ``keep`` tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (n_rows, width), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2 % n_rows, :7] = 0
    ids = ids.masked_fill(mask == 0, 0)
    targets = ids[:, -keep:]
    others = torch.randint(5, vocab, (n_rows, keep, 2), generator=g)
    kept_ids = torch.cat([targets.unsqueeze(-1), others], dim=-1)
    kept_ids[(others == targets.unsqueeze(-1)).any(-1)] = -1  # ids must be unique: drop those sets
    kept_ids[:, 1::4] = -1  # unknown sets: the size path
    sizes = torch.randint(1, 6, (n_rows, keep), generator=g)
    return ids, mask, keep, kept_ids, sizes


@pytest.mark.parametrize("kept", [False, True])
def test_tiles_bound_the_largest_vocabulary_tensor(tiny, largest_vocab_tensor, kept):
    """The head, fp32 cast, temperature and reduce run per tile: no [rows, K, V] tensor exists."""
    model, _ = tiny
    vocab = model.config.vocab_size
    ids, mask, keep, kept_ids, sizes = random_rows(vocab)
    reduce = kept_reducer(kept_ids=kept_ids, sizes=sizes) if kept else None
    results = {}
    with torch.no_grad():
        for chunk_tokens, batch_size, largest in [
            (None, None, 3 * (keep + 1) * vocab),  # untiled: the model's [3, K + 1, V] logits
            (12, None, 3 * 4 * vocab),  # 3 rows x 4 positions per tile (tiles of 4, 4, 3 positions)
            (12, 2, 2 * 6 * vocab),  # rows 0-1: tiles of 6 positions; row 2: 12 >= K, one tile of 11
            (DEFAULT_CHUNK_TOKENS, None, 3 * keep * vocab),  # the default covers K = 11 in one tile
        ]:
            with largest_vocab_tensor(vocab) as probe:
                results[chunk_tokens, batch_size] = token_logprobs(
                    model, ids, mask, keep, batch_size=batch_size, temperature=0.7, reduce=reduce,
                    chunk_tokens=chunk_tokens,
                )
            assert probe.largest == largest, (chunk_tokens, batch_size)
            if chunk_tokens is not None:
                assert probe.largest <= chunk_tokens * vocab or chunk_tokens == DEFAULT_CHUNK_TOKENS
    untiled = results[None, None]
    assert torch.isfinite(untiled).all() and (untiled <= 0).all()
    for key, got in results.items():
        # fp32 BLAS may pick another kernel for another row count (last-bit differences); bit for bit with
        # a row-invariant matmul: test_tiled_equals_untiled_bit_for_bit
        torch.testing.assert_close(got, untiled, rtol=0, atol=1e-6, msg=str(key))


@pytest.mark.parametrize("positions", ["mask", "arange"])
@pytest.mark.parametrize("kept", [False, True])
def test_tiled_equals_untiled_bit_for_bit(tiny, row_invariant_linear, positions, kept):
    model, _ = tiny
    ids, mask, keep, kept_ids, sizes = random_rows(model.config.vocab_size)
    reduce = kept_reducer(kept_ids=kept_ids, sizes=sizes) if kept else None
    with torch.no_grad():
        untiled = token_logprobs(model, ids, mask, keep, batch_size=2, positions=positions, temperature=0.7,
                                 reduce=reduce, chunk_tokens=None)
        for chunk_tokens in (1, 5, 8, 22, 23, 1000):  # tiles of 1 .. K positions, most not dividing K = 11
            tiled = token_logprobs(model, ids, mask, keep, batch_size=2, positions=positions, temperature=0.7,
                                   reduce=reduce, chunk_tokens=chunk_tokens)
            assert torch.equal(tiled, untiled), chunk_tokens
    assert torch.isfinite(untiled).all()


def test_tiled_equals_untiled_bit_for_bit_bf16_real_kernels(tiny_model):
    """bf16 logits: equal bit for bit with the real matmul kernels too (the rounding to bf16 absorbs them)."""
    model, _ = tiny_model("tiny-random-llama", "bf16")
    ids, mask, keep, kept_ids, sizes = random_rows(model.config.vocab_size)
    with torch.no_grad():
        untiled = token_logprobs(model, ids, mask, keep, batch_size=2, chunk_tokens=None)
        tiled = token_logprobs(model, ids, mask, keep, batch_size=2, chunk_tokens=8)
    assert torch.equal(tiled, untiled)


def test_tiles_cover_every_scored_token_once(tiny):
    model, _ = tiny
    ids, mask, keep, _, _ = random_rows(model.config.vocab_size)
    calls = []

    def reduce(logits, targets, index):
        calls.append(index)
        rows, cols = index
        assert logits.shape == (rows.stop - rows.start, cols.stop - cols.start, model.config.vocab_size)
        assert torch.equal(targets, ids[:, -keep:][index])
        return gather_logprobs(logits, targets)

    with torch.no_grad():
        token_logprobs(model, ids, mask, keep, batch_size=2, reduce=reduce, chunk_tokens=5)
    # rows 0-1: 5 // 2 = 2 positions per tile; row 2: 5 positions per tile; K = 11
    expected = [(slice(0, 2), slice(c, min(c + 2, keep))) for c in range(0, keep, 2)]
    expected += [(slice(2, 3), slice(c, min(c + 5, keep))) for c in range(0, keep, 5)]
    assert calls == expected
    assert model.lm_head.__class__ is nn.Linear  # the head is back


def test_head_restored_when_reduce_raises(tiny):
    model, _ = tiny
    ids, mask, keep, _, _ = random_rows(model.config.vocab_size)
    head = model.lm_head

    def bad_reduce(logits, targets, index):
        raise RuntimeError("boom")

    with torch.no_grad(), pytest.raises(RuntimeError, match="boom"):
        token_logprobs(model, ids, mask, keep, reduce=bad_reduce, chunk_tokens=4)
    assert model.lm_head is head and model.get_output_embeddings() is head


class _HalvedLogits(nn.Module):
    """A causal LM that changes its logits after the head inside its forward, as logit softcapping or
    ``logit_scale`` models do."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        out.logits = out.logits * 0.5
        return out


def _gemma2_softcapped(vocab: int):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, final_logit_softcapping=0.5,
                          pad_token_id=0)
    torch.manual_seed(0)
    return Gemma2ForCausalLM(config).eval()


@pytest.mark.parametrize("kind", ["wrapper", "gemma2"])
def test_model_changing_logits_after_head_is_scored_untiled(tiny, kind):
    model = _HalvedLogits(tiny[0]) if kind == "wrapper" else _gemma2_softcapped(tiny[0].config.vocab_size)
    ids, mask, keep, _, _ = random_rows(tiny[0].config.vocab_size)
    with torch.no_grad():
        untiled = token_logprobs(model, ids, mask, keep, batch_size=2, chunk_tokens=None)
        with pytest.warns(RuntimeWarning, match="changes its logits after the LM head"):
            first = token_logprobs(model, ids, mask, keep, batch_size=2, chunk_tokens=4)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # known from then on: no second attempt, no second warning
            second = token_logprobs(model, ids, mask, keep, batch_size=2, chunk_tokens=4)
    assert torch.equal(first, untiled) and torch.equal(second, untiled)
    if kind == "wrapper":
        with torch.no_grad():
            plain = token_logprobs(tiny[0], ids, mask, keep, batch_size=2, chunk_tokens=None)
        assert not torch.allclose(untiled, plain)  # the change really applies


class _NoHeadFound(nn.Module):
    """A causal LM wrapper exposing no ``get_output_embeddings`` / ``lm_head``."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, **kwargs):
        return self.inner(**kwargs)


def test_model_without_findable_head_is_scored_untiled_with_one_warning(tiny, largest_vocab_tensor):
    model = _NoHeadFound(tiny[0])
    vocab = tiny[0].config.vocab_size
    ids, mask, keep, _, _ = random_rows(vocab)
    with torch.no_grad():
        expected = token_logprobs(tiny[0], ids, mask, keep, chunk_tokens=None)
        with pytest.warns(RuntimeWarning, match="no LM head found on _NoHeadFound"), \
                largest_vocab_tensor(vocab) as probe:
            got = token_logprobs(model, ids, mask, keep, chunk_tokens=4)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = token_logprobs(model, ids, mask, keep, chunk_tokens=4)
    assert probe.largest == 3 * (keep + 1) * vocab  # untiled
    assert torch.equal(got, expected) and torch.equal(again, expected)


def test_join_tiles():
    a = torch.arange(6.0).view(2, 3)
    parts = [
        ((slice(2, 3), slice(0, 5)), torch.full((1, 5), 9.0)),
        ((slice(0, 2), slice(3, 5)), torch.ones(2, 2)),
        ((slice(0, 2), slice(0, 3)), a),
    ]
    joined = join_tiles(parts)
    assert torch.equal(joined, torch.cat([torch.cat([a, torch.ones(2, 2)], 1), torch.full((1, 5), 9.0)]))
    # a later value for the same tile replaces the earlier one (the fp16 guard's fp32 re-score)
    again = join_tiles(parts + [((slice(2, 3), slice(0, 5)), torch.zeros(1, 5))])
    assert torch.equal(again[2], torch.zeros(5))
    with pytest.raises(ValueError, match="uncovered"):
        join_tiles(parts[:2])
    with pytest.raises(ValueError, match="different numbers of positions"):
        join_tiles(parts[:1] + [((slice(0, 2), slice(0, 3)), a)])


def test_bad_chunk_tokens_raise(tiny):
    model, tokenizer = tiny
    ids, mask, keep = left_padded_batch(tokenizer)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="chunk_tokens must be an integer >= 0"):
            token_logprobs(model, ids, mask, keep, chunk_tokens=bad)
