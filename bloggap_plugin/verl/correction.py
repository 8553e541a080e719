"""Truncation-aware rollout correction and the all-rejected guard, around verl's rollout_corr_helper.

vLLM's ``processed_logprobs`` are normalised over the kept set of top_p/top_k/min_p sampling; verl's
``old_log_probs`` over the full vocabulary. So ``log ratio = old - rollout = log S_t <= 0`` on every token
(S_t = kept probability mass), and Geo-RS / Seq-MIS reject every sequence. The fix lifts the rollout log-probs
to the full-vocabulary support, ``rollout + log S_t`` on response tokens (:func:`lift_rollout_log_probs`),
before verl's IS/RS see them.

Metrics added to verl's step dict (all floats):

- ``gap/verl/kept_source``: 0 = no kept mass available (not lifted), 1 = from the rollout's kept-set sizes
  (``rollout_support_size``, patched verl), 2 = re-truncated from the actor's logits (approximate),
  3 = supplied in the batch by other code.
- ``gap/verl/log_kept_mass_mean``: mean log S_t over response tokens (nats, <= 0), when lifted.
- ``gap/verl/all_rejected``: 1 when rejection sampling removed every sequence (or every sequence IS weight
  sits at the exp(-20) floor), else 0.
- ``gap/verl/is_floor_frac``: share of sequences whose sequence-level IS weight is at the floor.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from bloggap_plugin.verl.config import (
    BloggapVerlConfig,
    is_truncated,
    load_settings,
    sampling_from_trainer_config,
    settings_from_trainer_config,
)
from bloggap_plugin.verl.fp16 import check_fp16

logger = logging.getLogger("bloggap.verl")

KEPT_SOURCE_CODES = {"none": 0.0, "support_size": 1.0, "retruncate": 2.0, "batch": 3.0}
SAFETY_BOUND = 20.0  # verl's rollout_corr_helper.SAFETY_BOUND (log-ratio clamp)

# Human names the verl docs use for the presets.
PRESET_NICKNAMES = {
    "decoupled_geo_rs": "Geo-RS",
    "decoupled_seq_is_rs": "Seq-MIS",
    "decoupled_k3_rs": "K3-RS",
    "decoupled_seq_is": "Seq-TIS",
    "decoupled_token_is": "Token-TIS",
    "decoupled_token_icepop": "Token-IcePop",
    "decoupled_geo_rs_seq_tis": "Geo-RS + Seq-TIS",
    "decoupled_geo_rs_token_tis": "Geo-RS + Token-TIS",
    "decoupled_k3_rs_seq_tis": "K3-RS + Seq-TIS",
    "decoupled_k3_rs_token_tis": "K3-RS + Token-TIS",
    "bypass_ppo_clip_geo_rs": "bypass PPO-clip + Geo-RS",
    "bypass_ppo_clip_k3_rs": "bypass PPO-clip + K3-RS",
    "bypass_pg_geo_rs": "bypass REINFORCE + Geo-RS",
    "bypass_pg_is": "bypass REINFORCE + Seq-TIS",
}
_PRESET_FIELDS = ("rollout_is", "rollout_is_threshold", "rollout_rs", "rollout_rs_threshold", "bypass_mode", "loss_type")


class AllRejectedError(RuntimeError):
    """Raised by the guard (``bloggap.guard=raise``) when a step keeps no sequence."""


def lift_rollout_log_probs(
    rollout_log_probs: torch.Tensor, log_kept_mass: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """Rollout log-probs on the full-vocabulary support: ``rollout + log_kept_mass`` on response tokens.

    ``rollout_log_probs`` ``[B, T]`` (nats, kept-set normalised), ``log_kept_mass`` ``[B, T]`` (nats, <= 0,
    log of the kept probability mass at each position), ``response_mask`` ``[B, T]`` (0/1 or bool). Positions
    outside the mask are returned unchanged. Returns a new tensor in ``rollout_log_probs``' dtype.
    """
    if rollout_log_probs.shape != log_kept_mass.shape or rollout_log_probs.shape != response_mask.shape:
        raise ValueError(
            f"shape mismatch: rollout_log_probs {tuple(rollout_log_probs.shape)}, log_kept_mass "
            f"{tuple(log_kept_mass.shape)}, response_mask {tuple(response_mask.shape)}; all three must be [B, T] "
            "over the response tokens"
        )
    mask = response_mask.bool()
    selected = log_kept_mass[mask]
    if selected.numel():
        if not torch.isfinite(selected).all():
            raise ValueError("log_kept_mass is not finite on a response token (an empty kept set?)")
        if float(selected.max()) > 1e-5:
            raise ValueError(
                f"log_kept_mass must be <= 0 (a probability mass <= 1), got max {float(selected.max()):.3g}; "
                "did you pass the kept mass instead of its log, or a log-prob?"
            )
    lifted = rollout_log_probs.float() + torch.where(mask, log_kept_mass.float(), torch.zeros_like(log_kept_mass.float()))
    return torch.where(mask, lifted, rollout_log_probs.float()).to(rollout_log_probs.dtype)


# ----------------------------------------------------------------------------------------------------------
# Per-step context: the V1 trainer's method wrappers tell the name-level wrapper what it cannot see itself.


@dataclass
class StepContext:
    """What the trainer knows for this step: settings, rollout sampling, kept-mass source, TQ batch meta."""

    settings: BloggapVerlConfig
    sampling: dict
    kept_source: str = "none"
    batch_meta: Any = None
    extra: dict = field(default_factory=dict)


_STEP: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar("bloggap_verl_step", default=None)


def current_context() -> StepContext | None:
    return _STEP.get()


def resolve_kept_source(settings: BloggapVerlConfig, config: Any) -> str:
    """``support_size`` / ``retruncate`` / ``none`` for a trainer config (see ``BloggapVerlConfig.kept_source``)."""
    if not settings.fix_truncation or settings.kept_source == "off":
        return "none"
    sampling = sampling_from_trainer_config(config, settings)
    if not is_truncated(sampling):
        return "none"
    if settings.kept_source != "auto":
        return settings.kept_source
    replay = False
    try:
        replay = bool(config.actor_rollout_ref.rollout.engine_kwargs.vllm.get("return_sampling_mask", False))
    except Exception:  # noqa: BLE001 - node absent: no replay
        replay = False
    return "support_size" if replay else "retruncate"


# ----------------------------------------------------------------------------------------------------------
# Preset naming and the guard.


def _cfg_get(cfg: Any, key: str, default=None):
    if cfg is None:
        return default
    if hasattr(cfg, "get"):
        try:
            return cfg.get(key, default)
        except TypeError:
            pass
    return getattr(cfg, key, default)


def _norm(value):
    if isinstance(value, float | int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value.strip()
    return value


def infer_preset(cfg: Any) -> str:
    """Name of the ``RolloutCorrectionConfig`` preset a rollout-correction config equals, e.g.
    ``"decoupled_geo_rs (Geo-RS)"``; for a config matching no preset, ``"custom"`` plus the preset whose
    IS/RS modes it shares, if any (``"custom, like decoupled_geo_rs (Geo-RS) with another threshold"``)."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    wanted = {key: _norm(_cfg_get(cfg, key)) for key in _PRESET_FIELDS}
    same_modes = None
    for name in sorted(dir(RolloutCorrectionConfig)):
        if not (name.startswith("decoupled_") or name.startswith("bypass_")):
            continue
        factory = getattr(RolloutCorrectionConfig, name)
        if not callable(factory):
            continue
        preset = factory()
        values = {key: _norm(getattr(preset, key)) for key in _PRESET_FIELDS}
        label = f"{name} ({PRESET_NICKNAMES[name]})" if name in PRESET_NICKNAMES else name
        if values == wanted:
            return label
        modes = ("rollout_is", "rollout_rs", "bypass_mode")
        if same_modes is None and all(values[k] == wanted[k] for k in modes):
            same_modes = label
    if same_modes is not None:
        return f"custom, like {same_modes} with another threshold"
    return "custom"


def _describe_fix(sampling: dict, kept_source: str, preset: str) -> str:
    if kept_source == "none" and is_truncated(sampling):
        return (
            "the rollout samples with top_p/top_k/min_p, so vLLM's processed log-probs are normalised over the "
            "kept set and log(old/rollout) = log(kept mass) < 0 on every token. Fix: let bloggap lift the rollout "
            "log-probs (+bloggap.fix_truncation=true, the default; exact with `bloggap patch verl --apply` and "
            "+actor_rollout_ref.rollout.engine_kwargs.vllm.return_sampling_mask=true, top_k=1024), or sample with "
            "actor_rollout_ref.rollout.top_p=1.0 top_k=-1, or use a preset that tolerates it (decoupled_k3_rs "
            "for top_p >= 0.9) or a wider threshold"
        )
    if kept_source != "none":
        return (
            "the kept-mass lift is on, so what remains is the engine/trainer numerical mismatch; the "
            f"{preset} threshold is narrower than that mismatch. Fix: widen the threshold, use decoupled_k3_rs, "
            "or reduce the mismatch (fp32 LM head: +bloggap.fp32_head=true; param_dtype, see docs/verl.md)"
        )
    return (
        "the rollout is untruncated, so this is the engine/trainer numerical mismatch (bf16, batch shape); "
        f"the {preset} threshold is narrower than it. Fix: widen the threshold, use decoupled_k3_rs, or reduce "
        "the mismatch (+bloggap.fp32_head=true; param_dtype, see docs/verl.md)"
    )


def guard_check(
    cfg: Any,
    input_mask: torch.Tensor,
    output_mask: torch.Tensor,
    is_weights: torch.Tensor | None,
    context: StepContext,
    log_kept_mass_mean: float | None = None,
) -> dict[str, float]:
    """The all-rejected guard: metrics, plus a warning (or :class:`AllRejectedError`) when it fires."""
    metrics: dict[str, float] = {"gap/verl/all_rejected": 0.0}
    valid_seq = input_mask.bool().any(-1)
    n_valid = int(valid_seq.sum())
    reasons = []
    if _cfg_get(cfg, "rollout_rs") is not None and n_valid > 0:
        kept_seq = output_mask.bool().any(-1) & valid_seq
        if int(kept_seq.sum()) == 0:
            reasons.append(f"rejection sampling removed all {n_valid} sequences")
    rollout_is = _cfg_get(cfg, "rollout_is")
    if rollout_is == "sequence" and is_weights is not None and n_valid > 0:
        # The weight is constant along a sequence; read it at the first valid token.
        first = input_mask.bool().float().argmax(-1)
        seq_w = is_weights.gather(-1, first.unsqueeze(-1)).squeeze(-1)[valid_seq].double()
        floor = math.exp(-SAFETY_BOUND)
        at_floor = seq_w <= floor * (1.0 + 1e-3)
        metrics["gap/verl/is_floor_frac"] = float(at_floor.double().mean())
        if not bool(_cfg_get(cfg, "rollout_is_batch_normalize", False)) and bool(at_floor.all()):
            reasons.append(f"every sequence IS weight sits at the exp(-{SAFETY_BOUND:g}) floor (gradient ~ 0)")
    if not reasons:
        return metrics
    metrics["gap/verl/all_rejected"] = 1.0
    preset = infer_preset(cfg)
    sampling = context.sampling
    thresholds = (
        f"rollout_rs={_cfg_get(cfg, 'rollout_rs')}, rollout_rs_threshold={_cfg_get(cfg, 'rollout_rs_threshold')}, "
        f"rollout_is={rollout_is}, rollout_is_threshold={_cfg_get(cfg, 'rollout_is_threshold')}"
    )
    kept = "" if log_kept_mass_mean is None else f", mean log kept mass lifted {log_kept_mass_mean:.4f}"
    message = (
        f"bloggap: rollout correction preset {preset} ({thresholds}): {'; '.join(reasons)}. Sampling: "
        f"top_p={sampling.get('top_p')}, top_k={sampling.get('top_k')}, min_p={sampling.get('min_p')}, "
        f"temperature={sampling.get('temperature')}; kept-mass source: {context.kept_source}{kept}. Cause: "
        f"{_describe_fix(sampling, context.kept_source, preset)}. (verl itself only prints 'Response mask is all "
        "False'.)"
    )
    if context.settings.guard == "raise":
        raise AllRejectedError(message + " Stopping because bloggap.guard=raise.")
    logger.warning(message)
    return metrics


# ----------------------------------------------------------------------------------------------------------
# The wrapper around verl's compute_rollout_correction_and_add_to_batch.


def _fetch_log_kept_mass_from_tq(context: StepContext):
    """``log_kept_mass`` [B, T_resp] for the V1 batch from TransferQueue (None if the field is absent)."""
    meta = context.batch_meta
    if meta is None:
        return None
    try:
        import transfer_queue as tq
        from verl.workers.utils.padding import response_from_nested

        data = tq.kv_batch_get(
            keys=meta.keys, partition_id=meta.partition_id, select_fields=["log_kept_mass", "response_mask"]
        )
        nested = response_from_nested(data["log_kept_mass"], data["response_mask"])
        return nested.to_padded_tensor(0.0)
    except Exception as err:  # noqa: BLE001 - the engine override did not produce the field
        logger.warning("bloggap: no log_kept_mass for this batch (%s); rollout log-probs not lifted", err)
        return None


def corrected_rollout_correction(original, batch, rollout_corr_config):
    """verl's ``compute_rollout_correction_and_add_to_batch`` with the kept-mass lift before it and the guard
    after it. ``original`` is verl's function."""
    context = current_context()
    if context is None:
        settings = load_settings()
        context = StepContext(settings=settings, sampling=sampling_from_trainer_config(None, settings))
    metrics: dict[str, float] = {}
    tensors = batch.batch
    source = "none"
    log_kept_mass = None
    if context.settings.fix_truncation:
        if "log_kept_mass" in tensors.keys():
            log_kept_mass = tensors["log_kept_mass"]
            source = context.kept_source if context.kept_source != "none" else "batch"
        elif context.kept_source != "none":
            log_kept_mass = _fetch_log_kept_mass_from_tq(context)
            source = context.kept_source if log_kept_mass is not None else "none"
    input_mask = tensors["response_mask"].clone()
    lkm_mean = None
    if log_kept_mass is not None:
        rollout = tensors["rollout_log_probs"]
        log_kept_mass = log_kept_mass.to(rollout.device)
        if log_kept_mass.shape != rollout.shape:
            # nested -> padded conversions pad to the longest response in the batch; verl pads to response_length
            padded = torch.zeros_like(rollout, dtype=torch.float32)
            width = min(rollout.shape[-1], log_kept_mass.shape[-1])
            padded[:, :width] = log_kept_mass[:, :width]
            log_kept_mass = padded
        tensors["rollout_log_probs"] = lift_rollout_log_probs(rollout, log_kept_mass, input_mask)
        selected = log_kept_mass[input_mask.bool()]
        lkm_mean = float(selected.double().mean()) if selected.numel() else 0.0
        metrics["gap/verl/log_kept_mass_mean"] = lkm_mean
    metrics["gap/verl/kept_source"] = KEPT_SOURCE_CODES[source]
    context.kept_source = source if source != "batch" else context.kept_source
    batch, corr_metrics = original(batch, rollout_corr_config)
    if context.settings.guard != "off":
        is_weights = batch.batch["rollout_is_weights"] if "rollout_is_weights" in batch.batch.keys() else None
        metrics.update(
            guard_check(rollout_corr_config, input_mask, batch.batch["response_mask"], is_weights, context, lkm_mean)
        )
    corr_metrics = dict(corr_metrics)
    corr_metrics.update(metrics)
    return batch, corr_metrics


def make_wrapper(original):
    """A drop-in replacement for verl's function (same signature), marked so it is never wrapped twice."""
    if getattr(original, "__bloggap_wrapped__", False):
        return original

    @functools.wraps(original)
    def compute_rollout_correction_and_add_to_batch(batch, rollout_corr_config):
        return corrected_rollout_correction(original, batch, rollout_corr_config)

    compute_rollout_correction_and_add_to_batch.__bloggap_wrapped__ = True
    compute_rollout_correction_and_add_to_batch.__bloggap_original__ = original
    return compute_rollout_correction_and_add_to_batch


def patch_helper_module(module) -> None:
    """Wrap the helper in ``verl.trainer.ppo.rollout_corr_helper`` (reaches the legacy trainer, which imports
    it inside ``fit``)."""
    module.compute_rollout_correction_and_add_to_batch = make_wrapper(module.compute_rollout_correction_and_add_to_batch)


# ----------------------------------------------------------------------------------------------------------
# V1 trainer (verl.trainer.ppo.v1.trainer_base): wrap the imported name and two PPOTrainer methods.


def _trainer_context(trainer, batch_meta) -> StepContext:
    return trainer_step(trainer.config, batch_meta).context


def engine_extra_info(context: StepContext) -> dict:
    """The ``bloggap_*`` keys the trainer adds to the old-log-prob call's ``extra_info`` for the engine."""
    info = {"bloggap_fp32_head": bool(context.settings.fp32_head)}
    if context.kept_source in ("support_size", "retruncate"):
        info.update(
            {
                "bloggap_log_kept_mass": context.kept_source,
                "bloggap_top_p": float(context.sampling["top_p"]),
                "bloggap_top_k": int(context.sampling["top_k"]),
                "bloggap_min_p": float(context.sampling["min_p"]),
            }
        )
    return info


def _validate_settings_at_construction(trainer_cls) -> None:
    """Make ``trainer_cls.__init__`` check the ``bloggap`` config node first, so a bad ``+bloggap.*`` value (or an
    fp16 actor/rollout the doctor's result refuses: :func:`~bloggap_plugin.verl.fp16.check_fp16`) fails in the
    constructor, before the trainer starts workers or loads a model (``SettingsError``, one line)."""
    init = trainer_cls.__init__
    if getattr(init, "__bloggap_wrapped__", False):
        return

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):  # noqa: N807 - replaces the constructor
        config = kwargs.get("config", args[0] if args else None)
        check_fp16(config, settings_from_trainer_config(config))
        return __init__.__bloggap_original__(self, *args, **kwargs)

    __init__.__bloggap_wrapped__ = True
    __init__.__bloggap_original__ = init
    trainer_cls.__init__ = __init__


def patch_v1_trainer_module(module) -> None:
    """Wrap ``trainer_base.compute_rollout_correction_and_add_to_batch`` (the name V1 calls), make
    ``PPOTrainer._compute_old_log_prob`` / ``_compute_advantage`` publish the step context and its constructor
    validate the ``bloggap`` node."""
    module.compute_rollout_correction_and_add_to_batch = make_wrapper(module.compute_rollout_correction_and_add_to_batch)
    trainer_cls = module.PPOTrainer
    _validate_settings_at_construction(trainer_cls)

    old_log_prob = trainer_cls._compute_old_log_prob
    if not getattr(old_log_prob, "__bloggap_wrapped__", False):

        @functools.wraps(old_log_prob)
        def _compute_old_log_prob(self, batch, metrics):
            context = _trainer_context(self, batch)
            extra = getattr(batch, "extra_info", None)
            info = engine_extra_info(context)
            if extra is not None:
                extra.update(info)
            try:
                return _compute_old_log_prob.__bloggap_original__(self, batch, metrics)
            finally:  # the training forward and the ref pass must not see the old-log-prob-only requests
                if extra is not None:
                    for key in info:
                        extra.pop(key, None)

        _compute_old_log_prob.__bloggap_wrapped__ = True
        _compute_old_log_prob.__bloggap_original__ = old_log_prob
        trainer_cls._compute_old_log_prob = _compute_old_log_prob

    advantage = trainer_cls._compute_advantage
    if not getattr(advantage, "__bloggap_wrapped__", False):

        @functools.wraps(advantage)
        def _compute_advantage(self, batch, metrics):
            token = _STEP.set(_trainer_context(self, batch))
            try:
                return advantage(self, batch, metrics)
            finally:
                _STEP.reset(token)

        _compute_advantage.__bloggap_wrapped__ = True
        trainer_cls._compute_advantage = _compute_advantage


def patch_legacy_trainer_module(module) -> None:
    """Legacy ``RayPPOTrainer.fit`` imports the helper inside the function; publish the context around fit (and
    validate the ``bloggap`` node in the constructor)."""
    trainer_cls = module.RayPPOTrainer
    _validate_settings_at_construction(trainer_cls)
    fit = trainer_cls.fit
    if getattr(fit, "__bloggap_wrapped__", False):
        return

    @functools.wraps(fit)
    def fit_with_context(self, *args, **kwargs):
        token = _STEP.set(_trainer_context(self, None))
        try:
            return fit(self, *args, **kwargs)
        finally:
            _STEP.reset(token)

    fit_with_context.__bloggap_wrapped__ = True
    trainer_cls.fit = fit_with_context


class trainer_step:  # noqa: N801 - used as a context manager, like torch.no_grad
    """Publish the step context for a trainer config (what the V1 wrappers do), e.g. for the legacy trainer,
    a custom trainer or a test: ``with trainer_step(config): compute_rollout_correction_and_add_to_batch(...)``."""

    def __init__(self, config: Any, batch_meta: Any = None):
        settings = settings_from_trainer_config(config)
        self.context = StepContext(
            settings=settings,
            sampling=sampling_from_trainer_config(config, settings),
            kept_source=resolve_kept_source(settings, config),
            batch_meta=batch_meta,
        )
        self._token = None

    def __enter__(self) -> StepContext:
        self._token = _STEP.set(self.context)
        return self.context

    def __exit__(self, *exc) -> None:
        _STEP.reset(self._token)
