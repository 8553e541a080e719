"""Engine override for verl's FSDP language-model engine: fp32 LM head in the old-log-prob pass (arm E) and the
per-token log kept mass of truncated sampling.

Both act only in a forward-only call without a loss function (the old-log-prob / ref pass); the training forward
is verl's unchanged. The trainer asks for them per call through ``extra_info`` keys (``bloggap_fp32_head``,
``bloggap_log_kept_mass`` = ``support_size`` | ``retruncate``, ``bloggap_top_p/top_k/min_p``); the environment
variable ``BLOGGAP_VERL_FP32_HEAD=1`` turns the fp32 head on without the trainer.

Evidence hook: with ``BLOGGAP_VERL_DUMP_LOGPROBS=PATH`` the first forward-only micro-batch of each process is saved
to ``PATH.<pid>.pt`` (``input_ids`` and ``log_probs`` as flat ``[total]`` tensors with their ``offsets``, whether the
fp32 head was on), so that its old log-probs can be checked against an independent scoring of the same tokens
(``benchmarks/verl_live.py check-head``).

Registration: the subclass is registered in verl's ``EngineRegistry`` for ``language_model`` /
``fsdp``,``fsdp2`` under the keys ``("cuda", "nvidia")`` (verl looks that key up before the vendor-less
built-in, so NVIDIA machines get it with no config change) and ``("cuda", "bloggap")`` (select explicitly with
``VERL_ENGINE_VENDOR=bloggap``). A key already held by another plugin's class is left alone (logged).
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch
import torch.nn.functional as F

from bloggap_plugin.verl.config import dump_path, load_settings

logger = logging.getLogger("bloggap.verl")

ENGINE_KEYS = (("cuda", "nvidia"), ("cuda", "bloggap"))
BACKENDS = ("fsdp", "fsdp2")


def fp32_head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """LM-head logits ``[..., V]`` computed in fp32 with autocast off: ``hidden.float() @ weight.float().T``.

    ``hidden`` ``[..., H]`` is the final (post-norm) hidden state, ``weight`` ``[V, H]``. The weights are cast,
    never modified (with FSDP mixed precision they are the bf16 unsharded copy: the product and the
    log-softmax are fp32, the weights carry bf16 rounding).
    """
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        return F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())


def _output_embedding(model: torch.nn.Module) -> torch.nn.Module:
    inner = model
    for _ in range(3):  # FSDP1 / DDP / PEFT wrappers
        if hasattr(inner, "get_output_embeddings"):
            head = inner.get_output_embeddings()
            if head is not None:
                return head
        inner = getattr(inner, "module", getattr(inner, "_fsdp_wrapped_module", inner))
    raise ValueError(
        f"{type(model).__name__} has no output embedding (get_output_embeddings() is None): the fp32 LM head needs an "
        "HF causal LM"
    )


@contextlib.contextmanager
def fp32_output_head(model: torch.nn.Module):
    """Within the block, the model's LM head returns fp32 logits from :func:`fp32_head_logits`.

    A forward hook replaces the head's output; it is removed on exit. Weights are never written.
    """
    head = _output_embedding(model)

    def hook(module, args, output):
        return fp32_head_logits(args[0], module.weight, getattr(module, "bias", None))

    handle = head.register_forward_hook(hook)
    try:
        yield head
    finally:
        handle.remove()


def log_kept_mass_rows(
    logits: torch.Tensor,
    labels: torch.Tensor,
    sizes: torch.Tensor | None = None,
    temperature: torch.Tensor | float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    min_p: float = 0.0,
    chunk_rows: int = 512,
) -> torch.Tensor:
    """Log kept mass ``[N]`` (fp32, <= 0) per row of ``logits`` ``[N, V]`` (raw, not temperature-scaled).

    With ``sizes`` ``[N]`` (the rollout's kept-set sizes; 0 = untruncated) the kept set is the trainer's top
    ``size`` tokens; without, it is re-derived with top_p/top_k/min_p in vLLM's order, always keeping the row's
    ``labels`` token (approximate at the boundary). ``temperature`` is a scalar or per-row ``[N]``. Rows are
    processed in chunks of ``chunk_rows`` so memory stays ``O(chunk_rows * V)``.
    """
    from bloggap_plugin.core.truncation import kept_mask, log_kept_mass, log_kept_mass_from_size

    n = logits.shape[0]
    if labels.shape != (n,):
        raise ValueError(f"labels {tuple(labels.shape)} must be [N] for logits {tuple(logits.shape)}")
    if sizes is not None and sizes.shape != (n,):
        raise ValueError(f"sizes {tuple(sizes.shape)} must be [N] for logits {tuple(logits.shape)}")
    temp = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device)
    temp = temp.expand(n) if temp.dim() == 0 else temp
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    topk = int(top_k) if top_k is not None and int(top_k) > 0 else 0
    for start in range(0, n, chunk_rows):
        stop = min(start + chunk_rows, n)
        scaled = logits[start:stop].float() / temp[start:stop].clamp(min=1e-8).unsqueeze(-1)
        if sizes is not None:
            out[start:stop] = log_kept_mass_from_size(scaled, sizes[start:stop])
        else:
            kept = kept_mask(scaled, top_k=topk, top_p=float(top_p), min_p=float(min_p), sampled=labels[start:stop])
            out[start:stop] = log_kept_mass(scaled, kept)
    return out


def _non_tensor(micro_batch, key: str, default):
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=micro_batch, key=key, default=default)


def make_engine_class(base):
    """The bloggap subclass of verl's ``FSDPEngineWithLMHead`` (``base``)."""

    class BloggapFSDPEngineWithLMHead(base):
        """verl's FSDP LM engine + fp32 LM head (arm E) and log kept mass, in the forward-only pass only."""

        _bloggap_forward_only = False
        _bloggap_fp32 = False

        def forward_step(self, micro_batch, loss_function, forward_only):
            only = bool(forward_only and loss_function is None)
            self._bloggap_forward_only = only
            flag = _non_tensor(micro_batch, "bloggap_fp32_head", None)
            fp32 = only and (bool(flag) if flag is not None else load_settings().fp32_head)
            self._bloggap_fp32 = fp32
            try:
                if not fp32:
                    return super().forward_step(micro_batch, loss_function, forward_only)
                if _non_tensor(micro_batch, "use_fused_kernels", False):
                    raise NotImplementedError(
                        "bloggap fp32 LM head needs materialised logits: set actor_rollout_ref.model.use_fused_kernels=false"
                    )
                with fp32_output_head(self.module):
                    return super().forward_step(micro_batch, loss_function, forward_only)
            finally:
                self._bloggap_forward_only = False

        def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
            mode = _non_tensor(micro_batch, "bloggap_log_kept_mass", None) if self._bloggap_forward_only else None
            log_kept = self._bloggap_log_kept_mass(output, output_args, micro_batch, mode) if mode else None
            model_output = super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)
            if log_kept is not None:
                model_output["log_kept_mass"] = log_kept
            path = dump_path() if self._bloggap_forward_only else None
            if path:
                dump_forward_only_batch(path, micro_batch, model_output, self._bloggap_fp32)
            return model_output

        def _bloggap_log_kept_mass(self, output, output_args, micro_batch, mode):
            if _non_tensor(micro_batch, "use_fused_kernels", False):
                raise NotImplementedError(
                    "bloggap log kept mass needs materialised logits: set actor_rollout_ref.model.use_fused_kernels=false"
                )
            if getattr(self, "ulysses_sequence_parallel_size", 1) > 1:
                raise NotImplementedError("bloggap log kept mass does not support Ulysses sequence parallelism yet")
            input_ids = micro_batch["input_ids"]
            offsets = input_ids.offsets()
            total = int(offsets[-1])
            sizes = None
            if mode == "support_size":
                if "rollout_support_size" not in micro_batch.keys():
                    raise RuntimeError(
                        "bloggap.kept_source=support_size but the batch has no rollout_support_size: apply "
                        "patches/verl (`bloggap patch verl --apply`) and set "
                        "+actor_rollout_ref.rollout.engine_kwargs.vllm.return_sampling_mask=true, or use "
                        "+bloggap.kept_source=retruncate"
                    )
                sizes = micro_batch["rollout_support_size"].values().long()
            if _non_tensor(micro_batch, "use_remove_padding", True):
                logits = output.logits.squeeze(0)[:total]
                labels = output_args["input_ids_rmpad_rolled"].reshape(-1)[:total]
                temperature = output_args["temperature_rmpad"].reshape(-1)[:total]
            else:
                lengths = offsets.diff().tolist()
                logits = torch.cat([output.logits[b, :length] for b, length in enumerate(lengths)])
                labels = output_args["input_ids_rmpad_rolled"].reshape(-1)[:total]
                temperature = torch.repeat_interleave(output_args["temperature"].float(), offsets.diff())
            values = log_kept_mass_rows(
                logits,
                labels,
                sizes=sizes,
                temperature=temperature,
                top_p=float(_non_tensor(micro_batch, "bloggap_top_p", 1.0)),
                top_k=int(_non_tensor(micro_batch, "bloggap_top_k", -1)),
                min_p=float(_non_tensor(micro_batch, "bloggap_min_p", 0.0)),
            )
            return torch.nested.nested_tensor_from_jagged(values, offsets)

    BloggapFSDPEngineWithLMHead.__qualname__ = "BloggapFSDPEngineWithLMHead"
    return BloggapFSDPEngineWithLMHead


_DUMPED: set[str] = set()


def dump_forward_only_batch(path: str, micro_batch, model_output: dict, fp32_head: bool) -> str | None:
    """Save the first forward-only micro-batch of this process to ``path.<pid>.pt``: ``input_ids`` and ``log_probs``
    flat ``[total]`` (int64 / fp32), ``offsets`` ``[n+1]`` (row ``i`` is ``offsets[i]:offsets[i+1]``; ``log_probs[t]``
    is the log-prob of ``input_ids[t+1]`` of the same row, verl's rolled labels), ``fp32_head``. Once per process;
    returns the file written, or None."""
    target = f"{path}.{os.getpid()}.pt"
    log_probs = model_output.get("log_probs")
    if target in _DUMPED or log_probs is None:
        return None
    _DUMPED.add(target)
    input_ids = micro_batch["input_ids"]
    torch.save({"input_ids": input_ids.values().detach().cpu(), "offsets": input_ids.offsets().detach().cpu(),
                "log_probs": log_probs.values().detach().float().cpu(), "fp32_head": bool(fp32_head)}, target)
    logger.warning("bloggap: saved the first forward-only micro-batch to %s", target)
    return target


_ENGINE_CLASS = None


def engine_class():
    """The (single) bloggap engine class, built on first use."""
    global _ENGINE_CLASS
    if _ENGINE_CLASS is None:
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

        _ENGINE_CLASS = make_engine_class(FSDPEngineWithLMHead)
    return _ENGINE_CLASS


def register_engine(_module=None) -> None:
    """Register the engine under :data:`ENGINE_KEYS`; idempotent; never displaces another plugin's class."""
    from verl.workers.engine.base import EngineRegistry

    cls = engine_class()
    table = EngineRegistry._engines.setdefault("language_model", {})
    for backend in BACKENDS:
        registry = table.setdefault(backend, {})
        for device, vendor in ENGINE_KEYS:
            key = (device, vendor)
            holder = registry.get(key)
            if holder is cls:
                continue
            if holder is not None:
                logger.warning("bloggap: engine key %s/%s already held by %s; not overriding", backend, key, holder)
                continue
            EngineRegistry.register(model_type="language_model", backend=backend, device=device, vendor=vendor)(cls)
