"""Friction a first user hits (issue 47, class 6): the README's two commands, the doctor's CPU default and its
recommendation's shape, YAML's `off`, did-you-mean for override typos, one option vocabulary, help with defaults,
and clear refusals for a JSON `report` cannot read, a folder or pipe as a recipe, an empty `--table-only` table."""

from __future__ import annotations

import json
import os
import re

import pytest
from _support import ROOT
from _support.cli import RECIPES

ARM_A = RECIPES / "arm_A.yaml"
DOCTOR_JSON = ROOT / "benchmarks" / "results" / "h200" / "doctor.json"


def test_the_readme_set_up_is_the_main_job_and_the_tests():
    text = (ROOT / "README.md").read_text()
    block = text.split("On a fresh machine", 1)[1].split("```", 2)[1]
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip().startswith("make")]
    assert commands == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo: setup$", makefile, re.M) and re.search(r"^test: setup$", makefile, re.M)
    assert ".venv/bin/bloggap" in text and ". .venv/bin/activate" in text


def test_the_doctor_scales_itself_down_on_a_cpu_and_says_so(capsys):
    from bloggap_plugin.commands.doctor import CPU_SCALE, DoctorConfig, _run_size

    size = _run_size(DoctorConfig(cpu_bf16="emulated"), on_cpu=True)
    assert (size.rows, size.new_tokens, size.attn, size.skip) == (8, 16, ["sdpa"], CPU_SCALE["skip"])
    assert size.sample_dtype == "fp32" and size.scaled and size.cpu_bf16 == {"native": False,
                                                                             "from": "--cpu-bf16 emulated"}
    said = capsys.readouterr().out
    assert said.count("\n") == 1 and said.startswith("scaled down for this CPU (--full: the GPU size")
    for part in ("8 rollouts (GPU 64)", "16 tokens per rollout (GPU 64)", "sdpa attention (GPU sdpa,eager)",
                 "without b1_vs_b8_right, b1_vs_b8_equal_nopad, copy8_vs_alone, two_groupings_b8",
                 "sampled in fp32 (bf16 emulated: --cpu-bf16 emulated)",
                 "fp16 and fp32 without rerun_b1 (bf16's control stands)"):
        assert part in said and part in size.scaled_down, part
    assert size.skip_beyond_bf16 == ("rerun_b1",)
    native = _run_size(DoctorConfig(cpu_bf16="native"), on_cpu=True)
    assert native.sample_dtype == "bf16" and not any("sampled" in part for part in native.scaled_down)
    capsys.readouterr()
    given = _run_size(DoctorConfig(rows=8, new_tokens=4, attn=["eager"], dtype="bf16", cpu_bf16="emulated"), True)
    assert (given.rows, given.new_tokens, given.attn, given.sample_dtype) == (8, 4, ["eager"], "bf16")
    assert given.scaled_down == (f"without {', '.join(CPU_SCALE['skip'])}",
                                 "fp16 and fp32 without rerun_b1 (bf16's control stands)")


def test_full_restores_the_gpu_size_on_a_cpu_and_the_gpu_is_not_scaled(capsys):
    from bloggap_plugin.commands.doctor import DoctorConfig, _run_size

    for size in (_run_size(DoctorConfig(full=True, cpu_bf16="emulated"), on_cpu=True),
                 _run_size(DoctorConfig(), on_cpu=False)):
        assert (size.rows, size.new_tokens, size.attn, size.skip) == (64, 64, ["sdpa", "eager"], ())
        assert (size.sample_dtype, size.scaled, size.scaled_down, size.skip_beyond_bf16) == ("bf16", False, (), ())
    assert _run_size(DoctorConfig(), on_cpu=False).cpu_bf16 is None
    assert capsys.readouterr().out == ""


def test_auto_reads_the_cpu_feature_flags(monkeypatch):
    import bloggap_plugin.envinfo as envinfo
    from bloggap_plugin.commands.doctor import DoctorConfig, _run_size

    for native in (True, False):
        monkeypatch.setattr(envinfo, "cpu_bf16_native", lambda native=native: (native, "flags read"))
        size = _run_size(DoctorConfig(), on_cpu=True)
        assert size.cpu_bf16 == {"native": native, "from": "flags read"}
        assert size.sample_dtype == ("bf16" if native else "fp32")


@pytest.mark.parametrize("text, expected", [
    ("flags\t\t: fpu sse2 avx2 avx512f\n", (False, "none of avx512_bf16, amx_bf16, bf16 in {}")),
    ("flags\t\t: fpu avx2 avx512f avx512_bf16\nflags\t\t: fpu avx2\n", (True, "avx512_bf16 in {}")),
    ("flags\t\t: fpu amx_bf16 amx_tile\n", (True, "amx_bf16 in {}")),
    ("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n", (True, "bf16 in {}")),
    ("processor\t: 0\n", (None, "{} lists no feature flags")),
])
def test_cpu_bf16_native_reads_the_feature_flags(tmp_path, text, expected):
    from bloggap_plugin.envinfo import cpu_bf16_native

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(text)
    assert cpu_bf16_native(cpuinfo) == (expected[0], expected[1].format(cpuinfo))
    assert cpu_bf16_native(tmp_path / "none") == (None, f"no {tmp_path / 'none'} to read the CPU's feature flags from")


def test_unquoted_kept_off_reads_as_off(tmp_path):
    from bloggap_plugin.recipes import load_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text("gap:\n  arm: A\n  kept: off\n")
    assert load_recipe(recipe)[1].kept == "off"


@pytest.mark.parametrize("settings, needle", [
    ({"gap_overrides": {"bnad": 0.2}}, "did you mean 'band'"),
    ({"extra_overrides": {"lerning_rate": 1e-6}}, "did you mean 'learning_rate'"),
])
def test_an_override_typo_gets_a_suggestion(tmp_path, settings, needle):
    from bloggap_plugin.recipes import RecipeError
    from bloggap_plugin.trl.run import prepare_run

    with pytest.raises(RecipeError, match=needle):
        prepare_run(str(ARM_A), model="tiny-random-qwen2", device="cpu", output_dir=str(tmp_path), **settings)


@pytest.mark.parametrize("command", ["doctor", "attribute", "ladder"])
def test_one_option_vocabulary_with_the_old_names_as_deprecated_aliases(command, capsys):
    from bloggap_plugin.cli import build_parser

    argv = [command, "--rows", "16", "--new-tokens", "5", "--dtype", "fp32"]
    args = build_parser(argv).parse_args(argv)
    assert (args.rows, args.new_tokens, args.dtype) == (16, 5, "fp32")
    old = [command, "--num-seqs", "16", "--max-new-tokens", "5"] + (["--sample-dtype", "fp32"] if command == "doctor"
                                                                    else [])
    args = build_parser(old).parse_args(old)
    assert (args.rows, args.new_tokens) == (16, 5)
    err = capsys.readouterr().err
    assert "--num-seqs is deprecated; use --rows" in err and "--max-new-tokens is deprecated" in err


def test_a_config_file_with_an_old_name_is_read_as_the_new(tmp_path, capsys):
    from bloggap_plugin.cli import _apply_config_file, build_parser

    path = tmp_path / "c.yaml"
    path.write_text("num_seqs: 12\n")
    argv = ["doctor", "--config", str(path)]
    parser = build_parser(argv)
    _apply_config_file(parser, argv)
    assert parser.parse_args(argv).rows == 12 and "num_seqs is deprecated" in capsys.readouterr().err


def test_report_help_shows_the_defaults(bloggap):
    code, out, _ = bloggap("report", "--help")
    assert code == 0 and "(default: benchmarks/results)" in " ".join(out.split())


def test_report_names_a_ladder_json_in_one_line(bloggap, tmp_path):
    folder = tmp_path / "results" / "cpu"
    folder.mkdir(parents=True)
    (folder / "ladder.json").write_text(json.dumps({"command": "ladder", "schema_version": 1, "env": {}, "params": {},
                                                    "results": {}, "tables": []}))
    code, _, err = bloggap("report", "--results", tmp_path / "results", "--output", tmp_path / "B.md", "--no-plots",
                           "--readme", "none")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "`bloggap ladder --json`" in err, err


def test_a_folder_or_a_pipe_as_a_recipe_is_named_as_such(tmp_path):
    from bloggap_plugin.recipes import RecipeError, load_recipe

    with pytest.raises(RecipeError, match="is a folder"):
        load_recipe(tmp_path)
    pipe = tmp_path / "p.yaml"
    os.mkfifo(pipe)
    with pytest.raises(RecipeError, match="not a regular file"):
        load_recipe(pipe)
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "none.yaml")


def test_an_empty_table_only_table_exits_non_zero(bloggap, tmp_path):
    code, _, err = bloggap("compare", ARM_A, "--table-only", "--output-dir", tmp_path / "o")
    assert code == 2 and "no finished run" in err and len(err.strip().splitlines()) == 1


def _doctor(tmp_path, capsys, *flags) -> tuple[str, dict]:
    from bloggap_plugin.cli import main

    path = tmp_path / "doctor.json"
    assert main(["doctor", "--model", "tiny-random-llama", "--device", "cpu", "--json", str(path), "--no-progress",
                 "--cpu-bf16", "emulated", *flags]) == 0
    return capsys.readouterr().out, json.loads(path.read_text())


def test_a_default_cpu_run_says_and_records_what_it_scaled_down_and_times_its_phases(tmp_path, capsys, monkeypatch):
    import torch

    import bloggap_plugin.measure.rollouts as rollouts

    threads, sample = [], rollouts.sample_rollouts
    monkeypatch.setattr(rollouts, "sample_rollouts", lambda *a, **k: threads.append(torch.get_num_threads()) or
                        sample(*a, **k))
    before = torch.get_num_threads()
    out, result = _doctor(tmp_path, capsys, "--timings")
    assert threads == [1] and result["params"]["sample_threads"] == 1 and torch.get_num_threads() == before
    first, *_ = out.splitlines()
    assert first == "scaled down for this CPU (--full: the GPU size, slow here): " + "; ".join(
        result["params"]["scaled_down"])
    assert "sampled in fp32 (bf16 emulated: --cpu-bf16 emulated)" in result["params"]["scaled_down"]
    assert (result["rows"], result["max_new_tokens"], result["params"]["sample_dtype"]) == (8, 16, "fp32")
    assert result["sampler"]["dtype"] == "float32"
    timings = result["timings"]
    names = [p["phase"] for p in timings["phases"]]
    assert names[:3] == ["start (imports, checks)", "load fp32 (sampler)", "sampling (fp32)"]
    assert names[3:6] == ["load bf16", "score bf16/sdpa b1", "score bf16/sdpa rerun_b1"]
    assert "score fp16/sdpa b1 + fp16 check" in names and names[-1] == "paired cells, recommendation"
    # fp16 and fp32 without their rerun control on a CPU: bf16's stands, and their cells say they were left out
    assert not [n for n in names if n.endswith("rerun_b1") and not n.startswith("score bf16")]
    reruns = {c["dtype"]: c for c in result["cells"] if c["comparison"] == "rerun_b1"}
    assert "skipped" not in reruns["bf16"] and reruns["fp16"].get("skipped") and reruns["fp32"].get("skipped")
    for key in ("wall_s", "cpu_s"):  # consecutive phases: they add up to the run (each rounded to 1 ms)
        assert abs(sum(p[key] for p in timings["phases"]) - timings[key]) <= 0.001 * len(names)
        assert all(p[key] >= 0 for p in timings["phases"])
    assert timings["cpus"] == os.cpu_count() and "phases (" in out and f"  {'total':<44}" in out
    assert out.rstrip().splitlines()[-2].startswith(f"({timings['wall_s']:.0f} s wall, {timings['cpu_s']:.0f} s CPU")
    lead = out.split("\nrecommendation: ", 1)[1].splitlines()[0]
    assert lead.startswith(f"arm {result['recommendation']['arm']} ") and len(lead) <= 160, lead


def test_full_measures_every_comparison_on_every_row_sampled_in_bf16(tmp_path, capsys):
    out, result = _doctor(tmp_path, capsys, "--full", "--rows", "16", "--new-tokens", "2", "--attn", "sdpa")
    assert not out.startswith("scaled down") and result["params"]["scaled_down"] == []
    assert result["params"]["sample_dtype"] == "bf16" and result["params"]["rows_per_dtype"] == {
        "bf16": 16, "fp16": 16, "fp32": 16}
    skipped = {(c["dtype"], c["comparison"]) for c in result["cells"] if c.get("skipped")}
    assert skipped == {(d, n) for d in ("bf16", "fp16", "fp32") for n in ("b1_vs_b32_left_arange",
                                                                          "b1_vs_b32_left_mask")}


@pytest.mark.parametrize("cells, arm", [
    ("h200", "arm H (fp16 everywhere"),
    ("cpu_fp16_unsafe", "arm B (fp32 shadow copy)"),
])
def test_the_recommendation_leads_with_the_arm_in_one_short_line(cells, arm):
    from bloggap_plugin.measure.doctor_matrix import rerecommend

    path = DOCTOR_JSON if cells == "h200" else ROOT / "benchmarks" / "results" / "cpu" / "doctor_gemma3-270m.json"
    lead, *details = rerecommend(json.loads(path.read_text()))["recommendation"]["text"].splitlines()
    assert lead.startswith(arm) and len(lead) <= 160, lead
    assert details and all(line.startswith("  - ") for line in details)
