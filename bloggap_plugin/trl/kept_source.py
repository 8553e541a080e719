"""Where TRL's vLLM path takes its kept sets from (``gap.kept_source``): vLLM's own sampling mask, or re-truncation.

vLLM >= 0.28 returns, per generated token, the ids its sampler drew from (``LLM(return_sampling_mask=True)``,
vllm/entrypoints/llm.py; ``CompletionOutput.sampling_mask = SamplingMask(token_ids=list[list[int]])``, one row per
generated token, set once the request finished: vllm/outputs.py, vllm/v1/engine/output_processor.py). vLLM refuses
the setting without model runner V2, with speculative decoding, custom logits processors or another
``logprobs_mode`` than ``processed_logprobs`` (``_verify_sampling_replay_config``, vllm/config/vllm.py), and refuses
each request with ``temperature <= 0`` or ``top_k <= 0`` (vllm/v1/engine/input_processor.py). Read from vLLM 0.31's
source; not run live yet.

:func:`sampling_mask_problem` names the first missing condition and its fix; :func:`planned_sampling_mask` decides
before TRL builds the engine (from the GRPOConfig) whether to ask it for the mask; :func:`resolve_kept_source`
decides at attach from the engine as built; :func:`capture_sampling_masks` keeps each ``llm.generate`` call's masks
(parsed by :func:`bloggap_plugin.vllm_kept_sets.kept_sets_from_request_outputs`) for the generation's batch;
:func:`mask_kept_tensors` aligns them to TRL's completion rows.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from bloggap_plugin.recipes import GapConfig, RecipeError

__all__ = ["sampling_mask_problem", "planned_sampling_mask", "resolve_kept_source", "capture_sampling_masks",
           "mask_kept_tensors", "KEPT_SOURCE_CODES"]

KEPT_SOURCE_CODES = {"recorder": 1.0, "sampling_mask": 1.0, "retruncate": 2.0}
"""``gap/kept/source``: 1 the sampler's own kept sets (HF generate's recorder, vLLM's sampling mask), 2 re-truncated
from the trainer's logits (verl's ``gap/verl/kept_source`` uses 2 for re-truncation too)."""

_RETRUNCATE = "or set gap.kept_source: retruncate"


def sampling_mask_problem(*, vllm_mode: str | None, tensor_parallel_size: int, version: str | None,
                          temperature: float, top_k: int, tools: bool = False, runner: str | None = None,
                          engine_built: bool = True, engine_flag: bool | None = None,
                          engine_refusal: str | None = None) -> str | None:
    """The first condition that keeps vLLM's sampling mask from TRL's vLLM path, with its fix, or ``None``.
    ``runner`` (``"v1"``/``"v2"``, ``None``: not known) and, where ``engine_built``, ``engine_flag`` (the engine's
    ``return_sampling_mask``, ``None``: not readable) and ``engine_refusal`` (vLLM's error when the plugin asked
    for the mask under ``auto``) describe the engine."""
    from bloggap_plugin.core.vllm.versions import SAMPLING_MASK_RELEASE, has_sampling_mask
    from bloggap_plugin.vllm_kept_sets import DEFAULT_TOP_K_CAP

    if vllm_mode != "colocate":
        return (f"vllm_mode is {vllm_mode!r}: TRL's vllm_client returns no sampling mask; use vllm_mode: colocate "
                f"{_RETRUNCATE}")
    if tensor_parallel_size != 1:
        return (f"vllm_tensor_parallel_size is {tensor_parallel_size}: the mask is mapped to batch rows at "
                f"tensor_parallel_size 1 only; set vllm_tensor_parallel_size: 1 {_RETRUNCATE}")
    if not has_sampling_mask(version):
        have = "vLLM is not installed" if version is None else f"vLLM {version} has no return_sampling_mask"
        return f"{have} (vLLM >= {SAMPLING_MASK_RELEASE}); install vllm>={SAMPLING_MASK_RELEASE} {_RETRUNCATE}"
    if not temperature > 0:
        return (f"temperature is {temperature}: vLLM refuses sampling-mask requests with temperature <= 0; sample "
                f"with temperature > 0 {_RETRUNCATE}")
    if top_k <= 0:
        return (f"top_k is 0: vLLM returns no sampling mask without top_k > 0; set top_k: {DEFAULT_TOP_K_CAP} (the "
                f"cap becomes part of the sampler) {_RETRUNCATE}")
    if tools:
        return f"the trainer has tools: TRL appends tool output that vLLM did not sample to the completions; {_RETRUNCATE[3:]}"
    if runner == "v1":
        return (f"the colocate engine runs model runner V1 and vLLM's sampling mask needs V2; unset "
                f"VLLM_USE_V2_MODEL_RUNNER=0 {_RETRUNCATE}")
    if engine_built and engine_flag is not True:
        why = (f" (vLLM refused it: {engine_refusal})" if engine_refusal
               else " (its settings cannot be read)" if engine_flag is None else "")
        return (f"TRL's colocate engine was built without return_sampling_mask=True{why}; build the trainer with "
                f"GapGRPOTrainer or inside vllm_colocate_engine(**engine_kwargs_for(gap, args=grpo_config)) "
                f"{_RETRUNCATE}")
    return None


def _v2_runner_env(environ: dict | None = None) -> str | None:
    """``"v1"`` where ``VLLM_USE_V2_MODEL_RUNNER`` turns model runner V2 off, else ``None`` (vLLM decides)."""
    raw = (os.environ if environ is None else environ).get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower()
    return "v1" if raw in ("0", "false") else None


def planned_sampling_mask(gap: GapConfig, args: Any, environ: dict | None = None) -> tuple[str | None, str | None]:
    """``(engine mode, reason)`` before TRL builds its colocate engine from ``args`` (a GRPOConfig): ``"required"``
    (``gap.kept_source: sampling_mask``) or ``"auto"`` to ask the engine for the mask, ``None`` not to; ``reason``
    names what is missing (:func:`sampling_mask_problem`) where the mask was asked for and cannot be had. Raises
    ``RecipeError`` for ``gap.kept_source: sampling_mask`` where it cannot, before the engine loads."""
    from bloggap_plugin.core.vllm.versions import installed_vllm
    from bloggap_plugin.trl.colocate_reads import trl_sampling_args
    from bloggap_plugin.vllm_kept_sets import needs_kept_set

    if args is None or not getattr(args, "use_vllm", False) or gap.kept == "off" or gap.kept_source == "retruncate":
        return None, None
    sampling = trl_sampling_args(args)
    truncating = needs_kept_set(top_k=int(sampling.get("top_k") or 0), top_p=float(sampling.get("top_p", 1.0)),
                                min_p=float(sampling.get("min_p") or 0.0))
    if not truncating and gap.kept_source == "auto":
        return None, None
    problem = sampling_mask_problem(
        vllm_mode=getattr(args, "vllm_mode", None), tensor_parallel_size=int(getattr(args, "vllm_tensor_parallel_size", 1) or 1),
        version=installed_vllm(), temperature=float(sampling.get("temperature", 1.0)),
        top_k=int(sampling.get("top_k") or 0), runner=_v2_runner_env(environ), engine_built=False)
    if problem is not None and gap.kept_source == "sampling_mask":
        raise RecipeError(f"gap.kept_source: sampling_mask: {problem}")
    if problem is not None:
        return None, problem
    return ("required" if gap.kept_source == "sampling_mask" else "auto"), None


def resolve_kept_source(trainer: Any, gap: GapConfig, kept_on: bool) -> tuple[str | None, str | None]:
    """``(source, why not the mask)`` at attach: ``"recorder"`` (HF generate), ``"sampling_mask"`` or
    ``"retruncate"`` (TRL's vLLM path), ``None`` without kept sets. Raises ``RecipeError`` for
    ``gap.kept_source: sampling_mask`` where the mask cannot be had, and for a non-``auto`` source on the HF path."""
    from bloggap_plugin.core.vllm.versions import installed_vllm
    from bloggap_plugin.trl.colocate_reads import colocate_engine_setting, colocate_model_runner

    if not trainer.use_vllm:
        if gap.kept_source != "auto":
            raise RecipeError(f"gap.kept_source: {gap.kept_source} applies to TRL's vLLM path; HF generate's kept "
                              "sets are the sampler recorder's own (exact): drop it or set gap.kept_source: auto")
        return ("recorder" if kept_on else None), None
    if gap.kept_source == "retruncate":
        return ("retruncate" if kept_on else None), None
    if not kept_on and (gap.kept == "off" or gap.kept_source == "auto"):
        return None, None
    from bloggap_plugin.trl.colocate_reads import vllm_sampling

    generation = getattr(trainer, "vllm_generation", None)
    llm = getattr(generation, "llm", None)
    # what TRL's VLLMGeneration sends (its settings, generation_kwargs last)
    temperature = (getattr(generation, "generation_kwargs", None) or {}).get(
        "temperature", getattr(generation, "temperature", trainer.temperature))
    problem = sampling_mask_problem(
        vllm_mode=getattr(trainer.args, "vllm_mode", None),
        tensor_parallel_size=int(getattr(generation, "tensor_parallel_size", 1) or 1), version=installed_vllm(),
        temperature=float(temperature), top_k=vllm_sampling(trainer)["top_k"],
        tools=bool(getattr(trainer, "tools", None)), runner=colocate_model_runner(trainer),
        engine_flag=colocate_engine_setting(trainer, "return_sampling_mask"),
        engine_refusal=getattr(llm, "_bloggap_sampling_mask_refused", None))
    if problem is None and gap.kept != "off" and not kept_on:
        problem = "sampling is untruncated (top_k 0, top_p 1, min_p 0): there is no kept set"
    if problem is not None:
        if gap.kept_source == "sampling_mask":
            raise RecipeError(f"gap.kept_source: sampling_mask: {problem}")
        return ("retruncate" if kept_on else None), problem
    return ("sampling_mask" if kept_on else None), None


def capture_sampling_masks(trainer: Any, state: Any) -> None:
    """Wrap the colocate engine's ``llm.generate`` so that each call's kept sets (its completions' sampling masks,
    TRL's flattening order) are appended to ``state.generation.sampling_masks`` while that is a list (a training
    generation not yet aligned); evaluation generations and later calls are passed through untouched."""
    from bloggap_plugin.vllm_kept_sets import kept_sets_from_request_outputs

    llm = trainer.vllm_generation.llm
    generate = llm.generate

    def generate_with_masks(*args: Any, **kwargs: Any):
        outputs = generate(*args, **kwargs)
        pending = state.generation.sampling_masks
        if pending is not None:
            pending.append(kept_sets_from_request_outputs(outputs))
        return outputs

    generate_with_masks.__wrapped__ = generate  # type: ignore[attr-defined]
    llm.generate = generate_with_masks


def mask_kept_tensors(captured: list, completion_ids: torch.Tensor, mask: torch.Tensor,
                      store_ids_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kept ids [B, K, S] int64 with -1 padding, sizes [B, K] int32)`` of one generation's captured masks
    (``captured``: one :class:`~bloggap_plugin.vllm_kept_sets.KeptSets` per ``llm.generate`` call) on TRL's completion
    rows ``completion_ids`` ``[B, K]`` (``mask`` ``[B, K]``: TRL's completion mask). Each completion's generated
    tokens must be its row's leading tokens (else ``RuntimeError``: misaligned). Sets larger than ``store_ids_max``
    keep their size only (the trainer's top-``|S|``, as on the HF path)."""
    if len(captured) != 1:
        raise RuntimeError(f"bloggap: expected one vLLM generate call per generation with the sampling mask, got "
                           f"{len(captured)}")
    kept = captured[0]
    n_rows, width = completion_ids.shape
    if len(kept.sizes) != n_rows:
        raise RuntimeError(f"bloggap: vLLM returned {len(kept.sizes)} completions with sampling masks for {n_rows} "
                           "batch rows (alignment bug)")
    host = completion_ids.cpu()
    for row, tokens in enumerate(kept.token_ids):
        if len(tokens) > width or host[row, : len(tokens)].tolist() != list(tokens):
            raise RuntimeError(f"bloggap: completion {row}'s tokens differ from those vLLM's sampling mask is aligned "
                               "with (alignment bug)")
    device = completion_ids.device
    ids = kept.ids_tensor(width, max_ids=store_ids_max, device=device).masked_fill(~mask.bool().unsqueeze(-1), -1)
    sizes = kept.sizes_tensor(width, device=device) * mask.int()
    return ids, sizes
