"""``bloggap report``: BENCHMARKS.md and PNG plots from ``benchmarks/results/<device>/*.json`` alone."""

from __future__ import annotations

import argparse

HELP = "Build BENCHMARKS.md and plots from the benchmark result JSON files, beside the reference study's tables."


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", default="benchmarks/results", help="results folder with <device>/*.json")
    parser.add_argument("--output", default="BENCHMARKS.md", help="Markdown file to write (default: BENCHMARKS.md)")
    parser.add_argument("--plots", default="benchmarks/plots", help="folder for PNG plots (default: benchmarks/plots)")
    parser.add_argument("--no-plots", action="store_true", help="write the Markdown only")
    parser.add_argument("--require", nargs="*", default=[], help="benchmark names that must be present per device")


def run(args: argparse.Namespace) -> int:
    import sys

    from bloggap_plugin.report import ReportError, build_report

    try:
        written = build_report(args.results, args.output, None if args.no_plots else args.plots, require=args.require)
    except ReportError as err:
        print(f"bloggap report: {err}", file=sys.stderr)
        return 2
    print(f"wrote {written['markdown']} from {len(written['files'])} result file(s); {len(written['plots'])} plot(s)")
    return 0
