"""Arm I's scoring plan: a bf16 shadow of the policy run through :mod:`bloggap_plugin.core.vllm.form`'s forward.

:class:`VllmFormPlan` holds a clean bf16 copy of the policy (vLLM holds bf16 weights; TRL's forward is bf16
autocast over fp32 master weights) and scores with :class:`VllmFormLM`, a module with ``get_output_embeddings``
that the one scoring function (:func:`bloggap_plugin.core.scoring.token_logprobs`) calls like a causal LM, so its
LM-head tiling and fp32 log-softmax apply unchanged. Build it with ``make_plan(policy, "vllm", pieces=...)``.
Supported: Llama-family decoders (``model_type`` llama or qwen2; SiLU MLP without bias, default RoPE).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Unpack

import torch
import torch.nn.functional as F
from torch import nn

from ..model_parts import model_device, tensor_bytes
from ..scoring import (
    DEFAULT_CHUNK_TOKENS,
    LogprobReducer,
    ScoringOptions,
    TileIndex,
    autocast_off,
    gather_logprobs,
    join_tiles,
    token_logprobs,
    unwrap_model,
)
from ..vllm.autograd import autograd_kernels
from ..vllm.form import (
    SAMPLER_LOGPROBS,
    Kernels,
    PackedBatch,
    VllmForm,
    gather_tokens,
    norm_in_step_launches,
    pack,
    paged_kv,
    paged_layout,
    prompt_first,
    rms_norm_hf,
    rms_norm_vllm_triton,
    rope_hf,
    rope_vllm,
    step_launches,
    stepwise_attention,
    stepwise_calls,
    torch_varlen_attention,
    vllm_cos_sin_cache,
)
from .base import ScoringPlan
from .shadow import ShadowPlan

__all__ = ["VllmFormLM", "VllmFormPlan", "VllmFormParamsPlan", "OnPolicyForward", "sampler_reduce", "form_reduce",
           "SUPPORTED_MODEL_TYPES", "FAMILY_PIECES_MISSING", "check_vllm_form_supported"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


@dataclass
class _Output:
    logits: torch.Tensor


class _Head(nn.Module):
    """The LM head through the form's linear (vLLM's Triton persistent matmul under ``batch_invariant``), on the
    bf16 weight: ``cast`` (set by :meth:`VllmFormLM.forward` for one forward) or ``weight`` itself."""

    def __init__(self, weight: torch.Tensor, linear: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.weight = weight
        self._linear = linear
        self.cast: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._linear(hidden, self.weight if self.cast is None else self.cast, None)


FAMILY_PIECES_MISSING = {
    "gemma3_text": ("the GELU-tanh gated MLP (vLLM's GeluAndMul)", "Gemma's RMSNorm scaling by 1 + weight",
                    "the q/k norms", "the norms after attention and after the MLP",
                    "the embedding scaled by sqrt(hidden_size)", "sliding-window layers with their own RoPE base",
                    "the attention scale from query_pre_attn_scalar"),
    "gemma2": ("the GELU-tanh gated MLP (vLLM's GeluAndMul)", "Gemma's RMSNorm scaling by 1 + weight",
               "the norms after attention and after the MLP", "the embedding scaled by sqrt(hidden_size)",
               "sliding-window layers", "attention and final logit soft-capping"),
}
"""Per model family arms I and J do not compute: the pieces of vLLM's form of that decoder that the plugin has
not built (its error names them)."""
FAMILY_PIECES_MISSING["gemma3"] = FAMILY_PIECES_MISSING["gemma3_text"]


def check_vllm_form_supported(model: nn.Module) -> None:
    """Raise ``ValueError`` naming what ``model`` (an HF causal LM) has that arms I and J do not compute in vLLM's
    form: another family (its missing pieces listed where :data:`FAMILY_PIECES_MISSING` knows them), a RoPE other
    than the default, an MLP other than SiLU-gated without bias, sliding-window attention. Reads the config only."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    problems = []
    if model_type in FAMILY_PIECES_MISSING:
        problems.append(f"model_type {model_type!r}, whose decoder needs pieces arms I and J do not have: "
                        f"{', '.join(FAMILY_PIECES_MISSING[model_type])}")
    elif model_type not in SUPPORTED_MODEL_TYPES:
        problems.append(f"model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    else:
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            problems.append(f"RoPE type {rope.get('rope_type')!r} (only the default RoPE)")
        if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
            problems.append("an MLP other than SiLU-gated without bias")
        if getattr(config, "use_sliding_window", False):
            problems.append("sliding-window attention")
    if problems:
        raise ValueError(f"arms I and J compute Llama-family decoders the way vLLM does; {type(model).__name__} has "
                         f"{'; '.join(problems)}: use another arm (A-H) for this model")


class VllmFormLM(nn.Module):
    """A causal-LM-shaped forward (``input_ids, attention_mask, position_ids, logits_to_keep`` -> ``.logits``) over
    the weights of ``source`` (an HF Llama-family model), computed per ``form`` with ``kernels``.

    ``over_parameters=False`` (arm I's scorer): ``source`` is a bf16 shadow; the fused q/k/v and gate/up weights are
    built once and refreshed in place (:meth:`refresh`). ``over_parameters=True`` (the on-policy training forward):
    every weight is read from ``source``'s parameters at each forward through a differentiable cast to bf16 (the
    fused weights concatenated inside the graph), so gradients reach them; the cast gives each weight the bits a
    bf16 shadow of ``source`` holds, so both modes compute the same values.

    Tokens run packed (no padding rows in any matmul); the hidden states of the last ``logits_to_keep`` positions
    go back to the padded ``[B, keep, H]`` layout (zeros at padding) and through ``lm_head``, the module that
    ``token_logprobs`` tiles. Positions: ``position_ids`` at the real tokens, else ``0..n-1`` per row (vLLM's)."""

    def __init__(self, source: nn.Module, form: VllmForm, kernels: Kernels, *, over_parameters: bool = False) -> None:
        super().__init__()
        check_vllm_form_supported(source)
        self._shadow = [source]  # not a submodule: its owner (the plan, or the trainer) holds and syncs it
        self.over_parameters = over_parameters
        self.form = form
        self.kernels = kernels
        config = source.config
        self.config = config
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.scale = self.head_dim ** -0.5
        linear = kernels.linear if form.batch_invariant else F.linear
        self._linear = linear
        self.lm_head = _Head(source.get_output_embeddings().weight, linear)
        self._head = [self.lm_head]  # the head itself, also while token_logprobs tiles it
        self._fused: list[dict[str, torch.Tensor]] = []
        self.refresh()
        device = model_device(source)
        theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        self.cos_sin_cache = vllm_cos_sin_cache(self.head_dim, theta, int(config.max_position_embeddings),
                                                torch.bfloat16, device)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    @staticmethod
    def _bf16(weight: torch.Tensor | None) -> torch.Tensor | None:
        """``weight`` as vLLM holds it: cast to bf16 inside the graph (the tensor itself when already bf16)."""
        return None if weight is None else weight.to(torch.bfloat16)

    @staticmethod
    def _fused_parts(layer: nn.Module) -> dict[str, list[torch.Tensor] | None]:
        attn, mlp = layer.self_attn, layer.mlp
        biases = [getattr(m, "bias", None) for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
        return {"qkv": [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight],
                "qkv_bias": biases if all(b is not None for b in biases) else None,
                "gate_up": [mlp.gate_proj.weight, mlp.up_proj.weight]}

    def _fused_weight(self, index: int, key: str) -> torch.Tensor | None:
        """Layer ``index``'s fused ``qkv`` / ``qkv_bias`` / ``gate_up`` weight in bf16: the refreshed copy, or (over
        the parameters) the concatenation of their bf16 casts, inside the graph."""
        if not self.over_parameters:
            return self._fused[index][key]
        parts = self._fused_parts(self._shadow[0].model.layers[index])[key]
        return None if parts is None else torch.cat([self._bf16(p) for p in parts])

    def refresh(self) -> None:
        """Refresh the fused q/k/v and gate/up weights from the shadow (after the plan's sync), in place once built.
        Over the parameters nothing is kept: each forward reads them."""
        if not self.form.fused_proj or self.over_parameters:
            return
        for index, layer in enumerate(self._shadow[0].model.layers):
            parts = self._fused_parts(layer)
            if index == len(self._fused):
                self._fused.append({k: None if v is None else torch.cat(v) for k, v in parts.items()})
                continue
            for key, tensors in parts.items():
                if tensors is not None:
                    torch.cat(tensors, out=self._fused[index][key])

    def fused_tensors(self) -> list[torch.Tensor]:
        return [t for entry in self._fused for t in entry.values() if t is not None]

    # -- pieces
    def _norm(self, x: torch.Tensor, module: nn.Module, first: bool, packed) -> torch.Tensor:
        eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))
        weight = self._bf16(module.weight)
        if self.form.norm == "kernel":
            kernel = self.kernels.rms_norm if first else self.kernels.add_rms_norm
            # layer 0's first norm in batch-invariant mode is vLLM's Triton kernel: no launch-size dependence
            if self.form.norm_launch == "steps" and packed.launches is not None and not (first and self.form.batch_invariant):
                launched = getattr(kernel, "in_step_launches", None)  # a differentiable kernel: one piece
                if launched is not None:
                    return launched(x, weight, eps, packed.launches)
                return norm_in_step_launches(kernel, x, weight, eps, packed.launches)
            return kernel(x, weight, eps)
        if self.form.norm == "torch" and first and self.form.batch_invariant:
            return rms_norm_vllm_triton(x, weight, eps)
        return rms_norm_hf(x, weight, eps)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor, rotary: nn.Module) -> torch.Tensor:
        if self.form.rope == "hf":
            return rope_hf(x, positions, rotary.inv_freq)
        if self.form.rope == "torch":
            return rope_vllm(x, positions, self.cos_sin_cache)
        return self.kernels.rotary(x, positions, self.cos_sin_cache)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed) -> torch.Tensor:
        if self.form.attention == "sdpa":
            return torch_varlen_attention(q, k, v, packed.cu_seqlens, self.scale)
        max_len = max(packed.lengths)
        if self.form.attention_launch == "steps":
            return stepwise_attention(q, k, v, packed, self.form.page_size or 16, self.kernels.flash_paged, self.scale)
        if self.form.page_size:
            page = self.form.page_size  # its layout: made once per forward by :meth:`layout`
            k, v, table = paged_kv(k, v, packed.lengths, page, packed.paged[page])
            return self.kernels.flash(q, k, v, packed.cu_seqlens, max_len, self.scale, block_table=table)
        return self.kernels.flash(q, k.contiguous(), v.contiguous(), packed.cu_seqlens, max_len, self.scale)

    def _qkv(self, x: torch.Tensor, index: int, attn: nn.Module):
        if self.form.fused_proj:
            q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
            qkv = self._linear(x, self._fused_weight(index, "qkv"), self._fused_weight(index, "qkv_bias"))
            return qkv.split([q_size, kv_size, kv_size], dim=-1)
        return tuple(self._linear(x, self._bf16(m.weight), self._bf16(getattr(m, "bias", None)))
                     for m in (attn.q_proj, attn.k_proj, attn.v_proj))

    def _mlp(self, x: torch.Tensor, index: int, mlp: nn.Module) -> torch.Tensor:
        if self.form.fused_proj:
            gate_up = self._linear(x, self._fused_weight(index, "gate_up"), None)
        else:
            gate_up = torch.cat([self._linear(x, self._bf16(mlp.gate_proj.weight), None),
                                 self._linear(x, self._bf16(mlp.up_proj.weight), None)], -1)
        if self.form.act == "kernel":
            hidden = self.kernels.silu_and_mul(gate_up)
        else:
            half = gate_up.shape[-1] // 2
            hidden = F.silu(gate_up[..., :half]) * gate_up[..., half:]
        return self._linear(hidden, self._bf16(mlp.down_proj.weight), None)

    def _layer(self, index: int, layer: nn.Module, h: torch.Tensor, residual: torch.Tensor | None, packed, rotary):
        """vLLM's ``LlamaDecoderLayer.forward``: ``(h, residual)`` -> ``(h, residual)``, all bf16 ``[T, H]``."""
        residual = h if residual is None else residual + h
        x = self._norm(residual, layer.input_layernorm, first=index == 0, packed=packed)
        q, k, v = self._qkv(x, index, layer.self_attn)
        tokens = x.shape[0]
        q = self._rope(q.reshape(tokens, self.heads, self.head_dim), packed.positions, rotary)
        k = self._rope(k.reshape(tokens, self.kv_heads, self.head_dim), packed.positions, rotary)
        v = v.reshape(tokens, self.kv_heads, self.head_dim)
        attn = self._attention(q, k, v, packed).reshape(tokens, self.heads * self.head_dim)
        o_proj = layer.self_attn.o_proj
        h = self._linear(attn, self._bf16(o_proj.weight), self._bf16(getattr(o_proj, "bias", None)))
        residual = residual + h
        x = self._norm(residual, layer.post_attention_layernorm, first=False, packed=packed)
        return self._mlp(x, index, layer.mlp), residual

    def layout(self, attention_mask: torch.Tensor, position_ids: torch.Tensor | None, logits_to_keep: int
               ) -> PackedBatch:
        """Everything this form's pieces read of the rows' layout (:func:`~bloggap_plugin.core.vllm.form.pack`, which
        tokens were generated, the step-sized launches and paged attention calls), computed where ``attention_mask``
        lives, once per forward: with the mask on the CPU no piece reads the device back for it."""
        packed = pack(None, attention_mask, position_ids)
        if int(packed.positions.max()) >= self.cos_sin_cache.shape[0]:
            raise ValueError(f"arm I: position {int(packed.positions.max())} beyond the model's "
                             f"max_position_embeddings ({self.cos_sin_cache.shape[0]})")
        if logits_to_keep > 1:
            # the scored completion (the last logits_to_keep - 1 columns: the scorer asks for one more logit) was
            # generated token by token; everything before it was the prompt's prefill
            columns = torch.arange(attention_mask.shape[1], device=attention_mask.device)
            generated = (columns >= attention_mask.shape[1] - (logits_to_keep - 1)).expand_as(packed.where)
            packed.generated = generated.flatten()[packed.flat]
            if self.form.attention == "vllm_fa" and self.form.attention_launch == "steps":
                packed = prompt_first(packed)  # step-sized launches become contiguous slices
            elif self.form.norm == "kernel" and self.form.norm_launch == "steps":
                packed.launches = step_launches(packed.generated)
        if self.form.attention == "vllm_fa":
            page = self.form.page_size or 16
            if self.form.attention_launch == "steps":
                stepwise_calls(packed, page)
            elif self.form.page_size:
                packed.paged[page] = paged_layout(packed.lengths, page, packed.flat.device)
        return packed

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None,
                logits_to_keep: int = 0, **_: Any) -> _Output:
        """``.logits [B, logits_to_keep or L, V]`` of ``input_ids [B, L]``. ``attention_mask`` (and ``position_ids``)
        may be on the CPU with ``input_ids`` on the device: the layout is then computed on the host and copied over
        without waiting (:meth:`layout`), so the forward issues no host read of a device tensor."""
        base = self._shadow[0].model
        packed = gather_tokens(self.layout(attention_mask, position_ids, logits_to_keep), input_ids)
        h = F.embedding(packed.tokens, base.embed_tokens.weight).to(torch.bfloat16)  # = bf16(table)[tokens]
        residual = None
        for index, layer in enumerate(base.layers):
            h, residual = self._layer(index, layer, h, residual, packed, base.rotary_emb)
        final = self._norm(residual + h, base.norm, first=False, packed=packed)
        rows, width = packed.where.shape
        # back to the padded layout by each token's flat index (in the tokens' order, prompt_first's or packed)
        hidden = final.new_zeros((rows * width, final.shape[-1])).index_copy(0, packed.flat, final)
        hidden = hidden.view(rows, width, final.shape[-1])
        keep = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        head = self._head[0]
        head.cast = self._bf16(head.weight) if self.over_parameters else None  # one cast for all of the head's tiles
        try:
            return _Output(logits=self.lm_head(keep))
        finally:
            head.cast = None


def sampler_reduce(kernels: Kernels, fp32: bool = False) -> LogprobReducer:
    """The ``logprobs=v2_sampler`` reduce: ``[b, t]`` from the fp32 temperature-scaled logits ``[b, t, V]`` rounded to
    bf16 (exact at temperature 1, where they are the head's bf16 values; vLLM's in-place bf16 temperature otherwise),
    then ``kernels.token_logprobs`` (the sampler's kernel). ``fp32`` (``logprobs=v2_sampler_fp32``): the kernel
    reads the fp32 logits as they come, unrounded (vLLM 0.31's sampler when it processes the logits)."""

    def reduce(logits: torch.Tensor, targets: torch.Tensor, index: TileIndex) -> torch.Tensor:  # noqa: ARG001
        flat = (logits if fp32 else logits.to(torch.bfloat16)).reshape(-1, logits.shape[-1])
        return kernels.token_logprobs(flat, targets.reshape(-1)).view(targets.shape)

    return reduce


def form_reduce(form: VllmForm, kernels: Kernels) -> LogprobReducer | None:
    """The reduce ``form``'s ``logprobs`` piece scores with: :func:`sampler_reduce` for the V2 sampler's pieces,
    ``None`` for ``log_softmax`` (the scoring function's own log-softmax)."""
    if form.logprobs not in SAMPLER_LOGPROBS:
        return None
    return sampler_reduce(kernels, fp32=form.logprobs == "v2_sampler_fp32")


def _form_context(device: torch.device, form: VllmForm, kernels: Kernels) -> contextlib.ExitStack:
    """Autocast off (the form sets every dtype itself) and, for a batch-invariant form, ``kernels.scope()``: the
    context of a forward over the policy's parameters, scored with or without gradients."""
    stack = contextlib.ExitStack()
    for device_type in {device.type, "cpu"}:
        stack.enter_context(autocast_off(device_type))
    if form.batch_invariant:
        stack.enter_context(kernels.scope())
    return stack


class OnPolicyForward:
    """The exactly on-policy training forward: arm I's :class:`VllmFormLM` over the policy's own parameters
    (``over_parameters=True``) with every kernel piece given a backward (:func:`~bloggap_plugin.core.vllm.autograd.
    autograd_kernels`), so its log-probs are the values :class:`VllmFormPlan` scores on a bf16 shadow of the same
    weights, bit for bit, and gradients reach the policy's (fp32 master) parameters.

    It keeps no copy of the weights (each forward casts them inside the graph) and never changes them. Autocast is
    off inside it (the form sets every dtype itself); ``kernels.scope()`` surrounds the forward, not the backward."""

    def __init__(self, policy: nn.Module, form: VllmForm, kernels: Kernels) -> None:
        policy = unwrap_model(policy)
        self.form = form
        self.kernels = kernels
        self.model = VllmFormLM(policy, form, autograd_kernels(kernels), over_parameters=True)
        self._device = model_device(policy)

    def token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                       batch_size: int | None = None, *, temperature: float = 1.0,
                       chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS, compute_entropy: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logps [B, logits_to_keep] fp32, entropies [B, logits_to_keep] | None)`` of the last ``logits_to_keep``
        tokens, with gradients to the policy's parameters when grad is enabled (positions: vLLM's, from the mask).
        ``entropies`` (``compute_entropy``): of the same fp32 temperature-scaled logits, detached. ``attention_mask``
        on the CPU (a host copy of the device mask) stays there: the rows' layout is computed from it, and the forward
        and backward issue no host read of a device tensor for it."""
        entropy_parts: list[tuple[TileIndex, torch.Tensor]] = []
        scored = form_reduce(self.form, self.model.kernels) or gather_logprobs

        def reduce(logits: torch.Tensor, targets: torch.Tensor, index: TileIndex) -> torch.Tensor:
            if compute_entropy:
                with torch.no_grad():
                    logp = torch.log_softmax(logits, dim=-1)
                    entropy_parts.append((index, -(logp.exp() * logp).sum(-1)))
            return scored(logits, targets, index)

        with _form_context(self._device, self.form, self.kernels):
            mask = attention_mask if attention_mask.device.type == "cpu" else attention_mask.to(self._device)
            logps = token_logprobs(self.model, input_ids.to(self._device), mask,
                                   logits_to_keep, batch_size=batch_size, positions="mask", temperature=temperature,
                                   reduce=reduce, chunk_tokens=chunk_tokens)
        return logps, (join_tiles(entropy_parts) if compute_entropy else None)


TOKENS_PER_FORWARD = 16384
"""Padded-width tokens (rows x row width) per arm I forward when the caller sets no row bound: its forward is
batch-invariant, so the rows per forward set the host's launches per scored row, not the numbers; this bounds the
bf16 activations of one forward (the head's logits are tiled apart)."""


class _VllmFormScoring:
    """What arm I's plans share: rows per forward by a token budget, the V2 sampler's log-prob per tile, vLLM's
    batch-invariant overrides around the whole scoring call, and the pieces in their stats."""

    form: VllmForm
    kernels: Kernels
    model: VllmFormLM | None
    host_layout = True

    def _score_model(self) -> Callable[..., Any]:
        return self.model

    def rows_per_forward(self, width: int) -> int:
        """As many rows ``width`` tokens wide as :data:`TOKENS_PER_FORWARD` holds (at least one)."""
        return max(1, TOKENS_PER_FORWARD // max(1, int(width)))

    def token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                       batch_size: int | None = None, **options: Unpack[ScoringOptions]) -> torch.Tensor:
        """As :meth:`ScoringPlan.token_logprobs`; with a V2 sampler ``logprobs`` piece and no caller's ``reduce``,
        each tile's log-probs come from ``kernels.token_logprobs`` on its bf16 (or fp32) logits (:func:`form_reduce`)."""
        if options.get("reduce") is None:
            reduce = form_reduce(self.form, self.kernels)
            if reduce is not None:
                options["reduce"] = reduce
        return super().token_logprobs(input_ids, attention_mask, logits_to_keep, batch_size, **options)

    def _scoring_context(self) -> contextlib.AbstractContextManager:
        stack = super()._scoring_context()
        if self.form.batch_invariant:
            stack.enter_context(self.kernels.scope())
        return stack

    def stats(self) -> dict:
        """The base plan's stats plus ``pieces`` (:meth:`VllmForm.describe`) and ``kernels`` (their source)."""
        return {**super().stats(), "pieces": self.form.describe(), "kernels": self.kernels.source}

    def close(self) -> None:
        super().close()
        self.model = None


class VllmFormPlan(_VllmFormScoring, ShadowPlan):
    """Arm I: a bf16 shadow (the fp32/fp16 shadows' machinery) scored through :class:`VllmFormLM`, with autocast off
    and ``kernels.scope()`` around the whole scoring call (so the log-softmax of the head's tiles runs under vLLM's
    overrides too)."""

    def __init__(self, policy: nn.Module, form: VllmForm, kernels: Kernels, device: torch.device | None = None) -> None:
        check_vllm_form_supported(unwrap_model(policy))
        self.form = form
        self.kernels = kernels
        self.model: VllmFormLM | None = None
        super().__init__(policy, "vllm", torch.bfloat16, device, fp16_guard=False, tf32=False)
        with torch.no_grad():
            self.model = VllmFormLM(self.shadow, form, kernels)

    def _sync(self, source: nn.Module) -> None:
        super()._sync(source)
        if self.model is not None:
            self.model.refresh()

    def _bytes(self) -> int:
        extra = [] if self.model is None else [*self.model.fused_tensors(), self.model.cos_sin_cache]
        return super()._bytes() + tensor_bytes(extra)


class VllmFormParamsPlan(_VllmFormScoring, ScoringPlan):
    """Arm J's old log-probs: :class:`VllmFormLM` over the policy's own parameters (each cast to bf16 inside the
    forward), so no copy of the weights and nothing to sync; its values are those :class:`VllmFormPlan` scores on a
    bf16 shadow of the same weights, bit for bit, and those of :class:`OnPolicyForward` (the same forward with
    gradients). Autocast off and ``kernels.scope()`` around the whole scoring call, as arm I's plan."""

    def __init__(self, policy: nn.Module, form: VllmForm, kernels: Kernels) -> None:
        check_vllm_form_supported(unwrap_model(policy))
        super().__init__(policy, "vllm", fp16_guard=False, tf32=False)
        self.form = form
        self.kernels = kernels
        self.model: VllmFormLM | None = VllmFormLM(self._source, form, kernels, over_parameters=True)

    def _scoring_context(self) -> contextlib.AbstractContextManager:
        return _form_context(self._device(), self.form, self.kernels)

    def _bytes(self) -> int:
        return 0 if self.model is None else tensor_bytes([self.model.cos_sin_cache])

    def _fp32_share(self) -> float:
        return 0.0  # bf16 weights, as the shadow's
