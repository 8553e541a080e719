"""benchmarks/gpu/session.sh: one background job across device calls (the GSM8K comparison, a set of cost runs),
with a stand-in for the job (the real ones need vLLM and a GPU)."""

from __future__ import annotations

import os
import signal
import subprocess
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from _support.events import HANG_S, wait_for

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu" / "session.sh"

# The stand-in writes what gsm8k_compare_call.sh writes (a progress line and another, its outputs, a run's log and a
# saved policy in the sweep), then waits for the test's release file and exits 3, as the call script does when its
# budget ends with runs left. Its arguments and budget go to its console.
STAND_IN = """#!/usr/bin/env bash
echo "[compare] A_s0: started budget=$BUDGET_S args=$*"
echo "a line the progress pattern leaves out"
mkdir -p "$OUT/warmstart" "$SWEEP/runs" "$SWEEP/trainer/A_s0/final"
echo '{"benchmark": "gsm8k_warmstart"}' > "$OUT/warmstart/gsm8k_warmstart.json"
echo '{"step": 1}' > "$SWEEP/runs/A_s0.jsonl"
echo weights > "$SWEEP/trainer/A_s0/final/model.safetensors"
touch "$OUT/../ready"
while [ ! -f "$OUT/../release" ]; do sleep 0.1; done
exit 3
"""


def _session(tmp_path: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "STATE": str(tmp_path / "state"), "SWEEP": str(tmp_path / "sweep"),
               "OUT": str(tmp_path / "out"), **extra}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=environ, capture_output=True, text=True,
                          timeout=HANG_S)


def _start(tmp_path: Path, **extra: str) -> subprocess.CompletedProcess:
    (tmp_path / "job.sh").write_text(STAND_IN)
    return _session(tmp_path, "start", "bash", str(tmp_path / "job.sh"), "one", "two words", **extra)


@contextmanager
def _job(state: Path) -> Iterator[int]:
    """The started job's pid; its process group is killed on the way out, whatever the test did."""
    pid = int((state / "pid").read_text())
    try:
        yield pid
    finally:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _members(tmp_path: Path) -> set[str]:
    with tarfile.open(tmp_path / "out" / "session.tgz") as archive:
        return {member.name for member in archive.getmembers() if member.isfile()}


def test_start_needs_a_budget_and_a_command_and_watch_needs_a_started_job(tmp_path, spawns):
    done = _session(tmp_path, "start", "true")
    assert done.returncode == 2 and "set SESSION_S" in done.stderr
    done = _session(tmp_path, "start", "true", SESSION_S="soon")
    assert done.returncode == 2 and "set SESSION_S" in done.stderr
    done = _session(tmp_path, "start", SESSION_S="60")
    assert done.returncode == 2 and "name the command to run" in done.stderr
    done = _session(tmp_path, "watch")
    assert done.returncode == 2 and "no job was started on this machine" in done.stderr
    done = _session(tmp_path)
    assert done.returncode == 2 and done.stderr.startswith("usage:")


def test_the_job_runs_in_its_own_session_and_each_watch_packs_what_it_has_written(tmp_path, spawns):
    """start returns while the job runs (exit 3) and the job leads a new process session, the one kind of process
    the device machine leaves running when a call returns; it gets its arguments, BUDGET_S and OUT. A watch prints
    the lines PROGRESS picks and packs the job's log and outputs and the PACK paths as they are, without saved
    policies; once the job ends, watch says so (exit 0) and passes its exit status on."""
    state = tmp_path / "state"
    done = _start(tmp_path, SESSION_S="1234", WAIT_S="0", PACK=str(tmp_path / "sweep" / "runs"),
                  PROGRESS=r"^\[compare\]")
    with _job(state) as pid:
        assert done.returncode == 3, done.stdout + done.stderr
        assert "still running" in done.stdout and f"pid {pid}, budget 1234 s" in done.stdout
        assert os.getsid(pid) == pid  # a session leader: setsid, not a member of the call's session
        assert os.getsid(pid) != os.getsid(0)
        again = _start(tmp_path, SESSION_S="1234")
        assert again.returncode == 2 and f"a job is already running (pid {pid})" in again.stderr
        wait_for(lambda: (state / "ready").exists(), what="the stand-in's outputs")
        done = _session(tmp_path, "watch", WAIT_S="0")  # PACK and PROGRESS come from start
        assert done.returncode == 3 and "A_s0: started budget=1234 args=one two words" in done.stdout
        assert "leaves out" not in done.stdout
        assert _members(tmp_path) == {"job.log", "out/warmstart/gsm8k_warmstart.json", "runs/A_s0.jsonl"}
        assert not (tmp_path / "out" / "job_exit").exists()
        (state / "release").touch()
        done = _session(tmp_path, "watch", WAIT_S=str(HANG_S))
        assert done.returncode == 0 and "the job ended, exit 3" in done.stdout, done.stdout + done.stderr
        assert (tmp_path / "out" / "job_exit").read_text().strip() == "3"
        assert "exit" in _members(tmp_path)


def test_a_relative_pack_path_is_the_repository_roots_and_no_progress_pattern_prints_every_line(tmp_path, spawns):
    state = tmp_path / "state"
    relative = os.path.relpath(tmp_path / "sweep", ROOT)
    done = _start(tmp_path, SESSION_S="60", WAIT_S="0", PACK=relative)
    with _job(state):
        assert Path((state / "pack").read_text().strip()).resolve() == (tmp_path / "sweep").resolve()
        wait_for(lambda: (state / "ready").exists(), what="the stand-in's outputs")
        (state / "release").touch()
        done = _session(tmp_path, "watch", WAIT_S=str(HANG_S))
        assert done.returncode == 0 and "leaves out" in done.stdout
        assert "sweep/runs/A_s0.jsonl" in _members(tmp_path)
        assert not any("trainer" in name for name in _members(tmp_path))


def test_watch_tells_a_killed_job_from_one_that_ended(tmp_path, spawns):
    """A job killed from outside (no exit status written) is reported as such, exit 1, not as finished."""
    state = tmp_path / "state"
    _start(tmp_path, SESSION_S="60", WAIT_S="0")
    pid = int((state / "pid").read_text())
    wait_for(lambda: (state / "ready").exists(), what="the stand-in's outputs")
    os.killpg(pid, signal.SIGKILL)
    wait_for(lambda: not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z",
             what="the job's end")
    done = _session(tmp_path, "watch", WAIT_S=str(HANG_S))
    assert done.returncode == 1 and "ended without recording its exit status" in done.stderr


def test_cost_by_size_more_takes_its_budget_from_the_session_job(tmp_path, spawns):
    """cost_by_size_more.sh NAME - ...: the run's --budget-s is the session job's BUDGET_S less 60 s for the packing."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").write_text('#!/usr/bin/env bash\necho "python3 $*"\n')
    (bindir / "python3").chmod(0o755)
    vllm_t = tmp_path / "repo" / ".dev" / "vllm" / "t"
    vllm_t.mkdir(parents=True)
    (vllm_t / "env.sh").write_text("")
    name = f"c_test_{os.getpid()}"
    environ = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
               "BUDGET_S": "1000"}
    (tmp_path / "out").mkdir()
    try:
        done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "cost_by_size_more.sh"), name, "-", "--arms",
                               "A,J"], cwd=tmp_path / "repo", env=environ, capture_output=True, text=True,
                              timeout=HANG_S)
    finally:
        subprocess.run(["rm", "-rf", f"/tmp/{name}"], check=False)
    assert f"python3 -m benchmarks.cost_by_size run --budget-s 940 --out /tmp/{name} --arms A,J" in done.stdout
