"""benchmarks.arm_i --smoke: the GPU script's trainer side on CPU without vLLM (the lead runs the GPU phases)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _support import ROOT

from bloggap_plugin.results import ResultDocument, validate_result


def _script():
    import benchmarks.arm_i

    return benchmarks.arm_i


def test_smoke_scores_every_step_and_records_the_refused_pieces(tmp_path):
    script = _script()
    script.main(["--smoke", "--out", str(tmp_path), "--prompts", "4", "--tokens", "4"])
    doc = ResultDocument.read(tmp_path / "arm_i.json")
    rows = doc.results["rows"]
    hf_rows = ["HF forward, bf16 weights, sdpa (padded)", "HF forward, bf16 weights, vLLM FA via AttentionInterface"]
    assert [r["scorer"] for r in rows] == ["arm A (TRL's pass)", *hf_rows] + [label for label, _ in script.STEPS]
    assert rows[0]["x_arm_a"] == 1 and rows[0]["tokens"] == 16 and "kernels" not in rows[0]
    assert 0 <= rows[0]["b1_vs_b8_bitwise_pct"] <= 100
    assert len(doc.tables[0]["rows"]) == len(rows) and doc.tables[0]["columns"] == script.COLUMNS
    measured = {r["pieces"]: r for r in rows[1:] if "refused" not in r}
    assert list(measured) == ["hf forward, attention=sdpa", "hf", "hf,rope=torch", "hf,rope=torch,norm=torch", "torch"]
    for row in measured.values():
        assert 0 <= row["oob_pct"] <= 100 and 0 <= row["bitwise_pct"] <= 100 and row["x_arm_a"] > 0
        assert 0 <= row["abs_dlogp_mean"] <= row["abs_dlogp_max"] and row["kernels"] == "torch"
        assert row["bytes_added"] > 0 and row["sync_s"] >= 0 and 0 <= row["b1_vs_b8_bitwise_pct"] <= 100
    # without batch invariance vLLM's norms round where HF's do: the norm step changes no number
    assert measured["hf,rope=torch,norm=torch"]["abs_dlogp_max"] == measured["hf,rope=torch"]["abs_dlogp_max"]
    refused = [r for r in rows[1:] if "refused" in r]
    assert [r["pieces"] for r in refused] == ["hf forward, attention=vllm_fa", *(p for _, p in script.STEPS[4:])]
    assert all("the plan runs on cpu" in r["refused"] and "gap.i_pieces: torch" in r["refused"] for r in refused)


def test_all_records_a_failed_phase_with_its_log_and_keeps_a_valid_document(tmp_path, spawns):
    """Where a phase cannot run (here: no vLLM, no GPU), ``all`` records its exit code and log tail under
    ``results.errors`` and the document stays valid, so the lead's one call always returns something readable."""
    script = _script()
    script.main(["all", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path), "--budget-s", "120"])
    doc = ResultDocument.read(tmp_path / "arm_i.json")
    errors = doc.results["errors"]
    assert set(errors) == {"colocated", "scoped"} and all(e["code"] != 0 for e in errors.values())
    assert any("vllm" in line for line in errors["colocated"]["log_tail"])
    assert any("gen.pt" in line for line in errors["scoped"]["log_tail"])
    assert doc.results["rows"] == [] and doc.params["steps"][0] == ["I0 bf16 weights, packed tokens, HF maths", "hf"]


def test_rope_diagnostic_compares_values_not_layouts():
    """On the H200 the colocated phase read HF's RoPE cos 0.23 away from vLLM's cache. Without vLLM's process-wide
    bmm override (here, CPU) the diagnostic must read at most one bf16 step near 1 (2^-8) for the cos and fp32
    rounding for the angles (TF32 inputs would be off by up to ~0.25 rad at position 511), so a large value on the
    GPU is the override's, not a layout mismatch (HF's duplicated halves against vLLM's cos|sin cache)."""
    import torch

    from bloggap_plugin.models import _load_tiny

    model, _ = _load_tiny("tiny-random-llama", torch.float32)
    diagnostics = _script()._rope_diagnostics(model, torch.device("cpu"))
    assert diagnostics["hf_rope_cos_vs_vllm_cache_max_abs"] <= 2.0 ** -8
    assert diagnostics["fp32_bmm_rope_angle_max_abs_err"] <= 1e-4


def _live_script():
    import benchmarks.arm_i_live

    return benchmarks.arm_i_live


def test_arm_i_live_document_rebuilds_the_committed_results_from_their_run_logs(tmp_path):
    """``arm_i_live.py document`` recomputes every row of the committed T16-armI-live results from the packed JSONL
    logs: the files say what the logs hold. The sampler columns are recomputed here by hand as well."""
    import json
    import shutil
    import statistics
    import tarfile

    script = _live_script()
    results = ROOT / "benchmarks" / "results" / "h200"
    for name, logs in (("arm_i_live.json", "runs_final.tar.xz"),
                       ("arm_j_live.json", "runs_arm_j.tar.xz"),
                       ("arm_j_live_616bb98.json", "runs_arm_j_616bb98.tar.xz"),
                       ("arm_j_live_75f9295.json", "runs_arm_j_75f9295.tar.xz"),
                       ("arm_j_live_755f947.json", "runs_arm_j_755f947.tar.xz"),
                       ("arm_j_live_656713e.json", "runs_arm_j_656713e.tar.xz"),
                       ("arm_j_live_eager.json", "runs_arm_j_eager.tar.xz"),
                       ("arm_j_live_loop_backward.json", "runs_arm_j_loop_backward.tar.xz"),
                       ("arm_i_live_two_passes.json", "runs_two_passes.tar.xz"),
                       ("arm_i_live_rows_per_forward.json", "runs_rows_per_forward.tar.xz"),
                       ("arm_i_live_prompt_first.json", "runs_prompt_first.tar.xz"),
                       ("arm_i_live_v2_sampler.json", "runs_v2_sampler.tar.xz"),
                       ("arm_i_live_log_softmax.json", "runs_log_softmax.tar.xz"),
                       ("arm_i_live_packed_attention.json", "runs_packed_attention.tar.xz")):
        copy = tmp_path / name
        shutil.copy(results / name, copy)
        assert script.main(["document", str(copy), "--logs", str(results / "arm_i_live" / logs)]) == 0
        assert json.loads(copy.read_text()) == json.loads((results / name).read_text())
        ResultDocument.read(copy)
        with tarfile.open(results / "arm_i_live" / logs, "r:xz") as tar:
            packed = set(tar.getnames())
            for label, row in json.loads(copy.read_text())["results"].items():
                if f"{label}.jsonl" not in packed:  # a run whose log did not come back: its row says so
                    assert "JSONL not kept" in row["note"]
                    continue
                text = tar.extractfile(f"{label}.jsonl").read().decode()
                records = [json.loads(line) for line in text.splitlines()]
                sampler = [r["gap/sampler/oob_frac"] for r in records if r.get("gap/sampler/oob_frac") is not None]
                assert row["generations"] == len(sampler) and row["steps"] == len(records)
                assert row["sampler_oob_mean"] == statistics.fmean(sampler[1:])
                assert row["sampler_oob_max"] == max(sampler[1:])


def _synthetic_run(arm: str, split: bool = False) -> list[dict]:
    """24 steps, odd steps generating (num_iterations 2), with numbers chosen so that every T16-armJ-live cell has
    one hand-computed value (see the test below). ``split``: the second iterations' ratio under gap/update/* as the
    plugin logs it now; else under gap/ratio/* as in logs written before the split (the committed ones)."""
    records = []
    for step in range(1, 25):
        generating = step % 2 == 1
        record = {"step": step, "grad_norm": float(step) if arm == "A" else 2.0 * step}
        if arm == "A":
            record["step_time"] = 9.0 if step == 1 else 1.0 if generating else 0.5 if step <= 12 else 0.7
        else:
            record["step_time"] = 20.0 if step == 1 else 3.0 if generating else 1.25
        if generating:
            record["reward"] = (0.0 if step in (1, 3) else 0.5) if arm == "A" else 0.25
            record["gap/sampler/oob_frac"] = (0.5 if step == 1 else 0.02) if arm == "A" else 0.0
            record["gap/sampler/exact_frac"] = 0.0 if arm == "A" else 1.0
            record["gap/ratio/exact_frac"] = 0.5 if (arm == "A" and step == 3) else 1.0
            record["gap/ratio/oob_frac"] = 0.0
        else:
            record["gap/update/exact_frac" if split else "gap/ratio/exact_frac"] = 0.0 if arm == "A" else 0.01
        records.append(record)
    return records


@pytest.mark.parametrize("split", [False, True], ids=["logs-before-the-split", "gap-and-update-apart"])
def test_arm_j_live_table_from_synthetic_logs(split):
    """T16-armJ-live: per run, the sampler, the exact ratio at each iteration, the step times and their ratio to arm
    A's run, reward and grad_norm, all from the JSONL records (hand-computed values for fixed records); the same
    table from logs with the second iteration under gap/update/* and from older logs with it under gap/ratio/*."""
    script = _live_script()
    rows = {label: script.summarize(label, _synthetic_run(label.split("_")[1], split))
            for label in ("train_A_ni2", "train_J_ni2")}
    doc = script.document(rows, {}, {})
    assert [t["id"] for t in doc["tables"]] == ["T16-armI-live", "T16-armJ-live"]
    table = doc["tables"][1]
    assert table == json.loads(json.dumps(table))  # plain JSON
    assert table["columns"] == script.ONPOLICY_COLUMNS
    cells = [dict(zip(table["columns"], row)) for row in table["rows"]]
    a, j = cells
    # A: all steps after step 1 are 6 x 0.5, 6 x 0.7 and 11 x 1.0 s (median 0.7, mean 18.2 / 23); generating 1.0;
    # the others 0.6
    assert a == {"run": "train_A_ni2", "arm": "A", "steps": 24, "sampler oob % (mean)": 2.0,
                 "sampler bit-identical % (mean)": 0.0, "ratio exact_frac, first iteration (min)": 0.5,
                 "ratio exact_frac, first iteration (mean)": 0.9583, "ratio exact_frac, second iteration (mean)": 0.0,
                 "step s (median, after step 1)": 0.7, "step x arm A": 1.0, "step s (mean, after step 1)": 0.791,
                 "mean step x arm A": 1.0, "generating step s (median)": 1.0,
                 "generating step x arm A": 1.0, "other step s (median)": 0.6, "other step x arm A": 1.0,
                 "reward (mean)": 0.4167, "reward (mean, last 20 steps)": 0.5, "grad_norm (median)": 12.5}
    # J: 12 x 1.25 and 11 x 3.0 s after step 1 (median 1.25, / 0.7; mean 48 / 23, / (18.2 / 23) = 48 / 18.2);
    # generating 3.0 / 1.0; others 1.25 / 0.6
    assert j == {"run": "train_J_ni2", "arm": "J", "steps": 24, "sampler oob % (mean)": 0.0,
                 "sampler bit-identical % (mean)": 100.0, "ratio exact_frac, first iteration (min)": 1.0,
                 "ratio exact_frac, first iteration (mean)": 1.0, "ratio exact_frac, second iteration (mean)": 0.01,
                 "step s (median, after step 1)": 1.25, "step x arm A": 1.786, "step s (mean, after step 1)": 2.087,
                 "mean step x arm A": 2.637, "generating step s (median)": 3.0,
                 "generating step x arm A": 3.0, "other step s (median)": 1.25, "other step x arm A": 2.083,
                 "reward (mean)": 0.25, "reward (mean, last 20 steps)": 0.25, "grad_norm (median)": 25.0}
    assert "train_A_ni2" in table["notes"]
    validate_result(json.loads(json.dumps(doc)), "arm_j_live.json")  # what `bloggap report` reads (plot hint included)
    # a second arm J row with num_iterations 1 (every step generates): its generating step against A's, but not its
    # median over all steps (A's mixes generating and other steps), and no other steps
    rows["callback_J_ni1"] = script.summarize("callback_J_ni1", [
        {**r, "gap/sampler/oob_frac": 0.0, "step_time": r["step_time"] if r["step"] == 1 else 3.0}
        for r in _synthetic_run("J")])
    table = script.document(rows, {}, {})["tables"][1]
    cells = {row[0]: dict(zip(table["columns"], row)) for row in table["rows"]}
    assert list(cells) == ["train_A_ni2", "train_J_ni2", "callback_J_ni1"] and cells["train_J_ni2"] == j
    ni1 = cells["callback_J_ni1"]
    assert ni1["step s (median, after step 1)"] == 3.0 and ni1["step x arm A"] is None
    assert ni1["step s (mean, after step 1)"] == 3.0 and ni1["mean step x arm A"] is None
    assert ni1["generating step s (median)"] == 3.0 and ni1["generating step x arm A"] == 3.0
    assert ni1["other step s (median)"] is None and ni1["other step x arm A"] is None
    # without an arm J row there is nothing to show: one table; without an arm A row, arm J's own numbers and no
    # multiples
    alone = script.document({"train_J_ni2": rows["train_J_ni2"]}, {}, {})["tables"]
    assert [t["id"] for t in alone] == ["T16-armI-live", "T16-armJ-live"]
    cells = dict(zip(alone[1]["columns"], alone[1]["rows"][0]))
    assert {k: v for k, v in cells.items() if "x arm A" not in k} == {k: v for k, v in j.items() if "x arm A" not in k}
    assert all(v is None for k, v in cells.items() if "x arm A" in k) and "there is none here" in alone[1]["notes"]
    assert alone[1]["plot"] is False  # nothing to plot: the multiples are empty
    assert [t["id"] for t in script.document({"train_A_ni2": rows["train_A_ni2"]}, {}, {})["tables"]] == [
        "T16-armI-live"]


def test_arm_i_live_labels_and_command_lines():
    script = _live_script()
    assert script.parse_label("callback_I_ni1") == {"entry": "callback", "arm": "I", "num_iterations": 1}
    assert script.parse_label("train_I_ni2_b16") == {"entry": "train", "arm": "I", "num_iterations": 2,
                                                     "per_device_train_batch_size": 16}
    for bad in ("train_I", "serve_I_ni2", "train_I_2", "train_I_ni2_16"):
        try:
            script.parse_label(bad)
        except ValueError as err:
            assert "ENTRY_ARM_ni<K>" in str(err)
        else:
            raise AssertionError(bad)
    argv = script.train_argv("train_I_ni2", "M", 30, Path("x.jsonl"), 0.25)
    assert argv[1:5] == ["-m", "bloggap_plugin.cli", "train", "recipes/arm_I.yaml"]
    assert argv[argv.index("--vllm_mode") + 1] == "colocate" and argv[argv.index("--num_iterations") + 1] == "2"
    assert script.train_argv("callback_A_ni1", "M", 30, Path("x.jsonl"), 0.25)[1:4] == ["-m", "benchmarks.arm_i_live",
                                                                                       "callback"]
    for label in ("train_I_ni2_b16", "callback_I_ni2_b16"):  # a generation of 32 completions (gradient accumulation 2)
        argv = script.train_argv(label, "M", 30, Path("x.jsonl"), 0.25)
        assert argv[argv.index("--per_device_train_batch_size") + 1] == "16"
    assert "--per_device_train_batch_size" not in script.train_argv("train_I_ni2", "M", 30, Path("x.jsonl"), 0.25)
    # _graphs: the engine launches decode steps from CUDA graphs (gap.vllm_launch: decode_graphs), either entry;
    # _eager: one launch per kernel (gap.vllm_launch: eager); neither: the recipe's default (auto: decode graphs)
    assert script.parse_label("train_J_ni2_b16_graphs") == {"entry": "train", "arm": "J", "num_iterations": 2,
                                                           "per_device_train_batch_size": 16,
                                                           "vllm_launch": "decode_graphs"}
    assert script.parse_label("callback_I_ni2_b16_eager") == {"entry": "callback", "arm": "I", "num_iterations": 2,
                                                             "per_device_train_batch_size": 16,
                                                             "vllm_launch": "eager"}
    assert script.parse_label("train_J_ni2_eager") == {"entry": "train", "arm": "J", "num_iterations": 2,
                                                       "vllm_launch": "eager"}
    assert script.parse_label("train_J_ni2") == {"entry": "train", "arm": "J", "num_iterations": 2}
    argv = script.train_argv("train_J_ni2_graphs", "M", 30, Path("x.jsonl"), 0.25)
    assert argv[argv.index("--gap_overrides") + 1] == "{vllm_launch: decode_graphs}"
    argv = script.train_argv("train_J_ni2_eager", "M", 30, Path("x.jsonl"), 0.25)
    assert argv[argv.index("--gap_overrides") + 1] == "{vllm_launch: eager}"
    argv = script.train_argv("callback_I_ni1_graphs", "M", 30, Path("x.jsonl"), 0.25)
    assert argv[argv.index("--vllm_launch") + 1] == "decode_graphs"
    argv = script.train_argv("callback_I_ni1_eager", "M", 30, Path("x.jsonl"), 0.25)
    assert argv[argv.index("--vllm_launch") + 1] == "eager"
    for label in ("train_J_ni2", "callback_J_ni2"):  # the recipe's default: no launch on the command line
        argv = script.train_argv(label, "M", 30, Path("x.jsonl"), 0.25)
        assert "--gap_overrides" not in argv and "--vllm_launch" not in argv
    # --profile-steps: a callback run profiles those steps into LABEL.profile.txt; the CLI's train runs take none
    argv = script.train_argv("callback_J_ni2", "M", 30, Path("o/callback_J_ni2.jsonl"), 0.25, "10-11")
    assert argv[argv.index("--profile") + 1] == str(Path("o/callback_J_ni2.profile.txt"))
    assert argv[argv.index("--profile-steps") + 1] == "10-11"
    assert "--profile" not in script.train_argv("train_J_ni2", "M", 30, Path("x.jsonl"), 0.25, "10-11")
    assert "--profile-shapes" not in argv
    argv = script.train_argv("callback_J_ni2", "M", 30, Path("x.jsonl"), 0.25, "10-11", profile_shapes=True)
    assert argv[argv.index("--profile-steps") + 2] == "--profile-shapes"
    assert script._step_range("10-11") == (10, 11) and script._step_range("7") == (7, 7)
    for bad in ("train_I_ni2_graph", "train_I_ni2_graphs_b16", "train_I_ni2_b16_b8", "train_I_ni2_eager_graphs",
                "train_I_ni2_graphs_eager", "train_I_ni2_auto", "train_I_ni2_eager_b16"):
        with pytest.raises(ValueError, match=r"ENTRY_ARM_ni<K>\[_b<N>\]\[_graphs\|_eager\]"):
            script.parse_label(bad)
    for other_arm in ("train_A_ni2_graphs", "callback_H_ni1_eager"):  # a launch only arms I and J have
        with pytest.raises(ValueError, match=r"a launch suffix .* only for arms I and J"):
            script.parse_label(other_arm)


def test_arm_i_engine_table_is_built_from_its_results():
    """T16-armI-engine in the committed document is what ``table`` builds from its ``results``, and it holds the
    comparison that located the chunked-prefill defect: the same eager engine at TRL's 4096 tokens per step and with
    every prompt prefilled in one step (arm I bit-identical only in the latter)."""
    import json

    import benchmarks.arm_i_engine as script

    doc = json.loads((ROOT / "benchmarks" / "results" / "h200" / "arm_i_engine.json").read_text())
    ResultDocument.read(ROOT / "benchmarks" / "results" / "h200" / "arm_i_engine.json")
    assert doc["tables"] == [json.loads(json.dumps(script.table(doc["results"])))]
    results = doc["results"]
    assert results["eager_one_prefill"]["arm_i"]["bitwise_pct"] == 100.0
    assert results["eager"]["arm_i"]["bitwise_pct"] < 60.0
    assert results["eager"]["engine_kwargs"] == {k: v for k, v in script.VARIANTS["eager"].items()}
    # route 1 under the same condition: the compiled engine with every custom op and one-step prefill
    assert results["compiled_kernels_one_prefill"]["engine_kwargs"] == script.VARIANTS["compiled_kernels_one_prefill"]
    # the eager engine's kernels launched from full decode CUDA graphs: arm I bit-identical again
    assert results["graphs_one_prefill"]["engine_kwargs"] == script.VARIANTS["graphs_one_prefill"]
    assert results["graphs_one_prefill"]["arm_i"]["bitwise_pct"] == 100.0
    assert {v: e["revision"] for v, e in results.items()} == {
        "eager": "d49905d", "compiled_kernels": "d49905d", "compiled_kernels_prefix_cache": "d49905d",
        "compiled": "d49905d", "eager_one_prefill": "2169212", "compiled_kernels_one_prefill": "24e5d62",
        "graphs_one_prefill": "b01b450"}


def _engine_entry(**extra) -> dict:
    gap = {"oob_pct": 1.0, "abs_dlogp_mean": 0.1, "abs_dlogp_max": 0.5, "bitwise_pct": 50.0, "tokens": 4,
           "pass_s": 0.1}
    return {"engine_kwargs": {"enforce_eager": True}, "engine_start_s": 1.0, "generate_s": 0.5, "engine": gap,
            "arm_i": gap, "arm_a": gap, **extra}


def test_arm_i_engine_collect_keeps_an_entrys_revision_where_its_part_names_none(tmp_path):
    """``collect`` stamps each variant with its part's ``params.revision``; a part without one (the committed
    document itself, whose entries carry their own, or a call run without ``--revision``) keeps each entry's own
    instead of overwriting it with null."""
    import benchmarks.arm_i_engine as script

    params = {"model": "<SmolLM2 dense folder>", "prompts": 4}
    committed = {"benchmark": "arm_i_engine", "schema_version": 1, "env": {"gpu": "X"}, "params": params,
                 "results": {"eager": _engine_entry(revision="aaa"), "compiled": _engine_entry(revision="bbb")},
                 "tables": []}
    new = {"benchmark": "arm_i_engine", "schema_version": 1, "env": {"gpu": "Y"}, "params": {**params,
           "revision": "ccc"}, "results": {"compiled_kernels": _engine_entry()}, "errors": {}}
    unstamped = {**new, "params": {**params, "revision": None}, "results": {"eager_one_prefill": _engine_entry()}}
    for name, doc in (("committed", committed), ("new", new), ("unstamped", unstamped)):
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    result = tmp_path / "merged.json"
    script.main(["collect", str(result), *(f"--part={tmp_path / n}.json" for n in ("committed", "new", "unstamped"))])
    merged = json.loads(result.read_text())
    assert {v: e.get("revision") for v, e in merged["results"].items()} == {
        "eager": "aaa", "compiled": "bbb", "compiled_kernels": "ccc", "eager_one_prefill": None}
    assert merged["env"] == {"gpu": "X"} and "revision" not in merged["params"]
    assert [row[-1] for row in merged["tables"][0]["rows"]] == ["aaa", "bbb", "ccc", None]


def test_arm_i_live_exports_the_vllm_form_arms_variables_for_callback_runs_only():
    """Arms I and J as the user's own script (callback) run with VLLM_BATCH_INVARIANT=1 and IEEE fp32 Triton dots,
    as its user exports them; train runs get neither whatever the caller's environment holds (bloggap train sets
    what the arm needs), and nor does any other arm."""
    script = _live_script()
    caller = {"PATH": "/bin", "VLLM_BATCH_INVARIANT": "1", "TRITON_F32_DEFAULT": "tf32"}
    for label in ("callback_I_ni2", "callback_J_ni1"):
        env = script.run_env(label, caller)
        assert env["VLLM_BATCH_INVARIANT"] == "1" and env["TRITON_F32_DEFAULT"] == "ieee" and env["PATH"] == "/bin"
    for label in ("train_A_ni2", "train_I_ni2", "train_J_ni2_b16", "callback_A_ni2"):
        env = script.run_env(label, caller)
        assert "VLLM_BATCH_INVARIANT" not in env and "TRITON_F32_DEFAULT" not in env and env["PATH"] == "/bin"


def test_arm_i_live_collect_takes_a_later_folders_run_for_the_row_and_the_pack(tmp_path):
    """``collect --runs EARLY --runs LATE``: a label in both folders gets LATE's row and LATE's logs in the pack,
    each file once (an earlier call's run of the same label is not packed beside it)."""
    import tarfile

    script = _live_script()
    early, late = tmp_path / "early", tmp_path / "late"
    for folder, arms in ((early, ("A", "J")), (late, ("J",))):
        folder.mkdir()
        for arm in arms:
            records = _synthetic_run(arm)
            if folder is late:
                records = records[:12]
            (folder / f"train_{arm}_ni2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            (folder / f"train_{arm}_ni2.log").write_text(f"{folder.name} /tmp/vx/smollm2\n")
    env = tmp_path / "run.json"
    env.write_text(json.dumps({"env": {"gpu": "X"}, "params": {"memory": 0.25}, "results": {}}))
    result, pack = tmp_path / "live.json", tmp_path / "runs.tar.xz"
    assert script.main(["collect", str(result), "--runs", str(early), "--runs", str(late), "--env", str(env),
                        "--revision", "abc", "--pack", str(pack)]) == 0
    rows = json.loads(result.read_text())["results"]
    assert list(rows) == ["train_A_ni2", "train_J_ni2"] and rows["train_J_ni2"]["steps"] == 12
    with tarfile.open(pack, "r:xz") as tar:
        names = tar.getnames()
        assert sorted(names) == ["train_A_ni2.jsonl", "train_A_ni2.log", "train_J_ni2.jsonl", "train_J_ni2.log"]
        assert tar.extractfile("train_J_ni2.log").read().decode() == "late <SmolLM2 dense folder>\n"
        assert len(tar.extractfile("train_J_ni2.jsonl").read().decode().splitlines()) == 12
