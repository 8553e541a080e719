"""Live vLLM tests (GPU machine only): run with

    BLOGGAP_VLLM_MODEL=/tmp/vx/smollm2 python -m pytest -m gpu tests/benchmarks/test_gpu_vllm.py

after installing vLLM 0.26 there (README, "GPU tests"). They skip cleanly without CUDA, vLLM or the model folder.
Each live run is a subprocess of ``python -m benchmarks.vllm_live`` (vLLM and TRL's colocate mode own process-wide state);
the three runs start together in a module fixture.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _support import ROOT
from _support.events import HANG_S

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not os.environ.get("BLOGGAP_VLLM_MODEL"), reason="set BLOGGAP_VLLM_MODEL to a HF model folder"),
]



@pytest.fixture(scope="module")
def live(tmp_path_factory, spawns):
    pytest.importorskip("vllm")
    model = os.environ["BLOGGAP_VLLM_MODEL"]
    work = tmp_path_factory.mktemp("vllm_live")
    runs = {
        "gen": ["gen", "--model", model, "--dtype", "bfloat16", "--out-pt", str(work / "gen.pt"),
                "--out-json", str(work / "gen.json"), "--num-prompts", "8", "--new-tokens", "32"],
        "trl_A": ["trl", "--arm", "A", "--model", model, "--steps", "4", "--out-json", str(work / "trl_A.json")],
        "trl_H": ["trl", "--arm", "H", "--model", model, "--steps", "4", "--out-json", str(work / "trl_H.json")],
    }
    procs = {name: subprocess.Popen([sys.executable, "-m", "benchmarks.vllm_live", *argv], cwd=ROOT,
                                    stdout=open(work / f"{name}.log", "w"), stderr=subprocess.STDOUT) for name, argv in runs.items()}
    codes = {name: proc.wait(timeout=HANG_S) for name, proc in procs.items()}
    return work, codes


def _ok(live, name):
    work, codes = live
    if codes[name] != 0:
        pytest.fail(f"{name} exited {codes[name]}:\n" + (work / f"{name}.log").read_text()[-3000:])
    return work


def test_processed_logprobs_give_the_exact_kept_set_under_top_k(live):
    """top_k 20 with 25 returned entries: the rejected tokens come back as -inf, the kept ones carry the whole
    renormalised mass (logsumexp 0), and the parser marks every position exact. vLLM keeps ties at the k-th logit
    (bf16 logits tie often), so |S| >= 20: seen live, 23 at some positions."""
    work = _ok(live, "gen")
    meta = json.loads((work / "gen.json").read_text())
    saved = torch.load(work / "gen.pt", weights_only=True)
    top_k = meta["sets"]["top_k=20"]
    assert top_k["parser"]["ok"], top_k["parser"]
    assert top_k["parser"]["approximate"] is False and top_k["parser"]["covered_frac"] == 1.0
    lp = saved["sets"]["top_k=20"]["top_lp"]
    finite = torch.isfinite(lp)
    returned = finite | torch.isneginf(lp)
    assert torch.equal(finite.sum(-1), saved["sets"]["top_k=20"]["parser_sizes"])
    assert int(finite.sum(-1).min()) >= 20 and bool((torch.isneginf(lp).sum(-1) == returned.sum(-1) - finite.sum(-1)).all())
    assert int(torch.isneginf(lp).sum(-1).min()) >= 1
    mass = torch.logsumexp(torch.where(finite, lp, torch.full_like(lp, -math.inf)), dim=-1)
    assert float(mass.abs().max()) < 1e-3
    untruncated = meta["sets"]["untruncated"]["parser"]
    assert untruncated["ok"] and untruncated["approximate"] is True and untruncated["covered_frac"] == 0.0


def test_trl_colocate_metrics_agree_with_trl_for_arm_a(live):
    """Arm A keeps TRL's old log-probs: the plugin's sampler gap and IS-ratio statistics equal TRL's on each step."""
    work = _ok(live, "trl_A")
    run = json.loads((work / "trl_A.json").read_text())
    pairs = [("gap/sampler/abs_dlogp_mean", "sampling/sampling_logp_difference/mean"),
             ("gap/sampler/abs_dlogp_max", "sampling/sampling_logp_difference/max"),
             ("gap/sampler/is_ratio_mean", "sampling/importance_sampling_ratio/mean"),
             ("gap/sampler/is_ratio_min", "sampling/importance_sampling_ratio/min"),
             ("gap/sampler/is_ratio_max", "sampling/importance_sampling_ratio/max")]
    checked = 0
    for row in run["rows"]:
        if "gap/sampler/abs_dlogp_mean" not in row:
            continue
        for ours, theirs in pairs:
            assert abs(row[ours] - row[theirs]) <= 1e-6 * max(1.0, abs(row[theirs])), (row["step"], ours, row[ours], row[theirs])
            checked += 1
    assert checked >= len(pairs)
    assert run["summary"]["steps"] == 4


def test_arm_h_samples_in_fp16_with_vllm(live):
    work = _ok(live, "trl_H")
    run = json.loads((work / "trl_H.json").read_text())
    assert run["engine_dtype"] == "torch.float16"
    assert any("gap/sampler/oob_frac" in row for row in run["rows"])


def _live_runs(tmp_path, runs: str, out_env: str) -> dict[str, list[dict]]:
    """Run ``benchmarks.arm_i_live run`` for ``runs`` (30 steps each) and return each run's JSONL records; each run
    logged 30 steps with a generation at least every other step, and its sampler gap is 0 bit for bit."""
    pytest.importorskip("vllm")
    model = os.environ["BLOGGAP_VLLM_MODEL"]
    out = Path(os.environ.get(out_env) or tmp_path)
    code = subprocess.call([sys.executable, "-m", "benchmarks.arm_i_live", "run", "--model", model, "--out", str(out),
                            "--steps", "30", "--runs", runs], timeout=HANG_S, cwd=ROOT)
    assert code == 0
    logs = {}
    for label in runs.split(","):
        log = out / f"{label}.jsonl"
        assert log.exists(), (out / f"{label}.log").read_text()[-3000:]
        records = [json.loads(line) for line in log.read_text().splitlines()]
        generations = [r for r in records if r.get("gap/sampler/oob_frac") is not None]
        assert len(records) == 30 and len(generations) >= 15
        assert max(r["gap/sampler/oob_frac"] for r in generations) == 0.0
        assert max(r["gap/sampler/abs_dlogp_max"] for r in generations) == 0.0
        assert min(r["gap/sampler/exact_frac"] for r in generations) == 1.0, label
        logs[label] = records
    return logs


def test_arm_i_matches_the_sampler_live_in_trl_colocate(tmp_path, spawns):
    """Arm I through the product (``bloggap train``, GapGRPOTrainer builds the arm's engine) and through GapCallback,
    30 steps each, vLLM's batch-invariant mode on: every generation's old log-probs within the clip band of vLLM's
    sampled ones bit for bit (gap/sampler/exact_frac 1, abs_dlogp_max 0: the V2 model runner's log-prob kernel,
    T16-armI-live). ``BLOGGAP_ARM_I_LIVE_RUNS`` chooses the runs (``ENTRY_I_ni<K>[_b<N>][_graphs|_eager]``,
    comma-separated; default one per entry point, the recipe's engine launch, the train run with generations of 32
    completions, whose prompts exceed TRL's 4096 tokens per engine step unless the plugin's engine prefills them in
    one step); ``BLOGGAP_ARM_I_LIVE_OUT`` keeps their logs."""
    _live_runs(tmp_path, os.environ.get("BLOGGAP_ARM_I_LIVE_RUNS", "train_I_ni2_b16,callback_I_ni1"),
               "BLOGGAP_ARM_I_LIVE_OUT")


def test_arm_j_is_exactly_on_policy_live_in_trl_colocate(tmp_path, spawns):
    """Arm J through both entry points, 30 steps each: the sampler gap is 0 bit for bit (as arm I's), and the PPO
    ratio new/old is exactly 1 on every token at each generation's first iteration (gap/ratio/exact_frac 1, nothing
    out of band), since the training forward computes the old log-probs' numbers (T16-armJ-live).
    ``BLOGGAP_ARM_J_LIVE_RUNS`` (``ENTRY_J_ni<K>[_b<N>][_graphs|_eager]``), ``BLOGGAP_ARM_J_LIVE_OUT`` as for arm I."""
    logs = _live_runs(tmp_path, os.environ.get("BLOGGAP_ARM_J_LIVE_RUNS", "train_J_ni2,callback_J_ni1"),
                      "BLOGGAP_ARM_J_LIVE_OUT")
    for label, records in logs.items():
        first_iterations = [r for r in records if r.get("gap/sampler/oob_frac") is not None]
        assert min(r["gap/ratio/exact_frac"] for r in first_iterations) == 1.0, label
        assert max(r["gap/ratio/oob_frac"] for r in first_iterations) == 0.0, label
        assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records), label


def test_trl_colocate_renormalizes_over_vllms_sampling_mask(tmp_path, spawns):
    """Issue 49 item 2, live (vLLM >= 0.28: return_sampling_mask): arm A in TRL colocate at top_p 0.8, top_k 50,
    min_p 0.1 with gap.kept_source: sampling_mask trains on vLLM's own kept ids (gap/kept/source 1 on every measured
    generation, no refusal at attach), and renormalising over them moves the sampler ratio towards 1 and out-of-band
    tokens down. The full comparison with re-truncation and untruncated sampling: ``benchmarks.vllm_live mask-trl``."""
    from bloggap_plugin.core.vllm.versions import has_sampling_mask, installed_vllm

    pytest.importorskip("vllm")
    if not has_sampling_mask(installed_vllm()):
        pytest.skip(f"vLLM {installed_vllm()} has no return_sampling_mask (needs >= 0.28)")
    out = tmp_path / "mask.json"
    overrides = json.dumps({"top_k": 50, "top_p": 0.8, "min_p": 0.1})
    gap = json.dumps({"kept": "renormalize", "kept_source": "sampling_mask"})
    log = tmp_path / "mask.log"
    with open(log, "w") as handle:
        code = subprocess.call([sys.executable, "-m", "benchmarks.vllm_live", "trl", "--arm", "A", "--model",
                                os.environ["BLOGGAP_VLLM_MODEL"], "--steps", "4", "--out-json", str(out),
                                "--overrides", overrides, "--gap-overrides", gap], cwd=ROOT, stdout=handle,
                               stderr=subprocess.STDOUT, timeout=HANG_S)
    assert code == 0, log.read_text()[-3000:]
    rows = [r for r in json.loads(out.read_text())["rows"] if "gap/kept/mass_mean" in r]
    assert rows and all(r["gap/kept/source"] == 1.0 for r in rows)
    for r in rows:
        assert abs(r["gap/kept/ratio_after_mean"] - 1) < abs(r["gap/kept/ratio_before_mean"] - 1)
        assert r["gap/kept/oob_after"] <= r["gap/kept/oob_before"]
