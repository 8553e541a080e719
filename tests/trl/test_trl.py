"""GapMixin / GapCallback / GapGRPOTrainer in real TRL 1.16 GRPO runs on tiny random models (CPU)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

pytest.importorskip("trl")

from _support.trl_runs import Spy, count_no_grad_scoring_rows, first_log, logs_of, make  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from bloggap_plugin.core.scoring import token_logprobs  # noqa: E402
from bloggap_plugin.models import load_model  # noqa: E402
from bloggap_plugin.recipes import GapConfig, RecipeError  # noqa: E402
from bloggap_plugin.trl import GapCallback, UnsupportedTRLError, check_trl  # noqa: E402
from bloggap_plugin.trl.mixin import is_ratio  # noqa: E402

ALWAYS = [
    "gap/ratio/oob_frac", "gap/ratio/abs_dlogp_mean", "gap/ratio/abs_dlogp_max", "gap/clip/flip_frac",
    "gap/clip/clipped_frac", "gap/probe/oob_b1_vs_bN", "gap/sampler/oob_frac", "gap/sampler/abs_dlogp_mean",
    "gap/fp16/fallbacks", "gap/time/scoring_s", "gap/time/overhead_frac", "gap/time/generate_s",
]
KEPT = [
    "gap/kept/mass_mean", "gap/kept/mass_min", "gap/kept/size_mean", "gap/kept/size_max",
    "gap/kept/ratio_before_mean", "gap/kept/ratio_after_mean",
]


@pytest.mark.parametrize("arm", ["A", "B", "C", "D", "E", "F", "G", "H"])
def test_every_arm_trains_with_all_metrics(tmp_path, arm, trains):
    gap = GapConfig(arm=arm, probe_rows=8, layers=[1] if arm == "D" else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make(tmp_path, gap, dtype="bf16" if arm != "F" else "fp32", fp16=arm == "H", trainer_cls=Spy)
        trainer.train()
    assert any((batch["prompt_mask"] == 0).any() for batch in trainer.spied)  # left-padded prompts
    logs = logs_of(trainer)
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    first = logs[0]
    for key in ALWAYS:
        assert first.get(key) is not None, f"{key} missing for arm {arm}"
    for key in ("gap/ratio/oob_frac", "gap/clip/flip_frac", "gap/clip/clipped_frac", "gap/probe/oob_b1_vs_bN",
                "gap/sampler/oob_frac", "gap/time/overhead_frac"):
        assert 0.0 <= first[key] <= 1.0, (key, first[key])
    assert first["gap/ratio/abs_dlogp_max"] >= first["gap/ratio/abs_dlogp_mean"] >= 0.0
    assert first["gap/fp16/fallbacks"] >= 0 and first["gap/time/scoring_s"] > 0
    # second step: reused generation (num_iterations 2) after the first step's update: the update's ratio, apart
    assert logs[1].get("gap/update/oob_frac") is not None and "gap/ratio/oob_frac" not in logs[1]
    assert logs[1].get("gap/update_clip/clipped_frac") is not None and "gap/clip/clipped_frac" not in logs[1]


def count_prompt_padding(trainer) -> list:
    """Append, per teacher-forced forward of the policy, the number of padding tokens in its input."""
    padding: list = []

    def hook(module, args, kwargs):
        if "labels" in kwargs or kwargs.get("use_cache") is False:
            padding.append(int((kwargs["attention_mask"] == 0).sum()))

    trainer.model.register_forward_pre_hook(hook, with_kwargs=True)
    return padding


def test_arm_A_with_metrics_is_bitwise_plain_trl(tmp_path, trains):
    """Metrics on (sampler, probe rows, fp32 reference) must not change training at all."""
    runs = {}
    for mode in ("plain", "trainer", "callback"):
        torch.manual_seed(1234)
        trainer = make(tmp_path / mode, GapConfig(arm="A", probe_rows=8) if mode != "plain" else None, mode=mode,
                       dtype="bf16", max_steps=3)
        widths = count_prompt_padding(trainer)
        trainer.train()
        assert any(widths), mode  # left-padded prompts in the run
        runs[mode] = (
            [(h["loss"], h["grad_norm"]) for h in logs_of(trainer)],
            [p.detach().clone() for p in trainer.model.parameters()],
            torch.get_rng_state(),
        )
    assert "gap/sampler/oob_frac" in logs_of(trainer)[0]
    for mode in ("trainer", "callback"):
        assert runs[mode][0] == runs["plain"][0], mode
        assert all(torch.equal(a, b) for a, b in zip(runs[mode][1], runs["plain"][1], strict=True)), mode
        assert torch.equal(runs[mode][2], runs["plain"][2]), mode


@pytest.mark.parametrize(("arm", "dtype"), [("B", "fp32"), ("F", "fp16"), ("E", None)])
def test_old_logprobs_equal_independent_recomputation(tmp_path, arm, dtype, trains):
    gap = GapConfig(arm=arm, probe_rows=0, sampler=False)
    trainer = make(tmp_path, gap, dtype="bf16", trainer_cls=Spy, max_steps=1)
    trainer.train()
    batch = trainer.spied[0]
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    width = batch["completion_ids"].shape[1]
    # a separately loaded copy of the policy's (bf16) weights, converted to the arm's precision
    independent, _ = load_model("tiny-random-llama", dtype="bf16")
    if dtype is not None:
        independent.to({"fp32": torch.float32, "fp16": torch.float16}[dtype])
    else:  # E: bf16 body, fp32 final norm and LM head
        independent.model.norm.float()
        independent.lm_head.float()
        independent.model.norm.register_forward_pre_hook(lambda module, args: (args[0].float(),))
    with torch.no_grad():
        expected = token_logprobs(independent, ids, attn, width, batch_size=4, positions="mask")
    mask = batch["completion_mask"].bool()
    got = batch["old_per_token_logps"]
    trl_old = batch["gap_trl_old_logps"]
    assert torch.equal(got[mask], expected[mask])
    assert not torch.equal(got[mask], trl_old[mask])  # it really replaced TRL's bf16 values


def test_arm_G_ratio_exactly_one_in_fp32(tmp_path, trains):
    trainer = make(tmp_path, GapConfig(arm="G", probe_rows=4), dtype="fp32", max_steps=1)
    trainer.train()
    first = first_log(trainer)
    assert first["gap/ratio/exact_frac"] == 1.0
    assert first["gap/ratio/abs_dlogp_max"] == 0.0 and first["gap/ratio/oob_frac"] == 0.0
    # the same run scored pre-shuffle in TRL's chunks is not bit-exact against the training forward
    other = make(tmp_path / "c", GapConfig(arm="C", probe_rows=4), dtype="fp32", max_steps=1)
    other.train()
    assert first_log(other)["gap/ratio/exact_frac"] < 1.0


def run_G(tmp_path, skip: bool, mode="trainer", **overrides):
    """Arm G (probe_rows 0: no probe pass) with TRL's old pass skipped (the default) or kept (``skip=False``: the
    behaviour before G replaced it, where G's scores were installed over TRL's)."""
    from bloggap_plugin.trl.stats import Stats

    with pytest.MonkeyPatch.context() as patch:
        if not skip:
            patch.setattr(Stats, "trl_computes_old", lambda self: False)
        torch.manual_seed(1234)
        gap = GapConfig(arm="G", probe_rows=0) if mode != "plain" else None
        trainer = make(tmp_path, gap, mode=mode, dtype="fp32", max_steps=4, **overrides)
        rows = count_no_grad_scoring_rows(trainer)
        trainer.train()
    return trainer, rows


@pytest.fixture(scope="module")
def plain_G_rows(tmp_path_factory, trains) -> list:
    """The grad-free scoring rows of plain TRL in :func:`run_G`'s setting, shared by the arm G tests."""
    return run_G(tmp_path_factory.mktemp("plain_G"), True, mode="plain")[1]


def test_arm_G_replaces_trls_old_pass(tmp_path, plain_G_rows, trains):
    """G scores each micro-batch in place of TRL's old-logprob pass: as many grad-free rows as plain TRL (no probe
    rows), where keeping TRL's pass doubled them; losses, grad norms and weights bitwise those of the double-pass run."""
    plain_rows = plain_G_rows
    after, after_rows = run_G(tmp_path / "after", True)
    before, before_rows = run_G(tmp_path / "before", False)
    assert sum(plain_rows) == 2 * 8  # two generations of 8 rows (num_iterations 2, accumulation 2)
    assert sum(after_rows) == sum(plain_rows) and len(after_rows) == len(plain_rows)
    assert sum(before_rows) == 2 * sum(plain_rows)
    losses = [[(h["loss"], h["grad_norm"]) for h in logs_of(t)] for t in (before, after)]
    assert len(losses[0]) == 4 and losses[1] == losses[0]
    for a, b in zip(after.model.parameters(), before.model.parameters(), strict=True):
        assert torch.equal(a, b)
    logs = logs_of(after)
    assert logs[0]["gap/ratio/exact_frac"] == 1.0  # G's ratio at the first inner epoch
    assert "gap/old_vs_trl/oob_frac" not in logs[0] and "gap/old_vs_trl/oob_frac" in logs_of(before)[0]
    assert logs[0]["gap/time/old_pass_s"] > 0 and logs[1]["gap/time/old_pass_s"] == 0.0  # step 2 reuses the batch
    assert logs[0]["gap/time/generate_s"] > 0 and logs[1]["gap/time/generate_s"] == 0.0  # HF generate's seconds


def test_arm_G_extra_passes_are_the_gated_probes(tmp_path, plain_G_rows, trains):
    """With probe rows, G's grad-free rows beyond plain TRL's are exactly the probe passes of probed generations:
    probe_every 2 probes generation 1 of 2: 4 rows of the live batch-1 probe on the policy, 4 rows of the fp32
    batch-1 reference on its own shadow."""
    plain_rows = plain_G_rows
    torch.manual_seed(1234)
    trainer = make(tmp_path / "g", GapConfig(arm="G", probe_rows=4, probe_every=2), dtype="fp32", max_steps=4)
    rows = count_no_grad_scoring_rows(trainer)
    reference_rows: list = []
    trainer._gap_session.scorer.reference_plan().shadow.register_forward_pre_hook(
        lambda module, args, kwargs: reference_rows.append(int(kwargs["input_ids"].shape[0])), with_kwargs=True)
    trainer.train()
    assert sum(rows) == sum(plain_rows) + 4 and rows.count(1) == 4  # policy: TRL's rows + the live probe
    assert reference_rows == [1, 1, 1, 1]


def test_arm_G_measure_only_pass_follows_metrics_every(tmp_path, trains):
    """TRL computes no old log-probs (num_iterations 1): G's scoring is a metrics pass, run on measured generations
    only (metrics_every 2: generations 1 and 3 of 4), and the loss is plain TRL's."""
    plain, plain_rows = run_G(tmp_path / "plain", True, mode="plain", num_iterations=1)
    torch.manual_seed(1234)
    trainer = make(tmp_path / "g", GapConfig(arm="G", probe_rows=0, metrics_every=2), dtype="fp32", max_steps=4,
                   num_iterations=1)
    rows = count_no_grad_scoring_rows(trainer)
    trainer.train()
    # one generation per optimizer step (8 rows, scored in micro-batches of 4); two of the four measured
    assert sum(plain_rows) == 0 and rows == [4] * 4
    assert [h["loss"] for h in logs_of(trainer)] == [h["loss"] for h in logs_of(plain)]
    assert [h.get("gap/ratio/exact_frac") for h in logs_of(trainer)] == [1.0, None, 1.0, None]


@pytest.mark.parametrize("tf32", [True, False, "auto"])
def test_gap_tf32_reaches_the_arm_plan_not_the_reference(tmp_path, tf32):
    trainer = make(tmp_path, GapConfig(arm="B", tf32=tf32), dtype="bf16", max_steps=1)
    expected = tf32 is True  # auto on a CPU: IEEE fp32
    assert trainer._gap_session.state.resources.plan.tf32 is expected
    reference = trainer._gap_session.scorer.reference_plan()
    assert reference.tf32 is False and (reference is trainer._gap_session.state.resources.plan) == (not expected)


def test_measure_only_when_trl_computes_no_old_logprobs(tmp_path, trains):
    """num_iterations 1 (ratio identically 1 in TRL): arm B measures but the loss is plain TRL's."""
    losses = []
    for gap in (None, GapConfig(arm="B", probe_rows=4), GapConfig(arm="B", probe_rows=4, force_old_logprobs=True)):
        trainer = make(tmp_path, gap, mode="plain" if gap is None else "trainer", dtype="bf16", num_iterations=1,
                       max_steps=1)
        trainer.train()
        losses.append(first_log(trainer)["loss"])
        if gap is not None:
            assert first_log(trainer)["gap/ratio/oob_frac"] is not None
    assert losses[1] == losses[0]
    assert losses[2] != losses[0]  # forced: the fp32 old log-probs enter the ratio


def test_kept_renormalize_at_top_p(tmp_path, trains):
    gap = GapConfig(arm="C", probe_rows=4, kept="renormalize")
    trainer = make(tmp_path, gap, dtype="fp32", top_p=0.8)
    trainer.train()
    logs = logs_of(trainer)
    assert all(math.isfinite(h["loss"]) for h in logs)
    first = logs[0]
    for key in KEPT:
        assert first.get(key) is not None, key
    assert 0.0 < first["gap/kept/mass_min"] <= first["gap/kept/mass_mean"] < 1.0
    assert first["gap/kept/size_max"] >= first["gap/kept/size_mean"] >= 1.0
    # fp32 trainer vs fp32 sampler: before = the kept mass, after = 1
    assert abs(first["gap/kept/ratio_before_mean"] - first["gap/kept/mass_mean"]) < 1e-3
    assert abs(first["gap/kept/ratio_after_mean"] - 1.0) < 1e-4
    assert first["gap/sampler/oob_frac"] == 0.0  # old log-probs are renormalised, so they match the sampler
    measured = make(tmp_path / "m", GapConfig(arm="C", probe_rows=4, kept="measure"), dtype="fp32", top_p=0.8,
                    max_steps=1)
    measured.train()
    assert first_log(measured)["gap/sampler/oob_frac"] > 0.0  # without the fix: ratio = S, out of band


def test_is_ratio_matches_trl_formula():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -0.1, -3.0]])
    sampler = torch.tensor([[-1.1, -1.0, -0.5], [-0.2, -0.6, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    diff = (old - sampler) * mask
    seq = is_ratio(old, sampler, mask, "sequence_mask", None, 3.0)
    expected = torch.exp(diff.sum(-1, keepdim=True))
    assert torch.equal(seq, expected.masked_fill(expected > 3.0, 0.0))
    tok = is_ratio(old, sampler, mask, "token_truncate", 0.5, 2.0)
    assert torch.equal(tok, torch.exp(diff).clamp(0.5, 2.0))


def test_is_correction_on_hf_path_trains(tmp_path, trains):
    gap = GapConfig(arm="A", probe_rows=0, is_correction=True)
    trainer = make(tmp_path, gap, dtype="bf16", vllm_importance_sampling_mode="token_truncate", max_steps=1)
    trainer.train()
    assert math.isfinite(first_log(trainer)["loss"])


def test_unsupported_trl_version_and_missing_method(tmp_path, monkeypatch):
    import trl

    monkeypatch.setattr(trl, "__version__", "1.9.0")
    with pytest.raises(UnsupportedTRLError, match=r"supports trl 1\.16\.x.*found trl 1\.9\.0"):
        check_trl()
    trainer = make(tmp_path, None, mode="plain")
    with pytest.raises(UnsupportedTRLError, match="1.16"):
        GapCallback(trainer, gap=GapConfig())
    assert "_gap_originals" not in trainer.__dict__  # nothing half-installed
    with pytest.warns(UserWarning, match="found trl 1.9.0"):
        check_trl(strict=False)
    monkeypatch.setattr(trl, "__version__", "1.16.0")
    monkeypatch.delattr(GRPOTrainer, "_generate_single_turn")
    with pytest.raises(UnsupportedTRLError, match="GRPOTrainer._generate_single_turn is missing"):
        check_trl()


def test_bad_attach_errors(tmp_path):
    trainer = make(tmp_path, None, mode="plain")
    with pytest.raises(RecipeError, match="needs fp16: true"):
        GapCallback(trainer, gap=GapConfig(arm="H"))
    with pytest.raises(RecipeError, match=r"\[5\] out of range; this model has 2 decoder layers"):
        GapCallback(trainer, gap=GapConfig(arm="D", layers=[5]))
    GapCallback(trainer, gap=GapConfig(arm="A"))
    with pytest.raises(RuntimeError, match="already attached"):
        GapCallback(trainer, gap=GapConfig(arm="A"))


def test_callback_recipe_warns_about_grpo_fields(tmp_path):
    from _support import ROOT

    trainer = make(tmp_path, None, mode="plain")
    recipe = ROOT / "recipes" / "arm_G.yaml"
    with pytest.warns(UserWarning, match=r"only the gap: section applies.*per_device_train_batch_size"):
        callback = GapCallback(trainer, recipe=recipe)
    assert callback.gap.arm == "G"


@pytest.mark.parametrize("probe_every, expected", [(1, [True, True]), (2, [True, False])])
def test_probe_every_gates_the_extra_forwards(tmp_path, probe_every, expected, trains):
    """The fp32 reference and live probe run on generations 1, 1 + N, ...; the cheap metrics on every one."""
    gap = GapConfig(arm="A", probe_rows=4, probe_every=probe_every, probe_budget=0.0)
    trainer = make(tmp_path, gap, max_steps=4)  # num_iterations 2, accumulation 2: a new generation every 2 steps
    assert _probed_generations(trainer) == expected
    sampler_logged = [h for h in logs_of(trainer) if h.get("gap/sampler/oob_frac") is not None]
    assert len(sampler_logged) == 2  # both generations measured without the probe


def _probed_generations(trainer) -> list[bool]:
    """Train ``trainer``; per generation, whether the fp32 reference (the probe) ran."""
    probed = []
    original = trainer._gap_session.scorer.reference_plan

    def spy():
        probed[-1] = True
        return original()

    original_next = trainer._gap_next

    def next_impl(name, *args, **kwargs):
        if name == "_generate_and_score_completions":
            probed.append(False)
        return original_next(name, *args, **kwargs)

    trainer._gap_session.scorer.reference_plan = spy
    trainer._gap_next = next_impl
    trainer.train()
    return probed


@pytest.mark.parametrize("budget, expected", [(0.0, [True] * 4), (1.0, [True] * 4), (1e-12, [True, False, False, False])])
def test_probe_budget_caps_the_probe_share_of_training_time(tmp_path, budget, expected, trains):
    """gap.probe_budget: a due probe runs while the probe's time so far is within the budget's share of the
    training time so far; the first always runs; 0 = no cap. A probe costs far more than 1e-12 of a step and far
    less than all of it, so 1e-12 allows only the first and 1.0 all four."""
    gap = GapConfig(arm="A", probe_rows=4, probe_every=1, probe_budget=budget)
    trainer = make(tmp_path, gap, max_steps=8)  # a new generation every 2 steps: 4 generations
    assert _probed_generations(trainer) == expected
    logged = [h for h in logs_of(trainer) if h.get("gap/probe/oob_b1_vs_bN") is not None]
    assert len(logged) == sum(expected)  # the live batch-1 probe follows the same decision as the reference
    assert len([h for h in logs_of(trainer) if h.get("gap/sampler/oob_frac") is not None]) == 4


def test_probe_budget_must_not_be_negative():
    with pytest.raises(RecipeError, match=r"gap.probe_budget must be >= 0"):
        GapConfig(arm="A", probe_budget=-0.01).validate()


def test_arm_d_auto_layers_follow_process_zero(tmp_path, trains):
    """Arm D without layer ids: every process uses the layers process 0 chose (here: a forced disagreement)."""
    gap = GapConfig(arm="D", probe_rows=0, k=1)
    trainer = make(tmp_path, gap, dtype="bf16", max_steps=1)
    seen = []

    def agree(layers):
        seen.append(list(layers))
        return [1] if layers != [1] else [0]  # process 0 "chose" the other layer

    trainer._gap_session.scorer.agree_layers = agree
    trainer.train()
    assert len(seen) == 1
    assert trainer._gap_session.state.resources.plan.stats()["layers"] == ([1] if seen[0] != [1] else [0])


@pytest.mark.parametrize(("arm", "kept"), [("A", "measure"), ("B", "measure"), ("C", "renormalize")])
def test_score_chunk_tokens_tiles_change_nothing(tmp_path, row_invariant_linear, arm, kept, trains):
    """gap.score_chunk_tokens tiles the plugin's scoring (A: the kept-mass pass through TRL's model; B: the
    plan's old log-probs and kept mass; C + renormalize: the old and the training forward, entropy included):
    with a row-count-invariant matmul (conftest) the run is identical to the untiled one, step for step."""
    runs = {}
    for chunk in (0, 12):  # 12 tokens over 4 rows: tiles of 3 positions (3, 3, 2 for 8 completion tokens)
        torch.manual_seed(0)
        trainer = make(tmp_path / str(chunk), GapConfig(arm=arm, probe_rows=4, kept=kept, score_chunk_tokens=chunk),
                       dtype="fp32", top_p=0.8)
        widths = []
        shadow = getattr(trainer._gap_session.state.resources.plan, "shadow", None)  # arm B scores with its fp32 copy's head
        head = (shadow if shadow is not None else trainer.model).lm_head
        hook = head.register_forward_pre_hook(lambda mod, args, widths=widths: widths.append(args[0].shape[1]))
        trainer.train()
        hook.remove()
        runs[chunk] = (logs_of(trainer), [p.detach().clone() for p in trainer.model.parameters()], widths)
    assert not any(w in (2, 3) for w in runs[0][2])  # generation calls the head on 1 position at a time
    assert any(w == 3 for w in runs[12][2]) and any(w == 2 for w in runs[12][2])  # tiles of 3, 3, 2
    untiled_logs, tiled_logs = runs[0][0], runs[12][0]
    assert len(untiled_logs) == len(tiled_logs) == 2
    assert "gap/kept/mass_mean" in untiled_logs[0]
    for step, (untiled, tiled) in enumerate(zip(untiled_logs, tiled_logs)):
        keys = {k for k in untiled if "time" not in k and "runtime" not in k and "per_second" not in k}
        assert keys == {k for k in tiled if "time" not in k and "runtime" not in k and "per_second" not in k}
        for key in keys:
            a, b = untiled[key], tiled[key]
            if isinstance(a, float) and math.isnan(a):
                assert math.isnan(b), key
            elif kept == "renormalize" and (step > 0 or key == "grad_norm"):
                # the tiled training forward sums the head's weight gradient tile by tile (see below): the
                # gradient norm and everything after the first update agree to rounding only
                assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-8), (key, a, b)
            else:
                assert a == b, (key, a, b)
    if kept == "measure":  # only grad-free passes are tiled: training is bit for bit the same
        assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[12][1], strict=True))
    else:  # the training forward is tiled too: the head's weight gradient is summed tile by tile (same values,
        # another order of the sum over positions), so the weights agree to the last bits only
        diff = max((a - b).abs().max().item() for a, b in zip(runs[0][1], runs[12][1], strict=True))
        assert diff <= 1e-6, diff  # measured: 7.5e-9


def test_named_statistics_round_trip_and_the_shared_masks():
    """GapState's statistics keep their reduction order through to_tensor/from_tensor (the multi-process test reads
    them by position); completion_mask applies tool_mask where present; fit_width pads and cuts the width."""
    from bloggap_plugin.trl.state import GenerationMaxima, LossSums, completion_mask, fit_width

    sums = LossSums(oob=2.0, tokens=8.0, has_trl=1.0)
    assert list(sums) == [2.0, 8.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0] and len(sums) == 10
    assert LossSums.from_tensor(sums.to_tensor("cpu") * 2) == LossSums(oob=4.0, tokens=16.0, has_trl=2.0)
    maxima = GenerationMaxima()
    maxima.raise_to(is_max=3.0)
    maxima.raise_to(is_max=1.0, kept_size_max=5.0)
    assert list(maxima) == [-math.inf, 5.0, -math.inf, 3.0, -math.inf]
    batch = {"completion_mask": torch.tensor([[1, 1, 0]]), "tool_mask": None}
    assert torch.equal(completion_mask(batch), torch.tensor([[1, 1, 0]]))
    batch["tool_mask"] = torch.tensor([[1, 0, 1]])
    assert torch.equal(completion_mask(batch), torch.tensor([[1, 0, 0]]))
    x = torch.tensor([[1, 2], [3, 4]])
    assert torch.equal(fit_width(x, 3, fill=-1), torch.tensor([[1, 2, -1], [3, 4, -1]]))
    assert torch.equal(fit_width(x, 1), torch.tensor([[1], [3]]))


HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero")


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts the tensor operations that read a value back to the host (on CUDA each waits for the GPU)."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.reads.append(name)
        if name == "__getitem__" and len(args) > 1 and torch.is_tensor(args[1]) and args[1].dtype == torch.bool:
            self.reads.append("bool-index")  # the result's size needs the mask's count on the host
        return func(*args, **(kwargs or {}))


def _expected_loss_metrics(trainer, inputs, new, old, group: str = "ratio") -> dict:
    """One micro-batch's loss-time metrics from their definitions (DESIGN.md), by boolean selection, in float64;
    the ratio's statistics under ``gap/<group>/`` (ratio: no optimizer step since the old log-probs; update), the
    clip statistics under ``gap/clip/`` or ``gap/update_clip/`` alike."""
    from bloggap_plugin.core.metrics import trl_clip_status

    mask = inputs["completion_mask"].bool()
    band = trainer._gap_session.state.config.band
    d = new.double() - old.double()
    sel = d[mask]
    ratio = sel.exp()
    out = {f"gap/{group}/oob_frac": float(((ratio < 1 - band) | (ratio > 1 + band) | ~sel.isfinite()).sum()) / sel.numel(),
           f"gap/{group}/abs_dlogp_mean": float(sel.abs().sum()) / sel.numel(),
           f"gap/{group}/abs_dlogp_max": float(sel.abs().max()),
           f"gap/{group}/exact_frac": float((sel == 0).sum()) / sel.numel()}

    def clip(log_ratio, rows_mask, advantages):
        return trl_clip_status(log_ratio, advantages, rows_mask, loss_type=trainer.loss_type,
                               level=trainer.importance_sampling_level, eps_low=trainer.epsilon_low,
                               eps_high=trainer.epsilon_high, delta=trainer.args.delta)

    clip_group = "clip" if group == "ratio" else "update_clip"
    clipped = clip(new - old, mask, inputs["advantages"])
    out[f"gap/{clip_group}/clipped_frac"] = float(clipped[mask].sum()) / sel.numel()
    rows = [i for i, chosen in enumerate(inputs["gap_probe_row"].tolist()) if chosen]
    if rows:
        ref = inputs["gap_ref_logps"][rows].float()
        status = clip(new[rows] - ref, mask[rows], inputs["advantages"][rows])
        out[f"gap/{clip_group}/flip_frac"] = float((status != clipped[rows])[mask[rows]].sum()) / float(mask[rows].sum())
    trl_old = inputs["gap_trl_old_logps"].double()
    vs = old.double()[mask] - trl_old[mask]
    out["gap/old_vs_trl/oob_frac"] = float(((vs.exp() < 1 - band) | (vs.exp() > 1 + band)).sum()) / sel.numel()
    out["gap/old_vs_trl/abs_dlogp_mean"] = float(vs.abs().sum()) / sel.numel()
    return out


def test_loss_metrics_read_the_device_once_per_micro_batch_and_follow_their_definitions(tmp_path, monkeypatch, trains):
    """Each host read of a CUDA tensor waits for the GPU, and with several runs sharing one (the H200 reward sweep:
    8 at once) every wait is long: arm A's plugin time there was 0.11 s on optimizer steps with no generation at
    all (the loss-time metrics of two micro-batches). They are computed on the device and read with one transfer per
    micro-batch; their values are the definitions computed here by boolean selection (arm B on a bf16 model, so
    ratios differ from 1; TRL's own old log-probs beside the arm's; the first generation's probe rows)."""
    from bloggap_plugin.trl.stats import Stats

    original = Stats.loss_metrics
    seen = []

    def counted(self, inputs):
        new, old = self.state.new_logps, self.old_of(inputs)
        # calls 1-2: the generation's first iteration; 3-4: its second, after the first optimizer step
        expected = _expected_loss_metrics(self.trainer, inputs, new, old, "ratio" if len(seen) < 2 else "update")
        before = {key: len(values) for key, values in self.trainer._metrics["train"].items()}
        with _HostReads() as mode:
            original(self, inputs)
        logged = {key: values[-1] for key, values in self.trainer._metrics["train"].items()
                  if key in expected and len(values) > before.get(key, 0)}
        seen.append((mode.reads, expected, logged))

    monkeypatch.setattr(Stats, "loss_metrics", counted)
    torch.manual_seed(0)
    trainer = make(tmp_path, GapConfig(arm="B"), dtype="bf16", bf16=True, max_steps=2)
    trainer.train()
    assert len(seen) == 4  # 2 optimizer steps x 2 micro-batches
    assert any("gap/clip/flip_frac" in expected or "gap/update_clip/flip_frac" in expected for _, expected, _ in seen)
    assert any(expected.get("gap/ratio/oob_frac", expected.get("gap/update/oob_frac")) > 0 for _, expected, _ in seen)
    for reads, expected, logged in seen:
        assert reads == ["tolist"], reads
        assert logged.keys() == expected.keys()
        for key, value in expected.items():
            assert logged[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key


def test_generation_metrics_read_the_device_once_per_generation_off_probe_generations(tmp_path, monkeypatch, trains):
    """The generation-time statistics (sampler gap, IS ratio, kept sets) accumulate on the device and are read back
    once, when the generation is flushed; only generations with probe rows (1 in ``probe_every``) read more, to pick
    and score those rows. Arm A records generate's log-probs; arm G measures every micro-batch after the shuffle."""
    from bloggap_plugin.trl.stats import Stats

    reads: dict[str, list[int]] = {}

    def counting(name):
        original = getattr(Stats, name)

        def counted(self, *args, **kwargs):
            with _HostReads() as mode:
                result = original(self, *args, **kwargs)
            reads.setdefault(name, []).append((self.probe_due(), len(mode.reads)))
            return result

        monkeypatch.setattr(Stats, name, counted)

    counting("generation_metrics")
    counting("flush_generation")
    for arm in "AG":
        reads.clear()
        make(tmp_path / arm, GapConfig(arm=arm, probe_every=2, probe_budget=0.0), max_steps=8).train()  # 4 generations, 2 probed
        flushes = reads["flush_generation"]
        assert [due for due, _ in flushes] == [True, False, True, False] and all(n == 1 for _, n in flushes), arm
        off_probe = [n for due, n in reads["generation_metrics"] if not due]
        assert off_probe and all(n == 0 for n in off_probe), (arm, reads)


def test_flip_frac_counts_the_probed_micro_batches_only(tmp_path, trains):
    """One probe row per generation of 8 rows in two micro-batches: one micro-batch has no probe token. Its share is
    undefined and must not enter the logged mean (it made every such window NaN, logged as None); a window
    without any probed micro-batch logs no flip_frac at all."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make(tmp_path, GapConfig(arm="A", probe_rows=1), max_steps=4)
        trainer.train()
    logged = [h[key] for h in logs_of(trainer) for key in ("gap/clip/flip_frac", "gap/update_clip/flip_frac") if key in h]
    assert logged and all(value is not None and math.isfinite(value) for value in logged), logged
