"""Where a command's time goes: consecutive named phases of one process, each with its wall seconds, its CPU seconds
(the process's user + system time, every thread) and the 1-minute load average when it ended.

CPU seconds beside wall seconds tell a slow phase from a shared machine: on a busy host wall time grows while the
process's CPU time stays what the work costs.
"""

from __future__ import annotations

import os
import resource
import time

__all__ = ["PhaseTimer", "cpu_seconds", "load_average"]


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (all its threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def load_average() -> float | None:
    """The host's 1-minute load average (runnable processes), or ``None`` where the OS gives none."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


class PhaseTimer:
    """Consecutive phases: :meth:`lap` closes the phase that began at the previous lap (or at creation), so the
    phases' seconds add up to the whole run's. :meth:`record` is the JSON-ready summary."""

    def __init__(self) -> None:
        self.phases: list[dict] = []
        self._load_start = load_average()
        self._start = self._mark = (time.perf_counter(), cpu_seconds())

    def lap(self, name: str) -> dict:
        """Close the phase ``name`` (from the previous lap to now); returns its record."""
        now = (time.perf_counter(), cpu_seconds())
        phase = {"phase": name, "wall_s": round(now[0] - self._mark[0], 3), "cpu_s": round(now[1] - self._mark[1], 3),
                 "load_1min": load_average()}
        self._mark = now
        self.phases.append(phase)
        return phase

    def elapsed(self) -> float:
        """Wall seconds since the timer was made."""
        return time.perf_counter() - self._start[0]

    def record(self) -> dict:
        """``{"wall_s", "cpu_s", "cpus", "load_1min_start", "load_1min_end", "phases": [...]}`` up to the last lap
        (seconds; ``cpus``: the host's logical CPUs, so ``cpu_s / wall_s`` can be read against it)."""
        return {
            "wall_s": round(self._mark[0] - self._start[0], 3),
            "cpu_s": round(self._mark[1] - self._start[1], 3),
            "cpus": os.cpu_count(),
            "load_1min_start": self._load_start,
            "load_1min_end": self.phases[-1]["load_1min"] if self.phases else self._load_start,
            "phases": list(self.phases),
        }
