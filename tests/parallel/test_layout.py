"""``ParallelLayout``: which heads, columns, layers and vocabulary rows each rank of a T x P node holds."""

from __future__ import annotations

from typing import Any

import pytest

from common.config.model_config import ModelConfig
from common.parallel.layout import ParallelLayout, RankPlacement, stage_layers


def _config(**overrides: int) -> ModelConfig:
    fields: dict[str, Any] = {"vocab_size": 125, "hidden_size": 64, "intermediate_size": 128, "num_layers": 5,
                              "num_heads": 8, "num_kv_heads": 2, "head_dim": 8, **overrides}
    return ModelConfig(model_type="llama", **fields)


def _placements(t: int, p: int, config: ModelConfig) -> list[RankPlacement]:
    layout = ParallelLayout(t, p)
    return [layout.placement(g, config) for g in range(layout.world_size)]


def test_tp2_pp2_placements() -> None:
    ranks = _placements(2, 2, _config())
    assert [(r.tp_rank, r.pp_rank) for r in ranks] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [r.q_heads for r in ranks] == [(0, 4), (4, 8)] * 2
    assert [r.kv_heads for r in ranks] == [(0, 1), (1, 2)] * 2
    assert [r.intermediate for r in ranks] == [(0, 64), (64, 128)] * 2
    assert [r.layers for r in ranks] == [(0, 3), (0, 3), (3, 5), (3, 5)]  # the first stage takes the extra layer
    assert [r.vocab for r in ranks] == [(0, 63), (63, 125)] * 2  # padded to 126: the last rank's row 63 is padding
    assert {r.padded_vocab_per_rank for r in ranks} == {63}
    assert [r.tp_group for r in ranks] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [r.pp_group for r in ranks] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert [(r.prev_stage_rank, r.next_stage_rank) for r in ranks] == [(None, 2), (None, 3), (0, None), (1, None)]
    assert [(r.is_first_stage, r.is_last_stage) for r in ranks] == [(True, False)] * 2 + [(False, True)] * 2


def test_more_ranks_than_kv_heads_replicate_them() -> None:
    ranks = _placements(4, 1, _config())  # 8 query heads, 2 KV heads: each KV head on two ranks
    assert [r.q_heads for r in ranks] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [r.kv_heads for r in ranks] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    ranks = _placements(8, 1, _config(vocab_size=20))  # one query head each; 3 ids a rank, the last gets none
    assert [r.kv_heads for r in ranks] == [(0, 1)] * 4 + [(1, 2)] * 4
    assert [r.vocab for r in ranks] == [(0, 3), (3, 6), (6, 9), (9, 12), (12, 15), (15, 18), (18, 20), (20, 20)]


def test_single_rank_holds_everything() -> None:
    (only,) = _placements(1, 1, _config())
    assert (only.q_heads, only.kv_heads, only.layers, only.vocab) == ((0, 8), (0, 2), (0, 5), (0, 125))
    assert only.tp_group == only.pp_group == (0,) and only.prev_stage_rank is None and only.next_stage_rank is None


@pytest.mark.parametrize(("layers", "stages", "expected"), [
    (8, 3, [(0, 3), (3, 6), (6, 8)]),
    (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    (30, 4, [(0, 8), (8, 16), (16, 23), (23, 30)]),
])
def test_stage_layers_are_even_and_contiguous(layers: int, stages: int, expected: list[tuple[int, int]]) -> None:
    assert stage_layers(layers, stages) == expected


@pytest.mark.parametrize(("t", "p", "overrides", "needle"), [
    (3, 1, {}, r"--tensor-parallel-size 3 must divide num_attention_heads \(8\)"),
    (4, 1, {"num_heads": 12, "num_kv_heads": 6}, r"--tensor-parallel-size 4 must divide num_key_value_heads \(6\) "
                                                 r"or be a multiple of it"),
    (2, 1, {"intermediate_size": 127}, r"--tensor-parallel-size 2 must divide intermediate_size \(127\)"),
    (1, 6, {}, r"--pipeline-parallel-size 6 exceeds num_hidden_layers \(5\)"),
])
def test_validation_names_the_flag_and_the_constraint(t: int, p: int, overrides: dict[str, int], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        ParallelLayout(t, p).validate(_config(**overrides))
    with pytest.raises(ValueError, match=needle):
        ParallelLayout(t, p).placement(0, _config(**overrides))


@pytest.mark.parametrize(("t", "p", "needle"), [(0, 1, "--tensor-parallel-size must be >= 1, got 0"),
                                                (1, -2, "--pipeline-parallel-size must be >= 1, got -2")])
def test_sizes_below_one_are_refused(t: int, p: int, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        ParallelLayout(t, p)


def test_rank_outside_the_node_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rank 4 is outside a node of 2 x 2 = 4 ranks"):
        ParallelLayout(2, 2).placement(4, _config())


def test_layout_module_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, common.parallel.layout; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
