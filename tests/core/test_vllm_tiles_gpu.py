"""core.vllm.tile_table on a GPU with vLLM: a table installed in vLLM's batch-invariant module keeps every row's bits
independent of the rows beside it, and ``linear_batch_invariant`` (what the engine's layers and the arms' vLLM-form
passes call) goes through it. GPU machine only: ``pytest -m gpu tests/core/test_vllm_tiles_gpu.py``."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture
def batch_invariant_module():
    from bloggap_plugin.core.vllm.kernels import persistent_matmul_module

    module = persistent_matmul_module()
    if module is None:
        pytest.skip("needs vLLM with its batch-invariant Triton kernels")
    return module


@pytest.mark.parametrize("block_k", [64, 128])
def test_rows_keep_their_bits_whatever_bucket_serves_the_call(batch_invariant_module, block_k):
    from bloggap_plugin.core.vllm.tile_table import ShapeTiles, TileShape, install_tiles

    n, k = 3072, 2048
    # the largest tile's stages fit Hopper's 227 KiB of shared memory per block: bf16 (128 x K + K x 256) x stages
    # is 144 KiB at K 64 with 3 stages, 192 KiB at K 128 with 2 (with 3, 288 KiB: Triton asked for 320 KiB and
    # raised OutOfResources)
    stages = 3 if block_k == 64 else 2
    buckets = ((1, TileShape(16, 64, 4, 4)), (32, TileShape(64, 32, 4, 4)), (512, TileShape(128, 256, 8, stages)))
    uninstall = install_tiles(batch_invariant_module, {(n, k): ShapeTiles(block_k, buckets)})
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        weight = (torch.randn((n, k), device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        full = torch.randn((1000, k), device="cuda", generator=gen).to(torch.bfloat16)
        everything = batch_invariant_module.matmul_persistent(full, weight.t())  # the 512 bucket's tiles
        for rows in (1, 7, 32, 100, 600):
            part = batch_invariant_module.matmul_persistent(full[:rows].contiguous(), weight.t())
            assert torch.equal(part, everything[:rows]), f"rows={rows}"
        via_linear = batch_invariant_module.linear_batch_invariant(full[:7], weight)
        assert torch.equal(via_linear, everything[:7])
    finally:
        uninstall()
    if block_k == 64:  # vLLM's own configuration shares the K step: the same bits as without the table
        assert torch.equal(batch_invariant_module.matmul_persistent(full, weight.t()), everything)
