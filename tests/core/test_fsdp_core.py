"""The fp16 guard on an FSDP2-sharded policy (2 gloo processes, ``tests/_support/helpers_fsdp_core.py``): a chunk that
overflows in fp16 on one process only is re-scored in fp32 by both (the fp32 shadow's forward is a collective),
and only the process that overflowed keeps the re-score."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _support import ROOT, SUPPORT
from _support.events import HANG_S

HELPER = SUPPORT / "helpers_fsdp_core.py"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, spawns):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path_factory.mktemp("fsdp_core") / "guard"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           str(HELPER), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]


def test_the_shadows_are_sharded(ranks):
    assert all(r["shadow_sharded"] for r in ranks)


def test_only_the_overflowing_process_falls_back_and_keeps_the_fp32_scores(ranks):
    zero, one = ranks
    assert zero["fallbacks"] == 1 and one["fallbacks"] == 0
    assert any(v is None for v in zero["raw"][0])  # the fp16 scores of process 0's first chunk overflowed
    assert all(v is not None for row in one["raw"] for v in row)
    # process 0: chunk 0 (rows 0-1) re-scored by the fp32 shadow, chunk 1 kept in fp16
    assert zero["with_guard"][:2] == zero["fp32"][:2]
    assert zero["with_guard"][2:] == zero["raw"][2:]
    # process 1 took the same fp32 forward but kept its own fp16 scores
    assert one["with_guard"] == one["raw"]
    assert all(math.isfinite(v) for r in ranks for row in r["with_guard"] for v in row)


def test_a_shadow_syncs_its_rows_from_a_root_unit_that_keeps_its_gathered_tensors(ranks):
    """On the H200 (torch 2.11) the policy's root unit still held plain full tensors at the fp32 reference
    shadow's first sync after TRL's forward, and the shard-into-shard copy failed (49152 rows vs 24576). Each
    shard must then take its rows of the full tensor."""
    for record in ranks:
        gathered = record["gathered_root"]
        assert "model.embed_tokens.weight" in gathered["plain"] and "model.norm.weight" in gathered["plain"]
        assert "error" not in gathered, gathered["error"]
        assert gathered["rows_match"] == {name: True for name in gathered["plain"]}


def test_an_fp32_head_made_from_a_gathered_root_owns_its_weight(ranks):
    """On the H200 arm E with fp32 weights under FSDP2 (no mixed precision) took the gathered fp32 head weight as
    its own (an alias, since it was neither a DTensor nor another dtype); FSDP2 freed it at the next reshard and
    both processes crashed (SIGSEGV). The head must hold its own copy, equal to the weight."""
    for record in ranks:
        gathered = record["gathered_root"]
        assert gathered["head_owns_weight"] is True
        assert gathered["head_storage_bytes"] > 0 and gathered["head_equal"] is True
