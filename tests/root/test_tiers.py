"""The test tiers (tests/_support/fixtures.py): requesting `trains`, `spawns` or `real_model` marks a test, so
`make test-fast` (``-m "not trains and not spawns and not real_model and not gpu"``) leaves it out; a test that
trains, starts a subprocess or loads the real model without its fixture fails, naming the fixture."""

from __future__ import annotations

import os

import pytest
from _support import ROOT

INNER = '''
import subprocess, sys

import pytest
import transformers


def test_spawns_unmarked():
    subprocess.run([sys.executable, "-c", "pass"])


def test_spawns_marked(spawns):
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0


def test_git_is_no_spawn():
    subprocess.run(["git", "--version"], capture_output=True)


def test_trains_unmarked_even_if_caught():
    try:
        transformers.Trainer.train(None)
    except BaseException:
        pass


def test_trains_marked(trains):
    with pytest.raises(AttributeError):  # past the guard: the real Trainer.train, on no trainer
        transformers.Trainer.train(None)


def test_real_model_unmarked():
    import bloggap_plugin.models as models

    models._load_smollm2(None)


def test_pure():
    assert 1 + 1 == 2
'''


@pytest.fixture(scope="module")
def trainer_loaded():
    """transformers' Trainer, loaded in this process before ``pytester`` snapshots the modules: the modules an
    in-process run loads are unloaded after it, and numpy (under the Trainer) cannot load twice in a process."""
    import transformers.trainer  # noqa: F401


def _run(pytester, *args: str):
    pytester.makepyfile(test_inner=INNER)
    return pytester.runpytest_inprocess("-p", "_support.fixtures", "-p", "no:cacheprovider", *args)


def test_a_test_that_trains_spawns_or_loads_the_real_model_without_its_fixture_fails(trainer_loaded, pytester):
    result = _run(pytester)
    result.assert_outcomes(passed=4, failed=3)
    out = result.stdout.str()
    for name, fixture in (("test_spawns_unmarked", "spawns"), ("test_trains_unmarked_even_if_caught", "trains"),
                          ("test_real_model_unmarked", "real_model")):
        (line,) = [line for line in out.splitlines() if line.startswith(f"FAILED test_inner.py::{name} ")]
        assert f"`{fixture}`" in line, line


def test_the_fast_tier_leaves_out_what_the_fixtures_mark(trainer_loaded, pytester):
    result = _run(pytester, "-m", "not trains and not spawns and not real_model", "-q")
    result.assert_outcomes(passed=2, failed=3, deselected=2)
    assert "test_spawns_marked" not in result.stdout.str() and "test_trains_marked" not in result.stdout.str()


@pytest.mark.parametrize("marker", ["trains", "spawns", "real_model"])
def test_each_tier_marker_is_registered(pytestconfig, marker):
    assert any(line.startswith(f"{marker}:") for line in pytestconfig.getini("markers"))


def test_the_guard_loads_no_trainer_yet_guards_one_a_test_loads_later(pytester, monkeypatch, spawns):
    """In a fresh process (the in-process runs above share this session's Trainer): starting the tiers imports
    no ``transformers.trainer`` (about 10 s on a 2-core machine), and a Trainer a test loads later is guarded."""
    pytester.makepyfile(test_inner=INNER + '''

def test_a_loaded_trainer_is_guarded():
    assert transformers.Trainer.train.tier_guard
''')
    pytester.makeconftest('''
import sys


def pytest_collection_finish(session):
    print("trainer loaded at collection:", "transformers.trainer" in sys.modules)
''')
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = pytester.runpytest_subprocess("-p", "_support.fixtures", "-p", "no:cacheprovider", "-s")
    result.assert_outcomes(passed=5, failed=3)
    assert "trainer loaded at collection: False" in result.stdout.str()
