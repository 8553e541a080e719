"""The plan registry: plan name -> :class:`PlanEntry` (the builder of its class and what the plan takes and
does), and :func:`make_plan`, which checks the options against the entry.

Each builder takes ``(policy, name, options)`` and returns the plan; it does what the class needs before it is
built (a ``guided`` plan's layer choice, arm I's form and kernels). Code that treats plans differently asks the
entry (:func:`plan_entry`) for a capability, never compares plan names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..arms import ArmSpec, plan_name
from ..divergence import DivergenceProfile, divergence_profile
from ..model_parts import layer_list_path, model_device
from ..scoring import unwrap_model
from ..sharding import is_partitioned
from ..vllm.form import parse_form
from ..vllm.kernels import load_kernels
from .base import ScoringPlan
from .policy import PolicyPlan
from .shadow import SHADOW_DTYPES, ShadowPlan
from .upcast import UpcastPlan
from .vllm_shadow import VllmFormParamsPlan, VllmFormPlan

__all__ = ["PLANS", "PlanEntry", "PlanOptions", "REFERENCE_PLAN", "arm_plan_entry", "make_plan", "plan_entry",
           "guided_layers"]


@dataclass(frozen=True)
class PlanOptions:
    """:func:`make_plan`'s keyword options, as given (see there)."""

    device: str | torch.device | None = None
    layers: Sequence[int] | str | None = None
    k: int = 8
    calibration: tuple[torch.Tensor, torch.Tensor] | None = None
    fp16_guard: bool = True
    tf32: bool | str = False
    pieces: str | Any | None = None
    over_parameters: bool = False


def make_plan(
    policy: nn.Module,
    name: str,
    *,
    device: str | torch.device | None = None,
    layers: Sequence[int] | str | None = None,
    k: int = 8,
    calibration: tuple[torch.Tensor, torch.Tensor] | None = None,
    fp16_guard: bool = True,
    tf32: bool | str = False,
    pieces: str | Any | None = None,
    over_parameters: bool = False,
) -> ScoringPlan:
    """A :class:`ScoringPlan` scoring with ``policy`` as plan ``name`` (built by :data:`PLANS`).

    Args:
        policy: the causal LM (wrapped by DDP/accelerate or not); plan ``bf16`` calls it exactly as passed.
        name: a plan name ``bf16 | fp32 | fp16 | fp32_head | guided | vllm``, or an arm letter with a plan
            (``B C D E F I``, :mod:`bloggap_plugin.core.arms`), or ``A`` for ``bf16``
            (:data:`~bloggap_plugin.core.arms.PLAN_ALIASES`).
        device: where an fp32/fp16 (or arm I's bf16) shadow lives (default: the policy's device). Not used by other
            plans.
        layers: ``guided`` only: decoder layer ids to run in fp32, or ``"auto"`` (top-``k`` per-layer
            divergence increments between batch 1 and batch 8 on ``calibration`` rows; see
            :mod:`bloggap_plugin.core.divergence`).
        k: number of layers chosen by ``layers="auto"``.
        calibration: ``(input_ids, attention_mask)`` ``[N, L]`` rows for ``layers="auto"``: use rows
            disjoint from the ones you evaluate on.
        fp16_guard: re-score in fp32 any chunk whose fp16 scoring gives a non-finite value.
        tf32: the fp32 matmuls of the plan's forward (``fp32``, ``fp32_head``, ``guided``, the fp16 guard's
            re-score) in TF32 (``True``), IEEE fp32 (``False``), or TF32 on Ampere+ GPUs only (``"auto"``); set
            and restored around each call (:mod:`.tf32`). Ignored by plan ``bf16``.
        pieces: ``vllm`` (arm I) only: which pieces of its forward follow vLLM
            (:func:`bloggap_plugin.core.vllm.form.parse_form`; default ``"all"``). Pieces that call vLLM's kernels
            need vLLM and CUDA (:func:`bloggap_plugin.core.vllm.kernels.load_kernels` refuses otherwise).
        over_parameters: ``vllm`` only: score the policy's own parameters, each cast to bf16 in the forward, instead
            of a bf16 shadow (no copy, nothing to sync; arm J, whose training forward reads them the same way).
    """
    name = plan_name(name)
    if not (tf32 is True or tf32 is False or tf32 == "auto"):
        raise ValueError(f"tf32 must be True, False or 'auto', got {tf32!r}")
    if not isinstance(policy, nn.Module):
        raise TypeError(f"policy must be a torch.nn.Module, got {type(policy).__name__}")
    entry = PLANS[name]
    if not entry.takes_layers and (layers is not None or calibration is not None):
        raise ValueError(f"layers=/calibration= choose fp32 layers for arm {_with('takes_layers')} only, not {name!r}")
    if (pieces is not None or over_parameters) and not entry.takes_pieces:
        raise ValueError(f"pieces= and over_parameters= are arm I's plan options; arm {name!r} has none")
    if device is not None and not entry.takes_device:
        raise ValueError(f"device= places an fp32/fp16 shadow; arm {name!r} runs on the policy's own device")
    if entry.copies_weights and is_partitioned(policy):
        raise ValueError(
            f"plan {name!r} copies the policy's weights, but its parameters are DeepSpeed ZeRO-3 slices (ds_id), "
            "gathered only inside a forward: use FSDP2 (plans shard their copies like the policy), ZeRO stage 1 "
            "or 2, or the 'bf16' plan"
        )
    options = PlanOptions(device, layers, k, calibration, fp16_guard, tf32, pieces, over_parameters)
    return entry.build(policy, name, options)


def plan_entry(name: str) -> PlanEntry:
    """The registry entry of plan ``name`` (a plan name or an arm letter with a plan, :func:`plan_name`)."""
    return PLANS[plan_name(name)]


def arm_plan_entry(arm: ArmSpec) -> PlanEntry | None:
    """The registry entry of ``arm``'s plan (:attr:`~bloggap_plugin.core.arms.ArmSpec.plan`), or ``None`` for an arm
    without one (TRL's forward scores its old log-probs): what code asks for a planned arm's capabilities."""
    return None if arm.plan is None else PLANS[arm.plan]


def _with(capability: str) -> str:
    """The quoted names of the plans whose entry has ``capability`` (for error messages)."""
    return ", ".join(repr(name) for name, entry in PLANS.items() if getattr(entry, capability))


def _policy_plan(policy: nn.Module, name: str, options: PlanOptions) -> PolicyPlan:
    return PolicyPlan(policy, name, options.fp16_guard)


def _shadow_plan(policy: nn.Module, name: str, options: PlanOptions) -> ShadowPlan:
    return ShadowPlan(policy, name, SHADOW_DTYPES[name], options.device, options.fp16_guard, options.tf32)


def _upcast_plan(policy: nn.Module, name: str, options: PlanOptions) -> UpcastPlan:
    """``fp32_head``: no layer; ``guided`` (its entry takes layers): the given layers or those chosen on the
    calibration rows."""
    if not PLANS[name].takes_layers:
        return UpcastPlan(policy, name, [], options.fp16_guard, options.tf32)
    ids, profile = guided_layers(policy, options.layers, options.k, options.calibration)
    plan = UpcastPlan(policy, name, ids, options.fp16_guard, options.tf32)
    plan.profile = profile
    return plan


def _vllm_plan(policy: nn.Module, name: str, options: PlanOptions) -> VllmFormPlan | VllmFormParamsPlan:
    """Arms I and J: the form parsed and its kernels loaded before the bf16 shadow is built (or, over the
    parameters, on the policy's device)."""
    form = parse_form("all" if options.pieces is None else options.pieces)
    device = None if options.over_parameters else options.device
    target = torch.device(device) if device is not None else model_device(unwrap_model(policy))
    kernels = load_kernels(form, target)
    if options.over_parameters:
        return VllmFormParamsPlan(policy, form, kernels)
    return VllmFormPlan(policy, form, kernels, target)


@dataclass(frozen=True)
class PlanEntry:
    """One plan of :data:`PLANS`: how it is built and what it takes and does (what callers ask, not its name)."""

    build: Callable[[nn.Module, str, PlanOptions], ScoringPlan]
    """``(policy, name, options) -> plan``."""
    takes_device: bool = False
    """Holds its copy of the policy's weights where ``device=`` says (an fp32/fp16 shadow, arm I's bf16 shadow);
    otherwise it runs on the policy's own device and refuses ``device=``."""
    takes_layers: bool = False
    """``layers=`` / ``k=`` / ``calibration=`` choose the decoder layers it runs in fp32."""
    takes_pieces: bool = False
    """``pieces=`` (which pieces of its forward follow vLLM; vLLM's own kernels need vLLM and CUDA) and
    ``over_parameters=`` (score the policy's parameters instead of a shadow)."""
    copies_weights: bool = True
    """Builds weights of its own from the policy's parameters (a shadow, fp32 islands, fused projections): refused
    under DeepSpeed ZeRO-3, and rebuilt when the policy is sharded after it was made. ``False``: the policy as
    called, nothing of its own."""
    fp32_everywhere: bool = False
    """Every weight and activation in fp32: with ``tf32=False`` it scores as the IEEE fp32 reference does."""


PLANS: dict[str, PlanEntry] = {
    "bf16": PlanEntry(_policy_plan, copies_weights=False),
    "fp32": PlanEntry(_shadow_plan, takes_device=True, fp32_everywhere=True),
    "fp16": PlanEntry(_shadow_plan, takes_device=True),
    "fp32_head": PlanEntry(_upcast_plan),
    "guided": PlanEntry(_upcast_plan, takes_layers=True),
    "vllm": PlanEntry(_vllm_plan, takes_device=True, takes_pieces=True),
}
"""Plan name (:data:`bloggap_plugin.core.arms.PLAN_NAMES`, same order) -> its entry."""
REFERENCE_PLAN = "fp32"
"""The plan of the fp32 batch-1 reference (built with ``tf32=False``: IEEE fp32)."""


def guided_layers(
    policy: nn.Module, layers: Sequence[int] | str | None, k: int,
    calibration: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[list[int], DivergenceProfile | None]:
    """``(layer ids, attribution profile or None)`` of a ``guided`` plan: the given ids (checked against the
    model), or the top-``k`` of a divergence profile on ``calibration`` rows for ``layers="auto"``."""
    n_layers = len(layer_list_path(unwrap_model(policy))[1])
    profile = None
    if isinstance(layers, str):
        if layers != "auto":
            raise ValueError(f"layers must be a list of decoder layer ids or 'auto', got {layers!r}")
        if calibration is None:
            raise ValueError(
                "layers='auto' needs calibration=(input_ids, attention_mask): rows (disjoint from the evaluation "
                "rows) on which to measure the batch-1 vs batch-8 divergence per layer"
            )
        if not isinstance(k, int) or not 0 <= k <= n_layers:
            raise ValueError(
                f"k must be an integer in [0, {n_layers}] (the model has {n_layers} decoder layers), got {k!r}"
            )
        input_ids, attention_mask = calibration[0], calibration[1]
        profile = divergence_profile(policy, input_ids, attention_mask)
        layers = profile.top_k(k)
    elif layers is None:
        raise ValueError(
            "arm 'guided' needs layers=[ids] (decoder layers to run in fp32) or layers='auto' with "
            "calibration=(input_ids, attention_mask); use arm 'fp32_head' for the head only"
        )
    ids = list(layers)
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layers:
            raise ValueError(
                f"bad layer id {i!r}: the model has {n_layers} decoder layers, ids must be integers in 0..{n_layers - 1}"
            )
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate layer ids in {ids}")
    return ids, profile
