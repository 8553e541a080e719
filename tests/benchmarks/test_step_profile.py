"""The step-profile summary on a profile text in torch.profiler's table layout (values typed here, not produced by
the code under test): kernels summed by family, ops and annotated ranges left out, totals and units read."""

from __future__ import annotations

import pytest

from benchmarks import step_profile

_RULE = "-" * 55 + "  " + "  ".join(["-" * 12] * 10) + "  "


def _row(name: str, self_cpu: str, self_cuda: str, calls: int) -> str:
    cells = ["1.00%", self_cpu, "1.00%", self_cpu, "1.0us", self_cuda, "1.00%", self_cuda, "1.0us", str(calls)]
    return f"{name:>55}  " + "  ".join(f"{c:>12}" for c in cells) + "  "


PROFILE = "\n".join([
    "steps 10-11, by self_cuda_time_total",
    _RULE,
    _row("Name", "Self CPU", "Self CUDA", 0).replace(" 0  ", " # of Calls  "),
    _RULE,
    _row("aten::mm", "74.322ms", "881.557ms", 776),
    _row("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x256_...", "0.000us", "265.607ms", 192),
    _row("matmul_kernel_persistent", "0.000us", "260.377ms", 3590),
    _row("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize256x12...", "0.000us", "255.941ms", 96),
    _row("Optimizer.step#AdamW.step", "0.000us", "30.359ms", 2),
    _row("void at::native::(anonymous namespace)::multi_tensor...", "0.000us", "30.043ms", 154),
    _row("fmha_cutlassB_f32_aligned_64x64_k64_sm80(PyTorchMemE...", "0.000us", "30.678ms", 96),
    _row("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "0.000us", "26.339ms", 480),
    _row("void vllm::act_and_mul_kernel<c10::BFloat16, __nv_bf...", "0.000us", "3.907ms", 24),
    _RULE,
    "Self CPU time total: 1.787s",
    "Self CUDA time total: 1.000s",
    "",
    "by cpu_time_total",
    _row("void at::native::elementwise_kernel<128, 4, at::nati...", "0.000us", "999.000ms", 1),
])


def test_kernels_are_summed_by_family_and_ops_left_out():
    summary = step_profile.summarize(PROFILE)
    assert summary["steps"] == "10-11"
    assert summary["device_ms"] == 1000.0 and summary["host_ms"] == 1787.0
    assert summary["families"] == {
        "fp32 GEMM": {"ms": pytest.approx(265.607 + 255.941), "calls": 192 + 96},
        "batch-invariant Triton matmul": {"ms": 260.377, "calls": 3590},
        "optimizer": {"ms": 30.043, "calls": 154},
        "attention": {"ms": 30.678, "calls": 96},
        "16-bit GEMM": {"ms": 26.339, "calls": 480},
        "other kernels": {"ms": 3.907, "calls": 24},
    }
    listed = 265.607 + 255.941 + 260.377 + 30.043 + 30.678 + 26.339 + 3.907
    assert summary["unlisted_ms"] == pytest.approx(1000.0 - listed, abs=1e-3)


def test_the_table_gives_each_family_its_share_of_the_device_time():
    table = step_profile.profile_table({"J": step_profile.summarize(PROFILE)}, "T-x")
    row = dict(zip(table["columns"], table["rows"][0]))
    assert table["id"] == "T-x" and row["run"] == "J" and row["device ms"] == 1000.0
    assert row["fp32 GEMM ms"] == 521.5 and row["fp32 GEMM %"] == 52.2
    assert row["elementwise, copies, reductions ms"] == 0.0


@pytest.mark.parametrize(("text", "ms"), [("1.787s", 1787.0), ("881.557ms", 881.557), ("72.5us", 0.0725)])
def test_durations(text, ms):
    assert step_profile.duration_ms(text) == pytest.approx(ms)


def test_a_text_that_is_not_a_device_profile_is_refused():
    with pytest.raises(ValueError, match="not a StepProfiler device profile"):
        step_profile.summarize("steps 1-2, by self_cpu_time_total\nSelf CPU time total: 1s\n")
    with pytest.raises(ValueError, match="not a profiler duration"):
        step_profile.duration_ms("12 ms")


@pytest.mark.parametrize("real", [False, True])
def test_collect_marks_the_table_random_init_unless_the_profiled_model_has_real_weights(tmp_path, real):
    """T31 profiled SmolLM2-135M (real weights): ``--real-weights`` says so; without it the table is random-init
    (T21's 1.56B shape)."""
    profile = tmp_path / "J.profile.txt"
    profile.write_text(PROFILE)
    env = tmp_path / "env.json"
    env.write_text('{"env": {"gpu": "a card"}}')
    out = tmp_path / "doc.json"
    step_profile.main(["collect", f"J={profile}", "--out", str(out), "--revision", "r", "--table-id", "T-x",
                       "--env", str(env), *(["--real-weights"] if real else [])])
    import json

    table = json.loads(out.read_text())["tables"][0]
    assert table["random_init"] is (not real) and table["rows"][0][0] == "J"
