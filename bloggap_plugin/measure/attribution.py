"""Where in the network the batch-shape divergence enters (reference table T8): the measurement behind
``bloggap attribute``.

Samples completions from the model itself on the *calibration* prompts (disjoint from the evaluation prompts
the ladder uses), scores each row alone (batch 1, unpadded) and in left-padded chunks of ``batch_size`` rows,
and records the relative hidden-state divergence after the embedding and after every decoder layer
(:func:`bloggap_plugin.core.divergence.divergence_profile`), plus the out-of-band share of the same tokens'
log-probs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bloggap_plugin.core.divergence import divergence_profile, strip_padding
from bloggap_plugin.core.errors import UsageError
from bloggap_plugin.core.model_parts import decoder_layers
from bloggap_plugin.core.plans import make_plan
from bloggap_plugin.core.probe import compare
from bloggap_plugin.measure import rollouts

__all__ = ["b1_vs_bn", "run_attribution"]


def b1_vs_bn(
    plan, input_ids, attention_mask, logits_to_keep: int, batch_size: int = 8, positions: str = "mask"
):
    """Score with ``plan`` each row alone (unpadded, batch 1) and in chunks of ``batch_size`` left-padded
    rows; returns ``(logp_b1, logp_bn)``, each ``[N, K]`` fp32 on CPU."""
    singles = []
    for r in range(input_ids.shape[0]):
        row, _ = strip_padding(input_ids[r], attention_mask[r])
        singles.append(
            plan.token_logprobs(row, torch.ones_like(row), logits_to_keep, positions=positions).cpu()
        )
    batched = plan.token_logprobs(
        input_ids, attention_mask, logits_to_keep, batch_size=batch_size, positions=positions
    )
    return torch.cat(singles, dim=0), batched.cpu()


def run_attribution(
    model, tokenizer, *, rows: int = 32, new_tokens: int = 48, batch_size: int = 8, k: int = 8,
    positions: str = "mask", seed: int = 4321, band: float = 0.1, progress: Callable[[str], object] | None = None,
) -> dict:
    """The attribution profile (JSON-ready) of ``model`` on calibration-prompt rollouts."""
    n_layers = len(decoder_layers(model))
    if not 1 <= k <= n_layers:
        raise UsageError(f"--k {k} is out of range: this model has {n_layers} decoder layers; give k in 1..{n_layers}")
    say = progress or (lambda _msg: None)
    say(f"sampling {rows} calibration rollouts x {new_tokens} tokens")
    device = next(model.parameters()).device
    ids, mask, prompts = rollouts.rollout_rows(model, tokenizer, rollouts.calibration_prompts(), rows, new_tokens, seed)
    ids, mask = ids.to(device), mask.to(device)
    say("hidden-state divergence per layer")
    profile = divergence_profile(
        model, ids, mask, batch_size=batch_size, logits_to_keep=new_tokens, positions=positions
    )
    b1, bn = b1_vs_bn(make_plan(model, "bf16"), ids, mask, new_tokens, batch_size, positions)
    cell = compare(b1, bn, band=band)
    return {
        "profile": profile.to_dict(k=k),
        "logprob_b1_vs_bn": cell,
        "rows": rows,
        "new_tokens": new_tokens,
        "prompts": "calibration (last 16 of the 8 x 8 grid; disjoint from the ladder's evaluation prompts)",
        "distinct_prompts": len(set(prompts)),
        "seed": seed,
    }
