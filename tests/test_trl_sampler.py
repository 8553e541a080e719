"""The HF-generate sampler recorder inside real TRL 1.16 GRPO runs: bitwise plain TRL, generation config, modes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from bloggap_plugin.recipes import GapConfig  # noqa: E402
from tests.test_trl import logs_of, make  # noqa: E402

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
def test_arm_A_is_bitwise_plain_trl_with_combined_truncation(tmp_path, truncation):
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
