"""No silent wrong answer (issue 47, class 3): a recipe's value is kept unless its flag is given; a setting the run
cannot honour, or that conflicts with another, is refused or stated where the result is shown."""

from __future__ import annotations

import json

import pytest
from _support import ROOT
from _support.cli import RECIPES

ARM_A = RECIPES / "arm_A.yaml"
DOCTOR_JSON = ROOT / "benchmarks" / "results" / "h200" / "doctor.json"


def _recipe(tmp_path, extra: str = ""):
    path = tmp_path / "r.yaml"
    path.write_text("num_generations: 2\nper_device_train_batch_size: 2\nmax_completion_length: 8\ngap: {arm: A}\n"
                    + extra)
    return path


def test_a_recipes_run_settings_are_kept_when_their_flags_are_not_given(tmp_path):
    from bloggap_plugin.trl.run import prepare_run

    recipe = _recipe(tmp_path, "seed: 7\nreport_to: tensorboard\nsave_steps: 5\nlogging_steps: 3\n")
    plan = prepare_run(str(recipe), model="tiny-random-qwen2", device="cpu", output_dir=str(tmp_path / "o"))
    args = plan.args
    assert (args.seed, args.report_to, args.save_steps, args.logging_steps) == (7, ["tensorboard"], 5, 3)
    assert args.save_strategy == "steps" and plan.config.seed == 7
    given = prepare_run(str(recipe), model="tiny-random-qwen2", device="cpu", output_dir=str(tmp_path / "o"), seed=3,
                        report_to="none")
    assert (given.args.seed, given.args.report_to, given.config.seed) == (3, [], 3)


def test_without_a_recipe_value_the_run_defaults_apply(tmp_path):
    from bloggap_plugin.trl.run import prepare_run

    plan = prepare_run(str(_recipe(tmp_path)), model="tiny-random-qwen2", device="cpu", output_dir=str(tmp_path / "o"))
    assert (plan.args.seed, plan.args.report_to, plan.args.save_strategy, plan.args.logging_steps) == (0, [], "no", 1)


@pytest.mark.parametrize("override, needle", [
    ({"max_steps": 3}, "--max-steps"), ({"seed": 5}, "--seeds"), ({"output_dir": "x"}, "--output-dir"),
    ({"report_to": "wandb"}, "report_to"),
])
def test_compare_refuses_an_override_of_what_each_run_takes_from_the_sweep(tmp_path, override, needle):
    from bloggap_plugin.compare import CompareConfig, CompareError, validate_config

    config = CompareConfig(recipes=[str(ARM_A)], seeds=[0, 1], max_steps=1, model="tiny-random-qwen2",
                           output_dir=str(tmp_path / "o"), extra_overrides=override, heldout_n=0)
    with pytest.raises(CompareError, match=needle):
        validate_config(config)


def test_a_run_whose_arm_did_not_take_effect_is_named_in_the_compare_table():
    from bloggap_plugin.compare.outputs import _not_in_effect_words
    from bloggap_plugin.compare.statistics import summarize_run

    why = "arm H: accelerate runs without fp16 autocast on this device (e.g. CPU)"
    summary = summarize_run([{"step": 1, "reward": 0.5}], {"wall_s": 1.0, "result": {"arm_not_in_effect": why}})
    assert summary["arm_not_in_effect"] == why
    words = _not_in_effect_words({"runs": {"H_s0": summary, "A_s0": summarize_run([], None)}})
    assert words.startswith("NOT IN EFFECT in run(s) H_s0: ") and why in words and "A_s0" not in words


def test_arm_not_in_effect_reads_the_trainers_autocast():
    from types import SimpleNamespace

    from bloggap_plugin.recipes import GapConfig
    from bloggap_plugin.trl.attach import arm_not_in_effect

    cpu = SimpleNamespace(accelerator=SimpleNamespace(native_amp=False))
    cuda = SimpleNamespace(accelerator=SimpleNamespace(native_amp=True))
    assert "takes effect on CUDA" in arm_not_in_effect(cpu, GapConfig(arm="H"))
    assert arm_not_in_effect(cuda, GapConfig(arm="H")) is None and arm_not_in_effect(cpu, GapConfig(arm="A")) is None


def _stored(edit) -> dict:
    document = json.loads(DOCTOR_JSON.read_text())
    edit(document)
    return document


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["cells"].append(dict(d["cells"][0])), "repeats the cell"),
    (lambda d: d["cells"][0].update(comparison="b1_vs_b99"), "not a doctor comparison"),
    (lambda d: d.update(schema_version=2), "schema_version 2"),
    (lambda d: d.update(benchmark="ladder"), "benchmark 'ladder'"),
    (lambda d: d.pop("schema_version"), "schema_version"),
    (lambda d: d["cells"][0].update(dtype="fp16", attn="flex_attention"), "do not list"),
])
def test_doctor_from_json_refuses_a_document_it_would_misread(bloggap, tmp_path, edit, needle):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(_stored(edit)))
    code, _, err = bloggap("doctor", "--from-json", path)
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err


def test_doctor_from_json_refuses_the_flags_it_would_ignore(bloggap):
    code, _, err = bloggap("doctor", "--from-json", DOCTOR_JSON, "--model", "tiny-random-qwen2", "--rows", "4")
    assert code == 2 and "--model, --rows would be ignored" in err
    code, out, _ = bloggap("doctor", "--from-json", DOCTOR_JSON, "--no-progress")
    assert code == 0 and "recommendation: arm H" in out


def test_gap_config_type_checks_every_field():
    from bloggap_plugin.recipes import GapConfig, RecipeError

    for kwargs in ({"band": "0.2"}, {"probe_rows": 1.5}, {"sampler": "yes"}, {"k": "8"}, {"probe_budget": "0"}):
        with pytest.raises(RecipeError, match=f"gap.{next(iter(kwargs))} must be"):
            GapConfig(**kwargs)
    assert GapConfig(band=0.2, probe_budget=0).band == 0.2


def test_arm_d_k_beyond_the_models_layers_is_refused_once_they_are_known():
    from bloggap_plugin.recipes import GapConfig, RecipeError

    with pytest.raises(RecipeError, match="gap.k 50.*2 decoder layers"):
        GapConfig(arm="D", k=50).check_layers(2)
    GapConfig(arm="D", k=2).check_layers(2)
    with pytest.warns(UserWarning, match=r"gap.k 8 \(the default\) is more than this model's 2 decoder layers"):
        GapConfig(arm="D").check_layers(2)  # the default is capped at the layers, and said so
    GapConfig(arm="A", k=50).check_layers(2)  # k is arm D's alone


def test_gap_overrides_are_type_checked(tmp_path):
    from bloggap_plugin.recipes import RecipeError
    from bloggap_plugin.trl.run import prepare_run

    with pytest.raises(RecipeError, match="band must be"):
        prepare_run(str(ARM_A), model="tiny-random-qwen2", device="cpu", output_dir=str(tmp_path),
                    gap_overrides={"band": "0.2"})
