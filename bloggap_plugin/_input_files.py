"""Reading what a user hands in: one decoding rule for every text file, one bounded YAML loader, one bounded JSON
reader.

Every recipe, ``--config``, ``--override`` mapping, headline spec and patch file, and every JSON file a command
reads (``doctor --from-json``, ``report``'s result files, compare's run logs and records, a model folder's
``config.json``) is read through these, so a file
that is not UTF-8 text, holds NUL bytes, is too large, or is a YAML document that expands without bound (aliases,
nesting) is refused with one line naming the file and the fix, before anything is built from it. Error messages
never quote the value (its repr could be the expansion itself).
"""

from __future__ import annotations

import os
from pathlib import Path

from bloggap_plugin.core.errors import UsageError

__all__ = ["MAX_TEXT_BYTES", "MAX_JSON_BYTES", "MAX_YAML_DEPTH", "MAX_YAML_ALIASES", "MAX_YAML_NODES",
           "read_text_file", "check_file_size", "load_json_file", "load_yaml", "load_yaml_file", "display_name"]

MAX_TEXT_BYTES = 1 << 20
"""Largest input text file or YAML text, in bytes (recipes and configs are a few hundred)."""
MAX_JSON_BYTES = 64 << 20
"""Largest JSON or JSON-lines file a command reads (result documents, doctor JSON, run logs, model configs), in
bytes: far above any such file, far below what would exhaust memory."""
MAX_YAML_DEPTH = 32
"""Deepest nesting of YAML sequences and mappings."""
MAX_YAML_ALIASES = 100
"""Most alias (``*name``) references in one YAML document."""
MAX_YAML_NODES = 100_000
"""Most values a YAML document may hold once every alias is expanded."""


def display_name(path: str | os.PathLike) -> str:
    """``path`` as printable text: bytes of a file name that are not UTF-8 shown as U+FFFD (printing the raw name
    would raise ``UnicodeEncodeError``)."""
    return os.fsencode(path).decode("utf-8", "replace")


def check_file_size(path: str | os.PathLike, what: str, fix: str, error: type[Exception] = UsageError,
                    max_bytes: int = MAX_TEXT_BYTES, kind: str = "a settings file") -> None:
    """``error`` with one line when the file ``path`` is larger than ``max_bytes`` (``kind``: what such a file is,
    e.g. ``"a settings file"``); ``OSError`` as :meth:`Path.stat` raises it."""
    if Path(path).stat().st_size > max_bytes:
        raise error(f"{what}: larger than {max_bytes >> 20} MiB, not {kind}; {fix}")


def read_text_file(path: str | os.PathLike, what: str, fix: str, error: type[Exception] = UsageError,
                   max_bytes: int = MAX_TEXT_BYTES, kind: str = "a settings file") -> str:
    """The text of the file ``path`` (UTF-8, no NUL bytes, at most ``max_bytes``); else ``error`` with one line:
    ``what`` names the input (e.g. ``"--config x.yaml"``), ``fix`` says what to give instead."""
    path = Path(path)
    try:
        check_file_size(path, what, fix, error, max_bytes, kind)
        data = path.read_bytes()
    except OSError as err:
        raise error(f"{what}: cannot read ({err.strerror or err}); {fix}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{what}: not a text file (not UTF-8 at byte {err.start}); save it as UTF-8, "
                    f"or {fix}") from None
    if "\x00" in text:
        raise error(f"{what}: not a text file (it holds NUL bytes); {fix}")
    return text


def load_json_file(path: str | os.PathLike, what: str, fix: str, error: type[Exception] = UsageError,
                   kind: str = "a bloggap JSON file", **loads):
    """The JSON document in the file ``path``, read by :func:`read_text_file` with the limit :data:`MAX_JSON_BYTES`
    (``loads``: keyword arguments of :func:`json.loads`); else ``error`` with one line (a syntax error names its
    line and column)."""
    import json

    text = read_text_file(path, what, fix, error, MAX_JSON_BYTES, kind)
    try:
        return json.loads(text, **loads)
    except json.JSONDecodeError as err:
        raise error(f"{what}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); {fix}") from None


def load_yaml(text: str, what: str, loader: type | None = None, error: type[Exception] = UsageError):
    """The value of the YAML document ``text``, read with ``loader`` (a ``yaml.SafeLoader`` subclass, default
    SafeLoader), refused with ``error`` when it is larger than :data:`MAX_TEXT_BYTES`, nests deeper than
    :data:`MAX_YAML_DEPTH`, uses more than :data:`MAX_YAML_ALIASES` aliases or expands (aliases followed) to more
    than :data:`MAX_YAML_NODES` values, or is recursive. A YAML syntax error is ``error`` too."""
    import yaml

    loader = loader or yaml.SafeLoader
    if not issubclass(loader, yaml.SafeLoader):
        raise TypeError(f"load_yaml: {loader} is not a yaml.SafeLoader")
    if len(text.encode("utf-8", "surrogatepass")) > MAX_TEXT_BYTES:
        raise error(f"{what}: YAML larger than {MAX_TEXT_BYTES >> 20} MiB; give a settings file")
    fix = "write the values out plainly (no deep nesting, few &anchor/*alias references)"
    try:
        _check_events(yaml.parse(text, Loader=yaml.SafeLoader), what, fix, error)
        reader = loader(text)
        try:
            node = reader.get_single_node()
            if node is None:
                return None
            _check_expansion(node, what, fix, error)
            return reader.construct_document(node)
        finally:
            reader.dispose()
    except yaml.YAMLError as err:
        raise error(f"{what}: not valid YAML ({' '.join(str(err).split())[:300]}); fix the file") from None


def load_yaml_file(path: str | os.PathLike, what: str, fix: str, loader: type | None = None,
                   error: type[Exception] = UsageError):
    """:func:`load_yaml` of the file ``path`` read by :func:`read_text_file`."""
    return load_yaml(read_text_file(path, what, fix, error), what, loader, error)


def _check_events(events, what: str, fix: str, error: type[Exception]) -> None:
    """Depth and alias count from the parser's events (the parser is not recursive: a deep document is refused
    here before the recursive composer sees it)."""
    import yaml

    depth = aliases = 0
    for event in events:
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            depth += 1
            if depth > MAX_YAML_DEPTH:
                raise error(f"{what}: YAML nested deeper than {MAX_YAML_DEPTH} levels; {fix}")
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            depth -= 1
        elif isinstance(event, yaml.AliasEvent):
            aliases += 1
            if aliases > MAX_YAML_ALIASES:
                raise error(f"{what}: YAML uses more than {MAX_YAML_ALIASES} aliases (*name); {fix}")


def _check_expansion(root, what: str, fix: str, error: type[Exception]) -> None:
    """Refuse a composed node graph that is recursive or holds more than :data:`MAX_YAML_NODES` values once every
    alias is expanded (counted per node, not expanded: a shared node is sized once)."""
    import yaml

    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise error(f"{what}: YAML refers to itself (an alias inside its own anchor); {fix}")
        active.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(size(child) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(size(k) + size(v) for k, v in node.value)
        active.discard(key)
        if total > MAX_YAML_NODES:
            raise error(f"{what}: YAML expands to more than {MAX_YAML_NODES:,} values through its aliases; {fix}")
        sizes[key] = total
        return total

    size(root)
