"""``bloggap compare RECIPES... --seeds 0 1 --task arith --max-steps N``: the reward comparison across arms."""

from __future__ import annotations

import argparse
import json
import signal
import sys

HELP = "Run every recipe x seed (same prompts and sampling seeds), then the T10 reward table, a plot and the resolution."


def _overrides(text: str | None) -> dict:
    from bloggap_plugin.compare import CompareError

    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise CompareError(f"--override must be a JSON object, e.g. '{{\"num_iterations\": 2}}' ({err.msg})") from None
    if not isinstance(value, dict):
        raise CompareError("--override must be a JSON object of GRPOConfig fields, e.g. '{\"num_iterations\": 2}'")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipes", nargs="+", help="recipe files, one per arm (e.g. recipes/arm_*.yaml)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seeds (default: 0 1)")
    parser.add_argument("--task", choices=("arith", "gsm8k"), default="arith", help="training task (default: arith)")
    parser.add_argument("--difficulty", type=int, default=None, help="arith level 1-5 (default: the task's default)")
    parser.add_argument("--n", type=int, default=None, help="number of training prompts (default: the task's default)")
    parser.add_argument("--data", default=None, metavar="PATH",
                        help="gsm8k: a local file/folder (.jsonl, .json, .parquet), e.g. ../shared/data/gsm8k "
                             "(default: $BLOGGAP_GSM8K_DATA, else openai/gsm8k from the hub or its cache)")
    parser.add_argument("--calc-steps", default=None, metavar="N|LOW-HIGH",
                        help="gsm8k: only problems with N (or LOW-HIGH) <<...>> calculation steps")
    parser.add_argument("--use-vllm", action="store_true",
                        help="generate with TRL's colocated vLLM engine (needs CUDA and vLLM; the GPU's memory is "
                             "divided among the --parallel runs)")
    parser.add_argument("--max-steps", type=int, default=60, help="optimizer steps per run (default: 60)")
    parser.add_argument("--model", default="smollm2", help="model spec (default: smollm2)")
    parser.add_argument("--output-dir", default="compare_out", help="folder for logs, table, JSON, plot")
    parser.add_argument("--parallel", type=int, default=1, help="runs in flight at once, each its own process (default: 1)")
    parser.add_argument("--last-n", type=int, default=30, help="steps in the 'reward last-k' window (default: 30)")
    parser.add_argument("--baseline", default=None, help="arm the deltas are taken against (default: A, else the first)")
    parser.add_argument("--override", default=None, help="JSON object of GRPOConfig fields applied to every arm")
    parser.add_argument("--smooth", type=int, default=5, help="rolling-mean window of the reward plot (default: 5)")
    parser.add_argument("--run-fn", default=None, help="module:function that trains one run (default: run_training)")
    parser.add_argument("--table-only", action="store_true", help="do not train: rebuild table, JSON and plot from the logs")


def run(args: argparse.Namespace) -> int:
    from bloggap_plugin.compare import (
        DEFAULT_RUN_FN,
        CompareConfig,
        CompareError,
        SweepStopped,
        build_results,
        print_table,
        run_compare,
        validate_config,
        write_outputs,
    )

    try:
        config = CompareConfig(
            recipes=list(args.recipes),
            seeds=list(args.seeds),
            task=args.task,
            max_steps=args.max_steps,
            model=args.model,
            output_dir=args.output_dir,
            parallel=args.parallel,
            difficulty=args.difficulty,
            n=args.n,
            data=args.data,
            calc_steps=args.calc_steps,
            use_vllm=args.use_vllm,
            last_n=args.last_n,
            baseline=args.baseline,
            extra_overrides=_overrides(args.override),
            run_fn=args.run_fn or DEFAULT_RUN_FN,
            smooth=args.smooth,
        )
        if args.table_only:
            results = build_results(config, validate_config(config, training=False))
            write_outputs(config, results)
            for run_id, why in results["set_aside"].items():
                print(f"[compare] {run_id}: set aside: {why}")
            failed = {}
        else:
            results = run_compare(config)
            failed = results.get("failed", {})
    except CompareError as err:
        print(f"bloggap compare: {err}", file=sys.stderr)
        return 2
    except (SweepStopped, KeyboardInterrupt) as err:
        signum = err.signum if isinstance(err, SweepStopped) else signal.SIGINT
        stopped = err.stopped if isinstance(err, SweepStopped) else (err.args[0] if err.args else 0)
        print(f"bloggap compare: stopped by {signal.Signals(signum).name}; stopped {stopped} run(s) in flight; "
              "finished runs are kept: re-run the same command to resume", file=sys.stderr)
        return 128 + int(signum)
    print_table(results)
    print(f"\nwritten: {config.output_dir}/compare.json, compare.md, reward_curves.png")
    return 1 if failed or results["set_aside"] else 0
