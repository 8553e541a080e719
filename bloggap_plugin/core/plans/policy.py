"""Plan ``bf16``: the policy scores as called (its wrappers, dtype and autocast); it adds nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..model_parts import executed_numel, is_tied_safe
from ..scoring import output_head
from .base import ScoringPlan

__all__ = ["PolicyPlan"]


class PolicyPlan(ScoringPlan):
    """Plan ``bf16``: the policy exactly as passed (its wrappers, dtype and autocast)."""

    def _score_model(self) -> Callable[..., Any]:
        return self._policy_call

    def _fp32_share(self) -> float:
        stored = sum(p.numel() for p in self._source.parameters() if p.dtype == torch.float32)
        if is_tied_safe(self._source):
            head = output_head(self._source)[2].weight
            stored += head.numel() if head.dtype == torch.float32 else 0
        return stored / max(executed_numel(self._source), 1)
