"""bloggap: find and remove the importance ratio that should be 1 and is not.

Public API, imported lazily so that ``import bloggap_plugin`` stays cheap and imports neither torch, TRL, verl
nor transformers (``tests/root/test_package.py`` checks it):

- TRL: :class:`GapCallback`, :class:`GapGRPOTrainer`, :class:`GapMixin`; recipes: :class:`GapConfig`,
  :func:`load_recipe`
- scoring: :func:`token_logprobs`; precision: :func:`make_plan`; models: :func:`load_model`

Everything else lives in its module: the metric helpers (``oob_fraction``, ``abs_dlogp_stats``, ``clip_status``,
``clip_flip_fraction``, ``kl_k1``, ``kl_k3``, ``wilson_interval``) in :mod:`bloggap_plugin.core.metrics`, the
truncation maths in :mod:`bloggap_plugin.core.truncation`, :class:`ScoringPlan` in
:mod:`bloggap_plugin.core.plans`, the verl plugin in :mod:`bloggap_plugin.verl`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time __getattr__ imports on first use
    from bloggap_plugin.core.plans import make_plan
    from bloggap_plugin.core.scoring import token_logprobs
    from bloggap_plugin.models import load_model
    from bloggap_plugin.recipes import GapConfig, load_recipe
    from bloggap_plugin.trl import GapCallback, GapGRPOTrainer, GapMixin

_LAZY = {
    "make_plan": "bloggap_plugin.core.plans",
    "token_logprobs": "bloggap_plugin.core.scoring",
    "load_model": "bloggap_plugin.models",
    "GapConfig": "bloggap_plugin.recipes",
    "load_recipe": "bloggap_plugin.recipes",
    "GapCallback": "bloggap_plugin.trl",
    "GapGRPOTrainer": "bloggap_plugin.trl",
    "GapMixin": "bloggap_plugin.trl",
}

__all__ = [  # written out (not sorted(_LAZY)) so that linters and type checkers read it
    "GapCallback",
    "GapConfig",
    "GapGRPOTrainer",
    "GapMixin",
    "load_model",
    "load_recipe",
    "make_plan",
    "token_logprobs",
    "__version__",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'bloggap_plugin' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
