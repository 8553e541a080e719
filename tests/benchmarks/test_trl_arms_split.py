"""T12's gap and update columns: the ratio's out-of-band share split by whether an optimizer step lies between the
old log-probs and the pass, from logged steps in both log layouts (before and after gap/update/* existed)."""

from __future__ import annotations

import json

import pytest

from benchmarks import trl_arms

OLD_LAYOUT = [{"step": 1, "gap/sampler/oob_frac": 0.04, "gap/ratio/oob_frac": 0.0},
              {"step": 2, "gap/ratio/oob_frac": 0.4},
              {"step": 3, "gap/sampler/oob_frac": 0.01, "gap/ratio/oob_frac": 0.02},
              {"step": 4, "gap/ratio/oob_frac": 0.2}]
SPLIT_LAYOUT = [{"step": 1, "gap/sampler/oob_frac": 0.04, "gap/ratio/oob_frac": 0.0},
                {"step": 2, "gap/update/oob_frac": 0.4},
                {"step": 3, "gap/sampler/oob_frac": 0.01, "gap/ratio/oob_frac": 0.02},
                {"step": 4, "gap/update/oob_frac": 0.2}]


@pytest.mark.parametrize("history", [OLD_LAYOUT, SPLIT_LAYOUT])
def test_gap_is_the_first_iterations_and_update_the_later_ones(history):
    gap, update = trl_arms.gap_and_update(history)
    assert gap == pytest.approx(0.01, abs=1e-15) and update == pytest.approx(0.3, abs=1e-15)


def test_no_logged_ratio_gives_no_split():
    assert trl_arms.gap_and_update([{"step": 1, "gap/sampler/oob_frac": 0.1}]) == (None, None)


def test_rebuild_adds_the_two_columns_and_keeps_every_other_cell(tmp_path):
    from bloggap_plugin.results import ResultDocument

    columns = ["arm", "ratio OOB %", "sampler OOB %", "reward last"]
    document = ResultDocument(benchmark="trl_arms", env={"gpu": "x"}, params={"model": "m", "steps": 4},
                              results={"A": {"history": OLD_LAYOUT}, "B": {"error": "boom"}},
                              tables=[{"id": "T12", "title": "t", "columns": columns, "notes": "n.",
                                       "rows": [["A", 15.5, 2.5, 0.5], ["B", None, None, None]],
                                       "reference": None, "random_init": False}])
    path = document.write(tmp_path / "trl_arms.json")
    trl_arms.rebuild(path)
    table = json.loads(path.read_text())["tables"][0]
    assert table["columns"] == ["arm", "ratio OOB %", *trl_arms.SPLIT_COLUMNS, "sampler OOB %", "reward last"]
    assert table["rows"] == [["A", 15.5, 1.0, 30.0, 2.5, 0.5], ["B", None, None, None, None, None]]
    assert table["notes"].startswith("n. gap / update:")
    before = path.read_text()
    trl_arms.rebuild(path)  # a document that has the columns is left as it is
    assert path.read_text() == before
