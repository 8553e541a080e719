"""The TRL adapter's per-phase values cannot outlive their phase: a loss pass's (``GapState.loss_pass``) are gone when
it ends, also by an exception, and each training generation starts from a fresh ``GenerationPhase``, so nothing of
the previous one (a generation that failed halfway included) is visible in the next."""

from __future__ import annotations

import pytest
import torch
from _support import trl_runs
from trl import GRPOTrainer

from bloggap_plugin.recipes import GapConfig
from bloggap_plugin.trl.state import AttachSettings, GapState, GenerationPhase, Resources


def _state() -> GapState:
    return GapState(settings=AttachSettings(config=GapConfig()), resources=Resources(generator=torch.Generator()))


def test_an_exception_inside_the_loss_pass_leaves_no_loss_values():
    state = _state()
    logps = torch.zeros(2, 3)
    with pytest.raises(RuntimeError, match="inside the pass"), state.loss_pass(kept="kept sets") as loss:
        assert state.in_loss and state.loss.kept == "kept sets"
        loss.new_logps = logps
        assert state.new_logps is logps
        raise RuntimeError("inside the pass")
    assert state.loss is None and state.in_loss is False and state.new_logps is None


def test_loss_passes_do_not_nest():
    state = _state()
    with state.loss_pass(), pytest.raises(RuntimeError, match="a loss pass began inside another"):
        with state.loss_pass():
            pass
    assert state.loss is None


def test_a_generation_starts_from_fresh_values_and_skip_old_ends_with_trls_call():
    state = _state()
    with pytest.raises(RuntimeError, match="reward failed"), state.trl_generation(skip_old=True) as first:
        assert state.generation is first and first.skip_old
        first.pending_record, first.drives, first.old_skipped, first.old_step = "record", True, True, 3
        raise RuntimeError("reward failed")
    assert first.skip_old is False  # reset on the way out, also by an exception
    with state.trl_generation(skip_old=False) as second:
        assert second == GenerationPhase()  # nothing of the failed generation: record, drives, old_skipped, step
    assert state.generation is second


def test_a_loss_that_fails_after_the_training_forward_leaves_no_new_logps(tmp_path, trains, monkeypatch):
    """TRL's _compute_loss raises after the training forward left its log-probs: they do not outlive the pass."""
    original = GRPOTrainer._compute_loss
    forwards = []

    def failing_loss(self, model, inputs):
        original(self, model, inputs)
        forwards.append(self._gap_session.state.new_logps)
        raise RuntimeError("loss failed")

    monkeypatch.setattr(GRPOTrainer, "_compute_loss", failing_loss)
    trainer = trl_runs.make(tmp_path, gap=GapConfig(arm="C"), max_steps=1)
    with pytest.raises(RuntimeError, match="loss failed"):
        trainer.train()
    assert len(forwards) == 1 and forwards[0] is not None and forwards[0].shape[0] == 4  # set inside the pass
    state = trainer._gap_session.state
    assert state.in_loss is False and state.new_logps is None


def test_a_generation_that_failed_halfway_leaves_its_sampler_record_to_no_later_generation(tmp_path, trains,
                                                                                           monkeypatch):
    """The first generation's reward function raises after HF generate recorded the sampler; on the next call of
    train() the new generation sees no record until its own generate keeps one."""
    calls = []

    def reward_failing_once(completions, **kwargs):
        calls.append(len(completions))
        if len(calls) == 1:
            raise RuntimeError("reward failed")
        return [float(len(c) % 3) for c in completions]

    monkeypatch.setattr(trl_runs, "reward", reward_failing_once)
    trainer = trl_runs.make(tmp_path, gap=GapConfig(arm="C"), max_steps=1)
    session = trainer._gap_session
    with pytest.raises(RuntimeError, match="reward failed"):
        trainer.train()
    assert session.state.generation.pending_record is not None  # the failed generation's, not yet aligned
    seen = []
    generate = session.generate_single_turn

    def spied(*args, **kwargs):
        seen.append(session.state.generation.pending_record)
        return generate(*args, **kwargs)

    monkeypatch.setattr(session, "generate_single_turn", spied)
    trainer.train()
    assert seen and all(record is None for record in seen)
    assert "gap/sampler/oob_frac" in trl_runs.first_log(trainer)  # its own record was kept and aligned
