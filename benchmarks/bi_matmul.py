"""Harness (issue 44 item 3): vLLM's batch-invariant persistent matmul under other tile configurations, on one GPU.

    python -m benchmarks.bi_matmul run --shape llama-1.56b-v49k|MODEL_FOLDER [--shape ...] --out FILE [--tiles-out TILES]

The measurement is the product's (:mod:`bloggap_plugin.measure.matmul_tiles`, which ``bloggap tiles`` runs for a
user's model): every configuration of :data:`CONFIGS` on every linear layer of each shape (merged QKV, O, merged
gate/up, down, LM head; ``(N, K)`` from the shape's config) at each M of ``--rows``, bit for bit against its
``BLOCK_SIZE_K`` family's reference, and timed from CUDA-graph replays of ``--reps`` calls. Equal at every M means the
configuration can serve any row count of that shape beside the others of its family. This harness accepts the
benchmark shapes by name (``benchmarks/_lib/shapes.py``) and writes the cases as a result document.

Table T25: per configuration the cases (layer, M) bit-identical to its family's reference, and the device time of
one forward's linears at each M (per-call time x calls per forward, summed; the LM head once) as a multiple of
vLLM's configuration's. ``--tiles-out`` writes the tile table (:mod:`bloggap_plugin.core.vllm.tile_table`) of
:func:`derive_tiles`, which ``gap.matmul_tiles`` (or ``BLOGGAP_VLLM_MATMUL_TILES``) installs for arms I and J. A harness
result; T27-cost-by-size-tiles measures a table through ``bloggap train``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from bloggap_plugin.measure.matmul_tiles import CONFIGS, DEFAULT_ROWS, derive_tiles, measure_linears


def linear_shapes(shape: str) -> list[tuple[str, int, int, int]]:
    """:func:`~bloggap_plugin.measure.matmul_tiles.linear_shapes` of ``shape``: a ``benchmarks/_lib/shapes.py``
    name, or a model folder (its ``config.json``)."""
    import json

    from benchmarks._lib.shapes import SHAPES
    from bloggap_plugin.measure import matmul_tiles

    config = SHAPES[shape][1] if shape in SHAPES else json.loads((Path(shape) / "config.json").read_text())
    return matmul_tiles.linear_shapes(config)


def forward_us(cases: list[dict], config: str, rows: int) -> float | None:
    """Device microseconds of one forward's linears at ``rows`` rows under ``config`` (per-call time x count,
    summed over the layers); ``None`` where a case is missing."""
    total = 0.0
    for case in (c for c in cases if c["rows"] == rows):
        timing = case["us"].get(config)
        if timing is None:
            return None
        total += timing * case["count"]
    return total


def summary_table(results: dict, table_id: str) -> dict:
    """One row per configuration and shape (cuBLAS last): bit-identical cases / all, and per M the forward's linear
    time as a multiple of vLLM's configuration's."""
    all_rows = sorted({c["rows"] for cases in results["cases"].values() for c in cases})
    columns = (["shape", "configuration", "BLOCK_SIZE_K", "bit-identical to its family's reference (cases)"]
               + [f"linears x vLLM's, M={m}" for m in all_rows] + [f"vLLM's linears us, M={m}" for m in all_rows])
    table_rows = []
    for shape, cases in results["cases"].items():
        base = {m: forward_us(cases, "vllm", m) for m in all_rows}
        for config in [*results["configs"], "cublas"]:
            same = sum(1 for c in cases if c["equal"][config])
            block_k = results["config_values"][config]["BLOCK_SIZE_K"] if config != "cublas" else None
            cells = [shape, config, block_k, f"{same}/{len(cases)}"]
            for m in all_rows:
                mine = forward_us(cases, config, m)
                cells.append(None if mine is None or not base[m] else round(mine / base[m], 3))
            cells += [None if base[m] is None else round(base[m], 1) for m in all_rows]
            table_rows.append(cells)
    return {"id": table_id, "title": "vLLM's batch-invariant matmul under other tile configurations: bits and "
            "device time (harness)", "columns": columns, "rows": table_rows, "reference": None, "random_init": True,
            "notes": "Harness (benchmarks.bi_matmul): random bf16 operands, every linear layer of the shape as vLLM "
                     "merges them; a case is one (layer, M). Each configuration computes the first M rows of one "
                     "input and is compared bit for bit with its family's reference (same BLOCK_SIZE_K; vLLM's "
                     "configuration for 64) computing all rows at once; cublas (F.linear, torch's default "
                     "settings) is compared with vLLM's. Device time from CUDA-graph replays; 'linears x vLLM's' "
                     "sums per-call time x calls per forward over the layers (LM head once) and divides by the same "
                     "for vLLM's configuration."}


def _kernel_module() -> Any:
    from bloggap_plugin.core.vllm.kernels import persistent_matmul_module

    module = persistent_matmul_module()
    if module is None:
        raise SystemExit("bi_matmul needs vLLM with its batch-invariant Triton kernels on a CUDA GPU")
    return module


def measure_shape(module: Any, shape: str, rows: list[int], reps: int, log, cases: list[dict],
                  device: str = "cuda") -> list[dict]:
    """:func:`~bloggap_plugin.measure.matmul_tiles.measure_linears` of ``shape``'s linear layers
    (:func:`linear_shapes`)."""
    return measure_linears(module, shape, linear_shapes(shape), rows, reps, log, cases, device=device)


def run_main(args: argparse.Namespace) -> int:
    import torch

    from benchmarks._lib.output import write_and_show
    from bloggap_plugin._io import atomic_write_text
    from bloggap_plugin.core.vllm.kernels import vllm_layout
    from bloggap_plugin.core.vllm.tile_table import dump_tiles
    from bloggap_plugin.envinfo import environment_record
    from bloggap_plugin.results import ResultDocument

    started = time.time()

    def log(message: str) -> None:
        print(f"[bi_matmul {time.time() - started:5.0f}s] {message}", file=sys.stderr, flush=True)

    if not torch.cuda.is_available():
        raise SystemExit("bi_matmul needs a CUDA GPU")
    module = _kernel_module()
    rows = [int(r) for r in args.rows.split(",")] if args.rows else list(DEFAULT_ROWS)
    results = {"configs": list(CONFIGS), "config_values": CONFIGS, "cases": {}}
    params = {"shapes": args.shape, "rows": rows, "reps": args.reps, "revision": args.revision}
    env = environment_record("cuda", vllm=vllm_layout()[0])
    def write(message: str) -> None:  # after every case: a time limit keeps what finished
        log(message)
        ResultDocument("bi_matmul", env, params, results, [summary_table(results, args.table_id)]).write(args.out)

    for shape in args.shape:
        measure_shape(module, shape, rows, args.reps, write, results["cases"].setdefault(shape, []))
        document = ResultDocument("bi_matmul", env, params, results, [summary_table(results, args.table_id)])
        write_and_show(document, Path(args.out), log, started)
        table = derive_tiles(results)
        if args.tiles_out and table:
            text = dump_tiles(table, gpu=torch.cuda.get_device_name(), vllm=env.get("vllm"),
                              source=f"benchmarks.bi_matmul {args.out} (revision {args.revision})")
            atomic_write_text(Path(args.tiles_out), text)
            log(f"wrote {args.tiles_out}: {len(table)} weight shapes")
        elif args.tiles_out:
            log("no configuration bit-identical at every row count beats vLLM's on any weight shape: no tile table")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="measure on this machine's GPU")
    run.add_argument("--shape", action="append", required=True,
                     help="a benchmarks/_lib/shapes.py name or a model folder (its config.json; repeatable)")
    run.add_argument("--rows", default="", help=f"comma-separated row counts M (default: {DEFAULT_ROWS})")
    run.add_argument("--reps", type=int, default=20, help="calls per CUDA graph")
    run.add_argument("--out", required=True)
    run.add_argument("--tiles-out", default=None, help="write the derived tile table (BLOGGAP_VLLM_MATMUL_TILES)")
    run.add_argument("--revision", default=None)
    run.add_argument("--table-id", default="T25-bi-matmul-configs")
    args = parser.parse_args(argv)
    return run_main(args)


if __name__ == "__main__":
    sys.exit(main())
