"""A CPU stand-in for vLLM's batch-invariant matmul module and the device clock, for the tile measurement
(:mod:`bloggap_plugin.measure.matmul_tiles`) that ``bloggap tiles`` and ``benchmarks.bi_matmul`` run."""

from __future__ import annotations


def stand_in_kernel(monkeypatch, fast: set[str]):
    """Installed as ``tiles.launch``: a kernel whose K-step-64 family gives vLLM's bits and whose other K steps (and
    16-row tiles) round differently; the clock (``matmul_tiles.graph_us``) gives the configurations in ``fast`` 5 us
    and every other 10 us. Returns the stand-in module (``matmul_persistent``, ``matmul_kernel_persistent``)."""
    import torch

    from bloggap_plugin.core.vllm import tile_table as tiles
    from bloggap_plugin.measure import matmul_tiles

    def product(a, b, config):  # row by row, so a row's bits do not depend on the rows beside it (as a BLAS's may)
        out = torch.stack([(row.float()[:, None] * b.float()).sum(0) for row in a])
        if config["BLOCK_SIZE_K"] != 64 or config["BLOCK_SIZE_M"] == 16:  # 16-row tiles: another instruction
            out = out * (1 + 2 ** -7)
        return out.to(a.dtype)

    monkeypatch.setattr(tiles, "launch", lambda kernel, a, b, bias, config: product(a, b, config))
    monkeypatch.setattr(matmul_tiles, "graph_us", lambda fn, reps: 5.0 if any(
        fn.args[-1] is matmul_tiles.CONFIGS[name] for name in fast) else 10.0)  # partial(launch, ..., config)
    return type("BatchInvariant", (), {"matmul_persistent": staticmethod(lambda a, b, bias=None: product(
        a, b, matmul_tiles.VLLM_BF16)), "matmul_kernel_persistent": object()})
