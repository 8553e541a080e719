"""benchmarks/gpu/ckpt_out.sh, ckpt_parts.sh and ckpt_join.sh: a checkpoint folder brought back from the GPU machine
in calls of at most eight files, split here into chunks that each fit one call, and restored on a later machine byte
for byte (a stand-in checkpoint of pseudo-random bytes; small parts and chunks)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from _support import ROOT, python3_shim
from _support.events import HANG_S

from bloggap_plugin.checkpoint import checkpoint_sha256

GPU = ROOT / "benchmarks" / "gpu"


def _checkpoint(folder: Path, seed: int = 0) -> dict[str, bytes]:
    """A saved-model stand-in: config.json, 2.5 MB of weights, a tokenizer file."""
    folder.mkdir(parents=True)
    made = {"config.json": b'{"model_type": "llama"}',
            "model.safetensors": bytes((seed * 17 + i * 7919 + (i >> 9)) % 251 for i in range(2_500_000)),
            "tokenizer.json": b'{"version": "1.0"}'}
    for name, data in made.items():
        (folder / name).write_bytes(data)
    return made


def _env(tmp_path: Path, **extra: str) -> dict:
    bindir = tmp_path / "bin"
    if not bindir.exists():
        python3_shim(bindir)
    return {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", **extra}


def _script(name: str, tmp_path: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(GPU / name), *args], cwd=ROOT, env=_env(tmp_path, **extra),
                          capture_output=True, text=True, timeout=HANG_S)


def _bring_back(tmp_path: Path, ckpt: Path) -> list[Path]:
    """The ckpt_out.sh calls from part 0 while each says what comes next: one $OUT folder per call."""
    outs, first = [], "0"
    while True:
        out = tmp_path / f"out{len(outs)}"
        done = _script("ckpt_out.sh", tmp_path, first, CKPT=str(ckpt), STAGE=str(tmp_path / "stage"),
                       OUT=str(out), PART_BYTES="300000")
        assert done.returncode == 0, done.stderr
        outs.append(out)
        files = list(out.iterdir())
        assert len(files) <= 8 and all(f.stat().st_size <= 300_000 for f in files)  # what one call brings back
        if "all parts brought" in done.stdout:
            return outs
        first = done.stdout.split("ckpt_out.sh ")[-1].strip()


def test_a_checkpoint_brought_back_in_calls_is_restored_byte_for_byte_on_a_later_machine(tmp_path, spawns):
    made = _checkpoint(tmp_path / "ckpt")
    outs = _bring_back(tmp_path, tmp_path / "ckpt")
    manifest = (outs[0] / "ckpt.manifest").read_text().split()
    parts = int(manifest[manifest.index("nparts") + 1])
    assert len(outs) == -(-parts // 7) >= 2  # seven parts and the manifest a call
    sha = checkpoint_sha256(tmp_path / "ckpt")
    assert manifest[manifest.index("checkpoint_sha256") + 1] == sha
    done = _script("ckpt_parts.sh", tmp_path, *map(str, outs), DEST=str(tmp_path / "dest"), CHUNK="1000000")
    assert done.returncode == 0, done.stderr
    dest = tmp_path / "dest"
    count = int((dest / "t" / "nparts").read_text())
    assert done.stdout.strip() == (f'checkpoint {sha[:12]}: {count} calls, carry ["{dest}/pN"] for N = 1..{count}, '
                                   f"then ckpt_join.sh with {dest}/t carried")
    folders = sorted(dest.glob("p[0-9]*"), key=lambda p: int(p.name[1:]))
    assert [f.name for f in folders] == [f"p{n}" for n in range(1, count + 1)] and count >= 3
    assert all(next(f.iterdir()).stat().st_size <= 1_000_000 for f in folders)
    device = tmp_path / "device"
    device.mkdir()
    for folder in folders[:-1]:  # the chunk calls, the last one not yet made
        shutil.copy(next(folder.iterdir()), device)
    join = {"CKPT": str(tmp_path / "restored"), "CKPT_DIR": str(device), "T": str(dest / "t")}
    missing = _script("ckpt_join.sh", tmp_path, **join)
    assert missing.returncode == 3 and f"{count - 1} of {count} chunks" in missing.stderr
    shutil.copy(next(folders[-1].iterdir()), device)
    joined = _script("ckpt_join.sh", tmp_path, **join)
    assert joined.returncode == 0, joined.stderr
    assert joined.stdout.strip() == f"ckpt_join.sh: checkpoint {sha[:12]} in {tmp_path / 'restored'}"
    assert {p.name: p.read_bytes() for p in (tmp_path / "restored").iterdir()} == made
    assert not list(device.iterdir())  # the chunks and the tar are gone
    again = _script("ckpt_join.sh", tmp_path, **join)
    assert again.returncode == 0 and "already holds checkpoint" in again.stdout


def test_missing_or_damaged_parts_and_another_checkpoint_are_refused(tmp_path, spawns):
    _checkpoint(tmp_path / "ckpt")
    outs = _bring_back(tmp_path, tmp_path / "ckpt")
    dest = {"DEST": str(tmp_path / "dest"), "CHUNK": "1000000"}
    done = _script("ckpt_parts.sh", tmp_path, str(outs[0]), **dest)
    assert done.returncode == 2 and "parts 7 " in done.stderr and "ckpt_out.sh 7 on the machine" in done.stderr
    part = outs[1] / "ckpt.part_007"
    part.write_bytes(b"x" + part.read_bytes()[1:])
    done = _script("ckpt_parts.sh", tmp_path, *map(str, outs), **dest)
    assert done.returncode == 2 and "do not match the manifest's tar_sha256" in done.stderr
    assert not (tmp_path / "dest" / "ckpt.tar").exists()
    other = tmp_path / "other"
    _checkpoint(other / "ckpt", seed=1)
    other_out = _bring_back(other, other / "ckpt")
    done = _script("ckpt_parts.sh", tmp_path, str(outs[0]), str(other_out[1]), **dest)
    assert done.returncode == 2 and "the calls packed two checkpoints" in done.stderr
    done = _script("ckpt_parts.sh", tmp_path, str(tmp_path / "ckpt"), **dest)
    assert done.returncode == 2 and "no ckpt.manifest" in done.stderr
    # a restore over a folder that holds another checkpoint
    done = _script("ckpt_parts.sh", tmp_path, *map(str, other_out), **dest)
    assert done.returncode == 0, done.stderr
    done = _script("ckpt_join.sh", tmp_path, CKPT=str(tmp_path / "ckpt"), CKPT_DIR=str(tmp_path / "device"),
                   T=str(tmp_path / "dest" / "t"))
    assert done.returncode == 3 and "holds another checkpoint" in done.stderr and "remove it or set CKPT" in done.stderr


def test_ckpt_out_needs_a_checkpoint_and_a_part_that_exists(tmp_path, spawns):
    stage = {"STAGE": str(tmp_path / "stage"), "OUT": str(tmp_path / "out"), "PART_BYTES": "300000"}
    done = _script("ckpt_out.sh", tmp_path, "0", CKPT=str(tmp_path / "none"), **stage)
    assert done.returncode == 2 and "no checkpoint in" in done.stderr
    _checkpoint(tmp_path / "ckpt")
    done = _script("ckpt_out.sh", tmp_path, "x", CKPT=str(tmp_path / "ckpt"), **stage)
    assert done.returncode == 2 and "is not a part number" in done.stderr
    done = _script("ckpt_out.sh", tmp_path, "99", CKPT=str(tmp_path / "ckpt"), **stage)
    assert done.returncode == 2 and "is past the last part" in done.stderr
