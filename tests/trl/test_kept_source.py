"""gap.kept_source's pieces without a trainer: vLLM's sampling masks aligned to TRL's completion rows, what is asked
of the engine before it is built, and the refusal on the HF path."""

from __future__ import annotations

import types

import pytest
import torch
from _support.fake_vllm import SamplingMask

from bloggap_plugin.recipes import GapConfig, RecipeError
from bloggap_plugin.trl.kept_source import mask_kept_tensors, planned_sampling_mask, resolve_kept_source
from bloggap_plugin.vllm_kept_sets import kept_sets_from_request_outputs


def _outputs(completions):
    """``RequestOutput``-shaped objects, one completion each: ``(token_ids, mask rows)``."""
    return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=t, sampling_mask=SamplingMask(rows))])
            for t, rows in completions]


def test_masks_become_the_batchs_kept_ids_and_sizes_on_trls_rows():
    kept = kept_sets_from_request_outputs(_outputs([([5, 2], [[9, 5], [2]]), ([7], [[7, 1, 3]])]))
    completion_ids = torch.tensor([[5, 2, 0], [7, 0, 0]])  # right-padded as TRL pads
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    ids, sizes = mask_kept_tensors([kept], completion_ids, mask, store_ids_max=64)
    assert sizes.tolist() == [[2, 1, 0], [3, 0, 0]]
    assert ids.tolist() == [[[5, 9, -1], [2, -1, -1], [-1, -1, -1]], [[1, 3, 7], [-1, -1, -1], [-1, -1, -1]]]
    ids, sizes = mask_kept_tensors([kept], completion_ids, mask, store_ids_max=2)  # larger sets: size only
    assert ids[1, 0].tolist() == [-1, -1] and sizes[1, 0] == 3 and ids[0, 0].tolist() == [5, 9]


def test_a_mask_on_other_tokens_or_rows_is_an_alignment_error():
    kept = kept_sets_from_request_outputs(_outputs([([5, 2], [[5], [2]])]))
    mask = torch.ones(1, 2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="completion 0's tokens differ"):
        mask_kept_tensors([kept], torch.tensor([[5, 3]]), mask, 64)
    with pytest.raises(RuntimeError, match="1 completions with sampling masks for 2 batch rows"):
        mask_kept_tensors([kept], torch.tensor([[5, 2], [5, 2]]), torch.ones(2, 2), 64)
    with pytest.raises(RuntimeError, match="one vLLM generate call per generation.*got 0"):
        mask_kept_tensors([], torch.tensor([[5, 2]]), mask, 64)
    with pytest.raises(ValueError, match="sampling_mask has 1 rows for 2 generated tokens"):
        kept_sets_from_request_outputs(_outputs([([5, 2], [[5]])]))


def _args(**over):
    base = dict(use_vllm=True, vllm_mode="colocate", vllm_tensor_parallel_size=1, temperature=1.0, top_p=0.9, top_k=50,
                min_p=0.0, repetition_penalty=1.0, generation_kwargs=None)
    return types.SimpleNamespace(**{**base, **over})


@pytest.fixture
def vllm_031(monkeypatch):
    import bloggap_plugin.core.vllm.versions as versions

    monkeypatch.setattr(versions, "installed_vllm", lambda: "0.31.0")


@pytest.mark.parametrize("gap, args, mode, why", [
    (GapConfig(), _args(), "auto", None),
    (GapConfig(kept_source="sampling_mask"), _args(), "required", None),
    (GapConfig(kept_source="retruncate"), _args(), None, None),
    (GapConfig(kept="off"), _args(), None, None),
    (GapConfig(), _args(top_k=0, top_p=1.0), None, None),  # untruncated: no kept sets to ask for
    (GapConfig(), _args(top_k=0), None, "top_k is 0"),
    (GapConfig(), _args(generation_kwargs={"top_k": 0}), None, "top_k is 0"),
    (GapConfig(), _args(temperature=0.0), None, "temperature is 0.0"),
    (GapConfig(), _args(vllm_mode="server"), None, "vllm_mode is 'server'"),
    (GapConfig(), _args(vllm_tensor_parallel_size=2), None, "vllm_tensor_parallel_size is 2"),
    (GapConfig(), _args(use_vllm=False), None, None),
])
def test_what_the_engine_is_asked_for_before_it_is_built(vllm_031, gap, args, mode, why):
    got_mode, got_why = planned_sampling_mask(gap, args, environ={})
    assert got_mode == mode
    assert (got_why is None) if why is None else (why in got_why and got_why.endswith("gap.kept_source: retruncate"))


def test_a_source_other_than_auto_is_refused_on_the_hf_path():
    trainer = types.SimpleNamespace(use_vllm=False)
    assert resolve_kept_source(trainer, GapConfig(), kept_on=True) == ("recorder", None)
    for source in ("sampling_mask", "retruncate"):
        with pytest.raises(RecipeError, match=rf"^gap.kept_source: {source} applies to TRL's vLLM path"):
            resolve_kept_source(trainer, GapConfig(kept_source=source), kept_on=True)


def test_an_unknown_kept_source_is_refused_naming_the_choices():
    with pytest.raises(RecipeError, match="gap.kept_source must be one of auto, sampling_mask, retruncate, got 'mask'"):
        GapConfig(kept_source="mask")


def test_kept_off_needs_no_source_whatever_kept_source_says():
    """gap.kept: off records no kept sets: an explicit sampling_mask is moot there, not refused (the engine was not
    asked for the mask, planned_sampling_mask returns None for it)."""
    trainer = types.SimpleNamespace(use_vllm=True, args=_args(), vllm_generation=None, temperature=1.0)
    for source in ("auto", "sampling_mask", "retruncate"):
        assert resolve_kept_source(trainer, GapConfig(kept="off", kept_source=source), kept_on=False) == (None, None)
