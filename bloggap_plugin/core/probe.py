"""The batch-shape probe behind ``bloggap doctor``: sample rollouts once, rescore the same tokens
teacher-forced under several batch shapes, and compare (torch only at module top).

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
  interval, ``|dlogp|`` mean and max (all fractions and nats, never percent).

Batch 1 rows carry no padding, so both position modes agree there: batch 1 is the reference.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from bloggap_plugin.core.metrics import abs_dlogp_stats, oob_count, wilson_interval
from bloggap_plugin.core.scoring import token_logprobs

__all__ = [
    "STEMS",
    "TOPICS",
    "FP16_MAX",
    "COMPARISONS",
    "Row",
    "Rollouts",
    "Scored",
    "builtin_prompts",
    "encode_prompts",
    "sample_rollouts",
    "build_rows",
    "score_layout",
    "compare",
    "skipped_cell",
    "probe_model",
    "HiddenTracker",
    "pp",
    "json_safe",
    "recommend",
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
FP16_MAX = 65504.0

# name -> what is compared (the reference side is always named first).
COMPARISONS: dict[str, str] = {
    "rerun_b1": "batch 1 scored twice (control: must be 0, else the forward is nondeterministic)",
    "b1_vs_b8_left_arange": "batch 1 vs batch 8, left padding, positions 0..L-1 (TRL's scoring)",
    "b1_vs_b8_left_mask": "batch 1 vs batch 8, left padding, positions from the mask (as generate)",
    "b1_vs_b32_left_arange": "batch 1 vs batch 32, left padding, positions 0..L-1",
    "b1_vs_b32_left_mask": "batch 1 vs batch 32, left padding, positions from the mask",
    "b1_vs_b8_right": "batch 1 vs batch 8, right padding",
    "b1_vs_b8_equal_nopad": "equal-length rows (prompts cut to the shortest), batch 1 vs batch 8, no padding",
    "copy8_vs_alone": "one row alone vs the same row copied 8 times in one batch (first copy)",
    "two_groupings_b8": "equal-length rows in batches of 8: natural order vs a shuffled grouping (membership)",
    "sampler_vs_b1": "generate's own log-probs (KV-cache decode) vs teacher-forced batch 1",
}


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


def encode_prompts(tokenizer, prompts: Sequence[str], chat_template: bool | None = None) -> list[list[int]]:
    """Token ids of each prompt; with the tokenizer's chat template (user turn + generation prompt) when it
    has one (``chat_template=None``), or as plain text (``False``)."""
    use_template = bool(getattr(tokenizer, "chat_template", None)) if chat_template is None else chat_template
    encoded = []
    for prompt in prompts:
        if use_template:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(prompt)["input_ids"]
        if not ids:
            raise ValueError(f"prompt {prompt!r} encodes to no tokens")
        encoded.append(list(ids))
    return encoded


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


@torch.no_grad()
def sample_rollouts(
    model: torch.nn.Module,
    tokenizer,
    num_seqs: int = 32,
    max_new_tokens: int = 32,
    seed: int = 1234,
    prompts: Sequence[str] | None = None,
    batch_size: int = 8,
    chat_template: bool | None = None,
    progress: Callable[[int], object] | None = None,
    stop_at_eos: bool = False,
) -> Rollouts:
    """Sample ``num_seqs`` completions of ``max_new_tokens`` tokens from ``model`` itself.

    Plain sampling (temperature 1, no top-k/top-p), prompts left-padded in generation batches of
    ``batch_size`` (generate derives positions from the mask). By default end-of-sequence is disabled so
    every completion has exactly ``max_new_tokens`` tokens (the reference study's T2-T6 protocol);
    ``stop_at_eos=True`` ends each completion at its first eos token, inclusive (ragged, as T1 and TRL).
    The sampler's log-prob of each emitted token is ``log_softmax`` (fp32) of generate's raw per-step logits
    (``output_logits``): full-vocabulary, like the trainer's scoring. The global RNG state is restored afterwards; ``seed`` alone fixes the samples.
    """
    if num_seqs < 1 or max_new_tokens < 1 or batch_size < 1:
        raise ValueError(
            f"num_seqs, max_new_tokens and batch_size must be >= 1, got {num_seqs}, {max_new_tokens}, {batch_size}"
        )
    from transformers import GenerationConfig

    prompts = list(prompts) if prompts is not None else builtin_prompts(num_seqs)
    if len(prompts) < num_seqs:
        prompts = [prompts[i % len(prompts)] for i in range(num_seqs)]
    prompts = prompts[:num_seqs]
    encoded = encode_prompts(tokenizer, prompts, chat_template)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token; set tokenizer.pad_token")
    eos_id = tokenizer.eos_token_id
    if stop_at_eos and eos_id is None:
        raise ValueError("stop_at_eos=True needs tokenizer.eos_token_id")
    config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        # Forced length as in the reference protocol: min_new_tokens = max_new_tokens. eos_token_id=None alone is
        # not enough: transformers >= 5.1x fills None fields from the model's generation config.
        min_new_tokens=None if stop_at_eos else max_new_tokens,
        eos_token_id=eos_id if stop_at_eos else None,
        pad_token_id=pad_id,
        bos_token_id=getattr(model.generation_config, "bos_token_id", None),
        output_logits=True,
        return_dict_in_generate=True,
    )
    device = next(model.parameters()).device
    rows: list[Row] = []
    sampler_rows: list[torch.Tensor] = []
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for start in range(0, num_seqs, batch_size):
            chunk = encoded[start : start + batch_size]
            ids, mask = left_pad(chunk, pad_id)
            out = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config
            )
            new = out.sequences[:, ids.shape[1] :].cpu()
            if not stop_at_eos and new.shape[1] != max_new_tokens:
                raise RuntimeError(
                    f"generate returned {new.shape[1]} new tokens instead of {max_new_tokens}: a stopping "
                    "criterion of this model's generation config ended sampling early"
                )
            logits = torch.stack([s.float() for s in out.logits], dim=1).cpu()  # [b, C, V] raw
            # The sampler's full-vocabulary log-prob from the raw logits (what a trainer scores); the processed
            # scores can differ only by the min-length processor's EOS mask when length is forced.
            sampled = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
            for prompt_ids, completion, values in zip(chunk, new.tolist(), sampled):
                if stop_at_eos and eos_id in completion:
                    completion = completion[: completion.index(eos_id) + 1]
                rows.append(Row(tuple(prompt_ids), tuple(completion)))
                sampler_rows.append(values[: len(completion)])
            if progress is not None:
                progress(len(chunk))
    width = max(len(v) for v in sampler_rows)
    sampler_logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
    sampler_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, values in enumerate(sampler_rows):
        sampler_logprobs[i, : len(values)] = values
        sampler_mask[i, : len(values)] = True
    return Rollouts(
        rows=rows,
        sampler_logprobs=sampler_logprobs,
        sampler_mask=sampler_mask,
        pad_token_id=int(pad_id),
        prompts=prompts,
        sampler={
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "attn": getattr(model.config, "_attn_implementation", None),
            "batch_size": batch_size,
            "seed": seed,
            "max_new_tokens": max_new_tokens,
            "stop_at_eos": stop_at_eos,
            "temperature": 1.0,
            "sampler_logprobs_from": "raw logits (output_logits), full vocabulary",
        },
    )


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
    completion_width = max(len(r.completion) for r in rows)
    logprobs = torch.zeros((len(rows), completion_width), dtype=torch.float32)
    mask = torch.zeros((len(rows), completion_width), dtype=torch.bool)
    forwarded = 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for start in range(0, len(order), batch_size):
        index = order[start : start + batch_size]
        chunk = [rows[i] for i in index]
        ids, attn, keep, offsets = _layout_chunk(chunk, layout, pad_token_id)
        forwarded += ids.numel()
        values = token_logprobs(
            model, ids.to(device), attn.to(device), keep, positions=positions, forward=forward
        ).cpu()
        for j, (i, off) in enumerate(zip(index, offsets)):
            c = len(rows[i].completion)
            logprobs[i, :c] = values[j, off : off + c]
            mask[i, :c] = True
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return Scored(logprobs, mask, time.perf_counter() - started, forwarded)


def compare(
    logp_ref: torch.Tensor,
    logp_other: torch.Tensor,
    mask: torch.Tensor | None = None,
    band: float = 0.1,
    **labels,
) -> dict:
    """One cell: tokens with ``exp(logp_other - logp_ref)`` outside ``[1-band, 1+band]`` (non-finite counts as
    out), Wilson 95% interval, ``|dlogp|`` mean/max (nats), whether both are bitwise equal. Fractions, not
    percent. ``labels`` (e.g. ``dtype``, ``attn``, ``comparison``) are copied into the cell."""
    out, n = oob_count(logp_other, logp_ref, mask, band)
    stats = abs_dlogp_stats(logp_other, logp_ref, mask)
    low, high = wilson_interval(out, n)
    selected = mask.bool() if mask is not None else torch.ones_like(logp_ref, dtype=torch.bool)
    nonfinite = int((~torch.isfinite(logp_other[selected])).sum().item())
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


def probe_model(
    model: torch.nn.Module,
    rollouts: Rollouts,
    comparisons: Iterable[str] | None = None,
    band: float = 0.1,
    hidden_check: bool = False,
    progress: Callable[[str], object] | None = None,
) -> tuple[list[dict], dict]:
    """Run the named comparisons (default: all of :data:`COMPARISONS`) for one loaded model.

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
    rows = rollouts.rows
    pad = rollouts.pad_token_id
    count = len(rows)
    tick = progress or (lambda label: None)
    cells: list[dict] = []

    scored: dict[str, tuple[torch.Tensor, Scored]] = {}

    def cell(name, ref: torch.Tensor, other: Scored, mask, batch_size, layout, positions, rows_used):
        scored[name] = (ref, other)
        result = compare(ref, other.logprobs, mask, band, comparison=name)
        result.update(
            batch_size=batch_size,
            layout=layout,
            positions=positions,
            rows=rows_used,
            seconds=other.seconds,
            tokens_forwarded=other.tokens_forwarded,
        )
        cells.append(result)

    tracker = HiddenTracker(model) if hidden_check else None
    base = score_layout(model, rows, "left", 1, "mask", pad, forward=tracker)
    tick("b1")
    extras: dict = {"b1": base, "scored": scored}
    if tracker is not None:
        values = base.logprobs[base.mask]
        extras["hidden_check"] = {
            "nonfinite_logprobs": int((~torch.isfinite(values)).sum().item()),
            "n": int(values.numel()),
            "max_abs_hidden": tracker.max_abs_hidden,
            "nonfinite_hidden": tracker.nonfinite_hidden,
            "tensors_over_60000": tracker.tensors_over_threshold,
            "rows": count,
        }
    mask = base.mask
    equal_rows = None
    equal_b1 = equal_b8 = None
    for name in names:
        if name == "rerun_b1":
            again = score_layout(model, rows, "left", 1, "mask", pad)
            cell(name, base.logprobs, again, mask, 1, "left", "mask", count)
        elif name.startswith(("b1_vs_b8_left", "b1_vs_b32_left")):
            size = 8 if "_b8_" in name else 32
            positions = name.rsplit("_", 1)[1]
            other = score_layout(model, rows, "left", size, positions, pad)
            cell(name, base.logprobs, other, mask, min(size, count), "left", positions, count)
        elif name == "b1_vs_b8_right":
            other = score_layout(model, rows, "right", 8, "mask", pad)
            cell(name, base.logprobs, other, mask, min(8, count), "right", "mask", count)
        elif name in ("b1_vs_b8_equal_nopad", "two_groupings_b8"):
            if equal_rows is None:
                equal_rows = build_rows(rows, "equal_length")
            if equal_b8 is None:
                equal_b8 = score_layout(model, equal_rows, "left", 8, "mask", pad)
                tick("equal b8")
            if name == "b1_vs_b8_equal_nopad":
                equal_b1 = score_layout(model, equal_rows, "left", 1, "mask", pad)
                cell(name, equal_b1.logprobs, equal_b8, equal_b8.mask, min(8, count), "none", "mask", count)
            else:
                if count <= 8:
                    cells.append(skipped_cell(f"needs more than 8 rows to change membership (have {count})",
                                              comparison=name))
                    continue
                regrouped = score_layout(model, equal_rows, "left", 8, "mask", pad, order=_shuffled_grouping(count))
                cell(name, equal_b8.logprobs, regrouped, equal_b8.mask, 8, "none", "mask", count)
        elif name == "copy8_vs_alone":
            copies = score_layout(model, [rows[0]] * 8, "left", 8, "mask", pad)
            first = Scored(copies.logprobs[:1], copies.mask[:1], copies.seconds, copies.tokens_forwarded)
            cell(name, base.logprobs[:1], first, mask[:1], 8, "none", "mask", 1)
            cells[-1]["copies_identical"] = bool((copies.logprobs == copies.logprobs[:1]).all().item())
        elif name == "sampler_vs_b1":
            width = min(rollouts.sampler_logprobs.shape[1], base.logprobs.shape[1])
            sampler_mask = rollouts.sampler_mask[:, :width] & mask[:, :width]
            # ratio = exp(teacher-forced - sampler): the importance ratio trainer / sampler
            result = compare(
                rollouts.sampler_logprobs[:count, :width], base.logprobs[:, :width], sampler_mask, band,
                comparison=name,
            )
            result.update(batch_size=rollouts.sampler.get("batch_size"), layout="generate", positions="mask",
                          rows=count, sampler=dict(rollouts.sampler))
            cells.append(result)
            continue
        tick(name)
    return cells, extras


def json_safe(value):
    """``value`` with every non-finite float replaced by ``None`` (strict JSON has no NaN/Infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def pp(fraction: float | None) -> float | None:
    """Fraction -> percentage points rounded to 2 decimals (``None`` stays ``None``)."""
    return None if fraction is None or (isinstance(fraction, float) and math.isnan(fraction)) else round(
        100.0 * fraction, 2
    )


BATCH_SHAPE_COMPARISONS = (
    "b1_vs_b8_left_arange",
    "b1_vs_b8_left_mask",
    "b1_vs_b32_left_arange",
    "b1_vs_b32_left_mask",
    "b1_vs_b8_right",
    "b1_vs_b8_equal_nopad",
    "copy8_vs_alone",
    "two_groupings_b8",
)
HEADLINE = "b1_vs_b8_left_arange"  # TRL's scoring layout: left padding, positions 0..L-1


def _measured(cells: Iterable[dict]) -> list[dict]:
    return [c for c in cells if c.get("oob") is not None]


def _worst(cells: list[dict], dtype: str, names: Iterable[str]) -> dict | None:
    names = set(names)
    pool = [c for c in cells if c["dtype"] == dtype and c["comparison"] in names]
    return max(pool, key=lambda c: c["oob"]) if pool else None


def _seconds_per_token(cells: list[dict], dtype: str, attn: str | None) -> float | None:
    pool = [
        c for c in cells
        if c["dtype"] == dtype and (attn is None or c["attn"] == attn) and c["comparison"] == "b1_vs_b8_left_mask"
        and c.get("tokens_forwarded")
    ]
    return pool[0]["seconds"] / pool[0]["tokens_forwarded"] if pool else None


def recommend(
    cells: Sequence[dict],
    fp16_check: dict | None = None,
    device_type: str = "cpu",
    paired: Sequence[dict] = (),
) -> dict:
    """Pick an arm from measured cells (each with ``dtype``, ``attn``, ``comparison``, ``oob``, ``rows``...).

    Logic, on the headline comparison (b1 vs b8 with TRL's left padding and 0..L-1 positions, worst attention
    implementation): no bf16 gap anywhere -> arm A; fp16 safe and leaving <= 10% of bf16's gap on the same
    rows -> arm H (fp16 at both ends of the PPO ratio; fp16 old log-probs alone, arm F, leave a bf16 training
    forward in the ratio, which the H200 runs showed to cost more than the noise it removes); else fp32
    leaving <= 10% -> arm B (or a cheaper ladder rung), with the same caveat. A dtype scored on fewer rows
    is compared with bf16 on the same rows: ``paired`` holds such bf16 cells (same ``comparison``, ``attn``
    and ``rows``). Costs are each dtype's measured seconds per token on its batch-8 pass relative to bf16 on
    this device. Returns ``{"arm", "text", "basis"}``.
    """
    cells = _measured(cells)
    paired = _measured(paired)
    lines: list[str] = []
    basis: dict = {}
    nondeterministic = [
        f"{c['dtype']}/{c['attn']}" for c in cells
        if c["comparison"] == "rerun_b1" and not c.get("bitwise_equal", c["oob_count"] == 0)
    ]
    if nondeterministic:
        lines.append(
            "The forward is nondeterministic on this device (batch-1 rerun differs for "
            + ", ".join(nondeterministic)
            + "): part of every gap below is run-to-run noise, which no scoring arm removes."
        )
    basis["nondeterministic"] = nondeterministic

    def pct(c: dict) -> str:
        return f"{100 * c['oob']:.2f}%"

    def fmt(c: dict) -> str:
        return f"{pct(c)} ({c['oob_count']}/{c['n']} tokens, {c['attn']})"

    def bf16_same_rows(c: dict) -> dict | None:
        for pool in (cells, paired):
            for other in pool:
                if (other["dtype"] == "bf16" and other["comparison"] == c["comparison"]
                        and other["attn"] == c["attn"] and other.get("rows") == c.get("rows")):
                    return other
        return None

    bf16 = _worst(cells, "bf16", [HEADLINE])
    if bf16 is None:
        return {"arm": None, "text": "No bf16 cell was measured: nothing to recommend (bf16 is the trainer default).",
                "basis": basis}
    bf16_worst = _worst(cells, "bf16", BATCH_SHAPE_COMPARISONS)
    basis.update(bf16_headline=bf16["oob"], bf16_worst=bf16_worst["oob"], bf16_worst_comparison=bf16_worst["comparison"])
    base_attn = bf16["attn"]
    bf16_speed = _seconds_per_token(cells, "bf16", base_attn)

    def cost(dtype: str) -> float | None:
        speed = _seconds_per_token(cells, dtype, base_attn)
        return None if speed is None or not bf16_speed else speed / bf16_speed

    for dtype in ("fp16", "fp32"):
        basis[f"{dtype}_cost_vs_bf16"] = cost(dtype)

    fp16_safe = None
    if fp16_check and not fp16_check.get("skipped"):
        fp16_safe = fp16_check.get("nonfinite_logprobs", 1) == 0 and fp16_check.get("max_abs_hidden", FP16_MAX) < FP16_MAX / 2
    basis["fp16_safe"] = fp16_safe

    def cost_text(dtype: str) -> str:
        value = cost(dtype)
        if value is None:
            return "cost not measured"
        text = f"measured {value:.2f}x bf16's time per token here"
        if dtype == "fp16" and device_type == "cpu":
            text += " (this CPU has no native fp16 kernels; GPUs with fp16 tensor cores run it at about bf16 speed)"
        return text

    def removal(dtype: str) -> tuple[dict, dict, bool] | None:
        """(cell, bf16 on the same rows, removes >= 90% of a non-zero bf16 gap) for the dtype's headline."""
        c = _worst(cells, dtype, [HEADLINE])
        if c is None:
            return None
        ref = bf16_same_rows(c)
        if ref is None:
            return None
        return c, ref, ref["oob"] > 0 and c["oob"] <= 0.1 * ref["oob"]

    def removal_text(dtype: str, c: dict, ref: dict) -> str:
        rows = "" if c.get("rows") == bf16.get("rows") else f" on the {c.get('rows')} rows it was scored on"
        return (f"{dtype} removes {100 * (ref['oob'] - c['oob']):.2f} of {100 * ref['oob']:.2f} pp{rows} "
                f"(bf16 {fmt(ref)}, {dtype} {fmt(c)})")

    arm: str | None = "A"
    if bf16["oob"] == 0 and bf16_worst["oob"] == 0:
        lines.append(
            f"bf16 shows no batch-shape gap here: {fmt(bf16)} on TRL's layout and 0 in every other comparison. "
            "Arm A (trainer default) is enough; keep the live probe (gap/probe/*) on, since the gap depends on shapes."
        )
    else:
        lines.append(
            f"bf16 b1 vs b8 with TRL's layout: {fmt(bf16)}; worst bf16 comparison: "
            f"{bf16_worst['comparison']} {pct(bf16_worst)} ({bf16_worst['attn']})."
        )
        fp16 = removal("fp16")
        fp32 = removal("fp32")
        if fp16 is not None:
            basis["fp16_vs_bf16_same_rows"] = {"fp16": fp16[0]["oob"], "bf16": fp16[1]["oob"], "rows": fp16[0].get("rows")}
        if fp32 is not None:
            basis["fp32_vs_bf16_same_rows"] = {"fp32": fp32[0]["oob"], "bf16": fp32[1]["oob"], "rows": fp32[0].get("rows")}
        if fp16 is not None and fp16[2] and fp16_safe is not False:
            arm = "H"
            lines.append(
                f"{removal_text('fp16', fp16[0], fp16[1])}, {cost_text('fp16')}: arm H (fp16 everywhere: rollout, "
                "old log-probs and training in fp16 with loss scaling). Arm F (fp16 old log-probs only) removes the "
                "noise from the old-logprob pass, but while training stays in bf16 the PPO ratio new/old then "
                "carries the bf16-vs-fp16 difference of every token: watch gap/ratio/oob_frac against arm A before "
                "choosing it."
            )
        elif fp32 is not None and fp32[2]:
            arm = "B"
            if fp16_safe is False:
                why = "fp16 is not safe for this model (see the fp16 check)"
            elif fp16 is None:
                why = "fp16 was not measured"
            elif fp16[1]["oob"] == 0:
                why = (f"fp16 was scored on {fp16[0].get('rows')} rows where bf16 showed no gap, so it is not shown "
                       "to help (score more fp16 rows: --fp16-rows)")
            else:
                why = f"fp16 leaves {pct(fp16[0])} of bf16's {pct(fp16[1])} on the same rows (more than a tenth)"
            lines.append(
                f"{why}; {removal_text('fp32', fp32[0], fp32[1])}: arm B (fp32 shadow copy), {cost_text('fp32')}. "
                "It keeps the PPO ratio at 1 only if training also runs in fp32 (bf16: false); with bf16 training "
                "the ratio carries the bf16-vs-fp32 difference (watch gap/ratio/oob_frac). `bloggap ladder` finds "
                "cheaper rungs (fp32 head, guided fp32 layers: arms E, D)."
            )
        else:
            arm = None
            lines.append("Neither fp16 nor fp32 was shown to remove the gap in the measured cells: run "
                         "`bloggap attribute` and `bloggap ladder` to see where it enters.")
        mask_cell = _worst(cells, "bf16", ["b1_vs_b8_left_mask"])
        if mask_cell is not None and mask_cell["oob"] < bf16["oob"]:
            lines.append(
                f"Positions from the attention mask alone bring bf16 from {pct(bf16)} to {pct(mask_cell)} "
                "at no cost: set gap.positions: mask (TRL scores left-padded rows with positions 0..L-1)."
            )
        basis["arm_reason_cells"] = HEADLINE
    membership = [c for c in cells if c["comparison"] == "two_groupings_b8" and c["oob"] > 0]
    if membership:
        worst = max(membership, key=lambda c: c["oob"])
        lines.append(
            f"Batch membership changes results ({worst['dtype']}/{worst['attn']}: {pct(worst)} between "
            "two groupings of the same rows, as with MoE routing): arm G (matched shapes) keeps the first-epoch "
            "ratio at 1."
        )
    sampler = {}
    for c in sorted(cells, key=lambda c: c["oob"]):
        if c["comparison"] == "sampler_vs_b1":
            sampler[c["dtype"]] = c  # worst attention implementation per dtype
    if sampler:
        parts = []
        for dtype, c in sorted(sampler.items()):
            text = f"{dtype} scorer {pct(c)}"
            ref = bf16_same_rows(c) if dtype != "bf16" else None
            if ref is not None and c.get("rows") != sampler.get("bf16", {}).get("rows"):
                text += f" ({c.get('rows')} rows; bf16 scorer on them {pct(ref)})"
            parts.append(text)
        basis["sampler"] = {d: c["oob"] for d, c in sampler.items()}
        best = min(sampler.values(), key=lambda c: c["oob"])
        sampler_dtype = best.get("sampler", {}).get("dtype", "?")
        if best["oob"] > 0:
            lines.append(
                f"Sampler (generate's own log-probs, {sampler_dtype}) vs teacher-forced batch 1: {', '.join(parts)}. "
                f"No scorer precision removes it (best {pct(best)}): the sampler must change too (arm H, fp16 "
                "everywhere), or correct it with importance sampling."
            )
        else:
            lines.append(f"Sampler vs teacher-forced batch 1: {', '.join(parts)}.")
    if fp16_safe is False:
        lines.append(
            f"fp16 check failed: {fp16_check.get('nonfinite_logprobs')} non-finite log-probs, largest |hidden| "
            f"{fp16_check.get('max_abs_hidden'):.0f} vs fp16's 65,504: do not use fp16 for this model."
        )
    return {"arm": arm, "text": " ".join(lines), "basis": basis}


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
    completion_width = max(len(r.completion) for r in rows)
    logprobs = torch.zeros((len(rows), completion_width), dtype=torch.float32)
    mask = torch.zeros((len(rows), completion_width), dtype=torch.bool)
    forwarded = 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
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
        forwarded += total
        # score every position 1..total-1; token at absolute position t sits at column t-1
        values = token_logprobs(
            model, ids, torch.ones_like(ids), total - 1, positions="arange", forward=forward
        ).cpu()[0]
        offset = 0
        for j, r in enumerate(chunk):
            first = offset + len(r.prompt)
            logprobs[start + j, : len(r.completion)] = values[first - 1 : first - 1 + len(r.completion)]
            mask[start + j, : len(r.completion)] = True
            offset += lengths[j]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return Scored(logprobs, mask, time.perf_counter() - started, forwarded)
