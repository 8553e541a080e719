"""Shared test set-up: offline, single-threaded torch, a per-session model cache, shared fixtures."""

from __future__ import annotations

import atexit
import gc
import importlib.abc
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CI", "true")  # TRL sends no telemetry under CI
# Tests never inherit the user's GSM8K path (it would change what get_task("gsm8k") loads); a folder it names is
# still used to find the real data when ../shared is not beside the repository (see gsm8k_dir below).
_GSM8K_ENV_AT_START = os.environ.pop("BLOGGAP_GSM8K_DATA", None)

import pytest  # noqa: E402

# --- tiers by speed ---------------------------------------------------------------------------------------------
# A test that trains, starts Python in a subprocess, or loads a real model requests the fixture of that
# name (directly or through a fixture that does): the request marks it, and `make test-fast` leaves the marked tests
# out. The marks cannot drift: a test that does one of these without the fixture fails at once, naming it (so the
# fast tier passing shows that no test in it trains, spawns or loads the real model).

TIERS = {
    "trains": "runs a training loop (transformers' Trainer.train)",
    "spawns": "starts a subprocess (the CLI, a script, a multi-process launch: Python and torch load again)",
    "real_model": "loads a real model (SmolLM2-135M, the default, or Gemma 3 270M)",
}
"""Marker (and fixture) name -> what a test that carries it does."""


@pytest.fixture(scope="session")
def trains():
    """Requested by a test or fixture that trains: marks the test ``trains`` (left out of ``make test-fast``)."""


@pytest.fixture(scope="session")
def spawns():
    """Requested by a test or fixture that starts a subprocess: marks the test ``spawns``."""


@pytest.fixture(scope="session")
def real_model():
    """Requested by a test or fixture that loads a real model (smollm2, gemma3-270m): marks the test ``real_model``."""


def pytest_configure(config):
    for name, what in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {what}; set by requesting the `{name}` fixture")
    if _hands_tests_to_workers(config):  # runs none itself: no torch (seconds) before the workers start
        return
    import torch

    torch.set_num_threads(1)
    _guard_tiers()


def _hands_tests_to_workers(config) -> bool:
    """Whether this process is pytest-xdist's controller (``-n N``, not ``--collect-only``), which starts the
    workers and runs no test itself (xdist's own test for a distributed session, less its workers)."""
    distributed = config.getoption("dist", "no") != "no" and bool(config.getoption("tx", None))
    return distributed and not config.getoption("collectonly") and not hasattr(config, "workerinput")


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, every test module) is kept out of the cyclic garbage
    collector from here on (``gc.freeze``): it lives until the process ends, and each full collection would
    otherwise walk all of it again."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """An xdist worker ends here once its exit handlers ran: the controller already holds every report (the worker
    sent them, then ``workerfinished``, before unconfigure), and Python's own finalisation of the modules a worker
    loaded (torch, transformers, verl) takes seconds and checks nothing."""
    if not hasattr(config, "workerinput"):
        return
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these markers
def pytest_collection_modifyitems(items):
    for item in items:
        for name in TIERS:
            if name in getattr(item, "fixturenames", ()):
                item.add_marker(name)


_RUNNING: dict = {"item": None, "missing": []}
"""The test being run (set-up, call and teardown) and the tier fixtures it used without requesting them."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _RUNNING.update(item=item, missing=[])
    try:
        return (yield)
    finally:
        _RUNNING["item"] = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    try:
        return (yield)
    finally:  # also when the test failed otherwise (it caught the guard's error and went on without the result)
        if _RUNNING["missing"]:
            names = sorted(set(_RUNNING["missing"]))
            pytest.fail(f"this test {'; '.join(TIERS[n] for n in names)} without requesting the fixture "
                        f"{', '.join(f'`{n}`' for n in names)}: request it, so the test is marked for the tiers",
                        pytrace=False)


class TierError(AssertionError):
    """A test trained, spawned or loaded the real model without requesting that fixture."""


def _require(name: str) -> None:
    """Stop (and remember, in case the test catches it) what a test does without requesting fixture ``name``."""
    item = _RUNNING["item"]
    if item is not None and name not in item.fixturenames:
        _RUNNING["missing"].append(name)
        raise TierError(f"this test {TIERS[name]} without requesting the `{name}` fixture")


_LAUNCHERS = ("bash", "sh", "torchrun", "accelerate")
"""Programs besides Python that a test starts to run Python (scripts, multi-process launches)."""


def _subprocess_audit(event: str, args) -> None:
    if event != "subprocess.Popen":
        return
    executable, argv = args[0], args[1]
    program = Path(os.fsdecode(executable or (argv if isinstance(argv, (str, bytes)) else argv[0])))
    if program.name.startswith("python") or program.name in _LAUNCHERS:  # not git, uname (platform), nvidia-smi
        _require("spawns")


def _guard_trainer(trainer_module) -> None:
    """Make ``Trainer.train`` of module ``transformers.trainer`` stop a test that did not request `trains`."""
    train = trainer_module.Trainer.train

    def guarded_train(self, *args, **kwargs):
        _require("trains")
        return train(self, *args, **kwargs)

    guarded_train.tier_guard = True
    trainer_module.Trainer.train = guarded_train


class _GuardOnImport(importlib.abc.MetaPathFinder):
    """Guards ``transformers.trainer`` as it is first imported: the tiers cost no Trainer import (seconds) in a
    session whose tests never load one. Stays on ``sys.meta_path`` as the sign that this process is guarded."""

    tier_guard = True
    module = "transformers.trainer"

    def find_spec(self, fullname, path, target=None):
        if fullname != self.module:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module = _then_guard(spec.loader.exec_module)
                return spec
        return None


def _then_guard(exec_module):
    """``exec_module`` followed by guarding the Trainer of the module it ran."""

    def exec_and_guard(module):
        exec_module(module)
        _guard_trainer(module)

    return exec_and_guard


def _guard_tiers() -> None:
    """Stop a training run, a subprocess or a real-model load in a test that did not request its fixture (once per
    process: a pytest session run inside a test must not wrap them twice)."""
    if any(getattr(finder, "tier_guard", False) for finder in sys.meta_path):
        return
    if _GuardOnImport.module in sys.modules:
        _guard_trainer(sys.modules[_GuardOnImport.module])
    sys.meta_path.insert(0, _GuardOnImport())

    import bloggap_plugin.models as models

    load_smollm2 = models._load_smollm2

    def guarded_load_smollm2(*args, **kwargs):
        _require("real_model")
        return load_smollm2(*args, **kwargs)

    models._load_smollm2 = guarded_load_smollm2
    load_gemma3 = models._load_gemma3

    def guarded_load_gemma3(*args, **kwargs):
        _require("real_model")
        return load_gemma3(*args, **kwargs)

    models._load_gemma3 = guarded_load_gemma3
    sys.addaudithook(_subprocess_audit)


@pytest.fixture(scope="session")
def smollm2_bf16(real_model):
    """The real default model (SmolLM2-135M-Instruct) in bf16, loaded once per session."""
    from bloggap_plugin.models import load_model

    return load_model("smollm2", dtype="bf16")


@pytest.fixture(scope="session")
def smollm2_fp32(real_model):
    """The real default model in fp32, loaded once per session."""
    from bloggap_plugin.models import load_model

    return load_model("smollm2", dtype="fp32")


@pytest.fixture(scope="session")
def tiny_model():
    """``tiny_model(spec="tiny-random-llama", dtype="fp32")`` -> ``(model, tokenizer)`` on CPU, in eval mode: the
    one tiny random model of that spec and dtype for the whole session (seeded, so identical to a fresh
    ``load_model(spec)``). Shared: a test that changes a model's weights or configs loads its own copy."""
    from bloggap_plugin.models import load_model

    cache: dict[tuple[str, str], tuple] = {}

    def load(spec: str = "tiny-random-llama", dtype: str = "fp32"):
        if (spec, dtype) not in cache:
            cache[(spec, dtype)] = load_model(spec, dtype=dtype)
        return cache[(spec, dtype)]

    return load


@pytest.fixture(scope="session")
def tiny(tiny_model):
    """The default tiny model: ``(model, tokenizer)`` of tiny-random-llama in fp32 (2 layers, hidden 32)."""
    return tiny_model()


def real_gsm8k_dir():
    """The real GSM8K folder (train.jsonl, test.jsonl): ``../shared/data/gsm8k`` beside the repository (as in CI),
    else the folder ``$BLOGGAP_GSM8K_DATA`` named when the tests started; ``None`` when neither has the files."""
    from pathlib import Path

    from _support import ROOT

    candidates = [ROOT.parent / "shared" / "data" / "gsm8k"]
    if _GSM8K_ENV_AT_START:
        candidates.append(Path(_GSM8K_ENV_AT_START))
    for folder in candidates:
        if (folder / "train.jsonl").is_file() and (folder / "test.jsonl").is_file():
            return folder
    return None


@pytest.fixture
def gsm8k_dir():
    """The real GSM8K folder, or skip: the data lives outside the package (../shared/data/gsm8k)."""
    folder = real_gsm8k_dir()
    if folder is None:
        pytest.skip("real GSM8K data not found: expected ../shared/data/gsm8k beside the repository (train.jsonl, "
                    "test.jsonl), or set BLOGGAP_GSM8K_DATA to that folder")
    return folder


def _row_invariant_linear(x, weight, bias=None):
    """``F.linear`` as a product and a sum over the input features: each output element is reduced in the
    same order whatever the number of rows in the call (a BLAS matmul may pick another kernel for another
    row count, which changes the last bit: the noise this project measures)."""
    out = (x.unsqueeze(-2) * weight).sum(-1)
    return out if bias is None else out + bias


@pytest.fixture
def row_invariant_linear(monkeypatch):
    """Every ``nn.Linear`` / ``F.linear`` in the test computes row-count invariantly (see above), so tiled and
    untiled scoring can be compared bit for bit on any tile shape."""
    import torch

    monkeypatch.setattr(torch.nn.functional, "linear", _row_invariant_linear)


class LargestVocabTensor:
    """Context manager recording the largest tensor (numel) any torch op allocates whose last dimension is
    ``vocab``: the logits-sized tensors of a scoring call. Outputs sharing storage with an input (views:
    slices, reshapes, the head weight's transpose) allocate nothing and are not counted."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.largest = 0
        self._mode = None

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        probe = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                inputs = {
                    t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                    if isinstance(t, torch.Tensor)
                }
                for t in tree_flatten(out)[0]:
                    if not isinstance(t, torch.Tensor) or not t.dim() or t.shape[-1] != probe.vocab:
                        continue
                    if t.untyped_storage().data_ptr() not in inputs:  # a view of an input allocates nothing
                        probe.largest = max(probe.largest, t.numel())
                return out

        self.largest = 0
        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


@pytest.fixture
def largest_vocab_tensor():
    """``largest_vocab_tensor(vocab)``: a :class:`LargestVocabTensor` probe."""
    return LargestVocabTensor


def _no_model(*args, **kwargs):
    raise AssertionError("a model was loaded before the bad input was reported")


@pytest.fixture
def bloggap(monkeypatch, capsys):
    """Run ``bloggap ARGS`` in this process; fail if a model loads; return ``(exit code, stdout, stderr)``."""
    import bloggap_plugin.models as models

    monkeypatch.setattr(models, "load_model", _no_model)
    return cli_runner(capsys)


def cli_runner(capsys):
    """``run(*argv) -> (exit code, stdout, stderr)`` of ``bloggap ARGV`` in this process."""
    from bloggap_plugin import cli

    def run(*argv) -> tuple[int, str, str]:
        code = cli.main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run
