"""GapGRPOTrainer under FSDP2 (``accelerate launch --use_fsdp --fsdp_version 2``, full shard) on CPU, 2 gloo
processes, tiny-random-llama fp32: every parameter of the policy is a ``DTensor`` shard.

accelerate 1.15 shards only on GPU-like devices; ``benchmarks.fsdp_scale.force_cpu_fsdp`` (the helper's
``--cpu-fsdp``) lets it shard on CPU, so the plugin's sharded paths run here exactly as on GPUs, with gloo.

- ``fsdp``: arms A, B, E, F, G in one launch (2 steps each, top_p 0.8, probe rows): the shadows (B, F and the
  fp32 reference of the probe rows) are sharded like the policy, E's fp32 islands are gathered from shards;
- ``masked``: process 1's completion masks are all zero (as ``mask_truncated_completions`` gives when every row
  of a process is truncated): the kept-set forward must still be taken by both processes;
- ``equal_one`` / ``equal_two``: the same global batch (8 rows) in 1 process and in 2 FSDP2 processes, ``top_k
  1`` so both sample the same tokens, every row probed, 1 step: the logged gap/* values agree to 1e-6.

Every 2-process scenario runs in one launch (``SCENARIOS``: each process starts Python, torch and the trainer
stack once, not once per scenario), each writing its own records; each test reads its scenario's. ``equal_one``
trains in the test's own process.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("accelerate")

from _support.multiproc_launch import (  # noqa: E402
    ROOT,
    accelerate_launch,
    read_records,
    require_gloo,
    run_helper_here,
    run_helper_plan,
)
from _support.trl_runs import GENERATION_FIELDS, gen_index  # noqa: E402

from benchmarks import fsdp_scale  # noqa: E402

FSDP_CONFIG = ROOT / "benchmarks" / "gpu" / "accelerate_fsdp2.yaml"
ARMS = ("A", "B", "E", "F", "G")
# bitwise or wall-clock statistics: not determined by the maths (batch shape changes the last bits / timing); the
# benchmark's FSDP equality piece leaves out the same ones
NOT_EQUAL_BY_MATHS = set(fsdp_scale.NOT_EQUAL_BY_MATHS)
ONE_STEP = ("--steps", "1", "--num-iterations", "1")
EQUAL = ("--arm", "B,E,G", "--top-k", "1", *ONE_STEP, "--grad-accum", "1")  # the equal_one / equal_two runs
# the 2-process scenarios, {name: helper arguments}; records in NAME.json (NAME_ARM.json with several arms)
SCENARIOS = {
    "arms": ("--arm", ",".join(ARMS)),
    "masked": ("--arm", "C", "--mask-rank", "1", *ONE_STEP),
    "two": (*EQUAL, "--per-device-batch", "4", "--probe-rows", "4"),
    "guided": ("--arm", "D", "--k", "1", "--disagree-layers", *ONE_STEP),
    "synced": ("--arm", "B,E", "--steps", "3"),
    "norecord": ("--arm", "C", "--drop-record-rank", "1", *ONE_STEP),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    require_gloo()
    return tmp_path_factory.mktemp("fsdp")


@pytest.fixture(scope="module")
def launched(base, spawns) -> Path:
    """Every scenario of ``SCENARIOS`` run in one 2-process FSDP2 launch; the folder of their records."""
    prefix = accelerate_launch(2, "--config_file", str(FSDP_CONFIG))
    run_helper_plan(prefix, base / "plan.json",
                    [[base / f"{name}.json", "--cpu-fsdp", *args] for name, args in SCENARIOS.items()])
    return base


@pytest.fixture(scope="module")
def fsdp_runs(launched):
    return {arm: read_records(launched / f"arms_{arm}.json") for arm in ARMS}


def _first_log(record: dict) -> dict:
    return next(h for h in record["log_history"] if "loss" in h)


def test_the_policy_is_sharded_by_fsdp2(fsdp_runs):
    for arm, records in fsdp_runs.items():
        for rank, record in records.items():
            assert record["distributed_type"] == "DistributedType.FSDP", (arm, rank)
            assert record["num_processes"] == 2 and record["rank"] == rank
            assert record["sharded_params"] > 0
            # each process holds about half of the policy (shards of uneven rows differ by one row)
            assert 0.4 * record["policy_full_bytes"] < record["policy_bytes"] < 0.6 * record["policy_full_bytes"]


@pytest.mark.parametrize("arm", ARMS)
def test_every_arm_trains_with_its_metrics_under_fsdp2(fsdp_runs, arm):
    logs = [h for h in fsdp_runs[arm][0]["log_history"] if "loss" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    first = logs[0]
    for key in ("gap/ratio/oob_frac", "gap/sampler/oob_frac", "gap/probe/oob_b1_vs_bN", "gap/kept/mass_mean",
                "gap/kept/oob_after", "gap/clip/flip_frac", "gap/fp16/fallbacks"):
        assert first.get(key) is not None, (arm, key)
    for key in ("gap/ratio/oob_frac", "gap/sampler/oob_frac", "gap/probe/oob_b1_vs_bN", "gap/kept/oob_after"):
        assert 0.0 <= first[key] <= 1.0, (arm, key, first[key])
    assert 0.0 < first["gap/kept/mass_min"] <= first["gap/kept/mass_mean"] <= 1.0


@pytest.mark.parametrize("arm", ["B", "F"])
def test_shadows_are_sharded_like_the_policy(fsdp_runs, arm):
    """B's fp32 shadow (also the probe reference) of an fp32 policy holds this rank's half: its bytes equal the
    policy's local bytes; F's fp16 shadow half of that."""
    for rank, record in fsdp_runs[arm].items():
        assert record["shadow_sharded"]["plan"] is True
        share = 1.0 if arm == "B" else 0.5
        assert record["plan_bytes"]["plan"] == pytest.approx(share * record["policy_bytes"], rel=0.02), rank
    for arm_with_reference in ("A", "E", "F", "G"):
        for record in fsdp_runs[arm_with_reference].values():
            assert record["shadow_sharded"]["ref_plan"] is True
            assert record["plan_bytes"]["ref_plan"] == pytest.approx(record["policy_bytes"], rel=0.02)


def test_fp32_head_islands_are_full_copies_gathered_from_the_shards(fsdp_runs):
    """E's fp32 final norm and head: full fp32 copies on every rank (head V x H + norm H floats, 4 bytes each)."""
    from bloggap_plugin.models import load_model

    model, _ = load_model("tiny-random-llama", dtype="fp32")
    expected = 4 * (model.lm_head.weight.numel() + model.model.norm.weight.numel())
    for record in fsdp_runs["E"].values():
        assert record["plan_bytes"]["plan"] == expected


def test_a_process_without_any_completion_token_still_takes_every_forward(launched):
    """Process 1 has no completion token: the kept-set forward (top_p 0.8) and the reductions stay collective,
    and the logged kept statistics are process 0's alone."""
    records = read_records(launched / "masked.json")
    first = _first_log(records[0])
    gen = [r for r in records[0]["reduces"] if r["site"] == "flush_generation" and len(r["local"]) == len(GENERATION_FIELDS)]
    gen1 = [r for r in records[1]["reduces"] if r["site"] == "flush_generation" and len(r["local"]) == len(GENERATION_FIELDS)]
    assert gen and gen1
    kept_n, kept_mass = gen_index("kept_n"), gen_index("kept_mass_sum")  # GenerationSums field order
    assert gen1[0]["local"][kept_n] == 0.0 and gen[0]["local"][kept_n] > 0
    assert first["gap/kept/mass_mean"] == pytest.approx(gen[0]["local"][kept_mass] / gen[0]["local"][kept_n], rel=1e-12)


@pytest.fixture(scope="module")
def equal_runs(launched, trains):
    """equal_one trained in this process (one process, no launch), beside the launch's equal_two records."""
    run_helper_here(launched / "one.json", *EQUAL, "--per-device-batch", "8", "--probe-rows", "8")
    return {arm: (read_records(launched / f"one_{arm}.json", 1)[0], read_records(launched / f"two_{arm}.json")[0])
            for arm in ("B", "E", "G")}


@pytest.mark.parametrize("arm", ["B", "E", "G"])
def test_two_fsdp2_processes_log_the_single_process_values_at_step_1(equal_runs, arm):
    """Same 8 rows and tokens (top_k 1, the RepeatSampler's split), every row probed, before any update: each
    logged gap/* value is a global count over a global total, so both runs log the same value (to 1e-6)."""
    one, two = equal_runs[arm]
    assert one["num_processes"] == 1 and two["num_processes"] == 2 and two["distributed_type"] == "DistributedType.FSDP"
    single, pooled = _first_log(one), _first_log(two)
    keys = {k for k in single if k.startswith("gap/")} - NOT_EQUAL_BY_MATHS
    assert keys == {k for k in pooled if k.startswith("gap/")} - NOT_EQUAL_BY_MATHS
    assert len(keys) >= 15
    for key in sorted(keys):
        if single[key] is None:
            assert pooled[key] is None, key
            continue
        assert pooled[key] == pytest.approx(single[key], abs=1e-6, rel=0.0), (arm, key)
    assert single["completions/mean_length"] == pooled["completions/mean_length"]  # the same tokens


def test_guided_layers_chosen_differently_are_agreed_before_any_fp32_copy(launched):
    """Arm D with automatic layers: each process profiles its own rows, so they may choose different layers; the
    fp32 copies are gathered from shards (collectives), so process 0's choice must be agreed before any is made."""
    records = read_records(launched / "guided.json")
    assert records[0]["plan_layers"] == records[1]["plan_layers"] == [0]  # process 0 preferred layer 0
    assert math.isfinite(_first_log(records[0])["gap/ratio/oob_frac"])


def test_shadows_and_islands_follow_the_sharded_weights_after_an_update(launched):
    """Step 3 generates again after two optimizer steps: B's shadow (synced shard into shard) and E's islands
    (gathered) must hold the updated weights, so the training forward before the next update matches the old
    log-probs up to rounding (a stale copy would leave step 2's ~0.1 differences)."""
    for arm in ("B", "E"):
        logs = [h for h in read_records(launched / f"synced_{arm}.json")[0]["log_history"] if "loss" in h]
        assert [h["step"] for h in logs] == [1, 2, 3]
        assert logs[1]["gap/update/abs_dlogp_max"] > 1e-2  # step 2: the weights moved since the old log-probs
        assert logs[2].get("gap/sampler/oob_frac") is not None  # step 3 generated
        assert logs[2]["gap/ratio/abs_dlogp_max"] < 1e-4, arm


def test_a_process_whose_sampler_record_was_lost_still_takes_the_kept_set_forward(launched):
    """Process 1 has no sampler record (no gap_kept_* keys, as after a SamplerRecordError warning): the kept-set
    pass is still taken by both processes; the logged kept statistics are process 0's alone."""
    records = read_records(launched / "norecord.json")
    gen = [r for r in records[0]["reduces"] if r["site"] == "flush_generation" and len(r["local"]) == len(GENERATION_FIELDS)]
    gen1 = [r for r in records[1]["reduces"] if r["site"] == "flush_generation" and len(r["local"]) == len(GENERATION_FIELDS)]
    kept_n, kept_mass = gen_index("kept_n"), gen_index("kept_mass_sum")
    assert gen1[0]["local"][kept_n] == 0.0 and gen[0]["local"][kept_n] > 0
    first = _first_log(records[0])
    assert first["gap/kept/mass_mean"] == pytest.approx(gen[0]["local"][kept_mass] / gen[0]["local"][kept_n], rel=1e-12)
