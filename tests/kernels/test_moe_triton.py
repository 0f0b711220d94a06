"""The Triton grouped GEMM of a mixture of experts (common/kernels/triton/moe.py) against transformers' loop,
under Triton's CPU interpreter here (tests/kernels/conftest.py), compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from common.model.fused_ops import EagerOps
from common.model.moe import LoopExperts, TritonExperts, route
from tests.model.test_moe import _random_moe

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_align_pads_each_expert_to_whole_blocks() -> None:
    from common.kernels.triton.moe import align

    expert = torch.tensor([0, 0, 0, 2, 3, 3])  # sorted; expert 1 has no rows
    token = torch.tensor([4, 1, 2, 0, 5, 3])
    row_src, block_expert, slot = align(expert, token, 4, 2)
    assert row_src.tolist() == [4, 1, 2, -1, 0, -1, 5, 3]
    assert block_expert.tolist() == [0, 0, 2, 3]
    assert slot.tolist() == [0, 1, 2, 4, 6, 7]


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [(1, 16, 4), (20, 8, 2), (70, 4, 1), (0, 4, 2)])
def test_triton_experts_equal_the_loop(num_tokens: int, num_experts: int, top_k: int) -> None:
    moe = _random_moe(num_experts, top_k, hidden=48, inter=40).to(DEVICE)
    x = torch.randn(num_tokens, 48, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    ops = EagerOps()
    weights, ids = route(moe.gate(x), top_k, True)
    expected = LoopExperts().apply(moe, x, ids, weights, ops)
    torch.testing.assert_close(TritonExperts().apply(moe, x, ids, weights, ops), expected, atol=1e-4, rtol=1e-4)


def test_triton_experts_hold_an_expert_range() -> None:
    """Expert parallelism: a rank's experts [2, 4) of 4, the others' pairs skipped."""
    moe = _random_moe(4, 2, hidden=32, inter=16).to(DEVICE)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    ops = EagerOps()
    weights, ids = route(moe.gate(x), 2, True)
    moe.w13 = torch.nn.Parameter(moe.w13[2:].clone(), requires_grad=False)
    moe.w2 = torch.nn.Parameter(moe.w2[2:].clone(), requires_grad=False)
    moe.expert_start = 2
    torch.testing.assert_close(TritonExperts().apply(moe, x, ids, weights, ops),
                               LoopExperts().apply(moe, x, ids, weights, ops), atol=1e-4, rtol=1e-4)
