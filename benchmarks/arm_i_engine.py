"""Which vLLM engine settings arm I can match (issue 29 item 1, route 1 against route 2). ONE device call:

    . .dev/vllm/t/env.sh && python -m benchmarks.arm_i_engine all --model /tmp/vx/smollm2 --out $OUT

Each engine variant runs in its own process (``VLLM_BATCH_INVARIANT=1``, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the
engine in the process, as TRL's colocate mode builds it) and writes one entry of ``$OUT/arm_i_engine.json``
(rewritten after each variant, so a time limit keeps what finished); ``collect`` merges the documents of several
device calls into the committed ``benchmarks/results/h200/arm_i_engine.json`` (table ``T16-armI-engine``). A variant's engine samples ``--prompts`` x
``--tokens`` forced tokens of the task's chat prompts at temperature 1, untruncated, ``processed_logprobs`` (TRL's
setting), with TRL 1.16's ``max_num_batched_tokens`` (4096); then three scorers give the log-prob of every sampled
token, each compared with the sampler's own (bit-identical share, share with ``exp(d)`` outside [0.9, 1.1], max |d|):

- ``engine``: the same engine re-reads the rows as prompts (``prompt_logprobs=0``): its own forward as a prefill.
- ``arm_i``: arm I's scorer (``make_plan(model, "vllm", pieces="all")``) on a bf16 copy of the trainer's weights.
- ``arm_a``: TRL's own pass (fp32 master weights under bf16 autocast), for scale.

Variants (:data:`VARIANTS`): ``eager`` is what the plugin builds for arm I today (route 2); ``compiled`` is TRL's
default engine (torch.compile, CUDA graphs, prefix caching); ``compiled_kernels`` compiles with every vLLM custom op
enabled (``compilation_config.custom_ops=["all"]``), so the compiled graph calls the kernels arm I runs (without
prefix caching; ``compiled_kernels_prefix_cache`` with it, TRL's default). ``eager_one_prefill`` is ``eager`` with
16384 tokens per step, so that every prompt is prefilled in the first step (TRL's 4096 chunk 32 prompts of the
arithmetic task, about 194 tokens each, into steps mixed with decodes); ``compiled_kernels_one_prefill`` is route 1
under the same condition. ``graphs_one_prefill`` runs the eager engine's kernels (no torch.compile:
``compilation_config.mode`` 0) with full CUDA graphs for decode steps (``cudagraph_mode=FULL_DECODE_ONLY``): the
kernels arm I computes, launched from captured graphs (in batch-invariant mode FlashAttention runs with one split
either way).
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
from bloggap_plugin._io import atomic_write_text

VARIANTS: dict[str, dict] = {
    "eager": {"enforce_eager": True, "enable_prefix_caching": False},
    "compiled": {},
    "compiled_kernels": {"compilation_config": {"custom_ops": ["all"]}, "enable_prefix_caching": False},
    "compiled_kernels_prefix_cache": {"compilation_config": {"custom_ops": ["all"]}},
    "eager_one_prefill": {"enforce_eager": True, "enable_prefix_caching": False, "max_num_batched_tokens": 16384},
    "compiled_kernels_one_prefill": {"compilation_config": {"custom_ops": ["all"]}, "enable_prefix_caching": False,
                                     "max_num_batched_tokens": 16384},
    "graphs_one_prefill": {"compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"},
                           "enable_prefix_caching": False, "max_num_batched_tokens": 16384},
}
"""Variant name -> the ``LLM(...)`` keyword arguments it adds to TRL's colocate settings."""
TRL_ENGINE = {"dtype": "bfloat16", "logprobs_mode": "processed_logprobs", "max_num_batched_tokens": 4096,
              "max_model_len": 1024, "seed": 0, "kv_cache_memory_bytes": 2 << 30}
"""TRL 1.16's colocate ``LLM(...)`` arguments that matter here, plus a fixed KV cache and model length."""
BAND = 0.1
PROCESS_ENV = {"VLLM_BATCH_INVARIANT": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TRITON_F32_DEFAULT": "ieee"}
"""Every variant's process: vLLM's batch-invariant mode, the engine in the process, and IEEE fp32 in Triton's dots
(the batch-invariant ``bmm`` builds the engine's RoPE cache; arm I's recipe sets the same)."""


def _prompts(model: str, task: str, count: int) -> list[list[int]]:
    """The token ids of the task's first ``count`` prompts as TRL renders them for generation."""
    from transformers import AutoTokenizer

    from bloggap_plugin.tasks import get_task, prompt_token_ids

    tokenizer = AutoTokenizer.from_pretrained(model)
    dataset, _ = get_task(task, tokenizer, seed=0)
    return [prompt_token_ids(dataset[i]["prompt"], tokenizer) for i in range(count)]


def _engine_scores(llm, prompt_ids, tokens) -> list[list[float]]:
    """The engine's own log-prob of every completion token, its rows re-read as prompts (``prompt_logprobs=0``)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
    rows = [{"prompt_token_ids": p + t} for p, t in zip(prompt_ids, tokens)]
    outputs = llm.generate(rows, params, use_tqdm=False)
    scores = []
    for prompt, completion, out in zip(prompt_ids, tokens, outputs):
        entries = out.prompt_logprobs[len(prompt):]
        scores.append([entry[token].logprob for token, entry in zip(completion, entries)])
    return scores


def cmd_variant(args) -> None:
    """One engine variant in this process: sample, score three ways, merge the entry into ``--json``."""
    import torch
    from vllm import LLM, SamplingParams

    from bloggap_plugin.core.plans import make_plan
    from bloggap_plugin.envinfo import environment_record
    from bloggap_plugin.trl.colocate_reads import engine_model_runner

    device = torch.device("cuda")
    entry: dict = {"engine_kwargs": VARIANTS[args.variant]}
    prompt_ids = _prompts(args.model, args.task, args.prompts)
    start = time.perf_counter()
    llm = LLM(model=args.model, gpu_memory_utilization=args.gpu_mem, **{**TRL_ENGINE, **VARIANTS[args.variant]})
    entry["engine_start_s"] = round(time.perf_counter() - start, 2)
    entry["model_runner"] = engine_model_runner(getattr(llm, "llm_engine", None))
    params = [SamplingParams(temperature=1.0, max_tokens=args.tokens, ignore_eos=True, logprobs=0, seed=1000 + i,
                             detokenize=False) for i in range(len(prompt_ids))]
    rows = [{"prompt_token_ids": p} for p in prompt_ids]
    llm.generate(rows, params, use_tqdm=False)  # warm-up (JIT, graphs)
    start = time.perf_counter()
    outputs = [o.outputs[0] for o in llm.generate(rows, params, use_tqdm=False)]
    entry["generate_s"] = round(time.perf_counter() - start, 4)
    tokens = [list(c.token_ids) for c in outputs]
    sampled = torch.tensor([[d[t].logprob for t, d in zip(c.token_ids, c.logprobs)] for c in outputs])
    engine, seconds = median_time(lambda: _engine_scores(llm, prompt_ids, tokens), device)
    entry["engine"] = {**logprob_gap(torch.tensor(engine), sampled, BAND), "pass_s": round(seconds, 4)}
    print(f"[{args.variant}] engine rescore: {entry['engine']}", flush=True)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).eval()
    completion = torch.tensor(tokens)
    ids, mask = teacher_forced_batch(prompt_ids, completion, 0, device)
    width = completion.shape[1]
    plan = make_plan(model, "vllm", pieces="all", device=device)
    scores, seconds = median_time(lambda: plan.token_logprobs(ids, mask, width, positions="mask"), device)
    entry["arm_i"] = {**logprob_gap(scores, sampled, BAND), "pass_s": round(seconds, 4)}
    plan.close()
    print(f"[{args.variant}] arm I: {entry['arm_i']}", flush=True)
    base = make_plan(model, "bf16")

    def arm_a():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return base.token_logprobs(ids, mask, width, batch_size=8, positions="arange")

    scores, seconds = median_time(arm_a, device)
    entry["arm_a"] = {**logprob_gap(scores, sampled, BAND), "pass_s": round(seconds, 4)}
    print(f"[{args.variant}] arm A: {entry['arm_a']}", flush=True)
    path = Path(args.json)
    state = json.loads(path.read_text())
    state["env"] = environment_record(device)
    state["results"][args.variant] = entry
    atomic_write_text(path, json.dumps(state, indent=1) + "\n")


def cmd_all(args) -> None:
    """Every variant in ``--variants``, each in a subprocess; the document rewritten after each."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "arm_i_engine.json"
    state = {"benchmark": "arm_i_engine", "schema_version": 1, "env": {},
             "params": {"model": "<SmolLM2 dense folder>", "task": args.task, "prompts": args.prompts,
                        "tokens": args.tokens, "band": BAND, "trl_engine": TRL_ENGINE,
                        "revision": args.revision, "process_env": PROCESS_ENV}, "results": {}, "errors": {}}
    atomic_write_text(path, json.dumps(state, indent=1) + "\n")
    deadline = time.time() + args.budget_s
    for variant in args.variants.split(","):
        argv = module_command("benchmarks.arm_i_engine", "variant", variant, "--model", args.model, "--json",
                              str(path), "--prompts", str(args.prompts), "--tokens", str(args.tokens), "--task",
                              args.task, "--gpu-mem", str(args.gpu_mem))
        log_path = out / f"arm_i_engine_{variant}.log"
        code = run_logged(argv, log_path, repo_env({**os.environ, **PROCESS_ENV}), deadline)
        if code != 0:
            state = json.loads(path.read_text())
            state["errors"][variant] = {"code": code,
                                        "log_tail": log_path.read_text(errors="replace").splitlines()[-25:]}
            atomic_write_text(path, json.dumps(state, indent=1) + "\n")
        print(f"variant {variant}: exit {code}", flush=True)


TABLE_ID = "T16-armI-engine"
COLUMNS = ["variant", "engine settings (beyond TRL's)", "engine start s", "generate s",
           "arm I bit-identical %", "arm I oob %", "engine re-read bit-identical %", "engine re-read oob %",
           "arm A oob %", "arm I pass s", "arm A pass s", "engine re-read s", "revision"]


def table(results: dict) -> dict:
    """The ``T16-armI-engine`` table from a document's ``results`` (variant -> entry)."""
    rows = []
    for variant, entry in results.items():
        settings = ", ".join(f"{k}={v}" for k, v in entry["engine_kwargs"].items()) or "none (TRL's engine)"
        rows.append([variant, settings, entry["engine_start_s"], entry["generate_s"],
                     entry["arm_i"]["bitwise_pct"], entry["arm_i"]["oob_pct"], entry["engine"]["bitwise_pct"],
                     entry["engine"]["oob_pct"], entry["arm_a"]["oob_pct"], entry["arm_i"]["pass_s"],
                     entry["arm_a"]["pass_s"], entry["engine"]["pass_s"], entry.get("revision")])
    return {"id": TABLE_ID, "title": "Arm I against vLLM engine settings (harness): which engine arm I matches",
            "columns": COLUMNS, "rows": rows, "reference": None, "random_init": False,
            "notes": "benchmarks/arm_i_engine.py, one process per variant with VLLM_BATCH_INVARIANT=1 and "
                     "TRITON_F32_DEFAULT=ieee; 32 arithmetic chat prompts x 32 forced tokens at T=1, untruncated, "
                     "processed_logprobs, TRL 1.16's max_num_batched_tokens=4096 unless the variant sets it. Each "
                     "scorer's log-prob of every sampled token against the sampler's: bit-identical share, share "
                     "with exp(d) outside [0.9, 1.1]. Engine re-read: the same engine given each row as a prompt "
                     "(prompt_logprobs=0). generate s: the 32 completions after a warm-up generation. pass s: one "
                     "scoring of the 32 rows (median of 3 after a warm-up); arm A's in chunks of 8 rows as TRL's "
                     "old-logprob pass, arm I's in one forward (its rows per forward)."}


def cmd_collect(args) -> None:
    """One committed document from ``--part`` documents (later parts' variants replace earlier ones'), each
    variant stamped with its part's ``params.revision`` (a part without one, such as the committed document whose
    entries carry their own, keeps each entry's), machine paths replaced, the variants' logs packed into ``--pack``."""
    from benchmarks._lib.publish import pack_text_files, strip_paths

    merged: dict = {}
    for part in args.part:
        doc = json.loads(Path(part).read_text())
        merged.setdefault("env", doc["env"])
        merged.setdefault("params", {k: v for k, v in doc["params"].items() if k != "revision"})
        revision = doc["params"].get("revision")
        for variant, entry in doc["results"].items():
            merged.setdefault("results", {})[variant] = {**entry, "revision": revision if revision is not None
                                                         else entry.get("revision")}
    document = {"benchmark": "arm_i_engine", "schema_version": 1, "env": merged["env"], "params": merged["params"],
                "results": merged["results"], "tables": [table(merged["results"])]}
    text = strip_paths(json.dumps(document, indent=1) + "\n", args.model_path, "<SmolLM2 dense folder>")
    atomic_write_text(Path(args.result), text)
    if args.pack:
        pack_text_files([Path(log) for log in args.logs], Path(args.pack), args.model_path, "<SmolLM2 dense folder>")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("all", "variant"):
        p = sub.add_parser(name)
        if name == "variant":
            p.add_argument("variant", choices=sorted(VARIANTS))
            p.add_argument("--json", required=True)
        else:
            p.add_argument("--out", required=True)
            p.add_argument("--variants", default=",".join(VARIANTS))
            p.add_argument("--budget-s", type=float, default=500.0)
            p.add_argument("--revision", default=None)
        p.add_argument("--model", required=True)
        p.add_argument("--task", default="arith")
        p.add_argument("--prompts", type=int, default=32)
        p.add_argument("--tokens", type=int, default=32)
        p.add_argument("--gpu-mem", type=float, default=0.3)
    col = sub.add_parser("collect", help="one committed document from the documents of several device calls")
    col.add_argument("result")
    col.add_argument("--part", action="append", required=True, help="a document that `all` wrote (repeat)")
    col.add_argument("--logs", nargs="*", default=[], help="the variants' console logs to pack")
    col.add_argument("--pack", default=None, help="tar.xz for the logs")
    col.add_argument("--model-path", default="/tmp/vx/smollm2", help="the model folder on the GPU machine")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    {"all": cmd_all, "variant": cmd_variant, "collect": cmd_collect}[args.cmd](args)


if __name__ == "__main__":
    main()
