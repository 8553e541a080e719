"""The TRL adapter under the configurations users run (issue 11): kept modes, fp16 fallback, resume, reference
model (beta > 0, PEFT), TRL's loss types and importance-sampling levels, left padding; tiny CPU models."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

pytest.importorskip("trl")

from _support.trl_runs import Spy, first_log, logs_of, make, saved_model_dir  # noqa: E402

from bloggap_plugin.recipes import GapConfig  # noqa: E402
from bloggap_plugin.trl import GapGRPOTrainer  # noqa: E402


def count_scoring_forwards(model) -> list:
    """Append the input shape of every teacher-forced forward of ``model`` (TRL's fused pass passes ``labels``,
    the plugin's ``token_logprobs`` ``use_cache=False``; generation steps pass neither)."""
    calls: list = []

    def hook(module, args, kwargs):
        if "labels" in kwargs or kwargs.get("use_cache") is False:
            calls.append(tuple(kwargs["input_ids"].shape))

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return calls


# ------------------------------------------------------------------ item 7: gap.kept: off costs nothing
def test_kept_off_runs_no_extra_forward_and_logs_no_kept_metrics(tmp_path, trains):
    counts, logs, batches = {}, {}, {}
    for kept in ("plain", "off", "measure"):
        gap = None if kept == "plain" else GapConfig(arm="A", probe_rows=0, kept=kept)
        trainer = make(tmp_path / kept, gap, mode="plain" if gap is None else "trainer",
                       trainer_cls=Spy, top_p=0.8, max_steps=1)
        calls = count_scoring_forwards(trainer.model)
        trainer.train()
        counts[kept], logs[kept] = len(calls), first_log(trainer)
        batches[kept] = getattr(trainer, "spied", [{}])[0]
    assert counts["measure"] > counts["plain"]  # the premise: measuring the kept mass is one extra scoring
    assert counts["off"] == counts["plain"]
    assert logs["measure"]["gap/kept/mass_mean"] < 1.0
    assert not [k for k in logs["off"] if k.startswith("gap/kept/")]
    assert logs["off"]["gap/sampler/oob_frac"] is not None  # the sampler metrics stay on
    assert not [k for k in batches["off"] if k.startswith("gap_kept")]  # no kept sets recorded or carried


# ------------------------------------------------------------------ item 8: fp16 fallback with kept metrics
def overflowing_model_dir(tmp_path, token: str = "Z"):
    """tests/core/test_precision.py's overflowing policy, saved: a bf16 tiny llama whose embedding row of ``token``
    exceeds fp16's max (65504), so an fp16 forward of a row containing it is non-finite (bf16 holds it)."""
    from bloggap_plugin.models import load_model

    policy, tokenizer = load_model("tiny-random-llama", dtype="bf16")
    with torch.no_grad():
        policy.model.embed_tokens.weight[tokenizer.convert_tokens_to_ids(token)] *= 1e8
    folder = tmp_path / "overflowing"
    policy.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("kept", ["measure", "renormalize"])
def test_fp16_fallback_under_truncation_with_kept_metrics(tmp_path, kept, trains):
    gap = GapConfig(arm="F", probe_rows=0, kept=kept)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make(tmp_path, gap, dtype="bf16", model_name=overflowing_model_dir(tmp_path),
                       prompts=["Z+1=", "2+3=", "4+4=", "9+Z="], top_p=0.8, max_steps=1)
        trainer.train()
    first = first_log(trainer)
    assert first["gap/fp16/fallbacks"] > 0  # the premise: fp16 overflowed and was re-scored in fp32
    assert math.isfinite(first["loss"])
    assert 0.0 < first["gap/kept/mass_mean"] < 1.0
    # fp32 re-scored trainer vs bf16 sampler: the renormalised ratio is near 1, the full-vocabulary one near S
    assert abs(first["gap/kept/ratio_before_mean"] - first["gap/kept/mass_mean"]) < 0.05
    assert abs(first["gap/kept/ratio_after_mean"] - 1.0) < 0.05


# ------------------------------------------------------------------ item 1: shadows follow the weights
def arm_model(model, arm: str):
    """An independent copy of ``model``'s weights in arm ``arm``'s scoring precision (B: fp32; E: fp32 norm+head)."""
    if arm == "B":
        return model.float()
    model.model.norm.float()
    model.lm_head.float()
    model.model.norm.register_forward_pre_hook(lambda module, args: (args[0].float(),))
    return model


def spied_old_vs_independent(batch, independent) -> tuple[torch.Tensor, torch.Tensor]:
    from bloggap_plugin.core.scoring import token_logprobs

    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        expected = token_logprobs(independent, ids, attn, batch["completion_ids"].shape[1], batch_size=4,
                                  positions="mask")
    mask = batch["completion_mask"].bool()
    return batch["old_per_token_logps"][mask], expected[mask]


@pytest.mark.parametrize("arm", ["B", "E"])
def test_resume_scores_with_the_checkpoint_weights(tmp_path, arm, trains):
    from safetensors.torch import load_file

    from bloggap_plugin.models import load_model

    gap = GapConfig(arm=arm, probe_rows=0, sampler=False)
    first = make(tmp_path, gap, dtype="bf16", max_steps=2, save_strategy="steps", save_steps=2)
    first.train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    resumed = make(tmp_path, gap, dtype="bf16", trainer_cls=Spy, max_steps=3, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    independent, _ = load_model("tiny-random-llama", dtype="bf16")  # built as the policy was, then the checkpoint
    independent.load_state_dict(load_file(checkpoint / "model.safetensors"))
    independent = arm_model(independent, arm)
    got, expected = spied_old_vs_independent(resumed.spied[0], independent)
    assert torch.equal(got, expected)


def test_weights_changed_after_construction_are_scored(tmp_path, trains):
    from bloggap_plugin.models import load_model

    trainer = make(tmp_path, GapConfig(arm="B", probe_rows=0, sampler=False), dtype="bf16", trainer_cls=Spy,
                   max_steps=1)
    with torch.no_grad():
        for param in trainer.model.parameters():
            param.mul_(1.5)
    trainer.train()
    independent, _ = load_model("tiny-random-llama", dtype="bf16")
    with torch.no_grad():
        for param in independent.parameters():
            param.mul_(1.5)
    got, expected = spied_old_vs_independent(trainer.spied[0], arm_model(independent, "B"))
    assert torch.equal(got, expected)


# ------------------------------------------------------------------ item 5: the reference model's positions


class _RefSpy(Spy):
    """Also records, per micro-batch, the training forward's log-probs next to TRL's reference log-probs."""

    def _gap_attach(self, *args, **kwargs):
        super()._gap_attach(*args, **kwargs)
        self.ref_pairs = []
        _spy_loss_metrics(self, lambda new, inputs: self.ref_pairs.append(
            (new, inputs["ref_per_token_logps"], inputs["completion_mask"].bool())))


def _spy_loss_metrics(trainer, record) -> None:
    """Call ``record(new log-probs, inputs)`` before each of the session's loss-time metrics that has them."""
    stats = trainer._gap_session.stats
    loss_metrics = stats.loss_metrics

    def spied(inputs):
        if stats.state.new_logps is not None:
            record(stats.state.new_logps, inputs)
        return loss_metrics(inputs)

    stats.loss_metrics = spied


def assert_reference_equals_policy_at_step_zero(trainer) -> None:
    """Before the first optimizer step theta = theta_ref: the reference log-probs must be the training forward's."""
    assert any((batch["prompt_mask"] == 0).any() for batch in trainer.spied)  # the premise: left padding
    pairs = trainer.ref_pairs[: trainer.args.gradient_accumulation_steps]
    for new, ref, mask in pairs:
        assert torch.equal(new[mask], ref[mask])
    assert first_log(trainer)["kl"] == 0.0


@pytest.mark.parametrize("name", ["tiny-random-llama", "tiny-random-gpt_neox"])
@pytest.mark.parametrize("arm", ["C", "G"])
def test_kl_is_exactly_zero_at_step_zero_with_mask_positions(tmp_path, name, arm, trains):
    trainer = make(tmp_path, GapConfig(arm=arm, probe_rows=0), model_name=saved_model_dir(tmp_path, name),
                   trainer_cls=_RefSpy, beta=0.04, max_steps=1)
    assert trainer.ref_model is not None
    trainer.train()
    assert_reference_equals_policy_at_step_zero(trainer)


# ------------------------------------------------------------------ item 2: renormalize with beta > 0
@pytest.mark.parametrize("peft", [False, True])
def test_renormalized_reference_gives_zero_kl_at_step_zero(tmp_path, peft, trains):
    """The reference is renormalised over the sampler's kept sets like the policy: a separate reference model
    (beta > 0 without PEFT) and TRL's adapter-disabled pass of the policy (PEFT) both."""
    peft_config = None
    if peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make(tmp_path, GapConfig(arm="C", probe_rows=0, kept="renormalize"),
                       model_name=saved_model_dir(tmp_path), trainer_cls=_RefSpy,
                       peft_config=peft_config, beta=0.04, top_p=0.8, max_steps=1)
    assert (trainer.ref_model is None) == peft
    trainer.train()
    assert_reference_equals_policy_at_step_zero(trainer)
    assert first_log(trainer)["gap/kept/mass_mean"] < 1.0  # the premise: truncation bites


# ------------------------------------------------------------------ item 6: TRL's clipping rule per loss type
class _LossSpy(GapGRPOTrainer):
    """Records, per micro-batch, what the clip metric is computed from: new and old log-probs, A, mask."""

    def _gap_attach(self, *args, **kwargs):
        super()._gap_attach(*args, **kwargs)
        self.loss_rows = []
        _spy_loss_metrics(self, lambda new, inputs: self.loss_rows.append((
            new.float(), inputs["old_per_token_logps"].float(), inputs["advantages"], inputs["completion_mask"].bool())))


def expected_clipped(new, old, advantages, mask, loss_type, level, eps_low, eps_high, delta) -> float:
    """TRL 1.16 _compute_loss's clipping, written out independently: share of completion tokens clipped."""
    log_ratio = (new - old) * mask
    if level == "sequence":
        log_ratio = (log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)).unsqueeze(-1).expand_as(new)
    w = torch.exp(log_ratio)
    a = advantages.unsqueeze(-1).expand_as(new)
    if loss_type == "cispo":
        clipped = (w > eps_high) & (a > 0)
    else:
        clipped = ((w > 1 + eps_high) & (a > 0)) | ((w < 1 - eps_low) & (a < 0))
        if delta is not None:  # -min(min(w, delta) A, clip(w) A) = -delta A, constant, for A < 0 and w > delta
            clipped |= (w > delta) & (a < 0)
    return float(clipped[mask].float().mean())


CLIP_CONFIGS = {
    "grpo_token": dict(loss_type="grpo"),
    "grpo_sequence": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "dapo_delta": dict(loss_type="dapo", delta=1.0002),
    "bnpo_sequence_delta": dict(loss_type="bnpo", importance_sampling_level="sequence", epsilon=1e-5,
                                epsilon_high=1e-5, delta=1.00002),
    "cispo": dict(loss_type="cispo", epsilon_high=1.0),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "luspo_sequence": dict(loss_type="luspo", importance_sampling_level="sequence", epsilon=1e-5, epsilon_high=1e-5),
}


@pytest.mark.parametrize("config", list(CLIP_CONFIGS))
def test_clipped_frac_follows_trls_rule(tmp_path, config, trains):
    # tiny epsilons and step: the ratios are the bf16-vs-fp32 noise (|dlogp| ~ 4e-4), on both sides of 1 for every A
    overrides = {"epsilon": 1e-4, "epsilon_high": 1e-4, "learning_rate": 1e-7, **CLIP_CONFIGS[config]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # arm B on a bf16 policy: the fp32 old log-probs put ratios on both sides of 1 from the first step
        trainer = make(tmp_path, GapConfig(arm="B", probe_rows=0, sampler=False), dtype="bf16",
                       trainer_cls=_LossSpy, **overrides)
        trainer.train()
    args = trainer.args
    rules = dict(loss_type=args.loss_type, level=args.importance_sampling_level, eps_low=args.epsilon,
                 eps_high=args.epsilon_high, delta=args.delta)
    per_micro = [expected_clipped(*row, **rules) for row in trainer.loss_rows]
    steps = args.gradient_accumulation_steps
    expected = [sum(per_micro[i:i + steps]) / steps for i in range(0, len(per_micro), steps)]
    logged = [h["gap/update_clip/clipped_frac" if step % 2 else "gap/clip/clipped_frac"]  # num_iterations 2
              for step, h in enumerate(logs_of(trainer))]
    assert logged == pytest.approx(expected, abs=1e-12)
    assert max(expected) > 0.0  # the premise: something was clipped
    if args.delta is not None:  # the premise: two-sided clipping clipped tokens the one-sided rule keeps
        one_sided = [expected_clipped(*row, **{**rules, "delta": None}) for row in trainer.loss_rows]
        assert sum(per_micro) > sum(one_sided)
    last = logs_of(trainer)[-1]
    if config == "grpo_token":  # the same tokens and rule as TRL's own metric
        assert last["gap/update_clip/clipped_frac"] == pytest.approx(last["clip_ratio/region_mean"], abs=1e-12)
    if config == "cispo":
        assert last["gap/update_clip/clipped_frac"] == pytest.approx(last["cispo_clip_ratio"], abs=1e-12)


@pytest.mark.parametrize("loss_type", ["sapo", "vespo"])
def test_clip_metrics_absent_where_the_loss_does_not_clip(tmp_path, loss_type, trains):
    with pytest.warns(UserWarning, match=f"not logged with loss_type '{loss_type}'"):
        trainer = make(tmp_path, GapConfig(arm="A", probe_rows=4, probe_every=1), loss_type=loss_type)
    trainer.train()
    for step, log in enumerate(logs_of(trainer)):
        assert not [key for key in log if key.startswith(("gap/clip/", "gap/update_clip/"))]
        assert log["gap/update/oob_frac" if step else "gap/ratio/oob_frac"] is not None  # step 2: num_iterations 2


# ------------------------------------------------------------------ unsupported combinations: refused at attach
def _tool(x: int) -> int:
    """A tool.

    Args:
        x: a number.
    """
    return x


REFUSALS = {
    # (trainer attribute set before attaching, GRPOConfig overrides, gap settings) -> the error's words
    "is_correction_vllm": ({"use_vllm": True}, {}, dict(is_correction=True), "use TRL's own vllm_importance"),
    "renormalize_tools": ({"tools": [_tool]}, {}, dict(kept="renormalize"), "plain HF generate without tools"),
    "is_correction_vespo": ({}, {"loss_type": "vespo"}, dict(is_correction=True), "does not apply to loss_type vespo"),
    "renormalize_multimodal": ({"_is_vlm": True}, {}, dict(kept="renormalize"), "supports text-only models"),
    "unknown_loss_type": ({"loss_type": "ppo_kl"}, {}, {}, "loss_type 'ppo_kl' is not one bloggap supports"),
    "unknown_is_level": ({"importance_sampling_level": "group"}, {}, {}, "importance_sampling_level 'group'"),
    "renormalize_moe_aux_loss": ({"aux_loss_enabled": True}, {}, dict(kept="renormalize"),
                                 "does not support the MoE aux loss"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_unsupported_combinations_are_refused_at_attach(tmp_path, case):
    from bloggap_plugin.recipes import RecipeError
    from bloggap_plugin.trl import GapCallback

    attributes, overrides, settings, words = REFUSALS[case]
    trainer = make(tmp_path, None, mode="plain", top_p=0.8, **overrides)
    for name, value in attributes.items():
        setattr(trainer, name, value)
    with pytest.raises(RecipeError, match=words):
        GapCallback(trainer, gap=GapConfig(**settings))
    assert not [name for name in trainer.__dict__ if name.startswith("_gap")]  # nothing half-installed


# ------------------------------------------------------------------ PEFT: shadows hold the adapter
@pytest.mark.parametrize("arm", ["B", "F"])
def test_peft_shadow_arms_score_with_the_trained_adapter(tmp_path, arm, trains):
    from peft import LoraConfig

    from bloggap_plugin.core.scoring import token_logprobs

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make(tmp_path, GapConfig(arm=arm, probe_rows=0, sampler=False), trainer_cls=Spy, dtype="bf16",
                       peft_config=lora, max_steps=3, learning_rate=0.05)
        trainer.train()
    batch = trainer.spied[-1]  # generated after two optimizer steps: the adapter is no longer zero
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    mask = batch["completion_mask"].bool()
    with torch.no_grad(), trainer.model.disable_adapter():
        base = token_logprobs(trainer.model, ids, attn, batch["completion_ids"].shape[1], batch_size=4)
    adapter_effect = (base - batch["gap_trl_old_logps"])[mask].abs().max()
    precision_gap = (batch["old_per_token_logps"] - batch["gap_trl_old_logps"])[mask].abs().max()
    assert adapter_effect > 0.05  # the premise: the adapter moves the log-probs
    assert precision_gap < 0.01  # bf16 vs the shadow's precision only: the shadow carries the adapter


# ------------------------------------------------------------------ gap.score_rows: rows per scoring forward
def test_score_rows_bounds_the_rows_per_forward_of_the_arms_plan(tmp_path, trains):
    """Arm B with gap.score_rows 2: the fp32 shadow scores 2 rows per forward (4 is the micro-batch) and the old
    log-probs equal the micro-batch-sized scoring to fp32 rounding."""
    from bloggap_plugin.core.plans import ScoringPlan

    seen: list = []
    original = ScoringPlan.token_logprobs

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("batch_size"))
        return original(self, *args, **kwargs)

    olds = {}
    for rows in (0, 2):
        seen.clear()
        ScoringPlan.token_logprobs = spy
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer = make(tmp_path / str(rows), GapConfig(arm="B", probe_rows=0, score_rows=rows), trainer_cls=Spy,
                               max_steps=1)
                trainer.train()
        finally:
            ScoringPlan.token_logprobs = original
        olds[rows] = trainer.spied[0]["old_per_token_logps"]
        assert set(seen) == ({4} if rows == 0 else {2}), seen
    torch.testing.assert_close(olds[2], olds[0], rtol=0, atol=1e-5)


def test_score_rows_is_refused_for_arm_g_and_negative():
    from bloggap_plugin.recipes import RecipeError

    with pytest.raises(RecipeError, match="does not apply to arm G"):
        GapConfig(arm="G", score_rows=2)
    with pytest.raises(RecipeError, match="gap.score_rows must be >= 0"):
        GapConfig(arm="B", score_rows=-1)


# ------------------------------------------------------------------ DeepSpeed ZeRO-3: copies refused at attach
def _zero3_on(monkeypatch) -> None:
    """What transformers reports inside a trainer launched with a ZeRO-3 DeepSpeed config."""
    import transformers.integrations.deepspeed as hf_deepspeed

    monkeypatch.setattr(hf_deepspeed, "is_deepspeed_zero3_enabled", lambda: True)


@pytest.mark.parametrize("arm", ["B", "D", "E", "F", "I"])
def test_zero3_refuses_the_arms_that_copy_the_policys_weights(tmp_path, monkeypatch, arm):
    """Under ZeRO-3 each parameter is a slice gathered only inside its module's forward: by hand on CPU (DeepSpeed
    0.19.8, 2 gloo processes) B's shadow failed to build ('Cannot copy out of meta tensor') and E with fp32
    weights trained with a head frozen at the first weights."""
    from bloggap_plugin.recipes import RecipeError
    from bloggap_plugin.trl import GapCallback

    trainer = make(tmp_path, None, mode="plain")
    _zero3_on(monkeypatch)
    with pytest.raises(RecipeError, match=rf"DeepSpeed ZeRO-3 .*arm {arm} .*copies the policy's weights.*FSDP2"):
        GapCallback(trainer, gap=GapConfig(arm=arm, probe_rows=0))
    assert not [name for name in trainer.__dict__ if name.startswith("_gap")]


def test_zero3_refuses_the_probe_and_lets_the_arms_without_copies_attach(tmp_path, monkeypatch):
    from bloggap_plugin.recipes import RecipeError
    from bloggap_plugin.trl import GapCallback

    trainer = make(tmp_path, None, mode="plain")
    _zero3_on(monkeypatch)
    with pytest.raises(RecipeError, match=r"DeepSpeed ZeRO-3 .*gap.probe_rows: 4 .*set gap.probe_rows: 0"):
        GapCallback(trainer, gap=GapConfig(arm="A", probe_rows=4))
    for arm in ("A", "C", "G"):  # A and C (probe_rows 0) also trained under ZeRO-3 by hand; G: untested there
        trainer = make(tmp_path / arm, None, mode="plain")
        GapCallback(trainer, gap=GapConfig(arm=arm, probe_rows=0))
        assert trainer._gap_session.state.arm.letter == arm
