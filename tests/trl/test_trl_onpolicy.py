"""Arm J (exactly on-policy) in TRL 1.16 GRPO on the CPU fake of the colocate vLLM engine: the training forward is arm
I's form over the policy's parameters, so at each generation's first iteration the new log-probs are the old ones bit
for bit; arm I in the same run is not; what arm J cannot train with is refused by name."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

pytest.importorskip("trl")

from _support.fake_vllm import use_fake_vllm  # noqa: E402
from _support.trl_runs import logs_of, make  # noqa: E402

from bloggap_plugin.recipes import GapConfig, RecipeError  # noqa: E402
from bloggap_plugin.trl import GapCallback  # noqa: E402

STEPS = 4  # two generations (steps_per_generation 2, num_iterations 2)


def _spy_on_masks(monkeypatch) -> list:
    """Record, per arm J training forward, ``(TRL's attention mask, the batch's host mask, the mask the forward got)``."""
    from bloggap_plugin.core.plans.vllm_shadow import OnPolicyForward
    from bloggap_plugin.trl.scorer import Scorer

    seen: list = []
    onpolicy_logps, forward_logprobs = Scorer.onpolicy_logps, OnPolicyForward.token_logprobs

    def spy_scorer(self, input_ids, attention_mask, *args, host_mask=None, **kwargs):
        seen.append([attention_mask.clone(), host_mask, None])
        return onpolicy_logps(self, input_ids, attention_mask, *args, host_mask=host_mask, **kwargs)

    def spy_forward(self, input_ids, attention_mask, *args, **kwargs):
        seen[-1][2] = attention_mask
        return forward_logprobs(self, input_ids, attention_mask, *args, **kwargs)

    monkeypatch.setattr(Scorer, "onpolicy_logps", spy_scorer)
    monkeypatch.setattr(OnPolicyForward, "token_logprobs", spy_forward)
    return seen


def _spy_on_old_pass(monkeypatch) -> tuple[list, list]:
    """``(masks the old pass's plan scored with, each generation's batch host mask)``."""
    from bloggap_plugin.core.plans.vllm_shadow import VllmFormParamsPlan
    from bloggap_plugin.trl.session import GapSession

    scored, batches = [], []
    plan_logprobs, generate = VllmFormParamsPlan.token_logprobs, GapSession.generate_and_score_completions

    def spy_plan(self, input_ids, attention_mask, *args, **kwargs):
        scored.append(attention_mask)
        return plan_logprobs(self, input_ids, attention_mask, *args, **kwargs)

    def spy_generate(self, inputs):
        output = generate(self, inputs)
        batches.append(output.get("gap_host_mask"))
        return output

    monkeypatch.setattr(VllmFormParamsPlan, "token_logprobs", spy_plan)
    monkeypatch.setattr(GapSession, "generate_and_score_completions", spy_generate)
    return scored, batches


def _run(tmp_path, arm: str, **overrides):
    torch.manual_seed(4321)
    trainer = make(tmp_path, mode="plain", max_steps=STEPS, gradient_checkpointing=False, **overrides)
    use_fake_vllm(trainer)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.add_callback(GapCallback(trainer, gap=GapConfig(arm=arm, i_pieces="torch", probe_rows=0)))
        trainer.train()
    changed = any(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters(), strict=True))
    return trainer, logs_of(trainer), changed


@pytest.mark.parametrize("bf16", [False, True])
def test_arm_j_ratio_is_exactly_one_at_each_generations_first_iteration(tmp_path, bf16, trains, monkeypatch):
    """Steps 1 and 3 are the first iteration of a generation (the weights are those the old log-probs were scored
    with): under arm J every token's new log-prob equals the old one bitwise (exact share 1, none out of band); the
    loss is finite and the weights train (fp32 masters, with and without TRL's bf16 autocast). Arm I (same run, TRL's
    training forward) is not bitwise there. Every training forward lays out its rows from the batch's host copy of
    the mask (``gap_host_mask``, shuffled and split with the rows): equal to TRL's own mask of that micro-batch; the
    old pass scored from the same copy."""
    seen = _spy_on_masks(monkeypatch)
    old_pass, batches = _spy_on_old_pass(monkeypatch)
    trainer, logs, changed = _run(tmp_path / "J", "J", bf16=bf16)
    assert len(logs) == STEPS and changed
    assert len(seen) >= STEPS
    for trl_mask, host_mask, given in seen:
        assert host_mask is not None and host_mask.device.type == "cpu" and given is host_mask
        assert torch.equal(host_mask, trl_mask.cpu())
    # the old pass scores from the same host copy (one per generation), before it goes into the batch
    assert len(batches) == STEPS // 2 and [id(m) for m in old_pass] == [id(m) for m in batches]
    assert trainer._gap_session.state.resources.onpolicy is not None
    assert not hasattr(trainer._gap_session.state.resources.plan, "shadow")  # old log-probs over the parameters: no copy
    for row in logs:
        assert math.isfinite(row["loss"])
    for row in logs[0::2]:
        assert row["gap/ratio/exact_frac"] == 1.0 and row["gap/ratio/oob_frac"] == 0.0
    assert logs[1]["gap/update/exact_frac"] < 1.0  # the second iteration: the weights moved after step 1
    _, logs_i, _ = _run(tmp_path / "I", "I", bf16=bf16)
    assert logs_i[0]["gap/ratio/exact_frac"] < 1.0


@pytest.mark.parametrize(("overrides", "gap", "pattern"), [
    ({"gradient_checkpointing": True}, {}, r"gradient checkpointing .*set gradient_checkpointing: false"),
    ({"beta": 0.04}, {}, r"beta 0\.04 .*set beta: 0"),
    ({}, {"kept": "renormalize"}, r"gap\.kept: renormalize .*use gap\.kept: measure or off"),
    ({"is_fsdp_enabled": True}, {}, r"DeepSpeed or FSDP .*train on one process without them"),
    ({"is_deepspeed_enabled": True}, {}, r"DeepSpeed or FSDP"),
])
def test_arm_j_refuses_what_it_cannot_train_with(tmp_path, overrides, gap, pattern):
    """Each refusal names the setting and the fix, at attach (before any step). ``beta`` and the trainer's DeepSpeed /
    FSDP flags are set after construction (TRL would load a reference model, accelerate would need the backends)."""
    overrides = dict(overrides)
    after = {k: overrides.pop(k) for k in ("beta", "is_fsdp_enabled", "is_deepspeed_enabled") if k in overrides}
    trainer = make(tmp_path, mode="plain", **{"gradient_checkpointing": False, **overrides})
    for key, value in after.items():
        setattr(trainer.args if key == "beta" else trainer, key, value)
    use_fake_vllm(trainer, top_p=0.8)
    with warnings.catch_warnings(), pytest.raises(RecipeError, match=r"arm J \(exactly on-policy.*" + pattern):
        warnings.simplefilter("ignore")
        GapCallback(trainer, gap=GapConfig(arm="J", i_pieces="torch", probe_rows=0, **gap))


def test_arm_j_refuses_peft(tmp_path):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    with warnings.catch_warnings(), pytest.raises(RecipeError, match=r"a PEFT model .*train the full model"):
        warnings.simplefilter("ignore")
        make(tmp_path, mode="callback", gap=GapConfig(arm="J", i_pieces="torch", probe_rows=0),
             gradient_checkpointing=False, peft_config=config)


def test_arm_j_through_gap_grpo_trainer_on_hf_generate(tmp_path, trains):
    """The other entry point (``GapGRPOTrainer``, what ``bloggap train`` builds), sampling with HF ``generate``: the
    same training forward, so the first iteration's ratio is bitwise 1 there too."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make(tmp_path, GapConfig(arm="J", i_pieces="torch", probe_rows=0), gradient_checkpointing=False,
                       max_steps=2)
        trainer.train()
    logs = logs_of(trainer)
    assert logs[0]["gap/ratio/exact_frac"] == 1.0 and math.isfinite(logs[0]["loss"])
