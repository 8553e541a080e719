"""Running the sweep: one subprocess per run, at most ``parallel`` at once, under the output folder's lock; resume,
stop signals and the clean-up of runs in flight."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from bloggap_plugin._io import atomic_write_text
from bloggap_plugin.compare.heldout import heldout_path, heldout_spec, heldout_state, read_heldout
from bloggap_plugin.compare.logs import (
    MODEL_SHA256_KEY,
    check_resume_checkpoint,
    count_logged_steps,
    read_marker,
    run_settings,
    run_state,
)
from bloggap_plugin.compare.outputs import write_outputs
from bloggap_plugin.compare.statistics import build_results
from bloggap_plugin.compare.sweep_config import (
    CompareConfig,
    CompareError,
    RunSpec,
    effective_overrides,
    heldout_count,
    run_task_kwargs,
    validate_config,
)

__all__ = [
    "FAILED_CONSOLE",
    "SweepStopped",
    "run_compare",
]


FAILED_CONSOLE = r"\.out\.failed(?:\.\d+)?"
"""Regular expression of the name ending of a failed attempt's console that ``--retries`` keeps: ``runs/<run>.out``
renamed ``<run>.out.failed``, then ``.out.failed.1``, ... (:func:`_retry`)."""


class SweepStopped(Exception):
    """The sweep process got SIGTERM or SIGHUP; its runs were stopped (``signum`` says which signal)."""

    def __init__(self, signum: int, stopped: int = 0) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.stopped = stopped


def _spec_for(config: CompareConfig, run: RunSpec, attempt: str, part: Path, mode: str = "train",
              trained_attempt: str | None = None, model_sha: str | None = None) -> dict:
    return {
        MODEL_SHA256_KEY: model_sha,
        "mode": mode,
        "trained_attempt": trained_attempt,
        "heldout": heldout_spec(config, run),
        "run_fn": config.run_fn,
        "arm": run.arm,
        "recipe": run.recipe,
        "model": config.model,
        "task": config.task,
        "task_kwargs": run_task_kwargs(config),
        "max_steps": config.max_steps,
        "output_dir": run.output_dir,
        "seed": run.seed,
        "log_jsonl": run.log_jsonl,
        "part_jsonl": str(part),
        "attempt": attempt,
        "parent_pid": os.getpid(),
        "settings": run_settings(config, run),
        "extra_overrides": effective_overrides(config),
    }


def _part_logs(run: RunSpec) -> list[Path]:
    """Logs of earlier attempts of ``run`` that never completed (``runs/<run>.<attempt>.part.jsonl``)."""
    log = Path(run.log_jsonl)
    return sorted(log.parent.glob(f"{glob.escape(run.run_id)}.*.part.jsonl"), key=lambda p: p.stat().st_mtime)


def worker_environment(config: CompareConfig, environ: dict | None = None, ports_in_use: set | None = None) -> dict:
    """A run's environment: the sweep's, plus, when several runs each start a colocated vLLM engine on one GPU,
    a fixed vLLM KV cache (``BLOGGAP_VLLM_KV_CACHE_GIB`` = 2, unless set: vLLM's free-memory profiling fails when a
    neighbour frees memory while an engine starts) and a ``MASTER_PORT`` of the run's own, free now and not in
    ``ports_in_use`` (the runs in flight): TRL's colocate engine otherwise takes the first free of 29500, 23456, ...,
    which runs starting together all see free, and all but one then fail with EADDRINUSE. The sweep's extra import
    paths (``config.pythonpath``, for the user's run and held-out functions) go first on ``PYTHONPATH``."""
    env = dict(os.environ if environ is None else environ)
    if config.pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*config.pythonpath, *filter(None, [env.get("PYTHONPATH")])])
    if config.use_vllm and int(config.parallel) > 1:
        # imported here: the TRL integration takes seconds to import, and only vLLM runs use the name
        from bloggap_plugin.trl.vllm_colocate import KV_CACHE_ENV

        env.setdefault(KV_CACHE_ENV, "2")
        env.setdefault("MASTER_ADDR", "localhost")
        env["MASTER_PORT"] = str(_free_port(ports_in_use or set()))
    return env


def _free_port(avoid: set) -> int:
    """A TCP port the OS reports free on this host now, not in ``avoid``."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        if port not in avoid:
            return port
    raise RuntimeError(f"no free TCP port outside the {len(avoid)} the sweep's runs hold after 100 tries")


def _launch(config: CompareConfig, run: RunSpec, lock_fd: int, mode: str = "train", trained_attempt: str | None = None,
            ports_in_use: set | None = None, model_sha: str | None = None):
    """Start one attempt of ``run``: a fresh log only it writes, its console output, and the lock inherited, so that
    no other sweep can use the folder while the attempt lives (even if this process dies first). ``mode``
    ``"evaluate"``: only the held-out evaluation of the policy training attempt ``trained_attempt`` saved."""
    log = Path(run.log_jsonl)
    log.parent.mkdir(parents=True, exist_ok=True)
    for old in _part_logs(run):  # attempts of a sweep that was killed: no process writes them (we hold the lock)
        os.replace(old, _free_name(log.with_name(log.name + ".partial")))  # never over an earlier one
    attempt = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{time.monotonic_ns() % 10**6:06d}"
    part = log.with_name(f"{run.run_id}.{attempt}.part.jsonl")
    spec_path = log.with_name(f"{run.run_id}.spec.json")
    atomic_write_text(spec_path, json.dumps(_spec_for(config, run, attempt, part, mode, trained_attempt, model_sha), indent=1))
    console_path = log.with_name(f"{run.run_id}.out")
    fresh = console_path.with_name(f".{run.run_id}.{attempt}.out")
    console = open(fresh, "w")  # noqa: SIM115 - closed when the process ends
    os.replace(fresh, console_path)  # a new file: nothing else holds it open
    env = worker_environment(config, ports_in_use=ports_in_use)
    process = subprocess.Popen(
        [sys.executable, "-m", "bloggap_plugin.compare", "--worker", str(spec_path)],
        stdout=console,
        stderr=subprocess.STDOUT,
        pass_fds=(lock_fd,),
        env=env,
    )
    process.master_port = env.get("MASTER_PORT")  # type: ignore[attr-defined]  # read by the next launches
    return process, console, time.perf_counter(), attempt, part


def _progress(config: CompareConfig, run: RunSpec, part: Path, mode: str) -> str:
    """What a running attempt is doing, from its files: loading (no step logged yet), ``step k/N``, or evaluating
    the held-out set (an evaluation attempt, or a training attempt whose step log became the run's log)."""
    if mode == "evaluate":
        return "evaluating held-out"
    steps = count_logged_steps(part)
    if steps == 0 and not Path(part).exists() and read_marker(run.log_jsonl) is not None:
        return f"trained (step {count_logged_steps(run.log_jsonl)}/{config.max_steps}), evaluating held-out"
    return f"step {steps}/{config.max_steps}" if steps else f"loading (step 0/{config.max_steps})"


def _stop_all(processes: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    """SIGTERM every process, wait up to ``timeout_s`` in all, then SIGKILL what is left."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _lock(output_dir: Path, wait_s: float):
    """Hold ``output_dir/.compare.lock`` for the sweep (its runs inherit it): a second sweep on the same folder is
    refused while this one or any run it started lives. Waits up to ``wait_s`` for runs of a sweep that just died."""
    from bloggap_plugin._io import try_lock

    handle = try_lock(output_dir / ".compare.lock", wait_s)
    if handle is None:
        raise CompareError(f"another bloggap compare (or a run it started) is using {output_dir}; "
                           "wait for it to finish or use another --output-dir")
    return handle


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


def _raise_stopped(signum, frame):
    raise SweepStopped(signum)


def run_compare(config: CompareConfig, echo=print) -> dict:
    """Run (or resume) the sweep, then write the outputs; returns the results dict (see :func:`build_results`).

    SIGTERM and SIGHUP (when called from the main thread) and Ctrl-C stop every run before this returns by raising
    :class:`SweepStopped` or ``KeyboardInterrupt``; a SIGKILL of this process ends the runs too (see
    :func:`_die_with_parent`).
    """
    runs = validate_config(config)
    model_sha = _model_sha256(config)  # once per call: every run of it starts from these weights
    out = Path(config.output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CompareError(f"--output-dir {out}: cannot create it ({err.strerror or err}); choose another folder") from None
    lock = _lock(out, config.lock_wait_s)
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers[signal.SIGINT] = signal.getsignal(signal.SIGINT)
        for signum in (signal.SIGTERM, signal.SIGHUP):
            handlers[signum] = signal.signal(signum, _raise_stopped)
    try:
        check_resume_checkpoint(config, runs, model_sha)
        return _sweep(config, runs, echo, lock.fileno(), model_sha)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        lock.close()


def _plan_pending(config: CompareConfig, runs: list[RunSpec], echo) -> list[tuple[RunSpec, str, str | None]]:
    """``(run, mode, trained attempt)`` to start: held-out evaluations of runs trained earlier first (short), then
    the runs to train; logs of other settings, corrupt or unfinished are moved aside (named in a message)."""
    planned = [item for item in (_plan_run(config, run, echo) for run in runs) if item is not None]
    return [item for item in planned if item[1] == "evaluate"] + [item for item in planned if item[1] == "train"]


def _plan_run(config: CompareConfig, run: RunSpec, echo) -> tuple[RunSpec, str, str | None] | None:
    """What ``run`` needs from its log and held-out record: ``(run, "evaluate", trained attempt)``, ``(run, "train",
    None)`` (a log of other settings, corrupt or unfinished moved aside first, named in a message), or ``None``
    (finished, or trained with its saved policy gone)."""
    log = Path(run.log_jsonl)
    state, why = run_state(config, run)
    if state == "done":
        attempt = (read_marker(log) or {}).get("attempt")
        held = heldout_state(config, run, attempt)
        if held in ("off", "done"):
            echo(f"[compare] {run.run_id}: finished earlier, skipped")
        elif held == "pending":
            echo(f"[compare] {run.run_id}: trained earlier, its held-out evaluation is missing: evaluating it")
            return run, "evaluate", attempt
        else:
            echo(f"[compare] {run.run_id}: trained earlier without a held-out result, and its saved policy is gone; "
                 f"its held-out cell stays empty (delete {log} to train and evaluate it again)")
        return None
    suffix = {"unfinished": ".partial", "corrupt": ".corrupt", "changed": ".stale"}.get(state)
    if suffix:  # keep the old log aside under a name no run reads (never over an earlier one), train it again
        aside = _free_name(log.with_name(log.name + suffix))
        os.replace(log, aside)
        echo(f"[compare] {run.run_id}: {why}; kept as {aside.name}, running it again")
    return run, "train", None


def _retry(config: CompareConfig, run: RunSpec, retried: dict[str, list[int]], code: int | None,
           echo) -> tuple[RunSpec, str, str | None] | None:
    """The next attempt of ``run``, whose process just failed with exit ``code``, while ``config.retries`` allows one
    more (recorded in ``retried``): what its log and held-out record now need (:func:`_plan_run`: a training from
    zero, or the evaluation of the policy its training saved); ``None`` when none is left or it needs nothing. The
    failed attempt's console is kept as ``runs/<run>.out.failed``."""
    codes = retried.setdefault(run.run_id, [])
    if len(codes) >= config.retries:
        if not codes:
            del retried[run.run_id]
        return None
    codes.append(code)
    console = Path(run.log_jsonl).with_suffix(".out")
    kept = _free_name(console.with_name(console.name + ".failed"))
    if console.exists():
        os.replace(console, kept)
    again = _plan_run(config, run, echo)
    if again is not None:
        echo(f"[compare] {run.run_id}: retry {len(codes)} of {config.retries} "
             f"({'its evaluation' if again[1] == 'evaluate' else 'training from zero'}) after the runs waiting; the "
             f"failed attempt's console is kept as {kept.name}")
    return again


def _free_name(path: Path) -> Path:
    """``path``, or ``path.1``, ``path.2``, ... : the first that does not exist yet."""
    candidate, number = path, 0
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.name}.{number}")
    return candidate


def _record(path: Path):
    """A JSON record compare wrote in its output folder, through the bounded reader; ``ValueError`` when it is
    missing, too large, not UTF-8 or not JSON."""
    from bloggap_plugin._input_files import load_json_file

    return load_json_file(path, str(path), "delete it", ValueError, "a compare record")


def _prior_run_s(runs: list[RunSpec]) -> float | None:
    """Longest training plus evaluation time recorded by runs finished in earlier calls (their markers' ``wall_s``
    plus their held-out ``seconds``), or ``None``."""
    times = []
    for run in runs:
        marker = read_marker(run.log_jsonl)
        if marker and isinstance(marker.get("wall_s"), (int, float)):
            try:
                held = (_record(heldout_path(run)).get("result", {}).get("seconds") or 0.0)
            except (ValueError, AttributeError):
                held = 0.0
            times.append(float(marker["wall_s"]) + float(held))
    return max(times) if times else None


def _succeeded(config: CompareConfig, run: RunSpec, code: int | None, mode: str, attempt: str, trained: str | None) -> bool:
    if code != 0:
        return False
    if mode == "evaluate":
        return read_heldout(config, run, trained) is not None
    marker = read_marker(run.log_jsonl)
    return marker is not None and marker.get("attempt") == attempt


def _stopped_path(run: RunSpec) -> Path:
    """Where a training attempt stopped unfinished by the time budget records how long it ran."""
    log = Path(run.log_jsonl)
    return log.with_name(log.stem + ".stopped.json")


def _check_budget_progress(config: CompareConfig, pending: list) -> None:
    """Refuse a budget no longer than a pending run already had unfinished under one: it would be stopped at the
    same point and restarted from zero on every call, without end. What it had is the time since its call started
    where it was launched then (``call_seconds``: its launch took part of the budget, more so under load), else the
    seconds it ran (it waited for a slot)."""
    if config.time_budget_s is None:
        return
    for run, mode, _ in pending:
        path = _stopped_path(run)
        if mode != "train" or not path.is_file():
            continue
        try:
            record = _record(path)
            seconds = max(float(record["seconds"]), float(record.get("call_seconds") or 0.0))
        except (ValueError, KeyError, TypeError):
            continue
        if float(config.time_budget_s) <= seconds:
            raise CompareError(
                f"--time-budget-s {config.time_budget_s:g}: run {run.run_id} was stopped unfinished after {seconds:.0f} s "
                "in an earlier call and would start from zero again and be stopped at the same point, on every call: "
                f"give a budget above {seconds:.0f} s (a run's full length is known once one finishes), or none")


def _stop_for_budget(config: CompareConfig, running: dict, pending: list, echo, sweep_start: float,
                     at_start: set[str]) -> dict:
    """The time budget is spent: stop the runs in flight (their part logs are set aside on the next start), record
    how long each training attempt ran (and, for those launched when the call started, ``at_start``, the time since
    ``sweep_start``: the whole budget they had), and say what is left; returns ``{"stopped": run ids,
    "not_started": run ids}``."""
    _stop_all([entry[1] for entry in running.values() if entry[1].poll() is None])
    now = time.perf_counter()
    for run_id, (run, _, _, started, _, _, mode, _) in running.items():
        if mode == "train":
            record = {"seconds": now - started, "budget_s": config.time_budget_s}
            if run_id in at_start:
                record["call_seconds"] = now - sweep_start
            atomic_write_text(_stopped_path(run), json.dumps(record))
    for entry in running.values():
        entry[2].close()
    echo(f"[compare] time budget of {config.time_budget_s:g} s: stopped {len(running)} run(s) in flight, "
         f"{len(pending)} not started; re-run the same command to continue (finished runs are kept)")
    return {"stopped": sorted(running), "not_started": [run.run_id for run, *_ in pending]}


def _model_sha256(config: CompareConfig) -> str | None:
    """:func:`~bloggap_plugin.checkpoint.model_sha256` of ``--model`` (``None`` unless a folder), as a
    :class:`CompareError` when the folder's weights cannot be hashed."""
    from bloggap_plugin.checkpoint import model_sha256
    from bloggap_plugin.core.errors import UsageError

    try:
        return model_sha256(config.model)
    except UsageError as err:
        raise CompareError(str(err)) from None


class _RunClock:
    """Seconds of the whole runs that ended in this call, the estimate of the next run's length (``--time-budget-s``):
    a run's training, plus its evaluation where that ran apart (``heldout_apart``)."""

    def __init__(self) -> None:
        self.whole: list[float] = []
        self._trained: dict[str, float] = {}  # trained apart, evaluation not ended yet

    def ended(self, run_id: str, mode: str, seconds: float, apart: bool) -> None:
        """A process of ``run_id`` succeeded after ``seconds``: its training (``mode`` ``"train"``) or its evaluation."""
        if mode == "train" and apart:
            self._trained[run_id] = seconds
        elif mode == "train":
            self.whole.append(seconds)
        elif run_id in self._trained:  # not for a run trained in an earlier call
            self.whole.append(self._trained.pop(run_id) + seconds)

    def estimate(self, prior: float | None) -> float | None:
        """The longest whole run of this call, else ``prior`` (what earlier calls recorded)."""
        return max(self.whole) if self.whole else prior


def _sweep(config: CompareConfig, runs: list[RunSpec], echo, lock_fd: int, model_sha: str | None = None) -> dict:
    pending = _plan_pending(config, runs, echo)
    _check_budget_progress(config, pending)
    total, failed, clock = len(pending), {}, _RunClock()
    retried: dict[str, list[int]] = {}  # run_id -> exit codes of its failed attempts started again
    ended, finished = 0, 0  # processes that ended; runs whose last step (training, or its evaluation) succeeded
    apart = bool(config.heldout_apart and heldout_count(config))
    prior = _prior_run_s(runs)
    running: dict[str, tuple] = {}  # run_id -> (run, process, console, start, attempt, part log, mode, trained attempt)
    at_start: set[str] = set()  # runs launched before any run ended: they had the budget from the call's start
    last_report, sweep_start = 0.0, time.perf_counter()
    deadline = None if config.time_budget_s is None else sweep_start + float(config.time_budget_s)
    budget = {"budget_s": config.time_budget_s, "stopped": [], "not_started": []}
    try:
        while pending or running:
            declined = False  # the budget kept the next run from starting
            while pending and len(running) < config.parallel:
                run, mode, trained = pending[0]
                if deadline is not None:
                    estimate = clock.estimate(prior)
                    left = deadline - time.perf_counter()
                    if left <= 0 or (mode == "train" and estimate is not None and estimate > left):
                        declined = True
                        break
                pending.pop(0)
                ports = {int(entry[1].master_port) for entry in running.values() if entry[1].master_port}
                running[run.run_id] = (run, *_launch(config, run, lock_fd, mode, trained, ports, model_sha), mode,
                                       trained)
                if not ended:  # launched at the call's start
                    at_start.add(run.run_id)
                what = "evaluating" if mode == "evaluate" else f"started ({run.recipe}, seed {run.seed})"
                echo(f"[compare] {run.run_id}: {what}")
            for run_id, (run, process, console, started, attempt, _, mode, trained) in list(running.items()):
                code = process.poll()
                if code is None:
                    continue
                console.close()
                del running[run_id]
                ended += 1
                elapsed = time.perf_counter() - started
                if _succeeded(config, run, code, mode, attempt, trained):
                    failed.pop(run_id, None)  # a retry that succeeded
                    if mode == "train":
                        _stopped_path(run).unlink(missing_ok=True)
                    clock.ended(run_id, mode, elapsed, apart)
                    if mode == "train" and apart:  # its evaluation next, in a process of its own
                        pending.insert(0, (run, "evaluate", attempt))
                        echo(f"[compare] {run_id}: trained in {elapsed:.0f} s; its evaluation starts apart")
                        continue
                    finished += 1
                    echo(f"[compare] {run_id}: done in {elapsed:.0f} s ({finished}/{total} finished)")
                else:
                    failed[run_id] = code
                    echo(f"[compare] {run_id}: FAILED (exit {code}); last output:\n{_tail(Path(run.log_jsonl).with_suffix('.out'))}")
                    again = _retry(config, run, retried, code, echo)
                    if again is not None:
                        pending.append(again)
            now = time.perf_counter()
            # Stop at the deadline, or when nothing runs because the launcher declined the next run. A run that
            # ended in this pass leaves room the launcher has not seen yet: that is no reason to stop.
            if deadline is not None and (now >= deadline or (declined and pending and not running)):
                budget.update(_stop_for_budget(config, running, pending, echo, sweep_start, at_start))
                running, pending = {}, []
                break
            if running and now - last_report >= max(10.0, config.poll_s):
                states = ", ".join(f"{rid} {_progress(config, entry[0], entry[5], entry[6])}"
                                   for rid, entry in running.items())
                echo(f"[compare] {now - sweep_start:.0f} s: running {states}; {len(pending)} waiting")
                last_report = now
            if running:
                time.sleep(config.poll_s)
    except BaseException as err:
        _ignore_stop_signals()  # a second Ctrl-C or SIGTERM must not cut the clean-up short
        in_flight = [process for _, process, *_ in running.values() if process.poll() is None]
        _stop_all(in_flight)
        for _, _, console, *_ in running.values():
            console.close()
        if isinstance(err, SweepStopped):
            err.stopped = len(in_flight)
        elif isinstance(err, KeyboardInterrupt):
            err.args = (len(in_flight),)
        raise
    results = build_results(config, runs)
    write_outputs(config, results)
    for run_id, why in results["set_aside"].items():
        echo(f"[compare] {run_id}: set aside: {why}")
    results["failed"] = failed
    results["retried"] = retried
    for run_id, codes in retried.items():
        echo(f"[compare] {run_id}: started again after failing (exit {', '.join(map(str, codes))}); "
             f"{'failed again' if run_id in failed else 'finished'}")
    results["time_budget"] = budget
    if failed:
        echo(f"[compare] {len(failed)} run(s) failed: {', '.join(sorted(failed))}; see runs/<run>.out. "
             "Re-run the same command to retry them (finished runs are kept).")
    return results


def _ignore_stop_signals() -> None:
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
