"""The adapter's metrics: the arm's old log-probs installed into TRL's batch, generation-time and loss-time
statistics, and their reduction across processes (named :class:`~bloggap_plugin.trl.state.Statistics`).

:class:`Stats` is owned by :class:`~bloggap_plugin.trl.session.GapSession` and reads its state. Every logged ``gap/*`` value is a
global ratio: per-process sums are reduced (summed, or maxed) before dividing. Every name is a registered TRL metric
(:mod:`bloggap_plugin.core.metric_specs`); the ratio new/old goes under ``gap/ratio/*`` (its clip statistics under
``gap/clip/*``) where no optimizer step lies between the generation's old log-probs and the loss pass, else under
``gap/update/*`` (and ``gap/update_clip/*``).
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from bloggap_plugin.core import metrics as gap_metrics
from bloggap_plugin.core.metric_specs import clip_name, ratio_name, registered
from bloggap_plugin.core.sharding import all_ranks_true
from bloggap_plugin.trl.kept_source import KEPT_SOURCE_CODES
from bloggap_plugin.trl.scorer import Scorer
from bloggap_plugin.trl.state import (
    FallbackCount,
    GapState,
    LossMaxima,
    LossSums,
    Statistics,
    completion_mask,
)

__all__ = ["Stats", "is_ratio"]


def _masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """0-d float64: the sum of ``values`` (numbers or bools) where ``mask``; no host read."""
    return values.double().masked_fill(~mask, 0.0).sum()


def _masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """0-d float64: the largest of ``values`` where ``mask`` (``-inf`` where it selects nothing); no host read."""
    values = values.double()
    if values.numel() == 0:
        return torch.full((), -math.inf, dtype=torch.float64, device=values.device)
    return values.masked_fill(~mask, -math.inf).amax()


def is_ratio(old_logps, sampler_logps, mask, mode: str, clip_min, clip_max) -> torch.Tensor:
    """TRL 1.16's importance-sampling ratio (``GRPOTrainer._generate_and_score_completions``): ``[B, T]``
    (token_* modes) or ``[B, 1]`` (sequence_* modes)."""
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


class Stats:
    """Old log-probs into the batch, and the gap/* metrics of one trainer (state: the session's :class:`GapState`;
    the extra forwards the metrics need: its :class:`~bloggap_plugin.trl.scorer.Scorer`)."""

    def __init__(self, trainer, state: GapState, scorer: Scorer):
        self.trainer = trainer
        self.state = state
        self.scorer = scorer

    def install_old(self, batch: dict, old: torch.Tensor) -> None:
        """Put the arm's old log-probs where the loss reads them (or aside, measure-only) and redo IS ratios."""
        if self.state.generation.drives:
            batch["old_per_token_logps"] = old
        else:
            batch["gap_old_logps"] = old
        mask = completion_mask(batch)
        settings = (self.trainer.vllm_importance_sampling_mode, self.trainer.vllm_importance_sampling_clip_min,
                    self.trainer.vllm_importance_sampling_clip_max)
        if self.trainer.use_vllm and self.trainer.vllm_importance_sampling_correction and "sampling_per_token_logps" in batch:
            batch["importance_sampling_ratio"] = is_ratio(old, batch["sampling_per_token_logps"], mask, *settings)
        if self.state.config.is_correction and "gap_sampler_logps" in batch:
            batch["gap_is_ratio"] = is_ratio(old, batch["gap_sampler_logps"], mask, *settings)

    def old_of(self, batch: dict):
        """The arm's old log-probs in ``batch`` (where the loss reads them, or the measure-only key)."""
        return batch.get("old_per_token_logps") if self.state.generation.drives else batch.get("gap_old_logps")

    def trl_computes_old(self) -> bool:
        """Whether TRL 1.16 runs its own old-logprob pass this generation (``_generate_and_score_completions``)."""
        generate_every = self.trainer.args.steps_per_generation * self.trainer.num_iterations
        return bool(self.trainer.args.gradient_accumulation_steps % generate_every != 0
                    or (self.trainer.use_vllm and self.trainer.vllm_importance_sampling_correction))

    def generation_metrics(self, batch: dict, ids, attn, logits_to_keep) -> None:
        """Sampler, kept-set and probe statistics of one (pre- or post-shuffle) batch into the generation sums."""
        state = self.state
        sums, maxima = state.generation.sums, state.generation.maxima
        old = self.old_of(batch)
        mask = completion_mask(batch).bool()
        band = state.config.band
        sampler = batch.get("gap_sampler_logps")
        if sampler is None and "sampling_per_token_logps" in batch:
            sampler = batch["sampling_per_token_logps"]
            mask = mask & ~torch.isnan(sampler)
        if sampler is not None:  # masked sums on the device: an empty mask adds 0 (and -inf to the maximum)
            diff = (old.double() - sampler.double()).abs()
            sums.sampler_oob += _masked_sum(gap_metrics.out_of_band(old, sampler, band), mask)
            sums.sampler_n += mask.sum(dtype=torch.float64)
            sums.sampler_absd += _masked_sum(diff, mask)
            sums.sampler_exact += _masked_sum(diff == 0, mask)
            maxima.raise_to(sampler_absd_max=_masked_max(diff, mask))
        self.is_ratio_metrics(batch)
        # the kept-set pass is a forward: under FSDP2 every process must take it, also one without any completion
        # token (e.g. mask_truncated_completions with every row truncated) or without kept sets (its sampler record
        # was lost, with a warning): such a process takes the same pass and adds nothing
        has_kept = "gap_kept_sizes" in batch
        if state.settings.kept_on and not all_ranks_true([not has_kept], self.scorer.policy())[0]:
            if has_kept:
                self.kept_metrics(batch, ids, attn, logits_to_keep, old, sampler, mask)
            else:
                self.scorer.trainer_log_mass(batch, ids, attn, logits_to_keep, [])
        probe = batch.get("gap_probe_row")
        if probe is not None and self.probe_due() and probe.any():  # no host read off probe generations
            rows = probe.nonzero().squeeze(-1)
            with self.probe_timer(ids.device):
                b1 = self.scorer.probe_b1(batch, ids[rows], attn[rows], logits_to_keep, rows)
            pmask = mask[rows]
            if pmask.any():
                out, n = gap_metrics.oob_count(b1, old[rows].to(b1.device), pmask, band)
                sums.probe_oob += out
                sums.probe_n += n

    def is_ratio_metrics(self, batch: dict) -> None:
        """vLLM path: TRL's own IS-ratio statistic (rows for sequence-level modes, masked tokens otherwise)."""
        ratio = batch.get("importance_sampling_ratio")
        if ratio is None or not self.trainer.use_vllm:
            return
        sequence_level = self.trainer.vllm_importance_sampling_mode in ("sequence_mask", "sequence_truncate")
        ratio = ratio.double()
        counted = torch.ones_like(ratio, dtype=torch.bool) if sequence_level else completion_mask(batch).bool()
        sums, maxima = self.state.generation.sums, self.state.generation.maxima
        sums.is_sum += _masked_sum(ratio, counted)
        sums.is_n += counted.sum(dtype=torch.float64)
        maxima.raise_to(is_max=_masked_max(ratio, counted), is_neg_min=_masked_max(-ratio, counted))

    def kept_metrics(self, batch: dict, ids, attn, logits_to_keep, old, sampler, mask) -> None:
        """Kept mass and size, and the ratio to the sampler before (full vocabulary) and after renormalisation."""
        state = self.state
        sums, maxima, band = state.generation.sums, state.generation.maxima, state.config.band
        sizes = batch["gap_kept_sizes"]
        # before: trainer full-vocabulary vs sampler; after: renormalised over the kept set
        trainer_mass = self.scorer.trainer_log_mass(batch, ids, attn, logits_to_keep, [])
        before, after = (old + trainer_mass, old) if state.settings.renormalize else (old, old - trainer_mass)
        # vLLM's sampling mask carries no mass: the trainer's over the sampler's exact sets
        log_mass = batch.get("gap_sampler_log_kept_mass", trainer_mass)
        mass = torch.exp(log_mass.double())
        sums.kept_mass_sum += _masked_sum(mass, mask)
        sums.kept_size_sum += _masked_sum(sizes, mask)
        sums.kept_n += mask.sum(dtype=torch.float64)
        maxima.raise_to(kept_mass_neg_min=_masked_max(-mass, mask), kept_size_max=_masked_max(sizes, mask))
        sums.kept_ratio_before_sum += _masked_sum(torch.exp(before.double() - sampler.double()), mask)
        sums.kept_ratio_after_sum += _masked_sum(torch.exp(after.double() - sampler.double()), mask)
        sums.kept_oob_before += _masked_sum(gap_metrics.out_of_band(before, sampler, band), mask)
        sums.kept_oob_after += _masked_sum(gap_metrics.out_of_band(after, sampler, band), mask)

    def trl_sampling_metrics(self, batches: list) -> None:
        """TRL's own ``sampling/*`` statistics of this generation (TRL's vLLM path), recomputed by TRL's definitions
        (``_generate_and_score_completions``) from the arm's old log-probs and IS ratio over the whole generation
        batch of this process (``batches``: its micro-batches, or the one generation output), in place of the values
        TRL logged from its own pass: G's skipped pass's placeholder (difference 0, ratio 1), or the pass a planned
        arm's old log-probs replaced."""
        if not (self.trainer.use_vllm and self.trainer.vllm_importance_sampling_correction):
            return
        from trl.trainer.utils import nanmax, nanmin

        def joined(key):
            return torch.cat([b[key] for b in batches], dim=0)

        old, sampling = joined("old_per_token_logps"), joined("sampling_per_token_logps")
        ratio = joined("importance_sampling_ratio")
        mask = torch.cat([completion_mask(b) for b in batches], dim=0).bool()
        zero = torch.tensor(0.0, device=self.trainer.accelerator.device)
        gather = self.trainer.accelerator.gather
        delta = torch.abs(old - sampling)
        delta = delta[mask & ~torch.isnan(delta)]
        sequence_level = self.trainer.vllm_importance_sampling_mode in ("sequence_mask", "sequence_truncate")
        flat = ratio.flatten() if sequence_level else ratio[mask]
        values = {
            "sampling/sampling_logp_difference/mean": gather(torch.mean(delta) if delta.numel() > 0 else zero).mean().item(),
            "sampling/sampling_logp_difference/max": gather(torch.max(delta) if delta.numel() > 0 else zero).max().item(),
            "sampling/importance_sampling_ratio/min": nanmin(gather(torch.min(flat) if flat.numel() > 0 else zero)).item(),
            "sampling/importance_sampling_ratio/mean": gather(torch.mean(flat) if flat.numel() > 0 else zero).nanmean().item(),
            "sampling/importance_sampling_ratio/max": nanmax(gather(torch.max(flat) if flat.numel() > 0 else zero)).item(),
        }
        metrics = self.trainer._metrics["train"]
        for key, value in values.items():
            if metrics.get(key):
                metrics[key][-1] = value

    def reduce(self, values: Statistics) -> Statistics:
        """``values`` summed field by field over the processes (one process: ``values`` as they are, no device trip)."""
        if self.trainer.accelerator.num_processes == 1:
            return values
        tensor = self.trainer.accelerator.reduce(values.to_tensor(self.trainer.accelerator.device), reduction="sum")
        return type(values).from_tensor(tensor)

    def flush_generation(self) -> None:
        """Reduce one generation's statistics and log them (measured generations only), plus the fp16 fallbacks."""
        state = self.state
        local_sums, local_maxima = state.generation.sums, state.generation.maxima
        state.generation.sums = state.generation.maxima = None
        if local_sums is None or not state.generation.measure_now:
            return
        sums, maxima = self.reduce_pair(local_sums, local_maxima)
        values: dict[str, float] = {}
        if sums.sampler_n > 0:
            values.update({"gap/sampler/oob_frac": sums.sampler_oob / sums.sampler_n,
                           "gap/sampler/abs_dlogp_mean": sums.sampler_absd / sums.sampler_n,
                           "gap/sampler/abs_dlogp_max": maxima.sampler_absd_max,
                           "gap/sampler/exact_frac": sums.sampler_exact / sums.sampler_n})
        if sums.is_n > 0:
            values.update({"gap/sampler/is_ratio_mean": sums.is_sum / sums.is_n,
                           "gap/sampler/is_ratio_min": -maxima.is_neg_min, "gap/sampler/is_ratio_max": maxima.is_max})
        if sums.probe_n > 0:
            values["gap/probe/oob_b1_vs_bN"] = sums.probe_oob / sums.probe_n
        if sums.kept_n > 0:
            n = sums.kept_n
            values.update({"gap/kept/mass_mean": sums.kept_mass_sum / n, "gap/kept/mass_min": -maxima.kept_mass_neg_min,
                           "gap/kept/size_mean": sums.kept_size_sum / n, "gap/kept/size_max": maxima.kept_size_max,
                           "gap/kept/ratio_before_mean": sums.kept_ratio_before_sum / n,
                           "gap/kept/ratio_after_mean": sums.kept_ratio_after_sum / n,
                           "gap/kept/oob_before": sums.kept_oob_before / n, "gap/kept/oob_after": sums.kept_oob_after / n,
                           "gap/kept/source": KEPT_SOURCE_CODES[state.settings.kept_source]})
        plans = (state.resources.plan, state.resources.ref_plan)
        fallbacks = max([int(getattr(plan, "fp16_fallbacks", 0) or 0) for plan in plans
                         if plan is not None], default=0)
        new = fallbacks - state.totals.fallbacks_seen
        state.totals.fallbacks_seen = fallbacks
        values["gap/fp16/fallbacks"] = self.reduce(FallbackCount(float(new))).new
        self.log(values)

    def log(self, values: dict[str, float]) -> None:
        """Append each value to TRL's metric store under its name, which must be a registered TRL metric
        (:mod:`bloggap_plugin.core.metric_specs`)."""
        metrics = self.trainer._metrics["train"]
        for name, value in values.items():
            metrics[registered(name, "trl")].append(value)

    def update_since_old(self) -> bool:
        """Whether an optimizer step was taken since this generation's old log-probs were computed (then the ratio
        new/old holds the policy update, logged as ``gap/update/*`` and ``gap/update_clip/*``; else the numerical gap,
        ``gap/ratio/*`` and ``gap/clip/*``)."""
        return self.trainer.state.global_step != self.state.generation.old_step

    def loss_metrics(self, inputs) -> None:
        """Ratio, clip and old-vs-TRL statistics of one training micro-batch (new: the training forward's), computed on
        the device and read back with one transfer (each host read waits for the GPU)."""
        state = self.state
        new = state.new_logps  # inside the loss pass (GapState.loss_pass), which drops it on exit
        old = self.old_of(inputs)
        if new is None or old is None:
            return
        local, local_max = self.loss_sums(inputs, new.float(), old.to(new.device).float())
        sums, maxima = self.reduce_pair(local, local_max)
        n = sums.tokens
        if n <= 0:
            return
        update = self.update_since_old()
        values = {ratio_name("oob_frac", update, "trl"): sums.oob / n,
                  ratio_name("abs_dlogp_mean", update, "trl"): sums.abs_dlogp / n,
                  ratio_name("abs_dlogp_max", update, "trl"): maxima.abs_dlogp_max,
                  ratio_name("exact_frac", update, "trl"): sums.exact / n}
        if state.settings.clip_applies:
            values[clip_name("clipped_frac", update, "trl")] = sums.clipped / n
            if sums.probe_tokens > 0:  # a micro-batch without probe tokens has no share to average in
                values[clip_name("flip_frac", update, "trl")] = sums.flips / sums.probe_tokens
        if sums.has_trl > 0:
            values["gap/old_vs_trl/oob_frac"] = sums.oob_vs_trl / n
            values["gap/old_vs_trl/abs_dlogp_mean"] = sums.abs_dlogp_vs_trl / n
        self.log(values)

    def reduce_pair(self, sums: Statistics, maxima: Statistics) -> tuple[Statistics, Statistics]:
        """``sums`` summed and ``maxima`` maxed field by field over the processes (fields: numbers or 0-d device
        tensors), read back to the host once for both."""
        device = self.trainer.accelerator.device
        summed, maxed = sums.to_tensor(device), maxima.to_tensor(device)
        if self.trainer.accelerator.num_processes > 1:
            summed = self.trainer.accelerator.reduce(summed, reduction="sum")
            maxed = self.trainer.accelerator.gather(maxed.unsqueeze(0)).max(dim=0).values
        values = torch.cat([summed, maxed]).tolist()
        return type(sums)(*values[: len(sums)]), type(maxima)(*values[len(sums):])

    def loss_sums(self, inputs: dict, new: torch.Tensor, old: torch.Tensor) -> tuple[LossSums, LossMaxima]:
        """This process's :class:`LossSums` and :class:`LossMaxima` of one micro-batch (fp32 ``[B, K]`` inputs), as 0-d
        device tensors, without a host read: masks multiply instead of selecting, and the probe rows' clip status is
        taken on every row and counted on the probe rows only (the status is per row, also at sequence level)."""
        mask = completion_mask(inputs).bool()
        band = self.state.config.band
        advantages = inputs["advantages"]
        trl_old = inputs.get("gap_trl_old_logps")
        local = LossSums(has_trl=float(trl_old is not None))
        dlogp = new.double() - old.double()
        absd = dlogp.abs()
        local.tokens = mask.sum(dtype=torch.float64)
        local.oob = _masked_sum(gap_metrics.out_of_band(new, old, band), mask)
        local.abs_dlogp = _masked_sum(absd, mask)
        local.exact = _masked_sum(dlogp == 0, mask)
        clipped = self.clip_status(new - old, advantages, mask)
        probe = inputs.get("gap_probe_row")
        ref = inputs.get("gap_ref_logps")
        if clipped is not None:
            local.clipped = _masked_sum(clipped, mask)
            if probe is not None and ref is not None:
                on_probe = mask & probe.to(mask.device).unsqueeze(-1)
                clipped_ref = self.clip_status(new - ref.to(new.device).float(), advantages, on_probe)
                local.flips = _masked_sum(clipped != clipped_ref, on_probe)
                local.probe_tokens = on_probe.sum(dtype=torch.float64)
        if trl_old is not None:
            trl_old = trl_old.to(new.device).float()
            local.oob_vs_trl = _masked_sum(gap_metrics.out_of_band(old, trl_old, band), mask)
            local.abs_dlogp_vs_trl = _masked_sum((old.double() - trl_old.double()).abs(), mask)
        return local, LossMaxima(abs_dlogp_max=_masked_max(absd, mask))

    def probe_due(self) -> bool:
        """Whether this generation has probe rows (decided by :meth:`_gap_probe_scheduled` when it began)."""
        return self.state.generation.probe_now

    def probe_scheduled(self) -> bool:
        """Whether the generation that begins gets probe rows (host-side, the same on every process): due every
        ``metrics_every * probe_every`` generations when ``probe_rows`` > 0, and within ``probe_budget`` (the probe's
        seconds so far at most that share of the training seconds so far, both reduced over processes)."""
        state = self.state
        gap = state.config
        due = gap.probe_rows > 0 and (state.totals.generations - 1) % (gap.metrics_every * gap.probe_every) == 0
        if not due or gap.probe_budget <= 0:
            return due
        return state.totals.probe_total <= gap.probe_budget * state.totals.wall_total

    @contextlib.contextmanager
    def probe_timer(self, device: torch.device):
        """Adds the seconds of the probe forwards inside to the step's probe time; waits for the device at the end
        (probe generations only), so the budget counts their GPU time, not only their launches."""
        started = time.perf_counter()
        try:
            yield
        finally:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.state.totals.step_probe += time.perf_counter() - started

    def clip_status(self, log_ratio, advantages, mask):
        """TRL's clip status ``[B, T]`` under this trainer's loss type, IS level, epsilons and delta (or None)."""
        return gap_metrics.trl_clip_status(
            log_ratio, advantages, mask, loss_type=self.trainer.loss_type, level=self.trainer.importance_sampling_level,
            eps_low=self.trainer.epsilon_low, eps_high=self.trainer.epsilon_high, delta=self.trainer.args.delta,
        )
