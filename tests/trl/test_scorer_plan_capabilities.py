"""The TRL scorer treats plans by their registry entry's capabilities (core.plans.PlanEntry), not by their names: a
plan registered under a new name gets the device, the pieces and the layers exactly as its entry says; so do the
recipe's checks and the colocate engine's (gap.i_pieces, its positions, batch-invariant mode, the model runner)."""

from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from bloggap_plugin.core import arms
from bloggap_plugin.core.plans import PLANS, REFERENCE_PLAN, PlanEntry, PlanOptions, plan_entry
from bloggap_plugin.recipes import GapConfig, RecipeError
from bloggap_plugin.trl.scorer import Scorer
from bloggap_plugin.trl.vllm_colocate import model_runner_refusal, needs_batch_invariant

DEVICE = torch.device("meta")  # the trainer's device: a value no plan would choose by itself


class FakePlan:
    """What a plan builder returns, recording its name and options."""

    def __init__(self, name: str, options: PlanOptions):
        self.name, self.options = name, options
        self.layers = list(options.layers or [])
        self.tf32_option, self.tf32 = options.tf32, bool(options.tf32)
        self.sharded = True  # made from a sharded policy: the test policy is not, so a copying plan is rebuilt
        self.closed, self.syncs = False, 0

    def close(self) -> None:
        self.closed = True

    def sync(self, policy) -> None:
        self.syncs += 1


@pytest.fixture
def register(monkeypatch):
    """``register(name, **capabilities) -> built``: a plan ``name`` in the registry whose builder appends each plan
    it builds to ``built``."""

    def add(name: str, **capabilities) -> list[FakePlan]:
        built: list[FakePlan] = []

        def build(policy, plan_name, options):
            built.append(FakePlan(plan_name, options))
            return built[-1]

        monkeypatch.setitem(PLANS, name, PlanEntry(build, **capabilities))
        if name not in arms.PLAN_NAMES:
            monkeypatch.setattr(arms, "PLAN_NAMES", (*arms.PLAN_NAMES, name))
        return built

    return add


def _scorer(gap: GapConfig, plan: str = "fake", onpolicy_forward: bool = False) -> Scorer:
    policy = nn.Linear(2, 2)
    trainer = SimpleNamespace(
        model=policy, state=SimpleNamespace(global_step=0),
        accelerator=SimpleNamespace(device=DEVICE, unwrap_model=lambda model: model),
    )
    state = SimpleNamespace(config=gap, arm=SimpleNamespace(plan=plan, onpolicy_forward=onpolicy_forward),
                            resources=SimpleNamespace(plan=None, ref_plan=None, plan_step=None, ref_step=None))
    return Scorer(trainer, state)


@pytest.mark.parametrize(("takes_device", "takes_layers", "takes_pieces", "onpolicy"),
                         list(itertools.product([False, True], repeat=4)))
def test_a_registered_plans_capabilities_decide_what_the_scorer_passes(register, takes_device, takes_layers,
                                                                        takes_pieces, onpolicy):
    built = register("fake", takes_device=takes_device, takes_layers=takes_layers, takes_pieces=takes_pieces)
    gap = GapConfig(arm="I", i_pieces="torch,attention=vllm_fa", tf32="auto")
    plan = _scorer(gap, onpolicy_forward=onpolicy).make_plan("fake", layers=[1, 3], k=2)
    assert built == [plan] and plan.name == "fake"
    options = plan.options
    assert options.device == (DEVICE if takes_device else None)
    assert (options.layers, options.k) == (([1, 3], 2) if takes_layers else (None, 8))
    assert options.pieces == (gap.i_form if takes_pieces else None)
    assert options.over_parameters is (takes_pieces and onpolicy)
    assert options.tf32 == "auto" and options.fp16_guard is True


def test_a_plan_with_vllm_s_capabilities_under_another_name_is_given_arm_i_s_pieces(register):
    built = register("vllm_like", **{k: getattr(PLANS["vllm"], k) for k in ("takes_device", "takes_pieces")})
    gap = GapConfig(arm="J", i_pieces="hf")
    _scorer(gap, plan="vllm_like", onpolicy_forward=True).make_plan("vllm_like")
    assert built[0].options.pieces == gap.i_form and built[0].options.over_parameters is True


@pytest.mark.parametrize("copies_weights", [False, True])
def test_only_a_plan_that_copies_weights_is_rebuilt_for_a_policy_sharded_since(register, copies_weights):
    built = register("fake", copies_weights=copies_weights, takes_layers=True)
    scorer = _scorer(GapConfig())
    old = scorer.state.resources.plan = scorer.make_plan("fake", layers=[0, 4], k=2)
    current = scorer.sharded_like_policy(old)
    if not copies_weights:  # the policy as called: nothing of its own to shard
        assert current is old and len(built) == 1 and not old.closed
        return
    assert built == [old, current] and old.closed and scorer.state.resources.plan is current
    assert (current.options.layers, current.options.k) == ([0, 4], 2)  # its layers kept, as its entry takes them
    assert scorer.state.resources.plan_step is None  # synced before its next use


@pytest.mark.parametrize("fp32_everywhere", [False, True])
def test_the_reference_reuses_the_arms_plan_only_where_its_entry_computes_fp32_everywhere(register, fp32_everywhere):
    register("fake", fp32_everywhere=fp32_everywhere, copies_weights=False)
    references = register(REFERENCE_PLAN, takes_device=True, fp32_everywhere=True, copies_weights=False)
    scorer = _scorer(GapConfig(tf32=True))
    arm_plan = scorer.state.resources.plan = scorer.make_plan("fake", tf32=False)
    reference = scorer.reference_plan()
    if fp32_everywhere:
        assert reference is arm_plan and references == [] and arm_plan.syncs == 1
    else:  # the reference plan, IEEE fp32 whatever gap.tf32 says
        assert references == [reference] and reference.options.tf32 is False and reference.options.device == DEVICE
        assert reference.syncs == 0  # made from the current weights: their version is recorded, no sync needed
    assert scorer.reference_plan() is reference  # kept


def test_the_registry_entries_say_what_the_built_in_plans_take():
    """The capabilities of the built-in plans, as make_plan's checks read them (their errors unchanged)."""
    capabilities = {name: {k for k in ("takes_device", "takes_layers", "takes_pieces", "copies_weights",
                                       "fp32_everywhere") if getattr(entry, k)} for name, entry in PLANS.items()}
    assert capabilities == {
        "bf16": set(), "fp32": {"takes_device", "copies_weights", "fp32_everywhere"},
        "fp16": {"takes_device", "copies_weights"}, "fp32_head": {"copies_weights"},
        "guided": {"takes_layers", "copies_weights"}, "vllm": {"takes_device", "takes_pieces", "copies_weights"},
    }
    assert plan_entry("D") is PLANS["guided"] and plan_entry("J") is PLANS["vllm"]
    assert PLANS[REFERENCE_PLAN].fp32_everywhere


def test_an_arm_whose_plan_takes_pieces_gets_arm_i_s_settings_under_another_plan_name(register, monkeypatch):
    register("vllm_like", takes_device=True, takes_pieces=True)
    monkeypatch.setitem(arms.ARMS, "I", dataclasses.replace(arms.ARMS["I"], plan="vllm_like"))
    gap = GapConfig(arm="I")  # i_pieces "all": batch-invariant matmuls, the V2 runner's log-probs
    assert gap.takes_pieces and gap.i_form.batch_invariant
    assert needs_batch_invariant(gap) is True
    assert "model runner V1" in model_runner_refusal(gap, "v1")
    assert GapConfig(arm="I", i_pieces="torch").i_form.norm == "torch"
    with pytest.raises(RecipeError, match="set gap.positions: mask"):
        GapConfig(arm="I", positions="arange")


def test_an_arm_whose_plan_takes_no_pieces_refuses_them_whatever_its_plan_is_called(monkeypatch):
    monkeypatch.setitem(PLANS, "vllm", dataclasses.replace(PLANS["vllm"], takes_pieces=False))
    gap = GapConfig(arm="I", positions="arange")  # no positions demanded: the plan computes no vLLM form
    assert not gap.takes_pieces and needs_batch_invariant(gap) is False and model_runner_refusal(gap, "v1") is None
    with pytest.raises(RecipeError, match="gap.i_pieces only applies to arm I"):
        GapConfig(arm="I", i_pieces="torch")


def test_k_beyond_the_model_warns_for_an_arm_whose_plan_takes_layers_under_another_name(register, monkeypatch):
    register("guided_like", takes_layers=True)
    monkeypatch.setitem(arms.ARMS, "D", dataclasses.replace(arms.ARMS["D"], plan="guided_like"))
    with pytest.warns(UserWarning, match="more than this model's 2 decoder layers: arm D runs all 2 in fp32"):
        GapConfig(arm="D").check_layers(2)
