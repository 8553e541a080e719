"""Fused sync and the TF32 plan option on a CUDA GPU (GPU machine only; skipped without CUDA):

    python -m pytest -m gpu tests/core/test_gpu_precision.py

On a CPU the TF32 setting computes nothing differently and cuBLAS's check of the two TF32 APIs never runs; here the
plan's forward really runs cuBLAS fp32 matmuls under the caller's states that torch >= 2.9 can reach.
"""

from __future__ import annotations

import pytest
import torch

from bloggap_plugin.core.model_parts import param_pairs
from bloggap_plugin.core.plans import make_plan
from bloggap_plugin.models import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _rows(vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (4, 48), generator=generator).to(device)
    return ids, torch.ones_like(ids)


@pytest.mark.parametrize("arm", ["fp32", "fp16"])
def test_fused_sync_is_bitwise_the_copy_loop_on_cuda(arm):
    policy, _ = load_model("tiny-random-qwen2", dtype="bf16", device="cuda")  # tied embeddings
    plan = make_plan(policy, arm)
    loop = make_plan(policy, arm)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.01)
        plan.sync(policy)
        for dst, src in param_pairs(loop.shadow, policy):
            dst.copy_(src)
    for (name, a), b in zip(plan.shadow.named_parameters(), loop.shadow.parameters(), strict=True):
        assert torch.equal(a, b), name


def _settings() -> tuple:
    out = []
    for get in (torch._C._get_float32_matmul_precision, lambda: torch.backends.cuda.matmul.fp32_precision,
                lambda: torch.backends.fp32_precision):
        try:
            out.append(get())
        except RuntimeError:
            out.append("unreadable")
    return tuple(out)


@pytest.mark.parametrize("caller", ["default", "legacy", "transformers"])
def test_tf32_option_changes_the_plan_not_the_process(caller):
    policy, _ = load_model("tiny-random-llama", dtype="fp32", device="cuda")
    ids, mask = _rows(policy.config.vocab_size, "cuda")
    saved = torch._C._get_float32_matmul_precision(), torch.backends.fp32_precision
    try:
        if caller == "legacy":
            torch.backends.cuda.matmul.allow_tf32 = True
        elif caller == "transformers":
            torch.backends.fp32_precision = "tf32"  # transformers' enable_tf32(True) on torch >= 2.9
        before = _settings()
        ieee = make_plan(policy, "fp32", tf32=False).token_logprobs(ids, mask, 24)
        assert _settings() == before
        tf32 = make_plan(policy, "fp32", tf32=True).token_logprobs(ids, mask, 24)
        assert _settings() == before
        auto = make_plan(policy, "fp32", tf32="auto")
        assert auto.tf32 is (torch.cuda.get_device_capability()[0] >= 8)
        if auto.tf32:
            assert not torch.equal(ieee, tf32), "TF32 made no difference: did cuBLAS pick non-TF32 kernels?"
            assert torch.equal(auto.token_logprobs(ids, mask, 24), tf32)
        assert (ieee - tf32).abs().max() < 1e-2
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.fp32_precision = saved[1]
