"""The arith task's length reward (timing runs on random-init models)."""

from __future__ import annotations

import pytest

from bloggap_plugin.core.errors import UsageError
from bloggap_plugin.tasks import arith, get_task


def test_length_reward_is_minus_the_relative_distance_from_64_characters():
    texts = ["x" * 64, "x" * 32, "", "x" * 160]
    assert arith.length_reward(texts) == [0.0, -0.5, -1.0, -1.5]
    assert arith.length_reward([[{"role": "assistant", "content": "y" * 48}]]) == [-0.25]


def test_get_task_gives_the_length_reward_for_arith_only():
    _, rewards = get_task("arith", None, n=2, reward="length")
    assert rewards == [arith.length_reward]
    with pytest.raises(UsageError, match="applies to the 'arith' task only"):
        get_task("gsm8k", None, n=2, reward="length")
    with pytest.raises(UsageError, match="choose accuracy or length"):
        get_task("arith", None, n=2, reward="speed")
