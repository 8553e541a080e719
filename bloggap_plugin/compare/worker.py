"""The run subprocess: ``python -m bloggap_plugin.compare --worker SPEC`` trains one arm x seed into its own log."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from bloggap_plugin.compare.logs import MODEL_SHA256_KEY
from bloggap_plugin.compare.sweep_config import DONE_KEY, resolve_function
from bloggap_plugin.results import jsonable

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """End this process as soon as the sweep process ``parent_pid`` is gone, however it ended (SIGKILL, OOM kill).

    Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``; everywhere: a daemon thread that checks the parent every second
    (the fallback, and the cover for a parent that died before the request took effect).
    """
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):  # pragma: no cover - no prctl: the watchdog below does the job
            pass
    if os.getppid() != parent_pid:
        os._exit(1)

    def watchdog() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watchdog, name="bloggap-compare-parent-watchdog", daemon=True).start()


def _worker(spec_path: str) -> int:
    """Subprocess entry: run one arm x seed into this attempt's own log, then append the completion marker and
    rename that log to the run's log (so the run's log only ever exists complete); with a held-out evaluation, the
    training saves its policy and the evaluation follows (``mode == "evaluate"``: only the evaluation, of the
    policy training attempt ``trained_attempt`` saved), in this process unless the spec's held-out says ``apart``:
    then the sweep starts the evaluation as a process of its own once this one has ended."""
    spec = json.loads(Path(spec_path).read_text())
    _die_with_parent(int(spec["parent_pid"]))
    heldout = spec.get("heldout")
    attempt = spec["attempt"]
    if spec.get("mode") == "evaluate":
        attempt = spec["trained_attempt"]
    else:
        _train(spec, heldout)
        if heldout and heldout.get("apart"):
            return 0
    if heldout:
        from bloggap_plugin.compare.heldout import evaluate_run

        evaluate_run(spec, attempt)
    return 0


def _train(spec: dict, heldout: dict | None) -> None:
    """Train the run into its part log, mark it done and rename it to the run's log."""
    run_fn = resolve_function(spec["run_fn"])
    part = Path(spec["part_jsonl"])
    kwargs = dict(
        model=spec["model"],
        task=spec["task"],
        max_steps=spec["max_steps"],
        output_dir=spec["output_dir"],
        report_to="none",
        seed=spec["seed"],
        log_jsonl=str(part),
        extra_overrides=spec["extra_overrides"],
    )
    task_kwargs = {k: v for k, v in spec["task_kwargs"].items() if v is not None}
    if task_kwargs:  # the sweep checked that run_fn takes them
        kwargs["task_kwargs"] = task_kwargs
    if heldout:  # the sweep checked that run_fn takes save_final (and heldout, for --heldout-every)
        kwargs["save_final"] = heldout["final_dir"]
        if heldout["every"]:
            kwargs["heldout"] = {"every": heldout["every"], "n": heldout["settings"]["n"],
                                 "max_tokens": heldout["settings"]["max_tokens"], "batch_size": heldout["batch_size"]}
    part.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    result = run_fn(spec["recipe"], **kwargs)
    wall_s = time.perf_counter() - start
    own = result.get(MODEL_SHA256_KEY) if isinstance(result, dict) else None
    if own is not None and own != spec.get(MODEL_SHA256_KEY):  # the folder's weights changed while the sweep ran
        raise RuntimeError(f"the run hashed {spec['model']} as {own[:12]}..., the sweep as "
                           f"{str(spec.get(MODEL_SHA256_KEY))[:12]}...: its weights changed during the sweep; keep the "
                           "model folder unchanged until the sweep ends, then run the sweep again")
    if heldout:
        from bloggap_plugin.compare.heldout import stamp_final

        stamp_final(spec, spec["attempt"])
    marker = {DONE_KEY: "done", "arm": spec["arm"], "seed": spec["seed"], "attempt": spec["attempt"],
              "settings": spec["settings"], MODEL_SHA256_KEY: spec.get(MODEL_SHA256_KEY), "wall_s": wall_s,
              "result": jsonable(result)}
    with open(part, "a") as handle:
        handle.write(json.dumps(marker) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(part, spec["log_jsonl"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="bloggap compare worker (internal)")
    parser.add_argument("--worker", required=True, help="run spec JSON written by run_compare")
    args = parser.parse_args(argv)
    return _worker(args.worker)
