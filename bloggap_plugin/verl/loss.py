"""``gap_vanilla``: verl's vanilla PPO policy loss plus ``gap/*`` ratio and clip-flip metrics.

Select it with ``actor_rollout_ref.actor.policy_loss.loss_mode=gap_vanilla``. The loss value and gradient are
exactly verl's ``vanilla``; only metrics are added (MEAN-aggregated over micro-batches by verl):

- ``gap/ratio/oob_frac``: share of response tokens whose ``exp(log_prob - old_log_prob)`` is outside
  ``[1-b, 1+b]`` (b = ``BLOGGAP_VERL_BAND``, default 0.1);
- ``gap/ratio/abs_dlogp_mean`` / ``gap/ratio/abs_dlogp_max``: ``|log_prob - old_log_prob|`` (nats);
- ``gap/clip/flip_frac``: share of tokens whose PPO clip status (A>0 and r>1+eps_high, or A<0 and r<1-eps_low)
  differs from the status at ratio 1 (never clipped), i.e. tokens the ratio's deviation from 1 clips;
- ``gap/clip/clipped_frac``: share of tokens clipped (same rule).

At the first inner epoch of an on-policy step (ppo_epochs=1, one mini-batch) the ratio should be exactly 1, so
every out-of-band token and every flip there is spurious (batch-shape noise, precision mismatch between the
old-log-prob pass and the training forward: verl #6280). At later mini-batches/epochs the policy has moved and
the same numbers measure the real update.
"""

from __future__ import annotations

import torch

from bloggap_plugin.core.metrics import abs_dlogp_stats, clip_flip_fraction, clipped_fraction, oob_fraction
from bloggap_plugin.verl.config import load_settings

LOSS_NAME = "gap_vanilla"


def gap_ratio_metrics(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    band: float,
) -> dict[str, float]:
    """The ``gap/*`` metrics for one micro-batch (all ``[B, T]`` inputs; empty mask -> empty dict)."""
    mask = response_mask.bool()
    if not bool(mask.any()):
        return {}
    new = log_prob.detach().float()
    old = old_log_prob.detach().float()
    stats = abs_dlogp_stats(new, old, mask)
    ratio = torch.exp(new - old)
    return {
        "gap/ratio/oob_frac": oob_fraction(new, old, mask, band),
        "gap/ratio/abs_dlogp_mean": stats["mean"],
        "gap/ratio/abs_dlogp_max": stats["max"],
        "gap/clip/flip_frac": clip_flip_fraction(ratio, torch.ones_like(ratio), advantages.detach(), mask, eps_low, eps_high),
        "gap/clip/clipped_frac": clipped_fraction(ratio, advantages.detach(), mask, eps_low, eps_high),
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
        metrics.update(gap_ratio_metrics(old_log_prob, log_prob, advantages, response_mask, eps_low, eps_high, band))
    return loss, metrics


def register_loss(core_algos) -> None:
    """Register ``gap_vanilla`` in verl's policy-loss registry (re-registering the same function is a no-op)."""
    if core_algos.POLICY_LOSS_REGISTRY.get(LOSS_NAME) is not compute_policy_loss_gap_vanilla:
        core_algos.register_policy_loss(LOSS_NAME)(compute_policy_loss_gap_vanilla)
