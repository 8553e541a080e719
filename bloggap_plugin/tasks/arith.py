"""Arithmetic word problems with a difficulty knob, for models too small for GSM8K.

Each problem is a one-line story ("Mia has 7 apples. She gets 5 more apples. How many apples does Mia have
now?") whose answer is a non-negative integer. The prompt is conversational: a system message, three solved
examples as earlier user/assistant turns (``"7 + 5 = 12"``), then the question. Without the solved examples
SmolLM2-135M-Instruct rambles and is seldom right even on single-digit sums when sampling at temperature 1;
with them it answers in the ``a + b = c`` form and the difficulty sets the accuracy (per level in
``docs/compare.md``).

Reward: 1.0 when the *last* number of the completion (commas removed, :func:`parse_lenient` of the GSM8K
task) equals the answer, else 0.0. The last number, not the first: the model writes ``a + b = c``.

Difficulty levels (``LEVELS``):

1. addition, both operands 1-9
2. addition, first operand 10-29, second 1-9
3. addition, both operands 10-49
4. addition or subtraction (result >= 0), both operands 10-99
5. two steps ``a + b - c`` (result >= 0), operands 10-99
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from bloggap_plugin.core.errors import UsageError
from bloggap_plugin.tasks.gsm8k import completion_text, parse_lenient

__all__ = [
    "LEVELS",
    "DEFAULT_DIFFICULTY",
    "SYSTEM_PROMPT",
    "ArithProblem",
    "make_problem",
    "make_problems",
    "question_count_bound",
    "build_messages",
    "accuracy_reward",
    "length_reward",
    "LENGTH_TARGET_CHARS",
    "score_text",
]

SYSTEM_PROMPT = "Solve the problem. Write the calculation and its result, like '7 + 5 = 12', and nothing else."

DEFAULT_DIFFICULTY = 2


@dataclass(frozen=True)
class _Level:
    """Operand ranges of one difficulty level."""

    first: tuple[int, int]
    """Inclusive range of the first operand."""
    second: tuple[int, int]
    """Inclusive range of the second operand (and the third, for two-step problems)."""
    subtract: bool = False
    """Half of the problems subtract the second operand instead of adding it."""
    two_step: bool = False
    """Problems are ``a + b - c``."""


LEVELS: dict[int, _Level] = {
    1: _Level(first=(1, 9), second=(1, 9)),
    2: _Level(first=(10, 29), second=(1, 9)),
    3: _Level(first=(10, 49), second=(10, 49)),
    4: _Level(first=(10, 99), second=(10, 99), subtract=True),
    5: _Level(first=(10, 99), second=(10, 99), two_step=True),
}

_NAMES = ("Mia", "Tom", "Ana", "Sam", "Lea", "Ben", "Ivy", "Max", "Zoe", "Leo", "Kim", "Raj")
_PRONOUNS = {"Mia": "She", "Ana": "She", "Lea": "She", "Ivy": "She", "Zoe": "She", "Kim": "She"}
_OBJECTS = ("apples", "pencils", "stickers", "marbles", "books", "coins", "cards", "shells")


@dataclass(frozen=True)
class ArithProblem:
    """One generated problem."""

    question: str
    """The story and question, one line."""
    expression: str
    """The calculation, e.g. ``"7 + 5"``."""
    answer: int
    """The result (a non-negative integer)."""


def make_problem(rng: random.Random, difficulty: int = DEFAULT_DIFFICULTY) -> ArithProblem:
    """Draw one problem at ``difficulty`` (a key of :data:`LEVELS`) from ``rng``."""
    level = _level(difficulty)
    name = rng.choice(_NAMES)
    pronoun = _PRONOUNS.get(name, "He")
    obj = rng.choice(_OBJECTS)
    a = rng.randint(*level.first)
    b = rng.randint(*level.second)
    if level.two_step:
        c = rng.randint(*level.second)
        c = min(c, a + b)
        question = (
            f"{name} has {a} {obj}. {pronoun} gets {b} more {obj}, then gives {c} {obj} away. "
            f"How many {obj} does {name} have now?"
        )
        return ArithProblem(question, f"{a} + {b} - {c}", a + b - c)
    if level.subtract and rng.random() < 0.5:
        a, b = max(a, b), min(a, b)
        question = f"{name} has {a} {obj}. {pronoun} gives {b} {obj} away. How many {obj} does {name} have now?"
        return ArithProblem(question, f"{a} - {b}", a - b)
    question = f"{name} has {a} {obj}. {pronoun} gets {b} more {obj}. How many {obj} does {name} have now?"
    return ArithProblem(question, f"{a} + {b}", a + b)


def make_problems(n: int, seed: int = 0, difficulty: int = DEFAULT_DIFFICULTY) -> list[ArithProblem]:
    """``n`` problems drawn with ``random.Random(seed)``: the same list for the same arguments."""
    if n < 1:
        raise UsageError(f"n must be >= 1 problems, got {n}")
    rng = random.Random(seed)
    return [make_problem(rng, difficulty) for _ in range(n)]


def _level(difficulty: int) -> _Level:
    try:
        return LEVELS[int(difficulty)]
    except (KeyError, TypeError, ValueError):
        raise UsageError(
            f"arith difficulty must be one of {sorted(LEVELS)} (1 = single-digit sums ... 5 = two steps), got {difficulty!r}"
        ) from None


def question_count_bound(difficulty: int = DEFAULT_DIFFICULTY) -> int:
    """At least the number of distinct questions :func:`make_problem` can draw at ``difficulty`` (exactly it at
    levels 1-3): names x objects x the operand values, a third operand's values for two-step problems, two forms
    (gets, gives) for levels that subtract."""
    level = _level(difficulty)
    count = len(_NAMES) * len(_OBJECTS)
    for low, high in (level.first, level.second, *((level.second,) if level.two_step else ())):
        count *= high - low + 1
    return count * (2 if level.subtract else 1)


@functools.cache
def _examples(difficulty: int) -> tuple[ArithProblem, ...]:
    # Fixed solved examples at the same level, from their own generator (never the training stream); built once per
    # level, as every prompt holds them.
    return tuple(make_problems(3, seed=10_000 + int(difficulty), difficulty=difficulty))


def build_messages(problem: ArithProblem, difficulty: int = DEFAULT_DIFFICULTY) -> list[dict[str, str]]:
    """Conversational prompt: system message, three solved examples, then ``problem``."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for example in _examples(difficulty):
        messages.append({"role": "user", "content": example.question})
        messages.append({"role": "assistant", "content": f"{example.expression} = {example.answer}"})
    messages.append({"role": "user", "content": problem.question})
    return messages


def score_text(text: str | None, gold: str | int) -> float:
    """1.0 when the last number of ``text`` equals ``gold``, else 0.0 (the one scoring rule of this task)."""
    return 1.0 if parse_lenient(text) == str(gold) else 0.0


def accuracy_reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """TRL reward function: 1.0 where the last number of the completion equals ``answer``, else 0.0."""
    return [score_text(completion_text(c), gold) for c, gold in zip(completions, answer)]


LENGTH_TARGET_CHARS = 64
"""The completion length (characters) at which :func:`length_reward` is highest."""


def length_reward(completions: list, **kwargs) -> list[float]:
    """TRL reward function for timing runs: ``-|len(text) - 64| / 64`` per completion (``text`` its characters,
    :data:`LENGTH_TARGET_CHARS`). It varies between the completions of a group on any model, random-init ones too,
    so GRPO's advantages are non-zero and the backward does a real step's work."""
    return [-abs(len(completion_text(c) or "") - LENGTH_TARGET_CHARS) / LENGTH_TARGET_CHARS for c in completions]
