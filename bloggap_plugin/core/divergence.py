"""Where the batch-shape divergence enters: per-layer hidden-state divergence between batch 1 and batch N.

The same rows are scored twice through :func:`bloggap_plugin.core.scoring.token_logprobs`: each row alone
with its padding removed (batch 1) and in left-padded chunks of ``batch_size`` rows (batch N, TRL's layout).
Forward hooks capture the hidden state entering decoder layer 0 (after the embedding), after every decoder
layer and after the final norm, at the compared positions. Per boundary the **relative divergence** is the
mean over compared tokens of ``||h_1 - h_N||_2 / (||h_1||_2 + 1e-6)``; the **increment** of layer ``i`` is
``div[i + 1] - div[i]`` (``div[0]`` = after the embedding). Unlike HF's ``hidden_states`` tuple, the last
layer's value here is taken *before* the final norm, which is reported separately.

Choices for arm D: ``top_k`` = the ``k`` layers with the largest increments (ties: lower id first);
``best_window`` = the contiguous ``k`` layers with the largest summed increment (earliest on ties).
Measure on calibration rows disjoint from the rows you evaluate the plan on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from .model_parts import final_norm, layer_list_path
from .scoring import token_logprobs, unwrap_model

__all__ = [
    "DivergenceProfile",
    "divergence_profile",
    "layer_increments",
    "quartile_sums",
    "top_k_layers",
    "best_window",
    "strip_padding",
]

EPS = 1e-6


def layer_increments(divergence: list[float]) -> list[float]:
    """``[div[i + 1] - div[i] for i in range(L)]`` from the ``L + 1`` boundary divergences."""
    if len(divergence) < 2:
        raise ValueError(f"need L + 1 >= 2 boundary divergences (embedding + layers), got {len(divergence)}")
    return [divergence[i + 1] - divergence[i] for i in range(len(divergence) - 1)]


def quartile_sums(increments: list[float]) -> list[float]:
    """Increment sums over four quarters of the stack: ``q = L // 4`` layers each, the remainder to Q4."""
    n = len(increments)
    if n < 4:
        raise ValueError(f"quartile sums need at least 4 layers, got {n}")
    q = n // 4
    bounds = [0, q, 2 * q, 3 * q, n]
    return [float(sum(increments[bounds[j] : bounds[j + 1]])) for j in range(4)]


def top_k_layers(increments: list[float], k: int) -> list[int]:
    """Ids of the ``k`` largest increments, largest first (ties: lower id first)."""
    _check_k(k, len(increments))
    order = sorted(range(len(increments)), key=lambda i: (-increments[i], i))
    return order[:k]


def best_window(increments: list[float], k: int) -> list[int]:
    """The contiguous block of ``k`` layer ids with the largest summed increment (earliest on ties)."""
    _check_k(k, len(increments))
    if k == 0:
        return []
    best_start, best_sum = 0, None
    for start in range(len(increments) - k + 1):
        total = sum(increments[start : start + k])
        if best_sum is None or total > best_sum:
            best_start, best_sum = start, total
    return list(range(best_start, best_start + k))


def _check_k(k: int, n_layers: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= n_layers:
        raise ValueError(f"k must be an integer in [0, {n_layers}] (number of layers), got {k!r}")


@dataclass
class DivergenceProfile:
    """Relative hidden-state divergence batch 1 vs batch ``batch_size`` per layer boundary.

    Attributes:
        divergence: ``L + 1`` values: after the embedding, then after each decoder layer (before the final norm).
        final_norm_divergence: after the final norm (``None`` when the model has none).
        n_tokens: compared token positions; n_rows: rows; batch_size: rows per chunk on the batched side.
        positions: position-id mode used for scoring (``"mask"`` or ``"arange"``).
    """

    divergence: list[float]
    final_norm_divergence: float | None
    n_tokens: int
    n_rows: int
    batch_size: int
    positions: str = "mask"
    increments: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.increments = layer_increments(self.divergence)

    @property
    def n_layers(self) -> int:
        return len(self.increments)

    def top_k(self, k: int) -> list[int]:
        """See :func:`top_k_layers`."""
        return top_k_layers(self.increments, k)

    def best_window(self, k: int) -> list[int]:
        """See :func:`best_window`."""
        return best_window(self.increments, k)

    def quartile_sums(self) -> list[float]:
        """See :func:`quartile_sums`."""
        return quartile_sums(self.increments)

    def to_dict(self, k: int | None = None) -> dict:
        """JSON-ready dict; with ``k`` also the top-k layers and the best window of ``k``."""
        out = asdict(self)
        out["n_layers"] = self.n_layers
        out["after_last_layer"] = self.divergence[-1]
        if self.n_layers >= 4:
            out["quartile_sums"] = self.quartile_sums()
        if k is not None:
            k = min(k, self.n_layers)
            out["k"] = k
            out["top_k"] = self.top_k(k)
            out["best_window"] = self.best_window(k)
        return out


def strip_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """One row's real tokens ``[1, n]`` (mask == 1; must be contiguous) and their start column."""
    real = attention_mask.nonzero().flatten()
    if real.numel() == 0:
        raise ValueError("a row has no real token (attention_mask all zero)")
    start, stop = int(real[0]), int(real[-1]) + 1
    if stop - start != real.numel():
        raise ValueError("a row's real tokens are not contiguous (mask has holes); cannot score it alone")
    return input_ids[start:stop].unsqueeze(0), start


class _Capture:
    """Forward hooks storing, per boundary, the hidden state of the current forward pass."""

    def __init__(self, model: nn.Module) -> None:
        source = unwrap_model(model)
        _, layers = layer_list_path(source)
        self.n_layers = len(layers)
        self.hidden: dict[int, torch.Tensor] = {}
        self.handles = [layers[0].register_forward_pre_hook(self._pre_hook(0), with_kwargs=True)]
        for i, layer in enumerate(layers):
            self.handles.append(layer.register_forward_hook(self._post_hook(i + 1)))
        norm = final_norm(source)
        self.has_norm = norm is not None
        if norm is not None:
            self.handles.append(norm[2].register_forward_hook(self._post_hook(self.n_layers + 1)))

    def _pre_hook(self, index: int):
        def hook(module, args, kwargs):
            self.hidden[index] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _post_hook(self, index: int):
        def hook(module, args, output):
            self.hidden[index] = output[0] if isinstance(output, (tuple, list)) else output

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _compared_columns(mask_row: torch.Tensor, logits_to_keep: int | None) -> torch.Tensor:
    """Padded-row columns compared: real tokens; with ``logits_to_keep`` only the ``K`` positions whose
    logits score the last ``K`` tokens (columns ``L-K-1 .. L-2``)."""
    cols = mask_row.nonzero().flatten()
    if logits_to_keep is not None:
        width = mask_row.shape[0]
        cols = cols[(cols >= width - logits_to_keep - 1) & (cols <= width - 2)]
    return cols


def divergence_profile(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    batch_size: int = 8,
    logits_to_keep: int | None = None,
    positions: str = "mask",
) -> DivergenceProfile:
    """Per-boundary relative divergence, batch 1 (each row alone, unpadded) vs left-padded chunks.

    Args:
        model: the causal LM as it scores (wrappers allowed; hooks go on the unwrapped decoder layers).
        input_ids, attention_mask: ``[N, L]`` rows, left padded (right padding after the real tokens is fine).
        batch_size: rows per chunk on the batched side (8 = the reference study's b8).
        logits_to_keep: compare only the positions scoring the last ``K`` tokens (default: every real token).
        positions: ``"mask"`` or ``"arange"`` position ids (see ``token_logprobs``).
    """
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids and attention_mask must be [N, L] of equal shape, got {tuple(input_ids.shape)}"
        )
    n_rows, width = input_ids.shape
    if n_rows < 2 or batch_size < 2:
        raise ValueError(
            f"need >= 2 rows and batch_size >= 2 to compare batch shapes (got {n_rows} rows, {batch_size})"
        )
    columns = [_compared_columns(attention_mask[r], logits_to_keep) for r in range(n_rows)]
    if sum(len(c) for c in columns) == 0:
        raise ValueError("no token position to compare (check attention_mask / logits_to_keep)")
    capture = _Capture(model)
    n_boundaries = capture.n_layers + 1 + (1 if capture.has_norm else 0)
    singles: list[list[torch.Tensor]] = []
    sums = torch.zeros(n_boundaries, dtype=torch.float64)
    try:
        with torch.no_grad():
            for r in range(n_rows):
                row_ids, start = strip_padding(input_ids[r], attention_mask[r])
                if row_ids.shape[1] < 2:
                    raise ValueError(f"row {r} has fewer than 2 real tokens")
                capture.hidden.clear()
                token_logprobs(model, row_ids, torch.ones_like(row_ids), 1, positions=positions)
                cols = columns[r] - start
                singles.append([capture.hidden[b][0, cols].float() for b in range(n_boundaries)])
            for chunk_start in range(0, n_rows, batch_size):
                rows = range(chunk_start, min(chunk_start + batch_size, n_rows))
                capture.hidden.clear()
                token_logprobs(
                    model,
                    input_ids[rows.start : rows.stop],
                    attention_mask[rows.start : rows.stop],
                    1,
                    positions=positions,
                )
                for j, r in enumerate(rows):
                    for b in range(n_boundaries):
                        batched = capture.hidden[b][j, columns[r]].float()
                        single = singles[r][b]
                        rel = (single - batched).norm(dim=-1) / (single.norm(dim=-1) + EPS)
                        sums[b] += rel.double().sum().cpu()
                    singles[r] = []  # free as we go
    finally:
        capture.remove()
    n_tokens = sum(len(c) for c in columns)
    means = (sums / n_tokens).tolist()
    divergence = means[: capture.n_layers + 1]
    final = means[capture.n_layers + 1] if capture.has_norm else None
    return DivergenceProfile(divergence, final, n_tokens, n_rows, batch_size, positions)
