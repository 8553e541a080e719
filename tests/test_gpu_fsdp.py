"""Issue 17 item 2 on two GPUs: with the same global batch, the gap/* values 2 FSDP2 processes log at step 1 equal
the single-process run's to 1e-6 (SmolLM2, fp32, top_k 1; benchmarks/fsdp_scale.py's equality piece). GPU machine
with 2 GPUs only, trl/datasets/gguf importable and $BLOGGAP_GGUF set:

    python -m pytest -m gpu tests/test_gpu_fsdp.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (nvidia-h200-x2)")]
ROOT = Path(__file__).resolve().parents[1]


def test_two_fsdp2_gpus_log_the_single_gpu_values_at_step_1(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fsdp_scale.py"), "--pieces", "equality",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    document = json.loads((tmp_path / "fsdp_scale.json").read_text())
    table = next(t for t in document["tables"] if t["id"] == "T17-equality")
    assert [row[0] for row in table["rows"]] == ["B", "E", "G"]
    for arm, compared, worst, difference, ok in table["rows"]:
        assert compared >= 15 and ok == "yes", (arm, worst, difference)
