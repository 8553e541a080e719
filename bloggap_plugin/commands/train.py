"""``bloggap train RECIPE``: GRPO with a recipe (GRPOConfig fields + gap: section), offline, live gap/* metrics."""

from __future__ import annotations

import argparse
import json

HELP = "Train GRPO with a recipe (recipes/arm_A.yaml .. arm_H.yaml) and live gap/* metrics."


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML: GRPOConfig fields plus a gap: section")
    parser.add_argument("--model", default="smollm2", help="model spec (default smollm2, offline)")
    parser.add_argument("--task", default="arith", help="task: arith (default) or gsm8k")
    parser.add_argument("--data", default=None, metavar="PATH",
                        help="gsm8k: the data as a local .jsonl/.json/.parquet file or folder, e.g. ../shared/data/gsm8k "
                             "(default: $BLOGGAP_GSM8K_DATA, else openai/gsm8k from the Hugging Face hub or its cache)")
    parser.add_argument("--calc-steps", default=None, metavar="N|LOW-HIGH",
                        help="gsm8k: train on the problems with N (or LOW-HIGH) <<...>> calculation steps")
    parser.add_argument("--max-steps", type=int, default=None, help="optimizer steps, >= 1 (default: the recipe's)")
    parser.add_argument("--output-dir", default="bloggap-runs/train", help="trainer output folder")
    parser.add_argument("--report-to", default="none", help="none, wandb, tensorboard, trackio ...")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--log-jsonl", default=None, help="also write one JSON line per logged step here")


def _task_kwargs(args: argparse.Namespace) -> dict | None:
    kwargs = {key: value for key, value in (("data", args.data), ("calc_steps", args.calc_steps)) if value is not None}
    return kwargs or None


def run(args: argparse.Namespace) -> int:
    """Train; bad input raises ``UsageError`` before the model loads (``bloggap: error: ...``, exit 2)."""
    from bloggap_plugin.trl.train import run_training

    summary = run_training(args.recipe, model=args.model, task=args.task, max_steps=args.max_steps,
                           output_dir=args.output_dir, report_to=args.report_to, seed=args.seed,
                           log_jsonl=args.log_jsonl, device=args.device,
                           task_kwargs=_task_kwargs(args))
    print(json.dumps(summary, indent=2))
    return 0
