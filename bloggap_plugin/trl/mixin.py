"""GapMixin: the one implementation of the plugin inside TRL's GRPOTrainer (1.16.x, fused-LM-head path).

Hooks (TRL 1.16's ``GRPOTrainer`` methods, see ``docs/trl.md``):

- ``_generate_single_turn``: HF ``generate`` runs with :class:`~bloggap_plugin.sampling.SamplerRecorder` as the
  last logits processor (TRL's temperature/top_p/top_k/min_p handed to it), which records the sampler's
  log-prob and kept set of every emitted token;
- ``_generate_and_score_completions``: after TRL, adds the sampler record, probe rows, the fp32 batch-1
  reference of those rows, and the arm's old log-probs (replacing TRL's where TRL computes them, or with
  ``gap.force_old_logprobs``) to the batch under ``gap_*`` keys that TRL's shuffle/split carry along and its
  loss never reads;
- ``_prepare_inputs``: an arm that scores after the shuffle (G) scores every buffered micro-batch, in place of
  TRL's own old-logprob pass (skipped: a NaN placeholder stands in until G's scores are installed; on the vLLM
  path the IS ratio is recomputed per micro-batch and TRL's ``sampling/*`` statistics from G's scores);
  generation-time metrics are reduced and logged;
- ``_get_per_token_logps_and_entropies``: position ids from the mask (``gap.positions: mask``, arms B-G),
  kept-set renormalisation (``gap.kept: renormalize``, a non-fused forward), and a stash of the training
  forward's log-probs;
- ``_compute_loss``: HF-path IS correction (``gap.is_correction``) and the loss-time metrics;
- ``training_step``: plugin time and its share of the step.

The adapter's state is one object, ``trainer._gap_state`` (:class:`~bloggap_plugin.trl.state.GapState`); the
scoring lives in :mod:`bloggap_plugin.trl.plan_mixin`, the metrics in :mod:`bloggap_plugin.trl.stats`, the checks at
attach time in :mod:`bloggap_plugin.trl.attach`. Every extra forward runs under ``torch.no_grad`` inside
``torch.random.fork_rng`` and probe rows come from a private generator, so with arm A the trainer's RNG streams
and losses are exactly those of plain TRL.
"""

from __future__ import annotations

import time
import types
import warnings

import torch

from bloggap_plugin.recipes import GapConfig
from bloggap_plugin.trl.attach import KNOWN_LOSS_TYPES
from bloggap_plugin.trl.plan_mixin import PlanMixin
from bloggap_plugin.trl.state import GenerationMaxima, GenerationSums, StepTimes, fit_width
from bloggap_plugin.trl.stats import StatsMixin, is_ratio

__all__ = ["GapMixin", "HOOKED_METHODS", "BATCH_KEYS", "KNOWN_LOSS_TYPES", "is_ratio"]

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


class GapMixin(PlanMixin, StatsMixin):
    """Mix into ``GRPOTrainer`` (before it in the MRO) or install on an instance with :class:`GapCallback`."""

    # ------------------------------------------------------------------ plumbing
    def _gap_next(self, name: str, *args, **kwargs):
        """Call the next implementation of ``name``: the instance's original (callback) or the MRO's."""
        originals = self.__dict__.get("_gap_originals")
        if originals and name in originals:
            return originals[name](*args, **kwargs)
        return getattr(super(GapMixin, self), name)(*args, **kwargs)  # noqa: UP008 (explicit: also read in callback mode)

    def _gap_attach(self, gap: GapConfig, grpo_kwargs: dict | None = None, source: str = "gap config") -> None:
        """Validate ``gap`` against this trainer and set up its state (``self._gap_state``), recorder and plan."""
        from bloggap_plugin.trl.attach import attach_state

        state = attach_state(self, gap, grpo_kwargs, source)
        self._gap_state = state
        if state.arm.plan is not None and not (state.arm.takes_layers and gap.layers is None):
            state.plan = self._gap_make_plan(state.arm.plan, layers=gap.layers, k=gap.k)

    def _gap_active(self) -> bool:
        """Attached and training (the hooks pass evaluation and unattached calls straight to TRL)."""
        return getattr(self, "_gap_state", None) is not None and self.model.training

    # ------------------------------------------------------------------ generation: the sampler record
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        recorder = self._gap_state.recorder if getattr(self, "_gap_state", None) is not None else None
        if recorder is None or not self.model.training:
            return self._gap_next(
                "_generate_single_turn", prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        unwrapped = self.accelerator.unwrap_model(self.model_wrapped)
        had_own = "generate" in unwrapped.__dict__
        original_generate = unwrapped.generate
        captured: dict = {}
        unwrapped.generate = self._gap_recording_generate(unwrapped, original_generate, recorder, captured)
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
            self._gap_keep_record(recorder, captured["sequences"], captured["prompt_width"])
        return result

    def _gap_recording_generate(self, unwrapped, original_generate, recorder, captured: dict):
        """A ``generate`` for ``unwrapped`` that samples through ``recorder`` (HF's warpers neutralised) and puts
        the sequences and prompt width into ``captured``."""
        import copy

        from transformers import LogitsProcessorList

        from bloggap_plugin.sampling import (
            check_neutral_generation_config,
            effective_generation_config,
            sampler_settings,
            unsupported_generation_mode,
        )

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

        return generate

    def _gap_keep_record(self, recorder, sequences: torch.Tensor, prompt_width: int) -> None:
        """Finalise the recorder's record of ``sequences`` ``[B, prompt + completion]`` until TRL's batch exists."""
        from bloggap_plugin.sampling import SamplerRecordError

        state = self._gap_state
        start = time.perf_counter()
        try:
            state.pending_record = recorder.finalize(sequences, prompt_width, eos_token_id=list(self.eos_token_ids))
            state.pending_completion = sequences[:, prompt_width:]
        except SamplerRecordError as err:  # generate replaced / mocked, or ran without the recorder
            warnings.warn(f"bloggap: {err}; gap/sampler metrics dropped for this generation", stacklevel=3)
        state.time += time.perf_counter() - start

    def _gap_align_record(self, output: dict) -> None:
        """Put the sampler record, aligned to TRL's completion tensor, into ``output`` under gap_* keys."""
        state = self._gap_state
        record, state.pending_record = state.pending_record, None
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
        seen = state.pending_completion[:, :common].to(device)
        if not torch.equal((seen * mask[:, :common]), (completion_ids[:, :common] * mask[:, :common])):
            raise RuntimeError("bloggap: the recorded sampler tokens differ from TRL's completions (alignment bug)")
        output["gap_sampler_logps"] = fit_width(record.processed_logps, width, device=device) * mask
        output["gap_sampler_full_logps"] = fit_width(record.logps, width, device=device) * mask
        if state.kept_on:
            output["gap_kept_sizes"] = fit_width(record.kept_sizes, width, device=device) * mask
            output["gap_sampler_log_kept_mass"] = fit_width(record.log_kept_mass, width, device=device) * mask
            ids = record.kept_ids_tensor()
            if ids is not None:
                output["gap_kept_ids"] = fit_width(ids, width, -1, device).masked_fill(~mask.bool().unsqueeze(-1), -1)

    # ------------------------------------------------------------------ generation: the old log-probs
    def _generate_and_score_completions(self, inputs):
        state = getattr(self, "_gap_state", None)
        if state is None:
            return self._gap_next("_generate_and_score_completions", inputs)
        training = self.model.training
        # arm G: G's per-micro-batch scores (``_prepare_inputs``) take the place of TRL's old-logprob pass
        state.skip_old = training and state.arm.scores_after_shuffle and self._gap_trl_computes_old()
        state.old_skipped = False
        try:
            output = self._gap_next("_generate_and_score_completions", inputs)
        finally:
            state.skip_old = False
        if not training:
            return output
        start = time.perf_counter()
        gap = state.config
        state.generations += 1
        state.probe_now = self._gap_probe_scheduled()
        state.gen_sums, state.gen_maxima = GenerationSums(), GenerationMaxima()
        state.measure_now = measure = (state.generations - 1) % gap.metrics_every == 0
        self._gap_align_record(output)
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attn = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        logits_to_keep = output["completion_ids"].shape[1]
        # vLLM kept sets: every generation when they renormalise, on measured generations when they only measure
        if (self.use_vllm and state.kept_on and output.get("sampling_per_token_logps") is not None
                and (state.renormalize or measure)):
            self._gap_vllm_kept_sets(output, ids, attn, logits_to_keep)
        trl_old = output.get("old_per_token_logps")
        state.drives = trl_old is not None or gap.force_old_logprobs
        self._gap_probe_rows(output, ids, attn, logits_to_keep)
        if not state.arm.scores_after_shuffle:
            # TRL's own old pass ran before the vLLM kept sets existed: renormalising re-scores it
            if state.arm.keeps_trl_forward and trl_old is not None and not (self.use_vllm and state.renormalize):
                old = trl_old.float()
            else:
                batch_size = self.args.per_device_train_batch_size
                old = self._gap_arm_scores(ids, attn, logits_to_keep, batch_size, self._gap_kept_from(output))
                old = old.to(ids.device)
                if trl_old is not None:
                    output["gap_trl_old_logps"] = trl_old
            self._gap_install_old(output, old)
            if measure:
                self._gap_generation_metrics(output, ids, attn, logits_to_keep)
        state.time += time.perf_counter() - start
        return output

    def _gap_probe_rows(self, output: dict, ids, attn, logits_to_keep: int) -> None:
        """``gap_probe_row`` ``[B]`` (rows drawn with the private generator on due generations) and, for those rows,
        ``gap_ref_logps`` ``[B, K]``: the fp32 batch-1 reference (NaN elsewhere)."""
        state = self._gap_state
        gap = state.config
        n_rows = ids.shape[0]
        probe = torch.zeros(n_rows, dtype=torch.bool, device=ids.device)
        if self._gap_probe_due():
            chosen = torch.randperm(n_rows, generator=state.generator)[: gap.probe_rows]
            probe[chosen.to(ids.device)] = True
            rows = probe.nonzero().squeeze(-1)
            ref = torch.full((n_rows, logits_to_keep), float("nan"), device=ids.device)
            ref_kept = self._gap_kept_from(output, rows)
            with self._gap_probe_timer(ids.device):
                ref[rows] = self._gap_plan_scores(
                    self._gap_reference_plan(), ids[rows], attn[rows], logits_to_keep, 1, kept=ref_kept
                ).to(ref.device)
            output["gap_ref_logps"] = ref
        output["gap_probe_row"] = probe

    def _prepare_inputs(self, generation_batch):
        if not self._gap_active():
            return self._gap_next("_prepare_inputs", generation_batch)
        state = self._gap_state
        generate_every = self.args.steps_per_generation * self.num_iterations
        will_generate = self._step % generate_every == 0 or self._buffered_inputs is None
        inputs = self._gap_next("_prepare_inputs", generation_batch)
        if not will_generate:
            return inputs
        start = time.perf_counter()
        replaced = 0.0
        if state.arm.scores_after_shuffle and (state.drives or state.measure_now):
            # driving: its scores are the old log-probs (replacing TRL's skipped pass, or forced); measure-only (TRL
            # computes none): a metrics pass, gated by gap.metrics_every like the other generation-time metrics
            replaced = self._gap_score_buffered(self._buffered_inputs)
        # the pass that replaces TRL's own is TRL's cost, not the plugin's: logged apart (gap/time/old_pass_s)
        state.time += time.perf_counter() - start - replaced
        state.replaced_time += replaced
        self._gap_flush_generation()
        return inputs

    def _gap_score_buffered(self, batches: list) -> float:
        """Score each buffered training micro-batch exactly as the training forward will see it (rows, order,
        one chunk) and install the scores; returns the seconds spent in place of TRL's skipped pass."""
        state = self._gap_state
        replaced = 0.0
        for batch in batches:
            ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
            attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
            logits_to_keep = batch["completion_ids"].shape[1]
            if "old_per_token_logps" in batch and not state.old_skipped:
                batch["gap_trl_old_logps"] = batch["old_per_token_logps"]
            scored = time.perf_counter()
            old = self._gap_trl_scores(ids, attn, logits_to_keep, None, self._gap_kept_from(batch))
            if state.old_skipped:
                replaced += time.perf_counter() - scored
            self._gap_install_old(batch, old)
            if state.measure_now:
                self._gap_generation_metrics(batch, ids, attn, logits_to_keep)
        if state.old_skipped:
            self._gap_trl_sampling_metrics(batches)
        return replaced

    # ------------------------------------------------------------------ training forward
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **kwargs):
        state = getattr(self, "_gap_state", None)
        is_policy = model is self.model or model is getattr(self, "model_wrapped", None)
        # TRL's separate reference model (beta > 0 without PEFT) is scored like the policy's training forward
        # (same positions), so that KL(theta || theta_ref) is exactly 0 at theta = theta_ref.
        ref_model = getattr(self, "ref_model", None)
        is_reference = ref_model is not None and model is ref_model
        if state is None or not (is_policy or is_reference):
            return self._gap_next("_get_per_token_logps_and_entropies", model, input_ids, attention_mask,
                                  logits_to_keep, batch_size, compute_entropy, compute_aux_loss, **kwargs)
        if is_policy and state.skip_old and not torch.is_grad_enabled() and not state.in_loss:
            # TRL's old-logprob pass under arm G: the first grad-free policy call inside TRL's
            # _generate_and_score_completions. A NaN placeholder of the same shape stands in (TRL's IS ratio from it
            # is 1, its sampling/* statistics are recomputed from G's scores in _prepare_inputs); every micro-batch
            # gets G's scores before any loss reads them.
            state.skip_old = False
            state.old_skipped = True
            placeholder = torch.full((input_ids.shape[0], logits_to_keep), float("nan"), dtype=torch.float32,
                                     device=input_ids.device)
            return placeholder, None, None
        kept = state.loss_kept if is_policy else None
        record = state.pending_record
        if (kept is None and state.renormalize and not state.in_loss and record is not None
                and record.logps.shape[0] == input_ids.shape[0]):
            # TRL's own old-logprob pass and its reference pass (separate model, or PEFT's adapter-disabled
            # policy): renormalised over the same kept sets as the training forward, so KL is 0 at theta_ref
            kept = self._gap_kept_from_record(record, logits_to_keep)
        logps, entropies, aux = self._gap_policy_logps(
            model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
            kept=kept, renormalize=state.renormalize, **kwargs,
        )
        if state.in_loss and is_policy:
            state.new_logps = logps.detach()
        return logps, entropies, aux

    def _compute_loss(self, model, inputs):
        if not self._gap_active():
            return self._gap_next("_compute_loss", model, inputs)
        state = self._gap_state
        start = time.perf_counter()
        loss_inputs = inputs
        if state.renormalize:
            state.loss_kept = self._gap_kept_from(inputs)
        if state.config.is_correction and inputs.get("gap_is_ratio") is not None:
            # TRL multiplies the per-token loss by the IS ratio only with vLLM; every GRPO loss except vespo is
            # positively homogeneous in the advantage, so scaling A by w >= 0 is the same product.
            loss_inputs = dict(inputs)
            advantages = inputs["advantages"]
            if advantages.dim() == 1:
                advantages = advantages.unsqueeze(1)
            loss_inputs["advantages"] = advantages * inputs["gap_is_ratio"]
        state.in_loss = True  # TRL's _compute_loss calls the training forward back: it reads loss_kept, in_loss
        state.new_logps = None
        state.time += time.perf_counter() - start
        try:
            loss = self._gap_next("_compute_loss", model, loss_inputs)
        finally:
            state.in_loss = False
            state.loss_kept = None
        start = time.perf_counter()
        self._gap_loss_metrics(inputs)
        state.time += time.perf_counter() - start
        return loss

    # ------------------------------------------------------------------ timing
    def training_step(self, *args, **kwargs):
        state = getattr(self, "_gap_state", None)
        if state is None:
            return self._gap_next("training_step", *args, **kwargs)
        before = state.time
        start = time.perf_counter()
        output = self._gap_next("training_step", *args, **kwargs)
        state.step_wall += time.perf_counter() - start
        state.step_plugin += state.time - before
        if self._step % self.current_gradient_accumulation_steps == 0:
            times = self._gap_reduce(StepTimes(state.step_plugin, state.step_wall, state.replaced_time,
                                               state.step_probe))
            state.probe_total += times.probe  # the probe budget's totals: reduced, so alike on every process
            state.wall_total += times.wall
            procs = self.accelerator.num_processes
            metrics = self._metrics["train"]
            metrics["gap/time/scoring_s"].append(times.plugin / procs)
            metrics["gap/time/overhead_frac"].append(times.plugin / times.wall if times.wall > 0 else 0.0)
            if state.arm.scores_after_shuffle:
                # G's old-logprob pass in place of TRL's (0 on steps that reuse a generation)
                metrics["gap/time/old_pass_s"].append(times.replaced / procs)
            state.step_wall = state.step_plugin = state.replaced_time = state.step_probe = 0.0
        return output


def _helper_names() -> list[str]:
    """The ``_gap_*`` methods of GapMixin and its parts (bound onto an instance by :func:`install`)."""
    names = []
    for cls in GapMixin.__mro__:
        if cls is object:
            continue
        names += [name for name, fn in vars(cls).items() if name.startswith("_gap_") and callable(fn)]
    return list(dict.fromkeys(names))


def install(trainer, gap: GapConfig, grpo_kwargs: dict | None = None, source: str = "gap config") -> None:
    """Install :class:`GapMixin`'s hooks on an existing trainer instance (what :class:`GapCallback` does)."""
    if isinstance(trainer, GapMixin) or "_gap_originals" in trainer.__dict__:
        raise RuntimeError("bloggap is already attached to this trainer (GapGRPOTrainer or an earlier GapCallback)")
    trainer._gap_originals = {name: getattr(trainer, name) for name in HOOKED_METHODS}
    for name in _helper_names():
        setattr(trainer, name, types.MethodType(getattr(GapMixin, name), trainer))
    try:
        trainer._gap_attach(gap, grpo_kwargs, source)
    except Exception:
        for name in [n for n in list(trainer.__dict__) if n.startswith("_gap")]:
            delattr(trainer, name)
        raise
    for name in HOOKED_METHODS:
        setattr(trainer, name, types.MethodType(getattr(GapMixin, name), trainer))
