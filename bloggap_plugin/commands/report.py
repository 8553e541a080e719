"""``bloggap report``: BENCHMARKS.md, PNG plots and README's headline table from ``benchmarks/results/<device>/*.json``
alone."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

HELP = ("Build BENCHMARKS.md and plots from the benchmark result JSON files, beside the reference study's tables, "
        "and README's headline table.")


@dataclass
class ReportConfig:
    """Settings of ``bloggap report`` (each field is a flag with the help text below)."""

    results: str = field(default="benchmarks/results", metadata={"help": "Results folder with <device>/*.json."})
    output: str = field(default="BENCHMARKS.md", metadata={"help": "Markdown file to write."})
    plots: str = field(default="benchmarks/plots", metadata={"help": "Folder for the PNG plots."})
    no_plots: bool = field(default=False, metadata={"help": "Write the Markdown only."})
    require: list[str] = field(default_factory=list, metadata={
        "help": "Benchmark names that must be present for every device (a missing one is an error)."})
    readme: str = field(default="", metadata={
        "help": "README whose lines between <!-- bloggap:headline:start --> and <!-- bloggap:headline:end --> get "
                "the decision table (default: README.md beside --output, when that file exists; 'none': no README)."})
    headline: str = field(default="", metadata={
        "help": "YAML file naming the decision table's rows and the result cell each cites "
                "(default: docs/headline.yaml beside the README)."})


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
                               require=config.require, readme=_readme_path(config), headline=config.headline or None)
    except ReportError as err:
        print(f"bloggap report: {err}", file=sys.stderr)
        return 2
    readme = f"; the headline table in {written['readme']}" if written["readme"] else ""
    print(f"wrote {written['markdown']} from {len(written['files'])} result file(s); {len(written['plots'])} plot(s)"
          f"{readme}")
    return 0


def _readme_path(config: ReportConfig) -> Path | None:
    """The README to update: the one named, none for 'none', else README.md beside the output when it exists."""
    if config.readme.lower() == "none":
        return None
    if config.readme:
        return Path(config.readme)
    beside = Path(config.output).parent / "README.md"
    return beside if beside.is_file() else None
