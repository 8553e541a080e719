"""T15-baseline: a model's starting accuracy on GSM8K test, greedy and sampled at the training temperature.

Issue 15 item 2. Every row of the test split (1,319, or the first ``--limit``), prompted exactly as the gsm8k task
prompts for training (:func:`bloggap_plugin.tasks.task_prompt` of :func:`~bloggap_plugin.tasks.gsm8k.build_messages`,
then the chat template with the generation prompt, as TRL tokenizes it: :func:`~bloggap_plugin.tasks.prompt_token_ids`).
Two decodings, one completion per row and decoding, at most ``--max-tokens`` (256) new tokens:

- greedy (temperature 0);
- sampled at the training temperature (``--temperature`` 1.0, top_p 1, top_k off, min_p 0, as TRL's colocate
  engine samples), seed ``--seed + row index`` per row (vLLM), or ``torch.manual_seed(--seed)`` before each batch
  (``--hf``).

``--decodings greedy`` measures greedy alone (the sampled cells are then absent, and ``results.complete`` counts
the greedy pieces only): the evaluation other scripts run through this one, e.g. :mod:`benchmarks.gsm8k_warmstart`.

Correct = the training reward (:func:`bloggap_plugin.tasks.gsm8k.accuracy_reward`, the last number equals the gold
answer); the strict count (``#### n``) is kept in ``results``. Subsets: all rows, and the rows whose reference solution
has exactly 1 and exactly 2 ``<<...>>`` calculation steps. Interval: Wilson 95% (``core.metrics.wilson_interval``).

Engines: vLLM (default; ``--model`` is an HF model folder, or a spec of :func:`bloggap_plugin.models.load_model` whose
loaded copy lives in a folder, e.g. ``smollm2``, the folder TRL's colocate engine would load) in the checkpoint's dtype
unless ``--dtype``; ``--hf`` uses HF ``generate`` (any ``load_model`` spec, e.g. a tiny random model for a CPU smoke run).

    python -m benchmarks.gsm8k_baseline --model smollm2 --data ../shared/data/gsm8k --out benchmarks/results/h200
    python -m benchmarks.gsm8k_baseline --hf --model tiny-random-llama --data bloggap_plugin/data/gsm8k_sample.jsonl \\
        --limit 4 --max-tokens 16 --device cpu --out /tmp/gb                                   # CPU smoke run, seconds

Output: ``<out>/gsm8k_baseline.json`` (benchmark result schema, table ``T15-baseline``), written atomically after
every piece: the rows are generated greedy first, then sampled, each decoding in the order 1-step rows, 2-step rows,
the rest; after each piece the JSON holds every (subset, decoding) cell whose rows are all generated
(``results.done`` lists the pieces, ``results.complete`` says whether all are), so a run stopped by a time limit keeps
what finished. ``--completions PATH`` also writes every completion so far as JSON lines (``null`` where not yet).
(HF sampling seeds each batch with ``--seed``; batches are drawn within a piece.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks._lib.paths import RESULTS, ROOT

SUBSETS = (("all", None), ("1-step", 1), ("2-step", 2))
"""Subset name and its exact number of calculation steps (``None``: every row)."""
DECODINGS = ("greedy", "sampled")


class BaselineError(ValueError):
    """Bad input, reported as one line before any model loads."""


def parse_decodings(value: str) -> tuple[str, ...]:
    """``"greedy,sampled"`` -> the named decodings in :data:`DECODINGS` order; :class:`BaselineError` for an unknown
    name or none."""
    names = [part.strip() for part in str(value).split(",") if part.strip()]
    unknown = sorted(set(names) - set(DECODINGS))
    if unknown or not names:
        raise BaselineError(f"--decodings {value!r}: give one or more of {', '.join(DECODINGS)}, comma-separated")
    return tuple(name for name in DECODINGS if name in names)


def default_data() -> str | None:
    """``$BLOGGAP_GSM8K_DATA``, else ``../shared/data/gsm8k`` beside the repository if it exists, else ``None``."""
    from bloggap_plugin.tasks.gsm8k import resolve_data

    env = resolve_data(None)
    if env is not None:
        return env
    beside = ROOT.parent / "shared" / "data" / "gsm8k"
    return str(beside) if beside.is_dir() else None


def load_rows(data: str | None, split: str, limit: int | None, calc_steps: str | None = None) -> list[dict]:
    """``[{index, question, gold, calc_steps}]`` for the first ``limit`` rows of ``split`` (file order) that have
    ``calc_steps`` (``N`` or ``LOW-HIGH``, :func:`bloggap_plugin.tasks.gsm8k.parse_calc_steps`; None: every row);
    ``index`` is the row's position in the split."""
    from bloggap_plugin.tasks import gsm8k

    wanted = gsm8k.parse_calc_steps(calc_steps)
    dataset = gsm8k.load_gsm8k(data, split=split)
    rows = [{"index": i, "question": q, "gold": gsm8k.gold_answer(a), "calc_steps": gsm8k.calc_steps(a)}
            for i, (q, a) in enumerate(zip(gsm8k.column(dataset, "question"), gsm8k.column(dataset, "answer")))]
    if wanted is not None:
        rows = [row for row in rows if wanted[0] <= row["calc_steps"] <= wanted[1]]
    return rows if limit is None else rows[:limit]


def build_prompt_ids(rows: list[dict], tokenizer) -> list[list[int]]:
    """Prompt token ids per row, as the gsm8k task and TRL's trainer build them for generation."""
    from bloggap_plugin.tasks import gsm8k, prompt_token_ids, task_prompt

    return [prompt_token_ids(task_prompt(gsm8k.build_messages(row["question"]), tokenizer), tokenizer) for row in rows]


def score(rows: list[dict], completions: dict[str, list[str | None]]) -> dict:
    """Per subset and decoding: ``rows``, ``correct`` (training reward), ``strict_correct``, ``accuracy`` and the
    Wilson 95% interval (fractions); plus the indices of the rows each decoding got right. A completion may be
    ``None`` (not generated yet): a subset's cell of that decoding is then left out until all its rows have one."""
    from bloggap_plugin.core.metrics import wilson_interval
    from bloggap_plugin.tasks import gsm8k

    golds = [row["gold"] for row in rows]
    rewards = {name: [None if text is None else gsm8k.accuracy_reward([text], answer=[gold])[0]
                      for text, gold in zip(texts, golds)] for name, texts in completions.items()}
    strict = {name: [None if text is None else gsm8k.strict_accuracy_reward([text], answer=[gold])[0]
                     for text, gold in zip(texts, golds)] for name, texts in completions.items()}
    subsets = {}
    for subset, steps in SUBSETS:
        members = [i for i, row in enumerate(rows) if steps is None or row["calc_steps"] == steps]
        entry: dict = {"rows": len(members), "calc_steps": steps}
        for name in completions:
            if any(rewards[name][i] is None for i in members):
                continue
            correct = int(sum(rewards[name][i] for i in members))
            low, high = wilson_interval(correct, len(members)) if members else (None, None)
            entry[name] = {"correct": correct, "strict_correct": int(sum(strict[name][i] for i in members)),
                           "accuracy": correct / len(members) if members else None, "ci95": [low, high]}
        subsets[subset] = entry
    right = {name: [rows[i]["index"] for i, r in enumerate(rewards[name]) if r == 1.0] for name in completions}
    return {"subsets": subsets, "correct_rows": right}


def _pct(value: float | None) -> float | None:
    return None if value is None else round(100.0 * value, 2)


def baseline_table(scored: dict, params: dict, random_init: bool) -> dict:
    """Table ``T15-baseline``: one row per subset x decoding."""
    rows = []
    for subset, _ in SUBSETS:
        entry = scored["subsets"][subset]
        for name in DECODINGS:
            cell = entry.get(name)
            if cell is None:  # not generated yet (a run stopped early keeps the cells it finished)
                continue
            rows.append([subset, name if name == "greedy" else f"sampled T={params['temperature']}", entry["rows"],
                         cell["correct"], _pct(cell["accuracy"]), _pct(cell["ci95"][0]), _pct(cell["ci95"][1])])
    notes = (
        f"{params['model']} on GSM8K {params['split']} ({params['rows']} rows{', --limit' if params['limit'] else ''}{', calc steps ' + params['calc_steps'] if params.get('calc_steps') else ''}), "
        f"{params['engine']}, at most {params['max_tokens']} new tokens, the gsm8k task's training prompt (system "
        "prompt asking for '#### <number>', chat template). correct = the training reward (last number equals the "
        "gold answer). "
        + (f"sampled: one completion per row, temperature {params['temperature']}, top_p 1, no top_k/min_p, seed "
           f"{params['seed']}. " if "sampled" in params.get("decodings", DECODINGS) else "greedy only. ")
        + "1-step / 2-step: rows whose reference solution has exactly 1 / 2 <<...>> calculation steps. CI: Wilson 95%."
    )
    return {"id": "T15-baseline", "title": f"GSM8K starting accuracy ({params['model']})",
            "columns": ["subset", "decoding", "rows", "correct", "accuracy %", "CI low %", "CI high %"],
            "rows": rows, "notes": notes, "reference": None, "random_init": random_init, "plot": False}


# ----------------------------------------------------------------------------------------------------- engines


def _vllm_folder(model, spec: str) -> str:
    folder = Path(spec) if Path(spec).is_dir() else Path(getattr(model, "name_or_path", "") or "")
    if not str(folder) or not (folder / "config.json").is_file():
        raise BaselineError(f"--model {spec}: vLLM needs a model folder (config.json inside); give the folder, or use "
                            "--hf for a model that exists only in memory")
    return str(folder)


def vllm_generator(folder: str, prompt_ids: list[list[int]], rows: list[dict], args) -> tuple[Callable, dict]:
    """``(generate, timing)``: ``generate(decoding, indices)`` -> completions of those prompts with one ``vllm.LLM``
    (``prompt_token_ids`` in, text out); sampled rows use seed ``--seed`` + the row's split index."""
    # CUDA may already be initialised in this process (model loading, device checks): vLLM's engine core must then be
    # spawned, not forked (seen on the H200: "Cannot re-initialize CUDA in forked subprocess")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    kwargs = {"gpu_memory_utilization": args.gpu_mem, "seed": args.seed}
    if args.dtype != "auto":
        kwargs["dtype"] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(args.dtype, args.dtype)
    llm = LLM(model=folder, **kwargs)
    timing = {"engine_start_s": round(time.perf_counter() - t0, 2)}

    def params(decoding: str, i: int):
        if decoding == "greedy":
            return SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        return SamplingParams(temperature=args.temperature, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                              max_tokens=args.max_tokens, seed=args.seed + rows[i]["index"])

    def generate(decoding: str, indices: list[int]) -> list[str]:
        outputs = llm.generate([{"prompt_token_ids": prompt_ids[i]} for i in indices],
                               [params(decoding, i) for i in indices], use_tqdm=False)
        return [output.outputs[0].text for output in outputs]

    return generate, timing


def hf_generator(model, tokenizer, prompt_ids: list[list[int]], args) -> tuple[Callable, dict]:
    """``(generate, timing)``: ``generate(decoding, indices)`` -> completions with HF ``generate``
    (:func:`bloggap_plugin.heldout.generate_texts`: left-padded batches of ``--batch-size``; sampled:
    ``torch.manual_seed(--seed)`` before each batch)."""
    from bloggap_plugin.heldout_accuracy import generate_texts
    from bloggap_plugin.sampling import SamplerRecorder

    def generate(decoding: str, indices: list[int]) -> list[str]:
        sample = None if decoding == "greedy" else {**SamplerRecorder.neutral_generation_kwargs(),
                                                     "temperature": args.temperature}
        return generate_texts(model, tokenizer, [prompt_ids[i] for i in indices], args.max_tokens, args.batch_size,
                              sample_kwargs=sample, seed=args.seed)

    return generate, {}


def generation_order(rows: list[dict]) -> list[tuple[str, list[int]]]:
    """The pieces generated one after the other, per decoding: the 1-step rows, the 2-step rows, the rest (each
    ``(name, row positions)``, empty pieces left out), so that a run stopped early keeps whole subsets."""
    pieces = []
    for name, test in (("1-step", lambda s: s == 1), ("2-step", lambda s: s == 2), ("rest", lambda s: s not in (1, 2))):
        members = [i for i, row in enumerate(rows) if test(row["calc_steps"])]
        if members:
            pieces.append((name, members))
    return pieces


# ----------------------------------------------------------------------------------------------------- main


def _check_args(args) -> Path:
    from bloggap_plugin._io import check_writable_dir, check_writable_file
    from bloggap_plugin.models import check_model_spec

    args.decodings = parse_decodings(args.decodings)
    for option, value, low in (("--max-tokens", args.max_tokens, 1), ("--batch-size", args.batch_size, 1),
                               ("--limit", args.limit, 1)):
        if value is not None and value < low:
            raise BaselineError(f"{option} {value}: must be >= {low}")
    if not args.temperature > 0:
        raise BaselineError(f"--temperature {args.temperature}: must be > 0 (greedy is measured anyway)")
    if not 0 < args.gpu_mem <= 1:
        raise BaselineError(f"--gpu-mem {args.gpu_mem}: must be a fraction in (0, 1]")
    out_dir = Path(args.out) if args.out else None
    if out_dir is not None:
        problem = check_writable_dir(out_dir, "--out")
        if problem:
            raise BaselineError(problem)
    if args.completions:
        problem = check_writable_file(args.completions, "--completions", create_parents=True)
        if problem:
            raise BaselineError(problem)
    check_model_spec(args.model)
    if not args.hf:
        from bloggap_plugin.compare import vllm_unavailable_reason

        problem = vllm_unavailable_reason()
        if problem:
            raise BaselineError(f"{problem}: run on a CUDA machine with vLLM, or add --hf to generate with HF generate")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="HF model folder or load_model spec (default smollm2)")
    parser.add_argument("--data", default=None, help="GSM8K folder or file (default: $BLOGGAP_GSM8K_DATA, else "
                                                     "../shared/data/gsm8k beside the repository)")
    parser.add_argument("--split", default="test")
    parser.add_argument("--limit", type=int, default=None, help="only the first N rows (default: all)")
    parser.add_argument("--calc-steps", default=None, metavar="N|LOW-HIGH",
                        help="only the rows whose reference solution has N (or LOW-HIGH) <<...>> steps (default: all)")
    parser.add_argument("--max-tokens", type=int, default=256, help="new tokens per completion (default 256)")
    parser.add_argument("--temperature", type=float, default=1.0, help="the training temperature (default 1.0)")
    parser.add_argument("--decodings", default=",".join(DECODINGS),
                        help="which decodings to measure, comma-separated (default greedy,sampled)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf", action="store_true", help="HF generate instead of vLLM (e.g. a CPU smoke run)")
    parser.add_argument("--device", default=None, help="--hf: cpu or cuda (default: cuda if available)")
    parser.add_argument("--dtype", default="auto", help="vLLM: the checkpoint's (auto); --hf: auto means bf16")
    parser.add_argument("--batch-size", type=int, default=64, help="--hf: prompts per generate call")
    parser.add_argument("--gpu-mem", type=float, default=0.5, help="vLLM gpu_memory_utilization (default 0.5)")
    parser.add_argument("--out", default=None, help="output folder (default benchmarks/results/<device>)")
    parser.add_argument("--completions", default=None, help="also write every completion here (JSON lines)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from bloggap_plugin.core.errors import UsageError
    from bloggap_plugin.envinfo import device_tag, environment_record
    from bloggap_plugin.models import load_model, resolve_device
    from bloggap_plugin.results import format_text_table

    t_start = time.perf_counter()
    try:
        out_dir = _check_args(args)
        device = resolve_device(args.device) if args.hf else "cuda"
        data = args.data if args.data is not None else default_data()
        rows = load_rows(data, args.split, args.limit, args.calc_steps)
        hf_dtype = "bf16" if args.dtype == "auto" else args.dtype
        model, tokenizer = load_model(args.model, dtype=hf_dtype, device=device if args.hf else "cpu")
        folder = None if args.hf else _vllm_folder(model, args.model)
    except (UsageError, BaselineError) as err:
        print(f"gsm8k_baseline: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    out_dir = out_dir or RESULTS / device_tag(device)
    prompt_ids = build_prompt_ids(rows, tokenizer)
    if args.hf:
        generate, timing = hf_generator(model, tokenizer, prompt_ids, args)
    else:
        del model
        generate, timing = vllm_generator(folder, prompt_ids, rows, args)
    params = {"model": args.model, "model_folder": folder, "data": data or "openai/gsm8k", "split": args.split,
              "limit": args.limit, "calc_steps": args.calc_steps, "rows": len(rows), "engine": "HF generate" if args.hf else "vLLM",
              "dtype": args.dtype if not args.hf else hf_dtype, "max_tokens": args.max_tokens,
              "decodings": list(args.decodings), "temperature": args.temperature, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": args.seed,
              "batch_size": args.batch_size if args.hf else None, "gpu_mem": None if args.hf else args.gpu_mem,
              "reward": "lenient (last number), the gsm8k task's training reward",
              "prompt_tokens_mean": round(sum(map(len, prompt_ids)) / max(1, len(prompt_ids)), 1)}
    env = environment_record(device, model=args.model, engine=params["engine"])
    completions: dict[str, list[str | None]] = {name: [None] * len(rows) for name in args.decodings}
    done: list[str] = []
    for name in args.decodings:  # greedy for every subset first, then sampled: a time limit keeps whole decodings
        for piece, members in generation_order(rows):
            t1 = time.perf_counter()
            for i, text in zip(members, generate(name, members)):
                completions[name][i] = text
            timing[f"{name}_s"] = round(timing.get(f"{name}_s", 0.0) + time.perf_counter() - t1, 2)
            done.append(f"{name}/{piece}")
            document = _document(rows, completions, params, env, timing, done, t_start)
            path = document.write(out_dir / "gsm8k_baseline.json")
            if args.completions:
                _write_completions(args.completions, rows, completions)
    print(format_text_table(document.tables[0]))
    verdict = document.results["verdict"]
    if verdict and verdict["below_5pct"]:
        print(f"[gsm8k_baseline] even the 1-step subset starts below 5% ({100 * verdict['best_accuracy']:.1f}% at best): "
              "the model is too small for GSM8K")
    print(f"[gsm8k_baseline] wrote {path}")
    return 0


def _document(rows: list[dict], completions: dict, params: dict, env: dict, timing: dict, done: list[str],
              t_start: float):
    """The result document of what is generated so far (``results.done``: the decoding/piece pairs finished;
    ``results.complete``: all of them, for the decodings in ``completions``)."""
    from bloggap_plugin.models import TINY_MODELS
    from bloggap_plugin.results import ResultDocument

    scored = score(rows, completions)
    easiest = scored["subsets"]["1-step"]
    verdict = None
    measured = [easiest[name]["accuracy"] for name in DECODINGS if name in easiest]
    if easiest["rows"] and measured:
        best = max(measured)
        verdict = {"easiest_subset": "1-step", "best_accuracy": best, "below_5pct": best < 0.05,
                   "decodings": [name for name in DECODINGS if name in easiest]}
    complete = len(done) == len(completions) * len(generation_order(rows))
    return ResultDocument(
        benchmark="gsm8k_baseline",
        env=env,
        params=params,
        results={**scored, "verdict": verdict, "calc_steps_counts": _histogram(rows), "timing": dict(timing),
                 "wall_s": round(time.perf_counter() - t_start, 2), "done": list(done), "complete": complete},
        tables=[baseline_table(scored, params, random_init=params["model"] in TINY_MODELS)],
    )


def _write_completions(path: str, rows: list[dict], completions: dict) -> None:
    """Every completion generated so far as JSON lines (``null`` where a decoding has not reached the row)."""
    from bloggap_plugin._io import atomic_write_text

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"index": row["index"], "gold": row["gold"], "calc_steps": row["calc_steps"],
                         **{name: completions[name][i] for name in completions}}) for i, row in enumerate(rows)]
    atomic_write_text(path, "\n".join(lines) + "\n")


def _histogram(rows: list[dict]) -> dict[str, int]:
    counts: dict[int, int] = {}
    for row in rows:
        counts[row["calc_steps"]] = counts.get(row["calc_steps"], 0) + 1
    return {str(k): counts[k] for k in sorted(counts)}


if __name__ == "__main__":
    sys.exit(main())
