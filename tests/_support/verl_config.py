"""verl's trainer config (``ppo_trainer``) composed with Hydra from verl's own config folder, as
``python -m verl.trainer.main_ppo OVERRIDES`` composes it, for tests that check a command or recipe against it.

Each compose loads the same few dozen config files of verl's again (YAML parse, ``OmegaConf.create``, defaults
list); what Hydra's config repository loads is kept for the session, keyed by the search path, the config's path
and the file's text (a changed file is loaded again), and each compose gets its own deep copy."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator, Sequence
from unittest import mock

_LOADED: dict[tuple, object] = {}
"""(search path, config path, file text) -> the ``ConfigResult`` Hydra's ``ConfigRepository.load_config`` made."""


def _file_text(repository, config_path: str) -> str | None:
    """The text of the YAML file ``config_path`` resolves to in ``repository`` (``None``: not a file source)."""
    source = repository._find_object_source(config_path=config_path, object_type=_config_type())
    if source is None or source.scheme() != "file":
        return None
    name = source._normalize_file_name(config_path)
    with open(os.path.realpath(os.path.join(source.path, name)), encoding="utf-8") as file_:
        return file_.read()


def _config_type():
    from hydra.core.object_type import ObjectType

    return ObjectType.CONFIG


@contextlib.contextmanager
def _loads_kept() -> Iterator[None]:
    from hydra._internal.config_repository import ConfigRepository

    load = ConfigRepository.load_config

    def load_kept(self, config_path: str):
        key = (tuple((s.provider, s.path) for s in self.sources), config_path, _file_text(self, config_path))
        if key not in _LOADED:
            _LOADED[key] = load(self, config_path)
        return copy.deepcopy(_LOADED[key])

    with mock.patch.object(ConfigRepository, "load_config", load_kept):
        yield


def compose_ppo_trainer(overrides: Sequence[str]):
    """verl's ``ppo_trainer`` config with Hydra command-line ``overrides`` applied (a ``DictConfig``)."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with _loads_kept(), initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))
