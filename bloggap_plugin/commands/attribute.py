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
import sys
from dataclasses import dataclass, field
from typing import Literal

from bloggap_plugin.commands._measured import ModelOutputConfig, configure_with

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


@dataclass
class AttributeConfig(ModelOutputConfig):
    """``bloggap attribute``'s settings (each field is a flag; ``--config FILE.yaml`` sets any of them)."""

    dtype: Literal["bf16", "fp16", "fp32"] = field(default="bf16", metadata={"help": "model dtype (bf16)"})
    rows: int = field(default=32, metadata={"help": "calibration rollouts, at least --batch-size (default 32)", "min": 2,
                                            "deprecated": ["--num-seqs", "--num_seqs"]})
    new_tokens: int = field(default=48, metadata={"help": "tokens per rollout (default 48)", "min": 1,
                                                  "deprecated": ["--max-new-tokens", "--max_new_tokens"]})
    batch_size: int | None = field(default=None, metadata={
        "help": "rows per chunk on the batched side, at most --rows (default 8, capped at --rows)", "min": 2})
    k: int | None = field(default=None, metadata={
        "help": "layers for top-k and the window, in 1..layers of the model (default 8, capped at the layers)", "min": 1})
    seed: int = field(default=4321, metadata={"help": "sampling seed (default 4321)", "min": 0, "max": 2**32 - 1})


configure = configure_with(AttributeConfig)


def run(args: argparse.Namespace) -> int:
    from bloggap_plugin.commands._measured import checked_config, command_payload, emit, load_for
    from bloggap_plugin.core.model_parts import decoder_layers
    from bloggap_plugin.measure.attribution import run_attribution

    config = checked_config(AttributeConfig, args, ("rows", "new_tokens", "batch_size", "k"))
    if config.batch_size is not None and config.batch_size > config.rows:
        from bloggap_plugin.core.errors import UsageError

        raise UsageError(f"--batch-size {config.batch_size} is more than --rows {config.rows}: a chunk cannot hold more "
                         "rows than are sampled; give --batch-size <= --rows")
    batch_size = config.batch_size if config.batch_size is not None else min(8, config.rows)
    device, model, tokenizer = load_for(config, "attribute")
    result = run_attribution(
        model,
        tokenizer,
        rows=config.rows,
        new_tokens=config.new_tokens,
        batch_size=batch_size,
        k=config.k if config.k is not None else min(8, len(decoder_layers(model))),
        positions=config.positions,
        seed=config.seed,
        progress=lambda msg: print(f"[attribute] {msg}", file=sys.stderr),
    )
    payload = command_payload("attribute", SCHEMA_VERSION, device, config, model, result)
    emit(payload, format_profile(result), config.json)
    return 0
