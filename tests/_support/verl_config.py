"""verl's trainer config (``ppo_trainer``) composed with Hydra from verl's own config folder, as
``python -m verl.trainer.main_ppo OVERRIDES`` composes it, for tests that check a command or recipe against it.

Each compose reads the same few dozen YAML files of verl's again; their parsed contents are kept for the session,
keyed by the file's text (a changed file is parsed again), and each compose gets its own ``OmegaConf`` copy."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator, Sequence
from unittest import mock

_PARSED: dict[str, object] = {}
"""A YAML file's text -> what ``yaml.load`` with OmegaConf's loader made of it (plain dicts, lists, scalars)."""


def _load_parsed_once(file_):
    """``OmegaConf.load`` of an open file, the YAML parsed once per distinct text."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf._utils import get_yaml_loader

    text = file_.read()
    if text not in _PARSED:
        _PARSED[text] = yaml.load(text, Loader=get_yaml_loader())
    obj = copy.deepcopy(_PARSED[text])
    return OmegaConf.create() if obj is None else OmegaConf.create(obj)


@contextlib.contextmanager
def _yaml_parsed_once() -> Iterator[None]:
    from omegaconf import OmegaConf

    with mock.patch.object(OmegaConf, "load", _load_parsed_once):
        yield


def compose_ppo_trainer(overrides: Sequence[str]):
    """verl's ``ppo_trainer`` config with Hydra command-line ``overrides`` applied (a ``DictConfig``)."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with _yaml_parsed_once(), initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))
