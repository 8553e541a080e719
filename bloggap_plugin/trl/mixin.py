"""GapMixin: the one implementation of the plugin inside TRL's GRPOTrainer (1.16.x, fused-LM-head path).

Hooks (TRL 1.16's ``GRPOTrainer`` methods, see ``docs/trl.md``):

- ``_generate_single_turn``: timed (``gap/time/generate_s``, the sampler's seconds); HF ``generate`` runs with :class:`~bloggap_plugin.sampling.SamplerRecorder` as the
  last logits processor (TRL's temperature/top_p/top_k/min_p handed to it), which records the sampler's
  log-prob and kept set of every emitted token;
- ``_generate_and_score_completions``: after TRL, adds the sampler record, probe rows, the fp32 batch-1
  reference of those rows, and the arm's old log-probs (replacing TRL's where TRL computes them, or with
  ``gap.force_old_logprobs``) to the batch under ``gap_*`` keys that TRL's shuffle/split carry along and its
  loss never reads;
- ``_prepare_inputs``: an arm that scores after the shuffle (G) scores every buffered micro-batch, in place of
  TRL's own old-logprob pass (skipped: a NaN placeholder stands in until G's scores are installed; on the vLLM
  path the IS ratio is recomputed per micro-batch and TRL's ``sampling/*`` statistics from G's scores);
  generation-time metrics are reduced and logged;
- ``_get_per_token_logps_and_entropies``: position ids from the mask (``gap.positions: mask``, arms B-G),
  kept-set renormalisation (``gap.kept: renormalize``, a non-fused forward), and a stash of the training
  forward's log-probs;
- ``_compute_loss``: HF-path IS correction (``gap.is_correction``) and the loss-time metrics;
- ``training_step``: plugin time and its share of the step.

Each hook passes evaluation and unattached calls straight to TRL and hands the rest to the adapter's one object,
``trainer._gap_session`` (:class:`~bloggap_plugin.trl.session.GapSession`: the state, the scoring, the metrics);
the checks at attach time live in :mod:`bloggap_plugin.trl.attach`. Every extra forward runs under ``torch.no_grad`` inside
``torch.random.fork_rng`` and probe rows come from a private generator, so with arm A the trainer's RNG streams
and losses are exactly those of plain TRL.
"""

from __future__ import annotations

import types

from bloggap_plugin.recipes import GapConfig
from bloggap_plugin.trl.attach import KNOWN_LOSS_TYPES, attach_state
from bloggap_plugin.trl.session import GapSession
from bloggap_plugin.trl.stats import is_ratio

__all__ = ["GapMixin", "HOOKED_METHODS", "BATCH_KEYS", "KNOWN_LOSS_TYPES", "is_ratio"]

HOOKED_METHODS = (
    "_generate_single_turn",
    "_generate_and_score_completions",
    "_prepare_inputs",
    "_get_per_token_logps_and_entropies",
    "_compute_loss",
    "training_step",
)
# Keys the plugin adds to TRL's batch dict (permuted and split with it; TRL's loss never reads them).
BATCH_KEYS = (
    "gap_old_logps",
    "gap_trl_old_logps",
    "gap_sampler_logps",
    "gap_sampler_full_logps",
    "gap_kept_sizes",
    "gap_kept_ids",
    "gap_sampler_log_kept_mass",
    "gap_probe_row",
    "gap_ref_logps",
    "gap_is_ratio",
    "gap_host_mask",
)


class GapMixin:
    """Mix into ``GRPOTrainer`` (before it in the MRO) or install on an instance with :class:`GapCallback`.

    Thin overrides of TRL's hooks: each calls ``self._gap_session`` when attached (and training, where the hook
    only acts in training), else the next implementation."""

    def _gap_next(self, name: str, *args, **kwargs):
        """Call the next implementation of ``name``: the instance's original (callback) or the MRO's."""
        originals = self.__dict__.get("_gap_originals")
        if originals and name in originals:
            return originals[name](*args, **kwargs)
        return getattr(super(GapMixin, self), name)(*args, **kwargs)  # noqa: UP008 (explicit: also read in callback mode)

    def _gap_attach(self, gap: GapConfig, grpo_kwargs: dict | None = None, source: str = "gap config") -> None:
        """Validate ``gap`` against this trainer and set up its session (``self._gap_session``)."""
        state = attach_state(self, gap, grpo_kwargs, source)
        self._gap_session = GapSession(self, state)
        if state.settings.kept_source == "sampling_mask":
            from bloggap_plugin.trl.kept_source import capture_sampling_masks

            capture_sampling_masks(self, state)  # vLLM's own kept sets, kept per generation
        if gap.takes_pieces:
            from bloggap_plugin.trl.vllm_colocate import confine_batch_invariance

            confine_batch_invariance(self)  # the trainer's own passes at plain speed (arms I, J)

    def _gap_active(self) -> bool:
        """Attached and training (the hooks pass evaluation and unattached calls straight to TRL)."""
        return getattr(self, "_gap_session", None) is not None and self.model.training

    def _gap_close(self) -> None:
        """Close the session's plans (at the end of training)."""
        self._gap_session.close()

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if not self._gap_active():
            return self._gap_next(
                "_generate_single_turn", prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        return self._gap_session.generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                      has_tool_images)

    def _generate_and_score_completions(self, inputs):
        session = getattr(self, "_gap_session", None)
        if session is None:
            return self._gap_next("_generate_and_score_completions", inputs)
        return session.generate_and_score_completions(inputs)

    def _prepare_inputs(self, generation_batch):
        if not self._gap_active():
            return self._gap_next("_prepare_inputs", generation_batch)
        return self._gap_session.prepare_inputs(generation_batch)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **kwargs):
        session = getattr(self, "_gap_session", None)
        if session is None:
            return self._gap_next("_get_per_token_logps_and_entropies", model, input_ids, attention_mask,
                                  logits_to_keep, batch_size, compute_entropy, compute_aux_loss, **kwargs)
        return session.per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, batch_size,
                                                     compute_entropy, compute_aux_loss, **kwargs)

    def _compute_loss(self, model, inputs):
        if not self._gap_active():
            return self._gap_next("_compute_loss", model, inputs)
        return self._gap_session.compute_loss(model, inputs)

    def training_step(self, *args, **kwargs):
        session = getattr(self, "_gap_session", None)
        if session is None:
            return self._gap_next("training_step", *args, **kwargs)
        return session.training_step(*args, **kwargs)


def _helper_names() -> list[str]:
    """The ``_gap_*`` methods of GapMixin (bound onto an instance by :func:`install`)."""
    names = []
    for cls in GapMixin.__mro__:
        if cls is object:
            continue
        names += [name for name, fn in vars(cls).items() if name.startswith("_gap_") and callable(fn)]
    return list(dict.fromkeys(names))


def install(trainer, gap: GapConfig, grpo_kwargs: dict | None = None, source: str = "gap config") -> None:
    """Install :class:`GapMixin`'s hooks on an existing trainer instance (what :class:`GapCallback` does)."""
    if isinstance(trainer, GapMixin) or "_gap_originals" in trainer.__dict__:
        raise RuntimeError("bloggap is already attached to this trainer (GapGRPOTrainer or an earlier GapCallback)")
    trainer._gap_originals = {name: getattr(trainer, name) for name in HOOKED_METHODS}
    for name in _helper_names():
        setattr(trainer, name, types.MethodType(getattr(GapMixin, name), trainer))
    try:
        trainer._gap_attach(gap, grpo_kwargs, source)
    except Exception:
        for name in [n for n in list(trainer.__dict__) if n.startswith("_gap")]:
            delattr(trainer, name)
        raise
    for name in HOOKED_METHODS:
        setattr(trainer, name, types.MethodType(getattr(GapMixin, name), trainer))
