"""The sampler-recording logits processor for Hugging Face ``generate`` (the one mechanism on the HF path).

:class:`SamplerRecorder` is a ``transformers.LogitsProcessor`` that *is* the sampler's last stage: it divides
the scores by the temperature and, with ``truncate=True``, applies top_k / top_p / min_p itself in HF
``generate``'s order and arithmetic (:func:`bloggap_plugin.core.truncation.kept_mask` with ``order="hf"``: top_k,
top_p, then min_p), setting the other tokens to ``-inf``, so it draws bit for bit what HF's own warpers draw. HF then draws
from ``softmax`` of what it returns, so the recorder knows exactly the distribution each token came from.
It must run LAST: HF applies processors passed in ``logits_processor=`` *before* its own warpers, so the
caller's temperature / top_p / top_k / min_p must be neutralised (:meth:`SamplerRecorder.neutral_generation_kwargs`,
checked by :func:`check_neutral_generation_config` on :func:`effective_generation_config`, since ``generate``
fills ``None`` fields from the model's generation_config) and given to the recorder instead
(:func:`sampler_settings`, which refuses the warpers the recorder does not model: typical_p, epsilon/eta
cutoffs, top_h, watermarking). Only plain multinomial sampling can be recorded (:func:`unsupported_generation_mode`).

What it sees: everything that runs before it is included in the recorded distribution, i.e. HF's default
processors (repetition / presence penalties, ``no_repeat_ngram_size``, ``min_new_tokens`` EOS suppression,
bad words, forced tokens, ...) and any user processor placed before it. A trainer that scores without those
processors differs from the sampler by their effect too, exactly like vLLM's ``processed_logprobs``.

Recording cost: per step it keeps one ``[B, V]`` fp32 full log-softmax row (two when truncating) until the
next call reads the emitted token from ``input_ids[:, -1]``; per token it stores four scalars and, when
truncating, up to ``store_ids_max`` int32 ids (``B * C * store_ids_max * 4`` bytes on the device; no
host sync during generation). The kept ids stay tensors to the end (sorted and trimmed on the device).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import transformers

from bloggap_plugin.core.truncation import ORDERS, kept_mask, validate_sampling

__all__ = [
    "SamplerRecorder",
    "SamplerRecord",
    "SamplerRecordError",
    "check_neutral_generation_config",
    "effective_generation_config",
    "hf_warpers",
    "sampler_settings",
    "unsupported_generation_mode",
]


class SamplerRecordError(RuntimeError):
    """The recorder's steps do not describe the sequences ``generate`` returned (nothing recorded, because
    ``generate`` was replaced or ran without the recorder, or a different number of rows/steps/tokens)."""


@dataclass
class SamplerRecord:
    """What the sampler did for each generated token; ``C`` = completion width (``sequences.shape[1] - P``)."""

    logps: torch.Tensor
    """``[B, C]`` fp32: the sampler's full-vocabulary log-prob of the emitted token at temperature ``T``."""
    processed_logps: torch.Tensor
    """``[B, C]`` fp32: the log-prob it was actually drawn with (normalised over the kept set; == ``logps``
    when not truncating)."""
    kept_sizes: torch.Tensor
    """``[B, C]`` int32: kept-set size ``|S|``; 0 where untruncated (``truncate=False``) or masked out."""
    log_kept_mass: torch.Tensor
    """``[B, C]`` fp32: ``log S`` (<= 0) under the sampler's scores; 0 where untruncated or masked out."""
    kept_ids: torch.Tensor | None
    """``[B, C, S_max]`` int64: each token's kept ids in ascending order, ``-1`` padded; all ``-1`` where
    ``|S| > store_ids_max`` or masked out (scorers then use the size). ``S_max`` = the largest stored set
    (at least 1). ``None`` when not truncating. Built on the device without leaving tensors."""
    completion_mask: torch.Tensor | None = None
    """``[B, C]`` int: the mask applied (positions with 0 hold zeros), or ``None`` when none was given."""

    def kept_ids_tensor(self, pad: int = -1) -> torch.Tensor | None:
        """:attr:`kept_ids` with ``pad`` in place of ``-1`` (the form ``core.truncation.kept_reducer`` takes)."""
        if self.kept_ids is None or pad == -1:
            return self.kept_ids
        return self.kept_ids.masked_fill(self.kept_ids < 0, pad)


MODELLED_WARPERS = ("temperature", "top_k", "top_p", "min_p")
"""The HF warpers the recorder applies itself (in HF's order); every other warper is refused."""


def effective_generation_config(model, generation_config: transformers.GenerationConfig | None):
    """The config ``model.generate(generation_config=...)`` really runs with (a copy; the inputs are untouched).

    transformers fills every ``None`` field from ``model.generation_config`` and then from its global defaults
    (``GenerationMixin._prepare_generation_config``), so e.g. TRL's ``min_p=None`` becomes the model's ``min_p``.
    """
    prepare = getattr(model, "_prepare_generation_config", None)
    if prepare is None:  # not a transformers generation model: nothing is merged in
        return copy.deepcopy(generation_config) if generation_config is not None else transformers.GenerationConfig()
    return prepare(copy.deepcopy(generation_config))[0]


def hf_warpers(config: transformers.GenerationConfig) -> dict:
    """``{field: value}`` of the warpers HF ``generate`` applies after all logits processors (transformers 5.x
    ``_get_logits_processor``, in its order), for an effective config; empty when not sampling. ``min_p = 0`` is
    a no-op and not listed."""
    if config.do_sample is not True:
        return {}
    found = {}
    if config.temperature is not None and config.temperature != 1.0:
        found["temperature"] = config.temperature
    if getattr(config, "top_h", None) is not None:
        found["top_h"] = config.top_h
    if config.top_k is not None and config.top_k != 0:
        found["top_k"] = config.top_k
    if config.top_p is not None and config.top_p < 1.0:
        found["top_p"] = config.top_p
    if config.min_p is not None and config.min_p > 0.0:
        found["min_p"] = config.min_p
    if getattr(config, "typical_p", None) is not None and config.typical_p < 1.0:
        found["typical_p"] = config.typical_p
    for name in ("epsilon_cutoff", "eta_cutoff"):
        value = getattr(config, name, None)
        if value is not None and 0.0 < value < 1.0:
            found[name] = value
    if getattr(config, "watermarking_config", None) is not None:
        found["watermarking_config"] = config.watermarking_config
    return found


def sampler_settings(config: transformers.GenerationConfig) -> dict:
    """``{temperature, top_k, top_p, min_p}`` HF samples with under an effective config (off values when unset).

    Raises ``ValueError`` naming every warper the recorder does not model (typical_p, epsilon_cutoff,
    eta_cutoff, top_h, watermarking): it would run after the recorder and change the draw.
    """
    warpers = hf_warpers(config)
    unmodelled = {k: v for k, v in warpers.items() if k not in MODELLED_WARPERS}
    if unmodelled:
        raise ValueError(
            "the generation config (TRL's, with None fields filled from the model's generation_config) uses HF "
            "warpers the sampler recorder does not model: " + ", ".join(f"{k}={v}" for k, v in unmodelled.items())
        )
    return {
        "temperature": float(warpers.get("temperature", 1.0)),
        "top_k": int(warpers.get("top_k", 0)),
        "top_p": float(warpers.get("top_p", 1.0)),
        "min_p": float(warpers.get("min_p", 0.0)),
    }


def unsupported_generation_mode(config: transformers.GenerationConfig) -> str | None:
    """Why the recorder cannot model this config's generation mode (beam search, greedy, assisted, constrained,
    contrastive, ...), or ``None`` for plain multinomial sampling, the only mode it records."""
    mode = config.get_generation_mode()
    if mode == transformers.generation.GenerationMode.SAMPLE:
        return None
    return f"generation mode {mode.value!r} (do_sample={config.do_sample}, num_beams={config.num_beams})"


def check_neutral_generation_config(generation_config: transformers.GenerationConfig) -> None:
    """Raise ``ValueError`` if HF's own warpers would run after the recorder (they would change the draw).

    Pass the effective config (:func:`effective_generation_config`): fields left ``None`` are filled from the
    model's generation_config by ``generate``.
    """
    problems = [f"{k}={v}" for k, v in hf_warpers(generation_config).items()]
    if problems:
        raise ValueError(
            "generation_config still has HF warpers that run after SamplerRecorder: "
            + ", ".join(problems)
            + "; set SamplerRecorder.neutral_generation_kwargs() on the config and give these values to the recorder"
        )


class SamplerRecorder(transformers.LogitsProcessor):
    """Applies temperature (and, if ``truncate``, the kept set in HF's order) and records each emitted token.

    Args:
        temperature: sampling temperature (> 0); the recorder divides the scores by it.
        top_k, top_p, min_p: truncation (``top_k <= 0`` off, ``top_p = 1`` off, ``min_p = 0`` off); used only when
            ``truncate`` is true.
        truncate: apply the truncation here (and record the kept set); ``False`` records temperature only.
        store_ids_max: keep the kept ids of a token when ``|S| <= store_ids_max`` (else only its size).
        order: the truncation order and arithmetic, ``"hf"`` (what ``generate`` would apply; the default) or
            ``"vllm"`` (see :func:`bloggap_plugin.core.truncation.kept_mask`).

    Use: ``model.generate(..., do_sample=True, logits_processor=[recorder], **recorder.neutral_generation_kwargs())``
    after :meth:`reset`, then :meth:`finalize` with the returned sequences.
    """

    def __init__(
        self,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        truncate: bool = False,
        store_ids_max: int = 64,
        order: str = "hf",
    ) -> None:
        validate_sampling(temperature, top_k, top_p, min_p)
        if order not in ORDERS:
            raise ValueError(f"order must be 'hf' or 'vllm', got {order!r}")
        if store_ids_max < 0:
            raise ValueError(f"store_ids_max must be >= 0, got {store_ids_max}")
        self.temperature = float(temperature)
        self.top_k = int(top_k)
        self.top_p = float(top_p)
        self.min_p = float(min_p)
        self.truncate = bool(truncate)
        self.store_ids_max = int(store_ids_max)
        self.order = order
        self.reset()

    @staticmethod
    def neutral_generation_kwargs() -> dict:
        """``generate`` kwargs that switch every HF warper off explicitly (a ``None`` would be filled from the
        model's generation_config). ``top_h`` has no off value but ``None``: check the effective config."""
        return {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0,
                "eta_cutoff": 0.0}

    def settings(self) -> dict:
        """``{temperature, top_k, top_p, min_p}`` this recorder samples with (as :func:`sampler_settings`)."""
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p}

    def reset(self) -> None:
        """Forget everything recorded; call before each ``generate``."""
        self._width: int | None = None
        self._batch: int | None = None
        self._prev_full: torch.Tensor | None = None
        self._prev_processed: torch.Tensor | None = None
        self._tokens: list[torch.Tensor] = []
        self._logps: list[torch.Tensor] = []
        self._processed: list[torch.Tensor] = []
        self._sizes: list[torch.Tensor] = []
        self._log_mass: list[torch.Tensor] = []
        self._ids: list[torch.Tensor] = []
        self._steps = 0

    def _emit(self, tokens: torch.Tensor) -> None:
        """Record the previous step's token (``[B]``) from the stored rows, then drop them."""
        index = tokens.long().unsqueeze(-1)
        self._tokens.append(tokens)
        self._logps.append(self._prev_full.gather(-1, index).squeeze(-1))
        processed = self._prev_full if self._prev_processed is None else self._prev_processed
        self._processed.append(processed.gather(-1, index).squeeze(-1))
        self._prev_full = self._prev_processed = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        batch, width = input_ids.shape
        if self._width is not None and (width != self._width + 1 or batch != self._batch):
            raise RuntimeError(
                f"SamplerRecorder saw input width {width} (batch {batch}) after {self._width} (batch {self._batch}): "
                "call reset() before every generate(), and do not use beam search or assisted decoding with it"
            )
        if self._prev_full is not None:
            self._emit(input_ids[:, -1])
        self._width, self._batch = width, batch
        scaled = scores.float()
        if self.temperature != 1.0:
            scaled = scaled / self.temperature
        self._prev_full = torch.log_softmax(scaled, dim=-1)
        if self.truncate:
            kept = kept_mask(scaled, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, order=self.order)
            processed = scaled.masked_fill(~kept, float("-inf"))
            self._prev_processed = torch.log_softmax(processed, dim=-1)
            sizes = kept.sum(-1)
            self._sizes.append(sizes.to(torch.int32))
            self._log_mass.append(
                torch.logsumexp(self._prev_full.masked_fill(~kept, float("-inf")), dim=-1).clamp(max=0.0)
            )
            if self.store_ids_max > 0:
                vocab = scaled.shape[-1]
                width_ids = min(self.store_ids_max, vocab)
                # key V - id on kept tokens, 0 elsewhere: the top |S| keys are the kept ids in ascending order
                key = torch.where(kept, vocab - torch.arange(vocab, device=kept.device, dtype=torch.int32), 0)
                ids = torch.topk(key, width_ids, dim=-1).indices.to(torch.int32)
                rank = torch.arange(width_ids, device=ids.device)
                self._ids.append(torch.where(rank < sizes.unsqueeze(-1), ids, -1))
        else:
            processed = scaled
        self._steps += 1
        return processed.to(scores.dtype)

    def finalize(
        self,
        sequences: torch.Tensor,
        prompt_width: int,
        completion_mask: torch.Tensor | None = None,
        eos_token_id: int | list[int] | None = None,
    ) -> SamplerRecord:
        """Assemble the record for ``sequences`` ``[B, P + C]`` (``P = prompt_width``, as returned by ``generate``).

        Positions where ``completion_mask`` is 0 (or, if only ``eos_token_id`` is given, positions after the
        first EOS, TRL's rule) are zeroed: HF pads finished rows with a token the sampler may give probability
        0. Without either, a padded token outside the kept set raises with this advice.
        """
        if self._prev_full is None:
            raise SamplerRecordError(
                "SamplerRecorder recorded nothing: pass it to generate(logits_processor=[...]) first"
            )
        completion = sequences[:, prompt_width:]
        n_rows, width = completion.shape
        if width != self._steps or n_rows != self._batch:
            raise SamplerRecordError(
                f"sequences have {width} completion tokens x {n_rows} rows after prompt_width={prompt_width}, but the "
                f"recorder saw {self._steps} steps x {self._batch} rows; prompt_width must be the padded prompt width "
                "and reset() must be called before each generate()"
            )
        if self._tokens:
            seen = torch.stack(self._tokens, dim=1)
            if not torch.equal(seen.to(completion.device), completion[:, : width - 1]):
                raise SamplerRecordError(
                    "the tokens the recorder saw differ from sequences[:, prompt_width:]; wrong prompt_width?"
                )
        # the last token was never fed back: read it from the sequences (without consuming the stored rows)
        last = completion[:, -1].to(self._prev_full.device).long().unsqueeze(-1)
        last_processed = self._prev_full if self._prev_processed is None else self._prev_processed
        logps = torch.stack(self._logps + [self._prev_full.gather(-1, last).squeeze(-1)], dim=1)
        processed = torch.stack(self._processed + [last_processed.gather(-1, last).squeeze(-1)], dim=1)
        if self.truncate:
            sizes = torch.stack(self._sizes, dim=1)
            log_mass = torch.stack(self._log_mass, dim=1)
        else:
            sizes = torch.zeros_like(logps, dtype=torch.int32)
            log_mass = torch.zeros_like(logps)
        if completion_mask is None and eos_token_id is not None:
            completion_mask = _mask_after_eos(completion, eos_token_id)
        ids_tensor = torch.stack(self._ids, dim=1) if (self.truncate and self._ids) else None
        if completion_mask is not None:
            if completion_mask.shape != logps.shape:
                raise ValueError(f"completion_mask {tuple(completion_mask.shape)} must be [B, C] = {tuple(logps.shape)}")
            keep = completion_mask.to(logps.device).bool()
            logps, processed = logps.masked_fill(~keep, 0.0), processed.masked_fill(~keep, 0.0)
            sizes, log_mass = sizes.masked_fill(~keep, 0), log_mass.masked_fill(~keep, 0.0)
            if ids_tensor is not None:
                ids_tensor = ids_tensor.masked_fill(~keep.unsqueeze(-1), -1)
        bad = ~torch.isfinite(processed)
        if bad.any():
            raise ValueError(
                f"{int(bad.sum())} emitted tokens have probability 0 under the recorded sampler (padding after EOS): "
                "pass completion_mask= or eos_token_id= to finalize()"
            )
        kept_ids = _sorted_kept_ids(ids_tensor, sizes, self.store_ids_max) if self.truncate else None
        return SamplerRecord(logps, processed, sizes, log_mass, kept_ids, completion_mask)


def _mask_after_eos(completion: torch.Tensor, eos_token_id: int | list[int]) -> torch.Tensor:
    """1 up to and including the first EOS of each row, 0 after (TRL's completion mask). ``[B, C]`` int."""
    eos = torch.as_tensor(eos_token_id, device=completion.device).reshape(-1)
    is_eos = torch.isin(completion, eos)
    after = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return (~after).long()


def _sorted_kept_ids(ids: torch.Tensor | None, sizes: torch.Tensor, store_ids_max: int) -> torch.Tensor:
    """``[B, C, S_max]`` int64 ascending kept ids, ``-1`` padded, from the recorded ``[B, C, W]`` ids (ascending
    in the first ``|S|`` columns); all ``-1`` where ``|S| > store_ids_max`` or ``|S| = 0``. One host sync."""
    n_rows, width = sizes.shape
    stored = (sizes > 0) & (sizes <= store_ids_max)
    s_max = max(int(sizes.masked_fill(~stored, 0).max()), 1) if sizes.numel() else 1
    if ids is None:  # store_ids_max == 0: sizes only
        return torch.full((n_rows, width, 1), -1, dtype=torch.long, device=sizes.device)
    # W = min(store_ids_max, V) >= s_max; a token with |S| > store_ids_max has W valid ids: unknown, all -1
    return ids[..., :s_max].masked_fill(~stored.unsqueeze(-1), -1).long()
