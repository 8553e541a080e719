"""Device helpers for timing and memory measurements."""

from __future__ import annotations

import gc

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); a no-op elsewhere, where calls return when done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Collect garbage and, on CUDA, hand the allocator's cached blocks back."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
