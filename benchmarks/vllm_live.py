"""The plugin against a live vLLM (issue 12): sampler-vs-trainer gap per scoring arm, truncated sampling, batch-
invariant mode, and TRL GRPO colocate runs of every arm with the plugin attached. GPU machine only (vLLM 0.26).

One orchestrating command runs everything and writes ``vllm_live.json`` under ``--out`` after every phase, so a time
limit keeps what finished:

    python -m benchmarks.vllm_live all --model /tmp/vx/smollm2 --out $OUT            # ~6-8 min on one H200

Phases (each a subprocess where vLLM's process-wide settings differ; engine starts are serialised by a file lock
because vLLM profiles free GPU memory while it starts):

1. ``gen`` x 4 (vLLM bf16 / fp16, ``VLLM_BATCH_INVARIANT`` 0 / 1) and ``trl`` x 8 (arms A-H) side by side.
   ``gen``: 64 raw prompts (the probe's grid) x 128 forced tokens, temperature 1, ``processed_logprobs``, top-20
   log-probs per token (top-25 for top_k 20, so the rejected tokens' ``-inf`` shows), untruncated and with top_p 0.8,
   top_k 20, min_p 0.05; :func:`bloggap_plugin.vllm_kept_sets.kept_sets_from_processed_logprobs` runs on the real
   ``CompletionOutput`` objects. ``trl``: ``bloggap_plugin.trl.run.run_training`` with ``recipes/arm_X.yaml`` and
   ``use_vllm=True, vllm_mode="colocate"``: the plugin's ``gap/*`` next to TRL's ``sampling/*`` on every step.
2. ``score`` (in process, no vLLM): the trainer's old-logprob pass in each scoring arm (bf16 autocast over fp32 master
   weights as TRL runs it, fp32 head, fp16 shadow, fp32 shadow; plans from :func:`bloggap_plugin.core.precision.make_plan`)
   teacher-forces the sampled tokens, left-padded in chunks of 8 like TRL; the truncation table renormalises over the
   trainer's re-truncated kept set and over vLLM's exact kept set where its top-K log-probs cover it.
3. ``time`` x 4, one at a time: generation time with and without ``VLLM_BATCH_INVARIANT=1`` on SmolLM2 and on a
   random-init ~1B Llama shape (``load_format="dummy"``), plus greedy batch-1 vs batch-64 log-prob identity.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from benchmarks._lib.launch import module_command, repo_env
from benchmarks._lib.logprobs import teacher_forced_batch
from benchmarks._lib.paths import arm_recipe

TRUNCATIONS = {
    "untruncated": {},
    "top_p=0.8": {"top_p": 0.8},
    "top_k=20": {"top_k": 20},
    "min_p=0.05": {"min_p": 0.05},
}
TOPK_RETURNED = {"top_k=20": 25}  # more than the kept set: the rejected entries must come back as -inf
DEFAULT_TOPK = 20
ARMS = "ABCDEFGH"
LOCK = "/tmp/bloggap_vllm_start.lock"
KV_CACHE_BYTES = 2 << 30
"""Fixed KV cache per engine. With it vLLM skips its free-memory profiling, which asserts when another process on the
GPU frees memory while an engine starts (seen on the H200 with several runs side by side)."""


@contextlib.contextmanager
def engine_start_lock():
    """One vLLM engine starts at a time (its memory profiling reads the GPU's free memory)."""
    with open(LOCK, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_json(path: Path, payload: dict) -> None:
    """A work file (per-process JSON), atomically, through the results module's sanitiser (NaN/Infinity -> null)."""
    from bloggap_plugin._io import atomic_write_text
    from bloggap_plugin.results import dumps

    atomic_write_text(path, dumps(payload) + "\n")


# ----------------------------------------------------------------------------------------------------- gen
def gen_sampling_kwargs(new_tokens: int, logprobs: int, seed: int, truncation: dict) -> dict:
    """``SamplingParams`` of one ``gen`` rollout: exactly ``new_tokens`` tokens at temperature 1. The length is
    forced with ``ignore_eos``, not ``min_tokens``: vLLM's min-tokens processor sets the stop tokens' logits to -inf
    before processed log-probs are taken, which renormalised the sampler's log-probs without EOS (T13 until
    2026-12-01, recorded with min_tokens; docs/history/arm_i.md)."""
    return {"temperature": 1.0, "max_tokens": new_tokens, "ignore_eos": True, "logprobs": logprobs, "seed": seed,
            "detokenize": False, **truncation}


def cmd_gen(args) -> None:
    """vLLM rollouts with processed log-probs and top-K entries, saved as tensors for ``score``."""
    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from bloggap_plugin.core.probe import builtin_prompts
    from bloggap_plugin.vllm_kept_sets import kept_sets_from_processed_logprobs

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = builtin_prompts(args.num_prompts)
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    max_k = max([DEFAULT_TOPK, *TOPK_RETURNED.values()])
    t0 = time.perf_counter()
    with engine_start_lock():
        llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=True, gpu_memory_utilization=args.gpu_mem,
                  max_model_len=1024, seed=0, logprobs_mode="processed_logprobs", max_logprobs=max_k,
                  kv_cache_memory_bytes=KV_CACHE_BYTES)
    engine_s = time.perf_counter() - t0
    model_config = getattr(llm.llm_engine, "model_config", None) or llm.llm_engine.vllm_config.model_config
    result: dict = {"dtype": str(model_config.dtype), "batch_invariant": os.environ.get("VLLM_BATCH_INVARIANT", "0"),
                    "engine_start_s": round(engine_s, 2), "sets": {}}
    saved: dict = {"prompt_ids": prompt_ids, "sets": {}}
    for name, truncation in TRUNCATIONS.items():
        k = TOPK_RETURNED.get(name, DEFAULT_TOPK)
        params = [SamplingParams(**gen_sampling_kwargs(args.new_tokens, k, 1000 + i, truncation))
                  for i in range(len(prompt_ids))]
        t0 = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        completions = [o.outputs[0] for o in outputs]
        tokens = torch.tensor([list(c.token_ids) for c in completions], dtype=torch.long)
        sampled = torch.tensor([[d[int(t)].logprob for t, d in zip(c.token_ids, c.logprobs)] for c in completions],
                               dtype=torch.float64)
        top_ids = torch.full((len(completions), tokens.shape[1], k + 1), -1, dtype=torch.long)
        top_lp = torch.full((len(completions), tokens.shape[1], k + 1), float("nan"), dtype=torch.float64)
        for row, c in enumerate(completions):
            for t, entries in enumerate(c.logprobs):
                for j, (tok, lp) in enumerate(entries.items()):
                    top_ids[row, t, j] = int(tok)
                    top_lp[row, t, j] = float(lp.logprob)
        info: dict = {"seconds": round(seconds, 3), "tokens": int(tokens.numel()), "logprobs_k": k,
                      "logprob_type": type(completions[0].logprobs).__name__,
                      "entry_type": type(next(iter(completions[0].logprobs[0].values()))).__name__,
                      "entries_per_token_max": int((top_ids >= 0).sum(-1).max())}
        try:
            kept = kept_sets_from_processed_logprobs(completions)
            sizes = torch.tensor(kept.sizes, dtype=torch.long)
            covered = torch.tensor([[ids is not None for ids in row] for row in kept.ids])
            info["parser"] = {"ok": True, "approximate": kept.approximate, "stats": kept.stats,
                              "size_mean": float(sizes.double().mean()), "size_max": int(sizes.max()),
                              "covered_frac": float(covered.double().mean())}
            saved_sizes, saved_covered = sizes, covered
        except Exception as exc:  # the parser is what is under test: record its failure and go on
            info["parser"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            saved_sizes, saved_covered = None, None
        neg_inf = torch.isneginf(top_lp).sum().item()
        info["neg_inf_entries"] = int(neg_inf)
        result["sets"][name] = info
        saved["sets"][name] = {"tokens": tokens, "sampled": sampled, "top_ids": top_ids, "top_lp": top_lp,
                               "truncation": truncation, "parser_sizes": saved_sizes, "parser_covered": saved_covered}
        print(f"[gen {args.dtype} bi={result['batch_invariant']}] {name}: {seconds:.2f}s {info['parser']}", flush=True)
    torch.save(saved, args.out_pt)
    _write_json(Path(args.out_json), result)


# ----------------------------------------------------------------------------------------------------- trl
def cmd_trl(args) -> None:
    """One TRL GRPO colocate run of ``recipes/arm_{arm}.yaml`` with the plugin; every logged row to JSON."""
    import bloggap_plugin.trl.callback as callback_module
    from bloggap_plugin.trl.run import run_training
    from bloggap_plugin.trl.vllm_colocate import colocate_engine_dtype

    engine = {}
    original_attach = callback_module.GapGRPOTrainer._gap_attach

    def attach(self, *a, **kw):  # record what TRL built, then attach as usual
        engine["dtype"] = str(colocate_engine_dtype(self))
        return original_attach(self, *a, **kw)

    callback_module.GapGRPOTrainer._gap_attach = attach
    original_init = callback_module.GapGRPOTrainer.__init__

    def init(self, *a, **kw):
        with engine_start_lock():
            original_init(self, *a, **kw)

    callback_module.GapGRPOTrainer.__init__ = init
    generate_s: list[float] = []
    if not args.no_vllm:  # harness only: a fixed KV cache for TRL's engine (see KV_CACHE_BYTES)
        from trl.generation import vllm_generation

        trl_generate = vllm_generation.VLLMGeneration.generate

        def timed_generate(self, *a, **kw):  # seconds of each generating step's vLLM call (LLM.generate is blocking)
            start = time.perf_counter()
            try:
                return trl_generate(self, *a, **kw)
            finally:
                generate_s.append(round(time.perf_counter() - start, 4))

        vllm_generation.VLLMGeneration.generate = timed_generate

        trl_llm = vllm_generation.LLM

        def llm_fixed_kv(*a, **kw):
            kw.setdefault("kv_cache_memory_bytes", KV_CACHE_BYTES)
            return trl_llm(*a, **kw)

        vllm_generation.LLM = llm_fixed_kv
    overrides = {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": args.gpu_mem,
                 "vllm_enable_sleep_mode": False} if not args.no_vllm else {}
    overrides.update(json.loads(args.overrides or "{}"))
    gap_overrides = json.loads(args.gap_overrides or "{}")
    log = Path(args.out_json).with_suffix(".jsonl")
    log.unlink(missing_ok=True)
    t0 = time.perf_counter()
    summary = run_training(arm_recipe(args.arm), model=args.model, task="arith",
                           max_steps=args.steps, output_dir=f"/tmp/bloggap_trl_{Path(args.out_json).stem}", seed=0,
                           log_jsonl=log, extra_overrides=overrides, gap_overrides=gap_overrides or None)
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    payload = {"arm": args.arm, "engine_dtype": engine.get("dtype"), "wall_s": round(time.perf_counter() - t0, 2),
               "summary": summary, "rows": rows, "overrides": overrides, "gap_overrides": gap_overrides,
               "generate_s": generate_s}
    _write_json(Path(args.out_json), payload)
    print(f"[trl {args.arm}] engine {engine.get('dtype')} steps {summary.get('steps')}", flush=True)


# ----------------------------------------------------------------------------------------------------- time
def cmd_time(args) -> None:
    """Generation time (64 x 128 tokens, ignore_eos, best of 3 after a warm-up) and greedy batch-1 vs batch-64."""
    import torch
    from vllm import LLM, SamplingParams

    kwargs = dict(enforce_eager=True, gpu_memory_utilization=args.gpu_mem, max_model_len=1024, seed=0,
                  logprobs_mode="processed_logprobs")
    if args.shape == "llama-1b":
        from transformers import LlamaConfig

        folder = Path("/tmp/bloggap_llama1b")
        folder.mkdir(exist_ok=True)
        LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
                    torch_dtype="bfloat16").save_pretrained(folder)
        model, kwargs = str(folder), {**kwargs, "load_format": "dummy", "skip_tokenizer_init": True}
    else:
        model = args.model
    with engine_start_lock():
        llm = LLM(model=model, dtype="bfloat16", **kwargs)
    generator = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(100, 20000, (32,), generator=generator).tolist()} for _ in range(64)]
    params = SamplingParams(temperature=1.0, max_tokens=128, ignore_eos=True, logprobs=0, seed=0, detokenize=False)
    llm.generate(prompts, params, use_tqdm=False)
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=0, detokenize=False)
    batch = llm.generate(prompts, greedy, use_tqdm=False)
    identical, same_tokens, max_diff = 0, 0, 0.0
    for i in range(4):
        alone = llm.generate([prompts[i]], greedy, use_tqdm=False)[0].outputs[0]
        inbatch = batch[i].outputs[0]
        a = [d[t].logprob for t, d in zip(alone.token_ids, alone.logprobs)]
        b = [d[t].logprob for t, d in zip(inbatch.token_ids, inbatch.logprobs)]
        if list(alone.token_ids) == list(inbatch.token_ids):
            same_tokens += 1
            identical += int(a == b)
            max_diff = max(max_diff, max(abs(x - y) for x, y in zip(a, b)))
    payload = {"shape": args.shape, "batch_invariant": os.environ.get("VLLM_BATCH_INVARIANT", "0"),
               "seconds": [round(t, 4) for t in times], "best_s": round(min(times), 4),
               "median_s": round(sorted(times)[1], 4),
               "greedy_b1_vs_b64": {"prompts": 4, "same_tokens": same_tokens, "bit_identical": identical,
                                    "max_abs_dlogp_same_tokens": max_diff}}
    _write_json(Path(args.out_json), payload)
    print(f"[time {args.shape} bi={payload['batch_invariant']}] best {payload['best_s']}s", flush=True)


# ----------------------------------------------------------------------------------------------------- score
SCORERS = [
    # name, plan arm, positions, what it stands for
    ("bf16 (arm A, TRL's forward)", "bf16", "arange"),
    ("bf16, mask positions (arm C)", "bf16", "mask"),
    ("fp32 head (arm E)", "fp32_head", "mask"),
    ("fp16 shadow (arm F)", "fp16", "mask"),
    ("fp32 shadow (arm B)", "fp32", "mask"),
]


def _gap(trainer, sampler, band=0.1) -> dict:
    from bloggap_plugin.core.metrics import abs_dlogp_stats, oob_count

    stats = abs_dlogp_stats(trainer, sampler)
    out, n = oob_count(trainer, sampler, band=band)
    return {"oob_pct": round(100.0 * out / n, 3), "abs_dlogp_mean": stats["mean"], "abs_dlogp_max": stats["max"],
            "tokens": n}


def _score_untruncated(plans: dict, batch: tuple, sampler, label: str, band: float) -> list[dict]:
    """Sampler-vs-trainer rows of one untruncated set: every scorer of ``SCORERS`` on ``batch`` ``(ids, mask,
    width)`` against the sampler's log-probs ``[B, width]``."""
    import torch

    ids, mask, width = batch
    rows = []
    for name, arm, positions in SCORERS:
        with torch.autocast(ids.device.type, dtype=torch.bfloat16):
            logps = plans[arm].token_logprobs(ids, mask, width, batch_size=8, positions=positions)
        row = {"sampler": label, "scorer": name, **_gap(logps.cpu(), sampler, band)}
        rows.append(row)
        print(f"[score] {label} | {name}: {row['oob_pct']}% mean {row['abs_dlogp_mean']:.4f}", flush=True)
    return rows


def _truncation_reducer(data: dict, store: dict):
    """A ``token_logprobs`` reducer for one truncated set that records per tile of scored tokens (index = its rows
    and positions) the full-vocabulary log-probs, the trainer's re-truncated ones and kept mass, where the sampled
    token lies outside the trainer's set, and the log-probs over vLLM's exact kept set where its top-K processed
    log-probs cover it: ``(index, value)`` pairs in ``store``, joined with ``join_tiles``."""
    import torch

    from bloggap_plugin.core.scoring import gather_logprobs
    from bloggap_plugin.core.truncation import kept_mask, log_kept_mass, renormalized_logprobs

    trunc, top_ids, top_lp = data["truncation"], data["top_ids"], data["top_lp"]

    def reduce(logits, targets, index):
        full = gather_logprobs(logits, targets)
        natural = kept_mask(logits, top_k=trunc.get("top_k", 0), top_p=trunc.get("top_p", 1.0),
                            min_p=trunc.get("min_p", 0.0))
        forced = ~natural.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        kept = natural.scatter(-1, targets.unsqueeze(-1), True)
        store["full"].append((index, full.float().cpu()))
        store["retrunc"].append((index, renormalized_logprobs(logits, targets, kept).float().cpu()))
        store["log_mass"].append((index, log_kept_mass(logits, kept).float().cpu()))
        store["forced"].append((index, forced.cpu()))
        # vLLM's exact kept set where its top-K processed log-probs cover it (some returned entry is -inf)
        chunk_ids = top_ids[index].to(logits.device)
        finite = torch.isfinite(top_lp[index]).to(logits.device) & (chunk_ids >= 0)
        # count finite entries per id (padding slots, id -1, add 0), so a padding slot never clears a kept id
        hits = torch.zeros(kept.shape, dtype=torch.int32, device=logits.device)
        hits.scatter_add_(-1, chunk_ids.clamp(min=0), finite.to(torch.int32))
        exact = hits > 0
        store["exact"].append((index, renormalized_logprobs(logits, targets, exact).float().cpu()))
        return full

    return reduce


def _score_truncated(plans: dict, batch: tuple, data: dict, set_name: str, label: str, band: float) -> dict:
    """The truncation entry of one truncated set: ratios before and after the trainer's re-truncation and over
    vLLM's exact set where covered, kept mass, and TRL's sequence-level IS weight before and after."""
    import torch

    from bloggap_plugin.core.scoring import join_tiles
    from bloggap_plugin.trl.mixin import is_ratio

    ids, mask, width = batch
    sampler, covered = data["sampled"], data["parser_covered"]
    store: dict = {"full": [], "retrunc": [], "log_mass": [], "forced": [], "exact": []}
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        plans["bf16"].token_logprobs(ids, mask, width, batch_size=8, positions="mask",
                                     reduce=_truncation_reducer(data, store))
    full = join_tiles(store["full"])
    retrunc = join_tiles(store["retrunc"])
    log_mass = join_tiles(store["log_mass"])
    exact = join_tiles(store["exact"])
    ones = torch.ones_like(full)
    entry = {"sampler": label, "truncation": set_name, "scorer": "bf16 (mask positions)",
             "tokens": int(full.numel()),
             "kept_mass_trainer_mean": float(log_mass.double().exp().mean()),
             "kept_mass_trainer_min": float(log_mass.double().exp().min()),
             "sampled_outside_trainer_set_frac": float(join_tiles(store["forced"]).double().mean()),
             "ratio_mean_before": float((full.double() - sampler).exp().mean()),
             "ratio_mean_after_retruncation": float((retrunc.double() - sampler).exp().mean()),
             "before": _gap(full, sampler, band), "after_retruncation": _gap(retrunc, sampler, band)}
    if covered is not None:
        cov = covered.bool()
        entry["exact_covered_frac"] = float(cov.double().mean())
        if cov.any():
            entry["after_exact_on_covered"] = _gap(exact[cov], sampler[cov], band)
            entry["ratio_mean_after_exact_on_covered"] = float((exact.double() - sampler)[cov].exp().mean())
            entry["before_on_covered"] = _gap(full[cov], sampler[cov], band)
    # TRL's default vllm_importance_sampling_mode="sequence_mask", clip_max 3.0, clip_min None
    for key, old in (("before", full), ("after_retruncation", retrunc)):
        seq = is_ratio(old.double(), sampler, ones.double(), "sequence_mask", None, 3.0).squeeze(-1)
        raw = (old.double() - sampler).sum(-1).exp()
        entry[f"sequence_mask_{key}"] = {
            "masked_frac": float((seq == 0).double().mean()),
            "weight_below_0.5_frac": float((raw < 0.5).double().mean()),
            "ratio_median": float(raw.median()),
        }
    print(f"[trunc] {set_name}: before {entry['before']['oob_pct']}% after {entry['after_retruncation']['oob_pct']}% "
          f"mass {entry['kept_mass_trainer_mean']:.4f}", flush=True)
    return entry


def cmd_score(gen_files: list[Path], model_path: str, band: float = 0.1) -> dict:
    """Score the saved vLLM rollouts of ``gen_files`` with every scoring arm (untruncated sets) and the bf16 pass
    renormalised over kept sets (truncated sets of the default engine); the T13 and T13-trunc records."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bloggap_plugin.core.plans import make_plan

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    plans = {arm: make_plan(model, arm, **({"device": device} if arm in ("fp16", "fp32") else {}))
             for arm in ("bf16", "fp32_head", "fp16", "fp32")}
    table, truncation = [], []
    for path in gen_files:
        saved = torch.load(path, weights_only=True)  # tensors, numbers, text: nothing to unpickle
        meta = json.loads(path.with_suffix(".json").read_text())
        label = f"vLLM {meta['dtype'].replace('torch.', '')}, batch-invariant {meta['batch_invariant']}"
        for set_name, data in saved["sets"].items():
            tokens = data["tokens"]
            ids, mask = teacher_forced_batch(saved["prompt_ids"], tokens, pad_id, device)
            batch = (ids, mask, tokens.shape[1])
            if set_name == "untruncated":
                table += _score_untruncated(plans, batch, data["sampled"], label, band)
            elif meta["batch_invariant"] == "0":  # the truncation table uses the default engine
                truncation.append(_score_truncated(plans, batch, data, set_name, label, band))
    for plan in plans.values():
        plan.close()
    return {"sampler_vs_trainer": table, "truncation": truncation}


# ----------------------------------------------------------------------------------------------------- all
def _cross_check(trl_runs: dict) -> list[dict]:
    """Per arm and step: the plugin's gap/sampler metrics next to TRL's sampling/* on the same step."""
    rows = []
    for arm, run in sorted(trl_runs.items()):
        for record in run.get("rows", []):
            if "gap/sampler/abs_dlogp_mean" not in record or "sampling/sampling_logp_difference/mean" not in record:
                continue
            row = {"arm": arm, "step": record["step"]}
            for ours, theirs in (("gap/sampler/abs_dlogp_mean", "sampling/sampling_logp_difference/mean"),
                                 ("gap/sampler/abs_dlogp_max", "sampling/sampling_logp_difference/max"),
                                 ("gap/sampler/is_ratio_mean", "sampling/importance_sampling_ratio/mean"),
                                 ("gap/sampler/is_ratio_min", "sampling/importance_sampling_ratio/min"),
                                 ("gap/sampler/is_ratio_max", "sampling/importance_sampling_ratio/max")):
                a, b = record.get(ours), record.get(theirs)
                row[ours] = a
                row[theirs] = b
                row[f"diff {ours.split('/')[-1]}"] = None if a is None or b is None else abs(a - b)
            row["gap/sampler/oob_frac"] = record.get("gap/sampler/oob_frac")
            rows.append(row)
    return rows


def _env() -> dict:
    info: dict = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "trl", "vllm", "accelerate"):
        try:
            module = __import__(name)
            info[name] = getattr(module, "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - recorded, not fatal
            info[name] = f"missing ({type(exc).__name__})"
    try:
        import torch

        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    except Exception:  # noqa: BLE001
        pass
    info["VLLM_USE_FLASHINFER_SAMPLER"] = os.environ.get("VLLM_USE_FLASHINFER_SAMPLER")
    info["vllm_settings"] = {"enforce_eager": True, "logprobs_mode": "processed_logprobs", "attention": "vLLM default (FA3 on H200)"}
    return info


def _spawn(argv: list[str], log: Path, env_extra: dict | None = None) -> subprocess.Popen:
    env = repo_env({**os.environ, **(env_extra or {})})
    handle = open(log, "w")
    return subprocess.Popen(module_command("benchmarks.vllm_live", *argv), stdout=handle, stderr=subprocess.STDOUT,
                            env=env)


def _wait(procs: dict, deadline: float) -> dict:
    codes = {}
    for name, proc in procs.items():
        try:
            codes[name] = proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes[name] = "timeout"
    return codes


def _tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def assemble(work: Path, result: dict, arms: str = ARMS, gens: list[str] | None = None) -> dict:
    """Fold the per-process JSON files of ``work`` into ``result`` (TRL runs, cross-check, vLLM generation records,
    timing); a missing file becomes an entry of ``result["errors"]`` with its log's tail."""
    trl_runs = {}
    for arm in arms:
        path = work / f"trl_{arm}.json"
        if path.exists():
            trl_runs[arm] = json.loads(path.read_text())
        elif (work / f"trl_{arm}.log").exists():
            result["errors"][f"trl_{arm}"] = _tail(work / f"trl_{arm}.log")
    result.setdefault("trl_runs", {}).update({arm: {k: v for k, v in run.items() if k != "rows"} for arm, run in trl_runs.items()})
    result.setdefault("trl_rows", {}).update({arm: run.get("rows", []) for arm, run in trl_runs.items()})
    result["cross_check"] = _cross_check({arm: {"rows": rows} for arm, rows in result["trl_rows"].items()})
    result.setdefault("gen", {})
    for path in sorted(work.glob("gen_*.json")):
        result["gen"][path.stem] = json.loads(path.read_text())
    for name in gens or []:
        if name not in result["gen"] and (work / f"{name}.log").exists():
            result["errors"][name] = _tail(work / f"{name}.log")
    timing = {(t["shape"], t["batch_invariant"]): t for t in result.get("batch_invariant_timing", [])}
    for path in sorted(work.glob("time_*.json")):
        t = json.loads(path.read_text())
        timing[(t["shape"], t["batch_invariant"])] = t
    result["batch_invariant_timing"] = [timing[k] for k in sorted(timing)]
    done = {f"trl_{a}" for a in result["trl_runs"]} | set(result["gen"]) | {f"time_{s}_bi{b}" for s, b in timing}
    result["errors"] = {k: v for k, v in result["errors"].items() if k not in done}
    return result


def _r(value, digits=4):
    return None if value is None else round(float(value), digits)


def _t13_table(result: dict) -> dict:
    """T13: the sampler (vLLM) against each scoring arm's old-logprob pass, untruncated."""
    rows = [[r["sampler"], r["scorer"], r["tokens"], _r(r["oob_pct"], 2), _r(r["abs_dlogp_mean"]), _r(r["abs_dlogp_max"])]
            for r in result["sampler_vs_trainer"]]
    return {"id": "T13", "title": "Sampler (vLLM 0.26) vs the trainer's old-logprob pass, per scoring arm",
            "columns": ["vLLM sampler", "trainer pass", "tokens", "OOB %", "mean |dlogp|", "max |dlogp|"], "rows": rows,
            "notes": "SmolLM2-135M-Instruct, 64 raw prompts x 128 forced tokens, T=1, untruncated, vLLM processed "
                     "log-probs (enforce_eager, FA3). Trainer: fp32 master weights; bf16 = autocast as TRL runs it, "
                     "left-padded chunks of 8; arms' plans from make_plan. OOB = exp(trainer - vLLM) outside [0.9, 1.1].",
            "reference": None, "random_init": False}


def _t13_trunc_table(result: dict) -> dict:
    """T13-trunc: truncated sampling, ratio before and after renormalising, and TRL's sequence weight."""
    rows = []
    for t in result["truncation"]:
        before, after = t["sequence_mask_before"], t["sequence_mask_after_retruncation"]
        rows.append([t["sampler"].split(",")[0], t["truncation"], t["tokens"], _r(t["kept_mass_trainer_mean"]),
                     _r(t["ratio_mean_before"]), _r(t["before"]["oob_pct"], 2), _r(t["ratio_mean_after_retruncation"]),
                     _r(t["after_retruncation"]["oob_pct"], 2), _r(100 * t.get("exact_covered_frac", 0.0), 1),
                     _r(t.get("after_exact_on_covered", {}).get("oob_pct"), 2),
                     _r(100 * before["weight_below_0.5_frac"], 1), _r(100 * after["weight_below_0.5_frac"], 1),
                     _r(100 * before["masked_frac"], 1), _r(100 * after["masked_frac"], 1)])
    return {"id": "T13-trunc", "title": "Truncated sampling with vLLM processed log-probs: ratio before / after the "
            "plugin's renormalisation, and TRL's sequence-level IS weight",
            "columns": ["vLLM", "sampling", "tokens", "kept mass", "full vocab: mean ratio", "OOB %",
                        "re-truncated: mean ratio", "OOB %", "exact set covered %", "exact set: OOB %",
                        "seq weight < 0.5: before %", "after %", "seq masked: before %", "after %"],
            "rows": rows,
            "notes": "Same rollouts as T13 (64 x 128 tokens). Trainer = bf16 pass (mask positions). Kept mass = the "
                     "trainer's mass of its re-truncated set (vLLM order, sampled token forced in). 'exact set' = "
                     "vLLM's own kept set where its top-20/25 processed log-probs cover it (an entry is -inf), on "
                     "those positions only. Sequence weight = exp(sum(old - vLLM)) as TRL's default "
                     "vllm_importance_sampling_mode sequence_mask computes it; TRL masks only outside "
                     "[clip_min None, clip_max 3], so truncated sequences are not masked but weighted far below 1 "
                     "(each set's median weight: results.truncation[].sequence_mask_before.ratio_median).",
            "reference": "T11", "random_init": False}


def _t13_trl_table(result: dict) -> dict:
    """T13-trl: TRL GRPO colocate runs of every arm with the plugin."""
    rows = []
    for arm, run in sorted(result["trl_runs"].items()):
        summary = run["summary"]
        rows.append([arm, run["engine_dtype"].replace("torch.", ""), summary["steps"],
                     _r(100 * (summary.get("mean/gap/sampler/oob_frac") or 0.0), 2),
                     _r(summary.get("mean/gap/sampler/abs_dlogp_mean")), _r(summary.get("mean/gap/sampler/is_ratio_min")),
                     _r(summary.get("mean/gap/sampler/is_ratio_mean")), _r(summary.get("mean/gap/sampler/is_ratio_max")),
                     _r(100 * (summary.get("mean/gap/ratio/oob_frac") or 0.0), 2), _r(run["wall_s"], 1)])
    return {"id": "T13-trl", "title": "TRL 1.16 GRPO with use_vllm=True (colocate) and the plugin, every arm",
            "columns": ["arm", "vLLM dtype", "steps", "sampler OOB %", "sampler mean |dlogp|", "IS ratio min",
                        "IS ratio mean", "IS ratio max", "PPO ratio OOB %", "wall s"],
            "rows": rows,
            "notes": "recipes/arm_X.yaml (8 x 32-token completions, num_iterations 2, grad accumulation 2), 8 "
                     "optimizer steps (TRL generated on steps 1, 3, 5, 7), SmolLM2 on the arithmetic task, vLLM colocate (kv cache 2 GiB, "
                     "enforce_eager). Means over the logged steps of gap/sampler/* (old log-probs of the arm vs vLLM) "
                     "and gap/ratio/oob_frac. Runs shared the GPU (wall s is not a timing). Arm H: "
                     "GapGRPOTrainer built vLLM in fp16.",
            "reference": None, "random_init": False}


def _t13_check_table(result: dict) -> dict:
    """T13-check: the plugin's gap/sampler/* against TRL's sampling/* on the same steps."""
    worst: dict = {}
    for row in result["cross_check"]:
        entry = worst.setdefault(row["arm"], [0, 0.0, 0.0, 0.0])
        entry[0] += 1
        entry[1] = max(entry[1], row.get("diff abs_dlogp_mean") or 0.0)
        entry[2] = max(entry[2], row.get("diff abs_dlogp_max") or 0.0)
        entry[3] = max(entry[3], row.get("diff is_ratio_mean") or 0.0)
    return {"id": "T13-check", "title": "Plugin vs TRL on the same step: gap/sampler/* minus TRL's sampling/* (max over steps)",
            "columns": ["arm", "steps", "|d| abs_dlogp_mean", "|d| abs_dlogp_max", "|d| is_ratio_mean"],
            "rows": [[arm, v[0], float(f"{v[1]:.3g}"), float(f"{v[2]:.3g}"), float(f"{v[3]:.3g}")] for arm, v in sorted(worst.items())],
            "notes": "Arms A, H and G use TRL's own old log-probs at generation time, so both sides measure the same "
                     "tokens the same way: differences are float32 rounding (< 1e-6). C's differ by positions only "
                     "(mask vs 0..L-1: < 3e-6); B, D, E, F score old log-probs in another precision, so their "
                     "difference is the arm's effect, not a disagreement.",
            "reference": None, "random_init": False, "plot": False}


def _t13_bi_table(result: dict) -> dict:
    """T13-bi: generation time and greedy batch identity with and without ``VLLM_BATCH_INVARIANT``."""
    rows = []
    base = {t["shape"]: t["best_s"] for t in result.get("batch_invariant_timing", []) if t["batch_invariant"] == "0"}
    for t in result.get("batch_invariant_timing", []):
        g = t["greedy_b1_vs_b64"]
        rows.append([t["shape"], t["batch_invariant"], t["best_s"], t["median_s"],
                     _r(t["best_s"] / base[t["shape"]], 2) if t["shape"] in base else None,
                     f"{g['bit_identical']}/{g['prompts']}", _r(g["max_abs_dlogp_same_tokens"])])
    return {"id": "T13-bi", "title": "VLLM_BATCH_INVARIANT=1: generation time and greedy batch-1 vs batch-64",
            "columns": ["model", "batch-invariant", "best s", "median s", "x default", "greedy b1 = b64 bitwise",
                        "max |dlogp| (same tokens)"],
            "rows": rows,
            "notes": "64 prompts x 128 tokens (ignore_eos), best of 3 after a warm-up, one engine alone on the GPU, "
                     "bf16, enforce_eager. llama-1b = random-init Llama (hidden 2048, 16 layers, vocab 49152, "
                     "load_format dummy): timing only. Greedy: 4 prompts alone vs in the 64-batch, 64 tokens.",
            "reference": None, "random_init": False, "plot": False}


def tables(result: dict) -> list[dict]:
    """The T13 tables of BENCHMARKS.md, derived from the merged results (never typed)."""
    return [_t13_table(result), _t13_trunc_table(result), _t13_trl_table(result), _t13_check_table(result),
            _t13_bi_table(result)]


TRUNC_TRL = {
    "untruncated": ({}, {"kept": "measure"}),
    "top_p=0.8, kept measure": ({"top_p": 0.8}, {"kept": "measure"}),
    "top_p=0.8, kept renormalize": ({"top_p": 0.8}, {"kept": "renormalize"}),
}


def cmd_trunc_trl(args) -> None:
    """Truncated sampling in TRL GRPO with vLLM, live: three arm-A runs side by side (``trunc_*.json`` in ``--work``)."""
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    procs = {}
    for i, (name, (overrides, gap_overrides)) in enumerate(TRUNC_TRL.items()):
        procs[name] = _spawn(["trl", "--arm", "A", "--model", args.model, "--steps", str(args.steps),
                              "--out-json", str(work / f"trunc_{i}.json"), "--overrides", json.dumps(overrides),
                              "--gap-overrides", json.dumps(gap_overrides)], work / f"trunc_{i}.log")
    print(_wait(procs, time.time() + 300))


MASK_TRL = {
    "sampling_mask": ({"top_k": 50, "top_p": 0.8, "min_p": 0.1}, {"kept": "renormalize", "kept_source": "sampling_mask"}),
    "retruncate": ({"top_k": 50, "top_p": 0.8, "min_p": 0.1}, {"kept": "renormalize", "kept_source": "retruncate"}),
    "untruncated": ({"top_k": 0, "top_p": 1.0, "min_p": 0.0}, {"kept": "measure"}),
}
"""Issue 49 item 2: arm A in TRL colocate at top_p 0.8, top_k 50, min_p 0.1, renormalised over vLLM's sampling mask
(vLLM >= 0.28) vs over the trainer's re-truncated sets, and untruncated (the anchor)."""


def cmd_mask_trl(args) -> None:
    """The :data:`MASK_TRL` runs one at a time (``mask_<name>.json`` in ``--work``: every logged row and each
    generating step's vLLM seconds, ``generate_s``), then their table (``mask_trl.json``)."""
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    for name, (overrides, gap_overrides) in MASK_TRL.items():
        proc = _spawn(["trl", "--arm", "A", "--model", args.model, "--steps", str(args.steps),
                       "--out-json", str(work / f"mask_{name}.json"), "--overrides", json.dumps(overrides),
                       "--gap-overrides", json.dumps(gap_overrides)], work / f"mask_{name}.log")
        print(name, _wait({name: proc}, time.time() + args.run_s), flush=True)
    table = mask_trl_table(work)
    if table is not None:
        _write_json(work / "mask_trl.json", {"env": _env(), "tables": [table]})


def mask_trl_table(work: Path) -> dict | None:
    """Means over generating steps of each :data:`MASK_TRL` run found in ``work``."""
    rows = []
    for name in MASK_TRL:
        path = work / f"mask_{name}.json"
        if not path.exists():
            continue
        payload = json.loads(path.read_text())
        logged = [r for r in payload["rows"] if "sampling/importance_sampling_ratio/mean" in r]

        def mean(key, logged=logged):
            values = [r[key] for r in logged if isinstance(r.get(key), (int, float))]
            return _r(sum(values) / len(values)) if values else None

        seconds = payload.get("generate_s") or []
        rows.append([name, len(logged), mean("gap/kept/source"), mean("gap/sampler/is_ratio_mean"),
                     mean("gap/sampler/oob_frac"), mean("gap/kept/mass_mean"), mean("gap/kept/ratio_after_mean"),
                     mean("gap/kept/oob_after"), _r(sum(seconds[1:]) / len(seconds[1:])) if len(seconds) > 1 else None])
    if not rows:
        return None
    return {"id": "T13-mask", "title": "vLLM's sampling mask vs re-truncation in TRL GRPO colocate, arm A, top_p 0.8 / "
            "top_k 50 / min_p 0.1",
            "columns": ["kept sets", "generations", "gap/kept/source", "sequence IS weight mean", "sampler OOB",
                        "kept mass", "ratio after", "OOB after", "vLLM generate s (after the first)"],
            "rows": rows,
            "notes": "benchmarks/vllm_live.py mask-trl: recipes/arm_A.yaml, gap.kept renormalize over vLLM's "
                     "return_sampling_mask ids (gap.kept_source sampling_mask) or the trainer's re-truncated sets "
                     "(retruncate); untruncated = top_k 0, top_p 1, min_p 0 (kept measure). Means over generating "
                     "steps; vLLM seconds = TRL's VLLMGeneration.generate per generating step, the first (warm-up) "
                     "left out.",
            "reference": None, "random_init": False, "plot": False}


def trunc_trl_table(work: Path) -> dict | None:
    rows, found = [], False
    for i, name in enumerate(TRUNC_TRL):
        path = work / f"trunc_{i}.json"
        if not path.exists():
            continue
        found = True
        logged = [r for r in json.loads(path.read_text())["rows"] if "sampling/importance_sampling_ratio/mean" in r]
        def mean(key, logged=logged):
            values = [r[key] for r in logged if isinstance(r.get(key), (int, float))]
            return _r(sum(values) / len(values)) if values else None

        rows.append([name, len(logged), mean("sampling/importance_sampling_ratio/mean"),
                     mean("sampling/importance_sampling_ratio/min"), mean("gap/sampler/is_ratio_mean"),
                     mean("gap/sampler/is_ratio_min"), mean("gap/kept/mass_mean"), mean("gap/kept/ratio_before_mean"),
                     mean("gap/kept/ratio_after_mean"), mean("gap/sampler/oob_frac"), mean("reward")])
    if not found:
        return None
    return {"id": "T13-trl-trunc", "title": "Truncated sampling in TRL GRPO with vLLM (colocate), arm A: TRL's IS weight "
            "before and after the plugin's kept-set renormalisation",
            "columns": ["sampling / gap.kept", "generations", "TRL IS ratio mean", "TRL IS ratio min",
                        "IS ratio applied: mean", "min", "kept mass", "ratio before", "ratio after", "sampler OOB",
                        "reward"],
            "rows": rows,
            "notes": "recipes/arm_A.yaml with use_vllm colocate (vLLM bf16), 8 optimizer steps (TRL generated on 4), "
                     "TRL's default vllm_importance_sampling_mode sequence_mask (clip_max 3). 'TRL IS ratio' = TRL's "
                     "sampling/importance_sampling_ratio/* (computed with its full-vocabulary old log-probs); 'IS ratio "
                     "applied' = gap/sampler/is_ratio_* (the ratio in the loss after the plugin). Kept mass = the "
                     "trainer's mass of its re-truncated set; ratio before / after = mean per-token exp(old - vLLM) over the "
                     "full vocabulary / renormalised. Means over generation steps.",
            "reference": None, "random_init": False, "plot": False}


def _machine_paths_to_names(obj):
    """Absolute paths of the machines that ran (``/tmp/...``, ``/root/...``) become their last component: the
    committed result names what ran, not where a temporary file lay (work folders are archived in vllm_live_parts/)."""
    if isinstance(obj, str) and obj.startswith(("/tmp/", "/root/", "/work/", "/home/")):
        return Path(obj).name
    if isinstance(obj, dict):
        return {k: _machine_paths_to_names(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_machine_paths_to_names(v) for v in obj]
    return obj


def cmd_merge(args) -> None:
    """Combine runs made in several GPU calls: work folders (per-process JSON) and ``score`` outputs."""
    result: dict = {"table": "T13", "errors": {}, "sampler_vs_trainer": [], "truncation": [], "sources": []}
    if args.all:  # a whole ``all`` run's document is the base; work folders and score files then add to it
        whole = json.loads(Path(args.all).read_text())
        result.update({k: v for k, v in whole.items() if k not in ("table", "sources")})
        result["sources"].append(str(args.all))
    for work in args.work:
        assemble(Path(work), result)
        result["sources"].append(str(work))
    rows: dict = {(row["sampler"], row["scorer"]): row for row in result["sampler_vs_trainer"]}
    trunc: dict = {(row["sampler"], row["truncation"]): row for row in result["truncation"]}
    for path in args.score:
        score = json.loads(Path(path).read_text())
        for row in score.get("sampler_vs_trainer", []):
            rows[(row["sampler"], row["scorer"])] = row
        for row in score.get("truncation", []):
            trunc[(row["sampler"], row["truncation"])] = row
        for key in ("env", "settings", "commands"):
            if key in score:
                result[key] = score[key]
        result["sources"].append(str(path))
    result["sampler_vs_trainer"] = [rows[k] for k in sorted(rows)]
    result["truncation"] = [trunc[k] for k in sorted(trunc)]
    extra = []
    for work in args.trunc_trl:
        table = trunc_trl_table(Path(work))
        if table is not None:
            extra.append(table)
            result["trunc_trl_rows"] = {f"trunc_{i}": json.loads((Path(work) / f"trunc_{i}.json").read_text())["rows"]
                                        for i in range(len(TRUNC_TRL)) if (Path(work) / f"trunc_{i}.json").exists()}
    from bloggap_plugin.results import ResultDocument

    document = {"benchmark": "vllm_live", "env": result.pop("env", {}), "params": result.pop("settings", {}),
                "results": result, "tables": tables(result) + extra}
    ResultDocument(**_machine_paths_to_names(document)).write(Path(args.out))
    print(f"merged -> {args.out}: {len(result['trl_runs'])} TRL runs, {len(rows)} gap rows, {len(trunc)} truncation rows, "
          f"errors {sorted(result['errors'])}")


def cmd_all(args) -> None:
    out = Path(args.out)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    result_path = out / "vllm_live.json"
    result: dict = {"table": "T13", "env": _env(), "settings": {"num_prompts": args.num_prompts,
                    "new_tokens": args.new_tokens, "band": 0.1, "trl_steps": args.steps, "model": "SmolLM2-135M-Instruct"},
                    "commands": "python -m benchmarks.vllm_live all --model MODEL_DIR --out DIR", "errors": {}}
    _write_json(result_path, result)
    t_start = time.time()
    procs: dict[str, subprocess.Popen] = {}
    gens = []
    for spec in args.gens.split(","):
        dtype, bi = spec.split(":")
        if True:
            name = f"gen_{dtype}_bi{bi}"
            gens.append(name)
            procs[name] = _spawn(["gen", "--model", args.model, "--dtype", dtype, "--out-pt", str(work / f"{name}.pt"),
                                  "--out-json", str(work / f"{name}.json"), "--num-prompts", str(args.num_prompts),
                                  "--new-tokens", str(args.new_tokens)], work / f"{name}.log",
                                 {"VLLM_BATCH_INVARIANT": bi})
    arms = [a for a in args.arms]
    waves = [arms[:4], arms[4:]]
    trl_codes: dict = {}
    for wave in waves:
        wave_procs = {}
        for arm in wave:
            wave_procs[f"trl_{arm}"] = _spawn(["trl", "--arm", arm, "--model", args.model, "--steps", str(args.steps),
                                               "--out-json", str(work / f"trl_{arm}.json")], work / f"trl_{arm}.log")
        trl_codes.update(_wait(wave_procs, t_start + args.phase1_s))
    codes = {**_wait(procs, t_start + args.phase1_s), **trl_codes}
    result["phase1_s"] = round(time.time() - t_start, 1)
    result["exit_codes"] = codes
    assemble(work, result, "".join(arms), gens)
    _write_json(result_path, result)
    # phase 2: scoring
    try:
        files = [work / f"{g}.pt" for g in gens if (work / f"{g}.pt").exists()]
        result.update(cmd_score(files, args.model))
    except Exception:  # noqa: BLE001 - keep what finished
        result["errors"]["score"] = traceback.format_exc()[-4000:]
    _write_json(result_path, result)
    # phase 3: timing, one process at a time
    result["batch_invariant_timing"] = []
    for shape in ("smollm2", "llama-1b") if not args.skip_time else ():
        for bi in ("0", "1"):
            if time.time() - t_start > args.total_s:
                result["errors"][f"time_{shape}_bi{bi}"] = "skipped: out of time"
                continue
            name = f"time_{shape}_bi{bi}"
            proc = _spawn(["time", "--shape", shape, "--model", args.model, "--out-json", str(work / f"{name}.json"),
                           "--gpu-mem", "0.3"], work / f"{name}.log", {"VLLM_BATCH_INVARIANT": bi})
            _wait({name: proc}, time.time() + 110)
            path = work / f"{name}.json"
            if path.exists():
                result["batch_invariant_timing"].append(json.loads(path.read_text()))
            else:
                result["errors"][name] = _tail(work / f"{name}.log")
            _write_json(result_path, result)
    result["total_s"] = round(time.time() - t_start, 1)
    _write_json(result_path, result)
    for row in result.get("cross_check", []):
        print("cross-check", row["arm"], row["step"], row.get("diff abs_dlogp_mean"), row.get("diff is_ratio_mean"))
    print("errors:", {k: v[-300:] for k, v in result["errors"].items()})
    print(f"done in {result['total_s']} s -> {result_path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("all")
    p.add_argument("--model", required=True, help="HF folder of SmolLM2-135M-Instruct (vLLM and TRL load it by path)")
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/bloggap_vllm_live")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=8, help="TRL optimizer steps per arm (arm recipes generate every 4)")
    p.add_argument("--arms", default=ARMS)
    p.add_argument("--gens", default="bfloat16:0,bfloat16:1,float16:0,float16:1", help="vLLM dtype:batch_invariant list")
    p.add_argument("--skip-time", action="store_true")
    p.add_argument("--phase1-s", type=float, default=300.0)
    p.add_argument("--total-s", type=float, default=460.0)
    p = sub.add_parser("gen")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--out-pt", required=True)
    p.add_argument("--out-json", required=True)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--gpu-mem", type=float, default=0.07)
    p = sub.add_parser("trl")
    p.add_argument("--arm", required=True, choices=list(ARMS))
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out-json", required=True)
    p.add_argument("--gpu-mem", type=float, default=0.07)
    p.add_argument("--overrides", default=None, help="JSON of extra GRPOConfig fields")
    p.add_argument("--no-vllm", action="store_true", help="HF generate instead (a CPU dry run of the plumbing)")
    p.add_argument("--gap-overrides", default=None, help="JSON of gap: fields replacing the recipe's (e.g. kept)")
    p = sub.add_parser("trunc-trl", help="TRL colocate, arm A, top_p 0.8: kept measure vs renormalize vs untruncated")
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--work", default="/tmp/bloggap_trunc_trl")
    p = sub.add_parser("mask-trl", help="TRL colocate, arm A, top_p 0.8 / top_k 50 / min_p 0.1: renormalised over "
                                        "vLLM's sampling mask vs re-truncation vs untruncated (vLLM >= 0.28)")
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--work", default="/tmp/bloggap_mask_trl")
    p.add_argument("--run-s", type=float, default=180.0, help="limit per run (seconds)")
    p = sub.add_parser("time")
    p.add_argument("--shape", choices=["smollm2", "llama-1b"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out-json", required=True)
    p.add_argument("--gpu-mem", type=float, default=0.3)
    p = sub.add_parser("score", help="re-score the gen_*.pt files of a work folder (no vLLM needed)")
    p.add_argument("--work", default="/tmp/bloggap_vllm_live")
    p.add_argument("--model", required=True)
    p.add_argument("--out-json", required=True)
    p = sub.add_parser("merge", help="combine work folders and score outputs of several GPU calls into one JSON")
    p.add_argument("--all", default=None, help="the vllm_live.json of one whole 'all' run (the base of the merge)")
    p.add_argument("--work", nargs="*", default=[])
    p.add_argument("--score", nargs="*", default=[])
    p.add_argument("--trunc-trl", nargs="*", default=[], help="work folders of trunc-trl runs")
    p.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    {"all": cmd_all, "gen": cmd_gen, "trl": cmd_trl, "time": cmd_time, "merge": cmd_merge, "trunc-trl": cmd_trunc_trl,
     "mask-trl": cmd_mask_trl,
     "score": lambda a: _write_json(Path(a.out_json), {"env": _env(), **cmd_score(sorted(Path(a.work).glob("gen_*.pt")), a.model)})}[args.cmd](args)


if __name__ == "__main__":
    main()
