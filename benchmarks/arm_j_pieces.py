"""Arm J's training forward piece by piece (issue 29 item 2): what each of vLLM's pieces costs in a forward and
backward, against arm A's (TRL's bf16 autocast forward). ONE device call, after the vLLM bundle's ``env.sh``:

    python -m benchmarks.arm_j_pieces run --model /tmp/vx/smollm2 --out $OUT

then here ``python -m benchmarks.arm_j_pieces document $OUT/arm_j_pieces.json benchmarks/results/h200/arm_j_pieces.json``.

A TRL-shaped micro-batch (``--rows`` arithmetic chat prompts, left-padded, with ``--tokens`` completion tokens drawn
from the vocabulary) goes through :class:`~bloggap_plugin.core.plans.vllm_shadow.OnPolicyForward` in arm J's form
(``all``) and in forms with one piece put back to torch (:data:`FORMS`), each on the fp32 policy. Per form: the
forward (with gradients) and the backward of ``sum(logps)``, median seconds of ``--repeats`` after a warm-up; whether
the training forward's log-probs equal arm J's old log-probs in the same form (``VllmFormParamsPlan``) bit for bit;
the total against arm A's. For arm J's form, each piece's backward seconds (the device synchronised around each
piece, so the sum exceeds the plain backward; table ``T16-armJ-backward``). Last, the two attention backward
formulas (``core.vllm.autograd``: padded entries, dense over the cache) on one layer's calls (table
``T16-armJ-attention``).
``$OUT/arm_j_pieces.json`` (table ``T16-armJ-pieces``) is rewritten after each form, so a time limit keeps what
finished.

The process sets ``VLLM_BATCH_INVARIANT=1`` and ``TRITON_F32_DEFAULT=ieee`` before vLLM is imported (arm J's
recipe asks the user to export both).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bloggap_plugin._io import atomic_write_text

TABLE_ID = "T16-armJ-pieces"
BACKWARD_TABLE_ID = "T16-armJ-backward"
RESULT_NAME = "arm_j_pieces.json"
FORMS: dict[str, str] = {
    "J (all)": "all",
    "attention in one launch per row": "all,attention_launch=packed",
    "norms in one launch": "all,norm_launch=packed",
    "torch attention (sdpa)": "all,attention=sdpa",
    "torch norms": "all,norm=torch",
    "torch RoPE": "all,rope=torch",
    "torch activation": "all,act=torch",
    "log_softmax log-prob": "all,logprobs=log_softmax",
    "no batch-invariant kernels": "all,batch_invariant=false",
    "vLLM's maths in torch": "torch",
    "HF's maths, packed": "hf",
}
"""Row label -> arm I form (``core.vllm.form.parse_form``): arm J's, then one piece back to torch at a time."""
PROCESS_ENV = {"VLLM_BATCH_INVARIANT": "1", "TRITON_F32_DEFAULT": "ieee"}
COLUMNS = ["form", "pieces (core.vllm.form)", "forward s", "backward s", "total s", "x arm A", "equals the old log-probs"]
BACKWARD_PIECES: dict[str, str] = {
    "flash_paged_formula": "attention (paged FlashAttention, per call)",
    "flash_formula": "attention (contiguous FlashAttention)",
    "linear_formula": "linear (q/k/v, o, gate/up, down, head)",
    "rms_norm_over_launches": "RMSNorm in step launches (one piece per norm)",
    "over_launches": "RMSNorm in step launches (one piece per norm)",  # its name until ffb4913 (b01b450's document)
    "rotary_formula": "RoPE",
    "silu_and_mul_formula": "activation (silu and mul)",
    "rms_norm_formula": "RMSNorm in one launch",
    "token_logprobs_formula": "log-prob of the sampled token",
}
"""Backward formula (``core.vllm.autograd``) -> the piece of arm J's forward it differentiates."""
BACKWARD_COLUMNS = ["piece", "backward formula", "calls", "backward s (synchronised per piece)", "% of the backward"]


def _sync(device: Any) -> None:
    import torch

    if getattr(device, "type", device) == "cuda":
        torch.cuda.synchronize()


def _timed(call: Callable[[], Any], device: Any) -> tuple[Any, float]:
    _sync(device)
    started = time.perf_counter()
    out = call()
    _sync(device)
    return out, time.perf_counter() - started


def time_forward_backward(forward: Callable[[], Any], device: Any, repeats: int) -> dict:
    """``forward()`` -> log-probs ``[B, K]`` with gradients; median forward and backward seconds of ``repeats`` runs
    after a warm-up (the gradients set to ``None`` between runs), and the last run's log-probs (detached)."""
    times: dict[str, list[float]] = {"forward_s": [], "backward_s": []}
    logps = None
    for run in range(repeats + 1):
        logps, forward_s = _timed(forward, device)
        _, backward_s = _timed(logps.sum().backward, device)
        if run:
            times["forward_s"].append(forward_s)
            times["backward_s"].append(backward_s)
    out = {k: statistics.median(v) for k, v in times.items()}
    out["total_s"] = out["forward_s"] + out["backward_s"]
    return {**out, "logps": logps.detach()}


def backward_by_piece(forward: Callable[[], Any], device: Any) -> dict:
    """Seconds of each wrapped piece's backward in one backward of ``forward()`` (the device synchronised around
    each piece: the sum exceeds a plain backward), keyed by the piece's formula; ``calls`` per piece."""
    from bloggap_plugin.core.vllm import autograd as vllm_autograd

    seconds: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.Counter()
    original = vllm_autograd._KernelPiece.backward

    def timed(ctx, grad):
        _sync(device)
        started = time.perf_counter()
        out = original(ctx, grad)
        _sync(device)
        name = getattr(ctx.formula, "__name__", str(ctx.formula))
        seconds[name] += time.perf_counter() - started
        calls[name] += 1
        return out

    logps = forward()
    vllm_autograd._KernelPiece.backward = staticmethod(timed)
    try:
        _, total = _timed(lambda: logps.sum().backward(), device)
    finally:
        vllm_autograd._KernelPiece.backward = staticmethod(original)
    return {"total_s": total, "seconds": dict(seconds), "calls": dict(calls)}


def measure_form(policy: Any, ids: Any, mask: Any, keep: int, spec: str, kernels: Any, repeats: int,
                 device: Any, by_piece: bool = False) -> dict:
    """One form's row: forward/backward seconds of arm J's training forward in form ``spec`` over ``policy``, and
    whether its log-probs equal the same form's grad-free old log-probs (``VllmFormParamsPlan``) bit for bit."""
    import torch

    from bloggap_plugin.core.plans.vllm_shadow import OnPolicyForward, VllmFormParamsPlan
    from bloggap_plugin.core.vllm.form import parse_form

    form = parse_form(spec)
    training = OnPolicyForward(policy, form, kernels)
    row = time_forward_backward(lambda: training.token_logprobs(ids, mask, keep)[0], device, repeats)
    policy.zero_grad(set_to_none=True)
    with torch.no_grad():
        old = VllmFormParamsPlan(policy, form, kernels).token_logprobs(ids, mask, keep, positions="mask")
    logps = row.pop("logps")
    row["equals_old_logprobs"] = bool(torch.equal(logps, old))
    row["spec"], row["pieces"] = spec, form.describe()
    if by_piece:
        row["backward_by_piece"] = backward_by_piece(lambda: training.token_logprobs(ids, mask, keep)[0], device)
        policy.zero_grad(set_to_none=True)
    return row


def measure_arm_a(policy: Any, ids: Any, mask: Any, keep: int, repeats: int, device: Any) -> dict:
    """Arm A's row: TRL's training forward (the fp32 policy under bf16 autocast, positions from ``arange``)."""
    import torch

    from bloggap_plugin.core.scoring import token_logprobs

    device_type = getattr(device, "type", str(device))

    def forward():
        with torch.autocast(device_type, dtype=torch.bfloat16):
            return token_logprobs(policy, ids, mask, keep, positions="arange")

    row = time_forward_backward(forward, device, repeats)
    row.pop("logps")
    policy.zero_grad(set_to_none=True)
    return row


ATTENTION_FORMULAS = {"padded entries": "padded_paged_attention",
                      "dense over the cache": "dense_cache_attention",
                      "closed form": "paged_attention_gradient"}
"""Label -> attention backward (``core.vllm.autograd``) timed by :func:`attention_formula_rows`, padded entries first
(the others' outputs are compared with its): the two formulas differentiated by autograd, and the closed-form
gradient (a wrapped piece whose forward is the dense formula without gradients, given the decode call's rows as arm
J's forward gives them: by entry for the prefill and for the decode call by rows, ``paged_attention_gradient``)."""
PLUGIN_MARK = " (the plugin's)"
"""Appended to a row's label where arm J's backward takes that route for that call: the closed form within its cap
(``DENSE_GRADIENT_ELEMENTS``), else autograd of the formula ``core.vllm.autograd.paged_attention_formula`` picks."""


def plugin_attention_backward(q: Any, key_cache: Any, arguments: tuple, rows: tuple | None = None) -> str:
    """The :data:`ATTENTION_FORMULAS` name arm J's backward uses for one paged call (shapes and ints only):
    ``arguments`` the call's ``(cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k)``, ``rows`` the
    decode call by rows where the forward passes them."""
    from bloggap_plugin.core.vllm import autograd as vllm_autograd

    if vllm_autograd.paged_gradient_route(q, key_cache, arguments, rows) != "autograd":
        return "paged_attention_gradient"
    return vllm_autograd.paged_attention_formula(q, key_cache, arguments[3]).__name__


def _closed_form_piece() -> Callable[..., Any]:
    """A paged attention piece whose forward is the dense formula (fp32, no gradients) and whose backward is arm J's
    closed form (``core.vllm.autograd.paged_attention_gradient``)."""
    import dataclasses

    from bloggap_plugin.core.vllm import autograd as vllm_autograd
    from bloggap_plugin.core.vllm.form import TORCH_KERNELS

    kernels = dataclasses.replace(TORCH_KERNELS, flash_paged=vllm_autograd.dense_cache_attention)
    return vllm_autograd.autograd_kernels(kernels).flash_paged


def attention_formula_rows(policy: Any, ids: Any, mask: Any, keep: int, device: Any, repeats: int) -> dict:
    """The two paged calls of one layer of arm J's forward (the prefill over the prompts, the decode call with one
    entry per generated token; this micro-batch's shapes, random fp32 q/k/v) through each formula of
    :data:`ATTENTION_FORMULAS` in fp32, forward and backward timed as :func:`time_forward_backward` does; each
    formula's output against padded entries' (max |difference|). The row of the formula the plugin takes for
    the call is labelled :data:`PLUGIN_MARK`."""
    import torch

    from bloggap_plugin.core.vllm import autograd as vllm_autograd
    from bloggap_plugin.core.vllm.form import pack, paged_kv, prompt_first, stepwise_calls

    config = policy.config
    packed = pack(ids, mask)
    generated = torch.zeros(mask.shape, dtype=torch.bool, device=mask.device)
    generated[:, -keep:] = True
    packed.generated = generated[packed.where]
    ordered = prompt_first(packed)
    calls = stepwise_calls(ordered, 16)
    layout = ordered.paged[("order", 16)]  # the cache slot of each token in prompt_first's order
    total = int(ordered.cu_seqlens[-1])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    gen = torch.Generator(device=ids.device).manual_seed(0)
    q, k, v = (torch.randn(total, heads, head_dim, generator=gen, device=ids.device)
               for heads in (config.num_attention_heads, config.num_key_value_heads, config.num_key_value_heads))
    cache = paged_kv(k, v, ordered.lengths, 16, layout)[0]
    rows: dict = {}
    for call_name, call in zip(("prefill", "decode"), calls):
        index, arguments = call[0], call[1:]  # (cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k)
        by_rows = ordered.paged[("rows", 16)] if call_name == "decode" else None
        plugin_route = plugin_attention_backward(q[index], cache, arguments, by_rows)
        reference = None
        for label, name in ATTENTION_FORMULAS.items():
            formula = _closed_form_piece() if name == "paged_attention_gradient" else getattr(vllm_autograd, name)
            leaves = [q[index].clone().requires_grad_(True), k.clone().requires_grad_(True),
                      v.clone().requires_grad_(True)]

            hint = {"rows": by_rows} if name == "paged_attention_gradient" and by_rows is not None else {}

            def forward(leaves=leaves, formula=formula, arguments=arguments, hint=hint):
                key_cache, value_cache, _ = paged_kv(leaves[1], leaves[2], ordered.lengths, 16, layout)
                return formula(leaves[0], key_cache, value_cache, *arguments, head_dim ** -0.5, **hint)

            row = time_forward_backward(forward, device, repeats)
            out = row.pop("logps")
            reference = out if reference is None else reference
            row["max_abs_vs_padded"] = float((out - reference).abs().max())
            rows[f"{call_name}: {label}{PLUGIN_MARK if name == plugin_route else ''}"] = row
    return rows


def table(results: dict) -> dict:
    """``T16-armJ-pieces`` from the results (arm A's row first)."""
    base = results.get("arm A", {}).get("total_s")
    rows = []
    for label, row in results.items():
        ratio = None if not base or row.get("total_s") is None else round(row["total_s"] / base, 2)
        rows.append([label, row.get("spec", "TRL's forward, bf16 autocast"), round(row["forward_s"], 4),
                     round(row["backward_s"], 4), round(row["total_s"], 4), ratio, row.get("equals_old_logprobs")])
    return {"id": TABLE_ID, "title": "Arm J's training forward and backward, piece by piece, against arm A's",
            "columns": COLUMNS, "rows": rows, "reference": None, "random_init": False,
            "plot": {"kind": "bar", "x": "form", "y": ["forward s", "backward s"],
                     "title": "One micro-batch's training forward and backward by form", "ylabel": "s"},
            "notes": "One TRL micro-batch (rows x (prompt + completion) tokens, params); forward with gradients and "
                     "backward of sum(logps), median of the repeats after a warm-up. Each form after J puts one "
                     "piece back to torch (core.vllm.form). equals the old log-probs: the training forward's "
                     "log-probs bit for bit the same form's grad-free old log-probs. Arm J's backward by piece: "
                     "T16-armJ-backward."}


def backward_table(results: dict) -> dict | None:
    """``T16-armJ-backward``: arm J's backward by piece (``results['J (all)']['backward_by_piece']``), the largest
    first, then what ran outside the wrapped pieces (the backward's total less their sum: casts, concatenations,
    gathers, the embedding); ``None`` where arm J's row has no breakdown."""
    by_piece = results.get("J (all)", {}).get("backward_by_piece")
    if not by_piece:
        return None
    total = by_piece["total_s"]
    rows = [[BACKWARD_PIECES.get(name, name), name, by_piece["calls"].get(name), round(seconds, 4),
             round(100 * seconds / total, 1)]
            for name, seconds in sorted(by_piece["seconds"].items(), key=lambda item: -item[1])]
    outside = total - sum(by_piece["seconds"].values())
    rows.append(["outside the wrapped pieces", None, None, round(outside, 4), round(100 * outside / total, 1)])
    return {"id": BACKWARD_TABLE_ID, "title": "Arm J's backward by piece (one micro-batch, T16-armJ-pieces' form J)",
            "columns": BACKWARD_COLUMNS, "rows": rows, "reference": None, "random_init": False,
            "plot": {"kind": "bar", "x": "piece", "y": ["% of the backward"],
                     "title": "Arm J's backward by piece", "ylabel": "% of the backward"},
            "notes": "One backward of sum(logps) in arm J's form over T16-armJ-pieces' micro-batch, the device "
                     "synchronised before and after each wrapped piece's backward (core.vllm.autograd: torch's fp32 "
                     f"formula of the piece at its saved inputs), so its total ({round(total, 4)} s) exceeds the "
                     "plain backward of T16-armJ-pieces. calls: the piece's backward calls in that backward. "
                     "Outside the wrapped pieces: the total less the pieces' sum."}


ATTENTION_TABLE_ID = "T16-armJ-attention"


def attention_table(rows: dict) -> dict:
    """``T16-armJ-attention`` from :func:`attention_formula_rows`' rows (where a row has no
    ``max_abs_vs_padded``, an earlier run's ``max_abs_vs_plugin``: also against padded entries)."""
    if any("closed form" in label for label in rows):
        notes = ("fp32, on one layer's two paged calls of the micro-batch in params, random q/k/v; median of the "
                 "repeats after a warm-up. Padded entries and dense over the cache: the formula differentiated by "
                 "autograd; closed form: paged_attention_gradient as the backward of the dense formula's forward. "
                 "(the plugin's): what arm J's backward took for that call at the run's revision.")
    else:  # a document from before the closed form (111a0cf)
        notes = ("fp32 formula (what arm J's backward differentiates) on one layer's two paged calls of the "
                 "micro-batch in params, random q/k/v; median of the repeats after a warm-up. (the plugin's): the "
                 "formula flash_paged_formula took for that call at the run's revision.")
    body = [[label, round(row["forward_s"], 5), round(row["backward_s"], 5), round(row["total_s"], 5),
             float(f"{row.get('max_abs_vs_padded', row.get('max_abs_vs_plugin')):.3g}")]
            for label, row in rows.items()]
    return {"id": ATTENTION_TABLE_ID, "title": "Arm J's attention backward formulas on one layer's calls",
            "columns": ["call: formula", "forward s", "backward s", "total s", "max |out - padded entries'|"],
            "rows": body, "reference": None, "random_init": False,
            "notes": notes}


def document(results: dict, params: dict, env: dict, attention: dict | None = None) -> dict:
    """The result document: ``T16-armJ-pieces``, ``T16-armJ-backward`` where arm J's row has its breakdown, and
    ``T16-armJ-attention`` where ``attention`` (:func:`attention_formula_rows`) is given."""
    backward = backward_table(results)
    doc = {"benchmark": "arm_j_pieces", "schema_version": 1, "env": env, "params": params, "results": results,
           "tables": [table(results)] + ([backward] if backward is not None else [])}
    if attention:
        doc["attention_formulas"] = attention
        doc["tables"].append(attention_table(attention))
    return doc


def _batch(model: str, rows: int, tokens: int, device: Any) -> tuple:
    import torch
    from transformers import AutoTokenizer

    from benchmarks._lib.logprobs import teacher_forced_batch
    from bloggap_plugin.tasks import get_task, prompt_token_ids

    tokenizer = AutoTokenizer.from_pretrained(model)
    dataset, _ = get_task("arith", tokenizer, seed=0)
    prompts = [prompt_token_ids(dataset[i]["prompt"], tokenizer) for i in range(rows)]
    completion = torch.randint(5, len(tokenizer), (rows, tokens), generator=torch.Generator().manual_seed(0))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return teacher_forced_batch(prompts, completion, pad, device)


def cmd_run(args: argparse.Namespace) -> int:
    for key, value in PROCESS_ENV.items():
        os.environ.setdefault(key, value)
    import torch
    from transformers import AutoModelForCausalLM

    from bloggap_plugin.core.vllm.form import parse_form
    from bloggap_plugin.core.vllm.kernels import load_kernels
    from bloggap_plugin.envinfo import environment_record

    device = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    policy = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).train()
    ids, mask = _batch(args.model, args.rows, args.tokens, device)
    params = {"model": "<SmolLM2 dense folder>", "task": "arith", "rows": args.rows, "tokens": args.tokens,
              "width": ids.shape[1], "repeats": args.repeats, "revision": args.revision,
              "process_env": {k: os.environ.get(k) for k in PROCESS_ENV}}
    results: dict = {"arm A": measure_arm_a(policy, ids, mask, args.tokens, args.repeats, device)}
    env = environment_record(device)
    labels = list(FORMS) if args.forms is None else args.forms.split(",")
    for label in labels:
        spec = FORMS[label]
        started = time.perf_counter()
        try:
            kernels = load_kernels(parse_form(spec), device)
            results[label] = measure_form(policy, ids, mask, args.tokens, spec, kernels, args.repeats, device,
                                          by_piece=spec == "all")
        except Exception as error:  # a form that fails is recorded, the others still run
            results[label] = {"pieces": spec, "error": f"{type(error).__name__}: {error}"[:2000]}
        print(label, f"{time.perf_counter() - started:.1f} s", {k: v for k, v in results[label].items()
                                                                   if k != "backward_by_piece"}, flush=True)
        _write(out, results, params, env)
    attention = attention_formula_rows(policy, ids, mask, args.tokens, device, args.repeats)
    print("attention formulas", attention, flush=True)
    _write(out, results, params, env, attention)
    return 0


def _write(out: Path, results: dict, params: dict, env: dict, attention: dict | None = None) -> None:
    ok = {k: v for k, v in results.items() if "error" not in v}
    doc = document(ok, {**params, "errors": {k: v for k, v in results.items() if "error" in v}}, env, attention)
    atomic_write_text(out / RESULT_NAME, json.dumps(doc, indent=1) + "\n")


def cmd_document(args: argparse.Namespace) -> int:
    """The committed document from a ``run`` document: its tables rebuilt from its ``results`` (and its attention
    formulas' rows, where it has them) by this code, the machine's paths replaced
    (``benchmarks._lib.publish.strip_paths``)."""
    from benchmarks._lib.publish import strip_paths

    raw = json.loads(Path(args.raw).read_text())
    doc = document(raw["results"], raw["params"], raw["env"], raw.get("attention_formulas"))
    text = strip_paths(json.dumps(doc, indent=1) + "\n", args.model_path, "<SmolLM2 dense folder>")
    atomic_write_text(Path(args.result), text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="measure every form (GPU, vLLM)")
    run.add_argument("--model", required=True)
    run.add_argument("--out", required=True)
    run.add_argument("--rows", type=int, default=8, help="rows of the micro-batch (the recipes' 8)")
    run.add_argument("--tokens", type=int, default=32, help="completion tokens (the recipes' 32)")
    run.add_argument("--repeats", type=int, default=5)
    run.add_argument("--forms", default=None, help=f"comma-separated labels of {list(FORMS)} (default: all)")
    run.add_argument("--revision", default=None, help="the commit that runs (recorded)")
    doc = sub.add_parser("document", help="the committed document from a run's (tables rebuilt, paths replaced)")
    doc.add_argument("raw", help="arm_j_pieces.json as run wrote it")
    doc.add_argument("result", help="where the committed document goes")
    doc.add_argument("--model-path", default="/tmp/vx/smollm2", help="the model folder on the GPU machine")
    args = parser.parse_args(argv)
    return {"run": cmd_run, "document": cmd_document}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
