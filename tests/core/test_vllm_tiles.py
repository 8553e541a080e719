"""core.vllm.tile_table on CPU: the table's file format and its refusals, the bucket rule, and the dispatcher installed in
a stand-in of vLLM's batch-invariant module (a kernel that records its launch and computes the product in fp32)."""

from __future__ import annotations

import json
import types

import pytest
import torch

from bloggap_plugin.core.vllm import tile_table as tiles

SMALL, LARGE = tiles.TileShape(64, 32, 4, 4), tiles.TileShape(128, 256, 8, 3)


def _table() -> dict:
    return {(48, 40): tiles.ShapeTiles(64, ((32, SMALL), (512, LARGE)))}


def test_a_call_takes_the_first_bucket_that_holds_its_rows_and_the_last_above_them():
    shape = _table()[(48, 40)]
    assert shape.for_rows(1)["BLOCK_SIZE_M"] == 64 and shape.for_rows(32)["BLOCK_SIZE_N"] == 32
    assert shape.for_rows(33) == {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8,
                                  "num_warps": 8, "num_stages": 3}
    assert shape.for_rows(10_000) == shape.for_rows(512)
    # BLOCK_SIZE_K is the shape's for every row count: what keeps a row's bits independent of the batch
    assert {shape.for_rows(m)["BLOCK_SIZE_K"] for m in (1, 32, 33, 4096)} == {64}
    assert tiles.config_for(_table(), 8, 48, 41) is None


def test_the_file_round_trips_and_keeps_other_keys_out_of_the_table(tmp_path):
    path = tmp_path / "tiles.json"
    path.write_text(tiles.dump_tiles(_table(), gpu="H200", source="bi_matmul.json"))
    assert json.loads(path.read_text())["tiles"] == {"48x40": {"block_k": 64, "m_buckets": [[32, [64, 32, 4, 4]],
                                                                                         [512, [128, 256, 8, 3]]]}}
    assert tiles.load_tiles(path) == _table() == tiles.load_tiles(path, gpu="H200")
    with pytest.raises(tiles.TilesError, match="measured on H200, and this process runs on H100: measure this GPU's"):
        tiles.load_tiles(path, gpu="H100")


@pytest.mark.parametrize(("text", "message"), [
    ("{", "not JSON"),
    ('{"tiles": {}}', "'tiles' maps 'NxK' shapes"),
    ('{"tiles": {"48-40": {"block_k": 64, "m_buckets": [[1, [64, 32, 4, 4]]]}}}', "shape key '48-40' is not 'NxK'"),
    ('{"tiles": {"48x40": {"block_k": 0, "m_buckets": [[1, [64, 32, 4, 4]]]}}}', "block_k must be a positive"),
    ('{"tiles": {"48x40": {"block_k": 64, "m_buckets": []}}}', "no m_buckets"),
    ('{"tiles": {"48x40": {"block_k": 64, "m_buckets": [[1, [64, 32, 4]]]}}}', "a bucket is [max_rows,"),
    ('{"tiles": {"48x40": {"block_k": 64, "m_buckets": [[8, [64, 32, 4, 4]], [8, [64, 32, 4, 4]]]}}}',
     "ascend by max_rows without repeats"),
])
def test_a_bad_table_is_refused_naming_what_is_wrong(tmp_path, text, message):
    path = tmp_path / "tiles.json"
    path.write_text(text)
    with pytest.raises(tiles.TilesError, match=f"BLOGGAP_VLLM_MATMUL_TILES={path}.*{message}".replace("[", r"\[")):
        tiles.load_tiles(path)


def test_a_missing_file_names_the_command_that_writes_one(tmp_path):
    with pytest.raises(tiles.TilesError, match="cannot read it .* bloggap tiles --out wrote"):
        tiles.load_tiles(tmp_path / "absent.json")


class _Kernel:
    """Stands in for ``matmul_kernel_persistent[grid](...)``: records each launch, writes ``a @ b (+ bias)``."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        def run(a, b, c, bias, m, n, k, *strides, **meta):
            self.launches.append((grid, meta))
            c.copy_((a.float() @ b.float() + (0 if bias is None else bias.float())).to(c.dtype))
        return run


@pytest.fixture
def module(monkeypatch):
    monkeypatch.setattr(tiles, "sm_count", lambda index: 4)
    calls = []

    def original(a, b, bias=None):
        calls.append(a.shape)
        return (a @ b) if bias is None else (a @ b + bias)

    return types.SimpleNamespace(matmul_persistent=original, matmul_kernel_persistent=_Kernel(), calls=calls)


def test_the_dispatcher_launches_the_tables_configuration_and_leaves_other_calls_to_vllm(module):
    original = module.matmul_persistent
    uninstall = tiles.install_tiles(module, _table())
    a, weight = torch.randn(40, 40, dtype=torch.bfloat16), torch.randn(48, 40, dtype=torch.bfloat16)
    out = module.matmul_persistent(a, weight.t())
    assert torch.equal(out, (a.float() @ weight.t().float()).to(torch.bfloat16))
    grid, meta = module.matmul_kernel_persistent.launches[-1]
    # 40 rows -> the 512 bucket: 1 x 1 tiles of 128 x 256, so one program
    assert grid == (1,) and meta["BLOCK_SIZE_M"] == 128 and meta["NUM_SMS"] == 4 and meta["HAS_BIAS"] is False
    module.matmul_persistent(a[:3], weight.t())
    grid, meta = module.matmul_kernel_persistent.launches[-1]
    assert meta["BLOCK_SIZE_N"] == 32 and grid == (2,)  # 1 x 2 tiles of 64 x 32 for 48 columns
    assert module.calls == []
    module.matmul_persistent(a, torch.randn(40, 16, dtype=torch.bfloat16))  # a shape the table lacks
    module.matmul_persistent(a.float(), weight.t().float())  # not bf16
    assert module.calls == [(40, 40), (40, 40)] and len(module.matmul_kernel_persistent.launches) == 2
    assert tiles.installed_tiles(module) == _table()
    uninstall()
    assert module.matmul_persistent is original and tiles.installed_tiles(module) is None


def test_installing_again_replaces_the_table_and_keeps_vllms_function_to_restore(module):
    original = module.matmul_persistent
    tiles.install_tiles(module, _table())
    other = {(48, 40): tiles.ShapeTiles(64, ((1, LARGE),))}
    uninstall = tiles.install_tiles(module, other)
    assert module.matmul_persistent.__wrapped__ is original and tiles.installed_tiles(module) == other
    uninstall()
    assert module.matmul_persistent is original
