"""A CPU stand-in for TRL 1.16's ``VLLMGeneration`` (colocate) and vLLM's ``LLM``, so the plugin's vLLM path runs in tests.

:class:`FakeVLLMGeneration` follows TRL's colocate branch of ``vllm_generation.generate``: it builds the sampling
parameters, calls ``self.llm.generate(vllm_prompts, sampling_params=..., use_tqdm=False)`` and flattens the
``RequestOutput`` list as TRL does (``[o.token_ids for r in outputs for o in r.outputs]``, TRL's ``extract_logprobs``).
:class:`FakeLLM` samples with HF ``generate`` and :class:`~bloggap_plugin.sampling.SamplerRecorder` in vLLM's
truncation order (temperature, min_p, top_k, top_p) and returns per completion the token ids (up to and including
EOS), per token ``{token_id: Logprob}`` with the processed log-prob of the sampled token (``logprobs=0``), and, when
built with ``return_sampling_mask=True``, ``sampling_mask = SamplingMask(token_ids=list[list[int]])``: one row of
kept ids per generated token (vllm/outputs.py, vllm/v1/engine/output_processor.py in vLLM 0.31). It refuses what
vLLM 0.31 refuses: the setting without model runner V2 or with another ``logprobs_mode`` / custom logits processors
(``_verify_sampling_replay_config``, vllm/config/vllm.py), and, with it, a request with ``temperature <= 0`` or
``top_k <= 0`` (vllm/v1/engine/input_processor.py). The engine's kernels are the trainer's own here, so on CPU the
only sampler-vs-trainer difference is truncation. :class:`TeacherForcedLLM` stands in for the engine the doctor's
vLLM sampler column builds from a model folder.
"""

from __future__ import annotations

import os
import types
from dataclasses import dataclass

import torch

from bloggap_plugin.core.probe import left_pad
from bloggap_plugin.sampling import SamplerRecorder


@dataclass
class SamplingMask:
    """vLLM 0.31's ``vllm.outputs.SamplingMask``."""

    token_ids: list[list[int]]


@dataclass
class Logprob:
    """vLLM's ``vllm.logprobs.Logprob`` (the fields TRL's ``extract_logprobs`` reads)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class FakeLLM:
    """vLLM's ``LLM`` as TRL's colocate engine uses it; ``expose_engine`` adds ``llm_engine.vllm_config`` (what the
    plugin reads of a real engine: ``model_config.return_sampling_mask``, ``use_v2_model_runner``)."""

    default_runner = "v2"
    """The runner vLLM picks when ``VLLM_USE_V2_MODEL_RUNNER`` is unset (tests set ``v1`` to mimic a fallback)."""

    def __init__(self, model=None, *, return_sampling_mask: bool = False, logprobs_mode: str = "raw_logprobs",
                 logits_processors=None, expose_engine: bool = True, **_ignored):
        env = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower()
        runner = "v1" if env in ("0", "false") else "v2" if env in ("1", "true") else self.default_runner
        if return_sampling_mask:  # vllm/config/vllm.py _verify_sampling_replay_config
            if runner != "v2":
                raise ValueError("sampling distribution replay requires Model Runner V2")
            if logits_processors:
                raise ValueError("sampling distribution replay does not support custom logits processors")
            if logprobs_mode != "processed_logprobs":
                raise ValueError("sampling distribution replay requires logprobs_mode='processed_logprobs' so that "
                                 "returned logprobs are normalized over the same nucleus as the sampling mask")
        self.return_sampling_mask = bool(return_sampling_mask)
        self.generation = None  # the FakeVLLMGeneration that owns it (its trainer's model samples)
        if expose_engine:
            model_config = types.SimpleNamespace(return_sampling_mask=self.return_sampling_mask,
                                                 logprobs_mode=logprobs_mode)
            self.llm_engine = types.SimpleNamespace(vllm_config=types.SimpleNamespace(
                model_config=model_config, use_v2_model_runner=runner == "v2"))

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        params = sampling_params
        if self.return_sampling_mask:  # vllm/v1/engine/input_processor.py
            if params.temperature <= 0:
                raise ValueError("sampling distribution replay requires temperature > 0")
            if params.top_k <= 0:
                raise ValueError("sampling distribution replay requires top_k > 0 to bound sampling mask size, "
                                 "reduce transfer overhead, and avoid potential OOMs")
        trainer = self.generation.trainer
        model = trainer.accelerator.unwrap_model(trainer.model)
        tokenizer = trainer.processing_class
        pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
        ids, mask = left_pad([p["prompt_token_ids"] for p in prompts], pad)
        width = ids.shape[1]
        top_k, top_p, min_p = int(params.top_k or 0), float(params.top_p), float(params.min_p or 0.0)
        truncate = top_k > 0 or top_p < 1.0 or min_p > 0.0
        vocab = int(model.config.vocab_size)
        recorder = SamplerRecorder(temperature=params.temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                   truncate=truncate, order="vllm", store_ids_max=vocab if truncate else 0)
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()  # an inference engine runs no dropout
        with torch.no_grad():
            sequences = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                                       max_new_tokens=params.max_tokens, logits_processor=[recorder],
                                       pad_token_id=pad, eos_token_id=eos, **recorder.neutral_generation_kwargs())
        model.train(was_training)
        record = recorder.finalize(sequences, width)
        self.generation.last_record = record
        outputs = []
        for row, prompt in enumerate(prompts):
            tokens = sequences[row, width:].tolist()
            if eos in tokens:
                tokens = tokens[: tokens.index(eos) + 1]
            logprobs = [{token: Logprob(float(v), rank=1)}
                        for token, v in zip(tokens, record.processed_logps[row, : len(tokens)].tolist())]
            mask_rows = None
            if self.return_sampling_mask:
                kept = record.kept_ids[row, : len(tokens)]
                mask_rows = SamplingMask([[int(i) for i in r if i >= 0] for r in kept.tolist()])
            completion = types.SimpleNamespace(index=0, token_ids=tokens, logprobs=logprobs, sampling_mask=mask_rows,
                                               finish_reason="stop" if tokens and tokens[-1] == eos else "length")
            outputs.append(types.SimpleNamespace(prompt_token_ids=prompt["prompt_token_ids"], outputs=[completion]))
        return outputs


class FakeVLLMGeneration:
    def __init__(self, trainer, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float | None = None,
                 llm: FakeLLM | None = None):
        self.trainer = trainer
        self.temperature, self.top_p, self.top_k, self.min_p = temperature, top_p, top_k, min_p
        self.generation_kwargs: dict = {}
        self.mode = "colocate"
        self.tensor_parallel_size = 1
        self.calls = 0
        self.llm = llm if llm is not None else FakeLLM(expose_engine=False)
        self.llm.generation = self

    def sync_weights(self) -> None:
        pass

    def generate(self, prompts, images=None, num_generations=1, profiler=None):
        """TRL 1.16's colocate branch (tensor_parallel_size 1), with the fake engine."""
        from trl.generation.vllm_generation import extract_logprobs

        params = {"n": 1, "repetition_penalty": 1.0, "temperature": self.temperature, "top_p": self.top_p,
                  "top_k": self.top_k, "min_p": 0.0 if self.min_p is None else self.min_p,
                  "max_tokens": self.trainer.max_completion_length, "logprobs": 0}
        params.update(self.generation_kwargs)
        vllm_prompts = [{"prompt_token_ids": ids} for ids in prompts]
        all_outputs = self.llm.generate(vllm_prompts, sampling_params=types.SimpleNamespace(**params), use_tqdm=False)
        prompt_ids = [output.prompt_token_ids for output in all_outputs]
        completion_ids = [output.token_ids for outputs in all_outputs for output in outputs.outputs]
        logprobs, logprob_token_ids = extract_logprobs(all_outputs)
        self.calls += 1
        return prompt_ids, completion_ids, logprobs, logprob_token_ids


def use_fake_vllm(trainer, engine: dict | None = None, **sampling) -> FakeVLLMGeneration:
    """Switch a (plain, not yet plugged) GRPOTrainer to TRL's vLLM path with the fake engine. ``engine``: build the
    fake ``LLM`` as TRL's ``_init_vllm`` does (``trl.generation.vllm_generation.LLM(...,
    logprobs_mode="processed_logprobs")``, so a ``vllm_colocate_engine`` context around this call applies), with
    these extra keyword arguments, its ``llm_engine`` exposed; ``None``: an engine the plugin cannot read."""
    llm = None
    if engine is not None:
        from trl.generation import vllm_generation

        llm = vllm_generation.LLM(model=trainer.model.name_or_path, tensor_parallel_size=1,
                                  logprobs_mode="processed_logprobs", **engine)
    fake = FakeVLLMGeneration(trainer, temperature=trainer.temperature, llm=llm, **sampling)
    trainer.use_vllm = True
    trainer.vllm_mode = "colocate"
    trainer.vllm_generation = fake
    trainer._last_loaded_step = -1
    return fake


def install_fake_vllm_modules(monkeypatch, version: str, *modules) -> None:
    """Put ``modules`` (``types.ModuleType`` stand-ins named by their dotted vLLM paths) into ``sys.modules`` for
    the test, with every parent package created (each child set as its parent's attribute) and ``vllm.__version__``
    = ``version`` (vLLM is not installed on CPU, so the plugin reads the release from there)."""
    import sys
    import types

    for module in modules:
        parts = module.__name__.split(".")
        for depth in range(1, len(parts)):
            name = ".".join(parts[:depth])
            if not isinstance(sys.modules.get(name), types.ModuleType) or name not in _installed(monkeypatch):
                monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
                _installed(monkeypatch).add(name)
        monkeypatch.setitem(sys.modules, module.__name__, module)
        _installed(monkeypatch).add(module.__name__)
        for depth in range(1, len(parts)):
            parent, child = ".".join(parts[:depth]), ".".join(parts[: depth + 1])
            setattr(sys.modules[parent], parts[depth], sys.modules[child])
    sys.modules["vllm"].__version__ = version


def _installed(monkeypatch) -> set:
    """The module names this test's stand-ins created (kept on the monkeypatch fixture, which lives one test)."""
    if not hasattr(monkeypatch, "_bloggap_fake_vllm"):
        monkeypatch._bloggap_fake_vllm = set()
    return monkeypatch._bloggap_fake_vllm


class TeacherForcedLLM:
    """vLLM's ``LLM`` built from a model folder, as the doctor's sampler column builds it (its keyword arguments kept
    in ``built``): it loads ``model`` in fp32, samples each prompt at the request's temperature (forced length,
    untruncated) and returns, per sampled token, its log-prob from a teacher-forced batch-1 pass of that fp32 model
    (:func:`bloggap_plugin.core.probe.score_layout`, the doctor's own batch-1 scoring), so the doctor's fp32 scoring
    of these samples is the same computation: bit for bit equal on every token, by construction. ``sampled`` keeps
    each call's rows."""

    built: list[dict] = []
    sampled: list = []

    def __init__(self, **kwargs):
        from bloggap_plugin.models import load_model

        TeacherForcedLLM.built.append(kwargs)
        self.seed = kwargs["seed"]
        self.model, self.tokenizer = load_model(kwargs["model"], dtype="fp32")
        self.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=torch.float32))

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        from bloggap_plugin.core.probe import Row, score_layout

        params = sampling_params
        assert params.logprobs == 0 and params.n == 1 and params.ignore_eos is True
        rows = []
        generator = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():
            for prompt in prompts:
                ids = list(prompt["prompt_token_ids"])
                for _ in range(params.max_tokens):
                    logits = self.model(input_ids=torch.tensor([ids])).logits[0, -1].float() / params.temperature
                    ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)))
                width = len(prompt["prompt_token_ids"])
                rows.append(Row(tuple(ids[:width]), tuple(ids[width:])))
            scored = score_layout(self.model, rows, "left", 1, "mask", self.tokenizer.pad_token_id)
        TeacherForcedLLM.sampled.append(rows)
        outputs = []
        for index, row in enumerate(rows):
            logprobs = [{token: Logprob(float(scored.logprobs[index, position]), rank=1)}
                        for position, token in enumerate(row.completion)]
            completion = types.SimpleNamespace(index=0, token_ids=list(row.completion), logprobs=logprobs)
            outputs.append(types.SimpleNamespace(prompt_token_ids=list(row.prompt), outputs=[completion]))
        return outputs
