"""bloggap's verl integration against the real verl 0.9.1 on CPU (one verl import shared by the module)."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import math
import os
import re
import subprocess
import sys
import types

import pytest
import torch
from _support import ROOT
from _support.events import HANG_S
from _support.forked_cases import run_forked
from _support.verl_config import compose_ppo_trainer

verl = pytest.importorskip("verl")

from omegaconf import OmegaConf  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: E402
from verl.trainer.ppo import rollout_corr_helper  # noqa: E402
from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla, get_policy_loss_fn  # noqa: E402
from verl.workers.config.actor import ActorConfig, PolicyLossConfig  # noqa: E402

import bloggap_plugin.verl as bverl  # noqa: E402
from bloggap_plugin.core.truncation import kept_mask, log_kept_mass, log_kept_mass_from_size  # noqa: E402
from bloggap_plugin.verl.correction import AllRejectedError, infer_preset, trainer_step  # noqa: E402
from bloggap_plugin.verl.engine import fp32_output_head, log_kept_mass_rows  # noqa: E402

ROOT = str(ROOT)
B, T, V = 48, 96, 400
NOISE = 0.004  # nats of trainer/rollout numerical mismatch per token


# ------------------------------------------------------------------------------------------------ fixtures


def _trainer_config(top_p=1.0, top_k=-1, **bloggap):
    cfg = {"actor_rollout_ref": {"rollout": {"temperature": 1.0, "top_p": top_p, "top_k": top_k}}}
    if bloggap:
        cfg["bloggap"] = bloggap
    return OmegaConf.create(cfg)


@pytest.fixture(scope="module")
def batches():
    """Synthetic rollouts per sampling arm: full-vocab trainer log-probs (+ noise) vs kept-set rollout log-probs."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=gen) * 3.0
    noise = torch.randn(B, T, generator=gen) * NOISE
    lengths = torch.randint(T // 2, T + 1, (B,), generator=gen)
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    out = {}
    for name, top_p, top_k in (("control", 1.0, 0), ("top_p0.8", 0.8, 0), ("top_p0.95", 0.95, 0), ("top_k20", 1.0, 20)):
        kept = kept_mask(logits, top_p=top_p, top_k=top_k)
        probs = torch.softmax(logits.masked_fill(~kept, float("-inf")), dim=-1)
        tokens = torch.multinomial(probs.reshape(-1, V), 1, generator=gen).reshape(B, T)
        full = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        log_mass = log_kept_mass(logits, kept)
        out[name] = {
            "old": (full + noise) * mask,
            "rollout": (full - log_mass) * mask,  # vLLM processed_logprobs: normalised over the kept set
            "mask": mask,
            "sizes": kept.sum(-1),
            "log_mass": log_mass,
            "logits": logits,
            "tokens": tokens,
            "top_p": top_p,
            "top_k": top_k,
        }
    return out


def _seq_rejected(preset: RolloutCorrectionConfig, old, rollout, mask) -> float:
    _, new_mask, metrics = rollout_corr_helper.compute_rollout_correction_and_rejection_mask(
        old_log_prob=old,
        rollout_log_prob=rollout,
        response_mask=mask,
        rollout_is=preset.rollout_is,
        rollout_is_threshold=preset.rollout_is_threshold,
        rollout_rs=preset.rollout_rs,
        rollout_rs_threshold=preset.rollout_rs_threshold,
    )
    return metrics["rollout_corr/rollout_rs_seq_masked_fraction"]


PRESETS = {"geo_rs": RolloutCorrectionConfig.decoupled_geo_rs(), "seq_mis": RolloutCorrectionConfig.decoupled_seq_is_rs()}


# ------------------------------------------------------------------------------------------------ entry point


def test_entry_point_group_is_the_one_verl_loads():
    eps = [ep for ep in importlib.metadata.entry_points(group="verl.plugins") if ep.name == "bloggap"]
    assert len(eps) == 1 and eps[0].value == "bloggap_plugin.verl"
    source = open(os.path.join(os.path.dirname(verl.__file__), "__init__.py")).read()
    assert '_entry_points(group="verl.plugins")' in source
    assert bverl.is_registered()  # importing verl above loaded the entry point


def test_entry_point_registers_in_a_fresh_process_and_env_var_disables(tmp_path, spawns):
    """Each case in a process of its own, forked after torch loaded and before verl or the plugin did."""
    registered = ("import verl, sys; from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R; "
                  "print('REG', 'bloggap_plugin.verl' in sys.modules, 'gap_vanilla' in R)")
    disabled = "import bloggap_plugin.verl as b; print('REG', b.is_registered())"
    run, off = run_forked(tmp_path, "import torch, torch._dynamo; torch.set_num_threads(1)",
                          [({}, registered), ({"BLOGGAP_VERL_DISABLE": "1"}, disabled)],
                          not_loaded=("verl", "bloggap_plugin.verl"), env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert "REG True True" in run.stdout, run.stderr[-2000:]
    assert run.stderr.count("bloggap verl plugin registered") == 1
    assert "REG False" in off.stdout, off.stderr[-2000:]


def test_register_twice_is_idempotent():
    import verl.workers.engine.fsdp.transformer_impl  # noqa: F401
    from verl.workers.engine.base import EngineRegistry

    before = {k: dict(v) for k, v in EngineRegistry._engines["language_model"].items()}
    assert bverl.register(force=True) and bverl.register(force=True)
    assert {k: dict(v) for k, v in EngineRegistry._engines["language_model"].items()} == before
    wrapped = rollout_corr_helper.compute_rollout_correction_and_add_to_batch
    assert wrapped.__bloggap_wrapped__ and not getattr(wrapped.__bloggap_original__, "__bloggap_wrapped__", False)


# ------------------------------------------------------------------------------------------------ environment


def _clear_bloggap_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("BLOGGAP_VERL_"):
            monkeypatch.delenv(name)


BAD_ENV = [
    ("BLOGGAP_VERL_BAND", "abc", "a number in (0, 1)"),
    ("BLOGGAP_VERL_BAND", "1.5", "a number in (0, 1)"),
    ("BLOGGAP_VERL_BAND", "0", "a number in (0, 1)"),
    ("BLOGGAP_VERL_BAND", "nan", "a number in (0, 1)"),
    ("BLOGGAP_VERL_GUARD", "loud", "warn, raise, off"),
    ("BLOGGAP_VERL_DISABLE", "2", "1, 0, true, false, yes, no, on, off"),
    ("BLOGGAP_VERL_FP32_HEAD", "maybe", "1, 0, true, false, yes, no, on, off"),
    ("BLOGGAP_VERL_FIX_TRUNCATION", "2", "1, 0, true, false, yes, no, on, off"),
    ("BLOGGAP_VERL_KEPT_SOURCE", "sizes", "auto, support_size, retruncate, off"),
    ("BLOGGAP_VERL_TOP_P", "0", "a number in (0, 1]"),
    ("BLOGGAP_VERL_TOP_P", "1.5", "a number in (0, 1]"),
    ("BLOGGAP_VERL_TOP_K", "2.5", "an integer >= -1"),
    ("BLOGGAP_VERL_TOP_K", "-2", "an integer >= -1"),
    ("BLOGGAP_VERL_MIN_P", "1", "a number in [0, 1)"),
    ("BLOGGAP_VERL_MIN_P", "x", "a number in [0, 1)"),
]


@pytest.mark.parametrize("name,value,allowed", BAD_ENV)
def test_bad_environment_value_fails_at_registration_naming_the_variable(monkeypatch, name, value, allowed):
    _clear_bloggap_env(monkeypatch)
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as err:
        bverl.register()
    message = str(err.value.code)
    assert f"{name}={value!r}" in message and allowed in message, message
    assert "\n" not in message


def test_unknown_bloggap_variable_fails_at_registration(monkeypatch):
    _clear_bloggap_env(monkeypatch)
    monkeypatch.setenv("BLOGGAP_VERL_BNAD", "0.05")
    with pytest.raises(SystemExit) as err:
        bverl.register()
    message = str(err.value.code)
    assert "BLOGGAP_VERL_BNAD" in message and "BLOGGAP_VERL_BAND" in message, message


GOOD_ENV = [
    ({}, {"band": 0.1, "guard": "warn", "fp32_head": False, "fix_truncation": True, "kept_source": "auto", "top_k": None}),
    ({"BLOGGAP_VERL_BAND": "0.05"}, {"band": 0.05}),
    ({"BLOGGAP_VERL_BAND": ""}, {"band": 0.1}),  # empty = unset
    ({"BLOGGAP_VERL_GUARD": "raise"}, {"guard": "raise"}),
    ({"BLOGGAP_VERL_GUARD": " Off "}, {"guard": "off"}),
    ({"BLOGGAP_VERL_FP32_HEAD": "1", "BLOGGAP_VERL_FIX_TRUNCATION": "no"}, {"fp32_head": True, "fix_truncation": False}),
    ({"BLOGGAP_VERL_KEPT_SOURCE": "retruncate"}, {"kept_source": "retruncate"}),
    ({"BLOGGAP_VERL_TOP_P": "1", "BLOGGAP_VERL_TOP_K": "20", "BLOGGAP_VERL_MIN_P": "0"}, {"top_p": 1.0, "top_k": 20, "min_p": 0.0}),
    ({"BLOGGAP_VERL_TOP_K": "none", "BLOGGAP_VERL_TOP_P": "null"}, {"top_k": None, "top_p": None}),
    ({"BLOGGAP_VERL_DISABLE": "0"}, {}),
    ({"BLOGGAP_VERL_DISABLE": "off"}, {}),
]


@pytest.mark.parametrize("env,expected", GOOD_ENV)
def test_good_environment_values_register_and_are_read(monkeypatch, env, expected):
    from bloggap_plugin.verl.config import load_settings

    _clear_bloggap_env(monkeypatch)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert bverl.register() is True
    settings = load_settings()
    for field_name, value in expected.items():
        assert getattr(settings, field_name) == value, field_name


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_disable_values_switch_registration_off(monkeypatch, value):
    _clear_bloggap_env(monkeypatch)
    monkeypatch.setenv("BLOGGAP_VERL_DISABLE", value)
    assert bverl.register() is False


def test_hydra_node_values_are_validated_too():
    from bloggap_plugin.verl.config import load_settings

    for node, needle in (
        ({"guard": "loud"}, "bloggap.guard='loud'"),
        ({"band": "abc"}, "bloggap.band='abc'"),
        ({"top_k": 2.5}, "bloggap.top_k=2.5"),
        ({"fp32_head": 2}, "bloggap.fp32_head=2"),
    ):
        with pytest.raises(ValueError, match=re.escape(needle)):
            load_settings(node, environ={})
    assert load_settings({"band": 0.3, "top_k": 5}, environ={"BLOGGAP_VERL_BAND": "0.2"}).band == 0.3  # node wins



def _gap_vanilla_actor_config() -> ActorConfig:
    """verl's actor config with the plugin's ``gap_vanilla`` policy loss (one micro-batch, clip 0.2, token-mean)."""
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=0.2,
        loss_agg_mode="token-mean",
        policy_loss=PolicyLossConfig(loss_mode="gap_vanilla"),
    )

def test_loss_band_comes_from_the_environment(monkeypatch):
    _clear_bloggap_env(monkeypatch)
    config = _gap_vanilla_actor_config()
    old = torch.zeros(1, 4)
    new = torch.tensor([[0.0, 0.03, -0.07, 0.2]])  # ratios 1, 1.030, 0.932, 1.221
    adv, mask = torch.ones(1, 4), torch.ones(1, 4)
    loss_fn = get_policy_loss_fn("gap_vanilla")
    for band, expected in (("0.1", 0.25), ("0.05", 0.5), ("0.02", 0.75)):
        monkeypatch.setenv("BLOGGAP_VERL_BAND", band)
        _, metrics = loss_fn(old, new, adv, mask, "token-mean", config, None)
        assert metrics["gap/ratio/oob_frac"] == expected, band


def test_bad_band_read_by_the_loss_gives_the_same_one_line_error(monkeypatch):
    """The loss runs in workers, which read BLOGGAP_VERL_BAND themselves: a bad value stops it with the message
    registration gives, not a float() traceback or a silent default."""
    from bloggap_plugin.verl.config import SettingsError, read_environment

    _clear_bloggap_env(monkeypatch)
    monkeypatch.setenv("BLOGGAP_VERL_BAND", "1.5")
    with pytest.raises(SettingsError) as at_registration:
        read_environment()
    expected = "BLOGGAP_VERL_BAND='1.5' is not valid: expected a number in (0, 1), e.g. 0.1"
    assert str(at_registration.value) == expected
    old, new = torch.zeros(1, 4), torch.tensor([[0.0, 0.03, -0.07, 0.2]])
    with pytest.raises(SettingsError) as in_loss:
        get_policy_loss_fn("gap_vanilla")(old, new, torch.ones(1, 4), torch.ones(1, 4), "token-mean",
                                          _gap_vanilla_actor_config(), None)
    assert str(in_loss.value) == expected


def test_settings_dataclass_carries_help_and_types_from_annotations():
    """One table: every setting is a dataclass field with help metadata, parsed by the type of its annotation
    (no second name -> parser table to keep in step with the fields)."""
    import dataclasses
    import typing

    from bloggap_plugin.verl import config as vconfig

    hints = typing.get_type_hints(vconfig.BloggapVerlConfig)
    for item in dataclasses.fields(vconfig.BloggapVerlConfig):
        assert len(item.metadata.get("help", "")) > 20, item.name
        assert vconfig.setting_parser(item.name) is not None, item.name
    assert hints["band"] is float and hints["top_k"] == (int | None)
    assert not hasattr(vconfig, "_PARSERS")
    # the parsed value has the annotation's type, whatever the source's type
    settings = vconfig.load_settings({"band": "0.25", "top_k": "7", "fp32_head": "yes", "guard": "RAISE"}, environ={})
    assert (settings.band, settings.top_k, settings.fp32_head, settings.guard) == (0.25, 7, True, "raise")
    assert type(settings.band) is float and type(settings.top_k) is int


def test_only_config_reads_bloggap_environment_variables():
    package = os.path.join(ROOT, "bloggap_plugin", "verl")
    for name in sorted(os.listdir(package)):
        if name.endswith(".py") and name != "config.py":
            source = open(os.path.join(package, name)).read()
            assert "os.environ" not in source and "getenv" not in source, name


def test_import_verl_with_a_bad_value_exits_with_one_line(tmp_path, spawns):
    env = dict(os.environ, PYTHONWARNINGS="ignore", BLOGGAP_VERL_GUARD="loud")
    run = subprocess.run(
        [sys.executable, "-c", "import torch; torch.set_num_threads(1); import verl; print('TRAINED ANYWAY')"],
        capture_output=True,
        text=True,
        env=env,
        timeout=HANG_S,
    )
    assert run.returncode != 0 and "TRAINED ANYWAY" not in run.stdout
    assert "Traceback" not in run.stderr, run.stderr[-2000:]
    assert "BLOGGAP_VERL_GUARD='loud'" in run.stderr.strip().splitlines()[-1]


# ------------------------------------------------------------------------------------------------ lift maths


def test_lift_adds_log_kept_mass_on_response_tokens_only():
    rollout = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -0.2, 0.0]])
    log_mass = torch.tensor([[-0.1, -0.2, -0.3], [-0.05, 0.0, -0.7]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    lifted = bverl.lift_rollout_log_probs(rollout, log_mass, mask)
    assert torch.equal(lifted, torch.tensor([[-0.6, -1.2, -2.0], [-0.15, -0.2, 0.0]]))
    with pytest.raises(ValueError, match="<= 0"):
        bverl.lift_rollout_log_probs(rollout, -log_mass + 0.5, mask)
    with pytest.raises(ValueError, match="shape mismatch"):
        bverl.lift_rollout_log_probs(rollout, log_mass[:, :2], mask)


# ------------------------------------------------------------------------------------------------ presets vs truncation


@pytest.mark.parametrize("arm", ["top_p0.8", "top_p0.95", "top_k20"])
@pytest.mark.parametrize("preset", ["geo_rs", "seq_mis"])
def test_truncation_rejects_everything_and_the_lift_restores_the_control(batches, arm, preset):
    b, control = batches[arm], batches["control"]
    cfg = PRESETS[preset]
    assert _seq_rejected(cfg, control["old"], control["rollout"], control["mask"]) < 0.5
    assert _seq_rejected(cfg, b["old"], b["rollout"], b["mask"]) == 1.0
    # exact replay (kept-set sizes, as the patched verl ships them) and re-truncation from the actor's logits
    flat = b["logits"].reshape(-1, V)
    by_size = log_kept_mass_from_size(b["logits"], b["sizes"])
    retrunc = log_kept_mass_rows(flat, b["tokens"].reshape(-1), top_p=b["top_p"], top_k=b["top_k"]).reshape(B, T)
    control_rate = _seq_rejected(cfg, control["old"], control["rollout"], control["mask"])
    for log_mass in (by_size, retrunc):
        lifted = bverl.lift_rollout_log_probs(b["rollout"], log_mass, b["mask"])
        # same noise as the control, so after the lift only float rounding can move a boundary sequence
        assert _seq_rejected(cfg, b["old"], lifted, b["mask"]) <= control_rate + 1.0 / B


def test_wrapper_lifts_from_batch_and_guard_fires_without(batches, caplog):
    b = batches["top_p0.8"]
    cfg = OmegaConf.structured(RolloutCorrectionConfig.decoupled_geo_rs())
    fn = rollout_corr_helper.compute_rollout_correction_and_add_to_batch

    def batch(with_mass):
        tensors = {"old_log_probs": b["old"], "rollout_log_probs": b["rollout"].clone(), "response_mask": b["mask"]}
        if with_mass:
            tensors["log_kept_mass"] = log_kept_mass_from_size(b["logits"], b["sizes"]) * b["mask"]
        return DataProto.from_dict(tensors=tensors)

    with trainer_step(_trainer_config(top_p=0.8)):
        with caplog.at_level(logging.WARNING, logger="bloggap.verl"):
            out, metrics = fn(batch(False), cfg)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == 1.0
    assert metrics["gap/verl/all_rejected"] == 1.0 and metrics["gap/verl/kept_source"] == 0.0
    assert out.batch["response_mask"].sum() == 0
    text = caplog.text
    for needle in ("decoupled_geo_rs (Geo-RS)", "0.999_1.001", "top_p=0.8", "top_k=-1", "temperature=1.0", "Fix:"):
        assert needle in text, needle

    with trainer_step(_trainer_config(top_p=0.8)):
        out, metrics = fn(batch(True), cfg)
    assert metrics["gap/verl/all_rejected"] == 0.0
    assert metrics["gap/verl/kept_source"] == 2.0  # auto without return_sampling_mask -> re-truncation source
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] < 0.5
    assert metrics["gap/verl/log_kept_mass_mean"] == pytest.approx(
        float(b["log_mass"][b["mask"].bool()].double().mean()), abs=1e-6
    )

    with trainer_step(_trainer_config(top_p=0.8, guard="raise")):
        with pytest.raises(AllRejectedError, match="Geo-RS"):
            fn(batch(False), cfg)


@pytest.fixture
def root_logger_at_error():
    """The root logger as vLLM leaves it in verl's TaskRunner: vLLM's API routers import
    model_hosting_container_standards, whose logging_config.configure_root_logger() sets the root logger and its
    handlers to SAGEMAKER_CONTAINER_LOG_LEVEL, default ERROR (found on the H200, 2026-12-01: the guard fired
    on every step of geo_rs/guard and no warning reached the console or the Ray workers' own log files)."""
    root = logging.getLogger()
    saved = root.level, [(h, h.level) for h in root.handlers]
    root.setLevel(logging.ERROR)
    for handler in root.handlers:
        handler.setLevel(max(handler.level, logging.ERROR))
    yield
    root.setLevel(saved[0])
    for handler, level in saved[1]:
        handler.setLevel(level)


def test_guard_warning_survives_a_root_logger_raised_to_error(batches, root_logger_at_error, capsys):
    b = batches["top_p0.8"]
    cfg = OmegaConf.structured(RolloutCorrectionConfig.decoupled_geo_rs())
    data = DataProto.from_dict(tensors={"old_log_probs": b["old"], "rollout_log_probs": b["rollout"].clone(),
                                        "response_mask": b["mask"]})
    capsys.readouterr()
    with trainer_step(_trainer_config(top_p=0.8)):
        _, metrics = rollout_corr_helper.compute_rollout_correction_and_add_to_batch(data, cfg)
    assert metrics["gap/verl/all_rejected"] == 1.0
    err = capsys.readouterr().err
    assert err.count("bloggap: rollout correction preset decoupled_geo_rs (Geo-RS)") == 1, err[-2000:]
    assert err.startswith("WARNING:")  # verl's own format, as its "verl" logger writes


def test_guard_detects_sequence_is_weights_at_the_floor():
    # 256-token responses at top_k=20: sum of log kept mass ~ -40 nats per sequence, below the -20 clamp
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(8, 256, V, generator=gen) * 3.0
    kept = kept_mask(logits, top_k=20)
    tokens = torch.multinomial(torch.softmax(logits.masked_fill(~kept, float("-inf")), -1).reshape(-1, V), 1, generator=gen)
    full = torch.log_softmax(logits, -1).gather(-1, tokens.reshape(8, 256, 1)).squeeze(-1)
    rollout = full - log_kept_mass(logits, kept)
    cfg = OmegaConf.structured(RolloutCorrectionConfig.decoupled_seq_is())
    data = DataProto.from_dict(
        tensors={"old_log_probs": full, "rollout_log_probs": rollout, "response_mask": torch.ones(8, 256)}
    )
    with trainer_step(_trainer_config(top_k=20, fix_truncation=False)):
        _, metrics = rollout_corr_helper.compute_rollout_correction_and_add_to_batch(data, cfg)
    assert metrics["gap/verl/is_floor_frac"] == 1.0 and metrics["gap/verl/all_rejected"] == 1.0
    assert metrics["rollout_corr/rollout_is_seq_max"] <= math.exp(-20) * 1.001


def test_infer_preset_names_presets_and_custom_configs():
    assert infer_preset(RolloutCorrectionConfig.decoupled_seq_is_rs()) == "decoupled_seq_is_rs (Seq-MIS)"
    assert infer_preset(RolloutCorrectionConfig.decoupled_k3_rs()) == "decoupled_k3_rs (K3-RS)"
    wider = RolloutCorrectionConfig.decoupled_geo_rs(rs_threshold="0.99_1.01")
    assert infer_preset(wider) == "custom, like decoupled_geo_rs (Geo-RS) with another threshold"


# ------------------------------------------------------------------------------------------------ policy loss


def test_gap_vanilla_is_vanilla_plus_metrics():
    config = _gap_vanilla_actor_config()
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0, -1.0]])
    delta = torch.tensor([[0.0, 0.2, -0.3, 0.05, 0.9]])
    new = (old + delta).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    loss_fn = get_policy_loss_fn(config.policy_loss.loss_mode)
    loss, metrics = loss_fn(old, new, adv, mask, "token-mean", config, None)
    ref_loss, ref_metrics = compute_policy_loss_vanilla(old, new, adv, mask, "token-mean", config, None)
    assert torch.equal(loss, ref_loss)
    for key, value in ref_metrics.items():
        assert metrics[key] == value
    # ratios on the 4 masked tokens: 1, e^0.2=1.221 (A>0: clipped), e^-0.3=0.741 (A<0: clipped), e^0.05=1.051
    assert metrics["gap/ratio/oob_frac"] == 0.5
    assert metrics["gap/clip/flip_frac"] == 0.5 and metrics["gap/clip/clipped_frac"] == 0.5
    assert metrics["gap/ratio/abs_dlogp_mean"] == pytest.approx(0.55 / 4, abs=1e-7)
    assert metrics["gap/ratio/abs_dlogp_max"] == pytest.approx(0.3, abs=1e-7)


class _StandInWorker:
    """What verl's ``TrainingWorker.train_mini_batch`` reads of its worker, on one CPU process: its ``train_batch``
    runs ``gap_vanilla`` on the mini-batch with the policy's log-probs ``old + shift`` and then takes its optimizer
    step (``shift`` grows by 0.25 nats), so after k steps every token's ``|new - old|`` is exactly 0.25 k."""

    class _Engine:
        def get_data_parallel_size(self):
            return 1

        def get_data_parallel_rank(self):
            return 0

        def is_mp_src_rank_with_outputs(self):
            return True

        def train_mode(self, disable_auto_offload=False):
            import contextlib

            return contextlib.nullcontext()

    class _Profiler:
        def step(self):
            pass

    def __init__(self):
        self.engine, self.profiler, self.shift, self.config = self._Engine(), self._Profiler(), 0.0, _gap_vanilla_actor_config()

    def train_batch(self, data):
        from verl.utils import tensordict_utils as tu

        old = data["old_log_probs"]
        loss_fn = get_policy_loss_fn("gap_vanilla")
        _, metrics = loss_fn(old, old + self.shift, data["advantages"], data["response_mask"], "token-mean",
                             self.config, None)
        self.shift += 0.25  # the optimizer step at the end of the mini-batch
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {k: [[v]] for k, v in metrics.items()}})  # [dp][micro]


def test_verl_logs_the_first_mini_batch_as_the_gap_and_later_ones_as_the_update(monkeypatch):
    """verl's own mini-batch loop (``train_mini_batch``, 2 mini-batches x 2 epochs): only the first mini-batch, with
    no optimizer step since the old log-probs, logs ``gap/ratio/*`` (exactly 0 here: new == old); the three after
    a step log ``gap/update/*``, each the shift its steps made (0.25, 0.5, 0.75 nats)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers import engine_workers

    from bloggap_plugin.verl.loss import optimizer_steps_since_old

    _clear_bloggap_env(monkeypatch)
    assert getattr(engine_workers.TrainingWorker.train_mini_batch, "_bloggap_counts_steps", False)  # by the plugin
    rows = 8
    data = TensorDict({"old_log_probs": torch.full((rows, 4), -1.0), "advantages": torch.ones(rows, 4),
                       "response_mask": torch.ones(rows, 4)}, batch_size=[rows])
    tu.assign_non_tensor(data, num_mini_batch=2, epochs=2)
    worker = _StandInWorker()
    output = engine_workers.TrainingWorker.train_mini_batch(worker, data)
    metrics = tu.get(output, "metrics")  # per key: the values of the mini-batches that logged it, in order
    assert metrics["gap/ratio/abs_dlogp_max"] == [0.0] and metrics["gap/ratio/oob_frac"] == [0.0]
    assert metrics["gap/update/abs_dlogp_mean"] == pytest.approx([0.25, 0.5, 0.75], abs=1e-6)
    assert metrics["gap/update/oob_frac"] == [1.0, 1.0, 1.0]  # exp(0.25) > 1.1
    assert "train_batch" not in vars(worker) and optimizer_steps_since_old() == 0  # nothing outlives the loop
    # outside verl's loop (the loss called directly) a pass counts as the first
    loss_fn = get_policy_loss_fn("gap_vanilla")
    _, direct = loss_fn(data["old_log_probs"], data["old_log_probs"], data["advantages"], data["response_mask"],
                        "token-mean", _gap_vanilla_actor_config(), None)
    assert direct["gap/ratio/oob_frac"] == 0.0 and not any(k.startswith("gap/update/") for k in direct)


def test_verl_clip_metrics_of_the_first_mini_batch_apart_from_the_update(monkeypatch):
    """The clip statistics split like the ratio's: verl's loop (2 mini-batches x 2 epochs, every advantage 1, clip
    0.2) clips nothing on the first mini-batch (ratio exactly 1: ``gap/clip/*`` 0) and every token after a step
    (ratio exp(0.25 k) > 1.2: ``gap/update_clip/*`` 1), and no later mini-batch writes under ``gap/clip/*``."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers import engine_workers

    _clear_bloggap_env(monkeypatch)
    rows = 8
    data = TensorDict({"old_log_probs": torch.full((rows, 4), -1.0), "advantages": torch.ones(rows, 4),
                       "response_mask": torch.ones(rows, 4)}, batch_size=[rows])
    tu.assign_non_tensor(data, num_mini_batch=2, epochs=2)
    metrics = tu.get(engine_workers.TrainingWorker.train_mini_batch(_StandInWorker(), data), "metrics")
    assert metrics["gap/clip/clipped_frac"] == [0.0] and metrics["gap/clip/flip_frac"] == [0.0]
    assert metrics["gap/update_clip/clipped_frac"] == [1.0, 1.0, 1.0]
    assert metrics["gap/update_clip/flip_frac"] == [1.0, 1.0, 1.0]


# ------------------------------------------------------------------------------------------------ engine


def test_engine_registry_resolves_the_override(monkeypatch):
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from bloggap_plugin.verl.engine import engine_class

    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cuda")
    for vendor, expected in (("nvidia", engine_class()), ("bloggap", engine_class()), ("amd", FSDPEngineWithLMHead)):
        monkeypatch.setenv("VERL_ENGINE_VENDOR", vendor)
        for backend in ("fsdp", "fsdp2"):
            assert EngineRegistry.get_engine_cls("language_model", backend) is expected, (vendor, backend)
    assert issubclass(engine_class(), FSDPEngineWithLMHead)


def test_fp32_head_on_a_tiny_bf16_model_leaves_weights_alone(tiny_model):
    model, _ = tiny_model("tiny-random-llama", "bf16")
    head = model.get_output_embeddings()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    captured = {}
    pre = head.register_forward_pre_hook(lambda m, a: captured.__setitem__("h", a[0].detach().clone()))
    with torch.no_grad():
        bf16_logits = model(input_ids=ids).logits
        with fp32_output_head(model):
            fp32_logits = model(input_ids=ids).logits
        after_logits = model(input_ids=ids).logits
    pre.remove()
    assert bf16_logits.dtype == torch.bfloat16 and fp32_logits.dtype == torch.float32
    assert after_logits.dtype == torch.bfloat16 and torch.equal(after_logits, bf16_logits)  # hook removed
    reference = (captured["h"].double() @ head.weight.double().T).float()
    ref_lp = torch.log_softmax(reference.double(), -1)
    err_fp32 = (torch.log_softmax(fp32_logits, -1).double() - ref_lp).abs().max().item()
    err_bf16 = (torch.log_softmax(bf16_logits.float(), -1).double() - ref_lp).abs().max().item()
    assert err_fp32 < 1e-5 and err_bf16 > 10 * err_fp32
    for key, value in model.state_dict().items():
        assert torch.equal(value, weights[key]), key


def test_log_kept_mass_rows_against_an_independent_sort():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(40, 64, generator=gen) * 2
    sizes = torch.randint(0, 9, (40,), generator=gen)
    temperature = 0.7
    got = log_kept_mass_rows(logits, torch.zeros(40, dtype=torch.long), sizes=sizes, temperature=temperature, chunk_rows=7)
    probs = torch.softmax(logits.double() / temperature, -1).sort(-1, descending=True).values
    expected = torch.stack([probs[i, : max(int(s), 0)].sum() if s > 0 else probs.new_tensor(1.0) for i, s in enumerate(sizes)])
    assert torch.allclose(got.double(), expected.log(), atol=1e-5)
    # top_k=1 re-truncation keeps the argmax plus the sampled label
    labels = torch.randint(0, 64, (40,), generator=gen)
    got = log_kept_mass_rows(logits, labels, top_k=1, chunk_rows=16)
    p = torch.softmax(logits.double(), -1)
    top = p.argmax(-1)
    mass = p.max(-1).values + torch.where(labels != top, p.gather(-1, labels.unsqueeze(-1)).squeeze(-1), p.new_zeros(40))
    assert torch.allclose(got.double(), mass.log(), atol=1e-5)


# ------------------------------------------------------------------------------------------------ V1 trainer + tracking


def test_v1_trainer_name_and_methods_are_wrapped(monkeypatch):
    stub = types.ModuleType("transfer_queue")

    class KVBatchMeta:  # the names trainer_base imports at module level
        pass

    stub.KVBatchMeta = KVBatchMeta

    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})

    stub.__getattr__ = __getattr__
    if "transfer_queue" not in sys.modules:
        monkeypatch.setitem(sys.modules, "transfer_queue", stub)
    import verl.trainer.ppo.v1.trainer_base as tb

    assert tb.compute_rollout_correction_and_add_to_batch.__bloggap_wrapped__
    assert tb.PPOTrainer._compute_advantage.__bloggap_wrapped__
    assert tb.PPOTrainer._compute_old_log_prob.__bloggap_wrapped__

    # _compute_old_log_prob forwards the engine requests for this call only
    seen = {}

    def spy(self, batch, metrics):
        seen.update(batch.extra_info)
        return batch

    wrapper = tb.PPOTrainer._compute_old_log_prob
    monkeypatch.setattr(wrapper, "__bloggap_original__", spy)
    fake_meta = types.SimpleNamespace(extra_info={})
    trainer = types.SimpleNamespace(config=_trainer_config(top_p=0.9, fp32_head=True))
    wrapper(trainer, fake_meta, {})
    assert seen["bloggap_fp32_head"] is True and seen["bloggap_log_kept_mass"] == "retruncate"
    assert seen["bloggap_top_p"] == 0.9 and fake_meta.extra_info == {}

    # a bad +bloggap node stops the trainer's constructor, before init() loads any worker or model
    init = tb.PPOTrainer.__init__
    assert init.__bloggap_wrapped__
    built = []
    monkeypatch.setattr(init, "__bloggap_original__", lambda self, config: built.append(config))
    with pytest.raises(ValueError, match=re.escape("bloggap.guard='loud' is not valid: expected one of warn, raise, off")):
        init(types.SimpleNamespace(), _trainer_config(guard="loud"))
    assert built == []
    init(types.SimpleNamespace(), _trainer_config(guard="raise"))
    assert len(built) == 1


def test_metrics_reach_verl_tracking_file_backend(batches, tmp_path, monkeypatch):
    from verl.utils.tracking import Tracking

    path = tmp_path / "metrics.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    b = batches["top_p0.95"]
    data = DataProto.from_dict(
        tensors={"old_log_probs": b["old"], "rollout_log_probs": b["rollout"].clone(), "response_mask": b["mask"]}
    )
    with trainer_step(_trainer_config(top_p=0.95)):
        _, metrics = rollout_corr_helper.compute_rollout_correction_and_add_to_batch(
            data, OmegaConf.structured(RolloutCorrectionConfig.decoupled_geo_rs())
        )
    tracker = Tracking(project_name="bloggap", experiment_name="cpu", default_backend=["file"])
    tracker.log(data=metrics, step=1)
    tracker.finish()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[0]["step"] == 1 and rows[0]["data"]["gap/verl/all_rejected"] == 1.0
    assert math.isclose(rows[0]["data"]["rollout_corr/rollout_rs_seq_masked_fraction"], 1.0)


def test_recipes_compose_against_verls_hydra_config():
    import glob

    import yaml

    from bloggap_plugin.verl.config import load_settings

    recipes = sorted(glob.glob(os.path.join(ROOT, "recipes", "verl", "*.yaml")))
    assert {os.path.basename(r) for r in recipes} >= {"arm_A.yaml", "arm_B.yaml", "arm_E.yaml", "arm_F.yaml", "guard.yaml"}
    for recipe in recipes:
        cfg = compose_ppo_trainer(yaml.safe_load(open(recipe))["overrides"])
        load_settings(cfg.get("bloggap"))  # the plugin accepts every node the recipes set
        name = os.path.basename(recipe)
        if name == "arm_B.yaml":
            assert cfg.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype == "fp32"
        if name == "arm_E.yaml":
            assert cfg.bloggap.fp32_head is True and cfg.actor_rollout_ref.model.use_fused_kernels is False
    with pytest.raises(ValueError, match="unknown bloggap setting"):
        load_settings({"fp32head": True})


def test_the_tests_verl_config_is_what_hydra_composes_from_verls_files():
    """compose_ppo_trainer (tests/_support/verl_config.py, which keeps verl's config files, and the config Hydra
    merges from them before the overrides, once per session) gives the config Hydra composes reading every file:
    twice in a row (the second from the kept loads), and for a second recipe on the merge kept for the first."""
    import yaml
    from _support.verl_config import _MERGED
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    plain = {}
    for recipe in ("arm_E", "guard"):
        overrides = yaml.safe_load(open(os.path.join(ROOT, "recipes", "verl", f"{recipe}.yaml")))["overrides"]
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            plain[recipe] = OmegaConf.to_container(compose(config_name="ppo_trainer", overrides=overrides))
        merges = len(_MERGED)
        for _ in range(2):
            assert OmegaConf.to_container(compose_ppo_trainer(overrides)) == plain[recipe]
        if recipe == "guard":  # its overrides applied to the merge kept for arm_E's (the same defaults list)
            assert len(_MERGED) == merges
    assert plain["arm_E"]["bloggap"]["fp32_head"] is True and plain["guard"]["bloggap"]["guard"] == "raise"


def test_the_kept_config_loads_follow_a_changed_file(tmp_path):
    """A config file whose text changed is loaded again; changing a composed config changes no later compose."""
    from _support.verl_config import _loads_kept
    from hydra import compose, initialize_config_dir

    (tmp_path / "group").mkdir()
    (tmp_path / "main.yaml").write_text("defaults:\n  - group: a\n  - _self_\nx: 1\n")
    (tmp_path / "group" / "a.yaml").write_text("y: 2\n")

    def composed():
        with _loads_kept(), initialize_config_dir(config_dir=str(tmp_path), version_base=None):
            return compose(config_name="main")

    first = composed()
    assert OmegaConf.to_container(first) == {"x": 1, "group": {"y": 2}}
    first.group.y = 5
    assert composed().group.y == 2
    (tmp_path / "group" / "a.yaml").write_text("y: 3\n")
    assert OmegaConf.to_container(composed()) == {"x": 1, "group": {"y": 3}}


# ------------------------------------------------------------------------------------------------ differential
# With untruncated sampling the plugin lifts nothing, so its wrapped compute_rollout_correction_and_add_to_batch must
# give bit-identical tensors and rollout_corr/* metrics to verl's own function, over every preset and option.


@pytest.fixture(scope="module")
def pristine_helper():
    """verl's rollout_corr_helper executed afresh from its file under another name: never wrapped by the plugin."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pristine_rollout_corr_helper", rollout_corr_helper.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not getattr(module.compute_rollout_correction_and_add_to_batch, "__bloggap_wrapped__", False)
    assert rollout_corr_helper.compute_rollout_correction_and_add_to_batch.__bloggap_wrapped__
    return module


def _differential_batches():
    """Untruncated rollouts, 16 x 24: ``mild`` (0.05-nat noise, two shifted sequences, one empty response) and
    ``far`` (every token 1 nat off: sequence IS weights at the exp(-20) floor, RS rejects everything)."""
    import numpy as np

    gen = torch.Generator().manual_seed(11)
    rows, width = 16, 24
    old = torch.randn(rows, width, generator=gen) - 1.0
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    lengths[3] = 0
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).float()
    mild = old + torch.randn(rows, width, generator=gen) * 0.05
    mild[5] += 0.5
    mild[9] -= 0.5
    far = old + 1.0
    uid = np.array([f"p{i // 4}" for i in range(rows)], dtype=object)
    return {
        name: {"old_log_probs": old * mask, "rollout_log_probs": rollout * mask, "response_mask": mask, "uid": uid}
        for name, rollout in (("mild", mild), ("far", far))
    }


def _fresh(data: dict) -> DataProto:
    tensors = {k: v.clone() for k, v in data.items() if isinstance(v, torch.Tensor)}
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": data["uid"].copy()}, meta_info={"global_steps": 3})


def _bits(value):
    if isinstance(value, torch.Tensor):
        return (value.dtype, tuple(value.shape), value.detach().cpu().contiguous().numpy().tobytes())
    if isinstance(value, float):
        return ("float", value.hex())
    return (type(value).__name__, value)


def _run(fn, data, cfg):
    try:
        return fn(_fresh(data), cfg)
    except Exception as err:  # noqa: BLE001 - an invalid option must fail the same way in both
        return err


def _assert_identical(got, want, label):
    if isinstance(want, Exception):
        assert type(got) is type(want) and str(got) == str(want), (label, got, want)
        return
    assert not isinstance(got, Exception), (label, got)
    (got_batch, got_metrics), (want_batch, want_metrics) = got, want
    assert sorted(got_batch.batch.keys()) == sorted(want_batch.batch.keys()), label
    for key in want_batch.batch.keys():
        assert _bits(got_batch.batch[key]) == _bits(want_batch.batch[key]), (label, key)
    assert got_batch.non_tensor_batch.keys() == want_batch.non_tensor_batch.keys(), label
    for key, value in want_batch.non_tensor_batch.items():
        assert list(got_batch.non_tensor_batch[key]) == list(value), (label, key)
    assert got_batch.meta_info == want_batch.meta_info, label
    extra = set(got_metrics) - set(want_metrics)
    assert set(want_metrics) <= set(got_metrics) and all(k.startswith("gap/verl/") for k in extra), (label, extra)
    for key, value in want_metrics.items():
        assert _bits(got_metrics[key]) == _bits(value), (label, key, got_metrics[key], value)


def _presets() -> dict:
    presets = {"default": RolloutCorrectionConfig()}
    for name in sorted(dir(RolloutCorrectionConfig)):
        factory = getattr(RolloutCorrectionConfig, name)
        if callable(factory) and (name.startswith(("decoupled_", "bypass_")) or name == "disabled"):
            presets[name] = factory()
    presets["yaml_default"] = OmegaConf.load(
        os.path.join(os.path.dirname(verl.__file__), "trainer", "config", "algorithm", "rollout_correction.yaml")
    )
    return presets


def test_differential_covers_every_preset_and_rs_option():
    presets = _presets()
    # every classmethod preset verl 0.9.1 ships (19 with disabled), plus the dataclass and the YAML defaults
    assert len(presets) == 21, sorted(presets)
    used = set()
    for _, rs, _ in _option_grid_rs():
        used.update((rs or "").split(","))
    assert set(rollout_corr_helper.SUPPORTED_ROLLOUT_RS_OPTIONS) <= used


@pytest.fixture(scope="module")
def pristine_preset_runs(pristine_helper):
    """verl's own result (or error) for every preset, in both config forms, on both batches: ``(name, form, batch
    name) -> (cfg, data, result)``, computed once for the contexts the wrapped function runs in."""
    runs = {}
    batches = _differential_batches()
    for name, preset in _presets().items():
        for form, cfg in (("dataclass", preset), ("omegaconf", OmegaConf.structured(preset))):
            for batch_name, data in batches.items():
                want = _run(pristine_helper.compute_rollout_correction_and_add_to_batch, data, cfg)
                runs[(name, form, batch_name)] = (cfg, data, want)
    return runs


@pytest.mark.parametrize("context", ["none", "guard_warn", "guard_off"])
def test_wrapped_correction_is_bit_identical_to_verl_for_every_preset(pristine_preset_runs, monkeypatch, caplog,
                                                                      context):
    _clear_bloggap_env(monkeypatch)
    wrapped = rollout_corr_helper.compute_rollout_correction_and_add_to_batch
    steps = {"none": None, "guard_warn": _trainer_config(), "guard_off": _trainer_config(guard="off")}
    fired = 0
    for (name, form, batch_name), (cfg, data, want) in pristine_preset_runs.items():
        label = (context, name, form, batch_name)
        if steps[context] is None:
            got = _run(wrapped, data, cfg)
        else:
            with trainer_step(steps[context]):
                got = _run(wrapped, data, cfg)
        _assert_identical(got, want, label)
        if not isinstance(got, Exception):
            fired += got[1].get("gap/verl/all_rejected", 0.0) == 1.0
    # the guard path (warning, metrics) ran on the far batch and still changed nothing
    assert (fired > 0) == (context != "guard_off")


def _option_grid_rs():
    """(label, rollout_rs, rollout_rs_threshold) over every RS option verl 0.9.1 supports, each threshold form."""
    grid = [("no rs", None, None)]
    for option in sorted(rollout_corr_helper.SUPPORTED_ROLLOUT_RS_OPTIONS):
        if option.endswith("k1"):  # a band, or one float U meaning [1/U, U]
            grid += [(option, option, "0.9_1.1"), (option, option, 1.1)]
        else:
            grid += [(option, option, 0.002 if option.startswith("seq_mean") else "0.05")]
    grid += [
        ("shared threshold", "seq_mean_k2,seq_max_k3", 0.01),
        ("per-option thresholds", "token_k1,seq_sum_k2,seq_max_k3", "0.8_1.25,0.5,0.01"),
        ("duplicate option", "seq_mean_k1,seq_mean_k1", "0.95_1.05"),
        ("invalid: no threshold", "token_k2", None),
        ("invalid: k2 with a band", "token_k2", "0.5_2.0"),
        ("invalid: unknown option", "seq_k9", 0.1),
    ]
    return grid


def test_wrapped_correction_is_bit_identical_to_verl_over_every_option(pristine_helper, monkeypatch):
    _clear_bloggap_env(monkeypatch)
    wrapped = rollout_corr_helper.compute_rollout_correction_and_add_to_batch
    data = _differential_batches()["mild"]
    is_grid = [(None, 2.0, False)] + [
        (level, threshold, normalize)
        for level in ("token", "sequence")
        for threshold in (2.0, "1.05", "0.8_1.25")  # TIS as a float, TIS as a string, IcePop band
        for normalize in (False, True)
    ]
    outcomes = set()
    with trainer_step(_trainer_config()):
        for rollout_is, is_threshold, normalize in is_grid:
            for label, rollout_rs, rs_threshold in _option_grid_rs():
                cfg = OmegaConf.create(
                    {
                        "rollout_is": rollout_is,
                        "rollout_is_threshold": is_threshold,
                        "rollout_is_batch_normalize": normalize,
                        "rollout_rs": rollout_rs,
                        "rollout_rs_threshold": rs_threshold,
                        "bypass_mode": False,
                        "loss_type": "ppo_clip",
                    }
                )
                want = _run(pristine_helper.compute_rollout_correction_and_add_to_batch, data, cfg)
                got = _run(wrapped, data, cfg)
                _assert_identical(got, want, (rollout_is, is_threshold, normalize, label))
                outcomes.add(type(got).__name__ if isinstance(got, Exception) else "ok")
    assert outcomes == {"ok", "ValueError"}


def test_dump_forward_only_batch_saves_flat_rows_once_per_process(tmp_path, monkeypatch):
    from bloggap_plugin.verl import engine

    monkeypatch.setattr(engine, "_DUMPED", set())
    offsets = torch.tensor([0, 3, 8])
    ids = torch.arange(8) + 10
    log_probs = -torch.arange(8, dtype=torch.bfloat16) / 4
    batch = {"input_ids": torch.nested.nested_tensor_from_jagged(ids, offsets)}
    output = {"log_probs": torch.nested.nested_tensor_from_jagged(log_probs, offsets)}
    path = engine.dump_forward_only_batch(str(tmp_path / "d"), batch, output, fp32_head=True)
    saved = torch.load(path)
    assert path.endswith(f".{os.getpid()}.pt")
    assert saved["input_ids"].tolist() == list(range(10, 18)) and saved["offsets"].tolist() == [0, 3, 8]
    assert saved["log_probs"].dtype == torch.float32 and saved["log_probs"].tolist() == [-i / 4 for i in range(8)]
    assert saved["fp32_head"] is True
    assert engine.dump_forward_only_batch(str(tmp_path / "d"), batch, output, fp32_head=True) is None  # once
    assert engine.dump_forward_only_batch(str(tmp_path / "e"), batch, {}, fp32_head=False) is None  # no log-probs


_APPLY_MONKEY_PATCH = ("from verl.models.transformers.monkey_patch import apply_monkey_patch; "
                       "apply_monkey_patch(model, ulysses_sp_size=1, use_remove_padding=False); print('patched')")
"""verl's monkey patch (every FSDP actor's model build) on ``model``."""


def test_verl_fsdp_monkey_patch_runs_beside_trl_1_16(tmp_path, spawns):
    """verl 0.9.1's apply_monkey_patch (every FSDP actor's model build) imports AutoModelForCausalLMWithValueHead from
    trl.experimental.ppo or trl whenever TRL is importable; TRL 1.16 has neither, so the actor's init_model fails with
    ImportError (seen on the H200). With the plugin, verl skips that TRL-only patch and says why, once."""
    import importlib.util

    trl_dir = os.path.dirname(importlib.util.find_spec("trl").origin)
    if os.path.isdir(os.path.join(trl_dir, "experimental", "ppo")):
        pytest.skip("this TRL still has trl.experimental.ppo")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("BLOGGAP_VERL_DISABLE", None)
    # the tiny model loads once; verl and the plugin load in each case's process, under its BLOGGAP_VERL_DISABLE
    without, with_plugin = run_forked(
        tmp_path, "from bloggap_plugin.models import load_model; model, _ = load_model('tiny-random-llama')",
        [({"BLOGGAP_VERL_DISABLE": disable}, _APPLY_MONKEY_PATCH) for disable in ("1", "0")],
        not_loaded=("verl", "bloggap_plugin.verl", "trl"), env=env)
    assert without.returncode != 0 and "AutoModelForCausalLMWithValueHead" in without.stderr
    assert with_plugin.returncode == 0 and with_plugin.stdout.strip().endswith("patched"), with_plugin.stderr[-3000:]
    assert with_plugin.stderr.count("bloggap: TRL at ") == 1
    assert "has no AutoModelForCausalLMWithValueHead" in with_plugin.stderr
