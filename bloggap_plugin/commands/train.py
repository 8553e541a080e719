"""``bloggap train RECIPE``: GRPO with a recipe (GRPOConfig fields + gap: section), offline, live gap/* metrics.

The flags are the fields of :class:`bloggap_plugin.trl.train.TrainConfig` (``--config FILE.yaml`` sets any of them)
plus, as ``trl grpo`` does, every ``GRPOConfig`` field (``--learning_rate 1e-6``, ``--beta 0.04``, ...), applied
after the recipe. Both need TRL imported, so they are added to the parser on its first use (parsing or ``--help``):
``bloggap --help`` and the other commands stay fast.
"""

from __future__ import annotations

import argparse
import json

HELP = "Train GRPO with a recipe (recipes/arm_A.yaml .. arm_H.yaml) and live gap/* metrics."
GRPO_GROUP = "GRPOConfig overrides"


class _TrainParser(argparse.ArgumentParser):
    """``bloggap train``'s parser: TrainConfig's and GRPOConfig's flags are added on first use."""

    _flags_added = False

    def _add_flags(self) -> None:
        if self._flags_added:
            return
        self._flags_added = True
        from bloggap_plugin.commands._config import add_config_arguments
        from bloggap_plugin.trl.train import TrainConfig

        add_config_arguments(self, TrainConfig)
        self.set_defaults(_grpo_fields=_add_grpo_flags(self, taken={f.dest for f in self._actions}))

    def parse_known_args(self, args=None, namespace=None):  # noqa: D102 - argparse's
        self._add_flags()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:  # noqa: D102 - argparse's
        self._add_flags()
        return super().format_help()

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


def train_config_from_args(args: argparse.Namespace):
    """The :class:`~bloggap_plugin.trl.train.TrainConfig` of parsed ``args``: the GRPOConfig flags given join
    ``extra_overrides`` (a flag wins over the same key there)."""
    import dataclasses

    from bloggap_plugin.commands._config import config_from_args
    from bloggap_plugin.trl.train import TrainConfig

    config = config_from_args(TrainConfig, args)
    given = {name: getattr(args, name) for name in getattr(args, "_grpo_fields", ()) if hasattr(args, name)}
    if given:
        config = dataclasses.replace(config, extra_overrides={**(config.extra_overrides or {}), **given})
    return config


def run(args: argparse.Namespace) -> int:
    """Train; bad input raises ``UsageError`` before the model loads (``bloggap: error: ...``, exit 2)."""
    from bloggap_plugin.trl.train import run_training

    summary = run_training(train_config_from_args(args))
    print(json.dumps(summary, indent=2))
    return 0
