"""benchmarks/results/h200/gsm8k_warmstart*.json (issue 33 item 1, the H200 runs): their tables are built from
their results, their accuracy counts are the gsm8k task's reward recounted from the committed completions, and
gsm8k_warmstart_settings.json (T18-warmstart-settings) is rebuilt from the run documents it names."""

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


SETTINGS = RESULTS / "gsm8k_warmstart_settings.json"
RUNS = (json.loads(SETTINGS.read_text())["params"]["documents"] if SETTINGS.is_file()
        else ["gsm8k_warmstart.json"])
"""Every published run document, as the settings document lists them (the first run's among them)."""


@pytest.fixture(scope="module")
def doc() -> dict:
    return json.loads((RESULTS / "gsm8k_warmstart.json").read_text())


def _completions(document: str, phase: str) -> Path:
    return RESULTS / document.removesuffix(".json") / f"eval_{phase}" / "completions.jsonl.xz"


@pytest.mark.parametrize("document", RUNS)
def test_the_tables_are_built_from_the_results(document):
    from benchmarks import gsm8k_warmstart
    from bloggap_plugin.results import ResultDocument

    ResultDocument.read(RESULTS / document)
    payload = json.loads((RESULTS / document).read_text())
    rebuilt = gsm8k_warmstart.document(payload["env"], payload["params"], payload["results"]).to_dict()
    assert payload["tables"] == json.loads(json.dumps(rebuilt["tables"]))
    assert [t["id"] for t in payload["tables"]] == ["T18-warmstart", "T18-warmstart-curve"]


@pytest.mark.parametrize("document", RUNS)
def test_the_run_trained_on_the_published_data_without_contamination(document):
    results = json.loads((RESULTS / document).read_text())["results"]
    assert results["done"][:4] == ["data", "before", "train", "checkpoint"]
    assert results["complete"] == (results["done"] == ["data", "before", "train", "checkpoint", "after"])
    files = {**results["data"]["files"]["train"], **results["data"]["files"]["test"]}
    assert files == PUBLISHED
    assert results["data"]["train_rows"] == 7473 and results["data"]["test_questions"] == 1319
    assert results["data"]["targets"]["all_full_reward"] is True
    assert results["decontamination"]["exact"] == 0 and results["decontamination"]["substring"] == 0
    assert len(results["checkpoint"]["sha256"]) == 64


def test_the_first_run_finished():
    assert json.loads((RESULTS / "gsm8k_warmstart.json").read_text())["results"]["complete"] is True


EVALUATED = [(d, p) for d in RUNS for p in ("before", "after")
             if p in json.loads((RESULTS / d).read_text())["results"]["done"]]
"""(run document, phase) for every evaluation a run finished (a run cut short has no evaluation after)."""


@pytest.mark.parametrize("document,phase", EVALUATED)
def test_accuracy_is_the_task_reward_recounted_from_the_completions(document, phase):
    """Every test row's greedy completion scored again with the gsm8k task's training reward (lenient) and its
    strict one: the counts the document reports, over all 1,319 rows. A run that reused the first run's
    evaluation before (--before-from) reports that run's cells."""
    results = json.loads((RESULTS / document).read_text())["results"]
    if results[phase].get("reused_from"):
        reused = "benchmarks/results/h200/gsm8k_warmstart/eval_before/gsm8k_baseline.json"
        assert results[phase]["reused_from"] == reused
        first = json.loads((RESULTS / "gsm8k_warmstart.json").read_text())["results"][phase]
        assert results[phase]["subsets"] == first["subsets"] and not _completions(document, phase).exists()
        return
    text = lzma.decompress(_completions(document, phase).read_bytes()).decode()
    rows = [json.loads(line) for line in text.splitlines()]
    assert sorted(r["index"] for r in rows) == list(range(1319))
    correct = sum(gsm8k.accuracy_reward([r["greedy"]], answer=[r["gold"]])[0] for r in rows)
    strict = sum(gsm8k.strict_accuracy_reward([r["greedy"]], answer=[r["gold"]])[0] for r in rows)
    cell = results[phase]["subsets"]["all"]
    assert (cell["rows"], cell["correct"], cell["strict_correct"]) == (1319, int(correct), int(strict))
    assert cell["ci95"][0] < cell["accuracy"] == correct / 1319 < cell["ci95"][1]


@pytest.mark.skipif(not SETTINGS.is_file(), reason="no settings document")
def test_the_settings_table_is_rebuilt_from_the_run_documents():
    from benchmarks import gsm8k_warmstart_publish

    committed = json.loads(SETTINGS.read_text())
    rebuilt = gsm8k_warmstart_publish.settings_document([RESULTS / name for name in RUNS]).to_dict()
    assert committed == json.loads(json.dumps(rebuilt))
    assert "gsm8k_warmstart.json" in RUNS and committed["tables"][0]["id"] == "T18-warmstart-settings"


def test_the_committed_evaluation_before_stands_for_a_later_run_with_the_same_settings(doc):
    """A later GPU run of another warm-start setting can reuse this run's evaluation of the base model
    (``--before-from``): with the real run's evaluation settings it is accepted and gives the same cells."""
    import argparse

    from benchmarks import gsm8k_warmstart

    args = argparse.Namespace(**{**gsm8k_warmstart.GPU_DEFAULTS, "seed": 0})
    path = RESULTS / "gsm8k_warmstart" / "eval_before" / "gsm8k_baseline.json"
    reused = gsm8k_warmstart.reused_evaluation(path, args, 1319)
    assert reused["subsets"] == doc["results"]["before"]["subsets"] and reused["exit_code"] == 0
