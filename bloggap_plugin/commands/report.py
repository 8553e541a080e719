"""``bloggap report``: BENCHMARKS.md and PNG plots from ``benchmarks/results/<device>/*.json`` alone."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

HELP = "Build BENCHMARKS.md and plots from the benchmark result JSON files, beside the reference study's tables."


@dataclass
class ReportConfig:
    """Settings of ``bloggap report`` (each field is a flag with the help text below)."""

    results: str = field(default="benchmarks/results", metadata={"help": "Results folder with <device>/*.json."})
    output: str = field(default="BENCHMARKS.md", metadata={"help": "Markdown file to write."})
    plots: str = field(default="benchmarks/plots", metadata={"help": "Folder for the PNG plots."})
    no_plots: bool = field(default=False, metadata={"help": "Write the Markdown only."})
    require: list[str] = field(default_factory=list, metadata={
        "help": "Benchmark names that must be present for every device (a missing one is an error)."})


def configure(parser: argparse.ArgumentParser) -> None:
    from bloggap_plugin.commands._config import add_config_arguments

    add_config_arguments(parser, ReportConfig)
    for action in parser._actions:
        if action.dest == "require":
            action.nargs = "*"  # `--require` with no names: nothing required (as before the config dataclass)


def run(args: argparse.Namespace) -> int:
    import sys

    from bloggap_plugin.commands._config import config_from_args
    from bloggap_plugin.report_builder import ReportError, build_report

    config = config_from_args(ReportConfig, args)
    try:
        written = build_report(config.results, config.output, None if config.no_plots else config.plots,
                               require=config.require)
    except ReportError as err:
        print(f"bloggap report: {err}", file=sys.stderr)
        return 2
    print(f"wrote {written['markdown']} from {len(written['files'])} result file(s); {len(written['plots'])} plot(s)")
    return 0
