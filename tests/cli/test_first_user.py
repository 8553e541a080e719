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
    from bloggap_plugin.commands.doctor import CPU_SCALE, DoctorConfig, _scaled_for

    config = DoctorConfig()
    assert _scaled_for(config, on_cpu=True) == (CPU_SCALE["rows"], CPU_SCALE["new_tokens"], CPU_SCALE["skip"])
    assert config.attn == ["sdpa"]
    said = capsys.readouterr().err
    assert "scaled down to --rows 16, --new-tokens 16, --attn sdpa" in said and "copy8_vs_alone" in said
    given = DoctorConfig(rows=8, new_tokens=4, attn=["eager"])
    assert _scaled_for(given, on_cpu=True) == (8, 4, ())
    assert capsys.readouterr().err == ""
    assert _scaled_for(DoctorConfig(), on_cpu=False) == (64, 64, ())


def test_the_recommendation_leads_with_the_arm_and_its_reason():
    from bloggap_plugin.measure.doctor_matrix import rerecommend

    text = rerecommend(json.loads(DOCTOR_JSON.read_text()))["recommendation"]["text"]
    lead, *details = text.splitlines()
    assert lead.startswith("arm H (fp16 everywhere") and len(lead) <= 160, lead
    assert details and all(line.startswith("  - ") for line in details)


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
