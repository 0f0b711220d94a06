"""The project's import graph, parsed with ast (nothing is imported): modules, edges, closures, cycles.

Every ``import`` / ``from`` statement anywhere in a file is an edge: module level, function-local (a lazy
import still runs when called) and under ``if TYPE_CHECKING:`` (for cycles: a type-only cycle still ties
two modules together). The runtime closure leaves the TYPE_CHECKING edges out and adds, for each module,
the packages above it, whose ``__init__`` runs when it is imported.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "kv_transfer", "prefill_service", "decode_service", "gateway", "tandem_cli", "tandem",
            "benchmarks")


@dataclass
class ImportGraph:
    modules: set[str] = field(default_factory=set)
    edges: dict[str, set[str]] = field(default_factory=dict)  # every statement, TYPE_CHECKING included
    runtime: dict[str, set[str]] = field(default_factory=dict)  # project modules imported when it runs
    external: dict[str, set[str]] = field(default_factory=dict)  # top-level third-party names, at run time

    def closure(self, roots: set[str]) -> set[str]:
        """Every project module that importing (and running) ``roots`` can import."""
        seen: set[str] = set()
        todo = list(roots)
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            todo.extend(self.runtime.get(name, ()))
            todo.extend(_parents(name) & self.modules)
        return seen

    def external_closure(self, roots: set[str]) -> set[str]:
        return {ext for name in self.closure(roots) for ext in self.external.get(name, ())}

    def in_package(self, package: str) -> set[str]:
        return {m for m in self.modules if m == package or m.startswith(package + ".")}

    def cycles(self) -> list[list[str]]:
        """Each cycle once, as the path that closes it (``[a, b, a]``); empty when imports point one way."""
        return find_cycles(self.edges)


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    done: set[str] = set()
    cycles: list[list[str]] = []

    def visit(name: str, path: list[str]) -> None:
        for dep in sorted(graph.get(name, ())):
            if dep in path:
                cycles.append([*path[path.index(dep):], dep])
            elif dep not in done:
                visit(dep, [*path, dep])
        done.add(name)

    for name in sorted(graph):
        if name not in done:
            visit(name, [name])
    return cycles


def build(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> ImportGraph:
    files: dict[str, Path] = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    graph = ImportGraph(modules=set(files))
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        edges, runtime, external = set(), set(), set()
        for target, type_only in _imported_names(ast.parse(path.read_text(), str(path)), name, is_package):
            module = _resolve(target, graph.modules)
            if module is None:
                if not type_only and target.split(".")[0] not in packages:
                    external.add(target.split(".")[0])
                continue
            if module == name:
                continue
            edges.add(module)
            if not type_only:
                runtime.add(module)
        graph.edges[name], graph.runtime[name], graph.external[name] = edges, runtime, external
    return graph


def _imported_names(tree: ast.Module, module: str, is_package: bool) -> list[tuple[str, bool]]:
    """(dotted name, under TYPE_CHECKING) for every import; ``from a import b`` gives ``a.b`` and ``a``."""
    found: list[tuple[str, bool]] = []

    def walk(node: ast.AST, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    walk_stmt(stmt, True)
                for stmt in child.orelse:
                    walk_stmt(stmt, type_only)
                continue
            walk_stmt(child, type_only)

    def walk_stmt(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name, type_only) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, is_package)
            found.extend((f"{base}.{alias.name}", type_only) for alias in node.names)
        else:
            walk(node, type_only)

    walk(tree, False)
    return found


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    anchor = parts if is_package else parts[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join([*anchor, *([node.module] if node.module else [])])


def _resolve(target: str, modules: set[str]) -> str | None:
    """The longest prefix of ``target`` that is a project module (``from a import b``: ``a.b`` or ``a``)."""
    parts = target.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in modules:
            return name
    return None


def _parents(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:n]) for n in range(1, len(parts))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
