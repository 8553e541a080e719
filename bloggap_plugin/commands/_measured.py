"""What the measuring commands share: ``configure`` from a config dataclass; for ``bloggap attribute`` and
``bloggap ladder`` also the model/output settings, loading after the checks, and the JSON payload
(``{command, schema_version, env, params, results[, tables]}``, not a benchmark result document), printed as
text or written with ``--json`` as strict JSON (``bloggap_plugin.results.dumps``: non-finite numbers -> null)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["configure_with", "checked_config", "check_counts", "ModelOutputConfig", "check_json_option", "write_json_option", "load_for", "command_payload", "emit"]


def configure_with(config_type: type):
    """A command's ``configure(parser)``: one flag per field of ``config_type`` (and ``--config FILE.yaml``)."""

    def configure(parser) -> None:
        from bloggap_plugin.commands._config import add_config_arguments

        add_config_arguments(parser, config_type)

    return configure


def checked_config(config_type: type, args, counts: tuple[str, ...] = ()):
    """``config_type`` from the parsed ``args``, each field named in ``counts`` checked to be >= 1 (or unset):
    a one-line ``UsageError`` naming its flag otherwise."""
    from bloggap_plugin.commands._config import config_from_args

    config = config_from_args(config_type, args)  # its values checked against the fields' types
    check_counts(config, counts)
    return config


def check_counts(config, counts: tuple[str, ...]) -> None:
    """Each field of ``config`` named in ``counts`` is >= 1 or unset, else a one-line ``UsageError`` naming its flag."""
    from bloggap_plugin.core.errors import check_positive

    for name in counts:
        check_positive("--" + name.replace("_", "-"), getattr(config, name))


@dataclass
class ModelOutputConfig:
    """The model to load and where the result goes (fields shared by the measuring commands)."""

    model: str = field(default="smollm2", metadata={"help": "model spec (default: smollm2, offline)"})
    device: str | None = field(default=None, metadata={"help": "cpu, cuda, ... (default: cuda if available)"})
    attn: Literal["sdpa", "eager", "flex_attention"] | None = field(default=None, metadata={
        "help": "attention implementation: sdpa, eager or flex_attention (default: the model's)"})
    positions: Literal["mask", "arange"] = field(default="mask", metadata={"help": "position ids (mask)"})
    json: str | None = field(default=None, metadata={
        "help": "write JSON to PATH (stdout if no PATH)", "nargs": "?", "const": "-", "metavar": "PATH"})


def check_json_option(path: str | None, command: str) -> None:
    """Raise ``UsageError`` before measuring if ``--json PATH`` cannot be written (``-`` is stdout) or holds a file
    that ``bloggap COMMAND --json`` did not write."""
    from bloggap_plugin._io import check_writable_file, foreign_file_problem
    from bloggap_plugin.core.errors import UsageError

    if path and path != "-":
        problem = check_writable_file(path, "--json") or foreign_file_problem(path, "--json", _owned_by(command))
        if problem:
            raise UsageError(problem)


def _owned_by(command: str):
    """``owned(text)``: True when ``text`` is the ``--json`` output of ``bloggap COMMAND``."""
    from bloggap_plugin._io import json_of

    def owned(text: str) -> bool:
        document = json_of(text)
        return isinstance(document, dict) and document.get("command") == command and "results" in document

    return owned


def write_json_option(path: str, payload: dict) -> None:
    """Write ``payload`` to ``--json PATH`` atomically, never over a file its command did not write (a failed
    write leaves the previous file whole)."""
    from bloggap_plugin._io import write_output_text
    from bloggap_plugin.results import dumps

    write_output_text(path, dumps(payload, indent=2) + "\n", "--json", _owned_by(payload["command"]))
    print(f"wrote {path}")


def load_for(config: ModelOutputConfig, command: str) -> tuple[str, object, object]:
    """``(device, model, tokenizer)`` for ``config`` of ``bloggap COMMAND`` once ``--json``, ``--device`` and the
    model files passed their checks (each a one-line ``UsageError`` before anything loads)."""
    from bloggap_plugin.models import check_model_spec, load_model, resolve_device

    check_json_option(config.json, command)
    device = resolve_device(config.device)
    check_model_spec(config.model)
    model, tokenizer = load_model(config.model, dtype=config.dtype, device=device, attn_implementation=config.attn)
    return device, model, tokenizer


def command_payload(command: str, schema_version: int, device: str, config, model, results: dict,
                    tables: list[dict] | None = None) -> dict:
    """The JSON document of one measuring command run on the loaded ``model``."""
    from bloggap_plugin.envinfo import environment_record

    payload = {
        "command": command,
        "schema_version": schema_version,
        "env": environment_record(device),
        "params": {
            "model": config.model,
            "dtype": config.dtype,
            "attn": getattr(model.config, "_attn_implementation", None),
        },
        "results": results,
    }
    if tables is not None:
        payload["tables"] = tables
    return payload


def emit(payload: dict, text: str, json_option: str | None) -> None:
    """``--json`` alone (``-``): the payload on stdout; otherwise ``text``, and the payload to ``--json PATH``."""
    from bloggap_plugin.results import dumps

    if json_option == "-":
        print(dumps(payload, indent=2))
    else:
        print(text)
        if json_option:
            write_json_option(json_option, payload)
