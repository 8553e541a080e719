"""Plans ``fp32`` and ``fp16``: a *shadow*, a clean module of the policy's class in that dtype, refreshed in place.

The shadow is built from the policy's config on the meta device, materialised once in its dtype (on the policy's
device or ``device=``) and refreshed by :meth:`ScoringPlan.sync` (one ``torch._foreach_copy_`` per dtype group). It
carries none of the instance-level ``forward`` patches TRL and accelerate put on the policy, and runs with autocast
disabled, so it really computes in fp32 / fp16. Memory: 4 (fp32) or 2 (fp16) bytes per parameter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..model_parts import FusedCopy, build_shadow, model_device, param_pairs, tensor_bytes
from ..scoring import autocast_off
from ..sharding import reshard
from .base import ScoringPlan

__all__ = ["SHADOW_DTYPES", "ShadowPlan", "fp32_shadow"]

SHADOW_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
"""Plan name -> the dtype its shadow computes in."""


class ShadowPlan(ScoringPlan):
    """Plans ``fp32`` / ``fp16``: a clean copy in ``dtype`` run with autocast disabled, refreshed in place."""

    def __init__(
        self, policy: nn.Module, name: str, dtype: torch.dtype, device: torch.device | None, fp16_guard: bool,
        tf32: bool | str = False,
    ) -> None:
        super().__init__(policy, name, fp16_guard, tf32)
        self.dtype = dtype
        self._shadow_device = torch.device(device) if device is not None else model_device(self._source)
        self.shadow: nn.Module | None = build_shadow(self._source, dtype, self._shadow_device)
        self._copy = FusedCopy()
        with torch.no_grad():
            self._sync(self._source)

    def _device(self) -> torch.device:
        return self._shadow_device

    def _score_model(self) -> Callable[..., Any]:
        return self.shadow

    def _scoring_context(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        for device_type in {self._shadow_device.type, "cpu"}:
            stack.enter_context(autocast_off(device_type))
        if self.sharded:  # FSDP2: free the units a forward left gathered (core.sharding)
            stack.callback(reshard, self.shadow)
        return stack

    def _computes_fp16(self) -> bool:
        return self.dtype == torch.float16

    def _computes_fp32(self) -> bool:
        return self.dtype == torch.float32

    def _sync(self, source: nn.Module) -> None:
        self._copy(source, lambda: param_pairs(self.shadow, source))

    def _bytes(self) -> int:
        if self.shadow is None:
            return 0
        return tensor_bytes(list(self.shadow.parameters()) + list(self.shadow.buffers()))

    def _fp32_share(self) -> float:
        return 1.0 if self.dtype == torch.float32 else 0.0

    def _new_fp32_fallback(self) -> ScoringPlan:
        return fp32_shadow(self._source, self._device(), self.tf32_option)

    def close(self) -> None:
        super().close()
        self._copy.clear()
        self.shadow = None


def fp32_shadow(policy: nn.Module, device: torch.device, tf32: bool | str) -> ShadowPlan:
    """An unguarded fp32 shadow of ``policy`` on ``device``: what re-scores a chunk whose fp16 scoring overflowed."""
    return ShadowPlan(policy, "fp32", torch.float32, device, fp16_guard=False, tf32=tf32)
