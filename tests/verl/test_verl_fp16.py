"""Arm H in verl (issue 50 item 3, CPU part): the recipe composes against verl 0.9.1's Hydra config, and an fp16
actor or rollout is checked against the doctor's fp16 check when the trainer is constructed."""

from __future__ import annotations

import json
import os
import re
import types
import warnings

import pytest

pytest.importorskip("verl")

from omegaconf import OmegaConf  # noqa: E402

from bloggap_plugin.verl.config import SettingsError, load_settings  # noqa: E402
from bloggap_plugin.verl.fp16 import check_fp16, fp16_parts  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PARAM = "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"


def _config(param_dtype=None, rollout_dtype="bfloat16", **bloggap):
    actor = {"fsdp_config": {"mixed_precision": {"param_dtype": param_dtype}}} if param_dtype else {}
    cfg = {"actor_rollout_ref": {"actor": actor, "rollout": {"dtype": rollout_dtype}, "model": {"path": "/m/smol"}}}
    if bloggap:
        cfg["bloggap"] = bloggap
    return OmegaConf.create(cfg)


def _doctor(tmp_path, name="doctor.json", **check):
    fp16_check = {"nonfinite_logprobs": 0, "n": 128, "max_abs_hidden": 1200.0, "ok": True, **check}
    path = tmp_path / name
    path.write_text(json.dumps({"params": {"model": "smollm2"}, "fp16_check": fp16_check}))
    return path


def test_the_arm_h_recipe_puts_rollout_and_actor_in_fp16():
    import yaml
    from _support.verl_config import compose_ppo_trainer

    cfg = compose_ppo_trainer(yaml.safe_load(open(os.path.join(ROOT, "recipes", "verl", "arm_H.yaml")))["overrides"])
    assert cfg.actor_rollout_ref.rollout.dtype == "float16"
    assert fp16_parts(cfg) == [f"{PARAM}=fp16", "actor_rollout_ref.rollout.dtype=float16"]
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "gap_vanilla"


def test_a_failed_fp16_check_refuses_in_one_line_and_a_passed_one_does_not(tmp_path):
    failed = _doctor(tmp_path, "failed.json", nonfinite_logprobs=128, max_abs_hidden=54688.0, ok=False)
    config = _config("fp16", "float16", fp16_doctor=str(failed))
    with pytest.raises(SettingsError) as info:
        check_fp16(config, load_settings(config.bloggap))
    text = str(info.value)
    assert "\n" not in text and "the doctor's fp16 check failed on smollm2 (128 of 128 log-probs non-finite" in text
    assert text.endswith(f"drop {PARAM}=fp16 and actor_rollout_ref.rollout.dtype=float16 (arm A, E or B instead of H "
                         "or F)")
    # a large activation alone fails it too (over half of fp16's max), as the doctor's recommendation reads it
    near = _doctor(tmp_path, "near.json", max_abs_hidden=40000.0)
    with pytest.raises(SettingsError, match="largest \\|hidden\\| 40000.0"):
        check_fp16(_config(rollout_dtype="float16"), load_settings({"fp16_doctor": str(near)}))
    passed = _doctor(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_fp16(_config("fp16", "float16"), load_settings({"fp16_doctor": str(passed)}))


def test_without_fp16_nothing_is_read_and_without_a_doctor_it_warns(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_fp16(_config(), load_settings({"fp16_doctor": str(tmp_path / "absent.json")}))  # bf16: not read
    with pytest.warns(UserWarning, match=re.escape(f"{PARAM}=fp16 without a doctor check: run `bloggap doctor "
                                                   "--model /m/smol --json doctor.json`")):
        check_fp16(_config("fp16"), load_settings({}))


@pytest.mark.parametrize("content, words", [
    (None, "cannot read (No such file or directory)"),
    ("{", "not valid JSON"),
    (json.dumps({"cells": []}), "not a bloggap doctor result (no fp16_check)"),
    (json.dumps({"fp16_check": {"skipped": "no fp16 kernels on this CPU"}}),
     "the doctor skipped its fp16 check on its model (no fp16 kernels on this CPU)"),
])
def test_a_doctor_file_that_cannot_vouch_for_fp16_is_refused(tmp_path, content, words):
    path = tmp_path / "d.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SettingsError, match=re.escape(words)):
        check_fp16(_config("fp16"), load_settings({"fp16_doctor": str(path)}))


def test_the_trainer_constructor_refuses_before_building_anything(tmp_path, monkeypatch):
    """verl's V1 trainer constructor, as the plugin wraps it: the doctor's failed check stops it before the original
    constructor runs (no worker, no model)."""
    import sys

    stub = types.ModuleType("transfer_queue")
    stub.__getattr__ = lambda name: type(name, (), {})
    if "transfer_queue" not in sys.modules:
        monkeypatch.setitem(sys.modules, "transfer_queue", stub)
    import verl.trainer.ppo.v1.trainer_base as tb

    init = tb.PPOTrainer.__init__
    assert init.__bloggap_wrapped__
    built = []
    monkeypatch.setattr(init, "__bloggap_original__", lambda self, config: built.append(config))
    failed = _doctor(tmp_path, nonfinite_logprobs=3, ok=False)
    with pytest.raises(SettingsError, match="fp16 is not safe for this model"):
        init(types.SimpleNamespace(), _config("fp16", fp16_doctor=str(failed)))
    assert built == []
    init(types.SimpleNamespace(), _config(fp16_doctor=str(failed)))  # bf16 actor and rollout: not consulted
    assert len(built) == 1
