"""``bloggap tiles --model MODEL --out FILE``: the tile table of vLLM's batch-invariant matmul for arms I and J,
measured on this GPU for the model's weight shapes; ``gap.matmul_tiles: FILE`` installs it.

Every configuration of :data:`~bloggap_plugin.measure.matmul_tiles.CONFIGS` runs on every linear layer of the model
(random bf16 operands of its shapes; the weights are not read) at each row count of ``--rows``, is compared bit for
bit with its ``BLOCK_SIZE_K`` family's reference and timed (:func:`~bloggap_plugin.measure.matmul_tiles.measure_linears`);
the table keeps, per weight shape, the family that is fastest while identical at every row count, with its fastest
configuration per row-count bucket (:func:`~bloggap_plugin.measure.matmul_tiles.derive_tiles`). A shape where vLLM's
own configuration is already the fastest exact one is left out; where every shape is, no table is written.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

from bloggap_plugin.commands._measured import configure_with
from bloggap_plugin.measure.matmul_tiles import DEFAULT_ROWS

HELP = ("Measure the tile table of vLLM's batch-invariant matmul for a model on this GPU "
        "(arms I and J install it with gap.matmul_tiles).")


@dataclass
class TilesConfig:
    """Settings of ``bloggap tiles`` (each field is a flag with the help text below)."""

    model: str = field(default="smollm2", metadata={
        "help": "model spec, as bloggap train's --model (a folder, a hub id in the local cache, smollm2); only its "
                "config's shapes are used"})
    out: str = field(default="", metadata={"help": "the tile table to write (JSON); gap.matmul_tiles names it"})
    rows: list[int] = field(default_factory=lambda: list(DEFAULT_ROWS), metadata={
        "help": "row counts measured, each a bucket of the table (decode batches, a prefill, a training step's "
                "tokens)"})
    reps: int = field(default=20, metadata={"help": "calls per CUDA graph when timing a configuration"})
    cases: str = field(default="", metadata={
        "help": "also write every measured case (bits and device time per configuration) as JSON to this path"})


configure = configure_with(TilesConfig)


def _linear_shapes(spec: str) -> list[tuple[str, int, int, int]]:
    from bloggap_plugin.core.errors import UsageError
    from bloggap_plugin.measure.matmul_tiles import linear_shapes
    from bloggap_plugin.models import model_config

    config = model_config(spec)
    try:
        return linear_shapes(config)
    except KeyError as err:
        raise UsageError(f"--model {spec}: its config has no {err.args[0]!r} at the top level (model_type "
                         f"{config.get('model_type')!r}); bloggap tiles reads a decoder config as Llama's and Qwen2's "
                         "are laid out") from None


def run(args: argparse.Namespace) -> int:
    import torch

    from bloggap_plugin._io import atomic_write_text, check_writable_file
    from bloggap_plugin.commands._measured import checked_config
    from bloggap_plugin.core.errors import UsageError
    from bloggap_plugin.core.vllm.kernels import persistent_matmul_module, vllm_layout
    from bloggap_plugin.core.vllm.tile_table import dump_tiles
    from bloggap_plugin.core.vllm.versions import form_install_hint
    from bloggap_plugin.measure import matmul_tiles

    config = checked_config(TilesConfig, args, ("reps",))
    if not config.out:
        raise UsageError("--out: give the file to write the tile table to (gap.matmul_tiles will name it)")
    if not config.rows or any(rows < 1 for rows in config.rows):
        raise UsageError(f"--rows {' '.join(map(str, config.rows))}: give one or more row counts, each >= 1")
    for path, flag in ((config.out, "--out"), (config.cases, "--cases")):
        problem = path and check_writable_file(path, flag)
        if problem:
            raise UsageError(problem)
    if not torch.cuda.is_available():
        raise UsageError("bloggap tiles measures on the CUDA GPU that will train (a table is refused on another "
                         "GPU), and no CUDA GPU is visible here")
    module = persistent_matmul_module()
    if module is None:
        raise UsageError(f"bloggap tiles needs vLLM's batch-invariant matmul, which this process's vLLM "
                         f"({vllm_layout()[0] or 'not importable'}) lacks: {form_install_hint()}")
    shapes = _linear_shapes(config.model)
    started = time.time()

    def log(message: str) -> None:
        print(f"[tiles {time.time() - started:5.0f}s] {message}", file=sys.stderr, flush=True)

    rows = sorted(set(config.rows))
    results = {"configs": list(matmul_tiles.CONFIGS), "config_values": matmul_tiles.CONFIGS, "cases": {}}
    matmul_tiles.measure_linears(module, config.model, shapes, rows, config.reps, log,
                                 results["cases"].setdefault(config.model, []))
    gpu, vllm = torch.cuda.get_device_name(), vllm_layout()[0]
    if config.cases:
        import json

        atomic_write_text(config.cases, json.dumps({"gpu": gpu, "vllm": vllm, "model": config.model, "rows": rows,
                                                    **results}, indent=1) + "\n")
    table = matmul_tiles.derive_tiles(results)
    if not table:
        print(f"no tile table written: on {gpu}, vLLM's own configuration is the fastest one that keeps vLLM's bits "
              f"for every weight shape of {config.model}; arms I and J need no gap.matmul_tiles here")
        return 0
    atomic_write_text(config.out, dump_tiles(table, gpu=gpu, vllm=vllm, source=f"bloggap tiles --model {config.model}"))
    for (n, k), tiles in sorted(table.items()):
        buckets = ", ".join(f"<={rows_max}: {tile.block_m}x{tile.block_n} w{tile.num_warps} s{tile.num_stages}"
                            for rows_max, tile in tiles.m_buckets)
        print(f"{n}x{k}: BLOCK_SIZE_K {tiles.block_k}; {buckets}")
    left = len({(n, k) for _, n, k, _ in shapes} - set(table))
    print(f"wrote {config.out} ({len(table)} weight shape(s); {left} left to vLLM's configuration): set "
          f"gap.matmul_tiles: {config.out} in the arm I or J recipe")
    return 0
