"""The ``bloggap`` commands' arguments and errors: every setting is a flag with its help text (``--help``), the
config dataclasses keep the flags' meanings, ``--config FILE.yaml`` sets fields, and ``bloggap doctor``
end to end (measuring, ``--json``, ``--from-json``)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from _support.events import HANG_S

from bloggap_plugin import cli
from bloggap_plugin.commands.attribute import AttributeConfig
from bloggap_plugin.commands.doctor import DoctorConfig
from bloggap_plugin.commands.ladder import LadderConfig

CONFIGS = {"doctor": DoctorConfig, "attribute": AttributeConfig, "ladder": LadderConfig}


def _no_model(*args, **kwargs):
    raise AssertionError("a model was loaded before the bad input was reported")


@pytest.fixture
def bloggap(monkeypatch, capsys):
    """Run ``bloggap ARGS`` with model loading forbidden; return ``(exit code, stdout, stderr)``."""
    import bloggap_plugin.models as models

    monkeypatch.setattr(models, "load_model", _no_model)

    def run(*argv) -> tuple[int, str, str]:
        code = cli.main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def _parse(command: str, *argv: str):
    from bloggap_plugin.commands._config import config_from_args

    return config_from_args(CONFIGS[command], cli.build_parser().parse_args([command, *argv]))


def _one_line_error(result, *needles: str) -> None:
    code, out, err = result
    assert code == 2 and "Traceback" not in err + out, (code, out, err)
    (line,) = err.strip().splitlines()
    assert line.startswith("bloggap: error: ")
    for needle in needles:
        assert needle in line, (needle, line)


# ---------------------------------------------------------------- --help and the config dataclasses


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_help_lists_every_field_with_its_help_text(command, capsys):
    assert cli.main([command, "--help"]) == 0  # argparse's exit becomes main's return code
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    fields = dataclasses.fields(CONFIGS[command])
    assert len(fields) >= 10
    for field in fields:
        assert f"--{field.name}" in text, field.name
        if "_" in field.name:
            assert f"--{field.name.replace('_', '-')}" in text, field.name  # today's spelling still works
        help_text = " ".join(field.metadata["help"].split())
        assert help_text in text, (field.name, help_text)
    assert "--config FILE.yaml" in text


def test_doctor_defaults_and_flags_keep_their_meaning():
    config = _parse("doctor")
    assert config == DoctorConfig(dtypes=["bf16", "fp16", "fp32"], attn=None)  # None: sdpa,eager (GPU), sdpa (CPU)
    config = _parse("doctor", "--dtypes", "bf16,fp32", "--attn", "eager", "--num-seqs", "5", "--json", "x.json",
                    "--no-progress", "--from-json", "old.json", "--sample-dtype", "fp32", "--band", "0.2")
    assert (config.dtypes, config.attn, config.rows, config.json_path, config.no_progress, config.from_json,
            config.dtype, config.band) == (["bf16", "fp32"], ["eager"], 5, "x.json", True, "old.json",
                                                  "fp32", 0.2)


def test_attribute_and_ladder_flags_keep_their_meaning():
    assert _parse("attribute").json is None and _parse("attribute", "--json").json == "-"  # bare --json: stdout
    config = _parse("attribute", "--json", "a.json", "--k", "3", "--new-tokens", "7", "--dtype", "fp16")
    assert (config.json, config.k, config.new_tokens, config.dtype, config.seed) == ("a.json", 3, 7, "fp16", 4321)
    config = _parse("ladder", "--k", "2", "4", "--fp16", "on", "--calibration-rows", "8", "--positions", "arange")
    assert (config.k, config.fp16, config.calibration_rows, config.positions, config.seed) == ([2, 4], "on", 8,
                                                                                               "arange", 1234)
    assert _parse("ladder").k is None and _parse("ladder").rows is None


@pytest.mark.parametrize(("command", "argv"), [
    ("doctor", ["--dtypes", "bf8"]),
    ("doctor", ["--attn", "flash"]),
    ("doctor", ["--dtype", "int8"]),
    ("attribute", ["--dtype", "fp8"]),
    ("ladder", ["--dtype", "fp16"]),
    ("ladder", ["--fp16", "maybe"]),
    ("ladder", ["--positions", "random"]),
    ("ladder", ["--k", "two"]),
])
def test_bad_choices_are_refused_by_the_parser(command, argv, capsys):
    assert cli.main([command, *argv]) == 2
    err = capsys.readouterr().err
    assert f"argument --{argv[0].lstrip('-').replace('-', '_')}" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and f"bloggap {command} --help" in err  # one line, no usage block


def test_doctor_cli_bad_arguments(capsys):
    from bloggap_plugin.cli import main

    assert main(["doctor", "--dtypes", "bf8"]) == 2
    assert "comma-separated subset" in capsys.readouterr().err
    assert main(["doctor", "--model", "no-such-model", "--no-progress"]) == 2
    assert "accepted" in capsys.readouterr().err


# ---------------------------------------------------------------- --config FILE.yaml


def test_config_file_sets_doctor_fields_and_their_checks_apply(bloggap, tmp_path):
    config = tmp_path / "doctor.yaml"
    config.write_text("model: tiny-random-llama\ndevice: cpu\nrows: 0\n")
    _one_line_error(bloggap("doctor", "--config", config), "--rows 0: must be >= 1")
    config.write_text("band: 1.5\n")
    _one_line_error(bloggap("doctor", "--config", config, "--device", "cpu"), "--band 1.5: must be in (0, 1)")
    # the command line wins over the file
    config.write_text("rows: 0\n")
    _one_line_error(bloggap("doctor", "--config", config, "--rows", "-2", "--device", "cpu"), "--rows -2")


def test_config_file_for_ladder_and_attribute(bloggap, tmp_path):
    config = tmp_path / "ladder.yaml"
    config.write_text("k: [0, 3]\n")
    _one_line_error(bloggap("ladder", "--config", config, "--device", "cpu"), "--k 0", ">= 1")
    config.write_text("rows: 4\nlayers: 3\n")
    _one_line_error(bloggap("ladder", "--config", config), "unknown field(s) layers", "calibration_rows")
    config.write_text(f"json: {tmp_path}\n")
    _one_line_error(bloggap("attribute", "--config", config, "--device", "cpu"), "--json", "is a directory")


# ---------------------------------------------------------------- bloggap doctor end to end


def _cell(dtype, comparison, oob, n=1000, attn="sdpa", **extra):
    return {"dtype": dtype, "attn": attn, "comparison": comparison, "oob": oob, "oob_count": round(oob * n),
            "n": n, "abs_dlogp_mean": 0.0, "abs_dlogp_max": 0.0, "bitwise_equal": oob == 0, **extra}


def _timed(dtype, seconds):
    return _cell(dtype, "b1_vs_b8_left_mask", 0.0, seconds=seconds, tokens_forwarded=1000)


def test_doctor_cli_end_to_end_json(tmp_path, capsys):
    from bloggap_plugin.cli import main

    path = tmp_path / "doctor.json"
    code = main([
        "doctor", "--model", "tiny-random-llama", "--rows", "10", "--new-tokens", "4", "--attn", "sdpa,eager",
        "--device", "cpu", "--json", str(path), "--no-progress",
    ])
    assert code == 0
    printed = capsys.readouterr().out
    assert "recommendation:" in printed and "b1_vs_b8_left_arange" in printed
    assert "fp16 scaled down on CPU: 8 of 10 rows" in printed
    result = json.loads(path.read_text())
    for key in ("schema_version", "model", "device", "torch", "transformers", "tokens", "cells", "fp16_check",
                "recommendation", "env"):
        assert key in result, key
    assert result["schema_version"] == 1 and result["model"] == "tiny-random-llama" and result["device"] == "cpu"
    assert result["tokens"] == 40
    assert result["recommendation"]["text"] and "arm" in result["recommendation"]
    assert result["env"]["torch"] == torch.__version__
    cells = result["cells"]
    assert {(c["dtype"], c["attn"]) for c in cells} == {(d, a) for d in ("bf16", "fp16", "fp32")
                                                        for a in ("sdpa", "eager")}
    for c in cells:
        for key in ("dtype", "attn", "comparison", "oob", "ci_low", "ci_high", "abs_dlogp_mean", "abs_dlogp_max", "n"):
            assert key in c, key
        if c.get("skipped"):  # fp16 scaled down on CPU, left out on a CPU, or a comparison 10 rows cannot support
            from bloggap_plugin.commands.doctor import CPU_SCALE
            from bloggap_plugin.core.comparisons import COMPARISONS

            assert c["oob"] is None and (c["dtype"] == "fp16" or COMPARISONS[c["comparison"]].rows_needed > 10
                                         or c["comparison"] in CPU_SCALE["skip"]
                                         or c["dtype"] != "bf16" and c["comparison"] in CPU_SCALE["skip_beyond_bf16"])
        else:
            assert 0.0 <= c["ci_low"] <= c["oob"] <= c["ci_high"] <= 1.0
    measured_fp16 = {c["comparison"] for c in cells if c["dtype"] == "fp16" and not c.get("skipped")}
    assert measured_fp16 == {"b1_vs_b8_left_arange", "b1_vs_b8_left_mask", "sampler_vs_b1"}  # rerun: bf16's
    assert result["fp16_check"]["rows"] == 8 and result["fp16_check"]["ok"] is True
    # the file is also a benchmark result `bloggap report` accepts (it lives in benchmarks/results/<device>/)
    from bloggap_plugin.report_builder import validate_result

    validate_result(result, path)
    table, column = result["tables"]
    assert table["id"] == "DOCTOR" and table["random_init"] is True
    # no CUDA device here: the vLLM sampler column says so (docs/doctor.md)
    assert column["id"] == "DOCTOR-vllm" and column["rows"] == []
    assert result["vllm_sampler"] == {"absent": "no CUDA device: the doctor ran on cpu, and vLLM samples on a CUDA GPU"}
    headline = next(row for row in table["rows"] if row[0] == "b1_vs_b8_left_arange")
    index = table["columns"].index("bf16/sdpa")
    cell = next(c for c in cells if (c["dtype"], c["attn"], c["comparison"]) == ("bf16", "sdpa", "b1_vs_b8_left_arange"))
    assert headline[index] == round(100 * cell["oob"], 2)


def test_doctor_from_json_recomputes_the_recommendation_without_measuring(tmp_path, capsys):
    """--from-json re-derives the recommendation from stored cells (here: a constructed fp16-removes-it case)."""
    from bloggap_plugin.cli import main

    cells = [
        _cell("bf16", "b1_vs_b8_left_arange", 0.08), _timed("bf16", 1.0), _cell("bf16", "rerun_b1", 0.0),
        _cell("fp16", "b1_vs_b8_left_arange", 0.0), _timed("fp16", 1.0),
    ]
    stored = {
        "benchmark": "doctor", "schema_version": 1, "model": "m", "device": "h200", "rows": 8, "max_new_tokens": 4, "tokens": 1000, "band": 0.1,
        "params": {"dtypes": ["bf16", "fp16"], "attn": ["sdpa"], "sample_dtype": "bf16", "seed": 1},
        "cells": cells, "paired_cells": [], "fp16_check": {"nonfinite_logprobs": 0, "max_abs_hidden": 1.0,
                                                           "rows": 8, "attn": "sdpa", "n": 1000, "ok": True},
        "recommendation": {"arm": "F", "text": "old text"},
        "tables": [{"id": "DOCTOR", "notes": "cells... Recommendation: old text"}],
    }
    source, target = tmp_path / "old.json", tmp_path / "new.json"
    source.write_text(json.dumps(stored))
    assert main(["doctor", "--from-json", str(source), "--json", str(target)]) == 0
    result = json.loads(target.read_text())
    assert result["cells"] == json.loads(json.dumps(cells))  # measurements untouched
    assert result["recommendation"]["arm"] == "H"
    assert result["recommendation"]["recomputed"]["previous_arm"] == "F"
    assert result["tables"][0]["notes"].endswith(" ".join(result["recommendation"]["text"].split()))
    assert "arm H" in capsys.readouterr().out
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"cells": []}))
    assert main(["doctor", "--from-json", str(broken)]) == 2
    assert "missing key" in capsys.readouterr().err


@pytest.mark.parametrize(("command", "text", "needles"), [
    ("doctor", "dtype: fp8\n", ("--dtype", "'fp8'", "bf16, fp16, fp32")),
    ("doctor", "dtypes: [bf16, bf8]\n", ("--dtypes", "bf8", "comma-separated subset")),
    ("doctor", "attn: [sdpa, flash]\n", ("--attn", "flash", "comma-separated subset")),
    ("attribute", "dtype: int8\n", ("--dtype", "'int8'", "bf16, fp16, fp32")),
    ("ladder", "fp16: maybe\n", ("--fp16", "'maybe'", "auto, on, off")),
    ("ladder", "positions: random\n", ("--positions", "'random'", "mask, arange")),
])
def test_config_file_values_are_checked_like_flags(bloggap, tmp_path, command, text, needles):
    """A value from --config FILE.yaml gets the same choice check as the flag: one line, before any model loads."""
    config = tmp_path / "settings.yaml"
    config.write_text(text)
    _one_line_error(bloggap(command, "--config", config, "--model", "tiny-random-llama", "--device", "cpu"), *needles)


def test_top_level_help_builds_no_command_flags_and_imports_no_transformers(spawns):
    """``bloggap --help`` lists the commands without building their flags (HfArgumentParser imports transformers);
    a named command gets its flags."""
    import subprocess
    import sys

    code = ("import sys; from bloggap_plugin.cli import build_parser; p = build_parser(['--help']); "
            "subs = p.get_default('_subparsers'); "
            "assert all(len(s._actions) == 1 for s in subs.values()), 'flags built'; "
            "assert 'transformers' not in sys.modules, 'transformers imported'; "
            "d = build_parser(['doctor', '--num-seqs', '3']).get_default('_subparsers'); "
            "assert any('--num_seqs' in a.option_strings for a in d['doctor']._actions); "
            "assert len(d['ladder']._actions) == 1; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("argv, given", [(["patch", "verl"], "got none"),
                                         (["patch", "verl", "--check", "--revert"], "got --check and --revert")])
def test_patch_needs_exactly_one_mode(capsys, argv, given):
    from bloggap_plugin.cli import main

    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        f"bloggap: error: bloggap patch verl: choose exactly one of --check, --apply, --revert ({given})")


def test_patch_switch_may_precede_the_target(capsys):
    from bloggap_plugin.cli import main

    assert main(["patch", "--check", "verl"]) == 0
    assert "applies cleanly to 3 files" in capsys.readouterr().out
