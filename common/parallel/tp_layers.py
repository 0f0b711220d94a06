"""The tensor-parallel pieces of a Llama layer (Megatron-LM's split, as vLLM and gpt-fast's ``tp.py`` do it).

- Column-parallel (qkv_proj, gate_up_proj): a ``Linear`` holding this rank's output rows, so the
  attention and ``silu_mul`` run locally on this rank's heads and MLP columns: ``column_parallel``.
- Row-parallel (o_proj, down_proj): this rank's input columns; every rank's output is a partial sum, so
  ``RowParallelLinear`` all-reduces it right after the matmul and adds the bias once, after the reduce.
- ``VocabParallelEmbedding``: this rank's vocabulary rows; other ids give zeros, and the all-reduce
  assembles the full embedding. The LM head is a ``Linear`` over the same rows (its logits are this rank's
  slice; the caller gathers them).

Sharding slices the float weights as loaded; the after-load pass (common/model/prepare.py) then gives every
``Linear`` its method, the matmul inside ``RowParallelLinear`` included, so float and packed layers shard
alike and the reduce knows nothing of either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from common.model.linear import Linear

if TYPE_CHECKING:
    from common.parallel.comm import Communicator


def column_parallel(linear: Linear, rows: list[tuple[int, int]]) -> Linear:
    """The output rows ``rows`` (half-open ranges, concatenated in order) of ``linear``, as a new layer."""
    weight = torch.cat([linear.weight.detach()[a:b] for a, b in rows])  # a copy: the full matrix can be freed
    bias = None if linear.bias is None else torch.cat([linear.bias.detach()[a:b] for a, b in rows])
    return Linear.of(weight, bias)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x @ W[:, c0:c1].T) + b``: x holds this rank's input columns ``[n, c1 - c0]``."""

    def __init__(self, linear: Linear, bias: torch.Tensor | None, comm: Communicator) -> None:
        super().__init__()
        self.linear = linear  # [n, c1 - c0] -> [n, out] partial sums, no bias; any method (float or packed)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.comm = comm

    @classmethod
    def from_linear(cls, linear: Linear, columns: tuple[int, int], comm: Communicator) -> RowParallelLinear:
        c0, c1 = columns
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(Linear.of(linear.weight.detach()[:, c0:c1].contiguous(), None), bias, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce_(self.linear(x))  # a fresh output tensor, so reducing in place is safe
        return y if self.bias is None else y.add_(self.bias)


class VocabParallelEmbedding(nn.Module):
    """``forward(ids [n]) -> [n, hidden]``, holding only the rows of ids ``[vocab_start, vocab_end)``."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, comm: Communicator) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [vocab_end - vocab_start, hidden]
        self.vocab_start = vocab_start
        self.vocab_end = vocab_start + weight.shape[0]
        self.comm = comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        if self.weight.shape[0] == 0:  # a rank of padding only (a vocabulary smaller than T ranks' share)
            out = self.weight.new_zeros(ids.shape[0], self.weight.shape[1])
        else:
            out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
            out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.comm.all_reduce_(out)

    def extra_repr(self) -> str:
        return f"ids [{self.vocab_start}, {self.vocab_end}), hidden={self.weight.shape[1]}"
