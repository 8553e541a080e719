"""vLLM's batch-invariant mode confined to the colocated engine's steps (arms I and J), on CPU.

A stand-in for ``vllm.model_executor.layers.batch_invariant`` turns the mode on the way vLLM 0.26 does (an aten
override registered through ``torch.library``, ``torch.bmm`` replaced, torch's matmul settings changed, the module's
``_batch_invariant_MODE`` / ``_batch_invariant_LIB``), with a ``bmm`` whose output is recognisable (all zeros), so the
tests can tell which ``bmm`` ran.
"""

from __future__ import annotations

import types

import pytest
import torch
from _support.fake_vllm import install_fake_vllm_modules

from bloggap_plugin.core.errors import UsageError
from bloggap_plugin.core.vllm import kernels as vllm_kernels
from bloggap_plugin.core.vllm.kernels import MatmulSettings
from bloggap_plugin.core.vllm.versions import form_layout
from bloggap_plugin.trl import vllm_colocate


def _zeros_bmm(a, b, *, out=None):
    return torch.zeros(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype)


@pytest.fixture(params=["0.26.0", "0.31.0"])
def fake_vllm(monkeypatch, request):
    """vLLM's batch-invariant module with its mode switch (CPU dispatch key, zeros for bmm), where each release keeps
    it (0.26: ``vllm.model_executor.layers.batch_invariant``; 0.31: ``vllm.model_executor.determinism``)."""
    module = types.ModuleType(form_layout(request.param).batch_invariant)
    module._batch_invariant_MODE = False
    module._batch_invariant_LIB = None

    def enable_batch_invariant_mode():
        if module._batch_invariant_MODE:
            return
        module._batch_invariant_MODE = True
        module._batch_invariant_LIB = torch.library.Library("aten", "IMPL")
        module._batch_invariant_LIB.impl("aten::bmm", _zeros_bmm, "CPU", allow_override=True)
        torch.bmm = _zeros_bmm
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False

    module.enable_batch_invariant_mode = enable_batch_invariant_mode
    install_fake_vllm_modules(monkeypatch, request.param, module)
    plain = MatmulSettings.current()
    original_bmm = torch.bmm
    yield module
    if module._batch_invariant_LIB is not None:
        module._batch_invariant_LIB._destroy()
    torch.bmm = original_bmm
    plain.apply()


def _bmm_is_plain() -> bool:
    a, b = torch.ones(1, 2, 3), torch.ones(1, 3, 2)
    return bool((torch.bmm(a, b) == 3).all()) and bool((torch.matmul(a, b) == 3).all())


def test_suspend_turns_the_process_wide_mode_off_and_restores_the_settings(fake_vllm):
    plain = MatmulSettings.current()
    assert vllm_kernels.suspend_batch_invariant_mode(plain) is False  # off: nothing to do
    fake_vllm.enable_batch_invariant_mode()
    assert not _bmm_is_plain() and vllm_kernels.vllm_batch_invariant_active()
    assert MatmulSettings.current() != plain
    assert vllm_kernels.suspend_batch_invariant_mode(plain) is True
    assert _bmm_is_plain()  # the dispatcher's override and the Python binding both gone
    assert torch.bmm is torch._C._VariableFunctions.bmm
    assert MatmulSettings.current() == plain
    assert fake_vllm._batch_invariant_MODE is False and fake_vllm._batch_invariant_LIB is None
    assert not vllm_kernels.vllm_batch_invariant_active()


def test_engine_batch_invariance_turns_the_mode_on_for_the_block_only(fake_vllm):
    plain = MatmulSettings.current()
    fake_vllm.enable_batch_invariant_mode()
    vllm_kernels.suspend_batch_invariant_mode(plain)
    with vllm_kernels.engine_batch_invariance(plain):
        assert not _bmm_is_plain() and vllm_kernels.vllm_batch_invariant_active()
    assert _bmm_is_plain() and MatmulSettings.current() == plain
    with pytest.raises(RuntimeError, match="engine step failed"), vllm_kernels.engine_batch_invariance(plain):
        raise RuntimeError("engine step failed")
    assert _bmm_is_plain() and not vllm_kernels.vllm_batch_invariant_active()


class _Engine:
    """A colocate ``LLM`` stand-in: ``generate`` records whether the mode was on and which bmm ran."""

    def __init__(self):
        self.seen: list[tuple[bool, bool]] = []

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        self.seen.append((vllm_kernels.vllm_batch_invariant_active(), _bmm_is_plain()))
        return [f"out:{p}" for p in prompts]


def _trainer(engine):
    return types.SimpleNamespace(vllm_generation=types.SimpleNamespace(llm=engine))


def test_confine_wraps_generation_and_frees_the_trainer(fake_vllm):
    plain = MatmulSettings.current()
    engine = _Engine()
    engine._bloggap_plain_matmul = plain  # what vllm_colocate_engine records before the engine starts
    fake_vllm.enable_batch_invariant_mode()  # the engine's start-up
    trainer = _trainer(engine)
    assert vllm_colocate.confine_batch_invariance(trainer, environ={}) is True
    assert _bmm_is_plain() and MatmulSettings.current() == plain  # the trainer's own passes
    assert trainer.vllm_generation.llm.generate(["p0", "p1"], sampling_params=None) == ["out:p0", "out:p1"]
    assert trainer.vllm_generation.llm.generate(["p2"]) == ["out:p2"]
    assert engine.seen == [(True, False), (True, False)]  # generation in the mode, every time
    assert _bmm_is_plain() and not vllm_kernels.vllm_batch_invariant_active()


@pytest.mark.parametrize("case", ["process", "no record", "mode off"])
def test_confine_changes_nothing_where_it_should_not(fake_vllm, case):
    engine = _Engine()
    if case != "no record":
        engine._bloggap_plain_matmul = MatmulSettings.current()
    if case != "mode off":
        fake_vllm.enable_batch_invariant_mode()
    environ = {vllm_colocate.BATCH_INVARIANCE_SCOPE_ENV: "Process"} if case == "process" else {}
    generate = engine.generate
    assert vllm_colocate.confine_batch_invariance(_trainer(engine), environ=environ) is False
    assert engine.generate == generate
    assert vllm_kernels.vllm_batch_invariant_active() is (case != "mode off")


def test_a_bad_scope_value_is_refused_naming_the_variable():
    with pytest.raises(UsageError, match="BLOGGAP_VLLM_BATCH_INVARIANCE='everywhere'.*engine.*process"):
        vllm_colocate.batch_invariance_scope_setting({vllm_colocate.BATCH_INVARIANCE_SCOPE_ENV: "everywhere"})
    assert vllm_colocate.batch_invariance_scope_setting({}) == "engine"


def test_the_colocate_engine_records_the_settings_from_before_its_start(monkeypatch, fake_vllm):
    from trl.generation import vllm_generation

    class LLM:
        def __init__(self, *args, **kwargs):
            self.kwargs = kwargs
            fake_vllm.enable_batch_invariant_mode()  # vLLM's worker start-up

    monkeypatch.setattr(vllm_generation, "LLM", LLM, raising=False)
    before = MatmulSettings.current()
    with vllm_colocate.vllm_colocate_engine(enforce_eager=True):
        llm = vllm_generation.LLM(model="m")
    assert llm.kwargs == {"model": "m", "enforce_eager": True}
    assert llm._bloggap_plain_matmul == before != MatmulSettings.current()


def _gap(arm: str):
    from bloggap_plugin.recipes import GapConfig

    return GapConfig(arm=arm)


def _args(use_vllm=True, mode="colocate"):
    return types.SimpleNamespace(use_vllm=use_vllm, vllm_mode=mode)


@pytest.mark.parametrize("arm", ["I", "J"])
def test_a_process_that_owns_its_run_sets_what_arms_i_and_j_need(arm):
    environ: dict = {}
    added = vllm_colocate.own_batch_invariance_env(_gap(arm), _args(), environ)
    assert added == environ == {"VLLM_BATCH_INVARIANT": "1", "TRITON_F32_DEFAULT": "ieee"}
    kept = {"VLLM_BATCH_INVARIANT": "0"}
    assert vllm_colocate.own_batch_invariance_env(_gap(arm), _args(), kept) == {"TRITON_F32_DEFAULT": "ieee"}
    assert kept["VLLM_BATCH_INVARIANT"] == "0"  # the user's value stays (and the arm's check refuses it)


@pytest.mark.parametrize(("arm", "args"), [("A", _args()), ("H", _args()), ("I", _args(use_vllm=False)),
                                           ("J", _args(mode="server"))])
def test_other_arms_and_engines_get_no_variables(arm, args):
    environ: dict = {}
    assert vllm_colocate.own_batch_invariance_env(_gap(arm), args, environ) == {} == environ
