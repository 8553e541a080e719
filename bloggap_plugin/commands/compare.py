"""``bloggap compare RECIPES... --seeds 0 1 --task arith --max-steps N``: the reward comparison across arms."""

from __future__ import annotations

import argparse
import signal
import sys

HELP = "Run every recipe x seed (same prompts and sampling seeds), then the T10 reward table, a plot and the resolution."


def _overrides(text: str | dict | list | None) -> dict:
    """``--override`` (a YAML or JSON mapping, as train's ``--extra-overrides``) or ``extra_overrides`` from a
    ``--config`` file (a mapping) as a dict."""
    from bloggap_plugin._input_files import load_yaml
    from bloggap_plugin.compare import CompareError

    if text is None or text == "":
        return {}
    value = text
    example = "e.g. '{num_iterations: 2}'"
    if isinstance(text, str):
        try:
            value = load_yaml(text, "--override", error=CompareError)
        except CompareError as err:
            reason = " ".join(str(err).split())[:200]
            raise CompareError(f"--override must be a mapping of GRPOConfig fields (YAML or JSON), {example} "
                               f"({reason})") from None
    if not isinstance(value, dict):
        raise CompareError(f"--override must be a mapping of GRPOConfig fields (YAML or JSON), {example}")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    from bloggap_plugin.commands._config import add_config_arguments
    from bloggap_plugin.compare import CompareConfig

    add_config_arguments(parser, CompareConfig)
    parser.add_argument("--table-only", "--table_only", action="store_true", help="do not train: rebuild table, JSON and plot from the logs")


def run(args: argparse.Namespace) -> int:
    from bloggap_plugin.commands._config import config_from_args
    from bloggap_plugin.compare import (
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
        config = config_from_args(CompareConfig, args)
        config.extra_overrides = _overrides(config.extra_overrides)
        if args.table_only:
            results = build_results(config, validate_config(config, training=False))
            if not results["runs"]:
                raise CompareError(f"--table-only: no finished run of these recipes and seeds in {config.output_dir}"
                                   "/runs, so the table would be empty; run the sweep first (without --table-only)")
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
    budget = results.get("time_budget") or {}
    if budget.get("stopped") or budget.get("not_started"):
        return 3  # the time budget ended the call with runs left: re-run to continue
    return 1 if failed or results["set_aside"] else 0
