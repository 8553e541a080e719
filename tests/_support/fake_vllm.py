"""A CPU stand-in for TRL 1.16's ``VLLMGeneration`` (colocate), so the plugin's vLLM path runs in tests.

It samples with HF ``generate`` and :class:`~bloggap_plugin.sampling.SamplerRecorder` in vLLM's truncation order
(temperature, min_p, top_k, top_p) and returns what TRL's ``vllm_generation.generate`` returns with ``logprobs=0``:
per completion token ids (up to and including EOS) and, per token, ``[processed log-prob of the sampled token]``.
The engine's kernels are the trainer's own here, so on CPU the only sampler-vs-trainer difference is truncation.
"""

from __future__ import annotations

import torch

from bloggap_plugin.core.probe import left_pad
from bloggap_plugin.sampling import SamplerRecorder


class FakeVLLMGeneration:
    def __init__(self, trainer, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float | None = None):
        self.trainer = trainer
        self.temperature, self.top_p, self.top_k, self.min_p = temperature, top_p, top_k, min_p
        self.generation_kwargs: dict = {}
        self.mode = "colocate"
        self.calls = 0

    def sync_weights(self) -> None:
        pass

    def generate(self, prompts, images=None, num_generations=1, profiler=None):
        trainer = self.trainer
        model = trainer.accelerator.unwrap_model(trainer.model)
        tokenizer = trainer.processing_class
        pad = tokenizer.pad_token_id
        eos = tokenizer.eos_token_id
        ids, mask = left_pad(prompts, pad)
        width = ids.shape[1]
        top_k = int(self.top_k or 0)
        top_p = float(self.top_p if self.top_p is not None else 1.0)
        min_p = float(self.min_p or 0.0)
        recorder = SamplerRecorder(temperature=self.temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                   truncate=top_k > 0 or top_p < 1.0 or min_p > 0.0, order="vllm")
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()  # an inference engine runs no dropout
        with torch.no_grad():
            sequences = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                                       max_new_tokens=trainer.max_completion_length, logits_processor=[recorder],
                                       pad_token_id=pad, eos_token_id=eos, **recorder.neutral_generation_kwargs())
        model.train(was_training)
        record = recorder.finalize(sequences, width)
        completions, logprobs = [], []
        for row in range(len(prompts)):
            tokens = sequences[row, width:].tolist()
            if eos in tokens:
                tokens = tokens[: tokens.index(eos) + 1]
            completions.append(tokens)
            logprobs.append([[float(v)] for v in record.processed_logps[row, : len(tokens)].tolist()])
        self.calls += 1
        self.last_record = record
        return prompts, completions, logprobs, None


def use_fake_vllm(trainer, **sampling) -> FakeVLLMGeneration:
    """Switch a (plain, not yet plugged) GRPOTrainer to TRL's vLLM path with the fake engine."""
    fake = FakeVLLMGeneration(trainer, temperature=trainer.temperature, **sampling)
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
