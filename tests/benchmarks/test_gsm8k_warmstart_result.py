"""benchmarks/results/h200/gsm8k_warmstart.json (issue 33 item 1, the H200 run): its tables are built from its
results, and its accuracy counts are the gsm8k task's reward recounted from the committed completions."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import pytest

from bloggap_plugin.tasks import gsm8k

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "h200"
PUBLISHED = {"train.jsonl": "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
             "test.jsonl": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14"}
"""sha256 of GSM8K's files as ../shared/data/gsm8k/README.md lists them."""


@pytest.fixture(scope="module")
def doc() -> dict:
    return json.loads((RESULTS / "gsm8k_warmstart.json").read_text())


def test_the_tables_are_built_from_the_results(doc):
    from benchmarks import gsm8k_warmstart
    from bloggap_plugin.results import ResultDocument

    ResultDocument.read(RESULTS / "gsm8k_warmstart.json")
    rebuilt = gsm8k_warmstart.document(doc["env"], doc["params"], doc["results"]).to_dict()["tables"]
    assert doc["tables"] == json.loads(json.dumps(rebuilt))
    assert [t["id"] for t in doc["tables"]] == ["T18-warmstart", "T18-warmstart-curve"]


def test_the_run_finished_on_the_published_data_without_contamination(doc):
    results = doc["results"]
    assert results["complete"] and results["done"] == ["data", "before", "train", "checkpoint", "after"]
    files = {**results["data"]["files"]["train"], **results["data"]["files"]["test"]}
    assert files == PUBLISHED
    assert results["data"]["train_rows"] == 7473 and results["data"]["test_questions"] == 1319
    assert results["data"]["targets"]["all_full_reward"] is True
    assert results["decontamination"]["exact"] == 0 and results["decontamination"]["substring"] == 0
    assert len(results["checkpoint"]["sha256"]) == 64


@pytest.mark.parametrize("phase", ["before", "after"])
def test_accuracy_is_the_task_reward_recounted_from_the_completions(doc, phase):
    """Every test row's greedy completion scored again with the gsm8k task's training reward (lenient) and its strict
    one: the counts the document reports, over all 1,319 rows."""
    path = RESULTS / "gsm8k_warmstart" / f"eval_{phase}" / "completions.jsonl.xz"
    rows = [json.loads(line) for line in lzma.decompress(path.read_bytes()).decode().splitlines()]
    assert sorted(r["index"] for r in rows) == list(range(1319))
    correct = sum(gsm8k.accuracy_reward([r["greedy"]], answer=[r["gold"]])[0] for r in rows)
    strict = sum(gsm8k.strict_accuracy_reward([r["greedy"]], answer=[r["gold"]])[0] for r in rows)
    cell = doc["results"][phase]["subsets"]["all"]
    assert (cell["rows"], cell["correct"], cell["strict_correct"]) == (1319, int(correct), int(strict))
    assert cell["ci95"][0] < cell["accuracy"] == correct / 1319 < cell["ci95"][1]


def test_the_committed_evaluation_before_stands_for_a_later_run_with_the_same_settings(doc):
    """A later GPU run of another warm-start setting can reuse this run's evaluation of the base model
    (``--before-from``): with the real run's evaluation settings it is accepted and gives the same cells."""
    import argparse

    from benchmarks import gsm8k_warmstart

    args = argparse.Namespace(**{**gsm8k_warmstart.GPU_DEFAULTS, "seed": 0})
    path = RESULTS / "gsm8k_warmstart" / "eval_before" / "gsm8k_baseline.json"
    reused = gsm8k_warmstart.reused_evaluation(path, args, 1319)
    assert reused["subsets"] == doc["results"]["before"]["subsets"] and reused["exit_code"] == 0
