"""``bloggap tiles``: the tile table for arms I and J measured for a user's model, end to end on the CPU with a
stand-in kernel and clock (the GPU and vLLM faked by name), and its bad input."""

from __future__ import annotations

import functools
import json

import pytest
from _support.stand_in_matmul import stand_in_kernel

LLAMA_CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 200}


@pytest.fixture
def stand_in_gpu(monkeypatch, tmp_path):
    """A model folder (config only), a visible stand-in GPU, vLLM 0.26 by name, and the measurement on the CPU."""
    import torch

    from bloggap_plugin.core.vllm import kernels
    from bloggap_plugin.measure import matmul_tiles

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Stand-in GPU")
    monkeypatch.setattr(kernels, "vllm_layout", lambda: ("0.26.0", None))
    monkeypatch.setattr(matmul_tiles, "measure_linears", functools.partial(matmul_tiles.measure_linears, device="cpu"))

    def with_kernel(fast: set[str]):
        module = stand_in_kernel(monkeypatch, fast)
        monkeypatch.setattr(kernels, "persistent_matmul_module", lambda: module)

    return folder, with_kernel


def test_the_table_written_is_what_the_measurement_supports_and_loads_only_on_this_gpu(stand_in_gpu, tmp_path, capsys):
    """Every weight shape of the model gets the fast configuration that keeps vLLM's bits (the stand-in's 16-row tiles
    round differently, so the fast m16 one is never picked), at each row count asked for; the file loads for the GPU
    it was measured on and is refused on another."""
    from bloggap_plugin.cli import main
    from bloggap_plugin.core.vllm.tile_table import ShapeTiles, TilesError, TileShape, load_tiles

    folder, with_kernel = stand_in_gpu
    with_kernel({"m64n32w4s4", "m16n64w4s4"})
    out, cases = tmp_path / "tiles.json", tmp_path / "cases.json"
    assert main(["tiles", "--model", str(folder), "--out", str(out), "--rows", "4", "1", "--reps", "2",
                 "--cases", str(cases)]) == 0
    fast = TileShape(64, 32, 4, 4)
    shapes = {(4 * 16 + 2 * 2 * 16, 64), (64, 64), (192, 64), (64, 96), (200, 64)}  # qkv, o, gate_up, down, head
    assert load_tiles(out, gpu="Stand-in GPU") == {shape: ShapeTiles(64, ((1, fast), (4, fast))) for shape in shapes}
    with pytest.raises(TilesError, match="measured on Stand-in GPU, and this process runs on Other GPU"):
        load_tiles(out, gpu="Other GPU")
    document = json.loads(out.read_text())
    assert document["vllm"] == "0.26.0" and document["source"] == f"bloggap tiles --model {folder}"
    measured = json.loads(cases.read_text())
    assert measured["rows"] == [1, 4] and len(measured["cases"][str(folder)]) == 10  # 5 layers x 2 row counts
    printed = capsys.readouterr().out
    assert f"wrote {out} (5 weight shape(s); 0 left to vLLM's configuration)" in printed
    assert f"gap.matmul_tiles: {out}" in printed


def test_no_table_is_written_where_vllms_own_configuration_is_fastest(stand_in_gpu, tmp_path, capsys):
    from bloggap_plugin.cli import main

    folder, with_kernel = stand_in_gpu
    with_kernel(set())  # every configuration as fast as vLLM's: nothing to gain
    out = tmp_path / "tiles.json"
    assert main(["tiles", "--model", str(folder), "--out", str(out), "--rows", "1", "--reps", "2"]) == 0
    assert not out.exists()
    assert "no tile table written: on Stand-in GPU, vLLM's own configuration is the fastest" in capsys.readouterr().out


@pytest.mark.parametrize(("extra", "message"), [
    ([], r"--out: give the file to write the tile table to"),
    (["--out", "t.json", "--rows", "0"], r"--rows 0: give one or more row counts, each >= 1"),
    (["--out", "t.json", "--reps", "0"], r"--reps"),
])
def test_bad_flags_are_one_line_errors(stand_in_gpu, tmp_path, monkeypatch, capsys, extra, message):
    from bloggap_plugin.cli import main

    folder, with_kernel = stand_in_gpu
    with_kernel(set())
    monkeypatch.chdir(tmp_path)
    assert main(["tiles", "--model", str(folder), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("bloggap: error: ")
    assert pytest.importorskip("re").search(message, err)


def test_without_a_gpu_or_vllms_kernels_or_a_llama_style_config_it_says_which(stand_in_gpu, tmp_path, monkeypatch,
                                                                                capsys):
    import torch

    from bloggap_plugin.cli import main
    from bloggap_plugin.core.vllm import kernels

    folder, with_kernel = stand_in_gpu
    out = str(tmp_path / "tiles.json")
    monkeypatch.setattr(kernels, "persistent_matmul_module", lambda: None)
    assert main(["tiles", "--model", str(folder), "--out", out]) == 2
    assert "needs vLLM's batch-invariant matmul, which this process's vLLM (0.26.0) lacks: pip install vllm==" in \
        capsys.readouterr().err
    with_kernel(set())
    nested = tmp_path / "gemma"
    nested.mkdir()
    (nested / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": LLAMA_CONFIG}))
    assert main(["tiles", "--model", str(nested), "--out", out]) == 2
    assert "its config has no 'hidden_size' at the top level (model_type 'gemma3')" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["tiles", "--model", str(folder), "--out", out]) == 2
    assert "no CUDA GPU is visible here" in capsys.readouterr().err
    assert not (tmp_path / "tiles.json").exists()
