"""Subcommands that live above the product and register themselves through Python entry points."""

from __future__ import annotations

import argparse
import sys
from typing import Any

# Commands that live above the product and register themselves (`tandem bench` from benchmarks/, through
# pyproject's `bench = "benchmarks.cli:add_parser"`); the product never imports them.
COMMAND_ENTRY_POINTS = "tandem.commands"


def add_plugin_commands(sub: Any) -> None:
    """Let each ``tandem.commands`` entry point add its subcommand; one that cannot load, or a ``bench``
    that nothing provides (the benchmarks are not installed), becomes a command that says so."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=COMMAND_ENTRY_POINTS):
        if ep.name in sub.choices:
            continue
        try:
            add_parser = ep.load()
        except ImportError as exc:
            _add_missing_command(sub, ep.name, f"{ep.value} cannot be imported: {exc}")
            continue
        add_parser(sub)
    if "bench" not in sub.choices:
        _add_missing_command(sub, "bench", f"no {COMMAND_ENTRY_POINTS!r} entry point named 'bench' is registered")


def _add_missing_command(sub: Any, name: str, why: str) -> None:
    hint = (" The benchmarks (benchmarks/) ship with Tandem's source checkout: install that with "
            "`pip install -e .` or `make venv`." if name == "bench" else "")

    def missing(args: argparse.Namespace) -> int:
        print(f"tandem {name}: this command is not installed ({why}).{hint}", file=sys.stderr)
        return 2

    # Any arguments, options included (prefix_chars matches none), so every `tandem bench ...` gets the message.
    p = sub.add_parser(name, help="(not installed)", add_help=False, prefix_chars="\0")
    p.add_argument("args", nargs="*")
    p.set_defaults(func=missing)
