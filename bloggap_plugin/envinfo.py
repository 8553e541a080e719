"""Environment record stored with every benchmark and probe result (JSON-ready dict)."""

from __future__ import annotations

import datetime as _dt
import platform

import torch

__all__ = ["environment_record", "device_tag"]


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
