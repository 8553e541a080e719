"""The arithmetic task as verl parquet files and its verl custom reward (bloggap_plugin.tasks.verl_data)."""

from __future__ import annotations

import pytest

from bloggap_plugin.tasks import arith, verl_data


def test_parquet_round_trips_with_verls_columns(tmp_path):
    import datasets
    import pyarrow.parquet as pq

    train, val = verl_data.write_verl_parquet(tmp_path, n_train=5, n_val=3, seed=7, difficulty=1)
    assert (train.name, val.name) == ("train.parquet", "val.parquet")
    assert tuple(pq.read_schema(train).names) == verl_data.VERL_COLUMNS
    rows = pq.read_table(train).to_pylist()
    assert rows == verl_data.verl_rows(5, seed=7, difficulty=1, split="train")
    problems = arith.make_problems(5, seed=7, difficulty=1)
    assert [r["reward_model"] for r in rows] == [{"style": "rule", "ground_truth": str(p.answer)} for p in problems]
    assert rows[0]["prompt"][0] == {"role": "system", "content": arith.SYSTEM_PROMPT}
    assert rows[0]["prompt"][-1] == {"role": "user", "content": problems[0].question}
    assert len(rows[0]["prompt"]) == 8 and {r["data_source"] for r in rows} == {"bloggap/arith"}
    assert [r["extra_info"]["index"] for r in rows] == [0, 1, 2, 3, 4]
    # verl's RLHFDataset reads parquet through datasets: the same rows come back
    ds = datasets.load_dataset("parquet", data_files=str(val), split="train")
    assert ds.column_names == list(verl_data.VERL_COLUMNS) and len(ds) == 3
    assert ds[0]["extra_info"]["split"] == "val"
    assert ds.to_list() == verl_data.verl_rows(3, seed=7 + verl_data._VAL_SEED_OFFSET, difficulty=1, split="val")


@pytest.mark.parametrize(
    "text, gold, expected",
    [("17 + 5 = 22", "22", 1.0), ("17 + 5 = 21", "22", 0.0), ("The answer is 1,024.", "1024", 1.0),
     ("22 apples, so 23", "22", 0.0), ("", "3", 0.0), ("no number", "3", 0.0), ("3.0", "3", 1.0)],
)
def test_compute_score_known_strings(text, gold, expected):
    assert verl_data.compute_score("bloggap/arith", text, gold) == expected
    assert verl_data.compute_score("bloggap/arith", text, gold, extra_info={"index": 0}) == expected
    # one rule: the TRL reward gives the same score
    assert arith.accuracy_reward([text], [gold]) == [expected]


def test_compute_score_refuses_other_data_source():
    with pytest.raises(ValueError, match="data_source='openai/gsm8k'"):
        verl_data.compute_score("openai/gsm8k", "4", "4")


def test_verl_loads_the_reward_by_its_config_path():
    from verl.utils.import_utils import load_extern_object

    fn = load_extern_object(module_path=verl_data.REWARD_PATH, object_name="compute_score")
    assert fn("bloggap/arith", "7 + 5 = 12", "12") == 1.0


def test_cli_writes_files_and_rejects_bad_counts(tmp_path, capsys):
    assert verl_data.main([str(tmp_path), "--train", "4", "--val", "2"]) == 0
    assert (tmp_path / "train.parquet").exists() and (tmp_path / "val.parquet").exists()
    assert verl_data.main([str(tmp_path / "x"), "--train", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: need at least 1 train and 1 val problem, got train=0 val=64"
    assert verl_data.main([str(tmp_path / "y"), "--difficulty", "9"]) == 2
    assert "arith difficulty must be one of" in capsys.readouterr().err
