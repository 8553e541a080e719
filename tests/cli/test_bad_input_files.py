"""Files and names that are not what a command expects (not UTF-8, odd names, odd keys, a full disk): one line naming
the problem and the fix, exit 2, no traceback."""

from __future__ import annotations

import errno
import json
import os

import pytest
from _support.cli import RECIPES, assert_one_line_error, stored_doctor_json

NOT_UTF8 = b"num_seqs: 4\nmodel: \xff\xfe caf\xe9\n"


def test_config_file_not_utf8(bloggap, tmp_path):
    path = tmp_path / "doctor.yaml"
    path.write_bytes(NOT_UTF8)
    assert_one_line_error(bloggap("doctor", "--config", path), str(path), "not UTF-8", "save it as UTF-8")


@pytest.mark.parametrize("text, needle", [("1: 2\n", "int"), ("foo: 4\n3: x\n", "int"), ("null: 3\n", "NoneType"), ("true: 1\n", "bool"),
                                          ("? [a, b]\n: 1\n", "not valid YAML")])
def test_config_file_keys_that_are_not_names(bloggap, tmp_path, text, needle):
    path = tmp_path / "doctor.yaml"
    path.write_text(text)
    assert_one_line_error(bloggap("doctor", "--config", path), str(path), needle)


def test_config_file_name_not_utf8(bloggap, tmp_path):
    """A --config whose file name is not UTF-8: the message shows it with U+FFFD instead of failing to print."""
    path = os.path.join(os.fsencode(tmp_path), b"conf\xff.yaml")
    with open(path, "wb") as handle:
        handle.write(b"1: 2\n")
    line = assert_one_line_error(bloggap("doctor", "--config", os.fsdecode(path)), "conf\ufffd.yaml")
    line.encode("utf-8")  # printable


def test_patch_file_not_utf8(tmp_path, capsys):
    from bloggap_plugin.cli import main

    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "support_size_replay.patch").write_bytes(b"--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-\xff\n+y\n")
    code = main(["patch", "verl", "--check", "--root", str(tmp_path), "--patch-dir", str(patches)])
    assert_one_line_error((code, *capsys.readouterr()), "support_size_replay.patch", "not UTF-8")


def test_report_result_file_name_not_utf8(tmp_path, capsys):
    """A result file whose name is not UTF-8 is reported and rendered with U+FFFD (before: UnicodeEncodeError
    writing the Markdown)."""
    from bloggap_plugin.cli import main

    device = tmp_path / "results" / "dev"
    device.mkdir(parents=True)
    table = {"id": "T1", "title": "t", "columns": ["a", "b"], "rows": [["x", 1]], "notes": "", "reference": None,
             "random_init": False, "plot": False}
    document = {"benchmark": "tables", "schema_version": 1, "env": {}, "params": {}, "results": {}, "tables": [table]}
    with open(os.path.join(os.fsencode(device), b"r\xffs.json"), "w") as handle:
        json.dump(document, handle)
    output = tmp_path / "B.md"
    code = main(["report", "--results", str(tmp_path / "results"), "--output", str(output), "--no-plots",
                 "--readme", "none"])
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err, err
    assert "r\ufffds.json" in output.read_text(encoding="utf-8")


def test_compare_recipe_names_not_ascii(tmp_path, capsys):
    """Recipes named outside ASCII (UTF-8 or not, with $ for mathtext): the plot is drawn and compare.md written."""
    from bloggap_plugin.compare import CompareConfig, write_outputs

    names = ["ärm_Ω", "arm_$\\alpha$", os.fsdecode(b"arm_\xff")]
    results = {"arms": {name: {} for name in names}, "tables": [
        {"id": "T10", "title": "reward", "columns": ["arm", "reward"], "rows": [[name, 0.5] for name in names],
         "notes": "", "reference": None, "random_init": False}],
        "runs": {f"{name}_s0": {"arm": name, "rewards": [0.1, 0.2, 0.3]} for name in names}}
    config = CompareConfig(recipes=[str(tmp_path / f"{name}.yaml") for name in names], seeds=[0],
                           output_dir=str(tmp_path / "out"), model="tiny-random-llama")
    paths = write_outputs(config, results)
    markdown = (tmp_path / "out" / "compare.md").read_text(encoding="utf-8")
    assert "ärm_Ω" in markdown and "arm_\ufffd" in markdown
    assert open(paths["plot"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_doctor_json_on_a_full_disk(tmp_path, capsys, monkeypatch):
    """A full disk under ``doctor --json``: one line naming the file, the previous file unchanged."""
    from bloggap_plugin.cli import main

    source, target = tmp_path / "old.json", tmp_path / "new.json"
    source.write_text(json.dumps(stored_doctor_json()))

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    code = main(["doctor", "--from-json", str(source), "--json", str(target)])
    out, err = capsys.readouterr()
    assert_one_line_error((code, out, err), "new.json", "No space left on device", "previous file is unchanged")
    assert not target.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]


def test_verl_bloggap_node_that_is_a_value():
    """``+bloggap=5`` (or a list): one line saying how to give settings (before: TypeError from dict(5))."""
    from bloggap_plugin.verl.config import SettingsError, load_settings

    for node in (5, "band", [1, 2]):
        with pytest.raises(SettingsError, match=r"^bloggap=.* is not a group of settings: give each one as "
                                                r"\+bloggap\.<setting>=<value>"):
            load_settings(node, environ={})
    assert load_settings({"band": "0.05"}, environ={}).band == 0.05


def test_recipe_not_utf8_names_the_byte(bloggap, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes((RECIPES / "arm_A.yaml").read_bytes() + b"# caf\xe9\n")
    assert_one_line_error(bloggap("train", recipe, "--model", "tiny-random-llama", "--device", "cpu",
                                  "--output-dir", tmp_path / "out"), "not a text file", "not UTF-8 at byte")


def test_compare_log_with_a_byte_that_is_not_utf8_names_its_line(tmp_path):
    """A run log with a stray byte is a malformed line named by file and line (the run is set aside and trained
    again), not a UnicodeDecodeError from the whole file."""
    from bloggap_plugin.compare import read_log

    log = tmp_path / "A_s0.jsonl"
    log.write_bytes(b'{"step": 1}\n{"step": \xff2}\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"A_s0\.jsonl:2: not a JSON line \(not UTF-8 at byte 9\)"):
        read_log(log)
