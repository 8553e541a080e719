"""``gap_vanilla``: verl's vanilla PPO policy loss plus ``gap/*`` ratio and clip-flip metrics.

Select it with ``actor_rollout_ref.actor.policy_loss.loss_mode=gap_vanilla``. The loss value and gradient are
exactly verl's ``vanilla``; only metrics are added (MEAN-aggregated over micro-batches by verl). The names and
definitions are registered in :mod:`bloggap_plugin.core.metric_specs` (framework ``verl``):

- ``gap/ratio/oob_frac``, ``gap/ratio/abs_dlogp_mean`` / ``_max``: the ratio ``exp(log_prob - old_log_prob)``
  on the first mini-batch after the old-logprob pass, where no optimizer step lies between the two passes: it
  should be exactly 1, so every out-of-band token there is the numerical gap (batch-shape noise, precision
  mismatch between the old-logprob pass and the training forward: verl #6280);
- ``gap/update/*``: the same statistics on later mini-batches and epochs, where the policy has moved: the update;
- ``gap/clip/flip_frac``: share of tokens whose PPO clip status (A>0 and r>1+eps_high, or A<0 and r<1-eps_low)
  differs from the status at ratio 1 (never clipped), i.e. tokens the ratio's deviation from 1 clips, on the first
  mini-batch;
- ``gap/clip/clipped_frac``: share of tokens clipped (same rule), on the first mini-batch;
- ``gap/update_clip/*``: both clip statistics on later mini-batches and epochs (the update's clipping).

Which mini-batch a loss call belongs to is counted by a wrapper around verl's ``TrainingWorker.train_mini_batch``
(:func:`patch_training_worker`): it counts the ``train_batch`` calls (one optimizer step each) since it began. A
call outside that loop (the loss called directly) counts as the first mini-batch.
"""

from __future__ import annotations

import functools
import threading

import torch

from bloggap_plugin.core.metric_specs import clip_name, ratio_name
from bloggap_plugin.core.metrics import abs_dlogp_stats, clip_flip_fraction, clipped_fraction, oob_fraction
from bloggap_plugin.verl.config import load_settings

LOSS_NAME = "gap_vanilla"
_STEPS = threading.local()
"""``_STEPS.count``: optimizer steps (``train_batch`` calls) since this worker's ``train_mini_batch`` began, or
absent outside it."""


def optimizer_steps_since_old() -> int:
    """Optimizer steps this process took since the old log-probs of the batch being trained (0 outside verl's
    ``train_mini_batch``)."""
    return getattr(_STEPS, "count", 0)


def patch_training_worker(module) -> None:
    """Wrap ``module.TrainingWorker.train_mini_batch`` (verl 0.9.1's ``verl.workers.engine_workers``) so that the
    loss knows how many optimizer steps its mini-batch follows; idempotent, a module without the class is left
    alone."""
    worker = getattr(module, "TrainingWorker", None)
    original = getattr(worker, "train_mini_batch", None)
    if original is None or getattr(original, "_bloggap_counts_steps", False):
        return

    @functools.wraps(original)
    def train_mini_batch(self, data):
        train_batch = self.train_batch  # each call: one mini-batch, one optimizer step at its end

        @functools.wraps(train_batch)
        def counted(*args, **kwargs):
            try:
                return train_batch(*args, **kwargs)
            finally:
                _STEPS.count += 1

        _STEPS.count = 0
        self.train_batch = counted  # on the instance: the class's registered method stays as verl made it
        try:
            return original(self, data)
        finally:
            del self.train_batch
            del _STEPS.count

    train_mini_batch._bloggap_counts_steps = True
    worker.train_mini_batch = train_mini_batch


def gap_ratio_metrics(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    band: float,
    update: bool = False,
) -> dict[str, float]:
    """The ``gap/*`` metrics for one micro-batch (all ``[B, T]`` inputs; empty mask -> empty dict); the ratio's
    statistics under ``gap/update/*`` and its clip statistics under ``gap/update_clip/*`` when an optimizer step lies
    between the old log-probs and ``log_prob`` (``update``), else under ``gap/ratio/*`` and ``gap/clip/*``."""
    mask = response_mask.bool()
    if not bool(mask.any()):
        return {}
    new = log_prob.detach().float()
    old = old_log_prob.detach().float()
    stats = abs_dlogp_stats(new, old, mask)
    ratio = torch.exp(new - old)
    return {
        ratio_name("oob_frac", update, "verl"): oob_fraction(new, old, mask, band),
        ratio_name("abs_dlogp_mean", update, "verl"): stats["mean"],
        ratio_name("abs_dlogp_max", update, "verl"): stats["max"],
        clip_name("flip_frac", update, "verl"): clip_flip_fraction(ratio, torch.ones_like(ratio), advantages.detach(),
                                                                   mask, eps_low, eps_high),
        clip_name("clipped_frac", update, "verl"): clipped_fraction(ratio, advantages.detach(), mask, eps_low, eps_high),
    }


def compute_policy_loss_gap_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
):
    """verl's ``compute_policy_loss_vanilla`` (same loss) with the ``gap/*`` metrics added."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    loss, metrics = compute_policy_loss_vanilla(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        config=config,
        rollout_is_weights=rollout_is_weights,
    )
    clip_ratio = config.clip_ratio
    eps_low = config.clip_ratio_low if config.clip_ratio_low is not None else clip_ratio
    eps_high = config.clip_ratio_high if config.clip_ratio_high is not None else clip_ratio
    band = load_settings().band  # BLOGGAP_VERL_BAND: the loss runs in workers, which see only the environment
    with torch.no_grad():
        metrics = dict(metrics)
        update = optimizer_steps_since_old() > 0
        metrics.update(gap_ratio_metrics(old_log_prob, log_prob, advantages, response_mask, eps_low, eps_high, band,
                                         update))
    return loss, metrics


def register_loss(core_algos) -> None:
    """Register ``gap_vanilla`` in verl's policy-loss registry (re-registering the same function is a no-op)."""
    if core_algos.POLICY_LOSS_REGISTRY.get(LOSS_NAME) is not compute_policy_loss_gap_vanilla:
        core_algos.register_policy_loss(LOSS_NAME)(compute_policy_loss_gap_vanilla)
