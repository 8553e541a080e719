"""T18-warmstart: a supervised warm start on GSM8K's train split, then greedy accuracy on the test split before and after.

Issue 33 item 1. One command, seeded, rebuilds the checkpoint in one GPU call (the GPU machine keeps no files):

    python -m benchmarks.gsm8k_warmstart run --model /tmp/vx/smollm2 --model-name SmolLM2-135M-Instruct \\
        --data .dev/gsm8k --out $OUT --ckpt /tmp/vx/smollm2-gsm8k-sft
    python -m benchmarks.gsm8k_warmstart run --smoke --data DIR --out /tmp/ws      # CPU smoke run, tiny model
    python -m benchmarks.gsm8k_warmstart hash CHECKPOINT_DIR                        # the checkpoint's sha256

Phases, the result document rewritten after each (and at every logged training step), so a time limit keeps what
finished (``results.done``, ``results.complete``):

1. ``data``: every row of the train split (or the first ``--train-limit``) becomes one prompt-completion example:
   the prompt is the gsm8k task's (:func:`bloggap_plugin.tasks.task_prompt` of
   :func:`~bloggap_plugin.tasks.gsm8k.build_messages`), the completion the reference solution as an assistant turn
   (:func:`~bloggap_plugin.tasks.gsm8k.worked_solution`: ``<<...>>`` calculator marks removed, final line
   ``#### <gold>``). Checked before any model loads, and the run stops (exit 3) on a failure: every target earns
   reward 1.0 from both gsm8k reward functions; no test question (the whole test split, whatever ``--eval-limit``)
   equals a training question or is a substring of a training example's text (:func:`decontamination`).
2. ``before``: greedy accuracy of ``--model`` on the test split, by :mod:`benchmarks.gsm8k_baseline`
   (``--decodings greedy``; vLLM in a subprocess, or HF ``generate`` in this process with ``--hf``), its document
   and completions under ``<out>/eval_before/`` (``--before-from DOC``: an earlier run's evaluation with the same
   settings stands for it, :func:`reused_evaluation`).
3. ``train``: TRL's ``SFTTrainer`` (conversational prompt-completion data, loss on the completion tokens only,
   fp32 weights with bf16 autocast by default, AdamW, cosine schedule with warm-up, no gradient checkpointing,
   seeded); the loss curve of every logging step. The trainer's own tokenization is then checked row by row
   (:func:`format_check`): the prompt's token ids are exactly those the evaluation and TRL's GRPO generate from, the
   labels mask them and keep every completion token, the end-of-turn token included.
4. ``checkpoint``: the trained model and tokenizer saved to ``--ckpt`` (default ``<out>/checkpoint``; on the GPU
   machine put it outside ``$OUT``, which returns at most 8 files), and :func:`checkpoint_sha256`.
5. ``after``: greedy accuracy of the checkpoint, as in 2, under ``<out>/eval_after/``.

``--eval-split validation`` (the way a setting is chosen, :mod:`benchmarks.gsm8k_warmstart_publish` ``select``):
training takes its rows from ``train_minus_validation`` (train without the fixed validation rows,
:func:`bloggap_plugin.tasks.gsm8k.validation_rows`), both evaluations score the validation split, and the data
check also refuses a validation question in the training examples. ``--eval-split test`` (the default) trains on the
whole train split and scores test, as the published runs did.

Output: ``<out>/gsm8k_warmstart.json`` (benchmark result schema; tables ``T18-warmstart`` and
``T18-warmstart-curve``, built by :func:`table` and :func:`curve_table` from ``results`` and ``params``). Exit 0 when
every phase finished, 2 on bad input (one line, before any model loads), 3 when the data checks refuse, 1 when an
evaluation failed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from bisect import bisect_right
from pathlib import Path

from benchmarks._lib.paths import ROOT
from bloggap_plugin.checkpoint import HASH_DEFINITION, checkpoint_sha256, file_sha256

TABLE_ID = "T18-warmstart"
CURVE_TABLE_ID = "T18-warmstart-curve"
DOCUMENT = "gsm8k_warmstart.json"
PHASES = ("data", "before", "train", "checkpoint", "after")
EVAL_SPLITS = {"test": "train", "validation": "train_minus_validation"}
"""``--eval-split`` -> the split the training rows come from (never one holding an evaluated row)."""
EVALUATIONS = (("before", "eval_before"), ("after", "eval_after"))
"""(phase, sub-folder of ``--out`` holding that evaluation's gsm8k_baseline document and completions)."""
SUBSETS = ("all", "1-step", "2-step")

GPU_DEFAULTS = {"model": "smollm2", "hf": False, "device": None, "precision": "bf16", "train_limit": None,
                "epochs": 3.0, "max_steps": None, "lr": 5e-5, "batch": 64, "grad_accum": 1, "logging_steps": 5,
                "warmup": 0.03, "max_length": 1024, "eval_limit": None, "max_tokens": 256, "eval_batch_size": 64,
                "eval_dtype": "auto", "eval_split": "test"}
"""Settings of a real run: 3 epochs over 7,473 rows at 64 rows a step (351 optimizer steps), lr 5e-5."""
SMOKE_DEFAULTS = {**GPU_DEFAULTS, "model": "tiny-random-llama", "hf": True, "device": "cpu", "precision": "fp32",
                  "train_limit": 8, "max_steps": 3, "batch": 2, "logging_steps": 1, "eval_limit": 4,
                  "max_tokens": 16, "eval_batch_size": 4, "eval_dtype": "fp32"}
"""``--smoke``: a tiny random model on CPU, 8 training rows, 3 steps, 4 test rows x 16 new tokens (seconds)."""


class WarmstartError(ValueError):
    """Bad input, reported as one line before any model loads."""


class Refused(RuntimeError):
    """A data check failed: the run stops before training (exit 3). ``details``: what the check found, for the
    result document."""

    def __init__(self, message: str, details: dict | None = None) -> None:
        super().__init__(message)
        self.details = details


# ----------------------------------------------------------------------------------------------------- data


def load_train_rows(data: str | None, limit: int | None, split: str = "train") -> list[dict]:
    """``[{index, question, answer, gold}]`` for the first ``limit`` rows of ``split`` (``train`` or
    ``train_minus_validation``; file order; ``index``: the row's position in ``split``)."""
    from bloggap_plugin.tasks import gsm8k

    dataset = gsm8k.load_gsm8k(data, split=split)
    rows = [{"index": i, "question": q, "answer": a, "gold": gsm8k.gold_answer(a)}
            for i, (q, a) in enumerate(zip(gsm8k.column(dataset, "question"), gsm8k.column(dataset, "answer")))]
    return rows if limit is None else rows[:limit]


def load_test_questions(data: str | None, split: str = "test") -> list[str]:
    """Every question of ``split`` (the test split by default; the decontamination check reads all of them)."""
    from bloggap_plugin.tasks import gsm8k

    return gsm8k.column(gsm8k.load_gsm8k(data, split=split), "question")


def training_example(question: str, answer: str, tokenizer=None) -> dict:
    """One SFT example: ``{"prompt", "completion"}``. The prompt is the gsm8k task's for ``tokenizer``
    (:func:`~bloggap_plugin.tasks.task_prompt` of :func:`~bloggap_plugin.tasks.gsm8k.build_messages`: the system
    prompt and the question, as messages; plain text for a tokenizer without a chat template); the completion is
    :func:`~bloggap_plugin.tasks.gsm8k.worked_solution` of ``answer``, as one assistant message (plain text with a
    plain-text prompt)."""
    from bloggap_plugin.tasks import gsm8k, task_prompt

    prompt = task_prompt(gsm8k.build_messages(question), tokenizer)
    target = gsm8k.worked_solution(answer)
    completion = target if isinstance(prompt, str) else [{"role": "assistant", "content": target}]
    return {"prompt": prompt, "completion": completion}


def example_text(example: dict) -> str:
    """Everything a training example shows the model, as one text (the contents of its messages, in order)."""
    parts = []
    for part in (example["prompt"], example["completion"]):
        parts += [part] if isinstance(part, str) else [message["content"] for message in part]
    return "\n".join(parts)


def example_question(example: dict) -> str:
    """The user turn of a training example's prompt (the whole prompt when it is plain text)."""
    prompt = example["prompt"]
    if isinstance(prompt, str):
        return prompt
    return "\n".join(message["content"] for message in prompt if message["role"] == "user")


def normalise(text: str) -> str:
    """Whitespace runs collapsed to one space, ends stripped, case folded: the form the decontamination compares."""
    return " ".join(text.split()).casefold()


def decontamination(examples: list[dict], test_questions: list[str], shown: int = 5) -> dict:
    """Whether any test question is in what the model is trained on, after :func:`normalise`.

    ``exact``: test questions equal to a training example's question (its user turn); ``substring``: test questions
    found inside a training example's whole text (:func:`example_text`: system prompt, question and target), which
    covers ``exact``. ``contaminated`` is true when either is non-zero; ``matches`` lists the first ``shown`` as
    ``{"test": index in the test split, "train": index of the training example, "kind"}``.
    """
    questions = {}
    for i, example in enumerate(examples):
        questions.setdefault(normalise(example_question(example)), i)
    texts = [normalise(example_text(example)) for example in examples]
    joined = "\x00".join(texts)  # one search per test question; \x00 never occurs in a normalised text
    starts, offset = [], 0
    for text in texts:
        starts.append(offset)
        offset += len(text) + 1
    exact = substring = 0
    matches = []
    for t, question in enumerate(test_questions):
        needle = normalise(question)
        where = joined.find(needle)
        if needle in questions:
            exact += 1
            matches.append({"test": t, "train": questions[needle], "kind": "exact"})
        if where >= 0:
            substring += 1
            if needle not in questions:
                matches.append({"test": t, "train": bisect_right(starts, where) - 1, "kind": "substring"})
    return {"test_questions": len(test_questions), "train_examples": len(examples), "exact": exact,
            "substring": substring, "contaminated": bool(exact or substring), "matches": matches[:shown],
            "normalisation": "whitespace runs -> one space, ends stripped, case folded"}


def target_rewards(rows: list[dict], examples: list[dict]) -> dict:
    """How many training targets earn reward 1.0 from the gsm8k task's reward functions against their gold answer
    (lenient: the training reward; strict: ``#### n``); ``failing``: the first few train indices that do not."""
    from bloggap_plugin.tasks import gsm8k

    targets = [example["completion"] for example in examples]
    golds = [row["gold"] for row in rows]
    lenient = gsm8k.accuracy_reward(targets, answer=golds)
    strict = gsm8k.strict_accuracy_reward(targets, answer=golds)
    failing = [row["index"] for row, a, b in zip(rows, lenient, strict) if a != 1.0 or b != 1.0]
    return {"rows": len(rows), "lenient_full_reward": int(sum(lenient)), "strict_full_reward": int(sum(strict)),
            "all_full_reward": not failing, "failing": failing[:5]}


def data_file_hashes(data: str | None, split: str) -> dict[str, str] | None:
    """``{file name: sha256}`` of the local files the loader reads for ``split`` (``None`` for the hub)."""
    from bloggap_plugin.tasks.gsm8k import resolve_data

    local = resolve_data(data)
    if local is None:
        return None
    path = Path(local)
    if path.is_dir() and (path / f"{split}.jsonl").is_file():
        files = [path / f"{split}.jsonl"]
    elif path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (".parquet", ".jsonl", ".json",
                                                                                   ".arrow"))
        files = [p for p in found if p.name.startswith(split)] or found
    else:
        files = [path]
    return {str(p.relative_to(path)) if path.is_dir() else p.name: file_sha256(p) for p in files}


# ----------------------------------------------------------------------------------------------------- checkpoint


def checkpoint_files(folder: str | os.PathLike) -> dict[str, dict]:
    """``{name: {"bytes", "sha256"}}`` of every file at the top of ``folder``."""
    folder = Path(folder)
    return {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
            for p in sorted(folder.iterdir()) if p.is_file()}


# ----------------------------------------------------------------------------------------------------- training


def sft_config(args, output_dir: str, device: str):
    """TRL's ``SFTConfig`` of the run (every choice explicit, so a TRL default that moves does not move the run)."""
    from trl import SFTConfig

    return SFTConfig(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        num_train_epochs=args.epochs,
        max_steps=args.max_steps if args.max_steps is not None else -1,
        lr_scheduler_type="cosine",
        warmup_steps=args.warmup,  # a float in [0, 1): a share of the optimizer steps
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        logging_steps=args.logging_steps,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=args.seed,
        data_seed=args.seed,
        bf16=args.precision == "bf16",
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=device == "cpu",
        dataloader_num_workers=0,
        completion_only_loss=True,
        assistant_only_loss=False,
        packing=False,
        max_length=args.max_length,
        shuffle_dataset=False,
        dataset_num_proc=None,
    )


def format_check(prepared, examples: list[dict], tokenizer, max_length: int | None) -> dict:
    """Row by row, the trainer's tokenized examples (``prepared``: its ``train_dataset``, in the order of
    ``examples``) against the prompt token ids the gsm8k task's generation uses
    (:func:`~bloggap_plugin.tasks.prompt_token_ids`, as gsm8k_baseline and TRL's GRPO build them).

    Counts the rows whose ``input_ids`` start with exactly those ids (``prompt_prefix``), whose labels are -100 on
    the prompt and equal ``input_ids`` on every later token (``labels_completion_only``), whose completion holds the
    tokenizer's end-of-turn token (``completion_has_eos``), and that ``max_length`` may have cut
    (``at_max_length``). ``ok``: the row counts agree and every row passes the first three. ``example``: row 0's
    completion, decoded."""
    from bloggap_plugin.tasks import prompt_token_ids

    eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    counts = {"rows": len(prepared), "examples": len(examples), "prompt_prefix": 0, "labels_completion_only": 0,
              "completion_has_eos": 0, "at_max_length": 0}
    first = None
    for i, (row, example) in enumerate(zip(prepared, examples)):
        prompt = prompt_token_ids(example["prompt"], tokenizer)
        ids, labels = list(row["input_ids"]), list(row["labels"])
        n = len(prompt)
        counts["prompt_prefix"] += ids[:n] == prompt
        counts["labels_completion_only"] += (len(ids) > n and all(x == -100 for x in labels[:n])
                                             and labels[n:] == ids[n:])
        counts["completion_has_eos"] += eos_id in ids[n:]
        counts["at_max_length"] += max_length is not None and len(ids) >= max_length
        if i == 0:
            first = tokenizer.decode(ids[n:])
    rows = counts["rows"]
    counts["ok"] = (rows == len(examples) and counts["prompt_prefix"] == rows
                    and counts["labels_completion_only"] == rows and counts["completion_has_eos"] == rows)
    counts["example"] = first
    return counts


CURVE_KEYS = ("loss", "grad_norm", "learning_rate", "mean_token_accuracy", "entropy", "num_tokens")
"""What a point of the training curve keeps of a logged step (besides ``step`` and ``epoch``)."""


def curve_callback(curve: list, on_log):
    """A ``TrainerCallback`` appending each logged training step (``{"step", "epoch", *CURVE_KEYS}``) to ``curve``,
    then calling ``on_log()``; log events without a loss (the final summary) are left out."""
    from transformers import TrainerCallback

    class CurveCallback(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if "loss" not in logs:
                return
            point = {"step": state.global_step, "epoch": logs.get("epoch", state.epoch)}
            point.update({key: logs[key] for key in CURVE_KEYS if key in logs})
            curve.append(point)
            on_log()

    return CurveCallback()


def train(args, model_spec: str, rows: list[dict], device: str, curve: list, on_log, check_examples) -> tuple:
    """Fine-tune ``model_spec`` with TRL's ``SFTTrainer`` on the :func:`training_example` of each of ``rows`` for the
    model's tokenizer (``check_examples(examples)`` is called on them first and may raise :class:`Refused`); returns
    ``(trainer, summary)``, the summary holding the trainer's final metrics and :func:`format_check` of its
    tokenized data. ``curve`` gets each logged step; ``on_log()`` is called after each."""
    import datasets
    from trl import SFTTrainer

    from bloggap_plugin.models import load_model

    model, tokenizer = load_model(model_spec, dtype="fp32", device="cpu")
    use_cache = model.config.use_cache  # the Trainer sets it to its args.use_cache (False) for training
    examples = [training_example(row["question"], row["answer"], tokenizer) for row in rows]
    check_examples(examples)
    dataset = datasets.Dataset.from_list(examples)
    output_dir = tempfile.mkdtemp(prefix="gsm8k_warmstart_trainer_")  # the trainer saves nothing (save_strategy no)
    try:
        trainer = SFTTrainer(model=model, args=sft_config(args, output_dir, device), train_dataset=dataset,
                             processing_class=tokenizer, callbacks=[curve_callback(curve, on_log)])
        checked = format_check(trainer.train_dataset, examples, tokenizer, args.max_length)
        if not checked["ok"]:
            counts = {k: v for k, v in checked.items() if k != "example"}
            raise Refused(f"the trainer's tokenized examples are not the gsm8k prompt plus the target: {counts}",
                          checked)
        t0 = time.perf_counter()
        output = trainer.train()
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)
    trainer.model.config.use_cache = use_cache  # the checkpoint generates as the model it started from
    metrics = dict(output.metrics)
    return trainer, {"format_check": checked, "metrics": metrics, "steps": trainer.state.global_step,
                     "train_s": round(time.perf_counter() - t0, 2), "device": str(trainer.args.device)}


# ----------------------------------------------------------------------------------------------------- evaluation


def evaluation_argv(model: str, folder: Path, args, data: str | None) -> list[str]:
    """gsm8k_baseline's arguments for one greedy evaluation of ``model`` on ``args.eval_split``, written to
    ``folder``."""
    argv = ["--model", model, "--split", args.eval_split, "--decodings", "greedy", "--max-tokens", str(args.max_tokens),
            "--seed", str(args.seed), "--dtype", args.eval_dtype, "--out", str(folder),
            "--completions", str(folder / "completions.jsonl")]
    if data is not None:
        argv += ["--data", str(data)]
    if args.eval_limit is not None:
        argv += ["--limit", str(args.eval_limit)]
    if args.hf:
        argv += ["--hf", "--device", args.device, "--batch-size", str(args.eval_batch_size)]
    else:
        argv += ["--gpu-mem", str(args.gpu_mem)]
    return argv


def evaluate(model: str, folder: Path, args, data: str | None) -> dict:
    """Greedy accuracy of ``model`` by :mod:`benchmarks.gsm8k_baseline` (``--hf``: in this process; vLLM: in a
    subprocess, so its engine and GPU memory are gone when it returns) and :func:`evaluation_summary` of its
    document, plus its exit code and wall time."""
    from benchmarks import gsm8k_baseline

    argv = evaluation_argv(model, folder, args, data)
    t0 = time.perf_counter()
    if args.hf:
        code = gsm8k_baseline.main(argv)
    else:
        code = subprocess.call([sys.executable, "-m", "benchmarks.gsm8k_baseline", *argv], cwd=ROOT)
    summary = evaluation_summary(folder / "gsm8k_baseline.json")
    summary.update(exit_code=code, eval_s=round(time.perf_counter() - t0, 2))
    return summary


def reused_evaluation(path: Path, args, test_rows: int) -> dict:
    """``--before-from``: the greedy cells of an earlier run's evaluation of the same model (a gsm8k_baseline
    document, e.g. ``eval_before/gsm8k_baseline.json``), refused with one line unless it finished and was made with
    this run's evaluation settings (split, rows, decoding, token cap, engine, dtype, seed). Which model it evaluated is
    the caller's word: the document names the model as its machine saw it."""
    try:
        payload = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise WarmstartError(f"--before-from {path}: not a readable JSON document ({err.__class__.__name__})") from None
    if payload.get("benchmark") != "gsm8k_baseline":
        raise WarmstartError(f"--before-from {path}: not a gsm8k_baseline document")
    params, results = payload.get("params", {}), payload.get("results", {})
    rows = args.eval_limit if args.eval_limit is not None else test_rows
    wanted = {"split": args.eval_split, "rows": rows, "limit": args.eval_limit, "max_tokens": args.max_tokens,
              "engine": "HF generate" if args.hf else "vLLM", "dtype": args.eval_dtype, "seed": args.seed}
    differ = [f"{key} {params.get(key)!r} (this run: {value!r})" for key, value in wanted.items()
              if params.get(key) != value]
    if "greedy" not in params.get("decodings", []):
        differ.append("no greedy decoding")
    if differ or not results.get("complete"):
        problems = differ + ([] if results.get("complete") else ["it did not finish"])
        raise WarmstartError(f"--before-from {path}: made with other evaluation settings: {'; '.join(problems)}; "
                             "drop --before-from to evaluate the model again")
    return {**evaluation_summary(path), "reused_from": str(path), "exit_code": 0, "eval_s": 0.0}


def evaluation_summary(path: Path) -> dict:
    """The greedy cells of a gsm8k_baseline document (``subsets``: subset -> rows, correct, strict_correct,
    accuracy, ci95), with its settings and progress; ``{"subsets": {}}`` when the file is missing."""
    if not path.is_file():
        return {"subsets": {}, "document": None}
    payload = json.loads(path.read_text())
    subsets = {}
    for name, entry in payload["results"]["subsets"].items():
        if "greedy" in entry:
            subsets[name] = {"rows": entry["rows"], **entry["greedy"]}
    params = payload["params"]
    return {"subsets": subsets, "document": f"{path.parent.name}/{path.name}", "rows": params["rows"],
            "engine": params["engine"], "dtype": params["dtype"], "max_tokens": params["max_tokens"],
            "complete": payload["results"]["complete"], "done": payload["results"]["done"],
            "timing": payload["results"]["timing"]}


# ----------------------------------------------------------------------------------------------------- tables


def _pct(value) -> float | None:
    return None if value is None else round(100.0 * value, 2)


def table(results: dict, params: dict) -> dict:
    """``T18-warmstart``: greedy accuracy before and after the warm start, per subset, from ``results``."""
    rows = []
    for phase, label in (("before", "before"), ("after", "after SFT")):
        subsets = (results.get(phase) or {}).get("subsets", {})
        for subset in SUBSETS:
            cell = subsets.get(subset)
            if cell is not None:
                rows.append([label, subset, cell["rows"], cell["correct"], _pct(cell["accuracy"]),
                             _pct(cell["ci95"][0]), _pct(cell["ci95"][1])])
    data = results.get("data") or {}
    clean = results.get("decontamination") or {}
    train = results.get("train") or {}
    ckpt = results.get("checkpoint") or {}
    evaluation = results.get("after") or results.get("before") or {}
    length = f"{params['max_steps']} optimizer steps" if params["max_steps"] else f"{params['epochs']:g} epochs"
    notes = (
        f"{params['model']} fine-tuned with TRL's SFTTrainer on GSM8K train ({data.get('train_rows', '?')} rows: the "
        "gsm8k task's prompt, the reference solution as the assistant turn with its <<...>> calculator marks removed "
        f"and the final line '#### <gold>'; loss on the completion only), {length} "
        f"({train.get('steps', '?')} done), lr {params['lr']:g} cosine with {params['warmup']:g} warm-up, "
        f"{params['batch']} x {params['grad_accum']} rows per step, {params['precision']}, seed {params['seed']}. "
        f"Greedy accuracy on GSM8K {params.get('eval_split', 'test')} ({evaluation.get('rows', '?')} rows"
        f"{', --eval-limit' if params['eval_limit'] else ''}) by gsm8k_baseline ({evaluation.get('engine', '?')}, at "
        f"most {params['max_tokens']} new tokens); correct = the training reward (last number equals the gold answer); "
        "1-step / 2-step: rows whose reference solution has exactly 1 / 2 calculation steps. CI: Wilson 95%. "
        f"Decontamination: {clean.get('exact', '?')} exact and {clean.get('substring', '?')} substring matches of "
        f"{clean.get('test_questions', '?')} test questions in the training examples. Checkpoint sha256 "
        f"{(ckpt.get('sha256') or '?')[:16]}."
    )
    from bloggap_plugin.models import TINY_MODELS

    return {"id": TABLE_ID, "title": f"GSM8K greedy accuracy before and after a supervised warm start "
                                     f"({params['model']})",
            "columns": ["model", "subset", "rows", "correct", "accuracy %", "CI low %", "CI high %"],
            "rows": rows, "notes": notes, "reference": None, "random_init": params["model_spec"] in TINY_MODELS,
            "plot": False}


def curve_table(results: dict, params: dict) -> dict:
    """``T18-warmstart-curve``: the training loss at every logging step, from ``results['train']['curve']``."""
    from bloggap_plugin.models import TINY_MODELS

    curve = (results.get("train") or {}).get("curve", [])
    rows = [[point["step"], round(point["epoch"], 4) if point.get("epoch") is not None else None,
             round(point["loss"], 5), point.get("learning_rate"), point.get("mean_token_accuracy")] for point in curve]
    plot = ({"kind": "line", "x": "step", "y": ["loss"], "title": "SFT warm start: training loss",
             "ylabel": "loss (completion tokens)"} if rows else False)
    return {"id": CURVE_TABLE_ID, "title": f"Training loss of the GSM8K warm start ({params['model']})",
            "columns": ["step", "epoch", "loss", "learning rate", "mean token accuracy"], "rows": rows,
            "notes": f"Mean loss per completion token over the {params['logging_steps']} optimizer step(s) before each "
                     "row (TRL's logged loss); mean token accuracy: TRL's share of completion tokens whose argmax is "
                     "the target token.",
            "reference": None, "random_init": params["model_spec"] in TINY_MODELS, "plot": plot}


def document(env: dict, params: dict, results: dict):
    """The result document; its tables are :func:`table` and :func:`curve_table` of ``results``."""
    from bloggap_plugin.results import ResultDocument

    return ResultDocument(benchmark="gsm8k_warmstart", env=env, params=params, results=results,
                          tables=[table(results, params), curve_table(results, params)])


# ----------------------------------------------------------------------------------------------------- main


def _resolve(args) -> None:
    """Fill the options left unset from :data:`GPU_DEFAULTS` or, with ``--smoke``, :data:`SMOKE_DEFAULTS`."""
    defaults = SMOKE_DEFAULTS if args.smoke else GPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.smoke:
        args.hf = True


def _check(args) -> tuple[Path, Path, str | None, str]:
    """``(out, ckpt, data, device)`` or :class:`WarmstartError` / :class:`UsageError` with one line."""
    from benchmarks.gsm8k_baseline import default_data
    from bloggap_plugin._io import check_writable_dir
    from bloggap_plugin.models import check_model_spec, resolve_device

    for option, value, low in (("--batch", args.batch, 1), ("--grad-accum", args.grad_accum, 1),
                               ("--logging-steps", args.logging_steps, 1), ("--max-length", args.max_length, 16),
                               ("--max-tokens", args.max_tokens, 1), ("--eval-batch-size", args.eval_batch_size, 1),
                               ("--train-limit", args.train_limit, 1), ("--eval-limit", args.eval_limit, 1),
                               ("--max-steps", args.max_steps, 1)):
        if value is not None and value < low:
            raise WarmstartError(f"{option} {value}: must be >= {low}")
    if not args.epochs > 0:
        raise WarmstartError(f"--epochs {args.epochs}: must be > 0")
    if not 0 < args.lr < 1:
        raise WarmstartError(f"--lr {args.lr}: must be in (0, 1)")
    if not 0 <= args.warmup < 1:
        raise WarmstartError(f"--warmup {args.warmup}: a share of the steps in [0, 1)")
    if args.precision not in ("bf16", "fp32"):
        raise WarmstartError(f"--precision {args.precision}: bf16 (autocast over fp32 weights) or fp32")
    if not 0 < args.gpu_mem <= 1:
        raise WarmstartError(f"--gpu-mem {args.gpu_mem}: must be a fraction in (0, 1]")
    out = Path(args.out)
    problem = check_writable_dir(out, "--out")
    if problem:
        raise WarmstartError(problem)
    ckpt = Path(args.ckpt) if args.ckpt else out / "checkpoint"
    if ckpt.exists() and (not ckpt.is_dir() or any(ckpt.iterdir())):
        raise WarmstartError(f"--ckpt {ckpt} exists and is not an empty folder: remove it or choose another")
    check_model_spec(args.model)
    if args.hf:
        args.device = resolve_device(args.device)
        device = args.device
    else:
        from bloggap_plugin.compare import vllm_unavailable_reason

        problem = vllm_unavailable_reason()
        if problem:
            raise WarmstartError(f"{problem}: run on a CUDA machine with vLLM, or add --hf to evaluate with HF "
                                 "generate (or --smoke)")
        device = resolve_device(args.device)
    data = args.data if args.data is not None else default_data()
    return out, ckpt, data, device


def _params(args, data: str | None, ckpt: Path, device: str) -> dict:
    return {"model": args.model_name or args.model, "model_spec": args.model, "data": data or "openai/gsm8k",
            "smoke": args.smoke, "train_limit": args.train_limit, "epochs": args.epochs, "max_steps": args.max_steps,
            "lr": args.lr, "lr_scheduler": "cosine", "warmup": args.warmup, "weight_decay": 0.0,
            "max_grad_norm": 1.0, "optimizer": "adamw_torch", "batch": args.batch, "grad_accum": args.grad_accum,
            "logging_steps": args.logging_steps, "max_length": args.max_length, "precision": args.precision,
            "seed": args.seed, "device": device, "completion_only_loss": True, "gradient_checkpointing": False,
            "target": "gsm8k.worked_solution: <<...>> calculator marks removed, final line '#### <gold>'",
            "eval_engine": "HF generate" if args.hf else "vLLM", "eval_dtype": args.eval_dtype,
            "eval_limit": args.eval_limit, "max_tokens": args.max_tokens, "checkpoint_dir": str(ckpt),
            "eval_split": args.eval_split, "train_split": EVAL_SPLITS[args.eval_split],
            **({"before_from": args.before_from} if args.before_from is not None else {})}


def run(args) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from bloggap_plugin.core.errors import UsageError
    from bloggap_plugin.envinfo import environment_record
    from bloggap_plugin.results import format_text_table

    t_start = time.perf_counter()
    _resolve(args)
    try:
        out, ckpt, data, device = _check(args)
        rows = load_train_rows(data, args.train_limit, EVAL_SPLITS[args.eval_split])
        test_questions = load_test_questions(data)
        validation = load_test_questions(data, "validation") if args.eval_split == "validation" else None
        evaluated = len(test_questions) if validation is None else len(validation)
        reused = None if args.before_from is None else reused_evaluation(Path(args.before_from), args, evaluated)
    except (UsageError, WarmstartError) as err:
        print(f"gsm8k_warmstart: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    params = _params(args, data, ckpt, device)
    env = environment_record(device, model=params["model"], engine=params["eval_engine"])
    results: dict = {"done": [], "complete": False, "timing": {}}
    path = out / DOCUMENT

    def write() -> None:
        results["wall_s"] = round(time.perf_counter() - t_start, 2)
        document(env, params, results).write(path)

    def phase_done(name: str, t0: float) -> None:
        results["timing"][f"{name}_s"] = round(time.perf_counter() - t0, 2)
        results["done"].append(name)
        results["complete"] = results["done"] == list(PHASES)
        write()

    # 1. data (read above): examples, reward of every target, decontamination
    t0 = t_start
    examples = [training_example(row["question"], row["answer"]) for row in rows]
    results["data"] = {"train_rows": len(rows), "test_questions": len(test_questions),
                       "files": {"train": data_file_hashes(data, "train"), "test": data_file_hashes(data, "test")},
                       "targets": target_rewards(rows, examples)}
    results["decontamination"] = decontamination(examples, test_questions)
    if validation is not None:
        results["data"]["validation_questions"] = len(validation)
        results["decontamination_validation"] = decontamination(examples, validation)
    problems = []
    for key, split in (("decontamination", "test"), ("decontamination_validation", "validation")):
        clean = results.get(key)
        if clean and clean["contaminated"]:
            problems.append(f"{clean['substring']} {split} question(s) appear in the training examples "
                            f"({clean['exact']} exactly), e.g. {clean['matches'][:2]}")
    if not results["data"]["targets"]["all_full_reward"]:
        problems.append(f"training targets that the gsm8k reward does not score 1.0: rows "
                        f"{results['data']['targets']['failing']}")
    if problems:
        write()
        print(f"gsm8k_warmstart: refused before training: {'; '.join(problems)}", file=sys.stderr)
        return 3
    phase_done("data", t0)

    # 2. greedy accuracy of the model as given
    t0 = time.perf_counter()
    results["before"] = reused if reused is not None else evaluate(args.model, out / "eval_before", args, data)
    if results["before"]["exit_code"] == 0:
        phase_done("before", t0)
    else:
        write()  # training goes on: the checkpoint is what later steps need

    # 3. supervised fine-tuning
    t0 = time.perf_counter()
    results["train"] = {"curve": []}
    def check_examples(final: list[dict]) -> None:
        if final == examples:  # the tokenizer has a chat template: the examples checked above
            return
        again = results["decontamination_plain_text"] = decontamination(final, test_questions + (validation or []))
        if again["contaminated"]:
            raise Refused(f"{again['substring']} test or validation question(s) appear in the plain-text training "
                          "examples")

    try:
        trainer, summary = train(args, args.model, rows, device, results["train"]["curve"], write, check_examples)
    except Refused as err:
        results["train"]["format_check"] = err.details
        write()
        print(f"gsm8k_warmstart: refused: {err}", file=sys.stderr)
        return 3
    results["train"].update(summary)
    phase_done("train", t0)

    # 4. the checkpoint and its hash
    t0 = time.perf_counter()
    trainer.model.save_pretrained(ckpt)
    trainer.processing_class.save_pretrained(ckpt)
    results["checkpoint"] = {"sha256": checkpoint_sha256(ckpt), "files": checkpoint_files(ckpt),
                             "definition": HASH_DEFINITION}
    del trainer
    gc.collect()
    _empty_cuda_cache()
    phase_done("checkpoint", t0)

    # 5. greedy accuracy of the checkpoint
    t0 = time.perf_counter()
    results["after"] = evaluate(str(ckpt), out / "eval_after", args, data)
    before, after = (results[p]["subsets"].get("all") for p in ("before", "after"))
    if before and after and before["rows"] == after["rows"]:
        results["change"] = {"correct": after["correct"] - before["correct"],
                             "accuracy": after["accuracy"] - before["accuracy"]}
    if results["after"]["exit_code"] == 0:
        phase_done("after", t0)
    else:
        write()
    print(format_text_table(table(results, params)))
    print(f"[gsm8k_warmstart] checkpoint {ckpt} sha256 {results['checkpoint']['sha256']}")
    print(f"[gsm8k_warmstart] wrote {path}")
    return 0 if results["complete"] else 1


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def command_line() -> argparse.ArgumentParser:
    """The command line: ``run`` and ``hash``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    go = commands.add_parser("run", help="train, evaluate before and after, write gsm8k_warmstart.json")
    go.add_argument("--model", default=None, help="model folder or load_model spec (default smollm2; --smoke: "
                                                  "tiny-random-llama)")
    go.add_argument("--model-name", default=None, help="the model's name in the document (default: --model)")
    go.add_argument("--data", default=None, help="GSM8K folder with train and test files (default: "
                                                 "$BLOGGAP_GSM8K_DATA, else ../shared/data/gsm8k)")
    go.add_argument("--out", required=True, help="output folder (the document, eval_before/, eval_after/)")
    go.add_argument("--ckpt", default=None, help="where the trained checkpoint goes (default <out>/checkpoint; "
                                                 "must not exist or be empty)")
    go.add_argument("--smoke", action="store_true", help="CPU smoke run: tiny random model, a few rows and steps")
    go.add_argument("--epochs", type=float, default=None, help="passes over the training rows (default 3)")
    go.add_argument("--max-steps", type=int, default=None, help="optimizer steps, overriding --epochs")
    go.add_argument("--lr", type=float, default=None, help="peak learning rate (default 5e-5)")
    go.add_argument("--batch", type=int, default=None, help="rows per device batch (default 64)")
    go.add_argument("--grad-accum", type=int, default=None, help="batches per optimizer step (default 1)")
    go.add_argument("--warmup", type=float, default=None, help="warm-up share of the steps (default 0.03)")
    go.add_argument("--logging-steps", type=int, default=None, help="steps between curve points (default 5)")
    go.add_argument("--max-length", type=int, default=None, help="token cap per example (default 1024)")
    go.add_argument("--precision", default=None, help="bf16 (autocast over fp32 weights; default) or fp32")
    go.add_argument("--seed", type=int, default=0)
    go.add_argument("--before-from", default=None, help="an earlier run's eval_before/gsm8k_baseline.json of the "
                    "same model and evaluation settings: its accuracy stands for phase 2 (no evaluation)")
    go.add_argument("--eval-split", default=None, choices=sorted(EVAL_SPLITS), help="the split both evaluations "
                    "score: test (default; training on all of train) or validation (training on train without it: "
                    "how a setting is chosen)")
    go.add_argument("--train-limit", type=int, default=None, help="only the first N training rows")
    go.add_argument("--eval-limit", type=int, default=None, help="only the first N evaluated rows (default: all)")
    go.add_argument("--max-tokens", type=int, default=None, help="new tokens per test completion (default 256)")
    go.add_argument("--hf", action="store_true", default=None, help="evaluate with HF generate, not vLLM")
    go.add_argument("--device", default=None, help="--hf: cpu or cuda (default: cuda if available)")
    go.add_argument("--eval-dtype", default=None, help="evaluation dtype (vLLM: auto, the checkpoint's)")
    go.add_argument("--eval-batch-size", type=int, default=None, help="--hf: prompts per generate call")
    go.add_argument("--gpu-mem", type=float, default=0.5, help="vLLM gpu_memory_utilization (default 0.5)")
    digest = commands.add_parser("hash", help="print a checkpoint folder's sha256 (checkpoint_sha256)")
    digest.add_argument("folder")
    return parser


SETTING_KEYS = ("model", "lr", "epochs", "max_steps", "batch", "grad_accum", "warmup", "max_length", "precision",
                "seed", "train_limit", "eval_split", "eval_limit", "max_tokens")
"""The ``params`` of a run document that a declared setting fixes (:func:`setting_params`)."""


def setting_params(arguments: list[str]) -> dict:
    """What the ``run`` arguments ``arguments`` set of :data:`SETTING_KEYS`, defaults filled as a run fills them
    (``--model`` as the document's ``model_spec``: left out, it is not compared). Raises :class:`WarmstartError`
    for arguments ``run`` does not take."""
    try:
        args = command_line().parse_args(["run", "--out", "unused", *arguments])
    except SystemExit:
        raise WarmstartError(f"{' '.join(arguments)!r}: not arguments of gsm8k_warmstart run") from None
    given_model = args.model is not None
    _resolve(args)
    params = {key: getattr(args, key) for key in SETTING_KEYS}
    if not given_model:
        del params["model"]
    return params


def main(argv: list[str] | None = None) -> int:
    args = command_line().parse_args(argv)
    if args.command == "hash":
        try:
            print(checkpoint_sha256(args.folder))
        except FileNotFoundError as err:
            print(f"gsm8k_warmstart: {err}", file=sys.stderr)
            return 2
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
