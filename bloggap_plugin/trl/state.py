"""The TRL adapter's state (:class:`GapState`, ``trainer._gap_session.state``) and its named statistics.

The state is grouped by lifetime: :class:`AttachSettings` (fixed at attach, frozen), :class:`Resources` (plans,
recorder, generator), :class:`GenerationPhase` (one generation's values, replaced whole when the next begins),
:class:`LossPass` (one micro-batch's loss pass, set only inside :meth:`GapState.loss_pass`) and :class:`RunTotals`.

Statistics that are reduced across processes are small dataclasses (:class:`Statistics`): their fields, in
declaration order, are the values a process contributes; :meth:`Statistics.to_tensor` /
:meth:`Statistics.from_tensor` carry them through one ``accelerator.reduce`` (sums) or ``gather`` + max.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from bloggap_plugin.core.arms import ArmSpec
from bloggap_plugin.recipes import GapConfig

__all__ = ["GapState", "AttachSettings", "Resources", "GenerationPhase", "LossPass", "RunTotals", "Statistics",
           "LossSums", "LossMaxima", "GenerationSums", "GenerationMaxima", "StepTimes",
           "FallbackCount", "completion_mask", "fit_width"]


@dataclass
class Statistics:
    """Named per-process values, reduced across processes field by field (iterable in field order)."""

    def to_tensor(self, device: torch.device | str) -> torch.Tensor:
        """``[n_fields]`` float64 on ``device``. Fields may be Python numbers or 0-d tensors (accumulated on the
        device); neither is read back to the host here."""
        return torch.stack([v.to(device=device, dtype=torch.float64).reshape(()) if torch.is_tensor(v)
                            else torch.full((), float(v), dtype=torch.float64, device=device) for v in self])

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor):
        """The statistics of a ``[n_fields]`` tensor (as :meth:`to_tensor` lays them out)."""
        return cls(*tensor.tolist())

    def __iter__(self):
        return iter(dataclasses.astuple(self))

    def __len__(self) -> int:
        return len(dataclasses.fields(self))

    def raise_to(self, **values: float | torch.Tensor) -> None:
        """Raise each named field to ``value`` where that is larger (maxima); a 0-d tensor stays on its device."""
        for name, value in values.items():
            current = getattr(self, name)
            if torch.is_tensor(value):
                value = value.to(torch.float64)
                current = torch.maximum(current, value) if torch.is_tensor(current) else value.clamp(min=current)
            elif torch.is_tensor(current):
                current = current.clamp(min=float(value))
            else:
                current = max(current, float(value))
            setattr(self, name, current)


def _statistics(name: str, fields: str, default: float, doc: str) -> type[Statistics]:
    """A :class:`Statistics` dataclass named ``name`` with float ``fields`` (space-separated, in reduction order),
    each starting at ``default`` (0 for sums, -inf for maxima)."""
    cls = dataclasses.make_dataclass(name, [(f, float, dataclasses.field(default=default)) for f in fields.split()],
                                     bases=(Statistics,))
    cls.__doc__ = doc
    cls.__module__ = __name__
    return cls


LossSums = _statistics(
    "LossSums", "oob tokens abs_dlogp exact clipped flips probe_tokens oob_vs_trl abs_dlogp_vs_trl has_trl", 0.0,
    "One training micro-batch's loss-time sums: tokens, out-of-band and exact counts, |dlogp|, clipped tokens, "
    "clip flips against the reference on probe tokens, the arm vs TRL's own old log-probs (where TRL had them).")
LossMaxima = _statistics("LossMaxima", "abs_dlogp_max", -math.inf, "One training micro-batch's largest |dlogp|.")
GenerationSums = _statistics(
    "GenerationSums",
    "sampler_oob sampler_n sampler_absd sampler_exact probe_oob probe_n kept_mass_sum kept_size_sum kept_n kept_ratio_before_sum "
    "kept_ratio_after_sum kept_oob_before kept_oob_after is_sum is_n", 0.0,
    "One generation's sums over its measured batches (sampler, probe, kept sets, vLLM IS ratio).")
GenerationMaxima = _statistics(
    "GenerationMaxima", "kept_mass_neg_min kept_size_max sampler_absd_max is_max is_neg_min", -math.inf,
    "One generation's maxima (minima stored negated).")
StepTimes = _statistics("StepTimes", "plugin wall replaced probe generate", 0.0,
                        "Seconds of one optimizer step: the plugin's, the whole step's, arm G's pass in place of TRL's, "
                        "the probe forwards' (part of the plugin's), TRL's generation (the sampler's).")
FallbackCount = _statistics("FallbackCount", "new", 0.0, "fp16 chunks re-scored in fp32 since the last flush.")


@dataclass(frozen=True)
class AttachSettings:
    """What attach decided, fixed for the trainer's life (``state.settings``)."""

    config: GapConfig
    """The ``gap:`` section; the arm is its one field ``config.arm`` (its record: :attr:`GapState.arm`)."""
    trl_version: str = ""
    clip_applies: bool = True
    """TRL's loss clips the importance weight (``gap/clip/*`` are logged)."""
    sampler_on: bool = False
    truncating: bool = False
    """Sampling keeps a subset of the vocabulary (top_k, top_p or min_p)."""
    vllm_truncation: dict | None = None
    """``{top_k, top_p, min_p}`` TRL's vLLM generation samples with (``None``: HF generate)."""
    renormalize: bool = False
    """``gap.kept: renormalize`` with truncated sampling: the trainer's forwards renormalise over kept sets."""
    kept_on: bool = False
    kept_source: str | None = None
    """Where the kept sets come from (``gap.kept_source`` resolved at attach): ``recorder`` (HF generate),
    ``sampling_mask`` (vLLM's own), ``retruncate`` (the trainer's logits), ``None`` without kept sets."""
    positions: str = "arange"
    """The position ids of the plugin's scoring and of the training forward (``arange`` where the arm keeps TRL's)."""


@dataclass
class Resources:
    """What the session builds and keeps (``state.resources``): the probe rows' generator, the sampler recorder, the
    plans and the weights versions they were last synced at."""

    generator: torch.Generator
    """Private generator of the probe rows (the trainer's RNG is never drawn from)."""
    recorder: Any = None
    plan: Any = None
    ref_plan: Any = None
    vllm_plan: Any = None
    onpolicy: Any = None
    """Arm J's training forward (:class:`~bloggap_plugin.core.plans.vllm_shadow.OnPolicyForward` over the policy)."""
    plan_step: tuple | None = None
    ref_step: tuple | None = None


@dataclass
class GenerationPhase:
    """One training generation's values (``state.generation``), from TRL's ``_generate_and_score_completions`` until
    the next one begins (its micro-batches' loss passes read them); each generation starts from a fresh one
    (:meth:`GapState.trl_generation`), so nothing of the previous generation is visible."""

    skip_old: bool = False
    """Inside TRL's call only: its old-logprob pass is replaced by the arm's (a placeholder stands in)."""
    old_skipped: bool = False
    """TRL's old-logprob pass was replaced by a placeholder this generation."""
    pending_record: Any = None
    """The sampler's record of this generation, until it is aligned to TRL's completions."""
    pending_completion: torch.Tensor | None = None
    sampling_masks: list | None = dataclasses.field(default_factory=list)
    """Kept sets of the colocate engine's ``llm.generate`` calls of this generation (``gap.kept_source`` resolved to
    ``sampling_mask``: :func:`~bloggap_plugin.trl.kept_source.capture_sampling_masks`), until they are aligned to TRL's
    completions; ``None`` once read (later calls, e.g. evaluation's, are not kept)."""
    old_step: int = -1
    """The trainer's ``global_step`` when this generation's old log-probs were computed (-1: not yet)."""
    measure_now: bool = False
    probe_now: bool = False
    """This generation has probe rows (decided once per generation: ``probe_every`` and ``probe_budget``)."""
    drives: bool = False
    """The arm's old log-probs go into the loss (else they are measured only)."""
    sums: GenerationSums | None = None
    maxima: GenerationMaxima | None = None


@dataclass
class LossPass:
    """One training micro-batch's loss pass (``state.loss`` inside :meth:`GapState.loss_pass`, else ``None``): TRL's
    ``_compute_loss`` calls the training forward back, which reads ``kept`` and leaves ``new_logps`` here."""

    kept: Any = None
    """Kept sets the training forward renormalises over (``gap.kept: renormalize``), or ``None``."""
    new_logps: torch.Tensor | None = None
    """The training forward's log-probs ``[B, K]``, detached (for the loss-time metrics)."""
    host_mask: torch.Tensor | None = None
    """Arm J: the micro-batch's attention mask ``[B, L]`` on the CPU (``gap_host_mask``, copied once per generation),
    from which its training forward lays out the rows without reading the device."""


@dataclass
class RunTotals:
    """Counters and seconds summed since attach (``state.totals``)."""

    generations: int = 0
    fallbacks_seen: int = 0
    """fp16 chunks re-scored in fp32 by the plans, as last logged."""
    time: float = 0.0
    """Seconds of the plugin's own work since attach, this process."""
    replaced_time: float = 0.0
    """Seconds of the arm's pass in place of TRL's own, since the last optimizer step."""
    step_wall: float = 0.0
    step_plugin: float = 0.0
    step_probe: float = 0.0
    step_generate: float = 0.0
    """Seconds of this optimizer step so far (``training_step``'s, the plugin's, the probe forwards', TRL's
    ``_generate_single_turn``: the sampler, vLLM or HF ``generate``); reset at each optimizer step."""
    probe_total: float = 0.0
    """Seconds of probe forwards since attach, summed over processes (at optimizer steps)."""
    wall_total: float = 0.0
    """Seconds of ``training_step`` since attach, summed over processes (at optimizer steps)."""


@dataclass
class GapState:
    """Everything the adapter keeps between hook calls (``trainer._gap_session.state``, owned by the session), by
    lifetime: ``settings`` fixed at attach, ``resources`` built by the session, ``generation`` one generation's values,
    ``loss`` one loss pass's (``None`` outside it), ``totals`` summed since attach."""

    settings: AttachSettings
    resources: Resources
    generation: GenerationPhase = dataclasses.field(default_factory=GenerationPhase)
    loss: LossPass | None = None
    totals: RunTotals = dataclasses.field(default_factory=RunTotals)

    @property
    def config(self) -> GapConfig:
        """The ``gap:`` section (``settings.config``)."""
        return self.settings.config

    @property
    def arm(self) -> ArmSpec:
        """The arm's record, read from ``config.arm`` (the one place the arm is kept)."""
        return self.settings.config.arm_spec

    @property
    def in_loss(self) -> bool:
        """Inside a loss pass (:meth:`loss_pass`)."""
        return self.loss is not None

    @property
    def new_logps(self) -> torch.Tensor | None:
        """The current loss pass's training-forward log-probs (``None`` outside a loss pass or before the forward)."""
        return None if self.loss is None else self.loss.new_logps

    @contextlib.contextmanager
    def loss_pass(self, kept: Any = None, host_mask: torch.Tensor | None = None) -> Iterator[LossPass]:
        """One micro-batch's loss pass: ``loss`` is a fresh :class:`LossPass` with ``kept`` and ``host_mask`` inside,
        and ``None`` again on exit, also on an exception, so nothing of it outlives the pass. Passes do not nest."""
        if self.loss is not None:
            raise RuntimeError("bloggap: a loss pass began inside another (TRL's _compute_loss re-entered)")
        self.loss = LossPass(kept=kept, host_mask=host_mask)
        try:
            yield self.loss
        finally:
            self.loss = None

    @contextlib.contextmanager
    def trl_generation(self, skip_old: bool) -> Iterator[GenerationPhase]:
        """TRL's ``_generate_and_score_completions`` of a training generation: ``generation`` is a fresh
        :class:`GenerationPhase` from here on (the previous generation's values gone), with ``skip_old`` set inside
        and ``False`` on exit, also on an exception."""
        self.generation = GenerationPhase(skip_old=skip_old)
        try:
            yield self.generation
        finally:
            self.generation.skip_old = False


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
