"""``bloggap compare --model FOLDER``: each run records the sha256 of the weights it started from (hashed once per
call), a resume refuses to finish a seed from other weights, and the analysis never pairs runs of one seed that
started from different checkpoints."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from _support.compare_runs import compare_cli, install_fake_train, write_recipes

from bloggap_plugin.compare import (
    DONE_KEY,
    CompareConfig,
    CompareError,
    build_results,
    plan_runs,
    run_compare,
    run_settings,
)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    return install_fake_train(tmp_path, monkeypatch)


def _checkpoint(folder: Path, weights: bytes) -> Path:
    """A model folder as save_pretrained leaves one (config.json, model.safetensors; the fake training never
    loads it) and its sha256 by the definition: each file's name, NUL, 8-byte big-endian size, bytes, sorted."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "tokenizer.json").write_text("{}")  # not covered by the hash
    return folder


def _expected_sha(folder: Path) -> str:
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        data = (folder / name).read_bytes()
        digest.update(name.encode() + b"\x00" + len(data).to_bytes(8, "big") + data)
    return digest.hexdigest()


def _config(tmp_path, fake, model, seeds, **kw) -> CompareConfig:
    return CompareConfig(recipes=write_recipes(tmp_path), seeds=seeds, task="arith", max_steps=2, model=str(model),
                         output_dir=str(tmp_path / "out"), parallel=2, last_n=2, run_fn=fake["run_fn"],
                         pythonpath=[fake["dir"]], poll_s=0.1, heldout_n=0, **kw)


def _marker_sha(config, run_id) -> str | None:
    lines = (Path(config.output_dir) / "runs" / f"{run_id}.jsonl").read_text().splitlines()
    return json.loads(lines[-1])["model_sha256"]


def test_every_run_records_the_folders_sha256_hashed_once_per_call(tmp_path, fake, monkeypatch, spawns):
    import bloggap_plugin.checkpoint as checkpoint

    first = _checkpoint(tmp_path / "ckpt", b"weights one")
    calls = []
    real = checkpoint.checkpoint_sha256
    monkeypatch.setattr(checkpoint, "checkpoint_sha256", lambda folder: calls.append(folder) or real(folder))
    config = _config(tmp_path, fake, first, [0, 1], planned_seeds=[0, 1, 2])
    results = run_compare(config, echo=lambda *_: None)
    assert len(calls) == 1 and not results["set_aside"]
    assert {run_id: _marker_sha(config, run_id) for run_id in ("A_s0", "B_s0", "A_s1", "B_s1")} == dict.fromkeys(
        ("A_s0", "B_s0", "A_s1", "B_s1"), _expected_sha(first))
    # the folder now holds other weights (a new warm start): finished seeds stand, a new seed starts from these
    (first / "model.safetensors").write_bytes(b"weights two")
    again = run_compare(_config(tmp_path, fake, first, [0, 1, 2], planned_seeds=[0, 1, 2]), echo=lambda *_: None)
    assert not again["set_aside"] and again["analysis"]["status"] == "final"
    assert _marker_sha(config, "A_s2") == _marker_sha(config, "B_s2") == _expected_sha(first) != _marker_sha(
        config, "A_s0")
    assert again["checkpoints"]["mismatched_seeds"] == []
    assert again["runs"]["A_s2"]["model_sha256"] == _expected_sha(first)


def test_a_named_model_records_none(tmp_path, fake, spawns):
    config = _config(tmp_path, fake, "tiny-random-llama", [0])
    run_compare(config, echo=lambda *_: None)
    assert _marker_sha(config, "A_s0") is None and _marker_sha(config, "B_s0") is None


def test_a_seed_half_run_from_other_weights_is_not_finished_from_these(tmp_path, fake, capsys, spawns):
    folder = _checkpoint(tmp_path / "ckpt", b"weights one")
    config = _config(tmp_path, fake, folder, [0])
    run_compare(config, echo=lambda *_: None)
    old = _expected_sha(folder)
    (Path(config.output_dir) / "runs" / "B_s0.jsonl").unlink()  # B of seed 0 left to run
    (folder / "model.safetensors").write_bytes(b"weights two")
    with pytest.raises(CompareError, match=rf"seed 0's finished run\(s\) A_s0 started from another checkpoint "
                                           rf"\({old[:12]}\.\.\.\)"):
        run_compare(config, echo=lambda *_: None)
    assert not (Path(config.output_dir) / "runs" / "B_s0.jsonl").exists()  # nothing ran
    code, _, err = compare_cli([*config.recipes, "--seeds", "0", "--task", "arith", "--max-steps", "2",
                                "--model", str(folder), "--output-dir", config.output_dir, "--run-fn", fake["run_fn"],
                                "--pythonpath", fake["dir"], "--heldout-n", "0", "--last-n", "2"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "give --model the checkpoint they started" in err
    (folder / "model.safetensors").write_bytes(b"weights one")  # the weights A_s0 started from: B_s0 may run
    assert not run_compare(config, echo=lambda *_: None)["set_aside"]


def test_a_folder_without_safetensors_weights_is_refused_before_any_run(tmp_path, fake):
    folder = tmp_path / "bin_model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CompareError, match="holds no config.json and \\*.safetensors weights to hash"):
        run_compare(_config(tmp_path, fake, folder, [0]), echo=lambda *_: None)
    assert not (tmp_path / "out" / "runs").exists()


def _write_run(config, run, rewards, sha):
    path = Path(run.log_jsonl)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": i, "reward": r}) for i, r in enumerate(rewards, 1)]
    lines.append(json.dumps({DONE_KEY: "done", "wall_s": 1.0, "settings": run_settings(config, run), "model_sha256": sha}))
    path.write_text("\n".join(lines) + "\n")


def test_the_analysis_refuses_to_pair_runs_of_one_seed_from_different_checkpoints(tmp_path):
    """Seeds 0-2 planned; seed 1's arms started from different weights: all of seed 1 is set aside with the reason,
    no difference of seed 1 enters any table, and the analysis stays interim (no interval, no p-value)."""
    config = CompareConfig(recipes=write_recipes(tmp_path), seeds=[0, 1, 2], output_dir=str(tmp_path / "o"), last_n=2,
                           max_steps=2, heldout_n=0)
    runs = plan_runs(config)
    shas = {0: ("a" * 64, "a" * 64), 1: ("a" * 64, "b" * 64), 2: ("c" * 64, "c" * 64)}
    for run in runs:
        _write_run(config, run, [0.5, 0.5 + 0.25 * (run.arm == "B")], shas[run.seed][run.arm == "B"])
    results = build_results(config, runs)
    assert sorted(results["set_aside"]) == ["A_s1", "B_s1"]
    assert results["set_aside"]["A_s1"].startswith("seed 1: its runs started from different checkpoints (A_s1 "
                                                   "aaaaaaaaaaaa..., B_s1 bbbbbbbbbbbb...)")
    assert results["checkpoints"]["mismatched_seeds"] == [1]
    assert results["arms"]["B"]["delta_vs_base"] == {0: 0.125, 2: 0.125}
    assert results["analysis"]["status"] == "interim"
    assert results["analysis"]["metrics"]["reward_last"]["arms"]["B"] == {"n": 2, "mean": 0.125}
    # the same seed from one checkpoint: compared
    _write_run(config, runs[3], [0.5, 0.75], "a" * 64)
    fixed = build_results(config, runs)
    assert not fixed["set_aside"] and fixed["analysis"]["status"] == "final"


def test_a_run_that_hashed_other_weights_than_the_sweep_fails_and_is_not_marked_done(tmp_path, fake, monkeypatch, spawns):
    """run_training hashes the folder it loads; a hash other than the sweep's (the folder changed while the sweep
    ran) fails that run, so no log of it carries the marker; the run's own matching hash passes."""
    folder = _checkpoint(tmp_path / "ckpt", b"weights one")
    config = _config(tmp_path, fake, folder, [0])
    monkeypatch.setenv("FAKE_SHA", "f" * 64)
    results = run_compare(config, echo=lambda *_: None)
    assert sorted(results["failed"]) == ["A_s0", "B_s0"] and not results["runs"]
    out = (Path(config.output_dir) / "runs" / "A_s0.out").read_text()
    assert "its weights changed during the sweep" in out
    monkeypatch.setenv("FAKE_SHA", _expected_sha(folder))
    again = run_compare(config, echo=lambda *_: None)
    assert not again["failed"] and sorted(again["runs"]) == ["A_s0", "B_s0"]
