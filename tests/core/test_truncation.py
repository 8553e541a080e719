"""Exact tests of the kept-set maths against a plain, independent float64 reference written here."""

from __future__ import annotations

import math

import pytest
import torch

from bloggap_plugin.core.scoring import token_logprobs
from bloggap_plugin.core.truncation import (
    kept_ids_from_mask,
    kept_mask,
    kept_reducer,
    log_kept_mass,
    log_kept_mass_from_ids,
    log_kept_mass_from_size,
    pack_kept_ids,
    renormalized_logprobs,
)


def reference_kept(row: list[float], temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> set[int]:
    """One row, python floats, vLLM order; ties at a boundary kept (top-k rule, also applied to top-p)."""
    scaled = [x / temperature for x in row]
    alive = {i for i, x in enumerate(scaled) if x != -math.inf}

    def probs(ids):
        m = max(scaled[i] for i in ids)
        w = {i: math.exp(scaled[i] - m) for i in ids}
        z = sum(w.values())
        return {i: w[i] / z for i in ids}

    if min_p > 0:
        p = probs(alive)
        top = max(p.values())
        alive = {i for i in alive if p[i] >= min_p * top}
    if 0 < top_k < len(row):
        order = sorted(alive, key=lambda i: -scaled[i])
        if len(order) > top_k:
            cut = scaled[order[top_k - 1]]
            alive = {i for i in alive if scaled[i] >= cut}
    if top_p < 1.0:
        p = probs(alive)
        order = sorted(alive, key=lambda i: -scaled[i])
        above, last = 0.0, None
        for i in order:
            if above < top_p or last is None:
                last = i
            else:
                break
            above += p[i]
        alive = {i for i in alive if scaled[i] >= scaled[last]}
    return alive


def reference_log_mass(row: list[float], ids: set[int], temperature=1.0) -> float:
    scaled = [x / temperature for x in row]
    m = max(scaled)
    z = sum(math.exp(x - m) for x in scaled)
    return math.log(sum(math.exp(scaled[i] - m) for i in ids) / z)


SETTINGS = [
    dict(top_p=0.8),
    dict(top_k=5),
    dict(min_p=0.05),
    dict(top_p=0.9, temperature=0.7),
    dict(top_k=7, top_p=0.6, min_p=0.02, temperature=1.3),
    dict(top_k=40, top_p=0.95),
    dict(),
]


@pytest.mark.parametrize("setting", SETTINGS, ids=[str(s) for s in SETTINGS])
def test_kept_mask_matches_independent_reference(setting):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 50, generator=gen, dtype=torch.float64).float() * 3
    kept = kept_mask(logits, **setting)
    for row in range(logits.shape[0]):
        ref = reference_kept(logits[row].tolist(), **setting)
        assert set(torch.nonzero(kept[row]).squeeze(-1).tolist()) == ref
        got = log_kept_mass(logits[row], kept[row], temperature=setting.get("temperature", 1.0)).item()
        assert got == pytest.approx(reference_log_mass(logits[row].tolist(), ref, setting.get("temperature", 1.0)), abs=2e-6)


def test_disabled_and_oversized_settings_keep_everything():
    logits = torch.randn(4, 9)
    for setting in (dict(), dict(top_k=9), dict(top_k=100), dict(top_k=-1), dict(top_p=1.0), dict(min_p=0.0)):
        kept = kept_mask(logits, **setting)
        assert kept.all(), setting
        assert torch.equal(log_kept_mass(logits, kept), torch.zeros(4))


def test_order_is_vllm_min_p_before_top_k_before_top_p():
    # probs ~ [0.5, 0.2, 0.15, 0.1, 0.05]; top_p over the top_k=3 survivors renormalises to [0.588, 0.235, 0.176]
    logits = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]).log()
    kept = kept_mask(logits, top_k=3, top_p=0.8)
    # full-vocab top_p 0.8 would keep 3 tokens (0.5+0.2 < 0.8); after top_k renormalisation 0.588+0.235 >= 0.8 -> 2
    assert kept.tolist() == [[True, True, False, False, False]]
    assert kept_mask(logits, top_p=0.8).tolist() == [[True, True, True, False, False]]
    # min_p first: 0.25 * 0.5 = 0.125 drops 0.1 and 0.05 before top_k sees the row
    assert kept_mask(logits, min_p=0.25, top_k=4).tolist() == [[True, True, True, False, False]]


def test_ties_at_boundary_are_kept_together():
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    # probs [0.534, 0.197, 0.197, 0.072]: top_p 0.6 stops inside the tie -> both tied tokens kept
    assert kept_mask(logits, top_p=0.6).tolist() == [[True, True, True, False]]
    assert kept_mask(logits, top_k=2).tolist() == [[True, True, True, False]]
    assert kept_mask(logits, top_k=1).tolist() == [[True, False, False, False]]


def test_temperature_changes_top_p_set_but_not_top_k():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    cold = kept_mask(logits, temperature=0.5, top_p=0.9)
    hot = kept_mask(logits, temperature=2.0, top_p=0.9)
    assert cold.sum() < hot.sum()
    assert torch.equal(kept_mask(logits, temperature=0.5, top_k=2), kept_mask(logits, temperature=2.0, top_k=2))


def test_sampled_token_outside_the_set_is_forced_in():
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0], [0.0, 4.0, 0.0, 0.0]])
    kept = kept_mask(logits, top_k=1, sampled=torch.tensor([3, 1]))
    assert kept.tolist() == [[True, False, False, True], [False, True, False, False]]


def test_minus_inf_tokens_are_never_kept_and_bad_input_raises():
    logits = torch.tensor([[1.0, float("-inf"), 0.0]])
    assert kept_mask(logits, top_k=50).tolist() == [[True, False, True]]
    with pytest.raises(ValueError, match="temperature"):
        kept_mask(logits, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        kept_mask(logits, top_p=0.0)
    with pytest.raises(ValueError, match="min_p"):
        kept_mask(logits, min_p=1.5)
    with pytest.raises(ValueError, match="NaN"):
        kept_mask(torch.tensor([[float("nan"), 0.0]]))
    with pytest.raises(ValueError, match="empty"):
        log_kept_mass(torch.zeros(1, 3), torch.zeros(1, 3, dtype=torch.bool))


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_full_minus_processed_is_the_kept_mass(temperature):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 200, generator=gen) * 2
    kept = kept_mask(logits, temperature=temperature, top_p=0.8)
    # the processed log-prob as a sampler computes it: log_softmax of the masked, scaled logits
    processed = torch.log_softmax((logits / temperature).masked_fill(~kept, float("-inf")), -1)
    tokens = torch.stack([torch.nonzero(k).squeeze(-1)[-1] for k in kept])  # the least likely kept token
    full = torch.log_softmax(logits / temperature, -1).gather(-1, tokens[:, None]).squeeze(-1)
    proc = processed.gather(-1, tokens[:, None]).squeeze(-1)
    mass = torch.exp(log_kept_mass(logits, kept, temperature))
    assert torch.allclose(torch.exp(full - proc), mass, rtol=0, atol=1e-6)
    assert torch.allclose(renormalized_logprobs(logits, tokens, kept, temperature), proc, rtol=0, atol=1e-6)
    assert (mass < 1).all() and (log_kept_mass(logits, kept, temperature) <= 0).all()


@pytest.mark.parametrize("setting", [dict(top_p=0.8), dict(top_k=13), dict(min_p=0.1, temperature=0.8)])
def test_size_only_mass_equals_ids_mass_where_sets_agree(setting):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 40, 300, generator=gen) * 2
    temperature = setting.get("temperature", 1.0)
    kept = kept_mask(logits, **setting)
    sizes = kept.sum(-1)
    by_mask = log_kept_mass(logits, kept, temperature)
    by_size = log_kept_mass_from_size(logits, sizes, temperature)
    by_ids = log_kept_mass_from_ids(logits, pack_kept_ids(kept_ids_from_mask(kept)), temperature)
    # the recorded set is the top-|S| of the same logits here, so all three must agree to float rounding
    assert torch.allclose(by_size, by_mask, rtol=0, atol=2e-6)
    assert torch.allclose(by_ids, by_mask, rtol=0, atol=2e-6)


def test_size_zero_is_untruncated_and_sizes_over_vocab_clamp():
    logits = torch.randn(2, 3, 10)
    sizes = torch.tensor([[0, 10, 25], [1, 0, 3]])
    got = log_kept_mass_from_size(logits, sizes)
    assert got[0, 0] == 0 and got[1, 1] == 0
    assert got[0, 1].abs() < 1e-6 and got[0, 2].abs() < 1e-6
    assert got[1, 0] == pytest.approx(torch.log_softmax(logits[1, 0], -1).max().item(), abs=1e-6)
    with pytest.raises(ValueError, match=">= 0"):
        log_kept_mass_from_size(logits, -sizes)


def test_pack_and_unpack_kept_ids_round_trip():
    kept = torch.zeros(2, 3, 6, dtype=torch.bool)
    kept[0, 0, [1, 4]] = True
    kept[0, 1, :] = True
    kept[0, 2, 5] = True
    kept[1, :, 0] = True
    lists = kept_ids_from_mask(kept, max_ids=4)
    assert lists == [[[1, 4], None, [5]], [[0], [0], [0]]]
    packed = pack_kept_ids(lists)
    assert packed.shape == (2, 3, 2)
    assert packed[0, 0].tolist() == [1, 4] and packed[0, 1].tolist() == [-1, -1] and packed[0, 2].tolist() == [5, -1]


class _Logits(torch.nn.Module):
    """A 'model' whose logits at each position are a fixed table, so the expected values are known."""

    def __init__(self, table: torch.Tensor, all_ids: torch.Tensor):
        super().__init__()
        self.table, self.all_ids = table, all_ids

    def forward(self, input_ids, attention_mask=None, logits_to_keep=0, **_):
        rows = [int((self.all_ids == row).all(-1).nonzero()[0]) for row in input_ids]

        class Out:
            logits = self.table[rows][:, -logits_to_keep:, :]

        return Out()


def test_kept_reducer_through_token_logprobs_mask_ids_and_sizes():
    gen = torch.Generator().manual_seed(3)
    batch, width, k, vocab = 5, 9, 4, 30
    table = torch.randn(batch, width, vocab, generator=gen) * 2
    ids = torch.randint(0, vocab, (batch, width), generator=gen)
    mask = torch.ones_like(ids)
    logits_scored = table[:, -k - 1 : -1, :]  # position t scores token t + 1
    targets = ids[:, -k:]
    kept = kept_mask(logits_scored, top_p=0.7, sampled=targets)
    expected = renormalized_logprobs(logits_scored, targets, kept)
    model = _Logits(table, ids)

    def score(reduce):
        # chunks of 2 rows so the reducer must slice its full-batch tensors by `rows`
        return token_logprobs(model, ids, mask, k, batch_size=2, reduce=reduce)

    assert torch.allclose(score(kept_reducer(kept=kept)), expected, atol=1e-6, rtol=0)
    packed = pack_kept_ids(kept_ids_from_mask(kept))
    assert torch.allclose(score(kept_reducer(kept_ids=packed)), expected, atol=1e-6, rtol=0)
    # sizes reproduce the set only where the sampled token did not have to be forced in
    sizes = kept.sum(-1)
    top_prefix = kept_mask(logits_scored, top_p=0.7)
    agree = (top_prefix == kept).all(-1)
    by_size = score(kept_reducer(sizes=sizes))
    assert agree.any()
    assert torch.allclose(by_size[agree], expected[agree], atol=1e-6, rtol=0)
    # ids where known, sizes elsewhere; untouched positions are the full-vocabulary log-prob
    lists = kept_ids_from_mask(kept)
    lists[0][0] = None
    mixed = score(kept_reducer(kept_ids=pack_kept_ids(lists), sizes=torch.where(agree, sizes, 0)))
    full = torch.log_softmax(logits_scored, -1).gather(-1, targets[..., None]).squeeze(-1)
    if agree[0, 0]:
        assert mixed[0, 0] == pytest.approx(expected[0, 0].item(), abs=1e-6)
    else:
        assert mixed[0, 0] == pytest.approx(full[0, 0].item(), abs=1e-6)
    assert torch.allclose(mixed.flatten()[1:], expected.flatten()[1:], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="kept-set source"):
        kept_reducer()
    with pytest.raises(ValueError, match="logits_to_keep"):
        score(kept_reducer(kept=kept[:, :2]))


def test_reducer_gradient_is_the_renormalised_gradient():
    logits = torch.randn(1, 2, 7, requires_grad=True)
    targets = torch.tensor([[1, 3]])
    kept = kept_mask(logits.detach(), top_k=3, sampled=targets)
    kept_reducer(kept=kept)(logits, targets, slice(0, 1)).sum().backward()
    grad_reducer = logits.grad.clone()
    logits.grad = None
    renormalized_logprobs(logits, targets, kept).sum().backward()
    assert torch.allclose(grad_reducer, logits.grad, atol=1e-6)
    assert (grad_reducer[~kept].abs() < 1e-7).all()


HF_SETTINGS = [
    dict(top_p=0.9, min_p=0.1),
    dict(top_k=5, top_p=0.8),
    dict(top_k=7, top_p=0.6, min_p=0.05, temperature=1.3),
    dict(min_p=0.2, temperature=0.7),
]


@pytest.mark.parametrize("setting", HF_SETTINGS, ids=[str(s) for s in HF_SETTINGS])
def test_kept_mask_hf_order_is_exactly_transformers_warpers(setting):
    """order="hf": the set HF generate keeps (temperature, top_k, top_p, then min_p), checked against its warpers."""
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 50, generator=gen) * 3
    scores = TemperatureLogitsWarper(setting.get("temperature", 1.0))(None, logits.clone())
    for warper in (
        TopKLogitsWarper(setting["top_k"]) if "top_k" in setting else None,
        TopPLogitsWarper(setting["top_p"]) if "top_p" in setting else None,
        MinPLogitsWarper(setting["min_p"]) if "min_p" in setting else None,
    ):
        if warper is not None:
            scores = warper(None, scores)
    kept = kept_mask(logits, order="hf", **setting)
    assert torch.equal(kept, torch.isfinite(scores))
    if "min_p" in setting and "top_p" in setting:
        # the orders really differ on these rows (vLLM applies min_p first, then top_p on the renormalised rest)
        assert not torch.equal(kept, kept_mask(logits, order="vllm", **setting))


def test_kept_mask_rejects_unknown_order():
    with pytest.raises(ValueError, match="order must be 'hf' or 'vllm'"):
        kept_mask(torch.zeros(1, 3), top_k=1, order="sglang")
