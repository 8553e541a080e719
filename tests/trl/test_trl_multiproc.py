"""GapGRPOTrainer under ``accelerate launch --num_processes 2`` on CPU (gloo) against single-process runs.

Three runs of ``tests/_support/helpers_trl_multiproc.py`` (tiny-random-llama fp32, arm C, top_p 0.8, 2 steps,
num_iterations 2, gradient accumulation 2):

- ``two``: 2 processes x per-device batch 4 (16 rows per generation, 8 per process);
- ``half``: 1 process x per-device batch 4: the same seed, prompts (the RepeatSampler's first two groups),
  torch RNG state and model as process 0 of ``two``, so until the first optimizer step it sees exactly
  process 0's rows and tokens;
- ``total``: 1 process x per-device batch 8, the same total batch as ``two``.

Each process samples its own rows, so ``two`` and ``total`` see different tokens and their metrics can only
agree in kind and range. What maths does give exactly: every reduced value is the sum (max) of the two
processes' local values, every logged gap/* metric is the token-weighted combination of those sums (global
count / global tokens, averaged over the step's micro-batches as TRL logs), and process 0's local sums before
the first update are bit-identical to the single-process run on the same rows.

``half`` and ``total`` train in the test's own process (``half`` first; each trainer seeds itself), with no
start-up of Python and the trainer stack of their own.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("trl")
pytest.importorskip("accelerate")

from _support.multiproc_launch import (  # noqa: E402
    accelerate_launch,
    read_records,
    require_gloo,
    run_helper,
    run_helper_here,
)
from _support.trl_runs import GENERATION_FIELDS, gen_index  # noqa: E402

from bloggap_plugin.core.metric_specs import clip_name, names, ratio_name, registered  # noqa: E402

# What this run meets at its first step (registry conditions): the HF sampler recorded, truncated sampling with
# kept sets, probe rows, TRL's own old pass (num_iterations 2) and a clipping loss; the second step follows an update.
FIRST_STEP = {"sampler", "truncation", "probe", "trl_old", "clip"}
EXPECTED = names("trl", needs=FIRST_STEP)
FRACTIONS = names("trl", needs=FIRST_STEP, unit="fraction")
# Reduced sums of Stats.flush_generation, in the mixin's order: (metric, numerator index, denominator index).
GENERATION_SUMS = [(registered(key, "trl"), gen_index(num), gen_index(den)) for key, num, den in (
    ("gap/sampler/oob_frac", "sampler_oob", "sampler_n"), ("gap/sampler/abs_dlogp_mean", "sampler_absd", "sampler_n"),
    ("gap/sampler/exact_frac", "sampler_exact", "sampler_n"), ("gap/probe/oob_b1_vs_bN", "probe_oob", "probe_n"),
    ("gap/kept/mass_mean", "kept_mass_sum", "kept_n"), ("gap/kept/size_mean", "kept_size_sum", "kept_n"),
    ("gap/kept/ratio_before_mean", "kept_ratio_before_sum", "kept_n"),
    ("gap/kept/ratio_after_mean", "kept_ratio_after_sum", "kept_n"), ("gap/kept/oob_before", "kept_oob_before", "kept_n"),
    ("gap/kept/oob_after", "kept_oob_after", "kept_n"),
)]
# Reduced sums of Stats.loss_metrics: out-of-band, tokens, sum |dlogp|, exact, clipped, flips, probe tokens,
# out-of-band vs TRL, sum |dlogp| vs TRL, processes with TRL old log-probs. The ratio's statistics go under
# gap/ratio/ (no optimizer step since the generation) or gap/update/, the clip statistics under gap/clip/ or
# gap/update_clip/: (statistic, numerator, denominator).
RATIO_SUMS = [("oob_frac", 0, 1), ("abs_dlogp_mean", 2, 1), ("exact_frac", 3, 1)]
CLIP_SUMS = [("clipped_frac", 4, 1), ("flip_frac", 5, 6)]
LOSS_SUMS = [(registered(key, "trl"), num, den) for key, num, den in (
    ("gap/old_vs_trl/oob_frac", 7, 1), ("gap/old_vs_trl/abs_dlogp_mean", 8, 1),
)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, spawns, trains):
    require_gloo()
    base = tmp_path_factory.mktemp("multiproc")
    launch = accelerate_launch(2, "--multi_gpu", "--num_machines", "1", "--mixed_precision", "no",
                               "--dynamo_backend", "no")
    for name in ("two", "half", "total"):
        (base / name).mkdir()
    run_helper(launch, base / "two" / "history.json", "--per-device-batch", "4")
    run_helper_here(base / "half" / "history.json", "--per-device-batch", "4")
    run_helper_here(base / "total" / "history.json", "--per-device-batch", "8")
    return {name: read_records(base / name / "history.json", processes)
            for name, processes in (("two", 2), ("half", 1), ("total", 1))}


def _loss_logs(record: dict) -> list[dict]:
    return [h for h in record["log_history"] if "loss" in h]


def _mean(values: list[float]) -> float | None:
    """TRL 1.16's log: NaN-free mean of a step's appended values (None if none)."""
    valid = [v for v in values if not math.isnan(v)]
    return sum(valid) / len(valid) if valid else None


def test_runs_are_what_they_claim(runs):
    assert runs["two"][0]["num_processes"] == 2 and runs["two"][0]["distributed_type"] == "DistributedType.MULTI_CPU"
    assert runs["two"][1]["rank"] == 1
    for name in ("half", "total"):
        assert runs[name][0]["num_processes"] == 1 and runs[name][0]["distributed_type"] == "DistributedType.NO"


@pytest.mark.parametrize("name", ["two", "half", "total"])
def test_every_run_trains_with_all_metrics_in_range(runs, name):
    logs = _loss_logs(runs[name][0])
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    first = logs[0]
    for key in EXPECTED:
        assert first.get(key) is not None, f"{key} missing in run {name}"
    assert {k for k in first if k.startswith("gap/")} == {k for k in _loss_logs(runs["two"][0])[0] if k.startswith("gap/")}
    for key in FRACTIONS:
        assert 0.0 <= first[key] <= 1.0, (name, key, first[key])
    assert 0.0 < first["gap/kept/mass_min"] <= first["gap/kept/mass_mean"] <= 1.0
    assert 1.0 <= first["gap/kept/size_mean"] <= first["gap/kept/size_max"]
    assert first["gap/ratio/abs_dlogp_max"] >= first["gap/ratio/abs_dlogp_mean"] >= 0.0
    assert first["gap/fp16/fallbacks"] == 0.0 and first["gap/time/scoring_s"] > 0.0
    # second step reuses the generation (num_iterations 2) after the first step's update: loss-time metrics only,
    # the ratio's under gap/update/, its clip statistics under gap/update_clip/
    update = [n for n in names("trl") if n.startswith("gap/update/")]
    assert update and all(logs[1].get(n) is not None for n in update)
    assert logs[1].get("gap/update_clip/clipped_frac") is not None
    assert not [k for k in logs[1] if k.startswith(("gap/ratio/", "gap/sampler/", "gap/clip/"))]
    assert not [n for n in update if n in first]  # the first step has no update


def test_reductions_are_exact_sums_and_maxima_of_both_processes(runs):
    rank0, rank1 = runs["two"][0]["reduces"], runs["two"][1]["reduces"]
    assert len(rank0) == len(rank1) > 0
    assert [(r["kind"], r["site"], r["step"]) for r in rank0] == [(r["kind"], r["site"], r["step"]) for r in rank1]
    sites = {r["site"] for r in rank0}
    assert {"flush_generation", "loss_metrics", "training_step"} <= sites
    for mine, theirs in zip(rank0, rank1, strict=True):
        assert mine["reduced"] == theirs["reduced"], mine["site"]  # every process logs the same value
        combine = (lambda a, b: a + b) if mine["kind"] == "sum" else max
        assert mine["reduced"] == [combine(a, b) for a, b in zip(mine["local"], theirs["local"], strict=True)]
    # the two processes really saw different rows (else the checks above could not tell sum from copy)
    loss0 = [r["local"] for r in rank0 if r["site"] == "loss_metrics" and r["kind"] == "sum"]
    loss1 = [r["local"] for r in rank1 if r["site"] == "loss_metrics" and r["kind"] == "sum"]
    assert loss0 != loss1


def _expected_logs(record: dict) -> dict[int, dict[str, float]]:
    """The gap/* values a step must log, rebuilt from the reduced sums: global count / global tokens per call,
    then TRL's per-step mean over the calls."""
    procs = record["num_processes"]
    per_step: dict[int, dict[str, list[float]]] = {}
    reduces = record["reduces"]
    generated_at = None
    for i, red in enumerate(reduces):
        values = per_step.setdefault(red["step"] + 1, {})
        sums = red["reduced"]
        if red["site"] == "flush_generation":
            generated_at = red["step"]
        if red["site"] == "flush_generation" and red["kind"] == "sum" and len(sums) == len(GENERATION_FIELDS):
            for key, num, den in GENERATION_SUMS:
                if sums[den] > 0:
                    values.setdefault(key, []).append(sums[num] / sums[den])
            neg_mass_min, size_max = reduces[i + 1]["reduced"][:2]
            values.setdefault("gap/kept/mass_min", []).append(-neg_mass_min)
            values.setdefault("gap/kept/size_max", []).append(size_max)
        elif red["site"] == "flush_generation" and red["kind"] == "sum" and len(sums) == 1:
            values.setdefault("gap/fp16/fallbacks", []).append(sums[0])
        elif red["site"] == "loss_metrics" and red["kind"] == "sum":
            update = red["step"] != generated_at  # an optimizer step since this generation's old log-probs
            ratio_sums = [(ratio_name(statistic, update, "trl"), num, den) for statistic, num, den in RATIO_SUMS]
            clip_sums = [(clip_name(statistic, update, "trl"), num, den) for statistic, num, den in CLIP_SUMS]
            for key, num, den in ratio_sums + clip_sums + LOSS_SUMS:
                if key.startswith("gap/old_vs_trl/") and sums[9] == 0:
                    continue  # no process had TRL's own old log-probs
                if sums[den] > 0:  # the plugin logs no share of zero tokens (flip_frac without probe tokens)
                    values.setdefault(key, []).append(sums[num] / sums[den])
            values.setdefault(ratio_name("abs_dlogp_max", update, "trl"), []).append(reduces[i + 1]["reduced"][0])
        elif red["site"] == "training_step":
            # arm G's pass in place of TRL's; the probe forwards' seconds; TRL's generation (the sampler's)
            plugin, wall, _g_old_pass, probe, generate = sums
            assert 0 <= probe <= plugin  # the probe's time is part of the plugin's (probe_budget's numerator)
            assert 0 <= generate <= wall  # generation runs inside training_step (TRL's _prepare_inputs)
            values.setdefault("gap/time/scoring_s", []).append(plugin / procs)
            values.setdefault("gap/time/overhead_frac", []).append(plugin / wall)
            values.setdefault("gap/time/generate_s", []).append(generate / procs)
    return {step: {key: _mean(vals) for key, vals in values.items()} for step, values in per_step.items()}


@pytest.mark.parametrize("name", ["two", "half"])
def test_logged_metrics_are_the_token_weighted_combination(runs, name):
    expected = _expected_logs(runs[name][0])
    logs = {h["step"]: h for h in _loss_logs(runs[name][0])}
    assert sorted(expected) == sorted(logs) == [1, 2]
    for step, values in expected.items():
        assert len(values) >= 10
        for key, value in values.items():
            assert logs[step][key] == pytest.approx(value, rel=1e-12, abs=0.0), (step, key)


def test_process_0_matches_the_single_process_run_on_the_same_rows(runs):
    """Before the first optimizer step process 0 of the 2-process run computes bit-identical local sums to a
    single process given the same rows; the logged 2-process value is then the pooled ratio of that run's
    sums and process 1's."""
    two0, two1, half = runs["two"][0]["reduces"], runs["two"][1]["reduces"], runs["half"][0]["reduces"]

    def first_step(reduces):
        return [r for r in reduces if r["step"] == 0 and r["site"] in ("flush_generation", "loss_metrics")]

    mine, single = first_step(two0), first_step(half)
    assert len(mine) == len(single) >= 6
    for a, b in zip(mine, single, strict=True):
        assert (a["site"], a["kind"]) == (b["site"], b["kind"])
        assert a["local"] == b["local"], a["site"]
    # pooled generation metrics of step 1: (single-process sums + process 1's) / (its tokens + process 1's)
    gen_single = next(r["local"] for r in single if r["site"] == "flush_generation" and len(r["local"]) == len(GENERATION_FIELDS))
    gen_other = next(r["local"] for r in first_step(two1) if r["site"] == "flush_generation" and len(r["local"]) == len(GENERATION_FIELDS))
    logged = _loss_logs(runs["two"][0])[0]
    for key, num, den in GENERATION_SUMS:
        pooled = (gen_single[num] + gen_other[num]) / (gen_single[den] + gen_other[den])
        assert logged[key] == pytest.approx(pooled, rel=1e-12, abs=0.0), key
    # and it is not simply the single-process value (process 1 saw other rows)
    assert logged["gap/kept/mass_mean"] != _loss_logs(runs["half"][0])[0]["gap/kept/mass_mean"]
