"""Recipe files: TRL ``GRPOConfig`` fields plus a ``gap:`` section, loaded, validated and merged.

A recipe is YAML in TRL's config style::

    num_iterations: 2          # any GRPOConfig field
    learning_rate: 1.0e-6
    gap:                       # the plugin's section (GapConfig)
      arm: F
      band: 0.1

``load_recipe(path) -> (grpo_kwargs, gap)`` rejects unknown keys (naming the key, suggesting the closest
valid one and listing all of them), wrong types and bad values. Layer ids are checked against a model with
:meth:`GapConfig.check_layers` when the plugin attaches to a trainer.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bloggap_plugin.core.arms import ARM_LETTERS, ArmSpec, get_arm
from bloggap_plugin.core.arms import ARMS as ARM_RECORDS
from bloggap_plugin.core.errors import UsageError, short_repr

if TYPE_CHECKING:
    from bloggap_plugin.core.vllm.form import VllmForm

__all__ = [
    "GapConfig",
    "RecipeError",
    "load_recipe",
    "parse_recipe",
    "gap_config_from_dict",
    "merge_grpo_config",
    "check_grpo_values",
    "config_differences",
    "gap_field_table",
    "GAP_FIELD_TABLE_MARKERS",
    "ARMS",
]

ARMS = ARM_LETTERS  # the letters A..J, in order (records: bloggap_plugin.core.arms.ARMS)
KEPT_MODES = ("renormalize", "measure", "off")
KEPT_SOURCES = ("auto", "sampling_mask", "retruncate")
"""``gap.kept_source`` values (``auto`` and ``retruncate`` are verl's words too: ``bloggap.kept_source``)."""
POSITION_MODES = ("mask", "arange")
REFERENCES = ("fp32_b1",)
VLLM_LAUNCHES = ("auto", "eager", "decode_graphs")
"""``gap.vllm_launch`` values: ``auto`` (:data:`AUTO_VLLM_LAUNCH` for an arm whose engine runs vLLM's eager kernels,
nothing for any other arm) and the launches of bloggap_plugin.trl.vllm_colocate.VLLM_LAUNCH_SETTINGS (the engine
settings of each)."""
AUTO_VLLM_LAUNCH = "decode_graphs"
"""The launch ``gap.vllm_launch: auto`` (the default) gives an arm whose engine runs vLLM's eager kernels (I, J)."""


def _runs_vllm_eager_kernels(spec: ArmSpec) -> bool:
    """Whether ``spec``'s engine runs vLLM's eager kernels (its :attr:`~ArmSpec.vllm_engine` has ``enforce_eager``:
    arms I and J), the arms ``gap.vllm_launch`` applies to."""
    return bool(dict(spec.vllm_engine).get("enforce_eager"))


def _plan_takes_pieces(spec: ArmSpec) -> bool:
    """Whether ``spec``'s plan takes ``pieces=`` (its registry entry, :class:`~bloggap_plugin.core.plans.PlanEntry`)."""
    from bloggap_plugin.core.plans import arm_plan_entry

    entry = arm_plan_entry(spec)
    return entry is not None and entry.takes_pieces


class RecipeError(UsageError):
    """A recipe (or GapConfig) names an unknown key, has a wrong type, or an invalid value."""


def _help(text: str) -> dict:
    return {"help": " ".join(text.split())}


@dataclass
class GapConfig:
    """The plugin's settings: the ``gap:`` section of a recipe. Each field's ``metadata["help"]`` says what it
    does; its annotation is the type a recipe must give (checked by :func:`gap_config_from_dict`)."""

    arm: str = field(default="A", metadata=_help(
        """Old-logprob arm, one of A-J (bloggap_plugin.core.arms; aliases bf16=C, fp32=B, fp16=F, fp32_head=E, guided=D,
        matched=G, default=A, vllm=I, onpolicy=J). A and H keep TRL's own old log-probs; B-F score them with a precision
        plan; G scores each training micro-batch exactly as the training forward will see it; I scores them the way
        vLLM computes (``i_pieces``); J scores them as I does and computes the training forward the same way."""))
    band: float = field(default=0.1, metadata=_help(
        """Half-width ``b`` of the ratio band: a token is out of band when ``exp(dlogp)`` is outside
        ``[1-b, 1+b]``."""))
    probe_rows: int = field(default=4, metadata=_help(
        """Rows per generation (per process) scored by the fp32 batch-1 reference (clip flips) and the live
        batch-shape probe; chosen with a private generator, so the trainer's RNG is untouched. 0 disables both."""))
    layers: list[int] | None = field(default=None, metadata=_help(
        """Arm D: decoder-layer ids to run in fp32; ``None`` lets the precision plan choose (guided, top ``k``)."""))
    k: int = field(default=8, metadata=_help(
        """Arm D: number of layers the guided plan upcasts when ``layers`` is not given (the default 8 is capped at
        the model's layers, with a warning; a larger explicit value is refused)."""))
    positions: str = field(default="mask", metadata=_help(
        """Position ids of the plugin's scoring and, for arms B-G, of the training forward too: ``mask`` (as HF
        ``generate`` uses: cumsum of the attention mask) or ``arange`` (0..L-1, TRL's own scoring). Arms A and H
        keep TRL's forward untouched, so their scoring uses ``arange`` whatever this says."""))
    force_old_logprobs: bool = field(default=False, metadata=_help(
        """When TRL would not compute old log-probs (ratio identically 1: num_iterations 1 and
        steps_per_generation dividing gradient_accumulation_steps), still put the arm's old log-probs into the
        loss. Default: measure only, training unchanged."""))
    kept: str = field(default="measure", metadata=_help(
        """Truncated sampling (top_p/top_k/min_p): ``renormalize`` the trainer's log-probs over the sampler's
        kept set in the old, the training and (``beta > 0``) TRL's reference pass; ``measure`` only logs kept
        mass and ratios (one extra scoring per generation); ``off`` records no kept sets and adds no forward.
        ``renormalize`` needs the sampler recording (``sampler: true``) as kept-set source."""))
    kept_source: str = field(default="auto", metadata=_help(
        """Where TRL's vLLM path takes the kept sets from (``gap.kept`` measure or renormalize with truncated
        sampling): ``sampling_mask`` the ids vLLM sampled from (``return_sampling_mask``: vLLM >= 0.28, colocate,
        model runner V2, ``top_k > 0``, temperature > 0, tensor_parallel_size 1; refused at attach naming what is
        missing); ``retruncate`` the trainer re-applies top_k/top_p/min_p to its own logits (approximate at the
        boundary); ``auto`` the mask where all of that holds, else re-truncation (a warning says why). HF
        generate's kept sets are always the recorder's own."""))
    sampler: bool = field(default=True, metadata=_help(
        """Record the HF ``generate`` sampler's log-prob of every emitted token (and its kept set), so
        ``gap/sampler/*`` and ``gap/kept/*`` exist without vLLM. Sampling then runs through the plugin's logits
        processor (same temperature and truncation, vLLM's order)."""))
    store_ids_max: int = field(default=64, metadata=_help(
        """Kept sets up to this size are stored as ids (exact renormalisation); larger ones as sizes only
        (top-|S|)."""))
    score_chunk_tokens: int = field(default=256, metadata=_help(
        """Memory bound of the plugin's scoring (old log-probs, kept mass, probes, renormalised forwards): the LM
        head, fp32 cast and log-softmax run in tiles of about this many scored tokens (rows x completion
        positions; at least one position per tile), so the largest vocabulary-wide tensor is ``tile x V`` fp32
        instead of ``rows x completion_length x V`` (docs/precision.md, "Memory", works out both sizes). 0
        scores each chunk of rows untiled. Default: ``core.scoring.DEFAULT_CHUNK_TOKENS``."""))
    score_rows: int = field(default=0, metadata=_help(
        """Rows per forward of the arm's own old-logprob scoring (arms B-F); 0 = the micro-batch, as TRL scores.
        An fp32 body (arms B, D) holds fp32 activations, twice TRL's bf16 ones: on models whose MLP activations
        dominate the pass (e.g. Qwen2.5-1.5B's shape) half the micro-batch keeps the pass within TRL's peak.
        Arm I with 0 scores as many rows per forward as ``core.plans.vllm_shadow.TOKENS_PER_FORWARD`` holds (its forward is
        batch-invariant: fewer, larger forwards, same numbers). Not for arm G, which scores each training
        micro-batch whole."""))
    is_correction: bool = field(default=False, metadata=_help(
        """HF path: multiply the per-token loss by TRL's importance-sampling ratio between the old log-probs and
        the recorded sampler log-probs, with the trainer's ``vllm_importance_sampling_mode`` and
        ``vllm_importance_sampling_clip_min/clip_max`` semantics (TRL only does this with vLLM)."""))
    reference: str = field(default="fp32_b1", metadata=_help(
        """Reference scoring for clip flips: ``fp32_b1`` = an fp32 copy of the policy, one row at a time."""))
    metrics_every: int = field(default=1, metadata=_help(
        """Compute the generation-time metrics (probe, reference, sampler) every N generations; 1 = always."""))
    probe_every: int = field(default=8, metadata=_help(
        """Run the extra forwards (the fp32 batch-1 reference of ``probe_rows`` rows for clip flips, and the live
        batch-1 probe) on every N-th measured generation; 1 = every generation. These extra forwards are most of
        the plugin's cost, so the default amortises them; the probe-free metrics (ratio, sampler, kept mass) are still computed every
        time."""))
    probe_budget: float = field(default=0.005, metadata=_help(
        """Largest share of training time the probe forwards may take (0.005 = 0.5%): a probe that
        ``probe_every`` makes due runs only while the probe's seconds so far are within ``probe_budget`` times the
        training seconds so far (``training_step`` wall time; both summed over processes at the optimizer steps
        before, so every process decides alike). The first due probe always runs. A probe costs about a fixed
        number of batch-1 forwards, so on a small model with short steps the budget spaces probes out and on a
        large one ``probe_every`` decides. 0 = no cap."""))
    tf32: bool | str = field(default=False, metadata=_help(
        """Matmul precision of the fp32 scoring plans (arms B, D, E and the fp16 guard's fp32 re-score): ``true``
        TF32, ``false`` IEEE fp32, ``auto`` TF32 on GPUs with TF32 units (Ampere and later, compute capability >=
        8.0) and IEEE fp32 elsewhere. Set around the plan's own forward only and restored after it; the
        process-wide flag (``GRPOConfig.tf32``) is not read or changed, so the plans compute the same whatever it
        says. TF32 rounds matmul inputs to 10 mantissa bits and runs them on the tensor cores (docs/precision.md:
        its cost, and whether it still removes the batch-shape noise). Arms A, C, G and H have no
        fp32 plan; the fp32 batch-1 reference of the probe rows always computes in IEEE fp32."""))
    i_pieces: str = field(default="all", metadata=_help(
        """Arms I and J: which pieces of the vLLM-form forward (I: old log-probs; J: old log-probs and training)
        follow vLLM: a preset (``all``: every piece with vLLM's own kernels, needs vLLM and CUDA; ``torch``: vLLM's maths in plain torch; ``hf``: HF's maths) then
        ``piece=value`` overrides, e.g. ``torch,attention=vllm_fa`` (docs/arm_i.md lists the pieces)."""))
    vllm_launch: str = field(default="auto", metadata=_help(
        """Arms I and J with vLLM colocate: how the engine the plugin builds launches vLLM's eager kernels (the ones
        arm I computes): ``eager``, one launch per kernel; ``decode_graphs``, no torch.compile and every decode step
        replayed from a full CUDA graph, the same kernels, generating faster; ``auto`` (the default),
        ``decode_graphs`` for arms I and J and nothing for any other arm (TRL's engine untouched). An engine built
        eager is accepted for arms I and J only with ``eager`` set (docs/arm_i.md, tables T16-armI-live and
        T16-armJ-live: each launch measured live)."""))
    matmul_tiles: str | None = field(default=None, metadata=_help(
        """Arms I and J with vLLM colocate: path of a tile table for vLLM's batch-invariant matmul
        (bloggap_plugin.core.vllm.tile_table; ``bloggap tiles --model MODEL --out FILE`` measures one on the GPU that
        will use it, for that model's weight shapes), installed before the colocated
        engine starts, so generation and the arm's own passes launch the same tiles and keep the same bits. A table
        measured on another GPU is refused. ``None``: vLLM's one configuration for every shape (docs/arm_i.md,
        "Matmul tiles by shape and row count"; T27-cost-by-size-tiles measures both)."""))
    strict_version: bool = field(default=True, metadata=_help(
        """Refuse to attach to a TRL outside the supported range (1.16.x); ``False`` downgrades that to a warning
        (missing private methods are always an error)."""))

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`RecipeError` naming the field, the bad value and what is accepted."""
        try:
            spec = get_arm(str(self.arm))
        except ValueError as err:
            raise RecipeError(f"gap.arm: {err}") from None
        self.arm = spec.letter
        if self.kept is False:  # YAML reads an unquoted `kept: off` as false
            self.kept = "off"
        _check_gap_types({name: getattr(self, name) for name in _field_names(GapConfig)}, "gap")
        for name in _field_names(GapConfig):
            value = getattr(self, name)
            if isinstance(value, float) and not math.isfinite(value):
                raise RecipeError(f"gap.{name} must be a finite number, got {value!r}")
        if not 0.0 < float(self.band) < 1.0:
            raise RecipeError(f"gap.band must be in (0, 1), got {self.band}")
        for name, low, what in _GAP_LOWER_BOUNDS:
            if getattr(self, name) < low:
                raise RecipeError(f"gap.{name} must be >= {low}{what}, got {getattr(self, name)}")
        if self.score_rows and spec.scores_after_shuffle:
            raise RecipeError(f"gap.score_rows does not apply to arm {spec.letter}, which scores each training "
                              "micro-batch whole; drop it")
        for name, accepted in (("positions", POSITION_MODES), ("kept", KEPT_MODES), ("kept_source", KEPT_SOURCES),
                               ("reference", REFERENCES)):
            if getattr(self, name) not in accepted:
                raise RecipeError(f"gap.{name} must be one of {', '.join(accepted)}, got {getattr(self, name)!r}")
        if not (self.tf32 is True or self.tf32 is False or self.tf32 == "auto"):
            raise RecipeError(f"gap.tf32 must be true, false or auto, got {self.tf32!r}")
        if self.layers is not None:
            self._validate_layers(spec)
        self._validate_i_pieces(spec)
        self._validate_matmul_tiles(spec)
        if self.vllm_launch not in VLLM_LAUNCHES:
            raise RecipeError(f"gap.vllm_launch must be one of {', '.join(VLLM_LAUNCHES)}, got {self.vllm_launch!r}")
        if self.vllm_launch != "auto" and not _runs_vllm_eager_kernels(spec):
            raise RecipeError(f"gap.vllm_launch only applies to arms I and J (their engine runs vLLM's eager "
                              f"kernels); arm is {self.arm}: drop it")
        if self.kept == "renormalize" and not self.sampler:
            raise RecipeError(
                "gap.kept: renormalize needs a kept-set source: set gap.sampler: true (the HF generate path "
                "records the kept sets), or use gap.kept: measure / off"
            )
        if self.is_correction and not self.sampler:
            raise RecipeError("gap.is_correction needs the sampler's log-probs: set gap.sampler: true")

    def _validate_i_pieces(self, spec: ArmSpec) -> None:
        takes_pieces = _plan_takes_pieces(spec)
        if self.i_pieces != "all" and not takes_pieces:
            raise RecipeError(f"gap.i_pieces only applies to arm I; arm is {self.arm}: drop it (or use arm I or J)")
        if takes_pieces and self.positions != "mask":
            raise RecipeError("arm I scores with vLLM's positions (0.. from each sequence's first token): "
                              "set gap.positions: mask")
        self._parse_i_pieces()

    def _validate_matmul_tiles(self, spec: ArmSpec) -> None:
        if self.matmul_tiles is None:
            return
        if not self.matmul_tiles.strip():
            raise RecipeError("gap.matmul_tiles is empty: give the path of a tile table (bloggap tiles --model MODEL "
                              "--out FILE writes one), or drop it")
        if not (_plan_takes_pieces(spec) and self.i_form.batch_invariant):
            which = (f"arm is {self.arm}" if not _plan_takes_pieces(spec)
                     else f"gap.i_pieces {self.i_pieces!r} turns them off")
            raise RecipeError(f"gap.matmul_tiles only applies to arms I and J with vLLM's batch-invariant matmuls (the "
                              f"table chooses their tiles); {which}: drop it")

    def _parse_i_pieces(self) -> VllmForm:
        """Parse ``i_pieces`` and keep the result with the text it was parsed from (:attr:`i_form`)."""
        from bloggap_plugin.core.vllm.form import parse_form

        try:
            form = parse_form(self.i_pieces)
        except ValueError as err:
            raise RecipeError(f"gap.i_pieces: {err}") from None
        self._i_form = (self.i_pieces, form)
        return form

    @property
    def i_form(self) -> VllmForm:
        """``i_pieces`` parsed (:func:`bloggap_plugin.core.vllm.form.parse_form`): the one parsed value every reader
        of the pieces uses, parsed when the config is validated (again only if ``i_pieces`` is reassigned)."""
        text, form = getattr(self, "_i_form", (None, None))
        return form if text == self.i_pieces and form is not None else self._parse_i_pieces()

    def _validate_layers(self, spec: ArmSpec) -> None:
        if not isinstance(self.layers, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in self.layers
        ):
            raise RecipeError(f"gap.layers must be a list of integer layer ids, got {self.layers!r}")
        if any(i < 0 for i in self.layers):
            raise RecipeError(f"gap.layers ids must be >= 0, got {self.layers}")
        self.layers = list(self.layers)
        if not spec.takes_layers:
            raise RecipeError(f"gap.layers only applies to arm D (guided); arm is {self.arm}")

    def check_layers(self, num_layers: int) -> None:
        """Raise :class:`RecipeError` if a ``layers`` id is not a decoder layer of a ``num_layers``-layer model, or
        (arm D choosing its layers) ``k`` is more layers than it has."""
        if self.layers is None:
            if self.arm_spec.takes_layers and self.k > num_layers:
                default = next(f.default for f in dataclasses.fields(self) if f.name == "k")
                if self.k != default:
                    raise RecipeError(f"gap.k {self.k}: arm D would run {self.k} layers in fp32, and this model has "
                                      f"{num_layers} decoder layers; give k in 1..{num_layers}")
                warnings.warn(f"gap.k {self.k} (the default) is more than this model's {num_layers} decoder layers: "
                              f"arm D runs all {num_layers} in fp32", stacklevel=2)
            return
        bad = [i for i in self.layers if not 0 <= i < num_layers]
        if bad:
            raise RecipeError(
                f"gap.layers: {bad} out of range; this model has {num_layers} decoder layers (valid ids 0..{num_layers - 1})"
            )
        if len(set(self.layers)) != len(self.layers):
            raise RecipeError(f"gap.layers has duplicate ids: {self.layers}")

    @property
    def arm_spec(self) -> ArmSpec:
        """The arm's record (:mod:`bloggap_plugin.core.arms`)."""
        return ARM_RECORDS[self.arm]

    @property
    def resolved_vllm_launch(self) -> str | None:
        """The launch (a key of bloggap_plugin.trl.vllm_colocate.VLLM_LAUNCH_SETTINGS) the arm's engine runs vLLM's
        eager kernels with: ``vllm_launch``, ``auto`` read as :data:`AUTO_VLLM_LAUNCH`; ``None`` for an arm whose
        engine runs no eager kernels (TRL's engine untouched). What the engine settings are built from
        (bloggap_plugin.trl.vllm_colocate.engine_settings_for)."""
        if not _runs_vllm_eager_kernels(self.arm_spec):
            return None
        return AUTO_VLLM_LAUNCH if self.vllm_launch == "auto" else self.vllm_launch

    @property
    def takes_pieces(self) -> bool:
        """The arm's plan computes its forward piece by piece in vLLM's form (its registry entry takes ``pieces=``:
        arms I and J), so :attr:`i_pieces` / :attr:`i_form` apply."""
        return _plan_takes_pieces(self.arm_spec)

    @property
    def plan_arm(self) -> str | None:
        """The precision plan's name for this arm (None: TRL's own forward)."""
        return self.arm_spec.plan

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


GAP_FIELD_TABLE_MARKERS = ("<!-- bloggap:gap-fields:start -->", "<!-- bloggap:gap-fields:end -->")
"""The lines that enclose the generated ``gap:`` field table in docs/trl.md (:func:`gap_field_table`)."""


def gap_field_table(config_class: type = GapConfig) -> list[str]:
    """The Markdown lines of the ``gap:`` field table: one row per field of ``config_class`` (a dataclass; default
    :class:`GapConfig`) with its annotation, its default as a recipe writes it (YAML) and its ``metadata["help"]``.
    A field without a help text raises ``ValueError`` naming it."""
    lines = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for spec in dataclasses.fields(config_class):
        text = spec.metadata.get("help")
        if not text:
            raise ValueError(f"{config_class.__name__}.{spec.name} has no help text: give it "
                             "field(..., metadata={'help': ...}) so the gap: field table documents it")
        default = spec.default_factory() if spec.default is dataclasses.MISSING else spec.default
        cells = [f"`{spec.name}`", f"`{spec.type}`", f"`{_yaml_scalar(default)}`", text]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return lines


def _yaml_scalar(value: Any) -> str:
    """``value`` as a recipe writes it: ``true``/``false``/``null`` for booleans and None, else ``str``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# (field, lowest valid value, what it means): checked after the types
_GAP_LOWER_BOUNDS = (
    ("probe_rows", 0, ""),
    ("k", 1, ""),
    ("metrics_every", 1, ""),
    ("probe_every", 1, ""),
    ("probe_budget", 0, " (a share of training time; 0 = no cap)"),
    ("store_ids_max", 0, ""),
    ("score_chunk_tokens", 0, " (scored tokens per tile of the LM head; 0 = untiled)"),
    ("score_rows", 0, " (rows per scoring forward; 0 = the micro-batch)"),
)


def _runtime_types(hint: Any) -> tuple[type, ...]:
    """The runtime types a recipe value of annotation ``hint`` may have (a ``float`` also takes an ``int``)."""
    import types
    import typing

    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    out: list[type] = []
    for arg in typing.get_args(hint) if union else (hint,):
        kind = typing.get_origin(arg) or arg
        out += [float, int] if kind is float else [kind]
    return tuple(out)


@functools.cache
def _gap_field_types() -> dict[str, tuple[type, ...]]:
    """``{field: accepted runtime types}`` of :class:`GapConfig`, from its annotations (the one type table)."""
    import typing

    return {name: _runtime_types(hint) for name, hint in typing.get_type_hints(GapConfig).items()}


def _field_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def unknown_key_error(key: str, valid: list[str], where: str) -> RecipeError:
    """The error for an unknown ``key`` in ``where``: the closest valid key as a hint, and every valid key."""
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return RecipeError(f"{where}: unknown key {key!r}{hint}; valid keys: {', '.join(sorted(valid))}")


def _check_gap_types(section: dict, where: str) -> None:
    """Reject a ``gap`` value whose type its field's annotation does not take (an ``int`` for a ``float`` is
    taken), naming the key: the one type check of a recipe's ``gap:`` section, ``--gap-overrides`` and
    ``GapConfig(...)``."""
    for key, value in section.items():
        types = _gap_field_types()[key]
        if isinstance(value, bool) and bool not in types:
            raise RecipeError(f"{where}.{key} must be {' or '.join(t.__name__ for t in types)}, got {short_repr(value)}")
        if not isinstance(value, types):
            raise RecipeError(
                f"{where}.{key} must be {' or '.join(t.__name__ for t in types if t is not type(None))}, "
                f"got {type(value).__name__} {short_repr(value)}"
            )


def gap_config_from_dict(section: dict | None, where: str = "gap") -> GapConfig:
    """Build a :class:`GapConfig` from a mapping, rejecting unknown keys and wrong types by name."""
    section = dict(section or {})
    valid = _field_names(GapConfig)
    for key in section:
        if key not in valid:
            raise unknown_key_error(key, valid, where)
    if section.get("kept") is False:  # YAML reads an unquoted `kept: off` as false
        section["kept"] = "off"
    _check_gap_types(section, where)
    if "band" in section:
        section["band"] = float(section["band"])
    return GapConfig(**section)


def replace_gap(gap: GapConfig, overrides: dict, where: str = "--gap-overrides") -> GapConfig:
    """``gap`` with the fields of ``overrides`` replaced and validated; an unknown field is refused naming the
    closest one (as in a recipe)."""
    valid = _field_names(GapConfig)
    for key in overrides:
        if key not in valid:
            raise unknown_key_error(key, valid, where)
    return gap_config_from_dict({**gap.to_dict(), **overrides}, where)


def grpo_field_names() -> list[str] | None:
    """The field names of TRL's ``GRPOConfig``, or ``None`` where TRL does not import."""
    try:
        from trl import GRPOConfig
    except ImportError:  # pragma: no cover - TRL is a dependency; keep recipes loadable without it
        return None
    return _field_names(GRPOConfig)


def _grpo_scalar_types() -> dict[str, tuple[type, bool]]:
    """``{field: (int | float | bool | str, None allowed)}`` for the GRPOConfig fields of one scalar type."""
    import types
    import typing

    from trl import GRPOConfig

    out = {}
    for name, hint in typing.get_type_hints(GRPOConfig).items():
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union else (hint,)
        scalars = [a for a in args if a is not type(None)]
        if len(scalars) == 1 and scalars[0] in (int, float, bool, str):
            out[name] = (scalars[0], type(None) in args)
    return out


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _check_grpo_types(data: dict, where: str) -> dict:
    """Reject recipe values of the wrong type for GRPOConfig's scalar fields (naming the key); a float field given
    as a numeric string (YAML reads ``1e-6`` without a dot as a string) is converted."""
    expected = _grpo_scalar_types()
    out = dict(data)
    for key, value in data.items():
        if key not in expected or (value is None and expected[key][1]):
            continue
        kind = expected[key][0]
        if kind is float and isinstance(value, str):
            try:
                out[key] = float(value)
                continue
            except ValueError:
                pass
        ok = (isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))) or (
            kind is float and isinstance(value, int) and not isinstance(value, bool)
        )
        if not ok:
            raise RecipeError(f"{where}: {key} must be {_TYPE_WORDS[kind]}, got {type(value).__name__} {short_repr(value)}")
    return out


def parse_recipe(data: dict, where: str = "recipe") -> tuple[dict, GapConfig]:
    """Split a recipe mapping into ``(grpo_kwargs, GapConfig)``, validating every key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: a recipe must be a mapping of GRPOConfig fields plus a 'gap:' section")
    data = dict(data)
    gap_section = data.pop("gap", None)
    if gap_section is not None and not isinstance(gap_section, dict):
        raise RecipeError(f"{where}: 'gap' must be a mapping, got {type(gap_section).__name__}")
    valid = grpo_field_names()
    if valid is not None:
        for key in data:
            if key not in valid:
                raise unknown_key_error(key, valid + ["gap"], where)
        data = _check_grpo_types(data, where)
    return data, gap_config_from_dict(gap_section, where=f"{where}: gap")


def _unique_key_loader():
    """A ``yaml.SafeLoader`` that refuses a key given twice in one mapping (plain YAML keeps the last silently)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line + 1)
                except TypeError:  # an unhashable key: let PyYAML report it
                    continue
                if first != key_node.start_mark.line + 1:
                    raise RecipeError(
                        f"key {key!r} appears twice (lines {first} and {key_node.start_mark.line + 1}); "
                        "YAML would keep only the last: merge them into one"
                    )
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def check_recipe_path(path: str | Path) -> None:
    """Raise :class:`RecipeError` unless ``path`` is a regular file, saying what it is instead (missing, a folder,
    a pipe or other special file)."""
    from bloggap_plugin._input_files import display_name

    path = Path(path)
    if path.is_file():
        return
    ships = "(recipes ship in recipes/arm_A.yaml .. arm_J.yaml)"
    if not path.exists():
        raise RecipeError(f"recipe {display_name(path)} does not exist {ships}")
    what = "a folder" if path.is_dir() else "not a regular file (a pipe, socket or device)"
    raise RecipeError(f"recipe {display_name(path)} is {what}; give a recipe YAML file {ships}")


def load_recipe(path: str | Path) -> tuple[dict, GapConfig]:
    """Load a YAML recipe: ``(grpo_kwargs, gap)``. Errors name the file and the offending key.

    Refused: a missing, binary or empty file, invalid YAML, a key given twice in one mapping (e.g. two ``gap:``
    sections), unknown keys and wrong types. A recipe without a ``gap:`` section runs arm A (TRL's own old
    log-probs, metrics only) and says so with a warning.
    """
    from bloggap_plugin._input_files import display_name, load_yaml, read_text_file

    path = Path(path)
    name = display_name(path)
    check_recipe_path(path)
    text = read_text_file(path, f"recipe {name}", "give a YAML recipe such as recipes/arm_A.yaml", RecipeError)
    try:
        data = load_yaml(text, name, _unique_key_loader(), RecipeError)  # bounded size, depth and aliases
    except RecipeError as err:
        raise RecipeError(err if str(err).startswith(name) else f"{name}: {err}") from None
    if data is None or data == {}:
        raise RecipeError(
            f"recipe {path} is empty; give GRPOConfig fields and a 'gap:' section (start from recipes/arm_A.yaml)"
        )
    if isinstance(data, dict) and "gap" not in data:
        warnings.warn(f"recipe {path} has no 'gap:' section: running arm A (TRL's own old log-probs, metrics "
                      "only); add 'gap: {arm: A}' to say so", UserWarning, stacklevel=2)
    return parse_recipe(data, where=str(path))


def merge_grpo_config(grpo_kwargs: dict, base: Any = None, **overrides: Any):
    """A ``GRPOConfig`` from ``base`` (a GRPOConfig, a dict of fields, or None), then the recipe, then ``overrides``."""
    from trl import GRPOConfig

    if base is None:
        merged: dict = {}
    elif isinstance(base, dict):
        merged = dict(base)
    else:
        merged = {}
        for f in dataclasses.fields(GRPOConfig):
            if not f.init:
                continue
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            value = getattr(base, f.name)
            if value != default:
                merged[f.name] = value
        # derived in __post_init__ and mutually exclusive: keep the one the recipe or overrides do not set
        if "generation_batch_size" in merged and "steps_per_generation" in merged:
            keys = set(grpo_kwargs) | set(overrides)
            merged.pop("steps_per_generation" if "generation_batch_size" in keys else "generation_batch_size")
    merged.update(grpo_kwargs)
    merged.update(overrides)
    check_grpo_values(merged)
    try:
        return GRPOConfig(**merged)
    except (ValueError, TypeError) as err:
        message = " ".join(str(err).split())
        match = re.search(r"generation_batch_size \((\d+)\) must be divisible by num_generations \((\d+)\)", message)
        if match:
            batch = int(match.group(1))
            divisors = [d for d in range(2, batch + 1) if batch % d == 0]
            message += (f" Set num_generations to one of {', '.join(map(str, divisors))}, or change "
                        "per_device_train_batch_size / steps_per_generation so that it divides the generation batch.")
        raise RecipeError(f"GRPOConfig rejects these settings: {message}") from err


# (field, lower bound, lower inclusive, upper bound, upper inclusive, what it is): values TRL, transformers or torch
# reject only later (the optimizer at the first step, generate at the first generation) or silently misuse.
_GRPO_RANGES = (
    ("learning_rate", 0, True, None, False, "the optimizer's step size"),
    ("weight_decay", 0, True, None, False, "AdamW's weight decay"),
    ("adam_epsilon", 0, True, None, False, "AdamW's epsilon"),
    ("adam_beta1", 0, True, 1, False, "AdamW's beta1"),
    ("adam_beta2", 0, True, 1, False, "AdamW's beta2"),
    ("temperature", 0, False, None, False, "the sampling temperature"),
    ("top_p", 0, False, 1, True, "nucleus sampling's kept mass"),
    ("min_p", 0, True, 1, True, "min-p sampling's threshold"),
    ("num_iterations", 1, True, None, False, "PPO epochs per generation"),
    ("max_completion_length", 1, True, None, False, "tokens per completion"),
    ("per_device_train_batch_size", 1, True, None, False, "rows per micro-batch"),
    ("gradient_accumulation_steps", 1, True, None, False, "micro-batches per optimizer step"),
    ("num_train_epochs", 0, False, None, False, "passes over the training set"),
    ("warmup_steps", 0, True, None, False, "learning-rate warm-up (steps, or a share of them below 1)"),
    ("warmup_ratio", 0, True, 1, True, "the share of steps warming up"),
    ("max_grad_norm", 0, True, None, False, "the gradient-norm clip (0 = off)"),
    ("label_smoothing_factor", 0, True, 1, False, "label smoothing"),
    ("logging_steps", 0, False, None, False, "steps between logs (a share of the run below 1)"),
    ("save_steps", 0, False, None, False, "steps between checkpoints (a share of the run below 1)"),
    ("eval_steps", 0, False, None, False, "steps between evaluations"),
    ("seed", 0, True, 2**32 - 1, True, "the trainer's seed (numpy's seed range)"),
    ("data_seed", 0, True, 2**32 - 1, True, "the data sampler's seed (numpy's seed range)"),
    ("per_device_eval_batch_size", 1, True, None, False, "rows per evaluation batch"),
    ("dataloader_num_workers", 0, True, None, False, "data-loading processes"),
    ("save_total_limit", 0, True, None, False, "checkpoints kept"),
    ("torch_empty_cache_steps", 1, True, None, False, "steps between CUDA cache releases"),
    ("eval_accumulation_steps", 1, True, None, False, "evaluation steps accumulated"),
    ("num_generations", 2, True, None, False, "completions per prompt (a group needs two to have an advantage)"),
    ("num_generations_eval", 1, True, None, False, "completions per evaluation prompt"),
    ("generation_batch_size", 1, True, None, False, "completions per generation"),
    ("steps_per_generation", 1, True, None, False, "optimizer steps per generation"),
    ("top_k", 0, True, None, False, "top-k sampling's kept tokens (0 = off)"),
    ("repetition_penalty", 0, False, None, False, "the repetition penalty (1 = none)"),
    ("beta", 0, True, None, False, "the KL coefficient (0 = no reference model)"),
    ("epsilon", 0, True, None, False, "the PPO clip's lower half-width"),
    ("epsilon_high", 0, True, None, False, "the PPO clip's upper half-width"),
    ("delta", 0, False, None, False, "two-sided GRPO's upper clip"),
    ("sapo_temperature_neg", 0, False, None, False, "SAPO's temperature for negative advantages"),
    ("sapo_temperature_pos", 0, False, None, False, "SAPO's temperature for positive advantages"),
    ("top_entropy_quantile", 0, True, 1, True, "the share of highest-entropy tokens trained"),
    ("ref_model_mixup_alpha", 0, True, 1, True, "the reference model's mix-up weight"),
    ("ref_model_sync_steps", 1, True, None, False, "steps between reference-model syncs"),
    ("vllm_gpu_memory_utilization", 0, False, 1, True, "vLLM's share of the GPU's memory"),
    ("vllm_tensor_parallel_size", 1, True, None, False, "vLLM's tensor-parallel GPUs"),
    ("vllm_max_model_length", 1, True, None, False, "vLLM's context length"),
    ("vllm_server_timeout", 0, False, None, False, "seconds to wait for the vLLM server"),
    ("vllm_importance_sampling_clip_max", 0, False, None, False, "the IS correction's upper clip"),
    ("vllm_importance_sampling_clip_min", 0, True, None, False, "the IS correction's lower clip"),
    ("vllm_importance_sampling_cap", 0, False, None, False, "the IS correction's cap"),
    ("num_completions_to_print", 0, True, None, False, "completions printed per step"),
    ("max_tool_calling_iterations", 0, True, None, False, "tool-calling rounds per completion"),
)

# GRPOConfig's text fields with a fixed set of values that TRL accepts at construction and fails on (or ignores)
# during training: field -> the values TRL's GRPOTrainer reads (scale_rewards also takes true/false).
_GRPO_CHOICES = {
    "loss_type": ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"),
    "importance_sampling_level": ("token", "sequence"),
    "scale_rewards": ("group", "batch", "none", True, False),
    "multi_objective_aggregation": ("sum_then_normalize", "normalize_then_sum"),
    "vllm_mode": ("server", "colocate"),
    "vllm_model_impl": ("transformers", "vllm"),
    "vllm_importance_sampling_mode": ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate"),
}


@functools.lru_cache(maxsize=1)
def _grpo_float_fields() -> frozenset[str]:
    """GRPOConfig's fields annotated ``float`` (or ``float | None``)."""
    import typing

    from trl import GRPOConfig

    return frozenset(name for name, hint in typing.get_type_hints(GRPOConfig).items()
                     if hint is float or float in typing.get_args(hint))


def check_grpo_values(fields: dict) -> None:
    """Raise :class:`RecipeError` for GRPOConfig values out of their valid range (a negative learning rate, a
    temperature of 0, ...), which TRL accepts at construction and fails on, or silently misuses, during training, and
    for any value that is inf or NaN (``1e400`` and ``.inf`` in YAML, ``inf`` on the command line), on which the
    optimizer would train without an error."""
    numeric = _grpo_float_fields()
    for name, value in fields.items():
        number = value
        if isinstance(value, str) and name in numeric:  # YAML reads 1e400 as text; GRPOConfig turns it into inf
            try:
                number = float(value)
            except ValueError:
                raise RecipeError(f"{name} must be a number, got {value!r}") from None
        if isinstance(number, float) and not math.isfinite(number):
            raise RecipeError(f"{name} = {value!r} is not a finite number; give a finite value")
    for name, accepted in _GRPO_CHOICES.items():
        if name in fields and fields[name] not in accepted:
            raise RecipeError(f"{name} must be one of {', '.join(str(a).lower() for a in accepted)}, got "
                              f"{fields[name]!r}; fix it in the recipe")
    max_steps = fields.get("max_steps")
    if isinstance(max_steps, int) and not isinstance(max_steps, bool) and max_steps != -1 and max_steps < 1:
        raise RecipeError(f"max_steps (optimizer steps) must be >= 1 (or -1: the epochs decide), got {max_steps}")
    for name, low, low_inclusive, high, high_inclusive, what in _GRPO_RANGES:
        value = fields.get(name)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        too_low = value < low if low_inclusive else value <= low
        too_high = high is not None and (value > high if high_inclusive else value >= high)
        if too_low or too_high:
            if high is None:
                valid = f"{'>=' if low_inclusive else '>'} {low}"
            else:
                valid = f"in {'[' if low_inclusive else '('}{low}, {high}{']' if high_inclusive else ')'}"
            raise RecipeError(f"{name} ({what}) must be {valid}, got {value}; fix it in the recipe")


def config_differences(grpo_kwargs: dict, args: Any) -> dict[str, tuple[Any, Any]]:
    """``{field: (recipe value, trainer value)}`` for recipe GRPOConfig fields that differ from ``args``."""
    diffs = {}
    for key, value in grpo_kwargs.items():
        current = getattr(args, key, None)
        if current != value:
            diffs[key] = (value, current)
    return diffs
