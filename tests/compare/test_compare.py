"""bloggap compare: the sweep runner (resume, crash, kill), the T10 table maths, outputs, and a real tiny run."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _support import ROOT
from _support.compare_runs import compare_cli, install_fake_train, write_recipes
from _support.events import HANG_S, complete_lines, restore_sigint, wait_for

from bloggap_plugin.compare import (
    DONE_KEY,
    CompareConfig,
    CompareError,
    build_results,
    paired_interval,
    plan_runs,
    plugin_time_share,
    read_log,
    run_compare,
    run_settings,
    run_state,
    summarize_run,
    write_outputs,
)
from bloggap_plugin.recipes import RecipeError


@pytest.fixture
def fake(tmp_path, monkeypatch):
    return install_fake_train(tmp_path, monkeypatch)


def _calls(fake, key="run") -> list:
    if not fake["calls"].exists():
        return []
    return [json.loads(line)[key] for line in fake["calls"].read_text().splitlines()]


def _alive(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state not in ("Z", "X")


def _config(tmp_path, fake, **kw) -> CompareConfig:
    base = dict(
        recipes=write_recipes(tmp_path),
        seeds=[0, 1],
        task="arith",
        max_steps=4,
        model="tiny-random-llama",
        output_dir=str(tmp_path / "out"),
        parallel=2,
        last_n=2,
        run_fn=fake["run_fn"],
        pythonpath=[fake["dir"]],
        poll_s=0.1,
        extra_overrides={"num_iterations": 2},
    )
    base.update(kw)
    return CompareConfig(**base)


# --------------------------------------------------------------------------------------------- statistics


def test_paired_interval_by_hand():
    out = paired_interval([0.1, 0.3, 0.2, 0.4, 0.0])
    # mean 0.2, sd = sqrt(0.1 / 4) = 0.158114, half = t(0.975, 4) 2.776445 (printed tables) * 0.158114 / sqrt(5)
    assert out["mean"] == pytest.approx(0.2)
    assert out["sd"] == pytest.approx(math.sqrt(0.025))
    assert out["half_width"] == pytest.approx(2.776445 * math.sqrt(0.025) / math.sqrt(5), abs=1e-6)
    assert out["low"] == pytest.approx(0.2 - out["half_width"])
    two = paired_interval([0.1, 0.3])  # a t interval from 2 values (1 df) is not given
    assert two["n"] == 2 and two["mean"] == pytest.approx(0.2) and two["half_width"] is None and two["low"] is None
    one = paired_interval([0.5])
    assert one["n"] == 1 and one["mean"] == 0.5 and one["half_width"] is None


def test_summarize_run_on_constructed_log():
    # Reward only on generating steps (as TRL logs with num_iterations 2); clip and gap on every step.
    records = [
        {"step": 1, "reward": 0.0, "clip_ratio/region_mean": 0.0, "gap/ratio/oob_frac": 0.1, "step_time": 3.0},
        {"step": 2, "clip_ratio/region_mean": 0.2, "gap/ratio/oob_frac": 0.3, "step_time": 1.0},
        {"step": 3, "reward": 0.5, "clip_ratio/region_mean": 0.1, "step_time": 3.0},
        {"step": 4, "clip_ratio/region_mean": 0.1, "step_time": 1.0},
        {"step": 5, "reward": 1.0, "step_time": 2.0},
    ]
    s = summarize_run(records, {DONE_KEY: "done", "wall_s": 20.0}, last_n=2)
    assert s["steps"] == 5 and s["reward_steps"] == 3
    assert s["rewards"] == [0.0, 0.5, 1.0]
    assert s["reward_last"] == pytest.approx(0.75)
    assert s["reward_mean"] == pytest.approx(0.5)
    assert s["reward_sd_steps"] == pytest.approx(0.5)  # sd of 0, .5, 1 with n-1
    assert s["reward_sd_last"] == pytest.approx(math.sqrt(0.125))
    assert s["clip"] == pytest.approx(0.1)  # (0 + .2 + .1 + .1) / 4
    assert s["gap"] == {"gap/ratio/oob_frac": pytest.approx(0.2)}
    assert s["s_per_step"] == pytest.approx(2.0) and s["s_per_step_source"] == "step_time"
    no_time = summarize_run([{"step": 1, "reward": 1.0}, {"step": 2}], {DONE_KEY: "done", "wall_s": 8.0})
    assert no_time["s_per_step"] == pytest.approx(4.0) and no_time["s_per_step_source"] == "wall"


def test_plugin_time_share_is_time_weighted_not_a_mean_of_step_fractions():
    # One long probe step (0.5 s of plugin time in a 1.0 s step) and one short step without plugin time: the
    # plugin took 0.5 s of 1.1 s of training (45.45%); the mean of the per-step fractions (50% and 0%) says 25%.
    records = [
        {"step": 1, "step_time": 1.0, "gap/time/scoring_s": 0.5, "gap/time/overhead_frac": 0.5},
        {"step": 2, "step_time": 0.1, "gap/time/scoring_s": 0.0, "gap/time/overhead_frac": 0.0},
        {"step": 3, "reward": 1.0},  # a record without timing is not counted
    ]
    assert plugin_time_share(records) == 0.5 / 1.1
    s = summarize_run(records, {DONE_KEY: "done", "wall_s": 2.0})
    assert s["plugin_share"] == 0.5 / 1.1
    assert s["gap"]["gap/time/overhead_frac"] == pytest.approx(0.25)  # the logged per-step metric, unchanged
    assert plugin_time_share([{"step": 1, "reward": 1.0}]) is None


def _write_log(config, run, rewards, extra=None, done=True):
    path = Path(run.log_jsonl)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i, r in enumerate(rewards, 1):
            f.write(json.dumps({"step": i, "reward": r, **(extra or {})}) + "\n")
        if done:
            marker = {DONE_KEY: "done", "wall_s": 10.0 * len(rewards), "settings": run_settings(config, run)}
            f.write(json.dumps(marker) + "\n")


def test_table_maths_on_constructed_logs(tmp_path):
    config = CompareConfig(recipes=write_recipes(tmp_path, ("A", "B", "C")), seeds=[0, 1], output_dir=str(tmp_path / "o"),
                           last_n=2, max_steps=4)
    runs = {r.run_id: r for r in plan_runs(config)}
    assert list(runs) == ["A_s0", "B_s0", "C_s0", "A_s1", "B_s1", "C_s1"]
    logs = {
        "A_s0": [0.0, 0.5, 0.5, 0.5],   # last-2 0.5, mean 0.375
        "A_s1": [0.5, 0.0, 1.0, 0.0],   # last-2 0.5, mean 0.375
        "B_s0": [0.0, 0.0, 1.0, 1.0],   # last-2 1.0 -> delta +0.5
        "B_s1": [0.0, 0.0, 0.5, 1.0],   # last-2 0.75 -> delta +0.25
        "C_s0": [0.25, 0.25, 0.25, 0.25],  # delta -0.25
    }
    for run_id, rewards in logs.items():
        _write_log(config, runs[run_id], rewards, {"clip_ratio/region_mean": 0.01})
    _write_log(config, runs["C_s1"], [1.0, 1.0], done=False)  # unfinished: left out
    res = build_results(config, list(runs.values()))
    assert res["baseline"] == "A" and res["last_k"] == 2
    a, b, c = res["arms"]["A"], res["arms"]["B"], res["arms"]["C"]
    assert a["reward_last"] == pytest.approx(0.5) and a["reward_mean"] == pytest.approx(0.375)
    assert b["delta_vs_base"] == {0: pytest.approx(0.5), 1: pytest.approx(0.25)}
    assert b["reward_last"] == pytest.approx(0.875)
    # C_s1 unfinished: the declared analysis (planned seeds 0, 1) is interim, means only
    assert res["analysis"]["status"] == "interim" and res["analysis"]["planned_done"] == 1
    assert b["delta_interval"] == {"n": 2, "mean": pytest.approx(0.375)}
    assert c["seeds"] == [0] and c["delta_vs_base"] == {0: pytest.approx(-0.25)}
    assert c["delta_interval"] == {"n": 1, "mean": pytest.approx(-0.25)}
    assert a["clip"] == pytest.approx(0.01)
    # Resolution: per-run sd over the last-2 window, pooled as the root mean variance.
    sds_last = {"A_s0": 0.0, "A_s1": math.sqrt(0.5), "B_s0": 0.0, "B_s1": math.sqrt(0.125), "C_s0": 0.0}
    pooled = math.sqrt(sum(v * v for v in sds_last.values()) / 5)
    r = res["resolution"]
    assert r["step_sd_last"] == pytest.approx(pooled)
    assert r["se_last_mean"] == pytest.approx(pooled / math.sqrt(2))
    # two arms compared at alpha 0.05: 2.5% two-sided each; z(0.9875) = 2.241403, z(0.8) = 0.841621 (tables)
    assert r["mdd_step_noise"] == pytest.approx((2.241403 + 0.841621) * pooled * math.sqrt(2 / (2 * 2)), rel=1e-5)
    assert r["detectable_per_arm"] is None  # interim
    table = res["tables"][0]
    assert table["reference"] == "T10" and table["columns"][2] == "reward last-2"
    assert table["title"].startswith("Interim: ") and "INTERIM: 1 of 2 planned seeds" in table["notes"]
    rows = {row[0]: row for row in table["rows"]}
    assert rows["B"][2] == 0.875 and rows["B"][4] == "+0.500 / +0.250"
    assert rows["B"][5] == "+0.375 (interim: no interval)" and rows["B"][6] is None and rows["B"][7] is None
    assert rows["C"][5].startswith("-0.250 (interim")


def test_declared_analysis_is_final_only_with_every_planned_seed(tmp_path):
    """Three seeds planned and finished: the final analysis of the primary (last-k) and the secondary (whole-run
    mean) compares B and C with A at alpha 0.05 over two arms, as scipy computes it here; declaring a fourth seed
    turns the same logs into an interim table without intervals or p-values."""
    scipy_stats = pytest.importorskip("scipy.stats")
    config = CompareConfig(recipes=write_recipes(tmp_path, ("A", "B", "C")), seeds=[0, 1, 2], output_dir=str(tmp_path / "o"),
                           last_n=2, max_steps=4, secondary=["reward_mean"])
    runs = {r.run_id: r for r in plan_runs(config)}
    base = [0.0, 0.5, 0.5, 0.5]
    shifts = {"A": [0.0, 0.0, 0.0], "B": [0.1, 0.3, 0.2], "C": [-0.05, 0.05, 0.1]}
    for run in runs.values():
        shift = shifts[run.arm][run.seed]
        _write_log(config, run, [r + shift + 0.01 * run.seed for r in base])
    res = build_results(config, list(runs.values()))
    analysis = res["analysis"]
    assert analysis["status"] == "final" and analysis["declared"]["planned_seeds"] == [0, 1, 2]
    for metric in ("reward_last", "reward_mean"):
        for arm in ("B", "C"):
            row, values = analysis["metrics"][metric]["arms"][arm], shifts[arm]
            mean, sd = sum(values) / 3, math.sqrt(sum((v - sum(values) / 3) ** 2 for v in values) / 2)
            half = scipy_stats.t.ppf(1 - 0.025 / 2, 2) * sd / math.sqrt(3)
            assert row["mean"] == pytest.approx(mean) and row["half_width"] == pytest.approx(half)
            assert row["p_t"] == pytest.approx(scipy_stats.ttest_1samp(values, 0.0).pvalue)
    b = res["arms"]["B"]["delta_interval"]
    assert b is analysis["metrics"]["reward_last"]["arms"]["B"]
    rows = {row[0]: row for row in res["tables"][0]["rows"]}
    assert rows["B"][5] == f"+0.200 [{b['low']:+.3f}, {b['high']:+.3f}]" and rows["B"][6] == round(b["p_t_holm"], 4)
    assert not res["tables"][0]["title"].startswith("Interim")
    assert "simultaneous 95% CI" in res["tables"][0]["columns"][5]
    assert res["resolution"]["detectable_per_arm"] == {arm: analysis["metrics"]["reward_last"]["arms"][arm]["detectable"]
                                                       for arm in ("B", "C")}
    analysis_rows = [t for t in res["tables"] if t["id"] == "T10-analysis"][0]["rows"]
    assert [r[:3] for r in analysis_rows] == [["reward_last", "primary", "B"], ["reward_last", "primary", "C"],
                                              ["reward_mean", "secondary", "B"], ["reward_mean", "secondary", "C"]]
    assert "covers every reward step" not in res["tables"][0]["notes"]  # last-2 of 4 reward steps
    whole = build_results(dataclasses.replace(config, last_n=4), list(runs.values()))
    assert "The last-4 window covers every reward step of these runs" in whole["tables"][0]["notes"]
    later = dataclasses.replace(config, planned_seeds=[0, 1, 2, 3])
    interim = build_results(later, list(runs.values()))
    assert interim["analysis"]["status"] == "interim" and interim["analysis"]["planned_done"] == 3
    assert interim["arms"]["B"]["delta_interval"] == {"n": 3, "mean": pytest.approx(0.2)}
    assert all(r[5] is None and r[8] is None for r in [t for t in interim["tables"] if t["id"] == "T10-analysis"][0]["rows"])


@pytest.mark.parametrize("settings, message", [
    ({"primary": "loss"}, "--primary loss: not a metric"),
    ({"secondary": ["reward_last"]}, "--secondary lists the primary metric"),
    ({"alpha": 0.9}, "--alpha 0.9: must be in (0, 0.5]"),
    ({"planned_seeds": [0]}, "--seeds 1: not among --planned-seeds 0"),
    ({"planned_seeds": [0, 1, 1]}, "--planned-seeds 0 1 1: a seed is repeated"),
])
def test_a_bad_declared_analysis_is_refused_naming_the_flag(tmp_path, settings, message):
    from bloggap_plugin.compare import validate_config

    config = CompareConfig(recipes=write_recipes(tmp_path), seeds=[0, 1], output_dir=str(tmp_path / "o"), **settings)
    with pytest.raises(CompareError, match=re.escape(message)):
        validate_config(config, training=False)


def test_read_log_tolerates_a_cut_last_line_but_not_a_bad_middle_line(tmp_path):
    log = tmp_path / "x.jsonl"
    log.write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "rew')
    records, marker = read_log(log)
    assert records == [{"step": 1, "reward": 0.5}] and marker is None
    log.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"x.jsonl:2: not a JSON line"):
        read_log(log)


def test_plan_rejects_bad_input(tmp_path):
    recipes = write_recipes(tmp_path)
    with pytest.raises(ValueError, match="distinct"):
        plan_runs(CompareConfig(recipes=recipes, seeds=[0, 0]))
    with pytest.raises(RecipeError, match="nope.yaml does not exist"):
        plan_runs(CompareConfig(recipes=[str(tmp_path / "nope.yaml")]))
    with pytest.raises(ValueError, match="baseline arm 'Z'"):
        build_results(CompareConfig(recipes=recipes, baseline="Z", output_dir=str(tmp_path)), plan_runs(CompareConfig(recipes=recipes)))


# --------------------------------------------------------------------------------------------- the sweep


def test_sweep_with_fake_runs_writes_table_json_plot_and_resumes(tmp_path, fake, spawns):
    pytest.importorskip("matplotlib")
    config = _config(tmp_path, fake)
    messages = []
    res = run_compare(config, echo=messages.append)
    assert res["failed"] == {}
    assert sorted(_calls(fake)) == ["A_s0", "A_s1", "B_s0", "B_s1"]
    calls = [json.loads(line) for line in fake["calls"].read_text().splitlines()]
    assert all(c["overrides"] == {"num_iterations": 2} and c["task"] == "arith" and c["task_kwargs"] is None for c in calls)
    out = Path(config.output_dir)
    # Fake rewards: A = 0.25 + 0.125 seed + 0.25 on odd steps; B = A + 0.25. last-2 (steps 3, 4) = base + .125 s + .125
    arms = res["arms"]
    assert arms["A"]["reward_last_per_seed"] == {0: pytest.approx(0.375), 1: pytest.approx(0.5)}
    assert arms["B"]["delta_vs_base"] == {0: pytest.approx(0.25), 1: pytest.approx(0.25)}
    assert arms["B"]["delta_interval"] == {"n": 2, "mean": pytest.approx(0.25), "sd": None, "t": None, "p_t": None,
                                          "p_sign_flip": None, "low": None, "high": None, "half_width": None,
                                          "detectable": None, "p_t_holm": None, "p_sign_flip_holm": None}
    assert arms["B"]["gap"]["gap/ratio/oob_frac"] == pytest.approx(0.5)  # the first iterations' gap alone
    assert arms["B"]["gap"]["gap/update/oob_frac"] == pytest.approx(0.75)  # the update, apart
    assert arms["A"]["s_per_step"] == pytest.approx(2.0)
    document = json.loads((out / "compare.json").read_text())
    assert document["schema_version"] == 1 and document["benchmark"] == "compare"
    assert [t["id"] for t in document["tables"]] == ["T10", "T10-analysis", "T10-gap", "T10-resolution"]
    from bloggap_plugin.report_builder import validate_result

    validate_result(json.loads((out / "compare.json").read_text(), parse_float=__import__("decimal").Decimal), "compare.json", {"T10"})
    md = (out / "compare.md").read_text()
    assert "| B | 2 | 0.6875 |" in md and "gap/ratio/oob_frac %" in md and "Per-step reward sd" in md
    [gap_table] = [t for t in document["tables"] if t["id"] == "T10-gap"]
    assert {"gap/ratio/oob_frac", "gap/update/oob_frac"} <= set(gap_table["columns"])
    assert "gap/update/oob_frac %" not in md.split("T10-analysis")[0]  # not a headline column: the update
    png = (out / "reward_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    # Second call: everything finished, nothing runs again, same table.
    again = run_compare(config, echo=messages.append)
    assert sorted(_calls(fake)) == ["A_s0", "A_s1", "B_s0", "B_s1"]
    assert again["tables"][0]["rows"] == res["tables"][0]["rows"]


def test_a_crashed_run_does_not_stop_the_sweep(tmp_path, fake, monkeypatch, spawns):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("FAKE_CRASH", "B_s0")
    config = _config(tmp_path, fake, seeds=[0], parallel=1)
    messages = []
    res = run_compare(config, echo=messages.append)
    assert res["failed"] and list(res["failed"]) == ["B_s0"]
    assert any("B_s0: FAILED" in m and "fake crash" in m for m in messages)
    assert list(res["runs"]) == ["A_s0"]
    monkeypatch.delenv("FAKE_CRASH")
    res = run_compare(config, echo=messages.append)  # retry: only the crashed run runs again
    assert _calls(fake) == ["A_s0", "B_s0", "B_s0"] and res["failed"] == {}


def test_retries_start_a_failed_run_again_in_the_same_call_after_the_runs_waiting(tmp_path, fake, monkeypatch, spawns):
    """``retries`` 1: a run whose process failed once is trained again from zero in the same call, after the runs
    that were waiting, and counts as finished; the failed attempt's console is kept beside the new one."""
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("FAKE_CRASH_ONCE", "A_s0")
    config = _config(tmp_path, fake, seeds=[0, 1], parallel=1, retries=1)
    messages = []
    res = run_compare(config, echo=messages.append)
    assert _calls(fake) == ["A_s0", "B_s0", "A_s1", "B_s1", "A_s0"]  # after the runs waiting
    assert res["failed"] == {} and list(res["retried"]) == ["A_s0"] and res["retried"]["A_s0"][0] != 0
    assert sorted(res["runs"]) == ["A_s0", "A_s1", "B_s0", "B_s1"]
    runs = tmp_path / "out" / "runs"
    assert "fake crash, once" in (runs / "A_s0.out.failed").read_text()
    assert "fake crash" not in (runs / "A_s0.out").read_text()
    assert list(runs.glob("A_s0.*.part.jsonl")) == [] and len(list(runs.glob("A_s0.jsonl.partial*"))) == 1
    assert any(m.startswith("[compare] A_s0: retry 1 of 1 (training from zero)") for m in messages)
    assert f"[compare] A_s0: started again after failing (exit {res['retried']['A_s0'][0]}); finished" in messages


@pytest.mark.parametrize(("retries", "problem"), [(-1, "must be >= 0"), (1.5, "expected int"), (True, "expected int")])
def test_retries_that_are_not_a_whole_number_from_0_are_refused_through_the_api_too(tmp_path, fake, retries, problem):
    with pytest.raises(CompareError, match=rf"^--retries {retries}: {problem}$"):
        run_compare(_config(tmp_path, fake, retries=retries), echo=lambda m: None)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("retries", [0, 2])
def test_retries_end_with_the_run_failed_when_every_attempt_fails(tmp_path, fake, monkeypatch, spawns, retries):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("FAKE_CRASH", "B_s0")
    res = run_compare(_config(tmp_path, fake, seeds=[0], parallel=1, retries=retries), echo=lambda m: None)
    assert _calls(fake) == ["A_s0"] + ["B_s0"] * (retries + 1)
    assert list(res["failed"]) == ["B_s0"] and list(res["runs"]) == ["A_s0"]
    assert res["retried"] == ({"B_s0": [res["failed"]["B_s0"]] * retries} if retries else {})
    consoles = sorted(p.name for p in (tmp_path / "out" / "runs").glob("B_s0.out*"))
    assert consoles == ["B_s0.out", *(["B_s0.out.failed"] if retries else []),
                        *(f"B_s0.out.failed.{i}" for i in range(1, retries))]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=["SIGKILL", "SIGTERM", "SIGINT"])
def test_a_killed_sweep_leaves_no_worker_and_resumes_counting_each_step_once(tmp_path, fake, sig, spawns):
    """Kill only the sweep process (an OOM kill or ``kill PID``); its runs must not outlive it, and the resume must
    count each step once: a run that outlived its sweep used to keep appending to the log a resumed run writes."""
    pytest.importorskip("matplotlib")
    recipes = write_recipes(tmp_path)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "bloggap_plugin.cli", "compare", *recipes, "--seeds", "0", "--max-steps", "8",
               "--model", "tiny-random-llama", "--output-dir", str(out), "--parallel", "2", "--last-n", "2",
               "--run-fn", fake["run_fn"], "--poll-s", "0.1"]  # a run's end is seen at once, as in the in-process sweeps
    env = dict(os.environ, FAKE_HANG="B_s0", PYTHONPATH=os.pathsep.join([fake["dir"], os.environ.get("PYTHONPATH", "")]))
    # Ctrl-C's default action in the sweep, as in a terminal: pytest started as a background job inherits SIGINT
    # ignored (POSIX shells ignore it for asynchronous commands), and so would the sweep.
    sweep = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, preexec_fn=restore_sigint)
    runs = out / "runs"
    try:
        # A finishes at once; B logs its first step, then hangs (FAKE_HANG): kill the sweep once A's worker has
        # ended and B has logged that step.
        def a_done_b_started() -> bool:
            pids = dict(zip(_calls(fake), _calls(fake, "pid")))
            return ((runs / "A_s0.jsonl").exists() and "A_s0" in pids and not _alive(pids["A_s0"])
                    and any(complete_lines(p) for p in runs.glob("B_s0.*.part.jsonl")))

        wait_for(a_done_b_started, sweep, "A's end and B's first step")
        assert not (runs / "B_s0.jsonl").exists()  # a run writes only its own file until it is complete
        os.kill(sweep.pid, sig)  # the sweep process alone, not its group
        _, stderr = sweep.communicate(timeout=HANG_S)
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
            sweep.wait()
    worker = dict(zip(_calls(fake), _calls(fake, "pid")))["B_s0"]
    # B outliving its sweep would sleep out FAKE_HANG's 600 s and then log its other 7 steps (the hang guard is longer)
    wait_for(lambda: not _alive(worker), what="the end of the sweep's run B")
    (part,) = runs.glob("B_s0.*.part.jsonl")
    assert len(complete_lines(part)) == 1, "the run outlived its sweep"
    if sig != signal.SIGKILL:  # stopped by a signal it can catch: one line, no traceback, 128 + signal
        assert sweep.returncode == 128 + sig, stderr
        assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
        assert "stopped 1 run" in stderr and "re-run the same command to resume" in stderr
    env.pop("FAKE_HANG")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "A_s0: finished earlier, skipped" in done.stdout
    assert sorted(_calls(fake)) == ["A_s0", "B_s0", "B_s0"]  # A not run again, B started over once
    for run in ("A_s0", "B_s0"):
        records, marker = read_log(out / "runs" / f"{run}.jsonl")
        assert marker is not None and [r["step"] for r in records] == list(range(1, 9)), run
    runs = json.loads((out / "compare.json").read_text())["results"]["runs"]
    assert {k: (v["steps"], v["reward_steps"]) for k, v in runs.items()} == {"A_s0": (8, 8), "B_s0": (8, 8)}
    assert (out / "runs" / "B_s0.jsonl.partial").exists()  # the killed attempt's log, kept aside


def test_task_kwargs_need_a_run_function_that_takes_them(tmp_path, fake):
    (Path(fake["dir"]) / "narrow_train.py").write_text(textwrap.dedent('''
        def run_training(recipe_path, *, model, task, max_steps, output_dir, report_to, seed, log_jsonl, extra_overrides):
            raise AssertionError("must not be called")
    '''))
    config = _config(tmp_path, fake, seeds=[0], recipes=write_recipes(tmp_path, ("A",)), run_fn="narrow_train:run_training",
                     difficulty=3)
    with pytest.raises(CompareError, match=r"--run-fn narrow_train:run_training takes no task_kwargs, so \['difficulty'\]"):
        run_compare(config, echo=lambda m: None)
    assert not Path(config.output_dir).exists()  # refused before anything ran


def test_resume_runs_again_when_its_settings_changed(tmp_path, fake, spawns):
    """A finished run counts only for the settings it was trained with: other --max-steps, --model, --override or
    recipe content train it again (the old log kept aside), and the table never labels old logs with new settings."""
    pytest.importorskip("matplotlib")
    config = _config(tmp_path, fake, seeds=[0], parallel=2)
    run_compare(config, echo=lambda m: None)
    assert sorted(_calls(fake)) == ["A_s0", "B_s0"]
    messages = []
    res = run_compare(_config(tmp_path, fake, seeds=[0], max_steps=6), echo=messages.append)
    assert sorted(_calls(fake)[2:]) == ["A_s0", "B_s0"] and sorted(_calls(fake, "max_steps")[2:]) == [6, 6]
    assert any("A_s0" in m and "other settings (max_steps 4 -> 6)" in m for m in messages), messages
    assert {k: v["steps"] for k, v in res["runs"].items()} == {"A_s0": 6, "B_s0": 6}
    assert (Path(config.output_dir) / "runs" / "A_s0.jsonl.stale").exists()
    first_stale = (Path(config.output_dir) / "runs" / "A_s0.jsonl.stale").read_text()
    # Other overrides, then another model: both runs again each time.
    run_compare(_config(tmp_path, fake, seeds=[0], max_steps=6, extra_overrides={}), echo=messages.append)
    assert _calls(fake, "overrides")[4:] == [{}, {}]
    # the second change keeps the first run's log too: nothing set aside is overwritten
    runs_dir = Path(config.output_dir) / "runs"
    assert (runs_dir / "A_s0.jsonl.stale").read_text() == first_stale
    assert (runs_dir / "A_s0.jsonl.stale.1").exists() and any("kept as A_s0.jsonl.stale.1" in m for m in messages)
    assert any('extra_overrides {"num_iterations": 2} -> {}' in m for m in messages)
    run_compare(_config(tmp_path, fake, seeds=[0], max_steps=6, extra_overrides={}, model="tiny-random-gpt2"),
                echo=messages.append)
    assert _calls(fake, "model")[6:] == ["tiny-random-gpt2", "tiny-random-gpt2"]
    # The recipe file of B changes: B alone runs again.
    final = _config(tmp_path, fake, seeds=[0], max_steps=6, extra_overrides={}, model="tiny-random-gpt2")
    recipe_b = Path(final.recipes[1])
    recipe_b.write_text(recipe_b.read_text().replace("1.0e-6", "2.0e-6"))
    run_compare(final, echo=messages.append)
    assert _calls(fake)[8:] == ["B_s0"]
    assert any("B_s0" in m and "the recipe file's content" in m for m in messages)
    # Same settings: nothing runs.
    run_compare(final, echo=messages.append)
    assert len(_calls(fake)) == 9
    # --table-only with settings the logs were not trained with: those runs are set aside, not relabelled.
    other = dataclasses.replace(final, max_steps=4)
    res = build_results(other, plan_runs(other))
    assert res["runs"] == {} and sorted(res["set_aside"]) == ["A_s0", "B_s0"]
    assert "max_steps 6 -> 4" in res["set_aside"]["A_s0"]


def test_a_failed_output_write_keeps_the_previous_files(tmp_path, fake, monkeypatch, spawns):
    import errno

    pytest.importorskip("matplotlib")
    config = _config(tmp_path, fake, seeds=[0])
    run_compare(config, echo=lambda m: None)
    out = Path(config.output_dir)
    before = {name: (out / name).read_bytes() for name in ("compare.json", "compare.md", "reward_curves.png")}
    other = _config(tmp_path, fake, seeds=[0], last_n=3)  # a different table: the new files would differ
    results = build_results(other, plan_runs(other))

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(CompareError, match=r"compare\.json: cannot write \(No space left on device\); the previous "
                       r"file is unchanged .* --table-only"):
        write_outputs(other, results)
    assert {name: (out / name).read_bytes() for name in before} == before
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    monkeypatch.undo()
    write_outputs(other, results)  # the disk has room again: all three are replaced
    assert (out / "compare.md").read_bytes() != before["compare.md"] and "reward last-3" in (out / "compare.md").read_text()


@pytest.mark.parametrize(
    "args, problem",
    [
        (["--parallel", "0"], "--parallel 0: must be >= 1"),
        (["--max-steps", "0"], "--max-steps 0: must be >= 1"),
        (["--max-steps", "-1"], "--max-steps -1: must be >= 1"),
        (["--last-n", "0"], "--last-n 0: must be >= 1"),
        (["--retries", "-1"], "--retries -1: must be >= 0"),
        (["--seeds", "0", "1", "0"], "--seeds 0 1 0: seed 0 is repeated; give each seed once"),
        (["--baseline", "Z"], "--baseline Z names no arm; the arms are A, B"),
        (["--difficulty", "9"], "--difficulty 9: must be in [1, 5]"),
        (["--override", "[1]"], "--override must be a mapping of GRPOConfig fields"),
        (["--override", "{beta: [}"], "--override must be a mapping of GRPOConfig fields"),
    ],
)
def test_bad_compare_input_fails_in_one_line_before_anything_runs(tmp_path, fake, capsys, args, problem):
    out = tmp_path / "out"
    code, stdout, stderr = compare_cli([*write_recipes(tmp_path), "--seeds", "0", "--max-steps", "2", "--output-dir", str(out),
                                 "--run-fn", "fake_train:run_training", *args], capsys)
    # a value outside a field's declared range is refused by the command line's range check ("bloggap: error: "),
    # the rest by compare's own checks ("bloggap compare: ")
    assert code == 2 and stderr.startswith((f"bloggap compare: {problem}", f"bloggap: error: {problem}")), stderr
    assert len(stderr.strip().splitlines()) == 1 and not out.exists() and _calls(fake) == []


@pytest.mark.parametrize(
    "override, problem",
    [
        ('{"num_iteration": 2}', "--override: unknown key 'num_iteration' (did you mean 'num_iterations'?)"),
        ('{"num_generations": 3}', 'with --override {"num_generations": 3}: GRPOConfig rejects it: '),
    ],
)
def test_overrides_are_checked_once_against_grpo_config_before_any_run(tmp_path, capsys, override, problem):
    """With the real training function the recipes and --override make each arm's GRPOConfig up front (today this
    failed inside every run, after its model loaded)."""
    pytest.importorskip("trl")
    out = tmp_path / "out"
    code, _, stderr = compare_cli([*write_recipes(tmp_path), "--seeds", "0", "--max-steps", "2", "--output-dir", str(out),
                            "--model", "tiny-random-llama", "--override", override], capsys)
    assert code == 2 and problem in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert not out.exists()


def test_every_compare_config_field_is_a_flag_with_its_help(capsys):
    from bloggap_plugin.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["compare", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for item in dataclasses.fields(CompareConfig):
        help_text = " ".join(item.metadata["help"].split())
        assert help_text in text, item.name
        if item.name != "recipes":
            assert f"--{item.name}" in text, item.name
    for flag in ("--max-steps", "--output-dir", "--last-n", "--calc-steps", "--use-vllm", "--override", "--run-fn",
                 "--table-only", "--config"):
        assert flag in text


def test_compare_switches_take_no_value_so_recipes_may_follow_them():
    """--use-vllm and --table-only are switches, as before the config dataclass: a recipe after one is a recipe."""
    from bloggap_plugin.cli import build_parser

    args = build_parser().parse_args(["compare", "--table-only", "--use-vllm", "a.yaml", "b.yaml", "--seeds", "3"])
    assert (args.use_vllm, args.table_only, args.recipes, args.seeds) == (True, True, ["a.yaml", "b.yaml"], [3])
    args = build_parser().parse_args(["compare", "a.yaml"])
    assert (args.use_vllm, args.table_only, args.recipes) == (False, False, ["a.yaml"])


@pytest.mark.parametrize(
    "yaml_text, args, problem",
    [
        ("parallel: 0\n", [], "--parallel 0: must be >= 1"),
        ("parallel: 0\nbaseline: Z\n", ["--parallel", "1"], "--baseline Z names no arm; the arms are A, B"),
        ("extra_overrides: [1]\n", [], "--override must be a mapping of GRPOConfig fields"),
        ("seeds: [3, 3]\n", [], "--seeds 3 3: seed 3 is repeated"),
    ],
)
def test_compare_config_file_sets_fields_and_the_command_line_wins(tmp_path, fake, capsys, yaml_text, args, problem):
    config = tmp_path / "compare.yaml"
    config.write_text(yaml_text)
    out = tmp_path / "out"
    code, _, stderr = compare_cli([*write_recipes(tmp_path), "--max-steps", "2", "--output-dir", str(out),
                            "--run-fn", "fake_train:run_training", "--config", str(config), *args], capsys)
    assert code == 2 and stderr.startswith((f"bloggap compare: {problem}", f"bloggap: error: {problem}")), stderr
    assert not out.exists() and _calls(fake) == []


def test_compare_config_file_mapping_override_reaches_the_runs(tmp_path, fake, capsys, spawns):
    pytest.importorskip("matplotlib")
    config = tmp_path / "compare.yaml"
    config.write_text("seeds: [0]\nmax_steps: 2\nlast_n: 1\nextra_overrides:\n  num_iterations: 2\n")
    out = tmp_path / "out"
    code, stdout, stderr = compare_cli([*write_recipes(tmp_path), "--output-dir", str(out), "--run-fn", "fake_train:run_training",
                                 "--pythonpath", fake["dir"], "--config", str(config)], capsys)
    assert code == 0, stdout + stderr
    document = json.loads((out / "compare.json").read_text())
    assert document["params"]["extra_overrides"] == {"num_iterations": 2} and document["params"]["seeds"] == [0]
    assert sorted(document["results"]["runs"]) == ["A_s0", "B_s0"]
    assert sorted(_calls(fake)) == ["A_s0", "B_s0"] and _calls(fake, "max_steps") == [2, 2]
    assert _calls(fake, "overrides") == [{"num_iterations": 2}] * 2


def test_a_second_sweep_on_the_same_folder_is_refused_in_one_line(tmp_path, fake, capsys):
    import fcntl

    out = tmp_path / "out"
    out.mkdir()
    with open(out / ".compare.lock", "w") as held:  # a sweep (or a run it started) holds the folder
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # a short wait still polls the held lock more than once (the default waits 2 s)
        code, _, stderr = compare_cli([*write_recipes(tmp_path), "--seeds", "0", "--output-dir", str(out),
                                "--run-fn", "fake_train:run_training", "--lock-wait-s", "0.3"], capsys)
    assert code == 2 and "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1
    assert stderr.startswith(f"bloggap compare: another bloggap compare (or a run it started) is using {out}")
    assert _calls(fake) == []


def test_a_corrupted_log_line_sets_that_run_aside_naming_file_and_line(tmp_path, fake, capsys, spawns):
    pytest.importorskip("matplotlib")
    config = _config(tmp_path, fake)
    run_compare(config, echo=lambda m: None)
    log = Path(config.output_dir) / "runs" / "A_s1.jsonl"
    lines = log.read_text().splitlines()
    log.write_text("\n".join([lines[0], '{"step": 2, "rew', *lines[2:]]) + "\n")
    code, stdout, stderr = compare_cli([*config.recipes, "--seeds", "0", "1", "--max-steps", "4", "--output-dir",
                                 config.output_dir, "--last-n", "2", "--override", '{"num_iterations": 2}',
                                 "--model", config.model, "--run-fn", config.run_fn, "--table-only"], capsys)
    assert code == 1 and "Traceback" not in stderr, stderr
    assert f"A_s1: set aside: {log}:2: not a JSON line" in stdout
    document = json.loads((Path(config.output_dir) / "compare.json").read_text())
    assert sorted(document["results"]["runs"]) == ["A_s0", "B_s0", "B_s1"]
    assert document["results"]["arms"]["B"]["delta_vs_base"] == {"0": pytest.approx(0.25)}  # no A for seed 1
    messages = []
    res = run_compare(config, echo=messages.append)  # a sweep trains it again, keeping the corrupt log aside
    assert _calls(fake)[4:] == ["A_s1"] and res["set_aside"] == {} and res["failed"] == {}
    assert any(f"{log}:2: not a JSON line" in m and "kept as A_s1.jsonl.corrupt" in m for m in messages)
    assert (log.parent / "A_s1.jsonl.corrupt").read_text().count("\n") == 5


# --------------------------------------------------------------------------------------------- renamed run functions


OLD_DEFAULT_RUN_FN = "bloggap_plugin.trl.train:run_training"
"""The default training function as committed result files and run logs record it (its module was renamed)."""


def test_the_recorded_old_default_run_fn_resolves_to_the_renamed_function():
    """Run specs, logs and result files name the training function by ``module:function``; the name they recorded
    before the module was renamed still loads the function, and new runs record the new name."""
    pytest.importorskip("trl")
    from bloggap_plugin.compare import DEFAULT_RUN_FN, RENAMED_RUN_FNS
    from bloggap_plugin.compare.sweep_config import resolve_function
    from bloggap_plugin.trl.run import run_training

    assert DEFAULT_RUN_FN == "bloggap_plugin.trl.run:run_training"
    assert RENAMED_RUN_FNS == {OLD_DEFAULT_RUN_FN: DEFAULT_RUN_FN}
    assert resolve_function(OLD_DEFAULT_RUN_FN) is run_training
    assert resolve_function(DEFAULT_RUN_FN) is run_training


def test_a_log_that_records_the_old_default_run_fn_is_not_trained_again(tmp_path):
    """Resume (and ``--table-only``) read a log whose settings name the old default as trained with the same
    function; a sweep given the old name records the new one."""
    config = CompareConfig(recipes=write_recipes(tmp_path, ("A",)), seeds=[0], output_dir=str(tmp_path / "o"),
                           max_steps=2)
    run = plan_runs(config)[0]
    settings = run_settings(config, run)
    assert settings["run_fn"] == "bloggap_plugin.trl.run:run_training"
    Path(run.log_jsonl).parent.mkdir(parents=True)
    marker = {DONE_KEY: "done", "wall_s": 1.0, "settings": {**settings, "run_fn": OLD_DEFAULT_RUN_FN}}
    Path(run.log_jsonl).write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n" + json.dumps(marker) + "\n")
    assert run_state(config, run) == ("done", "")
    old_name = dataclasses.replace(config, run_fn=OLD_DEFAULT_RUN_FN)
    assert run_settings(old_name, run) == settings and run_state(old_name, run) == ("done", "")
    other = dataclasses.replace(config, run_fn="fake_train:run_training")  # any other function is other settings
    assert run_state(other, run)[0] == "changed"


def test_a_sweep_given_the_old_default_run_fn_by_hand_is_the_default_sweep(tmp_path):
    """``--run-fn`` with the recorded old name is the default training function: the config holds the new name,
    so the default run's checks (model, vLLM, GRPOConfig settings) apply to it as to a sweep that named none."""
    config = CompareConfig(recipes=write_recipes(tmp_path, ("A",)), seeds=[0], output_dir=str(tmp_path / "o"),
                           max_steps=2, run_fn=OLD_DEFAULT_RUN_FN)
    assert config.run_fn == "bloggap_plugin.trl.run:run_training"


# --------------------------------------------------------------------------------------------- real training


@pytest.mark.parametrize("apart", [False, True], ids=["evaluated-in-training-process", "evaluated-apart"])
def test_two_arms_one_seed_two_steps_on_a_tiny_model(tmp_path, spawns, apart):
    """The real run_training (TRL engineer's) end to end: table, JSON and plot; the held-out evaluation in the
    training process or, with heldout_apart, in a process of its own after it."""
    run = pytest.importorskip("bloggap_plugin.trl.run", reason="run_training (bloggap_plugin.trl.run) has not landed")
    pytest.importorskip("matplotlib")
    assert hasattr(run, "run_training")
    root = ROOT
    recipes = [str(root / "recipes" / "arm_A.yaml"), str(root / "recipes" / "arm_F.yaml")]
    config = CompareConfig(recipes=recipes, seeds=[0], task="arith", max_steps=2, model="tiny-random-llama",
                           output_dir=str(tmp_path / "out"), parallel=2, last_n=30, n=16, poll_s=0.5, heldout_n=6,
                           heldout_batch_size=4, heldout_apart=apart)
    messages = []
    res = run_compare(config, echo=messages.append)
    assert res["failed"] == {}, res["failed"]
    assert sum("its evaluation starts apart" in m for m in messages) == (2 if apart else 0)
    assert sum(m.endswith(": evaluating") for m in messages) == (2 if apart else 0)
    assert set(res["arms"]) == {"A", "F"}
    for summary in res["runs"].values():
        assert summary["steps"] == 2 and summary["reward_steps"] >= 1
        assert all(0.0 <= r <= 1.0 for r in summary["rewards"])
        held = summary["heldout"]  # the real evaluation: 6 held-out prompts, greedy, the recipes' 32 new tokens
        assert (held["n"], held["max_tokens"], held["engine"], held["dtype"]) == (6, 32, "HF generate", "fp32")
        assert held["batch_size"] == 4  # recorded: the prompts per generate call (two calls for six prompts)
        assert held["correct"] == round(6 * held["accuracy"])
    out = Path(config.output_dir)
    tables = json.loads((out / "compare.json").read_text())["tables"]
    assert [row[0] for row in tables[0]["rows"]] == ["A", "F"]
    assert tables[1]["id"] == "T10-heldout" and [row[0] for row in tables[1]["rows"]] == ["A", "F"]
    assert not list(out.glob("trainer/*/final"))  # each saved policy is deleted once its result is written
    assert (out / "reward_curves.png").read_bytes()[:4] == b"\x89PNG"


# --------------------------------------------------------------------------------------------- GSM8K and --use-vllm


def test_use_vllm_reaches_every_run_and_is_part_of_the_run_settings(tmp_path, fake, spawns):
    """--use-vllm adds TRL's colocate fields to each run's overrides, with the GPU's memory divided among the runs
    in flight; a resume with the other value trains again, a resume with another --parallel does not."""
    pytest.importorskip("matplotlib")
    config = _config(tmp_path, fake, seeds=[0], parallel=2, use_vllm=True)
    run_compare(config, echo=lambda m: None)
    # 0.75 of the GPU for the engines together, 2 runs in flight: 0.375 each
    expected = {"num_iterations": 2, "use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.375}
    assert _calls(fake, "overrides") == [expected, expected]
    document = json.loads((Path(config.output_dir) / "compare.json").read_text())
    assert document["params"]["use_vllm"] is True and "generation: vLLM colocate" in document["tables"][0]["notes"]
    run_compare(_config(tmp_path, fake, seeds=[0], parallel=1, use_vllm=True), echo=lambda m: None)
    assert len(_calls(fake)) == 2  # another --parallel changes the memory share, not the result: nothing reruns
    messages = []
    run_compare(_config(tmp_path, fake, seeds=[0], parallel=2), echo=messages.append)
    assert _calls(fake, "overrides")[2:] == [{"num_iterations": 2}] * 2
    assert any("A_s0" in m and "use_vllm true -> null" in m for m in messages), messages
    mine = {"num_iterations": 2, "vllm_gpu_memory_utilization": 0.2}
    run_compare(_config(tmp_path, fake, seeds=[0], parallel=2, use_vllm=True, extra_overrides=mine), echo=lambda m: None)
    assert _calls(fake, "overrides")[4:] == [{**expected, "vllm_gpu_memory_utilization": 0.2}] * 2  # --override wins


@pytest.mark.parametrize(
    "override, problem",
    [
        ('{"use_vllm": false}', "--use-vllm with --override use_vllm=false: drop one of them"),
        ('{"vllm_mode": "server"}', "--use-vllm runs TRL's colocated engine, but --override sets vllm_mode=\"server\""),
        ('{"vllm_gpu_memory_utilization": 1.5}', "--override vllm_gpu_memory_utilization=1.5: must be a fraction"),
    ],
)
def test_use_vllm_with_a_contradicting_override_is_refused(tmp_path, fake, capsys, override, problem):
    out = tmp_path / "out"
    code, _, stderr = compare_cli([*write_recipes(tmp_path), "--seeds", "0", "--output-dir", str(out), "--use-vllm",
                            "--run-fn", "fake_train:run_training", "--override", override], capsys)
    # a value outside a field's declared range is refused by the command line's range check ("bloggap: error: "),
    # the rest by compare's own checks ("bloggap compare: ")
    assert code == 2 and stderr.startswith((f"bloggap compare: {problem}", f"bloggap: error: {problem}")), stderr
    assert len(stderr.strip().splitlines()) == 1 and not out.exists() and _calls(fake) == []


def test_use_vllm_is_refused_without_vllm_or_cuda_before_anything_loads(tmp_path, capsys, monkeypatch):
    import importlib.util

    import torch

    import bloggap_plugin.compare as compare
    import bloggap_plugin.models as models

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before --use-vllm was refused")

    monkeypatch.setattr(models, "load_model", no_model)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    out = tmp_path / "out"
    args = [*write_recipes(tmp_path), "--seeds", "0", "--output-dir", str(out), "--model", "tiny-random-llama", "--use-vllm"]
    code, _, stderr = compare_cli(args, capsys)
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and not out.exists(), stderr
    assert stderr.startswith("bloggap compare: --use-vllm: vLLM is not installed here; run the sweep on a machine "
                             "with a CUDA GPU and vLLM"), stderr
    # vLLM present (pretended), no CUDA: the other reason; both present: nothing to refuse.
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real_find_spec(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert compare.vllm_unavailable_reason() == f"CUDA is not available here (torch {torch.__version__})"
    code, _, stderr = compare_cli(args, capsys)
    assert code == 2 and "--use-vllm: CUDA is not available here" in stderr and not out.exists()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert compare.vllm_unavailable_reason() is None


def test_gsm8k_options_reach_the_runs_and_the_data_in_effect_is_a_setting(tmp_path, fake, monkeypatch, spawns):
    """--task gsm8k: --data (or $BLOGGAP_GSM8K_DATA) and --calc-steps reach each run; the absolute data path in
    effect is recorded, so a resume on other data trains again."""
    from bloggap_plugin.tasks.gsm8k import DATA_ENV, SAMPLE_PATH

    pytest.importorskip("matplotlib")
    copy = tmp_path / "my_gsm8k.jsonl"
    copy.write_bytes(SAMPLE_PATH.read_bytes())
    monkeypatch.chdir(tmp_path)
    config = _config(tmp_path, fake, seeds=[0], task="gsm8k", data="my_gsm8k.jsonl", calc_steps="2")
    run_compare(config, echo=lambda m: None)
    expected = {"data": str(copy), "calc_steps": "2"}  # the worker passes the options that are set
    assert _calls(fake, "task_kwargs") == [expected, expected] and _calls(fake, "task") == ["gsm8k", "gsm8k"]
    monkeypatch.setenv(DATA_ENV, str(copy))  # the same file through the variable: nothing reruns
    run_compare(dataclasses.replace(config, data=None), echo=lambda m: None)
    assert len(_calls(fake)) == 2
    other = tmp_path / "other.jsonl"
    other.write_bytes(SAMPLE_PATH.read_bytes())
    monkeypatch.setenv(DATA_ENV, str(other))
    messages = []
    run_compare(dataclasses.replace(config, data=None), echo=messages.append)
    assert [kw["data"] for kw in _calls(fake, "task_kwargs")[2:]] == [str(other)] * 2
    assert any("other settings (task_kwargs" in m for m in messages), messages


def test_gsm8k_data_and_calc_steps_are_checked_before_anything_runs(tmp_path, fake, capsys, gsm8k_dir):
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "train.jsonl").write_text("".join((gsm8k_dir / "train.jsonl").read_text().splitlines(keepends=True)[1:]))
    out = tmp_path / "out"
    base = [*write_recipes(tmp_path), "--seeds", "0", "--output-dir", str(out), "--run-fn", "fake_train:run_training",
            "--task", "gsm8k"]
    for extra, problem in (
        (["--data", str(cut)], f"--data: GSM8K file {cut / 'train.jsonl'} has 7,472 rows, the published train.jsonl has 7,473"),
        (["--data", str(gsm8k_dir), "--calc-steps", "3-1"], "--calc-steps: calc_steps '3-1': give a number >= 0"),
        (["--data", str(gsm8k_dir), "--calc-steps", "99"], "--calc-steps: no GSM8K row has 99 calculation step(s)"),
    ):
        code, _, stderr = compare_cli([*base, *extra], capsys)
        assert code == 2 and stderr.startswith(f"bloggap compare: {problem}"), stderr
        assert len(stderr.strip().splitlines()) == 1 and not out.exists() and _calls(fake) == []



def test_compare_override_takes_yaml_as_train_does(tmp_path, fake, capsys, spawns):
    """--override reads a YAML mapping like train's --extra-overrides (JSON is YAML too): one syntax for both."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    code, stdout, stderr = compare_cli([*write_recipes(tmp_path), "--seeds", "0", "--max-steps", "2", "--output-dir", str(out),
                                 "--model", "tiny-random-llama", "--run-fn", "fake_train:run_training", "--pythonpath",
                                 fake["dir"], "--last-n", "1", "--override", "{num_iterations: 2}"], capsys)
    assert code == 0, stdout[-2000:] + stderr
    assert _calls(fake, "overrides") == [{"num_iterations": 2}, {"num_iterations": 2}]


def test_a_run_function_on_the_sweeps_own_import_paths_loads_without_editing_sys_path(tmp_path):
    """``--pythonpath`` reaches the workers through PYTHONPATH; the in-process check of the run function finds its
    module in those folders without adding them to this process's ``sys.path`` (the module records whether its
    folder was on ``sys.path`` while it was imported)."""
    import sys

    from bloggap_plugin.compare.sweep_config import _resolve_with_path

    folder = tmp_path / "extra"
    (folder / "extra_pkg").mkdir(parents=True)
    (folder / "extra_pkg" / "__init__.py").write_text("")
    (folder / "extra_pkg" / "runs.py").write_text(
        f"import sys\nON_PATH = {str(folder)!r} in sys.path\n\ndef run_training(**kwargs):\n    return kwargs\n")
    (folder / "extra_top.py").write_text(
        f"import sys\nON_PATH = {str(folder)!r} in sys.path\n\ndef run_training(**kwargs):\n    return kwargs\n")
    config = CompareConfig(recipes=write_recipes(tmp_path, ("A",)), seeds=[0], output_dir=str(tmp_path / "o"),
                           max_steps=2, pythonpath=[str(folder)])
    before = list(sys.path)
    for name in ("extra_top:run_training", "extra_pkg.runs:run_training"):
        function = _resolve_with_path(config, name)
        assert function(a=1) == {"a": 1}
        assert sys.modules[function.__module__].ON_PATH is False
    assert sys.path == before
