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


def test_prompt_sweep_peak_is_the_window_and_a_chunk_whatever_the_prompt() -> None:
    report = main(["--window", "16", "--prompts", "40,160", "--tokens", "4", "--block-size", "8", "--chunk", "8",
                   "--threads", "1"])
    short, long = report["sweep"]
    # freed early: at most blocks_needed(16 + 8 + 8 - 2) = 4 blocks; kept: the whole sequence (prompt + 4 tokens)
    assert short["peak_free_early"] <= 4 and long["peak_free_early"] <= 4
    assert (short["peak_kept"], long["peak_kept"]) == (6, 21) == (short["whole_sequence_blocks"],
                                                                    long["whole_sequence_blocks"])
