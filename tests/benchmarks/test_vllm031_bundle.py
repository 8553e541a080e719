"""The vLLM 0.31 bundle's shell scripts (benchmarks/gpu/vllm031_bundle.sh, probe_image.sh, vllm031/*.sh): they parse,
malformed knobs are refused with a one-line error before anything is downloaded, and the knobs select from the plan
what the plan says. Every run here sets PLAN_ONLY=1, so a knob that is wrongly accepted ends the run before the
download step instead of reaching the network."""

from __future__ import annotations

import os
import subprocess

import pytest
from _support import ROOT, tracked_tree_bytes

GPU = ROOT / "benchmarks" / "gpu"
BUNDLE = GPU / "vllm031_bundle.sh"
SCRIPTS = [BUNDLE, GPU / "probe_image.sh", GPU / "vllm031" / "install.sh", GPU / "vllm031" / "env.sh"]


def _plan() -> list[tuple[str, str, str]]:
    rows = []
    for line in (GPU / "vllm031_plan.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, spec, default = line.split()[:3]
            rows.append((key, spec, default))
    return rows


def _run(tmp_path, **knobs: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("SKIP", "WITH", "CHUNK", "NO_MODEL", "NO_TRL", "DEST")}
    env.update(PLAN_ONLY="1", DEST=str(tmp_path / "dest"), **knobs)
    return subprocess.run(["bash", str(BUNDLE)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def _carried(tmp_path, **knobs: str) -> set[str]:
    res = _run(tmp_path, **knobs)
    assert res.returncode == 0, res.stderr
    return {line.split()[1] for line in res.stdout.splitlines() if line.startswith("carry ")}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shell_syntax_is_valid(script, spawns):
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize(("knobs", "named"), [
    ({"CHUNK": "abc"}, "CHUNK='abc'"),
    ({"CHUNK": "0"}, "CHUNK='0'"),
    ({"CHUNK": "46e6"}, "CHUNK='46e6'"),
    ({"CHUNK": "999999"}, "CHUNK=999999 is outside"),
    ({"CHUNK": "70000000"}, "CHUNK=70000000 is outside"),
    ({"CHUNK": "99999999999999999999"}, "is outside"),
    ({"SKIP": "torch pytorch"}, "SKIP names 'pytorch'"),
    ({"WITH": "cudnn9"}, "WITH names 'cudnn9'"),
    ({"SKIP": "cudnn", "WITH": "cudnn"}, "'cudnn' is in both SKIP and WITH"),
    ({"NO_MODEL": "yes"}, "NO_MODEL='yes'"),
    ({"NO_TRL": "0"}, "NO_TRL='0'"),
])
def test_malformed_knobs_are_refused_with_one_line(tmp_path, spawns, knobs, named):
    res = _run(tmp_path, **knobs)
    assert res.returncode == 2
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vllm031_bundle.sh: ") and named in lines[0], res.stderr
    assert not (tmp_path / "dest").exists()


def test_default_selection_is_the_plans_yes_rows_plus_vllm_and_the_model(tmp_path, spawns):
    plan = _plan()
    assert _carried(tmp_path) == {k for k, _, d in plan if d == "yes"} | {"vllm", "model"}
    assert {"torch", "triton", "nccl"} <= _carried(tmp_path)  # torch 2.13 does not import with the image's NCCL
    assert "cudnn" not in _carried(tmp_path)


def test_skip_with_and_the_shortcuts_change_exactly_what_they_name(tmp_path, spawns):
    base = _carried(tmp_path)
    assert _carried(tmp_path, SKIP="triton sniffio") == base - {"triton", "sniffio"}
    assert _carried(tmp_path, WITH="cudnn cublas") == base | {"cudnn", "cublas"}
    assert _carried(tmp_path, NO_TRL="1") == base - {"trl", "datasets", "dill", "multiprocess"}
    assert _carried(tmp_path, NO_MODEL="1") == base - {"gguf", "model"}


def test_the_default_chunk_fits_one_call_beside_the_tracked_tree(tmp_path, spawns):
    """A device call carries the tracked tree and its chunk (and the bundle's small t/ and data), and a 46 MB chunk no
    longer fits beside the tree (benchmarks/results/h100/README.md). The default chunk is 63 MB less the tree less
    5 MB for the rest, rounded down to 100 kB; a CHUNK that cannot fit beside the tree is refused, naming its size."""
    tree = tracked_tree_bytes()
    res = _run(tmp_path)
    assert res.returncode == 0, res.stderr
    chunk_line = [line for line in res.stdout.splitlines() if line.startswith("chunk ")]
    assert chunk_line == [f"chunk {(63_000_000 - tree - 5_000_000) // 100_000 * 100_000} bytes (tracked tree {tree} "
                          f"bytes; a call carries at most 63000000 here)"]
    too_big = 63_000_000 - tree + 1
    res = _run(tmp_path, CHUNK=str(too_big))
    assert res.returncode == 2 and f"CHUNK={too_big} does not fit one call beside the tracked tree ({tree} bytes)" in \
        res.stderr
