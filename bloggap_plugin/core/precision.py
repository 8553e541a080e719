"""Scoring plans for the old-logprob pass: in which precision the policy scores its own tokens.

``make_plan(policy, arm)`` returns a :class:`ScoringPlan`; ``plan.token_logprobs(...)`` scores through
:func:`bloggap_plugin.core.scoring.token_logprobs` (the one scoring function) and returns ``[B, K]`` fp32.

Arms (recipes may use the letters):

- ``bf16`` (A): the policy as is, whatever dtype / autocast it runs in. Adds nothing.
- ``fp32`` (B), ``fp16`` (F): a *shadow*: a clean module of the policy's class built from its config on the
  meta device, materialised once in that dtype (on the policy's device or ``device=``) and refreshed in place
  from the policy by :meth:`ScoringPlan.sync` (one ``torch._foreach_copy_`` per dtype group, bitwise the
  per-tensor ``copy_``: no re-allocation, no ``load_state_dict``). A clean
  module carries none of the instance-level ``forward`` patches TRL and accelerate put on the policy, and the
  plan runs it with autocast disabled, so it really computes in fp32 / fp16. Memory: 4 (fp32) or 2 (fp16)
  bytes per parameter.
- ``fp32_head`` (E): final norm and LM head in fp32; ``guided`` (D): chosen decoder layers as well.
  These run on the **live policy**: for the duration of one ``token_logprobs`` call the chosen modules are
  swapped for fp32 islands (fp32 copies, or the live module itself when its weights are already fp32) that
  cast their inputs to fp32 and run with autocast disabled; a layer casts its output back to the residual
  stream's dtype only where the next layer stays in low precision. The swap is undone in ``finally``; no
  hook or module stays on the policy between calls. Memory: 4 bytes per upcast parameter (the head's
  ``V x H`` weight included) instead of a full bf16 copy of the model. A tied head is projected with a
  detached fp32 copy of the shared weight, refreshed on ``sync``; the embedding is never mutated. Rotary
  position embeddings entering an fp32 layer are recomputed in fp32 (not the rounded bf16 cos/sin), so a
  plan with every layer upcast equals the fp32 shadow.
- fp16 guard: when a plan computes in fp16 (``fp16``, or ``guided``/``fp32_head`` on an fp16 policy), a
  chunk with a non-finite value is re-scored in fp32 through the same ``token_logprobs`` and counted
  (``plan.fp16_fallbacks``). The fp32 model for this is built on the first overflow and kept (and synced).

TF32 (``make_plan(..., tf32=)``, ``gap.tf32``): plans that compute in fp32 (``fp32``, ``fp32_head``, ``guided``
and the fp16 guard's fp32 re-score) set CUDA's fp32 matmul precision for their own forward only
(:func:`cuda_matmul_tf32`: TF32 on or IEEE fp32) and restore the caller's setting afterwards, also when the
forward raises; the process-wide setting outside a call is never changed. ``True``: TF32; ``False`` (default):
IEEE fp32 whatever the process-wide flag says; ``"auto"``: TF32 when the plan runs on a GPU with TF32 units
(compute capability >= 8.0, Ampere and later), IEEE fp32 otherwise. Arm ``bf16`` runs the policy as called,
under the caller's setting, and the fp16 shadow has no fp32 matmuls: neither touches the setting.

Scoring always runs under ``torch.no_grad()`` (old log-probs are constants), and never changes the policy's
parameters, gradients, optimizer state or tied embeddings.
"""

from __future__ import annotations

import contextlib
import copy
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .scoring import (
    DEFAULT_CHUNK_TOKENS,
    LogprobReducer,
    TileIndex,
    gather_logprobs,
    output_head,
    token_logprobs,
    unwrap_model,
)

__all__ = [
    "ARMS",
    "ARM_ALIASES",
    "TF32_MODES",
    "resolve_arm",
    "resolve_tf32",
    "cuda_matmul_tf32",
    "make_plan",
    "ScoringPlan",
    "unwrap_model",
    "decoder_layers",
    "final_norm",
    "output_head",
]

ARMS = ("bf16", "fp32", "fp16", "fp32_head", "guided")
ARM_ALIASES = {"A": "bf16", "B": "fp32", "D": "guided", "E": "fp32_head", "F": "fp16"}
_NORM_NAMES = ("norm", "final_layer_norm", "ln_f", "norm_f", "final_norm")
_LAYER_LIST_NAMES = ("layers", "h", "blocks", "layer")


TF32_MODES = (True, False, "auto")
# torch >= 2.9's per-backend precision settings (``torch.backends.<path>.fp32_precision``), restored after a plan call
_FP32_PRECISION_PATHS = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul",
                         "mkldnn.conv", "mkldnn.rnn")


def resolve_tf32(tf32: bool | str, device: torch.device | str) -> bool:
    """Whether a plan on ``device`` scores with TF32: ``tf32`` itself, or for ``"auto"`` whether ``device`` is a
    CUDA GPU with TF32 units (compute capability >= 8.0: Ampere, Hopper, Blackwell)."""
    if tf32 is True or tf32 is False:
        return tf32
    if tf32 != "auto":
        raise ValueError(f"tf32 must be True, False or 'auto', got {tf32!r}")
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


def _precision_owner(path: str) -> Any:
    owner: Any = torch.backends
    for part in filter(None, path.split(".")):
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return owner


def _read_fp32_precisions() -> dict[str, str]:
    values = {}
    for path in _FP32_PRECISION_PATHS:
        owner = _precision_owner(path)
        if owner is None:
            continue
        try:
            values[path] = owner.fp32_precision
        except (AttributeError, RuntimeError):
            continue
    return values


@contextlib.contextmanager
def cuda_matmul_tf32(enabled: bool) -> Iterator[None]:
    """CUDA fp32 matmuls in TF32 (``enabled``) or IEEE fp32 for the block; the caller's settings come back after it,
    also when it raises.

    Set with the setter behind ``torch.backends.cuda.matmul.allow_tf32``, which keeps the legacy precision and
    torch >= 2.9's ``cuda.matmul.fp32_precision`` consistent (cuBLAS refuses a mix of the two); restored: the legacy
    ``float32_matmul_precision`` (or, where the caller's state mixes both APIs and cannot be read, the value cuBLAS
    saw), then every ``torch.backends.*.fp32_precision`` as it was."""
    saved = _read_fp32_precisions()
    try:
        legacy = torch._C._get_float32_matmul_precision()
    except RuntimeError:  # the caller mixed the legacy and the new API
        legacy = None
        try:
            cublas = bool(torch._C._get_cublas_allow_tf32())
        except RuntimeError:  # inconsistent for cuBLAS too: the legacy flag is the opposite of the new one
            cublas = saved.get("cuda.matmul") != "tf32"
    torch._C._set_cublas_allow_tf32(bool(enabled))
    try:
        yield
    finally:
        if legacy is not None:
            torch.set_float32_matmul_precision(legacy)
        else:
            torch._C._set_cublas_allow_tf32(cublas)
        for path, value in saved.items():
            with contextlib.suppress(RuntimeError):
                _precision_owner(path).fp32_precision = value


def resolve_arm(name: str) -> str:
    """Canonical arm name for ``name`` (``bf16 fp32 fp16 fp32_head guided`` or ``A B D E F``)."""
    if isinstance(name, str):
        if name in ARMS:
            return name
        if name in ARM_ALIASES:
            return ARM_ALIASES[name]
        if name.lower() in ARMS:
            return name.lower()
        if name.upper() in ARM_ALIASES:
            return ARM_ALIASES[name.upper()]
    accepted = ", ".join(ARMS) + " (or " + ", ".join(f"{k}={v}" for k, v in ARM_ALIASES.items()) + ")"
    raise ValueError(
        f"unknown scoring arm {name!r}; accepted: {accepted}. Arms C, G and H are trainer-level "
        "(chunking, matched batches, fp16 everywhere) and use the bf16 plan"
    )


# --------------------------------------------------------------------------------------------------
# Model structure


def _layer_list_path(model: nn.Module) -> tuple[str, nn.ModuleList]:
    n_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    candidates = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            leaf = name.rsplit(".", 1)[-1]
            if n_layers is not None and len(module) == n_layers:
                candidates.append((0 if leaf in _LAYER_LIST_NAMES else 1, name.count("."), name, module))
            elif n_layers is None and leaf in _LAYER_LIST_NAMES:
                candidates.append((2, name.count("."), name, module))
    if not candidates:
        raise ValueError(
            f"cannot find the decoder layers of {type(model).__name__}: expected an nn.ModuleList named one of "
            f"{_LAYER_LIST_NAMES} with config.num_hidden_layers={n_layers} entries; arms fp32_head/guided and "
            "attribution need a standard decoder-only causal LM (use arm fp32 or fp16 otherwise)"
        )
    candidates.sort(key=lambda c: (c[0], c[1]))
    return candidates[0][2], candidates[0][3]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers (``nn.ModuleList``) of a causal LM, e.g. ``model.model.layers``."""
    return _layer_list_path(unwrap_model(model))[1]


def _parent_of(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else model


def final_norm(model: nn.Module) -> tuple[nn.Module, str, nn.Module] | None:
    """``(parent, attribute, module)`` of the final norm after the last decoder layer, or ``None``."""
    model = unwrap_model(model)
    path, _ = _layer_list_path(model)
    base = _parent_of(model, path)
    for name in _NORM_NAMES:
        module = base._modules.get(name)
        if isinstance(module, nn.Module):
            return base, name, module
    return None


def _is_tied(model: nn.Module) -> bool:
    head = output_head(model)[2]
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return embed is not None and getattr(head, "weight", None) is getattr(embed, "weight", None)


def _unique_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _executed_numel(model: nn.Module) -> int:
    """Parameters as executed: a tied head counts twice (embedding lookup and projection)."""
    total = _unique_numel(model)
    if _is_tied_safe(model):
        total += output_head(model)[2].weight.numel()
    return total


def _is_tied_safe(model: nn.Module) -> bool:
    try:
        return _is_tied(model)
    except ValueError:
        return False


def _tensor_bytes(tensors: Iterator[torch.Tensor]) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _device_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _floating_dtype(model: nn.Module) -> torch.dtype:
    """Most common floating dtype of the parameters (the dtype the policy stores its weights in)."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.get) if counts else torch.float32


def _cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Cast every floating tensor in (nested tuples/lists/dicts of) ``obj`` to ``dtype``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, tuple):
        cast = [_cast_floating(x, dtype) for x in obj]
        return type(obj)(*cast) if hasattr(obj, "_fields") else tuple(cast)
    if isinstance(obj, list):
        return [_cast_floating(x, dtype) for x in obj]
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: _cast_floating(v, dtype) for k, v in obj.items()}
    if hasattr(obj, "to_tuple") and hasattr(obj, "keys"):  # transformers ModelOutput
        for key in list(obj.keys()):
            obj[key] = _cast_floating(obj[key], dtype)
        return obj
    return obj


def _first_floating(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj if obj.is_floating_point() else None
    if isinstance(obj, (tuple, list)):
        for x in obj:
            found = _first_floating(x)
            if found is not None:
                return found
    if isinstance(obj, dict):
        for x in obj.values():
            found = _first_floating(x)
            if found is not None:
                return found
    return None


def _strip_instance_patches(module: nn.Module) -> None:
    """Remove instance-level forward patches and hooks copied along with a module (clean forward)."""
    for sub in module.modules():
        for attr in ("forward", "_original_forward", "_old_forward", "_hf_hook"):
            sub.__dict__.pop(attr, None)
        for hooks in (
            "_forward_hooks",
            "_forward_hooks_with_kwargs",
            "_forward_hooks_always_called",
            "_forward_pre_hooks",
            "_forward_pre_hooks_with_kwargs",
            "_backward_hooks",
            "_backward_pre_hooks",
            "_state_dict_hooks",
            "_load_state_dict_pre_hooks",
        ):
            if isinstance(getattr(sub, hooks, None), dict):
                setattr(sub, hooks, type(getattr(sub, hooks))())


def _module_copy(module: nn.Module, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A hook-free copy of a (small) submodule with floating parameters in ``dtype`` on ``device``.

    Parameters are re-materialised from the meta device (no temporary copy in the source dtype) and filled
    by ``copy_``; buffers are copied (fp32 buffers stay fp32)."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        target = dtype if p.is_floating_point() else p.dtype
        memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=target, device="meta"), requires_grad=False)
    for b in module.buffers():
        memo[id(b)] = torch.empty(b.shape, dtype=_buffer_dtype(b, dtype), device="meta")
    clone = copy.deepcopy(module, memo)
    _strip_instance_patches(clone)
    clone.to_empty(device=device)
    with torch.no_grad():
        for (_, dst), (_, src) in zip(
            clone.named_parameters(remove_duplicate=False), module.named_parameters(remove_duplicate=False)
        ):
            dst.copy_(src)
        for (_, dst), (_, src) in zip(
            clone.named_buffers(remove_duplicate=False), module.named_buffers(remove_duplicate=False)
        ):
            dst.copy_(src)
    clone.requires_grad_(False)
    return clone


def _buffer_dtype(buffer: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """Buffers (e.g. rotary ``inv_freq``) keep fp32 when the policy holds them in fp32, as ``from_pretrained``
    does for any weight dtype; other floating buffers take the shadow's dtype; integer buffers are kept."""
    if not buffer.is_floating_point() or buffer.dtype == torch.float32:
        return buffer.dtype
    return dtype


def _tie_groups(model: nn.Module) -> list[tuple[str, ...]]:
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return sorted(tuple(sorted(v)) for v in groups.values() if len(v) > 1)


def _build_shadow(source: nn.Module, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A clean module of ``source``'s class in ``dtype`` on ``device`` holding ``source``'s weights.

    Built on the meta device (no random init, no temporary copy), materialised once, filled by ``copy_``.
    """
    config = getattr(source, "config", None)
    if config is not None and hasattr(type(source), "_from_config"):
        with torch.device("meta"):
            shadow = type(source)._from_config(copy.deepcopy(config), dtype=dtype)
        _strip_instance_patches(shadow)
    else:
        memo: dict[int, Any] = {}
        for p in source.parameters():
            target = dtype if p.is_floating_point() else p.dtype
            memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=target, device="meta"), requires_grad=False)
        for b in source.buffers():
            memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
        shadow = copy.deepcopy(source, memo)
        _strip_instance_patches(shadow)
    # Parameters keep the dtype the class gives them under ``dtype`` (as ``from_pretrained(dtype=...)`` would,
    # including any ``_keep_in_fp32_modules``); to_empty materialises them once on ``device``.
    shadow.to_empty(device=device)
    if hasattr(shadow, "tie_weights"):
        shadow.tie_weights()
    # Buffers: same dtype rule as from_pretrained, values from the policy.
    source_buffers = dict(source.named_buffers(remove_duplicate=False))
    for module_name, module in shadow.named_modules(remove_duplicate=False):
        for name, b in list(module._buffers.items()):
            if b is None:
                continue
            full = f"{module_name}.{name}" if module_name else name
            src = source_buffers.get(full)
            if src is None:
                raise ValueError(
                    f"shadow buffer {full} has no counterpart in the policy; cannot build the shadow"
                )
            module._buffers[name] = src.detach().to(device=device, dtype=_buffer_dtype(src, dtype)).clone()
    if _tie_groups(shadow) != _tie_groups(source):
        raise ValueError(
            f"the shadow's tied parameters {_tie_groups(shadow)} differ from the policy's {_tie_groups(source)}; "
            "check config.tie_word_embeddings matches the policy"
        )
    shadow.requires_grad_(False)
    shadow.eval()
    return shadow


def _param_pairs(dst_model: nn.Module, src_model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(shadow tensor, policy tensor) by name, for parameters (unique) and buffers; errors name the mismatch."""
    src_params = dict(src_model.named_parameters(remove_duplicate=False))
    src_buffers = dict(src_model.named_buffers(remove_duplicate=False))
    pairs = []
    for name, dst in dst_model.named_parameters():
        src = src_params.get(name)
        if src is None or src.shape != dst.shape:
            raise ValueError(
                f"policy parameter {name!r} is missing or has shape {None if src is None else tuple(src.shape)} "
                f"(shadow {tuple(dst.shape)}): sync needs the same architecture the plan was made from"
            )
        pairs.append((dst, src))
    for name, dst in dst_model.named_buffers():
        src = src_buffers.get(name)
        if src is not None and src.shape == dst.shape:
            pairs.append((dst, src))
    return pairs


class _FusedCopy:
    """``dst.copy_(src)`` for many pairs as one ``torch._foreach_copy_`` per (device, dtype) group.

    Bitwise the per-tensor ``copy_`` (same element-wise cast), into the same storage (nothing re-allocated). The
    grouping is built once per source model and kept while every source tensor is still the one its module holds
    (one dict lookup per tensor, no module traversal): a replaced parameter object (``module.weight = ...``) or
    another source model rebuilds it through ``pairs`` (which validates names and shapes). Replacing whole
    submodules of the policy after the plan was made needs a new plan."""

    def __init__(self) -> None:
        self._source: nn.Module | None = None
        self._slots: list[tuple[dict, str, torch.Tensor]] = []  # (module._parameters/_buffers, key, tensor)
        self._groups: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []

    def _valid_for(self, source: nn.Module) -> bool:
        return source is self._source and all(slots.get(key) is tensor for slots, key, tensor in self._slots)

    def __call__(self, source: nn.Module, pairs: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        if not self._valid_for(source):
            groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
            sources = set()
            for dst, src in pairs():
                group = groups.setdefault((dst.device, dst.dtype, src.device, src.dtype), ([], []))
                group[0].append(dst)
                group[1].append(src)
                sources.add(id(src))
            self._slots = [
                (slots, key, tensor)
                for module in source.modules()
                for slots in (module._parameters, module._buffers)
                for key, tensor in slots.items()
                if tensor is not None and id(tensor) in sources
            ]
            self._groups = list(groups.values())
            self._source = source
        for dsts, srcs in self._groups:
            torch._foreach_copy_(dsts, srcs)

    def clear(self) -> None:
        self._source, self._slots, self._groups = None, [], []


# --------------------------------------------------------------------------------------------------
# Plans


class ScoringPlan:
    """Scores tokens in one precision arm; see the module docstring. Use :func:`make_plan` to build one."""

    arm: str = ""

    def __init__(self, policy: nn.Module, arm: str, fp16_guard: bool = True, tf32: bool | str = False) -> None:
        self.arm = arm
        self._tf32_option = tf32
        self._policy_call = policy  # what the caller passed (wrapped or not): arm A calls exactly this
        self._source = unwrap_model(policy)
        self._fp16_guard = bool(fp16_guard)
        self.fp16_fallbacks = 0
        self._fallback: ScoringPlan | None = None
        self._last_sync_seconds = 0.0
        self._closed = False
        self.layers: list[int] | None = None
        self.profile = None  # attribution profile when layers="auto"

    # -- subclass interface
    def _score_model(self) -> Callable[..., Any]:
        raise NotImplementedError

    def _scoring_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def _device(self) -> torch.device:
        return _model_device(self._source)

    def _computes_fp16(self) -> bool:
        return False

    def _computes_fp32(self) -> bool:
        """Whether the forward has fp32 matmuls that the TF32 option governs."""
        return False

    @property
    def tf32(self) -> bool | None:
        """TF32 for this plan's fp32 matmuls (``gap.tf32`` resolved on the plan's device); ``None``: the plan has
        none and leaves the caller's setting alone."""
        return resolve_tf32(self._tf32_option, self._device()) if self._computes_fp32() else None

    def _precision_context(self) -> contextlib.AbstractContextManager:
        tf32 = self.tf32
        return contextlib.nullcontext() if tf32 is None else cuda_matmul_tf32(tf32)

    def _sync(self, source: nn.Module) -> None:
        pass

    def _bytes(self) -> int:
        return 0

    def _fp32_share(self) -> float:
        raise NotImplementedError

    # -- public surface
    def token_logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        positions: str = "mask",
        temperature: float = 1.0,
        reduce: LogprobReducer | None = None,
        chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
    ) -> torch.Tensor:
        """``[B, logits_to_keep]`` fp32 log-probs through :func:`core.scoring.token_logprobs` in this arm
        (``chunk_tokens``: scored tokens per tile of the LM head and log-softmax, as there)."""
        self._check_open()
        out_device = input_ids.device
        device = self._device()
        input_ids = input_ids.to(device)
        attention_mask = attention_mask.to(device)
        guard = self._fp16_guard and self._computes_fp16()
        finite: dict[tuple[int, int], list[torch.Tensor]] = {}  # per chunk of rows: one flag per tile
        call_reduce = reduce
        if guard:
            base_reduce = reduce or gather_logprobs

            def call_reduce(logits: torch.Tensor, targets: torch.Tensor, index: TileIndex) -> torch.Tensor:
                out = base_reduce(logits, targets, index)
                # default gather: a non-finite log-prob <=> a non-finite logit; a custom reduce may
                # legitimately return -inf (token outside a kept set), so check the logits there.
                probe = out if reduce is None else logits.sum(dim=(-1, -2))
                rows = index[0]
                finite.setdefault((rows.start, rows.stop), []).append(torch.isfinite(probe).all())
                return out

        with torch.no_grad(), self._precision_context(), self._scoring_context():
            result = token_logprobs(
                self._score_model(),
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size=batch_size,
                positions=positions,
                temperature=temperature,
                reduce=call_reduce,
                chunk_tokens=chunk_tokens,
            )
        if guard and finite:
            chunk_ok = torch.stack([torch.stack(flags).all() for flags in finite.values()]).cpu().tolist()
            for (start, stop), ok in zip(finite, chunk_ok):
                if ok:
                    continue
                rows = slice(start, stop)
                sub_reduce = _shifted_reduce(reduce, start) if reduce is not None else None
                result[rows] = (
                    self._fp32_fallback()
                    .token_logprobs(
                        input_ids[rows],
                        attention_mask[rows],
                        logits_to_keep,
                        batch_size=None,
                        positions=positions,
                        temperature=temperature,
                        reduce=sub_reduce,
                        chunk_tokens=chunk_tokens,
                    )
                    .to(result.device)
                )
                self.fp16_fallbacks += 1
        return result.to(out_device)

    def sync(self, policy: nn.Module) -> float:
        """Refresh the plan's copies from ``policy`` in place (``copy_``); returns the seconds it took."""
        self._check_open()
        source = unwrap_model(policy)
        device = self._device()
        _device_sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            self._sync(source)
            if self._fallback is not None:
                self._fallback._sync(source)
        _device_sync(device)
        self._last_sync_seconds = time.perf_counter() - start
        return self._last_sync_seconds

    def close(self) -> None:
        """Remove hooks and free shadows; the plan cannot score afterwards."""
        if self._fallback is not None:
            self._fallback.close()
            self._fallback = None
        self._closed = True

    def stats(self) -> dict:
        """``bytes_added``, ``sync_seconds`` (last), ``fp32_param_share``, ``fp16_fallbacks``, ``layers``, ``tf32``."""
        extra = self._fallback._bytes() if self._fallback is not None else 0
        return {
            "arm": self.arm,
            "bytes_added": int(self._bytes() + extra),
            "sync_seconds": float(self._last_sync_seconds),
            "fp32_param_share": float(self._fp32_share()),
            "fp16_fallbacks": int(self.fp16_fallbacks),
            "layers": None if self.layers is None else list(self.layers),
            "tf32": self.tf32,
        }

    def __enter__(self) -> ScoringPlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(arm={self.arm!r}, layers={self.layers})"

    # -- helpers
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                f"this {self.arm} plan is closed; make a new one with make_plan(policy, {self.arm!r})"
            )

    def _fp32_fallback(self) -> ScoringPlan:
        if self._fallback is None:
            warnings.warn(
                f"fp16 produced a non-finite log-prob; re-scoring that chunk in fp32 (building an fp32 copy of the "
                f"policy once: {4 * _unique_numel(self._source) / 2**30:.2f} GiB, refreshed by sync)",
                RuntimeWarning,
                stacklevel=3,
            )
            self._fallback = _ShadowPlan(
                self._source, "fp32", torch.float32, self._device(), fp16_guard=False, tf32=self._tf32_option
            )
        return self._fallback


def _shifted_reduce(reduce: LogprobReducer, offset: int) -> LogprobReducer:
    """``reduce`` for a re-score of rows ``offset...``: the index it sees stays in the full batch's rows."""

    def shifted(logits: torch.Tensor, targets: torch.Tensor, index: TileIndex) -> torch.Tensor:
        rows, cols = index
        return reduce(logits, targets, (slice(rows.start + offset, rows.stop + offset), cols))

    return shifted


class _PolicyPlan(ScoringPlan):
    """Arm A: the policy exactly as passed (its wrappers, dtype and autocast)."""

    def _score_model(self) -> Callable[..., Any]:
        return self._policy_call

    def _fp32_share(self) -> float:
        stored = sum(p.numel() for p in self._source.parameters() if p.dtype == torch.float32)
        if _is_tied_safe(self._source):
            head = output_head(self._source)[2].weight
            stored += head.numel() if head.dtype == torch.float32 else 0
        return stored / max(_executed_numel(self._source), 1)


class _ShadowPlan(ScoringPlan):
    """Arms B/F: a clean copy in ``dtype`` run with autocast disabled, refreshed in place."""

    def __init__(
        self, policy: nn.Module, arm: str, dtype: torch.dtype, device: torch.device | None, fp16_guard: bool,
        tf32: bool | str = False,
    ):
        super().__init__(policy, arm, fp16_guard, tf32)
        self.dtype = dtype
        self._shadow_device = torch.device(device) if device is not None else _model_device(self._source)
        self.shadow: nn.Module | None = _build_shadow(self._source, dtype, self._shadow_device)
        self._copy = _FusedCopy()
        with torch.no_grad():
            self._sync(self._source)

    def _device(self) -> torch.device:
        return self._shadow_device

    def _score_model(self) -> Callable[..., Any]:
        return self.shadow

    def _scoring_context(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        for device_type in {self._shadow_device.type, "cpu"}:
            stack.enter_context(torch.autocast(device_type=device_type, enabled=False))
        return stack

    def _computes_fp16(self) -> bool:
        return self.dtype == torch.float16

    def _computes_fp32(self) -> bool:
        return self.dtype == torch.float32

    def _sync(self, source: nn.Module) -> None:
        self._copy(source, lambda: _param_pairs(self.shadow, source))

    def _bytes(self) -> int:
        if self.shadow is None:
            return 0
        return _tensor_bytes(list(self.shadow.parameters()) + list(self.shadow.buffers()))

    def _fp32_share(self) -> float:
        return 1.0 if self.dtype == torch.float32 else 0.0

    def close(self) -> None:
        super().close()
        self._copy.clear()
        self.shadow = None


class _Fp32Island(nn.Module):
    """Runs ``inner`` in fp32 (inputs cast, autocast off); casts the output back to the residual dtype when
    ``cast_back``. ``state`` is shared by the plan's islands during one call."""

    def __init__(self, inner: nn.Module, state: dict, starts_chain: bool, cast_back: bool) -> None:
        super().__init__()
        self.inner = inner
        self._state = state
        self._starts_chain = starts_chain
        self._cast_back = cast_back

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        first = _first_floating((args, kwargs))
        if self._starts_chain and first is not None:
            self._state["residual_dtype"] = first.dtype
        rope = self._state.get("rope")
        if rope is not None and kwargs.get("position_embeddings") is rope[0]:
            kwargs["position_embeddings"] = rope[1]
        args = _cast_floating(args, torch.float32)
        kwargs = _cast_floating(kwargs, torch.float32)
        device_type = first.device.type if first is not None else "cpu"
        with contextlib.ExitStack() as stack:
            for dt in {device_type, "cpu"}:
                stack.enter_context(torch.autocast(device_type=dt, enabled=False))
            out = self.inner(*args, **kwargs)
        if self._cast_back:
            out = _cast_floating(out, self._state.get("residual_dtype", torch.bfloat16))
        return out


class _Fp32Head(nn.Module):
    """fp32 projection with a detached fp32 copy of the head weight (never the shared tensor itself)."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.in_features = head.weight.shape[1]
        self.out_features = head.weight.shape[0]
        self.owns_weight = head.weight.dtype != torch.float32
        weight = head.weight.detach()
        self.register_buffer(
            "weight32", weight.float().clone() if self.owns_weight else weight, persistent=False
        )
        bias = getattr(head, "bias", None)
        self.owns_bias = bias is not None and bias.dtype != torch.float32
        if bias is None:
            self.bias32 = None
        else:
            self.register_buffer(
                "bias32", bias.detach().float().clone() if self.owns_bias else bias.detach(), persistent=False
            )

    @property
    def weight(self) -> torch.Tensor:
        return self.weight32

    def refresh(self, head: nn.Module) -> None:
        if self.owns_weight:
            self.weight32.copy_(head.weight)
        if self.owns_bias:
            self.bias32.copy_(head.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with contextlib.ExitStack() as stack:
            for dt in {hidden.device.type, "cpu"}:
                stack.enter_context(torch.autocast(device_type=dt, enabled=False))
            return nn.functional.linear(hidden.float(), self.weight32, self.bias32)

    def owned_tensors(self) -> list[torch.Tensor]:
        out = [self.weight32] if self.owns_weight else []
        return out + ([self.bias32] if self.owns_bias else [])


class _UpcastPlan(ScoringPlan):
    """Arms E/D on the live policy: fp32 islands swapped in for one call (see the module docstring)."""

    def __init__(
        self, policy: nn.Module, arm: str, layers: Sequence[int], fp16_guard: bool, tf32: bool | str = False
    ) -> None:
        super().__init__(policy, arm, fp16_guard, tf32)
        source = self._source
        layer_path, layer_list = _layer_list_path(source)
        self._layer_list = layer_list
        n_layers = len(layer_list)
        self.layers = sorted(int(i) for i in layers)
        self._low_dtype = _floating_dtype(source)
        self._state: dict = {}
        self._owned: list[tuple[nn.Module, nn.Module]] = []  # (fp32 copy, live module) refreshed on sync
        self._copy = _FusedCopy()
        self._swaps: list[tuple[nn.Module, str, nn.Module, nn.Module]] = []  # (parent, key, live, island)
        chosen = set(self.layers)
        device = _model_device(source)
        for i in self.layers:
            live = layer_list[i]
            inner = self._fp32_version(live, device)
            island = _Fp32Island(
                inner,
                self._state,
                starts_chain=(i - 1) not in chosen,
                cast_back=(i + 1) in range(n_layers) and (i + 1) not in chosen,
            )
            self._swaps.append((layer_list, str(i), live, island))
        norm = final_norm(source)
        self._norm_numel = 0
        if norm is not None:
            parent, key, live = norm
            island = _Fp32Island(
                self._fp32_version(live, device), self._state, starts_chain=False, cast_back=False
            )
            self._swaps.append((parent, key, live, island))
            self._norm_numel = sum(p.numel() for p in live.parameters())
        parent, key, head = output_head(source)
        if getattr(head, "weight", None) is None or head.weight.dim() != 2:
            raise ValueError(
                f"the LM head {type(head).__name__} has no 2-D weight; fp32_head/guided cannot project it"
            )
        self._head = _Fp32Head(head)
        self._head_live = head
        self._swaps.append((parent, key, head, self._head))
        self._rope = self._find_rope(source, layer_path)
        self._layer_numel = sum(sum(p.numel() for p in layer_list[i].parameters()) for i in self.layers)

    @staticmethod
    def _find_rope(source: nn.Module, layer_path: str) -> nn.Module | None:
        base = _parent_of(source, layer_path)
        rope = base._modules.get("rotary_emb")
        return rope if isinstance(rope, nn.Module) else None

    def _fp32_version(self, live: nn.Module, device: torch.device) -> nn.Module:
        params = list(live.parameters())
        if params and all(p.dtype == torch.float32 for p in params if p.is_floating_point()):
            return live  # already fp32 (fp32 weights under autocast): run it as is, autocast off
        clone = _module_copy(live, torch.float32, device)
        self._owned.append((clone, live))
        return clone

    def _score_model(self) -> Callable[..., Any]:
        return self._policy_call

    def _computes_fp16(self) -> bool:
        return self._low_dtype == torch.float16

    def _computes_fp32(self) -> bool:
        return True  # the fp32 islands and head

    @contextlib.contextmanager
    def _scoring_context(self) -> Iterator[None]:
        handle = None
        if self._rope is not None and self.layers:
            handle = self._rope.register_forward_hook(self._rope_hook, with_kwargs=True)
        for clone, live in self._owned:
            clone.train(live.training)
        installed = []
        try:
            for parent, key, live, island in self._swaps:
                if parent._modules.get(key) is not live:
                    raise RuntimeError(
                        f"the policy's module {key!r} changed since the plan was made; make a new plan after "
                        "replacing modules (e.g. after PEFT wrapping or torch.compile)"
                    )
                parent._modules[key] = island
                installed.append((parent, key, live))
            yield
        finally:
            for parent, key, live in reversed(installed):
                parent._modules[key] = live
            if handle is not None:
                handle.remove()
            self._state.clear()

    def _rope_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        x = args[0] if args else kwargs.get("x")
        if not isinstance(x, torch.Tensor) or x.dtype == torch.float32:
            return
        rest_args = args[1:]
        rest_kwargs = {k: v for k, v in kwargs.items() if k != "x"}
        with torch.autocast(device_type=x.device.type, enabled=False):
            fp32_output = type(module).forward(module, x.float(), *rest_args, **rest_kwargs)
        self._state["rope"] = (output, fp32_output)

    def _sync(self, source: nn.Module) -> None:
        if source is not self._source:
            raise ValueError(
                "arms fp32_head/guided run on the live policy they were made from; sync got a different model "
                f"({type(source).__name__} at {id(source):#x}); make a new plan for it"
            )
        self._copy(source, lambda: [pair for clone, live in self._owned
                                    for pair in zip(clone.parameters(), live.parameters())])
        self._head.refresh(self._head_live)

    def _bytes(self) -> int:
        tensors: list[torch.Tensor] = []
        for clone, _ in self._owned:
            tensors += list(clone.parameters()) + list(clone.buffers())
        return _tensor_bytes(tensors + self._head.owned_tensors())

    def _fp32_share(self) -> float:
        numerator = self._layer_numel + self._norm_numel + self._head_live.weight.numel()
        bias = getattr(self._head_live, "bias", None)
        if bias is not None:
            numerator += bias.numel()
        return numerator / max(_executed_numel(self._source), 1)

    def close(self) -> None:
        super().close()
        self._copy.clear()
        self._owned = []
        self._swaps = []
        self._head = None
        self._state.clear()


# --------------------------------------------------------------------------------------------------


def make_plan(
    policy: nn.Module,
    arm: str,
    *,
    device: str | torch.device | None = None,
    layers: Sequence[int] | str | None = None,
    k: int = 8,
    calibration: tuple[torch.Tensor, torch.Tensor] | None = None,
    fp16_guard: bool = True,
    tf32: bool | str = False,
) -> ScoringPlan:
    """A :class:`ScoringPlan` scoring with ``policy`` in ``arm``.

    Args:
        policy: the causal LM (wrapped by DDP/accelerate or not); arm ``bf16`` calls it exactly as passed.
        arm: ``bf16 | fp32 | fp16 | fp32_head | guided`` or ``A | B | F | E | D``.
        device: where an fp32/fp16 shadow lives (default: the policy's device). Not used by other arms.
        layers: ``guided`` only: decoder layer ids to run in fp32, or ``"auto"`` (top-``k`` per-layer
            divergence increments between batch 1 and batch 8 on ``calibration`` rows; see
            :mod:`bloggap_plugin.core.attribution`).
        k: number of layers chosen by ``layers="auto"``.
        calibration: ``(input_ids, attention_mask)`` ``[N, L]`` rows for ``layers="auto"``: use rows
            disjoint from the ones you evaluate on.
        fp16_guard: re-score in fp32 any chunk whose fp16 scoring gives a non-finite value.
        tf32: the fp32 matmuls of the plan's forward (``fp32``, ``fp32_head``, ``guided``, the fp16 guard's
            re-score) in TF32 (``True``), IEEE fp32 (``False``), or TF32 on Ampere+ GPUs only (``"auto"``); set
            and restored around each call (see the module docstring). Ignored by arm ``bf16``.
    """
    arm = resolve_arm(arm)
    if not (tf32 is True or tf32 is False or tf32 == "auto"):
        raise ValueError(f"tf32 must be True, False or 'auto', got {tf32!r}")
    if not isinstance(policy, nn.Module):
        raise TypeError(f"policy must be a torch.nn.Module, got {type(policy).__name__}")
    if arm != "guided" and (layers is not None or calibration is not None):
        raise ValueError(f"layers=/calibration= choose fp32 layers for arm 'guided' only, not {arm!r}")
    if device is not None and arm not in ("fp32", "fp16"):
        raise ValueError(f"device= places an fp32/fp16 shadow; arm {arm!r} runs on the policy's own device")
    if arm == "bf16":
        return _PolicyPlan(policy, arm, fp16_guard)
    if arm in ("fp32", "fp16"):
        dtype = torch.float32 if arm == "fp32" else torch.float16
        return _ShadowPlan(policy, arm, dtype, device, fp16_guard, tf32)
    if arm == "fp32_head":
        return _UpcastPlan(policy, arm, [], fp16_guard, tf32)
    # guided
    source = unwrap_model(policy)
    n_layers = len(_layer_list_path(source)[1])
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
        from .attribution import divergence_profile

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
    plan = _UpcastPlan(policy, "guided", ids, fp16_guard, tf32)
    plan.profile = profile
    return plan
