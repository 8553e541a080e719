"""``bloggap doctor``: how large is the batch-shape log-prob gap for this model on this machine, which arm
removes it, and at what cost.

Samples rollouts once from the model itself, rescores the same tokens teacher-forced under several batch
shapes for every requested dtype and attention implementation (``bloggap_plugin.core.probe``), prints a
table and a recommendation derived from the measured cells, and optionally writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from bloggap_plugin.commands._measured import configure_with
from bloggap_plugin.core.comparisons import CPU_ROWS  # torch-free: `bloggap --help` stays fast

HELP = "Measure the batch-shape log-prob gap of a model on this machine and recommend an arm."
DTYPES = ("bf16", "fp16", "fp32")
ATTNS = ("sdpa", "eager", "flex_attention")
GPU_ATTN = "sdpa,eager"
CPU_SCALE = {"rows": 16, "new_tokens": 16, "attn": "sdpa", "skip": ("copy8_vs_alone",)}
"""What a run on a CPU measures where the flags leave it to the doctor (bf16 is emulated on most CPUs, about ten
times slower than fp32): fewer rollouts and tokens, one attention implementation, and no comparison that scores
each row in a batch of its own copies (``skip``; ``--attn`` given keeps them). The run says what it scaled down."""


def _csv(choices):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(choices)}, got {text!r}")
        return items

    return parse


@dataclass
class DoctorConfig:
    """``bloggap doctor``'s settings (each field is a flag; ``--config FILE.yaml`` sets any of them).

    ``dtypes`` and ``attn`` are written as comma lists and parsed into lists of names."""

    model: str = field(default="smollm2", metadata={"help": (
        "model: smollm2 (default, offline), gemma3-270m (offline after `make gemma`; Gemma terms apply), a local "
        "model folder with config.json, a .gguf file, a tiny-random-* test model, or a hub id org/name")})
    device: str | None = field(default=None, metadata={"help": "cpu, cuda, cuda:1 ... (default: cuda if available)"})
    dtypes: str = field(default=",".join(DTYPES), metadata={"help": "comma list (default bf16,fp16,fp32)",
                                                           "parse": _csv(DTYPES)})
    attn: str | None = field(default=None, metadata={
        "help": f"comma list of {', '.join(ATTNS)} (default {GPU_ATTN} on GPU, {CPU_SCALE['attn']} on CPU)",
        "parse": _csv(ATTNS)})
    rows: int | None = field(default=None, metadata={
        "help": f"rollouts (default 64 on GPU, {CPU_SCALE['rows']} on CPU)", "min": 1, "deprecated": ["--num-seqs", "--num_seqs"]})
    new_tokens: int | None = field(default=None, metadata={
        "help": f"tokens per rollout (default 64 on GPU, {CPU_SCALE['new_tokens']} on CPU)", "min": 1,
        "deprecated": ["--max-new-tokens", "--max_new_tokens"]})
    seed: int = field(default=1234, metadata={"help": "sampling seed (default 1234)", "min": 0, "max": 2**32 - 1})
    dtype: Literal["bf16", "fp16", "fp32"] = field(default="bf16", metadata={
        "help": "dtype of the model that samples the rollouts (bf16)", "deprecated": ["--sample-dtype", "--sample_dtype"]})
    gen_batch_size: int = field(default=8, metadata={"help": "prompts per generate call (default 8)", "min": 1})
    fp16_rows: int | None = field(default=None, metadata={
        "help": f"rows scored in fp16 (default: all on GPU, {CPU_ROWS['fp16']} on CPU, where fp16 is slow)", "min": 1})
    fp32_rows: int | None = field(default=None, metadata={
        "help": f"rows scored in fp32 (default: all on GPU, {CPU_ROWS['fp32']} on CPU)", "min": 1})
    band: float = field(default=0.1, metadata={"help": "ratio band half-width (default 0.1)", "above": 0, "below": 1})
    json_path: str | None = field(default=None, metadata={"help": "write the results as JSON to this path",
                                                          "aliases": ["--json"], "metavar": "PATH"})
    no_progress: bool = field(default=False, metadata={"help": "no progress bars"})
    from_json: str | None = field(default=None, metadata={
        "help": "measure nothing: re-read a doctor JSON (yours or a colleague's), recompute the recommendation "
                "from its cells with this version's logic, print it (and --json it)", "metavar": "PATH"})


configure = configure_with(DoctorConfig)


def _nats(value: float | None) -> str:
    """A |dlogp| statistic in nats; a stored run holds ``None`` where it was NaN (non-finite log-probs)."""
    return "not finite" if value is None or value != value else f"{value:.2e}"


def format_table(cells: list[dict], dtypes: list[str], attns: list[str]) -> str:
    """Comparisons as rows, dtype/attn as columns: out-of-band % and count (``-`` = skipped)."""
    from bloggap_plugin.core.comparisons import COMPARISONS, HEADLINE, SAMPLER
    from bloggap_plugin.results import text_table

    columns = [(d, a) for d in dtypes for a in attns]
    index = {(c["dtype"], c["attn"], c["comparison"]): c for c in cells}
    header = ["comparison"] + [f"{d}/{a}" for d, a in columns]
    body = []
    for name in COMPARISONS:
        line = [name]
        present = False
        for d, a in columns:
            c = index.get((d, a, name))
            if c is None or c.get("oob") is None:
                line.append("-")
            else:
                present = True
                line.append(f"{100 * c['oob']:.2f}% ({c['oob_count']}/{c['n']})")
        if present:
            body.append(line)
    out = text_table(header, body, rule=True)
    # a second block: mean / max |dlogp| for the headline comparisons
    out.append("")
    out.append("mean / max |dlogp| (nats), b1 vs b8 left (0..L-1) and sampler vs b1:")
    for d, a in columns:
        parts = []
        for name in (HEADLINE, SAMPLER):
            c = index.get((d, a, name))
            if c is not None and c.get("oob") is not None:
                parts.append(f"{name} {_nats(c['abs_dlogp_mean'])} / {_nats(c['abs_dlogp_max'])}")
        if parts:
            out.append(f"  {d}/{a}: " + "; ".join(parts))
    return "\n".join(out)


def _check(config: DoctorConfig) -> None:
    """Every check on the settings that needs no model (``UsageError``: one line, before anything loads)."""
    from bloggap_plugin._io import check_writable_file, foreign_file_problem
    from bloggap_plugin.commands._measured import check_counts
    from bloggap_plugin.core.errors import UsageError

    if config.json_path:  # before measuring: a bad path must not cost a run
        problem = (check_writable_file(config.json_path, "--json", create_parents=True)
                   or foreign_file_problem(config.json_path, "--json", is_doctor_json))
        if problem:
            raise UsageError(problem)
    if config.from_json:
        _check_nothing_to_measure(config)
        return
    check_counts(config, ("rows", "new_tokens", "gen_batch_size", "fp16_rows", "fp32_rows"))
    if not 0.0 < config.band < 1.0:
        raise UsageError(f"--band must be in (0, 1) (half-width b of the ratio band [1-b, 1+b]), got {config.band}")


_FROM_JSON_FLAGS = ("from_json", "json_path", "no_progress")
"""The settings ``--from-json`` reads; every other one sets a measurement, which it does not make."""


def _check_nothing_to_measure(config: DoctorConfig) -> None:
    """With ``--from-json``, refuse a measurement setting (``--model``, ``--rows`` ...): it would be ignored."""
    import dataclasses

    from bloggap_plugin.core.errors import UsageError

    def default(spec: dataclasses.Field):  # as argparse gives it: a text default through the field's parser
        parse = spec.metadata.get("parse")
        return parse(spec.default) if parse and isinstance(spec.default, str) else spec.default

    given = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(DoctorConfig)
             if f.name not in _FROM_JSON_FLAGS and getattr(config, f.name) not in (f.default, default(f))]
    if given:
        raise UsageError(f"--from-json re-reads a stored run and measures nothing, so {', '.join(given)} would be "
                         "ignored: drop them, or drop --from-json to measure")


def _from_json(config: DoctorConfig) -> int:
    """Measure nothing: re-derive the recommendation of a stored doctor JSON, print it (and write it)."""
    from bloggap_plugin._input_files import display_name, load_json_file
    from bloggap_plugin.core.errors import UsageError
    from bloggap_plugin.measure.doctor_matrix import rerecommend

    document = load_json_file(config.from_json, f"--from-json {display_name(config.from_json)}",
                              "give a bloggap doctor JSON", kind="a bloggap doctor JSON")
    try:
        result = rerecommend(document)
    except ValueError as err:
        raise UsageError(f"cannot re-read --from-json {config.from_json}: {err}; give a bloggap doctor JSON") from None
    _print_result(result)
    _write_json(result, config.json_path)
    return 0


def run(args: argparse.Namespace) -> int:
    """Measure (sample once, score the matrix), decide (the recommendation), render (print, write JSON)."""
    import torch
    from tqdm.auto import tqdm

    from bloggap_plugin.commands._config import config_from_args
    from bloggap_plugin.core.recommend import recommend
    from bloggap_plugin.measure import doctor_matrix
    from bloggap_plugin.measure import rollouts as sampling
    from bloggap_plugin.models import check_model_spec, load_model, resolve_device

    config = config_from_args(DoctorConfig, args)
    _check(config)
    if config.from_json:
        return _from_json(config)
    device = torch.device(resolve_device(config.device))
    check_model_spec(config.model)
    on_cpu = device.type == "cpu"
    num_seqs, max_new, skip = _scaled_for(config, on_cpu)
    rows_for = doctor_matrix.rows_per_dtype(num_seqs, config.fp16_rows, config.fp32_rows, on_cpu)
    started = time.perf_counter()

    sampler_model, tokenizer = load_model(config.model, dtype=config.dtype, device=device)
    with tqdm(total=num_seqs, desc="sampling", unit="row", file=sys.stderr, disable=config.no_progress) as bar:
        rollouts = sampling.sample_rollouts(
            sampler_model, tokenizer, num_seqs=num_seqs, max_new_tokens=max_new, seed=config.seed,
            batch_size=config.gen_batch_size, progress=bar.update,
        )
    plan, notes = doctor_matrix.scoring_plan(config.dtypes, rollouts, rows_for, on_cpu, skip)
    total = doctor_matrix.total_passes(plan, config.attn)
    with tqdm(total=total, desc="scoring", unit="pass", file=sys.stderr, disable=config.no_progress) as bar:
        matrix = doctor_matrix.score_matrix(lambda dtype: load_model(config.model, dtype=dtype, device=device)[0],
                                     plan, config.attn, sampler_model, config.dtype, config.band, bar)
    matrix.notes[:0] = notes
    paired = doctor_matrix.all_paired_cells(matrix, rollouts, rows_for, config.dtypes, config.band)
    recommendation = recommend(matrix.cells, matrix.fp16_check, device.type, paired)
    if matrix.notes:
        recommendation["notes"] = matrix.notes
    elapsed = time.perf_counter() - started
    params = {"model": config.model, "dtypes": config.dtypes, "attn": config.attn, "num_seqs": num_seqs,
              "max_new_tokens": max_new, "seed": config.seed, "sample_dtype": config.dtype,
              "gen_batch_size": config.gen_batch_size, "band": config.band, "rows_per_dtype": rows_for}
    result = doctor_matrix.doctor_result(model=config.model, device=device, params=params, rollouts=rollouts,
                                  matrix=matrix, paired=paired, recommendation=recommendation, seconds=elapsed)
    _print_result(result)
    print(f"({elapsed:.0f} s)")
    _write_json(result, config.json_path)
    return 0


def _scaled_for(config: DoctorConfig, on_cpu: bool) -> tuple[int, int, tuple[str, ...]]:
    """``(rollouts, tokens per rollout, comparisons skipped)`` of the run; ``config.attn`` set. On a CPU, what the
    flags leave out is :data:`CPU_SCALE`, said in one line on stderr."""
    scale = CPU_SCALE if on_cpu else {"rows": 64, "new_tokens": 64, "attn": GPU_ATTN, "skip": ()}
    scaled = [f"--{name.replace('_', '-')} {scale[name]}" for name in ("rows", "new_tokens", "attn")
              if getattr(config, name) is None]
    skip = scale["skip"] if config.attn is None else ()
    rows = config.rows if config.rows is not None else scale["rows"]
    new_tokens = config.new_tokens if config.new_tokens is not None else scale["new_tokens"]
    config.attn = config.attn if config.attn is not None else _csv(ATTNS)(scale["attn"])
    if on_cpu and scaled:
        print(f"bloggap doctor: on this CPU the default run is scaled down to {', '.join(scaled)} (GPU: 64 rollouts x "
              f"64 tokens, {GPU_ATTN}){', without ' + ', '.join(skip) if skip else ''}, and fp16/fp32 on fewer rows; "
              "give the flags to measure more", file=sys.stderr)
    return rows, new_tokens, skip


def _write_json(result: dict, json_path: str | None) -> None:
    """``result`` as strict JSON (``bloggap_plugin.results.dumps``: non-finite -> null) to ``json_path``, if given."""
    from bloggap_plugin._io import write_output_text
    from bloggap_plugin.core.errors import UsageError
    from bloggap_plugin.results import dumps

    if json_path:
        path = Path(json_path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UsageError(f"--json {path}: cannot create its folder ({err.strerror or err}); choose another "
                             "path") from None
        # atomic, and never over a file the doctor did not write: a failed write leaves the previous file whole
        write_output_text(path, dumps(result, indent=1) + "\n", "--json", is_doctor_json)
        print(f"wrote {path}")


def is_doctor_json(text: str) -> bool:
    """True when ``text`` is a ``bloggap doctor --json`` file (the only file ``--json`` may replace)."""
    from bloggap_plugin._io import json_of

    document = json_of(text)
    return isinstance(document, dict) and document.get("benchmark") == "doctor" and "recommendation" in document


def _print_result(result: dict) -> None:
    """The human-readable doctor report of one result dict (fresh or read back from JSON)."""
    params = result["params"]
    cells, paired, fp16_check = result["cells"], result.get("paired_cells", []), result["fp16_check"]
    recommendation = result["recommendation"]
    dtypes, attns = params["dtypes"], params["attn"]
    env = result.get("env", {})
    where = env.get("gpu") or ("CPU" if result.get("device") == "cpu" else result.get("device"))
    print(
        f"bloggap doctor: {result['model']} on {result.get('device')} ({where}), "
        f"{result['rows']} rollouts x {result['max_new_tokens']} tokens = {result['tokens']} completion tokens, "
        f"sampled in {params['sample_dtype']} (seed {params['seed']}); share of tokens with exp(dlogp) outside "
        f"[{1 - result['band']:.2f}, {1 + result['band']:.2f}] (count/n):"
    )
    print()
    print(format_table(cells, dtypes, attns))
    print()
    if fp16_check.get("skipped"):
        print(f"fp16 check: skipped ({fp16_check['skipped']})")
    else:
        print(
            f"fp16 check ({fp16_check['rows']} rows, {fp16_check['attn']}): {fp16_check['nonfinite_logprobs']} "
            f"non-finite of {fp16_check['n']} log-probs; largest |hidden| {fp16_check['max_abs_hidden']:.1f} "
            f"vs fp16 max 65,504 -> {'ok' if fp16_check['ok'] else 'NOT SAFE'}"
        )
    for note in recommendation.get("notes", []):
        print(f"note: {note}")
    for rows in sorted({c["rows"] for c in paired}):
        parts = [f"{c['comparison']} {100 * c['oob']:.2f}% ({c['oob_count']}/{c['n']})"
                 for c in paired if c["rows"] == rows and c["attn"] == attns[0]]
        print(f"bf16/{attns[0]} on the first {rows} rows (to compare with the scaled-down dtypes): " + "; ".join(parts))
    print()
    print(f"recommendation: {recommendation['text']}")  # the arm and its reason first, the details below
