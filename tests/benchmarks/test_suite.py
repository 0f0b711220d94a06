"""`tandem bench run --quick` on a tiny model: every section runs as a real process, the report and plots appear.

No timing assertions: the figures of a tiny random model on a shared machine mean nothing; what is tested is
that the suite completes, hands each section's JSON to the report, and skips missing peers with a note.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.suite import SECTION_NAMES, main

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


# Every section of the suite as a real process tree: 6 minutes on a busy 2-core machine, so past the
# suite-wide 600 s limit where CI's machine is busier still.
@pytest.mark.timeout(1500)
def test_quick_suite_on_the_tiny_model_writes_report_and_plots(
        tiny_served_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Peers must be skipped, not run, even on a machine that has them under .peers/.
    monkeypatch.setenv("TANDEM_PEER_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    monkeypatch.setenv("TANDEM_PEER_LLAMACPP_PYTHON", str(tmp_path / "no-such-python"))
    out = tmp_path / "run"
    status = main(["--quick", "--model", str(tiny_served_model_dir), "--dtype", "float32", "--threads", "1",
                   "--out", str(out)])

    suite = json.loads((out / "suite.json").read_text())
    by_name = {s["name"]: s for s in suite["sections"]}
    assert list(by_name) == list(SECTION_NAMES)
    failed = {n: s["note"] for n, s in by_name.items() if s["status"] == "failed"}
    assert not failed and status == 0
    # llama.cpp is skipped for a model that is not the bundled GGUF, vLLM as not installed.
    assert by_name["peer-vllm"]["status"] == "skipped" and "setup-peer.sh vllm" in by_name["peer-vllm"]["note"]
    assert by_name["peer-llamacpp"]["status"] == "skipped"
    for name, section in by_name.items():
        if section["status"] == "ok":
            assert (out / f"{name}.json").is_file() and section["command"].startswith("python -m benchmarks.")

    offline = json.loads((out / "offline.json").read_text())
    tandem = next(r for r in offline["results"] if r["system"] == "Tandem")
    assert tandem["output_tokens"] == 16 * 32  # the quick workload, every token generated
    mixed = json.loads((out / "serve-mixed.json").read_text())
    assert {s["system"] for s in mixed["systems"]} == {"disaggregated", "conditional", "colocated"}
    assert all(s["failed"] == 0 and set(s["by_kind"]) == {"short", "long"} for s in mixed["systems"])
    turns = json.loads((out / "serve-multi-turn.json").read_text())
    assert all(s["failed"] == 0 and set(s["by_kind"]) == {"turn 1", "turn 2", "turns 3+"} for s in turns["systems"])

    report = (out / "report.md").read_text()
    for heading in ("## Limits of this machine", "## Offline throughput", "## Speculative decoding",
                    "## KV transfer", "## Mixed workload"):
        assert heading in report
    plots = sorted(p.name for p in (out / "report-plots").iterdir())
    assert plots == sorted(["offline_throughput.png", "speculative_speedup.png", "kv_transfer_bandwidth.png",
                            "serve-serving_latency.png", "serve-shared-prefix_latency.png",
                            "serve-mixed_latency.png", "serve-multi-turn_latency.png"])
