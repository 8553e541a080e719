"""The ``gap/*`` metric registry: one :class:`MetricSpec` per logged key and adapter (TRL's trainer, verl's loss).

The adapters log only registered names (:func:`registered`), the metric tables of ``docs/trl.md`` and
``docs/verl.md`` are rendered from here (:func:`metric_table`, written by ``bloggap report``), and tests read
the names they expect from here.

The ratio new/old is split by what lies between the two passes:

- ``gap/ratio/*``: passes with no optimizer step since the old log-probs were computed (each generation's first
  iteration in TRL, every pass with ``num_iterations`` 1 and one optimizer step per generation; verl's first
  mini-batch). There the ratio should be exactly 1: this is the numerical gap.
- ``gap/update/*``: the same statistics on passes after an optimizer step (TRL's later iterations or later
  micro-batches of one generation, verl's later mini-batches and epochs): the policy update, PPO working.

The clip statistics are split the same way: ``gap/clip/*`` on passes with no optimizer step since the old log-probs,
``gap/update_clip/*`` on passes after one (where clipping is mostly PPO's own, the update moved the ratio).

Pure Python: no torch, no TRL, no verl.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MetricSpec", "METRIC_SPECS", "FRAMEWORKS", "NEEDS", "specs", "names", "registered", "ratio_name",
           "clip_name", "metric_table", "metric_table_markers"]

FRAMEWORKS = ("trl", "verl")
NEEDS = {
    "update": "an optimizer step since the old log-probs were computed",
    "clip": "a loss type with a hard clip (not sapo, vespo)",
    "probe": "a generation with probe rows (`gap.probe_rows`, `probe_every`)",
    "sampler": "the sampler's log-probs (HF generate recorded by the plugin, or vLLM's)",
    "vllm": "TRL's vLLM path with its importance-sampling correction",
    "truncation": "truncated sampling with kept sets (TRL: `gap.kept` measure or renormalize)",
    "trl_old": "TRL computed its own old log-probs and the arm replaced them",
    "replaced_pass": "an arm whose pass replaces TRL's old-logprob pass (G, I)",
    "correction": "verl's rollout correction",
}
"""The conditions a metric needs to be logged (a spec's ``needs``), and what each means."""


@dataclass(frozen=True)
class MetricSpec:
    """One logged key of one adapter: its name, unit, definition and when it is logged."""

    name: str
    """The full key, ``gap/<group>/<statistic>``."""
    framework: str
    """``trl`` (GapGRPOTrainer / GapCallback) or ``verl`` (``gap_vanilla`` and the rollout-correction hooks)."""
    unit: str
    """``fraction`` (of tokens or rows, in [0, 1]), ``nats``, ``ratio``, ``tokens``, ``count``, ``seconds``, ``code``."""
    definition: str
    logged: str
    """When a value is appended (per micro-batch, per generation, per optimizer step ...)."""
    needs: frozenset = frozenset()
    """Keys of :data:`NEEDS`: the conditions under which it is logged at all."""


def _ratio_specs(group: str, framework: str, logged: str, needs: frozenset) -> list[MetricSpec]:
    """``gap/ratio/*`` (``group`` ratio) or ``gap/update/*`` (``group`` update) of one adapter."""
    what = ("the numerical gap: no optimizer step lies between old and new, so the ratio should be 1"
            if group == "ratio" else "the policy update: an optimizer step lies between old and new (PPO working)")
    old = ("old = what reaches the loss, or the arm's values in measure-only mode" if framework == "trl"
           else "old = verl's `old_log_prob`")
    out = [
        MetricSpec(f"gap/{group}/oob_frac", framework, "fraction",
                   f"share of completion tokens with `exp(new - old)` outside `[1-band, 1+band]`, non-finite counted "
                   f"out ({old}); {what}", logged, needs),
        MetricSpec(f"gap/{group}/abs_dlogp_mean", framework, "nats", "mean `|new - old|` over completion tokens",
                   logged, needs),
        MetricSpec(f"gap/{group}/abs_dlogp_max", framework, "nats",
                   "largest `|new - old|` of a micro-batch (averaged over the logging window like TRL's clip maxima)"
                   if framework == "trl" else "largest `|new - old|` of a micro-batch", logged, needs),
    ]
    if framework == "trl":
        out.append(MetricSpec(f"gap/{group}/exact_frac", framework, "fraction",
                              "share of completion tokens with `new == old` bit for bit", logged, needs))
    return out


def _clip_specs(group: str, framework: str, logged: str, needs: frozenset) -> list[MetricSpec]:
    """``gap/clip/*`` (``group`` clip: no optimizer step since the old log-probs) or ``gap/update_clip/*`` (``group``
    update_clip: after one) of one adapter."""
    if framework == "trl":
        return [
            MetricSpec(f"gap/{group}/clipped_frac", framework, "fraction",
                       "share of tokens clipped by TRL's rule for the trainer's `loss_type`, `importance_sampling_level` "
                       "and `delta` under the arm (see Supported combinations)", logged, needs),
            MetricSpec(f"gap/{group}/flip_frac", framework, "fraction",
                       "share of probe-row tokens whose clip status differs between the arm's old log-probs and an fp32 "
                       "batch-1 reference", logged + ", holding probe rows", needs | _set("probe")),
        ]
    return [
        MetricSpec(f"gap/{group}/flip_frac", framework, "fraction",
                   "share of tokens whose PPO clip status (A>0 and r>1+eps_high, or A<0 and r<1-eps_low) differs from "
                   "the status at ratio 1 (never clipped)", logged, needs),
        MetricSpec(f"gap/{group}/clipped_frac", framework, "fraction", "share of tokens clipped (same rule)", logged,
                   needs),
    ]


_TRL_FIRST = "per training micro-batch with no optimizer step since its generation's old log-probs"
_TRL_LATER = "per training micro-batch after an optimizer step since its generation's old log-probs"
_TRL_LOSS = "per training micro-batch"
_TRL_GEN = "once per measured generation (`metrics_every`)"
_TRL_STEP = "per optimizer step"
_VERL_FIRST = "per micro-batch of the first mini-batch after the old-logprob pass"
_VERL_LATER = "per micro-batch of later mini-batches and epochs (after an optimizer step)"
_VERL_STEP = "per training step, from the rollout-correction hook"


def _set(*keys: str) -> frozenset:
    return frozenset(keys)


METRIC_SPECS: tuple[MetricSpec, ...] = (
    *_ratio_specs("ratio", "trl", _TRL_FIRST, _set()),
    *_ratio_specs("update", "trl", _TRL_LATER, _set("update")),
    *_clip_specs("clip", "trl", _TRL_FIRST, _set("clip")),
    *_clip_specs("update_clip", "trl", _TRL_LATER, _set("clip", "update")),
    MetricSpec("gap/old_vs_trl/oob_frac", "trl", "fraction",
               "share of tokens whose arm old log-prob is out of band against TRL's own", _TRL_LOSS, _set("trl_old")),
    MetricSpec("gap/old_vs_trl/abs_dlogp_mean", "trl", "nats", "mean `|old - TRL's old|`", _TRL_LOSS, _set("trl_old")),
    MetricSpec("gap/sampler/oob_frac", "trl", "fraction",
               "share of completion tokens whose old log-prob is out of band against the sampler's", _TRL_GEN,
               _set("sampler")),
    MetricSpec("gap/sampler/abs_dlogp_mean", "trl", "nats", "mean `|old - sampler|`", _TRL_GEN, _set("sampler")),
    MetricSpec("gap/sampler/abs_dlogp_max", "trl", "nats", "largest `|old - sampler|`", _TRL_GEN, _set("sampler")),
    MetricSpec("gap/sampler/exact_frac", "trl", "fraction",
               "share of completion tokens whose old log-prob equals the sampler's bit for bit (arm I's target with "
               "vLLM)", _TRL_GEN, _set("sampler")),
    MetricSpec("gap/sampler/is_ratio_mean", "trl", "ratio",
               "mean of TRL's importance-sampling ratio recomputed from the arm's old log-probs (tokens, or rows at "
               "sequence level)", _TRL_GEN, _set("sampler", "vllm")),
    MetricSpec("gap/sampler/is_ratio_min", "trl", "ratio", "smallest such ratio", _TRL_GEN, _set("sampler", "vllm")),
    MetricSpec("gap/sampler/is_ratio_max", "trl", "ratio", "largest such ratio", _TRL_GEN, _set("sampler", "vllm")),
    MetricSpec("gap/probe/oob_b1_vs_bN", "trl", "fraction",
               "share of probe-row tokens out of band between the row scored alone and in the arm's chunk",
               _TRL_GEN, _set("probe")),
    MetricSpec("gap/kept/mass_mean", "trl", "fraction", "mean kept probability mass of the sampled tokens' kept sets",
               _TRL_GEN, _set("truncation")),
    MetricSpec("gap/kept/mass_min", "trl", "fraction", "smallest kept probability mass", _TRL_GEN, _set("truncation")),
    MetricSpec("gap/kept/size_mean", "trl", "tokens", "mean kept-set size", _TRL_GEN, _set("truncation")),
    MetricSpec("gap/kept/size_max", "trl", "tokens", "largest kept-set size", _TRL_GEN, _set("truncation")),
    MetricSpec("gap/kept/ratio_before_mean", "trl", "ratio",
               "mean sampler ratio with full-vocabulary trainer log-probs", _TRL_GEN, _set("truncation")),
    MetricSpec("gap/kept/ratio_after_mean", "trl", "ratio",
               "mean sampler ratio with trainer log-probs renormalised over the kept set", _TRL_GEN, _set("truncation")),
    MetricSpec("gap/kept/oob_before", "trl", "fraction", "out-of-band share of the sampler ratio before renormalising",
               _TRL_GEN, _set("truncation")),
    MetricSpec("gap/kept/oob_after", "trl", "fraction", "out-of-band share of the sampler ratio after renormalising",
               _TRL_GEN, _set("truncation")),
    MetricSpec("gap/kept/source", "trl", "code",
               "where the kept sets came from: 1 the sampler's own (HF generate's recorder, or vLLM's sampling mask: "
               "`gap.kept_source`), 2 re-truncated from the trainer's logits (as `gap/verl/kept_source` 2)", _TRL_GEN,
               _set("truncation")),
    MetricSpec("gap/fp16/fallbacks", "trl", "count",
               "chunks re-scored in fp32 because fp16 gave a non-finite value, since the last generation", _TRL_GEN),
    MetricSpec("gap/time/scoring_s", "trl", "seconds", "plugin time of the optimizer step (per process)", _TRL_STEP),
    MetricSpec("gap/time/overhead_frac", "trl", "fraction", "plugin time as a share of the optimizer step's time",
               _TRL_STEP),
    MetricSpec("gap/time/generate_s", "trl", "seconds",
               "time of TRL's generation in the optimizer step: the sampler, vLLM or HF `generate` (per process; 0 on "
               "steps that reuse a generation)", _TRL_STEP),
    MetricSpec("gap/time/old_pass_s", "trl", "seconds",
               "time of the arm's old-logprob pass in place of TRL's (per process; 0 on steps that reuse a generation "
               "or where TRL runs no old pass; not in `overhead_frac`)", _TRL_STEP, _set("replaced_pass")),
    *_ratio_specs("ratio", "verl", _VERL_FIRST, _set()),
    *_ratio_specs("update", "verl", _VERL_LATER, _set("update")),
    *_clip_specs("clip", "verl", _VERL_FIRST, _set()),
    *_clip_specs("update_clip", "verl", _VERL_LATER, _set("update")),
    MetricSpec("gap/verl/kept_source", "verl", "code",
               "where the kept mass came from: 0 none (not lifted), 1 kept-set sizes, 2 re-truncated, 3 supplied in "
               "the batch", _VERL_STEP, _set("correction")),
    MetricSpec("gap/verl/log_kept_mass_mean", "verl", "nats", "mean log kept mass over response tokens (<= 0)",
               _VERL_STEP + ", when lifted", _set("correction", "truncation")),
    MetricSpec("gap/verl/all_rejected", "verl", "count",
               "1 when rejection sampling removed every sequence (or every IS weight is at the floor), else 0",
               _VERL_STEP, _set("correction")),
    MetricSpec("gap/verl/is_floor_frac", "verl", "fraction",
               "share of sequences whose sequence-level IS weight is at the floor", _VERL_STEP, _set("correction")),
)


def specs(framework: str) -> tuple[MetricSpec, ...]:
    """The specs of one adapter (``trl`` or ``verl``), in registry order."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}; expected one of {', '.join(FRAMEWORKS)}")
    return tuple(s for s in METRIC_SPECS if s.framework == framework)


def names(framework: str, needs: set | frozenset | None = None, unit: str | None = None) -> list[str]:
    """Names of one adapter's metrics, in registry order; with ``needs``, only those whose conditions are all in
    it (what a run meeting exactly those conditions logs); with ``unit``, only that unit."""
    return [s.name for s in specs(framework)
            if (needs is None or s.needs <= set(needs)) and (unit is None or s.unit == unit)]


_REGISTERED = {f: frozenset(s.name for s in METRIC_SPECS if s.framework == f) for f in FRAMEWORKS}


def registered(name: str, framework: str) -> str:
    """``name`` itself when it is one of ``framework``'s registered metrics, else ``KeyError`` naming it."""
    if name not in _REGISTERED[framework]:
        raise KeyError(f"{name!r} is not a registered {framework} gap/* metric (bloggap_plugin/core/metric_specs.py)")
    return name


def ratio_name(statistic: str, update: bool, framework: str) -> str:
    """``gap/ratio/<statistic>`` (no optimizer step since the old log-probs) or ``gap/update/<statistic>``."""
    return registered(f"gap/{'update' if update else 'ratio'}/{statistic}", framework)


def clip_name(statistic: str, update: bool, framework: str) -> str:
    """``gap/clip/<statistic>`` (no optimizer step since the old log-probs) or ``gap/update_clip/<statistic>``."""
    return registered(f"gap/{'update_clip' if update else 'clip'}/{statistic}", framework)


def metric_table_markers(framework: str) -> tuple[str, str]:
    """The lines that enclose the generated table in that adapter's doc page."""
    return (f"<!-- bloggap:metrics:{framework}:start -->", f"<!-- bloggap:metrics:{framework}:end -->")


def metric_table(framework: str) -> list[str]:
    """The Markdown lines of one adapter's metric table (key, unit, meaning, when logged)."""
    lines = ["| key | unit | meaning | logged | only with |", "|---|---|---|---|---|"]
    for spec in specs(framework):
        only = "; ".join(NEEDS[n] for n in sorted(spec.needs)) or "-"
        cells = [f"`{spec.name}`", spec.unit, spec.definition, spec.logged, only]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return lines
