"""benchmarks.fsdp_scale on CPU: its --smoke equality piece (2 FSDP2 gloo processes vs 1, tiny model), its
step-1 comparison, and its refusal of unknown pieces before anything loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from _support import ROOT
from _support.events import HANG_S

from benchmarks import fsdp_scale


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "benchmarks.fsdp_scale", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=HANG_S)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, spawns):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path_factory.mktemp("fsdp_scale")
    proc = _run("--smoke", "--pieces", "fsdp2,equality", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "fsdp_scale.json").read_text())


def test_smoke_fsdp2_piece_trains_every_arm_with_the_same_collectives_on_both_processes(smoke):
    """Arms A-H under FSDP2 (H: fp16 MixedPrecisionPolicy on CPU): both processes finish every arm, hold half
    the policy, shard the fp32 reference, and took the same number of parameter all-gathers."""
    table = next(t for t in smoke["tables"] if t["id"] == "T17-fsdp")
    columns = table["columns"]
    rows = {row[1]: dict(zip(columns, row, strict=True)) for row in table["rows"] if row[0] == "fsdp2"}
    assert sorted(rows) == ["A", "B", "E", "F", "G", "H"]
    for arm, row in rows.items():
        assert row["ranks"] == "2 ok" and row["shadow sharded"] is True, arm
        gathers = row["all-gathers per rank"]
        assert "/" not in gathers and int(gathers) > 0, (arm, gathers)  # one count: the same on both
    records = smoke["results"]["fsdp2"]["arms"]["B"]
    for record in records.values():
        assert record["policy_bytes"] == pytest.approx(record["policy_full_bytes"] / 2, rel=0.05)
        assert record["plan_bytes"]["ref_plan"] == pytest.approx(2 * record["policy_bytes"], rel=0.05)  # fp32 of bf16


def test_smoke_equality_piece_writes_the_step_1_comparison(smoke):
    table = next(t for t in smoke["tables"] if t["id"] == "T17-equality")
    assert [row[0] for row in table["rows"]] == ["B", "E", "G"]
    for arm, compared, _worst, difference, ok, noise, close in table["rows"]:
        assert compared >= 15 and difference <= 1e-6 and ok == "yes" and noise <= 0.01 and close == "yes", arm
    two = smoke["results"]["equality"]["equal_two"]["B"]
    assert {int(r) for r in two} == {0, 1} and two["0"]["distributed_type"] == "DistributedType.FSDP"
    assert two["0"]["shadow_sharded"]["plan"] is True


def test_document_rebuilds_the_tables_from_the_results_and_keeps_the_machine(smoke, tmp_path, spawns):
    stale = dict(smoke, env=dict(smoke["env"], gpu="the machine it ran on"))
    stale["tables"] = [dict(table, rows=[]) for table in smoke["tables"]]
    (tmp_path / "fsdp_scale.json").write_text(json.dumps(stale))
    proc = _run("document", "--smoke", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rebuilt = json.loads((tmp_path / "fsdp_scale.json").read_text())
    assert rebuilt["tables"] == smoke["tables"] and rebuilt["results"] == smoke["results"]
    assert rebuilt["env"]["gpu"] == "the machine it ran on" and rebuilt["params"] == smoke["params"]


def test_an_arm_missing_from_a_failed_launch_says_which_launch(tmp_path):
    results = {"equality": {"equal_one": {"E": {0: {"first_log": {"gap/ratio/oob_frac": 0.0}}}}, "equal_two": {},
                            "launches": {"equal_one": {"rc": 0}, "equal_two": {"rc": -11}}}}
    [row] = fsdp_scale._equality_rows(results)
    assert row == ["E", None, None, None, "missing (equal_two rc -11)", None, "missing (equal_two rc -11)"]


def _records(single: dict, pooled: dict) -> dict:
    return {"equality": {"equal_one": {"B": {0: {"first_log": single}}},
                         "equal_two": {"B": {0: {"first_log": pooled}}}}}


def test_equality_rows_report_the_largest_difference_and_ignore_timing():
    single = {"gap/ratio/oob_frac": 0.25, "gap/kept/mass_mean": 0.5, "gap/time/scoring_s": 1.0, "loss": 3.0}
    within = {"gap/ratio/oob_frac": 0.25, "gap/kept/mass_mean": 0.5 + 4e-7, "gap/time/scoring_s": 9.0, "loss": 1.0}
    [row] = fsdp_scale._equality_rows(_records(single, within))
    assert row[:3] == ["B", 2, "gap/kept/mass_mean"] and row[3] == pytest.approx(4e-7) and row[4] == "yes"
    assert row[5] == pytest.approx(4e-7 / (1e-6 + 1e-4 * (0.5 + 4e-7))) and row[6] == "yes"
    beyond = dict(within, **{"gap/ratio/oob_frac": 0.25 + 3e-6})  # fp32 noise: not 1e-6, within 1e-6 + 2.5e-5
    [row] = fsdp_scale._equality_rows(_records(single, beyond))
    assert row[2] == "gap/ratio/oob_frac" and row[3] == pytest.approx(3e-6) and row[4] == "no"
    assert row[5] == pytest.approx(3e-6 / (1e-6 + 1e-4 * (0.25 + 3e-6))) and row[6] == "yes"
    moved = dict(within, **{"gap/ratio/oob_frac": 0.25 + 1 / 40})  # one token of 40 out of band more
    [row] = fsdp_scale._equality_rows(_records(single, moved))
    assert row[5] > 100 and row[6] == "no"
    [row] = fsdp_scale._equality_rows(_records(single, {"gap/ratio/oob_frac": 0.25}))  # a value only one run logged
    assert row[4] == row[6] == "no ['gap/kept/mass_mean']"


def test_an_unknown_piece_is_refused_in_one_line(tmp_path, spawns):
    proc = _run("--smoke", "--pieces", "fsdp3", "--out", str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("unknown piece(s) ['fsdp3']; use a comma list of "
                                   "fsdp2, equality, ddp, single, mem1b")
    assert not (tmp_path / "fsdp_scale.json").exists()



def test_shared_gpu_maps_every_process_to_gpu_0_over_gloo_and_the_config_takes_it(tmp_path):
    """--shared-gpu (a one-GPU machine): rank 1 scores on cuda:0 as accelerate places it; a 2-process launch asks
    for gloo and the shorter collective timeout, a 1-process run for no backend (transformers would look for a
    process group; its GRPOConfig builds); without the flag neither is set."""
    from bloggap_plugin.trl.run import prepare_run

    assert [fsdp_scale.worker_device(rank, 1, smoke=False) for rank in (0, 1)] == ["cuda:0", "cuda:0"]
    assert [fsdp_scale.worker_device(rank, 2, smoke=False) for rank in (0, 1)] == ["cuda:0", "cuda:1"]
    assert fsdp_scale.worker_device(1, 0, smoke=False) == fsdp_scale.worker_device(1, 2, smoke=True) == "cpu"
    parsed = fsdp_scale.parse_args(["worker", "--out", str(tmp_path), "--shared-gpu", "--equal", "--batch", "4",
                                    "--generations", "4"])
    overrides, gap = fsdp_scale.trainer_overrides(parsed, processes=2)
    assert (overrides["ddp_backend"], overrides["ddp_timeout"]) == ("gloo", fsdp_scale.SHARED_GPU_TIMEOUT_S)
    assert gap == {"probe_rows": 4} and overrides["top_k"] == 1
    alone, _ = fsdp_scale.trainer_overrides(parsed, processes=1)  # the 1-process runs name no backend
    plan = prepare_run(ROOT / "recipes" / "arm_B.yaml", model="tiny-random-llama", task="arith", max_steps=1,
                       output_dir=str(tmp_path / "trainer"), device="cpu", extra_overrides=alone, gap_overrides=gap)
    assert plan.args.ddp_backend is None and alone == {k: v for k, v in overrides.items() if not k.startswith("ddp")}
    plain, _ = fsdp_scale.trainer_overrides(fsdp_scale.parse_args(["worker", "--out", str(tmp_path)]), processes=2)
    assert "ddp_backend" not in plain and "ddp_timeout" not in plain


def test_shared_gpu_writes_its_own_file_and_says_its_timings_are_not_two_gpus(tmp_path, spawns):
    proc = _run("--smoke", "--shared-gpu", "--pieces", "equality", "--budget", "30", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fsdp_scale_one_gpu.json"]
    document = json.loads((tmp_path / "fsdp_scale_one_gpu.json").read_text())
    assert document["benchmark"] == "fsdp_scale" and document["params"]["shared_gpu"] is True
    for table in document["tables"]:
        assert table["title"].endswith("on one GPU shared by both processes (gloo)")
        assert table["notes"].startswith(fsdp_scale.SHARED_GPU_NOTE)


def test_pieces_that_no_longer_fit_the_budget_are_skipped_and_said(tmp_path, spawns):
    proc = _run("--smoke", "--pieces", "fsdp2,equality", "--budget", "30", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    skipped = [line.split(",")[0] for line in proc.stdout.splitlines() if "of the budget left" in line]
    # --smoke: equal_two shares fsdp2's launch (at fsdp2's place), equal_one trains in the orchestrator after it
    assert skipped == ["[fsdp_scale] fsdp2: skipped", "[fsdp_scale] equal_two: skipped",
                       "[fsdp_scale] equal_one: skipped"]
    document = json.loads((tmp_path / "fsdp_scale.json").read_text())
    assert document["results"] == {} and all(table["rows"] == [] for table in document["tables"])
