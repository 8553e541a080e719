"""GapSession: the TRL adapter as one object, held by the trainer as ``trainer._gap_session``.

It owns the adapter's state (:class:`~bloggap_plugin.trl.state.GapState`, ``session.state``), its scoring
(:class:`~bloggap_plugin.trl.scorer.Scorer`, ``session.scorer``: plans, kept sets, every extra forward) and its
metrics (:class:`~bloggap_plugin.trl.stats.Stats`, ``session.stats``: old log-probs into TRL's batch,
generation-time and loss-time statistics, their reduction across processes), and runs the logic of each TRL hook
that :class:`~bloggap_plugin.trl.mixin.GapMixin` overrides (the sampler record, the old log-probs, the probe rows,
arm G's per-micro-batch scores, the training forward's positions and kept sets, the loss-time metrics, timing).
The trainer's attributes are read through ``session.trainer``; the next implementation of a hook (TRL's, or the
instance's original under :class:`~bloggap_plugin.trl.GapCallback`) is ``trainer._gap_next``.
"""

from __future__ import annotations

import time
import warnings
import weakref

import torch

from bloggap_plugin.trl.scorer import Scorer
from bloggap_plugin.trl.state import GapState, GenerationMaxima, GenerationSums, StepTimes, fit_width
from bloggap_plugin.trl.stats import Stats

__all__ = ["GapSession"]


class GapSession:
    """The adapter's state and logic for one trainer (made at attach, after every check has passed)."""

    def __init__(self, trainer, state: GapState):
        # a weak proxy: the trainer holds the session, so a strong reference back would keep a finished trainer (its
        # model, optimizer and progress bar) alive until the garbage collector's next cycle pass
        trainer = weakref.proxy(trainer)
        self.trainer = trainer
        self.state = state
        self.scorer = Scorer(trainer, state)
        self.stats = Stats(trainer, state, self.scorer)
        gap = state.config
        if state.arm.plan is not None and not (state.arm.takes_layers and gap.layers is None):
            state.resources.plan = self.scorer.make_plan(state.arm.plan, layers=gap.layers, k=gap.k)
        if state.arm.onpolicy_forward:
            state.resources.onpolicy = self.scorer.make_onpolicy_forward()

    def close(self) -> None:
        """Close the session's plans (their weight copies and hooks)."""
        self.scorer.close()

    def generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's generation, timed into the step's ``gap/time/generate_s``; with HF ``generate`` and a recorder, its
        sampled tokens' kept sets and log-probs recorded (:meth:`recorded_generation`)."""
        start = time.perf_counter()
        try:
            if self.state.resources.recorder is None:
                return self.trainer._gap_next("_generate_single_turn", prompt_ids, images, multimodal_fields,
                                              num_generations, has_tool_images)
            return self.recorded_generation(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        finally:
            self.state.totals.step_generate += time.perf_counter() - start

    def recorded_generation(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        recorder = self.state.resources.recorder
        unwrapped = self.trainer.accelerator.unwrap_model(self.trainer.model_wrapped)
        had_own = "generate" in unwrapped.__dict__
        original_generate = unwrapped.generate
        captured: dict = {}
        unwrapped.generate = self.recording_generate(unwrapped, original_generate, recorder, captured)
        try:
            result = self.trainer._gap_next(
                "_generate_single_turn", prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        finally:
            if had_own:
                unwrapped.generate = original_generate
            else:
                del unwrapped.generate
        if "sequences" in captured:
            self.keep_record(recorder, captured["sequences"], captured["prompt_width"])
        return result

    def recording_generate(self, unwrapped, original_generate, recorder, captured: dict):
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

    def keep_record(self, recorder, sequences: torch.Tensor, prompt_width: int) -> None:
        """Finalise the recorder's record of ``sequences`` ``[B, prompt + completion]`` until TRL's batch exists."""
        from bloggap_plugin.sampling import SamplerRecordError

        state = self.state
        start = time.perf_counter()
        try:
            state.generation.pending_record = recorder.finalize(sequences, prompt_width,
                                                                eos_token_id=list(self.trainer.eos_token_ids))
            state.generation.pending_completion = sequences[:, prompt_width:]
        except SamplerRecordError as err:  # generate replaced / mocked, or ran without the recorder
            warnings.warn(f"bloggap: {err}; gap/sampler metrics dropped for this generation", stacklevel=4)
        state.totals.time += time.perf_counter() - start

    def align_record(self, output: dict) -> None:
        """Put the sampler record, aligned to TRL's completion tensor, into ``output`` under gap_* keys."""
        state = self.state
        record, state.generation.pending_record = state.generation.pending_record, None
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
        seen = state.generation.pending_completion[:, :common].to(device)
        if not torch.equal((seen * mask[:, :common]), (completion_ids[:, :common] * mask[:, :common])):
            raise RuntimeError("bloggap: the recorded sampler tokens differ from TRL's completions (alignment bug)")
        output["gap_sampler_logps"] = fit_width(record.processed_logps, width, device=device) * mask
        output["gap_sampler_full_logps"] = fit_width(record.logps, width, device=device) * mask
        if state.settings.kept_on:
            output["gap_kept_sizes"] = fit_width(record.kept_sizes, width, device=device) * mask
            output["gap_sampler_log_kept_mass"] = fit_width(record.log_kept_mass, width, device=device) * mask
            ids = record.kept_ids_tensor()
            if ids is not None:
                output["gap_kept_ids"] = fit_width(ids, width, -1, device).masked_fill(~mask.bool().unsqueeze(-1), -1)

    def generate_and_score_completions(self, inputs):
        state = self.state
        if not self.trainer.model.training:  # evaluation: TRL's own; the training generation's values stay as they are
            return self.trainer._gap_next("_generate_and_score_completions", inputs)
        # arms G and I: the arm's scores (G: per micro-batch in ``_prepare_inputs``; I: below) take the place of
        # TRL's old-logprob pass
        skip_old = state.arm.replaces_trl_old_pass and self.stats.trl_computes_old()
        with state.trl_generation(skip_old) as generation:  # a fresh generation: nothing of the last one is visible
            output = self.trainer._gap_next("_generate_and_score_completions", inputs)
        start = time.perf_counter()
        gap = state.config
        state.totals.generations += 1
        # every old log-prob of this generation (TRL's, the arm's here, arm G's after the shuffle) is computed before
        # the next optimizer step: a loss pass at a later step sees the update (gap/update/*), not the gap
        generation.old_step = self.trainer.state.global_step
        generation.probe_now = self.stats.probe_scheduled()
        generation.sums, generation.maxima = GenerationSums(), GenerationMaxima()
        generation.measure_now = measure = (state.totals.generations - 1) % gap.metrics_every == 0
        self.align_record(output)
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attn = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        logits_to_keep = output["completion_ids"].shape[1]
        # vLLM kept sets: every generation when they renormalise, on measured generations when they only measure
        if state.settings.kept_source == "sampling_mask":  # vLLM's own kept sets: no scoring pass
            self.scorer.mask_kept_sets(output)
        elif (self.trainer.use_vllm and state.settings.kept_on and output.get("sampling_per_token_logps") is not None
                and (state.settings.renormalize or measure)):
            self.scorer.vllm_kept_sets(output, ids, attn, logits_to_keep)
        if state.arm.prefill_in_one_step and self.trainer.use_vllm:
            self.check_one_step_prefill(output)
        skipped = generation.old_skipped and not state.arm.scores_after_shuffle  # arm I: TRL's pass left a placeholder
        trl_old = None if skipped else output.get("old_per_token_logps")
        generation.drives = trl_old is not None or skipped or gap.force_old_logprobs
        self.probe_rows(output, ids, attn, logits_to_keep)
        # arms I and J: the mask on the host, read once here: their old pass and arm J's training forwards lay out
        # their rows from it (J's through the batch, shuffled and split with it), so none of them waits on the device
        onpolicy = state.resources.onpolicy is not None
        host_attn = attn.cpu() if onpolicy or getattr(state.resources.plan, "host_layout", False) else None
        replaced = 0.0
        if not state.arm.scores_after_shuffle:
            # TRL's own old pass ran before the vLLM kept sets existed: renormalising re-scores it
            from_arm = not (state.arm.keeps_trl_forward and trl_old is not None
                            and not (self.trainer.use_vllm and state.settings.renormalize))
            if not from_arm:
                old = trl_old.float()
            else:
                batch_size = self.trainer.args.per_device_train_batch_size
                scored = time.perf_counter()
                old = self.scorer.arm_scores(ids, attn if host_attn is None else host_attn, logits_to_keep,
                                             batch_size, self.scorer.kept_from(output))
                old = old.to(ids.device)
                if skipped:  # in place of TRL's skipped pass: TRL's cost, logged apart (gap/time/old_pass_s)
                    replaced = time.perf_counter() - scored
                if trl_old is not None:
                    output["gap_trl_old_logps"] = trl_old
            self.stats.install_old(output, old)
            if from_arm and (skipped or trl_old is not None):
                # TRL logged sampling/* from the pass just replaced (or its placeholder): recompute them from the
                # old log-probs (and IS ratio) the loss reads
                self.stats.trl_sampling_metrics([output])
            if measure:
                self.stats.generation_metrics(output, ids, attn, logits_to_keep)
        if onpolicy:
            output["gap_host_mask"] = host_attn
        state.totals.time += time.perf_counter() - start - replaced
        state.totals.replaced_time += replaced
        return output

    def check_one_step_prefill(self, output: dict) -> None:
        """Refuse (``RecipeError``) a generation whose prompts the colocate engine prefilled in more than one step
        (:func:`~bloggap_plugin.trl.vllm_colocate.prefill_refusal`); an engine whose budget cannot be read passes."""
        from bloggap_plugin.recipes import RecipeError
        from bloggap_plugin.trl.colocate_reads import colocate_engine_setting
        from bloggap_plugin.trl.vllm_colocate import prefill_refusal

        budget = colocate_engine_setting(self.trainer, "max_num_batched_tokens")
        refusal = prefill_refusal(int(output["prompt_mask"].sum()), budget, self.state.arm.letter)
        if refusal:
            raise RecipeError(refusal)

    def probe_rows(self, output: dict, ids, attn, logits_to_keep: int) -> None:
        """``gap_probe_row`` ``[B]`` (rows drawn with the private generator on due generations) and, for those rows,
        ``gap_ref_logps`` ``[B, K]``: the fp32 batch-1 reference (NaN elsewhere)."""
        state = self.state
        gap = state.config
        n_rows = ids.shape[0]
        probe = torch.zeros(n_rows, dtype=torch.bool, device=ids.device)
        if self.stats.probe_due():
            chosen = torch.randperm(n_rows, generator=state.resources.generator)[: gap.probe_rows]
            probe[chosen.to(ids.device)] = True
            rows = probe.nonzero().squeeze(-1)
            ref = torch.full((n_rows, logits_to_keep), float("nan"), device=ids.device)
            ref_kept = self.scorer.kept_from(output, rows)
            with self.stats.probe_timer(ids.device):
                ref[rows] = self.scorer.plan_scores(
                    self.scorer.reference_plan(), ids[rows], attn[rows], logits_to_keep, 1, kept=ref_kept
                ).to(ref.device)
            output["gap_ref_logps"] = ref
        output["gap_probe_row"] = probe

    def prepare_inputs(self, generation_batch):
        state = self.state
        generate_every = self.trainer.args.steps_per_generation * self.trainer.num_iterations
        will_generate = self.trainer._step % generate_every == 0 or self.trainer._buffered_inputs is None
        inputs = self.trainer._gap_next("_prepare_inputs", generation_batch)
        if not will_generate:
            return inputs
        start = time.perf_counter()
        replaced = 0.0
        if state.arm.scores_after_shuffle and (state.generation.drives or state.generation.measure_now):
            # driving: its scores are the old log-probs (replacing TRL's skipped pass, or forced); measure-only (TRL
            # computes none): a metrics pass, gated by gap.metrics_every like the other generation-time metrics
            replaced = self.score_buffered(self.trainer._buffered_inputs)
        # the pass that replaces TRL's own is TRL's cost, not the plugin's: logged apart (gap/time/old_pass_s)
        state.totals.time += time.perf_counter() - start - replaced
        state.totals.replaced_time += replaced
        self.stats.flush_generation()
        return inputs

    def score_buffered(self, batches: list) -> float:
        """Score each buffered training micro-batch exactly as the training forward will see it (rows, order,
        one chunk) and install the scores; returns the seconds spent in place of TRL's skipped pass."""
        state = self.state
        replaced = 0.0
        for batch in batches:
            ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
            attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
            logits_to_keep = batch["completion_ids"].shape[1]
            if "old_per_token_logps" in batch and not state.generation.old_skipped:
                batch["gap_trl_old_logps"] = batch["old_per_token_logps"]
            scored = time.perf_counter()
            old = self.scorer.trl_scores(ids, attn, logits_to_keep, None, self.scorer.kept_from(batch))
            if state.generation.old_skipped:
                replaced += time.perf_counter() - scored
            self.stats.install_old(batch, old)
            if state.generation.measure_now:
                self.stats.generation_metrics(batch, ids, attn, logits_to_keep)
        if state.generation.old_skipped:
            self.stats.trl_sampling_metrics(batches)
        return replaced

    def per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                      compute_entropy=False, compute_aux_loss=False, **kwargs):
        state = self.state
        is_policy = model is self.trainer.model or model is getattr(self.trainer, "model_wrapped", None)
        # TRL's separate reference model (beta > 0 without PEFT) is scored like the policy's training forward
        # (same positions), so that KL(theta || theta_ref) is exactly 0 at theta = theta_ref.
        ref_model = getattr(self.trainer, "ref_model", None)
        is_reference = ref_model is not None and model is ref_model
        if not (is_policy or is_reference):
            return self.trainer._gap_next("_get_per_token_logps_and_entropies", model, input_ids, attention_mask,
                                  logits_to_keep, batch_size, compute_entropy, compute_aux_loss, **kwargs)
        generation, loss = state.generation, state.loss  # loss: None outside TRL's _compute_loss
        if is_policy and generation.skip_old and not torch.is_grad_enabled() and loss is None:
            # TRL's old-logprob pass under an arm that replaces it (G, I): the first grad-free policy call inside
            # TRL's _generate_and_score_completions. A NaN placeholder of the same shape stands in (TRL's IS ratio and
            # sampling/* statistics from it are recomputed from the arm's scores: I's right after TRL's function
            # returns, G's in _prepare_inputs); every micro-batch gets the arm's scores before any loss reads them.
            generation.skip_old = False
            generation.old_skipped = True
            placeholder = torch.full((input_ids.shape[0], logits_to_keep), float("nan"), dtype=torch.float32,
                                     device=input_ids.device)
            return placeholder, None, None
        if is_policy and loss is not None and state.resources.onpolicy is not None:
            # arm J: the training forward in the old log-probs' form (vLLM's numbers), over the policy's parameters
            logps, entropies = self.scorer.onpolicy_logps(input_ids, attention_mask, logits_to_keep, batch_size,
                                                          compute_entropy, host_mask=loss.host_mask)
            loss.new_logps = logps.detach()
            return logps, entropies, None
        kept = loss.kept if is_policy and loss is not None else None
        record = generation.pending_record
        if (kept is None and state.settings.renormalize and loss is None and record is not None
                and record.logps.shape[0] == input_ids.shape[0]):
            # TRL's own old-logprob pass and its reference pass (separate model, or PEFT's adapter-disabled
            # policy): renormalised over the same kept sets as the training forward, so KL is 0 at theta_ref
            kept = self.scorer.kept_from_record(record, logits_to_keep)
        logps, entropies, aux = self.scorer.policy_logps(
            model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
            kept=kept, renormalize=state.settings.renormalize, **kwargs,
        )
        if loss is not None and is_policy:
            loss.new_logps = logps.detach()
        return logps, entropies, aux

    def compute_loss(self, model, inputs):
        state = self.state
        start = time.perf_counter()
        loss_inputs = inputs
        if state.config.is_correction and inputs.get("gap_is_ratio") is not None:
            # TRL multiplies the per-token loss by the IS ratio only with vLLM; every GRPO loss except vespo is
            # positively homogeneous in the advantage, so scaling A by w >= 0 is the same product.
            loss_inputs = dict(inputs)
            advantages = inputs["advantages"]
            if advantages.dim() == 1:
                advantages = advantages.unsqueeze(1)
            loss_inputs["advantages"] = advantages * inputs["gap_is_ratio"]
        kept = self.scorer.kept_from(inputs) if state.settings.renormalize else None
        # TRL's _compute_loss calls the training forward back: it reads the pass's kept sets and leaves its log-probs
        # there for the loss-time metrics; none of it outlives the pass
        with state.loss_pass(kept, host_mask=inputs.get("gap_host_mask")):
            state.totals.time += time.perf_counter() - start
            loss = self.trainer._gap_next("_compute_loss", model, loss_inputs)
            start = time.perf_counter()
            self.stats.loss_metrics(inputs)
            state.totals.time += time.perf_counter() - start
        return loss

    def training_step(self, *args, **kwargs):
        state = self.state
        totals = state.totals
        before = totals.time
        start = time.perf_counter()
        output = self.trainer._gap_next("training_step", *args, **kwargs)
        totals.step_wall += time.perf_counter() - start
        totals.step_plugin += totals.time - before
        if self.trainer._step % self.trainer.current_gradient_accumulation_steps == 0:
            times = self.stats.reduce(StepTimes(totals.step_plugin, totals.step_wall, totals.replaced_time,
                                                totals.step_probe, totals.step_generate))
            totals.probe_total += times.probe  # the probe budget's totals: reduced, so alike on every process
            totals.wall_total += times.wall
            procs = self.trainer.accelerator.num_processes
            values = {"gap/time/scoring_s": times.plugin / procs,
                      "gap/time/overhead_frac": times.plugin / times.wall if times.wall > 0 else 0.0,
                      "gap/time/generate_s": times.generate / procs}
            if state.arm.replaces_trl_old_pass:
                # the arm's old-logprob pass in place of TRL's (0 on steps that reuse a generation)
                values["gap/time/old_pass_s"] = times.replaced / procs
            self.stats.log(values)
            totals.step_wall = totals.step_plugin = totals.replaced_time = totals.step_probe = 0.0
            totals.step_generate = 0.0
        return output
