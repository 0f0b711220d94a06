"""README.md and docs/*.md name code; every name they use must exist today.

Checked against the code itself, not against a list kept here:
- every ``--flag``: a flag of some ``tandem`` subcommand (the parsers ``tandem_cli.cli.build_parser`` builds,
  plus the plugin commands pyproject.toml registers: ``tandem bench ...``, ``tandem plan``), or of a Tandem
  module or script the same pages run (``python -m benchmarks.X``, ``scripts/X.sh``), or of a peer tool
  (the small allowlist below);
- every ``TANDEM_*`` variable: a field of a settings class that ``load_settings`` fills
  (``TANDEM_<FIELD>``), or one of the variables read elsewhere, each listed with the file that reads it;
- every path under the repository's top-level folders, every ``python -m`` module of the project, every
  relative Markdown link (and its ``#anchor``), every Make target.
The benchmark result pages (benchmarks/RESULTS.md and each run's RESULTS.md) are checked for their links.
"""

from __future__ import annotations

import argparse
import importlib
import re
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULT_PAGES = [ROOT / "benchmarks" / "RESULTS.md", *sorted((ROOT / "benchmarks" / "results").glob("*/RESULTS.md"))]

# Classes whose fields ``load_settings`` (common/config/settings.py) reads as TANDEM_<FIELD>.
SETTINGS_CLASSES = {
    "common.config.settings": ("ModelSettings", "EngineSettings", "NodeSettings", "SecuritySettings",
                               "KernelSettings", "SpeculativeSettings"),
    "gateway.settings": ("GatewaySettings",),
    "common.telemetry.settings": ("TelemetrySettings",),
    "tandem_cli.client": ("ClientSecurity",),
}

# Variables read outside the settings classes, and the file that reads each.
OTHER_VARIABLES = {
    "TANDEM_PIN_CPUS": "tandem_cli/child_setup.py",
    "TANDEM_LAUNCHER_PID": "tandem_cli/child_setup.py",
    "TANDEM_PEER_VLLM_PYTHON": "benchmarks/peers/registry.py",
    "TANDEM_PEER_LLAMACPP_PYTHON": "benchmarks/peers/registry.py",
    "TANDEM_PEERS_DIR": "scripts/setup-peer.sh",
    "TANDEM_TEST_WORKERS": "scripts/run-tests.sh",
    "TANDEM_TEST_REQUIRE_GPU": "tests/conftest.py",
    "TANDEM_COMPOSE": "tests/deploy/test_compose_docker.py",
    "TANDEM_CONTAINER_ENGINE": "tests/deploy/test_compose_docker.py",
    "TANDEM_DOCKER_BASE_IMAGE": "tests/deploy/test_compose_docker.py",
    "TANDEM_K8S_CRD_DIR": "tests/deploy/test_kubernetes.py",
    "TANDEM_SMOKE_IMAGE": "scripts/k8s-smoke.sh",
    "TANDEM_SMOKE_NETWORK": "scripts/k8s-smoke.sh",
    "TANDEM_SMOKE_TIMEOUT_S": "scripts/k8s-smoke.sh",
    "TANDEM_PREFILL_CPUS": "compose.yaml",
    "TANDEM_DECODE_CPUS": "compose.yaml",
    "TANDEM_PREFILL_THREADS": "compose.yaml",
    "TANDEM_DECODE_THREADS": "compose.yaml",
    "TANDEM_PREFILL_GPU": "compose.yaml",
    "TANDEM_DECODE_GPU": "compose.yaml",
    "TANDEM_GPU_ATTENTION_BACKEND": "compose.yaml",
}

# Flags of tools that are not Tandem's, shown in the pages' example commands: docker / compose (`--rm`,
# `--name`, `--build`, `--profile`, `--build-arg`), Jaeger's image (`--set`), pip (`--no-deps`, `--no-index`),
# kubectl (`--replicas`), Ray's `ray start` (`--head`, `--node-ip-address`, `--resources`,
# `--min/max-worker-port`). They cannot be checked against Tandem's parsers; keep this list to other tools' flags
# only.
PEER_TOOL_FLAGS = {"--rm", "--name", "--build", "--profile", "--build-arg", "--set", "--no-deps", "--no-index",
                   "--replicas", "--head", "--node-ip-address", "--resources",
                   "--min-worker-port", "--max-worker-port"}

TOP_LEVEL = ("common", "tandem_cli", "benchmarks", "scripts", "docs", "gateway", "kv_transfer", "prefill_service",
             "decode_service", "tests", "protos", "requirements", "docker")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*-?\*?")
VARIABLE = re.compile(r"\bTANDEM_([A-Z0-9_]*)(\*|<[A-Za-z_]+>)?")
PATH = re.compile(r"(?<![\w./~$-])((?:" + "|".join(TOP_LEVEL) + r")/[\w./*<>{}-]*)")
MODULE = re.compile(r"python -m ([A-Za-z_][\w.]*)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
MAKE = re.compile(r"(?:^|[\s;&(])make ([a-z][\w-]*)")


def _text(page: Path) -> str:
    return page.read_text()


def _code(text: str) -> Iterator[str]:
    """The fenced blocks and inline code spans of a page."""
    yield from FENCE.findall(text)
    yield from INLINE_CODE.findall(FENCE.sub("", text))


def _pages_and(pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    """(page, whole match) for every match of ``pattern`` in README.md and docs/*.md."""
    return sorted({(page.relative_to(ROOT).as_posix(), m.group(0)) for page in PAGES
                   for m in pattern.finditer(_text(page))})


@cache
def tandem_flags() -> frozenset[str]:
    """Every option string of every ``tandem`` subcommand, plugins included."""
    from tandem_cli.cli import build_parser

    parser = build_parser()
    # The plugin commands from pyproject's entry points, added here as the CLI adds them, so the check holds
    # whether or not this checkout is installed.
    plugins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["tandem.commands"]
    extra = argparse.ArgumentParser(prog="tandem").add_subparsers()
    for target in plugins.values():
        module, _, function = target.partition(":")
        getattr(importlib.import_module(module), function)(extra)

    flags: set[str] = set()

    def walk(p: argparse.ArgumentParser) -> None:
        for action in p._actions:
            flags.update(s for s in action.option_strings if s.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)

    walk(parser)
    for sub in extra.choices.values():
        walk(sub)
    return frozenset(flags)


@cache
def own_tool_flags() -> frozenset[str]:
    """Flags of the Tandem modules and scripts the pages run themselves (`python -m benchmarks.X`,
    `scripts/X.sh`), read from their sources: argparse's ``add_argument("--x"`` and a shell ``--x)`` case."""
    flags: set[str] = set()
    text = "\n".join(_text(page) for page in PAGES)
    for module in set(MODULE.findall(text)):
        path = ROOT / (module.replace(".", "/") + ".py")
        if path.is_file():
            flags.update(re.findall(r"add_argument\(\s*\"(--[a-z][\w-]*)\"", path.read_text()))
    for script in set(re.findall(r"scripts/[\w.-]+\.sh", text)):
        path = ROOT / script
        if path.is_file():
            flags.update(re.findall(r"(--[a-z][\w-]*)\)", path.read_text()))
    return frozenset(flags)


@cache
def settings_variables() -> frozenset[str]:
    import dataclasses

    from common.config.settings import env_name

    names: set[str] = set()
    for module, classes in SETTINGS_CLASSES.items():
        for cls in classes:
            settings = getattr(importlib.import_module(module), cls)
            names.update(env_name(f.name, settings) for f in dataclasses.fields(settings))
    return frozenset(names)


def known_variables() -> frozenset[str]:
    return settings_variables() | frozenset(OTHER_VARIABLES)


@pytest.mark.parametrize(("page", "flag"), _pages_and(FLAG))
def test_every_flag_exists(page: str, flag: str) -> None:
    known = tandem_flags() | own_tool_flags() | PEER_TOOL_FLAGS
    if flag.endswith("*"):  # `--tls-*`: a family of flags
        assert any(k.startswith(flag[:-1]) for k in known), f"{page}: no flag starts with {flag[:-1]}"
        return
    flag = flag.rstrip("-")
    assert flag in known, f"{page} names {flag}, which no tandem command, Tandem script or listed peer tool has"


@pytest.mark.parametrize(("page", "variable"), _pages_and(VARIABLE))
def test_every_variable_is_read(page: str, variable: str) -> None:
    match = VARIABLE.fullmatch(variable)
    assert match is not None
    body, suffix = match.group(1), match.group(2) or ""
    if suffix.startswith("<") or not body:  # `TANDEM_<FIELD>`, `TANDEM_`: the rule, not a variable
        return
    if suffix == "*":  # `TANDEM_TLS_*`: a family
        prefix = "TANDEM_" + body
        assert any(v.startswith(prefix) for v in known_variables()), f"{page}: no variable starts with {prefix}"
        return
    name = "TANDEM_" + body.rstrip("_")
    assert name in known_variables(), f"{page} names {name}, which neither the settings nor the code reads"


@pytest.mark.parametrize(("name", "path"), sorted(OTHER_VARIABLES.items()))
def test_variables_read_elsewhere_are_read_there(name: str, path: str) -> None:
    assert name in (ROOT / path).read_text(), f"{path} no longer reads {name}"


def test_settings_classes_are_all_listed() -> None:
    """Every class the code passes to ``load_settings`` is one this test derives variables from."""
    import ast

    listed = {cls for classes in SETTINGS_CLASSES.values() for cls in classes}
    used: set[str] = set()
    for folder in ("common", "gateway", "kv_transfer", "prefill_service", "decode_service", "tandem_cli", "benchmarks"):
        for source in (ROOT / folder).rglob("*.py"):
            text = source.read_text()
            if "load_settings(" not in text:
                continue
            for node in ast.walk(ast.parse(text)):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "load_settings"
                        and node.args and isinstance(node.args[0], ast.Name)):
                    used.add(node.args[0].id)
    assert used <= listed, f"load_settings reads classes this test does not know: {used - listed}"


@pytest.mark.parametrize(("page", "path"), _pages_and(PATH))
def test_every_path_exists(page: str, path: str) -> None:
    path = path.rstrip(".,:")
    for stop in ("<", "{"):  # a placeholder (`results/<run-folder>/`): the part before it must exist
        if stop in path:
            path = path[: path.index(stop)].rsplit("/", 1)[0]
    if "*" in path:
        assert list(ROOT.glob(path)), f"{page}: nothing matches {path}"
    else:
        assert (ROOT / path).exists(), f"{page} names {path}, which does not exist"


@pytest.mark.parametrize(("page", "command"), _pages_and(MODULE))
def test_every_project_module_exists(page: str, command: str) -> None:
    module = command.removeprefix("python -m ")
    if module.split(".")[0] not in TOP_LEVEL:  # pip, venv, ...: not ours
        return
    base = ROOT / module.replace(".", "/")
    assert base.with_suffix(".py").is_file() or (base / "__main__.py").is_file(), f"{page}: no module {module}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in FENCE.sub("", _text(page)).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(out)


def _links() -> list[tuple[str, str]]:
    return sorted({(page.relative_to(ROOT).as_posix(), target) for page in [*PAGES, *RESULT_PAGES]
                   for target in LINK.findall(FENCE.sub("", _text(page)))
                   if not target.startswith(("http://", "https://", "mailto:"))})


@pytest.mark.parametrize(("page", "target"), _links())
def test_every_link_resolves(page: str, target: str) -> None:
    path, _, anchor = target.partition("#")
    source = ROOT / page
    resolved = (source.parent / path).resolve() if path else source
    assert resolved.exists(), f"{page} links to {target}: {resolved} does not exist"
    if anchor and resolved.suffix == ".md":
        assert anchor in anchors(resolved), f"{page} links to {target}: no such heading in {resolved.name}"


@cache
def make_targets() -> frozenset[str]:
    return frozenset(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))


def _make_mentions() -> list[tuple[str, str]]:
    return sorted({(page.relative_to(ROOT).as_posix(), target) for page in PAGES
                   for code in _code(_text(page)) for target in MAKE.findall(code)})


@pytest.mark.parametrize(("page", "target"), _make_mentions())
def test_every_make_target_exists(page: str, target: str) -> None:
    assert target in make_targets(), f"{page} runs `make {target}`; the Makefile has {sorted(make_targets())}"


def test_every_attention_backend_and_kernel_module_is_documented() -> None:
    """The two lists the README once had stale: the backend registry and the modules common.kernels.prebuild builds."""
    registry = (ROOT / "common" / "attention" / "backend.py").read_text()
    backends = re.findall(r"^\s+\"(\w+)\": \"common\.attention\.", registry, re.M)
    assert "flashinfer" in backends
    configuration = (ROOT / "docs" / "configuration.md").read_text()
    assert all(f"`{name}`" in configuration for name in backends), backends
    prebuild = (ROOT / "common" / "kernels" / "prebuild.py").read_text()
    modules = re.findall(r"\"([^\"]+)\": \w+[,}]", prebuild)
    kernels = (ROOT / "docs" / "cpu-kernels.md").read_text().lower()
    assert all(name.lower() in kernels for name in modules), modules
    count = ("none", "one", "two", "three", "four", "five", "six", "seven", "eight")[len(modules)]
    assert f"the {count} compiled modules" in kernels
    assert f"the {count} cpu kernel modules" in (ROOT / "README.md").read_text().lower()


def test_the_readme_is_a_door() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
