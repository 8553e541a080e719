"""The doctor's measurement: which comparisons each dtype is scored on (:func:`scoring_plan`), the scoring
matrix over dtypes and attention implementations (:func:`score_matrix`), bf16 re-compared on the rows of a
scaled-down dtype (:func:`paired_cells`), and the result record (:func:`doctor_result`,
:func:`rerecommend`). The decision is :func:`bloggap_plugin.core.recommend.recommend`; the command prints.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bloggap_plugin.core.comparisons import (
    COMPARISONS,
    CPU_FP16_COMPARISONS,
    CPU_ROWS,
    PAIRABLE,
    SAMPLER,
    scoring_passes,
)
from bloggap_plugin.core.errors import one_line
from bloggap_plugin.core.probe import FP16_MAX, Rollouts, compare, compare_sampler, probe_model, skipped_cell
from bloggap_plugin.core.recommend import recommend
from bloggap_plugin.results import ResultDocument

__all__ = [
    "DoctorPlan",
    "Matrix",
    "rows_per_dtype",
    "scoring_plan",
    "total_passes",
    "score_matrix",
    "paired_cells",
    "all_paired_cells",
    "doctor_table",
    "doctor_result",
    "rerecommend",
]

@dataclass(frozen=True)
class DoctorPlan:
    """One dtype's share of the matrix: the comparisons it is scored on and the rollouts (maybe a prefix)."""

    dtype: str
    names: tuple[str, ...]
    rollouts: Rollouts


@dataclass
class Matrix:
    """What :func:`score_matrix` measured: every cell (skipped ones included), the bf16 probe extras per
    attention implementation (for :func:`paired_cells`), the fp16 check and notes for the reader."""

    cells: list[dict] = field(default_factory=list)
    bf16_extras: dict[str, dict] = field(default_factory=dict)
    fp16_check: dict = field(default_factory=lambda: {"skipped": "fp16 not among --dtypes"})
    notes: list[str] = field(default_factory=list)
    vllm_cells: list[dict] = field(default_factory=list)
    """The vLLM sampler column: each dtype and attention's batch-1 scoring of vLLM's samples against vLLM's
    processed log-probs (:mod:`bloggap_plugin.measure.doctor_vllm`)."""


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass


def rows_per_dtype(num_seqs: int, fp16_rows: int | None, fp32_rows: int | None, on_cpu: bool) -> dict[str, int]:
    """Rows each dtype is scored on: bf16 all; fp16 / fp32 as given, else :data:`CPU_ROWS` on CPU, else all."""
    rows = {"bf16": num_seqs}
    for dtype, given in (("fp16", fp16_rows), ("fp32", fp32_rows)):
        rows[dtype] = min(given if given is not None else (CPU_ROWS[dtype] if on_cpu else num_seqs), num_seqs)
    return rows


def scoring_plan(
    dtypes: list[str], rollouts: Rollouts, rows_for: dict[str, int], on_cpu: bool, skip: tuple[str, ...] = (),
    skip_beyond_bf16: tuple[str, ...] = (),
) -> tuple[list[DoctorPlan], list[str]]:
    """Each dtype's comparisons and rows, with a note for every dtype scaled down to fewer rows: fp16 on CPU
    keeps only the comparisons marked ``cpu_fp16``; otherwise comparisons needing more rows are skipped; the
    comparisons in ``skip`` are left out, and those in ``skip_beyond_bf16`` for every dtype but bf16 (a note says
    so)."""
    num_seqs = len(rollouts.rows)
    plan, notes = [], []
    if skip:
        notes.append(f"skipped {', '.join(skip)} to keep the run short on this CPU (--full measures them)")
    beyond = [d for d in dtypes if d != "bf16"] if skip_beyond_bf16 else []
    if beyond:
        notes.append(f"{' and '.join(beyond)}: skipped {', '.join(skip_beyond_bf16)} to keep the run short on this "
                     "CPU (bf16's stands for the device; --full measures them)")
    for dtype in dtypes:
        names = [name for name in COMPARISONS if name not in skip and (dtype == "bf16" or name not in skip_beyond_bf16)]
        subset = rollouts
        rows = rows_for.get(dtype, num_seqs)
        if rows < num_seqs:
            subset = rollouts.subset(rows)
            if dtype == "fp16" and on_cpu:
                names = [name for name in CPU_FP16_COMPARISONS if name not in skip_beyond_bf16]
                notes.append(f"{dtype} scaled down on CPU: {rows} of {num_seqs} rows; skipped "
                             f"{', '.join(n for n in COMPARISONS if n not in names)} (this CPU has no native fp16 "
                             "kernels); the recommendation compares it with bf16 on the same rows")
            else:
                notes.append(f"{dtype} scaled down: {rows} of {num_seqs} rows; the recommendation compares it with "
                             "bf16 on the same rows")
        short = [n for n in names if COMPARISONS[n].rows_needed > rows]
        if short:  # a batch of 32 from 8 rows would be a batch of 8 under the name b1_vs_b32
            names = [n for n in names if n not in short]
            notes.append(f"{dtype}: skipped {', '.join(short)}: each needs as many rows as its batch (two groupings, "
                         f"two batches) and this run scores {rows} rows")
        plan.append(DoctorPlan(dtype, tuple(names), subset))
    return plan, notes


def total_passes(plan: list[DoctorPlan], attns: list[str], vllm: bool = False) -> int:
    """Scoring passes of the whole matrix (a progress-bar total); ``vllm``: with the sampler column's batch-1 pass
    of each dtype and attention."""
    return sum(scoring_passes(list(p.names)) + (scoring_passes([SAMPLER]) if vllm else 0) for p in plan) * len(attns)


def _fp16_check(hidden: dict, attn: str) -> dict:
    check = dict(hidden, attn=attn, fp16_max=FP16_MAX)
    check["headroom"] = FP16_MAX / check["max_abs_hidden"] if check["max_abs_hidden"] > 0 else None
    check["ok"] = check["nonfinite_logprobs"] == 0 and check["max_abs_hidden"] < FP16_MAX / 2
    return check


def _score_vllm(model, vllm: Rollouts, dtype: str, attn: str, band: float, matrix: Matrix, scored) -> None:
    """The sampler column's cell of one loaded model and attention: its batch-1 scoring of vLLM's samples ``vllm``
    against vLLM's log-probs (the probe's sampler comparison); a failure is recorded as a skipped cell."""
    try:
        found, _ = probe_model(model, vllm, [SAMPLER], band=band, progress=lambda label: scored(f"vLLM samples {label}"))
    except Exception as err:  # noqa: BLE001 - recorded, the run continues
        reason = f"{dtype}/{attn} on vLLM's samples failed: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
        matrix.vllm_cells.append(skipped_cell(reason, dtype=dtype, attn=attn, comparison=SAMPLER))
        return
    for c in found:
        c.update(dtype=dtype, attn=attn)
    matrix.vllm_cells += found


def _skip_vllm(vllm: Rollouts | None, reason: str, dtype: str, attn: str, matrix: Matrix, bar) -> None:
    """Where a scoring could not run, its sampler-column cell is skipped with the same reason."""
    if vllm is not None:
        matrix.vllm_cells.append(skipped_cell(reason, dtype=dtype, attn=attn, comparison=SAMPLER))
        bar.update(scoring_passes([SAMPLER]))


def _score_dtype(model, part: DoctorPlan, attns: list[str], band: float, matrix: Matrix, bar, lap,
                 vllm: Rollouts | None = None) -> None:
    """Every attention implementation of one loaded model: cells (and skips) into ``matrix``; ``lap(name)`` after
    every scoring pass. ``vllm``: vLLM's samples (as many rows as ``part``), scored for the sampler column."""
    dtype, names = part.dtype, list(part.names)
    for attn_index, attn in enumerate(attns):
        bar.set_postfix_str(f"{dtype}/{attn}")
        try:
            model.set_attn_implementation(attn)
        except Exception as err:  # noqa: BLE001 - recorded per cell, the run continues
            reason = f"attn_implementation {attn!r} unavailable: {str(err).splitlines()[0][:160]}"
            matrix.cells += [skipped_cell(reason, dtype=dtype, attn=attn, comparison=n) for n in names]
            bar.update(scoring_passes(names))
            _skip_vllm(vllm, reason, dtype, attn, matrix, bar)
            continue
        hidden = dtype == "fp16" and attn_index == 0

        def scored(label: str, dtype=dtype, attn=attn, hidden=hidden) -> None:
            lap(f"score {dtype}/{attn} {label}{' + fp16 check' if hidden and label == 'b1' else ''}")
            bar.update(1)

        try:
            found, extras = probe_model(model, part.rollouts, names, band=band, hidden_check=hidden, progress=scored)
        except Exception as err:  # noqa: BLE001 - e.g. a kernel missing for this dtype/device
            reason = f"{dtype}/{attn} failed: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
            matrix.cells += [skipped_cell(reason, dtype=dtype, attn=attn, comparison=n) for n in COMPARISONS]
            matrix.notes.append(reason)
            _skip_vllm(vllm, reason, dtype, attn, matrix, bar)
            continue
        for c in found:
            c.update(dtype=dtype, attn=attn)
        matrix.cells += found
        if dtype == "bf16":
            matrix.bf16_extras[attn] = extras
        matrix.cells += [
            skipped_cell(f"{dtype} scaled down (see notes)", dtype=dtype, attn=attn, comparison=n)
            for n in COMPARISONS if n not in names
        ]
        if hidden:
            matrix.fp16_check = _fp16_check(extras["hidden_check"], attn)
        if vllm is not None:
            _score_vllm(model, vllm, dtype, attn, band, matrix, scored)


def score_matrix(
    load, plan: list[DoctorPlan], attns: list[str], sampler_model, sample_dtype: str, band: float, bar=None,
    lap: Callable[[str], object] | None = None, vllm: Rollouts | None = None,
) -> Matrix:
    """Score every (dtype, attention implementation) of ``plan``. ``load(dtype)`` loads the model in a dtype
    (the sampling model is reused for ``sample_dtype`` and its attention implementation restored); ``bar``
    (tqdm-like: ``update``, ``set_postfix_str``) advances once per scoring pass; ``lap(phase)`` (a
    :class:`~bloggap_plugin.phase_timer.PhaseTimer`'s) is called after each model load and each scoring pass.
    ``vllm``: vLLM's samples of the same prompts, which every scoring also scores (on the dtype's rows) for the
    sampler column (``Matrix.vllm_cells``)."""
    bar = bar or _NoBar()
    lap = lap or (lambda name: None)
    matrix = Matrix()
    sampler_attn = getattr(sampler_model.config, "_attn_implementation", None)
    for part in plan:
        model = sampler_model
        if part.dtype != sample_dtype:
            model = load(part.dtype)
            lap(f"load {part.dtype}")
        rows = len(part.rollouts.rows)
        _score_dtype(model, part, attns, band, matrix, bar, lap, None if vllm is None else vllm.subset(rows))
        if model is not sampler_model:
            del model
        if part.dtype == sample_dtype and sampler_attn:
            sampler_model.set_attn_implementation(sampler_attn)
    return matrix


def paired_cells(extras: dict, rollouts: Rollouts, rows: int, band: float, attn: str) -> list[dict]:
    """bf16 cells re-compared on the first ``rows`` rows, to set beside a dtype scored on only those rows
    (the comparisons marked ``pairable``, and the sampler's)."""
    out = []
    for name in PAIRABLE:
        if name in extras["scored"] and (COMPARISONS[name].batch_size == 1 or rows % COMPARISONS[name].batch_size == 0):
            ref, other = extras["scored"][name]
            out.append(compare(ref[:rows], other.logprobs[:rows], other.mask[:rows], band,
                               comparison=name, dtype="bf16", attn=attn, rows=rows, paired=True))
    out.append(compare_sampler(rollouts, extras["b1"], band, rows,
                               comparison=SAMPLER, dtype="bf16", attn=attn, rows=rows, paired=True))
    return out


def all_paired_cells(matrix: Matrix, rollouts: Rollouts, rows_for: dict[str, int], dtypes: list[str],
                     band: float) -> list[dict]:
    """:func:`paired_cells` for every row count a dtype was scaled down to (needs bf16 in ``dtypes``)."""
    paired: list[dict] = []
    if "bf16" in dtypes and rollouts.sampler_logprobs is not None:
        num_seqs = len(rollouts.rows)
        for rows in sorted({rows_for[d] for d in dtypes if d != "bf16" and rows_for[d] < num_seqs}):
            for attn, extras in matrix.bf16_extras.items():
                paired += paired_cells(extras, rollouts, rows, band, attn)
    return paired


def doctor_table(model: str, cells: list[dict], dtypes: list[str], attns: list[str], notes: str) -> dict:
    """The DOCTOR report table: out-of-band % per comparison (rows) and dtype/attention (columns); ``None``
    where not measured."""
    index = {(c["dtype"], c["attn"], c["comparison"]): c for c in reversed(cells)}  # first cell of a key wins

    def pct(dtype: str, attn: str, name: str) -> float | None:
        c = index.get((dtype, attn, name))
        return None if c is None or c.get("oob") is None else round(100 * c["oob"], 2)

    return {
        "id": "DOCTOR",
        "title": f"bloggap doctor: OOB% per comparison, dtype and attention ({model})",
        "columns": ["comparison"] + [f"{d}/{a}" for d in dtypes for a in attns],
        "rows": [[name] + [pct(d, a, name) for d in dtypes for a in attns] for name in COMPARISONS],
        "notes": notes,
        "reference": None,
        "random_init": model.startswith("tiny-random-"),
    }


def doctor_result(
    *,
    model: str,
    device: torch.device,
    params: dict,
    rollouts: Rollouts,
    matrix: Matrix,
    paired: list[dict],
    recommendation: dict,
    seconds: float,
    timings: dict | None = None,
    vllm_sampler: dict | None = None,
) -> dict:
    """The doctor's JSON record, a :class:`~bloggap_plugin.results.ResultDocument` (the six schema keys, then the
    doctor's own: cells, paired_cells, fp16_check, recommendation...) as a dict. ``params`` holds the
    run's settings (``dtypes``, ``attn``, ``max_new_tokens``, ``seed``, ``sample_dtype``, ``band``...); ``timings``
    the run's phases (:meth:`bloggap_plugin.phase_timer.PhaseTimer.record`); ``vllm_sampler`` the sampler column
    (:func:`bloggap_plugin.measure.doctor_vllm.column_record`, with its DOCTOR-vllm table)."""
    import transformers

    from bloggap_plugin.envinfo import device_tag, environment_record
    from bloggap_plugin.measure.doctor_vllm import column_table

    band = params["band"]
    notes = (
        f"{len(rollouts.rows)} rollouts x {params['max_new_tokens']} tokens ({rollouts.tokens} completion tokens) "
        f"sampled once in {params['sample_dtype']}, seed {params['seed']}; share of completion tokens with "
        f"exp(dlogp) outside [{1 - band:.2f}, {1 + band:.2f}]; empty cells not measured. "
        + " ".join(f"Note: {n}." for n in matrix.notes)
        + f" Recommendation: {one_line(recommendation['text'])}"
    )
    extra = {
        "model": model,
        "device": device_tag(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokens": rollouts.tokens,
        "rows": len(rollouts.rows),
        "max_new_tokens": params["max_new_tokens"],
        "band": band,
        "units": "oob, ci_low, ci_high are fractions of completion tokens; abs_dlogp_* in nats",
        "sampler": rollouts.sampler,
        "cells": matrix.cells,
        "paired_cells": paired,
        "fp16_check": matrix.fp16_check,
        "recommendation": recommendation,
        "seconds": round(seconds, 1),
    }
    if timings is not None:
        extra["timings"] = timings
    tables = [doctor_table(model, matrix.cells, params["dtypes"], params["attn"], notes)]
    if vllm_sampler is not None:
        extra["vllm_sampler"] = vllm_sampler
        tables.append(column_table(vllm_sampler, model))
    # a benchmark result document, so `bloggap report` can render this file from benchmarks/results/<device>/
    return ResultDocument(
        benchmark="doctor",
        env=environment_record(device, model=model, seed=params["seed"], tokens=rollouts.tokens),
        params=params,
        results={"see": "cells, paired_cells, fp16_check, recommendation at the top level"},
        tables=tables,
        extra=extra,
    ).to_dict()


_STORED_DTYPES = ("bf16", "fp16", "fp32")


def _number(value) -> bool:
    """A finite JSON number (:func:`bloggap_plugin.results.is_number`, not inf or NaN)."""
    from bloggap_plugin.results import is_number

    return is_number(value) and math.isfinite(value)


def _check_cell(cell, where: str) -> None:
    if not isinstance(cell, dict):
        raise ValueError(f"{where} must be an object, got {type(cell).__name__}")
    for key in ("dtype", "attn", "comparison"):
        if not isinstance(cell.get(key), str):
            raise ValueError(f"{where} lacks the text field {key!r} (got {cell.get(key)!r})")
    if cell["dtype"] not in _STORED_DTYPES:
        raise ValueError(f"{where}.dtype {cell['dtype']!r} is not one of {', '.join(_STORED_DTYPES)}")
    if cell.get("skipped") and cell.get("oob") is None:
        return
    for key in ("oob", "ci_low", "ci_high"):
        value = cell.get(key)
        if key == "oob" or value is not None:
            if not _number(value) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{where}.{key} = {value!r}: a share must be a number in [0, 1]")
    for key in ("oob_count", "n"):
        value = cell.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{where}.{key} = {value!r}: a count must be a whole number >= 0")
    if cell["oob_count"] > cell["n"]:
        raise ValueError(f"{where}.oob_count = {cell['oob_count']} exceeds its n = {cell['n']}")
    for key in ("abs_dlogp_mean", "abs_dlogp_max"):
        value = cell.get(key)
        if value is not None and (not _number(value) or value < 0):
            raise ValueError(f"{where}.{key} = {value!r}: must be a number >= 0")


def check_stored(result) -> None:
    """Raise ``ValueError`` naming the field for a stored doctor result a recommendation cannot be derived from:
    missing keys, wrong types, or impossible values (a share outside [0, 1], a negative count, more tokens out of
    band than scored)."""
    from bloggap_plugin.results import SUPPORTED_SCHEMA_VERSIONS

    if not isinstance(result, dict):
        raise ValueError(f"not a bloggap doctor JSON: a JSON object is needed, got {type(result).__name__}")
    for key in ("benchmark", "schema_version", "cells", "fp16_check", "params", "recommendation"):
        if key not in result:
            raise ValueError(f"not a bloggap doctor JSON: missing key {key!r}")
    if result["benchmark"] != "doctor":
        raise ValueError(f"benchmark {result['benchmark']!r}: not a bloggap doctor JSON (benchmark 'doctor')")
    if result["schema_version"] not in SUPPORTED_SCHEMA_VERSIONS:
        raise ValueError(f"schema_version {result['schema_version']!r} is not one this version reads "
                         f"({', '.join(map(str, SUPPORTED_SCHEMA_VERSIONS))})")
    for key in ("cells", "paired_cells"):
        if not isinstance(result.get(key, []), list):
            raise ValueError(f"{key} must be a list of cells, got {type(result[key]).__name__}")
        for index, cell in enumerate(result.get(key, [])):
            _check_cell(cell, f"{key}[{index}]")
    if not isinstance(result.get("model"), str):
        raise ValueError(f"model must be the model's name, got {result.get('model')!r}")
    for key in ("rows", "max_new_tokens", "tokens"):
        value = result.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{key} = {value!r}: a count must be a whole number >= 0")
    if not _number(result.get("band")) or not 0.0 < result["band"] < 1.0:
        raise ValueError(f"band = {result.get('band')!r}: must be a number in (0, 1)")
    params = result["params"]
    if not isinstance(params, dict):
        raise ValueError(f"params must be an object, got {type(params).__name__}")
    for key in ("dtypes", "attn"):
        if not isinstance(params.get(key), list) or not all(isinstance(v, str) for v in params[key]):
            raise ValueError(f"params.{key} must be a list of names, got {params.get(key)!r}")
    if not isinstance(params.get("sample_dtype"), str) or isinstance(params.get("seed"), bool) or not isinstance(
            params.get("seed"), int):
        raise ValueError(f"params needs sample_dtype (a name) and seed (a whole number), got "
                         f"{params.get('sample_dtype')!r} and {params.get('seed')!r}")
    check = result["fp16_check"]
    if not isinstance(check, dict):
        raise ValueError(f"fp16_check must be an object, got {type(check).__name__}")
    if not check.get("skipped"):
        needed = {"rows": int, "attn": str, "nonfinite_logprobs": int, "n": int, "max_abs_hidden": (int, float),
                  "ok": bool}
        for key, kind in needed.items():
            if key not in check or not isinstance(check[key], kind) or (kind is int and isinstance(check[key], bool)):
                raise ValueError(f"fp16_check lacks {key!r} of the right type (got {check.get(key)!r})")
    if not isinstance(result["recommendation"], dict):
        raise ValueError(f"recommendation must be an object, got {type(result['recommendation']).__name__}")
    _check_cell_keys(result, params)
    _check_vllm_sampler(result.get("vllm_sampler"))


def _check_vllm_sampler(record) -> None:
    """The sampler column of a stored run (absent in runs before it): ``{"absent": reason}`` or cells (and arm I's
    form's cell) with ``exact_count`` (bit for bit equal tokens) between 0 and ``n``."""
    if record is None:
        return
    if not isinstance(record, dict) or not (isinstance(record.get("absent"), str) or isinstance(record.get("cells"), list)):
        raise ValueError(f"vllm_sampler must be an object with 'absent' (a reason) or 'cells' (a list), got {record!r}")
    arm_i = record.get("arm_i", {})
    if not isinstance(arm_i, dict):
        raise ValueError(f"vllm_sampler.arm_i must be an object, got {type(arm_i).__name__}")
    cells = [(f"vllm_sampler.cells[{index}]", cell) for index, cell in enumerate(record.get("cells", []))]
    for where, cell in cells + ([("vllm_sampler.arm_i.cell", arm_i["cell"])] if "cell" in arm_i else []):
        _check_cell(cell, where)
        if cell.get("oob") is None:
            continue
        if cell["n"] == 0:
            raise ValueError(f"{where}.n = 0: a measured cell scores at least one token")
        exact = cell.get("exact_count")
        if isinstance(exact, bool) or not isinstance(exact, int) or not 0 <= exact <= cell["n"]:
            raise ValueError(f"{where}.exact_count = {exact!r}: a count of tokens must be a whole number in [0, n]")


def _check_cell_keys(result: dict, params: dict) -> None:
    """Each cell a known comparison, of a dtype and attention the run measured, and measured once (a repeated cell
    would count twice in the recommendation)."""
    for key, extra in (("cells", ()), ("paired_cells", ("rows",))):
        seen = set()
        for index, cell in enumerate(result.get(key, [])):
            where = f"{key}[{index}]"
            if cell["comparison"] not in COMPARISONS:
                raise ValueError(f"{where}.comparison {cell['comparison']!r} is not a doctor comparison "
                                 f"({', '.join(COMPARISONS)})")
            if cell["dtype"] not in params["dtypes"] or cell["attn"] not in params["attn"]:
                raise ValueError(f"{where} is {cell['dtype']}/{cell['attn']}, which params.dtypes "
                                 f"{params['dtypes']} and params.attn {params['attn']} do not list")
            ident = (cell["dtype"], cell["attn"], cell["comparison"], *(cell.get(name) for name in extra))
            if ident in seen:
                raise ValueError(f"{where} repeats the cell {'/'.join(map(str, ident))}; each cell is measured once")
            seen.add(ident)


def rerecommend(result: dict) -> dict:
    """Recompute ``result['recommendation']`` from its stored cells with this version's
    :func:`~bloggap_plugin.core.recommend.recommend`.

    The measured cells are untouched; the new recommendation records that it was recomputed, and the DOCTOR
    table's notes are updated to match.
    """
    from bloggap_plugin import __version__

    check_stored(result)
    device_type = "cpu" if result.get("device") == "cpu" else "cuda"
    old = result["recommendation"]
    try:
        new = recommend(result["cells"], result["fp16_check"], device_type, result.get("paired_cells", []),
                        result.get("vllm_sampler"))
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"a field the recommendation reads is missing or of the wrong type ({type(err).__name__}: "
                         f"{err})") from None
    if old.get("notes"):
        new["notes"] = old["notes"]
    new["recomputed"] = {"by": f"bloggap doctor --from-json (bloggap {__version__})", "previous_arm": old.get("arm")}
    result["recommendation"] = new
    for table in result.get("tables", []):
        if table.get("id") == "DOCTOR" and " Recommendation: " in table.get("notes", ""):
            table["notes"] = table["notes"].split(" Recommendation: ")[0] + f" Recommendation: {one_line(new['text'])}"
    return result
