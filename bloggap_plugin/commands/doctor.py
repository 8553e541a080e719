"""``bloggap doctor``: how large is the batch-shape log-prob gap for this model on this machine, which arm
removes it, and at what cost.

Samples rollouts once from the model itself, rescores the same tokens teacher-forced under several batch
shapes for every requested dtype and attention implementation (``bloggap_plugin.core.probe``), prints a
table and a recommendation derived from the measured cells, and optionally writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from bloggap_plugin.commands._measured import configure_with
from bloggap_plugin.core.comparisons import CPU_ROWS  # torch-free: `bloggap --help` stays fast

HELP = "Measure the batch-shape log-prob gap of a model on this machine and recommend an arm."
DTYPES = ("bf16", "fp16", "fp32")
ATTNS = ("sdpa", "eager", "flex_attention")
GPU_ATTN = "sdpa,eager"
GPU_SCALE = {"rows": 64, "new_tokens": 64, "attn": GPU_ATTN, "skip": (), "skip_beyond_bf16": ()}
CPU_SCALE = {"rows": 8, "new_tokens": 16, "attn": "sdpa",
             "skip": ("b1_vs_b8_right", "b1_vs_b8_equal_nopad", "copy8_vs_alone", "two_groupings_b8"),
             "skip_beyond_bf16": ("rerun_b1",)}
"""What a run on a CPU measures where the flags leave it to the doctor: fewer rollouts and tokens, one attention
implementation, and only the comparisons the recommendation reads (``skip``: batch size without left padding, one
row's copies, batch membership). On a CPU without bf16 in hardware it also samples in fp32 (:func:`_run_size`). The
run says what it scaled down; ``--full`` measures the GPU size."""
CPU_BF16 = ("auto", "native", "emulated")


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
    dtype: Literal["bf16", "fp16", "fp32"] | None = field(default=None, metadata={
        "help": "dtype of the model that samples the rollouts: bf16, fp16 or fp32 (default bf16; fp32 on a CPU without "
                "bf16 in hardware, see --cpu-bf16)", "deprecated": ["--sample-dtype", "--sample_dtype"]})
    gen_batch_size: int = field(default=8, metadata={"help": "prompts per generate call (default 8)", "min": 1})
    fp16_rows: int | None = field(default=None, metadata={
        "help": f"rows scored in fp16 (default: all on GPU, {CPU_ROWS['fp16']} on CPU, where fp16 is slow)", "min": 1})
    fp32_rows: int | None = field(default=None, metadata={
        "help": f"rows scored in fp32 (default: all on GPU, {CPU_ROWS['fp32']} on CPU)", "min": 1})
    band: float = field(default=0.1, metadata={"help": "ratio band half-width (default 0.1)", "above": 0, "below": 1})
    json_path: str | None = field(default=None, metadata={"help": "write the results as JSON to this path",
                                                          "aliases": ["--json"], "metavar": "PATH"})
    no_progress: bool = field(default=False, metadata={"help": "no progress bars"})
    full: bool = field(default=False, metadata={
        "help": "on a CPU too, measure the GPU size: 64 rollouts x 64 tokens, sdpa,eager, every comparison, every "
                "row in every dtype, sampled in bf16 (slow on a CPU; flags given still win)"})
    cpu_bf16: Literal["auto", "native", "emulated"] = field(default="auto", metadata={
        "help": "whether this CPU runs bf16 in hardware (auto: read its feature flags in /proc/cpuinfo); where it is "
                "emulated, the CPU run samples in fp32 unless --dtype is given"})
    timings: bool = field(default=False, metadata={
        "help": "print each phase's wall and CPU seconds and the load average (the JSON records them always)"})
    no_vllm: bool = field(default=False, metadata={
        "help": "no vLLM sampler column: by default, where vLLM and a CUDA GPU are present, the doctor also samples with "
                "vLLM built as TRL's colocate engine and reports each scoring's gap to it (docs/doctor.md)"})
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


def format_vllm_column(record: dict | None) -> str | None:
    """The vLLM sampler column (``vllm_sampler`` of the result) as lines: per scoring, the share of tokens out of band
    and bit for bit equal against vLLM's processed log-probs, or the one line saying why it is absent; ``None`` for
    a run from before the column."""
    if record is None:
        return None
    if "absent" in record:
        return f"vLLM sampler column: absent ({record['absent']})"
    from bloggap_plugin.core.recommend import arm_i_engine_note

    sampler = record.get("sampler", {})
    lines = [f"vLLM sampler column (vLLM {sampler.get('vllm', '?')}, engine built as TRL's colocate engine, dtype "
             f"{sampler.get('engine_dtype', '?')}): its processed log-probs vs each scoring at batch 1, share of "
             "tokens out of band / bit for bit equal (count/n):"]
    def shares(c: dict) -> str:
        return (f"{100 * c['oob']:.2f}% out of band ({c['oob_count']}/{c['n']}), "
                f"{100 * c['exact_count'] / c['n']:.2f}% bitwise ({c['exact_count']}/{c['n']})")

    for c in record.get("cells", []):
        if c.get("oob") is None:
            lines.append(f"  {c['dtype']}/{c['attn']}: - ({c.get('skipped', 'not measured')})")
        else:
            lines.append(f"  {c['dtype']}/{c['attn']}: {shares(c)}")
    arm_i = record.get("arm_i", {})
    if "cell" in arm_i:
        lines.append(f"  arm I's form (pieces {arm_i['pieces']}, one batch): {shares(arm_i['cell'])}"
                     + arm_i_engine_note(sampler))
    elif arm_i.get("absent"):
        lines.append(f"  arm I's form: absent ({arm_i['absent']})")
    return "\n".join(lines)


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


_FROM_JSON_FLAGS = ("from_json", "json_path", "no_progress", "timings")
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
    if result["params"].get("scaled_down"):
        print(scaled_line(result["params"]["scaled_down"]))
    _print_result(result, timings=config.timings)
    _write_json(result, config.json_path)
    return 0


@dataclass(frozen=True)
class RunSize:
    """What one doctor run measures: ``rows`` rollouts of ``new_tokens`` tokens sampled in ``sample_dtype``,
    scored with the attention implementations ``attn``, without the comparisons in ``skip``; ``scaled``: whether
    the CPU scale-down applies (fp16 / fp32 on fewer rows), ``scaled_down``: what it left out, one phrase each,
    and ``cpu_bf16``: on a CPU, whether bf16 runs in hardware and how that was found."""

    rows: int
    new_tokens: int
    attn: list[str]
    skip: tuple[str, ...]
    sample_dtype: str
    scaled: bool
    scaled_down: tuple[str, ...] = ()
    cpu_bf16: dict | None = None
    skip_beyond_bf16: tuple[str, ...] = ()
    """Comparisons fp16 and fp32 leave out (the rerun control: bf16's stands for the device's determinism)."""


def _cpu_bf16(config: DoctorConfig) -> dict:
    """``{"native": bool | None, "from": phrase}``: ``--cpu-bf16`` when given, else the CPU's feature flags."""
    from bloggap_plugin.envinfo import cpu_bf16_native

    if config.cpu_bf16 != "auto":
        return {"native": config.cpu_bf16 == "native", "from": f"--cpu-bf16 {config.cpu_bf16}"}
    native, evidence = cpu_bf16_native()
    return {"native": native, "from": evidence}


def _run_size(config: DoctorConfig, on_cpu: bool) -> RunSize:
    """The run's size: the flags given, the rest from :data:`GPU_SCALE`, or on a CPU (without ``--full``) from
    :data:`CPU_SCALE`, with sampling in fp32 where bf16 is not in hardware (``--dtype`` given wins). A scaled-down
    run says what it left out in one line on stderr."""
    scaled = on_cpu and not config.full
    scale = CPU_SCALE if scaled else GPU_SCALE
    rows = config.rows if config.rows is not None else scale["rows"]
    new_tokens = config.new_tokens if config.new_tokens is not None else scale["new_tokens"]
    attn = config.attn if config.attn is not None else _csv(ATTNS)(scale["attn"])
    bf16 = _cpu_bf16(config) if on_cpu else None
    emulated = bf16 is not None and not bf16["native"]
    sample_dtype = config.dtype or ("fp32" if scaled and emulated else "bf16")
    said = []
    if scaled:
        said = [f"{scale[key]} {name} (GPU {GPU_SCALE[key]})" for key, name in
                (("rows", "rollouts"), ("new_tokens", "tokens per rollout"), ("attn", "attention")) if
                getattr(config, key) is None]
        said.append(f"without {', '.join(scale['skip'])}")
        said.append(f"fp16 and fp32 without {', '.join(scale['skip_beyond_bf16'])} (bf16's control stands)")
        if (config.fp16_rows, config.fp32_rows) == (None, None) and CPU_ROWS["fp16"] < rows:
            said.append(f"fp16 and fp32 on {CPU_ROWS['fp16']} rows")
        if config.dtype is None and sample_dtype != "bf16":
            said.append(f"sampled in {sample_dtype} (bf16 emulated: {bf16['from']})")
        print(scaled_line(said))
    return RunSize(rows, new_tokens, attn, scale["skip"], sample_dtype, scaled, tuple(said), bf16,
                   scale["skip_beyond_bf16"])


def run(args: argparse.Namespace) -> int:
    """Measure (sample once, score the matrix), decide (the recommendation), render (print, write JSON)."""
    from bloggap_plugin.phase_timer import PhaseTimer

    timer = PhaseTimer()
    import torch

    from bloggap_plugin.commands._config import config_from_args
    from bloggap_plugin.models import check_model_spec, resolve_device

    config = config_from_args(DoctorConfig, args)
    _check(config)
    if config.from_json:
        return _from_json(config)
    device = torch.device(resolve_device(config.device))
    check_model_spec(config.model)
    size = _run_size(config, device.type == "cpu")
    config.attn = size.attn
    timer.lap("start (imports, checks)")
    result = _measure(config, device, size, timer)
    _print_result(result, timings=config.timings)
    spent = result["timings"]
    print(f"({spent['wall_s']:.0f} s wall, {spent['cpu_s']:.0f} s CPU, load {spent['load_1min_start']} -> "
          f"{spent['load_1min_end']}{'' if config.timings else '; --timings: each phase'})")
    _write_json(result, config.json_path)
    return 0


def scaled_line(scaled_down: list[str] | tuple[str, ...]) -> str:
    """The one line saying what a CPU run left out (``params["scaled_down"]`` of its JSON)."""
    return f"scaled down for this CPU (--full: the GPU size, slow here): {'; '.join(scaled_down)}"


@contextlib.contextmanager
def _torch_threads(threads: int | None):
    """torch's CPU threads set to ``threads`` inside the block (``None``: left as they are), restored after. On a CPU
    the sampler runs on one: a decode step multiplies a few rows, too little to share, and threads that wait for
    each other at every product of a step stall whenever another process holds a core."""
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _measure(config: DoctorConfig, device, size: RunSize, timer) -> dict:
    """Sample once, score the matrix, recommend: the doctor's result record, its phases timed by ``timer``."""
    from tqdm.auto import tqdm

    from bloggap_plugin.core.recommend import recommend
    from bloggap_plugin.measure import doctor_matrix, doctor_vllm
    from bloggap_plugin.measure import rollouts as sampling
    from bloggap_plugin.models import load_model

    rows_for = doctor_matrix.rows_per_dtype(size.rows, config.fp16_rows, config.fp32_rows, size.scaled)
    sampler_model, tokenizer = load_model(config.model, dtype=size.sample_dtype, device=device)
    timer.lap(f"load {size.sample_dtype} (sampler)")
    threads = 1 if device.type == "cpu" else None
    with tqdm(total=size.rows, desc="sampling", unit="row", file=sys.stderr, disable=config.no_progress) as bar, \
            _torch_threads(threads):
        rollouts = sampling.sample_rollouts(
            sampler_model, tokenizer, num_seqs=size.rows, max_new_tokens=size.new_tokens, seed=config.seed,
            batch_size=config.gen_batch_size, progress=bar.update,
        )
    timer.lap(f"sampling ({size.sample_dtype})")
    vllm, absent = _vllm_samples(config, device, sampler_model, rollouts, size)
    if vllm is not None:
        timer.lap("vLLM sampling (engine start included)")
    plan, notes = doctor_matrix.scoring_plan(config.dtypes, rollouts, rows_for, size.scaled, size.skip,
                                             size.skip_beyond_bf16)
    total = doctor_matrix.total_passes(plan, size.attn, vllm=vllm is not None)
    with tqdm(total=total, desc="scoring", unit="pass", file=sys.stderr, disable=config.no_progress) as bar:
        matrix = doctor_matrix.score_matrix(lambda dtype: load_model(config.model, dtype=dtype, device=device)[0],
                                            plan, size.attn, sampler_model, size.sample_dtype, config.band, bar,
                                            lap=timer.lap, vllm=vllm)
    matrix.notes[:0] = notes
    paired = doctor_matrix.all_paired_cells(matrix, rollouts, rows_for, config.dtypes, config.band)
    arm_i = None
    if vllm is not None:
        pieces = doctor_vllm.arm_i_pieces(device.type, vllm.sampler.get("vllm"))
        arm_i = doctor_vllm.arm_i_row(sampler_model, vllm, config.band, pieces)
        timer.lap(f"score vLLM samples with arm I's form ({pieces})")
    column = doctor_vllm.column_record(matrix.vllm_cells, absent, None if vllm is None else vllm.sampler, arm_i)
    recommendation = recommend(matrix.cells, matrix.fp16_check, device.type, paired, column)
    if matrix.notes:
        recommendation["notes"] = matrix.notes
    timer.lap("paired cells, recommendation")
    params = {"model": config.model, "dtypes": config.dtypes, "attn": size.attn, "num_seqs": size.rows,
              "max_new_tokens": size.new_tokens, "seed": config.seed, "sample_dtype": size.sample_dtype,
              "gen_batch_size": config.gen_batch_size, "band": config.band, "rows_per_dtype": rows_for,
              "scaled_down": list(size.scaled_down), "sample_threads": threads}
    if size.cpu_bf16 is not None:
        params["cpu_bf16"] = size.cpu_bf16
    return doctor_matrix.doctor_result(model=config.model, device=device, params=params, rollouts=rollouts,
                                       matrix=matrix, paired=paired, recommendation=recommendation,
                                       seconds=timer.elapsed(), timings=timer.record(), vllm_sampler=column)


def _vllm_samples(config: DoctorConfig, device, sampler_model, rollouts, size: RunSize):
    """``(vLLM's samples of the doctor's prompts, None)`` for the sampler column, or ``(None, why it is absent)``;
    a vLLM that fails to build or sample is recorded as the reason, and the rest of the run goes on."""
    from bloggap_plugin.measure import doctor_vllm

    absent = doctor_vllm.absent_here(not config.no_vllm, device.type, sampler_model, config.model)
    if absent is not None:
        return None, absent
    try:
        return doctor_vllm.sample_with_vllm(doctor_vllm.model_folder(sampler_model), rollouts, size.new_tokens,
                                            config.seed), None
    except Exception as err:  # noqa: BLE001 - the column records why it is absent; the matrix is still measured
        return None, f"vLLM failed: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"


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


def format_timings(timings: dict) -> str:
    """The run's phases (:meth:`bloggap_plugin.phase_timer.PhaseTimer.record`) as lines: wall and CPU seconds, the
    1-minute load average at each phase's end, then the total."""
    lines = [f"  {p['phase']:<44} {p['wall_s']:>7.1f} s wall {p['cpu_s']:>7.1f} s CPU  load {p['load_1min']}"
             for p in timings["phases"]]
    return "\n".join([f"phases ({timings['cpus']} CPUs; wall, CPU = user + system of this process, 1-minute load):"]
                     + lines + [f"  {'total':<44} {timings['wall_s']:>7.1f} s wall {timings['cpu_s']:>7.1f} s CPU  load "
                                f"{timings['load_1min_start']} -> {timings['load_1min_end']}"])


def _print_result(result: dict, timings: bool = False) -> None:
    """The human-readable doctor report of one result dict (fresh or read back from JSON); ``timings``: its phases
    too (where the record has them)."""
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
    column = format_vllm_column(result.get("vllm_sampler"))
    if column:
        print(column)
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
    if timings and result.get("timings"):
        print(format_timings(result["timings"]))
    print()
    text = f"recommendation: {recommendation['text']}"  # the arm and its reason first, the details below
    print(_fit_terminal(text) if sys.stdout.isatty() else text)


def _fit_terminal(text: str) -> str:
    """``text`` with each line wider than the terminal wrapped at word boundaries, continuation lines indented under
    the line's own text (a finding's ``  - `` bullet: 4 spaces; the lead line: 2); for a terminal only (piped output
    keeps one line per finding, for tools that read it)."""
    import shutil
    import textwrap

    width = max(60, shutil.get_terminal_size().columns - 1)
    lines = []
    for line in text.splitlines():
        indent = " " * max(2, len(line) - len(line.lstrip(" -")))
        lines.append(textwrap.fill(line, width=width, subsequent_indent=indent, break_long_words=False,
                                   break_on_hyphens=False) if len(line) > width else line)
    return "\n".join(lines)
