"""The report builder on a hand-made run directory: every table and plot appears, skipped sections say why."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from benchmarks.manifest import SectionResult, SuiteRun
from benchmarks.report import write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _dist(base: float) -> dict[str, float]:
    return {"mean": base, "p50": base, "p90": 2 * base, "p99": 3 * base}


def _serve(name: str, systems: list[str], kinds: list[str]) -> dict:
    def system(label: str, scale: float) -> dict:
        records = [{"index": i, "kind": kinds[i % len(kinds)], "prompt_len": 100, "num_tokens": 32, "ok": True,
                    "ttft_s": scale * (0.1 + 0.01 * i), "tpot_s": scale * (0.02 + 0.001 * i), "e2e_s": scale}
                   for i in range(12)]
        return {"system": label, "placement": f"{label} [cpu 0,1]", "completed": 12, "failed": 0, "wrong_length": 0,
                "duration_s": 10.0, "input_tokens": 1200, "output_tokens": 384, "request_throughput": 1.2,
                "output_throughput": 38.4, "ttft_s": _dist(0.1 * scale), "tpot_s": _dist(0.02 * scale),
                "itl_s": _dist(0.02 * scale), "e2e_s": _dist(scale), "queue_s": None, "kv_transfer_s": _dist(0.004),
                "tokens_per_message": 1.0, "errors": [],
                "by_kind": {k: {"completed": 6, "ttft_s": _dist(0.1 * scale), "tpot_s": _dist(0.02 * scale),
                                "e2e_s": _dist(scale)} for k in kinds},
                "records": records}

    return {"model": "tiny", "dtype": "float32", "workload": {"name": name, "num_requests": 12, "seed": 0},
            "rate": 1.0, "concurrency": None, "cpus": [0, 1],
            "systems": [system(label, 1.0 + i) for i, label in enumerate(systems)]}


def make_run(run_dir: Path) -> None:
    files = {
        "roofline": {"machine": {"cpu": "Test CPU", "cores": 2, "threads": 2, "llc_bytes": 32 << 20,
                                 "copy_gb_s": 20.0, "read_gb_s": 30.0,
                                 "matmul_gflops": {"float32": 100.0, "bfloat16": 300.0},
                                 "decode_gemm_gflops": {"float32": 50.0, "bfloat16": 120.0}},
                     "model": {"name": "tiny", "dtype": "float32", "params": 1000, "weight_bytes_per_step": 4000,
                               "kv_bytes_per_token": 64, "flops_per_token": 2000.0},
                     "roofline": [{"batch": 1, "context": 256, "bytes_per_step": 20384, "tokens_per_s": 1.4e6,
                                   "bound": "memory"},
                                  {"batch": 64, "context": 256, "bytes_per_step": 1052576, "tokens_per_s": 1.5e7,
                                   "bound": "compute"}]},
        "offline": {"model": "tiny", "threads": 2,
                    "workload": {"num_prompts": 16, "prompt_len": 64, "output_len": 32, "seed": 0},
                    "results": [{"system": "Tandem", "dtype": "float32", "setting": "budget 2048, chunk 512",
                                 "output_tokens": 512, "seconds": 1.0, "cpu_seconds": 2.0, "first_tokens_s": 0.2,
                                 "tokens_at_first": 16, "note": "", "tokens_per_s": 512.0,
                                 "decode_tokens_per_s": 600.0, "best": True},
                                {"system": "HF generate", "dtype": "float32", "setting": "static batches of 16",
                                 "output_tokens": 512, "seconds": 4.0, "cpu_seconds": 8.0, "first_tokens_s": None,
                                 "tokens_at_first": 0, "note": "", "tokens_per_s": 128.0,
                                 "decode_tokens_per_s": None, "best": False}],
                    "profiles": {"float32": {"batch": 16, "ms_per_step": 20.0, "parts_ms": {"model forward": 18.0}}}},
        "peer-llamacpp": {"system": "llama.cpp (llama-cpp-python 0.3.36)", "dtype": "Q4_1", "setting": "one at a time",
                          "output_tokens": 96, "seconds": 1.0, "tokens_per_s": 96.0, "init_seconds": 0.5,
                          "prompts_measured": 3, "prompts_total": 16, "note": "Q4_1 weights"},
        "speculative": {"model": "tiny", "dtype": "float32", "threads": 1, "max_tokens": 32, "repeats": 1,
                        "prompts": ["a", "b"],
                        "rows": [{"category": c, "config": cfg, "speculative": cfg != "no speculation",
                                  "decode_tokens_per_s": 100.0 * x, "speedup": x, "tokens_per_step": x,
                                  "acceptance": None if cfg == "no speculation" else 0.5, "identical": 1, "prompts": 1}
                                 for c in ("input-grounded", "open-ended")
                                 for cfg, x in (("no speculation", 1.0), ("ngram k=4 n=1-4", 1.8))]},
        "kv-transfer": {"model": "SmolLM2-135M-Instruct", "backend": "gloo", "bytes_per_block": 368640,
                        "block_size": 16, "iters": 2,
                        "rows": [{"tokens": t, "blocks": t // 16, "bytes": t * 23040, "case": case, "sends": 1,
                                  "median_ms": 1.0, "gb_s": g * t / 1024, "vs_raw": g}
                                 for t in (128, 1024) for case, g in (("raw pg.send/recv", 1.0), ("contiguous", 0.9))]},
        "serve-serving": _serve("serving", ["disaggregated", "colocated"], ["chat"]),
        "serve-mixed": _serve("mixed", ["disaggregated", "colocated"], ["short", "long"]),
    }
    for name, data in files.items():
        (run_dir / f"{name}.json").write_text(json.dumps(data))
    sections = [SectionResult(name, f"title of {name}", "ok", 1.0, f"python -m benchmarks.{name}", "", f"{name}.json")
                for name in files]
    sections.insert(3, SectionResult("peer-vllm", "Peer: vLLM-CPU", "skipped",
                                     note="not installed: run `bash scripts/setup-peer.sh vllm`"))
    sections.append(SectionResult("serve-shared-prefix", "Shared prefix", "failed", 3.0, "python -m x",
                                  "exit status 1; boom"))
    run = SuiteRun("tiny", "float32", 2, True, "2026-11-29 12:00:00 UTC", "tandem bench run --quick", sections, 60.0,
                   cpu="Some CPU, 2 usable cores; flags avx2 fma")
    (run_dir / "suite.json").write_text(json.dumps(asdict(run)))


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    make_run(tmp_path)
    return tmp_path


def test_report_has_every_section_and_plot(run_dir: Path) -> None:
    report = write_report(run_dir).read_text()
    for heading in ("## Limits of this machine", "## Offline throughput", "## Speculative decoding",
                    "## KV transfer", "## title of serve-serving", "## title of serve-mixed"):
        assert heading in report
    assert "- CPU: Some CPU, 2 usable cores; flags avx2 fma" in report  # every report states the CPU flags
    # The roofline sits beside what Tandem measured: batch 16 from the offline profile (800 tok/s).
    assert "| 1 | 256 | 0.0 | memory | 1,400,000.0 | 100.0 |" in report
    # Peers: a measured one is a row, a missing one is skipped with its reason, never a number.
    assert "| llama.cpp (llama-cpp-python 0.3.36) | Q4_1 |" in report
    assert "Peer: vLLM-CPU: **skipped** — not installed: run `bash scripts/setup-peer.sh vllm`" in report
    assert "| Shared prefix | failed | 3 | exit status 1; boom |" in report
    # HF at a quarter of Tandem's rate.
    assert "| HF generate | float32 | static batches of 16 | 128.0 | 0.25x |" in report
    # The mixed workload is broken down by kind; the plain serving one is not.
    assert "| long: TTFT p99 (ms) |" in report and "| chat: TTFT" not in report
    images = [line[line.index("(") + 1: -1] for line in report.splitlines() if line.startswith("![")]
    assert len(images) == 5
    for image in images:
        assert (run_dir / image).read_bytes()[:8] == PNG_MAGIC


def test_report_includes_the_runs_notes(run_dir: Path) -> None:
    (run_dir / "notes.md").write_text("## What the figures say\n\nTandem decodes.\n")
    report = write_report(run_dir).read_text()
    assert report.index("## What the figures say") < report.index("## Limits of this machine")


def test_report_output_elsewhere_puts_plots_beside_it(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    dest = tmp_path_factory.mktemp("published") / "RESULTS.md"
    write_report(run_dir, dest)
    assert (dest.parent / "RESULTS-plots" / "offline_throughput.png").is_file()
    assert "](RESULTS-plots/offline_throughput.png)" in dest.read_text()
