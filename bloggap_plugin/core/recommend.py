"""The doctor's recommendation: :func:`decide` picks an arm from measured cells and records why as data
(:class:`Recommendation`: arm, reasons, numbers); :func:`render` is the one place that turns it into text.

Cells are the probe's dicts (``dtype``, ``attn``, ``comparison``, ``oob``, ``oob_count``, ``n``, ``rows``...);
rates are fractions, costs are ratios of measured seconds per token.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from bloggap_plugin.core.comparisons import BATCH_SHAPE_COMPARISONS, HEADLINE, SAMPLER, TIMED
from bloggap_plugin.core.metric_specs import registered
from bloggap_plugin.core.probe import FP16_MAX

__all__ = ["Measured", "Reason", "Recommendation", "decide", "fp16_safe", "render", "recommend"]

_GAP_RATIO = registered("gap/ratio/oob_frac", "trl")  # the live metric the recommendations tell the user to watch
REMOVES = 0.1  # a precision "removes" the gap when it leaves at most this share of bf16's rate on the same rows


@dataclass(frozen=True)
class Measured:
    """The numbers of one measured cell that a reason cites (``oob`` a fraction of ``n`` tokens)."""

    dtype: str
    attn: str
    comparison: str
    oob: float
    oob_count: int
    n: int
    rows: int | None = None

    @classmethod
    def of(cls, cell: Mapping) -> Measured:
        return cls(cell["dtype"], cell["attn"], cell["comparison"], cell["oob"], cell["oob_count"], cell["n"],
                   cell.get("rows"))


@dataclass(frozen=True)
class Reason:
    """One finding: ``kind`` names it, ``cells`` the measured cells it rests on, ``numbers`` the rest."""

    kind: str
    cells: Mapping[str, Measured] = field(default_factory=dict)
    numbers: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Recommendation:
    """The decision: ``arm`` (``"A"``, ``"B"``, ``"H"`` or ``None``: nothing shown to work), the ``reasons``
    in the order they are told, and ``basis``: the numbers the decision used (JSON-ready)."""

    arm: str | None
    reasons: tuple[Reason, ...]
    basis: Mapping[str, object]

    def to_dict(self) -> dict:
        """The JSON record: ``{"arm", "text", "basis"}``."""
        return {"arm": self.arm, "text": render(self), "basis": dict(self.basis)}


# ------------------------------------------------------------------------------------------------ selection


def _measured(cells: Iterable[dict]) -> list[dict]:
    return [c for c in cells if c.get("oob") is not None]


def _worst(cells: list[dict], dtype: str, names: Iterable[str]) -> dict | None:
    names = set(names)
    pool = [c for c in cells if c["dtype"] == dtype and c["comparison"] in names]
    return max(pool, key=lambda c: c["oob"]) if pool else None


def _seconds_per_token(cells: list[dict], dtype: str, attn: str | None) -> float | None:
    pool = [
        c for c in cells
        if c["dtype"] == dtype and (attn is None or c["attn"] == attn) and c["comparison"] == TIMED
        and c.get("tokens_forwarded")
    ]
    return pool[0]["seconds"] / pool[0]["tokens_forwarded"] if pool else None


def _bf16_same_rows(cell: dict, pools: Sequence[list[dict]]) -> dict | None:
    """The bf16 cell of the same comparison, attention and rows (a scaled-down dtype's pair)."""
    for pool in pools:
        for other in pool:
            if (other["dtype"] == "bf16" and other["comparison"] == cell["comparison"]
                    and other["attn"] == cell["attn"] and other.get("rows") == cell.get("rows")):
                return other
    return None


def fp16_safe(fp16_check: dict | None) -> bool | None:
    """Whether the doctor's fp16 check (``fp16_check`` of its result) found fp16 safe: no non-finite log-prob and the
    largest hidden value under half of fp16's max; ``None`` where the check is absent or was skipped."""
    if not fp16_check or fp16_check.get("skipped"):
        return None
    return fp16_check.get("nonfinite_logprobs", 1) == 0 and fp16_check.get("max_abs_hidden", FP16_MAX) < FP16_MAX / 2


# ------------------------------------------------------------------------------------------------ decision


def decide(
    cells: Sequence[dict],
    fp16_check: dict | None = None,
    device_type: str = "cpu",
    paired: Sequence[dict] = (),
    vllm_sampler: Mapping | None = None,
) -> Recommendation:
    """Pick an arm from measured cells.

    On the headline comparison (b1 vs b8 with TRL's left padding and 0..L-1 positions, worst attention
    implementation): no bf16 gap anywhere -> arm A; fp16 safe and leaving <= 10% of bf16's gap on the same
    rows -> arm H (fp16 at both ends of the PPO ratio; fp16 old log-probs alone, arm F, leave a bf16 training
    forward in the ratio, so the ratio carries the bf16-vs-fp16 difference of every token); else fp32
    leaving <= 10% -> arm B (or a cheaper ladder rung), with the same caveat. A dtype scored on fewer rows
    is compared with bf16 on the same rows: ``paired`` holds such bf16 cells (same ``comparison``, ``attn``
    and ``rows``). Costs are each dtype's measured seconds per token on its batch-8 pass relative to bf16 on
    this device.

    ``vllm_sampler`` (the doctor's ``vllm_sampler`` record, where it holds ``cells``): vLLM's samples, from an engine
    built as TRL's colocate engine, scored by each dtype at batch 1; the arm stays the one above (the batch-shape
    arms do not remove a sampler-vs-trainer gap), and a finding reports the gap the arm's trainer dtype trains with.
    """
    cells, paired = _measured(cells), _measured(paired)
    nondeterministic = [
        f"{c['dtype']}/{c['attn']}" for c in cells
        if c["comparison"] == "rerun_b1" and not c.get("bitwise_equal", c["oob_count"] == 0)
    ]
    basis: dict = {"nondeterministic": nondeterministic}
    bf16 = _worst(cells, "bf16", [HEADLINE])
    if bf16 is None:
        return Recommendation(None, (Reason("no_bf16"),), basis)
    reasons = [Reason("nondeterministic", numbers={"cells": tuple(nondeterministic)})] if nondeterministic else []
    arm, arm_reasons = _decide_arm(cells, paired, bf16, fp16_check, device_type, basis)
    reasons += arm_reasons
    membership = [c for c in cells if c["comparison"] == "two_groupings_b8" and c["oob"] > 0]
    if membership:
        reasons.append(Reason("membership", {"worst": Measured.of(max(membership, key=lambda c: c["oob"]))}))
    sampler = _sampler_reason(cells, paired, basis)
    if sampler is not None:
        reasons.append(sampler)
    with_vllm = _vllm_reason(vllm_sampler, arm, bf16, basis)
    if with_vllm is not None:
        reasons.append(with_vllm)
    if basis["fp16_safe"] is False:
        reasons.append(Reason("fp16_unsafe", numbers={
            "nonfinite_logprobs": fp16_check.get("nonfinite_logprobs"),
            "max_abs_hidden": fp16_check.get("max_abs_hidden"),
        }))
    return Recommendation(arm, tuple(reasons), basis)


def _decide_arm(cells, paired, bf16, fp16_check, device_type, basis) -> tuple[str | None, list[Reason]]:
    """The arm and the reasons that name it (fills ``basis`` with the numbers used)."""
    bf16_worst = _worst(cells, "bf16", BATCH_SHAPE_COMPARISONS)
    basis.update(bf16_headline=bf16["oob"], bf16_worst=bf16_worst["oob"],
                 bf16_worst_comparison=bf16_worst["comparison"])
    bf16_speed = _seconds_per_token(cells, "bf16", bf16["attn"])
    costs = {}
    for dtype in ("fp16", "fp32"):
        speed = _seconds_per_token(cells, dtype, bf16["attn"])
        costs[dtype] = basis[f"{dtype}_cost_vs_bf16"] = None if speed is None or not bf16_speed else speed / bf16_speed
    fp16_ok = basis["fp16_safe"] = fp16_safe(fp16_check)
    if bf16["oob"] == 0 and bf16_worst["oob"] == 0:
        return "A", [Reason("no_gap", {"bf16": Measured.of(bf16)})]
    reasons = [Reason("gap", {"bf16": Measured.of(bf16), "worst": Measured.of(bf16_worst)})]
    removal = {}
    for dtype in ("fp16", "fp32"):
        cell = _worst(cells, dtype, [HEADLINE])
        ref = None if cell is None else _bf16_same_rows(cell, (cells, paired))
        if ref is not None:
            removal[dtype] = (cell, ref, ref["oob"] > 0 and cell["oob"] <= REMOVES * ref["oob"])
            basis[f"{dtype}_vs_bf16_same_rows"] = {dtype: cell["oob"], "bf16": ref["oob"], "rows": cell.get("rows")}

    def removes(dtype: str, kind: str, extra: Mapping[str, Measured] | None = None, **numbers) -> Reason:
        cell, ref, _ = removal[dtype]
        cited = {"bf16": Measured.of(bf16), "cell": Measured.of(cell), "ref": Measured.of(ref), **(extra or {})}
        return Reason(kind, cited,
                      {"dtype": dtype, "cost": costs[dtype], "device_type": device_type, **numbers})

    fp16_removes = "fp16" in removal and removal["fp16"][2] and fp16_ok is not False
    if fp16_removes and device_type != "cpu":
        arm, reasons = "H", reasons + [removes("fp16", "arm_h")]
    elif "fp32" in removal and removal["fp32"][2]:
        fp16 = removal.get("fp16")
        why = ("cpu" if fp16_removes else "unsafe" if fp16_ok is False else "unmeasured" if fp16 is None
               else "quiet_rows" if fp16[1]["oob"] == 0 else "leaves")
        extra = {} if fp16 is None else {"fp16": Measured.of(fp16[0]), "fp16_ref": Measured.of(fp16[1])}
        arm, reasons = "B", reasons + [removes("fp32", "arm_b", extra, why=why)]
    elif fp16_removes:  # on a CPU: arm H cannot take effect, and fp32 was not shown to remove it
        arm, reasons = None, reasons + [removes("fp16", "h_needs_cuda")]
    else:
        arm, reasons = None, reasons + [Reason("no_removal")]
    mask_cell = _worst(cells, "bf16", [TIMED])
    if mask_cell is not None and mask_cell["oob"] < bf16["oob"]:
        reasons.append(Reason("positions_mask", {"bf16": Measured.of(bf16), "mask": Measured.of(mask_cell)}))
    basis["arm_reason_cells"] = HEADLINE
    return arm, reasons


def _sampler_reason(cells: list[dict], paired: list[dict], basis: dict) -> Reason | None:
    """The sampler-vs-scorer finding: each dtype's worst ``sampler_vs_b1`` cell, beside bf16 on its rows."""
    sampler: dict[str, dict] = {}
    for c in sorted(cells, key=lambda c: c["oob"]):
        if c["comparison"] == SAMPLER:
            sampler[c["dtype"]] = c  # worst attention implementation per dtype
    if not sampler:
        return None
    basis["sampler"] = {d: c["oob"] for d, c in sampler.items()}
    parts = []
    for dtype, c in sorted(sampler.items()):
        ref = _bf16_same_rows(c, (cells, paired)) if dtype != "bf16" else None
        beside = ref is not None and c.get("rows") != sampler.get("bf16", {}).get("rows")
        parts.append((Measured.of(c), Measured.of(ref) if beside else None))
    best = min(sampler.values(), key=lambda c: c["oob"])
    return Reason("sampler", {"best": Measured.of(best)},
                  {"parts": tuple(parts), "sampler_dtype": best.get("sampler", {}).get("dtype", "?"),
                   "fp16_safe": basis.get("fp16_safe")})


ARM_I_ENGINE_MODE = "vLLM's batch-invariant mode, which arm I's own engine runs (VLLM_BATCH_INVARIANT=1)"
"""What the vLLM sampler column names where its engine ran without that mode (the record's ``sampler.batch_invariant``
is ``False``): arm I's form scored against such an engine is not arm I's sampler gap."""


def arm_i_engine_note(sampler: Mapping) -> str:
    """``"; the engine ran without <ARM_I_ENGINE_MODE>"`` where the column's sampler record says its engine ran without
    vLLM's batch-invariant mode (``batch_invariant`` is ``False``), else ``""``: the clause the printed column and the
    DOCTOR-vllm table add to arm I's row."""
    return f"; the engine ran without {ARM_I_ENGINE_MODE}" if sampler.get("batch_invariant") is False else ""

ARM_TRAINER_DTYPE = {"A": "bf16", "B": "fp32", "H": "fp16", None: "bf16"}
"""The dtype whose scoring gives an arm's old log-probs (``None``: no arm, TRL's bf16 default)."""


def _vllm_reason(record: Mapping | None, arm: str | None, bf16: dict, basis: dict) -> Reason | None:
    """The vLLM sampler finding: each dtype's worst cell of the sampler column (out of band, bit for bit equal
    tokens), and the one of the arm's trainer dtype, which is the gap a vLLM user trains with (fills ``basis``)."""
    pool = _measured((record or {}).get("cells", []))
    if not pool:
        return None
    worst: dict[str, dict] = {}
    for c in sorted(pool, key=lambda c: (c["oob"], -c.get("exact_count", 0))):
        worst[c["dtype"]] = c
    exact = {d: c.get("exact_count", 0) / c["n"] for d, c in worst.items()}
    trainer = ARM_TRAINER_DTYPE.get(arm, "bf16")
    sampler = record.get("sampler", {})
    basis["vllm_sampler"] = {"oob": {d: c["oob"] for d, c in worst.items()}, "exact": exact, "trainer_dtype": trainer}
    train = worst.get(trainer)
    arm_i = record.get("arm_i", {})
    form = arm_i.get("cell") if isinstance(arm_i, Mapping) and arm_i.get("cell", {}).get("oob") is not None else None
    if form is not None:
        basis["vllm_sampler"]["arm_i"] = {"oob": form["oob"], "exact": form["exact_count"] / form["n"]}
    return Reason("vllm_sampler", {d: Measured.of(c) for d, c in sorted(worst.items())},
                  {"exact": exact, "arm": arm, "trainer_dtype": trainer, "trained": trainer if train else None,
                   "arm_i": None if form is None else (Measured.of(form), form["exact_count"] / form["n"],
                                                       arm_i.get("pieces", "?")),
                   "bf16_headline": bf16["oob"], "vllm": sampler.get("vllm", "?"),
                   "engine_dtype": sampler.get("engine_dtype", "the checkpoint's"),
                   "batch_invariant": sampler.get("batch_invariant")})


def recommend(*args, **kwargs) -> dict:
    """:func:`decide` (same arguments), as the doctor's JSON record ``{"arm", "text", "basis"}``."""
    return decide(*args, **kwargs).to_dict()


# ------------------------------------------------------------------------------------------------ the text


def _pct(c: Measured) -> str:
    return f"{100 * c.oob:.2f}%"


def _fmt(c: Measured) -> str:
    return f"{_pct(c)} ({c.oob_count}/{c.n} tokens, {c.attn})"


def _cost_text(reason: Reason) -> str:
    value = reason.numbers["cost"]
    if value is None:
        return "cost not measured"
    return f"measured {value:.2f}x bf16's time per token here"


def _removal_text(reason: Reason) -> str:
    dtype, c, ref, bf16 = reason.numbers["dtype"], reason.cells["cell"], reason.cells["ref"], reason.cells["bf16"]
    rows = "" if c.rows == bf16.rows else f" on the {c.rows} rows it was scored on"
    return (f"{dtype} removes {100 * (ref.oob - c.oob):.2f} of {100 * ref.oob:.2f} pp{rows} "
            f"(bf16 {_fmt(ref)}, {dtype} {_fmt(c)})")


def _arm_b_text(reason: Reason) -> str:
    why = reason.numbers["why"]
    if why == "cpu":
        text = (f"fp16 would remove it ({_pct(reason.cells['fp16'])} against bf16's "
                f"{_pct(reason.cells['fp16_ref'])}), but arm H needs fp16 autocast, which accelerate runs on CUDA "
                "only: on a CUDA GPU run the doctor there and choose arm H; on this CPU")
    elif why == "unsafe":
        text = "fp16 is not safe for this model (see the fp16 check)"
    elif why == "unmeasured":
        text = "fp16 was not measured"
    elif why == "quiet_rows":
        text = (f"fp16 was scored on {reason.cells['fp16'].rows} rows where bf16 showed no gap, so it is not shown "
                "to help (score more fp16 rows: --fp16-rows)")
    else:
        text = (f"fp16 leaves {_pct(reason.cells['fp16'])} of bf16's {_pct(reason.cells['fp16_ref'])} on the same "
                "rows (more than a tenth)")
    joint = ", " if why == "cpu" else "; "  # "... on this CPU, fp32 removes ..."
    return (
        f"{text}{joint}{_removal_text(reason)}: arm B (fp32 shadow copy), {_cost_text(reason)}. "
        "It keeps the PPO ratio at 1 only if training also runs in fp32 (bf16: false); with bf16 training "
        f"the ratio carries the bf16-vs-fp32 difference (watch {_GAP_RATIO}, the ratio where no optimizer step lies "
        "between old and new). `bloggap ladder` finds "
        "cheaper rungs (fp32 head, guided fp32 layers: arms E, D)."
    )


def _sampler_text(reason: Reason) -> str:
    parts = []
    for c, ref in reason.numbers["parts"]:
        text = f"{c.dtype} scorer {_pct(c)}"
        if ref is not None:
            text += f" ({c.rows} rows; bf16 scorer on them {_pct(ref)})"
        parts.append(text)
    best = reason.cells["best"]
    if best.oob > 0:
        return (
            f"Sampler (generate's own log-probs, {reason.numbers['sampler_dtype']}) vs teacher-forced batch 1: "
            f"{', '.join(parts)}. No scorer precision removes it (best {_pct(best)}): the sampler must change too "
            + ("(but not to fp16: the fp16 check failed on this model)" if reason.numbers.get("fp16_safe") is False
               else "(arm H, fp16 everywhere)")
            + ", or correct it with importance sampling."
        )
    return f"Sampler vs teacher-forced batch 1: {', '.join(parts)}."


def _vllm_text(reason: Reason) -> str:
    numbers = reason.numbers
    parts = [f"{d} {_pct(c)} out of band, {100 * numbers['exact'][d]:.2f}% bitwise ({c.n} tokens, {c.attn})"
             for d, c in reason.cells.items()]
    if numbers.get("arm_i") is not None:
        form, form_exact, pieces = numbers["arm_i"]
        parts.append(f"arm I's form (pieces {pieces}, one batch) {_pct(form)} out of band, {100 * form_exact:.2f}% "
                     "bitwise" + (f", against an engine without {ARM_I_ENGINE_MODE}: not arm I's sampler gap"
                                  if numbers["batch_invariant"] is False else ""))
    text = (f"With vLLM (TRL's colocate engine, vLLM {numbers['vllm']}, engine dtype {numbers['engine_dtype']}), "
            f"its processed log-probs vs each scoring at batch 1: {'; '.join(parts)}.")
    trained = numbers["trained"]
    if trained is None:
        return text + f" The {numbers['trainer_dtype']} scoring the arm trains with was not measured."
    cell, exact = reason.cells[trained], numbers["exact"][trained]
    arm = f"arm {numbers['arm']}" if numbers["arm"] else "TRL's default"
    text += f" {arm} scores old log-probs in {trained}: "
    if numbers["arm"] == "H":
        text += (f"arm H builds an fp16 engine, and this column's engine ran in {numbers['engine_dtype']}, so its "
                 "fp16 row is not arm H's sampler gap: ")
    if cell.oob == 0 and exact == 1:
        return text + "bit for bit equal to the sampler, the ratio starts at 1."
    text += (f"{_pct(cell)} of tokens out of band against the sampler: the gap you train with; the batch-shape "
             "arms do not remove it (TRL's vllm_importance_sampling_correction reweights it; arm I scores old "
             "log-probs in vLLM's form, docs/arm_i.md)")
    if cell.oob > numbers["bf16_headline"]:
        text += f", and it is larger than bf16's batch-shape gap ({100 * numbers['bf16_headline']:.2f}%)"
    return text + "."


_SENTENCES = {
    "no_bf16": lambda r: "No bf16 cell was measured: nothing to recommend (bf16 is the trainer default).",
    "nondeterministic": lambda r: (
        "The forward is nondeterministic on this device (batch-1 rerun differs for "
        + ", ".join(r.numbers["cells"])
        + "): part of every gap below is run-to-run noise, which no scoring arm removes."
    ),
    "no_gap": lambda r: (
        f"bf16 shows no batch-shape gap here: {_fmt(r.cells['bf16'])} on TRL's layout and 0 in every other "
        "comparison. Arm A (trainer default) is enough; keep the live probe (gap/probe/*) on, since the gap "
        "depends on shapes."
    ),
    "gap": lambda r: (
        f"bf16 b1 vs b8 with TRL's layout: {_fmt(r.cells['bf16'])}; worst bf16 comparison: "
        f"{r.cells['worst'].comparison} {_pct(r.cells['worst'])} ({r.cells['worst'].attn})."
    ),
    "arm_h": lambda r: (
        f"{_removal_text(r)}, {_cost_text(r)}: arm H (fp16 everywhere: rollout, old log-probs and training in fp16 "
        "with loss scaling). Arm F (fp16 old log-probs only) removes the noise from the old-logprob pass, but "
        "while training stays in bf16 the PPO ratio new/old then carries the bf16-vs-fp16 difference of every "
        f"token: watch {_GAP_RATIO} (the ratio where no optimizer step lies between old and new) against arm A "
        "before choosing it."
    ),
    "arm_b": _arm_b_text,
    "h_needs_cuda": lambda r: (
        f"{_removal_text(r)}: on a CUDA GPU that is arm H (fp16 everywhere), but arm H needs fp16 autocast, which "
        "accelerate runs on CUDA only, and fp32 was not shown to remove it here: run the doctor on the GPU you "
        "will train on."
    ),
    "no_removal": lambda r: (
        "Neither fp16 nor fp32 was shown to remove the gap in the measured cells: run `bloggap attribute` and "
        "`bloggap ladder` to see where it enters."
    ),
    "positions_mask": lambda r: (
        f"Positions from the attention mask alone bring bf16 from {_pct(r.cells['bf16'])} to {_pct(r.cells['mask'])} "
        "at no cost: set gap.positions: mask (TRL scores left-padded rows with positions 0..L-1)."
    ),
    "membership": lambda r: (
        f"Batch membership changes results ({r.cells['worst'].dtype}/{r.cells['worst'].attn}: "
        f"{_pct(r.cells['worst'])} between two groupings of the same rows, as with MoE routing): arm G (matched "
        "shapes) keeps the first-epoch ratio at 1."
    ),
    "sampler": _sampler_text,
    "vllm_sampler": _vllm_text,
    "fp16_unsafe": lambda r: (
        f"fp16 check failed: {r.numbers['nonfinite_logprobs']} non-finite log-probs, largest |hidden| "
        f"{r.numbers['max_abs_hidden']:.0f} vs fp16's 65,504: do not use fp16 for this model."
    ),
}


def _short_removal(reason: Reason) -> str:
    return (f"{reason.numbers['dtype']} takes bf16's {_pct(reason.cells['ref'])} out of band to "
            f"{_pct(reason.cells['cell'])}")


_B_WHY = {"cpu": "arm H would too, on a CUDA GPU", "unsafe": "fp16 is not safe for this model",
          "unmeasured": "fp16 was not measured", "quiet_rows": "fp16 was not shown to help",
          "leaves": "fp16 leaves too much of it"}

_LEADS = {
    "no_bf16": lambda r: "no arm: no bf16 cell was measured",
    "no_gap": lambda r: f"arm A (metrics only): bf16 shows no batch-shape gap here ({_pct(r.cells['bf16'])})",
    "arm_h": lambda r: f"arm H (fp16 everywhere: fp16: true): {_short_removal(r)}, {_cost_text(r)}",
    "arm_b": lambda r: f"arm B (fp32 shadow copy): {_short_removal(r)}; {_B_WHY[r.numbers['why']]}",
    "h_needs_cuda": lambda r: (f"no arm on this CPU: {_short_removal(r)}, but arm H (fp16 everywhere) runs on CUDA "
                               "only: run the doctor on the GPU you will train on"),
    "no_removal": lambda r: ("no arm: neither fp16 nor fp32 was shown to remove the gap; see `bloggap attribute` "
                             "and `bloggap ladder`"),
}


def render(recommendation: Recommendation) -> str:
    """The recommendation as text: a first line with the arm and its reason, then one line per finding (every
    reason's sentences, in order)."""
    lead = next((_LEADS[r.kind](r) for r in recommendation.reasons if r.kind in _LEADS), None)
    details = [_SENTENCES[reason.kind](reason) for reason in recommendation.reasons]
    return "\n".join(([lead + "."] if lead else []) + [f"  - {line}" for line in details])
