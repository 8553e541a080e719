"""vLLM kept-set sources: mask replay (exact), processed log-probs, sizes and trainer-side re-truncation.

vLLM is never imported here: every function works on the objects vLLM returns (duck-typed on the fields
its documentation names) or on plain lists / JSON, so the module can be tested without vLLM.

``kept_sets_from_processed_logprobs`` ran against a live vLLM 0.26 (real ``CompletionOutput`` / ``Logprob`` objects,
``tests/benchmarks/test_gpu_vllm.py``; vLLM's top_k keeps ties at the k-th logit, so ``|S|`` can exceed ``k``). Mask replay
(vLLM >= 0.28, ``return_sampling_mask``, PR #49577) is tested against vLLM 0.31's own objects without an engine
(``tests/root/test_vllm031_objects.py``), not a live engine: ``RequestOutput.outputs[i].sampling_mask`` is
``SamplingMask(token_ids: list[list[int]])``, one row
of kept ids per generated token, aligned with ``CompletionOutput.token_ids``; the engine-internal CSR form is
``SamplingMaskLists(token_ids: ndarray, offsets: ndarray)``; the token-in/token-out endpoint
``/inference/v1/generate`` returns a per-choice ``sampling_mask`` (list of lists of int). TRL's colocate path uses
:func:`colocate_engine_kwargs` and :func:`kept_sets_from_request_outputs` (``gap.kept_source``,
``bloggap_plugin/trl/kept_source.py``); the structures were checked against vLLM 0.31's source (vllm/outputs.py,
vllm/v1/engine/output_processor.py).

Sources, best first (``KeptSets.approximate`` says which kind a batch came from, for the metrics):

1. ``sampling_mask`` (mask replay): exact ids. Engine: ``return_sampling_mask=True`` with
   ``logprobs_mode="processed_logprobs"`` (:func:`colocate_engine_kwargs`, :func:`server_cli_args`); request:
   ``temperature > 0`` and ``top_k > 0`` (:func:`replay_sampling_params` caps ``top_k`` when only top_p/min_p
   truncate).
2. processed log-probs with ``logprobs=K`` (older vLLM): the finite entries are kept ids; exact where some
   returned entry is ``-inf`` (the set was covered), approximate where all ``K`` were finite.
3. sizes only (``|S|`` per token): the trainer's top-``|S|``; approximate at the boundary.
4. trainer-side re-truncation (:func:`retruncation_reducer`): ``kept_mask`` on the trainer's logits with the
   sampled token forced in; approximate (the two sides' logits differ).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bloggap_plugin.core.truncation import kept_mask, pack_kept_ids, renormalized_logprobs, validate_sampling

__all__ = [
    "KeptSets",
    "mask_rows",
    "kept_sets_from_request_outputs",
    "kept_sets_from_server_response",
    "kept_sets_from_processed_logprobs",
    "kept_sets_from_sizes",
    "colocate_engine_kwargs",
    "server_cli_args",
    "ReplaySampling",
    "replay_sampling_params",
    "needs_kept_set",
    "server_generate_payload",
    "retruncation_reducer",
    "DEFAULT_TOP_K_CAP",
]

DEFAULT_TOP_K_CAP = 1024
"""``top_k`` sent to vLLM when only top_p / min_p truncate (vLLM refuses mask replay with ``top_k <= 0``);
the reference study and TRL PR #7269 used 1024. The cap is part of the sampler, so the replayed set includes it."""

_ENGINE_FLAG = "return_sampling_mask"


@dataclass
class KeptSets:
    """Kept sets of a flat list of completions (TRL's order: prompts x ``n``), aligned with their token ids."""

    sizes: list[list[int]]
    """Per completion, per generated token: ``|S|`` (0 = unknown/untruncated)."""
    ids: list[list[list[int] | None]] | None = None
    """Per completion, per token: the kept ids (sorted), or ``None`` where unknown; ``None`` for size-only."""
    approximate: bool = False
    """True when the sets are not the sampler's exact ones (size-only, incomplete logprobs, re-truncation)."""
    source: str = "sampling_mask"
    """``sampling_mask`` | ``processed_logprobs`` | ``sizes``."""
    stats: dict[str, Any] = field(default_factory=dict)
    """Counts for the metrics (e.g. ``positions``, ``incomplete_positions``)."""
    token_ids: list[list[int]] | None = None
    """Per completion: the generated token ids the sets are aligned with (``sampling_mask`` sources)."""

    def sizes_tensor(self, width: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
        """``[N, width]`` int32, right-padded with 0 (``width`` defaults to the longest completion)."""
        width = max((len(s) for s in self.sizes), default=0) if width is None else int(width)
        out = torch.zeros(len(self.sizes), width, dtype=torch.int32)
        for row, sizes in enumerate(self.sizes):
            if len(sizes) > width:
                raise ValueError(f"completion {row} has {len(sizes)} tokens, more than width={width}")
            out[row, : len(sizes)] = torch.as_tensor(sizes, dtype=torch.int32)
        return out.to(device) if device is not None else out

    def ids_tensor(
        self, width: int | None = None, max_ids: int | None = None, device: torch.device | str | None = None
    ) -> torch.Tensor | None:
        """``[N, width, S_max]`` int64 with ``-1`` padding; sets larger than ``max_ids`` are left out (use sizes)."""
        if self.ids is None:
            return None
        rows = [[ids if ids is not None and (max_ids is None or len(ids) <= max_ids) else None for ids in row] for row in self.ids]
        width = max((len(r) for r in rows), default=0) if width is None else int(width)
        return pack_kept_ids(rows, width=width, device=device)


def mask_rows(mask: Any) -> list[list[int]]:
    """Kept-id rows from any documented layout: ``SamplingMask`` (``.token_ids`` lists), CSR
    ``SamplingMaskLists`` (``.token_ids`` flat + ``.offsets``), a dict with those keys, or a list of lists."""
    if mask is None:
        raise ValueError(
            "no sampling_mask on this output: start vLLM (>= 0.28) with return_sampling_mask=True and "
            "logprobs_mode='processed_logprobs' (see colocate_engine_kwargs / server_cli_args), with top_k > 0"
        )
    if isinstance(mask, dict):
        token_ids, offsets = mask.get("token_ids"), mask.get("offsets")
    elif hasattr(mask, "token_ids"):
        token_ids, offsets = mask.token_ids, getattr(mask, "offsets", None)
    else:
        token_ids, offsets = mask, None
    if token_ids is None:
        raise ValueError(f"sampling_mask of type {type(mask).__name__} has no token_ids")
    token_ids = token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids
    if offsets is not None:
        offsets = offsets.tolist() if hasattr(offsets, "tolist") else list(offsets)
        if not offsets or offsets[0] != 0 or offsets[-1] != len(token_ids) or any(b < a for a, b in zip(offsets, offsets[1:])):
            raise ValueError(f"CSR sampling mask has inconsistent offsets (first/last {offsets[:1]}/{offsets[-1:]}, {len(token_ids)} ids)")
        return [sorted(int(t) for t in token_ids[a:b]) for a, b in zip(offsets, offsets[1:])]
    return [sorted(int(t) for t in row) for row in token_ids]


def _checked(rows: list[list[int]], token_ids: Sequence[int], where: str) -> list[list[int]]:
    if len(rows) != len(token_ids):
        raise ValueError(f"{where}: sampling_mask has {len(rows)} rows for {len(token_ids)} generated tokens")
    for t, (row, token) in enumerate(zip(rows, token_ids)):
        if not row:
            raise ValueError(f"{where}: kept set of token {t} is empty")
        index = min(_bisect(row, int(token)), len(row) - 1)
        if row[index] != int(token):
            raise ValueError(f"{where}: generated token {t} (id {int(token)}) is not in its kept set: misaligned mask")
    return rows


def _bisect(row: list[int], value: int) -> int:
    lo, hi = 0, len(row)
    while lo < hi:
        mid = (lo + hi) // 2
        if row[mid] < value:
            lo = mid + 1
        else:
            hi = mid
    return lo


def kept_sets_from_request_outputs(request_outputs: Iterable[Any]) -> KeptSets:
    """Exact kept sets from ``LLM.generate`` results (``RequestOutput`` list), flattened like TRL's
    ``[output.token_ids for r in request_outputs for output in r.outputs]``. Raises if a mask is missing or
    misaligned (a generated token outside its own kept set)."""
    ids, sizes, tokens = [], [], []
    for r_index, request in enumerate(request_outputs):
        for c_index, completion in enumerate(request.outputs):
            where = f"request {r_index} completion {c_index}"
            token_ids = [int(t) for t in completion.token_ids]
            rows = _checked(mask_rows(getattr(completion, "sampling_mask", None)), token_ids, where)
            ids.append(rows)
            sizes.append([len(row) for row in rows])
            tokens.append(token_ids)
    return KeptSets(sizes=sizes, ids=ids, approximate=False, source="sampling_mask",
                    stats={"positions": sum(map(len, sizes))}, token_ids=tokens)


def kept_sets_from_server_response(response: dict | Sequence[dict]) -> KeptSets:
    """Exact kept sets from ``/inference/v1/generate`` JSON: ``{"choices": [{"token_ids", "sampling_mask"}, ...]}``
    (or a list of such responses, one per prompt), in choice order."""
    responses = [response] if isinstance(response, dict) else list(response)
    ids, sizes = [], []
    for r_index, body in enumerate(responses):
        if "choices" not in body:
            raise ValueError(f"response {r_index} has no 'choices' (keys: {sorted(body)}); is this /inference/v1/generate?")
        for c_index, choice in enumerate(body["choices"]):
            where = f"response {r_index} choice {c_index}"
            if choice.get("sampling_mask") is None:
                raise ValueError(f"{where}: no sampling_mask; start the server with {' '.join(server_cli_args())} and send top_k > 0")
            rows = _checked(mask_rows(choice["sampling_mask"]), choice["token_ids"], where)
            ids.append(rows)
            sizes.append([len(row) for row in rows])
    return KeptSets(sizes=sizes, ids=ids, approximate=False, source="sampling_mask", stats={"positions": sum(map(len, sizes))})


def _logprob_value(entry: Any) -> float:
    return float(entry.logprob if hasattr(entry, "logprob") else entry)


def kept_sets_from_processed_logprobs(completions: Iterable[Any]) -> KeptSets:
    """Kept sets from ``CompletionOutput.logprobs`` (list per token of ``{token_id: Logprob}``) requested with
    ``logprobs=K`` under ``processed_logprobs`` (older vLLM without mask replay). Finite entries are kept;
    a position is exact only if some returned entry is ``-inf`` (the whole set was covered), otherwise its
    set may be larger than ``K``: its ids are then dropped, its size is a lower bound (the finite count),
    and the batch is flagged approximate. Start the server with ``--max-logprobs >= K``."""
    ids, sizes, incomplete, positions = [], [], 0, 0
    for c_index, completion in enumerate(completions):
        if completion.logprobs is None:
            raise ValueError(f"completion {c_index} has no logprobs: request logprobs=K >= top_k in processed_logprobs mode")
        if len(completion.logprobs) != len(completion.token_ids):
            raise ValueError(f"completion {c_index}: {len(completion.logprobs)} logprob rows for {len(completion.token_ids)} tokens")
        row_ids, row_sizes = [], []
        for t, (entries, token) in enumerate(zip(completion.logprobs, completion.token_ids)):
            values = {int(k): _logprob_value(v) for k, v in entries.items()}
            finite = sorted(k for k, v in values.items() if math.isfinite(v))
            if int(token) not in finite:
                raise ValueError(f"completion {c_index} token {t}: sampled id {int(token)} has no finite processed log-prob")
            covered = len(finite) < len(values)
            positions += 1
            if covered:
                row_ids.append(finite)
            else:
                incomplete += 1
                row_ids.append(None)
            row_sizes.append(len(finite))
        ids.append(row_ids)
        sizes.append(row_sizes)
    return KeptSets(
        sizes=sizes,
        ids=ids,
        approximate=incomplete > 0,
        source="processed_logprobs",
        stats={"positions": positions, "incomplete_positions": incomplete},
    )


def kept_sets_from_sizes(sizes: Sequence[Sequence[int]]) -> KeptSets:
    """Size-only kept sets (``|S|`` per token, e.g. shipped by a patched server): always flagged approximate."""
    clean = [[int(s) for s in row] for row in sizes]
    if any(s < 0 for row in clean for s in row):
        raise ValueError("kept-set sizes must be >= 0 (0 = untruncated)")
    return KeptSets(sizes=clean, ids=None, approximate=True, source="sizes", stats={"positions": sum(map(len, clean))})


def colocate_engine_kwargs(existing: dict | None = None) -> dict:
    """``LLM(...)`` keyword arguments for mask replay, merged into ``existing``; raises on a conflicting setting."""
    kwargs = dict(existing or {})
    mode = kwargs.get("logprobs_mode", "processed_logprobs")
    if str(mode) != "processed_logprobs":
        raise ValueError(
            f"mask replay needs logprobs_mode='processed_logprobs', the engine is configured with {mode!r}; "
            "drop the override (TRL already uses processed_logprobs)"
        )
    if kwargs.get("logits_processors"):
        raise ValueError("vLLM refuses return_sampling_mask with engine-level custom logits_processors; remove them")
    if kwargs.get("enable_batch_sharded_sampling"):
        raise ValueError("return_sampling_mask is incompatible with enable_batch_sharded_sampling (masks are dropped)")
    kwargs["logprobs_mode"] = "processed_logprobs"
    kwargs[_ENGINE_FLAG] = True
    return kwargs


def server_cli_args() -> list[str]:
    """``vllm serve`` flags that make ``/inference/v1/generate`` return ``sampling_mask``."""
    return ["--return-sampling-mask", "--logprobs-mode", "processed_logprobs"]


def needs_kept_set(top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> bool:
    """True when any truncation is active (so full-vocabulary scoring carries the kept mass)."""
    return top_k > 0 or top_p < 1.0 or min_p > 0.0


@dataclass
class ReplaySampling:
    """Sampling settings to send to vLLM so it can replay the kept set."""

    params: dict
    """``temperature``, ``top_p``, ``top_k``, ``min_p`` for ``SamplingParams`` / the request."""
    replay: bool
    """Whether a kept set is needed (some truncation is active)."""
    capped: bool
    """Whether ``top_k`` was set to the cap because only top_p / min_p truncate."""


def replay_sampling_params(
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = 0,
    min_p: float | None = 0.0,
    top_k_cap: int = DEFAULT_TOP_K_CAP,
) -> ReplaySampling:
    """Adjust sampling settings for vLLM mask replay: ``temperature > 0`` is required (greedy has no kept
    set); ``top_k > 0`` is required, so a ``top_k_cap`` is added when only top_p / min_p truncate (the cap
    then truncates too, and the replayed set includes it). ``top_k=None``/``-1`` and ``min_p=None`` mean off."""
    top_k = 0 if top_k is None or top_k < 0 else int(top_k)
    min_p = 0.0 if min_p is None else float(min_p)
    if not temperature > 0:
        raise ValueError(
            f"vLLM mask replay needs temperature > 0 (got {temperature}); greedy decoding keeps one token and "
            "vLLM resets top_p/top_k/min_p: sample with temperature > 0 or turn kept-set handling off"
        )
    validate_sampling(temperature, top_k, top_p, min_p)
    if top_k_cap < 1:
        raise ValueError(f"top_k_cap must be >= 1, got {top_k_cap}")
    params = {"temperature": float(temperature), "top_p": float(top_p), "top_k": top_k, "min_p": min_p}
    if not needs_kept_set(top_k, top_p, min_p):
        return ReplaySampling(params=params, replay=False, capped=False)
    capped = top_k == 0
    if capped:
        params["top_k"] = int(top_k_cap)
    return ReplaySampling(params=params, replay=True, capped=capped)


def server_generate_payload(prompt_token_ids: Sequence[int], sampling_params: dict, model: str | None = None, **extra) -> dict:
    """JSON body for ``/inference/v1/generate`` (token in, token out): ``{"token_ids", "sampling_params"}``.

    The mask itself is switched on at server start (:func:`server_cli_args`), not per request; a request
    only has to satisfy ``temperature > 0`` and ``top_k > 0`` (see :func:`replay_sampling_params`).
    Field names follow vLLM's token-in/token-out request as we understand it; not checked against a live server.
    """
    if not prompt_token_ids or not all(isinstance(t, int) and t >= 0 for t in prompt_token_ids):
        raise ValueError("prompt_token_ids must be a non-empty list of non-negative ints")
    if not sampling_params.get("temperature", 1.0) > 0 or not sampling_params.get("top_k", 0) > 0:
        raise ValueError(
            "a sampling_mask request needs temperature > 0 and top_k > 0; build the params with replay_sampling_params()"
        )
    body = {"token_ids": list(prompt_token_ids), "sampling_params": dict(sampling_params)}
    if model is not None:
        body["model"] = model
    body.update(extra)
    return body


def retruncation_reducer(
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    stats: dict | None = None,
):
    """A ``reduce`` for ``token_logprobs`` that re-derives the kept set from the trainer's own (already
    temperature-scaled) logits per chunk, forces the sampled token in, and renormalises over it.

    Approximate: near a top-p / min-p boundary the trainer's set can differ from the sampler's. ``stats``
    (optional dict) accumulates ``positions`` and ``forced`` (sampled tokens outside the trainer's set), for
    ``sampled_outside_trainer_set_frac``. Memory: one ``[b, K, V]`` bool mask per chunk.
    """
    validate_sampling(1.0, top_k, top_p, min_p)

    def reduce(logits: torch.Tensor, targets: torch.Tensor, rows: slice) -> torch.Tensor:
        with torch.no_grad():
            natural = kept_mask(logits.detach(), top_k=top_k, top_p=top_p, min_p=min_p)
            outside = ~natural.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            kept = natural.scatter(-1, targets.unsqueeze(-1), True)
        if stats is not None:
            stats["positions"] = stats.get("positions", 0) + int(targets.numel())
            stats["forced"] = stats.get("forced", 0) + int(outside.sum())
        return renormalized_logprobs(logits, targets, kept)  # logits arrive temperature-scaled

    reduce.approximate = True  # type: ignore[attr-defined]
    return reduce
