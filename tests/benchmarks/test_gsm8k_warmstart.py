"""benchmarks/gsm8k_warmstart.py (issue 33 item 1) on CPU: the smoke run end to end, the training example's format, the
targets' reward, the decontamination check, the checkpoint hash, seeded repeats, refusals and a run cut short."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from _support import python3_shim
from _support.events import HANG_S

from bloggap_plugin.tasks import gsm8k, task_prompt


def _module():
    from benchmarks import gsm8k_warmstart

    return gsm8k_warmstart


def _fixture_rows() -> list[dict]:
    return [json.loads(line) for line in gsm8k.SAMPLE_PATH.read_text().splitlines() if line.strip()]


def _data_folder(folder, train: list[dict], test: list[dict]):
    """A GSM8K folder with a train and a test file (not named train.jsonl / test.jsonl: those are checked against
    the published files)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train_part.jsonl", train), ("test_part.jsonl", test)):
        (folder / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


@pytest.fixture(scope="module")
def smoke_data(tmp_path_factory):
    """The 12-problem fixture split in two: the first 8 rows train, the last 4 test."""
    rows = _fixture_rows()
    return _data_folder(tmp_path_factory.mktemp("gsm8k"), rows[:8], rows[8:])


def _smoke(data, out) -> tuple[int, dict]:
    code = _module().main(["run", "--smoke", "--data", str(data), "--out", str(out)])
    path = out / "gsm8k_warmstart.json"
    return code, json.loads(path.read_text()) if path.is_file() else {}


@pytest.fixture(scope="module")
def smoke(smoke_data, tmp_path_factory, trains):
    out = tmp_path_factory.mktemp("smoke")
    code, payload = _smoke(smoke_data, out)
    assert code == 0
    return out, payload


def test_smoke_run_writes_every_phase_and_tables_made_from_its_results(smoke, smoke_data):
    import decimal

    from bloggap_plugin.results import validate_result

    module = _module()
    out, payload = smoke
    validate_result(json.loads((out / "gsm8k_warmstart.json").read_text(), parse_float=decimal.Decimal),
                    "gsm8k_warmstart.json", None)
    results, params = payload["results"], payload["params"]
    assert payload["benchmark"] == "gsm8k_warmstart"
    assert results["done"] == list(module.PHASES) and results["complete"] is True
    # the tables are the table functions of the results, nothing else
    assert payload["tables"] == [module.table(results, params), module.curve_table(results, params)]
    main, curve = payload["tables"]
    assert main["id"] == "T18-warmstart" and curve["id"] == "T18-warmstart-curve" and main["random_init"] is True
    # data: file hashes of the files read, every target full reward, no contamination, the trainer's format checked
    for split, name in (("train", "train_part.jsonl"), ("test", "test_part.jsonl")):
        expected = hashlib.sha256((smoke_data / name).read_bytes()).hexdigest()
        assert results["data"]["files"][split] == {name: expected}
    assert results["data"]["train_rows"] == 8 and results["data"]["targets"]["all_full_reward"] is True
    assert results["decontamination"]["contaminated"] is False and results["decontamination"]["test_questions"] == 4
    check = results["train"]["format_check"]
    assert check["ok"] is True and check["rows"] == check["prompt_prefix"] == check["labels_completion_only"] == 8
    # the curve: one point per optimizer step (logging every step in the smoke), finite losses
    assert [point["step"] for point in results["train"]["curve"]] == [1, 2, 3] == [row[0] for row in curve["rows"]]
    assert all(point["loss"] > 0 for point in results["train"]["curve"])
    # the checkpoint: its hash recomputed from the files, the after-evaluation ran on it
    ckpt = out / "checkpoint"
    assert results["checkpoint"]["sha256"] == module.checkpoint_sha256(ckpt)
    assert set(results["checkpoint"]["files"]) == {p.name for p in ckpt.iterdir()}
    assert json.loads((ckpt / "config.json").read_text())["use_cache"] is True  # as the model it started from
    for phase, folder in module.EVALUATIONS:
        evaluated = json.loads((out / folder / "gsm8k_baseline.json").read_text())
        assert evaluated["params"]["decodings"] == ["greedy"] and evaluated["params"]["rows"] == 4
        assert evaluated["params"]["model"] == ("tiny-random-llama" if phase == "before" else str(ckpt))
        cell = evaluated["results"]["subsets"]["all"]["greedy"]
        assert results[phase]["subsets"]["all"] == {"rows": 4, **cell}
        row = next(r for r in main["rows"] if r[1] == "all" and r[0].startswith(phase))
        assert row[2:4] == [4, cell["correct"]]
        assert results[phase]["exit_code"] == 0
    assert results["change"]["correct"] == results["after"]["subsets"]["all"]["correct"] - \
        results["before"]["subsets"]["all"]["correct"]


def test_two_smoke_runs_with_one_seed_give_the_same_curve_and_checkpoint(smoke, smoke_data, tmp_path):
    """Seeded on CPU: the same losses at every step and the same checkpoint bytes."""
    _, first = smoke
    code, second = _smoke(smoke_data, tmp_path / "again")
    assert code == 0
    assert second["results"]["train"]["curve"] == first["results"]["train"]["curve"]
    assert second["results"]["checkpoint"]["sha256"] == first["results"]["checkpoint"]["sha256"]


def test_training_example_is_the_task_prompt_plus_the_worked_solution(tiny):
    """The prompt is the gsm8k task's own (its functions, not a copy), the completion the worked solution; through
    the chat template, the example is the generation prompt followed by the target and the end of the turn."""
    module = _module()
    _, tokenizer = tiny
    for row in _fixture_rows():
        example = module.training_example(row["question"], row["answer"], tokenizer)
        target = gsm8k.worked_solution(row["answer"])
        assert example["prompt"] == task_prompt(gsm8k.build_messages(row["question"]), tokenizer)
        assert example["completion"] == [{"role": "assistant", "content": target}]
        prompt_text = tokenizer.apply_chat_template(example["prompt"], add_generation_prompt=True, tokenize=False)
        whole = tokenizer.apply_chat_template(example["prompt"] + example["completion"], tokenize=False)
        assert whole == prompt_text + target + tokenizer.eos_token + "\n"


def test_the_trainers_tokens_are_the_generation_prompt_then_the_target_with_the_real_tokenizer(tmp_path, real_model):
    """SmolLM2's own chat template: TRL's tokenized example starts with exactly the prompt ids that gsm8k_baseline
    and TRL's GRPO generate from, and its labels cover the target and the end-of-turn token only."""
    import argparse

    import datasets
    from trl import SFTTrainer

    from bloggap_plugin.models import load_model

    module = _module()
    model, tokenizer = load_model("smollm2", dtype="fp32")
    rows = _fixture_rows()[:4]
    examples = [module.training_example(row["question"], row["answer"], tokenizer) for row in rows]
    args = argparse.Namespace(**{**module.SMOKE_DEFAULTS, "seed": 0})
    trainer = SFTTrainer(model=model, args=module.sft_config(args, str(tmp_path / "trainer"), "cpu"),
                         train_dataset=datasets.Dataset.from_list(examples), processing_class=tokenizer)
    check = module.format_check(trainer.train_dataset, examples, tokenizer, args.max_length)
    assert check["ok"] is True and check["rows"] == 4 and check["at_max_length"] == 0
    assert check["example"] == gsm8k.worked_solution(rows[0]["answer"]) + "<|im_end|>\n"


def test_every_target_scores_full_reward_with_the_tasks_reward_functions():
    module = _module()
    rows = _fixture_rows()
    examples = [module.training_example(row["question"], row["answer"]) for row in rows]
    golds = [gsm8k.gold_answer(row["answer"]) for row in rows]
    completions = [example["completion"] for example in examples]  # the assistant turn, as TRL hands it to rewards
    assert gsm8k.accuracy_reward(completions, answer=golds) == [1.0] * 12
    assert gsm8k.strict_accuracy_reward(completions, answer=golds) == [1.0] * 12
    scored = module.target_rewards([{**row, "index": i, "gold": gsm8k.gold_answer(row["answer"])}
                                    for i, row in enumerate(rows)], examples)
    assert scored["all_full_reward"] is True and scored["lenient_full_reward"] == scored["strict_full_reward"] == 12
    # a target whose last number is not the gold is found
    bad = [{**examples[0], "completion": [{"role": "assistant", "content": "#### 3 and then 4"}]}]
    assert module.target_rewards([{"index": 0, "gold": "3"}], bad)["failing"] == [0]


def test_decontamination_finds_a_planted_test_question():
    module = _module()
    rows = _fixture_rows()
    train, test = rows[:8], [row["question"] for row in rows[8:]]
    examples = [module.training_example(row["question"], row["answer"]) for row in train]
    clean = module.decontamination(examples, test)
    assert clean["contaminated"] is False and clean["exact"] == clean["substring"] == 0
    # the same question with other whitespace and case: an exact match
    planted = examples + [module.training_example("  " + test[2].upper().replace(" ", "\n "), rows[10]["answer"])]
    found = module.decontamination(planted, test)
    assert found["contaminated"] is True and found["exact"] == 1 and found["substring"] == 1
    assert found["matches"] == [{"test": 2, "train": 8, "kind": "exact"}]
    # inside a longer training question: a substring match
    inside = examples[:3] + [module.training_example(f"Read this first. {test[1]} Then add 2.", "#### 5")]
    found = module.decontamination(inside, test)
    assert (found["exact"], found["substring"], found["contaminated"]) == (0, 1, True)
    assert found["matches"] == [{"test": 1, "train": 3, "kind": "substring"}]
    # inside a training target
    target = examples[:1] + [module.training_example("Another question?", f"As asked: {test[0]}\n#### 7")]
    assert module.decontamination(target, test)["matches"] == [{"test": 0, "train": 1, "kind": "substring"}]


def test_the_run_refuses_contaminated_data_before_any_model_loads(tmp_path, capsys, monkeypatch):
    import bloggap_plugin.models as models

    module = _module()
    rows = _fixture_rows()
    data = _data_folder(tmp_path / "data", [rows[9]] + rows[:7], rows[8:])  # --smoke trains on the first 8 rows
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    out = tmp_path / "out"
    assert module.main(["run", "--smoke", "--data", str(data), "--out", str(out)]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gsm8k_warmstart: refused before training: 1 test question(s)")
    payload = json.loads((out / "gsm8k_warmstart.json").read_text())
    assert payload["results"]["decontamination"]["matches"] == [{"test": 1, "train": 0, "kind": "exact"}]
    assert payload["results"]["done"] == [] and payload["results"]["complete"] is False
    assert sorted(p.name for p in out.iterdir()) == ["gsm8k_warmstart.json"]


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch, smoke_data):
    import importlib.util

    module = _module()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    for argv, problem in (
        (["--smoke", "--lr", "0"], "--lr 0.0: must be in (0, 1)"),
        (["--smoke", "--precision", "fp16"], "--precision fp16: bf16"),
        (["--smoke", "--batch", "0"], "--batch 0: must be >= 1"),
        (["--smoke", "--ckpt", str(tmp_path / "full")], "exists and is not an empty folder"),
        (["--model", "tiny-random-llama"], "vLLM is not installed here"),
        (["--smoke", "--model", "tiny-random-nope"], "unknown tiny model"),
    ):
        assert module.main(["run", *argv, "--data", str(smoke_data), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("gsm8k_warmstart: ") and problem in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_a_run_cut_short_keeps_the_finished_phases(tmp_path, monkeypatch, smoke_data):
    """Killed while training (as a time limit would): the document holds the data checks and the evaluation before,
    valid, with the before rows in its table."""
    module = _module()

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("time limit")

    monkeypatch.setattr(module, "train", killed)
    with pytest.raises(KeyboardInterrupt):
        module.main(["run", "--smoke", "--data", str(smoke_data), "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "gsm8k_warmstart.json").read_text())
    assert payload["results"]["done"] == ["data", "before"] and payload["results"]["complete"] is False
    assert [row[:2] for row in payload["tables"][0]["rows"]] == [["before", s] for s in ("all", "1-step", "2-step")]
    assert payload["tables"][1]["rows"] == [] and payload["tables"][1]["plot"] is False


def test_a_trainer_tokenization_other_than_the_generation_prompt_stops_the_run(tmp_path, monkeypatch, capsys,
                                                                               smoke_data):
    """When the trainer's tokens do not start with the generation prompt (here: a format check that says so), the
    run stops before the first step (exit 3, one line) and the document keeps what the check found."""
    module = _module()
    real = module.format_check

    def mismatched(*args, **kwargs):
        return {**real(*args, **kwargs), "prompt_prefix": 0, "ok": False}

    monkeypatch.setattr(module, "format_check", mismatched)
    assert module.main(["run", "--smoke", "--data", str(smoke_data), "--out", str(tmp_path)]) == 3
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gsm8k_warmstart")]
    assert len(err) == 1 and err[0].startswith("gsm8k_warmstart: refused: the trainer's tokenized examples")
    results = json.loads((tmp_path / "gsm8k_warmstart.json").read_text())["results"]
    assert results["done"] == ["data", "before"] and results["train"]["format_check"]["prompt_prefix"] == 0
    assert results["train"]["curve"] == [] and not (tmp_path / "checkpoint").exists()


def test_the_vllm_evaluation_is_gsm8k_baseline_in_a_subprocess_with_arguments_it_accepts(tmp_path, monkeypatch,
                                                                                         capsys, smoke_data):
    """Without --hf the evaluation runs ``python -m benchmarks.gsm8k_baseline`` in a subprocess from the repository
    root; gsm8k_baseline parses those arguments (here it stops at its own vLLM check, not at argparse) and the
    summary is read from the document it writes."""
    import argparse
    import importlib.util
    import subprocess
    import sys

    from _support import ROOT

    from benchmarks import gsm8k_baseline

    module = _module()
    args = argparse.Namespace(**{**module.GPU_DEFAULTS, "seed": 3, "gpu_mem": 0.4, "eval_limit": 4})
    folder = tmp_path / "eval_after"
    argv = module.evaluation_argv("tiny-random-llama", folder, args, str(smoke_data))
    assert "--hf" not in argv and argv[argv.index("--decodings") + 1] == "greedy"
    assert argv[argv.index("--gpu-mem") + 1] == "0.4" and argv[argv.index("--seed") + 1] == "3"
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    assert gsm8k_baseline.main(argv) == 2
    assert "vLLM is not installed here" in capsys.readouterr().err
    calls = []

    def call(command, cwd=None):
        calls.append((command, cwd))
        return 0

    monkeypatch.setattr(subprocess, "call", call)
    summary = module.evaluate("tiny-random-llama", folder, args, str(smoke_data))
    assert calls == [([sys.executable, "-m", "benchmarks.gsm8k_baseline", *argv], ROOT)]
    assert summary["exit_code"] == 0 and summary["subsets"] == {} and summary["document"] is None


def _fake_checkpoint(folder):
    import torch
    from safetensors.torch import save_file

    folder.mkdir()
    save_file({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"model_type": "llama"}')
    return folder


def test_checkpoint_hash_is_stable_and_changes_with_any_byte(tmp_path, capsys):
    module = _module()
    folder = _fake_checkpoint(tmp_path / "a")
    first = module.checkpoint_sha256(folder)
    assert module.checkpoint_sha256(folder) == first
    assert module.checkpoint_sha256(shutil.copytree(folder, tmp_path / "b")) == first  # the path is not hashed
    assert module.main(["hash", str(folder)]) == 0 and capsys.readouterr().out.strip() == first
    (folder / "tokenizer.json").write_text("{}")  # not covered
    assert module.checkpoint_sha256(folder) == first
    weights = bytearray((folder / "model.safetensors").read_bytes())
    weights[-1] ^= 1
    (folder / "model.safetensors").write_bytes(bytes(weights))
    flipped = module.checkpoint_sha256(folder)
    assert flipped != first
    (folder / "config.json").write_text('{"model_type": "llama" }')
    assert module.checkpoint_sha256(folder) not in (first, flipped)
    shutil.copy(tmp_path / "b" / "model.safetensors", tmp_path / "b" / "model-2.safetensors")
    assert module.checkpoint_sha256(tmp_path / "b") != first
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        module.checkpoint_sha256(folder)


def test_the_gpu_call_script_reaches_the_vllm_check_and_fits_one_device_call(tmp_path, smoke_data, spawns):
    """benchmarks/gpu/gsm8k_warmstart_call.sh on a machine without vLLM: the run stops at the vLLM check in one line
    (in the log it tees), the script passes its exit on; its time limit leaves room in one 10-minute device call for
    the model's conversion before it."""
    import importlib.util
    import os
    import re
    import subprocess

    from _support import ROOT

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the script would run")
    script = ROOT / "benchmarks" / "gpu" / "gsm8k_warmstart_call.sh"
    (limit,) = [int(x) for x in re.findall(r"_S:-(\d+)", script.read_text())]
    assert limit <= 540
    bindir = python3_shim(tmp_path / "bin")
    out = tmp_path / "out"
    environ = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "OUT": str(out), "DATA": str(smoke_data),
               "MODEL": "tiny-random-llama", "CKPT": str(tmp_path / "ckpt")}
    done = subprocess.run(["bash", str(script)], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "gsm8k_warmstart_call: exit 2"
    assert len(lines) == 2 and lines[0].startswith("gsm8k_warmstart: vLLM is not installed here"), done.stdout
    assert (out / "gsm8k_warmstart.log").read_text().strip() == lines[0]
    assert sorted(p.name for p in out.iterdir()) == ["gsm8k_warmstart.log"] and not (tmp_path / "ckpt").exists()


def test_before_from_reuses_an_earlier_evaluation_and_refuses_other_settings(smoke, smoke_data, tmp_path, capsys,
                                                                              monkeypatch):
    """``--before-from``: the smoke run's own evaluation before training stands for phase 2 (only the evaluation
    after training runs); a document made with other evaluation settings is refused with one line naming them,
    before any model loads."""
    import importlib.util

    module = _module()
    out, first = smoke
    before = out / "eval_before" / "gsm8k_baseline.json"
    ran = []
    real_evaluate = module.evaluate
    monkeypatch.setattr(module, "evaluate", lambda model, folder, *a: ran.append(folder.name) or
                        real_evaluate(model, folder, *a))
    assert module.main(["run", "--smoke", "--data", str(smoke_data), "--out", str(tmp_path / "again"),
                        "--before-from", str(before)]) == 0
    payload = json.loads((tmp_path / "again" / "gsm8k_warmstart.json").read_text())
    assert ran == ["eval_after"] and not (tmp_path / "again" / "eval_before").exists()
    reused = payload["results"]["before"]
    assert reused["reused_from"] == str(before) and reused["subsets"] == first["results"]["before"]["subsets"]
    assert payload["params"]["before_from"] == str(before) and payload["results"]["complete"] is True
    # other settings: the smoke's token cap, and the H200 run's evaluation (vLLM, all 1,319 rows, 256 tokens)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    committed = (Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h200" / "gsm8k_warmstart" /
                 "eval_before" / "gsm8k_baseline.json")
    capsys.readouterr()  # the runs above
    for argv, problems in ((["--max-tokens", "8", "--before-from", str(before)], ["max_tokens 16 (this run: 8)"]),
                           (["--before-from", str(committed)], ["rows 1319 (this run: 4)", "max_tokens 256",
                                                                "engine 'vLLM' (this run: 'HF generate')"]),
                           (["--before-from", str(smoke_data / "train_part.jsonl")], ["not a readable JSON"])):
        assert module.main(["run", "--smoke", "--data", str(smoke_data), "--out", str(tmp_path / "no"), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("gsm8k_warmstart: --before-from ") and len(err.strip().splitlines()) == 1, err
        assert all(problem in err for problem in problems), err
    assert not (tmp_path / "no").exists()


def test_the_settings_script_runs_each_setting_packs_it_and_keeps_to_its_budget(tmp_path, smoke_data, spawns):
    """benchmarks/gpu/gsm8k_warmstart_settings.sh on a machine without vLLM: each NAME=ARGUMENTS setting runs
    gsm8k_warmstart (here it stops at the vLLM check, exit 2), is packed into OUT/NAME.tar.xz with its log, and
    reported in one line; a setting that would start with less than MIN_S of BUDGET_S left is not started; a
    malformed setting is refused before anything runs."""
    import importlib.util
    import os
    import subprocess
    import tarfile

    from _support import ROOT

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the script would run")
    script = ROOT / "benchmarks" / "gpu" / "gsm8k_warmstart_settings.sh"
    bindir = python3_shim(tmp_path / "bin")
    out, work = tmp_path / "out", tmp_path / "work"
    environ = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "OUT": str(out), "WORK": str(work),
               "DATA": str(smoke_data), "MODEL": "tiny-random-llama"}

    def run(*settings, **extra):
        return subprocess.run(["bash", str(script), *settings], cwd=ROOT, env={**environ, **extra},
                              capture_output=True, text=True, timeout=HANG_S)

    done = run("lr2e-4=--lr 2e-4", "e5=--epochs 5")
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["lr2e-4", "e5"]
    assert all(": exit 2, " in line and "vLLM is not installed here" in line for line in lines), lines
    assert sorted(p.name for p in out.iterdir()) == ["e5.tar.xz", "lr2e-4.tar.xz"]
    with tarfile.open(out / "lr2e-4.tar.xz") as tar:
        assert tar.getnames() == ["lr2e-4", "lr2e-4/gsm8k_warmstart.log"]
        assert b"vLLM is not installed here" in tar.extractfile("lr2e-4/gsm8k_warmstart.log").read()
    # PARALLEL=2: both settings at once, the lines in the order given; GPU_MEM reaches each setting's run
    for name in ("lr2e-4", "e5"):
        (out / f"{name}.tar.xz").unlink()
    done = run("lr2e-4=--lr 2e-4", "e5=--epochs 5", PARALLEL="2")
    assert done.returncode == 1, done.stdout + done.stderr
    assert [line.split(":")[0] for line in done.stdout.strip().splitlines()] == ["lr2e-4", "e5"]
    assert sorted(p.name for p in out.iterdir()) == ["e5.tar.xz", "lr2e-4.tar.xz"]
    done = run("lr2e-4=--lr 2e-4", PARALLEL="2", GPU_MEM="1.5")
    assert done.returncode == 1 and "--gpu-mem 1.5: must be a fraction in (0, 1]" in done.stdout, done.stdout
    for bad in ("0", "two"):
        done = run("lr2e-4=--lr 2e-4", PARALLEL=bad)
        assert done.returncode == 2 and f"PARALLEL={bad}: expected a positive whole number" in done.stderr
    done = run("late=--lr 1e-4", BUDGET_S="100", MIN_S="240")
    assert done.returncode == 1 and done.stdout.strip() == "late: not started (100 s left, a setting needs 240)"
    for bad in ("nameonly", "bad/name=--lr 1e-4"):
        done = run(bad)
        assert done.returncode == 2 and f"bad setting '{bad}'" in done.stderr, done.stderr
    assert run().returncode == 2


def test_a_setting_is_not_started_with_less_time_left_than_a_finished_one_took(tmp_path, spawns):
    """One at a time, a setting starts only while the budget left holds MIN_S and the longest setting that finished
    in this call (a setting stopped by the budget mid-evaluation wastes the device time it used); the stand-in call
    (WARMSTART_CALL) takes at least 2 s and succeeds, so with a 3 s budget the second is not started."""
    import os
    import subprocess

    from _support import ROOT

    call = tmp_path / "call.sh"
    call.write_text('sleep 2; mkdir -p "$OUT"; echo "after SFT | all    | 500  | 1       | 0.2" > '
                    '"$OUT/gsm8k_warmstart.log"\n')
    environ = {**os.environ, "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"),
               "WARMSTART_CALL": str(call), "BUDGET_S": "3", "MIN_S": "0"}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "gsm8k_warmstart_settings.sh"),
                           "first=--lr 1e-4", "second=--lr 2e-4"], cwd=ROOT, env=environ, capture_output=True,
                          text=True, timeout=HANG_S)
    first, second = done.stdout.strip().splitlines()
    assert first.startswith("first: exit 0, ") and first.endswith("; after SFT | all    | 500  | 1       | 0.2")
    taken = int(first.split(", ")[1].split(" ")[0])
    assert taken >= 2 and done.returncode == 1
    assert second.startswith("second: not started (") and second.endswith(
        f" s left, a setting needs 0, and one this call took {taken})"), second


def test_a_smoke_run_published_carries_its_numbers_and_no_machine_path(smoke, tmp_path):
    """benchmarks/gsm8k_warmstart_publish.py on a real run folder (the smoke run's, with a console log as the call
    script writes it): the document's numbers unchanged, its tables rebuilt, the run's folders as placeholders, the
    completions compressed byte for byte, the log without progress bars."""
    import lzma

    from benchmarks import gsm8k_warmstart_publish as publish
    from benchmarks._lib.publish import MACHINE_PATH

    module = _module()
    out, payload = smoke
    params = payload["params"]
    log = (f"{out}/eval_after: 50%|#####     | 1/2 [00:01<00:01]\n"
           f"[gsm8k_warmstart] checkpoint {params['checkpoint_dir']} sha256 {payload['results']['checkpoint']['sha256']}\n"
           f"/opt/torch/.venv/lib/python3.12/site-packages/x.py:1: UserWarning: w\n"
           f"[gsm8k_warmstart] wrote {out}/gsm8k_warmstart.json\n")
    folder = tmp_path / "run"
    shutil.copytree(out, folder, ignore=shutil.ignore_patterns("checkpoint"))
    (folder / "gsm8k_warmstart.log").write_text(log)
    into = tmp_path / "results"
    written = publish.publish_run(folder, "smoke", into)
    assert sorted(str(p.relative_to(into)) for p in written) == sorted(
        ["gsm8k_warmstart_smoke.json", "logs/gsm8k_warmstart_smoke.log",
         *(f"gsm8k_warmstart_smoke/{e}/{f}" for e in ("eval_before", "eval_after")
           for f in ("gsm8k_baseline.json", "completions.jsonl.xz"))])
    published = json.loads((into / "gsm8k_warmstart_smoke.json").read_text())
    assert (published["params"]["checkpoint_dir"], published["params"]["data"]) == ("$CKPT", "$DATA")
    assert published["results"]["after"]["subsets"] == payload["results"]["after"]["subsets"]
    assert published["results"]["train"]["curve"] == payload["results"]["train"]["curve"]
    assert published["results"]["checkpoint"]["sha256"] == payload["results"]["checkpoint"]["sha256"]
    assert published["tables"] == json.loads(json.dumps(module.document(
        published["env"], published["params"], published["results"]).to_dict()["tables"]))
    for evaluation in ("eval_before", "eval_after"):
        packed = into / "gsm8k_warmstart_smoke" / evaluation / "completions.jsonl.xz"
        assert lzma.decompress(packed.read_bytes()) == (out / evaluation / "completions.jsonl").read_bytes()
    after = json.loads((into / "gsm8k_warmstart_smoke/eval_after/gsm8k_baseline.json").read_text())
    assert after["params"]["model"] == "$CKPT"
    console = (into / "logs/gsm8k_warmstart_smoke.log").read_text()
    assert console.splitlines() == [
        f"[gsm8k_warmstart] checkpoint $CKPT sha256 {payload['results']['checkpoint']['sha256']}",
        "<image-site-packages>/x.py:1: UserWarning: w", "[gsm8k_warmstart] wrote $OUT/gsm8k_warmstart.json"]
    for path in written:
        data = lzma.decompress(path.read_bytes()) if path.suffix == ".xz" else path.read_bytes()
        assert not MACHINE_PATH.findall(data.decode()), path


def test_a_validation_run_trains_without_the_validation_rows_and_scores_only_them(gsm8k_dir, tmp_path, trains):
    """``--eval-split validation`` on the real data (tiny model, 8 rows, 3 steps): the training rows are the first
    of train_minus_validation, both evaluations score the first validation rows, and neither the validation nor the
    test split shares a question with the training examples."""
    module = _module()
    out = tmp_path / "out"
    code = module.main(["run", "--smoke", "--data", str(gsm8k_dir), "--out", str(out), "--eval-split", "validation"])
    assert code == 0
    payload = json.loads((out / "gsm8k_warmstart.json").read_text())
    params, results = payload["params"], payload["results"]
    assert params["eval_split"] == "validation" and params["train_split"] == "train_minus_validation"
    train = [json.loads(line) for line in (gsm8k_dir / "train.jsonl").read_text().splitlines()]
    held = json.loads(gsm8k.VALIDATION_FILE.read_text())["rows"]
    assert results["data"]["train_rows"] == 8 and results["data"]["validation_questions"] == 500
    assert results["decontamination"]["contaminated"] is False
    assert results["decontamination_validation"] == {**results["decontamination_validation"], "test_questions": 500,
                                                     "exact": 0, "substring": 0, "contaminated": False}
    for phase in ("eval_before", "eval_after"):
        evaluation = json.loads((out / phase / "gsm8k_baseline.json").read_text())
        assert evaluation["params"]["split"] == "validation" and evaluation["params"]["rows"] == 4
        assert results[phase.split("_")[1]]["subsets"]["all"]["rows"] == 4
    assert results["complete"] is True
    completions = [json.loads(line) for line in (out / "eval_after" / "completions.jsonl").read_text().splitlines()]
    golds = [gsm8k.gold_answer(train[i]["answer"]) for i in held[:4]]  # the first 4 validation rows, in train order
    assert [row["index"] for row in completions] == [0, 1, 2, 3] and [row["gold"] for row in completions] == golds


def test_a_validation_question_in_the_training_rows_stops_the_run(gsm8k_dir, tmp_path, capsys, monkeypatch):
    import bloggap_plugin.models as models

    module = _module()
    train = [json.loads(line) for line in (gsm8k_dir / "train.jsonl").read_text().splitlines()]
    planted = train[json.loads(gsm8k.VALIDATION_FILE.read_text())["rows"][3]]
    real = module.load_train_rows

    def with_planted(data, limit, split="train"):
        rows = real(data, limit, split)
        return [{"index": -1, "question": planted["question"], "answer": planted["answer"],
                 "gold": gsm8k.gold_answer(planted["answer"])}] + rows

    monkeypatch.setattr(module, "load_train_rows", with_planted)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    out = tmp_path / "out"
    assert module.main(["run", "--smoke", "--data", str(gsm8k_dir), "--out", str(out),
                        "--eval-split", "validation"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "refused before training: 1 validation question(s) appear" in err[0]
    payload = json.loads((out / "gsm8k_warmstart.json").read_text())
    assert payload["results"]["decontamination_validation"]["matches"] == [{"test": 3, "train": 0, "kind": "exact"}]


def test_the_settings_script_runs_declared_settings_by_name_and_refuses_others(tmp_path, smoke_data, spawns):
    """``DECLARED=FILE``: the names given pick declared settings (all of them with none given), run with the
    declaration's arguments; a name the file does not declare stops the script before anything runs."""
    import importlib.util
    import os
    import subprocess

    from _support import ROOT

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the script would run")
    bindir = python3_shim(tmp_path / "bin")
    declared = tmp_path / "declared.yaml"
    declared.write_text("eval_arguments: [--eval-split, validation]\nsettings: {a.1: [--lr, '2e-4'], b: []}\n")
    out = tmp_path / "out"
    environ = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "OUT": str(out), "WORK": str(tmp_path / "w"),
               "DATA": str(smoke_data), "MODEL": "tiny-random-llama", "DECLARED": str(declared)}

    def run(*names):
        return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "gsm8k_warmstart_settings.sh"), *names],
                              cwd=ROOT, env=environ, capture_output=True, text=True, timeout=HANG_S)

    refused = run("a.1", "c")
    assert refused.returncode == 2 and "setting 'c' is not declared in" in refused.stderr and not out.exists()
    assert run("a1").returncode == 2  # '.' is matched literally
    done = run("a.1")
    assert [line.split(":")[0] for line in done.stdout.strip().splitlines()] == ["a.1"]
    assert "vLLM is not installed here" in done.stdout  # the run got past its arguments to the vLLM check
    assert sorted(p.name for p in out.iterdir()) == ["a.1.tar.xz"]
    done = run()
    assert [line.split(":")[0] for line in done.stdout.strip().splitlines()] == ["a.1", "b"]
