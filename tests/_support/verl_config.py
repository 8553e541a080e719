"""verl's trainer config (``ppo_trainer``) composed with Hydra from verl's own config folder, as
``python -m verl.trainer.main_ppo OVERRIDES`` composes it, for tests that check a command or recipe against it.

Each compose loads the same few dozen config files of verl's again (YAML parse, ``OmegaConf.create``, defaults
list) and merges them in the same order, whatever the value overrides. Kept for the session, each keyed by what it
is made from (a changed file is read again), each compose getting its own deep copy (a pickle round trip, which
OmegaConf supports and which costs less than ``copy.deepcopy``): what Hydra's config repository
loads (keyed by the search path, the config's path and the file's text), and the config Hydra merges from a
defaults list before it applies the overrides (keyed by the search path and the defaults list with each file's
text)."""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Iterator, Sequence
from unittest import mock

_LOADED: dict[tuple, object] = {}
"""(search path, config path, file text) -> the ``ConfigResult`` Hydra's ``ConfigRepository.load_config`` made."""
_MERGED: dict[tuple, object] = {}
"""(search path, ((defaults list entry, file text), ...)) -> the ``DictConfig`` Hydra's
``ConfigLoaderImpl._compose_config_from_defaults_list`` merged from those files (no override applied yet)."""


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


def _sources(repository) -> tuple:
    return tuple((s.provider, s.path) for s in repository.get_sources())


@contextlib.contextmanager
def _loads_kept() -> Iterator[None]:
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.config_repository import ConfigRepository

    load = ConfigRepository.load_config
    merge = ConfigLoaderImpl._compose_config_from_defaults_list

    def load_kept(self, config_path: str):
        key = (_sources(self), config_path, _file_text(self, config_path))
        if key not in _LOADED:
            _LOADED[key] = load(self, config_path)
        return pickle.loads(pickle.dumps(_LOADED[key]))

    def merge_kept(self, defaults, repo):
        files = repo.delegate  # the CachingConfigRepository of this compose wraps the ConfigRepository
        key = (_sources(files), tuple((repr(d), d.config_path and _file_text(files, d.config_path)) for d in defaults))
        if key not in _MERGED:
            _MERGED[key] = merge(self, defaults, repo)
        return pickle.loads(pickle.dumps(_MERGED[key]))

    with mock.patch.object(ConfigRepository, "load_config", load_kept), \
            mock.patch.object(ConfigLoaderImpl, "_compose_config_from_defaults_list", merge_kept):
        yield


def compose_ppo_trainer(overrides: Sequence[str]):
    """verl's ``ppo_trainer`` config with Hydra command-line ``overrides`` applied (a ``DictConfig``)."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with _loads_kept(), initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))
