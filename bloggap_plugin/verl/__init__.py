"""bloggap's verl integration, loaded by verl itself through the ``verl.plugins`` entry point.

verl 0.9.1's ``verl/__init__.py`` loads every entry point of the group ``verl.plugins`` (unless
``VERL_USE_EXTERNAL_PLUGINS=none``), so importing verl in any process (driver, TaskRunner, Ray workers) imports
this module, which calls :func:`register`. Set ``BLOGGAP_VERL_DISABLE=1`` to switch it off.

:func:`register` first validates every ``BLOGGAP_VERL_*`` variable (:func:`bloggap_plugin.verl.config.read_environment`);
a bad value raises :class:`SystemExit` with a one-line message naming the variable, because verl's plugin loader
swallows ``Exception`` subclasses at DEBUG level, which would silently run without the plugin.

:func:`register` installs, each as soon as its verl module is imported (nothing is imported eagerly, because
this runs while ``verl/__init__`` is still executing):

- ``verl.trainer.ppo.core_algos``: the policy loss ``gap_vanilla`` (:mod:`bloggap_plugin.verl.loss`);
- ``verl.workers.engine_workers``: ``TrainingWorker.train_mini_batch`` counts its optimizer steps, so that
  ``gap_vanilla`` logs the first mini-batch's ratio as ``gap/ratio/*`` (clip: ``gap/clip/*``) and later ones' as
  ``gap/update/*`` (``gap/update_clip/*``);
- ``verl.trainer.ppo.rollout_corr_helper`` and ``verl.trainer.ppo.v1.trainer_base``: the kept-mass lift and the
  all-rejected guard around ``compute_rollout_correction_and_add_to_batch`` (:mod:`.correction`);
- ``verl.trainer.ppo.ray_trainer``: the same for the legacy trainer;
- ``verl.workers.engine.fsdp.transformer_impl``: the engine override (:mod:`.engine`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

import torch

from bloggap_plugin.verl.config import DISABLE_ENV, SettingsError, read_environment

__all__ = ["lift_rollout_log_probs", "register", "is_registered", "DISABLE_ENV"]
logger = logging.getLogger("bloggap.verl")
_LOCK = threading.Lock()
_REGISTERED = False


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted (Ray redirects it per worker)."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self):  # noqa: D102 - logging.StreamHandler's attribute
        return sys.stderr


def _own_log_handler(plugin_logger: logging.Logger) -> None:
    """Give the plugin's logger its own stderr handler at WARNING and stop it propagating, as verl does for its
    ``verl`` logger. In verl's TaskRunner the root logger cannot be relied on: vLLM's API routers import
    ``model_hosting_container_standards``, which sets the root logger and its handlers to ERROR, and the
    all-rejected guard's warning was lost. Idempotent; a level set by the user is kept."""
    if not any(isinstance(handler, _StderrHandler) for handler in plugin_logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:%(asctime)s:%(message)s"))
        plugin_logger.addHandler(handler)
    if plugin_logger.level == logging.NOTSET:
        plugin_logger.setLevel(logging.WARNING)
    plugin_logger.propagate = False


_own_log_handler(logger)


def lift_rollout_log_probs(
    rollout_log_probs: torch.Tensor, log_kept_mass: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """Rollout log-probs lifted to the full-vocabulary support: ``rollout + log_kept_mass`` on response tokens.

    Shapes ``[B, T]``; ``log_kept_mass`` in nats, <= 0; positions where ``response_mask`` is 0 are unchanged.
    See :func:`bloggap_plugin.verl.correction.lift_rollout_log_probs`.
    """
    from bloggap_plugin.verl.correction import lift_rollout_log_probs as _lift

    return _lift(rollout_log_probs, log_kept_mass, response_mask)


def is_registered() -> bool:
    return _REGISTERED


def _patch_core_algos(module) -> None:
    from bloggap_plugin.verl.loss import register_loss

    register_loss(module)


def _patch_helper(module) -> None:
    from bloggap_plugin.verl.correction import patch_helper_module

    patch_helper_module(module)


def _patch_v1(module) -> None:
    from bloggap_plugin.verl.correction import patch_v1_trainer_module

    patch_v1_trainer_module(module)


def _patch_legacy(module) -> None:
    from bloggap_plugin.verl.correction import patch_legacy_trainer_module

    patch_legacy_trainer_module(module)


def _patch_workers(module) -> None:
    from bloggap_plugin.verl.loss import patch_training_worker

    patch_training_worker(module)


def _patch_engine(module) -> None:
    from bloggap_plugin.verl.engine import register_engine

    register_engine(module)


def trl_lacks_value_head() -> str | None:
    """TRL's folder when TRL is importable but offers ``AutoModelForCausalLMWithValueHead`` neither in
    ``trl.experimental.ppo`` nor at its root (TRL >= 1.x removed it), else None. Read from the files: TRL is not
    imported."""
    import importlib.util

    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.origin:
        return None
    folder = os.path.dirname(spec.origin)
    if os.path.isdir(os.path.join(folder, "experimental", "ppo")):
        return None
    try:
        with open(spec.origin, encoding="utf-8") as handle:
            if "AutoModelForCausalLMWithValueHead" in handle.read():
                return None
    except OSError:
        return None
    return folder


def _patch_monkey_patch(module) -> None:
    """verl 0.9.1's ``apply_monkey_patch`` (every FSDP model build) imports ``AutoModelForCausalLMWithValueHead``
    whenever TRL is importable, only to patch that class's ``state_dict``; with a TRL that lacks the class, skip
    that step (``is_trl_available`` reads False in that module only) instead of failing with ImportError."""
    folder = trl_lacks_value_head()
    if folder is None or not hasattr(module, "is_trl_available"):
        return
    module.is_trl_available = lambda: False
    logger.warning(
        "bloggap: TRL at %s has no AutoModelForCausalLMWithValueHead (removed in TRL 1.x); verl's apply_monkey_patch "
        "would fail with ImportError, so its TRL value-head step is skipped (nothing else changes)",
        folder,
    )


HOOKS = (
    ("verl.models.transformers.monkey_patch", _patch_monkey_patch),
    ("verl.trainer.ppo.core_algos", _patch_core_algos),
    ("verl.trainer.ppo.rollout_corr_helper", _patch_helper),
    ("verl.trainer.ppo.v1.trainer_base", _patch_v1),
    ("verl.trainer.ppo.ray_trainer", _patch_legacy),
    ("verl.workers.engine.fsdp.transformer_impl", _patch_engine),
    ("verl.workers.engine_workers", _patch_workers),
)


def register(force: bool = False) -> bool:
    """Install every hook (idempotent). Returns False when disabled by ``BLOGGAP_VERL_DISABLE=1`` (ignored with
    ``force``). Raises :class:`SystemExit` (one line, naming the variable) when a ``BLOGGAP_VERL_*`` variable is
    bad."""
    global _REGISTERED
    try:
        disabled, _ = read_environment()
    except SettingsError as err:
        raise SystemExit(f"bloggap verl plugin: {err}") from None
    if disabled and not force:
        logger.info("bloggap verl plugin disabled by %s", DISABLE_ENV)
        return False
    from bloggap_plugin.verl._hooks import when_imported

    with _LOCK:
        first = not _REGISTERED
        _REGISTERED = True
    for name, callback in HOOKS:
        when_imported(name, callback)
    if first:
        logger.warning(
            "bloggap verl plugin registered (pid %d): policy loss gap_vanilla, kept-mass lift + all-rejected guard "
            "on rollout correction, fp32-head/kept-mass engine; disable with %s=1",
            os.getpid(),
            DISABLE_ENV,
        )
    return True


register()
