"""Harness (issue 44 item 3): vLLM's batch-invariant persistent matmul under other tile configurations, on one GPU.

    python -m benchmarks.bi_matmul run --shape llama-1.56b-v49k|MODEL_FOLDER [--shape ...] --out FILE [--tiles-out TILES]

Arms I and J compute every linear layer with vLLM's ``matmul_kernel_persistent`` (Triton), which vLLM 0.26 launches
at one configuration for bf16 (:data:`VLLM_BF16`). Each output element is an fp32 sum over K in ``BLOCK_SIZE_K``
steps, so configurations that share ``BLOCK_SIZE_K`` (a *family*) may give a row the same bits whatever the tile's
other sizes and the number of rows in the call (vLLM 0.31 relies on this for its tuned shapes); only a measurement
says whether they do on this GPU. For every linear layer of each shape (merged QKV, O, merged gate/up, down, LM head;
``(N, K)`` from the shape's config) one random bf16 input of the largest row count is drawn; the family's reference
(its first configuration: :data:`VLLM_BF16` for ``BLOCK_SIZE_K`` 64, with which vLLM's own ``matmul_persistent`` is
compared too) computes all its rows at once, and every configuration computes the first M rows for each M of
``--rows`` and is compared bit for bit with the reference's first M rows: equal at every M means the configuration
can serve any row count of that shape beside the others of its family. cuBLAS (``F.linear``) is timed and compared
beside them. Device time is taken from CUDA-graph replays of ``--reps`` calls (no host launch cost in it).

Table T25: per configuration the cases (layer, M) bit-identical to its family's reference, and the device time of
one forward's linears at each M (per-call time x calls per forward, summed; the LM head once) as a multiple of
vLLM's configuration's. ``--tiles-out`` writes the tile table (:mod:`bloggap_plugin.core.vllm.tiles`) of
:func:`derive_tiles`, which ``BLOGGAP_VLLM_MATMUL_TILES`` installs for arms I and J. A harness result until a
``bloggap train`` run with that table measures it.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

VLLM_BF16 = {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8, "num_stages": 3,
             "num_warps": 8}
"""``matmul_persistent``'s bf16 configuration (vLLM 0.26 ``model_executor/layers/batch_invariant.py``)."""


def _config(m: int, n: int, k: int, warps: int, stages: int) -> dict[str, int]:
    return {"BLOCK_SIZE_M": m, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": k, "GROUP_SIZE_M": 8, "num_warps": warps,
            "num_stages": stages}


CONFIGS: dict[str, dict[str, int]] = {
    "vllm": VLLM_BF16,
    "m128n128s4": _config(128, 128, 64, 8, 4),
    "m128n256s3": _config(128, 256, 64, 8, 3),
    "m128n64w4s4": _config(128, 64, 64, 4, 4),
    "m64n128w4s4": _config(64, 128, 64, 4, 4),
    "m64n64w4s4": _config(64, 64, 64, 4, 4),
    "m64n32w4s4": _config(64, 32, 64, 4, 4),
    "m32n64w4s4": _config(32, 64, 64, 4, 4),
    "m16n64w4s4": _config(16, 64, 64, 4, 4),
    "m16n128w4s4": _config(16, 128, 64, 4, 4),
    "k128m128n128w8s3": _config(128, 128, 128, 8, 3),
    "k128m128n256w8s2": _config(128, 256, 128, 8, 2),
    "k128m64n128w4s3": _config(64, 128, 128, 4, 3),
    "k128m64n64w4s4": _config(64, 64, 128, 4, 4),
    "k128m32n64w8s5": _config(32, 64, 128, 8, 5),
    "k128m16n64w4s4": _config(16, 64, 128, 4, 4),
    "k32": _config(128, 128, 32, 8, 4),
}
"""Configurations of ``matmul_kernel_persistent`` tried, by name; the first of each ``BLOCK_SIZE_K`` is its family's
reference (``vllm`` for 64). Tiles of 16-32 rows are what vLLM 0.31's tuned Hopper table uses for decode batches;
they may compile to another MMA instruction than 64-row tiles, which the comparison shows. A reference is compared
with itself over all rows (its own batch invariance); cuBLAS, with vLLM's (the control expected to differ)."""

DEFAULT_ROWS = (1, 32, 128, 512, 3584, 8192)
"""Row counts M: decode batches (1, 32, 128), a prefill, a training step's tokens (3584 = 112 rows x 32 tokens)."""


def family_references(configs: dict[str, dict[str, int]]) -> dict[int, str]:
    """``BLOCK_SIZE_K`` -> the name of its family's reference (the first configuration with it)."""
    references: dict[int, str] = {}
    for name, config in configs.items():
        references.setdefault(config["BLOCK_SIZE_K"], name)
    return references


def linear_shapes(shape: str) -> list[tuple[str, int, int, int]]:
    """``(layer, N, K, count)`` of a model's linear layers as vLLM merges them: QKV and gate/up one matmul each,
    ``count`` the number of such matmuls in one forward (the decoder layers; 1 for the LM head). ``shape``: a
    ``benchmarks/_lib/shapes.py`` name, or a model folder (its ``config.json``)."""
    import json

    from benchmarks._lib.shapes import SHAPES

    config = SHAPES[shape][1] if shape in SHAPES else json.loads((Path(shape) / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    layers = config["num_hidden_layers"]
    return [("qkv", (heads + 2 * kv_heads) * head_dim, hidden, layers),
            ("o", hidden, heads * head_dim, layers),
            ("gate_up", 2 * config["intermediate_size"], hidden, layers),
            ("down", hidden, config["intermediate_size"], layers),
            ("lm_head", config["vocab_size"], hidden, 1)]


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


def derive_tiles(results: dict) -> dict:
    """The tile table (``(N, K)`` -> :class:`~bloggap_plugin.core.vllm.tiles.ShapeTiles`) a measurement supports:
    per weight shape, the family (``BLOCK_SIZE_K``) whose configurations bit-identical to its reference at every M
    give the least summed time relative to vLLM's (sum over M of fastest / vLLM's), each M a bucket with that
    family's fastest such configuration. A shape where no family beats vLLM's configuration at any M is left out
    (vLLM's own launch serves it), and so is one where vLLM's own function did not give :data:`VLLM_BF16`'s bits
    (a vLLM that tunes that shape itself)."""
    from bloggap_plugin.core.vllm.tiles import ShapeTiles, TileShape

    table = {}
    for cases in results["cases"].values():
        for n, k in sorted({(c["n"], c["k"]) for c in cases}):
            mine = sorted((c for c in cases if (c["n"], c["k"]) == (n, k)), key=lambda c: c["rows"])
            if not all(c.get("vllm_function_equal", True) for c in mine):
                continue
            best = None
            for family in sorted({results["config_values"][name]["BLOCK_SIZE_K"] for name in results["configs"]}):
                names = [name for name in results["configs"]
                         if results["config_values"][name]["BLOCK_SIZE_K"] == family
                         and all(c["equal"].get(name) for c in mine)]
                if not names:
                    continue
                picks = [min(names, key=lambda name, c=c: c["us"][name]) for c in mine]
                score = sum(c["us"][pick] / c["us"]["vllm"] for c, pick in zip(mine, picks, strict=True))
                if best is None or score < best[0]:
                    best = (score, family, picks)
            if best is None or all(pick == "vllm" for pick in best[2]):
                continue
            _, family, picks = best
            buckets = tuple((c["rows"], TileShape(*(results["config_values"][pick][key] for key in (
                "BLOCK_SIZE_M", "BLOCK_SIZE_N", "num_warps", "num_stages")))) for c, pick in zip(mine, picks,
                                                                                                  strict=True))
            table[(n, k)] = ShapeTiles(family, buckets)
    return table


def _kernel_module() -> Any:
    from bloggap_plugin.core.vllm.kernels import persistent_matmul_module

    module = persistent_matmul_module()
    if module is None:
        raise SystemExit("bi_matmul needs vLLM with its batch-invariant Triton kernels on a CUDA GPU")
    return module


def graph_us(fn, reps: int) -> float:
    """Device microseconds per call of ``fn`` from a CUDA graph of up to ``reps`` calls (fewer for a slow call: about
    2 ms of calls, at least 2), replayed three times (median)."""
    import torch

    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    reps = max(2, min(reps, int(2000.0 / max(start.elapsed_time(end) * 1000.0, 1.0))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / reps)
    del graph
    return statistics.median(times)


def measure_shape(module: Any, shape: str, rows: list[int], reps: int, log, cases: list[dict],
                  device: str = "cuda") -> list[dict]:
    """Every (layer, M) case of ``shape``, appended to ``cases`` as it is measured (``log`` after each): per
    configuration bit-equality of its first-M-rows output with its family's reference over all rows, and device us
    per call (cuBLAS as ``cublas``, compared with vLLM's); operands on ``device``."""
    import torch
    import torch.nn.functional as F

    from bloggap_plugin.core.vllm.tiles import launch

    references = family_references(CONFIGS)
    gen = torch.Generator(device=device).manual_seed(0)
    for layer, n, k, count in linear_shapes(shape):
        weight = (torch.randn((n, k), device=device, generator=gen) * 0.02).to(torch.bfloat16)
        b = weight.t()
        full = torch.randn((max(rows), k), device=device, generator=gen).to(torch.bfloat16)
        reference = {block_k: launch(module.matmul_kernel_persistent, full, b, None, CONFIGS[name])
                     for block_k, name in references.items()}
        for m in rows:
            a = full[:m].contiguous()
            # vLLM's own function launches its configuration for this shape (vLLM 0.31: its tuned one, where it has)
            vllm_own = bool(torch.equal(module.matmul_persistent(a, b), reference[64][:m]))
            case = {"layer": layer, "n": n, "k": k, "rows": m, "count": count, "equal": {}, "max_abs_diff": {},
                    "us": {}, "vllm_function_equal": vllm_own}
            runs = {name: functools.partial(launch, module.matmul_kernel_persistent, a, b, None, config)
                    for name, config in CONFIGS.items()}
            runs["cublas"] = functools.partial(F.linear, a, weight)
            for name, fn in runs.items():
                out = fn()
                expected = reference[CONFIGS[name]["BLOCK_SIZE_K"] if name in CONFIGS else 64][:m]
                case["equal"][name] = bool(torch.equal(out, expected))
                case["max_abs_diff"][name] = float((out.float() - expected.float()).abs().max())
                case["us"][name] = graph_us(fn, reps)
            cases.append(case)
            log(f"{shape} {layer} M={m}: " + ", ".join(
                f"{name} {case['us'][name]:.1f}us{'' if case['equal'][name] else ' DIFF'}"
                for name in runs))
    return cases


def run_main(args: argparse.Namespace) -> int:
    import torch

    from benchmarks._lib.output import write_and_show
    from bloggap_plugin._io import atomic_write_text
    from bloggap_plugin.core.vllm.kernels import vllm_layout
    from bloggap_plugin.core.vllm.tiles import dump_tiles
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
