"""``bloggap attribute``: where in the network the batch-shape divergence enters (reference table T8).

Samples completions from the model itself on the *calibration* prompts (disjoint from the prompts
``bloggap ladder`` evaluates on), scores each row alone (batch 1, unpadded) and in left-padded chunks of
``--batch-size`` rows, and reports the relative hidden-state divergence after the embedding and after every
decoder layer, the per-layer increments, quartile sums, the top-k layers and the best contiguous window of k
(what arm D's ``layers: auto`` picks), plus the out-of-band share of the same tokens' log-probs. The
measurement is :func:`bloggap_plugin.measure.attribution.run_attribution`; this module parses and prints.
"""

from __future__ import annotations

import argparse
import json
import sys

HELP = "Per-layer hidden-state divergence between batch 1 and batch 8 (where to put fp32 layers)."

SCHEMA_VERSION = 1


def format_profile(result: dict) -> str:
    p = result["profile"]
    lines = [f"{'boundary':<14}{'rel. divergence':>18}{'increment':>14}"]
    lines.append(f"{'embedding':<14}{p['divergence'][0]:>18.3e}{'':>14}")
    for i, inc in enumerate(p["increments"]):
        lines.append(f"{'layer ' + str(i):<14}{p['divergence'][i + 1]:>18.3e}{inc:>+14.2e}")
    if p["final_norm_divergence"] is not None:
        lines.append(f"{'final norm':<14}{p['final_norm_divergence']:>18.3e}")
    if "quartile_sums" in p:
        lines.append(
            "quartile sums: " + ", ".join(f"Q{j + 1} {v:+.2e}" for j, v in enumerate(p["quartile_sums"]))
        )
    lines.append(f"top-{p['k']} layers: {p['top_k']}   best window of {p['k']}: {p['best_window']}")
    cell = result["logprob_b1_vs_bn"]
    lines.append(
        f"log-probs b1 vs b{p['batch_size']}: {100 * cell['oob']:.2f}% out of band over {cell['n']} tokens "
        f"(mean |dlogp| {cell['abs_dlogp_mean']:.2e})"
    )
    return "\n".join(lines)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="model spec (default: smollm2, offline)")
    parser.add_argument(
        "--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="model dtype (bf16)"
    )
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    parser.add_argument("--attn", default=None, help="attention implementation (default: the model's)")
    parser.add_argument("--rows", type=int, default=32, help="calibration rollouts (default 32)")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens per rollout (default 48)")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per chunk on the batched side (8)")
    parser.add_argument("--k", type=int, default=None,
                        help="layers for top-k and the window, in 1..layers of the model (default 8, capped at the layers)")
    parser.add_argument("--positions", default="mask", choices=("mask", "arange"), help="position ids (mask)")
    parser.add_argument("--seed", type=int, default=4321, help="sampling seed (default 4321)")
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="write JSON to PATH (stdout if no PATH)",
    )


def check_json_option(path: str | None) -> None:
    """Raise ``UsageError`` before measuring if ``--json PATH`` cannot be written (``-`` is stdout)."""
    from bloggap_plugin._io import check_writable_file
    from bloggap_plugin.errors import UsageError

    if path and path != "-":
        problem = check_writable_file(path, "--json")
        if problem:
            raise UsageError(problem)


def write_json_option(path: str, payload: dict) -> None:
    """Write ``payload`` to ``--json PATH`` atomically (a failed write leaves the previous file whole)."""
    from bloggap_plugin._io import atomic_write_text

    atomic_write_text(path, json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")


def run(args: argparse.Namespace) -> int:
    from bloggap_plugin.core.precision import decoder_layers
    from bloggap_plugin.envinfo import environment_record
    from bloggap_plugin.errors import check_positive
    from bloggap_plugin.measure.attribution import run_attribution
    from bloggap_plugin.models import check_model_spec, load_model, resolve_device

    for option, value in (("--rows", args.rows), ("--new-tokens", args.new_tokens),
                          ("--batch-size", args.batch_size), ("--k", args.k)):
        check_positive(option, value)
    check_json_option(args.json)
    device = resolve_device(args.device)
    check_model_spec(args.model)
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=device, attn_implementation=args.attn)

    def progress(msg):
        print(f"[attribute] {msg}", file=sys.stderr)

    result = run_attribution(
        model,
        tokenizer,
        rows=args.rows,
        new_tokens=args.new_tokens,
        batch_size=args.batch_size,
        k=args.k if args.k is not None else min(8, len(decoder_layers(model))),
        positions=args.positions,
        seed=args.seed,
        progress=progress,
    )
    payload = {
        "command": "attribute",
        "schema_version": SCHEMA_VERSION,
        "env": environment_record(device),
        "params": {
            "model": args.model,
            "dtype": args.dtype,
            "attn": getattr(model.config, "_attn_implementation", None),
        },
        "results": result,
    }
    if args.json == "-":
        print(json.dumps(payload, indent=2))
    else:
        print(format_profile(result))
        if args.json:
            write_json_option(args.json, payload)
    return 0
