"""``bloggap doctor``: how large is the batch-shape log-prob gap for this model on this machine, which arm
removes it, and at what cost.

Samples rollouts once from the model itself, rescores the same tokens teacher-forced under several batch
shapes for every requested dtype and attention implementation (``bloggap_plugin.core.probe``), prints a
table and a recommendation derived from the measured cells, and optionally writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HELP = "Measure the batch-shape log-prob gap of a model on this machine and recommend an arm."

SCHEMA_VERSION = 1
DTYPES = ("bf16", "fp16", "fp32")
ATTNS = ("sdpa", "eager", "flex_attention")
# On CPU, fp16 has no fast kernels (~7-10x bf16's time here) and fp32 costs ~2x bf16: both are scored on
# fewer rows there so the default run stays under 5 minutes on 2 cores. bf16 always gets every row.
CPU_ROWS = {"fp16": 8, "fp32": 16}
CPU_FP16_COMPARISONS = ("rerun_b1", "b1_vs_b8_left_arange", "b1_vs_b8_left_mask", "sampler_vs_b1")
# comparisons whose batch-1 and batch-8 chunks are the same computation on the first k rows (k % 8 == 0)
PAIRABLE = ("rerun_b1", "b1_vs_b8_left_arange", "b1_vs_b8_left_mask", "b1_vs_b8_right")


def _csv(choices):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(choices)}, got {text!r}")
        return items

    return parse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="model spec (default: smollm2, offline); see models.py")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    parser.add_argument("--dtypes", type=_csv(DTYPES), default=list(DTYPES), help="comma list (default bf16,fp16,fp32)")
    parser.add_argument("--attn", type=_csv(ATTNS), default=["sdpa", "eager"], help="comma list (default sdpa,eager)")
    parser.add_argument("--num-seqs", type=int, default=None, help="rollouts (default 64 on GPU, 32 on CPU)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="tokens per rollout (default 64 GPU, 24 CPU)")
    parser.add_argument("--seed", type=int, default=1234, help="sampling seed (default 1234)")
    parser.add_argument("--sample-dtype", choices=DTYPES, default="bf16", help="dtype of the sampling model (bf16)")
    parser.add_argument("--gen-batch-size", type=int, default=8, help="prompts per generate call (default 8)")
    parser.add_argument("--fp16-rows", type=int, default=None,
                        help=f"rows scored in fp16 (default: all on GPU, {CPU_ROWS['fp16']} on CPU, where fp16 is slow)")
    parser.add_argument("--fp32-rows", type=int, default=None,
                        help=f"rows scored in fp32 (default: all on GPU, {CPU_ROWS['fp32']} on CPU)")
    parser.add_argument("--band", type=float, default=0.1, help="ratio band half-width (default 0.1)")
    parser.add_argument("--json", dest="json_path", default=None, help="write the results as JSON to this path")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--from-json", default=None, metavar="PATH",
                        help="measure nothing: re-read a doctor JSON (yours or a colleague's), recompute the "
                             "recommendation from its cells with this version's logic, print it (and --json it)")


def _passes(names: list[str]) -> int:
    """Scoring passes probe_model makes for these comparisons (progress-bar total)."""
    count = 1  # batch-1 reference
    count += sum(1 for n in names if n not in ("sampler_vs_b1", "b1_vs_b8_equal_nopad", "two_groupings_b8"))
    if "b1_vs_b8_equal_nopad" in names or "two_groupings_b8" in names:
        count += 1  # equal-length batch 8
    count += sum(1 for n in names if n in ("b1_vs_b8_equal_nopad", "two_groupings_b8"))
    return count


def paired_cells(extras: dict, rollouts, rows: int, band: float, attn: str) -> list[dict]:
    """bf16 cells re-compared on the first ``rows`` rows, to set beside a dtype scored on only those rows."""
    from bloggap_plugin.core.probe import compare

    out = []
    for name in PAIRABLE:
        if name in extras["scored"] and (name == "rerun_b1" or rows % 8 == 0):
            ref, other = extras["scored"][name]
            out.append(compare(ref[:rows], other.logprobs[:rows], other.mask[:rows], band,
                               comparison=name, dtype="bf16", attn=attn, rows=rows, paired=True))
    base = extras["b1"]
    width = min(base.logprobs.shape[1], rollouts.sampler_logprobs.shape[1])
    mask = base.mask[:rows, :width] & rollouts.sampler_mask[:rows, :width]
    out.append(compare(rollouts.sampler_logprobs[:rows, :width], base.logprobs[:rows, :width], mask, band,
                       comparison="sampler_vs_b1", dtype="bf16", attn=attn, rows=rows, paired=True))
    return out


def format_table(cells: list[dict], dtypes: list[str], attns: list[str]) -> str:
    """Comparisons as rows, dtype/attn as columns: out-of-band % and count (``-`` = skipped)."""
    from bloggap_plugin.core.probe import COMPARISONS

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
    widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
    out = [" | ".join(h.ljust(w) for h, w in zip(header, widths)), "-+-".join("-" * w for w in widths)]
    out += [" | ".join(v.ljust(w) for v, w in zip(r, widths)) for r in body]
    # a second block: mean / max |dlogp| for the headline comparisons
    out.append("")
    out.append("mean / max |dlogp| (nats), b1 vs b8 left (0..L-1) and sampler vs b1:")
    for d, a in columns:
        parts = []
        for name in ("b1_vs_b8_left_arange", "sampler_vs_b1"):
            c = index.get((d, a, name))
            if c is not None and c.get("oob") is not None:
                parts.append(f"{name} {c['abs_dlogp_mean']:.2e} / {c['abs_dlogp_max']:.2e}")
        if parts:
            out.append(f"  {d}/{a}: " + "; ".join(parts))
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm.auto import tqdm

    from bloggap_plugin._io import check_writable_file
    from bloggap_plugin.core.probe import (
        COMPARISONS,
        probe_model,
        recommend,
        sample_rollouts,
        skipped_cell,
    )
    from bloggap_plugin.envinfo import environment_record
    from bloggap_plugin.errors import UsageError, check_positive
    from bloggap_plugin.models import check_model_spec, load_model, resolve_device

    if args.json_path:  # before measuring: a bad path must not cost a run
        problem = check_writable_file(args.json_path, "--json", create_parents=True)
        if problem:
            raise UsageError(problem)
    if args.from_json:
        try:
            result = rerecommend(json.loads(Path(args.from_json).read_text()))
        except (OSError, ValueError) as err:
            raise UsageError(f"cannot re-read --from-json {args.from_json}: {err}; give a bloggap doctor JSON") from None
        _print_result(result)
        _write_json(result, args.json_path)
        return 0
    for option, value in (("--num-seqs", args.num_seqs), ("--max-new-tokens", args.max_new_tokens),
                          ("--gen-batch-size", args.gen_batch_size), ("--fp16-rows", args.fp16_rows),
                          ("--fp32-rows", args.fp32_rows)):
        check_positive(option, value)
    if not 0.0 < args.band < 1.0:
        raise UsageError(f"--band must be in (0, 1) (half-width b of the ratio band [1-b, 1+b]), got {args.band}")
    device = torch.device(resolve_device(args.device))
    check_model_spec(args.model)
    on_cpu = device.type == "cpu"
    num_seqs = args.num_seqs if args.num_seqs is not None else (32 if on_cpu else 64)
    max_new = args.max_new_tokens if args.max_new_tokens is not None else (24 if on_cpu else 64)
    rows_for = {"bf16": num_seqs}
    for dtype, given in (("fp16", args.fp16_rows), ("fp32", args.fp32_rows)):
        rows_for[dtype] = min(given if given is not None else (CPU_ROWS[dtype] if on_cpu else num_seqs), num_seqs)
    started = time.perf_counter()
    notes: list[str] = []

    sampler_model, tokenizer = load_model(args.model, dtype=args.sample_dtype, device=device)
    sampler_attn = getattr(sampler_model.config, "_attn_implementation", None)
    with tqdm(total=num_seqs, desc="sampling", unit="row", file=sys.stderr, disable=args.no_progress) as bar:
        rollouts = sample_rollouts(
            sampler_model, tokenizer, num_seqs=num_seqs, max_new_tokens=max_new, seed=args.seed,
            batch_size=args.gen_batch_size, progress=bar.update,
        )

    plan = []  # (dtype, comparisons, rollouts)
    for dtype in args.dtypes:
        names = list(COMPARISONS)
        subset = rollouts
        rows = rows_for.get(dtype, num_seqs)
        if rows < num_seqs:
            subset = rollouts.subset(rows)
            if dtype == "fp16" and on_cpu:
                names = list(CPU_FP16_COMPARISONS)
                why = "this CPU has no native fp16 kernels"
            else:
                names = [n for n in names if not (n.startswith("b1_vs_b32") and rows < 32)]
                why = "batch 32 needs 32 rows"
            dropped = [n for n in COMPARISONS if n not in names]
            notes.append(
                f"{dtype} scaled down{' on CPU' if on_cpu else ''}: {rows} of {num_seqs} rows"
                + (f"; skipped {', '.join(dropped)} ({why})" if dropped else "")
                + "; the recommendation compares it with bf16 on the same rows"
            )
        plan.append((dtype, names, subset))
    total = sum(_passes(names) for _, names, _ in plan) * len(args.attn)

    cells: list[dict] = []
    bf16_extras: dict = {}
    fp16_check: dict = {"skipped": "fp16 not among --dtypes"}
    with tqdm(total=total, desc="scoring", unit="pass", file=sys.stderr, disable=args.no_progress) as bar:
        for dtype, names, subset in plan:
            if dtype == args.sample_dtype:
                model = sampler_model
            else:
                model, _ = load_model(args.model, dtype=dtype, device=device)
            for attn_index, attn in enumerate(args.attn):
                bar.set_postfix_str(f"{dtype}/{attn}")
                try:
                    model.set_attn_implementation(attn)
                except Exception as err:  # noqa: BLE001 - recorded per cell, the run continues
                    reason = f"attn_implementation {attn!r} unavailable: {str(err).splitlines()[0][:160]}"
                    cells += [skipped_cell(reason, dtype=dtype, attn=attn, comparison=n) for n in names]
                    bar.update(_passes(names))
                    continue
                hidden = dtype == "fp16" and attn_index == 0
                try:
                    found, extras = probe_model(
                        model, subset, names, band=args.band, hidden_check=hidden,
                        progress=lambda label: bar.update(1),
                    )
                except Exception as err:  # noqa: BLE001 - e.g. a kernel missing for this dtype/device
                    reason = f"{dtype}/{attn} failed: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
                    cells += [skipped_cell(reason, dtype=dtype, attn=attn, comparison=n) for n in COMPARISONS]
                    notes.append(reason)
                    continue
                for c in found:
                    c.update(dtype=dtype, attn=attn)
                cells += found
                if dtype == "bf16":
                    bf16_extras[attn] = extras
                skipped = [n for n in COMPARISONS if n not in names]
                cells += [
                    skipped_cell(f"{dtype} scaled down (see notes)", dtype=dtype, attn=attn, comparison=n)
                    for n in skipped
                ]
                if hidden:
                    fp16_check = dict(extras["hidden_check"], attn=attn, fp16_max=65504.0)
                    fp16_check["headroom"] = (
                        65504.0 / fp16_check["max_abs_hidden"] if fp16_check["max_abs_hidden"] > 0 else None
                    )
                    fp16_check["ok"] = (
                        fp16_check["nonfinite_logprobs"] == 0 and fp16_check["max_abs_hidden"] < 65504.0 / 2
                    )
            if model is not sampler_model:
                del model
            if dtype == args.sample_dtype and sampler_attn:
                sampler_model.set_attn_implementation(sampler_attn)

    paired: list[dict] = []
    if "bf16" in args.dtypes and rollouts.sampler_logprobs is not None:
        for rows in sorted({rows_for[d] for d in args.dtypes if d != "bf16" and rows_for[d] < num_seqs}):
            for attn, extras in bf16_extras.items():
                paired += paired_cells(extras, rollouts, rows, args.band, attn)
    recommendation = recommend(cells, fp16_check, device.type, paired)
    if notes:
        recommendation["notes"] = notes
    elapsed = time.perf_counter() - started
    import transformers

    from bloggap_plugin.envinfo import device_tag

    doctor_table = {
        "id": "DOCTOR",
        "title": f"bloggap doctor: OOB% per comparison, dtype and attention ({args.model})",
        "columns": ["comparison"] + [f"{d}/{a}" for d in args.dtypes for a in args.attn],
        "rows": [
            [name] + [
                None if (c := next((x for x in cells if x["dtype"] == d and x["attn"] == a
                                    and x["comparison"] == name), None)) is None or c.get("oob") is None
                else round(100 * c["oob"], 2)
                for d in args.dtypes for a in args.attn
            ]
            for name in COMPARISONS
        ],
        "notes": (
            f"{len(rollouts.rows)} rollouts x {max_new} tokens ({rollouts.tokens} completion tokens) sampled once in "
            f"{args.sample_dtype}, seed {args.seed}; share of completion tokens with exp(dlogp) outside "
            f"[{1 - args.band:.2f}, {1 + args.band:.2f}]; empty cells not measured. "
            + " ".join(f"Note: {n}." for n in notes)
            + f" Recommendation: {recommendation['text']}"
        ),
        "reference": None,
        "random_init": args.model.startswith("tiny-random-"),
    }
    result = {
        "schema_version": SCHEMA_VERSION,
        "benchmark": "doctor",
        "model": args.model,
        "device": device_tag(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokens": rollouts.tokens,
        "rows": len(rollouts.rows),
        "max_new_tokens": max_new,
        "band": args.band,
        "units": "oob, ci_low, ci_high are fractions of completion tokens; abs_dlogp_* in nats",
        "sampler": rollouts.sampler,
        "cells": cells,
        "paired_cells": paired,
        "fp16_check": fp16_check,
        "recommendation": recommendation,
        "seconds": round(elapsed, 1),
        "env": environment_record(device, model=args.model, seed=args.seed, tokens=rollouts.tokens),
        # the benchmark-result keys, so `bloggap report` can render this file from benchmarks/results/<device>/
        "params": {"model": args.model, "dtypes": args.dtypes, "attn": args.attn, "num_seqs": num_seqs,
                   "max_new_tokens": max_new, "seed": args.seed, "sample_dtype": args.sample_dtype,
                   "gen_batch_size": args.gen_batch_size, "band": args.band, "rows_per_dtype": rows_for},
        "results": {"see": "cells, paired_cells, fp16_check, recommendation at the top level"},
        "tables": [doctor_table],
    }

    _print_result(result)
    print(f"({elapsed:.0f} s)")
    _write_json(result, args.json_path)
    return 0


def _write_json(result: dict, json_path: str | None) -> None:
    from bloggap_plugin._io import atomic_write_text
    from bloggap_plugin.core.probe import json_safe

    if json_path:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # atomic: a failed write (full disk) leaves the previous file whole
        atomic_write_text(path, json.dumps(json_safe(result), indent=1, default=float, allow_nan=False) + "\n")
        print(f"wrote {path}")


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
    print(f"recommendation: {recommendation['text']}")


def rerecommend(result: dict) -> dict:
    """Recompute ``result['recommendation']`` from its stored cells with this version's :func:`recommend`.

    The measured cells are untouched; the new recommendation records that it was recomputed, and the DOCTOR
    table's notes are updated to match.
    """
    from bloggap_plugin import __version__
    from bloggap_plugin.core.probe import recommend

    for key in ("cells", "fp16_check", "params", "recommendation"):
        if key not in result:
            raise ValueError(f"not a bloggap doctor JSON: missing key {key!r}")
    device_type = "cpu" if result.get("device") == "cpu" else "cuda"
    old = result["recommendation"]
    new = recommend(result["cells"], result["fp16_check"], device_type, result.get("paired_cells", []))
    if old.get("notes"):
        new["notes"] = old["notes"]
    new["recomputed"] = {"by": f"bloggap doctor --from-json (bloggap {__version__})", "previous_arm": old.get("arm")}
    result["recommendation"] = new
    for table in result.get("tables", []):
        if table.get("id") == "DOCTOR" and " Recommendation: " in table.get("notes", ""):
            table["notes"] = table["notes"].split(" Recommendation: ")[0] + f" Recommendation: {new['text']}"
    return result
