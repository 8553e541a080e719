"""``bloggap attribute``: where in the network the batch-shape divergence enters (reference table T8).

Samples completions from the model itself on the *calibration* prompts (disjoint from the prompts
``bloggap ladder`` evaluates on), scores each row alone (batch 1, unpadded) and in left-padded chunks of
``--batch-size`` rows, and reports the relative hidden-state divergence after the embedding and after every
decoder layer, the per-layer increments, quartile sums, the top-k layers and the best contiguous window of k
(what arm D's ``layers: auto`` picks), plus the out-of-band share of the same tokens' log-probs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

HELP = "Per-layer hidden-state divergence between batch 1 and batch 8 (where to put fp32 layers)."

SCHEMA_VERSION = 1
# The probe's 8 x 8 prompt grid: evaluation prompts come first, calibration prompts are the last 16.
N_EVAL_PROMPTS = 48


def eval_prompts() -> list[str]:
    """The evaluation prompts (first 48 of the 8 x 8 grid)."""
    from bloggap_plugin.core.probe import builtin_prompts

    return builtin_prompts(64)[:N_EVAL_PROMPTS]


def calibration_prompts() -> list[str]:
    """The calibration prompts (last 16 of the grid): disjoint from :func:`eval_prompts`."""
    from bloggap_plugin.core.probe import builtin_prompts

    return builtin_prompts(64)[N_EVAL_PROMPTS:]


def rollout_rows(
    model, tokenizer, prompts: Sequence[str], rows: int, new_tokens: int, seed: int, gen_batch: int = 8
):
    """Sample ``rows`` completions of exactly ``new_tokens`` tokens (prompts cycled) and lay them out
    left-padded as TRL does. Returns ``(input_ids [N, L], attention_mask [N, L], prompt texts)`` on CPU."""

    from bloggap_plugin.core.probe import left_pad, sample_rollouts

    cycled = [prompts[i % len(prompts)] for i in range(rows)]
    rollouts = sample_rollouts(
        model,
        tokenizer,
        num_seqs=rows,
        max_new_tokens=new_tokens,
        seed=seed,
        prompts=cycled,
        batch_size=gen_batch,
    )
    seqs = [list(r.prompt) + list(r.completion) for r in rollouts.rows]
    ids, mask = left_pad(seqs, rollouts.pad_token_id)
    return ids, mask, cycled


def b1_vs_bn(
    plan, input_ids, attention_mask, logits_to_keep: int, batch_size: int = 8, positions: str = "mask"
):
    """Score with ``plan`` each row alone (unpadded, batch 1) and in chunks of ``batch_size`` left-padded
    rows; returns ``(logp_b1, logp_bn)``, each ``[N, K]`` fp32 on CPU."""
    import torch

    from bloggap_plugin.core.attribution import strip_padding

    singles = []
    for r in range(input_ids.shape[0]):
        row, _ = strip_padding(input_ids[r], attention_mask[r])
        singles.append(
            plan.token_logprobs(row, torch.ones_like(row), logits_to_keep, positions=positions).cpu()
        )
    batched = plan.token_logprobs(
        input_ids, attention_mask, logits_to_keep, batch_size=batch_size, positions=positions
    )
    return torch.cat(singles, dim=0), batched.cpu()


def run_attribution(
    model,
    tokenizer,
    *,
    rows: int = 32,
    new_tokens: int = 48,
    batch_size: int = 8,
    k: int = 8,
    positions: str = "mask",
    seed: int = 4321,
    band: float = 0.1,
    progress: Callable[[str], object] | None = None,
) -> dict:
    """The attribution profile (JSON-ready) of ``model`` on calibration-prompt rollouts."""
    from bloggap_plugin.core.attribution import divergence_profile
    from bloggap_plugin.core.precision import decoder_layers, make_plan
    from bloggap_plugin.core.probe import compare
    from bloggap_plugin.errors import UsageError

    n_layers = len(decoder_layers(model))
    if not 1 <= k <= n_layers:
        raise UsageError(f"--k {k} is out of range: this model has {n_layers} decoder layers; give k in 1..{n_layers}")
    say = progress or (lambda _msg: None)
    say(f"sampling {rows} calibration rollouts x {new_tokens} tokens")
    device = next(model.parameters()).device
    ids, mask, prompts = rollout_rows(model, tokenizer, calibration_prompts(), rows, new_tokens, seed)
    ids, mask = ids.to(device), mask.to(device)
    say("hidden-state divergence per layer")
    profile = divergence_profile(
        model, ids, mask, batch_size=batch_size, logits_to_keep=new_tokens, positions=positions
    )
    b1, bn = b1_vs_bn(make_plan(model, "bf16"), ids, mask, new_tokens, batch_size, positions)
    cell = compare(b1, bn, band=band)
    return {
        "profile": profile.to_dict(k=k),
        "logprob_b1_vs_bn": cell,
        "rows": rows,
        "new_tokens": new_tokens,
        "prompts": "calibration (last 16 of the 8 x 8 grid; disjoint from the ladder's evaluation prompts)",
        "distinct_prompts": len(set(prompts)),
        "seed": seed,
    }


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
