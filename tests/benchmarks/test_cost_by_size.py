"""The cost-by-size benchmark's pieces that need no GPU: labels, each run's environment, the table's arithmetic."""

from __future__ import annotations

import pytest

from benchmarks import cost_by_size as bench


def test_arm_texts_and_labels():
    assert bench.parse_arm("J") == ("J", None)
    assert bench.parse_arm("I:process") == ("I", "process")
    assert bench.run_label("I:process", 2) == "I_process-2"
    assert bench.parse_arm("A:vllm_workspaces") == ("A", "vllm_workspaces")
    for bad in ("K", "I:everywhere", "", "ij"):
        with pytest.raises(ValueError, match="expected a letter A-J"):
            bench.parse_arm(bad)


def test_runs_export_nothing_for_the_arm_but_the_scope_asked_for():
    caller = {"PATH": "/bin", "VLLM_BATCH_INVARIANT": "1", "TRITON_F32_DEFAULT": "ieee",
              "BLOGGAP_VLLM_BATCH_INVARIANCE": "process"}
    assert bench.run_environment("J", caller) == {"PATH": "/bin"}
    assert bench.run_environment("J:process", caller) == {"PATH": "/bin", "BLOGGAP_VLLM_BATCH_INVARIANCE": "process"}
    assert bench.run_environment("A:vllm_workspaces", {**caller, "CUBLASLT_WORKSPACE_SIZE": "9"}) == {
        "PATH": "/bin", "CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}
    assert bench.run_environment("A", {**caller, "CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == {"PATH": "/bin"}


def test_a_dense_attention_run_is_arm_js_attention_gradient_route_before():
    """``J:dense_attention`` runs arm J with ``BLOGGAP_ATTENTION_GRADIENT=dense`` (the dense closed form for every
    paged call: the by-entry route's before); no other run inherits the caller's variable."""
    caller = {"PATH": "/bin", "BLOGGAP_ATTENTION_GRADIENT": "dense"}
    assert bench.parse_arm("J:dense_attention") == ("J", "dense_attention")
    assert bench.run_label("J:dense_attention", 2) == "J_dense_attention-2"
    assert bench.run_environment("J:dense_attention", {"PATH": "/bin"}) == {"PATH": "/bin",
                                                                            "BLOGGAP_ATTENTION_GRADIENT": "dense"}
    assert bench.run_environment("J", caller) == bench.run_environment("J:tiles", caller) == {"PATH": "/bin"}
    both = "J:tiles+dense_attention"  # the route's before at a shape measured with a tile table
    assert bench.parse_arm(both) == ("J", "tiles+dense_attention")
    assert bench.run_label(both, 1) == "J_tiles_dense_attention-1"
    assert bench.run_environment(both, caller) == {"PATH": "/bin", "BLOGGAP_ATTENTION_GRADIENT": "dense"}
    assert bench.run_tiles(both, "t.json").endswith("t.json") and bench.run_tiles("J:dense_attention", "t.json") is None
    for bad in ("J:tiles+tiles", "I:process+engine", "J:tiles+fast", "J:+tiles"):
        with pytest.raises(ValueError, match=r"optionally :SCOPE with SCOPE one of process, engine, .*joined by \+"):
            bench.parse_arm(bad)


def test_only_a_tiles_run_names_the_tile_table_and_it_does_so_with_the_recipe_field(tmp_path, monkeypatch):
    """An ``ARM:tiles`` run names its table as a user does (``--gap_overrides '{matmul_tiles: FILE}'``, made absolute:
    runs start in the checkout); no run inherits the caller's variable."""
    import yaml

    monkeypatch.chdir(tmp_path)
    caller = {"PATH": "/bin", "BLOGGAP_VLLM_MATMUL_TILES": "/somewhere/else.json"}
    assert bench.parse_arm("J:tiles") == ("J", "tiles") and bench.run_label("J:tiles", 1) == "J_tiles-1"
    assert bench.run_environment("J:tiles", caller) == bench.run_environment("J", caller) == {"PATH": "/bin"}
    argv = bench.run_argv("J:tiles", "/m", 30, tmp_path / "x.jsonl", 0.3, "tiles.json")
    assert argv.count("--gap_overrides") == 1
    assert yaml.safe_load(argv[argv.index("--gap_overrides") + 1]) == {"matmul_tiles": str(tmp_path / "tiles.json")}
    assert "--gap_overrides" not in bench.run_argv("J", "/m", 30, tmp_path / "x.jsonl", 0.3, "tiles.json")
    with pytest.raises(ValueError, match="arm 'I:tiles' runs with a tile table: give its file with --matmul-tiles"):
        bench.run_argv("I:tiles", "/m", 30, tmp_path / "x.jsonl", 0.3)


def test_run_argv_is_bloggap_train_with_the_length_reward(tmp_path):
    argv = bench.run_argv("I:process", "/m", 30, tmp_path / "x.jsonl", 0.3)
    assert argv[2:5] == ["bloggap_plugin.cli", "train", "recipes/arm_I.yaml"]
    assert argv[-2:] == ["--task_kwargs", "{reward: length}"]
    assert argv[argv.index("--num_iterations") + 1] == "2" and argv[argv.index("--vllm_mode") + 1] == "colocate"


def _run(arm, median, mean, generating, other, exact=1.0, ratio_exact=None, steps=30, step1=9.0):
    return {"arm": arm, "steps": steps, "step_s_median": median, "step_s_mean": mean,
            "generating_step_s_median": generating, "other_step_s_median": other, "sampler_exact_mean": exact,
            "ratio_exact_first_iteration_min": ratio_exact, "step1_s": step1, "seconds": 60.0}


def test_size_table_divides_by_the_mean_of_the_same_models_arm_a_runs():
    models = {"m": {"A-1": _run("A", 1.0, 1.2, 2.0, 0.5, exact=0.9), "J-1": _run("J", 2.2, 2.4, 3.0, 1.0, 1.0, 1.0),
                    "A-2": _run("A", 1.2, 1.2, 2.0, 0.5, exact=0.8), "J-2": _run("J", 2.2, 3.6, 5.0, 1.5, 1.0, 1.0),
                    "I-1": {"arm": "I", "error": "exit 1", "seconds": 5.0}}}
    table = bench.size_table(models)
    rows = {row[0].split(" @ ")[0]: dict(zip(table["columns"], row)) for row in table["rows"]}
    assert [row[0] for row in table["rows"]] == ["A @ m", "J @ m", "I @ m"]
    a, j, i = rows["A"], rows["J"], rows["I"]
    assert a["runs"] == 2 and a["median step x arm A"] == 1.0 and a["median x A, runs (min-max)"] == "0.91-1.09"
    assert a["sampler bit-identical % (least run)"] == 80.0
    assert j["median step x arm A"] == 2.0 and j["median x A, runs (min-max)"] == "2.00-2.00"
    assert j["mean step x arm A"] == 2.5 and j["mean x A, runs (min-max)"] == "2.00-3.00"
    assert j["generating step x arm A (median)"] == 2.0 and j["training-only step x arm A (median)"] == 2.5
    assert j["training-only step s (median)"] == 1.25 and a["training-only step s (median)"] == 0.5
    assert j["ratio exact_frac, first iteration (least)"] == 1.0 and j["step 1 s (mean)"] == 9.0
    assert i["runs"] == 0 and i["median x A, runs (min-max)"] == "failed: I-1"


def test_a_failed_arms_row_says_why_from_its_logs_last_exception():
    """Issue 44: a shape that does not fit says why in the table. A failed run's cause is the last exception line of
    its console tail (rank prefix and message after its first sentence dropped); runs failing alike name it once,
    runs failing differently each cause, a tail without an exception only the failure."""
    oom = ("Traceback (most recent call last):\n[rank0]:   File \"adam.py\", line 178, in _init_group\n"
           "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 36.00 MiB. GPU 0 has 79.18 GiB\n")
    models = {"m": {"A-1": {"arm": "A", "error": "exit 1", "log_tail": oom, "seconds": 5.0},
                    "A-2": {"arm": "A", "error": "exit 1", "log_tail": oom.replace("36.00", "30.00"), "seconds": 5.0},
                    "J-1": {"arm": "J", "error": "exit 1", "log_tail": oom, "seconds": 5.0},
                    "J-2": {"arm": "J", "error": "exit 1", "log_tail": "ValueError: no kept set\n", "seconds": 5.0},
                    "I-1": {"arm": "I", "error": "exit 9", "log_tail": "killed\n", "seconds": 5.0}}}
    cells = {row[0]: row[6] for row in bench.size_table(models)["rows"]}
    assert cells == {"A @ m": "failed: A-1, A-2 (torch.OutOfMemoryError: CUDA out of memory)",
                     "J @ m": "failed: J-1, J-2 (torch.OutOfMemoryError: CUDA out of memory; ValueError: no kept set)",
                     "I @ m": "failed: I-1"}
    assert bench.failure_cause("x\nRuntimeError: the flash kernel changed one of its inputs in place; wrap it\n") == (
        "RuntimeError: the flash kernel changed one of its inputs in place; wrap it")


def test_a_run_splits_its_generating_steps_into_generation_and_old_pass_seconds():
    """Per run, the medians over generating steps after the first of ``gap/time/generate_s`` (the sampler's seconds)
    and ``gap/time/old_pass_s``; the table's row is their mean over the arm's runs."""
    records = [{"step": 1, "step_time": 9.0, "gap/sampler/oob_frac": 0.0, "gap/time/generate_s": 5.0},
               {"step": 2, "step_time": 1.0, "gap/sampler/oob_frac": 0.0, "gap/time/generate_s": 0.4,
                "gap/time/old_pass_s": 0.1},
               {"step": 3, "step_time": 0.5, "gap/time/generate_s": 0.0},
               {"step": 4, "step_time": 1.2, "gap/sampler/oob_frac": 0.0, "gap/time/generate_s": 0.6,
                "gap/time/old_pass_s": 0.3},
               {"step": 5, "step_time": 0.5, "gap/time/generate_s": 0.0}]
    run = bench.summarize_run("J", records)
    assert run["generate_s_median"] == 0.5 and run["old_pass_s_median"] == 0.2
    other = {**run, "generate_s_median": 0.7, "old_pass_s_median": None}
    table = bench.size_table({"m": {"J-1": run, "J-2": other}})
    row = dict(zip(table["columns"], table["rows"][0]))
    assert row["generation s (median)"] == 0.6 and row["old pass s (median)"] == 0.2


def test_a_model_without_arm_a_runs_has_no_multiples():
    table = bench.size_table({"m": {"J-1": _run("J", 2.0, 2.0, 3.0, 1.0)}})
    row = dict(zip(table["columns"], table["rows"][0]))
    assert row["step s (median)"] == 2.0 and row["median step x arm A"] is None and row["mean step x arm A"] is None


@pytest.mark.parametrize("name, billions", [("llama-0.48b-v49k", 0.48), ("llama-1.56b-v49k", 1.56),
                                            ("qwen2-1.39b-v49k", 1.39), ("llama-3b-v49k", 3.0)])
def test_each_v49k_shape_has_the_size_its_name_says(name, billions):
    """The cost-by-size shapes, built on the meta device (no memory): parameters within 5% of the name's size."""
    import torch

    from benchmarks._lib.shapes import build_shape

    model = build_shape(name, torch.device("meta"))
    count = sum(p.numel() for p in model.parameters())
    assert abs(count / 1e9 - billions) <= 0.05 * billions, count
    assert model.config.vocab_size == 49152 and model.config.tie_word_embeddings


def _analysis(arms: dict, status: str = "final") -> dict:
    return {"tables": [{"id": "T10-analysis"}], "results": {"analysis": {
        "status": status, "declared": {"primary": "reward_last", "baseline": "A", "alpha": 0.05},
        "metrics": {"reward_last": {"alpha": 0.05, "arms": arms}}}}}


def _arm(mean, low, high, p_t, p_sign):
    return {"mean": mean, "low": low, "high": high, "p_t_holm": p_t, "p_sign_flip_holm": p_sign}


def test_sweep_verdicts_need_the_interval_and_both_holm_p_values():
    """An arm is lower or higher than A only where its simultaneous interval excludes 0 and both Holm-adjusted
    p-values are under alpha; an interval that excludes 0 with a sign-flip p over alpha is not enough."""
    sweep = _analysis({"B": _arm(-0.02, -0.032, -0.008, 0.0013, 0.0098), "E": _arm(0.0, -0.009, 0.008, 1.0, 1.0),
                       "H": _arm(0.004, 0.0001, 0.008, 0.04, 0.0762), "K": _arm(0.01, 0.002, 0.02, 0.01, 0.02)})
    verdicts = bench.sweep_verdicts(sweep, "T10")
    assert verdicts["A"] == "baseline of T10"
    assert verdicts["B"] == ("lower than A: reward_last -0.020 [-0.032, -0.008], Holm p 0.0013 (t) / 0.0098 "
                             "(sign-flip), T10")
    assert verdicts["E"].startswith("not distinguishable from A: reward_last +0.000 [-0.009, +0.008]")
    assert verdicts["H"].startswith("not distinguishable from A")  # sign-flip 0.0762 >= 0.05
    assert verdicts["K"].startswith("higher than A")
    assert bench.sweep_verdicts(_analysis({}, status="interim"), "T10") == {}


def test_live_arms_table_means_the_gap_columns_and_keeps_the_least_exact_run():
    def run(arm, mean, sampler, ratio, exact, ratio_exact):
        return {**_run(arm, mean, mean, mean, mean, exact=exact, ratio_exact=ratio_exact),
                "sampler_oob_mean": sampler, "ratio_oob_first_iteration_mean": ratio}

    runs = {"A-1": run("A", 1.0, 0.04, 0.01, 0.0, 0.5), "B-1": run("B", 1.5, 0.03, 0.02, 0.0, 0.0),
            "A-2": run("A", 1.2, 0.02, 0.03, 0.1, 0.7), "B-2": run("B", 1.8, 0.05, 0.04, 0.0, 0.0),
            "J-1": run("J", 2.2, 0.0, 0.0, 1.0, 1.0), "J_process-1": run("J:process", 9.9, 0.0, 0.0, 1.0, 1.0),
            "H-1": {"arm": "H", "error": "exit 1", "seconds": 5.0}}
    table = bench.live_arms_table("smollm2-135m", {"smollm2-135m": runs}, {"A": "baseline of T10", "B": "lower than A"})
    rows = {row[0]: dict(zip(table["columns"], row)) for row in table["rows"]}
    assert list(rows) == ["A", "B", "J"]  # failed runs and ARM:SCOPE variants are not arms of the table
    a, b, j = rows["A"], rows["B"], rows["J"]
    assert a["sampler tokens out of band % (mean)"] == 3.0 and a["ratio out of band at a first iteration % (mean)"] == 2.0
    assert a["sampler bit-identical % (least run)"] == 0.0 and a["ratio exact_frac, first iteration (least)"] == 0.5
    assert b["mean step x arm A"] == 1.5 and b["mean x A, runs (min-max)"] == "1.36-1.64"
    assert b["reward vs arm A (sweep)"] == "lower than A" and j["reward vs arm A (sweep)"] == "not in the sweep"
    assert j["sampler bit-identical % (least run)"] == 100.0 and j["mean step x arm A"] == 2.0
    assert bench.live_arms_table("m", {"m": runs}, {})["rows"][0][-1] == "no sweep given"


def test_collect_adds_the_live_table_of_the_real_model_only(tmp_path):
    import json

    folder = tmp_path / "c1"
    (folder / "smollm2-135m").mkdir(parents=True)
    runs = {"A-1": {**_run("A", 1.0, 1.0, 1.0, 1.0), "sampler_oob_mean": 0.01, "ratio_oob_first_iteration_mean": 0.0}}
    (folder / bench.RESULT_NAME).write_text(json.dumps({"params": {}, "env": {"gpu": "x"},
                                                        "results": {"smollm2-135m": runs, "llama-1.56b": runs}}))
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps(_analysis({})))
    out = tmp_path / "doc.json"
    assert bench.main(["collect", str(folder), "--out", str(out), "--revision", "abc", "--real", "smollm2-135m",
                       "--sweep", str(sweep)]) == 0
    tables = json.loads(out.read_text())["tables"]
    assert [t["id"] for t in tables] == [bench.TABLE_ID, bench.LIVE_TABLE_ID]
    assert tables[1]["rows"][0][0] == "A" and tables[1]["rows"][0][-1] == "baseline of T10"
    with pytest.raises(SystemExit, match="--real qwen: no runs of that model"):
        bench.main(["collect", str(folder), "--out", str(out), "--revision", "abc", "--real", "qwen"])


def _call_folder(root, name, runs):
    import json

    folder = root / name
    (folder / "m").mkdir(parents=True)
    (folder / bench.RESULT_NAME).write_text(json.dumps({"params": {}, "env": {"gpu": "x"}, "results": {"m": runs}}))
    return folder


def test_collect_refuses_two_sets_whose_run_labels_collide(tmp_path):
    """Two calls' separate interleaved sets both hold A-1: joining them would drop one call's A-1 without a word."""
    first = _call_folder(tmp_path, "c1", {"A-1": _run("A", 1.0, 1.0, 1.0, 1.0), "J-1": _run("J", 2.0, 2.0, 2.0, 2.0)})
    second = _call_folder(tmp_path, "c2", {"A-1": _run("A", 0.5, 0.5, 0.5, 0.5), "I-1": _run("I", 0.6, 0.6, 0.6, 0.6)})
    out = tmp_path / "doc.json"
    with pytest.raises(SystemExit, match=r"m/A-1 differs between .*c1 and .*c2.*--interleaved-sets"):
        bench.main(["collect", str(first), str(second), "--out", str(out), "--revision", "abc"])


def test_collect_keeps_a_resumed_folder_s_runs_and_replaces_its_failed_ones(tmp_path):
    failed = {"arm": "J", "error": "exit 1", "seconds": 5.0}
    first = _call_folder(tmp_path, "c1", {"A-1": _run("A", 1.0, 1.0, 1.0, 1.0), "J-1": failed})
    later = _call_folder(tmp_path, "c1_later", {"A-1": _run("A", 1.0, 1.0, 1.0, 1.0),
                                                "J-1": _run("J", 2.0, 3.0, 2.0, 2.0)})
    out = tmp_path / "doc.json"
    assert bench.main(["collect", str(first), str(later), "--out", str(out), "--revision", "abc"]) == 0
    import json

    rows = {row[0]: dict(zip(bench.COLUMNS, row)) for row in json.loads(out.read_text())["tables"][0]["rows"]}
    assert rows["J @ m"]["mean step x arm A"] == 3.0


def test_interleaved_sets_compare_each_arm_with_arm_a_of_its_own_call(tmp_path):
    import json

    first = _call_folder(tmp_path, "c1", {"A-1": _run("A", 1.0, 1.0, 1.0, 1.0), "J-1": _run("J", 2.0, 2.0, 2.0, 2.0)})
    second = _call_folder(tmp_path, "c2", {"A-1": _run("A", 0.5, 0.5, 0.5, 0.5), "I-1": _run("I", 0.6, 0.6, 0.6, 0.6)})
    (first / "m" / "A-1.log").write_text("one")
    (second / "m" / "A-1.log").write_text("two")
    out = tmp_path / "doc.json"
    assert bench.main(["collect", str(first), str(second), "--out", str(out), "--revision", "abc",
                       "--interleaved-sets", "--pack-dir", str(tmp_path / "pack")]) == 0
    document = json.loads(out.read_text())
    assert sorted(document["results"]) == ["m-set1", "m-set2"]
    rows = {row[0]: dict(zip(bench.COLUMNS, row)) for row in document["tables"][0]["rows"]}
    assert rows["J @ m-set1"]["mean step x arm A"] == 2.0
    assert rows["I @ m-set2"]["mean step x arm A"] == 1.2
    assert rows["A @ m-set2"]["runs"] == 1
    assert sorted(p.name for p in (tmp_path / "pack").iterdir()) == ["runs_m-set1.tar.xz", "runs_m-set2.tar.xz"]


def test_the_live_table_of_a_real_model_in_two_interleaved_sets_is_one_table(tmp_path):
    """Arms A-J at 135M take longer than one session's device time, so they run as sets (each with its own arm A)
    on two machines; --real names the model once and gets one live table: each run's step multiple is over the arm A
    of its own set, the gap columns pool every run of the arm."""
    import json

    def run(arm, mean, sampler):
        return {**_run(arm, mean, mean, mean, mean), "sampler_oob_mean": sampler, "ratio_oob_first_iteration_mean": 0.0}

    first = _call_folder(tmp_path, "c1", {"A-1": run("A", 1.0, 0.02), "B-1": run("B", 1.5, 0.04)})
    second = _call_folder(tmp_path, "c2", {"A-1": run("A", 0.5, 0.04), "B-1": run("B", 0.6, 0.02),
                                           "J-1": run("J", 1.0, 0.0)})
    out = tmp_path / "doc.json"
    assert bench.main(["collect", str(first), str(second), "--out", str(out), "--revision", "abc",
                       "--interleaved-sets", "--real", "m"]) == 0
    tables = json.loads(out.read_text())["tables"]
    assert [t["id"] for t in tables] == [bench.TABLE_ID, bench.LIVE_TABLE_ID]
    rows = {row[0]: dict(zip(bench.LIVE_COLUMNS, row)) for row in tables[1]["rows"]}
    assert rows["A"]["runs"] == 2 and rows["A"]["mean step x arm A"] == 1.0
    assert rows["A"]["mean x A, runs (min-max)"] == "1.00-1.00"
    assert rows["B"]["runs"] == 2 and rows["B"]["mean step x arm A"] == 1.35  # 1.5 / 1.0 and 0.6 / 0.5
    assert rows["B"]["mean x A, runs (min-max)"] == "1.20-1.50"
    assert rows["B"]["sampler tokens out of band % (mean)"] == 3.0
    assert rows["J"]["mean step x arm A"] == 2.0
    assert "2 interleaved sets" in tables[1]["notes"]
    with pytest.raises(SystemExit, match="--real q: no runs of that model"):
        bench.main(["collect", str(first), str(second), "--out", str(out), "--revision", "abc", "--interleaved-sets",
                    "--real", "q"])


def test_collect_refuses_folders_from_two_kinds_of_gpu(tmp_path):
    """A step multiple compares arms on one card: sets made on an H100 and an H200 are not one table (the document
    keeps the first folder's env, so a mixed pair would be labelled with one card)."""
    import json

    first = _call_folder(tmp_path, "c1", {"A-1": _run("A", 1.0, 1.0, 1.0, 1.0)})
    second = _call_folder(tmp_path, "c2", {"A-1": _run("A", 0.5, 0.5, 0.5, 0.5)})
    document = json.loads((second / bench.RESULT_NAME).read_text())
    document["env"]["gpu"] = "NVIDIA H200"
    (second / bench.RESULT_NAME).write_text(json.dumps(document))
    with pytest.raises(SystemExit, match=r"c1 ran on x and .*c2 on NVIDIA H200: .*one card"):
        bench.main(["collect", str(first), str(second), "--out", str(tmp_path / "doc.json"), "--revision", "abc",
                    "--interleaved-sets"])


def test_a_tiles_arm_without_its_table_is_refused_before_any_run(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(bench.subprocess, "call", lambda *a, **k: started.append(a) or 0)
    with pytest.raises(ValueError, match="--matmul-tiles"):
        bench.main(["run", "--model", "m=/nowhere", "--arms", "A,J:tiles", "--out", str(tmp_path / "out")])
    assert started == []


def test_a_run_that_would_not_fit_the_budget_ends_the_call_so_the_order_stays_interleaved(tmp_path, monkeypatch):
    """A run too long for the time left is not skipped for a later, shorter one: that would run the arms out of their
    interleaved order (A J H A J H ...); the call stops there and the next call resumes at that run."""
    import json

    out = tmp_path / "out"
    out.mkdir()
    done = {"A-1": {**_run("A", 0.3, 0.3, 0.4, 0.2), "seconds": 100.0},
            "J-1": {**_run("J", 0.3, 0.3, 0.4, 0.2), "seconds": 5.0}}
    (out / bench.RESULT_NAME).write_text(json.dumps({"results": {"m": done}}))
    started = []
    monkeypatch.setattr(bench.subprocess, "call", lambda argv, **k: started.append(argv) or 1)
    monkeypatch.setattr(bench.arm_i_live, "_env", lambda: {})
    # H-1 has no finished run, so it is expected to take the longest run so far (100 s): more than the 50 s left
    assert bench.main(["run", "--model", "m=/nowhere", "--arms", "A,J,H", "--repeats", "2", "--budget-s", "50",
                       "--out", str(out)]) == 0
    assert started == []
    params = json.loads((out / bench.RESULT_NAME).read_text())["params"]
    assert params["skipped"] == ["m/H-1", "m/A-2", "m/J-2", "m/H-2"]
