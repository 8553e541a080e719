"""The batch-shape probe behind ``bloggap doctor``: rescore the same sampled tokens teacher-forced under
several batch shapes, and compare (torch only; sampling the rollouts is
:func:`bloggap_plugin.measure.rollouts.sample_rollouts`).

Vocabulary:

- a :class:`Row` is one sequence: ``prompt`` token ids followed by ``completion`` token ids; only the
  completion tokens are scored and compared;
- a *layout* says how a chunk of rows becomes one ``[b, L]`` tensor: ``"left"`` is TRL's layout (prompts
  left-padded, completions right-padded; with equal-length completions that is plain left padding) and
  ``"right"`` pads every row on the right;
- :func:`score_layout` scores rows in chunks of ``batch_size`` (each chunk padded to its own width, as a
  trainer builds each micro-batch) through :func:`bloggap_plugin.core.scoring.token_logprobs`, the one
  scoring path, and returns ``[N, C]`` fp32 log-probs in the original row order with a ``[N, C]`` mask;
- :func:`compare` turns two scorings of the same tokens into a *cell*: out-of-band share, Wilson 95%
  interval, ``|dlogp|`` mean and max (all fractions and nats, never percent);
- :func:`probe_model` runs the comparisons of :data:`bloggap_plugin.core.comparisons.COMPARISONS`.

Batch 1 rows carry no padding, so both position modes agree there: batch 1 is the reference.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from bloggap_plugin.core.comparisons import COMPARISONS, Comparison, comparison
from bloggap_plugin.core.metrics import abs_dlogp_stats, oob_count, wilson_interval
from bloggap_plugin.core.scoring import token_logprobs

__all__ = [
    "STEMS",
    "TOPICS",
    "FP16_MAX",
    "Row",
    "Rollouts",
    "Scored",
    "builtin_prompts",
    "left_pad",
    "build_rows",
    "score_layout",
    "compare",
    "compare_sampler",
    "skipped_cell",
    "probe_model",
    "HiddenTracker",
    "pp",
    "block_causal_mask",
    "score_packed",
]

# The reference study's prompts: 8 stems x 8 topics (stem-major order: the first 8 share one stem).
STEMS = (
    "Explain in two sentences why",
    "List three facts about",
    "Write one sentence about",
    "Give a short definition of",
    "Name one consequence of",
    "Describe briefly how",
    "In one sentence, compare",
    "State the main idea of",
)
TOPICS = (
    "the ocean",
    "photosynthesis",
    "gravity",
    "the printing press",
    "antibiotics",
    "monsoons",
    "the transistor",
    "vaccination",
)
FP16_MAX = 65504.0  # fp16's largest finite value


@dataclass(frozen=True)
class Row:
    """One sequence: prompt token ids then completion token ids (only the completion is scored)."""

    prompt: tuple[int, ...]
    completion: tuple[int, ...]


@dataclass
class Rollouts:
    """Sampled rows plus the sampler's own log-prob of every emitted token.

    ``sampler_logprobs`` is ``[N, C]`` fp32 (``C`` = longest completion), ``sampler_mask`` ``[N, C]`` bool.
    ``sampler`` records how they were made (dtype, attention, generation batch size, seed, forced length or
    stop at eos, and that the log-probs come from the raw logits).
    """

    rows: list[Row]
    sampler_logprobs: torch.Tensor
    sampler_mask: torch.Tensor
    pad_token_id: int
    prompts: list[str] = field(default_factory=list)
    sampler: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        """Number of completion tokens (the ``n`` of a full comparison)."""
        return int(self.sampler_mask.sum().item())

    def subset(self, count: int) -> Rollouts:
        """The first ``count`` rows (same sampler record)."""
        return Rollouts(
            rows=self.rows[:count],
            sampler_logprobs=self.sampler_logprobs[:count],
            sampler_mask=self.sampler_mask[:count],
            pad_token_id=self.pad_token_id,
            prompts=self.prompts[:count],
            sampler=dict(self.sampler),
        )


@dataclass
class Scored:
    """Teacher-forced completion log-probs ``[N, C]`` fp32 in row order, ``mask`` ``[N, C]`` bool, and cost."""

    logprobs: torch.Tensor
    mask: torch.Tensor
    seconds: float
    tokens_forwarded: int


def builtin_prompts(count: int) -> list[str]:
    """``count`` prompts ``"<stem> <topic>."`` from the reference study's 8 x 8 grid (cycled past 64)."""
    grid = [f"{stem} {topic}." for stem in STEMS for topic in TOPICS]
    return [grid[i % len(grid)] for i in range(count)]


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` ``[N, max len]`` int64: token-id lists left-padded with ``pad_id``, as TRL and
    ``generate`` lay out prompts."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, seq in enumerate(seqs):
        ids[i, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        mask[i, width - len(seq) :] = 1
    return ids, mask


def build_rows(rows: Sequence[Row], kind: str = "original") -> list[Row]:
    """``"original"``: rows as sampled. ``"equal_length"``: every prompt cut to its last ``NP`` tokens
    (``NP`` = shortest prompt) and every completion to the shortest completion, so all rows have the same
    length and need no padding (the reference study's equal-length rows)."""
    if kind == "original":
        return list(rows)
    if kind != "equal_length":
        raise ValueError(f"kind must be 'original' or 'equal_length', got {kind!r}")
    if not rows:
        raise ValueError("no rows")
    prompt_len = min(len(r.prompt) for r in rows)
    completion_len = min(len(r.completion) for r in rows)
    return [Row(r.prompt[len(r.prompt) - prompt_len :], r.completion[:completion_len]) for r in rows]


def _layout_chunk(rows: Sequence[Row], layout: str, pad_id: int):
    """One chunk -> (input_ids [b, L], attention_mask [b, L], logits_to_keep, per-row completion offsets)."""
    if layout == "left":
        prompt_width = max(len(r.prompt) for r in rows)
        completion_width = max(len(r.completion) for r in rows)
        width = prompt_width + completion_width
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            p, c = len(r.prompt), len(r.completion)
            ids[i, prompt_width - p : prompt_width] = torch.tensor(r.prompt)
            ids[i, prompt_width : prompt_width + c] = torch.tensor(r.completion)
            mask[i, prompt_width - p : prompt_width + c] = 1
        return ids, mask, completion_width, [0] * len(rows)
    if layout == "right":
        width = max(len(r.prompt) + len(r.completion) for r in rows)
        first = min(len(r.prompt) for r in rows)
        keep = width - first
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            seq = r.prompt + r.completion
            ids[i, : len(seq)] = torch.tensor(seq)
            mask[i, : len(seq)] = 1
        # column j of the kept block is absolute position first + j
        return ids, mask, keep, [len(r.prompt) - first for r in rows]
    raise ValueError(f"layout must be 'left' or 'right', got {layout!r}")


class _Sheet:
    """Teacher-forced scores being filled in row order: ``[N, C]`` fp32 log-probs and mask (``C`` = longest
    completion), tokens forwarded, and the wall time since creation (device-synchronized at both ends)."""

    def __init__(self, rows: Sequence[Row], device: torch.device):
        width = max(len(r.completion) for r in rows)
        self.logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
        self.mask = torch.zeros((len(rows), width), dtype=torch.bool)
        self.forwarded = 0
        self.device = device
        _synchronize(device)
        self.started = time.perf_counter()

    def put(self, row: int, values: torch.Tensor) -> None:
        """Row ``row``'s completion log-probs ``[c]``."""
        self.logprobs[row, : len(values)] = values
        self.mask[row, : len(values)] = True

    def done(self) -> Scored:
        _synchronize(self.device)
        return Scored(self.logprobs, self.mask, time.perf_counter() - self.started, self.forwarded)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def score_layout(
    model: torch.nn.Module,
    rows: Sequence[Row],
    layout: str = "left",
    batch_size: int = 1,
    positions: str = "mask",
    pad_token_id: int = 0,
    order: Sequence[int] | None = None,
    forward: Callable[..., object] | None = None,
) -> Scored:
    """Teacher-forced log-probs of every row's completion, rows taken in ``order`` (default 0..N-1) in chunks
    of ``batch_size``; each chunk is laid out by ``layout`` and scored by ``token_logprobs``. Returns
    :class:`Scored` with ``[N, C]`` values in the original row order (``C`` = longest completion)."""
    if not rows:
        raise ValueError("no rows to score")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = list(range(len(rows))) if order is None else list(order)
    if sorted(order) != list(range(len(rows))):
        raise ValueError("order must be a permutation of the row indices")
    device = next(model.parameters()).device
    sheet = _Sheet(rows, device)
    for start in range(0, len(order), batch_size):
        index = order[start : start + batch_size]
        chunk = [rows[i] for i in index]
        ids, attn, keep, offsets = _layout_chunk(chunk, layout, pad_token_id)
        sheet.forwarded += ids.numel()
        values = token_logprobs(
            model, ids.to(device), attn.to(device), keep, positions=positions, forward=forward
        ).cpu()
        for j, (i, off) in enumerate(zip(index, offsets)):
            sheet.put(i, values[j, off : off + len(rows[i].completion)])
    return sheet.done()


def compare(
    logp_ref: torch.Tensor,
    logp_other: torch.Tensor,
    mask: torch.Tensor | None = None,
    band: float = 0.1,
    **labels,
) -> dict:
    """One cell: tokens with ``exp(logp_other - logp_ref)`` outside ``[1-band, 1+band]`` (non-finite counts as
    out), Wilson 95% interval, ``|dlogp|`` mean/max (nats), ``exact_count``: tokens whose two values are bit for
    bit equal (``logp_other - logp_ref == 0``, as ``gap/*/exact_frac``), whether both are bitwise equal. Fractions,
    not percent. ``labels`` (e.g. ``dtype``, ``attn``, ``comparison``) are copied into the cell."""
    out, n = oob_count(logp_other, logp_ref, mask, band)
    stats = abs_dlogp_stats(logp_other, logp_ref, mask)
    low, high = wilson_interval(out, n)
    selected = mask.bool() if mask is not None else torch.ones_like(logp_ref, dtype=torch.bool)
    nonfinite = int((~torch.isfinite(logp_other[selected])).sum().item())
    exact = int(((logp_other[selected].double() - logp_ref[selected].double()) == 0).sum().item())
    return {
        **labels,
        "oob": out / n,
        "ci_low": low,
        "ci_high": high,
        "abs_dlogp_mean": stats["mean"],
        "abs_dlogp_max": stats["max"],
        "dlogp_sd": stats["sd"],
        "n": n,
        "oob_count": out,
        "exact_count": exact,
        "nonfinite": nonfinite,
        "bitwise_equal": _same_values(logp_ref[selected], logp_other[selected]),
    }


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Element-wise identical, NaN matching NaN (a rerun that yields NaN twice is deterministic)."""
    if a.shape != b.shape:
        return False
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all().item())


def skipped_cell(reason: str, **labels) -> dict:
    """A cell that was not measured, with the reason (numbers are ``None``)."""
    return {
        **labels,
        "oob": None,
        "ci_low": None,
        "ci_high": None,
        "abs_dlogp_mean": None,
        "abs_dlogp_max": None,
        "n": 0,
        "skipped": reason,
    }


class HiddenTracker:
    """A ``forward=`` wrapper for ``token_logprobs`` that also asks for hidden states and records the largest
    finite ``|h|`` over every layer boundary, the number of non-finite hidden values, and how many boundary
    tensors exceed ``threshold`` (fp16's largest value is 65,504)."""

    def __init__(self, model: torch.nn.Module, threshold: float = 60000.0):
        self.model = model
        self.threshold = threshold
        self.max_abs_hidden = 0.0
        self.nonfinite_hidden = 0
        self.tensors_over_threshold = 0

    def __call__(self, **kwargs):
        out = self.model(**kwargs, output_hidden_states=True)
        for hidden in out.hidden_states:
            finite = torch.isfinite(hidden)
            self.nonfinite_hidden += int((~finite).sum().item())
            largest = float(hidden.detach().abs().masked_fill(~finite, 0).max().item())
            self.max_abs_hidden = max(self.max_abs_hidden, largest)
            self.tensors_over_threshold += int(largest > self.threshold)
        return out


def _shuffled_grouping(count: int, seed: int = 7) -> list[int]:
    order = list(range(count))
    random.Random(seed).shuffle(order)
    return order


def compare_sampler(rollouts: Rollouts, base: Scored, band: float, first: int, **labels) -> dict:
    """The sampler cell on the first ``first`` rows: generate's own log-probs (reference side) vs the
    teacher-forced batch-1 scoring ``base``; the ratio ``exp(teacher-forced - sampler)`` is the importance ratio
    trainer / sampler. ``labels`` are copied into the cell."""
    width = min(rollouts.sampler_logprobs.shape[1], base.logprobs.shape[1])
    mask = rollouts.sampler_mask[:first, :width] & base.mask[:first, :width]
    return compare(rollouts.sampler_logprobs[:first, :width], base.logprobs[:first, :width], mask, band, **labels)


class _Probe:
    """One model's scorings of one set of rollouts: runs table rows of
    :data:`~bloggap_plugin.core.comparisons.COMPARISONS` against the batch-1 reference ``base``, collecting
    cells, the scorings behind them (``scored``) and the equal-length batch-8 pass they share."""

    def __init__(self, model: torch.nn.Module, rollouts: Rollouts, base: Scored, band: float, tick):
        self.model, self.rollouts, self.base, self.band, self.tick = model, rollouts, base, band, tick
        self.rows = rollouts.rows
        self.cells: list[dict] = []
        self.scored: dict[str, tuple[torch.Tensor, Scored]] = {}
        self._equal: tuple[list[Row], Scored] | None = None

    def score(self, rows: Sequence[Row], layout: str, batch_size: int, positions: str = "mask", order=None) -> Scored:
        return score_layout(self.model, rows, layout, batch_size, positions, self.rollouts.pad_token_id, order=order)

    def add(self, spec: Comparison, ref: torch.Tensor, other: Scored, mask, batch_size, rows_used: int) -> dict:
        self.scored[spec.name] = (ref, other)
        result = compare(ref, other.logprobs, mask, self.band, comparison=spec.name)
        result.update(batch_size=batch_size, layout=spec.layout, positions=spec.positions, rows=rows_used,
                      seconds=other.seconds, tokens_forwarded=other.tokens_forwarded)
        self.cells.append(result)
        return result

    def equal_b8(self) -> tuple[list[Row], Scored]:
        """The equal-length rows and their batch-8 scoring (made once, shared)."""
        if self._equal is None:
            rows = build_rows(self.rows, "equal_length")
            self._equal = rows, self.score(rows, "left", 8)
            self.tick("equal b8")
        return self._equal

    def run(self, spec: Comparison) -> None:
        count, base = len(self.rows), self.base
        if spec.scoring == "sampler":
            result = compare_sampler(self.rollouts, base, self.band, count, comparison=spec.name)
            sampler = self.rollouts.sampler
            result.update(batch_size=sampler.get("batch_size"), layout=spec.layout, positions=spec.positions,
                          rows=count, sampler=dict(sampler))
            self.cells.append(result)
            return
        if spec.scoring == "rerun":
            self.add(spec, base.logprobs, self.score(self.rows, "left", 1), base.mask, 1, count)
        elif spec.scoring == "batched":
            other = self.score(self.rows, spec.scoring_layout, spec.batch_size, spec.positions)
            self.add(spec, base.logprobs, other, base.mask, min(spec.batch_size, count), count)
        elif spec.scoring == "equal_length":
            rows, b8 = self.equal_b8()
            b1 = self.score(rows, "left", 1)
            self.add(spec, b1.logprobs, b8, b8.mask, min(spec.batch_size, count), count)
        elif spec.scoring == "regrouped":
            rows, b8 = self.equal_b8()
            if count <= spec.batch_size:
                reason = f"needs more than {spec.batch_size} rows to change membership (have {count})"
                self.cells.append(skipped_cell(reason, comparison=spec.name))
                return
            regrouped = self.score(rows, "left", spec.batch_size, order=_shuffled_grouping(count))
            self.add(spec, b8.logprobs, regrouped, b8.mask, spec.batch_size, count)
        elif spec.scoring == "copies":
            copies = self.score([self.rows[0]] * spec.batch_size, "left", spec.batch_size)
            first = Scored(copies.logprobs[:1], copies.mask[:1], copies.seconds, copies.tokens_forwarded)
            cell = self.add(spec, base.logprobs[:1], first, base.mask[:1], spec.batch_size, 1)
            cell["copies_identical"] = bool((copies.logprobs == copies.logprobs[:1]).all().item())
        else:
            raise ValueError(f"comparison {spec.name!r}: unknown scoring {spec.scoring!r}")
        self.tick(spec.name)


def _hidden_check(tracker: HiddenTracker, base: Scored, rows: int) -> dict:
    """The fp16 check fields of a batch-1 pass scored through ``tracker``."""
    values = base.logprobs[base.mask]
    return {
        "nonfinite_logprobs": int((~torch.isfinite(values)).sum().item()),
        "n": int(values.numel()),
        "max_abs_hidden": tracker.max_abs_hidden,
        "nonfinite_hidden": tracker.nonfinite_hidden,
        "tensors_over_60000": tracker.tensors_over_threshold,
        "rows": rows,
    }


def probe_model(
    model: torch.nn.Module,
    rollouts: Rollouts,
    comparisons: Iterable[str] | None = None,
    band: float = 0.1,
    hidden_check: bool = False,
    progress: Callable[[str], object] | None = None,
) -> tuple[list[dict], dict]:
    """Run the named comparisons (default: all of :data:`~bloggap_plugin.core.comparisons.COMPARISONS`) for
    one loaded model.

    Returns ``(cells, extras)``: cells carry ``comparison``, ``batch_size`` (effective), ``layout``,
    ``positions``, ``seconds`` and ``tokens_forwarded`` of the non-reference side; ``extras`` holds the batch-1
    scoring (``"b1"``), ``"scored"``: ``{comparison: (reference log-probs [N, C], Scored)}`` so callers can
    re-compare on a subset of rows, and the fp16 check fields (``"hidden_check"``) when ``hidden_check``.
    ``progress(label)`` is called after every scoring pass.
    """
    names = list(COMPARISONS) if comparisons is None else list(comparisons)
    unknown = [n for n in names if n not in COMPARISONS]
    if unknown:
        raise ValueError(f"unknown comparison(s) {unknown}; known: {list(COMPARISONS)}")
    tick = progress or (lambda label: None)
    tracker = HiddenTracker(model) if hidden_check else None
    base = score_layout(model, rollouts.rows, "left", 1, "mask", rollouts.pad_token_id, forward=tracker)
    tick("b1")
    probe = _Probe(model, rollouts, base, band, tick)
    extras: dict = {"b1": base, "scored": probe.scored}
    if tracker is not None:
        extras["hidden_check"] = _hidden_check(tracker, base, len(rollouts.rows))
    for name in names:
        probe.run(comparison(name))
    return probe.cells, extras


def pp(fraction: float | None) -> float | None:
    """Fraction -> percentage points rounded to 2 decimals (``None`` stays ``None``)."""
    return None if fraction is None or (isinstance(fraction, float) and math.isnan(fraction)) else round(
        100.0 * fraction, 2
    )


def block_causal_mask(segment_lengths: Sequence[int], dtype: torch.dtype, device=None) -> torch.Tensor:
    """Additive ``[1, 1, T, T]`` mask (0 where allowed, ``finfo(dtype).min`` elsewhere) for sequences packed
    into one row: position i may attend to j iff ``j <= i`` and both lie in the same segment."""
    segment = torch.repeat_interleave(
        torch.arange(len(segment_lengths), device=device), torch.tensor(list(segment_lengths), device=device)
    )
    total = int(segment.numel())
    causal = torch.ones(total, total, dtype=torch.bool, device=device).tril()
    allowed = causal & (segment[:, None] == segment[None, :])
    mask = torch.zeros(total, total, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


@torch.no_grad()
def score_packed(model: torch.nn.Module, rows: Sequence[Row], pack_size: int = 8) -> Scored:
    """Score rows packed ``pack_size`` to a row (concatenated, no padding) with an explicit block-diagonal
    causal 4-D mask and position ids restarting at 0 in every segment; ``pack_size=1`` is one row per
    sequence with an explicit 4-D causal mask. Goes through ``token_logprobs`` (its ``forward=`` hook
    injects the mask and positions), so the log-softmax path is the same as every other scoring."""
    if pack_size < 1:
        raise ValueError(f"pack_size must be >= 1, got {pack_size}")
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    sheet = _Sheet(rows, device)
    for start in range(0, len(rows), pack_size):
        chunk = list(rows[start : start + pack_size])
        sequences = [r.prompt + r.completion for r in chunk]
        lengths = [len(s) for s in sequences]
        ids = torch.tensor([tok for s in sequences for tok in s], device=device)[None]
        attn_4d = block_causal_mask(lengths, dtype, device)
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]

        def forward(_mask=attn_4d, _positions=positions, **kwargs):
            kwargs.update(attention_mask=_mask, position_ids=_positions)
            return model(**kwargs)

        total = ids.shape[1]
        sheet.forwarded += total
        # score every position 1..total-1; token at absolute position t sits at column t-1
        values = token_logprobs(
            model, ids, torch.ones_like(ids), total - 1, positions="arange", forward=forward
        ).cpu()[0]
        offset = 0
        for j, r in enumerate(chunk):
            first = offset + len(r.prompt)
            sheet.put(start + j, values[first - 1 : first - 1 + len(r.completion)])
            offset += lengths[j]
    return sheet.done()
