"""``bloggap ladder``: the precision ladder (reference table T7): how much of the batch-shape noise each
scoring plan removes, and what share of the parameters it runs in fp32.

Rollouts are sampled from the model itself (bf16 by default) on the evaluation prompts; the guided layer
choices come from an attribution profile measured on *calibration* rollouts from disjoint prompts. Every rung
is a :func:`bloggap_plugin.core.precision.make_plan` plan scoring the same tokens alone (batch 1, unpadded)
and in left-padded chunks of 8; the share of those tokens whose ratio leaves ``[1 - band, 1 + band]`` is the
rung's out-of-band rate. Rungs: bf16, fp32 head, first-k / last-k / guided top-k / guided window-k (each with
fp32 norm and head), fp16, fp16 + guided top-k, all fp32.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence

HELP = "Precision ladder: out-of-band rate b1 vs b8 for each scoring plan (bf16 ... all fp32)."

SCHEMA_VERSION = 1


def _rung_specs(
    n_layers: int, ks: Sequence[int], guided: dict, window: dict, fp16_guided_k: int | None
) -> list[dict]:
    specs = [{"name": "bf16", "arm": "bf16"}, {"name": "fp32 head", "arm": "fp32_head", "layers": []}]
    for k in ks:
        specs += [
            {"name": f"first-{k} + head", "arm": "guided", "k": k, "layers": list(range(k))},
            {
                "name": f"last-{k} + head",
                "arm": "guided",
                "k": k,
                "layers": list(range(n_layers - k, n_layers)),
            },
            {"name": f"guided-{k} + head", "arm": "guided", "k": k, "layers": guided[k]},
            {"name": f"window-{k} + head", "arm": "guided", "k": k, "layers": window[k]},
        ]
    specs.append({"name": "fp16", "arm": "fp16", "fp16": True})
    if fp16_guided_k is not None:
        specs.append(
            {
                "name": f"fp16 + guided-{fp16_guided_k} + head",
                "arm": "guided",
                "k": fp16_guided_k,
                "layers": guided[fp16_guided_k],
                "fp16": True,
                "base": "fp16",
            }
        )
    specs.append({"name": "all fp32", "arm": "fp32"})
    return specs


def run_ladder(
    model,
    tokenizer,
    *,
    rows: int = 128,
    calibration_rows: int = 32,
    new_tokens: int = 48,
    ks: Sequence[int] = (4, 8, 12),
    batch_size: int = 8,
    positions: str = "mask",
    band: float = 0.1,
    fp16: bool = True,
    seed: int = 1234,
    calibration_seed: int = 4321,
    progress: Callable[[str], object] | None = None,
) -> dict:
    """Run the ladder on ``model`` (the policy, usually bf16). JSON-ready dict with one entry per rung."""
    import torch

    from bloggap_plugin.commands.attribute import (
        b1_vs_bn,
        calibration_prompts,
        eval_prompts,
        rollout_rows,
    )
    from bloggap_plugin.core.attribution import divergence_profile
    from bloggap_plugin.core.precision import decoder_layers, make_plan
    from bloggap_plugin.core.probe import compare, skipped_cell
    from bloggap_plugin.errors import UsageError

    say = progress or (lambda _msg: None)
    n_layers = len(decoder_layers(model))
    bad = [k for k in ks if not 1 <= int(k) <= n_layers]
    if bad or not ks:
        raise UsageError(f"--k {' '.join(map(str, bad or ks))} out of range: this model has {n_layers} decoder "
                         f"layers; give layer counts in 1..{n_layers}")
    ks = sorted({int(k) for k in ks})
    device = next(model.parameters()).device
    if set(eval_prompts()) & set(calibration_prompts()):
        raise RuntimeError("calibration and evaluation prompts overlap")

    say(
        f"calibration: {calibration_rows} rollouts x {new_tokens} tokens from {len(calibration_prompts())} prompts"
    )
    cal_ids, cal_mask, _ = rollout_rows(
        model, tokenizer, calibration_prompts(), calibration_rows, new_tokens, calibration_seed
    )
    profile = divergence_profile(
        model,
        cal_ids.to(device),
        cal_mask.to(device),
        batch_size=batch_size,
        logits_to_keep=new_tokens,
        positions=positions,
    )
    guided = {k: sorted(profile.top_k(k)) for k in ks}
    window = {k: profile.best_window(k) for k in ks}

    say(f"evaluation: {rows} rollouts x {new_tokens} tokens from {len(eval_prompts())} prompts")
    ids, mask, _ = rollout_rows(model, tokenizer, eval_prompts(), rows, new_tokens, seed)
    ids, mask = ids.to(device), mask.to(device)

    fp16_guided_k = 8 if 8 in ks else ks[len(ks) // 2]
    specs = _rung_specs(n_layers, ks, guided, window, fp16_guided_k)
    rungs = []
    fp16_base = None
    for spec in specs:
        labels = {key: spec.get(key) for key in ("name", "arm", "k", "layers")}
        labels["base_dtype"] = spec.get("base", str(next(model.parameters()).dtype).removeprefix("torch."))
        if spec.get("fp16") and not fp16:
            rungs.append(
                skipped_cell("fp16 disabled (no fast fp16 kernels on this CPU; run on a GPU)", **labels)
            )
            say(f"{spec['name']:<28} skipped")
            continue
        started = time.perf_counter()
        if spec.get("base") == "fp16":
            if fp16_base is None:
                fp16_base = make_plan(model, "fp16")
            plan = make_plan(fp16_base.shadow, "guided", layers=spec["layers"])
        elif spec["arm"] == "guided":
            plan = make_plan(model, "guided", layers=spec["layers"])
        else:
            plan = make_plan(model, spec["arm"])
        b1, bn = b1_vs_bn(plan, ids, mask, new_tokens, batch_size, positions)
        cell = compare(b1, bn, band=band, **labels)
        stats = plan.stats()
        cell.update(
            fp32_param_share=stats["fp32_param_share"],
            bytes_added=stats["bytes_added"],
            fp16_fallbacks=stats["fp16_fallbacks"],
            seconds=time.perf_counter() - started,
        )
        plan.close()
        rungs.append(cell)
        say(
            f"{spec['name']:<28} {100 * cell['oob']:6.2f}% out of band   fp32 share {100 * cell['fp32_param_share']:5.1f}%"
        )
    if fp16_base is not None:
        fp16_base.close()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    sanity = rungs[-1]
    return {
        "rungs": rungs,
        "attribution": profile.to_dict(k=fp16_guided_k),
        "guided_layers": {str(k): guided[k] for k in ks},
        "window_layers": {str(k): window[k] for k in ks},
        "ks": list(ks),
        "n_layers": n_layers,
        "rows": rows,
        "calibration_rows": calibration_rows,
        "new_tokens": new_tokens,
        "tokens": int(rows * new_tokens),
        "batch_size": batch_size,
        "positions": positions,
        "band": band,
        "seed": seed,
        "calibration_seed": calibration_seed,
        "calibration_disjoint": True,
        "all_fp32_oob": sanity.get("oob"),
        "device_type": device.type,
    }


def ladder_table(result: dict, table_id: str = "T7", random_init: bool = False) -> dict:
    """The report TABLE for a ladder result (percent with 2 decimals)."""
    rows = []
    skipped = []
    for cell in result["rungs"]:
        layers = cell.get("layers")
        layer_text = "-" if not layers else ",".join(str(i) for i in layers)
        if cell.get("oob") is None:
            rows.append([cell["name"], layer_text, "-", "-", "-", "-", "-", "-", 0])
            skipped.append(f"{cell['name']}: {cell.get('skipped', 'skipped')}")
            continue
        rows.append(
            [
                cell["name"],
                layer_text,
                round(100 * cell["fp32_param_share"], 2),
                round(100 * cell["oob"], 2),
                round(100 * cell["ci_low"], 2),
                round(100 * cell["ci_high"], 2),
                float(f"{cell['abs_dlogp_mean']:.3g}"),
                cell["fp16_fallbacks"],
                cell["n"],
            ]
        )
    notes = (
        f"{result['rows']} rollouts x {result['new_tokens']} sampled tokens (evaluation prompts); guided/window "
        f"layers chosen on {result['calibration_rows']} calibration rollouts from disjoint prompts "
        f"(top-k / best window of per-layer divergence increments). Band +-{result['band']}, positions "
        f"'{result['positions']}'. fp32 params % counts a tied head twice (embedding + projection)."
    )
    if skipped:
        notes += " Skipped: " + "; ".join(skipped) + "."
    return {
        "id": table_id,
        "title": "Precision ladder: b1 vs b8 (left padded) out-of-band rate per scoring plan",
        "columns": [
            "plan",
            "fp32 layers",
            "fp32 params %",
            "OOB %",
            "CI low %",
            "CI high %",
            "mean |dlogp|",
            "fp16 fallbacks",
            "tokens",
        ],
        "rows": rows,
        "notes": notes,
        "reference": "T7",
        "random_init": random_init,
    }


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


def default_ks(model, gpu: bool) -> list[int]:
    """The default layer counts (4 8 12 on GPU, 8 on CPU), capped at the model's decoder layers."""
    from bloggap_plugin.core.precision import decoder_layers

    n_layers = len(decoder_layers(model))
    return sorted({min(k, n_layers) for k in ((4, 8, 12) if gpu else (8,))})


def run(args: argparse.Namespace) -> int:
    from bloggap_plugin.commands.attribute import check_json_option, write_json_option
    from bloggap_plugin.envinfo import environment_record
    from bloggap_plugin.errors import UsageError, check_positive
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
