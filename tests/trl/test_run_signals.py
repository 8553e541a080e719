"""``run_training`` from Python installs no signal handler (a library must not replace its caller's); SIGTERM and
SIGHUP act as Ctrl-C only inside :func:`~bloggap_plugin.trl.run.stop_signals_interrupt`, which ``bloggap train``
uses and a Python caller may use too."""

from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip("trl")

from _support import ROOT  # noqa: E402

from bloggap_plugin.trl import run  # noqa: E402

SMALL = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=8)


class _Terminated(Exception):
    """What the test's own SIGTERM handler raises."""


def test_run_training_installs_no_signal_handler(tmp_path, monkeypatch, trains):
    """A one-step run on a tiny model: ``signal.signal`` is never called, and the caller's handlers are the ones in
    force during training and after."""
    calls = []
    monkeypatch.setattr(signal, "signal", lambda *args: calls.append(args))
    seen = {}

    original = run.JsonlLogger

    def logger_that_looks(path):  # records the SIGTERM handler in force at each optimizer step's end
        logger = original(path)
        step_end = logger.on_step_end

        def on_step_end(*args, **kwargs):
            seen["sigterm"] = signal.getsignal(signal.SIGTERM)
            return step_end(*args, **kwargs)

        logger.on_step_end = on_step_end
        return logger

    monkeypatch.setattr(run, "JsonlLogger", logger_that_looks)
    before = signal.getsignal(signal.SIGTERM)
    summary = run.run_training(ROOT / "recipes" / "arm_A.yaml", model="tiny-random-llama", max_steps=1,
                               output_dir=tmp_path / "out", log_jsonl=tmp_path / "log.jsonl", extra_overrides=SMALL)
    assert summary["steps"] == 1 and not summary["interrupted"]
    assert calls == [] and seen["sigterm"] is before and signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("name", run.STOP_SIGNALS)
def test_stop_signals_interrupt_turns_a_stop_signal_into_ctrl_c(name):
    """Inside the context the signal raises ``KeyboardInterrupt`` (what ``run_training`` catches to summarise the
    finished steps) and is recorded; outside it, the caller's handler is back."""
    number = getattr(signal, name)

    def terminated(signum, frame):
        raise _Terminated

    previous = signal.signal(number, terminated)
    received: list[int] = []
    try:
        with pytest.raises(KeyboardInterrupt), run.stop_signals_interrupt(received):
            os.kill(os.getpid(), number)
            deadline = time.monotonic() + 60  # guards a hang only: the signal ends the wait
            while time.monotonic() < deadline:
                time.sleep(0.01)
        assert received == [number]
        assert signal.getsignal(number) is terminated
    finally:
        signal.signal(number, previous)
