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
    batches: list = []
    prepare = trainer._prepare_inputs

    def spy(generation_batch):
        inputs = prepare(generation_batch)
        batches.append({k: v.clone() for k, v in inputs.items() if torch.is_tensor(v)})
        return inputs

    trainer._prepare_inputs = spy
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
    assert not any("gap/old_vs_trl/oob_frac" in h for h in logs_of(after))
    for got, ref in zip(logs_of(after), logs_of(before), strict=True):
        for _, key in PAIRS:
            if key in ref:
                assert got[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-7), key
