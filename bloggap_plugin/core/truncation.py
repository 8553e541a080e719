"""Truncated sampling: kept sets in the sampler's order (vLLM or HF), kept mass, renormalisation (torch only).

With top_p / top_k / min_p the sampler draws from ``p_T(y) / S`` where ``S`` is the probability mass (at
temperature ``T``) of the kept set; a trainer that scores over the full vocabulary gets ``p_T(y)``, so the
ratio ``exp(logp_trainer - logp_sampler)`` equals ``S`` for every token (<= 1, whatever was sampled). The fix
is to renormalise the trainer's log-prob over the same kept set: ``log p(y) - log sum_{k in S} p(k)``.

Conventions: ``logits`` are ``[..., V]`` raw (not temperature-scaled) unless a function says otherwise;
``kept`` is a bool tensor ``[..., V]``; ``tokens`` / ``sizes`` are ``[...]``. All outputs are fp32.

Kept-set representations and their memory cost per scored token (``V`` = vocabulary, ``S`` = set size):

- bool mask ``[..., V]``: ``V`` bytes (151k vocab: 151 kB per token, 2.5 GB for 16 x 1024 tokens);
- padded ids ``[..., S_max]`` int64 with ``-1`` padding (:func:`pack_kept_ids`): ``8 * S_max`` bytes, plus
  ``4 * S_max`` bytes of gathered logits while scoring; exact, independent of ``V``;
- sizes ``[...]`` int (:func:`log_kept_mass_from_size`): 4 bytes; exact whenever the trainer's top-``|S|``
  equals the sampler's set (top_k, top_p and min_p all keep a prefix of the sorted vocabulary), approximate at
  the boundary where the two sides' logits order tokens differently; scoring needs a ``topk`` of width
  ``max |S|`` (``4 * max|S|`` bytes per token).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bloggap_plugin.core.scoring import LogprobReducer, TileIndex, gather_logprobs

__all__ = [
    "ORDERS",
    "kept_mask",
    "log_kept_mass",
    "log_kept_mass_from_size",
    "log_kept_mass_from_ids",
    "renormalized_logprobs",
    "pack_kept_ids",
    "kept_ids_from_mask",
    "kept_reducer",
    "validate_sampling",
]


def validate_sampling(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> None:
    """Raise ``ValueError`` naming the bad sampling parameter and the accepted range."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (greedy decoding has no kept set to renormalise over), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {top_p}")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {min_p}")
    if int(top_k) != top_k:
        raise ValueError(f"top_k must be an integer (0 or -1 disables it), got {top_k}")


def _threshold_keep(values_desc: torch.Tensor, last_kept: torch.Tensor, scaled: torch.Tensor) -> torch.Tensor:
    """Keep every token whose value is >= the value at sorted position ``last_kept`` (ties at the edge kept)."""
    cutoff = values_desc.gather(-1, last_kept.unsqueeze(-1))
    return scaled >= cutoff


ORDERS = ("vllm", "hf")


def kept_mask(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    sampled: torch.Tensor | None = None,
    order: str = "vllm",
) -> torch.Tensor:
    """The kept set ``[..., V]`` (bool) of truncated sampling, in the order of the sampler that drew the tokens.

    ``order="vllm"`` (vLLM, verl's rollouts): temperature, then min_p (keep ``p >= min_p * max p``), then top_k
    (keep the ``k`` largest), then top_p (keep the smallest prefix of the sorted, already-truncated distribution
    whose mass reaches ``top_p``: a token is kept iff the renormalised mass strictly above it is ``< top_p``).
    Ties at a boundary are all kept (vLLM's top-k rule; its top-p splits exact ties by sort order).

    ``order="hf"`` (Hugging Face ``generate``, transformers 5.x ``_get_logits_processor``): temperature, top_k,
    top_p, then min_p, each with exactly the operations of transformers' warpers (``TopPLogitsWarper`` removes
    the ascending-sorted tokens whose cumulative mass is ``<= 1 - top_p``; ``MinPLogitsWarper`` compares the
    softmax of what top_k / top_p left), so the set is bit-for-bit the one ``generate`` samples from.

    Each step renormalises over what the previous one kept. ``top_k <= 0`` or ``>= V``, ``top_p == 1`` and
    ``min_p == 0`` disable their step. Tokens whose logit is ``-inf`` (masked by an earlier processor) are never
    kept; ``sampled`` ``[...]`` (token ids), when given, is always kept, as trainer-side re-truncation needs.
    """
    validate_sampling(temperature, top_k, top_p, min_p)
    if order not in ORDERS:
        raise ValueError(f"order must be 'hf' or 'vllm' (the sampler that drew the tokens), got {order!r}")
    if torch.isnan(logits).any():
        raise ValueError("logits contain NaN; the kept set is undefined")
    scaled = logits.float() / temperature
    kept = scaled > float("-inf")
    if not kept.any(-1).all():
        raise ValueError("a row of logits is entirely -inf: nothing can be sampled from it")
    if order == "hf":
        kept &= _hf_kept(scaled, top_k, top_p, min_p)
    else:
        kept &= _vllm_kept(scaled, top_k, top_p, min_p)
    if sampled is not None:
        if sampled.shape != kept.shape[:-1]:
            raise ValueError(f"sampled {tuple(sampled.shape)} must match logits' leading shape {tuple(kept.shape[:-1])}")
        kept.scatter_(-1, sampled.long().unsqueeze(-1), True)
    return kept


def _vllm_kept(scaled: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """vLLM's order on temperature-scaled fp32 logits: min_p, top_k, top_p (see :func:`kept_mask`)."""
    kept = torch.ones_like(scaled, dtype=torch.bool)
    neg_inf = torch.tensor(float("-inf"), dtype=scaled.dtype, device=scaled.device)
    if min_p > 0.0:
        probs = torch.softmax(scaled, dim=-1)
        kept &= probs >= min_p * probs.amax(-1, keepdim=True)
        scaled = torch.where(kept, scaled, neg_inf)
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, int(top_k), dim=-1).values[..., -1:]
        kept &= scaled >= kth
        scaled = torch.where(kept, scaled, neg_inf)
    if top_p < 1.0:
        values_desc = torch.sort(scaled, dim=-1, descending=True).values
        probs_desc = torch.softmax(values_desc, dim=-1)
        mass_above = torch.cumsum(probs_desc, dim=-1) - probs_desc
        # number of sorted positions whose renormalised mass above is < top_p (always >= 1: position 0 has 0)
        n_keep = (mass_above < top_p).sum(-1).clamp(min=1)
        kept &= _threshold_keep(values_desc, n_keep - 1, scaled)
    return kept


def _hf_kept(scaled: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """transformers' warpers on temperature-scaled fp32 logits: top_k, top_p, min_p (``min_tokens_to_keep=1``)."""
    scores = scaled
    if top_k > 0:  # TopKLogitsWarper (k >= V keeps everything)
        kth = torch.topk(scores, min(int(top_k), scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:  # TopPLogitsWarper
        sorted_scores, sorted_ids = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - top_p)
        remove_sorted[..., -1:] = False
        scores = scores.masked_fill(remove_sorted.scatter(-1, sorted_ids, remove_sorted), float("-inf"))
    if min_p > 0.0:  # MinPLogitsWarper
        probs = torch.softmax(scores, dim=-1)
        remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
        remove.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores > float("-inf")


def _lse_all(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()
    return scaled, torch.logsumexp(scaled, dim=-1)


def log_kept_mass(logits: torch.Tensor, kept: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log sum_{k in kept} softmax(logits / T)_k`` ``[...]`` fp32, ``<= 0`` (0 when everything is kept).

    Raises if a row keeps nothing (the mass would be 0 and renormalisation undefined).
    """
    if kept.shape != logits.shape:
        raise ValueError(f"kept {tuple(kept.shape)} must have the logits' shape {tuple(logits.shape)}")
    if not kept.any(-1).all():
        raise ValueError("a kept set is empty; every position needs at least the sampled token")
    scaled, lse_all = _lse_all(logits, temperature)
    lse_kept = torch.logsumexp(scaled.masked_fill(~kept.bool(), float("-inf")), dim=-1)
    return (lse_kept - lse_all).clamp(max=0.0)


def log_kept_mass_from_size(logits: torch.Tensor, sizes: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log mass of the ``sizes`` most likely tokens ``[...]`` fp32, ``<= 0``; ``size == 0`` means untruncated (0).

    Uses one ``topk`` of width ``max(sizes)`` and a ``logcumsumexp`` along it, so it never builds a ``[V]``
    mask. Sizes above ``V`` are treated as ``V`` (everything kept).
    """
    if sizes.shape != logits.shape[:-1]:
        raise ValueError(f"sizes {tuple(sizes.shape)} must match logits' leading shape {tuple(logits.shape[:-1])}")
    if (sizes < 0).any():
        raise ValueError("kept-set sizes must be >= 0 (0 = untruncated)")
    scaled, lse_all = _lse_all(logits, temperature)
    vocab = scaled.shape[-1]
    sizes = sizes.long().clamp(max=vocab)
    k_max = int(sizes.max().item()) if sizes.numel() else 0
    if k_max == 0:
        return torch.zeros_like(lse_all)
    top = torch.topk(scaled, k_max, dim=-1).values
    prefix = torch.logcumsumexp(top, dim=-1)
    lse_top = prefix.gather(-1, (sizes - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)
    log_mass = (lse_top - lse_all).clamp(max=0.0)
    return torch.where(sizes > 0, log_mass, torch.zeros_like(log_mass))


def log_kept_mass_from_ids(logits: torch.Tensor, kept_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log mass of the ids in ``kept_ids`` ``[..., S_max]`` (int, ``-1`` = padding) ``[...]`` fp32, ``<= 0``.

    A position whose row is all padding counts as untruncated (0). Ids must be unique within a row.
    """
    if kept_ids.shape[:-1] != logits.shape[:-1]:
        raise ValueError(f"kept_ids {tuple(kept_ids.shape)} must match logits' leading shape {tuple(logits.shape[:-1])}")
    scaled, lse_all = _lse_all(logits, temperature)
    if kept_ids.shape[-1] == 0:
        return torch.zeros_like(lse_all)
    valid = kept_ids >= 0
    if (kept_ids >= scaled.shape[-1]).any():
        raise ValueError(f"kept id out of range for a vocabulary of {scaled.shape[-1]}")
    gathered = scaled.gather(-1, kept_ids.long().clamp(min=0)).masked_fill(~valid, float("-inf"))
    log_mass = (torch.logsumexp(gathered, dim=-1) - lse_all).clamp(max=0.0)
    return torch.where(valid.any(-1), log_mass, torch.zeros_like(log_mass))


def renormalized_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, kept: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``log p_T(token) - log sum_{k in kept} p_T(k)`` ``[...]`` fp32: the log-prob under the kept-set distribution.

    A token outside its kept set gets ``-inf`` (probability 0 there); force sampled tokens in with
    ``kept_mask(..., sampled=tokens)`` when the set is re-derived rather than recorded.
    """
    if tokens.shape != logits.shape[:-1]:
        raise ValueError(f"tokens {tuple(tokens.shape)} must match logits' leading shape {tuple(logits.shape[:-1])}")
    scaled, _ = _lse_all(logits, temperature)
    if kept.shape != scaled.shape:
        raise ValueError(f"kept {tuple(kept.shape)} must have the logits' shape {tuple(logits.shape)}")
    masked = scaled.masked_fill(~kept.bool(), float("-inf"))
    return torch.log_softmax(masked, dim=-1).gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def kept_ids_from_mask(kept: torch.Tensor, max_ids: int | None = None) -> list:
    """Nested lists (the leading shape of ``kept``) of the kept ids per position; ``None`` where ``|S| > max_ids``."""
    flat = kept.reshape(-1, kept.shape[-1])
    sizes = flat.sum(-1).tolist()
    out = []
    for row, size in zip(flat, sizes):
        out.append(None if max_ids is not None and size > max_ids else torch.nonzero(row).squeeze(-1).tolist())
    for dim in reversed(kept.shape[1:-1]):
        out = [out[i : i + dim] for i in range(0, len(out), dim)]
    return out


def pack_kept_ids(
    kept_ids: Sequence[Sequence[Sequence[int] | None]], width: int | None = None, device: torch.device | str | None = None
) -> torch.Tensor:
    """Pack per-row, per-position id lists into ``[B, width, S_max]`` int64, ``-1`` padding.

    ``kept_ids[b][t]`` is a list of ids or ``None`` (unknown: left all ``-1``, so callers fall back to sizes);
    rows shorter than ``width`` are padded with unknown positions. ``S_max`` is the longest list (at least 1).
    """
    n_rows = len(kept_ids)
    width = max((len(r) for r in kept_ids), default=0) if width is None else int(width)
    s_max = max((len(ids) for row in kept_ids for ids in row if ids is not None), default=0)
    packed = torch.full((n_rows, width, max(s_max, 1)), -1, dtype=torch.long)
    for b, row in enumerate(kept_ids):
        if len(row) > width:
            raise ValueError(f"row {b} has {len(row)} positions, more than width={width}")
        for t, ids in enumerate(row):
            if ids:
                packed[b, t, : len(ids)] = torch.as_tensor(list(ids), dtype=torch.long)
    return packed.to(device) if device is not None else packed


def kept_reducer(
    kept: torch.Tensor | None = None,
    kept_ids: torch.Tensor | None = None,
    sizes: torch.Tensor | None = None,
) -> LogprobReducer:
    """A ``reduce`` for :func:`bloggap_plugin.core.scoring.token_logprobs` that renormalises over the kept set.

    Give full-batch tensors aligned with the scored tokens (``[B, K]`` leading shape, ``K = logits_to_keep``):
    ``kept`` ``[B, K, V]`` bool (exact, ``V`` bytes per token), and/or ``kept_ids`` ``[B, K, S_max]`` int
    (``-1`` padding; exact, see :func:`pack_kept_ids`), and/or ``sizes`` ``[B, K]`` int (top-``|S|``, 0 =
    untruncated). Precedence per token: mask, then ids (where the row has any id), then size; a token with
    none is scored over the full vocabulary. The reducer receives temperature-scaled fp32 logits ``[b, t, V]``
    of one tile, targets ``[b, t]`` and the tile's ``index`` (``(rows, cols)`` slices of the full ``[B, K]``
    grid: ``kept[index]`` is the tile's part), and returns ``log p(y) - log M`` ``[b, t]`` fp32; the
    gradient flows through both terms, so it is the gradient of the renormalised log-prob.
    """
    if kept is None and kept_ids is None and sizes is None:
        raise ValueError("kept_reducer needs a kept-set source: kept (mask), kept_ids or sizes")

    def reduce(logits: torch.Tensor, targets: torch.Tensor, rows: TileIndex) -> torch.Tensor:
        full = gather_logprobs(logits, targets)
        log_mass = torch.zeros_like(full)
        known = torch.zeros_like(full, dtype=torch.bool)
        if kept is not None:
            chunk = kept[rows].to(logits.device)
            _check_leading(chunk, targets, "kept")
            log_mass = log_kept_mass(logits, chunk)
            known = torch.ones_like(known)
        if kept_ids is not None:
            chunk = kept_ids[rows].to(logits.device)
            _check_leading(chunk, targets, "kept_ids")
            has_ids = (chunk >= 0).any(-1) & ~known
            if has_ids.any():
                log_mass = torch.where(has_ids, log_kept_mass_from_ids(logits, chunk), log_mass)
                known = known | has_ids
        if sizes is not None:
            chunk = sizes[rows].to(logits.device)
            if chunk.shape != targets.shape:
                raise ValueError(f"sizes chunk {tuple(chunk.shape)} does not match the scored tokens {tuple(targets.shape)}")
            use = (chunk > 0) & ~known
            if use.any():
                log_mass = torch.where(use, log_kept_mass_from_size(logits, torch.where(use, chunk, 0)), log_mass)
        return full - log_mass

    return reduce


def _check_leading(chunk: torch.Tensor, targets: torch.Tensor, name: str) -> None:
    if chunk.shape[:2] != targets.shape:
        raise ValueError(
            f"{name} rows have leading shape {tuple(chunk.shape[:2])} but the scored tokens are {tuple(targets.shape)}; "
            "pass full-batch tensors aligned with the last logits_to_keep tokens"
        )
