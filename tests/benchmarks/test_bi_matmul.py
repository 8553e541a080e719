"""benchmarks.bi_matmul's CPU parts: the layers it times and the table it builds from measured cases."""

from __future__ import annotations

import pytest

from benchmarks import bi_matmul

pytestmark = pytest.mark.unit


def test_linear_shapes_are_vllms_merged_layers_of_the_156b_shape():
    shapes = bi_matmul.linear_shapes("llama-1.56b-v49k")
    # hidden 2048, 32 heads of 64, 8 KV heads, intermediate 8192, 24 layers, vocabulary 49152
    assert shapes == [("qkv", 3072, 2048, 24), ("o", 2048, 2048, 24), ("gate_up", 16384, 2048, 24),
                      ("down", 2048, 8192, 24), ("lm_head", 49152, 2048, 1)]


def _case(layer, rows, count, us, equal):
    return {"layer": layer, "rows": rows, "count": count, "us": us, "equal": equal}


def test_summary_sums_time_times_calls_and_divides_by_vllms():
    cases = [_case("qkv", 32, 24, {"vllm": 10.0, "fast": 5.0, "cublas": 4.0}, {"vllm": True, "fast": True,
                                                                              "cublas": False}),
             _case("lm_head", 32, 1, {"vllm": 60.0, "fast": 60.0, "cublas": 30.0}, {"vllm": True, "fast": False,
                                                                                 "cublas": False})]
    table = bi_matmul.summary_table({"configs": ["vllm", "fast"], "cases": {"s": cases}}, "T-x")
    rows = {row[1]: row for row in table["rows"]}
    # vLLM's: 24 x 10 + 60 = 300 us; fast: 24 x 5 + 60 = 180 us -> 0.6; cuBLAS 24 x 4 + 30 = 126 -> 0.42
    assert rows["vllm"][2:] == ["2/2", 1.0, 300.0]
    assert rows["fast"][2:] == ["1/2", 0.6, 300.0]
    assert rows["cublas"][2:] == ["0/2", 0.42, 300.0]
    assert table["columns"][3:] == ["linears x vLLM's, M=32", "vLLM's linears us, M=32"]


def test_a_configuration_missing_a_case_has_no_forward_time():
    cases = [_case("o", 8, 2, {"vllm": 1.0}, {"vllm": True})]
    assert bi_matmul.forward_us(cases, "other", 8) is None
    assert bi_matmul.forward_us(cases, "vllm", 8) == 2.0
