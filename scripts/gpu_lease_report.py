"""The GPU lease's report (scripts/gpu_lease.py): the pytest summary, issue 37's goals, the Markdown page."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

Row = dict[str, Any]


def junit_summary(path: Path) -> dict[str, Any]:
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        return {"junit_error": str(exc)}
    cases = list(root.iter("testcase"))
    failed, errors, skipped = [], [], Counter[str]()
    for case in cases:
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None:
            failed.append(name)
        elif case.find("error") is not None:
            errors.append(name)
        elif (skip := case.find("skipped")) is not None:
            skipped[(skip.get("message") or "")[:160]] += 1
    passed = len(cases) - len(failed) - len(errors) - sum(skipped.values())
    return {"passed": passed, "failed": len(failed), "errors": len(errors), "skipped": sum(skipped.values()),
            "failed_tests": failed[:40], "error_tests": errors[:40], "skip_reasons": dict(skipped.most_common(20))}


def log_summary(output: str) -> dict[str, Any]:
    """Outcome counts from pytest -v lines (``tests/x.py::test PASSED`` or xdist's ``[gw0] [ 5%] PASSED tests/...``)."""
    counts: Counter[str] = Counter()
    failed: list[str] = []
    for line in output.splitlines():
        match = re.search(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", line)
        if match is None or "::" not in line or line.startswith(("FAILED ", "ERROR ", "SKIPPED ")):
            continue  # the short summary at the end repeats the results
        counts[match.group(1)] += 1
        if match.group(1) in ("FAILED", "ERROR"):
            failed.append(next(word for word in line.split() if "::" in word))
    return {"passed": counts["PASSED"] + counts["XPASS"] + counts["XFAIL"], "failed": counts["FAILED"],
            "errors": counts["ERROR"], "skipped": counts["SKIPPED"], "failed_tests": failed[:40]}


def goals(rows: list[Row]) -> list[dict[str, Any]]:
    """Issue 37's GPU goals against this run's rows: met, missed, or not run (and why)."""

    def best(section: str, case: str, key: str) -> float | None:
        values = [r[key] for r in rows if r.get("section") == section and case in str(r.get("case"))
                  and isinstance(r.get(key), (int, float))]
        return max(values) if values else None

    graphs = next((r for r in rows if r.get("section") == "graphs" and "error" in r), {})
    table = [("Triton paged decode vs HBM copy", 0.70, best("decode", "triton", "vs_copy"), "no triton decode row"),
             ("CUDA-graph decode vs eager, batch 1, SmolLM2 shape", 1.5, best("graphs", "batch 1,", "speedup"),
              graphs.get("error", "no graphs row with a speedup")),
             ("FP8 GEMM vs bf16 at large M", 1.6, None, "benchmarks/gpu_check.py has no such section yet"),
             ("KV over CUDA IPC vs device memcpy", 0.70, best("kv-ipc", "", "vs_copy"), "no kv-ipc row")]
    return [{"goal": goal, "target": target, "measured": value,
             "verdict": "not run" if value is None else ("met" if value >= target else "missed"),
             "note": note if value is None else ""} for goal, target, value, note in table]


def markdown(report: dict[str, Any]) -> str:
    facts = report["facts"]
    versions = facts.get("versions", {})
    gpu = facts.get("gpu", {})
    lines = [f"# GPU lease, {report['started_utc']}", "",
             f"{gpu.get('name', 'no CUDA')} ({'; '.join(facts.get('nvidia_smi', [])) or 'nvidia-smi not run'}); "
             f"python {facts.get('python', '?')}, torch {versions.get('torch')} (CUDA {facts.get('torch_cuda')}), "
             f"triton {versions.get('triton')}, flashinfer {versions.get('flashinfer-python')}. "
             f"{report['elapsed_s']:.0f}s of a {report['deadline_s']:.0f}s deadline"
             + ("" if report["finished"] else ", still running") + ".", "",
             "| step | status | s | note |", "|---|---|---:|---|"]
    for s in report["steps"]:
        note = str(s["reason"]).replace("|", "/")
        lines.append(f"| {s['name']} | {s['status']} | {'' if s['seconds'] is None else s['seconds']} | {note} |")
    tests: dict[str, Any] = next((s["detail"] for s in report["steps"] if s["name"] == "gpu-tests"), {})
    if tests.get("failed_tests") or tests.get("error_tests") or tests.get("skip_reasons"):
        lines += ["", "## GPU tests", ""]
        lines += [f"- failed: {name}" for name in tests.get("failed_tests", [])]
        lines += [f"- error: {name}" for name in tests.get("error_tests", [])]
        lines += [f"- skipped x{n}: {why}" for why, n in tests.get("skip_reasons", {}).items()]
    if report["rows"]:
        lines += ["", "## Measurements", "", "| section | case | ms | GB/s | vs copy | tokens/s | note |",
                  "|---|---|---:|---:|---:|---:|---|"]
        for r in report["rows"]:
            note = str(r.get("error") or (f"max err {r['max_abs_err_vs_torch']:.2e}"
                                          if isinstance(r.get("max_abs_err_vs_torch"), float) else ""))
            lines.append(f"| {r.get('section')} | {r.get('case')} | {fmt(r.get('ms'), '.3f')} | "
                         f"{fmt(r.get('gb_s'), '.1f')} | {fmt(r.get('vs_copy'), '.0%')} | "
                         f"{fmt(r.get('tokens_per_s'), '.0f')} | {note.replace('|', '/')} |")
    lines += ["", "## Goals (issue 37)", "", "| goal | target | measured | verdict |", "|---|---:|---:|---|"]
    for g in report["goals"]:
        verdict = g["verdict"] + (f" ({g['note']})" if g["note"] else "")
        lines.append(f"| {g['goal']} | {g['target']:g} | {fmt(g['measured'], '.2f')} | {verdict} |")
    return "\n".join(lines) + "\n"


def fmt(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else ""
