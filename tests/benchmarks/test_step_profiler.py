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


def test_shapes_add_the_matmuls_by_input_shape_after_the_two_tables(tmp_path):
    """``shapes``: a third section lists the matmuls by input shape (the two shapes here apart), and nothing else;
    the first table, which ``benchmarks.step_profile`` reads, is unchanged in form."""
    path = tmp_path / "profile.txt"
    small, large = torch.randn(4, 8), torch.randn(16, 8)
    _steps(StepProfiler(path, 1, 1, shapes=True), 1,
           lambda step: (torch.mm(small, small.T), torch.mm(large, large.T), torch.cumsum(small, 0)))
    text = path.read_text()
    first, _, shapes = text.partition("matmuls by input shape, by self_cpu_time_total\n")
    assert first.startswith("steps 1-1, by self_") and "aten::cumsum" in first and shapes
    rows = [line for line in shapes.splitlines() if line.strip().startswith("aten::")]
    assert len(rows) == 2 and all(row.strip().startswith("aten::mm") for row in rows)
    assert "[[4, 8], [8, 4]]" in shapes and "[[16, 8], [8, 16]]" in shapes
    plain = tmp_path / "plain.txt"
    _steps(StepProfiler(plain, 1, 1), 1, lambda step: torch.mm(small, small.T))
    assert "matmuls by input shape" not in plain.read_text()
