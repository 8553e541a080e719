"""Arm I's maths: a decoder-only LM forward computed the way vLLM computes it, one switchable piece at a time.

vLLM (0.26, ``LlamaForCausalLM``) runs a bf16 model on *packed* tokens ``[T, H]`` (every real token of every
sequence, no padding), keeps the residual stream in bf16, fuses the q/k/v and gate/up projections into one
matmul each, applies RoPE from a bf16 ``cos_sin_cache`` in fp32 with one rounding, normalises with its own
RMSNorm kernels, attends through FlashAttention over a paged KV cache, and turns bf16 logits into fp32
log-probs. docs/arm_i.md gives the file references. This module is that forward in plain torch, with each piece
either in HF's form, in vLLM's form written in torch (CPU-testable), or (``"kernel"``) delegated to a
:class:`Kernels` object that the caller fills with vLLM's own CUDA/Triton functions
(:mod:`bloggap_plugin.core.vllm.kernels`). Torch only: nothing here imports vLLM.

Shapes: ``T`` packed tokens, ``H`` hidden size, ``nq``/``nkv`` query/key-value heads of ``d`` dims, ``B`` rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..scoring import position_ids_from_mask

__all__ = [
    "VllmForm",
    "SAMPLER_LOGPROBS",
    "parse_form",
    "FORM_PRESETS",
    "Kernels",
    "TORCH_KERNELS",
    "PackedBatch",
    "pack",
    "gather_tokens",
    "rms_norm_hf",
    "rms_norm_vllm_triton",
    "vllm_cos_sin_cache",
    "rope_hf",
    "rope_vllm",
    "paged_layout",
    "paged_kv",
    "torch_varlen_attention",
    "torch_paged_attention",
    "padded_flash_attention",
    "NORM_LARGE_LAUNCH",
    "torch_paged_varlen_attention",
    "stepwise_attention",
    "stepwise_calls",
    "step_launches",
    "norm_in_step_launches",
    "sampler_token_logprobs",
    "prompt_first",
]


SAMPLER_LOGPROBS = ("v2_sampler", "v2_sampler_fp32")
"""The ``logprobs`` pieces that call vLLM's model runner V2 log-prob kernel (on bf16 logits, on fp32 logits)."""


@dataclass(frozen=True)
class VllmForm:
    """Which pieces of arm I's forward follow vLLM. Each field is one piece the benchmark switches on in turn."""

    batch_invariant: bool = True
    """vLLM's ``VLLM_BATCH_INVARIANT=1`` kernels: every linear layer through vLLM's Triton persistent matmul
    (``linear_batch_invariant``), and for the forward's duration vLLM's aten overrides (``_log_softmax``,
    ``softmax``, ``mean.dim``, ``bmm``) and cuBLAS settings (no reduced-precision reductions, cuBLASLt). Needs vLLM."""
    attention: str = "vllm_fa"
    """``sdpa``: torch's scaled-dot-product attention per sequence; ``vllm_fa``: vLLM's FlashAttention build
    (``flash_attn_varlen_func``, FA3 on Hopper) over a paged KV cache, ``num_splits=1`` when batch-invariant."""
    norm: str = "kernel"
    """``hf``: HF's LlamaRMSNorm maths; ``torch``: vLLM's kernels' maths in torch (the first norm of layer 0 in
    batch-invariant mode rounds once, 1/sqrt; the others as HF); ``kernel``: vLLM's own kernels."""
    rope: str = "kernel"
    """``hf``: HF's cos/sin (fp32 from the policy's ``inv_freq``, rounded to bf16) applied in bf16 (three
    roundings); ``torch``: vLLM's bf16 ``cos_sin_cache`` built on the device, applied in fp32 with one rounding;
    ``kernel``: vLLM's ``rotary_embedding`` op on that cache."""
    fused_proj: bool = True
    """q/k/v and gate/up as one matmul each (vLLM's QKVParallelLinear / MergedColumnParallelLinear)."""
    act: str = "kernel"
    """``torch``: ``silu(gate) * up`` in bf16 (HF); ``kernel``: vLLM's ``silu_and_mul``."""
    page_size: int = 16
    """KV-cache block size of the ``vllm_fa`` attention (vLLM's default 16); 0: contiguous K/V (no block table)."""
    norm_launch: str = "steps"
    """How the ``kernel`` norms are launched. vLLM's CUDA RMSNorm kernels (``_C.fused_add_rms_norm``, ``_C.rms_norm``)
    pick their thread-block size by whether a launch holds fewer than :data:`NORM_LARGE_LAUNCH` tokens, and the
    block size sets the order of the variance's sum. ``packed``: one launch over all scored tokens (its size
    depends on the batch); ``steps``: each token in a launch sized like the vLLM step that computed it: prompt
    tokens as one prefill of at least that many tokens, generated tokens in launches of fewer (decode steps of
    fewer than 256 sequences)."""

    attention_launch: str = "steps"
    """How the ``vllm_fa`` attention is called. ``packed``: one causal call over every position of each row (the
    prompt and the generated tokens together); ``steps``: as vLLM's steps computed them: one prefill call over the
    prompt tokens, then one decode-form call in which every generated token is an entry of its own with one query
    against its row's paged K/V up to itself (FlashAttention's decode kernel, whose key tiles and reduction order
    can differ from a prefill call's over the same keys)."""

    logprobs: str = "v2_sampler"
    """How the head's bf16 logits become the scored token's fp32 log-prob, as the engine's sampler computes it.
    ``log_softmax``: vLLM's V1 model runner (logits cast to fp32, temperature in fp32, ``log_softmax``: vLLM's
    batch-invariant override when ``batch_invariant``); ``v2_sampler``: vLLM's model runner V2 (its default for
    dense decoders): the temperature applied to the bf16 logits in place (fp32 division rounded to bf16), then
    its own kernel over the bf16 logits (``compute_token_logprobs``: max, then the sum of ``exp(x - max)`` in
    fp32, ``x - max - log(sum)``), whose sum runs in another order than ``log_softmax``'s; ``v2_sampler_fp32``: the
    same kernel over the fp32 temperature-scaled logits, not rounded to bf16, as vLLM 0.31's V2 sampler computes
    it when a sampling parameter processes the logits (docs/vllm031_form.md; not yet measured on a GPU). Without a
    caller's kept-set reduce only (truncated scoring keeps its own reduce)."""

    def __post_init__(self) -> None:
        choices = {"attention": ("sdpa", "vllm_fa"), "norm": ("hf", "torch", "kernel"),
                   "rope": ("hf", "torch", "kernel"), "act": ("torch", "kernel"), "norm_launch": ("packed", "steps"),
                   "attention_launch": ("packed", "steps"),
                   "logprobs": ("log_softmax",) + SAMPLER_LOGPROBS}
        for name, accepted in choices.items():
            if getattr(self, name) not in accepted:
                raise ValueError(f"arm I piece {name}={getattr(self, name)!r}: use one of {', '.join(accepted)}")
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int) or self.page_size < 0:
            raise ValueError(f"arm I page_size must be an integer >= 0, got {self.page_size!r}")

    def needs_vllm(self) -> list[str]:
        """The pieces that call vLLM's kernels (``name=value``); empty: the form runs in plain torch anywhere."""
        out = ["batch_invariant=true"] if self.batch_invariant else []
        out += ["attention=vllm_fa"] if self.attention == "vllm_fa" else []
        out += [f"{name}=kernel" for name in ("norm", "rope", "act") if getattr(self, name) == "kernel"]
        out += [f"logprobs={self.logprobs}"] if self.logprobs in SAMPLER_LOGPROBS else []
        return out

    def describe(self) -> str:
        """``key=value`` list of every piece (what a result row records)."""
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)).lower()


FORM_PRESETS: dict[str, VllmForm] = {
    "all": VllmForm(),
    "torch": VllmForm(batch_invariant=False, attention="sdpa", norm="torch", rope="torch", fused_proj=True,
                      act="torch", logprobs="log_softmax"),
    "hf": VllmForm(batch_invariant=False, attention="sdpa", norm="hf", rope="hf", fused_proj=False, act="torch",
                   logprobs="log_softmax"),
}
"""``all``: every piece as vLLM (needs vLLM and CUDA); ``torch``: vLLM's maths where plain torch can express it;
``hf``: HF's maths in the packed bf16 forward (the starting point of the piece-by-piece measurement)."""


def parse_form(spec: str | VllmForm) -> VllmForm:
    """A :class:`VllmForm` from ``"preset[,piece=value...]"`` (presets :data:`FORM_PRESETS`), e.g.
    ``"hf,batch_invariant=true,attention=vllm_fa"``. ``ValueError`` names a bad preset, piece or value."""
    if isinstance(spec, VllmForm):
        return spec
    parts = [p.strip() for p in str(spec).split(",") if p.strip()]
    if not parts or parts[0] not in FORM_PRESETS:
        raise ValueError(f"arm I pieces {spec!r}: start with a preset, one of {', '.join(FORM_PRESETS)} "
                         "(then piece=value overrides, e.g. 'hf,attention=vllm_fa')")
    form = FORM_PRESETS[parts[0]]
    names = {f.name: f.type for f in dataclasses.fields(VllmForm)}
    for part in parts[1:]:
        key, _, value = part.partition("=")
        if key not in names or not value:
            raise ValueError(f"arm I pieces: {part!r} is not piece=value with a piece among {', '.join(names)}")
        if key in ("batch_invariant", "fused_proj"):
            if value.lower() not in ("true", "false"):
                raise ValueError(f"arm I piece {key} takes true or false, got {value!r}")
            form = dataclasses.replace(form, **{key: value.lower() == "true"})
        elif key == "page_size":
            if not value.isdigit():
                raise ValueError(f"arm I page_size takes an integer >= 0, got {value!r}")
            form = dataclasses.replace(form, page_size=int(value))
        else:
            form = dataclasses.replace(form, **{key: value})
    return form


# ----------------------------------------------------------------------------------------------------- pieces
def rms_norm_hf(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm (and vLLM's ``rms_norm``/``fused_add_rms_norm`` CUDA kernels' rounding points):
    ``bf16(bf16(x * rsqrt(mean(x^2) + eps)) * w)``, statistics in fp32. ``x [..., H]`` -> same dtype."""
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def rms_norm_vllm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """vLLM's batch-invariant Triton RMSNorm (``rms_norm_batch_invariant`` without residual): one rounding,
    ``bf16(x * (1 / sqrt(sum(x^2) / H + eps)) * w)`` in fp32. ``x [..., H]`` -> same dtype."""
    x32 = x.float()
    inv_rms = 1.0 / torch.sqrt((x32 * x32).sum(-1, keepdim=True) / x.shape[-1] + eps)
    return (x32 * inv_rms * weight.float()).to(x.dtype)


def vllm_cos_sin_cache(head_dim: int, base: float, max_positions: int, dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor:
    """vLLM's ``RotaryEmbedding`` cache ``[max_positions, head_dim]`` (cos | sin) built on ``device`` in fp32 and
    stored in ``dtype`` (``_compute_inv_freq`` / ``_compute_cos_sin_cache``; the outer product is exact)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))
    t = torch.arange(max_positions, dtype=torch.float, device=device)
    freqs = t[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_hf(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """HF's RoPE: ``cos/sin = (positions * inv_freq)`` in fp32 rounded to ``x.dtype``, then
    ``x * cos + rotate_half(x) * sin`` in ``x.dtype``. ``x [T, heads, d]``, ``positions [T]``."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :].to(x.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().to(x.dtype)[:, None, :]
    sin = emb.sin().to(x.dtype)[:, None, :]
    return (x * cos) + (_rotate_half(x) * sin)


def rope_vllm(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """vLLM's ``rotary_embedding`` kernel maths (neox style): cos/sin read from ``cache`` and the rotation computed
    in fp32, rounded once to ``x.dtype``. ``x [T, heads, d]``, ``positions [T]``."""
    cos, sin = cache.index_select(0, positions).float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


# ----------------------------------------------------------------------------------------------------- layout
NORM_LARGE_LAUNCH = 256
"""vLLM's CUDA RMSNorm launchers: ``max_block_size = (num_tokens < 256) ? 1024 : 256`` (csrc/layernorm_kernels.cu)."""


@dataclass
class PackedBatch:
    """Real tokens of ``B`` rows packed as vLLM lays them out: row ``i`` is ``tokens[cu[i]:cu[i+1]]``."""

    tokens: torch.Tensor | None
    """``[T]`` token ids (``None`` in a layout not yet given its tokens: :func:`gather_tokens`)."""
    positions: torch.Tensor
    """``[T]`` int64 positions (0.. per row, or the caller's position ids at the real tokens)."""
    cu_seqlens: torch.Tensor
    """``[B + 1]`` int32 offsets."""
    lengths: list[int]
    """Tokens per row."""
    where: torch.Tensor
    """``[B, L]`` bool: where each packed token sits in the padded layout."""
    paged: dict = field(default_factory=dict)
    """Page size -> :func:`paged_layout` of these rows, and ``("steps", page size)`` -> the step-sized attention calls
    (filled by the first layer that needs them)."""
    launches: tuple | None = None
    """``(prompt index [P], [generated index chunks])`` of :func:`norm_in_step_launches` (filled on first use)."""
    generated: torch.Tensor | None = None
    """``[T]`` bool: the tokens the sampler fed back one decode step at a time (``None``: unknown, all prefill)."""
    order: torch.Tensor | None = None
    """``[T]`` int64 (:func:`prompt_first`): ``tokens``, ``positions`` and ``flat`` hold the packed tokens in this order
    (every prompt token, then every generated one, each in row order); ``None``: packed order. ``generated`` and the
    row fields stay in packed order."""
    flat: torch.Tensor | None = None
    """``[T]`` int64: where each of ``tokens`` sits in the flattened ``[B * L]`` padded layout (in ``tokens``' order):
    tokens are gathered from it and hidden states put back by it, with no boolean-mask index (a host read)."""

    def to(self, device: torch.device) -> PackedBatch:
        """This layout with every tensor (also inside ``paged`` and ``launches``) on ``device``: from the CPU to CUDA
        through pinned memory without waiting (the copies queue on the current stream: no host read of the device)."""
        device = torch.device(device)
        return dataclasses.replace(self, **{f.name: _moved(getattr(self, f.name), device)
                                            for f in dataclasses.fields(self)})


def _moved(value, device: torch.device):
    """``value`` (a tensor, or tuples/lists/dicts of them among other values) with its tensors on ``device``."""
    if isinstance(value, torch.Tensor):
        if value.device == device:
            return value
        if value.device.type == "cpu" and device.type == "cuda":
            return value.pin_memory().to(device, non_blocking=True)
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_moved(v, device) for v in value)
    if isinstance(value, list):
        return [_moved(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _moved(v, device) for k, v in value.items()}
    return value


def prompt_first(packed: PackedBatch, large: int = NORM_LARGE_LAUNCH) -> PackedBatch:
    """``packed`` (with ``generated`` set) in the order vLLM's steps saw its tokens: every row's prompt tokens, then
    every row's generated tokens. Each step-sized launch is then one contiguous slice (``launches``: the prompt's
    slice and the generated tokens' slices of fewer than ``large``), so no launch gathers or scatters its tokens.
    Row-wise pieces compute the same values in any order; :func:`stepwise_attention` reads the order."""
    prompt = (~packed.generated).nonzero().squeeze(-1)
    order = torch.cat([prompt, packed.generated.nonzero().squeeze(-1)])
    total, start = order.numel(), prompt.numel()
    chunks = [slice(a, min(a + large - 1, total)) for a in range(start, total, large - 1)]
    return dataclasses.replace(packed, tokens=None if packed.tokens is None else packed.tokens[order],
                               positions=packed.positions[order], flat=packed.flat[order], order=order,
                               launches=(slice(0, start), chunks))


def pack(input_ids: torch.Tensor | None, attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None
         ) -> PackedBatch:
    """Pack the real tokens (mask 1) of ``[B, L]`` rows; each row's real tokens must be one contiguous run (TRL's
    layout: left-padded prompt, completion, right padding). ``ValueError`` otherwise or for an empty row.

    The layout (positions, offsets, lengths, ``flat``) is computed where ``attention_mask`` lives: with the mask on
    the CPU it reads nothing back from the device, and :meth:`PackedBatch.to` moves it to the device.
    ``input_ids`` ``None``: the layout alone (``tokens`` ``None``; :func:`gather_tokens` fills them)."""
    where = attention_mask.bool()
    lengths_t = where.sum(-1)
    if bool((lengths_t == 0).any()):
        raise ValueError("arm I: a row has no real token (attention_mask all 0); drop it before scoring")
    first = where.int().argmax(-1)
    span = torch.arange(where.shape[1], device=where.device)[None, :]
    contiguous = (span >= first[:, None]) & (span < (first + lengths_t)[:, None])
    if not torch.equal(contiguous, where):
        raise ValueError("arm I scores rows whose real tokens form one contiguous run (as vLLM's sequences); "
                         "a row's attention_mask has a gap")
    if position_ids is None:
        positions = position_ids_from_mask(attention_mask)  # 0..n-1 per row
    else:
        positions = position_ids.to(where.device)
    cu = torch.zeros(where.shape[0] + 1, dtype=torch.int32, device=where.device)
    cu[1:] = lengths_t.cumsum(0)
    flat = where.flatten().nonzero().squeeze(-1)
    packed = PackedBatch(None, positions.flatten()[flat].long(), cu, lengths_t.tolist(), where, flat=flat)
    return packed if input_ids is None else gather_tokens(packed, input_ids)


def gather_tokens(packed: PackedBatch, input_ids: torch.Tensor) -> PackedBatch:
    """``packed`` with ``tokens`` read from ``input_ids [B, L]`` at ``packed.flat`` (on the ids' device: the layout
    moved there first, so the index is a device tensor and nothing is read back)."""
    if packed.flat.device != input_ids.device:
        packed = packed.to(input_ids.device)
    packed.tokens = input_ids.reshape(-1)[packed.flat]
    return packed


def step_launches(generated: torch.Tensor, large: int = NORM_LARGE_LAUNCH) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Token indices for :func:`norm_in_step_launches` from ``generated [T]`` bool (packed order): the prompt tokens'
    index ``[P]`` (one prefill launch) and the generated tokens' in chunks of ``large - 1`` (decode launches)."""
    prompt = (~generated).nonzero().squeeze(-1)
    produced = generated.nonzero().squeeze(-1)
    return prompt, list(produced.split(large - 1)) if produced.numel() else []


def norm_in_step_launches(norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor], x: torch.Tensor,
                          weight: torch.Tensor, eps: float, launches: tuple[torch.Tensor, list[torch.Tensor]],
                          large: int = NORM_LARGE_LAUNCH) -> torch.Tensor:
    """``norm(x [T, H], weight, eps)`` with every token normalised in a launch sized like the vLLM step that
    computed it (``launches`` from :func:`step_launches`): the prompt tokens in one launch of at least ``large`` rows
    (zero rows appended when fewer: a row-wise kernel normalises each row alone, and zeros stay zeros), the
    generated ones in launches of fewer than ``large``. The same tokens give the same values in any batch."""
    prompt, chunks = launches
    if isinstance(prompt, slice):  # prompt_first's contiguous launches, in order: no gather, no scatter
        parts = []
        if prompt.stop > prompt.start:
            rows = x[prompt]
            count = rows.shape[0]
            if count < large:
                rows = torch.cat([rows, rows.new_zeros(large - count, rows.shape[1])])
            parts.append(norm(rows, weight, eps)[:count])
        parts += [norm(x[chunk], weight, eps) for chunk in chunks]
        return torch.cat(parts) if len(parts) > 1 else parts[0]
    out = torch.empty_like(x)
    if prompt.numel():
        rows = x[prompt]
        if rows.shape[0] < large:
            rows = torch.cat([rows, rows.new_zeros(large - rows.shape[0], rows.shape[1])])
        out[prompt] = norm(rows, weight, eps)[: prompt.numel()]
    for chunk in chunks:
        out[chunk] = norm(x[chunk], weight, eps)
    return out


def paged_layout(lengths: list[int], page: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where vLLM's paged KV cache puts packed tokens: ``(slot [T] int64, block_table [B, max_blocks] int32,
    blocks)``; row ``i``'s token ``j`` sits in block ``block_table[i, j // page]`` at slot ``j % page`` of it
    (blocks handed out in row order). The same for every layer of a forward: compute it once."""
    blocks_per_row = [(n + page - 1) // page for n in lengths]
    table = torch.zeros(len(lengths), max(blocks_per_row), dtype=torch.int32, device=device)
    slots = []
    start = 0
    for row, (n, blocks) in enumerate(zip(lengths, blocks_per_row)):
        ids = torch.arange(start, start + blocks, dtype=torch.int32, device=device)
        table[row, :blocks] = ids
        j = torch.arange(n, device=device)
        slots.append(ids[j // page].long() * page + j % page)
        start += blocks
    return torch.cat(slots), table, start


def paged_kv(key: torch.Tensor, value: torch.Tensor, lengths: list[int], page: int, layout=None):
    """vLLM's paged KV cache for packed ``key/value [T, nkv, d]``: ``(key_cache, value_cache [blocks, page, nkv,
    d], block_table [B, max_blocks] int32)`` laid out by :func:`paged_layout` (``layout``: its result, reused);
    unused slots are zero."""
    slot, table, blocks = layout if layout is not None else paged_layout(lengths, page, key.device)
    shape = (blocks * page, *key.shape[1:])
    key_cache = key.new_zeros(shape).index_copy_(0, slot, key).view(blocks, page, *key.shape[1:])
    value_cache = value.new_zeros(shape).index_copy_(0, slot, value).view(blocks, page, *value.shape[1:])
    return key_cache, value_cache, table


def torch_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Causal attention per packed row with torch's ``scaled_dot_product_attention`` (GQA heads shared).
    ``q [T, nq, d]``, ``k/v [T, nkv, d]`` -> ``[T, nq, d]``."""
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qi = q[start:end].transpose(0, 1)[None]
        ki = k[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)[None]
        vi = v[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)[None]
        out[start:end] = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)[0].transpose(0, 1)
    return out


def torch_paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          block_table: torch.Tensor, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference for the paged path: each row's K/V read back through ``block_table``, then
    :func:`torch_varlen_attention`. Same arguments as vLLM's kernel sees them."""
    page = key_cache.shape[1]
    bounds = cu_seqlens.tolist()
    keys, values = [], []
    for row, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        j = torch.arange(end - start, device=q.device)
        slot = block_table[row, j // page].long() * page + j % page
        keys.append(key_cache.flatten(0, 1)[slot])
        values.append(value_cache.flatten(0, 1)[slot])
    return torch_varlen_attention(q, torch.cat(keys), torch.cat(values), cu_seqlens, scale)


def torch_paged_varlen_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                 cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor, block_table: torch.Tensor,
                                 scale: float) -> torch.Tensor:
    """Reference for FlashAttention's paged varlen call: entry ``i`` has queries ``q[cu_seqlens_q[i]:cu_seqlens_q[i +
    1]]`` (the last ``n`` positions of a sequence) and keys ``0 .. seqused_k[i] - 1`` read through ``block_table[i]``;
    causal, aligned at the end (query ``r`` sees keys ``< seqused_k - n + r + 1``). ``q [Tq, nq, d]`` -> ``[Tq, nq, d]``."""
    page = key_cache.shape[1]
    groups = q.shape[1] // key_cache.shape[2]
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for entry, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        n_k, n_q = int(seqused_k[entry]), end - start
        j = torch.arange(n_k, device=q.device)
        slot = block_table[entry, j // page].long() * page + j % page
        keys = key_cache.flatten(0, 1)[slot].transpose(0, 1).repeat_interleave(groups, dim=0)[None]
        values = value_cache.flatten(0, 1)[slot].transpose(0, 1).repeat_interleave(groups, dim=0)[None]
        visible = torch.arange(n_k, device=q.device)[None, :] < (n_k - n_q + 1 + torch.arange(n_q, device=q.device))[:, None]
        qi = q[start:end].transpose(0, 1)[None]
        out[start:end] = F.scaled_dot_product_attention(qi, keys, values, attn_mask=visible, scale=scale)[0].transpose(0, 1)
    return out


def stepwise_calls(packed: PackedBatch, page: int) -> tuple:
    """The two paged calls of :func:`stepwise_attention` for ``packed``: ``(prefill, decode)``, each ``None`` or
    ``(token index, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k)``, and the cache slots of the
    tokens in their order. The same for every layer of a forward: computed once where the layout lives (its host reads
    made there: none of the device when it lives on the CPU), kept in ``packed.paged``."""
    key = ("steps", page)
    if key in packed.paged:
        return packed.paged[key]
    device = packed.cu_seqlens.device
    layout = packed.paged.get(page)
    if layout is None:
        layout = packed.paged[page] = paged_layout(packed.lengths, page, device)
    table = layout[1]
    total = int(packed.cu_seqlens[-1])
    generated = packed.generated if packed.generated is not None else torch.zeros(total, dtype=torch.bool, device=device)
    row = torch.repeat_interleave(torch.arange(len(packed.lengths), device=device),
                                  torch.tensor(packed.lengths, device=device))
    index_in_row = torch.arange(total, device=device) - packed.cu_seqlens.long()[row]
    prefill = decode = None
    prompt = (~generated).nonzero().squeeze(-1)
    if prompt.numel():
        prompt_lengths = torch.bincount(row[prompt], minlength=len(packed.lengths))
        used = prompt_lengths > 0
        cu = torch.zeros(int(used.sum()) + 1, dtype=torch.int32, device=device)
        cu[1:] = prompt_lengths[used].cumsum(0)
        longest = int(prompt_lengths.max())
        prefill = (prompt, cu, prompt_lengths[used].to(torch.int32), table[used], longest, longest)
    decoded = generated.nonzero().squeeze(-1)
    rows = None
    if decoded.numel():
        seen = (index_in_row[decoded] + 1).to(torch.int32)
        cu = torch.arange(decoded.numel() + 1, dtype=torch.int32, device=device)
        decode = (decoded, cu, seen, table[row[decoded]], 1, int(seen.max()))
        rows = decode_by_rows(row[decoded], index_in_row[decoded], packed.lengths, table)
    if packed.order is not None:  # prompt_first: the calls' queries are the two contiguous halves, in this order
        split = prompt.numel()
        prefill = None if prefill is None else (slice(0, split), *prefill[1:])
        decode = None if decode is None else (slice(split, total), *decode[1:])
    if packed.order is not None:  # the cache slot of each token in prompt_first's order
        packed.paged[("order", page)] = (layout[0][packed.order], *layout[1:])
    packed.paged[key] = (prefill, decode)
    packed.paged[("rows", page)] = rows
    return prefill, decode


def decode_by_rows(row: torch.Tensor, index_in_row: torch.Tensor, lengths: list[int],
                   block_table: torch.Tensor) -> tuple | None:
    """The decode call of :func:`stepwise_calls` (entry ``t``: generated token ``t``, its row's keys up to itself)
    described by rows, as a prefill-shaped call over the same queries and caches: ``(cu_seqlens_q, seqused_k,
    block_table, max_seqlen_q, max_seqlen_k)`` with one entry per row that generated, its generated tokens the
    entry's queries and its length the entry's keys. The same attention, since each row's generated tokens are the
    last of its tokens; ``None`` where they are not. ``row``, ``index_in_row [Tg]``: each generated token's row and
    position, in the call's (row-major) order. The host reads are the layout's own (none of the device where it
    lives on the CPU)."""
    device = block_table.device
    length = torch.tensor(lengths, device=device)
    per_row = torch.bincount(row, minlength=len(lengths))
    if not bool((index_in_row >= (length - per_row)[row]).all()):
        return None
    used = per_row > 0
    cu = torch.zeros(int(used.sum()) + 1, dtype=torch.int32, device=device)
    cu[1:] = per_row[used].cumsum(0)
    keys = length[used]
    return cu, keys.to(torch.int32), block_table[used], int(per_row.max()), int(keys.max())


def stepwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedBatch, page: int,
                       paged: Callable[..., torch.Tensor], scale: float) -> torch.Tensor:
    """Attention as vLLM's steps computed it (``attention_launch: steps``): one prefill call over each row's prompt
    tokens, then one call in which every generated token is an entry with one query against its row's K/V up to and
    including itself. ``paged(q, key_cache, value_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q,
    max_seqlen_k, scale)`` is the paged varlen kernel; a differentiable one that ``takes_rows`` also gets the decode
    call described by rows (:func:`decode_by_rows`), for its gradient. ``q [T, nq, d]``, ``k/v [T, nkv, d]`` -> ``[T,
    nq, d]``."""
    prefill, decode = stepwise_calls(packed, page)
    rows = packed.paged.get(("rows", page)) if getattr(paged, "takes_rows", False) else None
    calls = [(call, {"rows": rows} if call is decode and rows is not None else {})
             for call in (prefill, decode) if call is not None]
    layout = packed.paged[page]
    if packed.order is not None:  # the cache slots in prompt_first's order
        layout = packed.paged[("order", page)]
        key_cache, value_cache, _ = paged_kv(k, v, packed.lengths, page, layout)
        parts = [paged(q[call[0]], key_cache, value_cache, *call[1:], scale, **hint) for call, hint in calls]
        return torch.cat(parts) if len(parts) > 1 else parts[0]
    key_cache, value_cache, _ = paged_kv(k, v, packed.lengths, page, layout)
    out = torch.empty_like(q)
    for (index, *metadata), hint in calls:
        out[index] = paged(q[index], key_cache, value_cache, *metadata, scale, **hint)
    return out


# ----------------------------------------------------------------------------------------------------- kernels
def _torch_paged(q, key_cache, value_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k,  # noqa: ARG001
                 scale):
    return torch_paged_varlen_attention(q, key_cache, value_cache, cu_seqlens_q, seqused_k, block_table, scale)


def sampler_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """vLLM's model runner V2 log-prob of ``tokens [N]`` under ``logits [N, V]`` (bf16) in plain torch:
    ``x - max - log(sum(exp(x - max)))`` in fp32, the order of its kernel's operations (the sum's own order is the
    kernel's to choose). ``[N]`` fp32."""
    x = logits.float()
    top = x.max(dim=-1, keepdim=True).values
    lse = torch.log(torch.exp(x - top).sum(dim=-1, keepdim=True))
    return (x.gather(-1, tokens.long().unsqueeze(-1)) - top - lse).squeeze(-1)


def _torch_flash(q, k, v, cu_seqlens, max_seqlen, scale, block_table=None):  # noqa: ARG001 - kernel signature
    if block_table is None:
        return torch_varlen_attention(q, k, v, cu_seqlens, scale)
    return torch_paged_attention(q, k, v, block_table, cu_seqlens, scale)


@dataclass(frozen=True)
class Kernels:
    """The functions a ``kernel`` piece calls (vLLM's, from :mod:`bloggap_plugin.core.vllm.kernels`); the defaults
    are plain-torch stand-ins with the same signatures (used by CPU tests to check the wiring)."""

    linear: Callable[..., torch.Tensor] = F.linear
    """``(x [..., in], weight [out, in], bias | None) -> [..., out]``."""
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms_norm_hf
    """First norm of layer 0 (vLLM calls it without a residual)."""
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms_norm_hf
    """Every other norm, on the already summed bf16 residual stream (vLLM's fused add kernel)."""
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = rope_vllm
    """``(x [T, heads, d], positions [T], cache) -> x rotated``."""
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor] = lambda x: F.silu(x[..., : x.shape[-1] // 2]) * x[..., x.shape[-1] // 2:]
    """``[T, 2I] -> [T, I]``."""
    flash: Callable[..., torch.Tensor] = _torch_flash
    """``(q, k, v, cu_seqlens, max_seqlen, scale, block_table=None) -> [T, nq, d]``; with a block table ``k``/``v``
    are the paged caches."""
    flash_paged: Callable[..., torch.Tensor] = _torch_paged
    """``(q, key_cache, value_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k, scale) ->
    [Tq, nq, d]``: the paged varlen call with query and key lengths apart (``attention_launch: steps``)."""
    token_logprobs: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = sampler_token_logprobs
    """``(logits [N, V] bf16, tokens [N]) -> [N]`` fp32: the ``v2_sampler`` log-prob (vLLM's
    ``compute_token_logprobs``)."""
    scope: Callable[[], object] = field(default=lambda: __import__("contextlib").nullcontext())
    """A context manager around the whole forward (vLLM's batch-invariant aten overrides, scoped)."""
    source: str = "torch"
    """Where the functions come from (recorded in results)."""


TORCH_KERNELS = Kernels()


def padded_flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, scale: float, kernels: Kernels,
                           page_size: int = 16) -> torch.Tensor:
    """``kernels.flash`` on HF's padded layout (an attention function for transformers' ``AttentionInterface``):
    ``query [B, nq, L, d]``, ``key/value [B, nkv, L, d]``, ``attention_mask [B, L]`` (1/True = real token, or
    ``None``: no padding) -> ``[B, L, nq, d]`` (zeros at padding), packed and paged as vLLM lays tokens out."""
    batch, _, width, _ = query.shape
    mask = torch.ones(batch, width, dtype=torch.bool, device=query.device) if attention_mask is None else attention_mask
    packed = pack(torch.zeros(mask.shape, dtype=torch.long, device=query.device), mask.bool())
    where = packed.where
    q, k, v = (t.transpose(1, 2)[where] for t in (query, key, value))
    max_len = max(packed.lengths)
    if page_size:
        key_cache, value_cache, table = paged_kv(k, v, packed.lengths, page_size)
        out = kernels.flash(q, key_cache, value_cache, packed.cu_seqlens, max_len, scale, block_table=table)
    else:
        out = kernels.flash(q, k, v, packed.cu_seqlens, max_len, scale)
    padded = out.new_zeros((batch, width, *out.shape[1:]))
    padded[where] = out
    return padded
