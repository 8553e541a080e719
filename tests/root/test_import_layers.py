"""The package's import graph, read from the source with ``ast`` (imports inside functions and under
``TYPE_CHECKING`` included): ``core`` imports nothing above it, no module imports from a higher layer, no
import circle, no private name imported across modules, no module file name in two places."""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

import pytest
from _support import ROOT

PACKAGE = ROOT / "bloggap_plugin"
ROOT = "bloggap_plugin"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("core",),  # torch maths, the scoring plans, and the vocabulary they share (arms, errors)
    ("_io", "_input_files", "_fields", "envinfo"),
    ("results", "models", "recipes", "sampling", "tasks", "vllm_kept_sets", "run_timing", "phase_timer", "checkpoint"),
    ("report_builder", "heldout_accuracy"),
    ("measure", "verl", "trl"),  # measurements and the trainer adapters
    ("compare",),  # sweeps of training runs (it runs trl's run_training)
    ("commands",),
    ("cli",),
    ("__init__",),  # the public face: lazy re-exports of a few names
)
"""Top-level units of the package (a subpackage or a root module), from the ground up; a unit may import
its own layer's units and those below, never above."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _statements(body: list):
    """Every statement of ``body`` and of the blocks nested in it (functions, classes, if/try/with/for/while/match
    bodies): an import is a statement, so these are all the places one can be (expressions are not visited)."""
    for node in body:
        yield node
        for block in ("body", "orelse", "finalbody", "handlers", "cases"):
            inner = getattr(node, block, None)
            if isinstance(inner, list):
                yield from _statements(inner)


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str]]:
    """``(imported module, imported name or "")`` for every import of the package in ``path``'s source."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in _statements(ast.parse(path.read_text(), str(path)).body):
        if isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if alias.name.split(".")[0] == ROOT]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != ROOT:
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.append((submodule, "") if submodule in modules else (source, alias.name))
    return found


@functools.cache
def package_imports() -> dict[str, list[tuple[str, str]]]:
    """Module -> its :func:`_imports`; the source is parsed once for the tests of this file (which only read it)."""
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, including the packages a submodule import runs (``a.b.c``
    runs ``a.b``'s ``__init__``), except the importer's own packages and the root package's ``__version__``."""
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, imports in package_imports().items():
        for target, imported in imports:
            if target == ROOT and imported == "__version__":  # a constant; the root is loaded before any submodule
                continue
            parts = target.split(".")
            for depth in range(2, len(parts) + 1):
                module = ".".join(parts[:depth])
                if module in modules and module != name and not name.startswith(module + "."):
                    graph[name].add(module)
            if target == ROOT:
                graph[name].add(ROOT)
    return {name: graph.get(name, set()) for name in modules}


def unit_of(module: str) -> str:
    """The top-level unit of ``module``: ``core`` for ``bloggap_plugin.core.plans.base``, ``__init__`` for the root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports(graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """``"a -> b"`` for every import from a unit to a unit of a higher layer."""
    layer = {unit: level for level, units in enumerate(layers) for unit in units}
    return [f"{source} -> {target}" for source, targets in sorted(graph.items()) for target in sorted(targets)
            if layer[unit_of(target)] > layer[unit_of(source)]]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """The package's import graph (:func:`import_graph`), read once for the tests of this file (which only read it)."""
    return import_graph()


def test_the_graph_is_read(graph):
    assert "bloggap_plugin.core.arms" in graph["bloggap_plugin.core.plans.registry"]
    # an import inside a function counts: commands.doctor imports measure.doctor_matrix in its run()
    assert "bloggap_plugin.measure.doctor_matrix" in graph["bloggap_plugin.commands.doctor"]
    # a submodule import runs its package's __init__
    assert "bloggap_plugin.compare" in graph["bloggap_plugin.commands.compare"]


def test_every_unit_has_a_layer(graph):
    units = {unit_of(module) for module in graph}
    placed = [unit for units_ in LAYERS for unit in units_]
    assert len(placed) == len(set(placed)), "a unit is in two layers"
    assert units == set(placed), f"place these in LAYERS: {sorted(units - set(placed))}; gone: {sorted(set(placed) - units)}"


def test_core_imports_nothing_outside_core(graph):
    outside = [f"{source} -> {target}" for source, targets in sorted(graph.items())
               if unit_of(source) == "core" for target in sorted(targets) if unit_of(target) != "core"]
    assert outside == []


def test_no_import_from_a_lower_layer_to_a_higher_one(graph):
    assert upward_imports(graph, LAYERS) == []


def test_no_import_circle(graph):
    assert cycles(graph) == []


def test_the_checks_catch_what_they_look_for(tmp_path):
    planted = {"bloggap_plugin.core.a": {"bloggap_plugin.trl.b"}, "bloggap_plugin.trl.b": {"bloggap_plugin.core.a"}}
    assert cycles(planted) == [["bloggap_plugin.core.a", "bloggap_plugin.trl.b"]]
    assert upward_imports(planted, (("core",), ("trl",))) == ["bloggap_plugin.core.a -> bloggap_plugin.trl.b"]
    # an import in every kind of block is found (the reader visits statements only)
    source = tmp_path / "m.py"
    source.write_text("if TYPE_CHECKING:\n    import bloggap_plugin.a\ntry:\n    import bloggap_plugin.b\n"
                      "except E:\n    import bloggap_plugin.c\nelse:\n    import bloggap_plugin.d\nfinally:\n"
                      "    import bloggap_plugin.e\nclass K:\n    def f(self):\n        with x:\n"
                      "            for i in y:\n                while z:\n                    import bloggap_plugin.f\n"
                      "                else:\n                    from bloggap_plugin import _g\n"
                      "match v:\n    case 1:\n        import bloggap_plugin.h\n")
    found = _imports("bloggap_plugin.m", source, {})
    assert sorted(found) == sorted([(f"bloggap_plugin.{x}", "") for x in "abcdefh"] + [("bloggap_plugin", "_g")])


def test_no_private_name_is_imported_across_modules():
    private = [f"{name} imports {source}.{imported}" for name, imports in package_imports().items()
               for source, imported in imports if imported.startswith("_") and not imported.startswith("__")]
    assert private == []


def test_one_file_name_per_feature():
    places = defaultdict(list)
    for path in PACKAGE.rglob("*.py"):
        if path.stem not in ("__init__", "__main__"):
            places[path.stem].append(str(path.relative_to(PACKAGE)))
    repeated = {stem: sorted(paths) for stem, paths in places.items() if len(paths) > 1}
    assert repeated == {}
