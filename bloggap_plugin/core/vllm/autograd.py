"""Backward passes for arm I's kernel pieces, so that its forward can train (the exactly on-policy arm).

vLLM's kernels (:class:`~bloggap_plugin.core.vllm.form.Kernels`: the batch-invariant linear, the RMSNorm kernels,
``rotary_embedding``, ``silu_and_mul``, FlashAttention, the V2 sampler's log-prob) have no backward. Each is wrapped
here in a ``torch.autograd.Function`` whose forward calls the kernel unchanged (the values are the kernel's, bit for
bit) and whose backward is the gradient of the same piece's torch formula in fp32 at the saved inputs: in closed
form where :data:`PIECE_GRADIENTS` has it, else by differentiating the formula with autograd (the contiguous
attention's, and a paged call past :data:`DENSE_GRADIENT_ELEMENTS`); straight-through across the kernel's bf16
roundings, as vLLM + TorchTitan's bit-wise on-policy RL does. Each input's gradient is returned in its own dtype
(autograd rounds an fp32 gradient of a bf16 input to bf16).

Contract of a wrapped kernel: it returns a new tensor and leaves its inputs as they were
(:mod:`bloggap_plugin.core.vllm.kernels`' wrappers clone what vLLM's ops modify in place); a kernel that changes an
input it was given is an error at the call (its saved inputs would no longer be the ones it read). Torch only.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from ..errors import UsageError
from .form import NORM_LARGE_LAUNCH, Kernels, norm_in_step_launches

__all__ = [
    "autograd_kernels",
    "PIECE_FORMULAS",
    "linear_formula",
    "rms_norm_formula",
    "rotary_formula",
    "silu_and_mul_formula",
    "flash_formula",
    "flash_paged_formula",
    "paged_attention_formula",
    "padded_paged_attention",
    "dense_cache_attention",
    "DENSE_MASK_ELEMENTS",
    "DENSE_GRADIENT_ELEMENTS",
    "paged_unread_slots",
    "formula_gradient",
    "paged_attention_gradient",
    "dense_gradient_fits",
    "padded_entry_attention",
    "token_logprobs_formula",
]


# ------------------------------------------------------------------------------------- torch's formulas, fp32
def linear_formula(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``. ``x [..., in]``, ``weight [out, in]`` -> ``[..., out]``."""
    return F.linear(x, weight, bias)


def rms_norm_formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim (every RMSNorm kernel's maths, no rounding)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotary_formula(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Neox-style RoPE from vLLM's ``cos_sin_cache`` (cos | sin per position): ``[x1 cos - x2 sin, x2 cos + x1
    sin]``. ``x [T, heads, d]``, ``positions [T]``."""
    cos, sin = cache.index_select(0, positions).to(x.dtype).chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul_formula(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x = [gate | up]`` ``[T, 2I]`` -> ``[T, I]``."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


ENTRY_BLOCK_ELEMENTS = 1 << 26
"""Elements (entries x query rows x heads x keys, or x head dim) one padded attention block of
:func:`padded_entry_attention` may hold in fp32; more entries are computed in blocks of this size."""


def _query_entries(cu_seqlens_q: torch.Tensor, queries: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(counts [E], entry [Tq], within [Tq])`` of a varlen call's ``cu_seqlens_q [E + 1]``: each entry's query count
    (int64), and each query's entry and its index among that entry's queries. No host read (``queries`` is Tq)."""
    counts = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    entry = torch.repeat_interleave(torch.arange(counts.numel(), device=cu_seqlens_q.device), counts,
                                    output_size=queries)
    within = torch.arange(queries, device=cu_seqlens_q.device) - cu_seqlens_q[:-1].long()[entry]
    return counts, entry, within


def _entry_slots(block_table: torch.Tensor, j: torch.Tensor, page: int) -> torch.Tensor:
    """``[E, len(j)]`` int64: the cache slot entry ``e``'s position ``j`` sits in through ``block_table[e]`` (a position
    past the table's blocks maps into its last block: callers mask it)."""
    block = (j // page).clamp(max=block_table.shape[1] - 1)
    return block_table.long()[:, block] * page + j % page


def _visible_keys(counts: torch.Tensor, seqused_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int) -> torch.Tensor:
    """``[E, max_q, max_k]`` bool: the keys each padded query of an entry sees. Query ``r`` of entry ``i``'s
    ``counts[i]`` sees the keys ``< seqused_k[i] - counts[i] + r + 1``; every row sees key 0, so a padded query (``r >=
    counts[i]``, its output dropped, its gradient zero) has no all-masked softmax. No host read."""
    device = counts.device
    j = torch.arange(max_seqlen_k, device=device)
    rows = torch.arange(max_seqlen_q, device=device)
    limit = seqused_k.long()[:, None] - counts[:, None] + rows[None, :] + 1  # [E, max_q]
    visible = j[None, None, :] < limit[:, :, None]
    visible[:, :, 0] = True
    return visible


def padded_entry_attention(q: torch.Tensor, keys: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                           cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           scale: float) -> torch.Tensor:
    """Causal attention of varlen entries, all entries in one padded ``scaled_dot_product_attention`` per block:
    entry ``i`` has the queries ``q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]]`` (``n`` of them, the last ``n`` positions
    of its sequence) and ``seqused_k[i]`` keys; query ``r`` sees the keys ``< seqused_k[i] - n + r + 1``.
    ``keys(j [max_k])`` gives each entry's key and value at index ``j`` (``[E, max_k, nkv, d]`` each; indices past
    an entry's keys may hold anything, they are masked). No host read: the bounds are ``max_seqlen_q/k``.
    ``q [Tq, nq, d]`` -> ``[Tq, nq, d]``."""
    entries, heads, dim = cu_seqlens_q.numel() - 1, q.shape[1], q.shape[2]
    device = q.device
    counts, entry, within = _query_entries(cu_seqlens_q, q.shape[0])
    padded = q.new_zeros(entries, max_seqlen_q, heads, dim).index_put((entry, within), q)
    j = torch.arange(max_seqlen_k, device=device)
    visible = _visible_keys(counts, seqused_k, max_seqlen_q, max_seqlen_k)
    key, value = keys(j)
    groups = heads // key.shape[2]
    per_entry = max_seqlen_k * heads * max(dim, max_seqlen_q)
    block = max(1, ENTRY_BLOCK_ELEMENTS // max(1, per_entry))
    parts = []
    for start in range(0, entries, block):
        part = slice(start, start + block)
        parts.append(F.scaled_dot_product_attention(
            padded[part].transpose(1, 2), key[part].transpose(1, 2).repeat_interleave(groups, dim=1),
            value[part].transpose(1, 2).repeat_interleave(groups, dim=1), attn_mask=visible[part, None],
            scale=scale).transpose(1, 2))
    out = torch.cat(parts) if len(parts) > 1 else parts[0]
    return out[entry, within]


def _cache_rows(key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor):
    """``keys(j)`` for :func:`padded_entry_attention` reading row ``i``'s K/V through ``block_table[i]``."""
    page = key_cache.shape[1]
    keys_flat, values_flat = key_cache.flatten(0, 1), value_cache.flatten(0, 1)

    def keys(j: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        slot = _entry_slots(block_table, j, page)  # [E, max_k]
        return keys_flat[slot], values_flat[slot]

    return keys


def flash_formula(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                  scale: float, block_table: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention per packed row (``k``/``v`` the paged caches when ``block_table`` is given): the
    :attr:`Kernels.flash` signature."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if block_table is not None:
        return padded_paged_attention(q, k, v, cu_seqlens, lengths, block_table, max_seqlen, max_seqlen, scale)

    def keys(j: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        index = (cu_seqlens[:-1].long()[:, None] + j[None, :]).clamp(max=k.shape[0] - 1)
        return k[index], v[index]
    return padded_entry_attention(q, keys, cu_seqlens, lengths, max_seqlen, max_seqlen, scale)


def padded_paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor, block_table: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, scale: float) -> torch.Tensor:
    """The paged varlen call (the :attr:`Kernels.flash_paged` signature) as padded entries: entry ``i``'s queries
    against the keys its block table reads, each query ``r`` of ``n`` to the keys ``< seqused_k - n + r + 1``, all
    entries in one padded call (:func:`padded_entry_attention`; the keys gathered per entry). ``q [Tq, nq, d]``,
    ``key_cache/value_cache [blocks, page, nkv, d]`` -> ``[Tq, nq, d]``."""
    return padded_entry_attention(q, _cache_rows(key_cache, value_cache, block_table), cu_seqlens_q, seqused_k,
                                  max_seqlen_q, max_seqlen_k, scale)


def paged_unread_slots(cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor, block_table: torch.Tensor,
                       max_seqlen_k: int, queries: int, slots: int, page: int) -> torch.Tensor:
    """``[queries, slots]`` bool, True where query ``t`` does **not** read cache slot ``s`` in the paged varlen call
    (the :attr:`Kernels.flash_paged` metadata): query ``r`` of entry ``i``'s ``n`` reads the slots its block table
    maps positions ``< seqused_k[i] - n + r + 1`` to. No host read: the bound is ``max_seqlen_k``."""
    device = cu_seqlens_q.device
    counts, entry, within = _query_entries(cu_seqlens_q, queries)
    limit = seqused_k.long()[entry] - counts[entry] + within + 1  # [Tq]
    j = torch.arange(max_seqlen_k, device=device)
    slot = _entry_slots(block_table, j, page)[entry]  # [Tq, max_k]
    reads = torch.zeros(queries, slots, dtype=torch.int32, device=device)
    reads.scatter_add_(1, slot, (j[None, :] < limit[:, None]).to(torch.int32))
    return reads == 0


_UNREAD_MEMO: collections.OrderedDict = collections.OrderedDict()
_ENTRY_MEMO: collections.OrderedDict = collections.OrderedDict()
_MEMO_SIZE = 8


def _memo(store: collections.OrderedDict, build: Callable[..., object], metadata: tuple[torch.Tensor, ...],
          *sizes: int) -> object:
    """``build(*metadata, *sizes)``, computed once per call's metadata: every layer's call of a forward passes the
    same metadata tensors (``form.stepwise_calls``), so it is built for the first layer's backward and reused by the
    others. An entry holds weak references to the tensors and their versions: a tensor replaced or changed in place
    is a miss (built again), and the entry goes when any of them is freed; at most ``_MEMO_SIZE`` entries."""
    key = (*(id(t) for t in metadata), *sizes)
    held = store.get(key)
    if held is not None:
        refs, versions, value = held
        if all(ref() is t for ref, t in zip(refs, metadata)) and versions == tuple(t._version for t in metadata):
            with contextlib.suppress(KeyError):  # its metadata freed meanwhile
                store.move_to_end(key)
            return value
    value = build(*metadata, *sizes)

    def forget(_ref: weakref.ref, key: tuple = key) -> None:
        held = store.get(key)
        if held is not None and any(ref is _ref for ref in held[0]):
            store.pop(key, None)

    store[key] = (tuple(weakref.ref(t, forget) for t in metadata), tuple(t._version for t in metadata), value)
    while len(store) > _MEMO_SIZE:
        store.popitem(last=False)
    return value


def _memo_unread_slots(cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor, block_table: torch.Tensor,
                       max_seqlen_k: int, queries: int, slots: int, page: int) -> torch.Tensor:
    """:func:`paged_unread_slots`, computed once per call's metadata (:func:`_memo`)."""
    return _memo(_UNREAD_MEMO, paged_unread_slots, (cu_seqlens_q, seqused_k, block_table), max_seqlen_k, queries,
                 slots, page)


def dense_cache_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor, block_table: torch.Tensor,
                          max_seqlen_q: int, max_seqlen_k: int, scale: float) -> torch.Tensor:  # noqa: ARG001
    """The paged varlen call (the :attr:`Kernels.flash_paged` signature) dense over the cache: every query against
    the whole paged cache in one ``scaled_dot_product_attention``, a ``[Tq, slots]`` mask marking the keys its entry
    reads (:func:`paged_unread_slots`). No per-entry gather of the keys: their gradients land in the cache directly.
    ``q [Tq, nq, d]``, ``key_cache/value_cache [blocks, page, nkv, d]`` (``slots = blocks * page``) -> ``[Tq, nq,
    d]``. No host read: the bound is ``max_seqlen_k``."""
    page, heads = key_cache.shape[1], q.shape[1]
    unread = paged_unread_slots(cu_seqlens_q, seqused_k, block_table, max_seqlen_k, q.shape[0],
                                key_cache.shape[0] * page, page)
    groups = heads // key_cache.shape[2]
    keys = key_cache.flatten(0, 1).transpose(0, 1).repeat_interleave(groups, dim=0)[None]
    values = value_cache.flatten(0, 1).transpose(0, 1).repeat_interleave(groups, dim=0)[None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=~unread[None, None],
                                         scale=scale)
    return out[0].transpose(0, 1)


DENSE_MASK_ELEMENTS = 1 << 26
"""Elements (query rows ``Tq`` x cache slots) of the ``[Tq, slots]`` mask :func:`dense_cache_attention` builds (an
int32 count and a bool mask of that shape, broadcast over the heads by SDPA): :func:`paged_attention_formula` takes
the dense formula only for a call whose mask has at most this many, else padded entries."""


def paged_attention_formula(q: torch.Tensor, key_cache: torch.Tensor,
                            max_seqlen_q: int) -> Callable[..., torch.Tensor]:
    """The formula :func:`flash_paged_formula` differentiates for one call (table T16-armJ-attention compared both on
    arm J's calls): :func:`dense_cache_attention` for a decode call (``max_seqlen_q == 1``: one query per entry)
    whose ``[Tq, slots]`` mask is at most :data:`DENSE_MASK_ELEMENTS`, else :func:`padded_paged_attention` (the
    prefill, a query per prompt token). Reads shapes and the int ``max_seqlen_q`` only: no host read of a device
    tensor."""
    slots = key_cache.shape[0] * key_cache.shape[1]
    if max_seqlen_q == 1 and q.shape[0] * slots <= DENSE_MASK_ELEMENTS:
        return dense_cache_attention
    return padded_paged_attention


def flash_paged_formula(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor, block_table: torch.Tensor,
                        max_seqlen_q: int, max_seqlen_k: int, scale: float, rows: tuple | None = None) -> torch.Tensor:
    """The paged varlen call with query and key lengths apart (the :attr:`Kernels.flash_paged` signature): entry
    ``i``'s queries against the keys its block table reads, each query ``r`` of ``n`` to the keys ``< seqused_k - n +
    r + 1``. Per call, dense over the cache or padded entries (:func:`paged_attention_formula`; both compute the same
    attention). ``rows``: the same call described by rows (:func:`~bloggap_plugin.core.vllm.form.decode_by_rows`),
    read only by the gradient (:func:`paged_attention_gradient`). ``q [Tq, nq, d]`` -> ``[Tq, nq, d]``."""
    formula = paged_attention_formula(q, key_cache, max_seqlen_q)
    return formula(q, key_cache, value_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k, scale)


def token_logprobs_formula(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[tokens]``: ``logits [N, V]``, ``tokens [N]`` -> ``[N]``."""
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


PIECE_FORMULAS: dict[str, Callable[..., torch.Tensor]] = {
    "linear": linear_formula,
    "rms_norm": rms_norm_formula,
    "add_rms_norm": rms_norm_formula,
    "rotary": rotary_formula,
    "silu_and_mul": silu_and_mul_formula,
    "flash": flash_formula,
    "flash_paged": flash_paged_formula,
    "token_logprobs": token_logprobs_formula,
}
"""The torch formula each wrapped :class:`Kernels` field is differentiated with (same signature as the field)."""


# ------------------------------------------------------------------------- the formulas' gradients, closed form
# Each takes the piece's inputs as the kernel was given them (bf16, or fp32) and computes in fp32: a bf16 input is
# cast once where an op would otherwise compute in bf16, and elsewhere enters an op beside an fp32 operand, which
# promotes it exactly (bf16 -> fp32 is exact), so no cast is launched for it. A gradient is returned in fp32, or in
# its input's dtype where the last elementwise op stores it so (computed in fp32, rounded once on the store: the bits
# the backward's cast of the fp32 result would give, without its launch). ``needs`` (one flag per argument, all by
# default) names the gradients wanted; the others are returned as ``None`` without being computed.
def _wants(needs: Sequence[bool] | None, index: int) -> bool:
    return needs is None or (index < len(needs) and bool(needs[index]))


def linear_gradient(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                    needs: Sequence[bool] | None = None):
    """:func:`linear_formula`'s gradients ``(d x, d weight, d bias)`` for the output's gradient ``grad``, each only if
    wanted. Where ``x`` and ``weight`` share a 16-bit dtype, the matmuls run in it (``grad`` rounded to it; the
    matmuls accumulate in fp32), as autocast's backward of a bf16 linear does; else fp32 matmuls of the fp32 casts.
    ``d bias`` is an fp32 sum."""
    dtype = x.dtype if x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16) else torch.float32
    grad = grad.to(dtype)
    flat_grad = grad.reshape(-1, grad.shape[-1])
    dx = grad @ weight.to(dtype) if _wants(needs, 0) else None
    dweight = flat_grad.T @ x.reshape(-1, x.shape[-1]).to(dtype) if _wants(needs, 1) else None
    dbias = flat_grad.float().sum(0) if bias is not None and _wants(needs, 2) else None
    return dx, dweight, dbias


def rms_norm_gradient(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, *rest,
                      needs: Sequence[bool] | None = None):
    """:func:`rms_norm_formula`'s ``(d x, d weight, None, ...)``: with ``r = rsqrt(mean(x^2) + eps)``, ``n = x r`` and
    ``g = grad * weight``, ``d x = r (g - n mean(g n))`` (``= r g - x r^3 mean(g x)``) and ``d weight`` the sum over
    rows of ``grad n``. The means are sums times ``1 / width``: vLLM's batch-invariant mode replaces ``aten::mean.dim``
    process-wide with a Triton kernel, not ``aten::sum``."""
    width = x.shape[-1]
    x32 = x.float()
    rsqrt = x32.square().sum(-1, keepdim=True).mul_(1 / width).add_(eps).rsqrt_()
    normed = x32.mul_(rsqrt) if x.dtype != torch.float32 else x * rsqrt  # in place on the cast's copy
    dx = dweight = None
    if _wants(needs, 0):
        scaled = grad * weight.float()
        summed = (scaled * normed).sum(-1, keepdim=True)  # width x mean(g n)
        dx = torch.mul(torch.addcmul(scaled, normed, summed, value=-1 / width), rsqrt,
                       out=torch.empty(x.shape, dtype=x.dtype, device=x.device))
    if _wants(needs, 1):
        dweight = (grad * normed).reshape(-1, x.shape[-1]).sum(0)
    return (dx, dweight, None, *(None for _ in rest))


def rotary_gradient(grad: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, *,  # noqa: ARG001
                    needs: Sequence[bool] | None = None):  # noqa: ARG001
    """:func:`rotary_formula`'s ``(d x, None, None)``: the rotation by the opposite angle, ``[g1 cos + g2 sin,
    g2 cos - g1 sin]`` (``x`` is not read: the rotation is linear)."""
    cos, sin = cache.index_select(0, positions).float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    g1, g2 = grad.chunk(2, dim=-1)
    dx = torch.empty(grad.shape, dtype=x.dtype, device=grad.device)
    d1, d2 = dx.chunk(2, dim=-1)
    torch.addcmul(torch.mul(g1, cos), g2, sin, out=d1)
    torch.addcmul(torch.mul(g2, cos), g1, sin, value=-1, out=d2)
    return dx, None, None


def silu_and_mul_gradient(grad: torch.Tensor, x: torch.Tensor, *, needs: Sequence[bool] | None = None):  # noqa: ARG001
    """:func:`silu_and_mul_formula`'s ``(d x,)``: with ``s = sigmoid(gate)``, ``d gate = grad up s (1 + gate (1 -
    s)) = grad up (silu + s (1 - silu))`` and ``d up = grad silu(gate)``."""
    half = x.shape[-1] // 2
    gate, up = x[..., :half].float(), x[..., half:]
    sigmoid = torch.sigmoid(gate)
    silu = gate.mul_(sigmoid) if x.dtype != torch.float32 else gate * sigmoid  # in place on the cast's copy
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.mul(grad, silu, out=dx[..., half:])
    torch.mul(torch.addcmul(silu, sigmoid, 1 - silu).mul_(up), grad, out=dx[..., :half])
    return (dx,)


def token_logprobs_gradient(grad: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor, *,
                            needs: Sequence[bool] | None = None):  # noqa: ARG001
    """:func:`token_logprobs_formula`'s ``(d logits, None)``: ``grad (onehot(tokens) - softmax(logits))``."""
    grad = grad.float()
    dlogits = torch.softmax(logits, dim=-1, dtype=torch.float32).mul_(-grad[:, None])
    dlogits.scatter_add_(-1, tokens.long()[:, None], grad[:, None])
    return dlogits, None


def formula_gradient(formula: Callable[..., torch.Tensor], grad: torch.Tensor, *args,
                     needs: Sequence[bool] | None = None) -> tuple:
    """The gradients of ``formula(*args)`` for the output's gradient ``grad`` by torch's autograd in fp32: each
    floating-point tensor argument is cast to an fp32 leaf, the formula recomputed and differentiated; one entry per
    argument (``None`` where there is none or ``needs`` does not want it), in fp32."""
    wanted = [i for i, a in enumerate(args)
              if isinstance(a, torch.Tensor) and a.is_floating_point() and _wants(needs, i)]
    with torch.no_grad():  # fresh fp32 leaves (a bf16 input's cast is a copy: no detach needed)
        inputs = [(a.float() if a.dtype != torch.float32 else a.detach())
                  if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    grads: list[torch.Tensor | None] = [None] * len(args)
    if not wanted:
        return tuple(grads)
    with torch.enable_grad():
        for i in wanted:
            inputs[i].requires_grad_(True)
        out = formula(*inputs)
        found = torch.autograd.grad(out, [inputs[i] for i in wanted], grad.float(), allow_unused=True)
    for i, g in zip(wanted, found):
        grads[i] = g
    return tuple(grads)


ATTENTION_GRADIENT_ENV = "BLOGGAP_ATTENTION_GRADIENT"
"""Environment variable: ``dense`` gives every paged call the dense closed form of :func:`paged_attention_gradient`
(the form before the by-entry one: a benchmark's before, ``J:dense_attention`` in ``benchmarks.cost_by_size``);
unset, empty or ``by_entry``: by entry where the call allows it."""


def _by_entry_allowed() -> bool:
    value = os.environ.get(ATTENTION_GRADIENT_ENV, "").strip() or "by_entry"
    if value not in ("by_entry", "dense"):
        raise UsageError(f"{ATTENTION_GRADIENT_ENV}={value!r}: expected by_entry (the default) or dense; unset it "
                         "for the default")
    return value == "by_entry"


DENSE_GRADIENT_ELEMENTS = 1 << 26
"""Elements (query heads x query rows x cache slots) of one fp32 score matrix in :func:`paged_attention_gradient`'s
closed form, which holds about three of them at once; a larger call is differentiated through
:func:`flash_paged_formula` by autograd (:func:`formula_gradient`)."""


def _bmm(a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``alpha * a @ b`` for 3-d tensors through ``baddbmm`` with ``beta`` 0 (its input ignored): vLLM's
    batch-invariant mode replaces ``aten::bmm`` process-wide with a Triton kernel, not ``baddbmm``."""
    return torch.baddbmm(a.new_empty(()), a, b, beta=0, alpha=alpha)


def _heads_major(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``x [T, kv_heads * groups, d]`` (any float dtype) as fp32 ``[kv_heads, groups * T, d]``, query head ``h``
    under key/value head ``h // groups`` (one cast-and-permute copy)."""
    rows, heads, dim = x.shape
    groups = heads // kv_heads
    out = torch.empty(kv_heads, groups, rows, dim, dtype=torch.float32, device=x.device)
    out.copy_(x.view(rows, kv_heads, groups, dim).permute(1, 2, 0, 3))
    return out.view(kv_heads, groups * rows, dim)


def _rows_major(x: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """:func:`_heads_major`'s inverse: ``[kv_heads, groups * rows, d]`` -> ``[rows, kv_heads * groups, d]`` in
    ``dtype`` (one cast-and-permute copy, rounding once)."""
    kv_heads, _, dim = x.shape
    groups = x.shape[1] // rows
    out = torch.empty(rows, kv_heads * groups, dim, dtype=dtype, device=x.device)
    out.view(rows, kv_heads, groups, dim).copy_(x.view(kv_heads, groups, rows, dim).permute(2, 0, 1, 3))
    return out


def dense_gradient_fits(q: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether :func:`paged_attention_gradient` takes its closed form for a call with these shapes (query heads x
    queries x cache slots within :data:`DENSE_GRADIENT_ELEMENTS`), else autograd of :func:`flash_paged_formula`.
    Shapes only: no host read of a device tensor."""
    return q.shape[1] * q.shape[0] * key_cache.shape[0] * key_cache.shape[1] <= DENSE_GRADIENT_ELEMENTS


def paged_attention_gradient(grad: torch.Tensor, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                             cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor, block_table: torch.Tensor,
                             max_seqlen_q: int, max_seqlen_k: int, scale: float, rows: tuple | None = None, *,
                             needs: Sequence[bool] | None = None) -> tuple:
    """:func:`flash_paged_formula`'s ``(d q, d key_cache, d value_cache, None, ...)`` (one entry per argument) in
    closed form, one of two ways chosen from ints and shapes alone:

    - **by entry** (:func:`padded_entry_gradient`) for a call whose entries hold several queries each (a prefill,
      ``max_seqlen_q > 1``) or that comes with ``rows``, the same call described by rows (arm J's decode call: one
      entry per generated token, described as each row's generated tokens against the row's keys): each entry's
      queries against its own keys only, so the work is the sum over entries of queries x keys;
    - **dense over the cache** otherwise (one query per entry, entries sharing blocks): with ``S = scale q K^T``
      masked to the slots each query reads (:func:`paged_unread_slots`, built once per call's metadata), ``P =
      softmax(S)`` and ``dP = grad V^T``: ``d V = P^T grad``, ``dS = P (dP - rowsum(dP P))``, ``d q = scale dS K``,
      ``d K = scale dS^T q``, each key/value head shared by its query heads (GQA) without copying the cache per head.

    :data:`ATTENTION_GRADIENT_ENV` ``=dense`` takes the dense form for every call. In fp32 from the inputs as given,
    each gradient rounded once to its input's dtype. A call past its form's cap
    (:data:`DENSE_GRADIENT_ELEMENTS` score elements) goes through :func:`formula_gradient`.
    ``q [Tq, nq, d]``, ``key_cache/value_cache [blocks, page, nkv, d]``."""
    tail = (None,) * (6 + (rows is not None))
    metadata = (cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k)
    route = paged_gradient_route(q, key_cache, metadata, rows)
    if route == "autograd":
        return formula_gradient(flash_paged_formula, grad, q, key_cache, value_cache, *metadata, scale,
                                *(() if rows is None else (rows,)), needs=needs)
    if route == "by_entry":
        entry_call = rows if rows is not None else metadata
        return (*padded_entry_gradient(grad, q, key_cache, value_cache, *entry_call, scale, needs=needs), *tail)
    queries, heads, dim = q.shape
    blocks, page, kv_heads, _ = key_cache.shape
    slots = blocks * page
    want_q, want_keys, want_values = (_wants(needs, i) for i in range(3))
    unread = _memo_unread_slots(cu_seqlens_q, seqused_k, block_table, max_seqlen_k, queries, slots, page)
    groups = heads // kv_heads
    query = _heads_major(q, kv_heads)  # [nkv, groups * Tq, d]
    # the caches [blocks, page, nkv, d] as [nkv, slots, d]: one "query head" per key/value head
    keys = _heads_major(key_cache.view(slots, kv_heads, dim), kv_heads)
    values = _heads_major(value_cache.view(slots, kv_heads, dim), kv_heads)
    upstream = _heads_major(grad, kv_heads)
    probs = _bmm(query, keys.transpose(1, 2), scale)  # [nkv, groups * Tq, slots]
    probs.view(kv_heads, groups, queries, slots).masked_fill_(unread, float("-inf"))
    probs.sub_(probs.amax(-1, keepdim=True)).exp_()
    probs.div_(probs.sum(-1, keepdim=True))
    dq = dkeys = dvalues = None
    if want_values:
        dvalues = _bmm(probs.transpose(1, 2), upstream)  # [nkv, slots, d]
    if want_q or want_keys:
        dscores = _bmm(upstream, values.transpose(1, 2))
        dscores.sub_((dscores * probs).sum(-1, keepdim=True)).mul_(probs)
        if want_q:
            dq = _rows_major(_bmm(dscores, keys, scale), queries, q.dtype)
        if want_keys:
            dkeys = _bmm(dscores.transpose(1, 2), query, scale)
    dkeys = None if dkeys is None else _rows_major(dkeys, slots, key_cache.dtype).view(key_cache.shape)
    dvalues = None if dvalues is None else _rows_major(dvalues, slots, value_cache.dtype).view(value_cache.shape)
    return dq, dkeys, dvalues, *tail


def paged_gradient_route(q: torch.Tensor, key_cache: torch.Tensor, metadata: tuple, rows: tuple | None = None) -> str:
    """How :func:`paged_attention_gradient` differentiates one call, from shapes and ints alone: ``"by_entry"``
    (a call with several queries per entry or with ``rows``, unless :data:`ATTENTION_GRADIENT_ENV` says dense),
    ``"dense"``, or ``"autograd"`` where the form's score tensor is past :data:`DENSE_GRADIENT_ELEMENTS`.
    ``metadata``: the call's ``(cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k)``."""
    if (rows is not None or metadata[3] > 1) and _by_entry_allowed():
        return "by_entry" if entry_gradient_fits(q, *(rows if rows is not None else metadata)) else "autograd"
    return "dense" if dense_gradient_fits(q, key_cache) else "autograd"


def entry_gradient_fits(q: torch.Tensor, cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor,  # noqa: ARG001
                        block_table: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int) -> bool:  # noqa: ARG001
    """Whether :func:`padded_entry_gradient`'s fp32 score tensor (entries x query heads x ``max_seqlen_q`` x
    ``max_seqlen_k``) is within :data:`DENSE_GRADIENT_ELEMENTS`. Shapes and ints only: no host read."""
    return (cu_seqlens_q.shape[0] - 1) * q.shape[1] * max_seqlen_q * max_seqlen_k <= DENSE_GRADIENT_ELEMENTS


def entry_layout(cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor, block_table: torch.Tensor, max_seqlen_q: int,
                 max_seqlen_k: int, queries: int, slots: int, page: int) -> tuple:
    """Where :func:`padded_entry_gradient` puts each query and reads each key: ``(entry [Tq], within [Tq], read [E,
    max_k], write [E, max_k], hidden [E, max_q, max_k])``: query ``t`` is entry ``entry[t]``'s query ``within[t]``;
    entry ``e``'s key ``j`` is cache slot ``read[e, j]`` (a real slot also past its keys: masked) and its gradient goes
    to slot ``write[e, j]`` (``slots``, a slot past the cache, where ``j`` is past the entry's keys); ``hidden``: the
    keys a query does not see (query ``r`` of ``n`` sees the keys ``< seqused_k - n + r + 1``; a padded query, ``r >=
    n``, sees key 0 at least: its gradient is zero). No host read."""
    device = cu_seqlens_q.device
    counts, entry, within = _query_entries(cu_seqlens_q, queries)
    j = torch.arange(max_seqlen_k, device=device)
    slot = _entry_slots(block_table, j, page)  # [E, max_k]
    real = j[None, :] < seqused_k.long()[:, None]
    read = torch.where(real, slot, torch.zeros_like(slot))
    write = torch.where(real, slot, torch.full_like(slot, slots))
    hidden = ~_visible_keys(counts, seqused_k, max_seqlen_q, max_seqlen_k)
    return entry, within, read, write, hidden


def _padded_heads(x: torch.Tensor, entry: torch.Tensor, within: torch.Tensor, entries: int, max_q: int,
                  kv_heads: int) -> torch.Tensor:
    """``x [Tq, nq, d]`` (any float dtype) as fp32 ``[E * nkv, groups * max_q, d]``: entry ``e``'s queries under
    key/value head ``h``, query head ``h * groups + g`` at rows ``g * max_q ...`` (zeros at padded queries)."""
    queries, heads, dim = x.shape
    groups = heads // kv_heads
    padded = torch.zeros(entries, kv_heads, groups, max_q, dim, dtype=torch.float32, device=x.device)
    padded[entry, :, :, within] = x.view(queries, kv_heads, groups, dim).float()
    return padded.view(entries * kv_heads, groups * max_q, dim)


def padded_entry_gradient(grad: torch.Tensor, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor, block_table: torch.Tensor,
                          max_seqlen_q: int, max_seqlen_k: int, scale: float, *,
                          needs: Sequence[bool] | None = None) -> tuple:
    """``(d q, d key_cache, d value_cache)`` of the paged call with these metadata, entry by entry: each entry's
    queries (padded to ``max_seqlen_q``) against its own keys (gathered through its block table, padded to
    ``max_seqlen_k``), the closed form of :func:`paged_attention_gradient` on ``[E * nkv, groups * max_q, max_k]``
    scores; the keys' and values' gradients summed into the cache's slots (``index_put_`` accumulating: entries may
    share slots). In fp32, each gradient rounded once to its input's dtype. Layout from :func:`entry_layout`, once per
    call's metadata. No host read."""
    queries, heads, dim = q.shape
    blocks, page, kv_heads, _ = key_cache.shape
    slots = blocks * page
    entries = cu_seqlens_q.numel() - 1
    groups = heads // kv_heads
    max_q, max_k = max_seqlen_q, max_seqlen_k
    want_q, want_keys, want_values = (_wants(needs, i) for i in range(3))
    entry, within, read, write, hidden = _memo(_ENTRY_MEMO, entry_layout, (cu_seqlens_q, seqused_k, block_table),
                                               max_q, max_k, queries, slots, page)
    query = _padded_heads(q, entry, within, entries, max_q, kv_heads)  # [E * nkv, groups * max_q, d]
    upstream = _padded_heads(grad, entry, within, entries, max_q, kv_heads)

    def gathered(cache: torch.Tensor) -> torch.Tensor:  # [E * nkv, max_k, d] fp32
        rows = cache.view(slots, kv_heads, dim)[read]  # [E, max_k, nkv, d]
        out = torch.empty(entries, kv_heads, max_k, dim, dtype=torch.float32, device=cache.device)
        out.copy_(rows.permute(0, 2, 1, 3))
        return out.view(entries * kv_heads, max_k, dim)

    keys, values = gathered(key_cache), gathered(value_cache)
    probs = _bmm(query, keys.transpose(1, 2), scale)  # [E * nkv, groups * max_q, max_k]
    probs.view(entries, kv_heads, groups, max_q, max_k).masked_fill_(hidden[:, None, None], float("-inf"))
    probs.sub_(probs.amax(-1, keepdim=True)).exp_()
    probs.div_(probs.sum(-1, keepdim=True))

    def to_cache(per_entry: torch.Tensor, like: torch.Tensor) -> torch.Tensor:  # [E * nkv, max_k, d] -> like's
        summed = torch.zeros(slots + 1, kv_heads, dim, dtype=torch.float32, device=like.device)
        summed.index_put_((write,), per_entry.view(entries, kv_heads, max_k, dim).transpose(1, 2), accumulate=True)
        return summed[:slots].to(like.dtype).view(like.shape)

    dq = dkeys = dvalues = None
    if want_values:
        dvalues = to_cache(_bmm(probs.transpose(1, 2), upstream), value_cache)
    if want_q or want_keys:
        dscores = _bmm(upstream, values.transpose(1, 2))
        dscores.sub_((dscores * probs).sum(-1, keepdim=True)).mul_(probs)
        if want_q:
            padded = _bmm(dscores, keys, scale).view(entries, kv_heads, groups, max_q, dim)
            dq = padded[entry, :, :, within].view(queries, heads, dim).to(q.dtype)
        if want_keys:
            dkeys = to_cache(_bmm(dscores.transpose(1, 2), query, scale), key_cache)
    return dq, dkeys, dvalues


PIECE_GRADIENTS: dict[Callable[..., torch.Tensor], Callable[..., tuple]] = {
    linear_formula: linear_gradient,
    rms_norm_formula: rms_norm_gradient,
    rotary_formula: rotary_gradient,
    silu_and_mul_formula: silu_and_mul_gradient,
    token_logprobs_formula: token_logprobs_gradient,
    flash_paged_formula: paged_attention_gradient,
}
"""Formula -> its gradients in closed form ``gradient(grad, *args, needs=None)`` (one entry per argument, ``None``
where there is none or ``needs``, a flag per argument, does not want it), computed in fp32 from the arguments as the
kernel was given them (bf16 or fp32) instead of differentiating the formula (no fp32 recompute of the piece's output,
no inner autograd graph); a formula without an entry (the contiguous attention's) is differentiated by autograd
(:func:`formula_gradient`)."""


# ------------------------------------------------------------------------------------------------ the Function
@contextlib.contextmanager
def _cublas_for_backward() -> Iterator[None]:
    """cuBLAS, not cuBLASLt, for a piece's backward where the process prefers cuBLASLt (vLLM's batch-invariant mode
    sets that preference process-wide, and PyTorch asks cuBLASLt for an algorithm on the host at every call); the
    preference is restored afterwards. The backward's values are not compared bit for bit with anything, so they need
    no batch-invariant library."""
    cuda = torch.backends.cuda
    before = cuda.preferred_blas_library()
    if before != torch._C._BlasBackend.Cublaslt:
        yield
        return
    cuda.preferred_blas_library("cublas")
    try:
        yield
    finally:
        cuda.preferred_blas_library(before)


class _KernelPiece(torch.autograd.Function):
    """``forward``: ``kernel(*args)``; ``backward``: the gradient of ``formula(*args)`` in fp32 at the saved
    floating-point inputs (the others pass through as they were given)."""

    @staticmethod
    def forward(ctx, name: str, kernel: Callable[..., torch.Tensor], formula: Callable[..., torch.Tensor],
                spec: tuple, *tensors: torch.Tensor) -> torch.Tensor:
        versions = [t._version for t in tensors]
        out = kernel(*_rebuild(spec, tensors))
        if [t._version for t in tensors] != versions:
            raise RuntimeError(f"the {name} kernel changed one of its inputs in place; wrap it so that it works on a "
                               "copy (core.vllm.kernels does for vLLM's in-place ops)")
        ctx.formula, ctx.spec = formula, spec
        ctx.save_for_backward(*tensors)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        tensors = ctx.saved_tensors
        needs = ctx.needs_input_grad[4:]
        grads: list[torch.Tensor | None] = [None] * len(tensors)
        if not any(needs):
            return (None, None, None, None, *grads)
        gradient = PIECE_GRADIENTS.get(ctx.formula)
        if gradient is None:  # no closed form: torch's autograd of the formula
            gradient = functools.partial(formula_gradient, ctx.formula)
        # the gradient reads the saved inputs as they are (it casts what it computes with); under create_graph it
        # is not itself differentiated
        inputs = [t.detach() for t in tensors] if torch.is_grad_enabled() else tensors
        spec = ctx.spec
        with _cublas_for_backward():
            by_argument = gradient(grad, *_rebuild(spec, inputs),
                                   needs=[type(a) is _Slot and needs[a.index] for a in spec])
        for slot, g in zip(spec, by_argument):
            if g is not None and type(slot) is _Slot and needs[slot.index]:
                dtype = tensors[slot.index].dtype
                grads[slot.index] = g if g.dtype == dtype else g.to(dtype)
        return (None, None, None, None, *grads)


@dataclasses.dataclass(frozen=True)
class _Slot:
    index: int


def _split(args: Sequence) -> tuple[tuple, tuple[torch.Tensor, ...]]:
    """``args`` as ``(spec, tensors)``: ``spec`` holds each argument, a tensor's place marked by its index."""
    spec, tensors = [], []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            spec.append(_Slot(len(tensors)))
            tensors.append(arg)
        else:
            spec.append(arg)
    return tuple(spec), tuple(tensors)


def _rebuild(spec: tuple, tensors: Sequence[torch.Tensor]) -> list:
    return [tensors[a.index] if type(a) is _Slot else a for a in spec]


def _wrap(name: str, kernel: Callable[..., torch.Tensor], formula: Callable[..., torch.Tensor],
          keywords: tuple[str, ...] = ()) -> Callable[..., torch.Tensor]:
    def piece(*args, **kwargs):
        if kwargs:
            # keyword arguments of the signature (``block_table=`` of flash) become positional, in order
            args = (*args, *(kwargs.pop(k) for k in keywords if k in kwargs))
            if kwargs:
                raise TypeError(f"{name}: unexpected keyword arguments {sorted(kwargs)}")
        if not torch.is_grad_enabled():
            return kernel(*args)
        spec, tensors = _split(args)
        if not any(t.requires_grad for t in tensors):
            return kernel(*args)
        return _KernelPiece.apply(name, kernel, formula, spec, *tensors)

    piece.__name__ = f"{name}_with_backward"
    if name in _NORMS:
        # every launch of norm_in_step_launches in one piece: the formula is row-wise, so one fp32 recompute over
        # all the rows is each launch's, and the backward costs one piece instead of one per launch
        piece.in_step_launches = _wrap(f"{name}_in_step_launches", functools.partial(norm_in_step_launches, kernel),
                                       rms_norm_over_launches)
    return piece


_NORMS = ("rms_norm", "add_rms_norm")


def rms_norm_over_launches(x: torch.Tensor, weight: torch.Tensor, eps: float, launches,  # noqa: ARG001
                           large: int = NORM_LARGE_LAUNCH) -> torch.Tensor:  # noqa: ARG001
    """:func:`rms_norm_formula` over every row, with ``norm_in_step_launches``' signature (the formula is row-wise:
    one fp32 recompute over all the rows is each launch's)."""
    return rms_norm_formula(x, weight, eps)


PIECE_GRADIENTS[rms_norm_over_launches] = rms_norm_gradient


def autograd_kernels(kernels: Kernels) -> Kernels:
    """``kernels`` with every function piece (:data:`PIECE_FORMULAS`) differentiable: the forward values are the
    kernel's, the backward is torch's fp32 formula of the piece. ``scope`` and ``source`` are kept; grad-free calls
    (or inputs that need no gradient) call the kernel directly. The norms also carry ``in_step_launches(x, weight,
    eps, launches)``: :func:`~bloggap_plugin.core.vllm.form.norm_in_step_launches` of the kernel as one piece."""
    keywords = {"flash": ("block_table",), "flash_paged": ("rows",)}
    wrapped = {}
    for name, formula in PIECE_FORMULAS.items():
        kernel = getattr(kernels, name)
        wrapped[name] = _wrap(name, _without_rows(kernel) if name == "flash_paged" else kernel, formula,
                              keywords.get(name, ()))
    wrapped["flash_paged"].takes_rows = True
    return dataclasses.replace(kernels, **wrapped)


def _without_rows(kernel: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The paged kernel called with its nine arguments, a trailing ``rows`` hint (for the gradient) dropped."""
    def paged(*args):
        return kernel(*args[:9])
    return paged
