"""Pure logic of KV transfer: layout checks, model fingerprints, run coalescing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.kv.kv_cache import KVCacheSpec
from kv_transfer.block_runs import BlockRun, coalesce_runs
from kv_transfer.layout import layout_mismatch, make_layout, model_fingerprint

SPEC = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype_name="bfloat16")


def test_layout_carries_every_field() -> None:
    layout = make_layout(SPEC, "SmolLM2-135M-Instruct", "abc")
    assert (layout.model, layout.model_fingerprint, layout.dtype) == ("SmolLM2-135M-Instruct", "abc", "bfloat16")
    assert (layout.block_size, layout.num_layers, layout.num_kv_heads, layout.head_dim) == (16, 30, 3, 64)


def test_layout_mismatch_names_each_differing_field() -> None:
    decode = make_layout(SPEC, "m", "abc")
    assert layout_mismatch(decode, make_layout(SPEC, "m", "abc")) is None
    prefill = make_layout(KVCacheSpec(30, 3, 64, 32, "bfloat16"), "m", "abc")
    assert layout_mismatch(decode, prefill) == "block_size differs: prefill 32, decode 16"
    prefill = make_layout(KVCacheSpec(30, 2, 64, 16, "float16"), "m", "xyz")
    assert layout_mismatch(decode, prefill) == (
        "model_fingerprint differs: prefill 'xyz', decode 'abc'; dtype differs: prefill 'float16', decode 'bfloat16'; "
        "num_kv_heads differs: prefill 2, decode 3"
    )
    assert str(layout_mismatch(prefill, decode, "prefill", "decode")).startswith(
        "model_fingerprint differs: decode 'abc'")


def test_model_fingerprint_ignores_formatting_but_not_values(tmp_path: Path) -> None:
    config = {"hidden_size": 576, "num_hidden_layers": 30, "rope_theta": 100000.0}
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for directory in (a, b, c):
        directory.mkdir()
    (a / "config.json").write_text(json.dumps(config))
    (b / "config.json").write_text(json.dumps(dict(reversed(config.items())), indent=4))
    (c / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 31}))
    assert model_fingerprint(a) == model_fingerprint(b)
    assert model_fingerprint(a) != model_fingerprint(c)


def test_runs_break_where_either_side_breaks() -> None:
    assert coalesce_runs([], []) == []
    assert coalesce_runs([4, 5, 6, 7], [10, 11, 12, 13]) == [BlockRun(4, 10, 4)]
    # src breaks after 2, dst breaks after 3
    assert coalesce_runs([0, 1, 5, 6, 7], [10, 11, 12, 20, 21]) == [
        BlockRun(0, 10, 2), BlockRun(5, 12, 1), BlockRun(6, 20, 2)]
    # descending ids never coalesce
    assert coalesce_runs([3, 2], [1, 0]) == [BlockRun(3, 1, 1), BlockRun(2, 0, 1)]
    with pytest.raises(ValueError, match="src_block_ids has 2 blocks, dst_block_ids 1"):
        coalesce_runs([1, 2], [3])
