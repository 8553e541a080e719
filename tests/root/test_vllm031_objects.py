"""The plugin's vLLM keyword arguments and output parsers against real vLLM (>= 0.28) Python objects, on CPU.

No engine starts: the tests build vLLM's ``SamplingParams``, ``ModelConfig``, ``CompletionOutput`` /
``RequestOutput`` with ``SamplingMask`` rows and ``Logprob`` entries (made by vLLM's own
``append_logprobs_for_next_position``, as its output processor makes them), check ``LLM`` / ``EngineArgs`` accept
every keyword the plugin passes, run vLLM's own ``_verify_sampling_replay_config`` for the refusal texts, and compare
the plugin's parsers on these objects with the same content in the stand-ins of ``tests/_support/fake_vllm.py``.
Skipped where vLLM >= 0.28 does not import (CI has no vLLM). To run them with vLLM 0.31 beside the project's venv
(its torch, transformers and TRL), build ``/tmp/v31site`` with ``bash benchmarks/vllm031_cpu_site.sh`` and run::

    PYTHONPATH=/tmp/v31site HF_HUB_OFFLINE=1 python -m pytest -q -p no:cacheprovider tests/root/test_vllm031_objects.py
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import types

import numpy as np
import pytest
import torch

try:
    import vllm
    from packaging.version import Version
    from vllm.config import ModelConfig, VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.llm import LLM
    from vllm.logprobs import append_logprobs_for_next_position, create_sample_logprobs
    from vllm.outputs import CompletionOutput, RequestOutput, SamplingMask
    from vllm.sampling_params import SamplingParams
except Exception as err:  # noqa: BLE001 - any failure to import vLLM here means: not testable on this machine
    pytest.skip(f"vLLM >= 0.28 is not importable here ({type(err).__name__}: {err})", allow_module_level=True)
if Version(vllm.__version__) < Version("0.28"):
    pytest.skip(f"vLLM {vllm.__version__} has no return_sampling_mask (needs >= 0.28)", allow_module_level=True)

from bloggap_plugin.trl.kept_source import mask_kept_tensors  # noqa: E402
from bloggap_plugin.trl.vllm_colocate import (  # noqa: E402
    _REPLAY_REFUSAL,
    _build_with_sampling_mask,
    trl_colocate_llm_kwargs,
    trl_colocate_sampling_kwargs,
)
from bloggap_plugin.vllm_kept_sets import colocate_engine_kwargs, kept_sets_from_request_outputs  # noqa: E402
from tests._support import fake_vllm  # noqa: E402

# two requests, one completion each: generated token ids, per token (processed log-prob, rank), kept-id rows in the
# order vLLM's sampler leaves them (unsorted; each row holds its token)
TOKENS = [[7, 3, 11], [5, 9]]
LOGPROBS = [[(-0.25, 1), (-1.5, 3), (float("nan"), 2)], [(-0.75, 2), (-0.125, 1)]]
ROWS = [[[7, 2, 4], [3, 1, 5, 8, 0], [11]], [[9, 5], [9, 6, 2]]]
PROMPTS = [[1, 2], [4, 6, 8]]


def _real_outputs(flat: bool) -> list:
    """``RequestOutput``s as vLLM 0.31's output processor builds them: log-probs appended per position by
    ``append_logprobs_for_next_position`` (``logprobs=0``: the sampled token alone, with its rank) into the container
    ``flat_logprobs`` selects; the mask's rows from CSR chunks (``SamplingMask([chunk.token_ids.tolist() ...])``)."""
    outputs = []
    for index, (prompt, tokens, logprobs, rows) in enumerate(zip(PROMPTS, TOKENS, LOGPROBS, ROWS, strict=True)):
        container = create_sample_logprobs(flat)
        for token, (value, rank) in zip(tokens, logprobs, strict=True):
            append_logprobs_for_next_position(container, [token], [value], [None], rank, 0)
        chunks = [np.asarray(row, dtype=np.int32) for row in rows]
        completion = CompletionOutput(index=0, text="", token_ids=list(tokens), cumulative_logprob=None,
                                      logprobs=container, finish_reason="length",
                                      sampling_mask=SamplingMask([chunk.tolist() for chunk in chunks]))
        outputs.append(RequestOutput(request_id=str(index), prompt=None, prompt_token_ids=list(prompt),
                                     prompt_logprobs=None, outputs=[completion], finished=True))
    return outputs


def _stand_in_outputs() -> list:
    """The same content as :func:`FakeLLM.generate <tests._support.fake_vllm.FakeLLM.generate>` returns it."""
    outputs = []
    for prompt, tokens, logprobs, rows in zip(PROMPTS, TOKENS, LOGPROBS, ROWS, strict=True):
        completion = types.SimpleNamespace(
            index=0, token_ids=list(tokens), finish_reason="length", sampling_mask=fake_vllm.SamplingMask(rows),
            logprobs=[{token: fake_vllm.Logprob(value, rank=rank)} for token, (value, rank) in zip(tokens, logprobs)])
        outputs.append(types.SimpleNamespace(prompt_token_ids=list(prompt), outputs=[completion]))
    return outputs


def _accepted_keywords() -> set[str]:
    """What ``LLM(...)`` takes: its own parameters, and ``EngineArgs``' fields (its ``**kwargs`` go there)."""
    named = set(inspect.signature(LLM.__init__).parameters) - {"self", "kwargs"}
    return named | {field.name for field in dataclasses.fields(EngineArgs)}


def test_llm_and_engine_args_take_every_keyword_the_plugin_passes():
    engine = colocate_engine_kwargs(trl_colocate_llm_kwargs("/m", max_num_seqs=4, seed=0))
    extra = {"dtype", "kv_cache_memory_bytes"}  # arm H's and BLOGGAP_VLLM_KV_CACHE_GIB's additions
    assert set(engine) | extra <= _accepted_keywords(), set(engine) | extra - _accepted_keywords()
    assert engine["return_sampling_mask"] is True and engine["logprobs_mode"] == "processed_logprobs"
    assert "return_sampling_mask" in inspect.signature(LLM.__init__).parameters
    assert {"logprobs_mode", "enable_batch_sharded_sampling"} <= {f.name for f in dataclasses.fields(EngineArgs)}


def test_model_config_takes_the_replay_setting(tmp_path):
    config = _tiny_model_config(tmp_path, logprobs_mode="processed_logprobs")
    assert config.return_sampling_mask is True and config.logprobs_mode == "processed_logprobs"
    assert not config.logits_processors and config.is_diffusion is False


@pytest.mark.parametrize("settings", [
    types.SimpleNamespace(temperature=1.0, generation_kwargs={"ignore_eos": True}),  # the doctor's column
    types.SimpleNamespace(temperature=0.9, top_k=50, top_p=0.8, min_p=0.1, repetition_penalty=1.1),
    types.SimpleNamespace(temperature=0.7, top_p=1.0, min_p=None, generation_kwargs={"top_k": 1024, "top_p": 0.9}),
], ids=["doctor", "truncated", "generation_kwargs"])
def test_sampling_params_from_the_plugin_keywords(settings):
    sampling = trl_colocate_sampling_kwargs(settings, max_tokens=6)
    params = SamplingParams(**sampling)
    assert (params.n, params.max_tokens, params.logprobs) == (1, 6, 0)
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "top_k"):
        assert getattr(params, name) == pytest.approx(sampling[name]), name
    assert params.ignore_eos is bool((getattr(settings, "generation_kwargs", None) or {}).get("ignore_eos"))


def test_sampling_params_from_trl_colocate_generation_kwargs():
    """TRL 1.16's colocate dict (``VLLMGeneration.generate``), as ``FakeVLLMGeneration.generate`` writes it."""
    kwargs = {"n": 1, "repetition_penalty": 1.0, "temperature": 0.8, "top_p": 0.8, "top_k": 50, "min_p": 0.1,
              "max_tokens": 16, "logprobs": 0}
    params = SamplingParams(**kwargs)
    assert (params.top_k, params.top_p, params.min_p, params.logprobs) == (50, pytest.approx(0.8),
                                                                          pytest.approx(0.1), 0)
    assert SamplingParams(**{**kwargs, "top_k": 0}).top_k <= 0  # untruncated top_k: vLLM's mask refusal applies


@pytest.mark.parametrize("flat", [False, True], ids=["list", "flat_logprobs"])
def test_kept_sets_of_real_outputs_equal_the_stand_ins(flat):
    real, stand_in = kept_sets_from_request_outputs(_real_outputs(flat)), kept_sets_from_request_outputs(_stand_in_outputs())
    assert real.ids == stand_in.ids == [[sorted(row) for row in rows] for rows in ROWS]
    assert real.sizes == stand_in.sizes == [[len(row) for row in rows] for rows in ROWS]
    assert real.token_ids == stand_in.token_ids == TOKENS
    width = 4
    completion_ids = torch.tensor([tokens + [0] * (width - len(tokens)) for tokens in TOKENS])
    mask = torch.tensor([[1] * len(tokens) + [0] * (width - len(tokens)) for tokens in TOKENS])
    for store_ids_max in (64, 2):
        ids_real, sizes_real = mask_kept_tensors([real], completion_ids, mask, store_ids_max)
        ids_fake, sizes_fake = mask_kept_tensors([stand_in], completion_ids, mask, store_ids_max)
        assert torch.equal(ids_real, ids_fake) and torch.equal(sizes_real, sizes_fake)
        assert sizes_real.tolist() == [[3, 5, 1, 0], [2, 3, 0, 0]]


@pytest.mark.parametrize("flat", [False, True], ids=["list", "flat_logprobs"])
def test_trl_extract_logprobs_on_real_outputs_equals_the_stand_ins(flat):
    from trl.generation.vllm_generation import extract_logprobs

    real_values, real_ids = extract_logprobs(_real_outputs(flat))
    fake_values, fake_ids = extract_logprobs(_stand_in_outputs())
    assert real_ids == fake_ids == [[[token] for token in tokens] for tokens in TOKENS]
    expected = [[[None if math.isnan(value) else value] for value, _ in row] for row in LOGPROBS]
    assert real_values == fake_values == expected


class _ScriptedLLM:
    """An ``LLM`` stand-in for the doctor's ``sample_with_vllm``: refuses a keyword real vLLM's ``LLM`` does not
    take, and answers with :data:`TOKENS` / :data:`LOGPROBS` as real or stand-in outputs (``real``)."""

    real = True
    built: list[dict] = []

    def __init__(self, **kwargs):
        unknown = set(kwargs) - _accepted_keywords()
        assert not unknown, f"LLM(...) does not take {unknown}"
        _ScriptedLLM.built.append(kwargs)

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        assert isinstance(sampling_params, SamplingParams) and sampling_params.ignore_eos is True
        assert [p["prompt_token_ids"] for p in prompts] == PROMPTS
        return _real_outputs(flat=False) if self.real else _stand_in_outputs()


def test_doctor_vllm_rollouts_from_real_outputs_equal_the_stand_ins(monkeypatch):
    from bloggap_plugin.core.probe import Rollouts, Row
    from bloggap_plugin.measure import doctor_vllm

    new_tokens = 3
    tokens = [tokens + [2] * (new_tokens - len(tokens)) for tokens in TOKENS]  # forced length: 3 each
    logprobs = [row + [(-2.0, 4)] * (new_tokens - len(row)) for row in LOGPROBS]
    rows = [row + [[2]] * (new_tokens - len(row)) for row in ROWS]
    monkeypatch.setitem(globals(), "TOKENS", tokens)
    monkeypatch.setitem(globals(), "LOGPROBS", logprobs)
    monkeypatch.setitem(globals(), "ROWS", rows)
    monkeypatch.setattr(doctor_vllm, "engine_classes", lambda: (_ScriptedLLM, SamplingParams, vllm.__version__))
    prompts = [Row(tuple(p), ()) for p in PROMPTS]
    start = Rollouts(prompts, torch.zeros(2, 0), torch.zeros(2, 0, dtype=torch.bool), 0, ["a", "b"],
                     {"temperature": 1.0})
    results = {}
    for real in (True, False):
        monkeypatch.setattr(_ScriptedLLM, "real", real)
        results[real] = doctor_vllm.sample_with_vllm("/m", start, new_tokens, seed=0)
    expected = torch.tensor([[value for value, _ in row] for row in logprobs], dtype=torch.float32)
    for rollouts in results.values():
        assert [list(row.completion) for row in rollouts.rows] == tokens
        torch.testing.assert_close(rollouts.sampler_logprobs, expected, rtol=0, atol=0, equal_nan=True)
        assert rollouts.sampler_mask.all()
    assert results[True].sampler["sampling"] == results[False].sampler["sampling"]
    assert results[True].sampler["sampling"]["ignore_eos"] is True and _ScriptedLLM.built[-1]["seed"] == 0


def _tiny_model_config(tmp_path, **replay):
    """vLLM's ``ModelConfig`` of a saved tiny-random-qwen2 folder with ``return_sampling_mask=True`` and ``replay``
    (it builds on CPU; ``VllmConfig`` does not: it infers a device)."""
    from bloggap_plugin.models import load_model

    model, tokenizer = load_model("tiny-random-qwen2", dtype="fp32")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return ModelConfig(model=str(tmp_path), return_sampling_mask=True, **replay)


def _vllm_replay_check(model_config, v2_runner: bool) -> None:
    """vLLM's own ``VllmConfig._verify_sampling_replay_config`` on ``model_config`` (no speculative decoding)."""
    holder = types.SimpleNamespace(model_config=model_config, use_v2_model_runner=v2_runner, speculative_config=None)
    VllmConfig._verify_sampling_replay_config(holder)


def test_vllm_refusals_are_what_the_plugin_and_the_stand_in_match(tmp_path, monkeypatch):
    config = _tiny_model_config(tmp_path, logprobs_mode="processed_logprobs")
    _vllm_replay_check(config, v2_runner=True)  # accepted: TRL's setting on model runner V2
    refusals = {}
    with pytest.raises(ValueError) as v1:
        _vllm_replay_check(config, v2_runner=False)
    refusals["v1"] = str(v1.value)
    config.logprobs_mode = "raw_logprobs"
    with pytest.raises(ValueError) as raw:
        _vllm_replay_check(config, v2_runner=True)
    refusals["raw"] = str(raw.value)
    assert all(_REPLAY_REFUSAL in text for text in refusals.values()), refusals
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with pytest.raises(ValueError) as fake_v1:
        fake_vllm.FakeLLM(return_sampling_mask=True, logprobs_mode="processed_logprobs")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    with pytest.raises(ValueError) as fake_raw:
        fake_vllm.FakeLLM(return_sampling_mask=True, logprobs_mode="raw_logprobs")
    assert (str(fake_v1.value), str(fake_raw.value)) == (refusals["v1"], refusals["raw"])


def test_build_with_sampling_mask_falls_back_on_vllms_own_refusal(tmp_path):
    """An ``LLM`` whose construction runs vLLM's check on model runner V1: ``auto`` builds it without the mask and
    keeps vLLM's words; ``required`` refuses in one line quoting them."""
    from bloggap_plugin.recipes import RecipeError

    config = _tiny_model_config(tmp_path, logprobs_mode="processed_logprobs")
    built = []

    def llm_on_v1(**kwargs):
        config.return_sampling_mask = bool(kwargs.get("return_sampling_mask", False))
        config.logprobs_mode = kwargs["logprobs_mode"]
        _vllm_replay_check(config, v2_runner=False)
        built.append(kwargs)
        return types.SimpleNamespace(kwargs=kwargs)

    kwargs = trl_colocate_llm_kwargs(str(tmp_path), max_num_seqs=2)
    llm, refusal = _build_with_sampling_mask(llm_on_v1, (), kwargs, "auto")
    assert refusal == "sampling distribution replay requires Model Runner V2"
    assert "return_sampling_mask" not in llm.kwargs and len(built) == 1
    with pytest.raises(RecipeError, match="sampling distribution replay requires Model Runner V2"):
        _build_with_sampling_mask(llm_on_v1, (), kwargs, "required")


@pytest.mark.parametrize("truncation", [{}, {"top_k": 50, "top_p": 0.8, "min_p": 0.1},
                                        {"generation_kwargs": {"top_k": 1024, "min_p": 0.05}}],
                         ids=["defaults", "truncated", "generation_kwargs"])
def test_sampling_params_from_a_grpo_config(tmp_path, truncation):
    """TRL 1.16's GRPOConfig (its defaults: top_k 0, min_p None) through the plugin's keywords into SamplingParams."""
    from trl import GRPOConfig

    args = GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **truncation)
    params = SamplingParams(**trl_colocate_sampling_kwargs(args, max_tokens=4))
    wanted = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, **{k: v for k, v in truncation.items() if k != "generation_kwargs"},
              **truncation.get("generation_kwargs", {})}
    assert (params.top_k, params.top_p, params.min_p) == (wanted["top_k"], pytest.approx(wanted["top_p"]),
                                                          pytest.approx(wanted["min_p"]))
    assert params.temperature == pytest.approx(args.temperature) and params.logprobs == 0


def test_engine_settings_read_from_vllms_model_config(tmp_path):
    """The plugin reads ``return_sampling_mask`` of a built engine from ``llm.llm_engine.model_config``, the name
    vLLM's ``LLMEngine.__init__`` gives it. The doctor records the engine dtype from the same config: with no
    ``dtype`` (TRL's call) vLLM downcasts an fp32 checkpoint (the tiny model's) to its platform's preferred dtype."""
    from vllm.platforms import current_platform
    from vllm.v1.engine.llm_engine import LLMEngine

    from bloggap_plugin.trl.colocate_reads import colocate_engine_setting

    assert "self.model_config = vllm_config.model_config" in inspect.getsource(LLMEngine.__init__)
    config = _tiny_model_config(tmp_path, logprobs_mode="processed_logprobs")
    engine = types.SimpleNamespace(model_config=config)
    trainer = types.SimpleNamespace(vllm_generation=types.SimpleNamespace(llm=types.SimpleNamespace(llm_engine=engine)))
    assert colocate_engine_setting(trainer, "return_sampling_mask") is True
    assert colocate_engine_setting(trainer, "logprobs_mode") == "processed_logprobs"
    assert config.dtype == current_platform.supported_dtypes[0] != torch.float32
