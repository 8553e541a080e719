"""The shared command-settings mechanism (``bloggap_plugin.commands._config``): dataclass fields as flags,
``--config FILE.yaml`` defaults, errors for unknown fields."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field

import pytest

from bloggap_plugin.commands._config import add_config_arguments, apply_config_file, config_from_args
from bloggap_plugin.core.errors import UsageError


def _csv(text: str) -> list[str]:
    items = [t for t in text.split(",") if t]
    if not set(items) <= {"bf16", "fp16", "fp32"}:
        raise argparse.ArgumentTypeError(f"bad dtypes {text!r}")
    return items


@dataclass
class DemoConfig:
    recipes: list[str] = field(default_factory=list, metadata={"help": "recipe files", "positional": "+"})
    num_seqs: int = field(default=32, metadata={"help": "rollouts"})
    band: float = field(default=0.1, metadata={"help": "ratio band half-width"})
    json_path: str | None = field(default=None, metadata={"help": "write JSON here", "aliases": ["--json"]})
    dtypes: str = field(default="bf16,fp32", metadata={"help": "comma list", "parse": _csv})
    seeds: list[int] = field(default_factory=lambda: [0, 1], metadata={"help": "seeds"})
    no_progress: bool = field(default=False, metadata={"help": "no progress bars"})
    plots: bool = field(default=True, metadata={"help": "draw the plots"})


def _yaml(tmp_path, text: str) -> str:
    """A config file holding ``text``; its path."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="demo")
    add_config_arguments(parser, DemoConfig)
    return parser


def test_defaults_and_flags_both_spellings():
    config = config_from_args(DemoConfig, _parser().parse_args(["a.yaml"]))
    assert config == DemoConfig(recipes=["a.yaml"], dtypes=["bf16", "fp32"])
    args = _parser().parse_args(["a.yaml", "b.yaml", "--num-seqs", "8", "--num_seqs", "9", "--json", "x.json",
                                 "--dtypes", "fp16", "--seeds", "3", "4", "5", "--no-progress", "--band", "0.2"])
    config = config_from_args(DemoConfig, args)
    assert (config.recipes, config.num_seqs, config.json_path, config.dtypes, config.seeds, config.no_progress,
            config.band) == (["a.yaml", "b.yaml"], 9, "x.json", ["fp16"], [3, 4, 5], True, 0.2)


def test_bool_fields_are_switches_so_a_positional_may_follow():
    config = config_from_args(DemoConfig, _parser().parse_args(["--no-progress", "--no-plots", "a.yaml", "b.yaml"]))
    assert (config.recipes, config.no_progress, config.plots) == (["a.yaml", "b.yaml"], True, False)
    config = config_from_args(DemoConfig, _parser().parse_args(["a.yaml"]))
    assert (config.no_progress, config.plots) == (False, True)
    with pytest.raises(SystemExit):  # a switch takes no value
        _parser().parse_args(["a.yaml", "--no-progress=false"])


def test_types_are_checked_from_annotations():
    with pytest.raises(SystemExit):
        _parser().parse_args(["a.yaml", "--num-seqs", "many"])
    with pytest.raises(SystemExit):
        _parser().parse_args(["a.yaml", "--dtypes", "bf16,int8"])


def test_help_lists_every_field_with_its_help():
    text = _parser().format_help()
    for name, help_text in (("--num_seqs", "rollouts"), ("--json_path", "write JSON here"), ("--dtypes", "comma list"),
                            ("--seeds", "seeds"), ("--no_progress", "no progress bars"), ("--config", "YAML")):
        assert name in text and help_text in text


def test_config_file_sets_defaults_command_line_wins(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("num_seqs: 12\ndtypes: fp16,fp32\nseeds: [7, 8]\nband: 0.05\n")
    parser = _parser()
    assert apply_config_file(parser, (DemoConfig,), str(path)) == {"num_seqs": 12, "dtypes": "fp16,fp32",
                                                                   "seeds": [7, 8], "band": 0.05}
    config = config_from_args(DemoConfig, parser.parse_args(["a.yaml", "--band", "0.3"]))
    assert (config.num_seqs, config.dtypes, config.seeds, config.band) == (12, ["fp16", "fp32"], [7, 8], 0.3)


@pytest.mark.parametrize("text, message", [
    ("num_seq: 3\n", "unknown field(s) num_seq; valid: band, dtypes, json_path, no_progress, num_seqs, plots, seeds"),
    ("- 1\n- 2\n", "expected a mapping"),
    ("recipes: [a.yaml]\n", "recipes is given on the command line"),
    ("num_seqs: [\n", "not valid YAML"),
])
def test_config_file_errors_name_the_problem(tmp_path, text, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        apply_config_file(_parser(), (DemoConfig,), _yaml(tmp_path, text))


def test_missing_config_file(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        apply_config_file(_parser(), (DemoConfig,), str(tmp_path / "absent.yaml"))


def test_cli_refuses_config_for_a_command_without_settings():
    from bloggap_plugin.cli import _apply_config_file

    parser = argparse.ArgumentParser()
    parser.set_defaults(_subparsers={"report": argparse.ArgumentParser()})
    with pytest.raises(UsageError, match="bloggap report takes no --config file"):
        _apply_config_file(parser, ["report", "--config", "x.yaml"])
    _apply_config_file(parser, ["report"])  # no --config: nothing to do


@pytest.mark.parametrize("text, message", [
    ("num_seqs: 2.5\n", "--num-seqs 2.5: expected int"),
    ("num_seqs: true\n", "--num-seqs True: expected int"),
    ("seeds: [1, x]\n", "--seeds [1, 'x']: expected list"),
    ("no_progress: 1\n", "--no-progress 1: expected bool"),
    ("json_path: 3\n", "--json-path 3: expected"),
])
def test_config_file_values_are_checked_against_the_annotations(tmp_path, text, message):
    """argparse never type-checks a default: values from --config FILE.yaml are checked when the config is built."""
    parser = _parser()
    apply_config_file(parser, (DemoConfig,), _yaml(tmp_path, text))
    with pytest.raises(UsageError, match=re.escape(message)):
        config_from_args(DemoConfig, parser.parse_args(["a.yaml"]))


def test_config_file_int_for_a_float_field_is_accepted(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("band: 1\n")
    parser = _parser()
    apply_config_file(parser, (DemoConfig,), str(path))
    assert config_from_args(DemoConfig, parser.parse_args(["a.yaml"])).band == 1
