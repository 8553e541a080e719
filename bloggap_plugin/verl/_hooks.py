"""Run a callback right after a named module is imported (or now, if it already is).

verl loads ``verl.plugins`` entry points from inside ``verl/__init__.py``, before most of verl exists, and
several modules we patch (the V1 trainer needs ``transfer_queue``) may never be importable in a given
process. So nothing is imported eagerly: each patch waits for its target module.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable

_CALLBACKS: dict[str, list[Callable]] = {}
_DONE: set[tuple[str, int]] = set()
_LOCK = threading.RLock()


def _run(name: str, module) -> None:
    with _LOCK:
        callbacks = list(_CALLBACKS.get(name, ()))
    for callback in callbacks:
        key = (name, id(callback))
        if key in _DONE:
            continue
        _DONE.add(key)
        callback(module)


class _LoaderWrapper(importlib.abc.Loader):
    def __init__(self, loader, name: str):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _run(self._name, module)

    def __getattr__(self, item):
        return getattr(self._loader, item)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of watched modules so their callbacks run after the module body executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _CALLBACKS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _LoaderWrapper(spec.loader, fullname)
                return spec
        return None


_FINDER = _PostImportFinder()


def when_imported(name: str, callback: Callable) -> None:
    """Call ``callback(module)`` once, after ``name`` is imported (immediately if it already is)."""
    with _LOCK:
        callbacks = _CALLBACKS.setdefault(name, [])
        if callback not in callbacks:
            callbacks.append(callback)
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
    module = sys.modules.get(name)
    if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False) is False:
        _run(name, module)
