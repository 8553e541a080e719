"""Where a causal LM keeps its decoder layers, final norm and LM head, and hook-free copies of its modules.

The parts the precision plans (:mod:`bloggap_plugin.core.plans`) are built from: the model structure
(:func:`decoder_layers`, :func:`final_norm`), casts of nested outputs, and *shadows*: clean modules of the
policy's class in another dtype, refreshed in place from the policy (:class:`FusedCopy`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .scoring import output_head, unwrap_model
from .sharding import (
    fsdp_modules,
    full_value,
    is_dtensor,
    is_sharded,
    local_value,
    plain_class,
    shard_for,
    shard_like,
)

__all__ = [
    "FusedCopy",
    "build_shadow",
    "cast_floating",
    "decoder_layers",
    "device_sync",
    "executed_numel",
    "final_norm",
    "first_floating",
    "floating_dtype",
    "is_tied_safe",
    "layer_list_path",
    "model_device",
    "module_copy",
    "param_pairs",
    "parent_of",
    "tensor_bytes",
    "unique_numel",
]

_FSDP_STATE_KEY = "__composable_api_state_key"  # where fully_shard keeps a module's FSDP state (its __dict__)
_NORM_NAMES = ("norm", "final_layer_norm", "ln_f", "norm_f", "final_norm")
_LAYER_LIST_NAMES = ("layers", "h", "blocks", "layer")


def layer_list_path(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """``(dotted path, list)`` of the model's decoder layers (the ``ModuleList`` of ``num_hidden_layers`` blocks)."""
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
    return layer_list_path(unwrap_model(model))[1]


def parent_of(model: nn.Module, path: str) -> nn.Module:
    """The module holding the submodule at dotted ``path`` (``model`` itself for a top-level name)."""
    return model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else model


def final_norm(model: nn.Module) -> tuple[nn.Module, str, nn.Module] | None:
    """``(parent, attribute, module)`` of the final norm after the last decoder layer, or ``None``."""
    model = unwrap_model(model)
    path, _ = layer_list_path(model)
    base = parent_of(model, path)
    for name in _NORM_NAMES:
        module = base._modules.get(name)
        if isinstance(module, nn.Module):
            return base, name, module
    return None


def _is_tied(model: nn.Module) -> bool:
    head = output_head(model)[2]
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return embed is not None and getattr(head, "weight", None) is getattr(embed, "weight", None)


def unique_numel(model: nn.Module) -> int:
    """Parameters stored (a tied weight counted once)."""
    return sum(p.numel() for p in model.parameters())


def executed_numel(model: nn.Module) -> int:
    """Parameters as executed: a tied head counts twice (embedding lookup and projection)."""
    total = unique_numel(model)
    if is_tied_safe(model):
        total += output_head(model)[2].weight.numel()
    return total


def is_tied_safe(model: nn.Module) -> bool:
    """Whether the LM head shares the embedding's weight (``False`` where that cannot be told)."""
    try:
        return _is_tied(model)
    except ValueError:
        return False


def tensor_bytes(tensors: Iterator[torch.Tensor]) -> int:
    """Bytes held by ``tensors`` on this rank, each storage counted once (``None`` entries skipped)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = local_value(t)  # a shard: the bytes this rank holds
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def device_sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA only; a no-op elsewhere), so a wall-clock timing is complete."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a model without parameters)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def floating_dtype(model: nn.Module) -> torch.dtype:
    """Most common floating dtype of the parameters (the dtype the policy stores its weights in)."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.get) if counts else torch.float32


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Cast every floating tensor in (nested tuples/lists/dicts of) ``obj`` to ``dtype``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, tuple):
        cast = [cast_floating(x, dtype) for x in obj]
        return type(obj)(*cast) if hasattr(obj, "_fields") else tuple(cast)
    if isinstance(obj, list):
        return [cast_floating(x, dtype) for x in obj]
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: cast_floating(v, dtype) for k, v in obj.items()}
    if hasattr(obj, "to_tuple") and hasattr(obj, "keys"):  # transformers ModelOutput
        for key in list(obj.keys()):
            obj[key] = cast_floating(obj[key], dtype)
        return obj
    return obj


def first_floating(obj: Any) -> torch.Tensor | None:
    """The first floating-point tensor in ``obj`` (a tensor, or nested tuples, lists and dicts), or ``None``."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.is_floating_point() else None
    if isinstance(obj, (tuple, list)):
        for x in obj:
            found = first_floating(x)
            if found is not None:
                return found
    if isinstance(obj, dict):
        for x in obj.values():
            found = first_floating(x)
            if found is not None:
                return found
    return None


_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)


def _strip_instance_patches(module: nn.Module) -> None:
    """Remove instance-level forward patches and hooks copied along with a module (clean forward)."""
    for sub in module.modules():
        for attr in ("forward", "_original_forward", "_old_forward", "_hf_hook"):
            sub.__dict__.pop(attr, None)
        for hooks in _HOOK_DICTS:
            if isinstance(getattr(sub, hooks, None), dict):
                setattr(sub, hooks, type(getattr(sub, hooks))())


def module_copy(module: nn.Module, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A hook-free copy of a (small) submodule with floating parameters in ``dtype`` on ``device``.

    Parameters are re-materialised from the meta device (no temporary copy in the source dtype) and filled
    by ``copy_``; buffers are copied (fp32 buffers stay fp32)."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        target = dtype if p.is_floating_point() else p.dtype
        memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=target, device="meta"), requires_grad=False)
    for b in module.buffers():
        memo[id(b)] = torch.empty(b.shape, dtype=_buffer_dtype(b, dtype), device="meta")
    # an FSDP2 unit is copied as a plain module of its own class: its FSDP state (process groups, shards) stays
    # behind, and its class (which refuses deepcopy) is the plain one while copying
    units = [(unit, type(unit)) for unit in fsdp_modules(module)]
    for unit, _ in units:
        memo.update({id(v): None for k, v in vars(unit).items() if k.startswith(_FSDP_STATE_KEY)})
    for sub in module.modules():  # hooks are stripped from the copy anyway (FSDP's hold its state)
        memo.update({id(hooks): type(hooks)() for name in _HOOK_DICTS
                     if isinstance(hooks := getattr(sub, name, None), dict)})
    try:
        for unit, _ in units:
            unit.__class__ = plain_class(unit)
        clone = copy.deepcopy(module, memo)
    finally:
        for unit, fsdp_class in units:
            unit.__class__ = fsdp_class
    for sub in clone.modules():
        for key in [k for k in vars(sub) if k.startswith(_FSDP_STATE_KEY)]:
            delattr(sub, key)
    _strip_instance_patches(clone)
    clone.to_empty(device=device)
    with torch.no_grad():
        for (_, dst), (_, src) in zip(
            clone.named_parameters(remove_duplicate=False), module.named_parameters(remove_duplicate=False)
        ):
            dst.copy_(full_value(src))  # a sharded parameter: gathered (every rank copies at the same point)
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


def build_shadow(source: nn.Module, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A clean module of ``source``'s class in ``dtype`` on ``device`` holding ``source``'s weights.

    Built on the meta device (no random init, no temporary copy), materialised once, filled by ``copy_``. A
    policy sharded by FSDP2 gets a shadow sharded the same way (:func:`~bloggap_plugin.core.sharding.shard_like`):
    each rank materialises only its shards.
    """
    config = getattr(source, "config", None)
    cls = plain_class(source)
    sharded = is_sharded(source)
    if config is not None and hasattr(cls, "_from_config"):
        with torch.device("meta"):
            shadow = cls._from_config(copy.deepcopy(config), dtype=dtype)
        _strip_instance_patches(shadow)
    elif sharded:
        raise ValueError(
            f"a shadow of an FSDP-sharded {cls.__name__} needs a transformers model (a config and _from_config); "
            "use an arm without a shadow (A, C, E, G) for this model"
        )
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
    if sharded:
        if hasattr(shadow, "tie_weights"):
            shadow.tie_weights()  # tied before sharding: FSDP2 keeps a shared parameter in one unit
        shard_like(shadow, source)
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


def param_pairs(dst_model: nn.Module, src_model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
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


class FusedCopy:
    """``dst.copy_(src)`` for many pairs as one ``torch._foreach_copy_`` per (device, dtype) group.

    Bitwise the per-tensor ``copy_`` (same element-wise cast), into the same storage (nothing re-allocated). The
    grouping is built once per source model and kept while every source tensor is still the one its module holds
    (one dict lookup per tensor, no module traversal): a replaced parameter object (``module.weight = ...``) or
    another source model rebuilds it through ``pairs`` (which validates names and shapes). Replacing whole
    submodules of the policy after the plan was made needs a new plan."""

    def __init__(self) -> None:
        self._source: nn.Module | None = None
        self._units: list[nn.Module] = []  # the source's FSDP2 units (resharded before each copy)
        self._slots: list[tuple[dict, str, torch.Tensor]] = []  # (module._parameters/_buffers, key, tensor)
        self._groups: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []

    def _valid_for(self, source: nn.Module) -> bool:
        return source is self._source and all(slots.get(key) is tensor for slots, key, tensor in self._slots)

    def __call__(self, source: nn.Module, pairs: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        for unit in self._units if source is self._source else fsdp_modules(source):
            unit.reshard()  # FSDP2: the module holds its shards again (see core.sharding)
        if not self._valid_for(source):
            groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
            sources = set()
            for dst, src in pairs():
                group = groups.setdefault((dst.device, dst.dtype, src.device, src.dtype, is_dtensor(dst),
                                           is_dtensor(src)), ([], []))
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
            self._units = fsdp_modules(source)
        for dsts, srcs in self._groups:
            if dsts and is_dtensor(dsts[0]):  # a sharded shadow: shard into shard, no communication (a source
                # unit that still holds its gathered full tensors gives this shard's rows of them)
                torch._foreach_copy_([local_value(d) for d in dsts], [shard_for(s, d) for d, s in zip(dsts, srcs)])
            else:  # a full copy (fp32 island) of sharded parameters: gathered (a collective), else as is
                torch._foreach_copy_(dsts, [full_value(src) for src in srcs])

    def clear(self) -> None:
        self._source, self._units, self._slots, self._groups = None, [], [], []
