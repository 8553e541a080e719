"""The plugin on TRL's vLLM path (``use_vllm=True``), on CPU with a stand-in engine (``fake_vllm.py``).

The stand-in samples with the trainer's own model and returns processed log-probs as vLLM does, so the only
sampler-vs-trainer difference is the truncation term: exactly what the kept-set metrics and renormalisation must
find and remove. The live-engine counterparts are in ``test_gpu_vllm.py`` (GPU machine).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

pytest.importorskip("trl")

from _support.fake_vllm import use_fake_vllm  # noqa: E402
from _support.trl_runs import (  # noqa: E402
    count_no_grad_scoring_rows,
    logs_of,
    make,
    saved_model_dir,  # noqa: E402
)

from bloggap_plugin.recipes import GapConfig, RecipeError  # noqa: E402
from bloggap_plugin.trl import GapCallback  # noqa: E402
from bloggap_plugin.trl.mixin import is_ratio  # noqa: E402
from bloggap_plugin.trl.stats import Stats  # noqa: E402

EQUAL = ["1+1=", "2+2=", "3+5=", "7+1="]
"""Equal-length prompts: no left padding, so TRL's positions 0..L-1 are the sampler's (arm A compares like with like)."""
PAIRS = [
    ("gap/sampler/abs_dlogp_mean", "sampling/sampling_logp_difference/mean"),
    ("gap/sampler/abs_dlogp_max", "sampling/sampling_logp_difference/max"),
    ("gap/sampler/is_ratio_mean", "sampling/importance_sampling_ratio/mean"),
    ("gap/sampler/is_ratio_min", "sampling/importance_sampling_ratio/min"),
    ("gap/sampler/is_ratio_max", "sampling/importance_sampling_ratio/max"),
]


def sharpen(model, scale: float = 30.0) -> None:
    """Peak the random model's next-token distribution so that truncation removes some tokens, not most."""
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)


def vllm_run(tmp_path, gap, sampling, train=True, **overrides):
    torch.manual_seed(4321)
    trainer = make(tmp_path, mode="plain", prepare=sharpen, **overrides)
    fake = use_fake_vllm(trainer, **sampling)
    if gap is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.add_callback(GapCallback(trainer, gap=gap))
    if train:
        trainer.train()
    return trainer, fake


def _runs_with_and_without_trls_pass(tmp_path, monkeypatch, gaps: dict, **overrides) -> dict:
    """Name -> ``(trainer, grad-free policy forward rows, the training micro-batches as the loss read them)`` of one
    fake-vLLM run per ``gaps`` entry (name -> GapConfig or None); the run named ``before`` believes TRL computes no
    old log-probs, so an arm that replaces TRL's pass keeps it there."""
    runs = {}
    for name, gap in gaps.items():
        with monkeypatch.context() as patch:
            if name == "before":
                patch.setattr(Stats, "trl_computes_old", lambda self: False)
            trainer, _ = vllm_run(tmp_path / name, gap, {"top_p": 0.8}, train=False, **overrides)
            rows = count_no_grad_scoring_rows(trainer)
            batches: list = []
            prepare = trainer._prepare_inputs

            def spy(generation_batch, prepare=prepare, batches=batches):
                inputs = prepare(generation_batch)
                batches.append({k: v.clone() for k, v in inputs.items() if torch.is_tensor(v)})
                return inputs

            trainer._prepare_inputs = spy
            trainer.train()
        runs[name] = (trainer, rows, batches)
    return runs


@pytest.mark.parametrize("arm", ["A", "G", "F", "I"])
def test_sampler_metrics_equal_trls_on_the_same_step(tmp_path, arm, trains):
    """gap/sampler/* and TRL's sampling/* measure the old log-probs the loss reads: A keeps TRL's, G and I replace
    TRL's pass, F replaces TRL's old log-probs after its pass (and the IS ratio the loss reads with them), so TRL's
    logged sampling/* must be recomputed from the arm's, not left from the pass whose result was replaced."""
    extra = {"i_pieces": "torch", "positions": "mask", "probe_rows": 0} if arm == "I" else {}
    trainer, fake = vllm_run(tmp_path, GapConfig(arm=arm, kept="off", **extra), {"top_p": 0.8})
    checked = 0
    for row in logs_of(trainer):
        if "sampling/sampling_logp_difference/mean" not in row:
            continue
        for ours, theirs in PAIRS:
            assert abs(row[ours] - row[theirs]) <= 1e-6 * max(1.0, abs(row[theirs])), (ours, row[ours], row[theirs])
            checked += 1
    assert checked == len(PAIRS) and fake.calls == 1


def test_arm_G_replaces_trls_old_pass_on_vllm_path(tmp_path, monkeypatch, trains):
    """TRL's vLLM path always runs its old pass (IS correction): under G it is skipped and G's per-micro-batch scores
    take its place: as many grad-free rows as plain TRL, the IS ratio recomputed per micro-batch from G's scores,
    losses bitwise those of the run that kept TRL's pass, and TRL's sampling/* statistics recomputed from G's scores."""
    gaps = {"plain": None, "before": GapConfig(arm="G", kept="off", probe_rows=0)}
    gaps["after"] = gaps["before"]
    runs = _runs_with_and_without_trls_pass(tmp_path, monkeypatch, gaps, max_steps=4)
    plain, before, after = (runs[n] for n in ("plain", "before", "after"))
    assert sum(plain[1]) == 2 * 8 and after[1] == plain[1] and sum(before[1]) == 2 * sum(plain[1])
    assert [(h["loss"], h["grad_norm"]) for h in logs_of(after[0])] == [
        (h["loss"], h["grad_norm"]) for h in logs_of(before[0])]
    trainer = after[0]
    for batch, ref in zip(after[2], before[2], strict=True):
        assert torch.equal(batch["old_per_token_logps"], ref["old_per_token_logps"])  # G's scores, never NaN
        assert not torch.isnan(batch["old_per_token_logps"]).any()
        expected = is_ratio(batch["old_per_token_logps"], batch["sampling_per_token_logps"], batch["completion_mask"],
                            trainer.vllm_importance_sampling_mode, trainer.vllm_importance_sampling_clip_min,
                            trainer.vllm_importance_sampling_clip_max)
        assert torch.equal(batch["importance_sampling_ratio"], expected)
        assert torch.equal(batch["importance_sampling_ratio"], ref["importance_sampling_ratio"])
    # TRL's sampling/* of the generation: from G's scores (before: TRL's own pass, pre-shuffle chunks, same maths)
    for got, ref in zip(logs_of(after[0]), logs_of(before[0]), strict=True):
        if "sampling/sampling_logp_difference/mean" not in ref:
            continue
        for _, key in PAIRS:
            assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), key
        assert got["sampling/sampling_logp_difference/mean"] > 0.01  # not the placeholder's 0
        assert got["sampling/importance_sampling_ratio/mean"] < 0.99  # nor its ratio 1 (top_p truncation)


def test_kept_measure_finds_the_kept_mass_and_leaves_training_alone(tmp_path, trains):
    """Sampler = the trainer's own model: full-vocabulary old / processed sampler = the kept mass S per token, so the
    mean ratio before equals the mean kept mass and the ratio after renormalising is 1; training is plain TRL's."""
    plain, _ = vllm_run(tmp_path / "plain", None, {"top_p": 0.8}, prompts=EQUAL)
    trainer, fake = vllm_run(tmp_path / "gap", GapConfig(arm="A", kept="measure"), {"top_p": 0.8}, prompts=EQUAL)
    first = logs_of(trainer)[0]
    assert 0.5 < first["gap/kept/mass_mean"] < 0.999 and first["gap/kept/size_max"] < 104
    assert first["gap/kept/ratio_before_mean"] == pytest.approx(first["gap/kept/mass_mean"], abs=1e-5)
    assert first["gap/kept/ratio_after_mean"] == pytest.approx(1.0, abs=1e-5)
    assert first["gap/kept/oob_after"] == 0.0 and first["gap/kept/oob_before"] > 0.2
    # the sampler's own kept sizes are the trainer's re-truncated ones (same logits on CPU)
    record = fake.last_record
    sizes = record.kept_sizes[record.kept_sizes > 0].double()
    assert first["gap/kept/size_max"] == float(sizes.max())
    assert [(h["loss"], h["grad_norm"]) for h in logs_of(trainer)] == [(h["loss"], h["grad_norm"]) for h in logs_of(plain)]


def test_kept_renormalize_brings_the_is_ratio_to_one(tmp_path, trains):
    """renormalize: the arm's old log-probs are renormalised over the re-truncated kept set, so the IS ratio TRL then
    applies is 1 per sequence (TRL's default sequence_mask), where TRL alone weights every sequence by S^T. TRL's
    logged sampling/* describe the ratio the loss applies; the ratio before renormalising is gap/kept/*'s."""
    trainer, _ = vllm_run(tmp_path, GapConfig(arm="A", kept="renormalize"), {"top_p": 0.8}, prompts=EQUAL)
    first = logs_of(trainer)[0]
    assert first["gap/kept/ratio_before_mean"] < 0.9  # per token: the kept mass S (TRL alone: S^T per sequence)
    assert first["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-4)
    assert first["gap/sampler/is_ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert first["gap/sampler/is_ratio_min"] == pytest.approx(1.0, abs=1e-4)
    assert first["gap/sampler/oob_frac"] == 0.0
    # the training forward is renormalised over the same kept sets: new / old is 1 at the first inner step
    assert first["gap/ratio/abs_dlogp_max"] < 1e-5
    assert all(math.isfinite(h["loss"]) for h in logs_of(trainer))


@pytest.mark.parametrize("arm, sampling", [("C", {"top_k": 5}), ("C", {"min_p": 0.05}),
                                           ("C", {"top_p": 0.9, "min_p": 0.05}), ("G", {"top_p": 0.8}),
                                           ("E", {"top_p": 0.8})])
def test_kept_renormalize_other_truncations_and_arms(tmp_path, arm, sampling, trains):
    trainer, _ = vllm_run(tmp_path, GapConfig(arm=arm, kept="renormalize"), sampling, max_steps=1)
    first = logs_of(trainer)[0]
    assert first["gap/sampler/is_ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert first["gap/kept/ratio_after_mean"] == pytest.approx(1.0, abs=1e-5)


def test_kept_off_on_vllm_path_logs_no_kept_metrics(tmp_path, trains):
    trainer, _ = vllm_run(tmp_path, GapConfig(arm="A", kept="off"), {"top_p": 0.8}, max_steps=1)
    assert not any(k.startswith("gap/kept/") for h in logs_of(trainer) for k in h)


def test_untruncated_vllm_path_logs_no_kept_metrics(tmp_path, trains):
    trainer, _ = vllm_run(tmp_path, GapConfig(arm="C", kept="measure"), {}, max_steps=1)
    first = logs_of(trainer)[0]
    assert not any(k.startswith("gap/kept/") for k in first)
    # same model, untruncated, the sampler's positions (arm C): the sampler's log-probs are the trainer's
    assert first["gap/sampler/oob_frac"] == 0.0 and first["gap/sampler/abs_dlogp_max"] < 1e-4


def test_renormalize_with_beta_on_vllm_path_is_refused(tmp_path, trains):
    with pytest.raises(RecipeError, match="renormalize.*beta.*vLLM"):
        vllm_run(tmp_path, GapConfig(arm="A", kept="renormalize"), {"top_p": 0.8}, train=False, beta=0.04,
                 model_name=saved_model_dir(tmp_path))


@pytest.mark.parametrize("active, f32_default, warns", [(True, None, True), (True, "tf32", True), (False, None, False),
                                                     (True, "ieee", False)])
def test_colocated_batch_invariant_vllm_warns_about_rope(tmp_path, monkeypatch, active, f32_default, warns):
    """vLLM's batch-invariant mode on in the trainer's process (colocate) replaces bmm, which transformers' RoPE
    uses: attaching warns and names the fixes; without the mode, or with Triton's fp32 dots in IEEE
    (TRITON_F32_DEFAULT=ieee, measured on the H200 to bring the angles back), no such warning."""
    import bloggap_plugin.core.vllm.kernels as vllm_kernels

    monkeypatch.setattr(vllm_kernels, "vllm_batch_invariant_active", lambda: active)
    if f32_default is None:
        monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    else:
        monkeypatch.setenv("TRITON_F32_DEFAULT", f32_default)
    torch.manual_seed(4321)
    trainer = make(tmp_path, mode="plain", prepare=sharpen)
    use_fake_vllm(trainer, top_p=0.8)
    assert trainer.args.vllm_mode == "colocate"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.add_callback(GapCallback(trainer, gap=GapConfig(arm="A")))
    rope = [str(w.message) for w in caught if "VLLM_BATCH_INVARIANT" in str(w.message)]
    if warns:
        assert len(rope) == 1 and "RoPE" in rope[0] and "vllm_mode='server'" in rope[0]
        assert "TRITON_F32_DEFAULT=ieee" in rope[0]
    else:
        assert rope == []


def test_kept_measure_on_vllm_path_follows_metrics_every(tmp_path, trains):
    """measure-only kept sets cost a pass on measured generations only (metrics_every 2: generations 1, 3, ...)."""
    trainer, fake = vllm_run(tmp_path, GapConfig(arm="A", kept="measure", metrics_every=2), {"top_p": 0.8},
                             train=False, max_steps=4, num_iterations=1, gradient_accumulation_steps=1)
    passes = []
    derive = trainer._gap_session.scorer.vllm_kept_sets
    trainer._gap_session.scorer.vllm_kept_sets = lambda *a, **k: (passes.append(1), derive(*a, **k))[1]
    trainer.train()
    generated = [h for h in logs_of(trainer) if "sampling/importance_sampling_ratio/mean" in h]
    with_kept = [h for h in generated if "gap/kept/mass_mean" in h]
    assert fake.calls == len(generated) == 4 and len(with_kept) == 2 and len(passes) == 2


def test_sampler_exact_frac_counts_bit_identical_old_logprobs(tmp_path, trains):
    """gap/sampler/exact_frac: the share of completion tokens whose old log-prob equals the sampler's bit for bit,
    recomputed here from the batches the loss reads (same model, untruncated: some tokens equal, some differ in the
    last bits, so the share is strictly between 0 and 1 and must match the count, not a bound)."""
    torch.manual_seed(4321)
    trainer = make(tmp_path, mode="plain", prepare=sharpen, max_steps=1)
    use_fake_vllm(trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.add_callback(GapCallback(trainer, gap=GapConfig(arm="C", kept="off", probe_rows=0)))
    batches = _spy_batches(trainer)
    trainer.train()
    first = logs_of(trainer)[0]
    exact = tokens = 0
    for batch in batches[: trainer.args.gradient_accumulation_steps]:  # one generation's micro-batches
        old = batch["old_per_token_logps"] if "old_per_token_logps" in batch else batch["gap_old_logps"]
        sampler = batch["sampling_per_token_logps"]
        mask = batch["completion_mask"].bool() & ~torch.isnan(sampler)
        exact += int(((old == sampler) & mask).sum())
        tokens += int(mask.sum())
    assert 0 < exact < tokens and first["gap/sampler/exact_frac"] == exact / tokens


def test_arm_i_refuses_a_generation_its_engine_prefilled_in_chunks(tmp_path, trains):
    """Arm I reads the colocate engine's tokens per step on every generation: prompts that hold more tokens than one
    step were prefilled in chunks mixed with decode steps, so its scores would not be the sampler's. The step stops
    with the error naming both numbers; with a budget that holds them the same run trains."""
    import types

    def engine(budget):
        scheduler = types.SimpleNamespace(max_num_batched_tokens=budget)
        return types.SimpleNamespace(vllm_config=types.SimpleNamespace(scheduler_config=scheduler))

    gap = GapConfig(arm="I", i_pieces="torch", positions="mask", probe_rows=0)
    trainer, fake = vllm_run(tmp_path / "small", gap, {}, train=False, max_steps=1)
    fake.llm.llm_engine = engine(8)
    with pytest.raises(RecipeError, match=r"prompt tokens and the colocate engine computes max_num_batched_tokens=8"):
        trainer.train()
    trainer, fake = vllm_run(tmp_path / "large", gap, {}, train=False, max_steps=1)
    fake.llm.llm_engine = engine(1 << 20)
    trainer.train()
    assert logs_of(trainer)[0]["gap/sampler/oob_frac"] is not None


def test_arm_i_replaces_trls_old_pass_on_vllm_path(tmp_path, monkeypatch, trains):
    """TRL's vLLM path runs its own old pass (IS correction) only for the plugin to replace its result under arm I:
    it is skipped (no grad-free forward of the policy at all), arm I's scores take its place, and the run's losses,
    gradient norms, IS ratios and TRL's sampling/* are bitwise those of the run that kept TRL's pass; the replacing
    pass's seconds are gap/time/old_pass_s, outside gap/time/overhead_frac."""
    gap = GapConfig(arm="I", i_pieces="torch", positions="mask", kept="off", probe_rows=0)
    runs = _runs_with_and_without_trls_pass(tmp_path, monkeypatch, {"before": gap, "after": gap}, max_steps=4,
                                            num_iterations=2)
    (before, before_rows, before_batches), (after, after_rows, after_batches) = runs["before"], runs["after"]
    assert sum(before_rows) > 0 and after_rows == []
    assert [(h["loss"], h["grad_norm"]) for h in logs_of(after)] == [
        (h["loss"], h["grad_norm"]) for h in logs_of(before)]
    for batch, ref in zip(after_batches, before_batches, strict=True):
        assert torch.equal(batch["old_per_token_logps"], ref["old_per_token_logps"])
        assert torch.equal(batch["importance_sampling_ratio"], ref["importance_sampling_ratio"])
    generating = [h for h in logs_of(after) if "sampling/sampling_logp_difference/mean" in h]
    assert generating and all(h["gap/time/old_pass_s"] > 0 for h in generating)
    # the engine's generate seconds on generating steps, none on the steps that reuse a generation
    assert all(h["gap/time/generate_s"] > 0 for h in generating)
    assert all(h["gap/time/generate_s"] == 0.0 for h in logs_of(after) if h not in generating and "loss" in h)
    assert not any("gap/old_vs_trl/oob_frac" in h for h in logs_of(after))
    for got, ref in zip(logs_of(after), logs_of(before), strict=True):
        for _, key in PAIRS:
            if key in ref:
                assert got[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-7), key


# ---- gap.kept_source: vLLM's own sampling mask (return_sampling_mask, vLLM >= 0.28) ----

MASK_SAMPLING = {"top_k": 20, "top_p": 0.8}


@pytest.fixture
def vllm_031(monkeypatch):
    """vLLM 0.31 as the installed release and the fake ``LLM`` as TRL's ``vllm_generation.LLM`` (vLLM is absent on
    CPU, so TRL imported none)."""
    import trl.generation.vllm_generation as vllm_generation
    from _support.fake_vllm import FakeLLM

    import bloggap_plugin.core.vllm.versions as versions

    monkeypatch.setattr(versions, "installed_vllm", lambda: "0.31.0")
    monkeypatch.setattr(vllm_generation, "LLM", FakeLLM, raising=False)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    return FakeLLM


def mask_run(tmp_path, gap, sampling, train=True, engine=True, **overrides):
    """A fake-vLLM run whose engine is built as GapGRPOTrainer builds it for ``gap`` (``engine_kwargs_for(gap,
    args=...)`` around TRL's ``LLM(...)``; ``engine=False``: the fake's unreadable engine), its generate calls'
    request outputs kept in ``fake.outputs``."""
    import types

    from bloggap_plugin.trl.vllm_colocate import engine_kwargs_for, vllm_colocate_engine

    torch.manual_seed(4321)
    trainer = make(tmp_path, mode="plain", prepare=sharpen, **overrides)
    args = types.SimpleNamespace(**{**vars(trainer.args), "use_vllm": True, **sampling})
    with vllm_colocate_engine(**engine_kwargs_for(gap, args=args)):
        fake = use_fake_vllm(trainer, engine={} if engine else None, **sampling)
    fake.outputs = []
    generate = fake.llm.generate

    def keep(*a, **k):
        fake.outputs.append(generate(*a, **k))
        return fake.outputs[-1]

    fake.llm.generate = keep
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.add_callback(GapCallback(trainer, gap=gap))
    fake.warnings = [str(w.message) for w in caught]
    if train:
        trainer.train()
    return trainer, fake


def _spy_batches(trainer) -> list:
    batches: list = []
    prepare = trainer._prepare_inputs

    def spy(generation_batch):
        inputs = prepare(generation_batch)
        batches.append({k: v.clone() for k, v in inputs.items() if torch.is_tensor(v)})
        return inputs

    trainer._prepare_inputs = spy
    return batches


def test_sampling_mask_renormalizes_over_vllms_own_kept_ids(tmp_path, vllm_031, trains):
    """With the mask the kept ids in TRL's batch are the mask's rows exactly (each completion's, in TRL's row order),
    no re-deriving pass runs, and, sampler and trainer being one model, the renormalised old log-probs are vLLM's
    processed ones: the per-token ratio to the sampler is 1 after renormalising and the kept mass S before (so TRL's
    sequence IS ratio, S^T alone, is 1), and gap/kept/source says the sampler's own sets (1)."""
    gap = GapConfig(arm="A", kept="renormalize", kept_source="sampling_mask", probe_rows=0)
    trainer, fake = mask_run(tmp_path, gap, MASK_SAMPLING, train=False, prompts=EQUAL, max_steps=2)
    assert trainer._gap_session.state.settings.kept_source == "sampling_mask"
    assert fake.llm.llm_engine.vllm_config.model_config.return_sampling_mask is True
    scorer = trainer._gap_session.scorer
    scorer.vllm_kept_sets = lambda *a, **k: pytest.fail("the re-deriving pass ran with the mask")
    seen: list = []
    aligned = scorer.mask_kept_sets
    scorer.mask_kept_sets = lambda output: (aligned(output), seen.append({k: output[k].clone() for k in (
        "gap_kept_ids", "gap_kept_sizes", "completion_ids", "completion_mask")}))[0]
    batches = _spy_batches(trainer)
    trainer.train()
    assert len(seen) == len(fake.outputs) >= 1
    for got, outputs in zip(seen, fake.outputs):
        completions = [c for r in outputs for c in r.outputs]
        assert len(completions) == got["completion_ids"].shape[0]
        for row, completion in enumerate(completions):
            rows = completion.sampling_mask.token_ids
            assert len(rows) == len(completion.token_ids) == int(got["completion_mask"][row].sum())
            for t, ids in enumerate(rows):
                used = got["gap_kept_ids"][row, t]
                assert used[used >= 0].tolist() == sorted(ids) and int(got["gap_kept_sizes"][row, t]) == len(ids)
            assert (got["gap_kept_ids"][row, len(rows):] == -1).all()
    first = logs_of(trainer)[0]
    assert first["gap/kept/source"] == 1.0
    assert first["gap/kept/ratio_before_mean"] == pytest.approx(first["gap/kept/mass_mean"], abs=1e-5)
    assert first["gap/kept/ratio_before_mean"] < 0.95 and first["gap/kept/ratio_after_mean"] == pytest.approx(1.0, abs=1e-5)
    assert first["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-4)
    batch = batches[0]
    mask = batch["completion_mask"].bool()
    assert (batch["old_per_token_logps"] - batch["sampling_per_token_logps"])[mask].abs().max() < 1e-5


def test_sampling_mask_measure_leaves_training_alone(tmp_path, vllm_031, trains):
    """gap.kept: measure with the mask changes nothing in training (losses and gradient norms bitwise those of plain
    TRL on the same draws) and finds the kept mass the re-truncating run finds on the same draws (same model)."""
    plain, _ = vllm_run(tmp_path / "plain", None, MASK_SAMPLING, prompts=EQUAL, max_steps=2)
    masked, _ = mask_run(tmp_path / "mask", GapConfig(arm="A", kept="measure", kept_source="sampling_mask"),
                         MASK_SAMPLING, prompts=EQUAL, max_steps=2)
    retrunc, _ = mask_run(tmp_path / "re", GapConfig(arm="A", kept="measure", kept_source="retruncate"),
                          MASK_SAMPLING, prompts=EQUAL, max_steps=2)
    assert masked._gap_session.state.settings.kept_source == "sampling_mask"
    assert retrunc._gap_session.state.settings.kept_source == "retruncate"
    steps = [(h["loss"], h["grad_norm"]) for h in logs_of(plain)]
    assert [(h["loss"], h["grad_norm"]) for h in logs_of(masked)] == steps
    assert [(h["loss"], h["grad_norm"]) for h in logs_of(retrunc)] == steps
    a, b = logs_of(masked)[0], logs_of(retrunc)[0]
    assert (a["gap/kept/source"], b["gap/kept/source"]) == (1.0, 2.0)
    assert a["gap/kept/mass_mean"] == pytest.approx(b["gap/kept/mass_mean"], abs=1e-5) and a["gap/kept/mass_mean"] < 0.95
    assert a["gap/kept/size_mean"] == pytest.approx(b["gap/kept/size_mean"], rel=0.02)


NO_MASK_CASES = {
    "top_k_0": ({"top_p": 0.8}, {}, None, "top_k is 0: vLLM returns no sampling mask without top_k > 0; set top_k: 1024"),
    "runner_v1": (MASK_SAMPLING, {"VLLM_USE_V2_MODEL_RUNNER": "0"}, None, "model runner V1"),
    "old_vllm": (MASK_SAMPLING, {}, "0.26.0", "vLLM 0.26.0 has no return_sampling_mask (vLLM >= 0.28.0)"),
    "unreadable_engine": (MASK_SAMPLING, {}, None, "built without return_sampling_mask=True (its settings cannot be read)"),
}


def _no_mask_setup(monkeypatch, case):
    sampling, env, version, expected = NO_MASK_CASES[case]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if version is not None:
        import bloggap_plugin.core.vllm.versions as versions

        monkeypatch.setattr(versions, "installed_vllm", lambda: version)
    return sampling, expected


@pytest.mark.parametrize("case", sorted(NO_MASK_CASES))
def test_kept_source_auto_falls_back_to_retruncation_saying_why(tmp_path, monkeypatch, vllm_031, case, trains):
    sampling, expected = _no_mask_setup(monkeypatch, case)
    trainer, fake = mask_run(tmp_path, GapConfig(arm="A", kept="measure"), sampling, train=False,
                             engine=case != "unreadable_engine", max_steps=1)
    assert trainer._gap_session.state.settings.kept_source == "retruncate"
    said = [w for w in fake.warnings if "gap.kept_source: auto re-truncates" in w]
    assert len(said) == 1 and expected in said[0] and "gap.kept_source: retruncate" in said[0]
    if case != "unreadable_engine":
        assert fake.llm.llm_engine.vllm_config.model_config.return_sampling_mask is False
    if case == "top_k_0":  # and the run trains on re-truncated sets
        trainer.train()
        assert logs_of(trainer)[0]["gap/kept/source"] == 2.0


@pytest.mark.parametrize("case", sorted(NO_MASK_CASES))
def test_kept_source_sampling_mask_refuses_in_one_line(tmp_path, monkeypatch, vllm_031, case, trains):
    sampling, expected = _no_mask_setup(monkeypatch, case)
    with pytest.raises(RecipeError) as err:
        mask_run(tmp_path, GapConfig(arm="A", kept="measure", kept_source="sampling_mask"), sampling, train=False,
                 engine=case != "unreadable_engine", max_steps=1)
    text = str(err.value)
    assert "\n" not in text and text.startswith("gap.kept_source: sampling_mask: ") and expected in text
    assert text.endswith("gap.kept_source: retruncate")


def test_auto_builds_without_the_mask_where_vllm_refuses_it(tmp_path, monkeypatch, vllm_031, trains):
    """vLLM picks model runner V1 by itself (unset VLLM_USE_V2_MODEL_RUNNER; e.g. a model V2 does not support): it
    refuses return_sampling_mask while building its config; auto builds the engine without it and falls back."""
    monkeypatch.setattr(vllm_031, "default_runner", "v1")
    trainer, fake = mask_run(tmp_path, GapConfig(arm="A", kept="measure"), MASK_SAMPLING, train=False, max_steps=1)
    assert fake.llm.return_sampling_mask is False
    assert fake.llm._bloggap_sampling_mask_refused == "sampling distribution replay requires Model Runner V2"
    assert trainer._gap_session.state.settings.kept_source == "retruncate"
    with pytest.raises(RecipeError, match=r"^gap.kept_source: sampling_mask: vLLM refused return_sampling_mask"):
        mask_run(tmp_path / "required", GapConfig(arm="A", kept="measure", kept_source="sampling_mask"),
                 MASK_SAMPLING, train=False, max_steps=1)


def test_renormalize_with_beta_is_refused_with_the_mask_too(tmp_path, vllm_031, trains):
    with pytest.raises(RecipeError, match="renormalize.*beta.*vLLM"):
        mask_run(tmp_path, GapConfig(arm="A", kept="renormalize", kept_source="sampling_mask"), MASK_SAMPLING,
                 train=False, beta=0.04, model_name=saved_model_dir(tmp_path))


@pytest.mark.parametrize("arm, sampling", [("G", MASK_SAMPLING), ("E", MASK_SAMPLING), ("C", {"top_k": 5}),
                                           ("C", {"top_k": 30, "min_p": 0.05})])
def test_sampling_mask_renormalizes_in_other_arms_and_truncations(tmp_path, vllm_031, arm, sampling, trains):
    """The mask's ids travel with TRL's batch through the shuffle (arm G scores after it) and into the plans' scoring
    (E), under top_k alone and with min_p: the ratio in the loss is 1 after renormalising."""
    trainer, _ = mask_run(tmp_path, GapConfig(arm=arm, kept="renormalize", kept_source="sampling_mask"), sampling,
                          max_steps=1)
    first = logs_of(trainer)[0]
    assert first["gap/kept/source"] == 1.0
    assert first["gap/sampler/is_ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert first["gap/kept/ratio_after_mean"] == pytest.approx(1.0, abs=1e-5)
