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



def _cost_session(tmp_path: Path, budget_s: int, tiles_written: bool, **extra: str) -> list[str]:
    """Runs cost_by_size_session.sh (and its helpers) in a copy of the repository's layout whose other
    scripts, python3 and nvidia-smi are stand-ins that print what they were given (python3 also appends it to
    ``tmp_path/calls.log``, whole, and writes each --out FILE.json where ``tiles_written``); the lines printed."""
    repo = tmp_path / "repo"
    gpu = repo / "benchmarks" / "gpu"
    gpu.mkdir(parents=True)
    for script in ("cost_by_size_session.sh", "onpolicy_grad_test.sh", "tiles_or_plain.sh"):  # the job, real helpers
        (gpu / script).write_text((ROOT / "benchmarks" / "gpu" / script).read_text())
    (gpu / "tiles_first.sh").write_text('echo "tiles_first $* SHAPE=$SHAPE ARMS=$ARMS budget=$((BUDGET_S - 60))"\n')
    (gpu / "cost_by_size_more.sh").write_text('echo "more $*"\n')
    (repo / ".dev" / "vllm" / "t").mkdir(parents=True)
    (repo / ".dev" / "vllm" / "t" / "env.sh").write_text("")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    python3 = ['#!/usr/bin/env bash', 'echo "python3 $*"', f'echo "python3 $*" >> {tmp_path / "calls.log"}',
               '[ "$2" = pytest ] && echo "1 passed model=${BLOGGAP_GPU_TEST_MODEL:-tiny}"']
    if tiles_written:
        python3.append('prev=; for a in "$@"; do [ "$prev" = --out ] && [[ "$a" == *.json ]]'
                       ' && mkdir -p "$(dirname "$a")" && : > "$a"; prev=$a; done')
    (bindir / "python3").write_text("\n".join(python3) + "\n")
    (bindir / "nvidia-smi").write_text("#!/usr/bin/env bash\necho card\n")
    for tool in ("python3", "nvidia-smi"):
        (bindir / tool).chmod(0o755)
    (tmp_path / "out").mkdir()
    environ = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
               "BUDGET_S": str(budget_s), "VX": str(tmp_path / "vx"), **extra}
    done = subprocess.run(["bash", str(gpu / "cost_by_size_session.sh")], cwd=repo, env=environ, capture_output=True,
                          text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()


def _line(lines: list[str], prefix: str) -> str:
    return next(line for line in lines if line.startswith(prefix))


def test_the_cost_session_keeps_each_later_phase_its_reserve(tmp_path, spawns):
    """Phase 1 (the shape's set) ends by the job's end less the packing minute and the reserves of phases 2 (420 s)
    and 3 (150 s), phase 2 by the end less phase 3's reserve; the gradient test runs on the tiny Llama and the 1.56B
    shape; phase 4 (3B) gets the rest, with its own tile table for J:tiles."""
    lines = _cost_session(tmp_path, 1000, tiles_written=True)
    first = _line(lines, "tiles_first")
    assert first.startswith("tiles_first - SHAPE=llama-0.48b-v49k ARMS=A,J:tiles,I:tiles,H budget=")
    assert 1000 - 60 - 570 - 2 <= int(first.rsplit("=", 1)[1]) <= 1000 - 60 - 570
    small = _line(lines, "more c2").split()
    assert 1000 - 60 - 150 - 2 <= int(small[2]) <= 1000 - 60 - 150
    assert small[3:] == f"--model smollm2-135m={tmp_path}/vx/smollm2 --arms A,J --repeats 3 --steps 30".split()
    assert [line.split("model=")[1] for line in lines if line.startswith("1 passed")] == ["tiny", f"{tmp_path}/vx/l156"]
    assert (tmp_path / "out" / "onpolicy_gpu_grad.log").read_text().count("1 passed") == 2
    big = _line(lines, "more c3").split()
    assert 1000 - 60 - 2 <= int(big[2]) <= 1000 - 60
    assert big[3:] == (f"--model llama-3b={tmp_path}/vx/llama-3b-v49k --arms A,J:tiles --repeats 3 --steps 30 "
                       f"--matmul-tiles {tmp_path}/vx/tiles_3b.json").split()
    assert (tmp_path / "out" / "tiles_3b.json").exists()


def test_the_cost_session_runs_no_3b_without_the_time_and_no_tiles_arm_without_a_table(tmp_path, spawns):
    """With 240 s or less left after phase 3, phase 4 does not start; a phase with no time left gets 1 s (timeout 0
    would mean no limit). Without a 3B tile table its J:tiles run is a plain J run."""
    lines = _cost_session(tmp_path, 300, tiles_written=True)
    assert int(_line(lines, "tiles_first").rsplit("=", 1)[1]) == 1
    assert not any(line.startswith("more c3") for line in lines)
    lines = _cost_session(tmp_path / "again", 1000, tiles_written=False)
    big = f"--model llama-3b={tmp_path}/again/vx/llama-3b-v49k --arms A,J --repeats 3 --steps 30"
    assert _line(lines, "more c3").split()[3:] == big.split()


def test_cost_by_size_more_passes_each_run_line_on_as_it_comes(tmp_path, spawns):
    """A session's watch prints the job's console as it is: each finished run's line must reach it while the runs go
    on, not when the call's whole output ends (a pipe's buffer held them in session 31's first watch)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    release = tmp_path / "release"
    (bindir / "python3").write_text(f'#!/usr/bin/env bash\necho "smollm2-135m A-1 exit 0 61 s"\n'
                                    f'while [ ! -f {release} ]; do sleep 0.1; done\n')
    (bindir / "python3").chmod(0o755)
    (tmp_path / "repo" / ".dev" / "vllm" / "t").mkdir(parents=True)
    (tmp_path / "repo" / ".dev" / "vllm" / "t" / "env.sh").write_text("")
    (tmp_path / "out").mkdir()
    name = f"c_test_{os.getpid()}"
    environ = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out")}
    console = tmp_path / "console.log"
    with open(console, "w") as sink:
        script = ROOT / "benchmarks" / "gpu" / "cost_by_size_more.sh"
        job = subprocess.Popen(["bash", str(script), name, str(4 * HANG_S)],  # its own timeout well past the guard
                               cwd=tmp_path / "repo", env=environ, stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "A-1 exit 0" in console.read_text(), what="the run's line in the console")
    finally:
        release.touch()
        job.wait(timeout=HANG_S)
        subprocess.run(["rm", "-rf", f"/tmp/{name}"], check=False)


def test_a_skipped_cost_phase_reserves_nothing_and_phase_4_can_keep_a_reserve(tmp_path, spawns):
    """SMALL_ARMS= and GRAD_TEST=0 skip phases 2 and 3 (the shape's set and the 3B runs alone, as on an H200 for the
    Qwen2 shape); BIG_S keeps phase 4 its reserve from phase 1."""
    lines = _cost_session(tmp_path, 1000, tiles_written=True, SHAPE="qwen2-1.39b-v49k", SMALL_ARMS="", GRAD_TEST="0",
                          BIG_S="300", BIG_REPEATS="2")
    first = _line(lines, "tiles_first")
    assert first.startswith("tiles_first - SHAPE=qwen2-1.39b-v49k ")
    assert 1000 - 60 - 300 - 2 <= int(first.rsplit("=", 1)[1]) <= 1000 - 60 - 300
    assert not any(line.startswith(("more c2", "1 passed")) for line in lines)
    assert "--repeats 2" in _line(lines, "more c3")


def test_the_3b_shape_can_be_phase_1_and_then_no_phase_runs_it_again(tmp_path, spawns):
    """With SHAPE=llama-3b-v49k (an H200's job) and BIG_ARMS= phase 4 does not run the shape a second time."""
    lines = _cost_session(tmp_path, 1000, tiles_written=True, SHAPE="llama-3b-v49k", SMALL_ARMS="", GRAD_TEST="0",
                          BIG_ARMS="")
    first = _line(lines, "tiles_first")
    assert first.startswith("tiles_first - SHAPE=llama-3b-v49k ")
    assert 1000 - 60 - 2 <= int(first.rsplit("=", 1)[1]) <= 1000 - 60
    assert "phase 4: llama-3b-v49k, arms none" in "\n".join(lines)
    assert not any(line.startswith("more c3") for line in lines)


def test_the_cost_session_profiles_135m_between_its_small_runs_and_the_gradient_test(tmp_path, spawns):
    """PROFILE_ARMS=A,J profiles SmolLM2-135M's steps 10-11 per arm (callback runs of benchmarks.arm_i_live) into the
    job's out/prof_135m (phase 2p), and phase 1 keeps it its reserve (PROFILE_S, 300 s);
    without PROFILE_ARMS no profile runs and nothing is reserved."""
    lines = _cost_session(tmp_path, 1000, tiles_written=True, SMALL_ARMS="", GRAD_TEST="0", BIG_ARMS="",
                          PROFILE_ARMS="A,J")
    assert 1000 - 60 - 300 - 2 <= int(_line(lines, "tiles_first").rsplit("=", 1)[1]) <= 1000 - 60 - 300
    # from the stand-in's own record: the job cuts the console lines of this phase to 300 characters
    profile = _line((tmp_path / "calls.log").read_text().splitlines(), "python3 -m benchmarks.arm_i_live")
    assert profile == (f"python3 -m benchmarks.arm_i_live run --model {tmp_path}/vx/smollm2 --out {tmp_path}/out/"
                       "prof_135m --steps 12 --memory 0.3 --runs callback_A_ni2,callback_J_ni2 --profile-steps 10-11")
    lines = _cost_session(tmp_path / "again", 1000, tiles_written=True, SMALL_ARMS="", GRAD_TEST="0", BIG_ARMS="")
    assert 1000 - 60 - 2 <= int(_line(lines, "tiles_first").rsplit("=", 1)[1]) <= 1000 - 60
    assert not any("arm_i_live" in line for line in lines)
    # PROFILE_SHAPES=1: the profiles also list the matmuls by input shape
    _cost_session(tmp_path / "shapes", 1000, tiles_written=True, SMALL_ARMS="", GRAD_TEST="0", BIG_ARMS="",
                  PROFILE_ARMS="A,J", PROFILE_SHAPES="1")
    profile = _line((tmp_path / "shapes" / "calls.log").read_text().splitlines(), "python3 -m benchmarks.arm_i_live")
    assert profile.endswith("--profile-steps 10-11 --profile-shapes")


def test_without_a_tile_table_a_tiles_scope_joined_to_another_keeps_the_other(tmp_path, spawns):
    """tiles_or_plain.sh with no table: ARM:tiles becomes ARM, ARM:tiles+SCOPE and ARM:SCOPE+tiles become ARM:SCOPE
    (the route's before still runs, without the table), duplicates dropped in order."""
    script = (f". {ROOT / 'benchmarks' / 'gpu' / 'tiles_or_plain.sh'}; OUT={tmp_path}; "
              "arms=A,J:tiles,J:tiles+dense_attention,J:dense_attention+tiles,I:tiles,J; "
              f"tiles_or_plain {tmp_path / 'none.json'} arms; echo \"$arms\"")
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=HANG_S)
    assert done.stdout.splitlines()[-1] == "A,J,J:dense_attention,I", done.stdout + done.stderr


def test_the_gradient_test_takes_phase_1s_shape_when_it_is_the_1_56b_one(tmp_path, spawns):
    """With SHAPE=llama-1.56b-v49k phase 1 has already written the shape to $VX/l156: phase 3 tests it there without
    building it again, and leaves it; otherwise it builds the shape for the test and removes it after."""
    shape = tmp_path / "vx" / "l156"
    shape.mkdir(parents=True)
    (shape / "config.json").write_text("{}")
    lines = _cost_session(tmp_path, 1000, tiles_written=True, SHAPE="llama-1.56b-v49k", SMALL_ARMS="", BIG_ARMS="")
    assert not any("cost_by_size shape llama-1.56b-v49k" in line for line in lines)
    assert f"1 passed model={shape}" in lines and (shape / "config.json").exists()
    lines = _cost_session(tmp_path / "again", 1000, tiles_written=True, SMALL_ARMS="", BIG_ARMS="")
    assert any("cost_by_size shape llama-1.56b-v49k" in line for line in lines)
    assert f"1 passed model={tmp_path}/again/vx/l156" in lines


def test_big_memory_gives_the_3b_engines_another_share_and_labels_its_rows(tmp_path, spawns):
    """BIG_MEMORY=0.15 (a card where the runs' 0.3 left the trainer too little, T30's H100): phase 4's runs give
    their engines that share (--memory) under the label llama-3b-vllm0.15, so the size table says which share ran."""
    lines = _cost_session(tmp_path, 1000, tiles_written=False, SMALL_ARMS="", GRAD_TEST="0", BIG_MEMORY="0.15")
    big = f"--model llama-3b-vllm0.15={tmp_path}/vx/llama-3b-v49k --arms A,J --repeats 3 --steps 30 --memory 0.15"
    assert _line(lines, "more c3").split()[3:] == big.split()
