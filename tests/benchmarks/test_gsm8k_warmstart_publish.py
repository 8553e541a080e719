"""benchmarks/gsm8k_warmstart_publish.py: T18-warmstart-settings from run documents (which run is best, where it
stands against issue 33's floor and target), the folders a publication replaces, and its refusals. The smoke run's
publication end to end is in test_gsm8k_warmstart.py (it trains)."""

from __future__ import annotations

import json

import pytest

from benchmarks import gsm8k_warmstart_publish as publish


def _run(lr: float, correct: int, rows: int = 1000, complete: bool = True, max_steps=None, strict=None) -> dict:
    """A run document with only what the settings table reads."""
    cell = {"rows": rows, "correct": correct, "strict_correct": correct if strict is None else strict,
            "accuracy": correct / rows, "ci95": [correct / rows / 2, min(1.0, correct / rows * 2)]}
    before = {"rows": rows, "correct": 7, "strict_correct": 1, "accuracy": 7 / rows, "ci95": [0.001, 0.02]}
    return {"env": {"gpu": "H", "torch": "t", "trl": "r", "date": "d", "cpu": "ignored"},
            "params": {"lr": lr, "epochs": 3.0, "max_steps": max_steps, "seed": 0},
            "results": {"complete": complete, "timing": {"train_s": 100.5},
                        "train": {"steps": 351, "curve": [{"step": 5, "epoch": 0.04, "loss": 1.2},
                                                           {"step": 351, "epoch": 3.0, "loss": 0.43219}]},
                        "before": {"subsets": {"all": before}}, "after": {"subsets": {"all": cell}},
                        "checkpoint": {"sha256": "ab" * 32}}}


def test_the_best_run_is_the_most_accurate_complete_one_and_the_floor_counts_exactly():
    results = publish.settings_results({"a.json": _run(5e-5, 55), "b.json": _run(2e-4, 100),
                                        "c.json": _run(4e-4, 300, complete=False)})
    # c is the most accurate but did not finish: b, exactly at the 10% floor, is the best
    assert results["best"] == "b.json" and results["best_reaches_floor"] is True
    assert results["best_reaches_target"] is False
    results = publish.settings_results({"a.json": _run(5e-5, 55), "b.json": _run(2e-4, 99)})
    assert results["best"] == "b.json" and results["best_reaches_floor"] is False
    results = publish.settings_results({"a.json": _run(5e-5, 150)})
    assert results["best_reaches_floor"] is True and results["best_reaches_target"] is True
    none = publish.settings_results({"c.json": _run(4e-4, 300, complete=False)})
    assert none["best"] is None and none["best_reaches_floor"] is None
    assert "no complete run" in publish.settings_table(none)["notes"]


def test_the_settings_table_rows_are_the_documents_cells_in_percent():
    results = publish.settings_results({"a.json": _run(5e-5, 55, strict=50),
                                        "b.json": _run(2e-4, 123, rows=1319, max_steps=200)})
    table = publish.settings_table(results)
    assert table["id"] == "T18-warmstart-settings"
    rows = [dict(zip(table["columns"], row)) for row in table["rows"]]
    assert rows[0] == {"document": "a.json", "finished": True, "lr": 5e-5, "length": "3 epochs", "optimizer steps": 351,
                       "last loss": 0.4322, "train s": 100.5, "before %": 0.7, "after %": 5.5,
                       "after CI low %": 2.75, "after CI high %": 11.0, "after strict %": 5.0,
                       "checkpoint sha256": "ab" * 8}
    assert rows[1]["length"] == "200 steps" and rows[1]["after %"] == round(100 * 123 / 1319, 2) == 9.33
    assert "best: b.json, under the floor" in table["notes"] and "floor 10%" in table["notes"]
    cut = _run(1e-4, 90, complete=False)
    del cut["results"]["after"]  # stopped before its evaluation after: its row says so, with empty cells
    row = dict(zip(table["columns"], publish.settings_table(publish.settings_results({"c": cut}))["rows"][0]))
    assert row["finished"] is False and row["before %"] == 0.7
    assert [row[c] for c in ("after %", "after CI low %", "after CI high %", "after strict %")] == [None] * 4


def test_the_settings_document_is_written_from_the_documents_on_disk(tmp_path):
    paths = []
    for name, correct in (("gsm8k_warmstart.json", 55), ("gsm8k_warmstart_x.json", 120)):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(_run(1e-4, correct)))
    out = tmp_path / "settings.json"
    assert publish.main(["settings", "--out", str(out), *map(str, paths)]) == 0
    written = json.loads(out.read_text())
    assert written["params"]["documents"] == ["gsm8k_warmstart.json", "gsm8k_warmstart_x.json"]
    assert written["results"]["best"] == "gsm8k_warmstart_x.json"
    assert written["env"]["runs"]["gsm8k_warmstart.json"] == {"gpu": "H", "torch": "t", "trl": "r", "date": "d"}
    assert written["tables"] == [publish.settings_table(written["results"])]


def test_machine_folders_are_replaced_longest_first_and_only_when_they_are_folders():
    params = {"model_spec": "/tmp/vx/smollm2", "checkpoint_dir": "/tmp/vx/smollm2-gsm8k-sft", "data": ".dev/gsm8k"}
    log = ("[gsm8k_warmstart] wrote /tmp/vx/o/gsm8k_warmstart.json\n"
           "[gsm8k_warmstart] wrote /tmp/vx/w/r/gsm8k_warmstart.json")  # the last one counts
    assert publish.machine_folders(params, log) == [("/tmp/vx/smollm2-gsm8k-sft", "$CKPT"),
                                                    ("/tmp/vx/smollm2", "$MODEL"), ("/tmp/vx/w/r", "$OUT")]
    text = publish._replace("/tmp/vx/smollm2-gsm8k-sft and /tmp/vx/smollm2/config.json",
                            publish.machine_folders(params, log))
    assert text == "$CKPT and $MODEL/config.json"
    assert publish.machine_folders({"model_spec": "tiny-random-llama", "data": "/d/gsm8k"}, "") == [
        ("/d/gsm8k", "$DATA")]


def test_bad_input_is_one_line_naming_the_fix_and_writes_nothing(tmp_path, capsys):
    into = tmp_path / "into"
    assert publish.main(["run", str(tmp_path), "--name", "x", "--into", str(into)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gsm8k_warmstart_publish: ") and "no gsm8k_warmstart.json" in err and "NAME.tar.xz" in err
    junk = tmp_path / "junk.tar.xz"
    junk.write_bytes(b"not a pack")
    assert publish.main(["run", str(junk), "--name", "x", "--into", str(into)]) == 2
    assert "junk.tar.xz: not a readable pack" in capsys.readouterr().err
    assert publish.main(["run", str(tmp_path), "--name", "bad/name", "--into", str(into)]) == 2
    assert "bad run name 'bad/name'" in capsys.readouterr().err
    assert publish.main(["settings", "--out", str(into / "s.json"), str(tmp_path / "missing.json")]) == 2
    assert "no such run document" in capsys.readouterr().err
    assert not into.exists()


def test_a_machine_path_left_after_the_replacements_stops_the_publication(tmp_path):
    from benchmarks import gsm8k_warmstart

    run = tmp_path / "run"
    run.mkdir()
    payload = _run(1e-4, 90)
    payload["params"] = {**_ws_params(), "model_spec": "/tmp/vx/smollm2", "checkpoint_dir": "/tmp/vx/ckpt"}
    payload["env"]["python_home"] = "/root/.local/lib/x"  # a path nothing replaces
    payload["results"] = {**payload["results"], "done": []}
    (run / gsm8k_warmstart.DOCUMENT).write_text(json.dumps(payload))
    with pytest.raises(publish.PublishError, match=r"gsm8k_warmstart_n\.json would carry .*/root/\.local/lib/x"
                                                   r".*MACHINE_PATHS"):
        publish.publish_run(run, "n", tmp_path / "into")
    assert not (tmp_path / "into").exists()
    del payload["env"]["python_home"]
    (run / gsm8k_warmstart.DOCUMENT).write_text(json.dumps(payload))
    written = publish.publish_run(run, "n", tmp_path / "into")
    assert [p.name for p in written] == ["gsm8k_warmstart_n.json"]
    params = json.loads(written[0].read_text())["params"]
    assert (params["model_spec"], params["checkpoint_dir"]) == ("$MODEL", "$CKPT")


def test_a_settings_pack_is_published_as_its_unpacked_folder_and_holds_one_run(tmp_path):
    import tarfile

    from benchmarks import gsm8k_warmstart

    run = tmp_path / "lr9"
    run.mkdir()
    payload = _run(1e-4, 90)
    payload["params"] = {**_ws_params(), "checkpoint_dir": "/tmp/vx/w/ckpt-lr9"}
    payload["results"] = {**payload["results"], "done": []}
    (run / gsm8k_warmstart.DOCUMENT).write_text(json.dumps(payload))
    (run / "gsm8k_warmstart.log").write_text("[gsm8k_warmstart] wrote /tmp/vx/w/lr9/gsm8k_warmstart.json\n")
    with tarfile.open(tmp_path / "lr9.tar.xz", "w:xz") as tar:
        tar.add(run, arcname="lr9")
    from_folder = publish.run_files(run, "lr9")
    written = publish.publish_run(tmp_path / "lr9.tar.xz", "lr9", tmp_path / "into")
    assert {str(p.relative_to(tmp_path / "into")): p.read_bytes() for p in written} == from_folder
    assert b"$OUT/gsm8k_warmstart.json" in from_folder["logs/gsm8k_warmstart_lr9.log"]
    with tarfile.open(tmp_path / "two.tar.xz", "w:xz") as tar:
        tar.add(run, arcname="lr9")
        tar.add(run, arcname="lr10")
    with pytest.raises(publish.PublishError, match=r"two\.tar\.xz: a settings pack holds one run folder"):
        publish.publish_run(tmp_path / "two.tar.xz", "x", tmp_path / "into2")
    assert not (tmp_path / "into2").exists()


def _ws_params() -> dict:
    """Every parameter benchmarks.gsm8k_warmstart's tables read."""
    return {"model": "m", "model_spec": "m", "max_steps": None, "epochs": 3.0, "lr": 1e-4, "warmup": 0.03,
            "batch": 64, "grad_accum": 1, "precision": "bf16", "seed": 0, "eval_limit": None, "max_tokens": 256,
            "logging_steps": 5}


# ------------------------------------------------------------------------------------------- declared, select

DECLARED = "benchmarks/gsm8k_warmstart_declared.yaml"


def _declared_run(lr: float, correct: int, epochs: float = 3.0, split: str = "validation", rows: int = 500,
                  complete: bool = True) -> dict:
    """A run document as gsm8k_warmstart writes one for a declared setting (its default settings, ``lr``,
    ``epochs``, scored on ``split``)."""
    from benchmarks import gsm8k_warmstart

    params = {**{k: v for k, v in gsm8k_warmstart.GPU_DEFAULTS.items() if k != "model"}, "lr": lr,
              "epochs": epochs, "seed": 0, "eval_split": split, "model_spec": "/tmp/vx/smollm2"}
    document = _run(lr, correct, rows=rows, complete=complete)
    document["params"] = params
    document["results"]["checkpoint"] = {"sha256": f"{correct:064x}"}
    return document


def _all_declared(**correct) -> dict:
    counts = {"lr5e-5": 30, "lr2e-4": 44, "lr1e-4-e5": 40, "lr4e-4": 47, "lr8e-4": 45, **correct}
    settings = {"lr5e-5": (5e-5, 3.0), "lr2e-4": (2e-4, 3.0), "lr1e-4-e5": (1e-4, 5.0), "lr4e-4": (4e-4, 3.0),
                "lr8e-4": (8e-4, 3.0)}
    return {f"{name}.json": _declared_run(lr, counts[name], epochs) for name, (lr, epochs) in settings.items()}


def test_the_committed_declaration_lists_issue_33s_settings_plus_one_all_on_validation():
    from pathlib import Path

    from _support import ROOT

    declared = publish.declared_settings(ROOT / DECLARED)
    assert list(declared) == ["lr5e-5", "lr2e-4", "lr1e-4-e5", "lr4e-4", "lr8e-4"]
    assert declared["lr1e-4-e5"] == ["--lr", "1e-4", "--epochs", "5", "--eval-split", "validation", "--seed", "0"]
    assert all(argv[-4:] == ["--eval-split", "validation", "--seed", "0"] for argv in declared.values())
    assert Path(ROOT / DECLARED).is_file()


def test_select_chooses_the_most_validation_rows_correct_ties_to_the_first_declared():
    declared = publish.declared_settings(_root() / DECLARED)
    chosen = publish.select_setting(_all_declared(), declared)
    assert chosen["chosen"] == "lr4e-4" and chosen["document"] == "lr4e-4.json" and chosen["split"] == "validation"
    assert chosen["checkpoint_sha256"] == f"{47:064x}" and chosen["arguments"][:2] == ["--lr", "4e-4"]
    assert [row["correct"] for row in chosen["settings"]] == [30, 44, 40, 47, 45]
    tie = publish.select_setting(_all_declared(**{"lr8e-4": 47}), declared)
    assert tie["chosen"] == "lr4e-4"  # declared before lr8e-4
    assert publish.select_setting(_all_declared(**{"lr8e-4": 48}), declared)["chosen"] == "lr8e-4"


def _root():
    from _support import ROOT

    return ROOT


@pytest.mark.parametrize("change, message", [
    (lambda docs: docs["lr4e-4.json"]["params"].update(eval_split="test"),
     "lr4e-4.json is scored on the test split: the warm start is chosen on validation only"),
    (lambda docs: docs["lr4e-4.json"]["params"].pop("eval_split"),
     "lr4e-4.json is scored on the test split"),  # a document from before --eval-split
    (lambda docs: docs["lr4e-4.json"]["params"].update(lr=3e-4),
     "lr4e-4.json: its settings are none of the declared ones"),
    (lambda docs: docs.pop("lr8e-4.json"), r"declared setting\(s\) lr8e-4 have no run"),
    (lambda docs: docs["lr8e-4.json"]["results"].update(complete=False), "lr8e-4.json did not finish"),
    (lambda docs: docs.update({"again.json": json.loads(json.dumps(docs["lr2e-4.json"]))}),
     "again.json and lr2e-4.json are both runs of setting lr2e-4"),
    (lambda docs: docs["lr2e-4.json"]["results"]["after"]["subsets"]["all"].update(rows=400),
     "different numbers of validation rows"),
])
def test_select_refuses_test_undeclared_missing_unfinished_and_unequal_runs(change, message):
    documents = _all_declared()
    change(documents)
    with pytest.raises(publish.PublishError, match=message):
        publish.select_setting(documents, publish.declared_settings(_root() / DECLARED))


def test_a_declaration_scored_on_test_or_too_long_or_malformed_is_refused(tmp_path):
    cases = {
        "eval_arguments: [--eval-split, test]\nsettings: {a: []}\n": "setting a is scored on test",
        "settings: {a: []}\n": "setting a is scored on test",  # the run's default split is test
        "eval_arguments: [--eval-split, validation]\nsettings: {a: [--lr, '0.1'], b: [--nope]}\n":
            "setting b: '--nope --eval-split validation': not arguments of gsm8k_warmstart run",
        "eval_arguments: [--eval-split, validation]\nsettings: {" + ", ".join(f"s{i}: []" for i in range(7)) + "}\n":
            "7 settings declared; at most 6",
        "settings: [a]\n": "expected 'settings'",
        "eval_arguments: []\nsettings: {'bad/name': []}\n": "bad run name",
    }
    for number, (text, message) in enumerate(cases.items()):
        path = tmp_path / f"d{number}.yaml"
        path.write_text(text)
        with pytest.raises(publish.PublishError, match=message):
            publish.declared_settings(path)


def test_the_select_command_writes_the_choice_and_refuses_test_in_one_line(tmp_path, capsys):
    paths = []
    for name, document in _all_declared().items():
        path = tmp_path / name
        path.write_text(json.dumps(document))
        paths.append(str(path))
    out = tmp_path / "selection.json"
    assert publish.main(["select", *paths, "--file", str(_root() / DECLARED), "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["chosen"] == "lr4e-4" and written["declared_file"].endswith("gsm8k_warmstart_declared.yaml")
    assert capsys.readouterr().out.startswith("chosen: lr4e-4 (--lr 4e-4 --eval-split validation --seed 0)")
    committed = _root() / "benchmarks" / "results" / "h200" / "gsm8k_warmstart_lr4e-4.json"
    assert publish.main(["select", str(committed), "--file", str(_root() / DECLARED), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is scored on the test split" in err[0]
    assert json.loads(out.read_text()) == written  # nothing written on refusal


def test_select_names_the_card_each_setting_trained_on():
    """Settings scored on different cards (an H100 lent when no H200 was) stay comparable by the declared rule, but the
    selection says which card each ran on, so a reader sees it without opening every run document."""
    documents = _all_declared()
    for name, payload in documents.items():
        payload["env"] = {"gpu": "NVIDIA H100 80GB HBM3" if name.startswith("lr8") else "NVIDIA H200"}
    documents["lr5e-5.json"].pop("env")  # a run document without an env: the card is unknown, not guessed
    chosen = publish.select_setting(documents, publish.declared_settings(_root() / DECLARED))
    assert [row["gpu"] for row in chosen["settings"]] == [None, "NVIDIA H200", "NVIDIA H200", "NVIDIA H200",
                                                          "NVIDIA H100 80GB HBM3"]
