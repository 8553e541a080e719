"""The probe's comparisons: one table, name -> how the compared side is scored and what it shows.

Every consumer (the scoring loop in :func:`bloggap_plugin.core.probe.probe_model`, the doctor's pass count,
its CPU scale-down and its paired re-comparisons, the recommendation, the printed table) reads the fields of
:data:`COMPARISONS` instead of decoding names. The reference side of every comparison is named first in its
name; batch 1 carries no padding, so it is the reference wherever it appears.

``scoring`` says which procedure produces the two sides:

- ``"rerun"``: the original rows at batch 1 again (the control);
- ``"batched"``: the original rows in chunks of ``batch_size`` with ``layout`` and ``positions``;
- ``"equal_length"``: the equal-length rows (prompts cut to the shortest) at batch 1 vs batch 8;
- ``"regrouped"``: the equal-length rows in batches of 8, natural order vs a shuffled grouping;
- ``"copies"``: the first row alone vs the same row copied ``batch_size`` times in one batch;
- ``"sampler"``: generate's own log-probs vs teacher-forced batch 1 (no extra scoring pass).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Comparison",
    "COMPARISONS",
    "HEADLINE",
    "TIMED",
    "SAMPLER",
    "BATCH_SHAPE_COMPARISONS",
    "CPU_FP16_COMPARISONS",
    "CPU_ROWS",
    "PAIRABLE",
    "comparison",
    "scoring_passes",
]


@dataclass(frozen=True)
class Comparison:
    """One row of the comparisons table.

    ``layout`` is the recorded layout of the compared side (``"left"``: TRL's, prompts left-padded;
    ``"right"``; ``"none"``: rows that need no padding; ``"generate"``: the sampler's own). ``batch_size``
    is the rows per chunk on that side (``None``: the generation batch size). ``positions`` is how position
    ids are made (``"mask"``: from the attention mask, as ``generate``; ``"arange"``: 0..L-1, as TRL's scoring).
    """

    name: str
    scoring: str
    layout: str
    batch_size: int | None
    positions: str
    description: str
    batch_shape: bool = True  # a batch-shape effect (not the rerun control, not the sampler)
    pairable: bool = False  # batch-1 and batch-k chunks of the first m rows (m % k == 0) are the same computation
    cpu_fp16: bool = False  # still scored when fp16 is scaled down on CPU
    min_rows: int = 1  # a dtype scaled down to fewer rows skips it (the batch would not be full)
    shared_pass: str | None = None  # a scoring pass this comparison shares with others (counted once)

    @property
    def scoring_layout(self) -> str:
        """The layout handed to ``score_layout`` (rows without padding are laid out as ``"left"``)."""
        return "right" if self.layout == "right" else "left"

    @property
    def rows_needed(self) -> int:
        """Rows the comparison needs to be what its name says: a full batch for a batched one, two batches for two
        groupings, one row for the others (the rerun, one row's copies, the sampler)."""
        size = self.batch_size or 1
        need = {"batched": size, "equal_length": size, "regrouped": 2 * size}.get(self.scoring, 1)
        return max(need, self.min_rows)

    @property
    def own_passes(self) -> int:
        """Scoring passes this comparison makes beyond batch 1 and its shared pass."""
        return 0 if self.scoring == "sampler" else 1


_TABLE = (
    Comparison("rerun_b1", "rerun", "left", 1, "mask",
               "batch 1 scored twice (control: must be 0, else the forward is nondeterministic)",
               batch_shape=False, pairable=True, cpu_fp16=True),
    Comparison("b1_vs_b8_left_arange", "batched", "left", 8, "arange",
               "batch 1 vs batch 8, left padding, positions 0..L-1 (TRL's scoring)", pairable=True, cpu_fp16=True),
    Comparison("b1_vs_b8_left_mask", "batched", "left", 8, "mask",
               "batch 1 vs batch 8, left padding, positions from the mask (as generate)", pairable=True,
               cpu_fp16=True),
    Comparison("b1_vs_b32_left_arange", "batched", "left", 32, "arange",
               "batch 1 vs batch 32, left padding, positions 0..L-1", min_rows=32),
    Comparison("b1_vs_b32_left_mask", "batched", "left", 32, "mask",
               "batch 1 vs batch 32, left padding, positions from the mask", min_rows=32),
    Comparison("b1_vs_b8_right", "batched", "right", 8, "mask", "batch 1 vs batch 8, right padding",
               pairable=True),
    Comparison("b1_vs_b8_equal_nopad", "equal_length", "none", 8, "mask",
               "equal-length rows (prompts cut to the shortest), batch 1 vs batch 8, no padding",
               shared_pass="equal b8"),
    Comparison("copy8_vs_alone", "copies", "none", 8, "mask",
               "one row alone vs the same row copied 8 times in one batch (first copy)"),
    Comparison("two_groupings_b8", "regrouped", "none", 8, "mask",
               "equal-length rows in batches of 8: natural order vs a shuffled grouping (membership)",
               shared_pass="equal b8"),
    Comparison("sampler_vs_b1", "sampler", "generate", None, "mask",
               "generate's own log-probs (KV-cache decode) vs teacher-forced batch 1", batch_shape=False,
               cpu_fp16=True),
)

# name -> comparison, in the order the doctor's table prints them.
COMPARISONS: dict[str, Comparison] = {c.name: c for c in _TABLE}
HEADLINE = "b1_vs_b8_left_arange"  # TRL's scoring layout: left padding, positions 0..L-1
TIMED = "b1_vs_b8_left_mask"  # the batch-8 pass whose seconds per token price each dtype
SAMPLER = "sampler_vs_b1"
BATCH_SHAPE_COMPARISONS = tuple(c.name for c in _TABLE if c.batch_shape)
CPU_FP16_COMPARISONS = tuple(c.name for c in _TABLE if c.cpu_fp16)
# On a CPU, fp16 has no fast kernels (and fp32 costs more than bf16 where bf16 runs in hardware): a CPU run with more
# rollouts than these scores both on its first rows only (fp16 only on CPU_FP16_COMPARISONS). bf16 gets every row.
CPU_ROWS = {"fp16": 8, "fp32": 8}
PAIRABLE = tuple(c.name for c in _TABLE if c.pairable)


def comparison(name: str) -> Comparison:
    """The table row of ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return COMPARISONS[name]
    except KeyError:
        raise ValueError(f"unknown comparison {name!r}; known: {list(COMPARISONS)}") from None


def scoring_passes(names: list[str]) -> int:
    """Scoring passes :func:`~bloggap_plugin.core.probe.probe_model` makes for these comparisons: batch 1,
    each comparison's own pass, and each shared pass once (the doctor's progress-bar total)."""
    rows = [comparison(n) for n in names]
    return 1 + sum(c.own_passes for c in rows) + len({c.shared_pass for c in rows if c.shared_pass})
