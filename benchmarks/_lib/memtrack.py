"""Device-independent peak memory of one call: the peak of live tensor bytes created during it.

``torch.cuda.max_memory_allocated`` exists only on CUDA. :class:`TensorPeak` measures the same quantity on any
device from the tensors themselves: a ``TorchDispatchMode`` sees every aten op called inside the block and adds
the bytes of each new storage an op returns (``untyped_storage().nbytes()``, counted once per storage: views
and in-place results share their input's storage and add nothing); a ``weakref.finalize`` on the storage
subtracts them when it is freed. ``peak_bytes`` is the largest live total during the block, above what was
live before it (storages created before the block are never counted, and freeing them does not lower it).

What it does not see (so, on CUDA, ``max_memory_allocated`` can read higher): scratch memory a kernel allocates
and frees inside one op (for example a fused attention kernel's workspace or a BLAS packing buffer), allocator
rounding and caching, and tensors made outside the dispatcher (``torch.from_numpy``).

    with TensorPeak() as peak:
        fn()
    peak.peak_bytes      # int, bytes
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["TensorPeak", "call_peak_bytes"]


def _storages(tree) -> dict[int, torch.UntypedStorage]:
    """The distinct storages of the dense tensors in an op's arguments or outputs (tensors, nested in tuples,
    lists and dict values), keyed by their C++ storage address."""
    out: dict[int, torch.UntypedStorage] = {}
    _collect_storages(tree, out)
    return out


def _collect_storages(node, out: dict[int, torch.UntypedStorage]) -> None:
    # an aten op's arguments and outputs nest only in tuples, lists and dicts; walked by hand, as pytree's
    # general flattening cost more than the op itself on small tensors
    if isinstance(node, torch.Tensor):
        if node.layout == torch.strided and not node.is_meta:
            storage = node.untyped_storage()
            out[storage._cdata] = storage
    elif isinstance(node, (tuple, list)):
        for item in node:
            _collect_storages(item, out)
    elif isinstance(node, dict):
        for item in node.values():
            _collect_storages(item, out)


class TensorPeak(TorchDispatchMode):
    """Live and peak bytes of the tensor storages created inside the ``with`` block (see the module docstring).

    ``live_bytes``: bytes of the storages created in the block that are still alive; ``peak_bytes``: the
    largest ``live_bytes`` seen (both 0 at entry). A storage an op resizes is re-measured the next time an op
    returns it. Not thread-safe; the mode applies to the thread that entered it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._tracked: dict[int, int] = {}  # storage address -> bytes counted for it

    def _release(self, key: int) -> None:
        self.live_bytes -= self._tracked.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = None  # the inputs' storages, collected only once an output storage is not tracked yet
        for key, storage in _storages(out).items():
            nbytes = storage.nbytes()
            if key in self._tracked:
                self.live_bytes += nbytes - self._tracked[key]
                self._tracked[key] = nbytes
                continue
            if inputs is None:
                # lift_fresh returns the (fresh) tensor torch.tensor() built outside the dispatcher: a new allocation
                inputs = {} if func is torch.ops.aten.lift_fresh.default else _storages((args, kwargs))
            if key not in inputs:
                self._tracked[key] = nbytes
                self.live_bytes += nbytes
                weakref.finalize(storage, self._release, key)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return out


def call_peak_bytes(fn, *args, **kwargs) -> tuple[int, object]:
    """``(peak_bytes, result)`` of ``fn(*args, **kwargs)`` under :class:`TensorPeak`."""
    with TensorPeak() as peak:
        result = fn(*args, **kwargs)
    return peak.peak_bytes, result


_ARITHMETIC_OPS = {
    torch.ops.aten.mm,
    torch.ops.aten.addmm,
    torch.ops.aten.bmm,
    torch.ops.aten.baddbmm,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
}


def _to_meta(tree):
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), tree)


class SkipMatmulArithmetic(TorchDispatchMode):
    """Matmuls and CPU attention return zeros of the real shape, dtype and strides instead of computing.

    For measuring memory where the arithmetic is too slow to run (bf16 matmuls on a CPU without bf16 units
    run at ~1 GFLOP/s): every op still returns tensors of exactly the real op's size (its meta kernel gives
    the shape and strides), so :class:`TensorPeak` entered *inside* this mode (``with SkipMatmulArithmetic(),
    TensorPeak():``) measures what the real pass allocates, while the values are meaningless. ``out=``
    variants zero their output in place. Ops: ``mm``, ``addmm``, ``bmm``, ``baddbmm`` and
    ``_scaled_dot_product_flash_attention_for_cpu``; everything else runs for real.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket not in _ARITHMETIC_OPS:
            return func(*args, **kwargs)
        if "out" in kwargs:
            out = kwargs["out"]
            expected = func.overloadpacket.default(*_to_meta(args), **_to_meta({k: v for k, v in kwargs.items()
                                                                               if k != "out"}))
            if out.shape != expected.shape:
                out.resize_(expected.shape)
            return out.zero_()
        device = next(t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        meta = func(*_to_meta(args), **_to_meta(kwargs))
        return torch.utils._pytree.tree_map_only(
            torch.Tensor,
            lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device).zero_(),
            meta,
        )
