"""Writing a result document and showing its tables."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from bloggap_plugin.results import ResultDocument, format_text_table


def write_and_show(document: ResultDocument, path: Path, log: Callable[[str], None], started: float) -> Path:
    """Write ``document`` to ``path``, log where and the seconds since ``started`` (a ``time.time()``), print
    every table as text; returns the path written."""
    written = document.write(path)
    log(f"wrote {written} in {time.time() - started:.0f} s")
    for table in document.tables:
        print(format_text_table(table))
    return written
