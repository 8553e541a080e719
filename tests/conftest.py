"""Shared test set-up: offline, single-threaded torch, a per-session model cache, shared fixtures."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CI", "true")  # TRL sends no telemetry under CI

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2_bf16():
    """The real default model (SmolLM2-135M-Instruct) in bf16, loaded once per session."""
    from bloggap_plugin.models import load_model

    return load_model("smollm2", dtype="bf16")


@pytest.fixture(scope="session")
def smollm2_fp32():
    """The real default model in fp32, loaded once per session."""
    from bloggap_plugin.models import load_model

    return load_model("smollm2", dtype="fp32")


# Test modules share helpers by plain import (e.g. ``from test_trl import make``) under --import-mode=importlib.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
