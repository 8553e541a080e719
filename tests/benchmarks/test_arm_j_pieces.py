"""benchmarks/arm_j_pieces.py on CPU with the plain-torch stand-ins for vLLM's kernels: a row's fields, the
piece-by-piece backward (one wrapped piece per kernel call of the forward), and the table against arm A."""

from __future__ import annotations

import json

import pytest
import torch
from _support import ROOT

from bloggap_plugin.core.vllm.form import TORCH_KERNELS, parse_form


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
        "silu_and_mul_formula": layers, "rms_norm_formula": 1, "rms_norm_over_launches": 2 * layers,
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


def test_the_attention_rows_time_each_backward_and_mark_the_plugins_per_call(tiny_model, script, monkeypatch):
    """The attention backwards on this micro-batch's prefill and decode calls (both formulas by autograd, and the
    closed form, given the decode call's rows as arm J's forward gives them): the rows carry their times and the
    difference from padded entries (to fp32 rounding: values and gradients are tested equal in
    tests/core/test_onpolicy_forward.py); "(the plugin's)" marks the closed form for both calls, and past
    DENSE_GRADIENT_ELEMENTS the formula flash_paged_formula picks (padded entries for the prefill, dense over the
    cache for the decode call)."""
    from bloggap_plugin.core.vllm import autograd as vllm_autograd

    model, _ = tiny_model()
    ids, mask = _batch()
    assert list(script.ATTENTION_FORMULAS) == ["padded entries", "dense over the cache", "closed form"]
    rows = script.attention_formula_rows(model, ids, mask, 8, torch.device("cpu"), 1)
    assert list(rows) == ["prefill: padded entries", "prefill: dense over the cache",
                          "prefill: closed form (the plugin's)", "decode: padded entries",
                          "decode: dense over the cache", "decode: closed form (the plugin's)"]
    assert all(row["max_abs_vs_padded"] <= 1e-5 and row["total_s"] > 0 for row in rows.values())
    assert rows["prefill: padded entries"]["max_abs_vs_padded"] == 0.0
    monkeypatch.setattr(vllm_autograd, "DENSE_GRADIENT_ELEMENTS", 0)
    rows = script.attention_formula_rows(model, ids, mask, 8, torch.device("cpu"), 1)
    assert [label for label in rows if label.endswith("(the plugin's)")] == [
        "prefill: padded entries (the plugin's)", "decode: dense over the cache (the plugin's)"]


def test_the_attention_table_is_built_from_its_rows(script):
    """Rows as attention_formula_rows writes them, and an earlier run's (its labels, max_abs_vs_plugin) alike."""
    rows = {"decode: dense over the cache (the plugin's)": {"forward_s": 0.001, "backward_s": 0.002,
                                                            "total_s": 0.003, "max_abs_vs_padded": 1.5e-7},
            "decode: dense over the cache": {"forward_s": 0.001, "backward_s": 0.002, "total_s": 0.003,
                                             "max_abs_vs_plugin": 4.17e-7}}
    doc = script.document({}, {}, {}, rows)
    assert doc["tables"][1]["id"] == "T16-armJ-attention"
    assert doc["tables"][1]["rows"] == [["decode: dense over the cache (the plugin's)", 0.001, 0.002, 0.003, 1.5e-07],
                                        ["decode: dense over the cache", 0.001, 0.002, 0.003, 4.17e-07]]
    assert len(script.document({}, {}, {})["tables"]) == 1


def test_backward_table_gives_each_piece_largest_first_and_what_ran_outside_them(script):
    results = {"arm A": {"forward_s": 0.1, "backward_s": 0.3, "total_s": 0.4},
               "J (all)": {"forward_s": 0.2, "backward_s": 0.7, "total_s": 0.9, "spec": "all",
                           "equals_old_logprobs": True,
                           "backward_by_piece": {"total_s": 1.0, "seconds": {"linear_formula": 0.25,
                                                                             "flash_paged_formula": 0.5},
                                                 "calls": {"linear_formula": 9, "flash_paged_formula": 4}}}}
    table = script.backward_table(results)
    assert table["id"] == "T16-armJ-backward" and table["columns"] == script.BACKWARD_COLUMNS
    assert table["rows"] == [[script.BACKWARD_PIECES["flash_paged_formula"], "flash_paged_formula", 4, 0.5, 50.0],
                             [script.BACKWARD_PIECES["linear_formula"], "linear_formula", 9, 0.25, 25.0],
                             ["outside the wrapped pieces", None, None, 0.25, 25.0]]
    assert [t["id"] for t in script.document(results, {}, {})["tables"]] == ["T16-armJ-pieces", "T16-armJ-backward"]
    del results["J (all)"]["backward_by_piece"]
    assert [t["id"] for t in script.document(results, {}, {})["tables"]] == ["T16-armJ-pieces"]


@pytest.mark.parametrize(("name", "revision"), [("arm_j_pieces.json", "111a0cf"),
                                                ("arm_j_pieces_b01b450.json", "b01b450"),
                                                ("arm_j_pieces_75f9295.json", "75f9295")])
def test_committed_tables_are_built_from_their_results(script, name, revision):
    """benchmarks/results/h200/arm_j_pieces*.json: the tables are what this code builds from the document's results
    (generated, never typed); arm J's form equals its old log-probs bit for bit, and every wrapped piece of the
    forward has a backward row."""
    from bloggap_plugin.results import ResultDocument

    path = ROOT / "benchmarks" / "results" / "h200" / name
    ResultDocument.read(path)
    doc = json.loads(path.read_text())
    rebuilt = script.document(doc["results"], {}, {}, doc.get("attention_formulas"))["tables"]
    assert doc["tables"] == json.loads(json.dumps(rebuilt))
    assert doc["tables"][0] == json.loads(json.dumps(script.table(doc["results"])))
    assert doc["results"]["J (all)"]["equals_old_logprobs"] is True and doc["params"]["revision"] == revision
    assert set(doc["results"]["J (all)"]["backward_by_piece"]["seconds"]) <= set(script.BACKWARD_PIECES)
