"""Corrected inference for a sweep's arms against its baseline: paired t-tests (scipy) with Holm-adjusted p-values,
simultaneous Bonferroni intervals, exact sign-flip permutation p-values and each arm's detectable difference.

Every arm is compared with the baseline on its per-seed paired differences (same seed: same prompts and sampling
seeds). ``m`` arms compared make one family: the family-wise error rate is ``alpha``, so each interval is a
``1 - alpha / m`` t interval (all ``m`` cover their true differences together with probability >= ``1 - alpha``)
and p-values are Holm-adjusted (step-down Bonferroni). Each arm uses its own degrees of freedom (``n - 1``); no
variance is pooled across arms.
"""

from __future__ import annotations

import itertools
import math

__all__ = ["MIN_SEEDS", "holm", "sign_flip_p", "arm_statistics", "compare_with_baseline", "POWER"]

MIN_SEEDS = 3
"""Fewest paired differences an interval or a p-value is computed from (with 2 the t quantile has 1 df)."""
POWER = 0.8
"""Power of the detectable difference: the true difference a two-sided test at the family's level finds 80% of the
time."""


def holm(p_values: dict[str, float], family: int | None = None) -> dict[str, float]:
    """Holm's step-down adjustment of ``{name: p}`` in a family of ``family`` tests (default: these): sorted
    ascending, the ``i``-th (from 0) becomes ``max`` over ``j <= i`` of ``min(1, (m - j) p_(j))``."""
    ordered = sorted(p_values.items(), key=lambda item: item[1])
    m, running, adjusted = (len(ordered) if family is None else family), 0.0, {}
    for rank, (name, p) in enumerate(ordered):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[name] = running
    return adjusted


SIGN_FLIP_MAX_SEEDS = 20
"""Most paired differences :func:`sign_flip_p` enumerates (``2^20`` sign patterns)."""


def sign_flip_p(differences: list[float]) -> float:
    """Exact two-sided sign-flip permutation p-value of the mean of ``differences``: the share of all ``2^n`` sign
    patterns whose |mean| is at least the observed one, ties included. Its floor is ``2 / 2^n`` (0.0625 for 5 seeds).
    Enumerated here rather than with scipy's ``permutation_test``, whose tie tolerance is relative to the observed
    statistic: rewards are means of k/32 values, so patterns that tie exactly in exact arithmetic differ by rounding
    and scipy dropped some of them. Ties are counted within ``1e-9`` of the largest |difference|."""
    import numpy as np

    data = np.asarray(differences, dtype=float)
    if data.size > SIGN_FLIP_MAX_SEEDS:
        raise ValueError(f"sign_flip_p enumerates 2^n patterns; {data.size} differences is more than "
                         f"{SIGN_FLIP_MAX_SEEDS}")
    signs = np.array(list(itertools.product((1.0, -1.0), repeat=data.size)))
    means = np.abs(signs @ data) / data.size
    tolerance = 1e-9 * float(np.abs(data).max(initial=0.0))
    return float(np.mean(means >= abs(data.mean()) - tolerance))


def arm_statistics(differences: list[float], level: float, power: float = POWER) -> dict:
    """One arm's paired statistics at two-sided level ``level`` (already divided over the family): ``n``, ``mean``,
    ``sd``, ``t``, ``p_t``, ``p_sign_flip``, ``low``, ``high``, ``half_width``, ``detectable``; with fewer than
    :data:`MIN_SEEDS` differences only ``n`` and ``mean``."""
    from scipy import stats

    n = len(differences)
    mean = math.fsum(differences) / n if n else None
    out = {"n": n, "mean": mean, "sd": None, "t": None, "p_t": None, "p_sign_flip": None, "low": None, "high": None,
           "half_width": None, "detectable": None}
    if n < MIN_SEEDS:
        return out
    sd = math.sqrt(math.fsum((d - mean) ** 2 for d in differences) / (n - 1))
    se = sd / math.sqrt(n)
    quantile = float(stats.t.ppf(1 - level / 2, n - 1))
    out.update(sd=sd, half_width=quantile * se, low=mean - quantile * se, high=mean + quantile * se,
               detectable=(quantile + float(stats.t.ppf(power, n - 1))) * se, p_sign_flip=sign_flip_p(differences))
    if sd > 0:
        test = stats.ttest_1samp(differences, 0.0)
        out.update(t=float(test.statistic), p_t=float(test.pvalue))
    else:
        out.update(p_t=0.0 if mean != 0 else 1.0)
    return out


def compare_with_baseline(differences: dict[str, list[float]], alpha: float = 0.05, power: float = POWER) -> dict:
    """Per arm (``{arm: [per-seed difference to the baseline]}``, the baseline left out) the paired mean difference,
    its simultaneous ``1 - alpha`` interval (Bonferroni over the arms), t-test p (raw and Holm-adjusted), exact
    sign-flip p (raw and Holm-adjusted) and the detectable difference (``(t_{1-alpha/2m} + t_{power}) * sd /
    sqrt(n)``, the arm's own df). Arms with fewer than :data:`MIN_SEEDS` differences get their mean only.

    Returns ``{"alpha", "family", "level_per_arm", "power", "arms": {arm: {...}}}``."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    family = len(differences)
    level = alpha / family if family else alpha
    arms = {arm: arm_statistics(values, level, power) for arm, values in differences.items()}
    tested = {arm: row for arm, row in arms.items() if row["p_t"] is not None}
    for key in ("p_t", "p_sign_flip"):
        adjusted = holm({arm: row[key] for arm, row in tested.items()}, family) if tested else {}
        for arm, row in arms.items():
            row[f"{key}_holm"] = adjusted.get(arm)
    return {"alpha": alpha, "family": family, "level_per_arm": level, "power": power, "arms": arms}
