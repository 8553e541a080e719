"""The adapter's scoring: precision plans, kept sets, and every forward the plugin runs itself.

:class:`Scorer` is owned by :class:`~bloggap_plugin.trl.session.GapSession` and reads its state. Modes (kept sets, renormalisation,
the kept-mass capture) are arguments of these methods; nothing is flipped on the trainer around a call. Every
extra forward runs under ``torch.no_grad`` inside ``torch.random.fork_rng``.
"""

from __future__ import annotations

import torch

from bloggap_plugin.core.scoring import gather_logprobs, join_tiles, position_ids_from_mask, token_logprobs
from bloggap_plugin.core.sharding import is_sharded, reshard
from bloggap_plugin.recipes import RecipeError
from bloggap_plugin.trl.state import GapState, fit_width

__all__ = ["Scorer", "fork_rng", "MULTIMODAL_KEYS"]

MULTIMODAL_KEYS = (
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


def fork_rng(device: torch.device):
    """``torch.random.fork_rng`` over the CPU and, on CUDA, ``device``: the trainer's RNG streams are untouched."""
    devices = [device] if device.type == "cuda" else []
    return torch.random.fork_rng(devices=devices)


class Scorer:
    """Plans, kept sets and the plugin's own scoring for one trainer (state: the session's :class:`GapState`)."""

    def __init__(self, trainer, state: GapState):
        self.trainer = trainer
        self.state = state

    def vllm_kept_sets(self, output: dict, ids, attn, logits_to_keep) -> None:
        """Kept sets of vLLM's draws re-derived from the trainer's logits (``gap.kept_source: retruncate``, or ``auto``
        without vLLM's sampling mask: :meth:`mask_kept_sets`): ``gap_kept_sizes`` ``[B, K]`` and the trainer's
        log kept mass ``gap_sampler_log_kept_mass`` ``[B, K]`` (vLLM's own mass is not returned by TRL 1.16).

        One grad-free scoring pass in the arm's plan (TRL's forward for arms without one): the kept set follows vLLM's
        order (temperature, min_p, top_k, top_p) on the temperature-scaled logits with the sampled token forced in.
        Only sizes are kept, so old and new passes renormalise over their own top-``|S|`` (approximate at the boundary,
        exactly consistent between the two passes at equal weights).
        """
        from bloggap_plugin.core.plans import make_plan
        from bloggap_plugin.core.truncation import kept_mask, log_kept_mass

        truncation = self.state.settings.vllm_truncation
        sizes_parts: list = []
        mass_parts: list = []

        def reduce(logits, targets, index):
            kept = kept_mask(logits, sampled=targets, order="vllm", **truncation)
            sizes_parts.append((index, kept.sum(-1).to(torch.float32)))
            mass_parts.append((index, log_kept_mass(logits, kept)))
            return gather_logprobs(logits, targets)

        if self.state.resources.plan is not None:
            plan = self.synced(self.state.resources.plan, "plan_step")
        else:
            if self.state.resources.vllm_plan is None:  # TRL's own forward, as called
                self.state.resources.vllm_plan = make_plan(self.trainer.model, "bf16", fp16_guard=False)
            plan = self.state.resources.vllm_plan
        with torch.no_grad(), fork_rng(self.trainer.accelerator.device):
            plan.token_logprobs(ids, attn, logits_to_keep, batch_size=self.trainer.args.per_device_train_batch_size,
                                positions=self.state.settings.positions, temperature=self.trainer.temperature,
                                reduce=reduce, chunk_tokens=self.state.config.score_chunk_tokens)
        mask = output["completion_mask"]
        output["gap_kept_sizes"] = join_tiles(sizes_parts).round().to(torch.int32).to(mask.device) * mask.int()
        output["gap_sampler_log_kept_mass"] = join_tiles(mass_parts).to(mask.device) * mask

    def mask_kept_sets(self, output: dict) -> None:
        """vLLM's own kept sets of this generation (its sampling masks, ``gap.kept_source`` resolved to
        ``sampling_mask``) into ``output``: ``gap_kept_ids`` ``[B, K, S]`` and ``gap_kept_sizes`` ``[B, K]``, no
        scoring pass. The log kept mass is the trainer's over these sets, taken where the metrics need it
        (:meth:`trainer_log_mass`)."""
        from bloggap_plugin.trl.kept_source import mask_kept_tensors

        generation = self.state.generation
        captured, generation.sampling_masks = generation.sampling_masks, None
        output["gap_kept_ids"], output["gap_kept_sizes"] = mask_kept_tensors(
            captured or [], output["completion_ids"], output["completion_mask"], self.state.config.store_ids_max)

    def policy(self):
        return self.trainer.accelerator.unwrap_model(self.trainer.model)

    def make_plan(self, plan: str, **kwargs):
        """A scoring plan (a ``core.plans`` name) on the unwrapped policy, fp16 guard on, ``gap.tf32``; what else it
        is given follows its registry entry (:class:`~bloggap_plugin.core.plans.PlanEntry`)."""
        from bloggap_plugin.core.plans import make_plan, plan_entry

        policy = self.policy()
        entry = plan_entry(plan)
        if entry.takes_device:  # a copy of its own (a shadow): on the trainer's device
            kwargs["device"] = self.trainer.accelerator.device
        if entry.takes_pieces:  # arms I and J: their pieces (gap.i_pieces); J scores its parameters (no shadow)
            kwargs["pieces"] = self.state.config.i_form
            if self.state.arm.onpolicy_forward:
                kwargs["over_parameters"] = True
        if not entry.takes_layers:
            kwargs.pop("layers", None)
            kwargs.pop("k", None)
        kwargs.setdefault("tf32", self.state.config.tf32)
        return make_plan(policy, plan, fp16_guard=True, **kwargs)

    def make_onpolicy_forward(self):
        """Arm J's training forward: the plan's form and kernels over the policy's own parameters (no copy)."""
        from bloggap_plugin.core.plans.vllm_shadow import OnPolicyForward

        plan = self.state.resources.plan
        return OnPolicyForward(self.policy(), plan.form, plan.kernels)

    def onpolicy_logps(self, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, *,
                       host_mask: torch.Tensor | None = None):
        """``(logps [B, K] fp32, entropies [B, K] | None)`` of arm J's training forward, with gradients to the policy;
        the entropies are of the same logits, detached. ``host_mask``: ``attention_mask``'s copy on the CPU (the
        batch's ``gap_host_mask``), from which the forward lays out the rows without reading the device; used when
        its shape is the mask's, else the device mask is read."""
        if host_mask is not None and host_mask.shape == attention_mask.shape:
            attention_mask = host_mask
        return self.state.resources.onpolicy.token_logprobs(
            input_ids, attention_mask, logits_to_keep, batch_size, temperature=self.trainer.temperature,
            chunk_tokens=self.state.config.score_chunk_tokens, compute_entropy=compute_entropy,
        )

    def weights_version(self) -> tuple:
        """What identifies the policy's current weights: the optimizer step plus every parameter's identity and
        in-place version counter (bumped by the optimizer, ``load_state_dict`` on resume, any ``copy_``/``mul_``)."""
        policy = self.policy()
        reshard(policy)  # FSDP2: read the shards' versions, not those of gathered copies (core.sharding)
        return (self.trainer.state.global_step, tuple((id(p), p._version) for p in policy.parameters()))

    def synced(self, plan, attr: str):
        """``plan``, refreshed from the policy unless it already holds the current weights version (the state's
        ``attr``, ``"plan_step"`` or ``"ref_step"``, stores the version it was last synced at; ``None``, as after
        attach, always syncs)."""
        if plan is not None:
            plan = self.sharded_like_policy(plan)
            version = self.weights_version()
            resources = self.state.resources
            if getattr(resources, attr) != version:
                plan.sync(self.policy())
                setattr(resources, attr, version)
        return plan

    def sharded_like_policy(self, plan):
        """``plan``, or a new one in its place (the state's fields updated, the old one closed) when the policy was
        sharded since it was made: ``accelerator.prepare`` applies FSDP2's ``fully_shard`` after attach, and a plan
        made before would hold full copies (B, F) or the replaced parameters themselves (E, D)."""
        from bloggap_plugin.core.plans import plan_entry

        entry = plan_entry(plan.name)
        if not entry.copies_weights or plan.sharded == is_sharded(self.policy()):
            return plan
        layers = {"layers": list(plan.layers), "k": len(plan.layers)} if entry.takes_layers else {}
        rebuilt = self.make_plan(plan.name, tf32=plan.tf32_option, **layers)
        resources = self.state.resources
        for field, step in (("plan", "plan_step"), ("ref_plan", "ref_step")):
            if getattr(resources, field) is plan:
                setattr(resources, field, rebuilt)
                setattr(resources, step, None)
        plan.close()
        return rebuilt

    def reference_plan(self):
        """The fp32 batch-1 reference's plan (IEEE fp32), synced: the arm's own fp32 shadow where it is one."""
        from bloggap_plugin.core.plans import REFERENCE_PLAN, plan_entry

        res = self.state.resources
        if res.ref_plan is None:
            if res.plan is not None and plan_entry(res.plan.name).fp32_everywhere and not res.plan.tf32:
                res.ref_plan = res.plan
                res.ref_step = res.plan_step
            else:  # the reference is IEEE fp32 whatever gap.tf32 says
                res.ref_plan = self.make_plan(REFERENCE_PLAN, tf32=False)
                res.ref_step = self.weights_version()
        if res.ref_plan is res.plan:
            return self.synced(res.plan, "plan_step")
        return self.synced(res.ref_plan, "ref_step")

    def close(self) -> None:
        state = self.state
        plans = (state.resources.plan, state.resources.ref_plan, state.resources.vllm_plan)
        for plan in {id(p): p for p in plans if p is not None}.values():
            plan.close()

    def agree_layers(self, layers: list[int]) -> list[int]:
        """Process 0's automatically chosen fp32 layers, on every process (each chose from its own rows)."""
        if self.trainer.accelerator.num_processes <= 1:
            return layers
        from accelerate.utils import broadcast_object_list

        return list(broadcast_object_list([layers], from_process=0)[0])

    def kept_from(self, batch: dict, rows=None):
        """``(kept_ids [B,K,S] | None, sizes [B,K])`` of a batch dict (optionally only ``rows``)."""
        sizes = batch.get("gap_kept_sizes")
        if sizes is None:
            return None
        ids = batch.get("gap_kept_ids")
        if rows is not None:
            sizes = sizes[rows]
            ids = ids[rows] if ids is not None else None
        return ids, sizes

    def kept_from_record(self, record, width: int):
        """Kept sets of the pending (pre-shuffle) sampler record, fitted to completion width ``width``."""
        ids = record.kept_ids_tensor()
        return (fit_width(ids, width, -1) if ids is not None else None), fit_width(record.kept_sizes, width)

    def reducer(self, kept, capture: list | None = None, renormalize: bool = False):
        """A ``token_logprobs`` reduce: renormalised over ``kept`` (``renormalize``) or full; captures log kept mass.

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

        def reduce(logits, targets, index):
            renorm = inner(logits, targets, index)
            full = gather_logprobs(logits, targets)
            if capture is not None:
                capture.append((index, (full - renorm).detach()))  # per tile: join_tiles assembles [B, K]
            return renorm if renormalize else full

        return reduce

    def trl_scores(self, input_ids, attention_mask, logits_to_keep, batch_size, kept=None, *,
                        renormalize: bool | None = None, capture: list | None = None):
        """TRL's own old-logprob computation (the training forward's path), grad-free, ``[B, K]`` fp32.

        ``kept``: kept sets to renormalise over when ``renormalize`` (default: the state's mode); ``capture``
        receives the log kept mass per tile (see :meth:`_gap_reducer`)."""
        if renormalize is None:
            renormalize = self.state.settings.renormalize
        with torch.no_grad(), fork_rng(self.trainer.accelerator.device):
            logps, _, _ = self.policy_logps(self.trainer.model, input_ids, attention_mask, logits_to_keep, batch_size,
                                                 kept=kept, renormalize=renormalize, capture=capture)
        return logps.float()

    def policy_logps(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                          compute_entropy=False, compute_aux_loss=False, *, kept=None, renormalize=False,
                          capture=None, **kwargs):
        """``(logps, entropies, aux)`` of TRL's forward as the plugin runs it: renormalised over ``kept`` or
        capturing kept mass (a non-fused forward), else TRL's fused head with ``gap.positions`` (or TRL's own)."""
        multimodal = any(kwargs.get(k) is not None for k in MULTIMODAL_KEYS)
        if (renormalize and kept is not None) or capture is not None:
            if multimodal:
                raise RecipeError("gap.kept: renormalize supports text-only models")
            if compute_aux_loss:
                raise RecipeError("gap.kept: renormalize does not support MoE aux loss (router_aux_loss_coef)")
            logps, entropies = self.unfused(model, input_ids, attention_mask, logits_to_keep, batch_size,
                                                 compute_entropy, kept, capture, renormalize)
            return logps, entropies, None
        if self.state.settings.positions == "mask" and not multimodal:
            return self.fused_with_positions(model, input_ids, attention_mask, logits_to_keep, batch_size,
                                                  compute_entropy, compute_aux_loss)
        return self.trainer._gap_next("_get_per_token_logps_and_entropies", model, input_ids, attention_mask,
                              logits_to_keep, batch_size, compute_entropy, compute_aux_loss, **kwargs)

    def plan_scores(self, plan, input_ids, attention_mask, logits_to_keep, batch_size, kept=None, capture=None):
        """The old log-probs ``[B, K]`` fp32 of ``plan`` (renormalised per the state's mode; ``capture`` as above)."""
        state = self.state
        renormalize = state.settings.renormalize
        reduce = self.reducer(kept, capture, renormalize) if kept is not None and (renormalize or capture is not None) else None
        if state.config.score_rows:  # fewer rows per forward bounds an fp32 body's activations (gap.score_rows)
            batch_size = min(batch_size, state.config.score_rows) if batch_size else state.config.score_rows
        elif batch_size != 1 and (chosen := plan.rows_per_forward(input_ids.shape[1])) is not None:  # probe b1 stays
            batch_size = max(batch_size or 0, chosen)
        with torch.no_grad(), fork_rng(self.trainer.accelerator.device):
            return plan.token_logprobs(
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size=batch_size,
                positions=self.state.settings.positions,
                temperature=self.trainer.temperature,
                reduce=reduce,
                chunk_tokens=self.state.config.score_chunk_tokens,
            ).float()

    def arm_scores(self, input_ids, attention_mask, logits_to_keep, batch_size, kept=None):
        """The arm's old log-probs ``[B, K]`` for a pre-shuffle batch (arms A-F, H)."""
        if self.state.arm.takes_layers and self.state.resources.plan is None:
            # guided without layer ids: choose the top-k layers on the first generation batch
            from bloggap_plugin.core import divergence

            n_layers = int(getattr(self.policy().config, "num_hidden_layers", self.state.config.k))
            profile = divergence.divergence_profile(self.policy(), input_ids[:8], attention_mask[:8])
            # every process profiled its own rows: process 0's choice, agreed before any fp32 copy is made (under
            # FSDP2 the copies are gathered from shards, a collective over the same layers on every process)
            chosen = self.agree_layers(profile.top_k(min(self.state.config.k, n_layers)))
            plan = self.make_plan(self.state.arm.plan, layers=chosen, k=len(chosen))
            plan.profile = profile
            self.state.resources.plan = plan
            self.state.resources.plan_step = self.weights_version()
        if self.state.resources.plan is None:
            return self.trl_scores(input_ids, attention_mask, logits_to_keep, batch_size, kept)
        plan = self.synced(self.state.resources.plan, "plan_step")
        return self.plan_scores(plan, input_ids, attention_mask, logits_to_keep, batch_size, kept)

    def fused_with_positions(self, model, input_ids, attention_mask, logits_to_keep, batch_size,
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
            with self.trainer.accelerator.autocast():
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

    def unfused(self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, kept,
                     capture, renormalize):
        """Non-fused forward through ``token_logprobs`` with the kept-set reducer (logits in tiles of positions)."""
        entropy_parts: list = []
        reducer = self.reducer(kept, capture, renormalize)

        def reduce(logits, targets, index):
            if compute_entropy:
                logp_all = torch.log_softmax(logits, dim=-1)
                entropy_parts.append((index, -(logp_all.exp() * logp_all).sum(-1)))
            return reducer(logits, targets, index)

        def forward(**model_kwargs):
            with self.trainer.accelerator.autocast():
                return model(**model_kwargs)  # the fused head's non-fused path: the model's own forward

        logps = token_logprobs(model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                               positions=self.state.settings.positions, temperature=self.trainer.temperature,
                               reduce=reduce, forward=forward, chunk_tokens=self.state.config.score_chunk_tokens)
        entropies = join_tiles(entropy_parts) if compute_entropy else None
        return logps, entropies

    def trainer_log_mass(self, batch, ids, attn, logits_to_keep, capture) -> torch.Tensor | None:
        """The trainer's own log kept mass of the batch's kept sets ``[B, K]`` (one extra scoring, under the arm);
        ``None`` for a batch without kept sets (the same scoring, taken so that every process takes it)."""
        kept = self.kept_from(batch)
        batch_size = self.trainer.args.per_device_train_batch_size
        if self.state.resources.plan is not None:
            plan = self.synced(self.state.resources.plan, "plan_step")
            self.plan_scores(plan, ids, attn, logits_to_keep, batch_size, kept, capture)
        else:  # TRL's forward, full vocabulary: the capture holds its log kept mass
            self.trl_scores(ids, attn, logits_to_keep, batch_size, kept, renormalize=False, capture=capture)
        return join_tiles(capture).to(ids.device) if kept is not None else None

    def probe_b1(self, batch, ids, attn, logits_to_keep, rows) -> torch.Tensor:
        kept = self.kept_from(batch, rows)
        if self.state.resources.plan is None:
            return self.trl_scores(ids, attn, logits_to_keep, 1, kept)
        plan = self.synced(self.state.resources.plan, "plan_step")
        return self.plan_scores(plan, ids, attn, logits_to_keep, 1, kept)
