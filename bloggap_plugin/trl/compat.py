"""TRL version gate: the supported range and the private methods (with their parameters) the plugin hooks."""

from __future__ import annotations

import inspect
import warnings

__all__ = ["SUPPORTED_TRL", "REQUIRED_METHODS", "UnsupportedTRLError", "check_trl"]

SUPPORTED_TRL = ">=1.16,<1.17"
SUPPORTED_TRL_TEXT = "trl 1.16.x (fused-LM-head log-prob path)"
# Private GRPOTrainer methods the plugin wraps, with the leading parameters it relies on (after self).
REQUIRED_METHODS = {
    "_generate_and_score_completions": ("inputs",),
    "_get_per_token_logps_and_entropies": (
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
        "compute_aux_loss",
    ),
    "_compute_loss": ("model", "inputs"),
    "_prepare_inputs": ("generation_batch",),
    "_generate_single_turn": ("prompt_ids", "images", "multimodal_fields", "num_generations"),
}


class UnsupportedTRLError(RuntimeError):
    """The installed TRL is outside the supported range or lacks a hooked private method."""


def _in_range(version: str) -> bool:
    from packaging.version import Version

    v = Version(version)
    return Version("1.16") <= v < Version("1.17")


def check_trl(trainer_cls=None, strict: bool = True) -> str:
    """Check TRL's version and the hooked methods of ``trainer_cls`` (default: ``GRPOTrainer``).

    Returns the version string. Raises :class:`UnsupportedTRLError` naming the supported range and
    everything missing; with ``strict=False`` an out-of-range version only warns (missing methods still raise).
    """
    import trl

    version = getattr(trl, "__version__", "unknown")
    if trainer_cls is None:
        from trl import GRPOTrainer

        trainer_cls = GRPOTrainer
    problems = []
    for name, params in REQUIRED_METHODS.items():
        method = getattr(trainer_cls, name, None)
        if method is None:
            problems.append(f"GRPOTrainer.{name} is missing")
            continue
        try:
            signature = list(inspect.signature(method).parameters)
        except (TypeError, ValueError):
            problems.append(f"GRPOTrainer.{name} has no inspectable signature")
            continue
        if signature and signature[0] == "self":
            signature = signature[1:]
        if tuple(signature[: len(params)]) != params:
            problems.append(f"GRPOTrainer.{name} parameters are {tuple(signature)}, expected to start with {params}")
    try:
        from trl.trainer import utils as trl_utils

        if not hasattr(trl_utils, "add_fused_lm_head"):
            problems.append("trl.trainer.utils.add_fused_lm_head is missing (pre-1.16 logits path)")
    except ImportError:
        problems.append("trl.trainer.utils cannot be imported")
    try:
        version_ok = _in_range(version)
    except Exception:  # unparsable version string
        version_ok = False
    if problems:
        raise UnsupportedTRLError(
            f"bloggap supports {SUPPORTED_TRL_TEXT}; found trl {version} with: " + "; ".join(problems)
            + f". Install trl{SUPPORTED_TRL}."
        )
    if not version_ok:
        message = (
            f"bloggap supports {SUPPORTED_TRL_TEXT}; found trl {version}. Install trl{SUPPORTED_TRL}, or set "
            "gap.strict_version: false to try anyway (the hooked methods were found)."
        )
        if strict:
            raise UnsupportedTRLError(message)
        warnings.warn(message, stacklevel=2)
    return version
