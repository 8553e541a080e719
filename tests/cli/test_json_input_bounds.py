"""Every JSON file a user names is read through one bounded reader (``_input_files.load_json_file``): a file
larger than :data:`~bloggap_plugin._input_files.MAX_JSON_BYTES` is refused from its size, before a byte is read,
and a file that is not UTF-8 is refused, each in one line naming the file and the fix: ``doctor --from-json``,
``report``'s result files, compare's run logs and a model folder's ``config.json``."""

from __future__ import annotations

import json

import pytest
from _support.cli import assert_one_line_error, stored_doctor_json

from bloggap_plugin._input_files import MAX_JSON_BYTES

NOT_UTF8 = b'{"schema_version": 1, "title": "caf\xe9"}\n'


def _oversize(path):
    """A sparse file one byte over the limit (no disk used): only its size can refuse it."""
    with open(path, "wb") as handle:
        handle.truncate(MAX_JSON_BYTES + 1)
    return path


def _not_utf8(path):
    path.write_bytes(NOT_UTF8)
    return path


def test_doctor_from_json_refuses_an_oversize_file(bloggap, tmp_path):
    path = _oversize(tmp_path / "doctor.json")
    assert_one_line_error(bloggap("doctor", "--from-json", path), str(path), f"larger than {MAX_JSON_BYTES >> 20} MiB",
                          "give a bloggap doctor JSON")


def test_doctor_from_json_refuses_a_file_that_is_not_utf8(bloggap, tmp_path):
    path = _not_utf8(tmp_path / "doctor.json")
    assert_one_line_error(bloggap("doctor", "--from-json", path), str(path), "not UTF-8 at byte 35",
                          "give a bloggap doctor JSON")


def test_doctor_from_json_still_reads_a_doctor_json(bloggap, tmp_path):
    path = tmp_path / "doctor.json"
    path.write_text(json.dumps(stored_doctor_json()))
    code, out, err = bloggap("doctor", "--from-json", path)
    assert code == 0 and "Traceback" not in err, err


@pytest.mark.parametrize("make_file, needle", [(_oversize, f"larger than {MAX_JSON_BYTES >> 20} MiB"),
                                                (_not_utf8, "not UTF-8 at byte 35")], ids=["oversize", "not-utf8"])
def test_report_refuses_an_oversize_or_non_utf8_result_file(bloggap, tmp_path, make_file, needle):
    device = tmp_path / "results" / "cpu"
    device.mkdir(parents=True)
    path = make_file(device / "big.json")
    code, out, err = bloggap("report", "--results", tmp_path / "results", "--output", tmp_path / "B.md", "--no-plots",
                             "--readme", "none")
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, (code, err)
    assert str(path) in err and needle in err and "remove it from the results folder" in err
    assert not (tmp_path / "B.md").exists()


@pytest.mark.parametrize("make_file, needle", [(_oversize, f"larger than {MAX_JSON_BYTES >> 20} MiB"),
                                                (_not_utf8, "not UTF-8 at byte 35")], ids=["oversize", "not-utf8"])
def test_model_folder_config_json_is_bounded(bloggap, tmp_path, make_file, needle):
    folder = tmp_path / "model"
    folder.mkdir()
    path = make_file(folder / "config.json")
    assert_one_line_error(bloggap("doctor", "--model", folder, "--device", "cpu"), str(path), needle,
                          "fix or replace the model folder")


def test_compare_run_log_is_bounded(tmp_path):
    """A run log (compare reads every run's log in its output folder) over the limit: one line naming it."""
    from bloggap_plugin.compare.logs import read_log

    path = _oversize(tmp_path / "A_s0.jsonl")
    with pytest.raises(ValueError, match=f"{path}: larger than {MAX_JSON_BYTES >> 20} MiB") as err:
        read_log(path)
    assert "\n" not in str(err.value)


def test_compare_heldout_record_over_the_limit_is_not_read(tmp_path, monkeypatch):
    """The stored held-out result of a run: an oversize file counts as absent (evaluated again), and is never read
    into memory."""
    from pathlib import Path

    from bloggap_plugin.compare import heldout

    path = _oversize(tmp_path / "heldout.json")
    reads = []
    original = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: reads.append(self) or original(self))
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: reads.append(self) or "")
    monkeypatch.setattr(heldout, "heldout_path", lambda run: path)
    monkeypatch.setattr(heldout, "heldout_settings", lambda config, run: {})
    assert heldout.read_heldout(None, None, "attempt-1") is None
    assert path not in reads
