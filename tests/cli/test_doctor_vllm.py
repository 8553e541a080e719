"""The doctor's vLLM sampler column (issue 49 item 3): why it is absent, in one line each; the engine built with TRL
1.16's colocate keyword arguments (read from TRL's own source); and, with a stand-in engine on the CPU, the column's
cells exact where maths gives them."""

from __future__ import annotations

import ast
import json
import os
import sys
from types import SimpleNamespace

import pytest
from _support.fake_vllm import TeacherForcedLLM

from bloggap_plugin.cli import main
from bloggap_plugin.measure import doctor_vllm
from bloggap_plugin.measure.doctor_vllm import absent_reason
from bloggap_plugin.trl.vllm_colocate import trl_colocate_llm_kwargs, trl_colocate_sampling_kwargs

FOLDER = "/models/m"


def _reason(**given):
    facts = {"enabled": True, "device_type": "cuda", "version": "0.26.0", "folder": FOLDER, "model": "m"}
    return absent_reason(**{**facts, **given})


def test_each_absence_reason_is_one_line_naming_the_fix():
    assert _reason() is None
    assert _reason(enabled=False, device_type="cpu", version=None) == "turned off (--no-vllm)"
    assert _reason(device_type="cpu", version=None) == (
        "no CUDA device: the doctor ran on cpu, and vLLM samples on a CUDA GPU")
    assert _reason(version=None) == (
        'vLLM is not installed here: pip install -e ".[vllm]" (this project\'s extra, vLLM 0.26.0) or any vLLM '
        "0.22.0-0.31.0 (TRL 1.16's range) adds the column")
    assert _reason(version="0.32.1") == (
        "vLLM 0.32.1 is installed and the plugin supports vLLM 0.22.0-0.31.0 (TRL 1.16's range): install e.g. "
        "pip install vllm==0.26.0")
    assert _reason(version="0.31.0") is None  # the TRL range is the column's gate, not arm I's measured releases
    assert _reason(folder=None, model="tiny-random-qwen2") == (
        "vLLM loads a model folder with config.json, and 'tiny-random-qwen2' has none (a .gguf file or a "
        "tiny-random-* model built in memory): save it with save_pretrained and pass the folder as --model")


def test_this_cpu_machine_reads_no_vllm_and_imports_none(tiny):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    model, _ = tiny
    assert doctor_vllm.absent_here(True, "cpu", model, "tiny-random-llama") == _reason(device_type="cpu")
    assert doctor_vllm.absent_here(True, "cuda", model, "tiny-random-llama") == _reason(version=None)
    assert "vllm" not in sys.modules


def _trl_calls() -> tuple[dict, set]:
    """TRL 1.16's colocate ``LLM(...)`` keywords (constants as values, else the expression's text) and the keys of
    the ``generation_kwargs`` its colocate generation passes to ``SamplingParams``, read from TRL's source."""
    import trl.generation.vllm_generation as source

    tree = ast.parse(open(source.__file__).read())
    llm = next(node for node in ast.walk(tree) if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "LLM")
    keywords = {k.arg: k.value.value if isinstance(k.value, ast.Constant) else ast.unparse(k.value)
                for k in llm.keywords}
    sampling = next(node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                    and getattr(node.targets[0], "id", "") == "generation_kwargs" and isinstance(node.value, ast.Dict))
    return keywords, {key.value for key in sampling.keys}


def test_engine_and_sampling_kwargs_are_trls_colocate_ones():
    keywords, sampling_keys = _trl_calls()
    built = trl_colocate_llm_kwargs(FOLDER, max_num_seqs=8)
    assert set(built) == set(keywords)
    for name in ("distributed_executor_backend", "max_num_batched_tokens", "logprobs_mode"):
        assert built[name] == keywords[name]
    defaults = trl_colocate_sampling_kwargs(SimpleNamespace(), max_tokens=4)
    assert set(defaults) == sampling_keys and defaults["logprobs"] == 0  # TRL's VLLMGeneration default
    # generation_kwargs on top, as TRL updates the dict with them last
    assert trl_colocate_sampling_kwargs(SimpleNamespace(generation_kwargs={"max_tokens": 9}), 4)["max_tokens"] == 9


def _doctor(tmp_path, *argv) -> tuple[dict, str]:
    path = tmp_path / "doctor.json"
    assert main(["doctor", *argv, "--device", "cpu", "--json", str(path), "--no-progress"]) == 0
    return json.loads(path.read_text()), str(path)


def test_no_vllm_flag_says_so_in_the_json_the_table_and_the_print(tmp_path, capsys):
    result, _ = _doctor(tmp_path, "--model", "tiny-random-llama", "--rows", "2", "--new-tokens", "2", "--dtypes",
                        "bf16", "--no-vllm")
    assert result["vllm_sampler"] == {"absent": "turned off (--no-vllm)"}
    table = next(t for t in result["tables"] if t["id"] == "DOCTOR-vllm")
    assert table["rows"] == [] and table["notes"] == "absent: turned off (--no-vllm)"
    assert "vLLM sampler column: absent (turned off (--no-vllm))" in capsys.readouterr().out
    assert "With vLLM" not in result["recommendation"]["text"]


@pytest.fixture
def stand_in(monkeypatch):
    """The doctor measures the column on this CPU with :class:`TeacherForcedLLM` as vLLM 0.26.0."""
    monkeypatch.setattr(doctor_vllm, "absent_here", lambda *args: None)
    monkeypatch.setattr(doctor_vllm, "engine_classes", lambda: (TeacherForcedLLM, SimpleNamespace, "0.26.0"))
    TeacherForcedLLM.built.clear()
    TeacherForcedLLM.sampled.clear()


def test_the_column_with_a_stand_in_engine_is_exact_where_maths_gives_it(tmp_path, stand_in, capsys):
    from _support.trl_runs import saved_model_dir

    folder = saved_model_dir(tmp_path, "tiny-random-qwen2")
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    environment = {name: os.environ.get(name) for name in names}
    result, path = _doctor(tmp_path, "--model", folder, "--rows", "8", "--new-tokens", "2", "--dtype", "fp32")
    assert TeacherForcedLLM.built == [trl_colocate_llm_kwargs(folder, max_num_seqs=8, seed=1234)]
    assert {name: os.environ.get(name) for name in names} == environment  # TRL's process variables set while built
    column = result["vllm_sampler"]
    assert column["sampler"]["sampling"] == {**trl_colocate_sampling_kwargs(SimpleNamespace(), max_tokens=2),
                                             "ignore_eos": True}
    assert column["sampler"]["engine_dtype"] == "float32" and column["sampler"]["vllm"] == "0.26.0"
    assert column["sampler"]["batch_invariant"] is False  # no vLLM here: its batch-invariant mode cannot be on
    (sampled,) = TeacherForcedLLM.sampled
    assert [row.prompt for row in sampled] == [tuple(c) for c in _prompt_ids(result, folder)]
    cells = {c["dtype"]: c for c in column["cells"]}
    assert set(cells) == {"bf16", "fp16", "fp32"} and {c["attn"] for c in column["cells"]} == {"sdpa"}
    for c in cells.values():
        assert c["comparison"] == "sampler_vs_b1" and c["n"] == 8 * 2
    # the fp32 scoring is the stand-in's own computation: every token bit for bit equal, none out of band
    assert (cells["fp32"]["exact_count"], cells["fp32"]["oob_count"]) == (16, 0)
    # bf16 rounds the weights: its log-probs differ from the fp32 sampler's (bounded, not exact)
    assert cells["bf16"]["exact_count"] < 16 and cells["bf16"]["abs_dlogp_max"] > 0
    # arm I's form on this CPU: vLLM's maths in plain torch over a bf16 shadow, against the fp32 sampler: bounded
    arm_i = column["arm_i"]
    assert arm_i["pieces"] == "torch" and arm_i["cell"]["n"] == 16 and arm_i["cell"]["exact_count"] < 16
    assert arm_i["cell"]["batch_size"] == 8
    table = next(t for t in result["tables"] if t["id"] == "DOCTOR-vllm")
    assert table["rows"][2] == ["fp32/sdpa", 0.0, 100.0, 16] and table["rows"][3][0] == "arm I (pieces torch)"
    from bloggap_plugin.report_builder import render_table, validate_result

    validate_result(result, path)  # a result `bloggap report` renders, the column's table with it
    assert "| fp32/sdpa | 0.0 | 100.0 | 16 |" in render_table(table)
    printed = capsys.readouterr().out
    assert "  fp32/sdpa: 0.00% out of band (0/16), 100.00% bitwise (16/16)" in printed
    assert "  arm I's form (pieces torch, one batch): " in printed
    assert "With vLLM (TRL's colocate engine, vLLM 0.26.0, engine dtype float32)" in result["recommendation"]["text"]
    assert "arm I's form (pieces torch, one batch)" in result["recommendation"]["text"]
    # --from-json re-derives the same advice from the stored column
    assert main(["doctor", "--from-json", path]) == 0
    assert result["recommendation"]["text"] in capsys.readouterr().out


def test_arm_i_scores_with_vllm_kernels_only_where_they_are_the_measured_release():
    assert doctor_vllm.arm_i_pieces("cuda", "0.26.0") == "all"
    assert doctor_vllm.arm_i_pieces("cuda", "0.31.0") == "torch"  # read from its wheel, not yet measured
    assert doctor_vllm.arm_i_pieces("cpu", "0.26.0") == "torch"


def test_arm_i_on_a_family_it_does_not_compute_says_so(tiny_model):
    from bloggap_plugin.core.probe import Row

    model, _ = tiny_model("tiny-random-gpt_neox")
    samples = doctor_vllm.vllm_rollouts([Row((5, 6), (7, 8))], [[-1.0, -2.0]], 0, ["p"], {})
    row = doctor_vllm.arm_i_row(model, samples, 0.1, "torch")
    assert row["pieces"] == "torch" and row["absent"].startswith(
        "arm I's form: arms I and J compute Llama-family decoders the way vLLM does; GPTNeoXForCausalLM has model_type "
        "'gpt_neox' (supported: llama, qwen2)")


def _prompt_ids(result: dict, folder: str) -> list[list[int]]:
    from bloggap_plugin.measure.rollouts import encode_prompts
    from bloggap_plugin.models import load_model

    _, tokenizer = load_model(folder, dtype="fp32")
    from bloggap_plugin.core.probe import builtin_prompts

    return encode_prompts(tokenizer, builtin_prompts(result["rows"]))


def test_an_engine_that_fails_is_recorded_as_the_reason_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    class Broken:
        def __init__(self, **kwargs):
            raise RuntimeError("no memory left for the KV cache\nsecond line")

    monkeypatch.setattr(doctor_vllm, "absent_here", lambda *args: None)
    monkeypatch.setattr(doctor_vllm, "engine_classes", lambda: (Broken, SimpleNamespace, "0.26.0"))
    result, _ = _doctor(tmp_path, "--model", "tiny-random-llama", "--rows", "2", "--new-tokens", "2", "--dtypes",
                        "bf16")
    assert result["vllm_sampler"] == {"absent": "vLLM failed: RuntimeError: no memory left for the KV cache"}
    assert any(c["comparison"] == "sampler_vs_b1" and c["oob"] is not None for c in result["cells"])


def test_a_stored_column_with_an_impossible_count_is_refused(tmp_path, capsys):
    from _support.cli import stored_doctor_json

    document = stored_doctor_json()
    cell = {"dtype": "bf16", "attn": "sdpa", "comparison": "sampler_vs_b1", "oob": 0.0, "oob_count": 0, "n": 10,
            "exact_count": 11}
    document["vllm_sampler"] = {"cells": [cell], "sampler": {}}
    source = tmp_path / "stored.json"
    source.write_text(json.dumps(document))
    assert main(["doctor", "--from-json", str(source)]) == 2
    assert "vllm_sampler.cells[0].exact_count = 11" in capsys.readouterr().err



def test_vllm_rows_carry_nan_for_a_missing_log_prob_and_refuse_a_count_that_differs():
    from bloggap_plugin.core.probe import Row

    rows = [Row((1,), (2, 3)), Row((1,), (4,))]
    samples = doctor_vllm.vllm_rollouts(rows, [[-0.5, None], [-1.5]], 0, ["a", "b"], {"engine": "vllm"})
    assert samples.sampler_mask.tolist() == [[True, True], [True, False]]
    assert samples.sampler_logprobs[0, 0].item() == -0.5 and samples.sampler_logprobs[0, 1].isnan()
    with pytest.raises(ValueError, match="vLLM completion 1: 1 tokens but 2 log-probs"):
        doctor_vllm.vllm_rollouts(rows, [[-0.5, -1.0], [-1.5, -2.0]], 0, ["a", "b"], {})


def test_the_printed_column_names_a_skipped_scoring_and_an_absent_arm_i():
    from bloggap_plugin.commands.doctor import format_vllm_column

    record = {"sampler": {"vllm": "0.26.0", "engine_dtype": "bfloat16"},
              "cells": [{"dtype": "fp16", "attn": "eager", "oob": None, "skipped": "fp16/eager failed: X"}],
              "arm_i": {"pieces": "all", "absent": "arm I's form failed: Y"}}
    assert format_vllm_column(record).splitlines()[1:] == ["  fp16/eager: - (fp16/eager failed: X)",
                                                           "  arm I's form: absent (arm I's form failed: Y)"]
    assert format_vllm_column(None) is None  # a run from before the column prints nothing for it


def test_the_printed_arm_i_row_says_its_engine_was_not_batch_invariant():
    from bloggap_plugin.commands.doctor import format_vllm_column

    cell = {"oob": 0.1, "oob_count": 1, "exact_count": 0, "n": 10}
    record = {"sampler": {"vllm": "0.26.0", "engine_dtype": "bfloat16", "batch_invariant": False}, "cells": [],
              "arm_i": {"pieces": "all", "cell": cell}}
    assert format_vllm_column(record).splitlines()[-1] == (
        "  arm I's form (pieces all, one batch): 10.00% out of band (1/10), 0.00% bitwise (0/10); the engine ran "
        "without vLLM's batch-invariant mode, which arm I's own engine runs (VLLM_BATCH_INVARIANT=1)")
    record["sampler"]["batch_invariant"] = True
    assert format_vllm_column(record).splitlines()[-1].endswith("0.00% bitwise (0/10)")
    table = doctor_vllm.column_table({**record, "sampler": {**record["sampler"], "batch_invariant": False}}, "m")
    assert "the engine ran without vLLM's batch-invariant mode" in table["notes"]
