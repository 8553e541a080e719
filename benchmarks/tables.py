"""Reference tables T1-T6 on this device with the project's own probe, plus the position-ids effect and
this device vs the reference study's cards.

    python -m benchmarks.tables --out benchmarks/results/h200            # GPU, <= 3 min on an H200
    python -m benchmarks.tables --out /tmp/tables --quick --device cpu   # CPU smoke run, < 60 s

Writes ``<out>/tables.json`` (``{"benchmark": "tables", "schema_version": 1, "env", "params", "results",
"tables"}``) and prints the tables. Every scoring goes through ``bloggap_plugin.core.probe`` (which goes
through ``bloggap_plugin.core.scoring.token_logprobs``); every statistic through ``core.metrics``.

Tables (reference study ids in brackets):
- T1 [T1]   dtype x batch on EOS-terminated rollouts (left padding, both position modes);
- T2 [T2]   padding vs batch size vs membership (ragged padded, equal length, one row x8, two groupings);
- T3 [T3]   batch, explicit 4-D mask, packing with a block-diagonal mask (padded vs packed-1 sanity check);
- T4 [T4]   eager / sdpa / flex_attention over three rollout seeds, Wilson intervals, per-seed rates;
- T5 [T5]   PPO clip flips b1 vs b8 against the generator's own log-probs, advantages from a real reward
            over groups of 8 samples of one prompt, and synthetic advantages on the same tokens;
- T6 [T6]   clip flips vs advantage distribution (gaussian, binary +-1, sparse 90% zero), the reference's protocol;
- POS       TRL's positions 0..L-1 vs positions from the mask, per dtype, trainer vs trainer and sampler vs trainer;
- HW [T1b]  this device's T1 row beside the reference cards (RTX 4090, L40, V100; different models).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks._lib.paths import ROOT
from bloggap_plugin.core.metrics import (
    clip_flip_fraction,
    clip_status,
    clipped_fraction,
    wilson_interval,
)
from bloggap_plugin.core.probe import (
    Rollouts,
    build_rows,
    compare,
    pp,
    probe_model,
    score_layout,
    score_packed,
)
from bloggap_plugin.envinfo import environment_record
from bloggap_plugin.measure.rollouts import sample_rollouts
from bloggap_plugin.models import load_model
from bloggap_plugin.results import ResultDocument, format_text_table

# read when the Hugging Face libraries are first imported (lazily, by load_model) and used
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

NAME = "tables"
T4_SEEDS = (1234, 20260916, 7)
T5_PROMPTS = (
    ("Explain in two sentences why the ocean is salty.", "salt"),
    ("List three facts about photosynthesis.", "light"),
    ("Write one sentence about gravity.", "force"),
    ("Give a short definition of the printing press.", "gutenberg"),
    ("Name one consequence of antibiotics overuse.", "resist"),
    ("Describe briefly how monsoons form.", "wind"),
    ("In one sentence, compare the transistor and the vacuum tube.", "switch"),
    ("State the main idea of vaccination.", "immun"),
)
CLIP_EPS = 0.2


@dataclass
class Sizes:
    """Workload sizes: ``full`` follows the reference protocol, ``quick`` is a CPU smoke run."""

    main_rows: int  # T1 (EOS), T2, POS rollouts
    main_tokens: int
    t3_rows: int
    t3_tokens: int
    t4_rows: int
    t4_tokens: int
    t5_prompts: int
    t5_group: int
    t5_tokens: int
    gen_batch: int
    fp16_rows: int  # rows scored in fp16 (all on GPU; few on CPU, where fp16 has no fast kernels)
    chat_template: bool | None = None  # None: the tokenizer's template if it has one; quick: plain text

    @classmethod
    def make(cls, quick: bool, on_cpu: bool) -> Sizes:
        if quick:
            return cls(8, 8, 8, 8, 8, 8, 1, 8, 8, 8, 8 if not on_cpu else 2, chat_template=False)
        return cls(64, 64, 32, 48, 32, 48, 8, 8, 64, 16, 64 if not on_cpu else 8)


def template_text(sizes: Sizes) -> str:
    return "plain text, --quick" if sizes.chat_template is False else "chat template"


def table(table_id, title, columns, rows, notes, reference, random_init=False) -> dict:
    return {"id": table_id, "title": title, "columns": columns, "rows": rows, "notes": notes,
            "reference": reference, "random_init": random_init}


class Models:
    """One loaded model per dtype (re-used across tables); attention switched in place."""

    def __init__(self, spec: str, device: torch.device):
        self.spec, self.device, self.loaded = spec, device, {}
        self.label = "SmolLM2-135M" if spec == "smollm2" else spec
        self.random_init = spec.startswith("tiny-random-")

    def get(self, dtype: str, attn: str | None = None):
        if dtype not in self.loaded:
            self.loaded[dtype] = load_model(self.spec, dtype=dtype, device=self.device)
        model, tokenizer = self.loaded[dtype]
        model.set_attn_implementation(attn or "sdpa")
        return model, tokenizer


def log(message: str) -> None:
    print(f"[tables {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def cell_pct(cell: dict) -> float | None:
    return pp(cell.get("oob"))


def ci_text(cell: dict) -> str:
    return f"[{100 * cell['ci_low']:.2f}, {100 * cell['ci_high']:.2f}]"


# ---------------------------------------------------------------- T1 and HW


def run_t1(models: Models, rollouts: Rollouts, sizes: Sizes) -> tuple[dict, dict]:
    cells = {}
    for dtype in ("bf16", "fp16", "fp32"):
        model, _ = models.get(dtype)
        use = rollouts if dtype != "fp16" else rollouts.subset(min(sizes.fp16_rows, len(rollouts.rows)))
        names = ["b1_vs_b8_left_arange", "b1_vs_b8_left_mask"]
        if dtype == "bf16":
            names += ["rerun_b1", "b1_vs_b32_left_arange", "b1_vs_b32_left_mask"]
        found, _ = probe_model(model, use, names)
        for c in found:
            cells[f"{dtype}|{c['comparison']}"] = dict(c, dtype=dtype, attn="sdpa")
        log(f"T1 {dtype} done")
    tokens = rollouts.tokens
    rows = []
    for positions, label in (("arange", "positions 0..L-1 (TRL, reference)"), ("mask", "positions from mask")):
        rows.append([
            f"{models.label} ({tokens:,}), {label}",
            cell_pct(cells[f"bf16|b1_vs_b8_left_{positions}"]),
            cell_pct(cells[f"fp16|b1_vs_b8_left_{positions}"]),
            cell_pct(cells[f"fp32|b1_vs_b8_left_{positions}"]),
            cell_pct(cells["bf16|rerun_b1"]),
            cell_pct(cells[f"bf16|b1_vs_b32_left_{positions}"]),
        ])
    fp16_n = cells["fp16|b1_vs_b8_left_arange"]["n"]
    notes = (
        f"{len(rollouts.rows)} prompts (8 stems x 8 topics, {template_text(sizes)}), one bf16 rollout each (<= "
        f"{rollouts.sampler['max_new_tokens']} new tokens, EOS allowed: {tokens} completion tokens), sampled in "
        f"generate batches of {rollouts.sampler['batch_size']}. Each dtype re-loads the model; default attention "
        "(sdpa); left-padded ragged batches (prompts left, completions right). OOB% = share of completion tokens "
        "with exp(logp_bN - logp_b1) outside [0.9, 1.1]."
        + (f" fp16 on {fp16_n} tokens only (first {sizes.fp16_rows} rows: no fast fp16 kernels on CPU)."
           if fp16_n != tokens else "")
    )
    return (
        table("T1", "dtype x batch, no inference engine: OOB%",
              ["model (tokens)", "bf16 b1v8", "fp16 b1v8", "fp32 b1v8", "bf16 rerun", "bf16 b1v32"], rows, notes,
              "T1"),
        cells,
    )


def reference_tables() -> dict:
    path = ROOT / "bloggap_plugin" / "data" / "reference_study.json"
    data = json.loads(path.read_text())
    return {t["id"]: t for t in data["tables"]}


def run_hw(t1_cells: dict, tokens: int, env: dict, label: str) -> dict:
    reference = reference_tables()
    device = env.get("gpu") or f"CPU ({env.get('cpu')})"
    ours = [
        device, f"{label} ({tokens:,})", cell_pct(t1_cells["bf16|b1_vs_b8_left_arange"]),
        cell_pct(t1_cells["fp16|b1_vs_b8_left_arange"]), cell_pct(t1_cells["fp32|b1_vs_b8_left_arange"]),
        cell_pct(t1_cells["bf16|rerun_b1"]), "this run (T1)",
    ]
    rows = [ours]
    t1 = reference.get("T1", {"rows": []})
    for row in t1["rows"]:
        if any(name in str(row[0]) for name in ("pythia-410m", "Qwen2.5-0.5B", "Qwen2.5-1.5B")):
            rows.append(["RTX 4090", row[0], row[1], row[2], row[3], row[4], "reference T1"])
    t1b = reference.get("T1b")
    if t1b is not None:
        columns = [str(c) for c in t1b["columns"]]
        for row in t1b["rows"]:
            for card in ("L40", "V100"):
                index = next((i for i, c in enumerate(columns) if c.strip() == card), None)
                if index is not None:
                    rows.append([card, row[0], row[index], None, None, None, "reference T1b (bf16 b1v8 only)"])
    notes = (
        "Not a paired comparison: the reference cards scored pythia and Qwen2.5 models on their own rollouts; this "
        f"device scored {label} on its own rollouts, so "
        "levels can be compared, not differences. Reference cards: RTX 4090 and L40 (Ada, cc 8.9), V100 (Volta, "
        f"cc 7.0, no bf16 tensor cores). This device: {device}"
        + (f", cc {env.get('compute_capability')}, {env.get('sm_count')} SMs" if env.get("gpu") else "")
        + f", torch {env.get('torch')}, transformers {env.get('transformers')}. Empty cells: not in the reference table."
    )
    return table("HW", "This device vs the reference cards: T1 OOB% (bf16/fp16/fp32 b1 vs b8, rerun)",
                 ["device", "model (tokens)", "bf16 b1v8", "fp16 b1v8", "fp32 b1v8", "bf16 rerun", "source"],
                 rows, notes, "T1b")


# ---------------------------------------------------------------- T2


def run_t2(models: Models, rollouts: Rollouts) -> tuple[dict, dict]:
    model, _ = models.get("bf16")
    found, _ = probe_model(
        model, rollouts, ["b1_vs_b8_left_arange", "b1_vs_b8_equal_nopad", "copy8_vs_alone", "two_groupings_b8"]
    )
    cells = {c["comparison"]: c for c in found}
    equal = build_rows(rollouts.rows, "equal_length")
    pad = rollouts.pad_token_id
    equal_b1 = score_layout(model, equal, "left", 1, "mask", pad)
    equal_b32 = score_layout(model, equal, "left", 32, "mask", pad)
    cells["b1_vs_b32_equal_nopad"] = compare(equal_b1.logprobs, equal_b32.logprobs, equal_b1.mask,
                                             comparison="b1_vs_b32_equal_nopad")
    copy = cells["copy8_vs_alone"]
    rows = [[
        models.label,
        cell_pct(cells["b1_vs_b8_left_arange"]),
        cell_pct(cells["b1_vs_b8_equal_nopad"]),
        cell_pct(cells["b1_vs_b32_equal_nopad"]),
        f"{100 * copy['oob']:.2f} ({copy['oob_count']}/{copy['n']})",
        cell_pct(cells["two_groupings_b8"]),
    ]]
    prompt_len = len(equal[0].prompt)
    notes = (
        f"bf16, sdpa, {len(rollouts.rows)} prompts x {rollouts.sampler['max_new_tokens']} forced tokens (EOS "
        f"disabled). A: original rows left-padded, b1 vs b8, positions 0..L-1 (n = {cells['b1_vs_b8_left_arange']['n']}). "
        f"B: equal-length rows (prompts cut to their last {prompt_len} tokens), no padding, b1 vs b8; B32: b1 vs b32. "
        f"C: the first row copied 8 times in one batch vs alone (one sequence, n = {copy['n']}; all copies identical "
        f"to each other: {copy.get('copies_identical')}). D: equal-length rows in batches of 8, natural order vs a "
        "random.Random(7) shuffle (membership changes; 0 expected for a dense model)."
    )
    return (
        table("T2", "Padding vs batch size vs batch membership: OOB% (bf16)",
              ["model", "A ragged padded b1v8", "B equal length b1v8", "B32 equal length b1v32",
               "C one row x8 vs alone", "D two groupings of 8"], rows, notes, "T2"),
        cells,
    )


# ---------------------------------------------------------------- T3


def run_t3(models: Models, rollouts: Rollouts, sizes: Sizes) -> tuple[dict, dict]:
    rows_in = [r for r in rollouts.rows[: sizes.t3_rows]]
    rows_in = [type(r)(r.prompt, r.completion[: sizes.t3_tokens]) for r in rows_in]
    equal = build_rows(rows_in, "equal_length")
    cells, table_rows = {}, []
    sanity = {}
    for dtype in ("bf16", "fp32"):
        model, _ = models.get(dtype)
        padded_1 = score_layout(model, equal, "left", 1, "mask", rollouts.pad_token_id)
        padded_8 = score_layout(model, equal, "left", 8, "mask", rollouts.pad_token_id)
        packed_1 = score_packed(model, equal, 1)
        packed_8 = score_packed(model, equal, 8)
        mask = padded_1.mask
        cells[f"{dtype}|batch"] = compare(padded_1.logprobs, padded_8.logprobs, mask, comparison="batch")
        cells[f"{dtype}|mask"] = compare(padded_1.logprobs, packed_1.logprobs, mask, comparison="mask")
        cells[f"{dtype}|pack"] = compare(packed_1.logprobs, packed_8.logprobs, mask, comparison="pack")
        sanity[dtype] = float((padded_1.logprobs - packed_1.logprobs)[mask].abs().max().item())
        log(f"T3 {dtype} done")
    for change in ("batch", "mask", "pack"):
        table_rows.append([
            models.label, change, cell_pct(cells[f"bf16|{change}"]), cell_pct(cells[f"fp32|{change}"]),
            f"{cells[f'bf16|{change}']['abs_dlogp_max']:.2e}", f"{cells[f'fp32|{change}']['abs_dlogp_max']:.2e}",
        ])
    sanity_ok = sanity["fp32"] < 1e-6
    n = cells["bf16|batch"]["n"]
    notes = (
        f"{len(equal)} prompts x {len(equal[0].completion)} tokens, equal length (n = {n} per cell). batch: [1, L] vs "
        "[8, L], implicit causal mask. mask: batch 1 with the implicit mask vs an explicit additive 4-D float mask "
        "(0 allowed, finfo(dtype).min elsewhere) with the same causal pattern. pack: one sequence per row vs eight "
        "concatenated in one row, both with an explicit block-diagonal causal 4-D mask and position ids restarting "
        f"at 0. Sanity check, padded-1 vs packed-1 in fp32: max |dlogp| = {sanity['fp32']:.2e} "
        f"({'passes' if sanity_ok else 'FAILS'} the < 1e-6 check; bf16: {sanity['bf16']:.2e})."
    )
    return (
        table("T3", "Three ways to change the kernel path, bf16 vs fp32: OOB% and max |dlogp|",
              ["model", "change", "bf16 OOB%", "fp32 OOB%", "bf16 max |dlogp|", "fp32 max |dlogp|"],
              table_rows, notes, "T3"),
        {"cells": cells, "sanity_max_abs_dlogp": sanity, "sanity_ok": sanity_ok},
    )


# ---------------------------------------------------------------- T4 and T6


def run_t4(models: Models, seeded: dict[int, Rollouts], skip_flex: str | None = None) -> tuple[dict, dict]:
    results, table_rows = {}, []
    for attn in ("eager", "sdpa", "flex_attention"):
        if attn == "flex_attention" and skip_flex:
            results[attn] = {"skipped": skip_flex}
            table_rows.append([models.label, attn, None, "skipped", skip_flex])
            continue
        try:
            model, _ = models.get("bf16", attn)
            per_seed = {}
            for seed, rollouts in seeded.items():
                found, _ = probe_model(model, rollouts, ["b1_vs_b8_equal_nopad"])
                per_seed[seed] = found[0]
        except Exception as err:  # noqa: BLE001 - flex_attention may be unavailable: record and go on
            reason = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
            results[attn] = {"skipped": reason}
            table_rows.append([models.label, attn, None, "skipped", reason[:80]])
            log(f"T4 {attn} skipped: {reason}")
            continue
        out = sum(c["oob_count"] for c in per_seed.values())
        n = sum(c["n"] for c in per_seed.values())
        low, high = wilson_interval(out, n)
        results[attn] = {"out": out, "n": n, "rate": out / n, "ci": [low, high],
                         "per_seed": {str(s): {"out": c["oob_count"], "n": c["n"], "rate": c["oob"]}
                                      for s, c in per_seed.items()}}
        table_rows.append([
            models.label, attn, round(100 * out / n, 2), f"[{100 * low:.2f}, {100 * high:.2f}]",
            ", ".join(f"{100 * c['oob']:.2f}" for c in per_seed.values()),
        ])
        log(f"T4 {attn} done")
    models.get("bf16", "sdpa")
    first = next(iter(seeded.values()))
    notes = (
        f"Rollout seeds {', '.join(str(s) for s in seeded)}; per seed {len(first.rows)} prompts x "
        f"{first.sampler['max_new_tokens']} forced tokens sampled by the bf16 model (sdpa); rows made equal length, no "
        "padding; scoring model bf16 with the named attention implementation, b1 vs b8. Wilson 95% CI on the pooled "
        "count; per-seed rates in seed order."
    )
    return (
        table("T4", "Attention implementation and repeatability: OOB% (bf16, b1 vs b8)",
              ["model", "impl", "OOB%", "95% CI", "per seed"], table_rows, notes, "T4"),
        results,
    )


def group_normalise(values: list[float], group: int) -> torch.Tensor:
    """Per-group (consecutive ``group`` rows) ``(x - mean) / population sd`` (sd 0 -> 1): the reference's rule."""
    out = []
    for start in range(0, len(values), group):
        chunk = values[start : start + group]
        mean = statistics.fmean(chunk)
        sd = statistics.pstdev(chunk) or 1.0
        out += [(v - mean) / sd for v in chunk]
    return torch.tensor(out, dtype=torch.float64)


def synthetic_advantages(rows: int, group: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The reference's draws from one ``random.Random(seed)``, in order: gaussian, binary +-1, sparse 90% zero."""
    rng = random.Random(seed)
    gaussian = [rng.gauss(0, 1) for _ in range(rows)]
    binary = [rng.choice((-1.0, 1.0)) for _ in range(rows)]
    sparse = [0.0 if rng.random() < 0.9 else rng.gauss(0, 1) for _ in range(rows)]
    return {name: group_normalise(v, group) for name, v in
            (("gaussian", gaussian), ("binary +-1", binary), ("sparse (90% zero)", sparse))}


def flip_stats(logp_b1, logp_b8, rollout, mask, advantages) -> dict:
    """Clip statistics (TRL's rule, eps 0.2) for ratios against the generator's log-probs."""
    r1 = torch.exp(logp_b1.double() - rollout.double())
    r8 = torch.exp(logp_b8.double() - rollout.double())
    flips_frac = clip_flip_fraction(r1, r8, advantages, mask, CLIP_EPS)
    n = int(mask.sum().item())
    flips = round(flips_frac * n)
    low, high = wilson_interval(flips, n)
    adv = advantages.unsqueeze(-1).expand_as(r1)
    both = mask & ~clip_status(r1, advantages, CLIP_EPS) & ~clip_status(r8, advantages, CLIP_EPS) & (adv != 0)
    rel = ((r8 - r1).abs() / r1)[both]
    rel_sorted = torch.sort(rel).values
    return {
        "n": n, "flips": flips, "flip_rate": flips_frac, "ci": [low, high],
        "clipped_b1": clipped_fraction(r1, advantages, mask, CLIP_EPS),
        "clipped_b8": clipped_fraction(r8, advantages, mask, CLIP_EPS),
        "rel_coef_change_median": float(rel_sorted[len(rel_sorted) // 2]) if len(rel_sorted) else None,
        "rel_coef_change_p95": float(rel_sorted[min(int(0.95 * len(rel_sorted)), len(rel_sorted) - 1)])
        if len(rel_sorted) else None,
        "zero_advantage_share": float((adv == 0)[mask].double().mean()),
    }


def keyword_reward(text: str, keyword: str, reply_tokens: int) -> float:
    """1 if the reply (up to the first end-of-turn) mentions ``keyword``, minus 0.01 per reply token."""
    return float(keyword in text.lower()) - 0.01 * reply_tokens


def run_t5(models: Models, sizes: Sizes, seed: int) -> tuple[dict, dict]:
    model, tokenizer = models.get("bf16")
    prompts = [p for p, _ in T5_PROMPTS[: sizes.t5_prompts] for _ in range(sizes.t5_group)]
    rollouts = sample_rollouts(model, tokenizer, num_seqs=len(prompts), max_new_tokens=sizes.t5_tokens,
                               seed=seed, prompts=prompts, batch_size=sizes.t5_group,
                               chat_template=sizes.chat_template)
    pad = rollouts.pad_token_id
    b1 = score_layout(model, rollouts.rows, "left", 1, "mask", pad)
    b8 = score_layout(model, rollouts.rows, "left", sizes.t5_group, "mask", pad)
    eos = tokenizer.eos_token_id
    rewards = []
    for row, prompt in zip(rollouts.rows, prompts):
        reply = list(row.completion)
        reply = reply[: reply.index(eos)] if eos in reply else reply
        keyword = dict(T5_PROMPTS)[prompt]
        rewards.append(keyword_reward(tokenizer.decode(reply), keyword, len(reply)))
    advantages = {"real reward (keyword - 0.01/token)": group_normalise(rewards, sizes.t5_group)}
    advantages.update(synthetic_advantages(len(rewards), sizes.t5_group))
    stats = {name: flip_stats(b1.logprobs, b8.logprobs, rollouts.sampler_logprobs, b1.mask, adv)
             for name, adv in advantages.items()}
    zero_sd_groups = sum(
        1 for s in range(0, len(rewards), sizes.t5_group) if statistics.pstdev(rewards[s : s + sizes.t5_group]) == 0
    )
    rows = [[
        models.label, name, round(100 * s["clipped_b1"], 2), round(100 * s["clipped_b8"], 2),
        round(100 * s["flip_rate"], 2), s["flips"], s["n"],
        f"{s['rel_coef_change_median']:.4f} / {s['rel_coef_change_p95']:.3f}" if s["rel_coef_change_median"] is not None
        else "-",
    ] for name, s in stats.items()]
    notes = (
        f"{sizes.t5_prompts} fixed prompts ({template_text(sizes)}) x G = {sizes.t5_group} samples, each group generated in one "
        f"batch of {sizes.t5_group} identical prompts (no padding), {sizes.t5_tokens} forced tokens; rollout log-prob "
        "= log_softmax of generate's raw logits for the emitted token (full vocabulary; no top-k/top-p; the "
        "reference's generation-config warpers are absent). Ratios "
        "r1 = exp(logp_b1 - rollout), r8 = exp(logp_b8 - rollout), bf16 sdpa; batch 8 = one prompt's group. TRL's "
        "clip rule with eps 0.2; flip = clipped under one batch shape only. Real reward: 1 if the reply (up to the "
        f"first end-of-turn) names the topic keyword, minus 0.01 per reply token; {zero_sd_groups} of "
        f"{len(rewards) // sizes.t5_group} groups had zero reward spread. Advantages group-normalised (population sd). "
        "Synthetic rows use the same tokens. Last column: relative coefficient change |r8 - r1| / r1, median / p95, "
        "over tokens that contribute under both."
    )
    return (
        table("T5", "Does it reach the gradient: PPO clip-status flips, b1 vs b8 (bf16)",
              ["model", "advantages", "clipped b1 %", "clipped b8 %", "flips %", "flips", "n",
               "rel. coef change median / p95"], rows, notes, "T5"),
        {"stats": stats, "rewards": rewards, "zero_sd_groups": zero_sd_groups, "sampler": rollouts.sampler},
    )


def run_t6(models: Models, rollouts: Rollouts) -> tuple[dict, dict]:
    model, _ = models.get("bf16")
    pad = rollouts.pad_token_id
    equal = build_rows(rollouts.rows, "equal_length")
    b1 = score_layout(model, equal, "left", 1, "mask", pad)
    b8 = score_layout(model, equal, "left", 8, "mask", pad)
    width = b1.logprobs.shape[1]
    sampler = rollouts.sampler_logprobs[:, :width]
    stats = {name: flip_stats(b1.logprobs, b8.logprobs, sampler, b1.mask, adv)
             for name, adv in synthetic_advantages(len(equal), 8).items()}
    rows = [[models.label, name, round(100 * s["flip_rate"], 2),
             f"[{100 * s['ci'][0]:.2f}, {100 * s['ci'][1]:.2f}]", s["flips"], s["n"]] for name, s in stats.items()]
    notes = (
        f"Rollout seed {rollouts.sampler['seed']} (T4's), {len(equal)} prompts x {width} tokens, equal length, no "
        "padding, bf16 sdpa, b1 vs b8, rollout log-prob from generate's scores. Groups = 8 consecutive rows (8 "
        "different prompts: a synthetic grouping). One random.Random(0) draws gaussian, then binary +-1, then sparse "
        "(0 with probability 0.9, else N(0,1)); group-normalised; clip eps 0.2; Wilson 95% CI."
    )
    return (
        table("T6", "Clip-flip rate vs advantage distribution (bf16, b1 vs b8)",
              ["model", "advantage", "flips %", "95% CI", "flips", "n"], rows, notes, "T6"),
        stats,
    )


# ---------------------------------------------------------------- positions


def run_pos(models: Models, rollouts: Rollouts, sizes: Sizes, batch_sizes=(8, 32)) -> tuple[dict, dict]:
    results, rows = {}, []
    pad = rollouts.pad_token_id
    for dtype in ("bf16", "fp16", "fp32"):
        model, _ = models.get(dtype)
        use = rollouts if dtype != "fp16" else rollouts.subset(min(sizes.fp16_rows, len(rollouts.rows)))
        b1 = score_layout(model, use.rows, "left", 1, "mask", pad)
        sampler = use.sampler_logprobs
        cells = {"sampler_vs_b1": compare(sampler, b1.logprobs, b1.mask)}
        for size in batch_sizes:
            for positions in ("arange", "mask"):
                scored = score_layout(model, use.rows, "left", size, positions, pad)
                cells[f"b1_vs_b{size}_{positions}"] = compare(b1.logprobs, scored.logprobs, b1.mask)
                if size == 8:
                    cells[f"sampler_vs_b8_{positions}"] = compare(sampler, scored.logprobs, b1.mask)
        results[dtype] = cells
        rows.append([
            dtype, cells["b1_vs_b8_arange"]["n"],
            *(cell_pct(cells[k]) if k in cells else None for k in ("b1_vs_b8_arange", "b1_vs_b8_mask", "b1_vs_b32_arange", "b1_vs_b32_mask",
                                           "sampler_vs_b8_arange", "sampler_vs_b8_mask", "sampler_vs_b1")),
        ])
        log(f"POS {dtype} done")
    notes = (
        f"{len(rollouts.rows)} prompts x {rollouts.sampler['max_new_tokens']} forced tokens sampled by the bf16 model "
        f"(sdpa) in generate batches of {rollouts.sampler['batch_size']} (left-padded; generate takes positions from "
        "the mask). Scoring model in the row's dtype, sdpa, left padding. 0..L-1: no position ids (what TRL's scoring "
        "pass does for left-padded rows); mask: cumsum(mask) - 1 (what generate does). Sampler columns: ratio "
        "exp(teacher-forced - generate's own log-prob) on the same tokens; the sampler is always bf16."
        + (f" fp16 on the first {sizes.fp16_rows} rows only." if sizes.fp16_rows < len(rollouts.rows) else "")
    )
    return (
        table("POS", "Position ids: TRL's 0..L-1 vs positions from the mask, OOB% (new)",
              ["scorer dtype", "n", "b1v8 0..L-1", "b1v8 mask", "b1v32 0..L-1", "b1v32 mask",
               "sampler vs b8 0..L-1", "sampler vs b8 mask", "sampler vs b1"], rows, notes, None),
        results,
    )


# ---------------------------------------------------------------- main


def print_table(t: dict) -> None:
    print()
    print(format_text_table(t))


TABLE_ORDER = ("T1", "T2", "T3", "T4", "T5", "T6", "POS", "HW")


class TablesRun:
    """The tables made so far and their raw results, written to ``path`` after every table (a time limit that
    kills the run still leaves the finished tables); ``started`` is a ``time.perf_counter()``."""

    def __init__(self, path: Path, models: Models, env: dict, params: dict, started: float) -> None:
        self.path, self.models, self.env, self.params, self.started = path, models, env, params, started
        self.results: dict = {}
        self.tables: list[dict] = []

    def save(self, final: bool = False) -> None:
        """Write what exists so far; ``final``: every requested table is done."""
        self.tables.sort(key=lambda t: TABLE_ORDER.index(t["id"]))
        for t in self.tables:
            if t.get("random_init") != self.models.random_init:
                t["random_init"] = self.models.random_init
                if self.models.random_init:
                    t["notes"] += " RANDOM-INIT model: rates are not meaningful (near-uniform logits)."
        ResultDocument(
            benchmark=NAME,
            env=self.env,
            params={**self.params, "complete": final},
            results=self.results,
            tables=self.tables,
            extra={"seconds": round(time.perf_counter() - self.started, 1)},
        ).write(self.path)

    def timed(self, name: str, fn, *a):
        """``fn(*a)``, its wall seconds recorded under ``results["seconds"][name]``."""
        t0 = time.perf_counter()
        out = fn(*a)
        self.results.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 2)
        return out

    def add(self, table_id: str, produced: tuple[dict, object]) -> None:
        """Keep a ``(table, raw results)`` pair and write the document."""
        table_, raw = produced
        self.tables.append(table_)
        self.results[table_id] = raw
        self.save()


def make_tables(run: TablesRun, sizes: Sizes, args, only: set[str], on_cpu: bool) -> None:
    """Sample the rollouts the requested tables need and make each table, in an order that shares rollouts."""
    models = run.models
    sampler, tokenizer = models.get("bf16")
    main_rollouts = eos_rollouts = seeded = None
    if only & {"T1", "HW"}:
        eos_rollouts = run.timed("sample_t1", sample_rollouts, sampler, tokenizer, sizes.main_rows, sizes.main_tokens,
                                 args.seed, None, sizes.gen_batch, sizes.chat_template, None, True)
        log(f"T1 rollouts: {eos_rollouts.tokens} tokens")
        t1, t1_cells = run.timed("T1", run_t1, models, eos_rollouts, sizes)
        run.add("T1", (t1, {"tokens": eos_rollouts.tokens, "cells": t1_cells, "sampler": eos_rollouts.sampler}))
        if "HW" in only:
            run.tables.append(run_hw(t1_cells, eos_rollouts.tokens, run.env, models.label))
            run.save()
    if only & {"T2", "T3", "POS"}:
        main_rollouts = run.timed("sample_main", sample_rollouts, sampler, tokenizer, sizes.main_rows,
                                  sizes.main_tokens, args.seed, None, sizes.gen_batch, sizes.chat_template)
        log(f"main rollouts: {main_rollouts.tokens} tokens")
    if "T2" in only:
        run.add("T2", run.timed("T2", run_t2, models, main_rollouts))
    if "T3" in only:
        run.add("T3", run.timed("T3", run_t3, models, main_rollouts, sizes))
    if "T5" in only:
        run.add("T5", run.timed("T5", run_t5, models, sizes, args.seed))
    if "POS" in only:
        run.add("POS", run.timed("POS", run_pos, models, main_rollouts, sizes, (8,) if args.quick else (8, 32)))
    if only & {"T4", "T6"}:
        seeded = {
            seed: sample_rollouts(sampler, tokenizer, sizes.t4_rows, sizes.t4_tokens, seed, None, sizes.gen_batch,
                                  sizes.chat_template)
            for seed in T4_SEEDS
        }
        log("T4 rollouts sampled")
    if "T6" in only:
        run.add("T6", run.timed("T6", run_t6, models, seeded[T4_SEEDS[0]]))
    if "T4" in only:  # last: flex_attention compiles (slow the first time) and may be unavailable
        skip_flex = "--quick on CPU (flex_attention compiles for ~45 s)" if args.quick and on_cpu else None
        run.add("T4", run.timed("T4", run_t4, models, seeded, skip_flex))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output folder; writes <out>/tables.json")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--seed", type=int, default=1234, help="main rollout seed (reference: 1234)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a CPU smoke run in < 60 s")
    parser.add_argument("--only", default=None, help="comma list of table ids to run (T1,T2,T3,T4,T5,T6,POS,HW)")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_cpu = device.type == "cpu"
    if on_cpu:
        torch.set_num_threads(1)
    sizes = Sizes.make(args.quick, on_cpu)
    only = set(args.only.split(",")) if args.only else set(TABLE_ORDER)
    started = time.perf_counter()
    models = Models(args.model, device)
    models.get("bf16")
    log(f"model {args.model} on {device}; sizes {sizes}")
    env = environment_record(device, model=args.model, seed=args.seed)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{NAME}.json"
    params = {"model": args.model, "device": str(device), "seed": args.seed, "quick": args.quick,
              "sizes": sizes.__dict__, "t4_seeds": list(T4_SEEDS), "clip_eps": CLIP_EPS, "band": 0.1,
              "tables": sorted(only)}
    run = TablesRun(path, models, env, params, started)
    make_tables(run, sizes, args, only, on_cpu)
    run.save(final=True)
    elapsed = time.perf_counter() - started
    for t in run.tables:
        print_table(t)
    print(f"\nwrote {path} ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
