"""GSM8K's validation split: fixed rows of train, recorded in a committed file, kept out of training sets."""

from __future__ import annotations

import hashlib
import json

import pytest

from bloggap_plugin.core.errors import UsageError
from bloggap_plugin.tasks import get_heldout, get_task, gsm8k
from bloggap_plugin.tasks.gsm8k import GSM8KDataError


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _recorded() -> dict:
    return json.loads(gsm8k.VALIDATION_FILE.read_text())


def test_the_recorded_rows_follow_the_rule_written_in_the_file(gsm8k_dir):
    """An implementation of the rule as the committed file words it (salt, newline, question; lowest sha256 hex)
    picks exactly the recorded rows of the published train file, and the recorded checksum is theirs."""
    recorded = _recorded()
    train = _rows(gsm8k_dir / "train.jsonl")
    salt = "bloggap-gsm8k-validation-v1"
    assert f"'{salt}'" in recorded["rule"]
    ranked = sorted(range(len(train)),
                    key=lambda i: (hashlib.sha256((salt + "\n" + train[i]["question"]).encode("utf-8")).hexdigest(), i))
    assert sorted(ranked[:500]) == recorded["rows"]
    assert recorded["n"] == len(recorded["rows"]) == 500 and recorded["train_rows"] == len(train) == 7473
    assert recorded["train_sha256"] == hashlib.sha256((gsm8k_dir / "train.jsonl").read_bytes()).hexdigest()
    joined = ",".join(str(i) for i in recorded["rows"]).encode("ascii")
    assert recorded["rows_sha256"] == hashlib.sha256(joined).hexdigest()


def test_validation_and_the_rest_partition_train_in_file_order(gsm8k_dir):
    train = _rows(gsm8k_dir / "train.jsonl")
    rows = _recorded()["rows"]
    validation = gsm8k.load_gsm8k(gsm8k_dir, split="validation")
    rest = gsm8k.load_gsm8k(gsm8k_dir, split="train_minus_validation")
    assert gsm8k.column(validation, "question") == [train[i]["question"] for i in rows]
    held = set(rows)
    assert gsm8k.column(rest, "question") == [row["question"] for i, row in enumerate(train) if i not in held]
    assert len(validation) == 500 and len(rest) == 7473 - 500
    assert not set(gsm8k.column(validation, "question")) & set(gsm8k.column(rest, "question"))


def test_a_training_set_of_the_rest_never_holds_a_validation_question(gsm8k_dir):
    validation = set(gsm8k.column(gsm8k.load_gsm8k(gsm8k_dir, split="validation"), "question"))
    dataset, _ = get_task("gsm8k", None, seed=4, data=str(gsm8k_dir), train_split="train_minus_validation")
    questions = {prompt[-1]["content"] for prompt in gsm8k.column(dataset, "prompt")}
    assert len(dataset) == 7473 - 500 and not questions & validation
    every, _ = get_task("gsm8k", None, seed=4, data=str(gsm8k_dir))  # the default keeps every train row
    assert len(every) == 7473 and len({p[-1]["content"] for p in gsm8k.column(every, "prompt")} & validation) == 500
    heldout, _ = get_heldout("gsm8k", None, data=str(gsm8k_dir), train_split="train_minus_validation", heldout_n=3)
    test = _rows(gsm8k_dir / "test.jsonl")
    assert [p[-1]["content"] for p in heldout["prompt"]] == [row["question"] for row in test[:3]]


@pytest.mark.parametrize("split", ["validation", "test", "bogus"])
def test_training_on_validation_or_test_is_refused(split):
    with pytest.raises(UsageError, match=rf"train_split '{split}': GSM8K trains on train or train_minus_validation"):
        get_task("gsm8k", None, data=str(gsm8k.SAMPLE_PATH), train_split=split)
    with pytest.raises(UsageError, match="train_split applies to 'gsm8k' only"):
        get_task("arith", None, train_split="train")


def test_a_train_split_too_small_or_other_than_the_published_one_is_refused(gsm8k_dir, tmp_path):
    with pytest.raises(GSM8KDataError, match=r"holds 500 rows of GSM8K train, which has only \d+"):
        gsm8k.load_gsm8k(gsm8k.SAMPLE_PATH, split="validation")
    with pytest.raises(GSM8KDataError, match="split 'valid': choose one of train, test, validation"):
        gsm8k.load_gsm8k(gsm8k_dir, split="valid")
    lines = (gsm8k_dir / "train.jsonl").read_text().splitlines(keepends=True)
    first = _recorded()["rows"][0]
    row = json.loads(lines[first])
    row["question"] = "Edited: " + row["question"]  # same row count, a validation row's question changed
    lines[first] = json.dumps(row) + "\n"
    (tmp_path / "train_copy.jsonl").write_text("".join(lines))  # not named train.jsonl: no sha256 check first
    assert first not in gsm8k.validation_rows([json.loads(line)["question"] for line in lines])
    with pytest.raises(GSM8KDataError, match="differ from those recorded in gsm8k_validation.json"):
        gsm8k.load_gsm8k(tmp_path / "train_copy.jsonl", split="validation")
