"""What the sampler-vs-trainer benchmarks share: TRL's layout of forced completions, a scorer's log-probs against the
sampler's, and a pass's time."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def teacher_forced_batch(prompt_ids: list[list[int]], tokens, pad_id: int, device) -> tuple:
    """``(input_ids, attention_mask)`` in TRL's layout: prompts left-padded with ``pad_id``, completions ``tokens``
    ``[B, K]`` (all of the forced length) appended."""
    import torch

    from bloggap_plugin.core.probe import left_pad

    ids, mask = left_pad(prompt_ids, pad_id)
    return (torch.cat([ids, tokens], dim=1).to(device),
            torch.cat([mask, torch.ones_like(tokens)], dim=1).to(device))


def logprob_gap(trainer, sampler, band: float) -> dict:
    """A scorer's log-probs ``trainer`` against the sampler's, both ``[B, K]``: the share (%) of tokens with
    ``exp(trainer - sampler)`` outside ``[1 - band, 1 + band]``, mean and max |d|, the bit-identical share (%)."""
    import torch

    from bloggap_plugin.core.metrics import abs_dlogp_stats, oob_count

    trainer, sampler = trainer.float().cpu(), sampler.float().cpu()
    stats = abs_dlogp_stats(trainer, sampler)
    out, n = oob_count(trainer, sampler, band=band)
    return {"oob_pct": round(100.0 * out / n, 3), "abs_dlogp_mean": stats["mean"], "abs_dlogp_max": stats["max"],
            "bitwise_pct": round(100.0 * float(torch.eq(trainer, sampler).double().mean()), 3), "tokens": n}


def median_time(call: Callable[[], Any], device, repeats: int = 3) -> tuple[Any, float]:
    """``(result, median seconds of ``repeats`` calls after one warm-up)``, the device synchronised around each."""
    import torch

    def sync() -> None:
        if getattr(device, "type", device) == "cuda":
            torch.cuda.synchronize()

    result = call()
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        result = call()
        sync()
        times.append(time.perf_counter() - started)
    return result, statistics.median(times)
