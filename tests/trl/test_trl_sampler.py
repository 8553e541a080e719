"""The HF-generate sampler recorder inside real TRL 1.16 GRPO runs: bitwise plain TRL, generation config, modes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from _support.trl_runs import logs_of, make  # noqa: E402

from bloggap_plugin.recipes import GapConfig  # noqa: E402

VOCAB = 104  # the tiny models' character vocabulary


def sharpen(model, scale: float = 30.0) -> None:
    """Peak the random model's next-token distribution so that top_p / top_k / min_p really remove tokens."""
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)


def run(tmp_path, gap, mode, **overrides):
    torch.manual_seed(1234)
    trainer = make(tmp_path / mode, gap, mode=mode, dtype="bf16", prepare=sharpen, **overrides)
    trainer.train()
    return trainer, (
        [(h["loss"], h["grad_norm"]) for h in logs_of(trainer)],
        [p.detach().clone() for p in trainer.model.parameters()],
        torch.get_rng_state(),
    )


@pytest.mark.parametrize(
    "truncation", [dict(top_p=0.9, min_p=0.1), dict(top_k=6, top_p=0.8)], ids=["top_p+min_p", "top_k+top_p"]
)
def test_arm_A_is_bitwise_plain_trl_with_combined_truncation(tmp_path, truncation, trains):
    """The recorder truncates in HF's order (top_k, top_p, then min_p), so it draws exactly what plain TRL draws."""
    _, plain = run(tmp_path, None, "plain", max_steps=2, **truncation)
    trainer, ours = run(tmp_path, GapConfig(arm="A", probe_rows=0), "trainer", max_steps=2, **truncation)
    first = logs_of(trainer)[0]
    # the truncation bites: a few tokens kept out of the vocabulary, a kept mass visibly below 1
    assert 1.0 <= first["gap/kept/size_mean"] < 0.2 * VOCAB
    assert first["gap/kept/mass_mean"] < 0.99
    assert ours[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(ours[1], plain[1], strict=True))
    assert torch.equal(ours[2], plain[2])


def min_p_model(model) -> None:
    """A model shipping ``min_p: 0.3`` in its generation_config (transformers fills TRL's ``min_p=None`` from it)."""
    model.generation_config.min_p = 0.3


def test_model_generation_config_min_p_is_recorded_as_sampled(tmp_path, trains):
    """TRL leaves min_p None, so generate samples with the model's min_p 0.3: the recorder must model exactly that."""
    from _support.trl_runs import Spy
    from transformers import MinPLogitsWarper

    from bloggap_plugin.models import load_model

    trainer = make(tmp_path, GapConfig(arm="A", probe_rows=0), dtype="fp32", trainer_cls=Spy, prepare=min_p_model,
                   max_steps=1)
    trainer.train()
    batch = trainer.spied[0]
    assert "gap_kept_sizes" in batch, "min_p from the model's generation_config was not recorded as truncation"
    # independent: the same (seeded) weights, teacher-forced, HF's own MinP warper on the fp32 logits
    model, _ = load_model("tiny-random-llama", dtype="fp32")
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    width = batch["completion_ids"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, -width - 1:-1].float()
    warped = MinPLogitsWarper(0.3)(None, logits.reshape(-1, logits.shape[-1])).reshape(logits.shape)
    sizes = torch.isfinite(warped).sum(-1)
    drawn = torch.log_softmax(warped, -1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
    mask = batch["completion_mask"].bool()
    assert (sizes[mask] < VOCAB).all()  # min_p 0.3 really truncates this model
    agree = batch["gap_kept_sizes"][mask] == sizes[mask]
    assert agree.float().mean() >= 0.98  # KV-cache vs full-forward rounding may move a token across the edge
    assert torch.allclose(batch["gap_sampler_logps"][mask][agree], drawn[mask][agree], atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "field, value", [("typical_p", 0.9), ("epsilon_cutoff", 3e-4), ("eta_cutoff", 3e-4), ("top_h", 0.5)]
)
def test_unmodelled_warper_in_model_generation_config_is_refused(tmp_path, field, value):
    from bloggap_plugin.recipes import RecipeError

    def ship(model):
        setattr(model.generation_config, field, value)

    with pytest.raises(RecipeError, match=rf"{field}={value}.*generation_kwargs.*gap\.sampler: false"):
        make(tmp_path, GapConfig(arm="A"), prepare=ship)


def test_unmodelled_warper_in_generation_kwargs_is_refused(tmp_path):
    from bloggap_plugin.recipes import RecipeError

    with pytest.raises(RecipeError, match=r"typical_p=0\.8"):
        make(tmp_path, GapConfig(arm="A"), generation_kwargs={"typical_p": 0.8})


def test_warper_added_after_attach_fails_at_generate(tmp_path, trains):
    """The check runs on the config generate really uses (after transformers merges the model's)."""
    trainer = make(tmp_path, GapConfig(arm="A", probe_rows=0), max_steps=1)
    trainer.model.generation_config.typical_p = 0.9
    with pytest.raises(ValueError, match=r"typical_p=0\.9"):
        trainer.train()


@pytest.mark.parametrize("generation_kwargs", [{"num_beams": 2}, {"do_sample": False}], ids=["beams", "greedy"])
def test_unrecordable_generation_mode_turns_sampler_off_and_trains_like_plain_trl(tmp_path, generation_kwargs, trains):
    import warnings

    _, plain = run(tmp_path, None, "plain", max_steps=1, generation_kwargs=generation_kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, ours = run(tmp_path, GapConfig(arm="A", probe_rows=4), "trainer", max_steps=1,
                            generation_kwargs=generation_kwargs)
    off = [w for w in caught if "sampler recording is off" in str(w.message)]
    assert len(off) == 1, [str(w.message) for w in caught]
    assert ("beam" if "num_beams" in generation_kwargs else "greedy") in str(off[0].message)
    first = logs_of(trainer)[0]
    assert "gap/sampler/oob_frac" not in first and "gap/ratio/oob_frac" in first
    assert ours[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(ours[1], plain[1], strict=True))


def test_unrecordable_mode_with_renormalize_is_refused(tmp_path):
    from bloggap_plugin.recipes import RecipeError

    with pytest.raises(RecipeError, match=r"need the sampler recording.*'beam_sample'"):
        make(tmp_path, GapConfig(arm="C", kept="renormalize"), top_p=0.8, generation_kwargs={"num_beams": 2})


def test_replaced_generate_drops_the_sampler_metrics_with_a_warning(tmp_path, trains):
    """A mocked generate never calls the recorder: that generation has no sampler metrics, training goes on."""
    trainer = make(tmp_path, GapConfig(arm="C", probe_rows=4), max_steps=2)
    calls = []

    def fake_generate(input_ids, attention_mask=None, generation_config=None, **kwargs):
        calls.append(kwargs.get("logits_processor"))
        completion = torch.full((input_ids.shape[0], 3), 40 + len(calls), dtype=input_ids.dtype)
        return torch.cat([input_ids, completion], dim=1)

    trainer.model.generate = fake_generate
    with pytest.warns(UserWarning, match="recorded nothing.*gap/sampler metrics dropped for this generation"):
        trainer.train()
    logs = logs_of(trainer)
    assert len(calls) == 1 and len(logs) == 2 and all(h["loss"] == h["loss"] for h in logs)
    assert "gap/sampler/oob_frac" not in logs[0]
    assert logs[0]["gap/ratio/oob_frac"] is not None  # the other metrics are unaffected


def test_mode_changed_after_attach_drops_the_sampler_metrics(tmp_path, trains):
    trainer = make(tmp_path, GapConfig(arm="A", probe_rows=0), max_steps=1)
    trainer.model.generation_config.num_beams = 2  # generate fills TRL's num_beams=None from here
    with pytest.warns(UserWarning, match="cannot record generation mode 'beam_sample'.*dropped for this generation"):
        trainer.train()
    assert "gap/sampler/oob_frac" not in logs_of(trainer)[0]


# ---------------------------------------------------------------------------------------------------------------
# TRL's own GRPO test configurations (tests/test_grpo_trainer.py, TRL 1.16) with the plugin attached, on the local
# tiny model: each trains one optimizer step. Overrides of tests.test_trl.grpo_args.
SUITE = {
    "default": {},
    "loss_grpo": dict(loss_type="grpo"),
    "loss_bnpo": dict(loss_type="bnpo"),
    "loss_dr_grpo": dict(loss_type="dr_grpo"),
    "loss_cispo": dict(loss_type="cispo"),
    "loss_sapo": dict(loss_type="sapo"),
    "gspo_sequence": dict(importance_sampling_level="sequence"),
    "delta_two_sided": dict(delta=2.0),
    "beta": dict(beta=0.1),
    "num_iterations_1": dict(num_iterations=1),
    "steps_per_generation": dict(steps_per_generation=4, gradient_accumulation_steps=2),
    "scale_rewards_none": dict(scale_rewards="none"),
    "scale_rewards_batch": dict(scale_rewards="batch"),
    "mask_truncated": dict(mask_truncated_completions=True),
    "entropy_mask": dict(top_entropy_quantile=0.2),
    "truncation": dict(top_k=10, top_p=0.9, min_p=0.05, repetition_penalty=1.1),
    "generation_kwargs_sampling": dict(generation_kwargs={"top_k": 20, "length_penalty": -0.1}),
    "generation_kwargs_beams": dict(generation_kwargs={"num_beams": 2}),
    "peft": {},
}
SUITE_ARMS = ("A", "C", "E", "G")


@pytest.mark.parametrize("arm", SUITE_ARMS)
@pytest.mark.parametrize("name", list(SUITE))
def test_trl_suite_configuration_trains_with_the_plugin(tmp_path, name, arm, trains):
    import functools
    import math
    import warnings

    from bloggap_plugin.trl import GapGRPOTrainer

    trainer_cls = None
    if name == "peft":
        peft = pytest.importorskip("peft")
        trainer_cls = functools.partial(
            GapGRPOTrainer, peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        )
    prepare = None
    if SUITE[name].get("beta"):  # TRL loads the reference model from the policy's name_or_path: a local copy

        def prepare(model):
            model.save_pretrained(tmp_path / "policy")
            model.config._name_or_path = str(tmp_path / "policy")

    overrides = dict(per_device_train_batch_size=2, num_generations=2, gradient_accumulation_steps=1,
                     max_completion_length=4, max_steps=1, num_iterations=2) | SUITE[name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make(tmp_path, GapConfig(arm=arm, probe_rows=2), dtype="bf16", trainer_cls=trainer_cls,
                       prepare=prepare, **overrides)
        trainer.train()
    logs = logs_of(trainer)
    assert len(logs) == 1 and math.isfinite(logs[0]["loss"]) and math.isfinite(logs[0]["grad_norm"])
    if name == "beta":
        assert trainer.ref_model is not None and math.isfinite(logs[0]["kl"])
    if name == "peft":
        assert isinstance(trainer.model, peft.PeftModel)
    first = logs[0]
    assert first["gap/time/scoring_s"] > 0
    off = [str(w.message) for w in caught if "sampler recording is off" in str(w.message)]
    assert len(off) == (1 if name == "generation_kwargs_beams" else 0), off
    if first["completions/clipped_ratio"] == 1.0 and overrides.get("mask_truncated_completions"):
        # every completion hit max_completion_length and is masked out: no token to measure
        assert "gap/ratio/oob_frac" not in first and "gap/sampler/oob_frac" not in first
        return
    assert 0.0 <= first["gap/ratio/oob_frac"] <= 1.0
    if name == "generation_kwargs_beams":
        assert "gap/sampler/oob_frac" not in first
    else:
        assert 0.0 <= first["gap/sampler/oob_frac"] <= 1.0
    if name in ("truncation", "generation_kwargs_sampling"):
        assert 0.0 < first["gap/kept/mass_mean"] <= 1.0 and first["gap/kept/size_mean"] >= 1.0
