"""The plugin's share of a training run's time, from the run's log records (one dict per logged step).

Below both the TRL adapter (``bloggap train``'s summary) and ``bloggap compare`` (its per-run rows), which read the
same two keys: ``gap/time/scoring_s`` (the plugin's seconds in the step) and ``step_time`` (the step's seconds).
"""

from __future__ import annotations

__all__ = ["timed_steps", "plugin_time_share"]


def timed_steps(records: list[dict]) -> list[dict]:
    """The records that carry both ``gap/time/scoring_s`` and ``step_time`` (one per optimizer step), in order."""
    return [r for r in records if isinstance(r.get("gap/time/scoring_s"), (int, float))
            and isinstance(r.get("step_time"), (int, float))]


def plugin_time_share(records: list[dict]) -> float | None:
    """The plugin's share of training time: ``sum(gap/time/scoring_s) / sum(step_time)`` (seconds over seconds)
    over the :func:`timed_steps` of ``records``, or ``None`` without any.

    This is what the plugin costs a run. The mean of the logged per-step ``gap/time/overhead_frac`` is not: it
    weighs a rare long step (a probe generation) like a short one, and so understates a rare cost.
    """
    timed = timed_steps(records)
    wall = sum(r["step_time"] for r in timed)
    return sum(r["gap/time/scoring_s"] for r in timed) / wall if wall > 0 else None
