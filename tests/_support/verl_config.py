"""verl's trainer config (``ppo_trainer``) composed with Hydra from verl's own config folder, as
``python -m verl.trainer.main_ppo OVERRIDES`` composes it, for tests that check a command or recipe against it.

Each compose loads the same few dozen config files of verl's again (YAML parse, ``OmegaConf.create``, defaults
list) and merges them in the same order, whatever the value overrides. Kept for the session, each keyed by what it
is made from (a changed file is read again) and kept as its pickle, each compose getting its own copy (OmegaConf
supports pickling, which costs less than ``copy.deepcopy``): what Hydra's config repository
loads (keyed by the search path, the config's path and the file's text), and the config Hydra merges from a
defaults list before it applies the overrides (keyed by the search path and the defaults list with each file's
text). Two pure functions Hydra calls for every node of the defaults tree are kept by their arguments too: the
read-only map of known choices that deferred interpolations in a defaults list resolve against (rebuilt with
``OmegaConf.create`` per node), and the parse of a version string; and each command-line override is parsed once
(Hydra's ANTLR grammar), each compose getting its own copy of the parsed ``Override``."""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
from collections.abc import Iterator, Sequence
from unittest import mock

_LOADED: dict[tuple, bytes] = {}
"""(search path, config path, file text) -> the pickled ``ConfigResult`` Hydra's ``ConfigRepository.load_config``
made."""
_INTERPOLATION_MAPS: dict[tuple, object] = {}
"""(known choices, defaults list entries, self added) -> the read-only ``DictConfig`` Hydra's
``defaults_list._create_interpolation_map`` builds from them."""
_PARSED: dict[tuple[str, str], bytes] = {}
"""(override text, grammar rule) -> the pickled result of Hydra's ``OverridesParser.parse_rule``."""
_MERGED: dict[tuple, bytes] = {}
"""(search path, ((defaults list entry, file text), ...)) -> the pickled ``DictConfig`` Hydra's
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


def _interpolation_map_key(overrides, defaults_list, self_added: bool) -> tuple:
    """What ``_create_interpolation_map`` reads: the known choices, and each entry of the defaults list as it adds it."""
    from hydra.core.default_element import ConfigDefault, GroupDefault

    entries = []
    for default in defaults_list:
        if self_added and default.is_self():
            continue
        if isinstance(default, ConfigDefault):
            entries.append(default.get_config_path())
        elif isinstance(default, GroupDefault):
            entries.append((default.get_override_key(), repr(default.value)))
    return tuple(overrides.known_choices.items()), tuple(entries)


@contextlib.contextmanager
def _loads_kept() -> Iterator[None]:
    from hydra import version
    from hydra._internal import defaults_list
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.config_repository import ConfigRepository
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    load = ConfigRepository.load_config
    merge = ConfigLoaderImpl._compose_config_from_defaults_list
    interpolation_map = defaults_list._create_interpolation_map
    parse = OverridesParser.parse_rule

    def parse_kept(self, text: str, rule_name: str):
        key = (text, rule_name)
        if key not in _PARSED:  # an override that fails to parse raises here each time, as it would
            _PARSED[key] = pickle.dumps(parse(self, text, rule_name))
        return pickle.loads(_PARSED[key])

    def interpolation_map_kept(overrides, defaults, self_added):
        key = _interpolation_map_key(overrides, defaults, self_added)
        if key not in _INTERPOLATION_MAPS:
            known_choices = interpolation_map(overrides, defaults, self_added)
            OmegaConf.set_readonly(known_choices, True)  # shared: a write by Hydra would raise, not leak
            _INTERPOLATION_MAPS[key] = known_choices
        return _INTERPOLATION_MAPS[key]

    def load_kept(self, config_path: str):
        key = (_sources(self), config_path, _file_text(self, config_path))
        if key not in _LOADED:
            _LOADED[key] = pickle.dumps(load(self, config_path))
        return pickle.loads(_LOADED[key])

    def merge_kept(self, defaults, repo):
        files = repo.delegate  # the CachingConfigRepository of this compose wraps the ConfigRepository
        key = (_sources(files), tuple((repr(d), d.config_path and _file_text(files, d.config_path)) for d in defaults))
        if key not in _MERGED:
            _MERGED[key] = pickle.dumps(merge(self, defaults, repo))
        return pickle.loads(_MERGED[key])

    with mock.patch.object(ConfigRepository, "load_config", load_kept), \
            mock.patch.object(ConfigLoaderImpl, "_compose_config_from_defaults_list", merge_kept), \
            mock.patch.object(defaults_list, "_create_interpolation_map", interpolation_map_kept), \
            mock.patch.object(OverridesParser, "parse_rule", parse_kept), \
            mock.patch.object(version, "_get_version", functools.lru_cache(maxsize=None)(version._get_version)):
        yield


def compose_ppo_trainer(overrides: Sequence[str]):
    """verl's ``ppo_trainer`` config with Hydra command-line ``overrides`` applied (a ``DictConfig``)."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with _loads_kept(), initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))
