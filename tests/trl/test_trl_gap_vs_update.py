"""The gap apart from the update (TRL 1.16, CPU, tiny llama, arm A): a training micro-batch with no optimizer step
since its generation's old log-probs logs ``gap/ratio/*``, and those values are exactly the statistics of TRL's own
old log-probs against TRL's own training forward, taken from a plain TRL run with the same seed; a micro-batch after
an optimizer step logs ``gap/update/*`` (the policy update) and no ``gap/ratio/*``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from _support.trl_runs import logs_of, make  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from bloggap_plugin.core.metric_specs import names  # noqa: E402
from bloggap_plugin.recipes import GapConfig  # noqa: E402

BAND = 0.1
RATIO = [name for name in names("trl") if name.startswith("gap/ratio/")]
UPDATE = [name for name in names("trl") if name.startswith("gap/update/")]


def _statistics(old: torch.Tensor, new: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """One micro-batch's ratio statistics from their definitions, by boolean selection in float64."""
    d = (new.double() - old.double())[mask.bool()]
    ratio = d.exp()
    return {"oob_frac": float(((ratio < 1 - BAND) | (ratio > 1 + BAND) | ~d.isfinite()).sum()) / d.numel(),
            "abs_dlogp_mean": float(d.abs().sum()) / d.numel(), "abs_dlogp_max": float(d.abs().max()),
            "exact_frac": float((d == 0).sum()) / d.numel()}


def _plain_trl_micro_batches(tmp_path, monkeypatch, **overrides) -> list[dict[str, float]]:
    """Per training micro-batch of a plain TRL run: the ratio statistics of the old log-probs TRL's loss read
    against the log-probs of TRL's training forward."""
    seen: list = []
    forward, compute_loss = GRPOTrainer._get_per_token_logps_and_entropies, GRPOTrainer._compute_loss

    def recording_forward(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if torch.is_grad_enabled():  # the training forward (TRL's old pass runs without grad)
            seen[-1]["new"] = out[0].detach()
        return out

    def recording_loss(self, model, inputs):
        seen.append({"old": inputs["old_per_token_logps"], "mask": inputs["completion_mask"]})
        return compute_loss(self, model, inputs)

    with monkeypatch.context() as patch:
        patch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", recording_forward)
        patch.setattr(GRPOTrainer, "_compute_loss", recording_loss)
        torch.manual_seed(7)
        make(tmp_path, mode="plain", **overrides).train()
    return [_statistics(s["old"], s["new"], s["mask"]) for s in seen]


@pytest.mark.parametrize("overrides", [
    {"num_iterations": 2},  # generation every 2 steps: steps 1, 3 first iteration; 2, 4 the second
    {"num_iterations": 1, "steps_per_generation": 4},  # one iteration over 2 optimizer steps: the second after a step
], ids=["two-iterations", "one-iteration-two-steps"])
def test_first_iteration_gap_is_trls_own_pass_and_the_update_is_apart(tmp_path, monkeypatch, overrides, trains):
    common = dict(max_steps=4, gradient_accumulation_steps=2, **overrides)
    expected = _plain_trl_micro_batches(tmp_path / "plain", monkeypatch, **common)
    torch.manual_seed(7)
    trainer = make(tmp_path / "armA", GapConfig(arm="A", probe_rows=0, band=BAND), **common)
    trainer.train()
    logs = logs_of(trainer)
    assert len(logs) == 4 and len(expected) == 8  # 2 micro-batches per optimizer step
    for step, log in enumerate(logs):
        update = step % 2 == 1  # the second optimizer step of each generation follows the first's update
        logged, absent = (UPDATE, RATIO) if update else (RATIO, UPDATE)
        assert not any(name in log for name in absent), (step, log.keys())
        calls = expected[2 * step: 2 * step + 2]
        for name in logged:
            statistic = name.rsplit("/", 1)[1]
            assert log[name] == pytest.approx(sum(c[statistic] for c in calls) / 2, rel=1e-12, abs=0.0), (step, name)
    assert logs[1]["gap/update/abs_dlogp_max"] > 0  # the update moved the weights: not a zero column


def test_one_iteration_per_step_logs_only_the_gap(tmp_path, trains):
    """num_iterations 1, one optimizer step per generation (TRL runs no old pass: its ratio is 1): every loss pass
    measures the gap of arm A's own scoring; no update is ever logged."""
    torch.manual_seed(7)
    trainer = make(tmp_path, GapConfig(arm="A", probe_rows=0), max_steps=3, num_iterations=1)
    trainer.train()
    logs = logs_of(trainer)
    assert len(logs) == 3
    for log in logs:
        assert all(name in log for name in RATIO) and not any(name in log for name in UPDATE)
        assert 0.0 <= log["gap/ratio/oob_frac"] <= 1.0


def test_clip_metrics_at_a_later_iteration_are_not_logged_as_the_gap(tmp_path, trains):
    """num_iterations 2 with tiny epsilons (arm A, probe rows every generation): the first iteration of each
    generation logs its clip statistics under ``gap/clip/*``, the second (after the first's optimizer step) under
    ``gap/update_clip/*`` only; each step's clipped share is TRL's own ``clip_ratio/region_mean`` for that step."""
    torch.manual_seed(7)
    trainer = make(tmp_path, GapConfig(arm="A", probe_rows=4, probe_every=1), max_steps=4, num_iterations=2,
                   epsilon=1e-4, epsilon_high=1e-4)
    trainer.train()
    logs = logs_of(trainer)
    assert len(logs) == 4
    for step, log in enumerate(logs):
        group, other = ("update_clip", "clip") if step % 2 else ("clip", "update_clip")
        assert not any(key.startswith(f"gap/{other}/") for key in log), (step, sorted(log))
        assert log[f"gap/{group}/clipped_frac"] == pytest.approx(log["clip_ratio/region_mean"], abs=1e-12)
        assert 0.0 <= log.get(f"gap/{group}/flip_frac", 0.0) <= 1.0  # logged where a micro-batch held probe rows
    assert logs[1]["gap/update_clip/clipped_frac"] > 0  # the premise: the update moved ratios past 1 +- 1e-4
    assert any("gap/clip/flip_frac" in log for log in logs) and any("gap/update_clip/flip_frac" in log for log in logs)
