"""The sha256 of a model checkpoint folder: what a run records to name the weights it started from.

:func:`checkpoint_sha256` hashes ``config.json`` and every ``*.safetensors`` file at the top of a folder;
:func:`model_sha256` applies it to a model spec that is a folder (a named or tiny model is not hashed). The warm
start (``benchmarks/gsm8k_warmstart.py``) records it for the checkpoint it saves, ``bloggap train`` in its summary and
``bloggap compare`` in each run's completion marker, so runs can be checked to have started from the same weights.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from bloggap_plugin.core.errors import UsageError

__all__ = ["HASHED_FILES", "HASH_DEFINITION", "checkpoint_sha256", "file_sha256", "model_sha256"]

HASHED_FILES = ("config.json",)
"""Files besides the ``*.safetensors`` weights that :func:`checkpoint_sha256` covers."""
HASH_DEFINITION = ("sha256 over config.json and every *.safetensors file at the top of the checkpoint folder, in sorted "
                   "name order, each fed as its name (UTF-8), a NUL byte, its size (8 bytes, big endian) and its bytes")


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 (hex) of one file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def checkpoint_sha256(folder: str | os.PathLike) -> str:
    """sha256 of a saved checkpoint's weights and config: over ``config.json`` and every ``*.safetensors`` file of
    ``folder`` (top level), in sorted name order, each fed as its name (UTF-8), a NUL byte, its size (8 bytes, big
    endian) and its bytes. Equal files give an equal hash; any changed byte, renamed or added weight file changes
    it. Tokenizer and generation-config files are not covered. Raises ``FileNotFoundError`` when the folder holds
    no ``*.safetensors`` file or no ``config.json``."""
    folder = Path(folder)
    weights = sorted(p.name for p in folder.glob("*.safetensors") if p.is_file())
    if not weights or not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: a checkpoint needs config.json and *.safetensors weights")
    digest = hashlib.sha256()
    for name in sorted([*weights, *HASHED_FILES]):
        path = folder / name
        digest.update(name.encode() + b"\x00" + path.stat().st_size.to_bytes(8, "big"))
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def model_sha256(model: str, option: str = "--model") -> str | None:
    """:func:`checkpoint_sha256` of ``model`` when it is a folder, ``None`` for any other spec (a named or tiny
    model). Raises :class:`~bloggap_plugin.core.errors.UsageError` (one line) for a folder that holds no
    ``config.json`` and ``*.safetensors`` weights: its weights could not be named."""
    if not Path(model).is_dir():
        return None
    try:
        return checkpoint_sha256(model)
    except FileNotFoundError:
        raise UsageError(f"{option} {model}: the folder holds no config.json and *.safetensors weights to hash; save "
                         "the model with save_pretrained (safetensors is its default)") from None
