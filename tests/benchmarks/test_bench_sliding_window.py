"""Smoke test of benchmarks/bench_sliding_window.py: tiny sizes, the figures it reports are the exact bound."""

from __future__ import annotations

from benchmarks.bench_sliding_window import main


def test_peak_blocks_bounded_by_the_window_only_when_freed_early() -> None:
    report = main(["--window", "16", "--prompt", "40", "--tokens", "40", "--seqs", "2", "--block-size", "8",
                   "--threads", "1"])
    early, whole = report["runs"]
    assert report["bound_per_seq"] == 3  # ceil(16 / 8) + 1
    assert early["peak_decode_blocks"] == 2 * 3  # each sequence at the bound while decoding
    assert whole["peak_decode_blocks"] == whole["whole_sequence_blocks"] == 2 * 10  # 80 tokens in 8-token blocks
    assert early["generated"] == whole["generated"] == 2 * 40
