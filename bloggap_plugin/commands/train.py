"""``bloggap train RECIPE``: GRPO with a recipe (GRPOConfig fields + gap: section), offline, live gap/* metrics.

The flags are the fields of :class:`bloggap_plugin.trl.run.TrainConfig` (``--config FILE.yaml`` sets any of them)
plus, as ``trl grpo`` does, every ``GRPOConfig`` field (``--learning_rate 1e-6``, ``--beta 0.04``, ...), applied
after the recipe. Both need TRL imported, so they are added to the parser on its first use (parsing or ``--help``):
``bloggap --help`` and the other commands stay fast.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys

from bloggap_plugin.commands._config import OneLineParser

HELP = "Train GRPO with a recipe (recipes/arm_A.yaml .. arm_J.yaml) and live gap/* metrics."
GRPO_GROUP = "GRPOConfig overrides"
_WANDB_OFFLINE_LINE = "[INFO] Running in WANDB offline mode"
"""What transformers prints on import when WANDB_MODE=offline (the plugin's default), on stdout."""


class _HelpAll(argparse.Action):
    """``--help-all``: the help with every GRPOConfig flag, then exit."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser._show_all = True
        parser.print_help()
        parser.exit()


class _TrainParser(OneLineParser):
    """``bloggap train``'s parser: TrainConfig's and GRPOConfig's flags are added on first use."""

    _flags_added = False

    def _add_flags(self) -> None:
        if self._flags_added:
            return
        self._flags_added = True
        # importing TRL imports transformers' integrations, which print "[INFO] Running in WANDB offline mode" to
        # stdout when WANDB_MODE=offline: stdout carries the summary JSON alone, and that line is dropped
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            from bloggap_plugin.commands._config import add_config_arguments
            from bloggap_plugin.trl.run import TrainConfig

            add_config_arguments(self, TrainConfig)
            # report_to is str | list[str]: its flag takes a list, and argparse's list flag drops the field's "none"
            self.set_defaults(report_to=TrainConfig.__dataclass_fields__["report_to"].default)
            self.add_argument("--help-all", action=_HelpAll, help="show every flag, GRPOConfig's fields included")
            self.set_defaults(_grpo_fields=_add_grpo_flags(self, taken={f.dest for f in self._actions}))
        rest = [line for line in printed.getvalue().splitlines() if line != _WANDB_OFFLINE_LINE]
        if rest:
            print("\n".join(rest), file=sys.stderr)

    def parse_known_args(self, args=None, namespace=None):  # noqa: D102 - argparse's
        self._add_flags()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        """The flags of ``bloggap train`` itself; with ``--help-all`` also one per GRPOConfig field (hundreds)."""
        self._add_flags()
        if getattr(self, "_show_all", False):
            return super().format_help()
        groups, usage = self._action_groups, self.usage
        self._action_groups = [group for group in groups if group.title != GRPO_GROUP]
        self.usage = f"{self.prog} RECIPE [flags] [GRPOConfig flags: {self.prog} --help-all]"
        try:
            text = super().format_help()
        finally:
            self._action_groups, self.usage = groups, usage
        return text + (f"\n{GRPO_GROUP}:\n  every GRPOConfig field is a flag too (--learning_rate 1e-6, --beta 0.04, ...), "
                       f"applied after the recipe: {self.prog} --help-all lists them\n")

    def get_default(self, dest: str):  # noqa: D102 - argparse's (cli reads _config_types before parsing)
        self._add_flags()
        return super().get_default(dest)


def _add_grpo_flags(parser: argparse.ArgumentParser, taken: set[str]) -> tuple[str, ...]:
    """One flag per ``GRPOConfig`` field not already a TrainConfig field, in an argument group; a flag left out
    leaves the recipe's value (its default is suppressed). Returns the field names."""
    import copy
    import dataclasses
    import typing

    from transformers import HfArgumentParser
    from trl import GRPOConfig

    group = parser.add_argument_group(GRPO_GROUP, "any GRPOConfig field, applied after the recipe (as trl grpo takes "
                                                  "them)")
    hints = typing.get_type_hints(GRPOConfig)
    names = []
    for spec in dataclasses.fields(GRPOConfig):
        if not spec.init or spec.name in taken:
            continue
        spec = copy.copy(spec)
        spec.type = hints[spec.name]
        HfArgumentParser._parse_dataclass_field(group, spec)
        names.append(spec.name)
    for action in parser._actions:
        if action.dest in names:
            action.default = argparse.SUPPRESS
    return tuple(names)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.__class__ = _TrainParser  # flags on first use: see _TrainParser


def _integrations(value: str | list) -> list[str]:
    """``--report-to``'s names as TRL's ``report_to`` list: several flag values, a YAML list, or comma-separated
    (``--report-to wandb tensorboard``, ``--report-to wandb,tensorboard``, ``report_to: [wandb, tensorboard]``)."""
    items = [value] if isinstance(value, str) else value
    return [name.strip() for item in items for name in str(item).split(",") if name.strip()]


def train_config_from_args(args: argparse.Namespace):
    """The :class:`~bloggap_plugin.trl.run.TrainConfig` of parsed ``args``: the GRPOConfig flags given join
    ``extra_overrides`` (a flag wins over the same key there)."""
    import dataclasses

    from bloggap_plugin.commands._config import config_from_args
    from bloggap_plugin.trl.run import TrainConfig

    report_to = getattr(args, "report_to", None)
    if isinstance(report_to, list) or (isinstance(report_to, str) and "," in report_to):  # the default stays as is
        args.report_to = _integrations(report_to)
    config = config_from_args(TrainConfig, args)
    given = {name: getattr(args, name) for name in getattr(args, "_grpo_fields", ()) if hasattr(args, name)}
    if given:
        config = dataclasses.replace(config, extra_overrides={**(config.extra_overrides or {}), **given})
    return config


def _finish_wandb() -> None:
    """Close a wandb run the trainer opened (``--report-to wandb``), so its closing lines are printed now."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()


def run(args: argparse.Namespace) -> int:
    """Train; bad input raises ``UsageError`` before the model loads (``bloggap: error: ...``, exit 2).

    stdout carries the summary JSON alone (``bloggap train ... > summary.json``); the per-step logs go to stderr.
    Ctrl-C (SIGINT) stops training at once: the summary of the steps that finished is printed, exit 130; SIGTERM
    and SIGHUP do the same (exit 128 + the signal's number). A failed final save (``--save-final``) exits 1."""
    from bloggap_plugin.core.errors import UsageError
    from bloggap_plugin.trl.run import run_training, stop_signals_interrupt

    config = train_config_from_args(args)
    if config.log_jsonl is not None:
        from pathlib import Path

        log = Path(config.log_jsonl)
        if log.is_file() and log.stat().st_size > 0:
            raise UsageError(f"--log-jsonl {log}: the file exists and is not empty; bloggap train does not append to "
                             "another file's lines: give a new path, or remove it first")
    stopped_by: list[int] = []
    try:
        with stop_signals_interrupt(stopped_by), contextlib.redirect_stdout(sys.stderr):
            summary = run_training(config)
            _finish_wandb()  # its closing lines now, on stderr, not after the summary at exit
    except KeyboardInterrupt:
        print(f"bloggap train: {_stop_words(stopped_by)} before training started; nothing was trained",
              file=sys.stderr)
        return _stop_code(stopped_by)
    print(json.dumps(summary, indent=2))
    if summary.get("interrupted"):
        print(f"bloggap train: {_stop_words(stopped_by)} after {summary['steps']} optimizer step(s); the summary "
              "above covers them (no final save)", file=sys.stderr)
        return _stop_code(stopped_by)
    if summary.get("save_final_error"):
        print(f"bloggap train: {summary['save_final_error']}", file=sys.stderr)
        return 1
    return 0


def _stop_words(received: list[int]) -> str:
    import signal

    return f"stopped by {signal.Signals(received[0]).name}" if received else "interrupted"


def _stop_code(received: list[int]) -> int:
    """128 + the signal's number: 130 for Ctrl-C, 143 for SIGTERM."""
    return 128 + (received[0] if received else 2)
