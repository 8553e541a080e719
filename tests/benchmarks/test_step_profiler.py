"""benchmarks/_lib/profile.StepProfiler: profiles exactly the chosen steps and writes their ops."""

from __future__ import annotations

import types

import pytest
import torch

from benchmarks._lib.profile import StepProfiler


def _steps(profiler, count, work):
    state = types.SimpleNamespace(global_step=0)
    for step in range(1, count + 1):
        profiler.on_step_begin(None, state, None)
        work(step)
        state.global_step = step
        profiler.on_step_end(None, state, None)


def test_only_the_chosen_steps_are_profiled(tmp_path):
    path = tmp_path / "profile.txt"
    x = torch.randn(8, 8)
    # steps 2-3 run a matmul; steps 1 and 4 run a different op, which must not appear
    _steps(StepProfiler(path, 2, 3), 4, lambda step: torch.mm(x, x) if step in (2, 3) else torch.cumsum(x, 0))
    text = path.read_text()
    assert text.startswith("steps 2-3, by self_")
    assert "aten::mm" in text and "aten::cumsum" not in text


def test_bad_step_range_is_refused(tmp_path):
    with pytest.raises(ValueError, match="1 <= FIRST <= LAST"):
        StepProfiler(tmp_path / "p.txt", 3, 2)
