"""The reward comparison across arms: run every recipe x seed, then the T10 table, a plot and the resolution.

Every arm runs with the same seeds, so for one seed all arms see the same prompts in the same order and the
same sampling seeds; they differ only in what the recipe changes (the old-logprob pass). Each run is a
subprocess (``python -m bloggap_plugin.compare --worker SPEC``) that calls the training function
(default :func:`bloggap_plugin.trl.run.run_training`), which writes one JSONL record per logged step into a
log of its own (``runs/<run>.<attempt>.part.jsonl``). When the function returns, the worker appends a
completion marker ``{"_compare": "done", "attempt": ..., "settings": {...}, ...}`` and renames that log to
``runs/<run>.jsonl``: the run's log exists only complete, and only one process ever writes a given file.

Every setting is checked before anything trains (:func:`validate_config`, :class:`CompareError`).

Resume: a run whose log carries the marker and the same settings (:func:`run_settings`: training function,
recipe content, model, task and its options (GSM8K: the data path in effect, ``--data`` or ``$BLOGGAP_GSM8K_DATA``),
steps, seed, overrides, ``--use-vllm``) is skipped; one trained with other settings, or whose log
is corrupt, is trained again, its old log kept as ``<run>.jsonl.stale`` / ``.corrupt``; the log of an attempt
that never completed is kept as ``<run>.jsonl.partial``. A crashed run does not stop the sweep: the table is
built from the runs that finished and the command exits non-zero naming the others.

Stopping: runs die with the sweep (``PR_SET_PDEATHSIG`` on Linux and a parent-watch thread, so also on SIGKILL
or an OOM kill of the sweep); SIGTERM, SIGHUP and Ctrl-C stop every run before the sweep exits. The runs
inherit the folder's lock, so no other sweep uses the folder while any of them lives.

Held-out evaluation (``heldout_n``, default 512 with the default training function): each run saves its policy,
the worker evaluates it greedily on prompts no training set holds (:func:`bloggap_plugin.tasks.get_heldout`) into
``runs/<run>.heldout.json``, and table T10-heldout compares the arms with paired intervals; a run trained but not
evaluated is evaluated on resume from its saved policy (:mod:`.heldout`). ``time_budget_s`` ends a call cleanly: no
run starts that would not finish in time, the runs in flight at the limit are stopped, the outputs are written.

Layout: :mod:`.sweep_config` (settings, plan, checks), :mod:`.logs` (run logs, resume), :mod:`.worker` (the
run subprocess), :mod:`.sweep` (processes, lock, signals, time budget), :mod:`.statistics` (summaries,
intervals, resolution), :mod:`.outputs` (tables, plot, JSON, Markdown), :mod:`.heldout` (the held-out
evaluation's files and resume); every public name is importable from ``bloggap_plugin.compare``.

Outputs in ``output_dir``: ``runs/<arm>_s<seed>.jsonl`` (+ ``.out`` with the run's console output),
``compare.json`` (a :class:`bloggap_plugin.results.ResultDocument`: params, raw per-run results, tables), ``compare.md`` and
``reward_curves.png``, each written atomically.

Table definitions (as in the reference study's T10):

- reward last-k: mean of the per-step ``reward`` over the final k logged steps (k = ``last_n``, default 30,
  or all steps when a run logged fewer);
- reward mean: mean over all logged steps;
- vs A per seed: last-k of the arm minus last-k of the baseline arm with the same seed; mean delta with a
  95% paired t interval over seeds (needs >= 2 seeds);
- clip: mean over steps of TRL's ``clip_ratio/region_mean``; ``gap/*``: mean over steps of each plugin metric;
- s/step: mean of TRL's ``step_time`` where logged, else wall time / steps.

Generation: HF ``generate`` by default; ``use_vllm`` (``--use-vllm``) gives every run TRL's colocated vLLM engine
(``use_vllm=True, vllm_mode="colocate"``) with ``vllm_gpu_memory_utilization`` = :data:`VLLM_GPU_SHARE` / ``parallel``
(the GPU divided among the runs in flight; an ``--override`` of it wins). With the default training function the
sweep refuses it up front on a machine without vLLM or CUDA.
"""

from __future__ import annotations

from bloggap_plugin.compare.heldout import evaluate_saved, heldout_path, heldout_state, read_heldout
from bloggap_plugin.compare.logs import read_log, run_is_done, run_settings, run_state
from bloggap_plugin.compare.outputs import (
    plot_reward_curves,
    print_table,
    resolution_statement,
    write_outputs,
)
from bloggap_plugin.compare.statistics import build_results, heldout_by_arm, paired_interval, summarize_run
from bloggap_plugin.compare.sweep import SweepStopped, run_compare, worker_environment
from bloggap_plugin.compare.sweep_config import (
    DEFAULT_HELDOUT_FN,
    DEFAULT_RUN_FN,
    DONE_KEY,
    RENAMED_RUN_FNS,
    VLLM_GPU_SHARE,
    CompareConfig,
    CompareError,
    RunSpec,
    effective_overrides,
    heldout_count,
    plan_runs,
    validate_config,
    vllm_unavailable_reason,
)
from bloggap_plugin.run_timing import plugin_time_share, timed_steps

__all__ = [
    "CompareConfig",
    "CompareError",
    "SweepStopped",
    "VLLM_GPU_SHARE",
    "vllm_unavailable_reason",
    "effective_overrides",
    "RunSpec",
    "DONE_KEY",
    "DEFAULT_RUN_FN",
    "RENAMED_RUN_FNS",
    "DEFAULT_HELDOUT_FN",
    "heldout_count",
    "heldout_path",
    "heldout_state",
    "read_heldout",
    "evaluate_saved",
    "heldout_by_arm",
    "plan_runs",
    "validate_config",
    "run_settings",
    "run_state",
    "read_log",
    "run_is_done",
    "run_compare",
    "summarize_run",
    "plugin_time_share",
    "timed_steps",
    "build_results",
    "paired_interval",
    "write_outputs",
    "plot_reward_curves",
    "print_table",
    "resolution_statement",
    "worker_environment",
]
