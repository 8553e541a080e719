"""vLLM version gate: the versions the plugin supports, in one place, and the one check of the installed vLLM.

Two ranges: any vLLM path (TRL's colocate engine, the sampler metrics) needs a vLLM that TRL 1.16 accepts
(``trl/import_utils.py``: 0.22.0 to 0.31.0); arms I and J compute the kernels of the vLLM they were read from and
measured against (:data:`VLLM_FORM_RELEASES`, docs/arm_i.md), so their vLLM pieces need exactly that release.
Where each read release keeps those pieces is :data:`VLLM_FORM_LAYOUTS` (a release read from its wheel but not yet
measured is refused, naming what is missing, unless :data:`FORM_TRIAL_ENV` names it: docs/vllm031_form.md).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

__all__ = ["TRL_VLLM_RANGE", "VLLM_FORM_RELEASES", "installed_vllm", "vllm_problem", "supported_text",
           "form_install_hint", "vllm_unavailable_reason", "VllmFormLayout", "VLLM_FORM_LAYOUTS", "form_layout",
           "FORM_TRIAL_ENV", "v2_sampler_processing", "SAMPLING_MASK_RELEASE", "has_sampling_mask"]

TRL_VLLM_RANGE = ("0.22.0", "0.31.0")
"""The vLLM releases TRL 1.16 accepts, both ends included."""

SAMPLING_MASK_RELEASE = "0.28.0"
"""The first vLLM release whose ``LLM(return_sampling_mask=True)`` returns each completion's ``sampling_mask``
(vllm/entrypoints/llm.py, vllm/outputs.py ``SamplingMask``); read from vLLM 0.31's source, not run live."""

VLLM_FORM_RELEASES = ("0.26.0",)
"""The vLLM releases whose kernels arms I and J compute (each read from its wheel and measured on the GPU)."""


@dataclass(frozen=True)
class VllmFormLayout:
    """Where one vLLM release keeps the functions arms I and J call (modules, imported by name), and what its model
    runner V2 sampler feeds its log-prob kernel; each entry read from that release's wheel (docs/vllm031_form.md)."""

    batch_invariant: str
    """Module of ``linear_batch_invariant``, ``rms_norm_batch_invariant``, the aten overrides and the mode switch
    (``enable_batch_invariant_mode``, ``_batch_invariant_MODE``, ``_batch_invariant_LIB``)."""
    logprob: str = "vllm.v1.worker.gpu.sample.logprob"
    """Module of the V2 sampler's ``compute_token_logprobs(logits [N, V], token_ids [N, k]) -> [N, k]``."""
    fa_utils: str = "vllm.v1.attention.backends.fa_utils"
    """Module of ``get_flash_attn_version(..., head_size=...)``."""
    flash: str = "vllm.vllm_flash_attn"
    """Module of ``flash_attn_varlen_func`` (keyword call; FA3 on Hopper)."""
    processed_logits_fp32: bool = False
    """``False``: the V2 sampler applies the temperature to the bf16 logits in place, so its log-prob kernel reads
    bf16; ``True``: when a request's sampling parameters need processing (temperature not 0 or 1, top_k, top_p,
    min_p, penalties, logit bias, bad words) it first copies the logits to fp32, so the kernel reads fp32."""


VLLM_FORM_LAYOUTS: dict[str, VllmFormLayout] = {
    "0.26.0": VllmFormLayout(batch_invariant="vllm.model_executor.layers.batch_invariant"),
    "0.31.0": VllmFormLayout(batch_invariant="vllm.model_executor.determinism.batch_invariant",
                             processed_logits_fp32=True),
}
"""Release -> :class:`VllmFormLayout`, for every release read from its wheel (measured or not)."""

FORM_TRIAL_ENV = "BLOGGAP_VLLM_FORM_TRIAL"
"""Environment variable: a release of :data:`VLLM_FORM_LAYOUTS` not in :data:`VLLM_FORM_RELEASES` (read, not yet
measured) that arms I and J may run anyway, to measure it (e.g. ``0.31.0``, on the GPU: docs/vllm031_form.md)."""

_UNMEASURED = {
    "0.31.0": "the bitwise live run on a GPU, sampler against arm I's old log-probs, laid out in "
              "docs/vllm031_form.md; e.g. its batch-invariant matmul now picks tiles by row count for some shapes",
}
"""Release -> what is missing before it joins :data:`VLLM_FORM_RELEASES` (said by the gate's refusal)."""


def form_layout(version: str | None) -> VllmFormLayout | None:
    """The :class:`VllmFormLayout` of vLLM ``version`` (any local or dev suffix ignored), or ``None`` when no wheel
    of that release was read."""
    release = None if version is None else _release(version)
    for name, layout in VLLM_FORM_LAYOUTS.items():
        if release is not None and release == _release(name):
            return layout
    return None


def installed_vllm() -> str | None:
    """The installed vLLM's version (package metadata; vLLM is not imported), or ``None`` when it is absent."""
    from importlib import metadata

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=32)
def _release(version: str) -> tuple[int, ...] | None:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release[:3]
    except InvalidVersion:
        return None


def has_sampling_mask(version: str | None) -> bool:
    """Whether vLLM ``version`` (``None``: not installed) has ``return_sampling_mask`` (>= :data:`SAMPLING_MASK_RELEASE`)."""
    release = _release(version) if version else None
    return release is not None and release >= _release(SAMPLING_MASK_RELEASE)


def v2_sampler_processing(sampling: dict, vocab_size: int | None = None) -> list[str]:
    """The sampling parameters (``name=value``, in ``sampling``: a vLLM ``SamplingParams``' keywords) for which
    vLLM 0.31's model runner V2 sampler processes a request's logits, copying them to fp32 first
    (``Sampler.apply_sampling_params``), so its log-prob kernel reads fp32: temperature not 0 or 1, ``top_p`` below
    1, ``top_k`` above 0 and below ``vocab_size``, ``min_p`` (those four unless greedy:
    ``SamplingStates.add_request``), repetition/frequency/presence penalties (``use_penalty``), logit bias, allowed
    token ids or ``min_tokens`` (``LogitBiasState``), bad words. Empty: it reads the bf16 logits."""
    temperature = float(sampling.get("temperature", 1.0))
    top_k = int(sampling.get("top_k") or 0)
    checks = [("temperature", temperature not in (0.0, 1.0)),
              ("top_p", temperature != 0.0 and float(sampling.get("top_p", 1.0)) != 1.0),
              ("top_k", temperature != 0.0 and top_k > 0 and (vocab_size is None or top_k < vocab_size)),
              ("min_p", temperature != 0.0 and float(sampling.get("min_p") or 0.0) != 0.0),
              ("repetition_penalty", float(sampling.get("repetition_penalty", 1.0)) != 1.0),
              ("frequency_penalty", float(sampling.get("frequency_penalty", 0.0)) != 0.0),
              ("presence_penalty", float(sampling.get("presence_penalty", 0.0)) != 0.0),
              ("logit_bias", bool(sampling.get("logit_bias"))),
              ("allowed_token_ids", bool(sampling.get("allowed_token_ids"))),
              ("min_tokens", int(sampling.get("min_tokens") or 0) > 0),
              ("bad_words", bool(sampling.get("bad_words")))]
    return [f"{name}={sampling[name]!r}" for name, processes in checks if processes]


def supported_text() -> str:
    """``vLLM 0.22.0-0.31.0 (TRL 1.16's range)``: the range for messages."""
    return f"vLLM {TRL_VLLM_RANGE[0]}-{TRL_VLLM_RANGE[1]} (TRL 1.16's range)"


def form_install_hint() -> str:
    """How to install a vLLM whose kernels arms I and J compute: ``pip install vllm==0.26.0``."""
    return f"pip install vllm=={VLLM_FORM_RELEASES[-1]}"


def vllm_problem(needs_form: bool = False, version: str | None = None, environ: dict | None = None) -> str | None:
    """Why the installed vLLM (``version``: default :func:`installed_vllm`) cannot serve, in one line naming the
    installed and the supported versions, or ``None`` when it can. ``needs_form``: the run computes vLLM's kernels
    (arm I or J with vLLM pieces), which need one of :data:`VLLM_FORM_RELEASES`, or a release of
    :data:`VLLM_FORM_LAYOUTS` that :data:`FORM_TRIAL_ENV` (in ``environ``, default ``os.environ``) names."""
    version = installed_vllm() if version is None else version
    if version is None:
        return f"vLLM is not installed here: install {supported_text()}, e.g. {form_install_hint()}"
    release = _release(version)
    low, high = (_release(bound) for bound in TRL_VLLM_RANGE)
    if release is None or not low <= release <= high:
        return f"vLLM {version} is installed and the plugin supports {supported_text()}: install e.g. {form_install_hint()}"
    if needs_form and release not in {_release(v) for v in VLLM_FORM_RELEASES}:
        return _unmeasured_problem(version, os.environ if environ is None else environ)
    return None


def _unmeasured_problem(version: str, environ: dict) -> str | None:
    """The refusal for arms I and J's kernels on ``version``, not one of :data:`VLLM_FORM_RELEASES`: an unread
    release names the measured ones; a read one also says what is missing and how to run it as the measurement."""
    release = _release(version)
    read = next((name for name in VLLM_FORM_LAYOUTS if _release(name) == release), None)
    if read is None:
        return (f"vLLM {version} is installed, and arms I and J compute the kernels of vLLM "
                f"{', '.join(VLLM_FORM_RELEASES)} (read from its wheel and measured there): {form_install_hint()}, or "
                "set gap.i_pieces: torch (vLLM's maths in plain torch)")
    trial = environ.get(FORM_TRIAL_ENV, "").strip()
    if trial and _release(trial) == release:
        return None
    return (f"vLLM {version} is installed, and arms I and J's pieces were read from its wheel but are not yet "
            f"measured there (missing: {_UNMEASURED.get(read, 'the bitwise live run on a GPU')}): "
            f"{form_install_hint()}, set gap.i_pieces: torch (vLLM's maths in plain torch), or export "
            f"{FORM_TRIAL_ENV}={read} to run it as that measurement")


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
