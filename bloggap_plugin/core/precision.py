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
- ``vllm`` (I): a bf16 shadow scored the way vLLM computes (:mod:`bloggap_plugin.core.vllm_plan`; pieces
  switchable, docs/arm_i.md).
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
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Unpack

import torch
from torch import nn

from bloggap_plugin.arms import PLAN_ALIASES, PLAN_NAMES, plan_name

from .model_parts import (
    _build_shadow,
    _device_sync,
    _executed_numel,
    _FusedCopy,
    _is_tied_safe,
    _layer_list_path,
    _model_device,
    _param_pairs,
    _tensor_bytes,
    _unique_numel,
    decoder_layers,
    final_norm,
)
from .scoring import (
    LogprobReducer,
    ScoringOptions,
    TileIndex,
    gather_logprobs,
    output_head,
    token_logprobs,
    unwrap_model,
)
from .sharding import all_ranks_true, is_partitioned, is_sharded, reshard

__all__ = [
    "ARMS",
    "PLAN_ALIASES",
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

ARMS = PLAN_NAMES  # the plan names make_plan builds (arm letters: bloggap_plugin.arms)


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
    """Canonical plan name for ``name`` (``bf16 fp32 fp16 fp32_head guided vllm`` or a letter: ``A`` = ``bf16``, and
    each planned arm's letter ``B C D E F I``); see :func:`bloggap_plugin.arms.plan_name`."""
    return plan_name(name)


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
        reshard(self._source)  # FSDP2: the plan is built from the shards (core.sharding); no-op otherwise
        self.sharded = is_sharded(self._source)  # made from a sharded policy (a later fully_shard needs a new plan)
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
        **options: Unpack[ScoringOptions],
    ) -> torch.Tensor:
        """``[B, logits_to_keep]`` fp32 log-probs through :func:`core.scoring.token_logprobs` in this arm;
        ``options`` (``positions``, ``temperature``, ``reduce``, ``chunk_tokens``) as there."""
        self._check_open()
        reduce = options.pop("reduce", None)
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
                reduce=call_reduce,
                **options,
            )
        if guard and finite:
            chunk_ok = torch.stack([torch.stack(flags).all() for flags in finite.values()]).cpu().tolist()
            # sharded (FSDP2): a chunk is re-scored on every rank if it overflowed on any (the fp32 forward is a
            # collective); a rank whose own chunk was finite discards the re-score
            ok_on_every_rank = all_ranks_true(chunk_ok, self._source)
            for (start, stop), ok, all_ok in zip(finite, chunk_ok, ok_on_every_rank):
                if all_ok:
                    continue
                rows = slice(start, stop)
                sub_reduce = _shifted_reduce(reduce, start) if reduce is not None else None
                rescored = self._fp32_fallback().token_logprobs(
                    input_ids[rows], attention_mask[rows], logits_to_keep, batch_size=None, reduce=sub_reduce,
                    **options,
                )
                if ok:
                    continue
                result[rows] = rescored.to(result.device)
                self.fp16_fallbacks += 1
        return result.to(out_device)

    def rows_per_forward(self, width: int) -> int | None:  # noqa: ARG002 - the plans that choose use it
        """Rows per forward this plan chooses for rows ``width`` tokens wide, or ``None``: the caller's (its
        micro-batch), which bounds the activations of a plan whose numbers do not depend on it either."""
        return None

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
        if self.sharded:  # FSDP2: free the units a forward left gathered (core.sharding)
            stack.callback(reshard, self.shadow)
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
    pieces: str | Any | None = None,
) -> ScoringPlan:
    """A :class:`ScoringPlan` scoring with ``policy`` in ``arm``.

    Args:
        policy: the causal LM (wrapped by DDP/accelerate or not); arm ``bf16`` calls it exactly as passed.
        arm: a plan name ``bf16 | fp32 | fp16 | fp32_head | guided | vllm``, or an arm letter with a plan
            (``B C D E F I``, :mod:`bloggap_plugin.arms`), or ``A`` for ``bf16`` (:data:`PLAN_ALIASES`).
        device: where an fp32/fp16 (or arm I's bf16) shadow lives (default: the policy's device). Not used by other
            arms.
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
        pieces: ``vllm`` (arm I) only: which pieces of its forward follow vLLM
            (:func:`bloggap_plugin.core.vllm_form.parse_form`; default ``"all"``). Pieces that call vLLM's kernels
            need vLLM and CUDA (:func:`bloggap_plugin.vllm_kernels.load_kernels` refuses otherwise).
    """
    name = resolve_arm(arm)
    if not (tf32 is True or tf32 is False or tf32 == "auto"):
        raise ValueError(f"tf32 must be True, False or 'auto', got {tf32!r}")
    if not isinstance(policy, nn.Module):
        raise TypeError(f"policy must be a torch.nn.Module, got {type(policy).__name__}")
    if name != "guided" and (layers is not None or calibration is not None):
        raise ValueError(f"layers=/calibration= choose fp32 layers for arm 'guided' only, not {name!r}")
    if pieces is not None and name != "vllm":
        raise ValueError(f"pieces= chooses arm I's vLLM pieces; arm {name!r} has none")
    if device is not None and name not in (*_SHADOW_DTYPES, "vllm"):
        raise ValueError(f"device= places an fp32/fp16 shadow; arm {name!r} runs on the policy's own device")
    if name == "bf16":
        return _PolicyPlan(policy, name, fp16_guard)
    if is_partitioned(policy):
        raise ValueError(
            f"plan {name!r} copies the policy's weights, but its parameters are DeepSpeed ZeRO-3 slices (ds_id), "
            "gathered only inside a forward: use FSDP2 (plans shard their copies like the policy), ZeRO stage 1 "
            "or 2, or the 'bf16' plan"
        )
    if name in _SHADOW_DTYPES:
        return _ShadowPlan(policy, name, _SHADOW_DTYPES[name], device, fp16_guard, tf32)
    if name == "vllm":
        return _vllm_plan(policy, pieces, device)
    from .upcast import UpcastPlan

    if name == "fp32_head":
        return UpcastPlan(policy, name, [], fp16_guard, tf32)
    ids, profile = _guided_layers(policy, layers, k, calibration)
    plan = UpcastPlan(policy, "guided", ids, fp16_guard, tf32)
    plan.profile = profile
    return plan


_SHADOW_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def _vllm_plan(policy: nn.Module, pieces: Any, device: str | torch.device | None) -> ScoringPlan:
    """Arm I (:mod:`.vllm_plan`): the form parsed and its kernels loaded before the bf16 shadow is built."""
    from bloggap_plugin.vllm_kernels import load_kernels

    from .vllm_form import parse_form
    from .vllm_plan import VllmFormPlan

    form = parse_form("all" if pieces is None else pieces)
    target = torch.device(device) if device is not None else _model_device(unwrap_model(policy))
    return VllmFormPlan(policy, form, load_kernels(form, target), target)


def _guided_layers(
    policy: nn.Module, layers: Sequence[int] | str | None, k: int,
    calibration: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[list[int], Any]:
    """``(layer ids, attribution profile or None)`` of a ``guided`` plan: the given ids (checked against the
    model), or the top-``k`` of a divergence profile on ``calibration`` rows for ``layers="auto"``."""
    n_layers = len(_layer_list_path(unwrap_model(policy))[1])
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
    return ids, profile
