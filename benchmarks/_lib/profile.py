"""A torch profile of chosen optimizer steps of a TRL run, written as text tables (the live benchmarks' ``--profile``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
"""The matmul ops whose host time ``StepProfiler(shapes=True)`` lists by input shape."""


class StepProfiler(TrainerCallback):
    """Profiles optimizer steps ``first`` to ``last`` (1-based, as the logged ``step``) with ``torch.profiler`` (CPU,
    and CUDA when available) and writes ``path``: the ops by self device time, then by total CPU time (the host's
    launches), 40 rows each; with ``shapes`` (input shapes recorded, which costs the host a little more per op) also
    the :data:`MATMULS` by input shape and self CPU time, 25 rows (which of a step's matmuls take the host's time).
    The profiler stops at ``last``'s end, so the other steps run unprofiled."""

    def __init__(self, path: str | Path, first: int, last: int, shapes: bool = False) -> None:
        if not 1 <= first <= last:
            raise ValueError(f"profile steps {first}-{last}: expected 1 <= FIRST <= LAST")
        self.path, self.first, self.last, self.shapes = Path(path), first, last, shapes
        self._profiler: Any = None

    def on_step_begin(self, args, state, control, **kwargs):
        import torch

        if state.global_step + 1 == self.first and self._profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=self.shapes)
            self._profiler.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self._profiler is not None and state.global_step == self.last:
            self._profiler.__exit__(None, None, None)
            averages = self._profiler.key_averages()
            device_key = "self_cuda_time_total" if any(getattr(e, "self_device_time_total", 0) for e in averages) \
                else "self_cpu_time_total"
            text = (f"steps {self.first}-{self.last}, by {device_key}\n{averages.table(sort_by=device_key, row_limit=40)}\n"
                    f"by cpu_time_total\n{averages.table(sort_by='cpu_time_total', row_limit=40)}\n")
            if self.shapes:
                from torch.autograd.profiler_util import EventList

                matmuls = EventList([e for e in self._profiler.key_averages(group_by_input_shape=True)
                                     if e.key in MATMULS])
                text += (f"matmuls by input shape, by self_cpu_time_total\n"
                         f"{matmuls.table(sort_by='self_cpu_time_total', row_limit=25)}\n")
            self.path.write_text(text)
            self._profiler = None
