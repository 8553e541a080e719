"""What TRL's colocate engine and generation were built with, read without changing them: the engine's ``LLM(...)``
settings and model runner, and the sampling keywords TRL passes to vLLM. A lower layer for the modules that decide
on them (:mod:`~bloggap_plugin.trl.vllm_colocate`, :mod:`~bloggap_plugin.trl.kept_source`,
:mod:`~bloggap_plugin.trl.attach`)."""

from __future__ import annotations

from typing import Any

__all__ = ["colocate_llm", "colocate_engine", "colocate_engine_setting", "colocate_model_runner", "engine_model_runner",
           "trl_sampling_args", "vllm_sampling"]


def colocate_llm(trainer: Any) -> Any:
    """A GRPOTrainer's colocate ``LLM`` (``trainer.vllm_generation.llm``: what the plugin's engine records sit on), or
    ``None``."""
    return getattr(getattr(trainer, "vllm_generation", None), "llm", None)


def colocate_engine(trainer: Any) -> Any:
    """A GRPOTrainer's colocate ``LLMEngine`` (``trainer.vllm_generation.llm.llm_engine``), or ``None``."""
    return getattr(colocate_llm(trainer), "llm_engine", None)


def colocate_engine_setting(trainer: Any, name: str) -> Any:
    """The value of ``LLM(...)`` keyword ``name`` in a GRPOTrainer's colocate engine as built (read from vLLM's
    config objects, on the engine or its ``vllm_config``), or ``None`` when it cannot be read (no engine, server
    mode, another vLLM layout)."""
    engine = colocate_engine(trainer)
    for holder in (engine, getattr(engine, "vllm_config", None)):
        for part in ("model_config", "cache_config", "scheduler_config", "parallel_config"):
            config = getattr(holder, part, None)
            if config is not None and getattr(config, name, None) is not None:
                return getattr(config, name)
    return None


def colocate_model_runner(trainer: Any) -> str | None:
    """``"v1"`` or ``"v2"``: the model runner of a GRPOTrainer's colocate engine (:func:`engine_model_runner`)."""
    return engine_model_runner(colocate_engine(trainer))


def engine_model_runner(engine: Any) -> str | None:
    """``"v1"`` or ``"v2"``: the model runner of a vLLM ``LLMEngine`` (``vllm_config.use_v2_model_runner``), or
    ``None`` when it cannot be read."""
    try:
        uses_v2 = getattr(getattr(engine, "vllm_config", None), "use_v2_model_runner", None)
    except Exception:  # noqa: BLE001 - a config vLLM cannot evaluate here: not readable
        return None
    return None if not isinstance(uses_v2, bool) else ("v2" if uses_v2 else "v1")


def trl_sampling_args(args: Any) -> dict:
    """The ``SamplingParams`` keywords TRL 1.16's colocate generation passes (``vllm_generation.generate``): the
    GRPOConfig's temperature, top_p, top_k, min_p, repetition_penalty, updated by ``generation_kwargs``."""
    sampling = {name: getattr(args, name, default) for name, default in
                (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("repetition_penalty", 1.0))}
    sampling["min_p"] = sampling["min_p"] or 0.0
    sampling.update(getattr(args, "generation_kwargs", None) or {})
    return sampling


def vllm_sampling(trainer: Any) -> dict:
    """``{top_k, top_p, min_p}`` that TRL's vLLM generation samples with (``generation_kwargs`` override last)."""
    from bloggap_plugin.core.truncation import validate_sampling

    source = getattr(trainer, "vllm_generation", None) or trainer
    settings = {"top_k": getattr(source, "top_k", None), "top_p": getattr(source, "top_p", None),
                "min_p": getattr(source, "min_p", None)}
    settings.update({k: v for k, v in (getattr(source, "generation_kwargs", None) or {}).items() if k in settings})
    top_k = int(settings["top_k"] or 0)
    clean = {"top_k": top_k if top_k > 0 else 0,
             "top_p": 1.0 if settings["top_p"] is None else float(settings["top_p"]),
             "min_p": float(settings["min_p"] or 0.0)}
    validate_sampling(1.0, **clean)
    return clean
