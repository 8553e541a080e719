"""``gap.i_pieces`` is parsed once, when the config is validated, into ``GapConfig.i_form``; every reader (the vLLM
colocate checks, the scorer's arm I/J plan) uses that one parsed value, so they cannot disagree."""

from __future__ import annotations

import types

import pytest

from bloggap_plugin.core.vllm import form as vllm_form
from bloggap_plugin.core.vllm import versions as vllm_versions
from bloggap_plugin.recipes import GapConfig, RecipeError
from bloggap_plugin.trl import vllm_colocate
from bloggap_plugin.trl.scorer import Scorer

# pieces -> (batch_invariant, logprobs, calls vLLM's kernels): read from the presets' definitions (docs/arm_i.md)
PIECES = {
    "all": (True, "v2_sampler", True),
    "all,logprobs=log_softmax": (True, "log_softmax", True),
    "all,batch_invariant=false": (False, "v2_sampler", True),
    "torch": (False, "log_softmax", False),
    "torch,attention=vllm_fa": (False, "log_softmax", True),
    "hf,batch_invariant=true": (True, "log_softmax", True),
}


@pytest.fixture
def parses(monkeypatch) -> list[str]:
    """Every text ``core.vllm.form.parse_form`` parses from here on."""
    seen: list[str] = []
    original = vllm_form.parse_form

    def counting(spec):
        if isinstance(spec, str):
            seen.append(spec)
        return original(spec)

    monkeypatch.setattr(vllm_form, "parse_form", counting)
    return seen


def _engine_trainer():
    return types.SimpleNamespace(vllm_generation=types.SimpleNamespace(llm=types.SimpleNamespace(llm_engine=object())))


@pytest.mark.parametrize("pieces", list(PIECES))
@pytest.mark.parametrize("arm", ["I", "J"])
def test_every_reader_of_the_pieces_agrees_with_the_one_parse(monkeypatch, parses, arm, pieces):
    batch_invariant, logprobs, calls_vllm = PIECES[pieces]
    gap = GapConfig(arm=arm, i_pieces=pieces)
    assert parses == [pieces]  # parsed once, at validation
    form = gap.i_form
    assert (form.batch_invariant, form.logprobs, bool(form.needs_vllm())) == (batch_invariant, logprobs, calls_vllm)

    assert vllm_colocate.needs_batch_invariant(gap) is batch_invariant
    for runner, wanted in (("v1", "log_softmax"), ("v2", "v2_sampler")):
        assert (vllm_colocate.model_runner_refusal(gap, runner) is None) is (logprobs == wanted), runner
    asked = []
    monkeypatch.setattr(vllm_versions, "vllm_problem", lambda needs_form=False: asked.append(needs_form))
    vllm_colocate.check_engine_vllm(_engine_trainer(), gap)
    assert asked == [calls_vllm]

    made = []
    monkeypatch.setattr("bloggap_plugin.core.plans.make_plan", lambda policy, plan, **kwargs: made.append(kwargs))
    trainer = types.SimpleNamespace(accelerator=types.SimpleNamespace(device="cpu", unwrap_model=lambda m: m),
                                    model=object())
    state = types.SimpleNamespace(config=gap, arm=gap.arm_spec)
    Scorer(trainer, state).make_plan(gap.arm_spec.plan)
    assert made[0]["pieces"] is form and made[0].get("over_parameters", False) is (arm == "J")
    assert parses == [pieces] and gap.i_form is form  # no reader parsed the text again


def test_reassigned_pieces_are_parsed_again_and_bad_ones_refused(parses):
    gap = GapConfig(arm="I", i_pieces="torch")
    torch_form = gap.i_form
    gap.i_pieces = "hf"
    assert gap.i_form == vllm_form.FORM_PRESETS["hf"] and gap.i_form is gap.i_form and torch_form.norm == "torch"
    assert parses == ["torch", "hf"]
    gap.i_pieces = "hf,attention=nope"
    with pytest.raises(RecipeError, match=r"gap\.i_pieces: arm I piece attention=.nope.: use one of sdpa, vllm_fa"):
        _ = gap.i_form
    assert GapConfig(arm="I", i_pieces="torch") == GapConfig(arm="I", i_pieces="torch")  # the parse is not a field
    assert "i_form" not in GapConfig(arm="I").to_dict()
