"""FSDP2 (``torch.distributed.fsdp.fully_shard``) support for the precision plans: sharded shadows and islands.

Under FSDP2 each rank holds a shard (``DTensor``, ``Shard(0)``) of every parameter, and a module's forward
all-gathers its parameters: a forward is a collective that every rank must take. The plans keep that rule:

- a shadow (arms B, F, the fp32 reference) is sharded like the policy (:func:`shard_like`: the same FSDP units
  on the same mesh, no mixed-precision cast), so it is synced shard by shard without communication and
  gathered unit by unit while it scores, like the policy;
- an fp32 island (arms D, E) is a full fp32 copy on every rank, gathered from the shards at sync
  (:func:`full_value`, a collective: the plans sync on every rank at the same point, before scoring);
- before a sync the policy's units are resharded (:func:`reshard`): a grad-free forward of a unit that keeps
  its parameters gathered (``reshard_after_forward=False``, e.g. accelerate's final norm / LM head unit) leaves
  plain full tensors on the module in place of its shards, which would otherwise be paired with the shadow's
  shards. Resharding frees those gathered tensors (the next forward gathers again); values never change.

Everything here is a no-op for models without ``DTensor`` parameters. DeepSpeed ZeRO-3's parameter slices
(:func:`is_partitioned`) are not supported: no plan that copies weights is made from them.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

__all__ = ["is_dtensor", "is_sharded", "is_partitioned", "reshard", "full_value", "local_value", "shard_for",
           "plain_class", "shard_like", "fsdp_modules", "all_ranks_true"]


@functools.cache  # asked per parameter on every sync and step: import once
def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return None
    return FSDPModule


@functools.cache
def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (a shard of a sharded tensor)."""
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(tensor, dtensor)


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 units (``FSDPModule`` instances) of ``model``, in ``modules()`` order (empty if none)."""
    fsdp = _fsdp_module_type()
    return [] if fsdp is None else [m for m in model.modules() if isinstance(m, fsdp)]


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a ``DTensor`` (FSDP2 / tensor-parallel shards)."""
    return any(is_dtensor(p) for p in model.parameters())


def is_partitioned(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are DeepSpeed ZeRO-3 slices (``ds_id``), gathered only inside a forward."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def reshard(model: nn.Module) -> None:
    """Register every FSDP2 unit's sharded parameters again (``FSDPModule.reshard``), freeing gathered ones."""
    for module in fsdp_modules(model):
        module.reshard()


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a ``DTensor`` gathered from every rank (a collective), anything else as is."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def local_value(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor`` (its storage: writing it writes the ``DTensor``), anything else as is."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def shard_for(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` as the ``DTensor`` ``like`` lays it out (same global shape): the local shard
    of a ``DTensor`` placed like ``like``, else the slice of the whole tensor (gathered if it is a ``DTensor``
    placed otherwise: a collective) that ``like``'s local shard covers. An FSDP2 unit can still hold plain full
    tensors where its shards belong (torch 2.11, after TRL's old-logprob forward, when
    ``reshard`` left the root unit gathered); their rows are the values to copy."""
    if is_dtensor(tensor) and tensor.placements == like.placements and tensor.device_mesh == like.device_mesh:
        return tensor.to_local()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    return full_value(tensor)[tuple(slice(start, start + size) for start, size in zip(offset, shape))]


def plain_class(module: nn.Module) -> type:
    """``module``'s own class: for an FSDP2 unit, the class ``fully_shard`` subclassed (``FSDPLlama...`` -> ``Llama...``)."""
    fsdp = _fsdp_module_type()
    for cls in type(module).__mro__:
        if fsdp is None or not issubclass(cls, fsdp):
            return cls
    return type(module)


def _unit_groups(source: nn.Module) -> list[tuple[list[str], bool]]:
    """``(module names, reshard_after_forward)`` of every FSDP2 unit of ``source``, children before parents
    (the order ``fully_shard`` must be applied in); a unit made of several modules (``fully_shard([a, b])``)
    appears once with all its modules."""
    names = {id(m): name for name, m in source.named_modules()}
    groups, seen = [], set()
    unit_ids = {id(u) for u in fsdp_modules(source)}
    units = [(name, m) for name, m in source.named_modules() if id(m) in unit_ids]
    units.sort(key=lambda item: (item[0] == "", -item[0].count(".")))  # deepest first, the root last
    for _, module in units:
        state = module._get_fsdp_state()
        members = tuple(getattr(state, "_modules", None) or (module,))
        key = tuple(id(m) for m in members)
        if key in seen:
            continue
        seen.add(key)
        param_groups = getattr(state, "_fsdp_param_groups", None)
        if param_groups is None:  # older torch: one optional group
            group = getattr(state, "_fsdp_param_group", None)
            param_groups = [group] if group is not None else []
        after = all(g.post_forward_mesh_info is not None for g in param_groups) if param_groups else True
        groups.append(([names[id(m)] for m in members], after))
    return groups


def shard_like(shadow: nn.Module, source: nn.Module) -> None:
    """Apply ``fully_shard`` to ``shadow`` (on the meta device, before materialising) unit by unit as ``source``
    is sharded: same modules per unit, same mesh, same ``reshard_after_forward``, no mixed-precision cast (the
    shadow computes in its own dtype). Tied parameters must already be tied in ``shadow``."""
    from torch.distributed.fsdp import fully_shard

    mesh = next(p.device_mesh for p in source.parameters() if is_dtensor(p))
    for names, after in _unit_groups(source):
        targets = [shadow.get_submodule(name) for name in names]
        fully_shard(targets if len(targets) > 1 else targets[0], mesh=mesh, reshard_after_forward=after)


def all_ranks_true(flags: list[bool], model: nn.Module) -> list[bool]:
    """``flags`` and-ed over the ranks that shard ``model`` (one all-reduce; every rank passes as many flags);
    ``flags`` as is when ``model`` is not sharded. Decides data-dependent forwards together: a forward of a
    sharded model taken by some ranks only hangs the job."""
    import torch.distributed as dist

    param = next((p for p in model.parameters() if is_dtensor(p)), None)
    if param is None or not flags:
        return list(flags)
    group = param.device_mesh.get_group()
    device = param.device if dist.get_backend(group) != "gloo" else torch.device("cpu")
    tensor = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return [bool(v) for v in tensor.tolist()]
