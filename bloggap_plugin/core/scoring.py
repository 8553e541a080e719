"""Teacher-forced per-token log-probs of given tokens: the one scoring function every path uses.

Shapes: ``input_ids`` and ``attention_mask`` are ``[B, L]`` (prompt + completion, prompts left-padded,
completions right-padded, as TRL builds them); the result is ``[B, K]`` fp32 log-probs of the last
``K = logits_to_keep`` tokens of each row, each scored from the logits one position earlier.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["token_logprobs", "position_ids_from_mask", "gather_logprobs", "POSITION_MODES"]

POSITION_MODES = ("mask", "arange")

# reduce(logits [b, K, V] fp32 at temperature 1 after scaling, targets [b, K], rows slice) -> [b, K] fp32
LogprobReducer = Callable[[torch.Tensor, torch.Tensor, slice], torch.Tensor]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids as HF ``generate`` derives them: ``cumsum(mask) - 1``, padding set to 0. ``[B, L]`` long.

    (transformers 5 fills padding with 0, 4.x with 1; padded positions are masked out either way.)
    """
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 0)
    return position_ids


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
    """Full-vocabulary log-prob of ``targets`` under ``logits``: fp32 ``log_softmax`` then gather. ``[b, K]``."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    batch_size: int | None = None,
    positions: str = "mask",
    temperature: float = 1.0,
    reduce: LogprobReducer | None = None,
    forward: Callable[..., object] | None = None,
) -> torch.Tensor:
    """Per-token log-probs ``[B, logits_to_keep]`` (fp32) of the last ``logits_to_keep`` tokens.

    Args:
        model: a causal LM returning ``.logits`` (any dtype; the log-softmax is always fp32).
        input_ids, attention_mask: ``[B, L]``.
        logits_to_keep: number of trailing tokens to score (the completion width ``C``).
        batch_size: rows per forward pass (chunk); ``None`` scores all rows in one pass.
        positions: ``"mask"`` passes position ids derived from the attention mask (as ``generate`` does);
            ``"arange"`` passes none, so the model uses ``0..L-1`` (TRL's scoring of left-padded rows).
        temperature: logits are divided by it before the log-softmax (TRL's convention).
        reduce: optional ``(logits_fp32, targets, rows) -> logprobs`` replacing the full-vocabulary gather
            (e.g. renormalisation over a kept set); ``rows`` is the slice of the batch in this chunk.
        forward: optional callable used instead of ``model`` (e.g. an unwrapped ``_original_forward``).

    Gradients flow if the caller has grad enabled; scoring under ``torch.no_grad`` is the caller's choice.
    """
    if positions not in POSITION_MODES:
        raise ValueError(f"positions must be one of {POSITION_MODES}, got {positions!r}")
    if input_ids.shape != attention_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} differ")
    n_rows, width = input_ids.shape
    if not 0 < logits_to_keep < width:
        raise ValueError(f"logits_to_keep must be in [1, {width - 1}], got {logits_to_keep}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    batch_size = n_rows if batch_size is None else int(batch_size)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    call = forward if forward is not None else model
    reduce = reduce or gather_logprobs
    outputs = []
    for start in range(0, n_rows, batch_size):
        rows = slice(start, min(start + batch_size, n_rows))
        ids = input_ids[rows]
        mask = attention_mask[rows]
        kwargs = {"input_ids": ids, "attention_mask": mask, "logits_to_keep": logits_to_keep + 1, "use_cache": False}
        if positions == "mask":
            kwargs["position_ids"] = position_ids_from_mask(mask)
        logits = call(**kwargs).logits[:, :-1, :]
        logits = logits.float()
        if temperature != 1.0:
            logits = logits / temperature
        outputs.append(reduce(logits, ids[:, -logits_to_keep:], rows))
    return torch.cat(outputs, dim=0)
