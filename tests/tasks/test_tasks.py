"""Tasks: GSM8K loading, gold extraction and parsers (hand-written cases), the arithmetic generator, get_task."""

from __future__ import annotations

import json
import re

import pytest

from bloggap_plugin.tasks import arith, get_task, gsm8k, prompt_fingerprint
from bloggap_plugin.tasks.gsm8k import GSM8KDataError, gold_answer, parse_lenient, parse_strict


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is 42.", "42"),
        ("3 + 4 = 7", "7"),
        ("She pays $1,234 in total, so 1,234", "1234"),
        ("It costs 18.00 dollars", "18"),
        ("half is 7.5", "7.5"),
        ("from 10 down to -3", "-3"),
        ("10-3=7", "7"),
        ("5-3", "3"),
        ("list 1,2,3", "3"),
        ("#### 72\nThanks!", "72"),
        ("no digits here", None),
        ("", None),
        (None, None),
        ("model h200 said 12", "12"),
        ("x2 is not a number", None),
    ],
)
def test_parse_lenient(text, expected):
    assert parse_lenient(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so 5 + 7 = 12\n#### 12", "12"),
        ("#### 1,000", "1000"),
        ("#### $45", "45"),
        ("####-8", "-8"),
        ("first #### 3 then #### 4", "4"),
        ("The answer is 12", None),
        ("#### twelve", None),
        ("#### 12.50", "12.5"),
        (None, None),
    ],
)
def test_parse_strict(text, expected):
    assert parse_strict(text) == expected


def test_gold_answer():
    assert gold_answer("He has 3 + 4 = <<3+4=7>>7 apples.\n#### 7") == "7"
    assert gold_answer("Total <<a>>.\n#### 1,440") == "1440"
    assert gold_answer("#### -7 ") == "-7"
    with pytest.raises(GSM8KDataError, match="no '####'"):
        gold_answer("The answer is 7")
    with pytest.raises(GSM8KDataError, match="not a number"):
        gold_answer("#### seven")


def test_sample_fixture_loads_in_every_local_form(tmp_path):
    rows = [json.loads(line) for line in gsm8k.SAMPLE_PATH.read_text().splitlines()]
    golds = ["12", "30", "252", "6", "1440", "255", "26", "20", "195", "4", "-7", "3500"]
    assert [gold_answer(r["answer"]) for r in rows] == golds
    from_jsonl = gsm8k.load_gsm8k(gsm8k.SAMPLE_PATH)
    assert from_jsonl["question"] == [r["question"] for r in rows]
    parquet = tmp_path / "train-00000-of-00001.parquet"
    from_jsonl.to_parquet(str(parquet))
    assert gsm8k.load_gsm8k(parquet)["answer"] == from_jsonl["answer"]
    assert gsm8k.load_gsm8k(tmp_path)["answer"] == from_jsonl["answer"]  # a folder of parquet files (hub layout)
    saved = tmp_path / "saved"
    from_jsonl.save_to_disk(str(saved))
    assert gsm8k.load_gsm8k(saved)["question"] == from_jsonl["question"]


def test_a_column_reads_as_the_list_of_its_rows_after_shuffle_and_select():
    dataset = gsm8k.load_gsm8k(gsm8k.SAMPLE_PATH)
    for view in (dataset, dataset.shuffle(seed=3), dataset.shuffle(seed=3).select([2, 0])):
        got = gsm8k.column(view, "question")
        assert type(got) is list and got == [view[i]["question"] for i in range(len(view))]


def test_gsm8k_errors_say_how_to_provide_data(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty_hf_home"))  # no cached copy either
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "empty_hf_home" / "datasets"))
    with pytest.raises(GSM8KDataError, match=r"openai/gsm8k.*--data PATH.*\.parquet"):
        gsm8k.load_gsm8k(None)
    with pytest.raises(GSM8KDataError, match="does not exist"):
        gsm8k.load_gsm8k(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "solution": "#### 1"}) + "\n")
    with pytest.raises(GSM8KDataError, match=r"lacks column\(s\) \['answer', 'question'\]"):
        gsm8k.load_gsm8k(bad)
    with pytest.raises(GSM8KDataError, match="must end in"):
        gsm8k.load_gsm8k(tmp_path / "data.csv") if (tmp_path / "data.csv").write_text("a") else None


def test_get_task_gsm8k_from_fixture():
    dataset, rewards = get_task("gsm8k", None, seed=0, data=str(gsm8k.SAMPLE_PATH))
    assert dataset.column_names == ["prompt", "answer"] and len(dataset) == 12
    first = dataset[0]["prompt"]
    assert first[0] == {"role": "system", "content": gsm8k.SYSTEM_PROMPT} and "#### <number>" in first[0]["content"]
    assert first[1]["role"] == "user"
    # Shuffled with the seed: same seed, same order; another seed, another order; same content.
    again, _ = get_task("gsm8k", None, seed=0, data=str(gsm8k.SAMPLE_PATH))
    other, _ = get_task("gsm8k", None, seed=1, data=str(gsm8k.SAMPLE_PATH))
    assert prompt_fingerprint(dataset) == prompt_fingerprint(again) != prompt_fingerprint(other)
    assert sorted(dataset["answer"]) == sorted(other["answer"])
    three, _ = get_task("gsm8k", None, seed=0, n=3, data=str(gsm8k.SAMPLE_PATH))
    assert three["answer"] == dataset["answer"][:3]
    # Rewards take TRL's conversational completions; lenient vs strict.
    gold = dataset["answer"][:2]
    completions = [[{"role": "assistant", "content": f"so it is {gold[0]}"}], [{"role": "assistant", "content": f"#### {gold[1]}"}]]
    assert rewards[0](completions, answer=gold) == [1.0, 1.0]
    strict = get_task("gsm8k", None, data=str(gsm8k.SAMPLE_PATH), parser="strict")[1][0]
    assert strict(completions, answer=gold) == [0.0, 1.0]
    assert rewards[0](["wrong 0.5", "no number"], answer=["1", "2"]) == [0.0, 0.0]
    with pytest.raises(ValueError, match="difficulty applies to the 'arith' task only"):
        get_task("gsm8k", None, difficulty=2, data=str(gsm8k.SAMPLE_PATH))


def _evaluate(expression: str) -> int:
    tokens = expression.split()
    total = int(tokens[0])
    for op, value in zip(tokens[1::2], tokens[2::2]):
        total = total + int(value) if op == "+" else total - int(value)
    return total


@pytest.mark.parametrize("level", sorted(arith.LEVELS))
def test_arith_problems_are_right_and_in_range(level):
    problems = arith.make_problems(200, seed=3, difficulty=level)
    spec = arith.LEVELS[level]
    for p in problems:
        numbers = [int(x) for x in re.findall(r"\d+", p.question)]
        assert numbers == [int(x) for x in re.findall(r"\d+", p.expression)]  # the story states the operands
        assert p.answer == _evaluate(p.expression) and p.answer >= 0
        assert spec.first[0] <= max(numbers[:2]) <= max(spec.first[1], spec.second[1])
    if level == 1:
        assert all(re.fullmatch(r"[1-9] \+ [1-9]", p.expression) for p in problems)
    if level == 4:
        assert {"+", "-"} <= {p.expression.split()[1] for p in problems}
    if level == 5:
        assert all(re.fullmatch(r"\d+ \+ \d+ - \d+", p.expression) for p in problems)
    assert arith.make_problems(200, seed=3, difficulty=level) == problems
    assert arith.make_problems(200, seed=4, difficulty=level) != problems


def test_get_task_arith_and_reward():
    dataset, rewards = get_task("arith", None, seed=5, difficulty=2, n=16)
    assert len(dataset) == 16 and dataset.column_names == ["prompt", "answer"]
    prompt = dataset[0]["prompt"]
    assert [m["role"] for m in prompt] == ["system", "user", "assistant", "user", "assistant", "user", "assistant", "user"]
    for shot, answer in zip(prompt[1:7:2], prompt[2:7:2]):  # the solved examples are right
        expr, result = answer["content"].split(" = ")
        assert _evaluate(expr) == int(result)
        assert re.findall(r"\d+", shot["content"]) == re.findall(r"\d+", expr)
    answers = dataset["answer"]
    completions = [[{"role": "assistant", "content": f"{a} + 0 = {a}"}] for a in answers[:2]]
    completions += [[{"role": "assistant", "content": f"{int(answers[2]) + 1}"}], [{"role": "assistant", "content": "I don't know"}]]
    assert rewards[0](completions, answer=answers[:4]) == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="arith difficulty must be one of"):
        get_task("arith", None, difficulty=9)
    with pytest.raises(ValueError, match="--data applies to 'gsm8k' only"):
        get_task("arith", None, data="x.jsonl")
    with pytest.raises(ValueError, match="unknown task 'mmlu'"):
        get_task("mmlu", None)


def test_prompts_follow_the_tokenizer():
    from bloggap_plugin.models import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    dataset, _ = get_task("arith", tokenizer, n=2)
    text = tokenizer.apply_chat_template(dataset[0]["prompt"], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n" + arith.SYSTEM_PROMPT) and text.endswith("<|im_start|>assistant\n")
    tokenizer.chat_template = None
    plain, _ = get_task("arith", tokenizer, n=2)
    assert isinstance(plain[0]["prompt"], str) and plain[0]["prompt"].endswith("\nA:")
    assert arith.SYSTEM_PROMPT in plain[0]["prompt"]


def test_a_set_built_before_the_tokenizer_fits_it_as_if_built_with_it():
    """for_tokenizer: what run_training does with the set prepare_run built (no tokenizer yet) equals get_task's set
    for the tokenizer, with and without a chat template (the same object with one: nothing is rebuilt)."""
    from bloggap_plugin.models import tiny_tokenizer
    from bloggap_plugin.tasks import for_tokenizer, get_heldout

    tokenizer = tiny_tokenizer()
    early, _ = get_task("arith", None, n=3, seed=2)
    assert for_tokenizer(early, tokenizer) is early
    tokenizer.chat_template = None
    for build in (lambda tok: get_task("arith", tok, n=3, seed=2)[0],
                  lambda tok: get_heldout("arith", tok, seed=2, heldout_n=3, n=3)[0]):
        fitted = for_tokenizer(build(None), tokenizer)
        assert fitted.to_dict() == build(tokenizer).to_dict() and isinstance(fitted[0]["prompt"], str)


# --------------------------------------------------------------------------------------------- the real GSM8K files


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in open(path) if line.strip()]


def test_real_gsm8k_loads_from_a_folder_or_a_file_and_is_checked(gsm8k_dir):
    train, test = _rows(gsm8k_dir / "train.jsonl"), _rows(gsm8k_dir / "test.jsonl")
    assert (len(train), len(test)) == (7473, 1319)  # the README's counts, read without the loader
    from_folder = gsm8k.load_gsm8k(gsm8k_dir, split="train")
    assert len(from_folder) == 7473 and from_folder["question"][:3] == [r["question"] for r in train[:3]]
    from_file = gsm8k.load_gsm8k(gsm8k_dir / "test.jsonl", split="test")
    assert from_file["answer"] == [r["answer"] for r in test]
    assert len(gsm8k.load_gsm8k(gsm8k_dir, split="test")) == 1319


def test_the_environment_variable_names_the_data_and_data_wins(gsm8k_dir, monkeypatch):
    monkeypatch.setenv(gsm8k.DATA_ENV, str(gsm8k_dir))
    assert len(gsm8k.load_gsm8k(None, split="test")) == 1319
    dataset, _ = get_task("gsm8k", None, seed=0, n=5)
    golds = {gold_answer(r["answer"]) for r in _rows(gsm8k_dir / "train.jsonl")}
    assert len(dataset) == 5 and set(dataset["answer"]) <= golds
    assert len(gsm8k.load_gsm8k(gsm8k.SAMPLE_PATH)) == 12  # an explicit path beats the variable
    monkeypatch.setenv(gsm8k.DATA_ENV, "")
    assert gsm8k.resolve_data(None) is None  # empty: the hub id


def _altered_copies(gsm8k_dir, tmp_path) -> dict:
    lines = (gsm8k_dir / "test.jsonl").read_text().splitlines(keepends=True)
    short = tmp_path / "short"
    short.mkdir()
    (short / "test.jsonl").write_text("".join(lines[:-1]))  # one row removed
    edited = tmp_path / "edited"
    edited.mkdir()
    first = json.loads(lines[0])
    first["answer"] = first["answer"].replace("#### ", "#### 1", 1)  # a gold answer changed, rows unchanged
    (edited / "test.jsonl").write_text(json.dumps(first) + "\n" + "".join(lines[1:]))
    return {"short": short, "edited": edited}


def test_a_cut_or_edited_copy_of_a_published_file_is_refused_in_one_line(gsm8k_dir, tmp_path, monkeypatch):
    copies = _altered_copies(gsm8k_dir, tmp_path)
    with pytest.raises(GSM8KDataError) as cut:
        gsm8k.load_gsm8k(copies["short"] / "test.jsonl", split="test")
    message = str(cut.value)
    assert "\n" not in message and f"{copies['short'] / 'test.jsonl'} has 1,318 rows" in message
    assert "the published test.jsonl has 1,319" in message and "restore the unchanged file" in message
    assert "point --data at another copy" in message
    with pytest.raises(GSM8KDataError, match=r"test\.jsonl has the right row count \(1,319\) but other bytes") as edit:
        gsm8k.load_gsm8k(copies["edited"], split="test")  # the folder form resolves to test.jsonl
    assert "\n" not in str(edit.value)
    monkeypatch.setenv(gsm8k.DATA_ENV, str(copies["short"]))
    with pytest.raises(GSM8KDataError, match=r"point \$BLOGGAP_GSM8K_DATA at another copy"):
        gsm8k.load_gsm8k(None, split="test")
    monkeypatch.setenv(gsm8k.DATA_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(GSM8KDataError, match=r"nowhere \(given by \$BLOGGAP_GSM8K_DATA\) does not exist"):
        gsm8k.load_gsm8k(None)
    # The same rows under a name of one's own are a subset, not the published file: loaded as they are.
    own = tmp_path / "my_subset.jsonl"
    own.write_text((copies["short"] / "test.jsonl").read_text())
    assert len(gsm8k.load_gsm8k(own)) == 1318


# --------------------------------------------------------------------------------------------- difficulty


def test_calc_steps_filter_matches_an_independent_count_on_real_data(gsm8k_dir):
    test = _rows(gsm8k_dir / "test.jsonl")
    loaded = gsm8k.load_gsm8k(gsm8k_dir, split="test")
    for steps, wanted in ((1, {1}), (2, {2}), ("1-2", {1, 2}), ((0, 1), {0, 1})):
        expected = [r["question"] for r in test if r["answer"].count("<<") in wanted]
        assert gsm8k.filter_by_calc_steps(loaded, steps)["question"] == expected, steps
    assert len(gsm8k.filter_by_calc_steps(loaded, None)) == 1319
    train = _rows(gsm8k_dir / "train.jsonl")
    one_step = sorted(gold_answer(r["answer"]) for r in train if r["answer"].count("<<") == 1)
    dataset, _ = get_task("gsm8k", None, seed=3, data=str(gsm8k_dir), calc_steps=1)
    assert sorted(dataset["answer"]) == one_step and len(one_step) > 100


def test_calc_steps_on_the_fixture_and_bad_values():
    rows = _rows(gsm8k.SAMPLE_PATH)
    assert [gsm8k.calc_steps(r["answer"]) for r in rows] == [r["answer"].count("<<") for r in rows]
    two = [gold_answer(r["answer"]) for r in rows if r["answer"].count("<<") == 2]
    dataset, _ = get_task("gsm8k", None, data=str(gsm8k.SAMPLE_PATH), calc_steps="2")
    assert sorted(dataset["answer"]) == sorted(two) and len(two) > 0
    assert gsm8k.parse_calc_steps(2) == (2, 2) and gsm8k.parse_calc_steps(" 1-3 ") == (1, 3)
    assert gsm8k.parse_calc_steps([0, 2]) == (0, 2) and gsm8k.parse_calc_steps(None) is None
    for bad in ("x", "-1", "3-1", True, "1-2-3", -2):
        with pytest.raises(ValueError, match="calc_steps"):
            gsm8k.parse_calc_steps(bad)
    with pytest.raises(GSM8KDataError, match="no GSM8K row has 40 calculation step"):
        get_task("gsm8k", None, data=str(gsm8k.SAMPLE_PATH), calc_steps=40)
    with pytest.raises(ValueError, match="calc_steps .* applies to 'gsm8k' only"):
        get_task("arith", None, calc_steps=1)


def test_worked_solution_removes_calculator_marks_and_ends_on_the_gold():
    """The supervised target: marks gone (the text beside them keeps the result), '#### <gold>' without commas."""
    answer = "Half is 48/2 = <<48/2=24>>24.\nShe pays $<<1000*1=1000>>1,000 in all.\n#### 1,000"
    assert gsm8k.worked_solution(answer) == "Half is 48/2 = 24.\nShe pays $1,000 in all.\n#### 1000"
    assert gsm8k.worked_solution(answer, calc_marks=True) == (
        "Half is 48/2 = <<48/2=24>>24.\nShe pays $<<1000*1=1000>>1,000 in all.\n#### 1000")
    with pytest.raises(gsm8k.GSM8KDataError):
        gsm8k.worked_solution("no final line")


def _targets_full_reward(rows: list[dict]) -> bool:
    targets = [gsm8k.worked_solution(row["answer"]) for row in rows]
    golds = [gsm8k.gold_answer(row["answer"]) for row in rows]
    return (gsm8k.accuracy_reward(targets, answer=golds) == [1.0] * len(rows)
            and gsm8k.strict_accuracy_reward(targets, answer=golds) == [1.0] * len(rows))


def test_every_worked_solution_of_the_fixture_scores_full_reward():
    rows = [json.loads(line) for line in gsm8k.SAMPLE_PATH.read_text().splitlines() if line.strip()]
    assert _targets_full_reward(rows)


def test_every_worked_solution_of_the_real_train_split_scores_full_reward(gsm8k_dir):
    rows = [json.loads(line) for line in (gsm8k_dir / "train.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) == 7473 and _targets_full_reward(rows)


# --------------------------------------------------------------------------------------------- T15 baseline script


def _baseline_module():
    from benchmarks import gsm8k_baseline

    return gsm8k_baseline


def test_gsm8k_baseline_scoring_by_hand():
    module = _baseline_module()
    rows = [{"index": i, "question": "q", "gold": gold, "calc_steps": steps}
            for i, (gold, steps) in enumerate([("5", 1), ("7", 2), ("1,000", 2), ("3", 3)])]
    rows[2]["gold"] = "1000"
    completions = {"greedy": ["so #### 5", "it is 7 apples", "#### 1,000", "3 or 4"],
                   "sampled": ["5 then 6", "#### 7", "1000.00", "three"]}
    scored = module.score(rows, completions)
    subsets = scored["subsets"]
    assert [subsets[s]["rows"] for s in ("all", "1-step", "2-step")] == [4, 1, 2]
    assert [subsets[s]["greedy"]["correct"] for s in ("all", "1-step", "2-step")] == [3, 1, 2]
    assert [subsets[s]["sampled"]["correct"] for s in ("all", "1-step", "2-step")] == [2, 0, 2]
    assert subsets["all"]["greedy"]["strict_correct"] == 2 and subsets["all"]["sampled"]["strict_correct"] == 1
    assert scored["correct_rows"] == {"greedy": [0, 1, 2], "sampled": [1, 2]}
    # Wilson 95% for 2 of 4, by hand: centre 0.5, half-width 1.96 * sqrt(1/16 + 1.96^2/64) / (1 + 1.96^2/4)
    low, high = subsets["all"]["sampled"]["ci95"]
    assert low == pytest.approx(0.150035, abs=1e-5) and high == pytest.approx(0.849965, abs=1e-5)


def test_gsm8k_baseline_quick_on_a_tiny_model(tmp_path, tiny):
    """The T15 script end to end with HF generate on CPU: the schema, the prompt TRL would build, and counts that
    equal an independent count of the fixture's rows and of the written completions."""
    module = _baseline_module()
    completions_path = tmp_path / "completions.jsonl"
    argv = ["--hf", "--model", "tiny-random-llama", "--device", "cpu", "--data", str(gsm8k.SAMPLE_PATH), "--limit", "4",
            "--max-tokens", "8", "--batch-size", "3", "--out", str(tmp_path), "--completions", str(completions_path)]
    assert module.main(argv) == 0
    payload = json.loads((tmp_path / "gsm8k_baseline.json").read_text())
    assert payload["benchmark"] == "gsm8k_baseline" and payload["schema_version"] == 1
    assert set(payload) == {"benchmark", "schema_version", "env", "params", "results", "tables"}
    (table,) = payload["tables"]
    assert table["id"] == "T15-baseline" and table["random_init"] is True
    assert table["columns"] == ["subset", "decoding", "rows", "correct", "accuracy %", "CI low %", "CI high %"]
    assert [row[:2] for row in table["rows"]] == [[s, d] for s in ("all", "1-step", "2-step")
                                                  for d in ("greedy", "sampled T=1.0")]
    fixture = _rows(gsm8k.SAMPLE_PATH)[:4]
    steps = [r["answer"].count("<<") for r in fixture]
    expected_rows = {"all": 4, "1-step": steps.count(1), "2-step": steps.count(2)}
    written = [json.loads(line) for line in completions_path.read_text().splitlines()]
    assert [w["gold"] for w in written] == [r["answer"].split("####")[-1].strip() for r in fixture]

    def last_number_is_gold(text: str, gold: str) -> bool:
        numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
        return bool(numbers) and numbers[-1].replace(",", "").rstrip(".") == gold

    for row in table["rows"]:
        subset, decoding, n, correct = row[:4]
        name = "greedy" if decoding == "greedy" else "sampled"
        members = [w for w, s in zip(written, steps) if subset == "all" or s == int(subset[0])]
        assert n == expected_rows[subset] == len(members)
        assert correct == sum(last_number_is_gold(w[name], w["gold"]) for w in members)
        assert (row[4] is None) == (n == 0)
    assert payload["params"]["rows"] == 4 and payload["params"]["engine"] == "HF generate"
    # The prompt is the gsm8k task's, through the chat template with the generation prompt (as TRL tokenizes it).
    _, tokenizer = tiny
    ids = module.build_prompt_ids(module.load_rows(str(gsm8k.SAMPLE_PATH), "test", 1), tokenizer)[0]
    text = ("<|im_start|>system\n" + gsm8k.SYSTEM_PROMPT + "<|im_end|>\n<|im_start|>user\n" + fixture[0]["question"]
            + "<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(ids) == text


def test_gsm8k_baseline_rows_by_calc_steps_keep_their_split_index():
    """--calc-steps keeps the rows with that many <<...>> steps, in file order, with their index in the split; --limit
    then counts among them (the fixture's steps per row: 2 2 2 3 1 3 3 1 2 1 1 1)."""
    module = _baseline_module()
    rows = module.load_rows(str(gsm8k.SAMPLE_PATH), "test", None, "1")
    assert [r["index"] for r in rows] == [4, 7, 9, 10, 11] and {r["calc_steps"] for r in rows} == {1}
    rows = module.load_rows(str(gsm8k.SAMPLE_PATH), "test", 4, "1-2")
    assert [(r["index"], r["calc_steps"]) for r in rows] == [(0, 2), (1, 2), (2, 2), (4, 1)]
    assert len(module.load_rows(str(gsm8k.SAMPLE_PATH), "test", None)) == 12


def test_gsm8k_baseline_refuses_bad_input_in_one_line(tmp_path, capsys, monkeypatch):
    import importlib.util

    module = _baseline_module()
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    for argv, problem in (
        (["--model", "tiny-random-llama", "--data", str(gsm8k.SAMPLE_PATH)], "vLLM is not installed here"),
        (["--hf", "--model", "tiny-random-llama", "--limit", "0"], "--limit 0: must be >= 1"),
        (["--hf", "--model", "tiny-random-llama", "--data", str(gsm8k.SAMPLE_PATH), "--calc-steps", "3-1"],
         "calc_steps '3-1': give a number >= 0 or a range low-high with low <= high"),
        (["--hf", "--model", "tiny-random-llama", "--data", str(tmp_path / "none.jsonl")], "does not exist"),
        (["--hf", "--model", "tiny-random-llama", "--decodings", "greedy,beam"],
         "--decodings 'greedy,beam': give one or more of greedy, sampled"),
    ):
        assert module.main([*argv, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("gsm8k_baseline: ") and problem in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------- held-out prompts


@pytest.mark.parametrize("level", [1, 2, 3, 4, 5])
def test_arith_heldout_never_shares_a_question_with_training(level):
    """The held-out problems and the training problems of every seed tried (and the prompt's solved examples) have
    no question in common, although the held-out generator alone would repeat training questions (shown at level 1,
    whose 7,776 possible questions a 1,024-problem training set covers an eighth of)."""
    from bloggap_plugin.tasks import ARITH_HELDOUT_SEED, get_heldout

    examples = {p.question for p in arith.make_problems(3, seed=10_000 + level, difficulty=level)}
    for seed in (0, 1, 2, 3):
        training = {p.question for p in arith.make_problems(1024, seed=seed, difficulty=level)}
        heldout, (reward,) = get_heldout("arith", None, seed=seed, difficulty=level, heldout_n=300)
        questions = [prompt[-1]["content"] for prompt in gsm8k.column(heldout, "prompt")]  # one read, not per row
        assert len(questions) == len(set(questions)) == 300
        assert not set(questions) & training and not set(questions) & examples
        # every answer is the sum / difference written in its question (an independent check of the answers)
        for question, answer in zip(questions[:20], heldout["answer"][:20]):
            numbers = [int(x) for x in re.findall(r"\d+", question)]
            expected = {numbers[0] + numbers[1]} if len(numbers) == 2 else {numbers[0] + numbers[1] - numbers[2]}
            if "gives" in question and len(numbers) == 2:
                expected = {numbers[0] - numbers[1]}
            assert int(answer) in expected
        assert reward([f"= {heldout['answer'][0]}"], answer=[heldout["answer"][0]]) == [1.0]
    unfiltered = {p.question for p in arith.make_problems(300, seed=ARITH_HELDOUT_SEED, difficulty=1)}
    if level == 1:
        assert unfiltered & {p.question for p in arith.make_problems(1024, seed=0, difficulty=1)}


def test_arith_heldout_is_the_same_across_seeds_but_for_skipped_questions_and_follows_n():
    from bloggap_plugin.tasks import get_heldout

    a = get_heldout("arith", None, seed=0, heldout_n=64)[0]["prompt"]
    b = get_heldout("arith", None, seed=1, heldout_n=64)[0]["prompt"]
    overlap = len({json.dumps(p) for p in a} & {json.dumps(p) for p in b})
    assert 50 <= overlap <= 64  # level 2: 17,280 questions, a training set of 1,024 skips ~6% of them
    small = {p[-1]["content"] for p in get_heldout("arith", None, seed=0, n=16, heldout_n=64)[0]["prompt"]}
    assert not small & {p.question for p in arith.make_problems(16, seed=0)}
    with pytest.raises(Exception, match="heldout_n must be"):
        get_heldout("arith", None, heldout_n=0)
    with pytest.raises(Exception, match="too few questions"):
        get_heldout("arith", None, difficulty=1, heldout_n=7_000)
    # 12 names x 8 objects x the operands' values: level 1 (1-9, 1-9) and level 2 (10-29, 1-9), the counts the
    # refusal above and the overlap bound rest on
    assert arith.question_count_bound(1) == 12 * 8 * 9 * 9 and arith.question_count_bound(2) == 12 * 8 * 20 * 9


def test_gsm8k_heldout_is_the_test_split_filtered_and_refuses_one_file(gsm8k_dir):
    from bloggap_plugin.tasks import get_heldout

    test = _rows(gsm8k_dir / "test.jsonl")
    train_questions = {r["question"] for r in _rows(gsm8k_dir / "train.jsonl")}
    heldout, _ = get_heldout("gsm8k", None, data=str(gsm8k_dir), calc_steps="1", heldout_n=40)
    one_step = [r for r in test if r["answer"].count("<<") == 1]
    assert [p[-1]["content"] for p in gsm8k.column(heldout, "prompt")] == [r["question"] for r in one_step[:40]]
    assert heldout["answer"] == [r["answer"].split("####")[-1].strip().replace(",", "") for r in one_step[:40]]
    assert not {p[-1]["content"] for p in gsm8k.column(heldout, "prompt")} & train_questions
    assert len(get_heldout("gsm8k", None, data=str(gsm8k_dir), calc_steps="1", heldout_n=1000)[0]) == 65
    with pytest.raises(Exception, match="is one file"):
        get_heldout("gsm8k", None, data=str(gsm8k.SAMPLE_PATH))


def test_gsm8k_baseline_stopped_after_the_first_decoding_keeps_it_in_valid_json(tmp_path, monkeypatch):
    """A run that dies while sampling (here: the generator raises on the first sampled piece, as a time limit would
    kill it) leaves a result document that passes the schema and holds every greedy cell, and no sampled one."""
    import decimal

    from bloggap_plugin.results import validate_result

    module = _baseline_module()
    real = module.hf_generator

    def dies_when_sampling(*args, **kwargs):
        generate, timing = real(*args, **kwargs)

        def wrapped(decoding, indices):
            if decoding == "sampled":
                raise KeyboardInterrupt("time limit")
            return generate(decoding, indices)

        return wrapped, timing

    monkeypatch.setattr(module, "hf_generator", dies_when_sampling)
    argv = ["--hf", "--model", "tiny-random-llama", "--device", "cpu", "--data", str(gsm8k.SAMPLE_PATH), "--limit", "6",
            "--max-tokens", "4", "--batch-size", "4", "--out", str(tmp_path), "--completions", str(tmp_path / "c.jsonl")]
    with pytest.raises(KeyboardInterrupt):
        module.main(argv)
    text = (tmp_path / "gsm8k_baseline.json").read_text()
    validate_result(json.loads(text, parse_float=decimal.Decimal), "gsm8k_baseline.json", None)
    payload = json.loads(text)
    (table,) = payload["tables"]
    # the fixture's first 6 rows have 2 2 2 3 1 3 steps: pieces 1-step (1 row), 2-step (3), rest (2)
    assert payload["results"]["done"] == ["greedy/1-step", "greedy/2-step", "greedy/rest"]
    assert payload["results"]["complete"] is False
    assert [row[:3] for row in table["rows"]] == [["all", "greedy", 6], ["1-step", "greedy", 1], ["2-step", "greedy", 3]]
    written = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert all(isinstance(w["greedy"], str) and w["sampled"] is None for w in written) and len(written) == 6
    assert payload["results"]["verdict"]["decodings"] == ["greedy"]


def test_gsm8k_baseline_greedy_alone_is_a_complete_run(tmp_path):
    """--decodings greedy: only greedy cells and completions, every piece done, the run complete; the greedy cells
    equal those of a run that also samples (the same rows, the same greedy texts)."""
    module = _baseline_module()
    common = ["--hf", "--model", "tiny-random-llama", "--device", "cpu", "--data", str(gsm8k.SAMPLE_PATH), "--limit",
              "4", "--max-tokens", "4", "--batch-size", "4"]
    assert module.main([*common, "--decodings", "greedy", "--out", str(tmp_path / "g"),
                        "--completions", str(tmp_path / "g.jsonl")]) == 0
    assert module.main([*common, "--out", str(tmp_path / "both")]) == 0
    alone = json.loads((tmp_path / "g" / "gsm8k_baseline.json").read_text())
    both = json.loads((tmp_path / "both" / "gsm8k_baseline.json").read_text())
    assert alone["params"]["decodings"] == ["greedy"] and alone["results"]["complete"] is True
    assert [row[1] for row in alone["tables"][0]["rows"]] == ["greedy"] * 3
    assert alone["tables"][0]["rows"] == [row for row in both["tables"][0]["rows"] if row[1] == "greedy"]
    assert "greedy only" in alone["tables"][0]["notes"]
    written = [json.loads(line) for line in (tmp_path / "g.jsonl").read_text().splitlines()]
    assert len(written) == 4 and all(set(w) == {"index", "gold", "calc_steps", "greedy"} for w in written)


def test_reading_local_gsm8k_prints_no_progress_bars_and_leaves_the_setting_alone(gsm8k_dir, tmp_path, monkeypatch,
                                                                                   capfd):
    """A first read of the local files (empty datasets cache) drew "Generating train split" bars on stderr, so a
    command's one-line refusal that followed was not its only stderr line; the user's bar setting is kept."""
    import datasets

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))  # a cold cache: datasets builds the split
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    was_disabled = datasets.are_progress_bars_disabled()
    capfd.readouterr()
    assert len(gsm8k.load_gsm8k(gsm8k_dir, split="test")) == 1319
    assert "Generating" not in capfd.readouterr().err
    assert datasets.are_progress_bars_disabled() == was_disabled
