"""The doctor's vLLM sampler column with the real engine (GPU machine only): run with

    BLOGGAP_VLLM_MODEL=/tmp/vx/smollm2 python -m pytest -m gpu tests/cli/test_gpu_doctor_vllm.py

after installing vLLM there (README, "GPU tests"). It skips without CUDA, vLLM or the model folder. The doctor runs
in a subprocess (vLLM's engine owns process-wide state)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from _support import ROOT
from _support.events import HANG_S

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not os.environ.get("BLOGGAP_VLLM_MODEL"), reason="set BLOGGAP_VLLM_MODEL to a HF model folder"),
]

ROWS, TOKENS = 16, 16


def test_the_real_engine_fills_the_column_for_every_scoring(tmp_path, spawns):
    pytest.importorskip("vllm")
    from bloggap_plugin.trl.vllm_colocate import trl_colocate_llm_kwargs

    model, path = os.environ["BLOGGAP_VLLM_MODEL"], tmp_path / "doctor.json"
    run = subprocess.run([sys.executable, "-m", "bloggap_plugin.cli", "doctor", "--model", model, "--rows", str(ROWS),
                          "--new-tokens", str(TOKENS), "--dtypes", "bf16,fp32", "--attn", "sdpa", "--no-progress",
                          "--json", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0, run.stderr[-3000:]
    column = json.loads(path.read_text())["vllm_sampler"]
    assert "absent" not in column, column
    assert column["sampler"]["batch_invariant"] is (os.environ.get("VLLM_BATCH_INVARIANT") == "1")
    assert column["sampler"]["llm_kwargs"] == trl_colocate_llm_kwargs(model, max_num_seqs=ROWS, seed=1234)
    cells = {c["dtype"]: c for c in column["cells"]}
    assert set(cells) == {"bf16", "fp32"}
    for c in cells.values():
        assert c["n"] == ROWS * TOKENS and 0 <= c["oob_count"] <= c["n"] and 0 <= c["exact_count"] <= c["n"]
    # vLLM's bf16 engine against an fp32 scorer: different arithmetic, so not every token bit for bit equal
    assert column["sampler"]["engine_dtype"] == "bfloat16" and cells["fp32"]["exact_count"] < cells["fp32"]["n"]
    # arm I's form with vLLM's kernels where the installed vLLM is the measured release (0.26.0), else in torch
    from bloggap_plugin.core.vllm.versions import installed_vllm
    from bloggap_plugin.measure.doctor_vllm import arm_i_pieces

    assert column["arm_i"]["pieces"] == arm_i_pieces("cuda", installed_vllm())
    assert column["arm_i"].get("cell", {}).get("n") == ROWS * TOKENS, column["arm_i"]
    assert "vLLM sampler column (vLLM " in run.stdout
