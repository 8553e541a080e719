"""The base of every scoring plan: :class:`ScoringPlan` scores through the one scoring function in its precision.

A subclass says which model scores (``_score_model``), in which context (``_scoring_context``), what it copies
(``_sync``, ``_bytes``) and whether it computes in fp16 or fp32; the base adds ``torch.no_grad``, the TF32 setting
(:mod:`.tf32`), the fp16 guard's re-score and the statistics.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable
from typing import Any, Unpack

import torch
from torch import nn

from ..model_parts import device_sync, model_device, unique_numel
from ..scoring import LogprobReducer, ScoringOptions, TileIndex, gather_logprobs, token_logprobs, unwrap_model
from ..sharding import all_ranks_true, is_sharded, reshard
from .tf32 import cuda_matmul_tf32, resolve_tf32

__all__ = ["ScoringPlan"]


class ScoringPlan:
    """Scores tokens in one precision; see :mod:`bloggap_plugin.core.plans`. Build one with :func:`make_plan`."""

    name: str = ""
    """The plan name (:data:`bloggap_plugin.core.arms.PLAN_NAMES`) it was built for."""
    host_layout: bool = False
    """Its forward lays out the rows from an attention mask on the CPU without reading the device (arms I and J): a
    mask given on the CPU stays there."""

    def __init__(self, policy: nn.Module, name: str, fp16_guard: bool = True, tf32: bool | str = False) -> None:
        self.name = name
        self.tf32_option = tf32  # gap.tf32 as given: True, False or "auto" (self.tf32: its value on this device)
        self._policy_call = policy  # what the caller passed (wrapped or not): plan bf16 calls exactly this
        self._source = unwrap_model(policy)
        reshard(self._source)  # FSDP2: the plan is built from the shards (core.sharding); no-op otherwise
        self.sharded = is_sharded(self._source)  # made from a sharded policy (a later fully_shard needs a new plan)
        self._fp16_guard = bool(fp16_guard)
        self.fp16_fallbacks = 0
        self._fallback: ScoringPlan | None = None
        self._last_sync_seconds = 0.0
        self._closed = False
        self.layers: list[int] | None = None
        self.profile = None  # attribution profile when layers="auto"

    # -- subclass interface
    def _score_model(self) -> Callable[..., Any]:
        raise NotImplementedError

    def _scoring_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def _device(self) -> torch.device:
        return model_device(self._source)

    def _computes_fp16(self) -> bool:
        return False

    def _computes_fp32(self) -> bool:
        """Whether the forward has fp32 matmuls that the TF32 option governs."""
        return False

    @property
    def tf32(self) -> bool | None:
        """TF32 for this plan's fp32 matmuls (``gap.tf32`` resolved on the plan's device); ``None``: the plan has
        none and leaves the caller's setting alone."""
        return resolve_tf32(self.tf32_option, self._device()) if self._computes_fp32() else None

    def _precision_context(self) -> contextlib.AbstractContextManager:
        tf32 = self.tf32
        return contextlib.nullcontext() if tf32 is None else cuda_matmul_tf32(tf32)

    def _sync(self, source: nn.Module) -> None:
        pass

    def _bytes(self) -> int:
        return 0

    def _fp32_share(self) -> float:
        raise NotImplementedError

    def _new_fp32_fallback(self) -> ScoringPlan:
        """The fp32 plan that re-scores a chunk whose fp16 scoring overflowed (plans that compute in fp16 give one)."""
        raise NotImplementedError

    # -- public surface
    def token_logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        **options: Unpack[ScoringOptions],
    ) -> torch.Tensor:
        """``[B, logits_to_keep]`` fp32 log-probs through :func:`core.scoring.token_logprobs` in this plan;
        ``options`` (``positions``, ``temperature``, ``reduce``, ``chunk_tokens``) as there."""
        self._check_open()
        reduce = options.pop("reduce", None)
        out_device = input_ids.device
        device = self._device()
        input_ids = input_ids.to(device)
        if not (self.host_layout and attention_mask.device.type == "cpu"):
            attention_mask = attention_mask.to(device)
        guard = self._fp16_guard and self._computes_fp16()
        finite: dict[tuple[int, int], list[torch.Tensor]] = {}  # per chunk of rows: one flag per tile
        call_reduce = reduce
        if guard:
            base_reduce = reduce or gather_logprobs

            def call_reduce(logits: torch.Tensor, targets: torch.Tensor, index: TileIndex) -> torch.Tensor:
                out = base_reduce(logits, targets, index)
                # default gather: a non-finite log-prob <=> a non-finite logit; a custom reduce may
                # legitimately return -inf (token outside a kept set), so check the logits there.
                probe = out if reduce is None else logits.sum(dim=(-1, -2))
                rows = index[0]
                finite.setdefault((rows.start, rows.stop), []).append(torch.isfinite(probe).all())
                return out

        with torch.no_grad(), self._precision_context(), self._scoring_context():
            result = token_logprobs(
                self._score_model(),
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size=batch_size,
                reduce=call_reduce,
                **options,
            )
        if guard and finite:
            chunk_ok = torch.stack([torch.stack(flags).all() for flags in finite.values()]).cpu().tolist()
            # sharded (FSDP2): a chunk is re-scored on every rank if it overflowed on any (the fp32 forward is a
            # collective); a rank whose own chunk was finite discards the re-score
            ok_on_every_rank = all_ranks_true(chunk_ok, self._source)
            for (start, stop), ok, all_ok in zip(finite, chunk_ok, ok_on_every_rank):
                if all_ok:
                    continue
                rows = slice(start, stop)
                sub_reduce = _shifted_reduce(reduce, start) if reduce is not None else None
                rescored = self._fp32_fallback().token_logprobs(
                    input_ids[rows], attention_mask[rows], logits_to_keep, batch_size=None, reduce=sub_reduce,
                    **options,
                )
                if ok:
                    continue
                result[rows] = rescored.to(result.device)
                self.fp16_fallbacks += 1
        return result.to(out_device)

    def rows_per_forward(self, width: int) -> int | None:  # noqa: ARG002 - the plans that choose use it
        """Rows per forward this plan chooses for rows ``width`` tokens wide, or ``None``: the caller's (its
        micro-batch), which bounds the activations of a plan whose numbers do not depend on it either."""
        return None

    def sync(self, policy: nn.Module) -> float:
        """Refresh the plan's copies from ``policy`` in place (``copy_``); returns the seconds it took."""
        self._check_open()
        source = unwrap_model(policy)
        device = self._device()
        device_sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            self._sync(source)
            if self._fallback is not None:
                self._fallback._sync(source)
        device_sync(device)
        self._last_sync_seconds = time.perf_counter() - start
        return self._last_sync_seconds

    def close(self) -> None:
        """Remove hooks and free shadows; the plan cannot score afterwards."""
        if self._fallback is not None:
            self._fallback.close()
            self._fallback = None
        self._closed = True

    def stats(self) -> dict:
        """``bytes_added``, ``sync_seconds`` (last), ``fp32_param_share``, ``fp16_fallbacks``, ``layers``, ``tf32``."""
        extra = self._fallback._bytes() if self._fallback is not None else 0
        return {
            "arm": self.name,  # the key result files were written with
            "bytes_added": int(self._bytes() + extra),
            "sync_seconds": float(self._last_sync_seconds),
            "fp32_param_share": float(self._fp32_share()),
            "fp16_fallbacks": int(self.fp16_fallbacks),
            "layers": None if self.layers is None else list(self.layers),
            "tf32": self.tf32,
        }

    def __enter__(self) -> ScoringPlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, layers={self.layers})"

    # -- helpers
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                f"this {self.name} plan is closed; make a new one with make_plan(policy, {self.name!r})"
            )

    def _fp32_fallback(self) -> ScoringPlan:
        if self._fallback is None:
            warnings.warn(
                f"fp16 produced a non-finite log-prob; re-scoring that chunk in fp32 (building an fp32 copy of the "
                f"policy once: {4 * unique_numel(self._source) / 2**30:.2f} GiB, refreshed by sync)",
                RuntimeWarning,
                stacklevel=3,
            )
            self._fallback = self._new_fp32_fallback()
        return self._fallback


def _shifted_reduce(reduce: LogprobReducer, offset: int) -> LogprobReducer:
    """``reduce`` for a re-score of rows ``offset...``: the index it sees stays in the full batch's rows."""

    def shifted(logits: torch.Tensor, targets: torch.Tensor, index: TileIndex) -> torch.Tensor:
        rows, cols = index
        return reduce(logits, targets, (slice(rows.start + offset, rows.stop + offset), cols))

    return shifted
