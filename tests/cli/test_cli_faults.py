"""Bad input and faults across the commands (train, compare, doctor, report): one line on stderr naming the problem
and the fix, exit 2, no traceback, no model loaded; no silent wrong answer (non-finite settings, hidden NaN steps); a
log is never appended to another run's, a failed write warns and training goes on; help says what flags take.
`bloggap train` run in its own process (Ctrl-C, reporting, the hub flag): test_train_process.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _support import ROOT
from _support.cli import RECIPES, assert_one_line_error

from bloggap_plugin import cli

ARM_A = str(RECIPES / "arm_A.yaml")
TINY = ("--model", "tiny-random-llama")


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e400"])
def test_a_non_finite_grpo_setting_on_the_command_line_is_refused(bloggap, tmp_path, value):
    line = assert_one_line_error(bloggap("train", ARM_A, *TINY, "--max-steps", "1", "--output-dir", tmp_path,
                                          f"--learning_rate={value}"), "learning_rate")
    assert "finite" in line


@pytest.mark.parametrize("text", ["1e400", ".inf", ".nan"])
def test_a_non_finite_value_in_a_recipe_is_refused(bloggap, tmp_path, text):
    recipe = tmp_path / "r.yaml"
    recipe.write_text((RECIPES / "arm_A.yaml").read_text().replace("learning_rate: 2.0e-6", f"learning_rate: {text}"))
    assert f"learning_rate: {text}" in recipe.read_text()
    line = assert_one_line_error(bloggap("train", recipe, *TINY, "--max-steps", "1", "--output-dir", tmp_path / "o"),
                                  "learning_rate")
    assert "finite" in line


@pytest.mark.parametrize("field, value", [("probe_budget", ".inf"), ("band", ".nan")])
def test_a_non_finite_gap_field_is_refused(bloggap, tmp_path, field, value):
    recipe = tmp_path / "r.yaml"
    recipe.write_text((RECIPES / "arm_A.yaml").read_text().replace("  band: 0.1\n", f"  band: 0.1\n  {field}: {value}\n")
                      if field != "band" else (RECIPES / "arm_A.yaml").read_text().replace("band: 0.1", f"band: {value}"))
    assert_one_line_error(bloggap("train", recipe, *TINY, "--max-steps", "1", "--output-dir", tmp_path / "o"),
                           f"gap.{field}")


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_a_seed_outside_numpys_range_is_refused(bloggap, tmp_path, seed):
    line = assert_one_line_error(bloggap("train", ARM_A, *TINY, "--max-steps", "1", "--output-dir", tmp_path,
                                          f"--seed={seed}"), "--seed")
    assert "4294967295" in line


def test_an_unknown_flag_is_one_line_not_the_usage(capsys):
    code = cli.main(["train", ARM_A, "--no-such-flag", "1"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--no-such-flag" in lines[0] and "bloggap train --help" in lines[0], err[:2000]


def test_an_existing_log_is_not_appended_to(bloggap, tmp_path):
    log = tmp_path / "run.jsonl"
    log.write_text('{"step": 1, "loss": 0.5}\n')
    assert_one_line_error(bloggap("train", ARM_A, *TINY, "--max-steps", "1", "--output-dir", tmp_path / "o",
                                   "--log-jsonl", log), str(log), "exists")
    recipe = tmp_path / "arm_A.yaml"
    recipe.write_text((RECIPES / "arm_A.yaml").read_text())
    assert_one_line_error(bloggap("train", recipe, *TINY, "--max-steps", "1", "--output-dir", tmp_path / "o",
                                   "--log-jsonl", recipe), "exists")
    assert recipe.read_text() == (RECIPES / "arm_A.yaml").read_text()  # the recipe is untouched


def test_the_summary_counts_non_finite_steps_instead_of_hiding_them():
    from bloggap_plugin.trl.run import summarize_history

    history = [{"loss": 0.5, "grad_norm": 1.0, "reward": 0.25}, {"loss": float("nan"), "grad_norm": float("nan"),
                                                                  "reward": 0.5}]
    summary = summarize_history(history)
    assert summary["mean/reward"] == 0.375
    assert summary["non_finite_steps"] == {"grad_norm": 1, "loss": 1}
    assert summarize_history([{"loss": 0.1, "reward": 1.0}])["non_finite_steps"] == {}


def test_a_text_value_for_a_number_field_is_refused(bloggap, tmp_path):
    assert_one_line_error(bloggap("train", ARM_A, *TINY, "--max-steps", "1", "--output-dir", tmp_path,
                                   "--extra-overrides", "{beta: high}"), "beta", "'high'")


@pytest.mark.parametrize("name", ["bad.jsonl", "folder"])
def test_a_gsm8k_file_with_a_line_that_is_not_json_is_named_with_its_line(bloggap, tmp_path, name):
    rows = [json.dumps({"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"})] * 3
    rows.insert(2, '{"question": "cut off')
    if name == "folder":
        (tmp_path / "folder").mkdir()
        path, bad = tmp_path / "folder", tmp_path / "folder" / "train_small.jsonl"
    else:
        path = bad = tmp_path / name
    bad.write_text("\n".join(rows) + "\n")
    assert_one_line_error(bloggap("train", ARM_A, *TINY, "--max-steps", "1", "--output-dir", tmp_path / "o",
                                   "--task", "gsm8k", "--data", path), f"{bad}:3", "not a JSON")


def test_compare_checks_the_model_before_the_sweep(bloggap, tmp_path):
    """A model path that is no model: one line before any run starts (each run printed ModelSpecError)."""
    code, out, err = bloggap("compare", ARM_A, "--model", tmp_path / "nomodel", "--seeds", "0", "--max-steps", "1",
                             "--output-dir", tmp_path / "o")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("bloggap compare: --model ") and "no such file or folder" in lines[0]
    assert not (tmp_path / "o" / "runs").exists()


def _run_in_process(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_completion_length_beyond_the_models_positions_is_refused(capsys, tmp_path):
    code, out, err = _run_in_process(capsys, "train", ARM_A, *TINY, "--max-steps", "1", "--output-dir", tmp_path,
                                     "--max_completion_length", "2100")
    lines = [line for line in err.strip().splitlines() if line.startswith("bloggap")]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err[-2000:]
    assert "max_completion_length 2100" in lines[0] and "max_position_embeddings 2048" in lines[0]


def test_a_model_with_non_finite_weights_is_refused_naming_it(capsys, tmp_path):
    """Corrupt weights (NaN / inf) failed mid-generation inside torch.multinomial; they are named at load."""
    import torch

    from bloggap_plugin.models import load_model

    model, tokenizer = load_model("tiny-random-llama")
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    folder = tmp_path / "broken"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    code, out, err = _run_in_process(capsys, "train", ARM_A, "--model", folder, "--max-steps", "1", "--output-dir",
                                     tmp_path / "o")
    lines = [line for line in err.strip().splitlines() if line.startswith("bloggap")]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err[-2000:]
    assert "model.layers.0.mlp.up_proj.weight" in lines[0] and "not finite" in lines[0]


def test_a_log_write_that_fails_warns_once_and_training_goes_on(tmp_path):
    """--log-jsonl on a full disk (/dev/full: every write fails with ENOSPC): one warning, the steps are still kept
    in the logger's records, and nothing raises into the trainer."""
    import warnings

    from bloggap_plugin.trl.run import JsonlLogger

    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    logger = JsonlLogger("/dev/full")
    state = type("State", (), {"global_step": 1})()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logger.on_log(None, state, None, logs={"loss": 0.5})
        state.global_step = 2
        logger.on_log(None, state, None, logs={"loss": 0.25})
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "/dev/full" in messages[0] and "training goes on" in messages[0]
    assert [r["step"] for r in logger.records] == [1, 2]


def test_report_reads_a_compare_output_folder(capsys, tmp_path):
    """`bloggap report --results COMPARE_DIR`: the folder's compare.json is the result (its runs/ hold run files, not
    results), where it failed with "missing key 'benchmark'" on a run's held-out file."""
    import shutil

    folder = tmp_path / "cmp"
    (folder / "runs").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "results" / "h200" / "compare_sweep.json", folder / "compare.json")
    (folder / "runs" / "A_s0.heldout.json").write_text('{"attempt": 1, "result": {"accuracy": 0.5}}')
    code = cli.main(["report", "--results", str(folder), "--output", str(tmp_path / "B.md"), "--no-plots"])
    err = capsys.readouterr().err
    assert code == 0, err
    text = (tmp_path / "B.md").read_text()
    assert "## cmp" in text and "T10" in text


def test_a_bloggap_cache_that_is_a_file_is_refused_before_dequantising(bloggap, tmp_path, monkeypatch):
    blocker = tmp_path / "cache-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("BLOGGAP_CACHE", str(blocker))
    assert_one_line_error(bloggap("train", ARM_A, "--max-steps", "1", "--output-dir", tmp_path / "o"),
                           "BLOGGAP_CACHE", "not a folder")


def test_a_cache_write_that_fails_leaves_no_temporary_folder(tmp_path, monkeypatch, real_model):
    """A full disk while the dequantised copy is saved: a ModelSpecError naming the cache and the fix, and no
    half-written temporary folder left behind (the next load would not find one either)."""
    import errno

    import bloggap_plugin.models as models

    monkeypatch.setenv("BLOGGAP_CACHE", str(tmp_path / "cache"))
    tiny, tokenizer = models.load_model("tiny-random-llama")
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: tmp_path / "x.gguf")
    monkeypatch.setattr(models, "_from_pretrained", lambda *a, **k: (tiny, tokenizer))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(type(tiny), "save_pretrained", full)
    with pytest.raises(models.ModelSpecError, match="No space left on device.*BLOGGAP_CACHE"):
        models._load_smollm2(tiny.dtype)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []


def _stored_doctor() -> dict:
    def cell(dtype, comparison, oob, n=1000):
        return {"dtype": dtype, "attn": "sdpa", "comparison": comparison, "oob": oob, "oob_count": round(oob * n),
                "n": n, "abs_dlogp_mean": 0.0, "abs_dlogp_max": 0.0, "bitwise_equal": oob == 0}

    return {"benchmark": "doctor", "schema_version": 1, "model": "m", "device": "h200", "rows": 8, "max_new_tokens": 4, "tokens": 1000, "band": 0.1,
            "cells": [cell("bf16", "b1_vs_b8_left_arange", 0.08), cell("fp16", "b1_vs_b8_left_arange", 0.0)],
            "paired_cells": [], "params": {"dtypes": ["bf16", "fp16"], "attn": ["sdpa"], "sample_dtype": "bf16",
                                           "seed": 1},
            "recommendation": {"arm": "F", "text": "t"},
            "fp16_check": {"nonfinite_logprobs": 0, "max_abs_hidden": 1.0, "rows": 8, "attn": "sdpa", "n": 1000,
                           "ok": True}}


@pytest.mark.parametrize("edit, needles", [
    (lambda d: d["cells"][0].update(oob=7.5), ("cells[0].oob", "7.5", "[0, 1]")),
    (lambda d: d["cells"][1].update(oob_count=-3), ("cells[1].oob_count", "-3")),
    (lambda d: d["cells"][0].update(oob_count=2000), ("cells[0].oob_count", "2000", "n")),
    (lambda d: d["cells"][0].pop("dtype"), ("cells[0]", "dtype")),
    (lambda d: d["cells"][0].update(oob="high"), ("cells[0].oob", "'high'")),
    (lambda d: d.update(cells={"a": 1}), ("cells", "list")),
    (lambda d: d.update(fp16_check=[1, 2]), ("fp16_check",)),
    (lambda d: d["fp16_check"].pop("attn"), ("'attn'",)),
    (lambda d: d["params"].pop("attn"), ("params.attn",)),
    (lambda d: d.update(band=2), ("band", "(0, 1)")),
])
def test_a_stored_doctor_result_with_wrong_or_impossible_values_is_refused(bloggap, tmp_path, edit, needles):
    stored = _stored_doctor()
    edit(stored)
    path = tmp_path / "d.json"
    path.write_text(json.dumps(stored))
    assert_one_line_error(bloggap("doctor", "--from-json", path), "--from-json", *needles)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_stored_doctor()))
    assert bloggap("doctor", "--from-json", good)[0] == 0


def test_two_trains_into_one_output_folder_are_refused(bloggap, tmp_path):
    """A second bloggap train into the folder a running one writes (its logs and final save would interleave): one
    line naming the folder, before any model loads. The lock is the one compare uses for its folders."""
    from bloggap_plugin._io import try_lock

    out = tmp_path / "o"
    out.mkdir()
    held = try_lock(out / ".bloggap-train.lock")
    assert held is not None
    try:
        assert_one_line_error(bloggap("train", ARM_A, *TINY, "--max-steps", "1", "--output-dir", out),
                               str(out), "another bloggap train")
    finally:
        held.close()
    assert try_lock(out / ".bloggap-train.lock") is not None  # free again once the holder is gone


def test_train_help_is_short_and_help_all_lists_every_grpo_field(capsys):
    assert cli.main(["train", "--help"]) == 0
    short = capsys.readouterr().out
    assert len(short.splitlines()) < 150 and "--help-all" in short and "--max_steps" in short
    assert "--vllm_gpu_memory_utilization" not in short
    assert cli.main(["train", "--help-all"]) == 0
    full = capsys.readouterr().out
    assert "--vllm_gpu_memory_utilization" in full and "--learning_rate" in full and len(full.splitlines()) > 300


@pytest.mark.parametrize("rows, skipped", [(8, {"b1_vs_b32_left_arange", "b1_vs_b32_left_mask", "two_groupings_b8"}),
                                           (3, {"b1_vs_b8_left_arange", "b1_vs_b8_left_mask", "b1_vs_b32_left_arange",
                                                "b1_vs_b32_left_mask", "b1_vs_b8_right", "b1_vs_b8_equal_nopad",
                                                "two_groupings_b8"})])
def test_doctor_skips_and_names_the_comparisons_its_rows_cannot_support(capsys, tmp_path, rows, skipped):
    """--num-seqs 8 printed 'b1_vs_b32' rows that were batch-8 passes, and with 3 rows every 'b8' row was a batch of
    3 while two_groupings_b8 vanished without a word: a comparison needs as many rows as its batch (two groupings
    need two batches); the others are skipped for every dtype, and a note names them and why."""
    path = tmp_path / "d.json"
    code = cli.main(["doctor", "--model", "tiny-random-llama", "--num-seqs", str(rows), "--max-new-tokens", "3",
                     "--device", "cpu", "--dtypes", "bf16", "--attn", "sdpa", "--full", "--json", str(path), "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out[-2000:]
    result = json.loads(path.read_text())
    bf16 = {c["comparison"]: c for c in result["cells"] if c["dtype"] == "bf16"}
    assert {name for name, c in bf16.items() if c.get("skipped")} == skipped
    assert all(c.get("oob") is not None for name, c in bf16.items() if name not in skipped)
    notes = result["tables"][0]["notes"]
    assert "two_groupings_b8" in notes and f"this run scores {rows} rows" in notes


def test_bloggap_gguf_is_not_ignored_once_a_cache_exists(bloggap, tmp_path, monkeypatch):
    """$BLOGGAP_GGUF names another file than the one the cached default model was built from: said in one line with
    the fix, before any model loads (the cache was used without a word)."""
    cache = tmp_path / "cache"
    dense = cache / "smollm2-135m-instruct"
    dense.mkdir(parents=True)
    (dense / "config.json").write_text("{}")
    (dense / "bloggap_source.json").write_text(json.dumps({"gguf": str(tmp_path / "old.gguf"), "size": 10}))
    other = tmp_path / "new.gguf"
    other.write_bytes(b"GGUF" + b"\0" * 20)
    monkeypatch.setenv("BLOGGAP_CACHE", str(cache))
    monkeypatch.setenv("BLOGGAP_GGUF", str(other))
    assert_one_line_error(bloggap("train", ARM_A, "--max-steps", "1", "--output-dir", tmp_path / "o"),
                           "BLOGGAP_GGUF", str(other), "old.gguf", str(dense))
    (dense / "bloggap_source.json").write_text(json.dumps({"gguf": str(other), "size": other.stat().st_size}))
    monkeypatch.setattr("bloggap_plugin.models._check_model_folder", lambda path: None)
    with pytest.raises(AssertionError, match="a model was loaded"):  # the same file: the cache is used
        bloggap("train", ARM_A, "--max-steps", "1", "--output-dir", tmp_path / "o2")


def test_doctor_help_names_the_model_specs_instead_of_a_source_file(capsys):
    assert cli.main(["doctor", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "models.py" not in text and "a local model folder with config.json" in text and "org/name" in text


def test_the_default_models_tokenizer_decodes_without_the_bpe_clean_up_warning(smollm2_bf16, capfd):
    """transformers warns on every run that clean_up_tokenization_spaces=True is ignored for a BPE tokenizer (and
    would corrupt its output): the loaded tokenizer has it off, so decoding is quiet and unchanged."""
    _, tokenizer = smollm2_bf16
    assert tokenizer.clean_up_tokenization_spaces is False
    text = tokenizer.decode(tokenizer("Hello , world !")["input_ids"])
    assert "clean_up_tokenization_spaces" not in capfd.readouterr().err and text.endswith("Hello , world !")


def test_compare_plot_labels_reward_steps_and_shows_a_single_point(tmp_path, monkeypatch):
    """A short run's curve of one reward point was an empty plot, and the x-axis said 'step' while it counts the
    steps that logged a reward (every other optimizer step with num_iterations 2)."""
    pytest.importorskip("matplotlib")
    import bloggap_plugin.report_builder as report
    from bloggap_plugin.compare.outputs import plot_reward_curves

    figures = []
    monkeypatch.setattr(report, "save_figure", lambda fig, path, dpi=120: figures.append(fig))
    results = {"arms": {"A": {}, "B": {}}, "runs": {"A_s0": {"arm": "A", "rewards": [0.25]},
                                                    "B_s0": {"arm": "B", "rewards": [0.5]}}}
    plot_reward_curves(results, tmp_path / "p.png", smooth=5)
    (axes,) = figures[0].axes
    assert axes.get_xlabel().startswith("reward step") and len(axes.get_lines()) == 2
    assert all(line.get_marker() not in (None, "None", "") for line in axes.get_lines())


@pytest.mark.parametrize("flags", [("--report-to", "wandb", "nosuch"), ("--report-to", "wandb,nosuch"),
                                   ("--report_to=tensorboard,nosuch",)])
def test_report_to_takes_a_list_as_trl_does(bloggap, tmp_path, flags):
    """TRL's report_to is a list: --report-to takes several integrations, space- or comma-separated; each is
    checked before the model loads (here the unknown one is named, so the list was read past its first name)."""
    assert_one_line_error(bloggap("train", ARM_A, *TINY, "--max-steps", "1", "--output-dir", tmp_path, *flags),
                           "--report-to nosuch", "unknown")


def test_report_to_a_list_from_a_config_file(bloggap, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("report_to: [wandb, nosuch]\n")
    assert_one_line_error(bloggap("train", ARM_A, *TINY, "--max-steps", "1", "--output-dir", tmp_path, "--config",
                                   config), "--report-to nosuch", "unknown")


def test_compare_progress_follows_the_run_through_training_and_evaluation(tmp_path):
    """The progress line read "step 0/2" for a whole short run: 0 while the model loads, and 0 again once training
    ended and the worker evaluated the held-out set (its step log had been renamed to the run's log). It says what
    the run is doing: loading, step k/N, then the held-out evaluation."""
    from types import SimpleNamespace

    from bloggap_plugin.compare.logs import DONE_KEY
    from bloggap_plugin.compare.sweep import _progress

    part, log = tmp_path / "A_s0.x.part.jsonl", tmp_path / "A_s0.jsonl"
    run = SimpleNamespace(log_jsonl=str(log))
    config = SimpleNamespace(max_steps=8)
    assert _progress(config, run, part, "train") == "loading (step 0/8)"
    part.write_text("".join(json.dumps({"step": s, "loss": 0.1}) + "\n" for s in (1, 2, 3)))
    assert _progress(config, run, part, "train") == "step 3/8"
    text = part.read_text() + json.dumps({DONE_KEY: "done", "attempt": "x"}) + "\n"
    part.unlink()
    log.write_text(text)
    assert _progress(config, run, part, "train") == "trained (step 3/8), evaluating held-out"
    assert _progress(config, run, part, "evaluate") == "evaluating held-out"


def test_compare_help_shows_the_defaults(capsys):
    """`bloggap compare --help` showed no defaults (train's flags come from dataclasses that say them): each flag
    with a default says it once, in argparse's '(default: ...)' form; a help text that already names its default
    is not given a second one."""
    from bloggap_plugin.compare import CompareConfig

    assert cli.main(["compare", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split()).split("options:", 1)[1]
    defaults = CompareConfig(recipes=[])
    for flag, value in (("--max-steps", defaults.max_steps), ("--parallel", defaults.parallel),
                        ("--poll-s", defaults.poll_s), ("--task", defaults.task), ("--alpha", defaults.alpha)):
        after = text.split(flag, 1)[1].split(" --", 1)[0]
        assert f"(default: {value})" in after, (flag, after)
    assert "(default: the task's default). (default:" not in text and "(default: None)" not in text


def test_train_without_report_to_reports_to_none(bloggap, tmp_path):
    """--report-to left out is TrainConfig's "none" (a list field's parser default would be None, refused)."""
    with pytest.raises(AssertionError, match="a model was loaded"):
        bloggap("train", ARM_A, *TINY, "--max-steps", "1", "--output-dir", tmp_path)




class _ClosedPipe:
    """A stdout whose reader has gone (``bloggap doctor ... | head -1`` after head exits): every write raises."""

    encoding = "utf-8"

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_output_into_a_closed_pipe_stops_quietly(monkeypatch, capsys):
    """A reader that stops early (``| head``) ends the command as SIGPIPE would (exit 141), without a traceback."""
    result = ROOT / "benchmarks" / "results" / "cpu" / "doctor_gemma3-270m.json"
    capsys.readouterr()
    monkeypatch.setattr("sys.stdout", _ClosedPipe())
    code = cli.main(["doctor", "--from-json", str(result)])
    monkeypatch.undo()
    assert code == 141
    assert capsys.readouterr().err == ""


def test_the_doctors_findings_fit_a_terminal_and_stay_one_line_each_in_a_pipe(monkeypatch, capsys):
    """On a terminal the recommendation's long finding lines wrap at its width (under their bullet); piped, each
    finding stays one line. The words are the same either way."""
    import os
    import shutil
    import sys

    result = str(ROOT / "benchmarks" / "results" / "cpu" / "doctor_gemma3-270m.json")
    assert cli.main(["doctor", "--from-json", result]) == 0
    piped = capsys.readouterr().out.split("recommendation: ", 1)[1]
    assert max(len(line) for line in piped.splitlines()) > 100  # the stored findings are longer than the terminal
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr(shutil, "get_terminal_size", lambda *a, **k: os.terminal_size((100, 40)))
    assert cli.main(["doctor", "--from-json", result]) == 0
    shown = capsys.readouterr().out.split("recommendation: ", 1)[1]
    assert max(len(line) for line in shown.splitlines()) <= 99
    assert shown.split() == piped.split()
    bullets = [line for line in shown.splitlines() if line.startswith("  - ")]
    assert len(bullets) == len([line for line in piped.splitlines() if line.startswith("  - ")])
    continued = [line for line in shown.splitlines()[1:] if line and not line.startswith("  - ")]
    assert continued and all(line.startswith("  ") and not line.startswith("  - ") for line in continued)
