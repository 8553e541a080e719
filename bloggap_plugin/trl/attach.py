"""Attaching the plugin to a GRPOTrainer: every check of ``gap`` against the trainer, then a fresh :class:`GapState`.

Errors are :class:`~bloggap_plugin.recipes.RecipeError` naming the setting and the fix; they are raised before
anything is installed. ``_STACK`` is the number of frames between these helpers and the user's call (the
trainer's ``__init__`` or :class:`~bloggap_plugin.trl.GapCallback`), so warnings point at the user's line.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from bloggap_plugin.core import metrics as gap_metrics
from bloggap_plugin.core.vllm import kernels as vllm_kernels
from bloggap_plugin.recipes import GapConfig, RecipeError, config_differences
from bloggap_plugin.trl.colocate_reads import vllm_sampling
from bloggap_plugin.trl.kept_source import resolve_kept_source
from bloggap_plugin.trl.state import AttachSettings, GapState, Resources

__all__ = ["attach_state", "check_vllm_fp16", "vllm_sampling", "KNOWN_LOSS_TYPES"]

# TRL 1.16's loss types (grpo_trainer._compute_loss): the plugin's metrics are defined for exactly these
KNOWN_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
_STACK = 5  # warn() in a helper here <- attach_state <- GapMixin._gap_attach <- trainer __init__/install <- user


def attach_state(trainer: Any, gap: GapConfig, grpo_kwargs: dict | None, source: str) -> GapState:
    """Validate ``gap`` against ``trainer`` (a GRPOTrainer with GapMixin's hooks) and return its state."""
    from trl import GRPOTrainer

    from bloggap_plugin.trl.compat import check_trl

    if not isinstance(gap, GapConfig):
        raise TypeError(f"gap must be a GapConfig, got {type(gap).__name__}")
    trl_version = check_trl(GRPOTrainer, strict=gap.strict_version)
    _warn_recipe_differences(trainer, grpo_kwargs, source)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    num_layers = getattr(getattr(policy, "config", None), "num_hidden_layers", None)
    if num_layers is not None:
        gap.check_layers(int(num_layers))
    _check_precision(trainer, gap)
    _check_zero3(trainer, gap)
    _check_vllm(trainer, gap)
    _check_vllm_form_model(gap, policy)
    _check_onpolicy(trainer, gap, policy)
    settings = _sampler_settings(trainer, gap, policy)
    clip_applies = _check_loss(trainer, gap)
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int(trainer.args.seed) + 7919 * trainer.accelerator.process_index)
    truncation, recorder = _truncation(trainer, gap, settings)
    # Arms that keep TRL's forward score with positions 0..L-1; the others use gap.positions everywhere.
    positions = "arange" if gap.arm_spec.keeps_trl_forward else gap.positions
    fixed = AttachSettings(config=gap, trl_version=trl_version, clip_applies=clip_applies,
                           sampler_on=settings is not None, positions=positions, **truncation)
    return GapState(settings=fixed, resources=Resources(generator=generator, recorder=recorder))


def _warn_recipe_differences(trainer: Any, grpo_kwargs: dict | None, source: str) -> None:
    diffs = config_differences(grpo_kwargs, trainer.args) if grpo_kwargs else {}
    if diffs:
        listed = ", ".join(f"{k}: recipe {r!r} vs trainer {t!r}" for k, (r, t) in sorted(diffs.items()))
        warnings.warn(
            f"{source}: attached to an existing trainer, only the gap: section applies; these GRPOConfig "
            f"fields differ and are NOT applied: {listed}",
            stacklevel=_STACK,
        )


def _zero3_enabled(trainer: Any) -> bool:
    """Whether ``trainer`` runs under DeepSpeed ZeRO-3 (accelerate's plugin, or transformers' global config)."""
    state = getattr(getattr(trainer, "accelerator", None), "state", None)
    plugin = getattr(state, "deepspeed_plugin", None)
    if plugin is not None and getattr(plugin, "zero_stage", None) == 3:
        return True
    from transformers.integrations import deepspeed as hf_deepspeed

    return bool(hf_deepspeed.is_deepspeed_zero3_enabled())


def _check_zero3(trainer: Any, gap: GapConfig) -> None:
    """Under ZeRO-3 every parameter is a slice on each process, gathered only inside its module's forward: no
    copy of the weights can be built or synced from it (the shadows, fp32 islands and the probe's fp32 reference)."""
    if not _zero3_enabled(trainer):
        return
    arm, needs = gap.arm_spec, []
    if arm.copies_weights:
        needs.append(f"arm {arm.letter} ({arm.description}) copies the policy's weights")
    if gap.probe_rows > 0:
        needs.append(f"gap.probe_rows: {gap.probe_rows} scores probe rows with an fp32 copy of the policy (set "
                     "gap.probe_rows: 0)")
    if needs:
        raise RecipeError(
            f"DeepSpeed ZeRO-3 partitions every parameter (each process holds a slice, gathered only inside its "
            f"module's forward), so no copy of the policy can be built from it: {'; '.join(needs)}. Use FSDP2 "
            "(accelerate fsdp_version: 2; bloggap shards its copies like the policy), ZeRO stage 1 or 2, or under "
            "ZeRO-3 an arm that copies no weights (A, C, G, H) with gap.probe_rows: 0 (docs/trl.md)"
        )


def arm_not_in_effect(trainer: Any, gap: GapConfig) -> str | None:
    """Why ``gap``'s arm does not take effect in ``trainer`` (arm H where accelerate runs no fp16 autocast, e.g. on
    a CPU), or ``None``: what a run's summary and a comparison's table state beside its numbers."""
    arm = gap.arm_spec
    if arm.needs_fp16_training and not getattr(trainer.accelerator, "native_amp", True):
        return (f"arm {arm.letter}: accelerate runs without fp16 autocast on this device (e.g. CPU), so rollout, old "
                f"log-probs and training stay in the model's dtype; arm {arm.letter} takes effect on CUDA")
    return None


def _check_precision(trainer: Any, gap: GapConfig) -> None:
    """The arm's precision against the trainer's: fp16 training where the arm needs it, a warning where it
    scores above the fp16 it trains in."""
    arm, args = gap.arm_spec, trainer.args
    if arm.needs_fp16_training and not args.fp16:
        raise RecipeError(f"gap.arm {arm.letter} (fp16 everywhere) needs fp16: true in the GRPOConfig (see "
                          f"recipes/arm_{arm.letter}.yaml)")
    not_in_effect = arm_not_in_effect(trainer, gap)
    if not_in_effect:
        warnings.warn(not_in_effect, stacklevel=_STACK)
    if args.fp16 and arm.scores_above_fp16:
        warnings.warn(f"arm {arm.letter} scores old log-probs above fp16 while training runs in fp16",
                      stacklevel=_STACK)


def _check_vllm(trainer: Any, gap: GapConfig) -> None:
    from bloggap_plugin.trl.vllm_colocate import refuse_matmul_tiles_without_colocate

    refuse_matmul_tiles_without_colocate(gap, trainer.use_vllm, getattr(trainer.args, "vllm_mode", None))
    if not trainer.use_vllm:
        return
    if gap.arm_spec.needs_fp16_training:
        check_vllm_fp16(trainer)
    if getattr(trainer.args, "vllm_mode", None) == "colocate":
        from bloggap_plugin.trl.vllm_colocate import check_colocate_engine, check_engine_vllm

        check_engine_vllm(trainer, gap)
        check_colocate_engine(trainer, gap)
    if gap.kept == "renormalize" and trainer.args.beta != 0.0:
        raise RecipeError(
            "gap.kept: renormalize with beta > 0 is not supported on TRL's vLLM path: TRL scores the reference "
            "model before the plugin re-derives the kept sets, so the KL term would compare a renormalised "
            "policy with a full-vocabulary reference; use beta: 0, gap.kept: measure, or HF generate"
        )
    if gap.is_correction:
        raise RecipeError(
            "gap.is_correction is the HF-path correction; with vLLM use TRL's own "
            "vllm_importance_sampling_correction"
        )
    if (getattr(trainer.args, "vllm_mode", None) == "colocate" and vllm_kernels.vllm_batch_invariant_active()
            and os.environ.get("TRITON_F32_DEFAULT", "").lower() != "ieee"):
        warnings.warn(
            "vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1) is on in the trainer's process (vllm_mode="
            "'colocate'): it replaces torch's bmm process-wide with a Triton kernel whose fp32 dots use TF32, and "
            "transformers computes its RoPE angles (inv_freq @ positions, fp32) with bmm, so every trainer forward, "
            "TRL's own included, rotates with wrong angles (0.226 rad off below position 1024 on the H200: "
            "benchmarks/results/h200/arm_i.json); set TRITON_F32_DEFAULT=ieee before vLLM starts (measured there to "
            "bring the angles back to fp32's), or run vLLM in server mode (vllm_mode='server') or without "
            "VLLM_BATCH_INVARIANT",
            stacklevel=_STACK,
        )


def _check_vllm_form_model(gap: GapConfig, policy: Any) -> None:
    """Arms whose plan computes the forward in vLLM's form (I, J) refuse a model family they do not compute, at
    attach (before any generation), naming what the model has that they lack."""
    if not gap.takes_pieces:
        return
    from bloggap_plugin.core.plans.vllm_shadow import check_vllm_form_supported

    try:
        check_vllm_form_supported(policy)
    except ValueError as err:
        raise RecipeError(f"arm {gap.arm_spec.letter}: {err}") from None


def _check_onpolicy(trainer: Any, gap: GapConfig, policy: Any) -> None:
    """What an arm whose training forward is its vLLM-form forward over the policy's parameters (arm J) cannot train
    with, each refusal naming the fix."""
    arm = gap.arm_spec
    if not arm.onpolicy_forward:
        return
    args, config = trainer.args, getattr(policy, "config", None)
    problems = []
    if getattr(policy, "peft_config", None) is not None:
        problems.append("a PEFT model (the forward reads the base weights, not the adapters): train the full model")
    if args.gradient_checkpointing or getattr(policy, "is_gradient_checkpointing", False):
        problems.append("gradient checkpointing (the forward keeps its activations): set gradient_checkpointing: "
                        "false")
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        problems.append("DeepSpeed or FSDP (the forward reads whole parameters outside the wrapper's gathering): "
                        "train on one process without them")
    elif trainer.accelerator.num_processes > 1:
        problems.append(f"{trainer.accelerator.num_processes} processes (the forward runs outside the "
                        "DistributedDataParallel wrapper, which would not all-reduce its gradients): train on one "
                        "process")
    if gap.kept == "renormalize":
        problems.append("gap.kept: renormalize (the forward scores the full vocabulary, as vLLM's sampler does): "
                        "use gap.kept: measure or off")
    if args.beta != 0.0:
        problems.append(f"beta {args.beta} (the reference model would be scored by TRL's forward, not in vLLM's "
                        "numbers, so KL would not be 0 at the reference): set beta: 0")
    if getattr(trainer, "aux_loss_enabled", False):
        problems.append("the MoE aux loss (router_aux_loss_coef != 0): set router_aux_loss_coef: 0.0")
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        problems.append("attention dropout (the forward has none): set the model's attention_dropout to 0")
    if problems:
        raise RecipeError(f"arm {arm.letter} ({arm.description}) computes the policy's training forward in "
                          f"vLLM's form and does not support {'; '.join(problems)}")


def _sampler_settings(trainer: Any, gap: GapConfig, policy: Any) -> dict | None:
    """The sampler recorder's settings (what HF ``generate`` really samples with), or ``None`` when it is off."""
    if not gap.sampler or trainer.use_vllm:
        return None
    from bloggap_plugin.sampling import (
        effective_generation_config,
        sampler_settings,
        unsupported_generation_mode,
    )

    off_reason = None
    settings = None
    if getattr(trainer, "use_transformers_continuous_batching", False) or getattr(trainer, "tools", None):
        off_reason = "it supports plain HF generate without tools or continuous batching only"
    else:
        # what generate really runs with: TRL's config, None fields filled from the model's generation_config
        effective = effective_generation_config(policy, getattr(trainer, "generation_config", None))
        mode = unsupported_generation_mode(effective)
        if mode is not None:
            off_reason = f"it records plain multinomial sampling only, not {mode}"
        else:
            try:
                settings = sampler_settings(effective)
            except ValueError as err:
                raise RecipeError(
                    f"{err}; turn them off in GRPOConfig.generation_kwargs (typical_p: 1.0, epsilon_cutoff: "
                    "0.0, eta_cutoff: 0.0) or in the model's generation_config (top_h: None, "
                    "watermarking_config: None), or set gap.sampler: false"
                ) from None
    if off_reason is not None:
        if gap.kept == "renormalize" or gap.is_correction:
            raise RecipeError(f"gap.kept: renormalize / gap.is_correction need the sampler recording, and {off_reason}")
        warnings.warn(f"sampler recording is off ({off_reason}): no gap/sampler or gap/kept metrics; "
                      "training is unchanged", stacklevel=_STACK)
    return settings


def _check_loss(trainer: Any, gap: GapConfig) -> bool:
    """Refuse loss settings the metrics are undefined for; return whether TRL's loss clips the importance weight."""
    args = trainer.args
    loss_type = getattr(trainer, "loss_type", args.loss_type)
    if loss_type not in KNOWN_LOSS_TYPES:
        raise RecipeError(
            f"loss_type {loss_type!r} is not one bloggap supports (TRL 1.16: {', '.join(KNOWN_LOSS_TYPES)}); "
            "its ratio and clip metrics would be undefined"
        )
    level = getattr(trainer, "importance_sampling_level", args.importance_sampling_level)
    if level not in ("token", "sequence"):
        raise RecipeError(f"importance_sampling_level {level!r} is not supported; use 'token' or 'sequence'")
    if gap.kept == "renormalize" and getattr(trainer, "_is_vlm", False):
        raise RecipeError(
            "gap.kept: renormalize supports text-only models (its non-fused scoring passes no image inputs); "
            "use gap.kept: measure with a vision-language model"
        )
    if gap.kept == "renormalize" and getattr(trainer, "aux_loss_enabled", False):
        raise RecipeError(
            "gap.kept: renormalize does not support the MoE aux loss (router_aux_loss_coef != 0); set "
            "router_aux_loss_coef: 0.0 or use gap.kept: measure"
        )
    if gap.is_correction and loss_type == "vespo":
        raise RecipeError("gap.is_correction does not apply to loss_type vespo (TRL feeds IS ratios into its gamma weights)")
    clip_applies = loss_type in gap_metrics.CLIP_RULE_LOSSES
    if not clip_applies:
        warnings.warn(
            f"gap/clip/* and gap/update_clip/* (clipped_frac, flip_frac) are not logged with loss_type {loss_type!r}: it "
            "does not clip the importance weight (sapo: soft gate; vespo: gamma weights)",
            stacklevel=_STACK,
        )
    return clip_applies


def _truncation(trainer: Any, gap: GapConfig, settings: dict | None) -> tuple[dict, Any]:
    """``(AttachSettings fields, sampler recorder or None)``: the sampler recorder (HF path) or vLLM's truncation, and
    the kept-set modes that follow from them."""
    from bloggap_plugin.vllm_kept_sets import needs_kept_set

    recorder, vllm_truncation, truncating = None, None, False
    if settings is not None:
        from bloggap_plugin.sampling import SamplerRecorder

        truncating = needs_kept_set(top_k=settings["top_k"], top_p=settings["top_p"], min_p=settings["min_p"])
        recorder = SamplerRecorder(**settings, truncate=truncating, order="hf",
                                   store_ids_max=gap.store_ids_max if gap.kept != "off" else 0)
    if trainer.use_vllm:
        # what TRL sends to vLLM: VLLMGeneration's settings, generation_kwargs last
        vllm_truncation = vllm_sampling(trainer)
        truncating = needs_kept_set(**vllm_truncation)
    if gap.kept == "renormalize" and not truncating:
        warnings.warn("gap.kept: renormalize with untruncated sampling (top_p 1, top_k 0, min_p 0) changes nothing",
                      stacklevel=_STACK)
    # gap.kept: off records no kept sets and runs no kept-mass scoring (the recorder still truncates: it samples)
    kept_on = gap.kept != "off" and truncating
    kept_source, no_mask = resolve_kept_source(trainer, gap, kept_on)
    if no_mask is not None and kept_on:
        warnings.warn(f"gap.kept_source: auto re-truncates the trainer's logits (approximate at the boundary) "
                      f"instead of using vLLM's sampling mask: {no_mask}", stacklevel=_STACK)
    fields = {"truncating": truncating, "vllm_truncation": vllm_truncation,
              "renormalize": gap.kept == "renormalize" and truncating, "kept_on": kept_on, "kept_source": kept_source}
    return fields, recorder


def check_vllm_fp16(trainer: Any) -> None:
    """Arm H samples in fp16: refuse a colocate engine built in another dtype; warn where it cannot be read."""
    from bloggap_plugin.trl.vllm_colocate import colocate_engine_dtype

    if getattr(trainer, "vllm_mode", None) == "server":
        warnings.warn(
            "arm H with vLLM server mode: start the server in fp16 (`trl vllm-serve --dtype float16`); the trainer "
            "cannot check the server's dtype (server mode is untested live)",
            stacklevel=6,
        )
        return
    dtype = colocate_engine_dtype(trainer)
    if dtype is None:
        warnings.warn("arm H: could not read the vLLM engine's dtype; make sure it samples in fp16", stacklevel=6)
    elif dtype != torch.float16:
        raise RecipeError(
            f"arm H (fp16 everywhere) needs vLLM to sample in fp16, but TRL built the colocate engine in {dtype}: "
            "use GapGRPOTrainer(..., gap=arm H), which builds it in fp16, or construct the GRPOTrainer inside "
            "`with bloggap_plugin.trl.vllm_colocate_dtype('float16'):` before adding GapCallback"
        )
