"""TRL's vLLM colocate engine: the sampler's dtype (arm H samples in fp16) and a check of what was built.

TRL 1.16 builds the colocate engine as ``LLM(model=model.name_or_path, ...)`` inside
``trl.generation.vllm_generation.VLLMGeneration._init_vllm`` and passes no ``dtype``: vLLM then runs in the
checkpoint config's dtype (bf16 for most checkpoints; an fp32 checkpoint downcast to bf16 on a CUDA GPU), whatever the
trainer's precision. :func:`vllm_colocate_dtype`
adds ``dtype=`` to that one ``LLM(...)`` call while the trainer is constructed; :class:`~bloggap_plugin.trl.GapGRPOTrainer`
uses it for arm H, and with :class:`~bloggap_plugin.trl.GapCallback` the user wraps the trainer's construction::

    with vllm_colocate_dtype("float16"):
        trainer = GRPOTrainer(..., args=GRPOConfig(use_vllm=True, vllm_mode="colocate", fp16=True, ...))
    trainer.add_callback(GapCallback(trainer, recipe="recipes/arm_H.yaml"))

TRL's weight sync (``load_weights``) copies the trainer's parameters into the engine's, which casts them to the
engine's dtype, so an fp16 engine stays fp16 after every sync. Server mode (``trl vllm-serve``) takes
``--dtype float16`` on the server's command line; the trainer cannot check it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from bloggap_plugin.trl.colocate_reads import (
    colocate_engine,
    colocate_engine_setting,
    colocate_llm,
    colocate_model_runner,
    trl_sampling_args,
)

__all__ = ["vllm_colocate_dtype", "vllm_colocate_engine", "colocate_engine_dtype", "engine_kwargs_from_env", "KV_CACHE_ENV",
           "engine_kwargs_for", "check_colocate_engine", "BATCH_INVARIANT_ENV",
           "one_step_prefill_tokens", "prefill_refusal", "ONE_STEP_PREFILL_CAP", "confine_batch_invariance",
           "own_batch_invariance_env", "BATCH_INVARIANCE_SCOPE_ENV", "check_engine_vllm",
           "trl_colocate_llm_kwargs", "trl_colocate_sampling_kwargs", "colocate_process_env"]

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


ONE_STEP_PREFILL_CAP = 65536
"""The most tokens per engine step :func:`one_step_prefill_tokens` asks for: vLLM sizes its start-up memory profile
(activations of one step) by ``max_num_batched_tokens``, so a long-context model's ``max_num_seqs x max_model_len``
could leave no memory for the KV cache; a generation whose prompts exceed the cap is refused (:func:`prefill_refusal`)."""


def one_step_prefill_tokens(max_num_seqs: int, max_model_len: int) -> int:
    """Tokens per engine step that prefill every prompt of a generation at once: ``max_num_seqs`` sequences (TRL
    sets it to the generation's size) of at most ``max_model_len`` tokens each, at most :data:`ONE_STEP_PREFILL_CAP`."""
    return min(int(max_num_seqs) * int(max_model_len), ONE_STEP_PREFILL_CAP)


def _model_max_len(model: Any) -> int | None:
    """``max_position_embeddings`` of ``model``'s HF config (a folder, or a hub id already cached), else ``None``."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(model))
    except Exception:  # noqa: BLE001 - an unreadable config leaves TRL's setting; the per-generation check remains
        return None
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if value else None


def _prefill_in_one_step(args: tuple, kwargs: dict) -> None:
    """Raise the call's ``max_num_batched_tokens`` to :func:`one_step_prefill_tokens` (in place), where the call's
    ``max_num_seqs`` and its ``max_model_len`` (else the model config's) are known."""
    seqs = kwargs.get("max_num_seqs")
    length = kwargs.get("max_model_len") or _model_max_len(kwargs.get("model", args[0] if args else None))
    if seqs and length:
        needed = one_step_prefill_tokens(seqs, length)
        kwargs["max_num_batched_tokens"] = max(int(kwargs.get("max_num_batched_tokens") or 0), needed)


@contextlib.contextmanager
def vllm_colocate_engine(*, prefill_in_one_step: bool = False, sampling_mask: str | None = None,
                         matmul_tiles: str | None = None, **engine_kwargs: Any) -> Iterator[None]:
    """While active, TRL's colocate ``LLM(...)`` gets ``engine_kwargs`` (each unless the call already sets it).

    E.g. ``dtype="float16"`` (arm H) or ``kv_cache_memory_bytes=2 << 30`` (several engines on one GPU: a fixed KV
    cache skips vLLM's free-memory profiling, which fails when a neighbour frees memory while an engine starts).
    ``prefill_in_one_step`` (arm I) replaces TRL's ``max_num_batched_tokens`` (4096) with
    :func:`one_step_prefill_tokens` of the call's ``max_num_seqs`` and ``max_model_len`` (the model config's
    ``max_position_embeddings`` when the call passes none), so that a generation's prompts are prefilled in one
    step. Restores TRL's ``LLM`` on exit. The engine keeps a record of torch's matmul settings from before its
    start-up, which :func:`confine_batch_invariance` restores for the trainer. A tile table, ``matmul_tiles``
    (``gap.matmul_tiles``) or the file :data:`~bloggap_plugin.core.vllm.tile_table.TILES_ENV` names, is installed before
    the engine starts (:func:`install_named_tiles`). ``sampling_mask`` (``"auto"`` or
    ``"required"``) asks vLLM for each token's sampling mask (``return_sampling_mask=True``, ``gap.kept_source``):
    under ``auto`` an engine whose vLLM refuses it is built without, and the refusal is kept on the ``LLM``.
    """
    from trl.generation import vllm_generation

    from bloggap_plugin.core.vllm.versions import supported_text

    if sampling_mask not in (None, "auto", "required"):
        raise ValueError(f"sampling_mask must be 'auto' or 'required', got {sampling_mask!r}")
    original = getattr(vllm_generation, "LLM", None)
    if original is None:
        raise RuntimeError(
            "trl.generation.vllm_generation has no LLM: vLLM is not installed (TRL imports it only when available); "
            f"install {supported_text()} to use vllm_mode='colocate'"
        )

    def llm_with_kwargs(*args: Any, **kwargs: Any):
        for key, value in engine_kwargs.items():
            kwargs.setdefault(key, value)
        if prefill_in_one_step:
            _prefill_in_one_step(args, kwargs)
        plain = _matmul_settings()  # before the engine's start-up changes them (batch-invariant mode)
        tiles = install_named_tiles(path=matmul_tiles)  # before the engine captures its kernels
        llm, refused = _build_with_sampling_mask(original, args, kwargs, sampling_mask)
        with contextlib.suppress(AttributeError, TypeError):  # an object that takes no attributes: no record
            llm._bloggap_plain_matmul = plain
            llm._bloggap_matmul_tiles = tiles
            if refused is not None:
                llm._bloggap_sampling_mask_refused = refused
        return llm

    llm_with_kwargs.__wrapped__ = original  # type: ignore[attr-defined]
    vllm_generation.LLM = llm_with_kwargs
    try:
        yield
    finally:
        vllm_generation.LLM = original


def _named_tiles(path: str | None, environ: dict | None) -> tuple[str | None, str, str]:
    """``(path, where, drop)`` of the tile table ``path`` (``gap.matmul_tiles``) or else the variable
    :data:`~bloggap_plugin.core.vllm.tile_table.TILES_ENV` names (``None`` where neither does), with the setting that
    named it and how to run without it, for :func:`~bloggap_plugin.core.vllm.tile_table.load_tiles`'s errors; both
    naming different files is a ``TilesError``."""
    from bloggap_plugin.core.vllm.tile_table import TILES_ENV, TilesError

    named = (os.environ if environ is None else environ).get(TILES_ENV, "").strip()
    if path and named and Path(named).resolve() != Path(path).resolve():
        raise TilesError(f"gap.matmul_tiles {path} and {TILES_ENV}={named} name two tile tables: unset the variable "
                         "or drop gap.matmul_tiles")
    if path:
        return str(path), f"gap.matmul_tiles {path}", "drop gap.matmul_tiles"
    return named or None, f"{TILES_ENV}={named}", "unset the variable"


def install_named_tiles(environ: dict | None = None, path: str | None = None) -> str | None:
    """Install a tile table (:func:`~bloggap_plugin.core.vllm.tile_table.install_tiles`) in this process's vLLM
    batch-invariant module, for the colocated engine and the arm's vLLM-form passes alike: ``path``
    (``gap.matmul_tiles``) or else the file :data:`~bloggap_plugin.core.vllm.tile_table.TILES_ENV` names. Returns the
    path installed, or ``None`` where neither names one. Both naming different files, or a table that cannot be used
    (unreadable, measured on another GPU, no batch-invariant module in this vLLM), is a
    :class:`~bloggap_plugin.core.vllm.tile_table.TilesError` naming the fix."""
    from bloggap_plugin.core.vllm import kernels
    from bloggap_plugin.core.vllm.tile_table import TilesError, install_tiles, load_tiles
    from bloggap_plugin.core.vllm.versions import form_install_hint

    path, where, drop = _named_tiles(path, environ)
    if not path:
        return None
    module = kernels.persistent_matmul_module()
    if module is None:
        version = kernels.vllm_layout()[0]
        raise TilesError(f"{where}: this process's vLLM ({version or 'not importable'}) has no "
                         f"batch-invariant matmul the plugin has read: {form_install_hint()}, or {drop}")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    install_tiles(module, load_tiles(path, gpu=gpu, where=where, drop=drop))
    return path


_REPLAY_REFUSAL = "sampling distribution replay"
"""What vLLM's refusals of ``return_sampling_mask`` say (``_verify_sampling_replay_config``, vllm/config/vllm.py)."""


def _build_with_sampling_mask(original: Any, args: tuple, kwargs: dict, mode: str | None) -> tuple[Any, str | None]:
    """``(llm, refusal)``: ``original(*args, **kwargs)`` with ``return_sampling_mask=True`` and processed log-probs
    (:func:`~bloggap_plugin.vllm_kept_sets.colocate_engine_kwargs`) where ``mode`` asks for the mask. vLLM checks the
    setting while it builds its config, before the engine loads: under ``"auto"`` a refusal (e.g. model runner V1)
    builds the engine without it and returns vLLM's words; under ``"required"`` it is a ``RecipeError``."""
    from bloggap_plugin.recipes import RecipeError
    from bloggap_plugin.vllm_kept_sets import colocate_engine_kwargs

    if mode is None:
        return original(*args, **kwargs), None
    try:
        return original(*args, **colocate_engine_kwargs(kwargs)), None
    except ValueError as err:
        if _REPLAY_REFUSAL not in str(err):
            raise
        if mode == "required":
            raise RecipeError(f"gap.kept_source: sampling_mask: vLLM refused return_sampling_mask ({err}); remove "
                              "what it names or set gap.kept_source: retruncate") from None
        return original(*args, **kwargs), str(err)


def vllm_colocate_dtype(dtype: str | torch.dtype) -> contextlib.AbstractContextManager:
    """While active, TRL's colocate ``LLM(...)`` is built with ``dtype=dtype`` (unless the call already sets one).

    ``dtype``: ``"float16" | "bfloat16" | "float32"`` or the torch dtype. Restores TRL's ``LLM`` on exit.
    """
    return vllm_colocate_engine(dtype=_dtype_name(dtype))


def trl_colocate_llm_kwargs(model: str, *, max_num_seqs: int, seed: int = 0, gpu_memory_utilization: float = 0.3,
                            max_model_len: int | None = None) -> dict:
    """The ``LLM(...)`` keyword arguments TRL 1.16's colocate engine is built with
    (``VLLMGeneration._init_vllm``), at GRPOConfig's defaults (one process, tensor parallel 1, no sleep mode,
    ``vllm_model_impl="vllm"``, no quantization): ``model`` is the policy's ``name_or_path`` (a model folder);
    ``max_num_seqs`` the prompts of one generation; ``seed`` TRL's process index (0 on one process);
    ``max_model_len`` ``vllm_max_model_length`` (``None``: the model config's). No ``dtype``: the engine runs in the
    checkpoint config's dtype (an fp32 one downcast to vLLM's preferred dtype, bf16 on a CUDA GPU), as TRL builds it."""
    return {"model": model, "tensor_parallel_size": 1, "gpu_memory_utilization": gpu_memory_utilization,
            "max_model_len": max_model_len, "max_num_seqs": max_num_seqs, "enable_sleep_mode": False,
            "model_impl": "vllm", "distributed_executor_backend": "external_launcher", "seed": seed,
            "max_num_batched_tokens": 4096, "logprobs_mode": "processed_logprobs", "quantization": None,
            "trust_remote_code": False}


def trl_colocate_sampling_kwargs(args: Any, max_tokens: int) -> dict:
    """All the ``SamplingParams`` keyword arguments TRL 1.16's colocate generation passes
    (``VLLMGeneration.generate``): one completion per prompt, ``max_tokens`` (the trainer's
    ``max_completion_length``), ``logprobs=0`` (the sampled token's processed log-prob alone, TRL's default), and
    ``args``' sampling settings with its ``generation_kwargs`` on top (:func:`trl_sampling_args`; ``args``: a
    GRPOConfig or any object with those attributes, missing ones at GRPOConfig's defaults)."""
    return {"n": 1, "max_tokens": max_tokens, "logprobs": 0, **trl_sampling_args(args)}


@contextlib.contextmanager
def colocate_process_env() -> Iterator[dict]:
    """While active, what TRL 1.16's colocate mode sets before it builds the engine on one process
    (``external_launcher`` reads them): ``RANK`` 0, ``LOCAL_RANK`` 0, ``WORLD_SIZE`` 1, and ``MASTER_ADDR`` /
    ``MASTER_PORT`` where unset (TRL's ``ensure_master_addr_port``: localhost, a free port). Yields the values set;
    the environment is restored on exit."""
    from trl.trainer.utils import ensure_master_addr_port

    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    before = {name: os.environ.get(name) for name in names}
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    ensure_master_addr_port()
    try:
        yield {name: os.environ[name] for name in names}
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


KV_CACHE_ENV = "BLOGGAP_VLLM_KV_CACHE_GIB"
"""Environment variable: a fixed KV cache (GiB) for the colocate engine that GapGRPOTrainer builds; set it when
several runs share one GPU (``bloggap compare --use-vllm --parallel K`` sets 2 for K > 1)."""


def engine_kwargs_from_env(environ: dict | None = None) -> dict:
    """``{"kv_cache_memory_bytes": ...}`` from :data:`KV_CACHE_ENV`, or ``{}`` when unset; a bad value is an error
    naming the variable."""
    from bloggap_plugin.core.errors import UsageError

    raw = (os.environ if environ is None else environ).get(KV_CACHE_ENV, "").strip()
    if not raw:
        return {}
    try:
        gib = float(raw)
    except ValueError:
        gib = float("nan")
    if not gib > 0 or gib != gib or gib == float("inf"):
        raise UsageError(f"{KV_CACHE_ENV}={raw!r} is not valid: expected a positive number of GiB, e.g. 2")
    return {"kv_cache_memory_bytes": int(gib * (1 << 30))}


def _dtype_name(dtype: str | torch.dtype) -> str:
    if isinstance(dtype, torch.dtype):
        for name, value in _DTYPES.items():
            if value == dtype:
                return name
    elif isinstance(dtype, str):
        key = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32"}.get(dtype, dtype)
        if key in _DTYPES:
            return key
    raise ValueError(f"unsupported vLLM dtype {dtype!r}: use one of {sorted(_DTYPES)}")


def colocate_engine_dtype(trainer: Any) -> torch.dtype | None:
    """The dtype of a GRPOTrainer's colocate vLLM engine, or ``None`` when it cannot be read (no engine, server
    mode, another vLLM layout)."""
    dtype = colocate_engine_setting(trainer, "dtype")
    if isinstance(dtype, torch.dtype):
        return dtype
    return _DTYPES.get(dtype) if isinstance(dtype, str) else None


BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"
"""vLLM's process setting for its batch-invariant kernels, read when the engine starts."""


VLLM_LAUNCH_SETTINGS: dict[str, dict[str, Any]] = {
    "eager": {"enforce_eager": True},
    "decode_graphs": {"enforce_eager": False, "compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}},
}
"""``gap.vllm_launch`` (as :attr:`~bloggap_plugin.recipes.GapConfig.resolved_vllm_launch` reads it: ``auto`` is
``decode_graphs``) -> the ``LLM(...)`` settings with which an arm that computes vLLM's eager kernels (I, J) has its
engine launch them: ``eager`` one launch per kernel; ``decode_graphs`` no torch.compile (compilation mode 0,
``NONE``) and decode steps replayed from full CUDA graphs (the same kernels; in batch-invariant mode FlashAttention
runs one split either way)."""


def engine_settings_for(gap: Any) -> dict:
    """The ``LLM(...)`` settings ``gap``'s arm needs of its engine: the arm's
    :attr:`~bloggap_plugin.core.arms.ArmSpec.vllm_engine`, its eager kernels launched as
    :attr:`~bloggap_plugin.recipes.GapConfig.resolved_vllm_launch` says."""
    settings = dict(gap.arm_spec.vllm_engine)
    launch = gap.resolved_vllm_launch
    if launch is not None:
        settings.update(VLLM_LAUNCH_SETTINGS[launch])
    return settings


def engine_kwargs_for(gap: Any, environ: dict | None = None, args: Any = None) -> dict:
    """The ``LLM(...)`` keyword arguments the plugin gives TRL's colocate engine for ``gap`` (a GapConfig): the
    arm's :attr:`~bloggap_plugin.core.arms.ArmSpec.vllm_engine` settings, ``dtype="float16"`` for an arm that trains in
    fp16, ``prefill_in_one_step=True`` for an arm that computes a generation's prompts as one prefill,
    :data:`KV_CACHE_ENV`'s fixed KV cache, and ``sampling_mask="auto" | "required"`` where ``args`` (the GRPOConfig)
    lets vLLM return its sampling mask (:func:`~bloggap_plugin.trl.kept_source.planned_sampling_mask`, which refuses
    ``gap.kept_source: sampling_mask`` where it cannot), and ``matmul_tiles`` where ``gap.matmul_tiles`` names a tile
    table. With
    :class:`~bloggap_plugin.trl.GapCallback` the user builds the trainer inside
    ``vllm_colocate_engine(**engine_kwargs_for(gap, args=grpo_config))``."""
    from bloggap_plugin.trl.kept_source import planned_sampling_mask

    spec = gap.arm_spec
    kwargs = engine_kwargs_from_env(environ)
    mask_mode, _ = planned_sampling_mask(gap, args, environ)
    if mask_mode is not None:
        kwargs["sampling_mask"] = mask_mode
    kwargs.update(engine_settings_for(gap))
    if spec.prefill_in_one_step:
        kwargs["prefill_in_one_step"] = True
    if spec.needs_fp16_training:
        kwargs["dtype"] = "float16"  # arm H: vLLM samples in fp16 too
    if gap.matmul_tiles:
        kwargs["matmul_tiles"] = gap.matmul_tiles  # installed before the engine starts
    return kwargs


BATCH_INVARIANCE_SCOPE_ENV = "BLOGGAP_VLLM_BATCH_INVARIANCE"
"""Environment variable: ``process`` leaves vLLM's batch-invariant mode on for the whole process, as the colocated
engine's start-up turns it on (the trainer's own forward and backward included); unset or ``engine`` (the default):
:func:`confine_batch_invariance` confines it to the engine's steps and the arm's vLLM-form passes."""


def _matmul_settings() -> Any:
    from bloggap_plugin.core.vllm.kernels import MatmulSettings

    return MatmulSettings.current()


def batch_invariance_scope_setting(environ: dict | None = None) -> str:
    """``"engine"`` or ``"process"`` from :data:`BATCH_INVARIANCE_SCOPE_ENV`; another value is an error naming it."""
    from bloggap_plugin.core.errors import UsageError

    raw = (os.environ if environ is None else environ).get(BATCH_INVARIANCE_SCOPE_ENV, "").strip().lower()
    if raw in ("", "engine"):
        return "engine"
    if raw == "process":
        return "process"
    raise UsageError(f"{BATCH_INVARIANCE_SCOPE_ENV}={raw!r} is not valid: expected engine (the default) or process")


def confine_batch_invariance(trainer: Any, environ: dict | None = None) -> bool:
    """Confine vLLM's batch-invariant mode, which the colocated engine's start-up turned on for the whole process, to
    the engine's generation calls (``llm.generate`` wrapped in
    :func:`~bloggap_plugin.core.vllm.kernels.engine_batch_invariance`); the arm's vLLM-form passes install it for
    themselves (:func:`~bloggap_plugin.core.vllm.kernels.batch_invariant_scope`), and the trainer's own forward and
    backward run with torch's matmul settings from before the engine started. ``True`` where it was confined; nothing
    changes where the mode is off, the engine was not built through :func:`vllm_colocate_engine` (no record of the
    settings before it), or :data:`BATCH_INVARIANCE_SCOPE_ENV` is ``process``."""
    from bloggap_plugin.core.vllm import kernels as vllm_kernels

    llm = colocate_llm(trainer)
    plain = getattr(llm, "_bloggap_plain_matmul", None)
    if (plain is None or batch_invariance_scope_setting(environ) == "process"
            or not vllm_kernels.vllm_batch_invariant_active()):
        return False
    generate = llm.generate

    def generate_batch_invariant(*args: Any, **kwargs: Any):
        with vllm_kernels.engine_batch_invariance(plain):
            return generate(*args, **kwargs)

    generate_batch_invariant.__wrapped__ = generate  # type: ignore[attr-defined]
    llm.generate = generate_batch_invariant
    return vllm_kernels.suspend_batch_invariant_mode(plain)


def own_batch_invariance_env(gap: Any, args: Any, environ: dict | None = None) -> dict:
    """For a process that owns its run (``bloggap train``, a compare worker): set what ``gap``'s arm needs of vLLM
    before the colocated engine loads, where the arm scores with vLLM's batch-invariant kernels and the variables
    are unset: :data:`BATCH_INVARIANT_ENV` ``1`` and ``TRITON_F32_DEFAULT`` ``ieee`` (vLLM reads both when its engine
    starts). Returns what it set; a value the user set is kept (and refused later if it contradicts the arm)."""
    environ = os.environ if environ is None else environ
    if not (getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", None) == "colocate"
            and needs_batch_invariant(gap)):
        return {}
    wanted = {BATCH_INVARIANT_ENV: "1", "TRITON_F32_DEFAULT": "ieee"}
    added = {name: value for name, value in wanted.items() if name not in environ}
    environ.update(added)
    return added


def prefill_refusal(prompt_tokens: int, budget: int | None, arm: str = "I") -> str | None:
    """Why ``arm`` (I or J) cannot score a generation whose prompts hold ``prompt_tokens`` tokens in an engine that
    computes ``budget`` tokens per step (``max_num_batched_tokens``): its prompts were prefilled in chunks mixed with
    decode steps. ``None`` when they fit, or when the budget cannot be read."""
    if budget is None or prompt_tokens <= budget:
        return None
    return (f"arm {arm}: this generation's prompts hold {prompt_tokens} prompt tokens and the colocate engine computes "
            f"max_num_batched_tokens={budget} per step, so it prefilled them in chunks mixed with decode steps, which "
            f"arm {arm} does not compute; build the engine with vllm_colocate_engine(..., prefill_in_one_step=True) (what "
            "GapGRPOTrainer and bloggap train do; it gives max_num_seqs x max_model_len tokens per step, at most "
            f"{ONE_STEP_PREFILL_CAP}), set vllm_max_model_length, or lower per_device_train_batch_size x "
            "steps_per_generation")


def colocate_compilation_mode(trainer: Any) -> int | None:
    """The colocate engine's ``compilation_config.mode`` (0: no torch.compile; 3: vLLM's compile, vLLM's default),
    or ``None`` when it cannot be read."""
    engine = colocate_engine(trainer)
    config = getattr(getattr(engine, "vllm_config", None), "compilation_config", None)
    mode = getattr(config, "mode", None)
    return None if mode is None else int(mode)


def check_engine_vllm(trainer: Any, gap: Any) -> None:
    """Where the trainer has a real colocate engine, refuse (``RecipeError``, one line naming the installed and the
    supported versions) a vLLM outside the supported range, or, for an arm that computes vLLM's kernels (I, J with
    vLLM pieces), one whose kernels it was not read from (:mod:`bloggap_plugin.core.vllm.versions`)."""
    from bloggap_plugin.core.vllm.versions import vllm_problem
    from bloggap_plugin.recipes import RecipeError

    if colocate_engine(trainer) is None:
        return
    needs_form = bool(gap.takes_pieces and gap.i_form.needs_vllm())
    problem = vllm_problem(needs_form=needs_form)
    if problem:
        raise RecipeError(f"arm {gap.arm_spec.letter}: {problem}")
    refusal = sampler_logits_refusal(trainer, gap) if needs_form else None
    if refusal:
        raise RecipeError(refusal)


def _trl_sampling(trainer: Any) -> dict:
    """The ``SamplingParams`` keywords TRL 1.16's colocate generation passes for ``trainer`` (:func:`trl_sampling_args`
    of its ``args``)."""
    return trl_sampling_args(trainer.args)


def sampler_logits_refusal(trainer: Any, gap: Any) -> str | None:
    """The error text when arm I's V2 sampler ``logprobs`` piece reads the logits in another dtype than the
    installed vLLM's sampler does for TRL's sampling parameters, else ``None``. vLLM 0.31
    (:attr:`~bloggap_plugin.core.vllm.versions.VllmFormLayout.processed_logits_fp32`) copies them to fp32 when a
    parameter processes them (``logprobs=v2_sampler_fp32``) and reads bf16 otherwise (``v2_sampler``); vLLM 0.26
    always reads bf16."""
    from bloggap_plugin.core.vllm.form import SAMPLER_LOGPROBS
    from bloggap_plugin.core.vllm.versions import form_layout, installed_vllm, v2_sampler_processing

    version = installed_vllm()
    layout = form_layout(version)
    if layout is None or gap.i_form.logprobs not in SAMPLER_LOGPROBS:
        return None
    vocab = getattr(getattr(getattr(trainer, "model", None), "config", None), "vocab_size", None)
    processed = v2_sampler_processing(_trl_sampling(trainer), vocab) if layout.processed_logits_fp32 else []
    wanted = "v2_sampler_fp32" if processed else "v2_sampler"
    if gap.i_form.logprobs == wanted:
        return None
    why = (f"copies the logits to fp32 before applying {', '.join(processed)} and takes the log-prob over those"
           if processed else "takes the log-prob over the bf16 logits with these sampling parameters")
    return (f"arm {gap.arm_spec.letter}: vLLM {version}'s model runner V2 sampler {why} (docs/vllm031_form.md), and "
            f"gap.i_pieces has logprobs={gap.i_form.logprobs}: set logprobs={wanted} in gap.i_pieces")


def check_colocate_engine(trainer: Any, gap: Any, environ: dict | None = None) -> None:
    """Refuse (``RecipeError``) a colocate engine that lacks a setting ``gap``'s arm needs, naming each setting and
    how to build the engine with it. A setting that cannot be read is not refused (the engine may be another
    layout); vLLM's batch-invariant mode is read from vLLM itself. An engine built eager is what arms I and J need
    only with ``gap.vllm_launch: eager`` set: under ``auto`` (the default, decode graphs) it is refused, and the
    error names that setting."""
    from bloggap_plugin.core.vllm import kernels as vllm_kernels
    from bloggap_plugin.recipes import RecipeError

    spec = gap.arm_spec
    wrong = []
    for name, wanted in engine_settings_for(gap).items():
        if name == "compilation_config":
            mode = colocate_compilation_mode(trainer)
            if mode is not None and mode != wanted["mode"]:
                wrong.append(f"compilation_config mode {wanted['mode']} (the engine has mode {mode}: torch.compile)")
            continue
        have = colocate_engine_setting(trainer, name)
        if have is not None and have != wanted:
            wrong.append(f"{name}={wanted!r} (the engine has {have!r})")
    if spec.prefill_in_one_step:
        budget, seqs, length = (colocate_engine_setting(trainer, name)
                                for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"))
        if None not in (budget, seqs, length) and budget < one_step_prefill_tokens(seqs, length):
            wrong.append(f"max_num_batched_tokens >= {one_step_prefill_tokens(seqs, length)} (max_num_seqs {seqs} x "
                         f"max_model_len {length}, at most {ONE_STEP_PREFILL_CAP}; the engine has {budget})")
    if wrong:
        settings = ", ".join(f"{name}={value!r}" for name, value in engine_kwargs_for(gap, {}).items())
        raise RecipeError(
            f"arm {spec.letter} computes the old log-probs as vLLM's engine computes them, and TRL's colocate "
            f"engine was built without {'; '.join(wrong)}: use GapGRPOTrainer (or bloggap train), which builds it "
            f"so, or build the trainer inside `with bloggap_plugin.trl.vllm_colocate_engine({settings}):` "
            f"(what vllm_colocate_engine(**engine_kwargs_for(gap)) gives) before adding GapCallback"
            f"{_eager_engine_hint(trainer, gap)}"
        )
    if needs_batch_invariant(gap) and not vllm_kernels.vllm_batch_invariant_active():
        raise RecipeError(batch_invariant_refusal(gap))
    refusal = matmul_tiles_refusal(trainer, gap) or model_runner_refusal(gap, colocate_model_runner(trainer))
    if refusal:
        raise RecipeError(refusal)


def refuse_matmul_tiles_without_colocate(gap: Any, use_vllm: bool, mode: str | None) -> None:
    """Raise ``RecipeError`` when ``gap.matmul_tiles`` names a tile table and the trainer (``use_vllm``,
    ``vllm_mode`` ``mode``) builds no colocate engine to install it in (HF generate, vLLM server mode): the table
    would change nothing."""
    from bloggap_plugin.recipes import RecipeError

    use_vllm = bool(use_vllm)
    if not gap.matmul_tiles or (use_vllm and mode == "colocate"):
        return
    settings = f"use_vllm {use_vllm}" + (f", vllm_mode {mode!r}" if use_vllm else "")
    raise RecipeError(f"gap.matmul_tiles {gap.matmul_tiles} is installed in TRL's colocate vLLM engine, and this run "
                      f"has none ({settings}): set use_vllm: true and vllm_mode: colocate, or drop gap.matmul_tiles")


def check_matmul_tiles_file(gap: Any) -> None:
    """Read ``gap.matmul_tiles`` as a tile table (:func:`~bloggap_plugin.core.vllm.tile_table.load_tiles`), so an
    unreadable or malformed one is refused before a model loads; which GPU it was measured on is checked when the
    engine starts, where that GPU is known."""
    from bloggap_plugin.core.vllm.tile_table import load_tiles

    if gap.matmul_tiles:
        path, where, drop = _named_tiles(gap.matmul_tiles, {})
        load_tiles(path, where=where, drop=drop)


def installed_tile_table(trainer: Any) -> dict | None:
    """``{"path", "sha256"}`` of the tile table ``trainer``'s colocate engine installed before it started (the
    engine's record, :func:`vllm_colocate_engine`), or ``None`` where it installed none or there is no engine."""
    from bloggap_plugin.checkpoint import file_sha256

    path = getattr(colocate_llm(trainer), "_bloggap_matmul_tiles", None)
    return None if path is None else {"path": path, "sha256": file_sha256(path)}


def matmul_tiles_refusal(trainer: Any, gap: Any) -> str | None:
    """The error text when ``gap.matmul_tiles`` names a tile table and ``trainer``'s colocate engine was built
    without it (not inside :func:`vllm_colocate_engine` with that table: its kernels then launch vLLM's own tiles,
    and the arm's passes would launch the table's), else ``None``."""
    if not gap.matmul_tiles or colocate_engine(trainer) is None:
        return None
    have = getattr(colocate_llm(trainer), "_bloggap_matmul_tiles", None)
    if have is not None and Path(have).resolve() == Path(gap.matmul_tiles).resolve():
        return None
    built = "without a tile table" if have is None else f"with the tile table {have}"
    return (f"gap.matmul_tiles {gap.matmul_tiles}: TRL's colocate engine was built {built}, so generation would launch "
            "other tiles than the arm's passes: use GapGRPOTrainer (or bloggap train), which installs it before the "
            "engine starts, or build the trainer inside `with bloggap_plugin.trl.vllm_colocate_engine("
            "**engine_kwargs_for(gap, args=grpo_config)):` before adding GapCallback")


def _eager_engine_hint(trainer: Any, gap: Any) -> str:
    """For an engine built eager (``enforce_eager=True``) under ``gap.vllm_launch: auto``, which asks arms I and J
    for decode graphs: how to keep that engine instead (set ``eager`` explicitly); else ``""``."""
    launch = gap.resolved_vllm_launch
    if gap.vllm_launch != "auto" or launch is None:
        return ""
    if colocate_engine_setting(trainer, "enforce_eager") is not True:
        return ""
    return (f"; the engine is eager, and gap.vllm_launch: auto (the default) gives arm {gap.arm_spec.letter} "
            f"{launch}: to keep an eager engine set gap.vllm_launch: eager")


def model_runner_refusal(gap: Any, runner: str | None) -> str | None:
    """The error text when arm I's ``logprobs`` piece is not the one of the engine's model runner (``runner``:
    :func:`colocate_model_runner`), else ``None``: the runners compute the sampled token's log-prob differently."""
    if not gap.takes_pieces or runner is None:
        return None
    from bloggap_plugin.core.vllm.form import SAMPLER_LOGPROBS

    if (gap.i_form.logprobs in SAMPLER_LOGPROBS) == (runner == "v2"):
        return None
    fix = ("gap.i_pieces: all,logprobs=log_softmax" if runner == "v1"
           else "logprobs=v2_sampler in gap.i_pieces (the default of preset all)")
    return (f"arm {gap.arm_spec.letter} (gap.i_pieces: {gap.i_pieces}) computes the sampled token's log-prob as the "
            f"other vLLM model runner does, and this engine runs the model runner {runner.upper()} "
            f"(VLLM_USE_V2_MODEL_RUNNER chooses it): set {fix}")


def needs_batch_invariant(gap: Any) -> bool:
    """Whether ``gap``'s old-logprob pass computes vLLM's batch-invariant matmuls (arm I with that piece on), which
    equal the sampler's only if the engine runs in vLLM's batch-invariant mode."""
    return gap.takes_pieces and gap.i_form.batch_invariant


def batch_invariant_refusal(gap: Any) -> str:
    """The error text for an arm I run whose engine is not in vLLM's batch-invariant mode."""
    return (
        f"arm {gap.arm_spec.letter} (gap.i_pieces: {gap.i_pieces}) scores with vLLM's batch-invariant matmuls, which "
        f"equal the sampler's only when the engine runs them too: export {BATCH_INVARIANT_ENV}=1 (and "
        "TRITON_F32_DEFAULT=ieee, which keeps the trainer's RoPE in fp32 under that mode) before the process "
        "starts, or set gap.i_pieces: all,batch_invariant=false"
    )
