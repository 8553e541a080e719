"""``bloggap ladder``: the precision ladder (reference table T7): how much of the batch-shape noise each
scoring plan removes, and what share of the parameters it runs in fp32.

Rollouts are sampled from the model itself (bf16 by default) on the evaluation prompts; the guided layer
choices come from an attribution profile measured on *calibration* rollouts from disjoint prompts. Every rung
is a :func:`bloggap_plugin.core.precision.make_plan` plan scoring the same tokens alone (batch 1, unpadded)
and in left-padded chunks of 8; the share of those tokens whose ratio leaves ``[1 - band, 1 + band]`` is the
rung's out-of-band rate. Rungs: bf16, fp32 head, first-k / last-k / guided top-k / guided window-k (each with
fp32 norm and head), fp16, fp16 + guided top-k, all fp32. The measurement is
:func:`bloggap_plugin.measure.ladder.run_ladder`; this module parses and prints.
"""

from __future__ import annotations

import argparse
import json
import sys

HELP = "Precision ladder: out-of-band rate b1 vs b8 for each scoring plan (bf16 ... all fp32)."

SCHEMA_VERSION = 1


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="model spec (default: smollm2, offline)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="policy dtype (bf16)")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    parser.add_argument("--attn", default=None, help="attention implementation (default: the model's)")
    parser.add_argument(
        "--rows", type=int, default=None, help="evaluation rollouts (default 128 GPU, 16 CPU)"
    )
    parser.add_argument(
        "--calibration-rows", type=int, default=None, help="calibration rollouts (32 GPU, 8 CPU)"
    )
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens per rollout (48 GPU, 24 CPU)")
    parser.add_argument(
        "--k", type=int, nargs="+", default=None,
        help="layer counts, each in 1..layers of the model (default 4 8 12 GPU, 8 CPU, capped at the layers)"
    )
    parser.add_argument("--positions", default="mask", choices=("mask", "arange"), help="position ids (mask)")
    parser.add_argument(
        "--fp16",
        choices=("auto", "on", "off"),
        default="auto",
        help="fp16 rungs (auto: off on CPU, where fp16 is slow)",
    )
    parser.add_argument("--seed", type=int, default=1234, help="sampling seed (default 1234)")
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="write JSON to PATH (stdout if no PATH)",
    )


def run(args: argparse.Namespace) -> int:
    from bloggap_plugin.commands.attribute import check_json_option, write_json_option
    from bloggap_plugin.envinfo import environment_record
    from bloggap_plugin.errors import UsageError, check_positive
    from bloggap_plugin.measure.ladder import default_ks, ladder_table, run_ladder
    from bloggap_plugin.models import check_model_spec, load_model, resolve_device
    from bloggap_plugin.report import format_text_table

    for option, value in (("--rows", args.rows), ("--calibration-rows", args.calibration_rows),
                          ("--new-tokens", args.new_tokens)):
        check_positive(option, value)
    if args.k is not None and any(k < 1 for k in args.k):
        raise UsageError(f"--k {' '.join(str(k) for k in args.k if k < 1)}: layer counts must be >= 1")
    check_json_option(args.json)
    device = resolve_device(args.device)
    gpu = device.startswith("cuda")
    check_model_spec(args.model)
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=device, attn_implementation=args.attn)
    result = run_ladder(  # checks --k against the model's layer count before sampling anything
        model,
        tokenizer,
        rows=args.rows if args.rows is not None else (128 if gpu else 16),
        calibration_rows=args.calibration_rows if args.calibration_rows is not None else (32 if gpu else 8),
        new_tokens=args.new_tokens if args.new_tokens is not None else (48 if gpu else 24),
        ks=args.k or default_ks(model, gpu),
        positions=args.positions,
        fp16={"on": True, "off": False}.get(args.fp16, gpu),
        seed=args.seed,
        progress=lambda msg: print(f"[ladder] {msg}", file=sys.stderr),
    )
    table = ladder_table(result)
    payload = {
        "command": "ladder",
        "schema_version": SCHEMA_VERSION,
        "env": environment_record(device),
        "params": {
            "model": args.model,
            "dtype": args.dtype,
            "attn": getattr(model.config, "_attn_implementation", None),
        },
        "results": result,
        "tables": [table],
    }
    if args.json == "-":
        print(json.dumps(payload, indent=2))
    else:
        print(format_text_table(table))
        if args.json:
            write_json_option(args.json, payload)
    return 0
