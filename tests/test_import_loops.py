"""No import loops among lmserver's modules.

The graph is read from the source with ``ast`` (nothing is imported): an edge A -> B for
every ``import``/``from ... import`` in A that names lmserver module B, at module level or
inside a function (a deferred import is still a dependency). ``from .pkg import name``
points at ``pkg.name`` when that is a module, else at ``pkg`` (its ``__init__``).

Imports under ``if TYPE_CHECKING:`` COUNT too. They never run, so such a loop cannot fail
at import time; but it is still two modules that each need the other to be understood (the
review's loops were all of this kind: ``tiers/base.py`` <-> ``tiers/spec.py`` for
``ConfigError``, ``disk/tier.py`` <-> ``disk/victim.py`` for the victim's owner), and the
way out is usually a small shared module or a ``Protocol``, not hiding the import. The
runtime-only graph (``import_graph(type_checking=False)``) is a part of it, so it has no loop
either.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import lmserver

ROOT = Path(lmserver.__file__).parent


def module_names() -> dict[str, Path]:
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = ["lmserver", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST, type_checking: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import under ``node``; without ``type_checking``, not those under
    ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if not type_checking and isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _imports_of(other, type_checking)
            continue
        yield from _imports_of(child, type_checking)


def _imports_of(node: ast.AST, type_checking: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    else:
        yield from _imports(node, type_checking)


def import_graph(*, type_checking: bool = True) -> dict[str, set[str]]:
    modules = module_names()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path)), type_checking):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" for alias in node.names] + [source]
                # ``from pkg import mod`` names the module; ``from pkg import func`` the package.
                named = [t for t in targets[:-1] if t in modules]
                targets = named if len(named) == len(node.names) else [*named, source]
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_checker_sees_imports_and_loops() -> None:
    graph = import_graph()
    assert "lmserver.storage.store" in graph["lmserver.server"]
    assert "lmserver.storage.tiers.base" in graph["lmserver.storage.store"]
    assert "lmserver.storage.tiers.spec" in graph["lmserver.storage.tiers.base"]  # TYPE_CHECKING
    assert (
        "lmserver.storage.tiers.spec" not in import_graph(type_checking=False)["lmserver.storage.tiers.base"]
    )
    assert "lmserver.storage.tiers.disk.writer" in graph["lmserver.storage.tiers.disk"]  # its __init__
    assert "lmserver.storage.tiers.disk.index" in graph["lmserver.storage.tiers.disk.tier"]  # from . import
    assert loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert loops({"a": {"b"}, "b": set()}) == []


def test_no_import_loops() -> None:
    assert loops(import_graph()) == []
