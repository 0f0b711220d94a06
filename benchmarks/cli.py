"""`tandem bench serve | run | soak | report`: the benchmark commands, each delegating to its module in benchmarks/.

The ``tandem`` CLI finds this module through the ``tandem.commands`` entry point group (pyproject.toml:
``bench = "benchmarks.cli:add_parser"``) and calls ``add_parser`` with its subparsers; the product never
imports benchmarks/, the benchmarks import the product.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from benchmarks import bench_serve, bench_soak, report, suite


def cmd_bench_serve(args: argparse.Namespace) -> int:
    return bench_serve.run(args)


def cmd_bench_run(args: argparse.Namespace) -> int:
    args.command_line = shlex.join(["tandem", *sys.argv[1:]])
    try:
        return suite.run(args)
    except ValueError as exc:
        print(f"tandem bench run: error: {exc}", file=sys.stderr)
        return 2


def cmd_bench_soak(args: argparse.Namespace) -> int:
    try:
        return bench_soak.run(args)
    except ValueError as exc:
        print(f"tandem bench soak: error: {exc}", file=sys.stderr)
        return 2


def cmd_bench_report(args: argparse.Namespace) -> int:
    print(report.write_report(Path(args.run_dir), Path(args.output) if args.output else None))
    return 0


def add_parser(sub: Any) -> None:
    """Add ``bench`` and its subcommands to the ``tandem`` subparsers ``sub`` (the entry point's target)."""
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, module, help_text, func in (
            ("serve", bench_serve, "load test over gRPC: disaggregated vs colocated", cmd_bench_serve),
            ("run", suite, "the whole suite (and installed peers) -> report.md + plots", cmd_bench_run),
            ("soak", bench_soak, "mixed load with cancellations and a node restart: RSS over time, leaks",
             cmd_bench_soak),
            ("report", report, "rebuild a run's report.md and plots from its JSON", cmd_bench_report)):
        parser = bench_sub.add_parser(name, help=help_text, description=module.__doc__,
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(parser)
        parser.set_defaults(func=func)
