"""Tile configurations for vLLM's batch-invariant persistent matmul, chosen per weight shape and row count.

Arms I and J compute every linear layer with vLLM's ``matmul_kernel_persistent`` (Triton), which vLLM 0.26 launches
at one configuration for every bf16 shape. Each output element is an fp32 sum over K in ``BLOCK_SIZE_K`` steps, in
the same order whatever the tile's other sizes, so one ``block_k`` per weight shape ``(N, K)`` keeps a row's bits
independent of how many rows share the call, while the tile's rows and columns, warps and stages may follow the row
count: vLLM 0.31 does this for the shapes it tuned (``determinism/batch_invariant_configs.py``, the same
``(N, K) -> block_k, m_buckets`` layout as :class:`ShapeTiles`). A :data:`TileTable` gives it to any vLLM: installed
(:func:`install_tiles`) in a process before its colocated engine starts, the engine's generation and the arm's own
vLLM-form passes go through the same dispatcher, so the sampler and the trainer compute the same bits.

A table is a JSON file (:func:`load_tiles`) written by ``bloggap tiles --model MODEL --out FILE`` (or the harness
``python -m benchmarks.bi_matmul run --tiles-out FILE``) from a measurement on the GPU that will use it;
``gap.matmul_tiles`` or :data:`TILES_ENV` names it for ``bloggap train`` and
:func:`~bloggap_plugin.trl.vllm_colocate.vllm_colocate_engine`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from bloggap_plugin.core.errors import UsageError

__all__ = ["TILES_ENV", "TileShape", "ShapeTiles", "TileTable", "TilesError", "config_for", "load_tiles",
           "dump_tiles", "install_tiles", "installed_tiles"]

TILES_ENV = "BLOGGAP_VLLM_MATMUL_TILES"
"""Environment variable: the path of a tile table (:func:`load_tiles`) to install before the colocated engine
starts; unset or empty: vLLM's own configurations."""


class TilesError(UsageError):
    """A tile table that cannot be used, named with the fix."""


class TileShape(NamedTuple):
    """One launch configuration of ``matmul_kernel_persistent`` besides ``BLOCK_SIZE_K``."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class ShapeTiles:
    """The configurations of one weight shape: ``block_k`` for every row count (what keeps a row's bits independent
    of the batch), and ``m_buckets``: ``(max_rows, TileShape)`` in ascending ``max_rows``; a call with more rows than
    the last bucket's uses the last bucket's configuration (vLLM 0.31's rule)."""

    block_k: int
    m_buckets: tuple[tuple[int, TileShape], ...]

    def for_rows(self, rows: int) -> dict[str, int]:
        """The kernel's launch keywords for a call of ``rows`` rows."""
        tile = self.m_buckets[-1][1]
        for max_rows, bucket in self.m_buckets:
            if max_rows >= rows:
                tile = bucket
                break
        return {"BLOCK_SIZE_M": tile.block_m, "BLOCK_SIZE_N": tile.block_n, "BLOCK_SIZE_K": self.block_k,
                "GROUP_SIZE_M": 8, "num_warps": tile.num_warps, "num_stages": tile.num_stages}


TileTable = Mapping[tuple[int, int], ShapeTiles]
"""``(N, K)`` of a weight (the matmul's output width and reduction length) -> its :class:`ShapeTiles`."""


def config_for(table: TileTable, rows: int, n: int, k: int) -> dict[str, int] | None:
    """The launch keywords ``table`` gives a bf16 ``(rows, k) @ (k, n)`` matmul, or ``None`` (a shape it lacks)."""
    tiles = table.get((n, k))
    return None if tiles is None else tiles.for_rows(rows)


def _positive(value: Any, what: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TilesError(f"{where}: {what} must be a positive whole number, got {value!r}")
    return value


def _shape_tiles(key: str, entry: Any, where: str) -> tuple[tuple[int, int], ShapeTiles]:
    try:
        n, k = (int(part) for part in key.split("x"))
    except ValueError:
        raise TilesError(f"{where}: shape key {key!r} is not 'NxK' (the weight's output width x its input width)") \
            from None
    here = f"{where}, shape {key}"
    if not isinstance(entry, dict) or set(entry) != {"block_k", "m_buckets"}:
        raise TilesError(f"{here}: expected an object with block_k and m_buckets")
    block_k = _positive(entry["block_k"], "block_k", here)
    buckets = []
    for bucket in entry["m_buckets"] or []:
        if not (isinstance(bucket, list) and len(bucket) == 2 and isinstance(bucket[1], list) and len(bucket[1]) == 4):
            raise TilesError(f"{here}: a bucket is [max_rows, [block_m, block_n, num_warps, num_stages]], got "
                             f"{bucket!r}")
        values = [_positive(v, name, here) for v, name in zip(bucket[1], TileShape._fields, strict=True)]
        buckets.append((_positive(bucket[0], "max_rows", here), TileShape(*values)))
    if not buckets:
        raise TilesError(f"{here}: no m_buckets")
    if [b[0] for b in buckets] != sorted({b[0] for b in buckets}):
        raise TilesError(f"{here}: m_buckets must ascend by max_rows without repeats, got {[b[0] for b in buckets]}")
    return (n, k), ShapeTiles(block_k, tuple(buckets))


def load_tiles(path: str | os.PathLike, gpu: str | None = None, where: str | None = None,
               drop: str = "unset the variable") -> dict[tuple[int, int], ShapeTiles]:
    """A tile table from ``path``: ``{"gpu": NAME, "tiles": {"NxK": {"block_k": B, "m_buckets": [[max_rows,
    [block_m, block_n, num_warps, num_stages]], ...]}}}`` (other top-level keys, e.g. the measurement it came from,
    are ignored). With ``gpu`` (the name of the GPU that will use it), a table measured on another GPU is refused:
    which configurations give vLLM's bits is a property of the GPU and its compiler, measured, not assumed. Errors
    start with ``where`` (default ``TILES_ENV=path``: the setting that named the file) and end with ``drop`` (how to
    run without a table)."""
    where = where or f"{TILES_ENV}={path}"
    try:
        document = json.loads(Path(path).read_text())
    except OSError as err:
        raise TilesError(f"{where}: cannot read it ({err.strerror}): give the file bloggap tiles --out "
                         f"wrote, or {drop}") from None
    except ValueError as err:
        raise TilesError(f"{where}: not JSON ({err})") from None
    if not isinstance(document, dict) or not isinstance(document.get("tiles"), dict) or not document["tiles"]:
        raise TilesError(f"{where}: expected an object whose 'tiles' maps 'NxK' shapes to their configurations")
    if gpu is not None and document.get("gpu") != gpu:
        raise TilesError(f"{where}: measured on {document.get('gpu') or 'an unnamed GPU'}, and this process runs on "
                         f"{gpu}: measure this GPU's table (bloggap tiles --model MODEL --out FILE) or "
                         f"{drop}")
    return dict(_shape_tiles(key, entry, where) for key, entry in document["tiles"].items())


def dump_tiles(table: TileTable, **about: Any) -> str:
    """``table`` as the JSON text :func:`load_tiles` reads, ``about``'s keys beside it."""
    tiles = {f"{n}x{k}": {"block_k": t.block_k, "m_buckets": [[rows, list(tile)] for rows, tile in t.m_buckets]}
             for (n, k), t in sorted(table.items())}
    return json.dumps({**about, "tiles": tiles}, indent=1) + "\n"


def installed_tiles(module: Any) -> TileTable | None:
    """The table installed in ``module`` (vLLM's batch-invariant module), or ``None``."""
    return getattr(module.matmul_persistent, "tiles", None)


def install_tiles(module: Any, table: TileTable) -> Callable[[], None]:
    """Route ``module``'s ``matmul_persistent`` (vLLM's batch-invariant module: ``linear_batch_invariant``,
    ``matmul_batch_invariant`` and the aten ``mm``/``addmm`` overrides all call it) through ``table``: a bf16 call
    whose weight shape the table has launches ``matmul_kernel_persistent`` at the table's configuration for its row
    count; every other call goes to vLLM's own function. The dispatcher carries its table (``.tiles``) and vLLM's
    function (``.__wrapped__``). Returns the function that puts vLLM's back. Installing again replaces the table."""
    import torch

    current = module.matmul_persistent
    original = current.__wrapped__ if installed_tiles(module) is not None else current
    kernel = module.matmul_kernel_persistent
    table = dict(table)

    def matmul_persistent(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows, k = a.shape
        n = b.shape[1]
        config = config_for(table, rows, n, k) if a.dtype == torch.bfloat16 else None
        if config is None:
            return original(a, b, bias)
        return launch(kernel, a, b, bias, config)

    matmul_persistent.__wrapped__ = original  # type: ignore[attr-defined]
    matmul_persistent.tiles = table  # type: ignore[attr-defined]
    module.matmul_persistent = matmul_persistent

    def uninstall() -> None:
        if module.matmul_persistent is matmul_persistent:
            module.matmul_persistent = original

    return uninstall


@functools.cache
def sm_count(device_index: int | None) -> int:
    """Streaming multiprocessors of CUDA device ``device_index`` (the programs a persistent launch starts at most)."""
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch(kernel: Any, a: Any, b: Any, bias: Any, config: dict[str, int]) -> Any:
    """``a @ b (+ bias)`` by ``kernel`` (``matmul_kernel_persistent``) at ``config``, launched as vLLM's
    ``matmul_persistent`` launches it (one program per SM at most, the tiles strided over them)."""
    import torch

    sms = sm_count(a.device.index)
    rows, k = a.shape
    n = b.shape[1]
    c = torch.empty((rows, n), device=a.device, dtype=a.dtype)
    tiles = -(-rows // config["BLOCK_SIZE_M"]) * -(-n // config["BLOCK_SIZE_N"])
    kernel[(min(sms, tiles),)](
        a, b, c, bias, rows, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        NUM_SMS=sms, A_LARGE=a.numel() > 2**31, B_LARGE=b.numel() > 2**31, C_LARGE=c.numel() > 2**31,
        HAS_BIAS=bias is not None, **config)
    return c
