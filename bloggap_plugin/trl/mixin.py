"""GapMixin: the one implementation of the plugin inside TRL's GRPOTrainer (1.16.x, fused-LM-head path).

Hooks (see ``shared/reference/trl_notes.md``):

- ``_generate_single_turn``: HF ``generate`` runs with :class:`~bloggap_plugin.sampling.SamplerRecorder` as the
  last logits processor (TRL's temperature/top_p/top_k/min_p handed to it), which records the sampler's
  log-prob and kept set of every emitted token;
- ``_generate_and_score_completions``: after TRL, adds the sampler record, probe rows, the fp32 batch-1
  reference of those rows, and the arm's old log-probs (replacing TRL's where TRL computes them, or with
  ``gap.force_old_logprobs``) to the batch under ``gap_*`` keys that TRL's shuffle/split carry along and its
  loss never reads;
- ``_prepare_inputs``: arm G scores every buffered micro-batch after TRL's shuffle, in place of TRL's own
  old-logprob pass (skipped: a NaN placeholder stands in until G's scores are installed; on the vLLM path the IS
  ratio is recomputed per micro-batch and TRL's ``sampling/*`` statistics from G's scores); generation-time
  metrics are reduced and logged;
- ``_get_per_token_logps_and_entropies``: position ids from the mask (``gap.positions: mask``, arms B-G),
  kept-set renormalisation (``gap.kept: renormalize``, a non-fused forward), and a stash of the training
  forward's log-probs;
- ``_compute_loss``: HF-path IS correction (``gap.is_correction``) and the loss-time metrics;
- ``training_step``: plugin time and its share of the step.

Every extra forward runs under ``torch.no_grad`` inside ``torch.random.fork_rng`` and probe rows come from a
private generator, so with arm A the trainer's RNG streams and losses are exactly those of plain TRL.
"""

from __future__ import annotations

import logging
import math
import time
import types
import warnings

import torch

from bloggap_plugin.core import metrics as gap_metrics
from bloggap_plugin.core.scoring import gather_logprobs, join_tiles, position_ids_from_mask, token_logprobs
from bloggap_plugin.recipes import GapConfig, RecipeError, config_differences

logger = logging.getLogger(__name__)

__all__ = ["GapMixin", "HOOKED_METHODS", "BATCH_KEYS"]

HOOKED_METHODS = (
    "_generate_single_turn",
    "_generate_and_score_completions",
    "_prepare_inputs",
    "_get_per_token_logps_and_entropies",
    "_compute_loss",
    "training_step",
)
# Keys the plugin adds to TRL's batch dict (permuted and split with it; TRL's loss never reads them).
BATCH_KEYS = (
    "gap_old_logps",
    "gap_trl_old_logps",
    "gap_sampler_logps",
    "gap_sampler_full_logps",
    "gap_kept_sizes",
    "gap_kept_ids",
    "gap_sampler_log_kept_mass",
    "gap_probe_row",
    "gap_ref_logps",
    "gap_is_ratio",
)
# TRL 1.16's loss types (grpo_trainer._compute_loss): the plugin's metrics are defined for exactly these
KNOWN_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
_MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def _fork_rng(device: torch.device):
    devices = [device] if device.type == "cuda" else []
    return torch.random.fork_rng(devices=devices)


def is_ratio(old_logps, sampler_logps, mask, mode: str, clip_min, clip_max) -> torch.Tensor:
    """TRL 1.16's importance-sampling ratio (grpo_trainer l.2660-2705): ``[B, T]`` (token_*) or ``[B, 1]``."""
    diff = torch.nan_to_num((old_logps - sampler_logps) * mask, nan=0.0)
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    if mode in ("sequence_mask", "token_mask"):
        low = clip_min if clip_min is not None else -math.inf
        high = clip_max if clip_max is not None else math.inf
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    raise ValueError(f"unknown importance sampling mode {mode!r}")


class _Stats:
    """Per-process sums for one metric group; reduced across processes in a fixed key order."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.maxes: dict[str, float] = {}

    def add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + float(value)

    def max(self, key: str, value: float) -> None:
        self.maxes[key] = max(self.maxes.get(key, -math.inf), float(value))


class GapMixin:
    """Mix into ``GRPOTrainer`` (before it in the MRO) or install on an instance with :class:`GapCallback`."""

    # ------------------------------------------------------------------ plumbing
    def _gap_next(self, name: str, *args, **kwargs):
        """Call the next implementation of ``name``: the instance's original (callback) or the MRO's."""
        originals = self.__dict__.get("_gap_originals")
        if originals and name in originals:
            return originals[name](*args, **kwargs)
        return getattr(super(GapMixin, self), name)(*args, **kwargs)  # noqa: UP008 (explicit: also read in callback mode)

    def _gap_attach(self, gap: GapConfig, grpo_kwargs: dict | None = None, source: str = "gap config") -> None:
        """Validate ``gap`` against this trainer and set up plans, recorder and state."""
        from bloggap_plugin.trl.compat import check_trl

        if not isinstance(gap, GapConfig):
            raise TypeError(f"gap must be a GapConfig, got {type(gap).__name__}")
        from trl import GRPOTrainer

        self._gap_trl_version = check_trl(GRPOTrainer, strict=gap.strict_version)
        args = self.args
        if grpo_kwargs:
            diffs = config_differences(grpo_kwargs, args)
            if diffs:
                listed = ", ".join(f"{k}: recipe {r!r} vs trainer {t!r}" for k, (r, t) in sorted(diffs.items()))
                warnings.warn(
                    f"{source}: attached to an existing trainer, only the gap: section applies; these GRPOConfig "
                    f"fields differ and are NOT applied: {listed}",
                    stacklevel=3,
                )
        policy = self.accelerator.unwrap_model(self.model)
        num_layers = getattr(getattr(policy, "config", None), "num_hidden_layers", None)
        if num_layers is not None:
            gap.check_layers(int(num_layers))
        arm = gap.arm_spec
        if arm.needs_fp16_training and not args.fp16:
            raise RecipeError(f"gap.arm {arm.letter} (fp16 everywhere) needs fp16: true in the GRPOConfig (see "
                              f"recipes/arm_{arm.letter}.yaml)")
        if arm.needs_fp16_training and not getattr(self.accelerator, "native_amp", True):
            warnings.warn(
                f"arm {arm.letter}: accelerate runs without fp16 autocast on this device (e.g. CPU), so rollout, old log-probs "
                f"and training stay in the model's dtype; arm {arm.letter} takes effect on CUDA",
                stacklevel=3,
            )
        if args.fp16 and arm.scores_above_fp16:
            warnings.warn(f"arm {arm.letter} scores old log-probs above fp16 while training runs in fp16", stacklevel=3)
        if self.use_vllm and arm.needs_fp16_training:
            self._gap_check_vllm_fp16()
        if self.use_vllm:
            if gap.kept == "renormalize" and args.beta != 0.0:
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
        sampler = gap.sampler and not self.use_vllm
        gen_cfg = getattr(self, "generation_config", None)
        settings = None
        if sampler:
            from bloggap_plugin.sampling import (
                effective_generation_config,
                sampler_settings,
                unsupported_generation_mode,
            )

            off_reason = None
            if getattr(self, "use_transformers_continuous_batching", False) or getattr(self, "tools", None):
                off_reason = "it supports plain HF generate without tools or continuous batching only"
            else:
                # what generate really runs with: TRL's config, None fields filled from the model's generation_config
                effective = effective_generation_config(policy, gen_cfg)
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
                    raise RecipeError(
                        f"gap.kept: renormalize / gap.is_correction need the sampler recording, and {off_reason}"
                    )
                warnings.warn(f"sampler recording is off ({off_reason}): no gap/sampler or gap/kept metrics; "
                              "training is unchanged", stacklevel=3)
                sampler = False
        loss_type = getattr(self, "loss_type", args.loss_type)
        if loss_type not in KNOWN_LOSS_TYPES:
            raise RecipeError(
                f"loss_type {loss_type!r} is not one bloggap supports (TRL 1.16: {', '.join(KNOWN_LOSS_TYPES)}); "
                "its ratio and clip metrics would be undefined"
            )
        level = getattr(self, "importance_sampling_level", args.importance_sampling_level)
        if level not in ("token", "sequence"):
            raise RecipeError(f"importance_sampling_level {level!r} is not supported; use 'token' or 'sequence'")
        if gap.kept == "renormalize" and getattr(self, "_is_vlm", False):
            raise RecipeError(
                "gap.kept: renormalize supports text-only models (its non-fused scoring passes no image inputs); "
                "use gap.kept: measure with a vision-language model"
            )
        if gap.kept == "renormalize" and getattr(self, "aux_loss_enabled", False):
            raise RecipeError(
                "gap.kept: renormalize does not support the MoE aux loss (router_aux_loss_coef != 0); set "
                "router_aux_loss_coef: 0.0 or use gap.kept: measure"
            )
        if gap.is_correction and loss_type == "vespo":
            raise RecipeError("gap.is_correction does not apply to loss_type vespo (TRL feeds IS ratios into its gamma weights)")
        self._gap_clip_applies = loss_type in gap_metrics.CLIP_RULE_LOSSES
        if not self._gap_clip_applies:
            warnings.warn(
                f"gap/clip/clipped_frac and gap/clip/flip_frac are not logged with loss_type {loss_type!r}: it "
                "does not clip the importance weight (sapo: soft gate; vespo: gamma weights)",
                stacklevel=3,
            )
        self._gap = gap
        self._gap_sampler_on = sampler
        self._gap_recorder = None
        self._gap_truncating = False
        if sampler:
            from bloggap_plugin.sampling import SamplerRecorder

            self._gap_truncating = settings["top_k"] > 0 or settings["top_p"] < 1.0 or settings["min_p"] > 0.0
            self._gap_recorder = SamplerRecorder(
                **settings, truncate=self._gap_truncating, order="hf",
                store_ids_max=gap.store_ids_max if gap.kept != "off" else 0,
            )
        self._gap_vllm_truncation = None
        if self.use_vllm:
            # what TRL sends to vLLM: VLLMGeneration's settings, generation_kwargs last (vllm_generation.py l.662-672)
            self._gap_vllm_truncation = self._gap_vllm_sampling()
            self._gap_truncating = any((self._gap_vllm_truncation["top_k"] > 0, self._gap_vllm_truncation["top_p"] < 1.0,
                                        self._gap_vllm_truncation["min_p"] > 0.0))
        if gap.kept == "renormalize" and not self._gap_truncating:
            warnings.warn("gap.kept: renormalize with untruncated sampling (top_p 1, top_k 0, min_p 0) changes nothing", stacklevel=3)
        self._gap_renormalize = gap.kept == "renormalize" and self._gap_truncating
        # gap.kept: off records no kept sets and runs no kept-mass scoring (the recorder still truncates: it samples)
        self._gap_kept_on = gap.kept != "off" and self._gap_truncating
        # Arms A and H keep TRL's forward (positions 0..L-1); the others use gap.positions everywhere.
        self._gap_positions = "arange" if arm.keeps_trl_forward else gap.positions
        self._gap_plan = None
        self._gap_ref_plan = None
        self._gap_plan_step = None
        self._gap_ref_step = None
        self._gap_fallbacks_seen = 0
        self._gap_generator = torch.Generator(device="cpu")
        self._gap_generator.manual_seed(int(args.seed) + 7919 * self.accelerator.process_index)
        self._gap_generations = 0
        self._gap_time = 0.0
        self._gap_gen_stats: _Stats | None = None
        self._gap_new_logps = None
        self._gap_in_loss = False
        self._gap_current_kept = None
        self._gap_pending_record = None
        self._gap_measure_now = False
        self._gap_drives = False
        self._gap_skip_old = False
        self._gap_old_skipped = False
        self._gap_replaced_time = 0.0
        self._gap_capture = None
        self._gap_pending_completion = None
        if arm.plan is not None and not (arm.takes_layers and gap.layers is None):
            self._gap_plan = self._gap_make_plan(arm.plan, layers=gap.layers, k=gap.k)

    def _gap_vllm_sampling(self) -> dict:
        """``{top_k, top_p, min_p}`` that TRL's vLLM generation samples with (``generation_kwargs`` override last)."""
        from bloggap_plugin.core.truncation import validate_sampling

        source = getattr(self, "vllm_generation", None) or self
        settings = {"top_k": getattr(source, "top_k", None), "top_p": getattr(source, "top_p", None),
                    "min_p": getattr(source, "min_p", None)}
        settings.update({k: v for k, v in (getattr(source, "generation_kwargs", None) or {}).items() if k in settings})
        top_k = int(settings["top_k"] or 0)
        clean = {"top_k": top_k if top_k > 0 else 0,
                 "top_p": 1.0 if settings["top_p"] is None else float(settings["top_p"]),
                 "min_p": float(settings["min_p"] or 0.0)}
        validate_sampling(1.0, **clean)
        return clean

    def _gap_vllm_kept_sets(self, output: dict, ids, attn, logits_to_keep) -> None:
        """Kept sets of vLLM's draws, re-derived from the trainer's logits: ``gap_kept_sizes`` ``[B, K]`` and the trainer's
        log kept mass ``gap_sampler_log_kept_mass`` ``[B, K]`` (vLLM's own mass is not returned by TRL 1.16).

        One grad-free scoring pass in the arm's plan (TRL's forward for arms without one): the kept set follows vLLM's
        order (temperature, min_p, top_k, top_p) on the temperature-scaled logits with the sampled token forced in.
        Only sizes are kept, so old and new passes renormalise over their own top-``|S|`` (approximate at the boundary,
        exactly consistent between the two passes at equal weights).
        """
        from bloggap_plugin.core.precision import make_plan
        from bloggap_plugin.core.truncation import kept_mask, log_kept_mass

        truncation = self._gap_vllm_truncation
        sizes_parts: list = []
        mass_parts: list = []

        def reduce(logits, targets, index):
            kept = kept_mask(logits, sampled=targets, order="vllm", **truncation)
            sizes_parts.append((index, kept.sum(-1).to(torch.float32)))
            mass_parts.append((index, log_kept_mass(logits, kept)))
            return gather_logprobs(logits, targets)

        if self._gap_plan is not None:
            plan = self._gap_synced(self._gap_plan, "_gap_plan_step")
        else:
            if getattr(self, "_gap_vllm_plan", None) is None:
                self._gap_vllm_plan = make_plan(self.model, "bf16", fp16_guard=False)  # TRL's own forward, as called
            plan = self._gap_vllm_plan
        with torch.no_grad(), _fork_rng(self.accelerator.device):
            plan.token_logprobs(ids, attn, logits_to_keep, batch_size=self.args.per_device_train_batch_size,
                                positions=self._gap_positions, temperature=self.temperature, reduce=reduce,
                                chunk_tokens=self._gap.score_chunk_tokens)
        mask = output["completion_mask"]
        output["gap_kept_sizes"] = join_tiles(sizes_parts).round().to(torch.int32).to(mask.device) * mask.int()
        output["gap_sampler_log_kept_mass"] = join_tiles(mass_parts).to(mask.device) * mask

    def _gap_check_vllm_fp16(self) -> None:
        """Arm H samples in fp16: refuse a colocate engine built in another dtype; warn where it cannot be read."""
        from bloggap_plugin.trl.vllm_colocate import colocate_engine_dtype

        if getattr(self, "vllm_mode", None) == "server":
            warnings.warn(
                "arm H with vLLM server mode: start the server in fp16 (`trl vllm-serve --dtype float16`); the trainer "
                "cannot check the server's dtype (server mode is untested live)",
                stacklevel=4,
            )
            return
        dtype = colocate_engine_dtype(self)
        if dtype is None:
            warnings.warn("arm H: could not read the vLLM engine's dtype; make sure it samples in fp16", stacklevel=4)
        elif dtype != torch.float16:
            raise RecipeError(
                f"arm H (fp16 everywhere) needs vLLM to sample in fp16, but TRL built the colocate engine in {dtype}: "
                "use GapGRPOTrainer(..., gap=arm H), which builds it in fp16, or construct the GRPOTrainer inside "
                "`with bloggap_plugin.trl.vllm_colocate_dtype('float16'):` before adding GapCallback"
            )

    # ------------------------------------------------------------------ plans
    def _gap_policy(self):
        return self.accelerator.unwrap_model(self.model)

    def _gap_make_plan(self, plan: str, **kwargs):
        """A precision plan (``core.precision`` name) on the unwrapped policy, fp16 guard on, ``gap.tf32``."""
        from bloggap_plugin.core.precision import make_plan

        policy = self._gap_policy()
        if plan in ("fp32", "fp16"):  # a shadow: on the trainer's device
            kwargs["device"] = self.accelerator.device
        if plan != "guided":
            kwargs.pop("layers", None)
            kwargs.pop("k", None)
        kwargs.setdefault("tf32", self._gap.tf32)
        return make_plan(policy, plan, fp16_guard=True, **kwargs)

    def _gap_weights_version(self) -> tuple:
        """What identifies the policy's current weights: the optimizer step plus every parameter's identity and
        in-place version counter (bumped by the optimizer, ``load_state_dict`` on resume, any ``copy_``/``mul_``)."""
        return (self.state.global_step, tuple((id(p), p._version) for p in self._gap_policy().parameters()))

    def _gap_synced(self, plan, attr: str):
        """``plan``, refreshed from the policy unless it already holds the current weights version (``attr``
        stores the version it was last synced at; ``None``, as after attach, always syncs)."""
        if plan is not None:
            version = self._gap_weights_version()
            if getattr(self, attr) != version:
                plan.sync(self._gap_policy())
                setattr(self, attr, version)
        return plan

    def _gap_reference_plan(self):
        if self._gap_ref_plan is None:
            if self._gap.arm_spec.plan == "fp32" and self._gap_plan is not None and not self._gap_plan.tf32:
                self._gap_ref_plan = self._gap_plan
                self._gap_ref_step = self._gap_plan_step
            else:  # the reference is IEEE fp32 whatever gap.tf32 says
                self._gap_ref_plan = self._gap_make_plan("fp32", tf32=False)
                self._gap_ref_step = self._gap_weights_version()
        if self._gap_ref_plan is self._gap_plan:
            return self._gap_synced(self._gap_plan, "_gap_plan_step")
        return self._gap_synced(self._gap_ref_plan, "_gap_ref_step")

    def _gap_close(self) -> None:
        plans = (self._gap_plan, self._gap_ref_plan, getattr(self, "_gap_vllm_plan", None))
        for plan in {id(p): p for p in plans if p is not None}.values():
            plan.close()

    # ------------------------------------------------------------------ kept sets
    def _gap_kept_from(self, batch: dict, rows=None):
        """``(kept_ids [B,K,S] | None, sizes [B,K])`` of a batch dict (optionally only ``rows``)."""
        sizes = batch.get("gap_kept_sizes")
        if sizes is None:
            return None
        ids = batch.get("gap_kept_ids")
        if rows is not None:
            sizes = sizes[rows]
            ids = ids[rows] if ids is not None else None
        return ids, sizes

    def _gap_kept_from_record(self, record, width: int):
        """Kept sets of the pending (pre-shuffle) sampler record, fitted to completion width ``width``."""
        def fit(tensor, fill=0):
            out = torch.full((tensor.shape[0], width, *tensor.shape[2:]), fill, dtype=tensor.dtype,
                             device=tensor.device)
            common = min(width, tensor.shape[1])
            out[:, :common] = tensor[:, :common]
            return out

        ids = record.kept_ids_tensor()
        return (fit(ids, -1) if ids is not None else None), fit(record.kept_sizes)

    def _gap_reducer(self, kept, capture: list | None = None):
        """A ``token_logprobs`` reduce: renormalised (``gap.kept: renormalize``) or full; captures log kept mass.

        ``capture`` receives ``(index, log kept mass [b, t])`` per scored tile; a tile scored again (the fp16
        guard's fp32 re-score) appends the same index again, and the later value wins (``join_tiles``).
        """
        from bloggap_plugin.core.truncation import kept_reducer

        if kept is None:
            if capture is None:
                return None

            def full(logits, targets, index):
                out = gather_logprobs(logits, targets)
                capture.append((index, torch.zeros_like(out)))
                return out

            return full
        ids, sizes = kept
        inner = kept_reducer(kept_ids=ids, sizes=sizes.long())
        renormalize = self._gap_renormalize

        def reduce(logits, targets, index):
            renorm = inner(logits, targets, index)
            full = gather_logprobs(logits, targets)
            if capture is not None:
                capture.append((index, (full - renorm).detach()))  # per tile: join_tiles assembles [B, K]
            return renorm if renormalize else full

        return reduce

    # ------------------------------------------------------------------ scoring
    def _gap_trl_scores(self, input_ids, attention_mask, logits_to_keep, batch_size, kept=None):
        """TRL's own old-logprob computation (its method, the training forward's path), grad-free."""
        self._gap_current_kept = kept
        try:
            with torch.no_grad(), _fork_rng(self.accelerator.device):
                logps, _, _ = self._get_per_token_logps_and_entropies(
                    self.model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
                )
        finally:
            self._gap_current_kept = None
        return logps.float()

    def _gap_plan_scores(self, plan, input_ids, attention_mask, logits_to_keep, batch_size, kept=None, capture=None):
        reduce = self._gap_reducer(kept, capture) if (kept is not None and (self._gap_renormalize or capture is not None)) else None
        if self._gap.score_rows:  # fewer rows per forward bounds an fp32 body's activations (gap.score_rows)
            batch_size = min(batch_size, self._gap.score_rows) if batch_size else self._gap.score_rows
        with torch.no_grad(), _fork_rng(self.accelerator.device):
            return plan.token_logprobs(
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size=batch_size,
                positions=self._gap_positions,
                temperature=self.temperature,
                reduce=reduce,
                chunk_tokens=self._gap.score_chunk_tokens,
            ).float()

    def _gap_agree_layers(self, layers: list[int]) -> list[int]:
        """Process 0's automatically chosen fp32 layers, on every process (each chose from its own rows)."""
        if self.accelerator.num_processes <= 1:
            return layers
        from accelerate.utils import broadcast_object_list

        return list(broadcast_object_list([layers], from_process=0)[0])

    def _gap_arm_scores(self, input_ids, attention_mask, logits_to_keep, batch_size, kept=None):
        """The arm's old log-probs ``[B, K]`` for a pre-shuffle batch (arms A-F, H)."""
        if self._gap.arm_spec.takes_layers and self._gap_plan is None:
            # guided without layer ids: choose the top-k layers on the first generation batch
            n_layers = int(getattr(self._gap_policy().config, "num_hidden_layers", self._gap.k))
            plan = self._gap_make_plan("guided", layers="auto", k=min(self._gap.k, n_layers),
                                       calibration=(input_ids[:8], attention_mask[:8]))
            chosen = self._gap_agree_layers(list(plan.stats()["layers"]))
            if chosen != list(plan.stats()["layers"]):  # another process's rows chose differently
                plan.close()
                plan = self._gap_make_plan("guided", layers=chosen, k=len(chosen))
            self._gap_plan = plan
            self._gap_plan_step = self._gap_weights_version()
        if self._gap_plan is None:
            return self._gap_trl_scores(input_ids, attention_mask, logits_to_keep, batch_size, kept)
        plan = self._gap_synced(self._gap_plan, "_gap_plan_step")
        return self._gap_plan_scores(plan, input_ids, attention_mask, logits_to_keep, batch_size, kept)

    # ------------------------------------------------------------------ hooks
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        recorder = getattr(self, "_gap_recorder", None)
        if recorder is None or not self.model.training:
            return self._gap_next(
                "_generate_single_turn", prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        import copy

        from transformers import LogitsProcessorList

        from bloggap_plugin.sampling import (
            SamplerRecordError,
            check_neutral_generation_config,
            effective_generation_config,
            sampler_settings,
            unsupported_generation_mode,
        )

        unwrapped = self.accelerator.unwrap_model(self.model_wrapped)
        had_own = "generate" in unwrapped.__dict__
        original_generate = unwrapped.generate
        captured: dict = {}
        neutral = recorder.neutral_generation_kwargs()

        def generate(*gen_args, **gen_kwargs):
            config = gen_kwargs.get("generation_config")
            config = copy.deepcopy(config if config is not None else unwrapped.generation_config)
            # what plain TRL would sample with now (the model's generation_config may have changed since attach)
            effective = effective_generation_config(unwrapped, config)
            mode = unsupported_generation_mode(effective)
            if mode is not None:
                warnings.warn(f"bloggap: the sampler recorder cannot record {mode}; gap/sampler metrics dropped for "
                              "this generation", stacklevel=2)
                return original_generate(*gen_args, **gen_kwargs)
            settings = sampler_settings(effective)
            if settings != recorder.settings():
                raise ValueError(f"bloggap: generation settings {settings} differ from those at attach time "
                                 f"{recorder.settings()}; attach the plugin after the last change to them")
            for key, value in neutral.items():
                setattr(config, key, value)
            check_neutral_generation_config(effective_generation_config(unwrapped, config))
            gen_kwargs["generation_config"] = config
            processors = LogitsProcessorList(gen_kwargs.pop("logits_processor", None) or [])
            processors.append(recorder)  # last: after HF's default processors (penalties etc.)
            recorder.reset()
            sequences = original_generate(*gen_args, logits_processor=processors, **gen_kwargs)
            captured["sequences"] = sequences
            captured["prompt_width"] = gen_kwargs["input_ids"].shape[1]
            return sequences

        unwrapped.generate = generate
        try:
            result = self._gap_next(
                "_generate_single_turn", prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        finally:
            if had_own:
                unwrapped.generate = original_generate
            else:
                del unwrapped.generate
        if "sequences" in captured:
            start = time.perf_counter()
            completion = captured["sequences"][:, captured["prompt_width"]:]
            eos = list(self.eos_token_ids)
            try:
                self._gap_pending_record = recorder.finalize(captured["sequences"], captured["prompt_width"],
                                                             eos_token_id=eos)
                self._gap_pending_completion = completion
            except SamplerRecordError as err:  # generate replaced / mocked, or ran without the recorder
                warnings.warn(f"bloggap: {err}; gap/sampler metrics dropped for this generation", stacklevel=2)
            self._gap_time += time.perf_counter() - start
        return result

    def _gap_align_record(self, output: dict) -> None:
        """Put the sampler record, aligned to TRL's completion tensor, into ``output`` under gap_* keys."""
        record = self._gap_pending_record
        self._gap_pending_record = None
        if record is None:
            return
        completion_ids = output["completion_ids"]
        mask = output["completion_mask"]
        n_rows, width = completion_ids.shape
        if record.logps.shape[0] != n_rows:
            warnings.warn("sampler record rows do not match the batch; gap/sampler metrics skipped", stacklevel=2)
            return
        device = completion_ids.device
        common = min(width, record.logps.shape[1])
        seen = self._gap_pending_completion[:, :common].to(device)
        if not torch.equal((seen * mask[:, :common]), (completion_ids[:, :common] * mask[:, :common])):
            raise RuntimeError("bloggap: the recorded sampler tokens differ from TRL's completions (alignment bug)")

        def fit(tensor, fill=0):
            out = torch.full((n_rows, width, *tensor.shape[2:]), fill, dtype=tensor.dtype, device=device)
            out[:, :common] = tensor[:, :common].to(device)
            return out

        output["gap_sampler_logps"] = fit(record.processed_logps) * mask
        output["gap_sampler_full_logps"] = fit(record.logps) * mask
        if self._gap_kept_on:
            output["gap_kept_sizes"] = fit(record.kept_sizes) * mask
            output["gap_sampler_log_kept_mass"] = fit(record.log_kept_mass) * mask
            ids = record.kept_ids_tensor()
            if ids is not None:
                output["gap_kept_ids"] = fit(ids, fill=-1).masked_fill(~mask.bool().unsqueeze(-1), -1)

    def _generate_and_score_completions(self, inputs):
        if not hasattr(self, "_gap"):
            return self._gap_next("_generate_and_score_completions", inputs)
        training = self.model.training
        # arm G: G's per-micro-batch scores (``_prepare_inputs``) take the place of TRL's old-logprob pass
        self._gap_skip_old = training and self._gap.arm_spec.scores_after_shuffle and self._gap_trl_computes_old()
        self._gap_old_skipped = False
        try:
            output = self._gap_next("_generate_and_score_completions", inputs)
        finally:
            self._gap_skip_old = False
        if not training:
            return output
        start = time.perf_counter()
        gap = self._gap
        self._gap_generations += 1
        self._gap_gen_stats = _Stats()
        measure = (self._gap_generations - 1) % gap.metrics_every == 0
        self._gap_measure_now = measure
        self._gap_align_record(output)
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attn = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        logits_to_keep = output["completion_ids"].shape[1]
        n_rows = ids.shape[0]
        batch_size = self.args.per_device_train_batch_size
        # vLLM kept sets: every generation when they renormalise, on measured generations when they only measure
        if (self.use_vllm and self._gap_kept_on and output.get("sampling_per_token_logps") is not None
                and (self._gap_renormalize or measure)):
            self._gap_vllm_kept_sets(output, ids, attn, logits_to_keep)
        kept = self._gap_kept_from(output)
        trl_old = output.get("old_per_token_logps")
        self._gap_drives = trl_old is not None or gap.force_old_logprobs
        # probe rows (private generator: no draw from the trainer's RNG)
        probe = torch.zeros(n_rows, dtype=torch.bool, device=ids.device)
        probe_due = (self._gap_generations - 1) % (gap.metrics_every * gap.probe_every) == 0
        if probe_due and gap.probe_rows > 0:
            chosen = torch.randperm(n_rows, generator=self._gap_generator)[: gap.probe_rows]
            probe[chosen.to(ids.device)] = True
            rows = probe.nonzero().squeeze(-1)
            ref = torch.full((n_rows, logits_to_keep), float("nan"), device=ids.device)
            ref_kept = self._gap_kept_from(output, rows)
            ref[rows] = self._gap_plan_scores(
                self._gap_reference_plan(), ids[rows], attn[rows], logits_to_keep, 1, kept=ref_kept
            ).to(ref.device)
            output["gap_ref_logps"] = ref
        output["gap_probe_row"] = probe
        if not gap.arm_spec.scores_after_shuffle:
            # TRL's own old pass ran before the vLLM kept sets existed: renormalising re-scores it
            if gap.arm_spec.keeps_trl_forward and trl_old is not None and not (self.use_vllm and self._gap_renormalize):
                old = trl_old.float()
            else:
                old = self._gap_arm_scores(ids, attn, logits_to_keep, batch_size, kept).to(ids.device)
                if trl_old is not None:
                    output["gap_trl_old_logps"] = trl_old
            self._gap_install_old(output, old)
            if measure:
                self._gap_generation_metrics(output, ids, attn, logits_to_keep)
        self._gap_time += time.perf_counter() - start
        return output

    def _gap_install_old(self, batch: dict, old: torch.Tensor) -> None:
        """Put the arm's old log-probs where the loss reads them (or aside, measure-only) and redo IS ratios."""
        if self._gap_drives:
            batch["old_per_token_logps"] = old
        else:
            batch["gap_old_logps"] = old
        mask = batch["completion_mask"] if batch.get("tool_mask") is None else batch["completion_mask"] * batch["tool_mask"]
        if self.use_vllm and self.vllm_importance_sampling_correction and "sampling_per_token_logps" in batch:
            batch["importance_sampling_ratio"] = is_ratio(
                old, batch["sampling_per_token_logps"], mask, self.vllm_importance_sampling_mode,
                self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max,
            )
        if self._gap.is_correction and "gap_sampler_logps" in batch:
            batch["gap_is_ratio"] = is_ratio(
                old, batch["gap_sampler_logps"], mask, self.vllm_importance_sampling_mode,
                self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max,
            )

    def _gap_old_of(self, batch: dict):
        old = batch.get("old_per_token_logps") if self._gap_drives else batch.get("gap_old_logps")
        return old

    def _gap_generation_metrics(self, batch: dict, ids, attn, logits_to_keep) -> None:
        """Sampler, kept-set and probe statistics of one (pre- or post-shuffle) batch into the generation sums."""
        stats = self._gap_gen_stats
        old = self._gap_old_of(batch)
        mask = batch["completion_mask"] if batch.get("tool_mask") is None else batch["completion_mask"] * batch["tool_mask"]
        mask = mask.bool()
        band = self._gap.band
        sampler = batch.get("gap_sampler_logps")
        if sampler is None and "sampling_per_token_logps" in batch:
            sampler = batch["sampling_per_token_logps"]
            mask = mask & ~torch.isnan(sampler)
        if sampler is not None and mask.any():
            out, n = gap_metrics.oob_count(old, sampler, mask, band)
            diff = (old.double() - sampler.double())[mask].abs()
            stats.add("sampler_oob", out)
            stats.add("sampler_n", n)
            stats.add("sampler_absd", float(diff.sum()))
            stats.max("sampler_absd_max", float(diff.max()))
        ratio = batch.get("importance_sampling_ratio")
        if ratio is not None and self.use_vllm:
            # TRL's own statistic (grpo_trainer l.2874): rows for sequence-level modes, masked tokens otherwise
            token_mask = batch["completion_mask"] if batch.get("tool_mask") is None else batch["completion_mask"] * batch["tool_mask"]
            sequence_level = self.vllm_importance_sampling_mode in ("sequence_mask", "sequence_truncate")
            flat = ratio.flatten() if sequence_level else ratio[token_mask.bool()]
            if flat.numel() > 0:
                stats.add("is_sum", float(flat.double().sum()))
                stats.add("is_n", int(flat.numel()))
                stats.max("is_max", float(flat.max()))
                stats.max("is_neg_min", -float(flat.min()))
        if self._gap_kept_on and "gap_kept_sizes" in batch and mask.any():
            log_mass = batch["gap_sampler_log_kept_mass"]
            sizes = batch["gap_kept_sizes"]
            stats.add("kept_mass_sum", float(torch.exp(log_mass.double())[mask].sum()))
            stats.max("kept_mass_neg_min", -float(torch.exp(log_mass.double())[mask].min()))
            stats.add("kept_size_sum", float(sizes.double()[mask].sum()))
            stats.max("kept_size_max", float(sizes[mask].max()))
            stats.add("kept_n", int(mask.sum()))
            # before: trainer full-vocabulary vs sampler; after: renormalised over the kept set
            capture: list = []
            if self._gap_renormalize:
                after = old
                before = old + self._gap_trainer_log_mass(batch, ids, attn, logits_to_keep, capture)
            else:
                before = old
                after = old - self._gap_trainer_log_mass(batch, ids, attn, logits_to_keep, capture)
            ratio_before = torch.exp(before.double() - sampler.double())[mask]
            ratio_after = torch.exp(after.double() - sampler.double())[mask]
            stats.add("kept_ratio_before_sum", float(ratio_before.sum()))
            stats.add("kept_ratio_after_sum", float(ratio_after.sum()))
            stats.add("kept_oob_before", gap_metrics.oob_count(before, sampler, mask, band)[0])
            stats.add("kept_oob_after", gap_metrics.oob_count(after, sampler, mask, band)[0])
        probe = batch.get("gap_probe_row")
        if probe is not None and probe.any():
            rows = probe.nonzero().squeeze(-1)
            b1 = self._gap_probe_b1(batch, ids[rows], attn[rows], logits_to_keep, rows)
            pmask = mask[rows]
            if pmask.any():
                out, n = gap_metrics.oob_count(b1, old[rows].to(b1.device), pmask, band)
                stats.add("probe_oob", out)
                stats.add("probe_n", n)

    def _gap_trainer_log_mass(self, batch, ids, attn, logits_to_keep, capture) -> torch.Tensor:
        """The trainer's own log kept mass of the batch's kept sets ``[B, K]`` (one extra scoring, under the arm)."""
        kept = self._gap_kept_from(batch)
        saved = self._gap_renormalize
        try:
            if self._gap_plan is not None:
                plan = self._gap_synced(self._gap_plan, "_gap_plan_step")
                self._gap_plan_scores(plan, ids, attn, logits_to_keep, self.args.per_device_train_batch_size, kept, capture)
            else:
                self._gap_renormalize = False
                self._gap_capture = capture
                self._gap_trl_scores(ids, attn, logits_to_keep, self.args.per_device_train_batch_size, kept)
        finally:
            self._gap_renormalize = saved
            self._gap_capture = None
        return join_tiles(capture).to(ids.device)

    def _gap_probe_b1(self, batch, ids, attn, logits_to_keep, rows) -> torch.Tensor:
        kept = self._gap_kept_from(batch, rows)
        if self._gap_plan is None:
            return self._gap_trl_scores(ids, attn, logits_to_keep, 1, kept)
        plan = self._gap_synced(self._gap_plan, "_gap_plan_step")
        return self._gap_plan_scores(plan, ids, attn, logits_to_keep, 1, kept)

    def _prepare_inputs(self, generation_batch):
        if not hasattr(self, "_gap") or not self.model.training:
            return self._gap_next("_prepare_inputs", generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        will_generate = self._step % generate_every == 0 or self._buffered_inputs is None
        inputs = self._gap_next("_prepare_inputs", generation_batch)
        if not will_generate:
            return inputs
        start = time.perf_counter()
        replaced = 0.0
        if self._gap.arm_spec.scores_after_shuffle and (self._gap_drives or self._gap_measure_now):
            # driving: G's scores are the old log-probs (replacing TRL's skipped pass, or forced); measure-only (TRL
            # computes none): a metrics pass, gated by gap.metrics_every like the other generation-time metrics
            for batch in self._buffered_inputs:
                ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
                attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
                logits_to_keep = batch["completion_ids"].shape[1]
                if "old_per_token_logps" in batch and not self._gap_old_skipped:
                    batch["gap_trl_old_logps"] = batch["old_per_token_logps"]
                # exactly the training forward's rows, order and shape (one chunk)
                scored = time.perf_counter()
                old = self._gap_trl_scores(ids, attn, logits_to_keep, None, self._gap_kept_from(batch))
                if self._gap_old_skipped:
                    replaced += time.perf_counter() - scored
                self._gap_install_old(batch, old)
                if self._gap_measure_now:
                    self._gap_generation_metrics(batch, ids, attn, logits_to_keep)
            if self._gap_old_skipped:
                self._gap_trl_sampling_metrics(self._buffered_inputs)
        # the pass that replaces TRL's own is TRL's cost, not the plugin's: logged apart (gap/time/old_pass_s)
        self._gap_time += time.perf_counter() - start - replaced
        self._gap_replaced_time = getattr(self, "_gap_replaced_time", 0.0) + replaced
        self._gap_flush_generation()
        return inputs

    def _gap_trl_computes_old(self) -> bool:
        """Whether TRL 1.16 runs its own old-logprob pass this generation (grpo_trainer l.2642-2645)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return bool(self.args.gradient_accumulation_steps % generate_every != 0
                    or (self.use_vllm and self.vllm_importance_sampling_correction))

    def _gap_trl_sampling_metrics(self, batches: list) -> None:
        """Arm G on TRL's vLLM path: TRL's own ``sampling/*`` statistics of this generation, recomputed by TRL's
        definitions (grpo_trainer l.2860-2896) from G's old log-probs over the whole generation batch of this process,
        in place of the values TRL logged from the skipped pass's placeholder (difference 0, ratio 1)."""
        if not (self.use_vllm and self.vllm_importance_sampling_correction):
            return
        from trl.trainer.utils import nanmax, nanmin

        def joined(key):
            return torch.cat([b[key] for b in batches], dim=0)

        old, sampling = joined("old_per_token_logps"), joined("sampling_per_token_logps")
        ratio = joined("importance_sampling_ratio")
        tool = [b.get("tool_mask") for b in batches]
        mask = joined("completion_mask")
        if all(t is not None for t in tool):
            mask = mask * torch.cat(tool, dim=0)
        mask = mask.bool()
        device = self.accelerator.device
        zero = torch.tensor(0.0, device=device)
        delta = torch.abs(old - sampling)
        delta = delta[mask & ~torch.isnan(delta)]
        sequence_level = self.vllm_importance_sampling_mode in ("sequence_mask", "sequence_truncate")
        flat = ratio.flatten() if sequence_level else ratio[mask]
        values = {
            "sampling/sampling_logp_difference/mean": self.accelerator.gather(
                torch.mean(delta) if delta.numel() > 0 else zero).mean().item(),
            "sampling/sampling_logp_difference/max": self.accelerator.gather(
                torch.max(delta) if delta.numel() > 0 else zero).max().item(),
            "sampling/importance_sampling_ratio/min": nanmin(self.accelerator.gather(
                torch.min(flat) if flat.numel() > 0 else zero)).item(),
            "sampling/importance_sampling_ratio/mean": self.accelerator.gather(
                torch.mean(flat) if flat.numel() > 0 else zero).nanmean().item(),
            "sampling/importance_sampling_ratio/max": nanmax(self.accelerator.gather(
                torch.max(flat) if flat.numel() > 0 else zero)).item(),
        }
        metrics = self._metrics["train"]
        for key, value in values.items():
            if metrics.get(key):
                metrics[key][-1] = value

    def _gap_reduce(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            tensor = self.accelerator.reduce(tensor, reduction="sum")
        return tensor.tolist()

    def _gap_reduce_max(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            tensor = self.accelerator.gather(tensor.unsqueeze(0)).max(dim=0).values
        return tensor.tolist()

    def _gap_flush_generation(self) -> None:
        stats = self._gap_gen_stats
        self._gap_gen_stats = None
        if stats is None or not self._gap_measure_now:
            return
        metrics = self._metrics["train"]
        sum_keys = [
            "sampler_oob", "sampler_n", "sampler_absd", "probe_oob", "probe_n", "kept_mass_sum", "kept_size_sum",
            "kept_n", "kept_ratio_before_sum", "kept_ratio_after_sum", "kept_oob_before", "kept_oob_after",
            "is_sum", "is_n",
        ]
        max_keys = ["kept_mass_neg_min", "kept_size_max", "sampler_absd_max", "is_max", "is_neg_min"]
        sums = dict(zip(sum_keys, self._gap_reduce([stats.sums.get(k, 0.0) for k in sum_keys]), strict=True))
        maxes = dict(zip(max_keys, self._gap_reduce_max([stats.maxes.get(k, -math.inf) for k in max_keys]), strict=True))
        if sums["sampler_n"] > 0:
            metrics["gap/sampler/oob_frac"].append(sums["sampler_oob"] / sums["sampler_n"])
            metrics["gap/sampler/abs_dlogp_mean"].append(sums["sampler_absd"] / sums["sampler_n"])
            metrics["gap/sampler/abs_dlogp_max"].append(maxes["sampler_absd_max"])
        if sums["is_n"] > 0:
            metrics["gap/sampler/is_ratio_mean"].append(sums["is_sum"] / sums["is_n"])
            metrics["gap/sampler/is_ratio_min"].append(-maxes["is_neg_min"])
            metrics["gap/sampler/is_ratio_max"].append(maxes["is_max"])
        if sums["probe_n"] > 0:
            metrics["gap/probe/oob_b1_vs_bN"].append(sums["probe_oob"] / sums["probe_n"])
        if sums["kept_n"] > 0:
            n = sums["kept_n"]
            metrics["gap/kept/mass_mean"].append(sums["kept_mass_sum"] / n)
            metrics["gap/kept/mass_min"].append(-maxes["kept_mass_neg_min"])
            metrics["gap/kept/size_mean"].append(sums["kept_size_sum"] / n)
            metrics["gap/kept/size_max"].append(maxes["kept_size_max"])
            metrics["gap/kept/ratio_before_mean"].append(sums["kept_ratio_before_sum"] / n)
            metrics["gap/kept/ratio_after_mean"].append(sums["kept_ratio_after_sum"] / n)
            metrics["gap/kept/oob_before"].append(sums["kept_oob_before"] / n)
            metrics["gap/kept/oob_after"].append(sums["kept_oob_after"] / n)
        fallbacks = 0
        for plan in (self._gap_plan, self._gap_ref_plan):
            if plan is not None:
                fallbacks = max(fallbacks, int(getattr(plan, "fp16_fallbacks", 0) or 0))
        new = fallbacks - self._gap_fallbacks_seen
        self._gap_fallbacks_seen = fallbacks
        metrics["gap/fp16/fallbacks"].append(self._gap_reduce([float(new)])[0])

    # ------------------------------------------------------------------ training forward
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **kwargs):
        gap = getattr(self, "_gap", None)
        is_policy = model is self.model or model is getattr(self, "model_wrapped", None)
        # TRL's separate reference model (beta > 0 without PEFT) is scored like the policy's training forward
        # (same positions), so that KL(theta || theta_ref) is exactly 0 at theta = theta_ref.
        ref_model = getattr(self, "ref_model", None)
        is_reference = ref_model is not None and model is ref_model
        if gap is None or not (is_policy or is_reference):
            return self._gap_next("_get_per_token_logps_and_entropies", model, input_ids, attention_mask,
                                  logits_to_keep, batch_size, compute_entropy, compute_aux_loss, **kwargs)
        if is_policy and getattr(self, "_gap_skip_old", False) and not torch.is_grad_enabled() and not self._gap_in_loss:
            # TRL's old-logprob pass under arm G: the first grad-free policy call inside TRL's
            # _generate_and_score_completions. A NaN placeholder of the same shape stands in (TRL's IS ratio from it
            # is 1, its sampling/* statistics are recomputed from G's scores in _prepare_inputs); every micro-batch
            # gets G's scores before any loss reads them.
            self._gap_skip_old = False
            self._gap_old_skipped = True
            placeholder = torch.full((input_ids.shape[0], logits_to_keep), float("nan"), dtype=torch.float32,
                                     device=input_ids.device)
            return placeholder, None, None
        multimodal = any(kwargs.get(k) is not None for k in _MULTIMODAL_KEYS)
        kept = self._gap_current_kept if is_policy else None
        record = self._gap_pending_record
        if (kept is None and self._gap_renormalize and not self._gap_in_loss and record is not None
                and record.logps.shape[0] == input_ids.shape[0]):
            # TRL's own old-logprob pass and its reference pass (separate model, or PEFT's adapter-disabled
            # policy): renormalised over the same kept sets as the training forward, so KL is 0 at theta_ref
            kept = self._gap_kept_from_record(record, logits_to_keep)
        capture = getattr(self, "_gap_capture", None) if is_policy else None
        if (self._gap_renormalize and kept is not None) or capture is not None:
            if multimodal:
                raise RecipeError("gap.kept: renormalize supports text-only models")
            logps, entropies = self._gap_unfused(model, input_ids, attention_mask, logits_to_keep, batch_size,
                                                 compute_entropy, kept, capture)
            aux = None
            if compute_aux_loss:
                raise RecipeError("gap.kept: renormalize does not support MoE aux loss (router_aux_loss_coef)")
        elif self._gap_positions == "mask" and not multimodal:
            logps, entropies, aux = self._gap_fused_with_positions(model, input_ids, attention_mask, logits_to_keep,
                                                                   batch_size, compute_entropy, compute_aux_loss)
        else:
            logps, entropies, aux = self._gap_next("_get_per_token_logps_and_entropies", model, input_ids,
                                                   attention_mask, logits_to_keep, batch_size, compute_entropy,
                                                   compute_aux_loss, **kwargs)
        if self._gap_in_loss and is_policy:
            self._gap_new_logps = logps.detach()
        return logps, entropies, aux

    def _gap_fused_with_positions(self, model, input_ids, attention_mask, logits_to_keep, batch_size,
                                  compute_entropy, compute_aux_loss):
        """TRL 1.16's text-only loop, plus ``position_ids`` from the attention mask (as ``generate`` uses)."""
        batch_size = batch_size or input_ids.size(0)
        all_logps, all_entropies, all_aux = [], [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids = input_ids[start:start + batch_size]
            mask = attention_mask[start:start + batch_size]
            model_inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask)}
            if compute_aux_loss:
                model_inputs["output_router_logits"] = True
            labels = ids.masked_fill(mask == 0, -100)
            labels[:, :-logits_to_keep] = -100
            with self.accelerator.autocast():
                outputs = model(**model_inputs, labels=labels, fused_lm_head=True)
            all_logps.append(outputs.log_probs[:, -logits_to_keep:])
            if compute_entropy:
                all_entropies.append(outputs.entropy[:, -logits_to_keep:])
            if compute_aux_loss:
                all_aux.append(outputs.aux_loss)
        logps = torch.cat(all_logps, dim=0)
        entropies = torch.cat(all_entropies, dim=0) if compute_entropy else None
        aux = torch.stack(all_aux).mean() if compute_aux_loss else None
        return logps, entropies, aux

    def _gap_unfused(self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, kept,
                     capture):
        """Non-fused forward through ``token_logprobs`` with the kept-set reducer (logits in tiles of positions)."""
        entropy_parts: list = []
        reducer = self._gap_reducer(kept, capture)

        def reduce(logits, targets, index):
            if compute_entropy:
                logp_all = torch.log_softmax(logits, dim=-1)
                entropy_parts.append((index, -(logp_all.exp() * logp_all).sum(-1)))
            return reducer(logits, targets, index)

        def forward(**model_kwargs):
            with self.accelerator.autocast():
                return model(**model_kwargs)  # the fused head's non-fused path: the model's own forward

        logps = token_logprobs(model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                               positions=self._gap_positions, temperature=self.temperature, reduce=reduce,
                               forward=forward, chunk_tokens=self._gap.score_chunk_tokens)
        entropies = join_tiles(entropy_parts) if compute_entropy else None
        return logps, entropies

    def _compute_loss(self, model, inputs):
        if not hasattr(self, "_gap") or not self.model.training:
            return self._gap_next("_compute_loss", model, inputs)
        start = time.perf_counter()
        loss_inputs = inputs
        if self._gap_renormalize:
            self._gap_current_kept = self._gap_kept_from(inputs)
        if self._gap.is_correction and inputs.get("gap_is_ratio") is not None:
            # TRL multiplies the per-token loss by the IS ratio only with vLLM; every GRPO loss except vespo is
            # positively homogeneous in the advantage, so scaling A by w >= 0 is the same product.
            loss_inputs = dict(inputs)
            advantages = inputs["advantages"]
            if advantages.dim() == 1:
                advantages = advantages.unsqueeze(1)
            loss_inputs["advantages"] = advantages * inputs["gap_is_ratio"]
        self._gap_in_loss = True
        self._gap_new_logps = None
        self._gap_time += time.perf_counter() - start
        try:
            loss = self._gap_next("_compute_loss", model, loss_inputs)
        finally:
            self._gap_in_loss = False
            self._gap_current_kept = None
        start = time.perf_counter()
        self._gap_loss_metrics(inputs)
        self._gap_time += time.perf_counter() - start
        return loss

    def _gap_loss_metrics(self, inputs) -> None:
        new = self._gap_new_logps
        self._gap_new_logps = None
        old = self._gap_old_of(inputs)
        if new is None or old is None:
            return
        new = new.float()
        old = old.to(new.device).float()
        mask = inputs["completion_mask"] if inputs.get("tool_mask") is None else inputs["completion_mask"] * inputs["tool_mask"]
        mask = mask.bool()
        band = self._gap.band
        advantages = inputs["advantages"]
        dlogp = (new.double() - old.double())
        local = [0.0] * 9
        local_max = -math.inf
        if mask.any():
            absd = dlogp.abs()[mask]
            out, n = gap_metrics.oob_count(new, old, mask, band)
            clipped = self._gap_clip_status(new - old, advantages, mask)
            clipped_sum = float(clipped[mask].sum()) if clipped is not None else 0.0
            local[0:5] = [out, n, float(absd.sum()), float((dlogp[mask] == 0).sum()), clipped_sum]
            local_max = float(absd.max())
            probe = inputs.get("gap_probe_row")
            ref = inputs.get("gap_ref_logps")
            if clipped is not None and probe is not None and ref is not None and probe.any():
                rows = probe.nonzero().squeeze(-1)
                pmask = mask[rows]
                if pmask.any():
                    clipped_ref = self._gap_clip_status(new[rows] - ref[rows].to(new.device).float(),
                                                        advantages[rows], pmask)
                    flips = clipped[rows] != clipped_ref
                    local[5] = float(flips[pmask].sum())
                    local[6] = float(pmask.sum())
            trl_old = inputs.get("gap_trl_old_logps")
            if trl_old is not None:
                out_trl, _ = gap_metrics.oob_count(old, trl_old.to(new.device).float(), mask, band)
                local[7] = out_trl
                local[8] = float((old.double() - trl_old.double()).abs()[mask].sum())
        has_trl = float(inputs.get("gap_trl_old_logps") is not None)
        sums = self._gap_reduce(local + [has_trl])
        (absd_max,) = self._gap_reduce_max([local_max])
        metrics = self._metrics["train"]
        n = sums[1]
        if n <= 0:
            return
        metrics["gap/ratio/oob_frac"].append(sums[0] / n)
        metrics["gap/ratio/abs_dlogp_mean"].append(sums[2] / n)
        metrics["gap/ratio/abs_dlogp_max"].append(absd_max)
        metrics["gap/ratio/exact_frac"].append(sums[3] / n)
        if self._gap_clip_applies:
            metrics["gap/clip/clipped_frac"].append(sums[4] / n)
            metrics["gap/clip/flip_frac"].append(sums[5] / sums[6] if sums[6] > 0 else float("nan"))
        if sums[9] > 0:
            metrics["gap/old_vs_trl/oob_frac"].append(sums[7] / n)
            metrics["gap/old_vs_trl/abs_dlogp_mean"].append(sums[8] / n)

    def _gap_clip_status(self, log_ratio, advantages, mask):
        """TRL's clip status ``[B, T]`` under this trainer's loss type, IS level, epsilons and delta (or None)."""
        return gap_metrics.trl_clip_status(
            log_ratio, advantages, mask, loss_type=self.loss_type, level=self.importance_sampling_level,
            eps_low=self.epsilon_low, eps_high=self.epsilon_high, delta=self.args.delta,
        )

    # ------------------------------------------------------------------ timing
    def training_step(self, *args, **kwargs):
        if not hasattr(self, "_gap"):
            return self._gap_next("training_step", *args, **kwargs)
        before = self._gap_time
        start = time.perf_counter()
        output = self._gap_next("training_step", *args, **kwargs)
        self._gap_step_wall = getattr(self, "_gap_step_wall", 0.0) + time.perf_counter() - start
        self._gap_step_plugin = getattr(self, "_gap_step_plugin", 0.0) + self._gap_time - before
        if self._step % self.current_gradient_accumulation_steps == 0:
            replaced = getattr(self, "_gap_replaced_time", 0.0)
            plugin, wall, replaced = self._gap_reduce([self._gap_step_plugin, self._gap_step_wall, replaced])
            procs = self.accelerator.num_processes
            self._metrics["train"]["gap/time/scoring_s"].append(plugin / procs)
            self._metrics["train"]["gap/time/overhead_frac"].append(plugin / wall if wall > 0 else 0.0)
            if self._gap.arm_spec.scores_after_shuffle:
                # G's old-logprob pass in place of TRL's (0 on steps that reuse a generation)
                self._metrics["train"]["gap/time/old_pass_s"].append(replaced / procs)
            self._gap_step_wall = 0.0
            self._gap_step_plugin = 0.0
            self._gap_replaced_time = 0.0
        return output


def install(trainer, gap: GapConfig, grpo_kwargs: dict | None = None, source: str = "gap config") -> None:
    """Install :class:`GapMixin`'s hooks on an existing trainer instance (what :class:`GapCallback` does)."""
    if isinstance(trainer, GapMixin) or "_gap_originals" in trainer.__dict__:
        raise RuntimeError("bloggap is already attached to this trainer (GapGRPOTrainer or an earlier GapCallback)")
    trainer._gap_originals = {name: getattr(trainer, name) for name in HOOKED_METHODS}
    helpers = [name for name, fn in vars(GapMixin).items() if name.startswith("_gap_") and callable(fn)]
    for name in helpers:
        setattr(trainer, name, types.MethodType(getattr(GapMixin, name), trainer))
    try:
        trainer._gap_attach(gap, grpo_kwargs, source)
    except Exception:
        for name in [n for n in list(trainer.__dict__) if n.startswith("_gap")]:
            delattr(trainer, name)
        raise
    for name in HOOKED_METHODS:
        setattr(trainer, name, types.MethodType(getattr(GapMixin, name), trainer))
