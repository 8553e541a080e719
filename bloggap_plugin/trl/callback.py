"""The two entry points: ``GapCallback(trainer, recipe=...)`` and ``GapGRPOTrainer(..., gap=...)``."""

from __future__ import annotations

import os
from pathlib import Path

from transformers import TrainerCallback
from trl import GRPOTrainer

from bloggap_plugin.recipes import GapConfig, load_recipe
from bloggap_plugin.trl.mixin import GapMixin, install

__all__ = ["GapCallback", "GapGRPOTrainer", "resolve_gap"]


def resolve_gap(recipe: str | Path | None = None, gap: GapConfig | dict | None = None) -> tuple[GapConfig, dict]:
    """``(GapConfig, recipe GRPOConfig kwargs)`` from a recipe path or a GapConfig/dict (not both)."""
    if recipe is not None and gap is not None:
        raise ValueError("give either recipe= (a YAML path) or gap= (a GapConfig), not both")
    if recipe is not None:
        grpo_kwargs, config = load_recipe(recipe)
        return config, grpo_kwargs
    if gap is None:
        return GapConfig(), {}
    if isinstance(gap, dict):
        from bloggap_plugin.recipes import gap_config_from_dict

        return gap_config_from_dict(gap), {}
    if not isinstance(gap, GapConfig):
        raise TypeError(f"gap must be a GapConfig or a dict, got {type(gap).__name__}")
    return gap, {}


class GapCallback(TrainerCallback):
    """Attach bloggap to an existing ``GRPOTrainer``: ``trainer.add_callback(GapCallback(trainer, recipe=...))``.

    Following TRL's convention for callbacks that need the trainer, it takes the trainer and installs the
    :class:`GapMixin` hooks on that instance at construction. Only the recipe's ``gap:`` section applies;
    GRPOConfig fields of the recipe that differ from the trainer's are listed in one warning.
    """

    def __init__(self, trainer: GRPOTrainer, recipe: str | Path | None = None, gap: GapConfig | dict | None = None):
        if not isinstance(trainer, GRPOTrainer):
            raise TypeError(f"GapCallback needs a trl GRPOTrainer, got {type(trainer).__name__}")
        self.gap, grpo_kwargs = resolve_gap(recipe, gap)
        self.trainer = trainer
        install(trainer, self.gap, grpo_kwargs, source=str(recipe) if recipe else "gap config")

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer._gap_close()


class GapGRPOTrainer(GapMixin, GRPOTrainer):
    """``GRPOTrainer`` with bloggap: ``GapGRPOTrainer(model, reward_funcs, args=..., gap=GapConfig(...) | recipe=path)``.

    Composes with other GRPOTrainer subclasses through the MRO: ``class T(GapMixin, MyGRPOTrainer)``.
    """

    def __init__(self, *args, gap: GapConfig | dict | None = None, recipe: str | Path | None = None, **kwargs):
        import contextlib

        config, grpo_kwargs = resolve_gap(recipe, gap)
        engine = contextlib.nullcontext()
        trl_args = kwargs.get("args")
        if getattr(trl_args, "use_vllm", False) and getattr(trl_args, "vllm_mode", None) == "colocate":
            from bloggap_plugin.trl import vllm_colocate

            if vllm_colocate.needs_batch_invariant(config) and os.environ.get(vllm_colocate.BATCH_INVARIANT_ENV) != "1":
                from bloggap_plugin.recipes import RecipeError

                raise RecipeError(vllm_colocate.batch_invariant_refusal(config))  # before the engine loads
            # the arm's engine settings, fp16 for H, KV cache, vLLM's sampling mask (gap.kept_source; refused here,
            # before the engine loads, where gap.kept_source: sampling_mask cannot have it)
            engine_kwargs = vllm_colocate.engine_kwargs_for(config, args=trl_args)
            if engine_kwargs:
                engine = vllm_colocate.vllm_colocate_engine(**engine_kwargs)
        with engine:
            super().__init__(*args, **kwargs)
        self._gap_attach(config, grpo_kwargs, source=str(recipe) if recipe else "gap config")
