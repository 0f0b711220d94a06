"""Benchmarks sit above the product: they import it, it never imports them, and their own imports form no cycle.

Every import statement counts (module level, under TYPE_CHECKING, inside functions), parsed with ast.
`tandem bench` reaches the CLI through the ``tandem.commands`` entry point, and says so when it is missing.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import tomllib
from pathlib import Path

import pytest

from tandem_cli.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("common", "kv_transfer", "prefill_service", "decode_service", "gateway", "tandem_cli", "tandem")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path) -> set[str]:
    """Every module ``path`` names in an import (absolute, relative resolved), and ``from x import y`` as x.y too."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name)
              and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("import_module", "__import__")):
            names.update(a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str))
    return names


def _benchmark_graph() -> dict[str, set[str]]:
    paths = sorted((ROOT / "benchmarks").rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): {m for m in _imported(p) if m in modules} - {_module_name(p)} for p in paths}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in sorted(graph[node]):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_among_benchmark_modules() -> None:
    graph = _benchmark_graph()
    assert {"benchmarks.suite", "benchmarks.report", "benchmarks.manifest", "benchmarks.cli"} <= set(graph)
    assert "benchmarks.report" in graph["benchmarks.suite"]  # the parser sees function-local imports too
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_product_module_imports_benchmarks() -> None:
    bad = []
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            if found := sorted(n for n in _imported(path) if n.split(".")[0] == "benchmarks"):
                bad.append(f"{path.relative_to(ROOT)} imports {found}")
    assert bad == []


def test_bench_is_an_entry_point_of_the_tandem_cli() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["entry-points"]["tandem.commands"]["bench"] == "benchmarks.cli:add_parser"
    from benchmarks import cli

    for argv, func in ((["bench", "report", "RUN_DIR"], cli.cmd_bench_report),
                       (["bench", "run", "--quick", "--sections", "offline"], cli.cmd_bench_run),
                       (["bench", "serve", "--workload", "mixed"], cli.cmd_bench_serve)):
        assert build_parser().parse_args(argv).func is func


def test_bench_without_the_benchmarks_says_they_are_not_installed(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kwargs: [])
    assert main(["bench", "run", "--quick"]) == 2
    assert "tandem bench: this command is not installed" in capsys.readouterr().err
    assert isinstance(build_parser().parse_args(["health", "--target", "x:1"]), argparse.Namespace)

    broken = importlib.metadata.EntryPoint("bench", "no_such_package_xyz.cli:add_parser", "tandem.commands")
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kwargs: [broken])
    assert main(["bench", "--help"]) == 2
    err = capsys.readouterr().err
    assert "not installed" in err and "no_such_package_xyz" in err


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parser and every subcommand's, depth first."""
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                found += _parsers(sub)
    return found


def test_every_command_s_help_renders() -> None:
    """argparse %-formats each help string: a bare '%' (as in '90%') breaks --help with a ValueError."""
    from benchmarks import bench_serve

    parsers = _parsers(build_parser())
    assert len(parsers) > 10
    serve = argparse.ArgumentParser(prog="python -m benchmarks.bench_serve")
    bench_serve.add_arguments(serve)
    for parser in [*parsers, serve]:
        assert parser.format_help()
