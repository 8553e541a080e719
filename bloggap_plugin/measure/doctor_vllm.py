"""The doctor's vLLM sampler column: where vLLM and a CUDA GPU are present, the doctor also samples its prompts with
vLLM, built as TRL 1.16's colocate engine builds it (:func:`~bloggap_plugin.trl.vllm_colocate.trl_colocate_llm_kwargs`),
and every scoring it measures (each dtype and attention implementation, teacher-forced batch 1) scores those samples;
:func:`bloggap_plugin.core.probe.compare_sampler` compares them with vLLM's processed log-prob of each sampled token.

Where the column cannot be measured, :func:`absent_reason` says why in one line (turned off, no CUDA device, vLLM not
installed or outside the supported range, no model folder for vLLM to load). vLLM is never imported on a machine
where it is absent: the version is read from package metadata.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from bloggap_plugin.core.probe import Rollouts, Row

__all__ = ["NO_VLLM_FLAG", "absent_reason", "absent_here", "model_folder", "engine_classes", "sample_with_vllm",
           "vllm_rollouts", "arm_i_pieces", "arm_i_row", "column_record", "column_table"]

NO_VLLM_FLAG = "--no-vllm"


def _not_installed() -> str:
    from bloggap_plugin.core.vllm.versions import VLLM_FORM_RELEASES, supported_text

    return (f'vLLM is not installed here: pip install -e ".[vllm]" (this project\'s extra, vLLM '
            f"{VLLM_FORM_RELEASES[-1]}) or any {supported_text()} adds the column")


def absent_reason(*, enabled: bool, device_type: str, version: str | None, folder: str | None, model: str) -> str | None:
    """Why the column is absent, in one line, or ``None`` when it can be measured: ``enabled`` is ``False`` under
    ``--no-vllm``; ``device_type`` the doctor's device (``cuda`` needed); ``version`` the installed vLLM's (``None``:
    not installed); ``folder`` the model folder vLLM would load (``None``: there is none for ``model``)."""
    from bloggap_plugin.core.vllm.versions import vllm_problem

    if not enabled:
        return f"turned off ({NO_VLLM_FLAG})"
    if device_type != "cuda":
        return f"no CUDA device: the doctor ran on {device_type}, and vLLM samples on a CUDA GPU"
    if version is None:
        return _not_installed()
    problem = vllm_problem(version=version)
    if problem:
        return problem
    if folder is None:
        return (f"vLLM loads a model folder with config.json, and {model!r} has none (a .gguf file or a tiny-random-* "
                "model built in memory): save it with save_pretrained and pass the folder as --model")
    return None


def model_folder(model: torch.nn.Module) -> str | None:
    """The folder TRL's colocate engine loads (the model's ``name_or_path``), where it holds ``config.json``; else
    ``None``."""
    name = str(getattr(model, "name_or_path", "") or "")
    return name if name and (Path(name) / "config.json").is_file() else None


def absent_here(enabled: bool, device_type: str, model: torch.nn.Module, spec: str) -> str | None:
    """:func:`absent_reason` for this machine: the installed vLLM read from package metadata (not imported) and
    ``model``'s folder."""
    from bloggap_plugin.core.vllm.versions import installed_vllm

    return absent_reason(enabled=enabled, device_type=device_type, version=installed_vllm(),
                         folder=model_folder(model), model=spec)


def vllm_rollouts(rows: Sequence[Row], logprobs: Sequence[Sequence[float | None]], pad_token_id: int,
                  prompts: Sequence[str], record: dict) -> Rollouts:
    """:class:`~bloggap_plugin.core.probe.Rollouts` of vLLM's samples: ``rows`` (prompt, completion token ids) and,
    per completion token, vLLM's processed log-prob of the sampled token (``None``: NaN, as TRL's
    ``extract_logprobs`` gives it) as ``sampler_logprobs`` ``[N, C]`` fp32."""
    if len(rows) != len(logprobs):
        raise ValueError(f"vLLM returned {len(logprobs)} log-prob rows for {len(rows)} completions")
    width = max(len(row.completion) for row in rows)
    values = torch.zeros((len(rows), width), dtype=torch.float32)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for index, (row, row_logprobs) in enumerate(zip(rows, logprobs, strict=True)):
        if len(row_logprobs) != len(row.completion):
            raise ValueError(f"vLLM completion {index}: {len(row.completion)} tokens but {len(row_logprobs)} log-probs")
        values[index, : len(row_logprobs)] = torch.tensor(
            [float("nan") if v is None else v for v in row_logprobs], dtype=torch.float32)
        mask[index, : len(row_logprobs)] = True
    return Rollouts(list(rows), values, mask, pad_token_id, list(prompts), dict(record))


def engine_classes() -> tuple[Any, Any, str]:
    """``(LLM, SamplingParams, version)`` of the installed vLLM (imported here, only when the column is measured; the
    CPU tests put a stand-in here)."""
    import vllm
    from vllm import LLM, SamplingParams

    return LLM, SamplingParams, vllm.__version__


def sample_with_vllm(folder: str, rollouts: Rollouts, new_tokens: int, seed: int) -> Rollouts:
    """Sample one completion of exactly ``new_tokens`` tokens for each prompt of ``rollouts`` (the doctor's prompt
    token ids) with a vLLM engine built as TRL's colocate engine is (``seed``: the engine's seed), untruncated at
    temperature 1 (the doctor's sampling), ``logprobs=0``; the engine's classes come from :func:`engine_classes`. The
    record says whether the engine ran vLLM's batch-invariant mode (``batch_invariant``), which arm I's engine runs."""
    from trl.generation.vllm_generation import extract_logprobs

    from bloggap_plugin.core.vllm.kernels import vllm_batch_invariant_active
    from bloggap_plugin.trl.vllm_colocate import (
        colocate_process_env,
        trl_colocate_llm_kwargs,
        trl_colocate_sampling_kwargs,
    )

    llm_class, params_class, version = engine_classes()
    prompt_ids = [list(row.prompt) for row in rollouts.rows]
    llm_kwargs = trl_colocate_llm_kwargs(folder, max_num_seqs=len(prompt_ids), seed=seed)
    # the doctor forces the length (its rollouts ignore eos), so TRL's settings plus ignore_eos
    settings = SimpleNamespace(temperature=rollouts.sampler.get("temperature", 1.0),
                               generation_kwargs={"ignore_eos": True})
    sampling = trl_colocate_sampling_kwargs(settings, max_tokens=new_tokens)
    with colocate_process_env():
        llm = llm_class(**llm_kwargs)
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                               sampling_params=params_class(**sampling), use_tqdm=False)
    completions = [list(out.token_ids) for request in outputs for out in request.outputs]
    logprobs, token_ids = extract_logprobs(outputs)
    if logprobs is None:
        raise RuntimeError("vLLM returned no log-probs (logprobs=0 was asked for)")
    if len(completions) != len(prompt_ids) or any(len(c) != new_tokens for c in completions):
        raise RuntimeError(f"vLLM returned {[len(c) for c in completions]} tokens for {len(prompt_ids)} prompts, "
                           f"expected {new_tokens} each (ignore_eos)")
    rows = [Row(tuple(ids), tuple(tokens)) for ids, tokens in zip(prompt_ids, completions, strict=True)]
    config = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    engine_dtype = str(getattr(config, "dtype", "unread")).removeprefix("torch.")
    record = {"engine": "vllm", "vllm": version, "engine_dtype": engine_dtype, "llm_kwargs": llm_kwargs,
              "sampling": sampling, "batch_invariant": vllm_batch_invariant_active(),
              "max_new_tokens": new_tokens, "temperature": sampling["temperature"],
              "sampler_logprobs_from": "vLLM processed_logprobs of the sampled token (logprobs=0)"}
    del llm
    sampled = [[values[ids.index(token)] for values, ids, token in zip(row_values, row_ids, tokens, strict=True)]
               for row_values, row_ids, tokens in zip(logprobs, token_ids, completions, strict=True)]
    return vllm_rollouts(rows, sampled, rollouts.pad_token_id, rollouts.prompts, record)


def arm_i_pieces(device_type: str, version: str | None) -> str:
    """The pieces arm I's form scores with here: ``"all"`` (vLLM's own kernels) on CUDA with a vLLM whose kernels arms
    I and J compute (:func:`~bloggap_plugin.core.vllm.versions.vllm_problem` with ``needs_form``), else ``"torch"``
    (vLLM's maths in plain torch)."""
    from bloggap_plugin.core.vllm.versions import vllm_problem

    usable = device_type == "cuda" and version is not None and vllm_problem(needs_form=True, version=version) is None
    return "all" if usable else "torch"


def arm_i_row(model: torch.nn.Module, vllm: Rollouts, band: float, pieces: str) -> dict:
    """Arm I's form (``make_plan(model, "vllm", pieces=pieces)``: a bf16 shadow of ``model`` computed as vLLM computes
    it) scoring vLLM's samples, every row in one batch in TRL's layout (prompts left-padded, positions from the mask,
    as the engine prefills them), against vLLM's log-probs: ``{"pieces", "cell"}``, or ``{"pieces", "absent"}``
    naming why it could not score."""
    from bloggap_plugin.core.plans import make_plan
    from bloggap_plugin.core.plans.vllm_shadow import check_vllm_form_supported
    from bloggap_plugin.core.probe import compare, left_pad

    try:
        check_vllm_form_supported(model)
    except ValueError as err:
        return {"pieces": pieces, "absent": f"arm I's form: {err}"}
    ids, mask = left_pad([list(r.prompt) + list(r.completion) for r in vllm.rows], vllm.pad_token_id)
    width = vllm.sampler_logprobs.shape[1]
    try:
        plan = make_plan(model, "vllm", pieces=pieces)
        try:
            with torch.no_grad():
                scores = plan.token_logprobs(ids, mask, width, positions="mask").float().cpu()
        finally:
            plan.close()
    except Exception as err:  # noqa: BLE001 - recorded, the run continues
        return {"pieces": pieces, "absent": f"arm I's form failed: {type(err).__name__}: "
                                            f"{str(err).splitlines()[0][:200] if str(err) else ''}"}
    cell = compare(vllm.sampler_logprobs, scores, vllm.sampler_mask, band, comparison="sampler_vs_b1", dtype="bf16",
                   attn="vllm_form", rows=len(vllm.rows), batch_size=len(vllm.rows))
    return {"pieces": pieces, "cell": cell}


def column_record(cells: list[dict] | None, absent: str | None, sampler: dict | None = None,
                  arm_i: dict | None = None) -> dict:
    """The result JSON's ``vllm_sampler``: ``{"absent": reason}``, or the measured cells (one per dtype and attention
    implementation: ``oob`` the out-of-band share, ``exact_count`` of ``n`` tokens bit for bit equal), the sampler's
    record and arm I's form (:func:`arm_i_row`)."""
    if absent is not None:
        return {"absent": absent}
    return {"units": "oob: share of completion tokens with exp(trainer - sampler) outside the band; bitwise: "
                     "exact_count / n, tokens whose log-probs are bit for bit equal",
            "trainer_side": "teacher-forced batch 1 in each dtype and attention implementation; arm I: its form, "
                            "every row in one batch",
            "sampler": sampler or {}, "cells": cells or [], "arm_i": arm_i or {"absent": "not scored"}}


def column_table(record: dict, model: str) -> dict:
    """The DOCTOR-vllm report table of a ``vllm_sampler`` record: per scoring (dtype/attention), out of band % and
    bitwise % of the tokens (``None`` where skipped); no rows, and the reason in the notes, where absent."""
    from bloggap_plugin.core.recommend import arm_i_engine_note

    rows, notes = [], f"absent: {record['absent']}" if "absent" in record else ""
    for c in record.get("cells", []):
        measured = c.get("oob") is not None
        rows.append([f"{c['dtype']}/{c['attn']}", round(100 * c["oob"], 2) if measured else None,
                     round(100 * c["exact_count"] / c["n"], 2) if measured else None, c.get("n", 0)])
    arm_i = record.get("arm_i", {})
    if "cell" in arm_i:
        c = arm_i["cell"]
        rows.append([f"arm I (pieces {arm_i['pieces']})", round(100 * c["oob"], 2),
                     round(100 * c["exact_count"] / c["n"], 2), c["n"]])
    if "absent" not in record:
        sampler = record.get("sampler", {})
        notes = (f"vLLM {sampler.get('vllm', '?')} engine built as TRL 1.16's colocate engine (dtype "
                 f"{sampler.get('engine_dtype', '?')}), untruncated at temperature {sampler.get('temperature', '?')}; "
                 "its processed log-prob of each sampled token vs each scoring at batch 1: share of tokens with "
                 "exp(trainer - sampler) outside the band, and share bit for bit equal; arm I's form scores every row "
                 "in one batch" + (f" (absent: {arm_i['absent']})" if "absent" in arm_i else "")
                 + arm_i_engine_note(sampler) + ".")
    return {"id": "DOCTOR-vllm", "title": "bloggap doctor: vLLM sampler vs each scoring, OOB% and bitwise%",
            "columns": ["scoring", "out of band %", "bitwise %", "tokens"], "rows": rows, "notes": notes,
            "reference": None, "random_init": model.startswith("tiny-random-"), "plot": False}
