"""`bench parallel` on a tiny model: every layout's greedy tokens equal 1x1's, the report has its rows."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks.bench_parallel import markdown, parse_layout, run


def test_layout_names() -> None:
    assert parse_layout("3x1") == (3, 1, "shm") and parse_layout("2x2-gloo") == (2, 2, "gloo")
    for bad in ("3", "axb", "2x1-nccl"):
        with pytest.raises(ValueError, match="layout"):
            parse_layout(bad)


@pytest.mark.slow
def test_layouts_run_and_match_one_rank(tiny_served_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "parallel.json"
    result = run(argparse.Namespace(model=str(tiny_served_model_dir), dtype="float32", layouts=["2x1", "1x2-gloo"],
                                    quick=True, collectives=False, json=str(out)))
    assert [r["layout"] for r in result["layouts"]] == ["1x1", "2x1", "1x2-gloo"]
    for r in result["layouts"]:
        assert r["equal_to_1x1"], r["layout"]
        assert r["batch1"]["tokens"] == 16 and r["batch8"]["tokens"] == 8 * 16
        assert r["batch1"]["steps"] >= 16 and r["batch1"]["tokens_per_s"] > 0
    assert result["layouts"][1]["batch1"]["collective_ms_per_step"] > 0  # the ranks measured their all-reduces
    text = markdown(result)
    assert "| 2x1 | shm |" in text and "| 1x2-gloo | - |" in text and "CPU flags" in text
    assert json.loads(out.read_text())["layouts"][2]["pipeline_parallel_size"] == 2
