"""The TRL adapter's state (:class:`GapState`, one attribute ``trainer._gap_state``) and its named statistics.

Statistics that are reduced across processes are small dataclasses (:class:`Statistics`): their fields, in
declaration order, are the values a process contributes; :meth:`Statistics.to_tensor` /
:meth:`Statistics.from_tensor` carry them through one ``accelerator.reduce`` (sums) or ``gather`` + max.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from bloggap_plugin.arms import ArmSpec
from bloggap_plugin.recipes import GapConfig

__all__ = ["GapState", "Statistics", "LossSums", "LossMaxima", "GenerationSums", "GenerationMaxima", "StepTimes",
           "FallbackCount", "completion_mask", "fit_width"]


@dataclass
class Statistics:
    """Named per-process values, reduced across processes field by field (iterable in field order)."""

    def to_tensor(self, device: torch.device | str) -> torch.Tensor:
        """``[n_fields]`` float64 on ``device``."""
        return torch.tensor([float(v) for v in self], dtype=torch.float64, device=device)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor):
        """The statistics of a ``[n_fields]`` tensor (as :meth:`to_tensor` lays them out)."""
        return cls(*tensor.tolist())

    def __iter__(self):
        return iter(dataclasses.astuple(self))

    def __len__(self) -> int:
        return len(dataclasses.fields(self))


@dataclass
class LossSums(Statistics):
    """One training micro-batch's loss-time sums (tokens, out-of-band counts, |dlogp| sums)."""

    oob: float = 0.0
    tokens: float = 0.0
    abs_dlogp: float = 0.0
    exact: float = 0.0
    clipped: float = 0.0
    flips: float = 0.0
    probe_tokens: float = 0.0
    oob_vs_trl: float = 0.0
    abs_dlogp_vs_trl: float = 0.0
    has_trl: float = 0.0


@dataclass
class LossMaxima(Statistics):
    abs_dlogp_max: float = -math.inf


@dataclass
class GenerationSums(Statistics):
    """One generation's sums over its measured batches (sampler, probe, kept sets, vLLM IS ratio)."""

    sampler_oob: float = 0.0
    sampler_n: float = 0.0
    sampler_absd: float = 0.0
    probe_oob: float = 0.0
    probe_n: float = 0.0
    kept_mass_sum: float = 0.0
    kept_size_sum: float = 0.0
    kept_n: float = 0.0
    kept_ratio_before_sum: float = 0.0
    kept_ratio_after_sum: float = 0.0
    kept_oob_before: float = 0.0
    kept_oob_after: float = 0.0
    is_sum: float = 0.0
    is_n: float = 0.0


@dataclass
class GenerationMaxima(Statistics):
    """One generation's maxima (minima stored negated)."""

    kept_mass_neg_min: float = -math.inf
    kept_size_max: float = -math.inf
    sampler_absd_max: float = -math.inf
    is_max: float = -math.inf
    is_neg_min: float = -math.inf

    def update(self, **values: float) -> None:
        """Raise each named maximum to ``value`` where larger."""
        for name, value in values.items():
            setattr(self, name, max(getattr(self, name), float(value)))


@dataclass
class StepTimes(Statistics):
    """Seconds of one optimizer step: the plugin's, the whole step's, arm G's pass in place of TRL's."""

    plugin: float = 0.0
    wall: float = 0.0
    replaced: float = 0.0


@dataclass
class FallbackCount(Statistics):
    new: float = 0.0


@dataclass
class GapState:
    """Everything the adapter keeps on a trainer between hook calls (``trainer._gap_state``)."""

    config: GapConfig
    arm: ArmSpec
    generator: torch.Generator
    """Private generator of the probe rows (the trainer's RNG is never drawn from)."""
    trl_version: str = ""
    clip_applies: bool = True
    sampler_on: bool = False
    recorder: Any = None
    truncating: bool = False
    vllm_truncation: dict | None = None
    renormalize: bool = False
    """``gap.kept: renormalize`` with truncated sampling: the trainer's forwards renormalise over kept sets."""
    kept_on: bool = False
    positions: str = "arange"
    # plans and the weights version they were last synced at
    plan: Any = None
    ref_plan: Any = None
    vllm_plan: Any = None
    plan_step: tuple | None = None
    ref_step: tuple | None = None
    fallbacks_seen: int = 0
    # one generation
    generations: int = 0
    gen_sums: GenerationSums | None = None
    gen_maxima: GenerationMaxima | None = None
    pending_record: Any = None
    pending_completion: torch.Tensor | None = None
    measure_now: bool = False
    drives: bool = False
    """The arm's old log-probs go into the loss (else they are measured only)."""
    skip_old: bool = False
    old_skipped: bool = False
    # one training micro-batch (TRL's _compute_loss calls back into the training forward)
    in_loss: bool = False
    loss_kept: Any = None
    new_logps: torch.Tensor | None = None
    # timing
    time: float = 0.0
    replaced_time: float = 0.0
    step_wall: float = 0.0
    step_plugin: float = 0.0


def completion_mask(batch: dict) -> torch.Tensor:
    """The tokens TRL's loss counts: ``completion_mask``, times ``tool_mask`` where the batch has one. ``[B, K]``."""
    mask = batch["completion_mask"]
    return mask if batch.get("tool_mask") is None else mask * batch["tool_mask"]


def fit_width(tensor: torch.Tensor, width: int, fill: int | float = 0, device: torch.device | None = None) -> torch.Tensor:
    """``tensor`` ``[B, T, ...]`` cut or padded with ``fill`` to ``[B, width, ...]`` (on ``device``, default its own)."""
    out = torch.full((tensor.shape[0], width, *tensor.shape[2:]), fill, dtype=tensor.dtype,
                     device=tensor.device if device is None else device)
    common = min(width, tensor.shape[1])
    out[:, :common] = tensor[:, :common].to(out.device)
    return out
