"""Environment record stored with every benchmark and probe result (JSON-ready dict)."""

from __future__ import annotations

import datetime as _dt
import platform
from pathlib import Path

import torch

__all__ = ["environment_record", "device_tag", "cpu_bf16_native", "BF16_CPU_FLAGS"]


def device_tag(device: str | torch.device | None = None) -> str:
    """Short folder name for results: ``h200``, ``rtx4090``, ..., or ``cpu``."""
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    for tag in ("h200", "h100", "a100", "l40", "v100", "b200", "4090"):
        if tag in name:
            return "rtx4090" if tag == "4090" else tag
    return "".join(ch for ch in name if ch.isalnum())[:24] or "cuda"


def environment_record(device: str | torch.device | None = None, **extra) -> dict:
    """GPU name, SM count, compute capability, driver/CUDA, torch, transformers, trl, host, date, plus ``extra``."""
    import transformers

    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    record = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device_type": device.type,
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
    }
    try:
        import trl

        record["trl"] = trl.__version__
    except Exception:  # noqa: BLE001 - optional
        record["trl"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        record.update(
            gpu=props.name,
            sm_count=props.multi_processor_count,
            compute_capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
        )
        try:
            import subprocess

            record["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10,
            ).stdout.strip().splitlines()[0]
        except Exception:  # noqa: BLE001 - best effort
            record["driver"] = None
    record.update(extra)
    return record


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
"""CPU feature flags (``/proc/cpuinfo``: x86 ``flags``, Arm ``Features``) of bf16 arithmetic in hardware; without one,
torch runs bf16 matrix products through conversions, several times slower than fp32."""


def cpu_bf16_native(cpuinfo: str | Path = "/proc/cpuinfo") -> tuple[bool | None, str]:
    """``(native, evidence)``: whether this CPU has bf16 arithmetic in hardware, read from its feature flags in
    ``cpuinfo`` (``None`` when the file cannot be read, e.g. not Linux), and a phrase saying what was read."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return None, f"no {cpuinfo} to read the CPU's feature flags from"
    flags = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    if not flags:
        return None, f"{cpuinfo} lists no feature flags"
    found = [flag for flag in BF16_CPU_FLAGS if flag in flags]
    if found:
        return True, f"{', '.join(found)} in {cpuinfo}"
    return False, f"none of {', '.join(BF16_CPU_FLAGS)} in {cpuinfo}"
