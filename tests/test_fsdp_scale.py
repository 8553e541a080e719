"""benchmarks/fsdp_scale.py on CPU: its --smoke equality piece (2 FSDP2 gloo processes vs 1, tiny model), its
step-1 comparison, and its refusal of unknown pieces before anything loads."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "fsdp_scale.py"
spec = importlib.util.spec_from_file_location("fsdp_scale", SCRIPT)
fsdp_scale = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fsdp_scale)


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
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
    for arm, compared, _worst, difference, ok in table["rows"]:
        assert compared >= 15 and difference <= 1e-6 and ok == "yes", arm
    two = smoke["results"]["equality"]["equal_two"]["B"]
    assert {int(r) for r in two} == {0, 1} and two["0"]["distributed_type"] == "DistributedType.FSDP"
    assert two["0"]["shadow_sharded"]["plan"] is True


def _records(single: dict, pooled: dict) -> dict:
    return {"equality": {"equal_one": {"B": {0: {"first_log": single}}},
                         "equal_two": {"B": {0: {"first_log": pooled}}}}}


def test_equality_rows_report_the_largest_difference_and_ignore_timing():
    single = {"gap/ratio/oob_frac": 0.25, "gap/kept/mass_mean": 0.5, "gap/time/scoring_s": 1.0, "loss": 3.0}
    within = {"gap/ratio/oob_frac": 0.25, "gap/kept/mass_mean": 0.5 + 4e-7, "gap/time/scoring_s": 9.0, "loss": 1.0}
    [row] = fsdp_scale._equality_rows(_records(single, within))
    assert row[:3] == ["B", 2, "gap/kept/mass_mean"] and row[3] == pytest.approx(4e-7) and row[4] == "yes"
    beyond = dict(within, **{"gap/ratio/oob_frac": 0.25 + 3e-6})
    [row] = fsdp_scale._equality_rows(_records(single, beyond))
    assert row[2] == "gap/ratio/oob_frac" and row[3] == pytest.approx(3e-6) and row[4].startswith("no")
    [row] = fsdp_scale._equality_rows(_records(single, {"gap/ratio/oob_frac": 0.25}))  # a value only one run logged
    assert row[4] == "no ['gap/kept/mass_mean']"


def test_an_unknown_piece_is_refused_in_one_line(tmp_path):
    proc = _run("--smoke", "--pieces", "fsdp3", "--out", str(tmp_path), timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("unknown piece(s) ['fsdp3']; use a comma list of "
                                   "fsdp2, equality, ddp, single, mem1b")
    assert not (tmp_path / "fsdp_scale.json").exists()



def test_pieces_that_no_longer_fit_the_budget_are_skipped_and_said(tmp_path):
    proc = _run("--smoke", "--pieces", "fsdp2,equality", "--budget", "30", "--out", str(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    skipped = [line.split(",")[0] for line in proc.stdout.splitlines() if "of the budget left" in line]
    assert skipped == ["[fsdp_scale] fsdp2: skipped", "[fsdp_scale] equal_one: skipped",
                       "[fsdp_scale] equal_two: skipped"]
    document = json.loads((tmp_path / "fsdp_scale.json").read_text())
    assert document["results"] == {} and all(table["rows"] == [] for table in document["tables"])
