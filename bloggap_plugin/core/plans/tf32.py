"""TF32 for a plan's fp32 matmuls: :func:`resolve_tf32` decides, :func:`cuda_matmul_tf32` sets it for one block.

Plans that compute in fp32 set CUDA's fp32 matmul precision for their own forward only and restore the caller's
setting afterwards, also when the forward raises; the process-wide setting outside a call is never changed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["TF32_MODES", "resolve_tf32", "cuda_matmul_tf32"]

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
