"""Harness (issue 44 item 3): vLLM's batch-invariant persistent matmul under other tile configurations, on one GPU.

    python -m benchmarks.bi_matmul run --shape llama-1.56b-v49k [--shape ...] --out FILE [--revision R]

Arms I and J compute every linear layer with vLLM's ``matmul_kernel_persistent`` (Triton) at the one configuration
``matmul_persistent`` gives bf16 (:data:`VLLM_BF16`). Each output element is an fp32 sum over K in steps of
``BLOCK_SIZE_K``, so a configuration that keeps ``BLOCK_SIZE_K`` and changes only the tile's M and N widths, the
warps or the pipeline stages may give the same bits at another speed; only a measurement says whether it does.
For every linear layer of each shape (merged QKV, O, merged gate/up, down, LM head; ``(N, K)`` from the shape's
config) and every row count M of ``--rows``, each configuration of :data:`CONFIGS` runs the same kernel on the same
random bf16 operands (the weight transposed, as ``linear_batch_invariant`` passes it) and is compared bit for bit
with vLLM's own ``matmul_persistent``; cuBLAS (``F.linear``) is timed and compared beside them. Device time is
taken from CUDA-graph replays of ``--reps`` calls (no host launch cost in it). Per configuration the table gives the
share of (layer, M) cases it matches bit for bit and the device time of one model forward's linears at each M
(the per-layer sum times the layer count, plus the LM head) as a multiple of vLLM's configuration's.

A harness result: the product does not use any configuration but vLLM's until one is adopted and measured through
``bloggap train``.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path
from typing import Any

VLLM_BF16 = {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8, "num_stages": 3,
             "num_warps": 8}
"""``matmul_persistent``'s bf16 configuration (vLLM 0.26 ``model_executor/layers/batch_invariant.py``)."""

CONFIGS: dict[str, dict[str, int]] = {
    "vllm": VLLM_BF16,
    "m128n128s4": VLLM_BF16 | {"num_stages": 4},
    "m128n256s3": VLLM_BF16 | {"BLOCK_SIZE_N": 256},
    "m128n128w4": VLLM_BF16 | {"num_warps": 4},
    "m128n64w4s4": VLLM_BF16 | {"BLOCK_SIZE_N": 64, "num_warps": 4, "num_stages": 4},
    "m64n128w4s4": VLLM_BF16 | {"BLOCK_SIZE_M": 64, "num_warps": 4, "num_stages": 4},
    "m64n64w4s4": VLLM_BF16 | {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "num_warps": 4, "num_stages": 4},
    "m64n256w8s3": VLLM_BF16 | {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 256},
    "m64n32w4s4": VLLM_BF16 | {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 32, "num_warps": 4, "num_stages": 4},
    "m64n16w4s4": VLLM_BF16 | {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 16, "num_warps": 4, "num_stages": 4},
    "m32n32w4s4": VLLM_BF16 | {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 32, "num_warps": 4, "num_stages": 4},
    "k32": VLLM_BF16 | {"BLOCK_SIZE_K": 32, "num_stages": 4},
}
"""Configurations of ``matmul_kernel_persistent`` tried, by name. ``k32`` changes the K step, so it is expected to
differ from vLLM's bits (a control that the comparison can fail). Narrow N tiles give a decode batch's few rows more
programs (vLLM's 128-wide tiles leave most SMs idle at N = 2048); tiles below 64 rows may compile to another MMA
instruction than vLLM's."""

DEFAULT_ROWS = (1, 32, 128, 512, 3584, 8192)
"""Row counts M: decode batches (1, 32, 128), a prefill, a training step's tokens (3584 = 112 rows x 32 tokens)."""


def linear_shapes(shape: str) -> list[tuple[str, int, int, int]]:
    """``(layer, N, K, count)`` of a model shape's linear layers as vLLM merges them: QKV and gate/up one matmul
    each, ``count`` the number of such matmuls in one forward (the decoder layers; 1 for the LM head)."""
    from benchmarks._lib.shapes import SHAPES

    _, config = SHAPES[shape]
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
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
    """One row per configuration (cuBLAS last): bit-identical cases / all, and per M the forward's linear time as a
    multiple of vLLM's configuration's, per shape."""
    columns = ["shape", "configuration", "bit-identical to vLLM's (cases)"]
    rows_by_shape = {shape: sorted({c["rows"] for c in cases}) for shape, cases in results["cases"].items()}
    all_rows = sorted({m for ms in rows_by_shape.values() for m in ms})
    columns += [f"linears x vLLM's, M={m}" for m in all_rows] + [f"vLLM's linears us, M={m}" for m in all_rows]
    table_rows = []
    for shape, cases in results["cases"].items():
        for config in [*results["configs"], "cublas"]:
            same = sum(1 for c in cases if c["equal"].get(config))
            cells = [shape, config, f"{same}/{len(cases)}"]
            base = {m: forward_us(cases, "vllm", m) for m in all_rows}
            for m in all_rows:
                mine = forward_us(cases, config, m)
                cells.append(None if mine is None or not base[m] else round(mine / base[m], 3))
            cells += [None if base[m] is None else round(base[m], 1) for m in all_rows]
            table_rows.append(cells)
    return {"id": table_id, "title": "vLLM's batch-invariant matmul under other tile configurations: bits and "
            "device time (harness)", "columns": columns, "rows": table_rows,
            "notes": "Harness (benchmarks.bi_matmul): random bf16 operands, every linear layer of the shape as vLLM "
                     "merges them; a case is one (layer, M); 'bit-identical' compares each configuration's output "
                     "with vLLM's matmul_persistent bit for bit; device time from CUDA-graph replays; 'linears x "
                     "vLLM's' sums per-call time x calls per forward over the layers (LM head once) and divides by "
                     "the same for vLLM's configuration. cublas is F.linear with torch's default settings."}


def _kernel_module() -> Any:
    from bloggap_plugin.core.vllm.kernels import _batch_invariant_module

    module = _batch_invariant_module()
    if module is None or not hasattr(module, "matmul_kernel_persistent"):
        raise SystemExit("bi_matmul needs vLLM with its batch-invariant Triton kernels on a CUDA GPU")
    return module


def run_config(module: Any, a, b, config: dict[str, int]):
    """``a @ b`` by vLLM's ``matmul_kernel_persistent`` at ``config`` (``a`` (M, K), ``b`` (K, N), bf16)."""
    import torch
    import triton

    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty((m, n), device=a.device, dtype=a.dtype)
    grid = (min(sms, triton.cdiv(m, config["BLOCK_SIZE_M"]) * triton.cdiv(n, config["BLOCK_SIZE_N"])),)
    module.matmul_kernel_persistent[grid](
        a, b, c, None, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        NUM_SMS=sms, A_LARGE=a.numel() > 2**31, B_LARGE=b.numel() > 2**31, C_LARGE=c.numel() > 2**31,
        HAS_BIAS=False, **config)
    return c


def graph_us(fn, reps: int) -> float:
    """Device microseconds per call of ``fn`` from a CUDA graph of ``reps`` calls, replayed three times (median)."""
    import statistics

    import torch

    fn()
    torch.cuda.synchronize()
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


def measure_shape(module: Any, shape: str, rows: list[int], reps: int, log) -> list[dict]:
    """Every (layer, M) case of ``shape``: per configuration bit-equality with vLLM's ``matmul_persistent`` and
    device us per call (cuBLAS as ``cublas``)."""
    import torch
    import torch.nn.functional as F

    cases = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for layer, n, k, count in linear_shapes(shape):
        weight = (torch.randn((n, k), device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        b = weight.t()
        for m in rows:
            a = torch.randn((m, k), device="cuda", generator=gen).to(torch.bfloat16)
            reference = module.matmul_persistent(a, b)
            case = {"layer": layer, "n": n, "k": k, "rows": m, "count": count, "equal": {}, "max_abs_diff": {},
                    "us": {}}
            runs = {name: functools.partial(run_config, module, a, b, config) for name, config in CONFIGS.items()}
            runs["cublas"] = functools.partial(F.linear, a, weight)
            for name, fn in runs.items():
                out = fn()
                case["equal"][name] = bool(torch.equal(out, reference))
                case["max_abs_diff"][name] = float((out.float() - reference.float()).abs().max())
                case["us"][name] = graph_us(fn, reps)
            cases.append(case)
            log(f"{shape} {layer} M={m}: " + ", ".join(
                f"{name} {case['us'][name]:.1f}us{'' if case['equal'][name] else ' DIFF'}" for name in runs))
    return cases


def run_main(args: argparse.Namespace) -> int:
    import torch

    from benchmarks._lib.output import write_and_show
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
    for shape in args.shape:
        results["cases"][shape] = measure_shape(module, shape, rows, args.reps, log)
        document = ResultDocument("bi_matmul", environment_record("cuda", vllm=_vllm_version()), params, results,
                                  [summary_table(results, args.table_id)])
        write_and_show(document, Path(args.out), log, started)
    return 0


def _vllm_version() -> str | None:
    from bloggap_plugin.core.vllm.kernels import vllm_layout

    return vllm_layout()[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="measure on this machine's GPU")
    run.add_argument("--shape", action="append", required=True, help="a benchmarks/_lib/shapes.py name (repeatable)")
    run.add_argument("--rows", default="", help=f"comma-separated row counts M (default: {DEFAULT_ROWS})")
    run.add_argument("--reps", type=int, default=20, help="calls per CUDA graph")
    run.add_argument("--out", required=True)
    run.add_argument("--revision", default=None)
    run.add_argument("--table-id", default="T25-bi-matmul-configs")
    args = parser.parse_args(argv)
    return run_main(args)


if __name__ == "__main__":
    sys.exit(main())
