"""A suite run's manifest, ``suite.json``: what ran, how, and where each section's files are.

Written by the suite (``benchmarks.suite``) after every section, read back by the report
(``benchmarks.report``); both import these types from here, neither imports the other for them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

MANIFEST_NAME = "suite.json"


@dataclass
class SectionResult:
    name: str
    title: str
    status: str  # ok | failed | skipped
    seconds: float = 0.0
    command: str = ""
    note: str = ""
    json_file: str | None = None


@dataclass
class SuiteRun:
    """The manifest of one run (``suite.json``): what ran, how, and where its files are."""

    model: str
    dtype: str
    threads: int
    quick: bool
    started: str
    command: str
    sections: list[SectionResult] = field(default_factory=list)
    total_seconds: float = 0.0
    cpu: str = ""  # model name, usable cores and vector-ISA flags of the machine it ran on ("" in old manifests)


def write_run(out_dir: Path, run: SuiteRun) -> None:
    (out_dir / MANIFEST_NAME).write_text(json.dumps(asdict(run), indent=2))


def load_run(out_dir: Path) -> SuiteRun:
    data = json.loads((out_dir / MANIFEST_NAME).read_text())
    sections = [SectionResult(**s) for s in data.pop("sections")]
    return SuiteRun(**data, sections=sections)
