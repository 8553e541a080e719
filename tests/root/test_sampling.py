"""SamplerRecorder on a tiny random model: it must reproduce HF's own sampler and record what it drew from."""

from __future__ import annotations

import pytest
import torch
import transformers

from bloggap_plugin.core.scoring import token_logprobs
from bloggap_plugin.core.truncation import kept_reducer, pack_kept_ids
from bloggap_plugin.models import load_model
from bloggap_plugin.sampling import (
    SamplerRecorder,
    SamplerRecordError,
    check_neutral_generation_config,
    effective_generation_config,
    sampler_settings,
    unsupported_generation_mode,
)

PROMPTS = ["Hello there", "A", "The quick brown fox", "x = 1 + 2"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def prompts(tiny):
    """:data:`PROMPTS` tokenised for the shared tiny model, left-padded: ``input_ids`` / ``attention_mask`` ``[4, L]``."""
    _, tok = tiny
    return tok(PROMPTS, return_tensors="pt", padding=True)


def _generate(model, batch, seed, **kwargs):
    torch.manual_seed(seed)
    return model.generate(
        **batch,
        do_sample=True,
        max_new_tokens=NEW_TOKENS,
        output_scores=True,
        return_dict_in_generate=True,
        **kwargs,
    )


def _hf_logprobs(out, tokens):
    """log_softmax of HF's processed scores (what multinomial drew from) at the emitted tokens. [B, C]."""
    scores = torch.stack(out.scores, dim=1).float()
    return torch.log_softmax(scores, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def test_untruncated_records_hf_sampler_logprobs(tiny, prompts):
    model, batch = tiny[0], prompts
    width = batch["input_ids"].shape[1]
    recorder = SamplerRecorder(temperature=0.7)
    # repetition_penalty runs before the recorder, so it is part of what both runs sample from
    ours = _generate(
        model, batch, 11, logits_processor=[recorder], repetition_penalty=1.3, **recorder.neutral_generation_kwargs()
    )
    hf = _generate(model, batch, 11, temperature=0.7, top_k=0, top_p=1.0, repetition_penalty=1.3)
    assert torch.equal(ours.sequences, hf.sequences)
    completion = hf.sequences[:, width:]
    record = recorder.finalize(ours.sequences, width, eos_token_id=model.generation_config.eos_token_id)
    keep = record.completion_mask.bool()
    expected = _hf_logprobs(hf, completion)
    assert torch.allclose(record.logps[keep], expected[keep], atol=1e-6, rtol=0)
    assert torch.equal(record.processed_logps, record.logps)
    assert record.kept_ids is None and not record.kept_sizes.any() and not record.log_kept_mass.any()
    assert (record.logps[~keep] == 0).all()


@pytest.mark.parametrize(
    "truncation",
    [dict(top_p=0.8), dict(top_k=5), dict(min_p=0.3), dict(top_p=0.9, min_p=0.1), dict(top_k=5, top_p=0.8)],
    ids=["top_p0.8", "top_k5", "min_p0.3", "top_p0.9+min_p0.1", "top_k5+top_p0.8"],
)
def test_truncated_recorder_draws_exactly_what_hf_warpers_draw(tiny, prompts, truncation):
    model, batch = tiny[0], prompts
    width = batch["input_ids"].shape[1]
    temperature = 0.1  # the random model's logits are nearly flat; sharpen so sets are of mixed size
    recorder = SamplerRecorder(temperature=temperature, truncate=True, store_ids_max=1000, **truncation)
    ours = _generate(model, batch, 5, logits_processor=[recorder], **recorder.neutral_generation_kwargs())
    hf_kwargs = dict(temperature=temperature, top_k=0, top_p=1.0) | truncation
    hf = _generate(model, batch, 5, **hf_kwargs)
    assert torch.equal(ours.sequences, hf.sequences)
    completion = hf.sequences[:, width:]
    record = recorder.finalize(ours.sequences, width, eos_token_id=model.generation_config.eos_token_id)
    keep = record.completion_mask.bool()
    hf_scores = torch.stack(hf.scores, dim=1)
    hf_sets = torch.isfinite(hf_scores)
    for b in range(completion.shape[0]):
        for t in range(completion.shape[1]):
            if not keep[b, t]:
                continue
            ids = [i for i in record.kept_ids[b, t].tolist() if i >= 0]
            assert ids == torch.nonzero(hf_sets[b, t]).squeeze(-1).tolist()
            assert int(completion[b, t]) in ids
            assert record.kept_sizes[b, t] == len(ids)
    # the draw's log-prob is HF's, and full - processed is the kept mass, token by token
    assert torch.allclose(record.processed_logps[keep], _hf_logprobs(hf, completion)[keep], atol=1e-6, rtol=0)
    mass_from_ratio = torch.exp(record.logps - record.processed_logps)
    assert torch.allclose(mass_from_ratio[keep], torch.exp(record.log_kept_mass)[keep], atol=1e-6, rtol=0)
    assert (record.log_kept_mass[keep] < 0).any()
    if set(truncation) == {"top_k"}:
        assert (record.kept_sizes[keep] == truncation["top_k"]).all()


def test_teacher_forced_rescoring_over_recorded_set_gives_ratio_one(tiny, prompts):
    model, batch = tiny[0], prompts
    width = batch["input_ids"].shape[1]
    temperature = 0.1  # kept sets of ~34-51 tokens: store_ids_max=40 sends some through ids, some through sizes
    recorder = SamplerRecorder(temperature=temperature, top_p=0.8, truncate=True, store_ids_max=40)
    out = _generate(model, batch, 3, logits_processor=[recorder], **recorder.neutral_generation_kwargs())
    record = recorder.finalize(out.sequences, width, eos_token_id=model.generation_config.eos_token_id)
    keep = record.completion_mask.bool()
    stored = (record.kept_ids >= 0).any(-1)
    assert stored[keep].any() and (~stored[keep]).any()  # both the ids and the size-only path are exercised
    attention = torch.cat([batch["attention_mask"], torch.ones_like(out.sequences[:, width:])], dim=1)
    with torch.no_grad():
        full = token_logprobs(model, out.sequences, attention, NEW_TOKENS, temperature=temperature)
        reduce = kept_reducer(kept_ids=record.kept_ids_tensor(), sizes=record.kept_sizes)
        renorm = token_logprobs(model, out.sequences, attention, NEW_TOKENS, temperature=temperature, reduce=reduce)
    ratio_before = torch.exp(full - record.processed_logps)[keep]
    ratio_after = torch.exp(renorm - record.processed_logps)[keep]
    # uncorrected: ratio = kept mass S per token; corrected: 1 within fp32 rounding (cache vs full forward)
    assert torch.allclose(ratio_before, torch.exp(record.log_kept_mass)[keep], atol=1e-5, rtol=0)
    assert ratio_before.max() < 0.999
    assert torch.allclose(ratio_after, torch.ones_like(ratio_after), atol=1e-5, rtol=0)


def test_kept_ids_are_a_tensor_equal_to_the_packed_id_lists(tiny, prompts):
    """Kept ids stay tensors end to end: the same values as packing the per-token sorted id lists (the old form)."""
    model, batch = tiny[0], prompts
    width = batch["input_ids"].shape[1]
    recorder = SamplerRecorder(temperature=0.1, top_p=0.8, truncate=True, store_ids_max=40)
    ours = _generate(model, batch, 3, logits_processor=[recorder], **recorder.neutral_generation_kwargs())
    hf = _generate(model, batch, 3, temperature=0.1, top_k=0, top_p=0.8)
    assert torch.equal(ours.sequences, hf.sequences)
    record = recorder.finalize(ours.sequences, width, eos_token_id=model.generation_config.eos_token_id)
    keep = record.completion_mask.bool()
    hf_sets = torch.isfinite(torch.stack(hf.scores, dim=1))
    lists = [
        [
            ids if keep[b, t] and len(ids) <= 40 else None
            for t, ids in enumerate(torch.nonzero(hf_sets[b, t]).squeeze(-1).tolist() for t in range(NEW_TOKENS))
        ]
        for b in range(len(PROMPTS))
    ]
    assert any(ids is None for row in lists for ids in row) and any(ids is not None for row in lists for ids in row)
    expected = pack_kept_ids(lists, width=NEW_TOKENS)
    assert torch.is_tensor(record.kept_ids) and record.kept_ids.dtype == torch.long
    assert torch.equal(record.kept_ids, expected)
    assert torch.equal(record.kept_ids_tensor(), expected)
    assert torch.equal(record.kept_ids_tensor(pad=0), expected.clamp(min=0))


def test_misuse_gives_clear_errors(tiny, prompts):
    model, batch = tiny[0], prompts
    width = batch["input_ids"].shape[1]
    recorder = SamplerRecorder(top_k=3, truncate=True)
    with pytest.raises(SamplerRecordError, match="recorded nothing"):
        recorder.finalize(batch["input_ids"], width)
    out = _generate(model, batch, 0, logits_processor=[recorder], **recorder.neutral_generation_kwargs())
    with pytest.raises(SamplerRecordError, match="prompt_width"):
        recorder.finalize(out.sequences, width - 1)
    with pytest.raises(RuntimeError, match="reset"):
        _generate(model, batch, 0, logits_processor=[recorder], **recorder.neutral_generation_kwargs())
    recorder.reset()
    _generate(model, batch, 0, logits_processor=[recorder], **recorder.neutral_generation_kwargs())
    with pytest.raises(ValueError, match="temperature"):
        SamplerRecorder(temperature=0.0)
    config = transformers.GenerationConfig(do_sample=True, top_p=0.9, top_k=0)
    with pytest.raises(ValueError, match="top_p=0.9"):
        check_neutral_generation_config(config)
    config.update(**SamplerRecorder.neutral_generation_kwargs())
    check_neutral_generation_config(config)


def test_effective_config_takes_the_models_warpers_and_neutral_kwargs_switch_all_off():
    """generate fills None fields from model.generation_config: min_p=None is NOT off when the model ships min_p."""
    model, _ = load_model("tiny-random-llama", dtype="fp32")
    model.generation_config.min_p = 0.3
    model.generation_config.typical_p = 0.95
    trl_like = transformers.GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9, top_k=0, min_p=None)
    effective = effective_generation_config(model, trl_like)
    assert trl_like.min_p is None and effective.min_p == 0.3 and effective.typical_p == 0.95
    with pytest.raises(ValueError, match=r"typical_p=0\.95"):
        sampler_settings(effective)
    model.generation_config.typical_p = None
    assert sampler_settings(effective_generation_config(model, trl_like)) == dict(
        temperature=0.7, top_k=0, top_p=0.9, min_p=0.3
    )
    trl_like.update(min_p=None, temperature=1.0, top_p=1.0)  # the old neutral kwargs: min_p None
    with pytest.raises(ValueError, match=r"min_p=0\.3"):
        check_neutral_generation_config(effective_generation_config(model, trl_like))
    trl_like.update(**SamplerRecorder.neutral_generation_kwargs())
    check_neutral_generation_config(effective_generation_config(model, trl_like))
    for name in ("typical_p", "epsilon_cutoff", "eta_cutoff"):  # the neutral values switch a model's value off
        setattr(model.generation_config, name, 0.5 if name == "typical_p" else 3e-4)
    check_neutral_generation_config(effective_generation_config(model, trl_like))
    # only plain multinomial sampling is recordable
    assert unsupported_generation_mode(trl_like) is None
    assert "beam" in unsupported_generation_mode(transformers.GenerationConfig(do_sample=True, num_beams=2))
    assert "greedy" in unsupported_generation_mode(transformers.GenerationConfig(do_sample=False))
    assert "assisted" in unsupported_generation_mode(
        transformers.GenerationConfig(do_sample=True, prompt_lookup_num_tokens=3)
    )


def test_trunc_bias_benchmark_quick_mode_on_tiny_fp32(tmp_path):
    """The T11 script end to end (quick, tiny fp32 model): schema, and the maths it is meant to show."""
    import json

    from benchmarks import trunc_bias as module

    argv = ["--quick", "--device", "cpu", "--model", "tiny-random-llama", "--dtype", "fp32", "--out", str(tmp_path)]
    assert module.main(argv) == 0
    data = json.loads((tmp_path / "trunc_bias.json").read_text())
    assert data["benchmark"] == "trunc_bias" and data["schema_version"] == 1 and "env" in data
    t11 = next(t for t in data["tables"] if t["id"] == "T11")
    assert t11["reference"] == "T11" and t11["random_init"] is True and len(t11["rows"]) == 4
    assert all(len(row) == len(t11["columns"]) for row in t11["rows"])
    for arm in data["results"]["arms"]:
        assert arm["sampler_mass_identity_max_abs"] < 1e-5
        if not arm["truncate"]:
            assert arm["ratio_full_vocab"]["mean"] == pytest.approx(1.0, abs=1e-5)
            continue
        # fp32: the uncorrected mean ratio is the mean kept mass; renormalised, every token's ratio is 1
        assert arm["ratio_full_vocab"]["mean"] == pytest.approx(arm["kept_mass_sampler_mean"], abs=1e-5)
        if arm["arm"] in ("top_p=0.8", "top_k=20"):  # min_p 0.05 keeps everything of this flat random model
            assert arm["kept_mass_sampler_mean"] < 0.99
        assert arm["ratio_kept_set"]["abs_dlogp"]["max"] < 1e-5 and arm["ratio_kept_set"]["oob"] == 0
        assert arm["sets_equal"] == arm["positions_with_ids"] == arm["tokens"]
