"""Ratio, clip and KL statistics between two scorings of the same tokens (torch only).

Conventions: log-prob tensors are ``[B, T]`` (or any matching shape) of natural-log probabilities;
``mask`` is a 0/1 or bool tensor of the same shape selecting the tokens that count (completion tokens);
``mask=None`` means every element counts. A token is *out of band* when ``exp(logp_a - logp_b)`` lies
outside ``[1 - band, 1 + band]``; a non-finite difference is always out of band.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "oob_fraction",
    "oob_count",
    "out_of_band",
    "abs_dlogp_stats",
    "clip_status",
    "trl_clip_status",
    "importance_weights",
    "clip_flip_fraction",
    "clipped_fraction",
    "kl_k1",
    "kl_k3",
    "wilson_interval",
]


def _selected(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Flatten ``values`` to the masked elements (float64). Raises on an empty selection."""
    if mask is None:
        flat = values.reshape(-1)
    else:
        if mask.shape != values.shape:
            raise ValueError(f"mask shape {tuple(mask.shape)} does not match values shape {tuple(values.shape)}")
        flat = values[mask.bool()]
    if flat.numel() == 0:
        raise ValueError("empty mask: no token selected, the statistic is undefined (check the completion mask)")
    return flat.double()


def _difference(logp_a: torch.Tensor, logp_b: torch.Tensor) -> torch.Tensor:
    """``logp_a - logp_b`` in float64 (same shape required)."""
    if logp_a.shape != logp_b.shape:
        raise ValueError(f"shape mismatch: logp_a {tuple(logp_a.shape)} vs logp_b {tuple(logp_b.shape)}")
    return logp_a.double() - logp_b.double()


def _dlogp(logp_a: torch.Tensor, logp_b: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return _selected(_difference(logp_a, logp_b), mask)


def oob_count(
    logp_a: torch.Tensor, logp_b: torch.Tensor, mask: torch.Tensor | None = None, band: float = 0.1
) -> tuple[int, int]:
    """(out-of-band count, token count) for ``exp(logp_a - logp_b)`` against ``[1-band, 1+band]``."""
    if not 0.0 < band < 1.0:
        raise ValueError(f"band must be in (0, 1), got {band}")
    delta = _dlogp(logp_a, logp_b, mask)
    return int(_outside(delta, band).sum().item()), int(delta.numel())


def out_of_band(logp_a: torch.Tensor, logp_b: torch.Tensor, band: float = 0.1) -> torch.Tensor:
    """Per element bool (same shape): ``exp(logp_a - logp_b)`` outside ``[1-band, 1+band]`` (difference in float64;
    non-finite counts as outside). No host read: for counts on the device (``(out_of_band(a, b) & mask).sum()``)."""
    return _outside(_difference(logp_a, logp_b), band)


def _outside(delta: torch.Tensor, band: float) -> torch.Tensor:
    if not 0.0 < band < 1.0:
        raise ValueError(f"band must be in (0, 1), got {band}")
    ratio = torch.exp(delta)
    return ~(torch.isfinite(delta) & (ratio >= 1.0 - band) & (ratio <= 1.0 + band))


def oob_fraction(
    logp_a: torch.Tensor, logp_b: torch.Tensor, mask: torch.Tensor | None = None, band: float = 0.1
) -> float:
    """Share of masked tokens whose ratio ``exp(logp_a - logp_b)`` is outside ``[1-band, 1+band]``.

    Non-finite differences count as out of band. Raises ``ValueError`` on an empty mask.
    """
    out, n = oob_count(logp_a, logp_b, mask, band)
    return out / n


def abs_dlogp_stats(logp_a: torch.Tensor, logp_b: torch.Tensor, mask: torch.Tensor | None = None) -> dict:
    """Statistics of ``|logp_a - logp_b|`` over masked tokens (nats).

    Returns ``{"mean", "sd", "p95", "max", "n"}``: ``sd`` is the population standard deviation of the
    signed difference (the reference study's ``sd``), ``p95`` is element ``int(0.95 * n)`` of the sorted
    absolute differences. Non-finite differences propagate (mean/max become inf or nan).
    """
    delta = _dlogp(logp_a, logp_b, mask)
    absd = delta.abs()
    n = int(delta.numel())
    sorted_abs = torch.sort(absd).values
    p95 = float(sorted_abs[min(int(0.95 * n), n - 1)].item())
    return {
        "mean": float(absd.mean().item()),
        "sd": float(delta.std(unbiased=False).item()) if n > 1 else 0.0,
        "p95": p95,
        "max": float(absd.max().item()),
        "n": n,
    }


def clip_status(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float = 0.2, eps_high: float | None = None
) -> torch.Tensor:
    """TRL's PPO clip rule per token: clipped iff (A > 0 and r > 1+eps_high) or (A < 0 and r < 1-eps_low).

    ``ratio`` is ``[B, T]``; ``advantages`` is per sequence ``[B]`` or per token ``[B, T]``.
    ``eps_high=None`` means ``eps_low``. A = 0 is never clipped; a non-finite ratio compares False.
    """
    eps_high = eps_low if eps_high is None else eps_high
    if advantages.dim() == ratio.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.expand_as(ratio)
    upper = (advantages > 0) & (ratio > 1.0 + eps_high)
    lower = (advantages < 0) & (ratio < 1.0 - eps_low)
    return upper | lower


# TRL 1.16 loss types whose objective clips the importance weight PPO-style (grpo_trainer._compute_loss)
PPO_CLIP_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# Loss types with a clipping rule the plugin follows; sapo (soft gate) and vespo (gamma weights) clip nothing
CLIP_RULE_LOSSES = PPO_CLIP_LOSSES + ("cispo",)


def importance_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str = "token") -> torch.Tensor:
    """TRL's importance weight ``exp(log_ratio)``: ``[B, T]`` (``token``) or ``[B, 1]`` (``sequence``: the exponent
    is the mean of ``log_ratio`` over the row's masked tokens, GSPO)."""
    if level == "token":
        return torch.exp(log_ratio)
    if level == "sequence":
        total = log_ratio.masked_fill(~mask.bool(), 0.0).sum(-1, keepdim=True)  # padding may hold non-finite values
        return torch.exp(total / mask.to(log_ratio.dtype).sum(-1, keepdim=True).clamp(min=1.0))
    raise ValueError(f"importance sampling level must be 'token' or 'sequence', got {level!r}")


def trl_clip_status(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str = "dapo",
    level: str = "token",
    eps_low: float = 0.2,
    eps_high: float | None = None,
    delta: float | None = None,
) -> torch.Tensor | None:
    """Per token ``[B, T]`` bool: is this token's importance weight clipped by TRL 1.16's loss ``loss_type``?

    ``log_ratio`` = new - old ``[B, T]``; ``advantages`` ``[B]`` or ``[B, T]``; ``level`` token or sequence
    (a sequence's weight, and so its clip status, applies to all its tokens). Rules (grpo_trainer._compute_loss):

    - grpo, bnpo, dr_grpo, dapo, luspo: ``A > 0 and w > 1+eps_high`` or ``A < 0 and w < 1-eps_low``; with
      two-sided clipping (``delta``) also ``A < 0 and w > delta`` (the loss is then ``delta * A``, constant);
    - cispo: ``A > 0 and w > eps_high`` (TRL's ``cispo_clip_ratio``; eps_high is the absolute cap there).

    Returns ``None`` for loss types that clip nothing (sapo: a soft gate; vespo: gamma weights): no number
    describes them, so the caller reports no clip metric.
    """
    if loss_type not in CLIP_RULE_LOSSES:
        return None
    eps_high = eps_low if eps_high is None else eps_high
    weights = importance_weights(log_ratio, mask, level).expand_as(log_ratio)
    if advantages.dim() == log_ratio.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.expand_as(log_ratio)
    if loss_type == "cispo":
        return (advantages > 0) & (weights > eps_high)
    status = clip_status(weights, advantages, eps_low, eps_high)
    if delta is not None:
        status = status | ((advantages < 0) & (weights > delta))
    return status


def clipped_fraction(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor | None = None, eps_low: float = 0.2,
    eps_high: float | None = None,
) -> float:
    """Share of masked tokens that TRL's clip rule excludes (see :func:`clip_status`)."""
    status = clip_status(ratio, advantages, eps_low, eps_high)
    return float(_selected(status.double(), mask).mean().item())


def clip_flip_fraction(
    ratio_a: torch.Tensor, ratio_b: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor | None = None,
    eps_low: float = 0.2, eps_high: float | None = None,
) -> float:
    """Share of masked tokens whose clip status differs between ratios ``ratio_a`` and ``ratio_b``."""
    if ratio_a.shape != ratio_b.shape:
        raise ValueError(f"shape mismatch: ratio_a {tuple(ratio_a.shape)} vs ratio_b {tuple(ratio_b.shape)}")
    flips = clip_status(ratio_a, advantages, eps_low, eps_high) != clip_status(ratio_b, advantages, eps_low, eps_high)
    return float(_selected(flips.double(), mask).mean().item())


def kl_k1(logp_p: torch.Tensor, logp_q: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """k1 estimator of KL(p || q) from samples of p: mean of ``logp_p - logp_q`` (nats per token).

    verl's ``rollout_corr/kl`` is this with p = rollout, q = trainer (``mean(rollout - old)``).
    """
    return float(_dlogp(logp_p, logp_q, mask).mean().item())


def kl_k3(logp_p: torch.Tensor, logp_q: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """k3 estimator of KL(p || q) from samples of p: mean of ``rho - 1 - log rho`` with ``rho = q/p``.

    Always >= 0 per token. verl's ``rollout_corr/k3_kl`` is this with p = rollout, q = trainer.
    """
    log_rho = -_dlogp(logp_p, logp_q, mask)
    return float((torch.exp(log_rho) - 1.0 - log_rho).mean().item())


def wilson_interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion ``k / n`` (fractions, not percent)."""
    if n <= 0:
        raise ValueError("wilson_interval needs n > 0")
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, n], got k={k}, n={n}")
    p = k / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)
