"""GPU run of the reward comparison (issue 8 item 4): SmolLM2 on the arithmetic task, arms A-G x 2 seeds.

    python -m benchmarks.compare_gpu --out benchmarks/results/h200            # H200, ~5-8 min
    python -m benchmarks.compare_gpu --out /tmp/cg --quick                    # CPU smoke run, < 60 s on a quiet machine

Steps: (1) the starting accuracy of the model at the chosen difficulty (sampled at the recipes' temperature 1.0,
128 prompts), so the run is known to start at 20-50% correct; (2) ``bloggap compare`` over recipes/arm_{A..G}.yaml
with ``num_iterations: 2`` (old log-probs drive the PPO ratio), 32 completions per generation (4 prompts x 8),
several runs in parallel processes on the one GPU; (3) ``<out>/compare_gpu.json`` (benchmark schema: the T10 table,
gap/* means, the resolution, per-run reward curves in ``results``); logs, compare.md and reward_curves.png under
``<out>/compare_gpu/``. Re-running the same command resumes: finished runs are skipped.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from benchmarks._lib.paths import arm_recipe

NAME = "compare_gpu"


def starting_accuracy(model_spec: str, device: str, difficulty: int, n: int, max_new_tokens: int, batch: int = 64) -> dict:
    """Share of ``n`` arithmetic prompts (seed 99, not a training seed) answered right when sampling at T = 1."""
    import torch

    from bloggap_plugin.models import load_model
    from bloggap_plugin.tasks import get_task

    model, tokenizer = load_model(model_spec, dtype="bf16", device=device)
    dataset, rewards = get_task("arith", tokenizer, seed=99, difficulty=difficulty, n=n)
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in dataset["prompt"]]
    scores: list[float] = []
    torch.manual_seed(0)
    for start in range(0, n, batch):
        encoded = tokenizer(texts[start:start + batch], return_tensors="pt", padding=True).to(device)
        with torch.no_grad():
            out = model.generate(**encoded, max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0, top_p=1.0,
                                 top_k=0)
        completions = tokenizer.batch_decode(out[:, encoded["input_ids"].shape[1]:], skip_special_tokens=True)
        scores += rewards[0]([[{"role": "assistant", "content": c}] for c in completions],
                             answer=dataset["answer"][start:start + batch])
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"n": n, "correct": int(sum(scores)), "accuracy": sum(scores) / n, "difficulty": difficulty,
            "temperature": 1.0, "max_new_tokens": max_new_tokens}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/h200", help="folder for compare_gpu.json (+ compare_gpu/)")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--model", default="smollm2", help="model spec (default smollm2)")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, 2 arms x 1 seed x 2 steps")
    parser.add_argument("--arms", nargs="+", default=list("ABCDEFG"), help="arms (recipes/arm_<X>.yaml)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--max-steps", type=int, default=60, help="optimizer steps per run (default 60)")
    parser.add_argument("--difficulty", type=int, default=2, help="arith level (default 2: 36-44%% sampled on CPU)")
    parser.add_argument("--batch", type=int, default=16, help="per_device_train_batch_size (x grad-accum 2 = rows per generation)")
    parser.add_argument("--parallel", type=int, default=7, help="runs in flight at once on the one GPU (default 7)")
    parser.add_argument("--accuracy-prompts", type=int, default=128, help="prompts for the starting-accuracy check")
    parser.add_argument("--heldout-n", type=int, default=0, help="held-out prompts per run (default 0: none, as the "
                        "recorded run; the decisive sweep is benchmarks/compare_sweep.sh)")
    return parser


def result_tables(args, accuracy: dict, results: dict) -> list[dict]:
    """The starting-accuracy table, then ``bloggap compare``'s tables (only T10 plotted, as bars per arm)."""
    accuracy_table = {
        "id": "start",
        "title": "Starting accuracy of the policy on the task (sampled, temperature 1)",
        "columns": ["model", "difficulty", "prompts", "correct", "accuracy %"],
        "rows": [[args.model, args.difficulty, accuracy["n"], accuracy["correct"], round(100 * accuracy["accuracy"], 2)]],
        "notes": "Arithmetic word problems (bloggap_plugin.tasks.arith), seed 99 (not a training seed), 32 new tokens, "
                 "reward = last number equals the answer. The issue asks for a start between 20 and 50 percent.",
        "reference": None,
        "random_init": args.model.startswith("tiny-random"),
        "plot": False,
    }
    tables = [accuracy_table]
    for table in results["tables"]:
        table = dict(table)
        if table["id"] == "T10":
            table["plot"] = {"kind": "bar", "x": "arm", "y": [table["columns"][2], "reward mean"]}
        elif table["id"] != "T10":
            table["plot"] = False
        tables.append(table)
    return tables


def check_starting_accuracy(args, device: str) -> dict:
    """Measure the starting accuracy and warn (outside ``--quick``) when it is outside 20-50%."""
    start = time.perf_counter()
    print(f"[{NAME}] starting accuracy: {args.accuracy_prompts} prompts, difficulty {args.difficulty}, {device}", flush=True)
    accuracy = starting_accuracy(args.model, device, args.difficulty, args.accuracy_prompts, max_new_tokens=32)
    print(f"[{NAME}] starting accuracy {100 * accuracy['accuracy']:.1f}% ({accuracy['correct']}/{accuracy['n']}) "
          f"in {time.perf_counter() - start:.0f} s", flush=True)
    if not args.quick and not 0.2 <= accuracy["accuracy"] <= 0.5:
        print(f"[{NAME}] WARNING: starting accuracy outside 20-50%; consider --difficulty {args.difficulty + (1 if accuracy['accuracy'] > 0.5 else -1)}")
    return accuracy


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    import torch

    torch.set_num_threads(1 if not torch.cuda.is_available() else min(4, os.cpu_count() or 1))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.quick:
        args.model, args.arms, args.seeds, args.max_steps = "tiny-random-llama", ["A", "G"], [0], 2
        args.parallel, args.accuracy_prompts, args.batch = 2, 8, 4
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the training subprocesses must not pick a GPU either
    out = Path(args.out)
    runs_dir = out / NAME
    out.mkdir(parents=True, exist_ok=True)

    from bloggap_plugin.compare import CompareConfig, print_table, run_compare
    from bloggap_plugin.envinfo import environment_record
    from bloggap_plugin.results import ResultDocument

    start = time.perf_counter()
    accuracy = check_starting_accuracy(args, device)
    overrides = {"num_iterations": 2, "per_device_train_batch_size": args.batch, "gradient_accumulation_steps": 2,
                 "num_generations": 8, "max_completion_length": 32}
    config = CompareConfig(
        recipes=[str(arm_recipe(arm)) for arm in args.arms],
        seeds=args.seeds,
        task="arith",
        difficulty=args.difficulty,
        max_steps=args.max_steps,
        model=args.model,
        output_dir=str(runs_dir),
        parallel=args.parallel,
        extra_overrides=overrides,
        heldout_n=args.heldout_n,
        poll_s=1.0,
    )
    compare_start = time.perf_counter()
    results = run_compare(config)
    compare_s = time.perf_counter() - compare_start
    document = ResultDocument(
        benchmark=NAME,
        env=environment_record(device, model=args.model),
        params={**vars(args), "device": device, "overrides": overrides, "recipes": config.recipes,
                "runs_dir": str(runs_dir)},
        results={
            "starting_accuracy": accuracy,
            "compare_wall_s": compare_s,
            "total_wall_s": time.perf_counter() - start,
            "failed_runs": results.get("failed", {}),
            **{k: v for k, v in results.items() if k not in ("tables", "failed")},
        },
        tables=result_tables(args, accuracy, results),
    )
    path = document.write(out / f"{NAME}.json")
    shutil.copyfile(runs_dir / "reward_curves.png", out / f"{NAME}_reward_curves.png")
    print(f"[{NAME}] wrote {path} and {out / (NAME + '_reward_curves.png')}; sweep {compare_s:.0f} s, "
          f"total {time.perf_counter() - start:.0f} s\n")
    print_table(results)
    return 1 if results.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
