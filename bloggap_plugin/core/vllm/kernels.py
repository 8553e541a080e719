"""vLLM's own kernels for arm I's ``kernel`` pieces (:class:`bloggap_plugin.core.vllm.form.Kernels`).

The functions are the ones vLLM's ``LlamaForCausalLM`` calls on CUDA (docs/arm_i.md has 0.26's file references,
docs/vllm031_form.md what moved in 0.31), imported from the modules the installed release's
:class:`~bloggap_plugin.core.vllm.versions.VllmFormLayout` names: ``linear_batch_invariant`` (Triton persistent
matmul) for every linear layer and the LM head when ``VLLM_BATCH_INVARIANT=1``; ``rms_norm_batch_invariant`` /
``_C.rms_norm`` for layer 0's first norm and ``_C.fused_add_rms_norm`` for every other; ``_C.rotary_embedding`` on the bf16 ``cos_sin_cache``;
``_C.silu_and_mul``; ``vllm_flash_attn.flash_attn_varlen_func`` (FA3 on Hopper) over a paged KV cache with
``num_splits=1`` in batch-invariant mode. :func:`batch_invariant_scope` installs vLLM's aten overrides for one
scoring call only (a ``torch.library`` registration destroyed afterwards, so the previous kernels come back).

Only :func:`load_kernels` is needed by callers; it refuses, naming the fix, where vLLM or CUDA is missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Iterator
from typing import Any

import torch

from bloggap_plugin.core.errors import UsageError
from bloggap_plugin.core.vllm.form import TORCH_KERNELS, Kernels, VllmForm, padded_flash_attention

__all__ = ["VllmFormUnavailable", "load_kernels", "batch_invariant_scope", "vllm_batch_invariant_active",
           "vllm_layout", "register_hf_attention", "HF_ATTENTION_NAME", "MatmulSettings",
           "suspend_batch_invariant_mode", "engine_batch_invariance", "persistent_matmul_module"]

HF_ATTENTION_NAME = "bloggap_vllm_fa"
"""The ``attn_implementation`` name :func:`register_hf_attention` registers with transformers."""


class VllmFormUnavailable(UsageError):
    """An arm I piece needs vLLM's CUDA kernels and this process cannot provide them."""


def _refuse(form: VllmForm, why: str) -> VllmFormUnavailable:
    from bloggap_plugin.core.vllm.versions import form_install_hint

    return VllmFormUnavailable(
        f"arm I pieces {', '.join(form.needs_vllm())} call vLLM's CUDA kernels, but {why}: score on a CUDA GPU with "
        f"vLLM installed ({form_install_hint()}), or use gap.i_pieces: torch (vLLM's maths in plain torch)"
    )


def vllm_layout() -> tuple[str | None, Any]:
    """``(version, layout)`` of the vLLM this process imports: its version (``vllm.__version__``, else package
    metadata) and :func:`~bloggap_plugin.core.vllm.versions.form_layout` of it (``None`` for a release not read);
    ``(None, None)`` when vLLM does not import. Called around every vLLM-form scoring call: the module attribute
    first, since a metadata lookup scans the installed distributions."""
    from bloggap_plugin.core.vllm.versions import form_layout, installed_vllm

    try:
        import vllm
    except Exception:  # noqa: BLE001 - no (importable) vLLM
        return None, None
    version = getattr(vllm, "__version__", None) or installed_vllm()
    return version, form_layout(version)


def _batch_invariant_module() -> Any:
    """The installed vLLM's batch-invariant module (where its layout says), or ``None`` (no vLLM, a release not
    read, or the module does not import)."""
    _, layout = vllm_layout()
    if layout is None:
        return None
    try:
        return importlib.import_module(layout.batch_invariant)
    except Exception:  # noqa: BLE001 - vLLM without its kernels (no CUDA build): mode not available
        return None


def persistent_matmul_module() -> Any:
    """vLLM's batch-invariant module where it holds the persistent matmul (``matmul_persistent`` and its Triton
    ``matmul_kernel_persistent``, what :mod:`bloggap_plugin.core.vllm.tile_table` routes), else ``None``."""
    module = _batch_invariant_module()
    return module if hasattr(module, "matmul_kernel_persistent") else None


def vllm_batch_invariant_active() -> bool:
    """Whether vLLM already enabled its batch-invariant mode in this process (``VLLM_BATCH_INVARIANT=1`` engine);
    ``False`` without vLLM or for a release whose layout was not read (the plugin does not touch its internals)."""
    module = _batch_invariant_module()
    return bool(getattr(module, "_batch_invariant_MODE", False))


@contextlib.contextmanager
def batch_invariant_scope() -> Iterator[None]:
    """vLLM's batch-invariant aten overrides (``_log_softmax``, ``softmax``, ``_softmax``, ``mean.dim``, ``bmm`` on
    CUDA) and its matmul settings (no fp16/bf16 reduced-precision reductions, cuBLASLt, IEEE fp32) for the block only.

    Where vLLM's engine has the mode on process-wide, this adds nothing. Not scoped: cuBLAS(Lt) workspace sizes
    (``CUBLAS_WORKSPACE_CONFIG``, ``CUBLASLT_WORKSPACE_SIZE``), which torch reads once per process; vLLM sets them
    before its first matmul (docs/arm_i.md)."""
    bi = _batch_invariant_module()
    if getattr(bi, "_batch_invariant_MODE", False):  # the engine's mode is on process-wide
        yield
        return
    saved = MatmulSettings.current()
    library = torch.library.Library("aten", "IMPL")
    try:
        library.impl("aten::_log_softmax", bi._log_softmax_batch_invariant, "CUDA")
        library.impl("aten::softmax", bi.softmax_batch_invariant, "CUDA")
        library.impl("aten::_softmax", bi.softmax_batch_invariant, "CUDA")
        library.impl("aten::mean.dim", bi.mean_batch_invariant, "CUDA")
        library.impl("aten::bmm", bi.bmm_batch_invariant, "CUDA", allow_override=True)
        off = (False, False) if isinstance(saved.bf16_reduced, tuple) else False
        MatmulSettings(off, off, "cublaslt", None if saved.fp32_precision is None else "ieee").apply()
        yield
    finally:
        library._destroy()
        saved.apply()


@dataclasses.dataclass(frozen=True)
class MatmulSettings:
    """The process-wide torch settings that vLLM's batch-invariant mode changes besides its aten overrides: fp16 and
    bf16 reduced-precision reductions in cuBLAS, the preferred BLAS library, the fp32 matmul precision."""

    fp16_reduced: Any
    bf16_reduced: Any
    blas: Any
    fp32_precision: str | None

    @classmethod
    def current(cls) -> MatmulSettings:
        """The settings in force now (e.g. before vLLM's engine starts)."""
        matmul = torch.backends.cuda.matmul
        return cls(matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction,
                   torch.backends.cuda.preferred_blas_library(), getattr(matmul, "fp32_precision", None))

    def apply(self) -> None:
        """Put these settings in force."""
        matmul = torch.backends.cuda.matmul
        matmul.allow_fp16_reduced_precision_reduction = self.fp16_reduced
        matmul.allow_bf16_reduced_precision_reduction = self.bf16_reduced
        torch.backends.cuda.preferred_blas_library(self.blas)
        if self.fp32_precision is not None:
            matmul.fp32_precision = self.fp32_precision


def suspend_batch_invariant_mode(plain: MatmulSettings) -> bool:
    """Turn off vLLM's process-wide batch-invariant mode, which its colocated engine turned on at start-up for the
    whole process (the trainer's forward and backward included): its aten overrides unregistered, ``torch.bmm``
    restored, torch's matmul settings back to ``plain`` (as they were before the engine started). ``True`` if the
    mode was on. Not undone: the cuBLAS(Lt) workspace sizes (torch reads them once per process).

    :func:`batch_invariant_scope` then installs the overrides for arm I's and J's vLLM-form passes alone, and
    :func:`engine_batch_invariance` for the engine's own steps."""
    bi = _batch_invariant_module()
    if not getattr(bi, "_batch_invariant_MODE", False):
        return False
    if bi._batch_invariant_LIB is not None:
        bi._batch_invariant_LIB._destroy()
    bi._batch_invariant_LIB = None
    bi._batch_invariant_MODE = False
    torch.bmm = torch._C._VariableFunctions.bmm  # vLLM also replaces the Python binding
    plain.apply()
    return True


@contextlib.contextmanager
def engine_batch_invariance(plain: MatmulSettings) -> Iterator[None]:
    """vLLM's batch-invariant mode for the block, as its worker turns it on at start-up (``enable_batch_invariant_mode``
    and fp32 matmuls in IEEE precision), then off again (:func:`suspend_batch_invariant_mode` with ``plain``): for the
    colocated engine's own steps (generation) once the mode was suspended for the rest of the process."""
    bi = _batch_invariant_module()
    bi.enable_batch_invariant_mode()
    matmul = torch.backends.cuda.matmul
    if getattr(matmul, "fp32_precision", None) is not None:
        matmul.fp32_precision = "ieee"
    try:
        yield
    finally:
        suspend_batch_invariant_mode(plain)


def _norms(batch_invariant: bool, bi: Any):
    from vllm import _custom_ops as ops

    rms_norm_batch_invariant = bi.rms_norm_batch_invariant

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if batch_invariant:
            return rms_norm_batch_invariant(x, weight, eps)
        out = torch.empty_like(x)
        ops.rms_norm(out, x.contiguous(), weight, eps)
        return out

    def add_rms_norm(summed: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # vLLM's fused kernel adds the residual in fp32 and rounds to bf16 before normalising; the caller already
        # holds that bf16 sum, and sum + 0 is the same sum, so the kernel normalises exactly what vLLM's does.
        out = summed.contiguous().clone()
        ops.fused_add_rms_norm(out, torch.zeros_like(out), weight, eps)
        return out

    return rms_norm, add_rms_norm


def _rotary(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    from vllm import _custom_ops as ops

    flat = x.reshape(x.shape[0], -1).clone()
    ops.rotary_embedding(positions, flat, None, x.shape[-1], cache, True)
    return flat.view_as(x)


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)
    torch.ops._C.silu_and_mul(out, x.contiguous())
    return out


def _flash_functions(layout: Any) -> tuple[Any, Any]:
    """``(get_flash_attn_version, flash_attn_varlen_func)`` from the modules ``layout`` names."""
    return (importlib.import_module(layout.fa_utils).get_flash_attn_version,
            importlib.import_module(layout.flash).flash_attn_varlen_func)


def _flash(batch_invariant: bool, layout: Any):
    get_flash_attn_version, flash_attn_varlen_func = _flash_functions(layout)

    def flash(q, k, v, cu_seqlens, max_seqlen, scale, block_table=None):
        kwargs = dict(q=q, k=k, v=v, max_seqlen_q=max_seqlen, cu_seqlens_q=cu_seqlens, max_seqlen_k=max_seqlen,
                      softmax_scale=scale, causal=True, fa_version=get_flash_attn_version(head_size=q.shape[-1]),
                      num_splits=1 if batch_invariant else 0)
        if block_table is None:
            kwargs["cu_seqlens_k"] = cu_seqlens
        else:
            kwargs["seqused_k"] = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)
            kwargs["block_table"] = block_table
        return flash_attn_varlen_func(**kwargs)

    return flash


def _flash_paged(batch_invariant: bool, layout: Any):
    get_flash_attn_version, flash_attn_varlen_func = _flash_functions(layout)

    def flash_paged(q, key_cache, value_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k, scale):
        return flash_attn_varlen_func(q=q, k=key_cache, v=value_cache, max_seqlen_q=max_seqlen_q,
                                      cu_seqlens_q=cu_seqlens_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k,
                                      block_table=block_table, softmax_scale=scale, causal=True,
                                      fa_version=get_flash_attn_version(head_size=q.shape[-1]),
                                      num_splits=1 if batch_invariant else 0)

    return flash_paged


def load_kernels(form: VllmForm, device: torch.device | str) -> Kernels:
    """The :class:`Kernels` for ``form`` on ``device``: plain torch when no piece needs vLLM, else vLLM's functions.

    Each function comes from the module the installed release's layout names
    (:data:`~bloggap_plugin.core.vllm.versions.VLLM_FORM_LAYOUTS`). Raises :class:`VllmFormUnavailable` (naming the
    pieces and the fix) off CUDA, for a vLLM the gate refuses or whose layout was not read, or when vLLM does not
    import."""
    if not form.needs_vllm():
        return TORCH_KERNELS
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise _refuse(form, f"the plan runs on {device}")
    from bloggap_plugin.core.vllm.versions import VLLM_FORM_LAYOUTS, installed_vllm, vllm_problem

    problem = vllm_problem(needs_form=True) if installed_vllm() is not None else None
    if problem:
        raise VllmFormUnavailable(f"arm I pieces {', '.join(form.needs_vllm())}: {problem}")
    version, layout = vllm_layout()
    if layout is None:
        raise _refuse(form, "vLLM does not import here (or gives no version)" if version is None else
                      f"vLLM {version} is not a release whose pieces were read ({', '.join(VLLM_FORM_LAYOUTS)})")
    try:
        import vllm._custom_ops  # noqa: F401 - registers torch.ops._C

        bi = importlib.import_module(layout.batch_invariant)
        linear = bi.linear_batch_invariant
        flash, flash_paged = _flash(form.batch_invariant, layout), _flash_paged(form.batch_invariant, layout)
    except Exception as err:  # noqa: BLE001 - any import failure is the same refusal
        raise _refuse(form, f"vLLM does not import here ({type(err).__name__}: {err})") from None
    rms_norm, add_rms_norm = _norms(form.batch_invariant, bi)
    return Kernels(linear=linear, rms_norm=rms_norm, add_rms_norm=add_rms_norm, rotary=_rotary,
                   silu_and_mul=_silu_and_mul, flash=flash, flash_paged=flash_paged,
                   token_logprobs=_token_logprobs(form, layout), scope=batch_invariant_scope,
                   source=f"vllm {version}")


def _token_logprobs(form: VllmForm, layout: Any):
    """vLLM's model runner V2 log-prob kernel (``compute_token_logprobs`` from ``layout.logprob``) as ``(logits
    [N, V], tokens [N]) -> [N]``; the torch stand-in when the form does not use it. :class:`VllmFormUnavailable`
    when this vLLM has no V2 runner."""
    if form.logprobs == "log_softmax":
        return TORCH_KERNELS.token_logprobs
    from bloggap_plugin.core.vllm.versions import form_install_hint
    try:
        compute_token_logprobs = importlib.import_module(layout.logprob).compute_token_logprobs
    except Exception as err:  # noqa: BLE001 - any import failure is the same refusal
        raise VllmFormUnavailable(
            f"arm I piece logprobs={form.logprobs} calls vLLM's model runner V2 log-prob kernel, which this vLLM lacks "
            f"({type(err).__name__}: {err}): {form_install_hint()}, or, for an engine on the V1 "
            "model runner, set gap.i_pieces: all,logprobs=log_softmax"
        ) from None

    def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        # the kernel reads row i's token id at i * topk of the tensor's storage: a strided view (the targets of a
        # one-position tile of the head) must be made dense first
        return compute_token_logprobs(logits.contiguous(), tokens.reshape(-1, 1).contiguous())[:, 0]

    return token_logprobs


def register_hf_attention(kernels: Kernels, page_size: int = 16, name: str = HF_ATTENTION_NAME) -> str:
    """Register ``kernels.flash`` (vLLM's FlashAttention from :func:`load_kernels`, or a stand-in) as the HF attention
    implementation ``name`` (``AttentionInterface``), with FlashAttention-style masks (``AttentionMaskInterface``: the
    2-D padding mask, or none): an HF model with ``config._attn_implementation = name`` then attends as vLLM does
    (packed, paged with ``page_size``, ``num_splits`` as the kernels were loaded) inside its own forward. Returns
    ``name``; registering again replaces the kernels."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if dropout:
            raise ValueError(f"{name} attention has no dropout (scoring runs in eval mode); got dropout={dropout}")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return padded_flash_attention(query, key, value, attention_mask, scale, kernels, page_size), None

    AttentionInterface.register(name, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, flash_attention_mask)
    return name
