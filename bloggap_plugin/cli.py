"""The ``bloggap`` command line: ``bloggap doctor | attribute | ladder | train | compare | report | patch | tiles``.

Each subcommand lives in ``bloggap_plugin/commands/<name>.py`` with ``HELP``, ``configure(parser)`` and
``run(args) -> int``; heavy imports happen inside ``run`` so ``bloggap --help`` stays fast. A command's settings are a
dataclass with per-field help (``bloggap_plugin.commands._config``): every field is a flag, and ``--config FILE.yaml``
sets any of them (the command line wins). Bad input raises
:class:`bloggap_plugin.core.errors.UsageError` (checked before any model loads), printed here as one line on stderr,
``bloggap: error: <problem and fix>``, with exit code 2 and no traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys

COMMANDS = ("doctor", "attribute", "ladder", "train", "compare", "report", "patch", "tiles")


def _named_command(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names (its first token that is one), or None."""
    return next((token for token in argv if token in COMMANDS), None)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``bloggap`` parser. With ``argv``, only the subcommand it names gets its arguments (building a command's
    flags imports transformers' HfArgumentParser, and TRL for ``train``): ``bloggap --help`` stays fast."""
    from bloggap_plugin.commands._config import OneLineParser

    named = None if argv is None else _named_command(argv)
    parser = OneLineParser(
        prog="bloggap",
        description="Measure and remove the spurious PPO/IS ratio from bf16 batch-shape noise and truncated sampling.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.set_defaults(_subparsers={})
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"bloggap_plugin.commands.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"bloggap_plugin.commands.{name}":
                raise
            continue
        command = sub.add_parser(name, help=module.HELP, description=module.HELP)
        if argv is None or name == named:
            module.configure(command)
        command.set_defaults(_run=module.run)
        parser.get_default("_subparsers")[name] = command
    return parser


def _apply_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """``bloggap COMMAND --config FILE.yaml ...``: the file's fields become the command's defaults."""
    from bloggap_plugin.commands._config import apply_config_file, config_file_path

    name = _named_command(argv)
    command = parser.get_default("_subparsers").get(name)
    path = config_file_path(argv[argv.index(name) + 1:]) if command is not None else None
    if path is None:
        return
    config_types = command.get_default("_config_types")
    if not config_types:
        from bloggap_plugin.core.errors import UsageError

        raise UsageError(f"bloggap {name} takes no --config file; give its settings as flags (bloggap {name} --help)")
    apply_config_file(command, config_types, path)


def _model_in(argv: list[str]) -> str | None:
    """The value of ``--model`` in ``argv`` (``--model X`` or ``--model=X``), read before any parser is built."""
    for index, token in enumerate(argv):
        if token == "--model" and index + 1 < len(argv):
            return argv[index + 1]
        if token.startswith("--model="):
            return token.split("=", 1)[1]
    return None


def _model_named(argv: list[str]) -> str | None:
    """The model the command will use, read before any parser is built: ``--model`` in ``argv``, else the
    ``model:`` of its ``--config`` file (a file that does not read leaves None: its error is said later)."""
    model = _model_in(argv)
    if model is not None:
        return model
    try:
        from bloggap_plugin.commands._config import config_file_path

        path = config_file_path(argv)
        if path is None:
            return None
        from bloggap_plugin._input_files import load_yaml_file

        values = load_yaml_file(path, "--config", "")  # bounded: a YAML alias bomb must not expand here
    except Exception:  # noqa: BLE001 - any problem with the file is reported when it is applied
        return None
    model = values.get("model") if isinstance(values, dict) else None
    return model if isinstance(model, str) else None


def _is_hub_id(model: str | None) -> bool:
    """True when ``model`` is a Hugging Face hub id (``org/name`` that is not a local path)."""
    return bool(model) and model.count("/") == 1 and not os.path.exists(model) and not model.startswith((".", "/"))


def main(argv: list[str] | None = None) -> int:
    from bloggap_plugin.core.errors import UsageError, one_line

    argv = list(sys.argv[1:] if argv is None else argv)
    for stream in (sys.stdout, sys.stderr):  # a file name that is not UTF-8 prints escaped, never a traceback
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    # Offline by default, the hub reached only when the user names a hub model (--model, or the --config file's
    # model); set before the parser is built, since building it imports huggingface_hub (through TRL), which reads
    # HF_HUB_OFFLINE once, at import
    if not _is_hub_id(_model_named(argv)):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = build_parser(argv)
    try:
        _apply_config_file(parser, argv)
    except UsageError as err:
        print(f"bloggap: error: {one_line(err)}", file=sys.stderr)
        return 2
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # named by the subcommand's parser, so the hint points at its --help
            command = parser.get_default("_subparsers").get(getattr(args, "command", None)) or parser
            command.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as stop:  # argparse's own exit: --help (0) or a bad flag, already said in one line (2)
        return int(stop.code or 0)
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    # wandb offline unless the user set a mode or a key: --report-to wandb must not need the network or a login
    if not os.environ.get("WANDB_API_KEY"):
        os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except UsageError as err:
        print(f"bloggap: error: {one_line(err)}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader of the output left (``| head``): stop as a command that SIGPIPE ends, without a traceback; what
        # is still buffered goes to /dev/null, so the interpreter's flush at exit does not raise again
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
