"""TRL integration: :class:`GapCallback` (attach to an existing GRPOTrainer) and :class:`GapGRPOTrainer`
(``GRPOTrainer`` + :class:`GapMixin`); one implementation behind both. Supported: trl 1.16.x."""

from __future__ import annotations

from bloggap_plugin.trl.callback import GapCallback, GapGRPOTrainer, resolve_gap
from bloggap_plugin.trl.compat import SUPPORTED_TRL, UnsupportedTRLError, check_trl
from bloggap_plugin.trl.mixin import GapMixin
from bloggap_plugin.trl.vllm_colocate import (
    colocate_engine_dtype,
    engine_kwargs_for,
    vllm_colocate_dtype,
    vllm_colocate_engine,
)

__all__ = ["GapCallback", "GapGRPOTrainer", "GapMixin", "resolve_gap", "check_trl", "UnsupportedTRLError", "SUPPORTED_TRL",
           "vllm_colocate_dtype", "vllm_colocate_engine", "colocate_engine_dtype", "engine_kwargs_for"]
