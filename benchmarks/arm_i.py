"""Arm I on the H200 (issue 16 item 4): how close the trainer's old-logprob pass comes to vLLM's own log-probs,
piece by piece, and what each piece costs against arm A's pass. ONE device call (vLLM 0.26, about 4-6 minutes):

    . .dev/vllm/t/env.sh && python -m benchmarks.arm_i all --model /tmp/vx/smollm2 --out $OUT

Phases, each a subprocess; ``$OUT/arm_i.json`` (a results document, table ``T16-armI``) is rewritten after every
scored row, so a time limit keeps what finished (``$OUT/arm_i_work/`` holds the logs and the rollouts):

1. ``colocated``: ``VLLM_BATCH_INVARIANT=1`` and ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the engine runs in this
   process as under TRL's colocate mode and vLLM's batch-invariant mode is process-wide (recorded). vLLM (bf16,
   ``enforce_eager``, ``processed_logprobs``) samples ``--prompts`` x ``--tokens`` forced tokens at temperature 1,
   untruncated; then the trainer, in the same process, scores those completions: arm A (TRL's pass: fp32 master
   weights under bf16 autocast, positions 0..L-1, chunks of 8 rows), the bf16 shadow's own HF forward with sdpa and
   with vLLM's FlashAttention registered through transformers' ``AttentionInterface``, and arm I after each piece
   of :data:`STEPS` (cumulative). Per row: share of tokens with ``exp(trainer - sampler)`` outside [0.9, 1.1], mean/max |dlogp|,
   share of bit-identical log-probs, and the pass's time (median of 3 after a warm-up) relative to arm A's; for
   every scorer also its own batch invariance (the first 8 rows scored one at a time vs together, bit-identical
   share; on 2026-12-01 only ``all`` had it: 0.195%).
   Diagnostics: the engine's bf16 weights and RoPE cache against the trainer's (where the engine's model can be
   reached), and HF's RoPE matmul under vLLM's process-wide ``bmm`` override (also in phase ``scoped``, without
   the override: on 2026-12-01 HF's cos was 0.23 from vLLM's cache in ``colocated``, not measured in ``scoped``).
2. ``scoped``: the same completions (``gen.pt``) in a fresh process without an engine: vLLM's batch-invariant
   overrides now exist only inside arm I's forward (the ``batch_invariant`` piece's own effect). The variable stays
   1 there so that vLLM's C++ kernels pick their batch-invariant launch settings as the sampler's did; nothing
   enables the mode itself without an engine (recorded as ``process_batch_invariant``).

``--smoke --out DIR`` (the ``smoke`` command; CPU, no vLLM, seconds): a tiny random Llama, the fp32 scores as the "sampler", the same steps; the
pieces that need vLLM's kernels are recorded as refused with the plugin's message (tests/benchmarks/test_arm_i_bench.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks._lib.launch import module_command, repo_env, run_logged
from benchmarks._lib.logprobs import logprob_gap, median_time, teacher_forced_batch

STEPS = [
    # (label, gap.i_pieces): each step adds one piece to the one before
    ("I0 bf16 weights, packed tokens, HF maths", "hf"),
    ("I1 + vLLM RoPE cache and rounding (torch)", "hf,rope=torch"),
    ("I2 + vLLM RMSNorm maths (torch)", "hf,rope=torch,norm=torch"),
    ("I3 + fused qkv / gate_up projections", "torch"),
    ("I4 + batch-invariant kernels (Triton matmul, aten overrides)", "torch,batch_invariant=true"),
    ("I5 + vLLM FlashAttention, paged KV, num_splits=1", "torch,batch_invariant=true,attention=vllm_fa"),
    # I6-I8 launch each norm once over all scored tokens (norm_launch=packed), as vLLM 0.26's kernels do not: their
    # block size depends on the launch's token count. I9 sizes the launches like vLLM's steps: arm I's default since
    # the 2026-12-01 H200 run (arm_i.json), which labelled I8 "(= all)" and I9 "all,norm_launch=steps".
    ("I6 + vLLM RMSNorm kernels", "torch,batch_invariant=true,attention=vllm_fa,norm=kernel,norm_launch=packed"),
    ("I7 + vLLM RoPE kernel",
     "torch,batch_invariant=true,attention=vllm_fa,norm=kernel,rope=kernel,norm_launch=packed"),
    ("I8 + vLLM silu_and_mul (= all, norm_launch=packed)", "all,norm_launch=packed"),
    ("I8 with contiguous K/V (no block table)", "all,norm_launch=packed,page_size=0"),
    ("I9 = I8, norm launches sized as vLLM's steps", "all"),
    # I10 calls the attention as vLLM's steps did: prefill over the prompts, then one query per generated token
    ("I10 = I9, attention called as vLLM's prefill and decode steps", "all,attention_launch=steps,logprobs=log_softmax"),
    # I11 computes the sampled token's log-prob as vLLM's model runner V2 (the engine's runner here) does
    ("I11 = I10, log-prob by the V2 model runner's kernel on bf16 logits", "all"),
]
BAND = 0.1
ROWS_PER_PASS = 8  # TRL's per_device_train_batch_size in the recipes
COLUMNS = ["phase", "scorer", "pieces", "oob %", "mean |dlogp|", "max |dlogp|", "bitwise %", "b1 = b8 bitwise %",
           "pass s", "x arm A", "note"]


def _write(path: Path, state: dict) -> None:
    """The results document at ``path``: ``state``'s env and params, its results plus the raw ``rows``, one table."""
    from bloggap_plugin.results import ResultDocument

    def sig(value):
        return None if value is None else float(f"{value:.3g}")

    rows = [[r["phase"], r["scorer"], r.get("pieces"), r.get("oob_pct"), sig(r.get("abs_dlogp_mean")),
             sig(r.get("abs_dlogp_max")), r.get("bitwise_pct"), r.get("b1_vs_b8_bitwise_pct"), r.get("pass_s"),
             r.get("x_arm_a"),
             (r.get("refused") or r.get("error") or "")[:120] or None] for r in state["rows"]]
    table = {"id": "T16-armI", "title": "Arm I: trainer old log-probs vs vLLM's sampled log-probs, piece by piece",
             "columns": COLUMNS, "rows": rows, "reference": None, "random_init": state["params"].get("smoke", False),
             "notes": "oob: exp(trainer - sampler) outside [0.9, 1.1]; bitwise: trainer == sampler exactly (fp32); "
                      "b1 = b8: the first 8 rows scored one at a time vs together, bit-identical share (the scorer's own "
                      "batch invariance); x arm A: this pass's time over arm A's (TRL's bf16-autocast pass) in the "
                      "same phase; "
                      "refused or failed pieces: results.rows"}
    ResultDocument(benchmark="arm_i", env=state["env"], params=state["params"],
                   results={**state["results"], "rows": state["rows"]}, tables=[table]).write(path)


def _read(path: Path) -> dict:
    """The state :func:`_write` wrote (``env``, ``params``, ``results`` without ``rows``, ``rows``)."""
    doc = json.loads(path.read_text())
    results = dict(doc["results"])
    return {"env": doc["env"], "params": doc["params"], "rows": results.pop("rows", []), "results": results}


def _measure(state: dict, out: Path, row: dict, build, sampler, base_s: float | None, model=None) -> float | None:
    """One row: ``build()`` -> ``(score, plan | None, extra fields)`` (``UsageError``: the row is refused; anything
    else: failed), then the pass timed and compared with ``sampler``; ``out`` rewritten. Returns the pass's seconds
    (``None`` if it did not run)."""
    import torch

    from bloggap_plugin.core.errors import UsageError

    seconds = None
    try:
        score, plan, extra = build()
        row.update(extra)
    except Exception as err:  # noqa: BLE001 - refused (a piece this machine cannot run) or failed: recorded
        row["refused" if isinstance(err, UsageError) else "error"] = (
            str(err) if isinstance(err, UsageError) else f"{type(err).__name__}: {err}")
        score, plan = None, None
    try:
        if score is not None:
            logps, seconds = median_time(score, sampler.device)
            row.update(logprob_gap(logps, sampler, BAND), pass_s=round(seconds, 4),
                       x_arm_a=1.0 if base_s is None else round(seconds / base_s, 3))
            if plan is not None:
                row.setdefault("kernels", plan.stats()["kernels"])
                row.update(sync_s=round(plan.sync(model), 5), bytes_added=plan.stats()["bytes_added"])
            # the scorer's own batch invariance: the first 8 rows one at a time vs together, bit-identical share
            alone = score(rows=ROWS_PER_PASS, batch_size=1)
            row["b1_vs_b8_bitwise_pct"] = round(100.0 * float(torch.eq(alone, logps[:ROWS_PER_PASS]).double()
                                                              .mean()), 3)
    except Exception as err:  # noqa: BLE001 - a failing piece is a result; the others still run
        row["error"] = f"{type(err).__name__}: {err}"
    finally:
        if plan is not None:
            plan.close()
    state["rows"].append(row)
    _write(out, state)
    print(f"[{row['phase']}] {row['scorer']}: {row.get('oob_pct')}% oob, bitwise {row.get('bitwise_pct')}%, "
          f"x{row.get('x_arm_a')} {row.get('error', '')}{row.get('refused', '')[:80]}", flush=True)
    return seconds


def _scorer(call, ids, mask, width: int, context=None):
    """``score(rows=None, batch_size=8)``: ``call(ids, mask, width, batch_size)`` on the first ``rows`` rows."""
    import contextlib

    def score(rows=None, batch_size=ROWS_PER_PASS):
        with context() if context is not None else contextlib.nullcontext():
            return call(ids[:rows], mask[:rows], width, batch_size)

    return score


def _hf_forward(model, ids, mask, width: int, attention: str):
    """The bf16 shadow's own HF forward (padded, TRL's layout, mask positions) with ``attention``: ``sdpa``, or
    vLLM's FlashAttention registered with transformers' ``AttentionInterface`` (:func:`register_hf_attention`)."""
    import torch

    from bloggap_plugin.core.plans import make_plan
    from bloggap_plugin.core.scoring import token_logprobs
    from bloggap_plugin.core.vllm.form import parse_form
    from bloggap_plugin.core.vllm.kernels import load_kernels, register_hf_attention

    device = ids.device
    name, kernels = "sdpa", "torch"
    if attention == "vllm_fa":
        loaded = load_kernels(parse_form("hf,attention=vllm_fa"), device)
        name, kernels = register_hf_attention(loaded), loaded.source
    plan = make_plan(model, "vllm", pieces="hf", device=device)
    plan.shadow.config._attn_implementation = name

    def call(i, m, w, batch_size):
        return token_logprobs(plan.shadow, i, m, w, batch_size=batch_size, positions="mask")

    context = lambda: torch.autocast(device.type, enabled=False)  # noqa: E731 - the shadow computes in bf16
    return _scorer(call, ids, mask, width, context=context), plan, {"kernels": kernels}


def score_rows(model, ids, mask, sampler, phase: str, state: dict, out: Path) -> None:
    """Arm A's pass; the bf16 shadow's HF forward with sdpa and with vLLM's FlashAttention through transformers'
    ``AttentionInterface``; then arm I after each step of :data:`STEPS`. One row each, ``out`` rewritten after each."""
    import torch

    from bloggap_plugin.core.plans import make_plan

    device = ids.device
    width = sampler.shape[1]
    sampler = sampler.to(device)

    def arm_a():
        plan = make_plan(model, "bf16")
        call = lambda i, m, w, b: plan.token_logprobs(i, m, w, batch_size=b, positions="arange")  # noqa: E731
        context = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731 - TRL's autocast
        return _scorer(call, ids, mask, width, context=context), None, {}

    row = {"phase": phase, "scorer": "arm A (TRL's pass)", "pieces": None}
    base_s = _measure(state, out, row, arm_a, sampler, None)
    for label, attention in (("HF forward, bf16 weights, sdpa (padded)", "sdpa"),
                             ("HF forward, bf16 weights, vLLM FA via AttentionInterface", "vllm_fa")):
        row = {"phase": phase, "scorer": label, "pieces": f"hf forward, attention={attention}"}
        _measure(state, out, row, lambda a=attention: _hf_forward(model, ids, mask, width, a), sampler, base_s, model)
    for label, pieces in STEPS:

        def arm_i(pieces=pieces):
            plan = make_plan(model, "vllm", pieces=pieces, device=device)
            call = lambda i, m, w, b: plan.token_logprobs(i, m, w, batch_size=b, positions="mask")  # noqa: E731
            return _scorer(call, ids, mask, width), plan, {}

        _measure(state, out, {"phase": phase, "scorer": label, "pieces": pieces}, arm_i, sampler, base_s, model)


# ----------------------------------------------------------------------------------------------------- GPU phases
def _trainer_model(path: str, device):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()


def _generate(args) -> dict:
    """vLLM rollouts in this process: prompt ids, forced-length completions and their sampled log-probs."""
    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from bloggap_plugin.core.probe import builtin_prompts

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if getattr(args, "task_prompts", None):
        # the task's conversational prompts as TRL renders them (chat template, generation prompt): the prompts
        # bloggap train sends to vLLM
        from bloggap_plugin.tasks import get_task, prompt_token_ids

        dataset, _ = get_task(args.task_prompts, tokenizer, seed=0)
        prompt_ids = [prompt_token_ids(dataset[i]["prompt"], tokenizer) for i in range(args.prompts)]
    else:
        prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in builtin_prompts(args.prompts)]
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=args.gpu_mem,
              max_model_len=1024, seed=0, logprobs_mode="processed_logprobs", max_logprobs=1,
              kv_cache_memory_bytes=2 << 30)
    engine_s = time.perf_counter() - t0
    # ignore_eos, not min_tokens: vLLM's min_tokens processor sets the stop tokens' logits to -inf, so processed
    # log-probs would be renormalised without them while the trainer's cover the whole vocabulary
    params = [SamplingParams(temperature=1.0, max_tokens=args.tokens, ignore_eos=True, logprobs=0,
                             seed=1000 + i, detokenize=False) for i in range(len(prompt_ids))]
    t0 = time.perf_counter()
    outputs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params,
                                                   use_tqdm=False)]
    gen_s = time.perf_counter() - t0
    if {len(c.token_ids) for c in outputs} != {args.tokens}:
        raise RuntimeError(f"vLLM returned completions of lengths {sorted({len(c.token_ids) for c in outputs})}, "
                           f"expected {args.tokens} each (ignore_eos); lower --tokens below max_model_len")
    tokens = torch.tensor([list(c.token_ids) for c in outputs], dtype=torch.long)
    sampled = torch.tensor([[d[int(t)].logprob for t, d in zip(c.token_ids, c.logprobs)] for c in outputs],
                           dtype=torch.float32)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return {"llm": llm, "prompt_ids": prompt_ids, "tokens": tokens, "sampled": sampled, "pad_id": pad,
            "engine_start_s": round(engine_s, 2), "generate_s": round(gen_s, 3)}


def _engine_model(llm):
    """The engine's ``nn.Module`` where an in-process engine exposes it (vLLM 0.26 V1), else ``None``."""
    paths = ("llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model",
             "llm_engine.model_executor.driver_worker.worker.model_runner.model")
    for path in paths:
        obj = llm
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is not None:
            return obj
    return None


def _rope_cache(model, device):
    """``(head_dim, theta, cache)``: the model's RoPE settings and vLLM's bf16 ``cos_sin_cache`` built from them."""
    import torch

    from bloggap_plugin.core.vllm.form import vllm_cos_sin_cache

    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = float(config.rope_parameters["rope_theta"])
    return head_dim, theta, vllm_cos_sin_cache(head_dim, theta, config.max_position_embeddings, torch.bfloat16, device)


def _rope_diagnostics(model, device, cache=None) -> dict:
    """HF's RoPE in this process against vLLM's cache, and the fp32 ``bmm`` it is built with against float64: with
    vLLM's batch-invariant mode on, ``aten::bmm`` is vLLM's Triton kernel, whose ``tl.dot`` computes fp32 in TF32
    by default, and transformers computes the RoPE angles ``inv_freq @ positions`` with that ``bmm``. Positions
    0..1023 (fewer if the model has fewer); run in both phases, so the process-wide override's effect is the difference.
    ``cache``: :func:`_rope_cache`'s result, if the caller has it."""
    import torch

    head_dim, theta, ours = cache or _rope_cache(model, device)
    out: dict = {}
    n_positions = min(1024, int(model.config.max_position_embeddings))
    positions = torch.arange(0, n_positions, device=device)[None]
    probe = torch.zeros(1, 1, head_dim, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        cos_hf, _ = model.model.rotary_emb(probe, positions)
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
        exact = positions[0].double()[:, None] * inv_freq[None, :]
        angles = torch.bmm(inv_freq.float()[None, :, None], positions.float()[:, None, :]).transpose(1, 2)[0]
    out["hf_rope_cos_vs_vllm_cache_max_abs"] = float((cos_hf[0, :, : head_dim // 2].float()
                                                      - ours[:n_positions, : head_dim // 2].float()).abs().max())
    out["fp32_bmm_rope_angle_max_abs_err"] = float((angles.double() - exact).abs().max())
    return out


def _diagnostics(llm, model, device) -> dict:
    """Engine weights and RoPE cache vs the trainer's bf16 values, and :func:`_rope_diagnostics`."""
    import torch

    cache = _rope_cache(model, device)
    ours = cache[2]
    out: dict = _rope_diagnostics(model, device, cache)
    engine = _engine_model(llm)
    if engine is None:
        out["engine_model"] = "not reachable from the LLM object"
        return out
    caches = [m.cos_sin_cache for m in engine.modules() if isinstance(getattr(m, "cos_sin_cache", None), torch.Tensor)]
    if caches:
        theirs = caches[0].to(device)
        rows = min(theirs.shape[0], ours.shape[0])
        out["engine_rope_cache_dtype"] = str(theirs.dtype)
        out["engine_rope_cache_equal"] = bool(torch.equal(theirs[:rows].to(ours.dtype), ours[:rows]))
    params = dict(engine.named_parameters())
    embed = next((v for k, v in params.items() if k.endswith("embed_tokens.weight")), None)
    if embed is not None:
        mine = model.get_input_embeddings().weight.detach().to(torch.bfloat16)
        out["engine_embed_equal_bf16"] = bool(torch.equal(embed.detach()[: mine.shape[0]], mine))
    return out


def cmd_phase(args) -> None:
    """One phase (``colocated`` generates first; ``scoped`` reads ``gen.pt``); writes ``--json`` after each row."""
    import torch

    from bloggap_plugin.core.vllm.kernels import vllm_batch_invariant_active
    from bloggap_plugin.envinfo import environment_record

    device = torch.device("cuda")
    work = Path(args.work)
    state = _read(Path(args.json))
    results = state["results"].setdefault(args.phase, {})
    if args.phase == "colocated":
        gen = _generate(args)
        # here, not above: it loads TRL, which a phase that stops before sampling (no vLLM) does not need
        from bloggap_plugin.trl.colocate_reads import engine_model_runner

        torch.save({k: gen[k] for k in ("prompt_ids", "tokens", "sampled", "pad_id")}, work / "gen.pt")
        results.update(engine_start_s=gen["engine_start_s"], generate_s=gen["generate_s"],
                       model_runner=engine_model_runner(getattr(gen["llm"], "llm_engine", None)))
    else:
        gen = torch.load(work / "gen.pt", weights_only=True)  # tensors and ints: nothing to unpickle
    state["env"] = environment_record(device)
    results["process_batch_invariant"] = vllm_batch_invariant_active()
    results["env_vars"] = {k: os.environ.get(k) for k in ("VLLM_BATCH_INVARIANT", "CUBLAS_WORKSPACE_CONFIG",
                                                           "CUBLASLT_WORKSPACE_SIZE", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    model = _trainer_model(args.model, device)
    try:
        results["diagnostics"] = (_diagnostics(gen["llm"], model, device) if args.phase == "colocated"
                                  else _rope_diagnostics(model, device))
    except Exception as err:  # noqa: BLE001 - diagnostics never stop the measurement
        results["diagnostics"] = {"error": f"{type(err).__name__}: {err}"}
    ids, mask = teacher_forced_batch(gen["prompt_ids"], gen["tokens"], gen["pad_id"], device)
    results["tokens"] = int(gen["tokens"].numel())
    score_rows(model, ids, mask, gen["sampled"], args.phase, state, Path(args.json))
    if args.profile:
        state = _read(Path(args.json))
        state["results"][args.phase]["profile"] = _profile(model, ids, mask, gen["sampled"].shape[1])
        _write(Path(args.json), state)


def _profile(model, ids, mask, width: int, rows: int = 15) -> dict:
    """One arm I pass (preset ``all``, chunks of :data:`ROWS_PER_PASS` rows) under ``torch.profiler``: its wall
    seconds, the summed device time of its kernels, the number of kernel launches, and the ``rows`` operators with
    the most host (self CPU) time and with the most device time, in ms."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bloggap_plugin.core.plans import make_plan

    plan = make_plan(model, "vllm", pieces="all", device=ids.device)
    try:
        score = lambda: plan.token_logprobs(ids, mask, width, batch_size=ROWS_PER_PASS, positions="mask")  # noqa: E731
        score()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            score()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
    finally:
        plan.close()
    events = prof.key_averages()

    def device_us(event) -> float:
        return float(getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0))

    def on_device(event) -> bool:
        return "CUDA" in str(getattr(event, "device_type", ""))

    kernels = [e for e in prof.events() if on_device(e)]

    def table(chosen, key) -> list[dict]:
        return [{"op": e.key, "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
                 "self_device_ms": round(device_us(e) / 1e3, 3)} for e in sorted(chosen, key=key, reverse=True)[:rows]]

    return {"wall_s": round(wall, 4), "device_busy_s": round(sum(device_us(e) for e in kernels) / 1e6, 4),
            "kernel_launches": len(kernels), "rows": int(ids.shape[0]), "width": width,
            "top_host": table([e for e in events if not on_device(e)], lambda e: e.self_cpu_time_total),
            "top_device": table([e for e in events if on_device(e)], device_us)}


def cmd_all(args) -> None:
    """Both phases, one after the other, each in a subprocess with its own environment."""
    out = Path(args.out)
    work = out / "arm_i_work"
    work.mkdir(parents=True, exist_ok=True)
    path = out / "arm_i.json"
    state = {"env": {}, "params": {"model": args.model, "prompts": args.prompts, "tokens": args.tokens, "band": BAND,
                                   "task_prompts": args.task_prompts,
                                   "rows_per_pass": ROWS_PER_PASS, "steps": STEPS}, "results": {"errors": {}},
             "rows": []}
    _write(path, state)
    deadline = time.time() + args.budget_s
    for phase, env in (("colocated", {"VLLM_BATCH_INVARIANT": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),
                       ("scoped", {"VLLM_BATCH_INVARIANT": "1"})):  # no engine: vLLM's mode is never enabled
        if phase not in args.phases.split(","):
            continue
        argv = module_command("benchmarks.arm_i", "phase", phase, "--model", args.model, "--work", str(work), "--json",
                              str(path), "--prompts", str(args.prompts), "--tokens", str(args.tokens),
                              "--gpu-mem", str(args.gpu_mem))
        argv += ["--task-prompts", args.task_prompts] if args.task_prompts else []
        argv += ["--profile"] if args.profile else []
        code = run_logged(argv, work / f"{phase}.log", repo_env({**os.environ, **env}), deadline)
        if code != 0:
            current = _read(path)
            lines = (work / f"{phase}.log").read_text(errors="replace").splitlines()
            current["results"].setdefault("errors", {})[phase] = {"code": code, "log_tail": lines[-25:]}
            _write(path, current)


# ----------------------------------------------------------------------------------------------------- smoke
def cmd_smoke(args) -> dict:
    """CPU: a tiny random Llama, the fp32 shadow's scores as the sampler, every step (vLLM pieces refused)."""
    import torch

    from bloggap_plugin.core.plans import make_plan
    from bloggap_plugin.envinfo import environment_record
    from bloggap_plugin.models import _load_tiny

    model, _ = _load_tiny("tiny-random-llama", torch.float32)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 90, (args.prompts, 12 + args.tokens), generator=gen)
    mask = torch.ones_like(ids)
    for row in range(args.prompts):
        mask[row, : row % 5] = 0  # left-padded prompts of different lengths
    sampler = make_plan(model, "fp32").token_logprobs(ids, mask, args.tokens, positions="mask")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state = {"env": environment_record("cpu"), "params": {"smoke": True, "prompts": args.prompts,
                                                           "tokens": args.tokens, "steps": STEPS},
             "results": {"smoke": {"sampler": "fp32 shadow scores (no vLLM on this machine)"}}, "rows": []}
    score_rows(model, ids, mask, sampler, "smoke", state, out / "arm_i.json")
    return state


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--smoke"]:  # ``--smoke --out DIR`` is the ``smoke`` command
        argv[0] = "smoke"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("all", "phase", "smoke"):
        p = sub.add_parser(name)
        if name == "phase":
            p.add_argument("phase", choices=["colocated", "scoped"])
            p.add_argument("--work", required=True)
            p.add_argument("--json", required=True)
        if name != "smoke":
            p.add_argument("--model", required=True, help="folder of the HF model (SmolLM2-135M-Instruct)")
            p.add_argument("--gpu-mem", type=float, default=0.3)
        if name != "phase":
            p.add_argument("--out", required=True, help="folder for arm_i.json")
        p.add_argument("--prompts", type=int, default=8 if name == "smoke" else 64)
        p.add_argument("--tokens", type=int, default=8 if name == "smoke" else 128)
        if name == "all":
            p.add_argument("--budget-s", type=float, default=540.0, help="both phases together stop after this")
            p.add_argument("--phases", default="colocated,scoped", help="which phases to run (comma-separated)")
        if name != "smoke":
            p.add_argument("--profile", action="store_true",
                           help="after the rows, profile one arm I pass (preset all) with torch.profiler")
        if name != "smoke":
            p.add_argument("--task-prompts", default=None,
                           help="sample from this task's prompts with the chat template (as bloggap train sends "
                                "them) instead of the built-in short prompts")
    args = parser.parse_args(argv)
    {"all": cmd_all, "phase": cmd_phase, "smoke": cmd_smoke}[args.cmd](args)


if __name__ == "__main__":
    main()
