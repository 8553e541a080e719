"""Training tasks for GRPO runs: a prompt dataset plus reward functions.

``get_task(name, tokenizer, ...)`` returns ``(train_dataset, reward_funcs)`` ready for ``GRPOTrainer``:

- ``train_dataset``: a ``datasets.Dataset`` with a ``prompt`` column of conversational prompts (lists of
  ``{"role", "content"}`` messages, so TRL applies the tokenizer's chat template; plain strings when the
  tokenizer has no chat template) and an ``answer`` column (the gold answer as a string);
- ``reward_funcs``: a list of TRL reward functions ``f(completions, answer, **kwargs) -> list[float]``.

Tasks: ``"gsm8k"`` (:mod:`bloggap_plugin.tasks.gsm8k`) and ``"arith"`` (:mod:`bloggap_plugin.tasks.arith`).
"""

from __future__ import annotations

import os

from bloggap_plugin.core.errors import UsageError

__all__ = ["TASKS", "TRAIN_SPLITS", "ARITH_HELDOUT_SEED", "HELDOUT_DEFAULT_N", "get_task", "get_heldout", "task_prompt", "for_tokenizer",
           "prompt_fingerprint", "prompt_token_ids"]

TASKS = ("gsm8k", "arith")

ARITH_HELDOUT_SEED = 2**40 + 15
"""Seed of the arithmetic task's held-out generator: far from any training seed, and its problems are filtered
against the run's training problems anyway (:func:`get_heldout`), so the two sets never share a question."""

HELDOUT_DEFAULT_N = 512
"""Held-out prompts per evaluation by default (GSM8K: fewer when the filtered test split has fewer rows)."""

TRAIN_SPLITS = ("train", "train_minus_validation")
"""GSM8K splits a training set may come from (:func:`get_task`'s ``train_split``)."""

ARITH_TRAIN_N = 1024
"""Prompts of the arithmetic training set when ``n`` is not given."""


def _as_text_prompt(messages: list[dict[str, str]]) -> str:
    # For tokenizers without a chat template: the same content as plain text.
    parts = []
    for message in messages:
        prefix = {"system": "", "user": "Q: ", "assistant": "A: "}.get(message["role"], "")
        parts.append(prefix + message["content"])
    return "\n".join(parts) + "\nA:"


def task_prompt(messages: list[dict[str, str]], tokenizer=None) -> list[dict[str, str]] | str:
    """The ``prompt`` entry :func:`get_task` makes of ``messages`` for ``tokenizer``: the messages themselves when it
    has a chat template (or is ``None``), else the same content as plain text."""
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is not None:
        return messages
    return _as_text_prompt(messages)


def for_tokenizer(dataset, tokenizer):
    """``dataset``, built by :func:`get_task` or :func:`get_heldout` with ``tokenizer=None``, as they build it for
    ``tokenizer``: the same rows, with plain-text prompts when ``tokenizer`` has no chat template (else ``dataset``
    itself). The data are read and checked once, before the model (and so its tokenizer) loads."""
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is not None:
        return dataset
    import datasets

    prompts = [task_prompt(messages, tokenizer) for messages in dataset["prompt"]]
    return datasets.Dataset.from_dict({"prompt": prompts, "answer": dataset["answer"]})


def get_task(
    name: str,
    tokenizer=None,
    seed: int = 0,
    difficulty: int | None = None,
    n: int | None = None,
    data: str | os.PathLike | None = None,
    parser: str = "lenient",
    calc_steps: int | str | tuple[int, int] | None = None,
    reward: str = "accuracy",
    train_split: str | None = None,
):
    """``(train_dataset, reward_funcs)`` for task ``name``.

    Args:
        name: ``"gsm8k"`` or ``"arith"``.
        tokenizer: the policy's tokenizer; prompts are conversational when it has a chat template, plain text
            otherwise. ``None`` means conversational.
        seed: GSM8K: shuffle seed of the training split; arith: generator seed. Same seed, same prompt order.
        difficulty: arith level 1-5 (default :data:`~bloggap_plugin.tasks.arith.DEFAULT_DIFFICULTY`); must be
            ``None`` for GSM8K.
        n: number of prompts (GSM8K: the first ``n`` after filtering and shuffling, default all; arith: default
            1024).
        data: GSM8K only: a local file or folder in GSM8K format; ``None``: ``$BLOGGAP_GSM8K_DATA``, else
            ``openai/gsm8k`` from the hub (see :func:`bloggap_plugin.tasks.gsm8k.load_gsm8k`).
        parser: GSM8K reward parser, ``"lenient"`` (last number) or ``"strict"`` (``#### n``).
        reward: arith only: ``"accuracy"`` (default) or ``"length"`` (:func:`~bloggap_plugin.tasks.arith.length_reward`:
            non-zero advantages on any model, for timing random-init shapes).
        calc_steps: GSM8K only: keep the problems whose reference solution has this many ``<<...>>`` calculation
            steps: a number (``1``: exactly one) or a range (``"1-2"``); ``None`` keeps all.
        train_split: GSM8K only: the split the prompts come from, ``"train"`` (``None``: the default, every row) or
            ``"train_minus_validation"`` (train without the fixed validation rows,
            :func:`~bloggap_plugin.tasks.gsm8k.validation_rows`); never validation or test.
    """
    import datasets

    if n is not None and n < 1:
        raise UsageError(f"n must be >= 1 prompts, got {n}")
    if reward not in ("accuracy", "length"):
        raise UsageError(f"reward {reward!r} is not a reward of the tasks: choose accuracy or length")
    if reward != "accuracy" and name != "arith":
        raise UsageError(f"reward {reward!r} applies to the 'arith' task only (timing runs); {name} scores accuracy")
    if name == "gsm8k":
        from bloggap_plugin.tasks import gsm8k

        if difficulty is not None:
            raise UsageError("difficulty applies to the 'arith' task only; for GSM8K choose problems by their number "
                             "of calculation steps with calc_steps (--calc-steps)")
        if parser not in ("lenient", "strict"):
            raise UsageError(f"parser must be 'lenient' or 'strict', got {parser!r}")
        gsm8k.parse_calc_steps(calc_steps)  # a bad value fails before the data loads
        split = "train" if train_split is None else train_split
        if split not in TRAIN_SPLITS:
            raise UsageError(f"train_split {train_split!r}: GSM8K trains on {' or '.join(TRAIN_SPLITS)}; validation "
                             "and test are for evaluation only")
        raw = gsm8k.filter_by_calc_steps(gsm8k.load_gsm8k(data, split=split), calc_steps).shuffle(seed=seed)
        if n is not None:
            raw = raw.select(range(min(n, len(raw))))
        messages = [gsm8k.build_messages(q) for q in gsm8k.column(raw, "question")]
        answers = [gsm8k.gold_answer(a) for a in gsm8k.column(raw, "answer")]
        reward = gsm8k.accuracy_reward if parser == "lenient" else gsm8k.strict_accuracy_reward
    elif name == "arith":
        from bloggap_plugin.tasks import arith

        if data is not None:
            raise UsageError("the 'arith' task generates its problems; --data applies to 'gsm8k' only")
        if calc_steps is not None:
            raise UsageError("calc_steps (<<...>> calculation steps) applies to 'gsm8k' only; the 'arith' task has "
                             "--difficulty")
        if train_split is not None:
            raise UsageError("train_split applies to 'gsm8k' only; the 'arith' task generates its problems")
        level = arith.DEFAULT_DIFFICULTY if difficulty is None else difficulty
        problems = arith.make_problems(ARITH_TRAIN_N if n is None else n, seed=seed, difficulty=level)
        messages = [arith.build_messages(p, level) for p in problems]
        answers = [str(p.answer) for p in problems]
        reward = arith.accuracy_reward if reward == "accuracy" else arith.length_reward
    else:
        raise UsageError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    prompts = [task_prompt(m, tokenizer) for m in messages]
    dataset = datasets.Dataset.from_dict({"prompt": prompts, "answer": answers})
    return dataset, [reward]


def get_heldout(name: str, tokenizer=None, seed: int = 0, heldout_n: int = HELDOUT_DEFAULT_N, **task_options):
    """``(heldout_dataset, reward_funcs)``: prompts no training run of this task saw, for a greedy evaluation.

    ``name``, ``seed`` and ``task_options`` (``difficulty``, ``n``, ``data``, ``calc_steps``, ``parser``) are those of
    the training set (:func:`get_task`); ``heldout_n`` is the number of held-out prompts. GSM8K: the first ``heldout_n`` rows of the *test* split (file order, the same for every seed)
    among those with ``calc_steps`` steps; the training set is the train split. Arithmetic: problems of the same level
    drawn from the generator seeded :data:`ARITH_HELDOUT_SEED`, skipping every question of the training set of
    ``seed`` (``n`` problems) and of the three solved examples in the prompt, and repeats: different seeds can draw
    the same question, so a disjoint seed alone would not keep the sets apart. The set depends on ``seed`` only
    through those skipped questions.
    """
    import datasets

    if isinstance(heldout_n, bool) or not isinstance(heldout_n, int) or heldout_n < 1:
        raise UsageError(f"heldout_n must be a whole number >= 1 of held-out prompts, got {heldout_n!r}")
    _, reward_funcs = get_task(name, None, seed=seed, **{**task_options, "n": 1})  # checks the options
    difficulty, n, data, calc_steps = (task_options.get(key) for key in ("difficulty", "n", "data", "calc_steps"))
    if name == "gsm8k":
        from pathlib import Path

        from bloggap_plugin.tasks import gsm8k

        local = gsm8k.resolve_data(data)
        if local is not None and Path(local).is_file():
            raise UsageError(f"GSM8K data {local} is one file, so its 'test' split would be its training rows: point "
                             "--data at a folder holding train and test files (e.g. ../shared/data/gsm8k), or turn the "
                             "held-out evaluation off (--heldout-n 0)")
        raw = gsm8k.filter_by_calc_steps(gsm8k.load_gsm8k(data, split="test"), calc_steps)
        raw = raw.select(range(min(heldout_n, len(raw))))
        messages = [gsm8k.build_messages(q) for q in gsm8k.column(raw, "question")]
        answers = [gsm8k.gold_answer(a) for a in gsm8k.column(raw, "answer")]
    else:
        import random

        from bloggap_plugin.tasks import arith

        level = arith.DEFAULT_DIFFICULTY if difficulty is None else difficulty
        seen = {p.question for p in arith.make_problems(ARITH_TRAIN_N if n is None else n, seed=seed, difficulty=level)}
        seen |= {p.question for p in arith._examples(level)}
        too_few = (f"arith level {level} has too few questions outside the training set for {heldout_n} held-out "
                   "prompts; ask for fewer")
        if arith.question_count_bound(level) - len(seen) < heldout_n:  # no number of draws could fill the set
            raise UsageError(too_few)
        rng, problems = random.Random(ARITH_HELDOUT_SEED), []
        for _ in range(20 * heldout_n + 10_000):  # draws: ample for any level with room for the set
            problem = arith.make_problem(rng, level)
            if problem.question not in seen:
                seen.add(problem.question)
                problems.append(problem)
                if len(problems) == heldout_n:
                    break
        else:
            raise UsageError(too_few)
        messages = [arith.build_messages(p, level) for p in problems]
        answers = [str(p.answer) for p in problems]
    prompts = [task_prompt(m, tokenizer) for m in messages]
    return datasets.Dataset.from_dict({"prompt": prompts, "answer": answers}), reward_funcs


def prompt_token_ids(prompt: list[dict[str, str]] | str, tokenizer) -> list[int]:
    """Token ids of one ``prompt`` column entry as TRL's GRPOTrainer (1.16) builds them for generation: the chat
    template with the generation prompt for conversational prompts, the plain text without special tokens else."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    encoded = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
    ids = encoded["input_ids"]
    return list(ids[0] if ids and isinstance(ids[0], list) else ids)


def prompt_fingerprint(dataset) -> str:
    """Short hash of the prompts and answers in order: equal across arms iff they see the same prompt order."""
    import hashlib
    import json

    digest = hashlib.sha256()
    for prompt, answer in zip(dataset["prompt"], dataset["answer"]):
        digest.update(json.dumps([prompt, answer], sort_keys=True).encode())
    return digest.hexdigest()[:16]

