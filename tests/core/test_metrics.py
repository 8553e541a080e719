"""bloggap_plugin.core.metrics against hand-computed values (no model)."""

from __future__ import annotations

import math

import pytest
import torch

from bloggap_plugin.core.metrics import (
    abs_dlogp_stats,
    clip_flip_fraction,
    clip_status,
    clipped_fraction,
    kl_k1,
    kl_k3,
    oob_count,
    oob_fraction,
    wilson_interval,
)


def f64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# ---------------------------------------------------------------- out-of-band rate


def test_band_edges_are_inside_and_just_beyond_is_outside():
    # ratios exactly 0.9 and 1.1 lie on the band's edges: inside. One part in 1e9 further: outside.
    ratios = [0.9, 1.1, 1.0, 0.9 * (1 - 1e-9), 1.1 * (1 + 1e-9)]
    logp_a = f64([math.log(r) for r in ratios])
    logp_b = torch.zeros(5, dtype=torch.float64)
    assert oob_count(logp_a, logp_b) == (2, 5)
    assert oob_fraction(logp_a, logp_b) == 2 / 5


def test_band_argument_and_direction():
    # exp(a - b) = 1.15: outside band 0.1, inside band 0.2; b/a = 1/1.15 = 0.8696 also outside 0.1
    logp_a = f64([math.log(1.15)])
    logp_b = f64([0.0])
    assert oob_fraction(logp_a, logp_b, band=0.1) == 1.0
    assert oob_fraction(logp_a, logp_b, band=0.2) == 0.0
    assert oob_fraction(logp_b, logp_a, band=0.1) == 1.0
    with pytest.raises(ValueError, match="band"):
        oob_fraction(logp_a, logp_b, band=0.0)
    with pytest.raises(ValueError, match="band"):
        oob_fraction(logp_a, logp_b, band=1.5)


def test_nonfinite_counts_out_of_band():
    nan, inf = float("nan"), float("inf")
    logp_a = f64([0.0, nan, inf, -inf, inf, 0.0])
    logp_b = f64([0.0, 0.0, 0.0, 0.0, inf, 0.0])  # inf - inf = nan
    assert oob_count(logp_a, logp_b) == (4, 6)


def test_mask_selects_tokens():
    logp_a = f64([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    logp_b = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    assert oob_count(logp_a, logp_b, mask) == (1, 4)
    assert oob_fraction(logp_a, logp_b, mask.bool()) == 0.25


def test_empty_mask_raises_everywhere():
    logp = torch.zeros(2, 3)
    empty = torch.zeros(2, 3, dtype=torch.bool)
    for call in (
        lambda: oob_fraction(logp, logp, empty),
        lambda: abs_dlogp_stats(logp, logp, empty),
        lambda: kl_k1(logp, logp, empty),
        lambda: kl_k3(logp, logp, empty),
        lambda: clip_flip_fraction(logp.exp(), logp.exp(), torch.ones(2), empty),
        lambda: clipped_fraction(logp.exp(), torch.ones(2), empty),
    ):
        with pytest.raises(ValueError, match="empty mask"):
            call()


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="shape"):
        oob_fraction(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="mask shape"):
        oob_fraction(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3, 2))


# ---------------------------------------------------------------- |dlogp| statistics


def test_abs_dlogp_stats_hand_computed():
    # signed differences 0.1, -0.2, 0.3, -0.4: |d| mean 0.25, max 0.4; signed mean -0.05,
    # population variance ((0.15^2 + 0.15^2 + 0.35^2 + 0.35^2) / 4) = 0.0725; p95 = sorted |d|[int(3.8)] = 0.4
    logp_a = f64([0.1, -0.2, 0.3, -0.4])
    logp_b = torch.zeros(4, dtype=torch.float64)
    stats = abs_dlogp_stats(logp_a, logp_b)
    assert stats["n"] == 4
    assert stats["mean"] == pytest.approx(0.25, abs=1e-15)
    assert stats["max"] == pytest.approx(0.4, abs=1e-15)
    assert stats["sd"] == pytest.approx(math.sqrt(0.0725), abs=1e-15)
    assert stats["p95"] == pytest.approx(0.4, abs=1e-15)
    masked = abs_dlogp_stats(logp_a, logp_b, torch.tensor([True, True, False, False]))
    assert masked["n"] == 2 and masked["max"] == pytest.approx(0.2) and masked["mean"] == pytest.approx(0.15)


def test_abs_dlogp_stats_identical_is_zero():
    logp = torch.randn(3, 5)
    stats = abs_dlogp_stats(logp, logp.clone())
    assert stats == {"mean": 0.0, "sd": 0.0, "p95": 0.0, "max": 0.0, "n": 15}


# ---------------------------------------------------------------- clip rule


def test_clip_status_trl_rule_per_sequence():
    # eps 0.2: A > 0 clipped iff r > 1.2; A < 0 clipped iff r < 0.8; edges 1.2 / 0.8 are not clipped
    ratio = f64([[1.3, 0.7, 1.2, 0.8, 1.0], [1.3, 0.7, 1.2, 0.8, 1.0]])
    advantages = f64([1.0, -1.0])
    expected = torch.tensor([[True, False, False, False, False], [False, True, False, False, False]])
    assert torch.equal(clip_status(ratio, advantages), expected)


def test_clip_status_zero_advantage_never_clipped():
    ratio = f64([[100.0, 0.01, 1.0, float("nan")]])
    assert not clip_status(ratio, f64([0.0])).any()
    assert not clip_status(ratio, torch.zeros(1, 4, dtype=torch.float64)).any()


def test_clip_status_per_token_equals_broadcast_per_sequence():
    ratio = f64([[1.3, 0.7, 1.1], [0.5, 1.5, 0.95]])
    per_seq = f64([2.0, -0.5])
    per_token = per_seq.unsqueeze(-1).expand(2, 3).clone()
    assert torch.equal(clip_status(ratio, per_seq), clip_status(ratio, per_token))
    # a genuinely per-token advantage: signs differ within the row
    mixed = f64([[1.0, -1.0, 1.0], [-1.0, 1.0, 0.0]])
    assert torch.equal(
        clip_status(ratio, mixed), torch.tensor([[True, True, False], [True, True, False]])
    )


def test_clip_status_eps_high():
    ratio = f64([[1.25, 1.29, 0.79]])
    assert torch.equal(clip_status(ratio, f64([1.0])), torch.tensor([[True, True, False]]))
    assert torch.equal(clip_status(ratio, f64([1.0]), eps_high=0.28), torch.tensor([[False, True, False]]))
    # eps_high leaves the lower side on eps_low
    assert torch.equal(clip_status(ratio, f64([-1.0]), eps_high=0.28), torch.tensor([[False, False, True]]))


def test_clipped_and_flip_fractions_hand_computed():
    ratio_a = f64([[1.3, 1.0, 0.7, 1.25]])
    ratio_b = f64([[1.1, 1.3, 0.7, 1.25]])
    advantages = f64([[1.0, 1.0, -1.0, 0.0]])
    # clipped under a: 1.3 (A>0), 0.7 (A<0) -> 2/4; under b: 1.3 (A>0), 0.7 -> 2/4; flips at 0 and 1 -> 2/4
    assert clipped_fraction(ratio_a, advantages) == 0.5
    assert clipped_fraction(ratio_b, advantages) == 0.5
    assert clip_flip_fraction(ratio_a, ratio_b, advantages) == 0.5
    mask = torch.tensor([[True, False, True, True]])
    assert clip_flip_fraction(ratio_a, ratio_b, advantages, mask) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="shape"):
        clip_flip_fraction(ratio_a, ratio_b[:, :3], advantages)


# ---------------------------------------------------------------- KL estimators


def test_kl_k1_k3_hand_computed():
    # p = (0.5, 0.25), q = (0.25, 0.5) at the two sampled tokens:
    # k1 = mean(log p - log q) = mean(log 2, -log 2) = 0
    # k3 = mean(rho - 1 - log rho), rho = q/p = (0.5, 2): ((-0.5 + log 2) + (1 - log 2)) / 2 = 0.25
    logp_p = f64([math.log(0.5), math.log(0.25)])
    logp_q = f64([math.log(0.25), math.log(0.5)])
    assert kl_k1(logp_p, logp_q) == pytest.approx(0.0, abs=1e-15)
    assert kl_k3(logp_p, logp_q) == pytest.approx(0.25, abs=1e-15)
    # one token only: k1 = log 2; k3 = 0.5 - 1 + log 2
    first = torch.tensor([True, False])
    assert kl_k1(logp_p, logp_q, first) == pytest.approx(math.log(2), abs=1e-15)
    assert kl_k3(logp_p, logp_q, first) == pytest.approx(-0.5 + math.log(2), abs=1e-15)


def test_kl_zero_for_identical_and_k3_nonnegative():
    logp = torch.randn(4, 6, dtype=torch.float64)
    assert kl_k1(logp, logp) == 0.0 and kl_k3(logp, logp) == 0.0
    other = torch.randn(4, 6, dtype=torch.float64)
    assert kl_k3(logp, other) >= 0.0


# ---------------------------------------------------------------- Wilson interval


@pytest.mark.parametrize(
    ("k", "n", "low", "high"),
    [
        # closed forms: k = 0 -> (0, z^2 / (n + z^2)); k = n -> (n / (n + z^2), 1)
        (0, 10, 0.0, 1.96**2 / (10 + 1.96**2)),
        (10, 10, 10 / (10 + 1.96**2), 1.0),
        # k = 5, n = 10 by hand: centre 0.5, half = 1.96 * sqrt(0.025 + 0.009604) / 1.38416 = 0.263414
        (5, 10, 0.5 - 0.2634139, 0.5 + 0.2634139),
        # Newcombe (1998), Statistics in Medicine 17:857, Table I, method 3 (score, no continuity correction)
        (81, 263, 0.2553, 0.3662),
        (15, 148, 0.0624, 0.1605),
        (0, 20, 0.0, 0.1611),
        (1, 29, 0.0061, 0.1718),
    ],
)
def test_wilson_interval_values(k, n, low, high):
    got_low, got_high = wilson_interval(k, n)
    assert got_low == pytest.approx(low, abs=1e-4)
    assert got_high == pytest.approx(high, abs=1e-4)


def test_wilson_interval_bad_input():
    with pytest.raises(ValueError, match="n > 0"):
        wilson_interval(0, 0)
    with pytest.raises(ValueError, match="k must be"):
        wilson_interval(5, 4)
    with pytest.raises(ValueError, match="k must be"):
        wilson_interval(-1, 4)


def test_trl_clip_status_per_loss_type_and_level():
    from bloggap_plugin.core.metrics import trl_clip_status

    w = torch.tensor([[0.7, 0.95, 1.1, 1.3, 2.0]], dtype=torch.float64)
    log_ratio = torch.log(w)
    mask = torch.ones_like(w, dtype=torch.bool)
    pos, neg = f64([1.0]), f64([-1.0])
    kw = dict(eps_low=0.2, eps_high=0.2)
    # PPO rule: A > 0 clips w > 1.2; A < 0 clips w < 0.8; delta 1.5 also clips A < 0 with w > 1.5
    assert trl_clip_status(log_ratio, pos, mask, "grpo", **kw).tolist() == [[False, False, False, True, True]]
    assert trl_clip_status(log_ratio, neg, mask, "dapo", **kw).tolist() == [[True, False, False, False, False]]
    assert trl_clip_status(log_ratio, neg, mask, "bnpo", delta=1.5, **kw).tolist() == [[True, False, False, False, True]]
    assert trl_clip_status(log_ratio, pos, mask, "luspo", delta=1.5, **kw).tolist() == [[False, False, False, True, True]]
    # cispo: A > 0 and w > eps_high (the absolute cap)
    assert trl_clip_status(log_ratio, pos, mask, "cispo", eps_high=1.2).tolist() == [[False, False, False, True, True]]
    assert not trl_clip_status(log_ratio, neg, mask, "cispo", eps_high=1.2).any()
    # sequence level: one weight per row, exp(mean log ratio over the mask), clip status shared by its tokens
    row = torch.log(torch.tensor([[1.5, 1.5, 100.0], [0.5, 1.0, 1.0]], dtype=torch.float64))
    row_mask = torch.tensor([[True, True, False], [True, True, True]])
    got = trl_clip_status(row, f64([1.0, -1.0]), row_mask, "grpo", level="sequence", **kw)
    # row 0: w = 1.5 > 1.2 with A > 0 (the masked 100 does not count); row 1: w = 0.5^(1/3) = 0.794 < 0.8, A < 0
    assert got.tolist() == [[True, True, True], [True, True, True]]
    got = trl_clip_status(row, f64([1.0, -1.0]), row_mask, "grpo", level="sequence", eps_low=0.25, eps_high=0.6)
    assert got.tolist() == [[False, False, False], [False, False, False]]
    for loss_type in ("sapo", "vespo"):
        assert trl_clip_status(log_ratio, pos, mask, loss_type) is None
    with pytest.raises(ValueError, match="'token' or 'sequence'"):
        trl_clip_status(log_ratio, pos, mask, "grpo", level="tokens")


def test_out_of_band_is_the_elementwise_oob_that_oob_count_counts():
    """out_of_band keeps the shape (no selection, so no host read on a GPU); masked, it counts what oob_count counts;
    a non-finite difference is outside."""
    from bloggap_plugin.core.metrics import out_of_band

    a = torch.tensor([[0.0, 0.09, -0.1, 0.2], [float("nan"), -math.inf, 0.05, -0.2]])  # ratios 1, 1.094, 0.905, 1.22
    b = torch.zeros(2, 4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 0]]).bool()
    outside = out_of_band(a.double(), b.double(), band=0.1)
    assert outside.tolist() == [[False, False, False, True], [True, True, False, True]]
    assert int((outside & mask).sum()) == oob_count(a.double(), b.double(), mask, band=0.1)[0] == 2
    with pytest.raises(ValueError, match="band must be in"):
        out_of_band(a, b, band=1.5)
    with pytest.raises(ValueError, match="shape mismatch"):
        out_of_band(a, b[:, :2])
