"""bloggap: find and remove the importance ratio that should be 1 and is not.

Public API (imported lazily, so ``import bloggap_plugin`` stays cheap and never imports TRL or verl):

- metrics: :func:`oob_fraction`, :func:`abs_dlogp_stats`, :func:`clip_status`, :func:`clip_flip_fraction`,
  :func:`kl_k1`, :func:`kl_k3`, :func:`wilson_interval`
- scoring: :func:`token_logprobs`; models: :func:`load_model`
- precision: :func:`make_plan`, :class:`ScoringPlan`
- truncation: :func:`kept_mask`, :func:`log_kept_mass`, :func:`log_kept_mass_from_size`,
  :func:`renormalized_logprobs`
- TRL: :class:`GapCallback`, :class:`GapGRPOTrainer`, :class:`GapMixin`, :class:`GapConfig`, :func:`load_recipe`
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "oob_fraction": "bloggap_plugin.core.metrics",
    "abs_dlogp_stats": "bloggap_plugin.core.metrics",
    "clip_status": "bloggap_plugin.core.metrics",
    "clip_flip_fraction": "bloggap_plugin.core.metrics",
    "kl_k1": "bloggap_plugin.core.metrics",
    "kl_k3": "bloggap_plugin.core.metrics",
    "wilson_interval": "bloggap_plugin.core.metrics",
    "token_logprobs": "bloggap_plugin.core.scoring",
    "load_model": "bloggap_plugin.models",
    "make_plan": "bloggap_plugin.core.precision",
    "ScoringPlan": "bloggap_plugin.core.precision",
    "kept_mask": "bloggap_plugin.core.truncation",
    "log_kept_mass": "bloggap_plugin.core.truncation",
    "log_kept_mass_from_size": "bloggap_plugin.core.truncation",
    "renormalized_logprobs": "bloggap_plugin.core.truncation",
    "GapCallback": "bloggap_plugin.trl",
    "GapGRPOTrainer": "bloggap_plugin.trl",
    "GapMixin": "bloggap_plugin.trl",
    "GapConfig": "bloggap_plugin.recipes",
    "load_recipe": "bloggap_plugin.recipes",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'bloggap_plugin' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
