"""benchmarks/compare_seeds.py: whole seeds from several machines' packs into one runs/ folder."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from benchmarks.compare_seeds import SeedsError, collect, main
from bloggap_plugin.compare.logs import MODEL_SHA256_KEY
from bloggap_plugin.compare.sweep_config import DONE_KEY


def _run(arm: str, seed: int, sha: str, *, attempt: str = "t1", evaluated_attempt: str | None = "t1") -> dict:
    """One run's files as the sweep writes them: a log ending in its marker, its held-out result, its console."""
    log = json.dumps({"step": 1, "reward": 0.5}) + "\n" + json.dumps(
        {DONE_KEY: "done", "arm": arm, "seed": seed, "attempt": attempt, MODEL_SHA256_KEY: sha}) + "\n"
    files = {f"{arm}_s{seed}.jsonl": log, f"{arm}_s{seed}.out": f"console of {arm}_s{seed} on {sha[:4]}\n"}
    if evaluated_attempt is not None:
        files[f"{arm}_s{seed}.heldout.json"] = json.dumps(
            {"attempt": evaluated_attempt, "settings": {"n": 4}, "result": {"accuracy": 0.25, "n": 4}})
    return files


def _pack(path: Path, *runs: dict, prefix: str = "runs") -> Path:
    with tarfile.open(path, "w:gz") as archive:
        for files in runs:
            for name, text in files.items():
                data = text.encode()
                member = tarfile.TarInfo(f"{prefix}/{name}")
                member.size = len(data)
                archive.addfile(member, io.BytesIO(data))
        partial = b'{"step": 1}\n'  # a stopped attempt's log: never collected
        member = tarfile.TarInfo(f"{prefix}/A_s9.20261205T1-1.part.jsonl")
        member.size = len(partial)
        archive.addfile(member, io.BytesIO(partial))
    return path


def test_whole_seeds_of_each_pack_are_copied_and_the_rest_named(tmp_path):
    first = _pack(tmp_path / "one.tgz", _run("A", 0, "aaaa" * 16), _run("B", 0, "aaaa" * 16),
                  _run("A", 1, "aaaa" * 16), _run("B", 1, "aaaa" * 16, evaluated_attempt="t0"))
    second = _pack(tmp_path / "two.tgz", _run("A", 1, "bbbb" * 16), _run("B", 1, "bbbb" * 16),
                   _run("A", 2, "bbbb" * 16), _run("B", 2, "cccc" * 16), _run("A", 3, "bbbb" * 16),
                   prefix="compare_gsm8k/runs")
    into, said = tmp_path / "runs", []
    assert collect([first, second], into, ["A", "B"], echo=said.append) == [0, 1]
    assert sorted(p.name for p in into.iterdir()) == [
        "A_s0.heldout.json", "A_s0.jsonl", "A_s0.out", "A_s1.heldout.json", "A_s1.jsonl", "A_s1.out",
        "B_s0.heldout.json", "B_s0.jsonl", "B_s0.out", "B_s1.heldout.json", "B_s1.jsonl", "B_s1.out"]
    assert (into / "B_s1.out").read_text() == "console of B_s1 on bbbb\n"  # seed 1 from the pack where it is whole
    assert (into / "A_s0.jsonl").read_text() == _run("A", 0, "aaaa" * 16)["A_s0.jsonl"]
    assert f"seed 1 in {first}: not whole (B not evaluated), left out" in said
    assert f"seed 2 in {second}: not whole (its arms started from different checkpoints (bbbbbbbbbbbb, cccccccccccc)), left out" in said
    assert f"seed 3 in {second}: not whole (B not trained), left out" in said
    assert f"seed 1: whole in {second} (checkpoint bbbbbbbbbbbb), in {into}" in said
    # again into the same folder: the same files, nothing refused
    assert collect([first, second], into, ["A", "B"], echo=said.append) == [0, 1]


def test_a_seed_whole_twice_or_another_run_in_the_folder_is_refused_and_nothing_copied(tmp_path):
    first = _pack(tmp_path / "one.tgz", _run("A", 0, "aaaa" * 16), _run("B", 0, "aaaa" * 16))
    second = _pack(tmp_path / "two.tgz", _run("A", 0, "bbbb" * 16), _run("B", 0, "bbbb" * 16))
    into = tmp_path / "runs"
    with pytest.raises(SeedsError, match=f"seed 0 is whole in both {first} and {second}"):
        collect([first, second], into, ["A", "B"], echo=lambda line: None)
    assert not into.exists()
    collect([first], into, ["A", "B"], echo=lambda line: None)
    with pytest.raises(SeedsError, match="seed 0 is in --into already from another machine"):
        collect([second], into, ["A", "B"], echo=lambda line: None)
    assert (into / "A_s0.out").read_text() == "console of A_s0 on aaaa\n"


def test_without_heldout_a_trained_run_counts_and_the_command_line_says_what_it_did(tmp_path, capsys):
    pack = _pack(tmp_path / "one.tgz", _run("A", 0, "aaaa" * 16, evaluated_attempt=None),
                 _run("B", 0, "aaaa" * 16, evaluated_attempt=None))
    into = tmp_path / "runs"
    assert main(["collect", str(pack), "--into", str(into), "--arms", "A,B"]) == 0
    assert "not whole (A not evaluated; B not evaluated)" in capsys.readouterr().out and not into.exists()
    assert main(["collect", str(pack), "--into", str(into), "--arms", "A,B", "--no-heldout"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "1 whole seed(s): 0"
    assert main(["collect", str(tmp_path / "missing.tgz"), "--into", str(into), "--arms", "A"]) == 2
    assert "missing.tgz: not a readable tar pack" in capsys.readouterr().err


def test_one_seed_in_two_packs_as_the_same_files_is_one_seed(tmp_path):
    """A run carried to the next machine is packed there again: the same files in two packs are not a conflict."""
    seed0 = (_run("A", 0, "aaaa" * 16), _run("B", 0, "aaaa" * 16))
    first = _pack(tmp_path / "one.tgz", *seed0)
    second = _pack(tmp_path / "two.tgz", *seed0, _run("A", 1, "aaaa" * 16), _run("B", 1, "aaaa" * 16))
    assert collect([first, second], tmp_path / "runs", ["A", "B"], echo=lambda line: None) == [0, 1]


def test_partial_keeps_the_finished_runs_of_seeds_whole_nowhere_from_one_checkpoint(tmp_path, capsys):
    """--partial (one checkpoint carried to every machine): seed 1's A from one pack and B from another are copied
    beside the whole seed 0, and the rest is named; a failed attempt's console travels with its run."""
    sha = "aaaa" * 16
    retried = {**_run("A", 1, sha), "A_s1.out.failed": "the first attempt's console\n"}
    first = _pack(tmp_path / "one.tgz", _run("A", 0, sha), _run("B", 0, sha), retried, _run("A", 2, sha),
                  _run("B", 2, sha, evaluated_attempt=None))
    second = _pack(tmp_path / "two.tgz", _run("B", 1, sha), _run("C", 1, sha))
    into = tmp_path / "runs"
    assert main(["collect", str(first), str(second), "--into", str(into), "--arms", "A,B,C", "--partial"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sorted(p.name for p in into.iterdir()) == sorted(
        [f"{arm}_s{seed}{kind}" for arm, seed in (("A", 0), ("B", 0), ("A", 1), ("B", 1), ("C", 1), ("A", 2))
         for kind in (".heldout.json", ".jsonl", ".out")] + ["A_s1.out.failed"])
    assert (into / "A_s1.out.failed").read_text() == "the first attempt's console\n"
    assert (into / "B_s1.out").read_text() == "console of B_s1 on aaaa\n"
    assert f"seed 0: A, B finished (checkpoint {sha[:12]}), in {into}; still to run: C" in out  # no C in any pack
    assert f"seed 1: whole across packs (A from {first}; B from {second}; C from {second}; checkpoint {sha[:12]}), in {into}" in out
    assert f"seed 2: A finished (checkpoint {sha[:12]}), in {into}; still to run: B, C" in out
    assert f"seed 2 in {first}: not whole (B not evaluated; C not trained), its finished runs kept" in out
    assert out[-1] == "1 whole seed(s): 1"


def test_partial_refuses_two_checkpoints_in_a_seed_and_a_run_finished_twice(tmp_path):
    first = _pack(tmp_path / "one.tgz", _run("A", 0, "aaaa" * 16))
    second = _pack(tmp_path / "two.tgz", _run("B", 0, "bbbb" * 16))
    into = tmp_path / "runs"
    with pytest.raises(SeedsError, match=r"seed 0's finished runs started from different checkpoints \(aaaaaaaaaaaa, "
                                         r"bbbbbbbbbbbb\): --partial needs one checkpoint carried"):
        collect([first, second], into, ["A", "B", "C"], echo=lambda line: None, partial=True)
    again = _pack(tmp_path / "three.tgz", {**_run("A", 0, "aaaa" * 16), "A_s0.out": "another console\n"})
    with pytest.raises(SeedsError, match=f"run A_s0 finished in both {first} and {again}"):
        collect([first, again], into, ["A", "B", "C"], echo=lambda line: None, partial=True)
    assert not into.exists()
    # without --partial neither pack's seed 0 is whole: nothing copied, nothing refused
    assert collect([first, second], into, ["A", "B", "C"], echo=lambda line: None) == [] and not into.exists()
