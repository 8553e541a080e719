"""T7b: what each scoring plan costs: tokens/s relative to bf16 in the same run, peak memory, sync time;
plus whether TF32 still removes the batch-shape noise (arm B with TF32, SmolLM2 real weights).

Memory (CUDA): ``pass_peak_gib`` is the peak allocated during one scoring pass above what was allocated just
before it (the pass's own activations and logits tiles; a plan's resident copies are ``bytes_added``), for
every plan and for TRL 1.16's own old-logprob pass (its fused LM head, the baseline);
``pass_peak_vs_trl`` is the ratio (target: <= 1.25 for every arm). Plans score in tiles of
``--score-chunk-tokens`` scored tokens (``gap.score_chunk_tokens``); "fp32 head (untiled)" is the same plan
with the whole ``[rows, K, V]`` logits at once, as before tiling.

Memory off CUDA: the same ``pass_peak_gib`` from the tensors themselves (``benchmarks/_lib/memtrack.py``
``TensorPeak``: the peak of live tensor storages created during the pass; kernel-internal scratch is not seen).
There TRL's fused head runs its torch fallback, which projects every position and makes fp32 copies of each
``[4096, 32768]`` tile; the extra baseline row "TRL fused head, CUDA memory model" (``pass_peak_vs_trl_cuda_like``)
is the same pass with only the labelled positions projected and an allocation-free fold, as on CUDA with
Triton. ``--memory-only`` runs one pass per arm (no timing) and writes ``cost_memory.json`` (table
T7c-memory); ``--skip-matmul-arithmetic`` (CPU, with ``--memory-only``) makes matmuls and attention return zeros
of their real size instead of computing (the same tensors, so the same peaks: tested equal on tiny models),
for CPUs whose bf16/fp16 matmuls run at ~1 GFLOP/s.

Shapes: SmolLM2-135M (real weights) and random-init real-size shapes (Qwen2.5-1.5B, Qwen2.5-7B, a
Llama-3.1-8B-class shape) built directly on the device (random init is valid for timing only). Input: random
token ids, batch ``--batch`` x ``--seq`` tokens, the last half scored (``logits_to_keep = seq // 2``) through
``plan.token_logprobs``; ``--warmup`` untimed passes, then the median of ``--passes`` timed passes.

Plans: bf16 (the policy), raw fp16 (the fp16 shadow module called directly, no plan: the plan's overhead
baseline), fp16 plan, fp32 head, guided-8 + head (layers 0,1,2,3,4,8,9,L-1: the reference study's Qwen2.5-1.5B
set), all fp32, each fp32 plan twice: ``tf32=False`` (IEEE fp32) and ``tf32=True`` (TF32 matmuls), the plan option
``gap.tf32`` that sets the matmul precision around the plan's own forward only (on a CPU both rows compute the
same). ``sync`` = ``plan.sync(policy)`` (one fused ``torch._foreach_copy_`` per dtype group), median of 3, next to
``sync loop`` (the per-tensor ``copy_`` loop it replaced, same tensors, median of 3); its share of one scoring pass
over a GRPO generation batch (``--gen-rows`` rows of ``--seq`` tokens, extrapolated linearly from the measured
pass) is reported against the target of 1%.

    python -m benchmarks.cost --out benchmarks/results/h200            # GPU, ~2-3 min on an H200
    python -m benchmarks.cost --quick --device cpu --out /tmp/cost     # CPU smoke run, < 60 s
    python -m benchmarks.cost --memory-only --skip-matmul-arithmetic --device cpu --shapes smollm2 \
        qwen2.5-1.5b --layers 2 --out benchmarks/results/cpu          # T7c-memory on CPU, ~5 min
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks._lib.device import free_memory, synchronize
from benchmarks._lib.memtrack import SkipMatmulArithmetic, TensorPeak
from benchmarks._lib.output import write_and_show
from benchmarks._lib.paths import RESULTS
from benchmarks._lib.shapes import load_policy
from bloggap_plugin.core.model_parts import param_pairs as _param_pairs
from bloggap_plugin.core.plans import make_plan
from bloggap_plugin.core.scoring import DEFAULT_CHUNK_TOKENS, token_logprobs, unwrap_model
from bloggap_plugin.results import ResultDocument

NAME = "cost"
MEMORY_NAME = "cost_memory"
MEMORY_METHOD = {
    "cuda": "torch.cuda.max_memory_allocated during the pass minus memory_allocated before it",
    "other": "peak of live tensor storages created during the pass (benchmarks/_lib/memtrack.py TensorPeak: "
    "every aten op's new output storages, freed by finalizers; kernel-internal scratch not seen)",
}
# The arm letters for each plan of this benchmark (trl = TRL's own old-logprob pass, arm A).
ARM_LETTERS = {"trl": "A", "trl_cuda_like": "A", "fp32": "B", "bf16": "C", "guided": "D", "fp32_head": "E",
               "fp16": "F", "raw_fp16": "F"}

def loop_sync_seconds(plan, policy, device, repeats: int = 3) -> float | None:
    """Median seconds of the per-tensor ``copy_`` loop that ``plan.sync`` replaced (fp32/fp16 shadows only): the same
    (shadow, policy) tensor pairs, one ``copy_`` each, as the comparison baseline for the fused sync."""
    shadow = getattr(plan, "shadow", None)
    if shadow is None:
        return None
    pairs = _param_pairs(shadow, unwrap_model(policy))
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        with torch.no_grad():
            for dst, src in pairs:
                dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_passes(fn, device, warmup: int, passes: int) -> list[float]:
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def pass_peak(fn, device, skip_arithmetic: bool = False) -> tuple[float, float | None]:
    """``(extra, absolute)`` GiB of one call of ``fn``. CUDA: the peak allocated during it minus what was
    allocated just before (allocator statistics), and the peak itself. Other devices: the peak of live tensor
    bytes created during the call (``benchmarks._lib.memtrack.TensorPeak``: tensors only, no kernel scratch, see
    ``MEMORY_METHOD``) and ``None`` (no absolute figure); ``skip_arithmetic``: matmuls and attention return
    zeros of their real size (``SkipMatmulArithmetic``; same tensors, meaningless values). Garbage is collected
    first on CUDA only, where the allocator's figures count it; ``TensorPeak`` counts only what the call creates."""
    if device.type != "cuda":
        with SkipMatmulArithmetic() if skip_arithmetic else contextlib.nullcontext(), TensorPeak() as peak:
            fn()
        return peak.peak_bytes / 2**30, None
    free_memory(device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return (peak - before) / 2**30, peak / 2**30


@contextlib.contextmanager
def trl_cuda_memory_model(enabled: bool):
    """TRL's fused head off CUDA as it allocates on CUDA (a memory model for the CPU baseline): only the
    labelled positions are projected (TRL's ``compact`` path, taken where Triton runs) and the per-tile fold
    allocates nothing (on CUDA it is a Triton kernel updating its running statistics in place; off CUDA
    ``_forward_tile`` computes fp32 copies of each ``[4096, 32768]`` tile, which the block runs untracked by
    ``TensorPeak``). The values are unchanged; only what the memory tracker sees differs."""
    if not enabled:
        yield
        return
    import trl.kernels.chunked_logprob as kernels
    import trl.trainer.utils as trl_utils
    from torch.utils._python_dispatch import _disable_current_modes

    original_fold, original_use_triton = kernels._forward_tile, trl_utils._use_triton

    def untracked_fold(*args, **kwargs):
        with _disable_current_modes():
            return original_fold(*args, **kwargs)

    kernels._forward_tile, trl_utils._use_triton = untracked_fold, lambda device: True
    try:
        yield
    finally:
        kernels._forward_tile, trl_utils._use_triton = original_fold, original_use_triton


def trl_old_logprob_pass(policy, ids, mask, keep: int, batch_size: int, cuda_like: bool = False):
    """TRL 1.16's own old-logprob pass, the memory baseline: its fused LM head patched on ``policy`` as
    ``GRPOTrainer`` does (``add_fused_lm_head``, log-probs and entropy), then the text-only loop of
    ``_get_per_token_logps_and_entropies`` (labels on the last ``keep`` tokens, chunks of ``batch_size`` rows,
    ``fused_lm_head=True``), grad-free. ``cuda_like``: under :func:`trl_cuda_memory_model` (off CUDA only).
    Returns ``(fn, remove)``: ``remove()`` takes the patch off again."""
    from trl.trainer.utils import add_fused_lm_head

    had_own = "forward" in policy.__dict__
    add_fused_lm_head(policy, temperature=1.0, outputs=("log_probs", "entropy"))

    def fn():
        with torch.no_grad(), trl_cuda_memory_model(cuda_like):
            out = []
            for start in range(0, ids.shape[0], batch_size):
                chunk_ids, chunk_mask = ids[start : start + batch_size], mask[start : start + batch_size]
                labels = chunk_ids.masked_fill(chunk_mask == 0, -100)
                labels[:, :-keep] = -100
                outputs = policy(input_ids=chunk_ids, attention_mask=chunk_mask, labels=labels, fused_lm_head=True)
                out.append(outputs.log_probs[:, -keep:])
            return torch.cat(out)

    def remove():
        if not had_own:
            del policy.forward

    return fn, remove


def _guided_layers(n_layers: int) -> list[int]:
    base = [0, 1, 2, 3, 4, 8, 9, n_layers - 1]
    return sorted({i for i in base if i < n_layers})


def _arm_passes(name: str, guided: list[int], args, cuda: bool) -> list[tuple[str, str, dict, bool]]:
    """``(label, arm, plan options, tf32)`` of every pass measured on shape ``name``, in measuring order."""
    fp16_ok = (cuda or name.startswith("tiny") or args.skip_matmul_arithmetic) and not args.skip_fp16
    arms = [("bf16", "bf16", {}, False), ("TRL fused head (baseline)", "trl", {}, False)]
    if not cuda:
        arms.append(("TRL fused head, CUDA memory model", "trl_cuda_like", {}, False))
    if fp16_ok:
        arms += [("raw fp16", "raw_fp16", {}, False), ("fp16 plan", "fp16", {}, False)]
    arms += [
        ("fp32 head", "fp32_head", {}, False),
        ("fp32 head (untiled)", "fp32_head", {"chunk_tokens": 0}, False),
        (f"guided-{len(guided)} + head", "guided", {"layers": guided}, False),
        ("all fp32", "fp32", {}, False),
    ]
    if args.memory_only and args.batch > 1:
        # fp32 bodies hold activations twice the size of the bf16 body's: the same pass with half the rows per
        # forward shows what splitting their row chunks would bring
        half = args.batch // 2
        arms += [
            (f"guided-{len(guided)} + head, {half} rows per forward", "guided", {"layers": guided, "rows": half}, False),
            (f"all fp32, {half} rows per forward", "fp32", {"rows": half}, False),
        ]
    if not args.memory_only:  # TF32 changes no tensor's size: same memory as the rows above
        # the same fp32 plans with gap.tf32: true (the plan sets TF32 around its own forward)
        arms += [
            ("fp32 head (TF32)", "fp32_head", {}, True),
            (f"guided-{len(guided)} + head (TF32)", "guided", {"layers": guided}, True),
            ("all fp32 (TF32)", "fp32", {}, True),
        ]
    return arms


def _pass_callable(policy, arm: str, options: dict, use_tf32: bool, batch: tuple, chunk_tokens: int, rows: int,
                   fp16_plan, args, device: torch.device):
    """One arm's scoring pass as a callable: ``(fn, plan, remove, fp16_plan)``. ``batch`` is ``(ids, mask,
    keep)``; ``plan`` is ``None`` for TRL's own pass and the raw fp16 module; ``remove`` undoes TRL's patch;
    ``fp16_plan`` is the fp16 plan the raw fp16 pass made, whose shadow the fp16 plan's own pass re-uses."""
    ids, mask, keep = batch
    if arm in ("trl", "trl_cuda_like"):
        fn, remove = trl_old_logprob_pass(policy, ids, mask, keep, args.batch, cuda_like=arm == "trl_cuda_like")
        return fn, None, remove, fp16_plan
    if arm == "raw_fp16":
        fp16_plan = make_plan(policy, "fp16")
        shadow = fp16_plan.shadow

        def fn(shadow=shadow, chunk_tokens=chunk_tokens):
            with torch.no_grad(), torch.autocast(device.type, enabled=False):
                return token_logprobs(shadow, ids, mask, keep, batch_size=args.batch, chunk_tokens=chunk_tokens)

        return fn, None, None, fp16_plan
    if arm == "fp16" and fp16_plan is not None:
        plan = fp16_plan  # the same shadow module the raw pass used
    else:
        if arm in ("fp32", "fp32_head", "guided"):
            options["tf32"] = use_tf32
        plan = make_plan(policy, arm, **options)

    def fn(plan=plan, chunk_tokens=chunk_tokens, rows=rows):
        return plan.token_logprobs(ids, mask, keep, batch_size=rows, chunk_tokens=chunk_tokens)

    return fn, plan, None, fp16_plan


def _measure_pass(fn, plan, policy, arm: str, use_tf32: bool, chunk_tokens: int, rows: int, args,
                  device: torch.device) -> dict:
    """One pass for its own peak memory, then (unless ``--memory-only``) the timed passes and the plan's sync:
    the entry's fields from ``tf32`` to ``sync_loop_seconds`` (seconds, GiB)."""
    cuda = device.type == "cuda"
    slow = arm in ("fp32", "guided", "fp32_head") and not use_tf32 and cuda
    started = time.perf_counter()
    extra_gib, pass_abs_gib = pass_peak(fn, device, args.skip_matmul_arithmetic)  # one pass: its own peak
    memory_pass_seconds = time.perf_counter() - started
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times, sync_times = [], []
    loop_seconds = None
    if not args.memory_only:
        times = time_passes(fn, device, args.warmup, max(2, args.passes - 2) if slow else args.passes)
        if plan is not None and arm != "bf16":
            plan.sync(policy)  # first call builds the fused copy lists
            sync_times = [plan.sync(policy) for _ in range(3)]
            loop_seconds = loop_sync_seconds(plan, policy, device)
    seconds = statistics.median(times) if times else None
    return {
        "tf32": use_tf32,
        "pass_seconds": seconds,
        "pass_seconds_all": times,
        "memory_pass_seconds": memory_pass_seconds,
        "tokens_per_s": args.batch * args.seq / seconds if seconds else None,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "pass_peak_gib": extra_gib,
        "pass_peak_abs_gib": pass_abs_gib,
        "memory_method": MEMORY_METHOD["cuda" if cuda else "other"],
        "chunk_tokens": None if arm.startswith("trl") else chunk_tokens,
        "rows_per_forward": rows,
        "sync_seconds": statistics.median(sync_times) if sync_times else None,
        "sync_loop_seconds": loop_seconds,
    }


def _add_ratios(results: list[dict], args) -> None:
    """Each entry's time relative to the first (bf16) pass, its pass peak relative to TRL's pass (and to its
    CUDA memory model off CUDA), and the sync's share of one pass and of a generation batch's pass."""
    base = results[0]["pass_seconds"]
    trl = next(e for e in results if e["arm"] == "trl")
    trl_cuda_like = next((e for e in results if e["arm"] == "trl_cuda_like"), None)
    for entry in results:
        entry["rel_time"] = None if base is None else entry["pass_seconds"] / base
        entry["pass_peak_vs_trl"] = entry["pass_peak_gib"] / trl["pass_peak_gib"] if trl["pass_peak_gib"] else None
        entry["pass_peak_vs_trl_cuda_like"] = (
            entry["pass_peak_gib"] / trl_cuda_like["pass_peak_gib"]
            if trl_cuda_like and trl_cuda_like["pass_peak_gib"] else None
        )
        if entry["sync_seconds"] is not None:
            per_row = entry["pass_seconds"] / args.batch
            gen_pass = per_row * args.gen_rows
            entry["sync_frac_of_pass"] = entry["sync_seconds"] / entry["pass_seconds"]
            entry["sync_frac_of_gen_batch_pass"] = entry["sync_seconds"] / gen_pass
            if entry["sync_loop_seconds"] is not None:
                entry["sync_loop_frac_of_gen_batch_pass"] = entry["sync_loop_seconds"] / gen_pass


def bench_shape(name: str, device: torch.device, args, log) -> dict:
    """Every arm's pass on shape ``name`` (``--batch`` x ``--seq`` random token ids, the last half scored):
    time, peak memory and sync per arm, with the shape's size."""
    policy, random_init = load_policy(name, device, args.layers)
    n_layers = policy.config.num_hidden_layers
    vocab = policy.config.vocab_size
    n_params = sum(p.numel() for p in policy.parameters())
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(
        min(100, vocab - 1), min(20000, vocab), (args.batch, args.seq), generator=generator
    ).to(device)
    batch = (ids, torch.ones_like(ids), args.seq // 2)
    guided = _guided_layers(n_layers)
    results = []
    fp16_plan = None
    for label, arm, options, use_tf32 in _arm_passes(name, guided, args, device.type == "cuda"):
        if device.type == "cuda":  # the previous arm's plan out of the allocator before this one is built
            free_memory(device)
        options = dict(options)
        chunk_tokens = options.pop("chunk_tokens", args.score_chunk_tokens)
        rows = options.pop("rows", args.batch)  # rows per forward
        fn, plan, remove, fp16_plan = _pass_callable(policy, arm, options, use_tf32, batch, chunk_tokens, rows,
                                                     fp16_plan, args, device)
        entry = {"plan": label, "arm": arm, "arm_letter": ARM_LETTERS.get(arm),
                 **_measure_pass(fn, plan, policy, arm, use_tf32, chunk_tokens, rows, args, device)}
        if plan is not None:
            stats = plan.stats()
            entry.update(bytes_added=stats["bytes_added"], fp32_param_share=stats["fp32_param_share"])
            entry["layers"] = stats["layers"]
        elif fp16_plan is not None:
            entry.update(bytes_added=fp16_plan.stats()["bytes_added"], fp32_param_share=0.0, layers=None)
        results.append(entry)
        seconds = entry["pass_seconds"]
        timing = "" if seconds is None else f"{seconds * 1e3:9.1f} ms/pass  {entry['tokens_per_s']:10.0f} tok/s  "
        log(f"{name:<14} {label:<34} {timing}pass peak {entry['pass_peak_gib'] * 1024:9.1f} MiB "
            f"({entry['memory_pass_seconds']:.0f} s)")
        if remove is not None:
            remove()
        if plan is not None and plan is not fp16_plan:
            plan.close()
        if arm == "fp16" and fp16_plan is not None:
            fp16_plan.close()
            fp16_plan = None
    _add_ratios(results, args)
    raw = next((e for e in results if e["arm"] == "raw_fp16"), None)
    plan16 = next((e for e in results if e["arm"] == "fp16"), None)
    out = {
        "shape": name,
        "random_init": random_init,
        "n_params": n_params,
        "n_layers": n_layers,
        "vocab": vocab,
        "tied": bool(getattr(policy.config, "tie_word_embeddings", False)),
        "guided_layers": guided,
        "arms": results,
        "fp16_plan_over_raw_fp16": (
            plan16["pass_seconds"] / raw["pass_seconds"] if raw and plan16 and raw["pass_seconds"] else None
        ),
    }
    del policy
    free_memory(device)
    return out


def tf32_noise(device: torch.device, args, log) -> dict | None:
    """b1 vs b8 out-of-band rate on SmolLM2 (real weights) for fp32 / fp32 head / guided, TF32 off and on."""
    if device.type != "cuda":
        return None
    from bloggap_plugin.core.probe import compare
    from bloggap_plugin.measure.attribution import b1_vs_bn
    from bloggap_plugin.measure.rollouts import eval_prompts, rollout_rows
    from bloggap_plugin.models import load_model

    model, tok = load_model("smollm2", dtype="bf16", device=device)
    ids, mask, _ = rollout_rows(model, tok, eval_prompts(), args.tf32_rows, args.tf32_tokens, seed=1234)
    ids, mask = ids.to(device), mask.to(device)
    cells = []
    for label, arm, options in [
        ("bf16", "bf16", {}),
        ("fp32 head", "fp32_head", {}),
        ("guided-8 + head", "guided", {"layers": [0, 1, 2, 3, 4, 8, 9, 29]}),
        ("all fp32", "fp32", {}),
    ]:
        for use_tf32 in (False,) if arm == "bf16" else (False, True):
            if arm != "bf16":
                options = dict(options, tf32=use_tf32)
            plan = make_plan(model, arm, **options)
            b1, b8 = b1_vs_bn(plan, ids, mask, args.tf32_tokens, 8, "mask")
            cell = compare(b1, b8, plan=label, arm=arm, tf32=use_tf32)
            plan.close()
            cells.append(cell)
            log(
                f"smollm2 {label:<18} tf32={use_tf32!s:<5} {100 * cell['oob']:6.2f}% out of band (n={cell['n']})"
            )
    del model
    free_memory(device)
    return {"rows": args.tf32_rows, "new_tokens": args.tf32_tokens, "cells": cells}


def _tile_setting(entry: dict) -> str:
    rows = entry["rows_per_forward"]
    if entry["arm"].startswith("trl"):
        return "TRL's own: 4096 tokens x 32768 vocab columns"
    if not entry["chunk_tokens"]:
        return "untiled (all [rows, K, V] logits)"
    return f"{entry['chunk_tokens']} scored tokens ({rows} rows x {max(1, entry['chunk_tokens'] // rows)} positions)"


def memory_table(results: dict, args, device: torch.device) -> dict:
    """T7c-memory: each arm's old-logprob pass peak against TRL's own pass (target <= 1.25x)."""
    rows = []
    for shape in results["shapes"]:
        for e in shape["arms"]:
            rows.append([
                shape["shape"] + (f" (random init, {shape['n_layers']} layers)" if shape["random_init"] else ""),
                e["arm_letter"],
                e["plan"],
                round(e["pass_peak_gib"] * 1024, 1),
                None if e["pass_peak_vs_trl"] is None else round(e["pass_peak_vs_trl"], 3),
                None if e["pass_peak_vs_trl_cuda_like"] is None else round(e["pass_peak_vs_trl_cuda_like"], 3),
                _tile_setting(e),
            ])
    cuda = device.type == "cuda"
    skipped = [] if cuda or not args.skip_fp16 else [
        "arm F (fp16) not run: fp16 matmuls on this CPU are 30-80x slower than bf16"
    ]
    return {
        "id": "T7c-memory",
        "title": f"Peak memory of one old-logprob pass per arm vs TRL 1.16's own pass ({device.type.upper()})",
        "columns": ["model", "arm", "plan", "pass peak MiB", "x TRL's pass", "x TRL's pass (CUDA memory model)",
                    "tile setting"],
        "rows": rows,
        "notes": (
            f"Measured on {device.type.upper()}"
            + ("" if cuda else " (no GPU): " + MEMORY_METHOD["other"])
            + ("; matmul and attention arithmetic skipped (zeros of the real shape and dtype, SkipMatmulArithmetic: "
               "the same tensors as the real pass, checked equal on tiny models; values meaningless)"
               if args.skip_matmul_arithmetic else "")
            + f". One grad-free pass over {args.batch} rows x {args.seq} random token ids, the last {args.seq // 2} "
            f"scored, all rows in one forward unless the plan says otherwise; peak above what was live before the pass (weights, fp32 shadows "
            f"and heads are resident and not counted). Arm A = TRL 1.16's own pass (add_fused_lm_head, log-probs "
            f"+ entropy), the baseline. Off CUDA TRL projects every position and folds each 4096 x 32768 tile "
            f"with torch ops that make fp32 copies of it; 'CUDA memory model' = the same pass with only the "
            f"labelled positions projected and an allocation-free fold, as TRL runs with Triton on CUDA (the "
            f"stricter baseline). Target: every arm <= 1.25x. D with 2 layers puts every layer in fp32 (as B). "
            f"'N rows per forward' = the plan scoring its rows in chunks of N (a setting the product does not "
            f"have yet: it scores per_device_train_batch_size rows per forward, as TRL). " + "; ".join(skipped)
        ),
        "reference": None,
        "random_init": any(s["random_init"] for s in results["shapes"]),
        "plot": False,
    }  # fmt: skip


def tables(results: dict, args) -> list[dict]:
    rows = []
    for shape in results["shapes"]:
        for e in shape["arms"]:
            rows.append(
                [
                    shape["shape"] + (" (random init)" if shape["random_init"] else ""),
                    e["plan"],
                    round(e["rel_time"], 2),
                    round(e["tokens_per_s"]),
                    None if e["peak_gib"] is None else round(e["peak_gib"], 2),
                    None if e["pass_peak_gib"] is None else round(e["pass_peak_gib"], 3),
                    None if e["pass_peak_vs_trl"] is None else round(e["pass_peak_vs_trl"], 2),
                    "on" if e["tf32"] else "off",
                    None if e["sync_seconds"] is None else round(1e3 * e["sync_seconds"], 2),
                    None
                    if e.get("sync_frac_of_gen_batch_pass") is None
                    else round(100 * e["sync_frac_of_gen_batch_pass"], 2),
                    None if e.get("sync_loop_seconds") is None else round(1e3 * e["sync_loop_seconds"], 2),
                    None if e.get("fp32_param_share") is None else round(100 * e["fp32_param_share"], 2),
                ]
            )
    ratio_notes = []
    for shape in results["shapes"]:
        if shape["fp16_plan_over_raw_fp16"] is not None:
            ratio_notes.append(
                f"{shape['shape']} fp16 plan / raw fp16 = {shape['fp16_plan_over_raw_fp16']:.3f}"
            )
    out = [
        {
            "id": "T7b",
            "title": "Cost of each scoring plan: time relative to bf16 in the same run, peak memory, sync",
            "columns": ["model", "plan", "time vs bf16", "tokens/s", "peak GiB", "pass peak GiB", "pass peak vs TRL", "TF32", "sync ms", "sync % of gen-batch pass", "sync loop ms", "fp32 params %"],
            "rows": rows,
            "notes": (
                f"batch {args.batch} x {args.seq} random token ids, last {args.seq // 2} scored; median of timed passes "
                f"after {args.warmup} warm-up. 'raw fp16' = the fp16 shadow called directly (no plan). sync = in-place "
                f"fused copy from the policy (one torch._foreach_copy_ per dtype group), 'sync loop' = the per-tensor "
                f"copy_ loop it replaced; TF32 = the fp32 plan's gap.tf32 (set around its own forward only). The sync's share is of one scoring pass over a {args.gen_rows}-row generation batch "
                f"(extrapolated linearly). Targets: fp16 plan within 1% of raw fp16, fp32 head <= 1.15x, guided-8 + "
                f"head <= 1.5x, sync <= 1%. 'pass peak' = peak allocated during one pass minus what was allocated "
                f"before it (activations and logits; shadows and fp32 copies are resident, see bytes_added); "
                f"'TRL fused head' = TRL 1.16's own old-logprob pass, the baseline; plans score in tiles of "
                f"{args.score_chunk_tokens} tokens (gap.score_chunk_tokens), 'untiled' = all [rows, K, V] logits "
                f"at once. Target: every plan's pass peak <= 1.25x TRL's. " + "; ".join(ratio_notes)
            ),
            "reference": "T7b",
            "random_init": any(s["random_init"] for s in results["shapes"]),
        }
    ]  # fmt: skip
    noise = results.get("tf32_noise")
    if noise:
        out.append(
            {
                "id": "T7b-tf32",
                "title": "Does TF32 still remove the batch-shape noise? SmolLM2-135M, b1 vs b8 left padded",
                "columns": ["plan", "TF32", "OOB %", "CI low %", "CI high %", "mean |dlogp|", "tokens"],
                "rows": [
                    [c["plan"], "on" if c["tf32"] else "off", round(100 * c["oob"], 2), round(100 * c["ci_low"], 2),
                     round(100 * c["ci_high"], 2), float(f"{c['abs_dlogp_mean']:.3g}"), c["n"]]
                    for c in noise["cells"]
                ],
                "notes": f"{noise['rows']} rollouts x {noise['new_tokens']} sampled tokens, real weights.",
                "reference": None,
                "random_init": False,
            }
        )  # fmt: skip
    return out



def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="output folder (default benchmarks/results/<device>)")
    parser.add_argument("--device", default=None, help="default: cuda if available")
    parser.add_argument("--model", default="smollm2", help="real-weights model added to the shapes (smollm2)")
    parser.add_argument(
        "--shapes", nargs="+", default=None, help="shape names (default 1.5B, 7B, 8B; quick: tiny)"
    )
    parser.add_argument("--batch", type=int, default=None, help="rows per pass (8)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per row (1024; quick 32)")
    parser.add_argument("--passes", type=int, default=5, help="timed passes (fp32 arms: 2 fewer)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed passes before the timed ones (quick: 1 at most)")
    parser.add_argument(
        "--gen-rows", type=int, default=64, help="rows of a GRPO generation batch for the sync share"
    )
    parser.add_argument("--tf32-rows", type=int, default=64)
    parser.add_argument("--tf32-tokens", type=int, default=48)
    parser.add_argument(
        "--score-chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
        help=f"scored tokens per tile of the LM head (gap.score_chunk_tokens; {DEFAULT_CHUNK_TOKENS})",
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few passes (CPU smoke run)")
    parser.add_argument(
        "--memory-only", action="store_true",
        help=f"one pass per arm for its peak memory, no timing; writes {MEMORY_NAME}.json (table T7c-memory)",
    )
    parser.add_argument("--skip-fp16", action="store_true", help="leave out the fp16 plans (arm F)")
    parser.add_argument(
        "--skip-matmul-arithmetic", action="store_true",
        help="with --memory-only off CUDA: matmuls and attention return zeros of their real size instead of "
        "computing (same tensors, so the same memory; for CPUs where bf16 matmuls crawl)",
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="override the number of layers of the random-init shapes"
    )
    args = parser.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers {args.layers}: needs at least 1 layer")
    if args.skip_matmul_arithmetic and not args.memory_only:
        parser.error("--skip-matmul-arithmetic needs --memory-only (the values and timings would be meaningless)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from bloggap_plugin.envinfo import device_tag, environment_record

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and args.skip_matmul_arithmetic:
        parser.error("--skip-matmul-arithmetic is for CPU memory runs; on CUDA the allocator measures the real pass")
    if device.type == "cpu":
        torch.set_num_threads(1)
    if args.quick:
        shapes = args.shapes or ["tiny-llama", "tiny-qwen2-tied"]
        args.batch, args.seq = args.batch or 2, args.seq or 32
        args.passes, args.warmup = min(args.passes, 3), min(args.warmup, 1)
        args.tf32_rows, args.tf32_tokens = 16, 16
    else:
        shapes = args.shapes or [args.model, "qwen2.5-1.5b", "qwen2.5-7b", "llama-8b"]
        args.batch, args.seq = args.batch or 8, args.seq or 1024
    out_dir = Path(args.out or RESULTS / device_tag(device))
    out_dir.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(f"[cost] {msg}", flush=True)

    started = time.time()
    results = {"shapes": [bench_shape(name, device, args, log) for name in shapes]}
    results["tf32_noise"] = None if args.quick or args.memory_only else tf32_noise(device, args, log)
    name = MEMORY_NAME if args.memory_only else NAME
    document = ResultDocument(
        benchmark=name,
        env=environment_record(device),
        params={k: v for k, v in vars(args).items() if k != "out"} | {"shapes": shapes},
        results=results,
        tables=[memory_table(results, args, device)] if args.memory_only else tables(results, args),
    )
    write_and_show(document, out_dir / f"{name}.json", log, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
