"""The precision ladder (reference table T7), the measurement behind ``bloggap ladder``: how much of the
batch-shape noise each scoring plan removes, and what share of the parameters it runs in fp32.

Rollouts are sampled from the model itself (bf16 by default) on the evaluation prompts; the guided layer
choices come from an attribution profile measured on *calibration* rollouts from disjoint prompts. Every rung
is a :func:`bloggap_plugin.core.plans.make_plan` plan scoring the same tokens alone (batch 1, unpadded)
and in left-padded chunks of 8; the share of those tokens whose ratio leaves ``[1 - band, 1 + band]`` is the
rung's out-of-band rate. Rungs: bf16, fp32 head, first-k / last-k / guided top-k / guided window-k (each with
fp32 norm and head), fp16, fp16 + guided top-k, all fp32.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from bloggap_plugin.core.divergence import divergence_profile
from bloggap_plugin.core.errors import UsageError
from bloggap_plugin.core.model_parts import decoder_layers
from bloggap_plugin.core.plans import make_plan
from bloggap_plugin.core.probe import compare, skipped_cell
from bloggap_plugin.measure import rollouts
from bloggap_plugin.measure.attribution import b1_vs_bn

__all__ = ["run_ladder", "ladder_table", "default_ks"]


def _rung_specs(
    n_layers: int, ks: Sequence[int], guided: dict, window: dict, fp16_guided_k: int | None
) -> list[dict]:
    specs = [{"name": "bf16", "arm": "bf16"}, {"name": "fp32 head", "arm": "fp32_head", "layers": []}]
    for k in ks:
        specs += [
            {"name": f"first-{k} + head", "arm": "guided", "k": k, "layers": list(range(k))},
            {
                "name": f"last-{k} + head",
                "arm": "guided",
                "k": k,
                "layers": list(range(n_layers - k, n_layers)),
            },
            {"name": f"guided-{k} + head", "arm": "guided", "k": k, "layers": guided[k]},
            {"name": f"window-{k} + head", "arm": "guided", "k": k, "layers": window[k]},
        ]
    specs.append({"name": "fp16", "arm": "fp16", "fp16": True})
    if fp16_guided_k is not None:
        specs.append(
            {
                "name": f"fp16 + guided-{fp16_guided_k} + head",
                "arm": "guided",
                "k": fp16_guided_k,
                "layers": guided[fp16_guided_k],
                "fp16": True,
                "base": "fp16",
            }
        )
    specs.append({"name": "all fp32", "arm": "fp32"})
    return specs


def _check_ks(ks: Sequence[int], n_layers: int) -> list[int]:
    """The sorted distinct layer counts; ``UsageError`` naming any outside 1..n_layers."""
    bad = [k for k in ks if not 1 <= int(k) <= n_layers]
    if bad or not ks:
        raise UsageError(f"--k {' '.join(map(str, bad or ks))} out of range: this model has {n_layers} decoder "
                         f"layers; give layer counts in 1..{n_layers}")
    return sorted({int(k) for k in ks})


def _score_rung(model, spec: dict, ids, mask, new_tokens, batch_size, positions, band, fp16_base, labels,
                started: float) -> dict:
    """One rung's cell: its plan scores the rows at batch 1 and batch ``batch_size``; fp32 share and the
    seconds since ``started`` (``time.perf_counter()``)."""
    if spec.get("base") == "fp16":
        plan = make_plan(fp16_base.shadow, "guided", layers=spec["layers"])
    elif spec["arm"] == "guided":
        plan = make_plan(model, "guided", layers=spec["layers"])
    else:
        plan = make_plan(model, spec["arm"])
    b1, bn = b1_vs_bn(plan, ids, mask, new_tokens, batch_size, positions)
    cell = compare(b1, bn, band=band, **labels)
    stats = plan.stats()
    cell.update(
        fp32_param_share=stats["fp32_param_share"],
        bytes_added=stats["bytes_added"],
        fp16_fallbacks=stats["fp16_fallbacks"],
        seconds=time.perf_counter() - started,
    )
    plan.close()
    return cell


def run_ladder(
    model, tokenizer, *, rows: int = 128, calibration_rows: int = 32, new_tokens: int = 48,
    ks: Sequence[int] = (4, 8, 12), batch_size: int = 8, positions: str = "mask", band: float = 0.1,
    fp16: bool = True, seed: int = 1234, calibration_seed: int = 4321, progress: Callable[[str], object] | None = None,
) -> dict:
    """Run the ladder on ``model`` (the policy, usually bf16). JSON-ready dict with one entry per rung."""
    say = progress or (lambda _msg: None)
    n_layers = len(decoder_layers(model))
    ks = _check_ks(ks, n_layers)
    device = next(model.parameters()).device
    evaluation, calibration = rollouts.eval_prompts(), rollouts.calibration_prompts()
    if set(evaluation) & set(calibration):
        raise RuntimeError("calibration and evaluation prompts overlap")

    say(f"calibration: {calibration_rows} rollouts x {new_tokens} tokens from {len(calibration)} prompts")
    cal_ids, cal_mask, _ = rollouts.rollout_rows(
        model, tokenizer, calibration, calibration_rows, new_tokens, calibration_seed
    )
    profile = divergence_profile(model, cal_ids.to(device), cal_mask.to(device), batch_size=batch_size,
                                 logits_to_keep=new_tokens, positions=positions)
    guided = {k: sorted(profile.top_k(k)) for k in ks}
    window = {k: profile.best_window(k) for k in ks}

    say(f"evaluation: {rows} rollouts x {new_tokens} tokens from {len(evaluation)} prompts")
    ids, mask, _ = rollouts.rollout_rows(model, tokenizer, evaluation, rows, new_tokens, seed)
    ids, mask = ids.to(device), mask.to(device)

    fp16_guided_k = 8 if 8 in ks else ks[len(ks) // 2]
    rungs = []
    fp16_base = None
    scored: dict[tuple, dict] = {}  # (arm, layers, base) -> its cell: rungs naming one plan (first-k = window-k) score once
    for spec in _rung_specs(n_layers, ks, guided, window, fp16_guided_k):
        labels = {key: spec.get(key) for key in ("name", "arm", "k", "layers")}
        labels["base_dtype"] = spec.get("base", str(next(model.parameters()).dtype).removeprefix("torch."))
        if spec.get("fp16") and not fp16:
            rungs.append(skipped_cell("fp16 disabled (no fast fp16 kernels on this CPU; run on a GPU)", **labels))
            say(f"{spec['name']:<28} skipped")
            continue
        plan_key = (spec["arm"], tuple(spec.get("layers") or ()), spec.get("base"))
        if plan_key in scored:
            rungs.append({**scored[plan_key], **labels})
            say(f"{spec['name']:<28} the plan of {scored[plan_key]['name']}")
            continue
        started = time.perf_counter()
        if spec.get("base") == "fp16" and fp16_base is None:
            fp16_base = make_plan(model, "fp16")
        cell = _score_rung(model, spec, ids, mask, new_tokens, batch_size, positions, band, fp16_base, labels,
                           started)
        scored[plan_key] = cell
        rungs.append(cell)
        say(f"{spec['name']:<28} {100 * cell['oob']:6.2f}% out of band   fp32 share {100 * cell['fp32_param_share']:5.1f}%")
    if fp16_base is not None:
        fp16_base.close()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "rungs": rungs,
        "attribution": profile.to_dict(k=fp16_guided_k),
        "guided_layers": {str(k): guided[k] for k in ks},
        "window_layers": {str(k): window[k] for k in ks},
        "ks": list(ks),
        "n_layers": n_layers,
        "rows": rows,
        "calibration_rows": calibration_rows,
        "new_tokens": new_tokens,
        "tokens": int(rows * new_tokens),
        "batch_size": batch_size,
        "positions": positions,
        "band": band,
        "seed": seed,
        "calibration_seed": calibration_seed,
        "calibration_disjoint": True,
        "all_fp32_oob": rungs[-1].get("oob"),
        "device_type": device.type,
    }


def ladder_table(result: dict, table_id: str = "T7", random_init: bool = False) -> dict:
    """The report TABLE for a ladder result (percent with 2 decimals)."""
    rows = []
    skipped = []
    for cell in result["rungs"]:
        layers = cell.get("layers")
        layer_text = "-" if not layers else ",".join(str(i) for i in layers)
        if cell.get("oob") is None:
            rows.append([cell["name"], layer_text, "-", "-", "-", "-", "-", "-", 0])
            skipped.append(f"{cell['name']}: {cell.get('skipped', 'skipped')}")
            continue
        rows.append(
            [
                cell["name"],
                layer_text,
                round(100 * cell["fp32_param_share"], 2),
                round(100 * cell["oob"], 2),
                round(100 * cell["ci_low"], 2),
                round(100 * cell["ci_high"], 2),
                float(f"{cell['abs_dlogp_mean']:.3g}"),
                cell["fp16_fallbacks"],
                cell["n"],
            ]
        )
    notes = (
        f"{result['rows']} rollouts x {result['new_tokens']} sampled tokens (evaluation prompts); guided/window "
        f"layers chosen on {result['calibration_rows']} calibration rollouts from disjoint prompts "
        f"(top-k / best window of per-layer divergence increments). Band +-{result['band']}, positions "
        f"'{result['positions']}'. fp32 params % counts a tied head twice (embedding + projection)."
    )
    if skipped:
        notes += " Skipped: " + "; ".join(skipped) + "."
    return {
        "id": table_id,
        "title": "Precision ladder: b1 vs b8 (left padded) out-of-band rate per scoring plan",
        "columns": [
            "plan",
            "fp32 layers",
            "fp32 params %",
            "OOB %",
            "CI low %",
            "CI high %",
            "mean |dlogp|",
            "fp16 fallbacks",
            "tokens",
        ],
        "rows": rows,
        "notes": notes,
        "reference": "T7",
        "random_init": random_init,
    }


def default_ks(model, gpu: bool) -> list[int]:
    """The default layer counts (4 8 12 on GPU, 8 on CPU), capped at the model's decoder layers."""
    n_layers = len(decoder_layers(model))
    return sorted({min(k, n_layers) for k in ((4, 8, 12) if gpu else (8,))})
