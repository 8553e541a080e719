"""Teacher-forced per-token log-probs of given tokens: the one scoring function every path uses.

Shapes: ``input_ids`` and ``attention_mask`` are ``[B, L]`` (prompt + completion, prompts left-padded,
completions right-padded, as TRL builds them); the result is ``[B, K]`` fp32 log-probs of the last
``K = logits_to_keep`` tokens of each row, each scored from the logits one position earlier.

Memory: full logits are ``[B, K, V]`` (8 rows x 4096 tokens x 152k vocabulary in fp32: 20 GB per tensor).
:func:`token_logprobs` therefore runs the model once per chunk of rows and applies the LM head, the fp32
cast, the temperature and the log-softmax + gather (or a kept-set ``reduce``) in *tiles* of completion
positions: about ``chunk_tokens`` scored tokens (rows x positions) per tile, so the largest vocabulary-wide
tensor is ``rows x tile x V`` whatever ``K`` is. Each tile runs exactly the operations of the untiled
computation on a slice of positions; results are bit-identical to it where the head's matmul gives each row
the same value whatever the number of rows in the call (tested on CPU).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any, TypedDict

import torch
from torch import nn

__all__ = [
    "token_logprobs",
    "position_ids_from_mask",
    "gather_logprobs",
    "join_tiles",
    "unwrap_model",
    "output_head",
    "POSITION_MODES",
    "DEFAULT_CHUNK_TOKENS",
    "ScoringOptions",
    "autocast_off",
]

POSITION_MODES = ("mask", "arange")

DEFAULT_CHUNK_TOKENS = 256
"""Scored tokens (rows x completion positions) per tile of the LM head + log-softmax. A tile's logits are
``tile x V`` fp32 (256 x 152k: 156 MB), and two such tensors are alive at once (the logits and their
log-softmax; three briefly with a temperature or a kept-set reduce): about one tile of TRL 1.16's fused head
(4,096 tokens x 32,768 vocabulary columns in bf16: 268 MB), instead of ``rows x K x V`` (8 x 4096 x 152k
fp32: 20 GB). Small enough that models with a small body and a large vocabulary (Qwen2.5-1.5B) stay near
the peak memory of TRL's old-logprob pass; large enough that each tile's matmul keeps the GPU busy."""

# A tile of the [B, K] grid of scored tokens: (rows, positions) slices of the full batch; ``tensor[index]``
# selects the tile's part of any tensor whose leading shape is [B, K] (kept sets, sizes, ...).
TileIndex = tuple[slice, slice]
# reduce(logits [b, t, V] fp32 after temperature scaling, targets [b, t], index) -> [b, t] fp32
LogprobReducer = Callable[[torch.Tensor, torch.Tensor, TileIndex], torch.Tensor]


class ScoringOptions(TypedDict, total=False):
    """Keyword options of a scoring call, as :func:`token_logprobs` takes them (and passes on unchanged from
    :meth:`bloggap_plugin.core.plans.ScoringPlan.token_logprobs`); defaults are :func:`token_logprobs`'s."""

    positions: str
    temperature: float
    reduce: LogprobReducer | None
    chunk_tokens: int | None


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids as HF ``generate`` derives them: ``cumsum(mask) - 1``, padding set to 0. ``[B, L]`` long.

    (transformers 5 fills padding with 0, 4.x with 1; padded positions are masked out either way.)
    """
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 0)
    return position_ids


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor, index: TileIndex | None = None) -> torch.Tensor:
    """Full-vocabulary log-prob of ``targets`` under ``logits``: fp32 ``log_softmax`` then gather. ``[b, t]``."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def join_tiles(parts: list[tuple[TileIndex, torch.Tensor]]) -> torch.Tensor:
    """Assemble per-tile values (``(index, [b, t])`` pairs, as a ``reduce`` sees them) into one ``[B, K]`` tensor.

    Tiles may arrive in any order; a later value for the same tile replaces an earlier one (an fp16 chunk
    re-scored in fp32 by the overflow guard). The tiles of each chunk of rows must cover its positions
    ``0..K-1`` without gaps. Gradients flow through.
    """
    latest: dict[tuple[int, int, int, int], torch.Tensor] = {}
    for (rows, cols), value in parts:
        latest[(rows.start, rows.stop, cols.start, cols.stop)] = value
    by_rows: dict[tuple[int, int], list[torch.Tensor]] = {}
    ends: dict[tuple[int, int], int] = {}
    for (r0, r1, c0, c1), value in sorted(latest.items()):
        if c0 != ends.get((r0, r1), 0):
            raise ValueError(f"tiles of rows {r0}:{r1} leave positions {ends.get((r0, r1), 0)}:{c0} uncovered")
        ends[(r0, r1)] = c1
        by_rows.setdefault((r0, r1), []).append(value)
    if len({c1 for c1 in ends.values()}) > 1:
        raise ValueError(f"chunks of rows cover different numbers of positions: {sorted(set(ends.values()))}")
    return torch.cat([torch.cat(values, dim=1) for _, values in sorted(by_rows.items())], dim=0)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The bare model inside DDP / DataParallel / DeepSpeed / FSDP (``.module``) and ``torch.compile``
    (``._orig_mod``) wrappers, as ``accelerator.unwrap_model`` does. Instance-level ``forward`` patches
    (TRL's fused head, accelerate's autocast wrapper) stay on the returned module; shadows never copy them."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, nn.Module):
            model = inner
            continue
        inner = model._modules.get("module") if isinstance(model, nn.Module) else None
        if isinstance(inner, nn.Module) and getattr(model, "config", None) is None:
            model = inner
            continue
        break
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module policy, got {type(model).__name__}")
    return model


def output_head(model: nn.Module) -> tuple[nn.Module, str, nn.Module]:
    """``(parent, attribute, module)`` of the LM head (``get_output_embeddings()``)."""
    model = unwrap_model(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        head = model._modules.get("lm_head")
    if head is not None:
        for module in model.modules():
            for name, child in module._modules.items():
                if child is head:
                    return module, name, head
    raise ValueError(
        f"cannot find the LM head of {type(model).__name__} (get_output_embeddings() / lm_head); "
        "arms fp32_head/guided need one"
    )


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast disabled for ``device_type`` (a null context on a device without autocast, e.g. ``meta``)."""
    if not torch.amp.is_autocast_available(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, enabled=False)


def _score(produce: Callable[[], torch.Tensor], targets: torch.Tensor, index: TileIndex, temperature: float,
           reduce: LogprobReducer) -> torch.Tensor:
    """``reduce`` of the fp32, temperature-scaled logits that ``produce()`` returns ``[b, t, V]``: ``[b, t]``.

    The same operations tiled or not; autocast is off for them (they run inside the model's forward when
    tiled), so a ``reduce`` computes in fp32 whatever context the caller scores in.
    """
    logits = produce()
    with autocast_off(logits.device.type):
        logits = logits.float()  # the low-precision logits are freed here (only this frame holds them)
        if temperature != 1.0:
            logits = logits / temperature
        return reduce(logits, targets, index)


class _TiledHead(nn.Module):
    """Stands in for the LM head during one forward of one chunk of rows. Called with the hidden states of
    the ``width = K + 1`` kept positions, it projects them through the real head ``tile`` positions at a
    time (inside the model's forward, so in its autocast context) and hands each tile to ``consume``; it
    returns an empty fp32 placeholder as the model's logits, so the caller can see whether the model changed
    them afterwards (logit softcapping or scaling: then tiles cannot be used). Any other call goes to the
    real head unchanged."""

    def __init__(self, head: nn.Module, width: int, tile: int,
                 consume: Callable[[Callable[[], torch.Tensor], slice], None]) -> None:
        super().__init__()
        self.head = head
        self._width = width
        self._tile = tile
        self._consume = consume
        self.placeholder: torch.Tensor | None = None

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["head"], name)

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        expected = isinstance(hidden, torch.Tensor) and hidden.dim() == 3 and hidden.shape[1] == self._width
        if self.placeholder is not None or args or kwargs or not expected:
            return self.head(hidden, *args, **kwargs)
        head = self.head
        for start in range(0, self._width - 1, self._tile):
            cols = slice(start, min(start + self._tile, self._width - 1))
            self._consume(lambda cols=cols: head(hidden[:, cols].contiguous()), cols)
        self.placeholder = hidden.new_empty((hidden.shape[0], self._width, 0), dtype=torch.float32)
        return self.placeholder


# Model classes seen transforming the head's output inside their forward: scored untiled from then on.
_UNTILED_CLASSES: set[type] = set()


def _head_site(model: nn.Module) -> tuple[nn.Module, str, nn.Module] | None:
    """``(parent, key, head)`` to tile, or ``None`` (untiled) for a model class known not to allow it."""
    if not isinstance(model, nn.Module):
        return None  # a bare callable: nothing to tile
    base = unwrap_model(model)
    if type(base) in _UNTILED_CLASSES:
        return None
    try:
        return output_head(base)
    except ValueError:
        _UNTILED_CLASSES.add(type(base))
        warnings.warn(
            f"no LM head found on {type(base).__name__} (get_output_embeddings()); scoring it untiled: full "
            "[rows, K, V] logits per chunk of rows", RuntimeWarning, stacklevel=3,
        )
        return None


def _score_tiled(call: Callable[..., Any], kwargs: dict, site: tuple[nn.Module, str, nn.Module], tile: int,
                 targets: torch.Tensor, rows: slice, temperature: float,
                 reduce: LogprobReducer) -> tuple[torch.Tensor | None, Any]:
    """One chunk of rows through the model with the head tiled: ``(logprobs [b, K], None)``; or
    ``(None, outputs)`` when the head was not called as expected (score ``outputs.logits`` untiled); or
    ``(None, None)`` when the model changed the logits after its head (re-score untiled)."""
    parent, key, head = site
    width = targets.shape[1] + 1
    parts: list[torch.Tensor] = []

    def consume(produce: Callable[[], torch.Tensor], cols: slice) -> None:
        parts.append(_score(produce, targets[:, cols], (rows, cols), temperature, reduce))

    tiled = _TiledHead(head, width, tile, consume)
    if parent._modules.get(key) is not head:
        raise RuntimeError(f"the model's LM head {key!r} changed while scoring")
    parent._modules[key] = tiled
    try:
        outputs = call(**kwargs)
    finally:
        parent._modules[key] = head
    if tiled.placeholder is None:
        return None, outputs
    if outputs.logits is not tiled.placeholder:
        return None, None
    return torch.cat(parts, dim=1), None


def _checked_batch_size(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    batch_size: int | None,
    positions: str,
    temperature: float,
    chunk_tokens: int | None,
) -> int:
    """Check :func:`token_logprobs`'s arguments (``ValueError`` naming the bad one); the rows per forward pass."""
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
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                     or chunk_tokens < 0):
        raise ValueError(f"chunk_tokens must be an integer >= 0 (0 or None: untiled), got {chunk_tokens!r}")
    return batch_size


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
    chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """Per-token log-probs ``[B, logits_to_keep]`` (fp32) of the last ``logits_to_keep`` tokens.

    Args:
        model: a causal LM returning ``.logits`` (any dtype; the log-softmax is always fp32).
        input_ids, attention_mask: ``[B, L]``.
        logits_to_keep: number of trailing tokens to score (the completion width ``K``).
        batch_size: rows per forward pass (chunk); ``None`` scores all rows in one pass.
        positions: ``"mask"`` passes position ids derived from the attention mask (as ``generate`` does);
            ``"arange"`` passes none, so the model uses ``0..L-1`` (TRL's scoring of left-padded rows).
        temperature: logits are divided by it before the log-softmax (TRL's convention).
        reduce: optional ``(logits_fp32 [b, t, V], targets [b, t], index) -> logprobs [b, t]`` replacing the
            full-vocabulary gather (e.g. renormalisation over a kept set). ``index = (rows, cols)`` are the
            slices of the full ``[B, K]`` grid of scored tokens this call covers: ``tensor[index]`` is the
            matching part of any tensor aligned with the scored tokens. Called once per tile.
        forward: optional callable used instead of ``model`` (e.g. an unwrapped ``_original_forward``); the
            head that is tiled is ``model``'s (``get_output_embeddings()``).
        chunk_tokens: scored tokens (rows x completion positions) per tile of the LM head, fp32 cast and
            ``reduce``; a tile spans ``max(1, chunk_tokens // rows)`` positions of a chunk of rows, so the
            largest vocabulary-wide tensor is ``[rows, tile, V]``. ``None`` or ``0``: one tile (the whole
            ``[rows, K, V]``). A model that changes its logits after the head inside its forward (logit
            softcapping or scaling) is scored untiled, with a warning.

    Gradients flow if the caller has grad enabled; scoring under ``torch.no_grad`` is the caller's choice.
    """
    batch_size = _checked_batch_size(input_ids, attention_mask, logits_to_keep, batch_size, positions, temperature,
                                     chunk_tokens)
    n_rows = input_ids.shape[0]
    call = forward if forward is not None else model
    reduce = reduce or gather_logprobs
    site = _head_site(model) if chunk_tokens else None
    all_positions = slice(0, logits_to_keep)
    outputs = []
    for start in range(0, n_rows, batch_size):
        rows = slice(start, min(start + batch_size, n_rows))
        ids = input_ids[rows]
        mask = attention_mask[rows]
        kwargs = {"input_ids": ids, "attention_mask": mask, "logits_to_keep": logits_to_keep + 1, "use_cache": False}
        if positions == "mask":
            kwargs["position_ids"] = position_ids_from_mask(mask)
        targets = ids[:, -logits_to_keep:]
        scored, model_outputs = None, None
        if site is not None:
            tile = max(1, chunk_tokens // ids.shape[0])
            scored, model_outputs = _score_tiled(call, kwargs, site, tile, targets, rows, temperature, reduce)
            if scored is None and model_outputs is None:
                _UNTILED_CLASSES.add(type(unwrap_model(model)))
                site = None
                warnings.warn(
                    f"{type(unwrap_model(model)).__name__} changes its logits after the LM head inside its forward "
                    "(e.g. logit softcapping or scaling), so its head cannot be tiled; scoring it untiled: full "
                    "[rows, K, V] logits per chunk of rows (lower batch_size to bound the memory)",
                    RuntimeWarning, stacklevel=2,
                )
        if scored is None:
            # the outputs live only in ``pending`` until _score takes the logits, so that its fp32 cast frees
            # the model's low-precision logits
            pending = [model_outputs if model_outputs is not None else call(**kwargs)]
            del model_outputs
            scored = _score(lambda pending=pending: pending.pop().logits[:, :-1, :], targets, (rows, all_positions),
                            temperature, reduce)
        outputs.append(scored)
    return torch.cat(outputs, dim=0)
