"""``bloggap ladder``: the precision ladder (reference table T7): how much of the batch-shape noise each
scoring plan removes, and what share of the parameters it runs in fp32.

Rollouts are sampled from the model itself (bf16 by default) on the evaluation prompts; the guided layer
choices come from an attribution profile measured on *calibration* rollouts from disjoint prompts. Every rung
is a :func:`bloggap_plugin.core.plans.make_plan` plan scoring the same tokens alone (batch 1, unpadded)
and in left-padded chunks of 8; the share of those tokens whose ratio leaves ``[1 - band, 1 + band]`` is the
rung's out-of-band rate. Rungs: bf16, fp32 head, first-k / last-k / guided top-k / guided window-k (each with
fp32 norm and head), fp16, fp16 + guided top-k, all fp32. The measurement is
:func:`bloggap_plugin.measure.precision_ladder.run_ladder`; this module parses and prints.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Literal

from bloggap_plugin.commands._measured import ModelOutputConfig, configure_with

HELP = "Precision ladder: out-of-band rate b1 vs b8 for each scoring plan (bf16 ... all fp32)."

SCHEMA_VERSION = 1
BATCH = 8
"""Rows per chunk on the batched side of every rung (``run_ladder``'s ``batch_size``)."""


@dataclass
class LadderConfig(ModelOutputConfig):
    """``bloggap ladder``'s settings (each field is a flag; ``--config FILE.yaml`` sets any of them)."""

    dtype: Literal["bf16", "fp32"] = field(default="bf16", metadata={"help": "policy dtype (bf16)"})
    rows: int | None = field(default=None, metadata={
        "help": f"evaluation rollouts, >= {BATCH} (the batched side scores chunks of {BATCH}; default 128 GPU, 16 CPU)",
        "min": BATCH, "deprecated": ["--num-seqs", "--num_seqs"]})
    calibration_rows: int | None = field(default=None, metadata={
        "help": f"calibration rollouts, >= {BATCH} (32 GPU, 8 CPU)", "min": BATCH})
    new_tokens: int | None = field(default=None, metadata={"help": "tokens per rollout (48 GPU, 24 CPU)", "min": 1,
                                                           "deprecated": ["--max-new-tokens", "--max_new_tokens"]})
    k: list[int] | None = field(default=None, metadata={
        "help": "layer counts, each in 1..layers of the model (default 4 8 12 GPU, 8 CPU, capped at the layers)",
        "min": 1})
    fp16: Literal["auto", "on", "off"] = field(default="auto", metadata={
        "help": "fp16 rungs (auto: off on CPU, where fp16 is slow)"})
    seed: int = field(default=1234, metadata={"help": "sampling seed (default 1234)", "min": 0, "max": 2**32 - 1})


configure = configure_with(LadderConfig)


def run(args: argparse.Namespace) -> int:
    from bloggap_plugin.commands._measured import checked_config, command_payload, emit, load_for
    from bloggap_plugin.core.errors import UsageError
    from bloggap_plugin.measure.precision_ladder import default_ks, ladder_table, run_ladder
    from bloggap_plugin.results import format_text_table

    config = checked_config(LadderConfig, args, ("rows", "calibration_rows", "new_tokens"))
    if config.k is not None and any(k < 1 for k in config.k):
        raise UsageError(f"--k {' '.join(str(k) for k in config.k if k < 1)}: layer counts must be >= 1")
    device, model, tokenizer = load_for(config, "ladder")
    gpu = device.startswith("cuda")
    result = run_ladder(  # checks --k against the model's layer count before sampling anything
        model,
        tokenizer,
        rows=config.rows if config.rows is not None else (128 if gpu else 16),
        calibration_rows=config.calibration_rows if config.calibration_rows is not None else (32 if gpu else 8),
        new_tokens=config.new_tokens if config.new_tokens is not None else (48 if gpu else 24),
        ks=config.k or default_ks(model, gpu),
        positions=config.positions,
        fp16={"on": True, "off": False}.get(config.fp16, gpu),
        batch_size=BATCH,
        seed=config.seed,
        progress=lambda msg: print(f"[ladder] {msg}", file=sys.stderr),
    )
    table = ladder_table(result)
    payload = command_payload("ladder", SCHEMA_VERSION, device, config, model, result, [table])
    emit(payload, format_text_table(table), config.json)
    return 0
