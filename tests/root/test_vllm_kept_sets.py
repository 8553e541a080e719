"""vLLM kept-set parsing, tested against fakes shaped like vLLM's DOCUMENTED dataclasses (no live vLLM here).

Fakes follow vllm_and_ecosystem.md 1.3: ``RequestOutput.outputs[i]`` is a ``CompletionOutput`` whose
``sampling_mask`` is ``SamplingMask(token_ids: list[list[int]])``; the CSR form is
``SamplingMaskLists(token_ids: ndarray, offsets: ndarray)``; ``/inference/v1/generate`` returns choices with
``token_ids`` and ``sampling_mask``; ``logprobs`` is a list per token of ``{token_id: Logprob}``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from bloggap_plugin.core.truncation import kept_mask, kept_reducer, log_kept_mass
from bloggap_plugin.vllm_kept_sets import (
    DEFAULT_TOP_K_CAP,
    colocate_engine_kwargs,
    kept_sets_from_processed_logprobs,
    kept_sets_from_request_outputs,
    kept_sets_from_server_response,
    kept_sets_from_sizes,
    mask_rows,
    replay_sampling_params,
    retruncation_reducer,
    server_cli_args,
    server_generate_payload,
)


@dataclass
class SamplingMask:
    token_ids: list[list[int]]


@dataclass
class SamplingMaskLists:
    token_ids: np.ndarray
    offsets: np.ndarray


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    sampling_mask: SamplingMask | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


def simulate_vllm(logits: torch.Tensor, n: int, seed: int = 0, logprobs_k: int = 0, **sampling):
    """A stand-in engine: per position, the kept set in vLLM's order, a draw from it, processed log-probs.

    ``logits`` is ``[R * n, C, V]`` (the logits the sampler saw for each completion and position).
    Returns (request outputs, tokens [R*n, C], processed log-probs [R*n, C], kept masks [R*n, C, V]).
    """
    gen = torch.Generator().manual_seed(seed)
    temperature = sampling.get("temperature", 1.0)
    kept = kept_mask(logits, **sampling)
    processed = torch.log_softmax((logits / temperature).masked_fill(~kept, float("-inf")), -1)
    tokens = torch.multinomial(processed.exp().reshape(-1, logits.shape[-1]), 1, generator=gen).reshape(kept.shape[:-1])
    sampled_lp = processed.gather(-1, tokens[..., None]).squeeze(-1)
    requests = []
    for r in range(logits.shape[0] // n):
        outs = []
        for i in range(n):
            row = r * n + i
            rows = [torch.nonzero(kept[row, t]).squeeze(-1).tolist()[::-1] for t in range(kept.shape[1])]  # unsorted
            lps = None
            if logprobs_k:
                top = torch.topk(processed[row], logprobs_k, dim=-1)
                lps = []
                for t in range(kept.shape[1]):
                    entry = {int(i_): Logprob(float(v)) for v, i_ in zip(top.values[t], top.indices[t])}
                    entry[int(tokens[row, t])] = Logprob(float(sampled_lp[row, t]))
                    lps.append(entry)
            outs.append(
                CompletionOutput(i, "", tokens[row].tolist(), None, lps, "length", SamplingMask(token_ids=rows))
            )
        requests.append(RequestOutput(f"req-{r}", None, [1, 2, 3], outs))
    return requests, tokens, sampled_lp, kept


SETTINGS = [dict(top_p=0.8, top_k=DEFAULT_TOP_K_CAP), dict(top_k=20), dict(min_p=0.05, top_k=1024, temperature=0.7)]


@pytest.mark.parametrize("sampling", SETTINGS, ids=["top_p0.8", "top_k20", "min_p0.05_T0.7"])
def test_mask_replay_renormalisation_gives_ratio_one(sampling):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 10, 300, generator=gen) * 2.5
    requests, tokens, vllm_lp, kept = simulate_vllm(logits, n=2, **sampling)
    sets = kept_sets_from_request_outputs(requests)
    assert not sets.approximate and sets.source == "sampling_mask"
    assert sets.sizes_tensor().tolist() == kept.sum(-1).tolist()
    for row in range(6):
        for t in range(10):
            assert sets.ids[row][t] == torch.nonzero(kept[row, t]).squeeze(-1).tolist()
    temperature = sampling.get("temperature", 1.0)
    scaled = logits / temperature  # token_logprobs hands the reducer temperature-scaled logits
    reduce = kept_reducer(kept_ids=sets.ids_tensor(), sizes=sets.sizes_tensor())
    renorm = reduce(scaled, tokens, slice(0, 6))
    full = torch.log_softmax(scaled, -1).gather(-1, tokens[..., None]).squeeze(-1)
    # same logits on both sides here, so the only difference left is float rounding
    assert torch.allclose(torch.exp(renorm - vllm_lp), torch.ones_like(renorm), atol=2e-6, rtol=0)
    assert torch.allclose(torch.exp(full - vllm_lp), torch.exp(log_kept_mass(logits, kept, temperature)), atol=2e-6)
    # ids of very large sets can be dropped to save memory: the sizes reproduce the same renormalisation
    small = kept_reducer(kept_ids=sets.ids_tensor(max_ids=5), sizes=sets.sizes_tensor())(scaled, tokens, slice(0, 6))
    assert torch.allclose(small, renorm, atol=2e-6, rtol=0)


def test_csr_dict_and_server_layouts_parse_to_the_same_rows():
    rows = [[5, 1], [7], [2, 3, 4]]
    flat = np.array([5, 1, 7, 2, 3, 4], dtype=np.int32)
    offsets = np.array([0, 2, 3, 6], dtype=np.int64)
    expected = [[1, 5], [7], [2, 3, 4]]
    assert mask_rows(SamplingMask(rows)) == expected
    assert mask_rows(SamplingMaskLists(flat, offsets)) == expected
    assert mask_rows({"token_ids": rows}) == expected
    assert mask_rows(rows) == expected
    response = {"request_id": "x", "choices": [{"index": 0, "token_ids": [5, 7, 4], "sampling_mask": rows}]}
    sets = kept_sets_from_server_response(response)
    assert sets.ids == [expected] and sets.sizes == [[2, 1, 3]] and not sets.approximate
    with pytest.raises(ValueError, match="offsets"):
        mask_rows(SamplingMaskLists(flat, np.array([0, 2, 5])))


def test_missing_or_misaligned_masks_raise_with_the_fix():
    out = CompletionOutput(0, "", [3, 4], None, None)
    with pytest.raises(ValueError, match="return_sampling_mask=True"):
        kept_sets_from_request_outputs([RequestOutput("r", None, [1], [out])])
    out.sampling_mask = SamplingMask([[3]])
    with pytest.raises(ValueError, match="1 rows for 2 generated tokens"):
        kept_sets_from_request_outputs([RequestOutput("r", None, [1], [out])])
    out.sampling_mask = SamplingMask([[3], [5, 6]])
    with pytest.raises(ValueError, match="not in its kept set"):
        kept_sets_from_request_outputs([RequestOutput("r", None, [1], [out])])
    with pytest.raises(ValueError, match="--return-sampling-mask"):
        kept_sets_from_server_response({"choices": [{"token_ids": [1], "sampling_mask": None}]})
    with pytest.raises(ValueError, match="choices"):
        kept_sets_from_server_response({"error": "bad"})


def test_processed_logprobs_fallback_exact_when_covered_approximate_when_not():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 6, 200, generator=gen) * 3
    requests, tokens, _, kept = simulate_vllm(logits, n=1, logprobs_k=20, top_k=8)
    sets = kept_sets_from_processed_logprobs([o for r in requests for o in r.outputs])
    assert not sets.approximate and sets.stats["incomplete_positions"] == 0
    assert sets.sizes == kept.sum(-1).tolist()
    assert sets.ids[0][0] == torch.nonzero(kept[0, 0]).squeeze(-1).tolist()
    requests, _, _, kept = simulate_vllm(logits, n=1, logprobs_k=5, top_k=8)
    sets = kept_sets_from_processed_logprobs([o for r in requests for o in r.outputs])
    # |S| = 8 > K = 5 everywhere: no position is covered, ids are dropped, sizes are lower bounds (5 or 6)
    assert sets.approximate and sets.stats["incomplete_positions"] == sets.stats["positions"] == 12
    assert all(ids is None for row in sets.ids for ids in row)
    assert all(5 <= size < 8 for row in sets.sizes for size in row)
    with pytest.raises(ValueError, match="logprobs=K"):
        kept_sets_from_processed_logprobs([CompletionOutput(0, "", [1], None, None)])


def test_size_only_and_retruncation_are_flagged_approximate():
    sets = kept_sets_from_sizes([[3, 1], [2]])
    assert sets.approximate and sets.ids is None and sets.ids_tensor() is None
    assert sets.sizes_tensor().tolist() == [[3, 1], [2, 0]]
    with pytest.raises(ValueError, match=">= 0"):
        kept_sets_from_sizes([[-1]])
    logits = torch.tensor([[[4.0, 3.0, 0.0, -2.0], [1.0, 0.9, 0.8, -5.0]]])
    targets = torch.tensor([[3, 1]])
    stats: dict = {}
    reduce = retruncation_reducer(top_k=2, stats=stats)
    assert reduce.approximate
    got = reduce(logits, targets, slice(0, 1))
    # position 0: top-2 = {0, 1}, sampled 3 forced in; position 1: top-2 = {0, 1} already holds it
    expected_sets = [[0, 1, 3], [0, 1]]
    for t, ids in enumerate(expected_sets):
        lse = torch.logsumexp(logits[0, t, ids], -1)
        assert got[0, t].item() == pytest.approx((logits[0, t, targets[0, t]] - lse).item(), abs=1e-6)
    assert stats == {"positions": 2, "forced": 1}


def test_engine_and_request_settings():
    kwargs = colocate_engine_kwargs({"gpu_memory_utilization": 0.3})
    assert kwargs == {"gpu_memory_utilization": 0.3, "logprobs_mode": "processed_logprobs", "return_sampling_mask": True}
    with pytest.raises(ValueError, match="processed_logprobs"):
        colocate_engine_kwargs({"logprobs_mode": "raw_logprobs"})
    with pytest.raises(ValueError, match="logits_processors"):
        colocate_engine_kwargs({"logits_processors": ["x"]})
    assert "--return-sampling-mask" in server_cli_args()
    top_p_only = replay_sampling_params(temperature=1.0, top_p=0.8)
    assert top_p_only.replay and top_p_only.capped and top_p_only.params["top_k"] == DEFAULT_TOP_K_CAP
    top_k = replay_sampling_params(top_k=20, min_p=None)
    assert top_k.replay and not top_k.capped and top_k.params == {"temperature": 1.0, "top_p": 1.0, "top_k": 20, "min_p": 0.0}
    plain = replay_sampling_params(top_k=-1)
    assert not plain.replay and plain.params["top_k"] == 0
    with pytest.raises(ValueError, match="temperature > 0"):
        replay_sampling_params(temperature=0.0, top_p=0.9)
    payload = server_generate_payload([1, 2, 3], top_p_only.params, model="m")
    assert payload == {"token_ids": [1, 2, 3], "sampling_params": top_p_only.params, "model": "m"}
    with pytest.raises(ValueError, match="top_k > 0"):
        server_generate_payload([1], {"temperature": 1.0, "top_p": 0.8, "top_k": 0})


def test_vllm_live_gen_forces_length_without_masking_the_stop_tokens():
    """vLLM's min_tokens processor sets the stop tokens' logits to -inf before processed log-probs are taken, so a
    sampler log-prob read under min_tokens is renormalised without EOS while the trainer's covers the whole
    vocabulary (docs/history/arm_i.md). The gap benchmark forces its length with ignore_eos, which masks nothing."""
    from benchmarks import vllm_live

    kwargs = vllm_live.gen_sampling_kwargs(new_tokens=128, logprobs=20, seed=1003, truncation={"top_p": 0.8})
    assert "min_tokens" not in kwargs and kwargs["ignore_eos"] is True
    assert (kwargs["max_tokens"], kwargs["logprobs"], kwargs["seed"], kwargs["top_p"]) == (128, 20, 1003, 0.8)
    assert kwargs["temperature"] == 1.0


def test_committed_vllm_live_result_rebuilds_from_its_committed_parts(tmp_path, spawns):
    """benchmarks/results/h200/vllm_live.json is `python -m benchmarks.vllm_live merge` of the whole 'all' run of 2026-12-01 and the
    TRL truncation runs' work folder: merging the committed parts again gives the committed tables and results."""
    import json
    import subprocess
    import sys
    import tarfile

    from _support import ROOT

    root = ROOT
    parts = root / "benchmarks" / "results" / "h200" / "vllm_live_parts"
    with tarfile.open(parts / "work_call4_trunc_trl.tgz") as archive:
        archive.extractall(tmp_path / "trunc", filter="data")
    out = tmp_path / "vllm_live.json"
    subprocess.run([sys.executable, "-m", "benchmarks.vllm_live", "merge", "--all",
                    "benchmarks/results/h200/vllm_live_parts/all_2026-12-01.json", "--trunc-trl", str(tmp_path / "trunc"),
                    "--out", str(out)], cwd=root, check=True, capture_output=True)
    rebuilt, committed = json.loads(out.read_text()), json.loads((parts.parent / "vllm_live.json").read_text())
    assert rebuilt["tables"] == committed["tables"] and rebuilt["results"] == committed["results"]
    t13 = {(row[0], row[1]): row for row in committed["tables"][0]["rows"]}
    # arm H's pairing, fp16 sampler against the fp16 shadow: no token out of band
    assert t13[("vLLM float16, batch-invariant 0", "fp16 shadow (arm F)")][3] == 0.0
