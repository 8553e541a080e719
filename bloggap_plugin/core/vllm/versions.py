"""vLLM version gate: the versions the plugin supports, in one place, and the one check of the installed vLLM.

Two ranges: any vLLM path (TRL's colocate engine, the sampler metrics) needs a vLLM that TRL 1.16 accepts
(``trl/import_utils.py``: 0.22.0 to 0.31.0); arms I and J compute the kernels of the vLLM they were read from and
measured against (:data:`VLLM_FORM_RELEASES`, docs/arm_i.md), so their vLLM pieces need exactly that release.
"""

from __future__ import annotations

__all__ = ["TRL_VLLM_RANGE", "VLLM_FORM_RELEASES", "installed_vllm", "vllm_problem", "supported_text",
           "form_install_hint", "vllm_unavailable_reason"]

TRL_VLLM_RANGE = ("0.22.0", "0.31.0")
"""The vLLM releases TRL 1.16 accepts, both ends included."""

VLLM_FORM_RELEASES = ("0.26.0",)
"""The vLLM releases whose kernels arms I and J compute (each read from its wheel and measured on the GPU)."""


def installed_vllm() -> str | None:
    """The installed vLLM's version (package metadata; vLLM is not imported), or ``None`` when it is absent."""
    from importlib import metadata

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...] | None:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release[:3]
    except InvalidVersion:
        return None


def supported_text() -> str:
    """``vLLM 0.22.0-0.31.0 (TRL 1.16's range)``: the range for messages."""
    return f"vLLM {TRL_VLLM_RANGE[0]}-{TRL_VLLM_RANGE[1]} (TRL 1.16's range)"


def form_install_hint() -> str:
    """How to install a vLLM whose kernels arms I and J compute: ``pip install vllm==0.26.0``."""
    return f"pip install vllm=={VLLM_FORM_RELEASES[-1]}"


def vllm_problem(needs_form: bool = False, version: str | None = None) -> str | None:
    """Why the installed vLLM (``version``: default :func:`installed_vllm`) cannot serve, in one line naming the
    installed and the supported versions, or ``None`` when it can. ``needs_form``: the run computes vLLM's kernels
    (arm I or J with vLLM pieces), which need one of :data:`VLLM_FORM_RELEASES`."""
    version = installed_vllm() if version is None else version
    if version is None:
        return f"vLLM is not installed here: install {supported_text()}, e.g. {form_install_hint()}"
    release = _release(version)
    low, high = (_release(bound) for bound in TRL_VLLM_RANGE)
    if release is None or not low <= release <= high:
        return f"vLLM {version} is installed and the plugin supports {supported_text()}: install e.g. {form_install_hint()}"
    if needs_form and release not in {_release(v) for v in VLLM_FORM_RELEASES}:
        return (f"vLLM {version} is installed, and arms I and J compute the kernels of vLLM "
                f"{', '.join(VLLM_FORM_RELEASES)} (read from its wheel and measured there): {form_install_hint()}, or "
                "set gap.i_pieces: torch (vLLM's maths in plain torch)")
    return None


def vllm_unavailable_reason() -> str | None:
    """Why TRL's colocated vLLM engine cannot run here (``"vLLM is not installed here"``, ``"CUDA is not
    available here ..."``), or ``None`` when it can."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed here"
    import torch

    if not torch.cuda.is_available():
        return f"CUDA is not available here (torch {torch.__version__})"
    return None
