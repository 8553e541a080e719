"""The ``bloggap`` command line: ``bloggap doctor | attribute | ladder | train | compare | report | patch``.

Each subcommand lives in ``bloggap_plugin/commands/<name>.py`` with ``HELP``, ``configure(parser)`` and
``run(args) -> int``; heavy imports happen inside ``run`` so ``bloggap --help`` stays fast. Bad input raises
:class:`bloggap_plugin.errors.UsageError` (checked before any model loads), printed here as one line on stderr,
``bloggap: error: <problem and fix>``, with exit code 2 and no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS = ("doctor", "attribute", "ladder", "train", "compare", "report", "patch")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bloggap",
        description="Measure and remove the spurious PPO/IS ratio from bf16 batch-shape noise and truncated sampling.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"bloggap_plugin.commands.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"bloggap_plugin.commands.{name}":
                raise
            continue
        command = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.configure(command)
        command.set_defaults(_run=module.run)
    return parser


def _names_hub_model(args: argparse.Namespace) -> bool:
    """True when the user named a Hugging Face hub id (``org/name`` that is not a local path)."""
    model = getattr(args, "model", None)
    return bool(model) and model.count("/") == 1 and not os.path.exists(model) and not model.startswith((".", "/"))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Offline by default: the hub is reached only when the user names a hub model.
    if not _names_hub_model(args):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    from bloggap_plugin.errors import UsageError, one_line

    try:
        return int(args._run(args) or 0)
    except UsageError as err:
        print(f"bloggap: error: {one_line(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
