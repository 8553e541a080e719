"""A tile table for vLLM's batch-invariant matmul, measured on this GPU for a model's weight shapes (``bloggap tiles``).

Arms I and J compute every linear layer with vLLM's ``matmul_kernel_persistent`` (Triton), which vLLM 0.26 launches
at one configuration for bf16 (:data:`VLLM_BF16`). Each output element is an fp32 sum over K in ``BLOCK_SIZE_K``
steps, so configurations that share ``BLOCK_SIZE_K`` (a *family*) may give a row the same bits whatever the tile's
other sizes and the number of rows in the call; only a measurement says whether they do on this GPU. For every
linear layer (merged QKV, O, merged gate/up, down, LM head; ``(N, K)`` from the model's config) one random bf16
input of the largest row count is drawn; the family's reference (its first configuration: :data:`VLLM_BF16` for
``BLOCK_SIZE_K`` 64, with which vLLM's own ``matmul_persistent`` is compared too) computes all its rows at once, and
every configuration computes the first M rows for each M and is compared bit for bit with the reference's first M
rows. cuBLAS (``F.linear``) is timed and compared beside them. Device time is taken from CUDA-graph replays (no host
launch cost in it). :func:`derive_tiles` turns the cases into the table
:func:`~bloggap_plugin.core.vllm.tile_table.load_tiles` reads and ``gap.matmul_tiles`` installs.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["VLLM_BF16", "CONFIGS", "DEFAULT_ROWS", "family_references", "linear_shapes", "measure_linears",
           "derive_tiles", "graph_us"]

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
they may compile to another MMA instruction than 64-row tiles, which the comparison shows. Each fits a Hopper
block's shared memory (the 128-K-step 128x256 tile with 2 stages, not 3). A reference is compared with itself over
all rows (its own batch invariance); cuBLAS, with vLLM's (the control expected to differ)."""

DEFAULT_ROWS = (1, 32, 128, 512, 3584, 8192)
"""Row counts M: decode batches (1, 32, 128), a prefill, a training step's tokens (3584 = 112 rows x 32 tokens)."""


def family_references(configs: Mapping[str, Mapping[str, int]]) -> dict[int, str]:
    """``BLOCK_SIZE_K`` -> the name of its family's reference (the first configuration with it)."""
    references: dict[int, str] = {}
    for name, config in configs.items():
        references.setdefault(config["BLOCK_SIZE_K"], name)
    return references


def linear_shapes(config: Mapping[str, Any]) -> list[tuple[str, int, int, int]]:
    """``(layer, N, K, count)`` of a model's linear layers as vLLM merges them: QKV and gate/up one matmul each,
    ``count`` the number of such matmuls in one forward (the decoder layers; 1 for the LM head). ``config``: the
    model's ``config.json`` as a mapping."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    layers = config["num_hidden_layers"]
    return [("qkv", (heads + 2 * kv_heads) * head_dim, hidden, layers),
            ("o", hidden, heads * head_dim, layers),
            ("gate_up", 2 * config["intermediate_size"], hidden, layers),
            ("down", hidden, config["intermediate_size"], layers),
            ("lm_head", config["vocab_size"], hidden, 1)]


def graph_us(fn: Callable[[], Any], reps: int) -> float:
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


def measure_linears(module: Any, name: str, shapes: list[tuple[str, int, int, int]], rows: list[int], reps: int,
                    log: Callable[[str], None], cases: list[dict], device: str = "cuda") -> list[dict]:
    """Every (layer, M) case of ``shapes`` (:func:`linear_shapes`; ``name`` labels the log lines), appended to
    ``cases`` as it is measured (``log`` after each): per configuration of :data:`CONFIGS` bit-equality of its
    first-M-rows output with its family's reference over all rows, and device us per call (:func:`graph_us`; cuBLAS as
    ``cublas``, compared with vLLM's); operands on ``device``."""
    import torch
    import torch.nn.functional as F

    from bloggap_plugin.core.vllm.tile_table import launch

    references = family_references(CONFIGS)
    gen = torch.Generator(device=device).manual_seed(0)
    for layer, n, k, count in shapes:
        weight = (torch.randn((n, k), device=device, generator=gen) * 0.02).to(torch.bfloat16)
        b = weight.t()
        full = torch.randn((max(rows), k), device=device, generator=gen).to(torch.bfloat16)
        reference = {block_k: launch(module.matmul_kernel_persistent, full, b, None, CONFIGS[ref])
                     for block_k, ref in references.items()}
        for m in rows:
            a = full[:m].contiguous()
            # vLLM's own function launches its configuration for this shape (vLLM 0.31: its tuned one, where it has)
            vllm_own = bool(torch.equal(module.matmul_persistent(a, b), reference[64][:m]))
            case = {"layer": layer, "n": n, "k": k, "rows": m, "count": count, "equal": {}, "max_abs_diff": {},
                    "us": {}, "vllm_function_equal": vllm_own}
            runs = {config: functools.partial(launch, module.matmul_kernel_persistent, a, b, None, values)
                    for config, values in CONFIGS.items()}
            runs["cublas"] = functools.partial(F.linear, a, weight)
            for config, fn in runs.items():
                out = fn()
                expected = reference[CONFIGS[config]["BLOCK_SIZE_K"] if config in CONFIGS else 64][:m]
                case["equal"][config] = bool(torch.equal(out, expected))
                case["max_abs_diff"][config] = float((out.float() - expected.float()).abs().max())
                case["us"][config] = graph_us(fn, reps)
            cases.append(case)
            log(f"{name} {layer} M={m}: " + ", ".join(
                f"{config} {case['us'][config]:.1f}us{'' if case['equal'][config] else ' DIFF'}"
                for config in runs))
    return cases


def derive_tiles(results: Mapping[str, Any]) -> dict:
    """The tile table (``(N, K)`` -> :class:`~bloggap_plugin.core.vllm.tile_table.ShapeTiles`) a measurement supports
    (``results``: ``configs`` names, ``config_values`` by name, ``cases`` by model as :func:`measure_linears` writes
    them): per weight shape, the family (``BLOCK_SIZE_K``) whose configurations bit-identical to its reference at
    every M give the least summed time relative to vLLM's (sum over M of fastest / vLLM's), each M a bucket with
    that family's fastest such configuration (vLLM's family and, in it, vLLM's configuration win ties). A shape where
    no family beats vLLM's configuration at any M is left out (vLLM's own launch serves it), and so is one where
    vLLM's own function did not give :data:`VLLM_BF16`'s bits (a vLLM that tunes that shape itself)."""
    from bloggap_plugin.core.vllm.tile_table import ShapeTiles, TileShape

    vllm_family = results["config_values"]["vllm"]["BLOCK_SIZE_K"]
    # vLLM's family first: another wins only with a strictly smaller score, so a tie keeps vLLM's bits
    families = sorted({results["config_values"][name]["BLOCK_SIZE_K"] for name in results["configs"]},
                      key=lambda block_k: (block_k != vllm_family, block_k))
    table = {}
    for cases in results["cases"].values():
        for n, k in sorted({(c["n"], c["k"]) for c in cases}):
            mine = sorted((c for c in cases if (c["n"], c["k"]) == (n, k)), key=lambda c: c["rows"])
            if not all(c.get("vllm_function_equal", True) for c in mine):
                continue
            best = None
            for family in families:
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
