"""benchmarks/arm_j_pieces.py on CPU with the plain-torch stand-ins for vLLM's kernels: a row's fields, the
piece-by-piece backward (one wrapped piece per kernel call of the forward), and the table against arm A."""

from __future__ import annotations

import pytest
import torch

from bloggap_plugin.core.vllm_form import TORCH_KERNELS, parse_form


@pytest.fixture()
def script():
    import benchmarks.arm_j_pieces

    return benchmarks.arm_j_pieces


def _batch():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 90, (4, 30), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[2, :2] = 0
    return ids, mask


def test_every_form_parses(script):
    assert script.FORMS["J (all)"] == "all"
    for spec in script.FORMS.values():
        parse_form(spec)


def test_arm_js_row_equals_its_old_log_probs_and_times_one_backward_piece_per_kernel_call(tiny_model, script):
    model, _ = tiny_model()
    model = type(model)(model.config)
    layers = model.config.num_hidden_layers
    ids, mask = _batch()
    row = script.measure_form(model, ids, mask, 8, "all", TORCH_KERNELS, 1, torch.device("cpu"), by_piece=True)
    assert row["equals_old_logprobs"] is True
    assert row["total_s"] == row["forward_s"] + row["backward_s"] > 0
    # per layer: q/k/v, o, gate/up, down linears; q and k RoPE; the prefill and decode attention calls; one
    # activation; two norms (layer 0's first in batch-invariant mode is one launch, the others in step launches,
    # each one piece), then the final norm, the head and the log-prob
    assert row["backward_by_piece"]["calls"] == {
        "linear_formula": 4 * layers + 1, "rotary_formula": 2 * layers, "flash_paged_formula": 2 * layers,
        "silu_and_mul_formula": layers, "rms_norm_formula": 1, "over_launches": 2 * layers,
        "token_logprobs_formula": 1}
    assert all(p.grad is None for p in model.parameters())  # the benchmark leaves no gradients behind


def test_table_gives_each_form_against_arm_a(script):
    results = {"arm A": {"forward_s": 0.1, "backward_s": 0.3, "total_s": 0.4},
               "J (all)": {"forward_s": 0.2, "backward_s": 0.7, "total_s": 0.9, "spec": "all",
                           "equals_old_logprobs": True}}
    table = script.table(results)
    assert table["id"] == "T16-armJ-pieces"
    assert table["rows"] == [["arm A", "TRL's forward, bf16 autocast", 0.1, 0.3, 0.4, 1.0, None],
                             ["J (all)", "all", 0.2, 0.7, 0.9, 2.25, True]]
