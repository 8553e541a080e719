"""benchmarks.bi_matmul's CPU parts: the layers it times, the table it builds from measured cases, and the tile
table it derives from them."""

from __future__ import annotations

import json

from _support.stand_in_matmul import stand_in_kernel

from benchmarks import bi_matmul
from bloggap_plugin.core.vllm.tile_table import ShapeTiles, TileShape
from bloggap_plugin.measure import matmul_tiles


def test_linear_shapes_are_vllms_merged_layers_of_the_156b_shape():
    shapes = bi_matmul.linear_shapes("llama-1.56b-v49k")
    # hidden 2048, 32 heads of 64, 8 KV heads, intermediate 8192, 24 layers, vocabulary 49152
    assert shapes == [("qkv", 3072, 2048, 24), ("o", 2048, 2048, 24), ("gate_up", 16384, 2048, 24),
                      ("down", 2048, 8192, 24), ("lm_head", 49152, 2048, 1)]


def test_a_model_folders_config_gives_its_shapes(tmp_path):
    # SmolLM2-135M's widths: hidden 576, 9 heads of 64, 3 KV heads, intermediate 1536, 30 layers, vocabulary 49152
    (tmp_path / "config.json").write_text('{"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, '
                                          '"intermediate_size": 1536, "num_hidden_layers": 30, "vocab_size": 49152}')
    assert bi_matmul.linear_shapes(str(tmp_path)) == [("qkv", 960, 576, 30), ("o", 576, 576, 30),
                                                      ("gate_up", 3072, 576, 30), ("down", 576, 1536, 30),
                                                      ("lm_head", 49152, 576, 1)]


def test_each_block_k_has_one_reference_and_vllms_is_the_64_one():
    references = matmul_tiles.family_references(matmul_tiles.CONFIGS)
    assert references[64] == "vllm" and matmul_tiles.CONFIGS["vllm"] == matmul_tiles.VLLM_BF16
    assert references[128] == "k128m128n128w8s3" and references[32] == "k32"


def _case(layer, rows, count, us, equal, n=48, k=40):
    return {"layer": layer, "n": n, "k": k, "rows": rows, "count": count, "us": us, "equal": equal}


CONFIG_VALUES = {"vllm": matmul_tiles.VLLM_BF16, "fast": matmul_tiles._config(64, 32, 64, 4, 4),
                 "k128": matmul_tiles._config(128, 128, 128, 8, 3), "k128small": matmul_tiles._config(16, 64, 128, 4, 4)}


def test_summary_sums_time_times_calls_and_divides_by_vllms():
    cases = [_case("qkv", 32, 24, {"vllm": 10.0, "fast": 5.0, "cublas": 4.0},
                   {"vllm": True, "fast": True, "cublas": False}),
             _case("lm_head", 32, 1, {"vllm": 60.0, "fast": 60.0, "cublas": 30.0},
                   {"vllm": True, "fast": False, "cublas": False})]
    table = bi_matmul.summary_table({"configs": ["vllm", "fast"], "config_values": CONFIG_VALUES,
                                     "cases": {"s": cases}}, "T-x")
    rows = {row[1]: row for row in table["rows"]}
    # vLLM's: 24 x 10 + 60 = 300 us; fast: 24 x 5 + 60 = 180 us -> 0.6; cuBLAS 24 x 4 + 30 = 126 -> 0.42
    assert rows["vllm"][2:] == [64, "2/2", 1.0, 300.0]
    assert rows["fast"][2:] == [64, "1/2", 0.6, 300.0]
    assert rows["cublas"][2:] == [None, "0/2", 0.42, 300.0]
    assert table["columns"][4:] == ["linears x vLLM's, M=32", "vLLM's linears us, M=32"]


def test_a_configuration_missing_a_case_has_no_forward_time():
    cases = [_case("o", 8, 2, {"vllm": 1.0}, {"vllm": True})]
    assert bi_matmul.forward_us(cases, "other", 8) is None
    assert bi_matmul.forward_us(cases, "vllm", 8) == 2.0


def _results(cases):
    return {"configs": list(CONFIG_VALUES), "config_values": CONFIG_VALUES, "cases": {"s": cases}}


def test_the_derived_table_takes_per_shape_the_family_with_the_least_time_and_its_fastest_config_per_m():
    everything = {name: True for name in CONFIG_VALUES}
    cases = [  # shape 48x40: the 64 family's fast config wins at M=1, vLLM's at M=512; the 128 family is slower
        _case("o", 1, 1, {"vllm": 10.0, "fast": 4.0, "k128": 12.0, "k128small": 9.0}, everything),
        _case("o", 512, 1, {"vllm": 20.0, "fast": 30.0, "k128": 25.0, "k128small": 40.0}, everything),
        # shape 96x40: the 128 family is faster at both M, but k128small differs from its reference at M=512
        _case("up", 1, 1, {"vllm": 10.0, "fast": 9.0, "k128": 6.0, "k128small": 3.0}, everything, n=96),
        _case("up", 512, 1, {"vllm": 20.0, "fast": 19.0, "k128": 10.0, "k128small": 8.0},
              everything | {"k128small": False}, n=96),
        # shape 16x40: nothing beats vLLM's
        _case("down", 1, 1, {"vllm": 1.0, "fast": 2.0, "k128": 3.0, "k128small": 3.0}, everything, n=16),
    ]
    table = matmul_tiles.derive_tiles(_results(cases))
    assert table == {
        (48, 40): ShapeTiles(64, ((1, TileShape(64, 32, 4, 4)), (512, TileShape(128, 128, 8, 3)))),
        # k128small is out (not bit-identical at every M), so k128 serves both buckets: 6/10 + 10/20 < 9/10 + 19/20
        (96, 40): ShapeTiles(128, ((1, TileShape(128, 128, 8, 3)), (512, TileShape(128, 128, 8, 3)))),
    }


def test_no_table_entry_without_a_configuration_identical_at_every_m():
    cases = [_case("o", 1, 1, {"vllm": 10.0, "fast": 1.0, "k128": 1.0, "k128small": 1.0},
                   {"vllm": True, "fast": False, "k128": False, "k128small": True}),
             _case("o", 8, 1, {"vllm": 10.0, "fast": 1.0, "k128": 1.0, "k128small": 1.0},
                   {"vllm": True, "fast": True, "k128": True, "k128small": False})]
    assert matmul_tiles.derive_tiles(_results(cases)) == {}


def test_a_shape_vllm_tunes_itself_is_left_to_vllm():
    everything = {name: True for name in CONFIG_VALUES}
    cases = [_case("o", 1, 1, {"vllm": 10.0, "fast": 4.0, "k128": 12.0, "k128small": 9.0}, everything),
             _case("o", 8, 1, {"vllm": 10.0, "fast": 4.0, "k128": 12.0, "k128small": 9.0}, everything)]
    assert (48, 40) in matmul_tiles.derive_tiles(_results(cases))
    cases[1]["vllm_function_equal"] = False  # vLLM's own matmul_persistent launched another configuration here
    assert matmul_tiles.derive_tiles(_results(cases)) == {}


def test_the_harness_compares_each_configuration_on_the_first_rows_of_one_input(monkeypatch):
    """measure_shape's flow on the CPU: a stand-in kernel whose K-step-64 family gives vLLM's bits and whose other
    K steps round differently, and a clock that says which configuration is fast."""
    from bloggap_plugin.core.vllm import tile_table as tiles

    module = stand_in_kernel(monkeypatch, fast={"m64n32w4s4", "m16n64w4s4"})  # the second is fast and wrong
    cases, logged = [], []
    bi_matmul.measure_shape(module, "tiny-llama", [1, 4], 3, logged.append, cases, device="cpu")
    assert [(c["layer"], c["rows"]) for c in cases] == [(layer, m) for layer in ("qkv", "o", "gate_up", "down",
                                                                                   "lm_head") for m in (1, 4)]
    assert len(logged) == 10 and all(c["vllm_function_equal"] for c in cases)
    # the 64 family and each other family's reference against itself: equal; a K-step-128 member rounds like its
    # reference here, so equal too; cuBLAS (F.linear in bf16 on the CPU) is compared with vLLM's bits
    differ = {"m16n64w4s4", "m16n128w4s4"}  # the stand-in rounds their K-step-64 sums unlike vLLM's
    assert all(c["equal"][name] for c in cases for name in matmul_tiles.CONFIGS if name not in differ)
    assert not any(c["equal"][name] for c in cases for name in differ)
    table = matmul_tiles.derive_tiles({"configs": list(matmul_tiles.CONFIGS), "config_values": matmul_tiles.CONFIGS,
                                    "cases": {"tiny-llama": cases}})
    fast = tiles.TileShape(64, 32, 4, 4)
    assert table[(2048, 128)] == tiles.ShapeTiles(64, ((1, fast), (4, fast)))  # the LM head of tiny-llama
    assert len(table) == 5


def test_the_summary_table_is_a_valid_result_table(tmp_path):
    # run_main writes the document after every case; on the GPU machine its first write failed validation
    # (the table had no random_init key), so no T25 and no tile table came back
    from bloggap_plugin.results import ResultDocument

    cases = [_case("qkv", 32, 24, {"vllm": 10.0, "fast": 5.0, "cublas": 4.0},
                   {"vllm": True, "fast": True, "cublas": False})]
    results = {"configs": ["vllm", "fast"], "config_values": CONFIG_VALUES, "cases": {"s": cases}}
    table = bi_matmul.summary_table(results, "T-x")
    path = tmp_path / "bi_matmul.json"
    ResultDocument("bi_matmul", {"gpu": "test"}, {"shapes": ["s"]}, results, [table]).write(path)
    assert json.loads(path.read_text())["tables"][0]["rows"] == table["rows"]
    assert table["random_init"] is True  # random bf16 operands, no trained weights


def test_run_writes_a_valid_t25_and_a_tile_table_this_gpu_loads(monkeypatch, tmp_path):
    """run_main end to end on the CPU: the stand-in kernel and clock (:func:`_support.stand_in_matmul.stand_in_kernel`), the GPU and vLLM
    faked by name; what the GPU machine returns (the result document after each case, then the tile table) must
    load."""
    import functools

    import torch

    from bloggap_plugin import envinfo
    from bloggap_plugin.core.vllm import kernels
    from bloggap_plugin.core.vllm import tile_table as tiles
    from bloggap_plugin.results import validate_result

    module = stand_in_kernel(monkeypatch, fast={"m64n32w4s4"})
    monkeypatch.setattr(bi_matmul, "_kernel_module", lambda: module)
    monkeypatch.setattr(bi_matmul, "measure_shape", functools.partial(bi_matmul.measure_shape, device="cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Stand-in GPU")
    monkeypatch.setattr(envinfo, "environment_record", lambda device=None, **extra: {"gpu": "Stand-in GPU", **extra})
    monkeypatch.setattr(kernels, "vllm_layout", lambda: ("0.26.0", None))
    out, tiles_out = tmp_path / "bi_matmul.json", tmp_path / "tiles.json"
    assert bi_matmul.main(["run", "--shape", "tiny-llama", "--rows", "1,4", "--reps", "2", "--out", str(out),
                           "--tiles-out", str(tiles_out), "--revision", "abc1234"]) == 0
    document = json.loads(out.read_text())
    validate_result(document, out)
    (table,) = document["tables"]
    assert table["id"] == "T25-bi-matmul-configs" and len(document["results"]["cases"]["tiny-llama"]) == 10
    rows = {row[1]: row for row in table["rows"]}
    assert rows["vllm"][3] == "10/10" and rows["m64n32w4s4"][4:6] == [0.5, 0.5]  # 5 us against vLLM's 10 us
    fast = tiles.TileShape(64, 32, 4, 4)
    assert tiles.load_tiles(tiles_out, gpu="Stand-in GPU")[(2048, 128)] == tiles.ShapeTiles(64, ((1, fast), (4, fast)))


def test_a_family_that_only_ties_vllms_configuration_is_not_chosen():
    """Every configuration as fast as vLLM's: nothing beats it at any M, so the shape stays with vLLM's launch. A
    family with a smaller K step sorts before vLLM's 64 and used to win the tie, giving a table that changes the
    shape's bits for no time."""
    values = CONFIG_VALUES | {"k32": matmul_tiles._config(128, 128, 32, 8, 4)}
    same = {name: 10.0 for name in values}
    cases = [_case("o", m, 1, dict(same), {name: True for name in values}) for m in (1, 8)]
    assert matmul_tiles.derive_tiles({"configs": list(values), "config_values": values, "cases": {"s": cases}}) == {}
    # a strictly faster K-32 configuration is still chosen
    cases[0]["us"]["k32"] = 5.0
    table = matmul_tiles.derive_tiles({"configs": list(values), "config_values": values, "cases": {"s": cases}})
    assert table[(48, 40)].block_k == 32
