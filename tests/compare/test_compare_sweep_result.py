"""The decisive sweep's committed result (issue 15): its tables come back from its committed run logs, and the
publishing step names the model, strips machine paths and keeps every run."""

from __future__ import annotations

import json
import tarfile

import pytest
from _support import ROOT

RESULT = ROOT / "benchmarks" / "results" / "h200" / "compare_sweep.json"
RUNS = ROOT / "benchmarks" / "results" / "h200" / "compare_sweep" / "runs.tar.xz"


def _rows(document: dict, table_id: str) -> list[list]:
    return next(t for t in document["tables"] if t["id"] == table_id)["rows"]


def _close(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b) <= 1.5e-4  # 4-digit rounding of a mean that sits on a rounding edge (numpy 2.5 vs here)
    return a == b


@pytest.mark.skipif(not RESULT.exists(), reason="no committed sweep result")
def test_the_committed_tables_are_rebuilt_from_the_committed_run_logs(tmp_path, capsys):
    """``bloggap compare --table-only`` over the committed logs gives the committed T10, T10-heldout and resolution
    (the numbers in BENCHMARKS.md and the README come from logs anyone can re-read)."""
    pytest.importorskip("matplotlib")
    from bloggap_plugin.cli import main

    document = json.loads(RESULT.read_text())
    params = document["params"]
    with tarfile.open(RUNS) as archive:
        archive.extractall(tmp_path, filter="data")
    assert len(list((tmp_path / "runs").glob("*.jsonl"))) == len(params["recipes"]) * len(params["seeds"]) == 60
    code = main(["compare", *[str(ROOT / r) for r in params["recipes"]], "--config",
                 str(ROOT / "benchmarks" / "compare_sweep.yaml"), "--model", params["model"], "--seeds",
                 *map(str, params["seeds"]), "--output-dir", str(tmp_path), "--table-only"])
    capsys.readouterr()
    assert code == 0
    rebuilt = json.loads((tmp_path / "compare.json").read_text())
    for table_id in ("T10", "T10-heldout", "T10-resolution"):
        committed, again = _rows(document, table_id), _rows(rebuilt, table_id)
        assert len(committed) == len(again)
        for row, row_again in zip(committed, again):
            assert all(_close(a, b) for a, b in zip(row, row_again, strict=True)), (table_id, row, row_again)
    # declared: 10 planned seeds, all 10 finished: final, so every arm but the baseline has its interval and p-values
    assert document["results"]["analysis"]["status"] == "final" and document["params"]["planned_seeds"] == list(range(10))
    t10 = next(t for t in document["tables"] if t["id"] == "T10")
    assert not t10["title"].startswith("Interim")
    assert all((row[6] is None) == (row[0] == "A") and (row[7] is None) == (row[0] == "A") for row in t10["rows"])
    start = {row[0]: row for row in _rows(document, "start")}
    firsts = [run["rewards"][0] for run in rebuilt["results"]["runs"].values()]
    assert start["all"][1] == 60 and start["all"][2] == pytest.approx(sum(firsts) / 60, abs=5e-5)
    assert 0.2 <= start["all"][2] <= 0.5  # the starting window


def test_publish_names_the_model_strips_paths_and_packs_every_run(tmp_path):
    """A sweep folder as it comes back from the GPU machine becomes the committed files: the model path is the
    model's name everywhere, install paths are placeholders, progress bars and logged dicts leave the console
    output, every run's log is in the archive unchanged but for the paths."""
    from benchmarks import compare_sweep_publish as publish

    model_path = "/tmp/vx/smollm2"
    sweep = tmp_path / "compare_sweep"
    (sweep / "runs").mkdir(parents=True)
    results = {"arms": {"A": {}, "B": {}},
               "runs": {"A_s0": {"arm": "A", "seed": 0, "rewards": [0.25, 0.5]},
                        "B_s0": {"arm": "B", "seed": 0, "rewards": [0.5, 1.0]}}}
    table = {"notes": "", "random_init": False, "reference": None}
    document = {"benchmark": "compare", "schema_version": 1, "env": {"model": model_path},
                "params": {"model": model_path, "task": "arith", "smooth": 1},
                "results": results,
                "tables": [{"id": "T10", "title": f"Reward (arith, {model_path})", **table,
                            "columns": ["arm", "seeds", "reward last-2", "reward mean"],
                            "rows": [["A", 1, 0.5, 0.375], ["B", 1, 1.0, 0.75]]},
                           {"id": "T10-gap", "title": "gap", "columns": ["arm"], "rows": [["A"], ["B"]], **table}]}
    (sweep / "compare.json").write_text(json.dumps(document))
    log_line = json.dumps({"step": 1, "reward": 0.25, "model": model_path})
    (sweep / "runs" / "A_s0.jsonl").write_text(log_line + "\n")
    (sweep / "runs" / "A_s0.out").write_text(
        "Loading: 100%|#####| 1/1 [00:02<00:00]\r  5%|5 | 1/20 [00:03<01:05]\n{'loss': '0.18', 'reward': '0.25'}\n"
        f"  File \"/opt/torch/.venv/lib/python3.12/site-packages/torch/x.py\", line 3\nloaded {model_path} from /tmp/site/vllm\n")
    (sweep / "runs" / "A_s0.spec.json").write_text("{}")  # the sweep's own bookkeeping: not published
    # a failed attempt's console (bloggap compare --retries): published beside the run's, trimmed the same way
    (sweep / "runs" / "A_s0.out.failed").write_text(f"loaded {model_path}\nRuntimeError: CUDA out of memory\n")
    call_log = tmp_path / "call1.log"
    call_log.write_text(f"[compare] A_s0: started\nmodel {model_path}\n")
    out = tmp_path / "out"

    path = publish.publish(sweep, out, "sweep", "SmolLM2-135M-Instruct", [call_log])

    written = json.loads(path.read_text())
    text = path.read_text()
    assert model_path not in text and written["params"]["model"] == "SmolLM2-135M-Instruct"
    assert written["benchmark"] == "sweep" and [t["id"] for t in written["tables"]] == ["start", "T10", "T10-gap"]
    assert _rows(written, "start") == [["A", 1, 0.25], ["B", 1, 0.5], ["all", 2, 0.375]]
    plots = {t["id"]: t["plot"] for t in written["tables"]}
    assert plots["T10"]["y"] == ["reward last-2", "reward mean"] and plots["T10-gap"] is False
    assert (out / "sweep_reward_curves.png").stat().st_size > 0
    with tarfile.open(out / "sweep" / "runs.tar.xz") as archive:
        names = sorted(archive.getnames())
        files = {m.name: archive.extractfile(m).read().decode() for m in archive.getmembers() if m.isfile()}
    assert names == ["runs", "runs/A_s0.jsonl", "runs/A_s0.out", "runs/A_s0.out.failed"]
    assert files["runs/A_s0.out.failed"] == "loaded SmolLM2-135M-Instruct\nRuntimeError: CUDA out of memory\n"
    assert json.loads(files["runs/A_s0.jsonl"]) == {"step": 1, "reward": 0.25, "model": "SmolLM2-135M-Instruct"}
    assert files["runs/A_s0.out"] == ('  File "<image-site-packages>/torch/x.py", line 3\n'
                                      "loaded SmolLM2-135M-Instruct from <bundle-site>/vllm\n")
    assert not (out / "sweep" / "runs").exists()
    assert (out / "logs" / "sweep.log").read_text() == (
        "==> device call 1: call1.log <==\n[compare] A_s0: started\nmodel SmolLM2-135M-Instruct\n")
