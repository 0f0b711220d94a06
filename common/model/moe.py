"""Routed experts (Mixtral, Qwen3-MoE): the router, the experts' stacked weights, and how routed tokens meet them.

``SparseMoE`` replaces a layer's dense MLP. Per token: the router's logits over all experts, a softmax in fp32,
the ``k`` most probable experts (their probabilities renormalised to sum to 1 where the family says so), and
the sum over those experts of ``weight * down(silu(gate(x)) * up(x))`` — transformers' ``*SparseMoeBlock``.

The experts' weights are stacked as transformers 5 and vLLM hold them: ``w13`` ``[experts, 2 * inter, hidden]``
(each expert's gate rows, then its up rows) and ``w2`` ``[experts, hidden, inter]``. A module may hold only some
experts (expert parallelism: ``expert_start`` is the global id of its first) or only some intermediate columns
of every expert (tensor parallelism); either way its output is a partial sum that ``reduce`` (the rank group's
all-reduce, common/parallel/tp_model.py) completes.

How the routed tokens are multiplied is the module's ``experts`` strategy (vLLM's ``FusedMoEMethodBase``):

- ``LoopExperts``: transformers' loop — for each expert that any token chose, gather its tokens, two matmuls,
  scatter back. The reference, and what the benchmark (benchmarks/moe_step.py) measures against.
- ``GroupedExperts``: the (token, expert) pairs sorted by expert once per step; then, at decode sizes (few rows
  per expert, every expert's weights read once whatever the rows), all experts' GEMMs as two batched matmuls
  over the rows padded to the busiest expert; at prefill sizes (many rows per expert, where padding would be
  wasted arithmetic) one GEMM per expert over its contiguous slice of the sorted rows; where few experts are
  hit (batch-1 decode), one GEMM per hit expert. Each expert's weights are read once per step either way.
- On CUDA, ``TritonExperts`` (common/kernels/triton/moe.py): one grouped-GEMM launch per projection over the
  sorted rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from common.model.linear import Linear

if TYPE_CHECKING:
    from common.model.families import MoEOptions
    from common.model.fused_ops import FusedOps
    from common.parallel.comm import Communicator

# GroupedExperts' choice between its ways (see the module docstring), by the shape of the step's routing:
# batched matmuls over padded rows while the busiest expert has at most this many rows (a decode step: the
# weights' bytes dominate, padding costs no memory traffic) ...
PADDED_MAX_ROWS = 64
# ... or while padding adds at most this factor of arithmetic; and one GEMM per hit expert where at most this
# fraction of the experts is hit (padding would read every expert's weights for a few tokens).
PADDED_MAX_WASTE = 1.5
FEW_EXPERTS_FRACTION = 0.25


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits ``[T, experts]`` -> (weights ``[T, k]`` fp32, expert ids ``[T, k]`` int64), as transformers'
    routers compute them: softmax over every expert in fp32, top-k, optionally renormalised."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


class RoutedExperts(Protocol):
    """How a ``SparseMoE`` multiplies the routed tokens by its experts."""

    name: str

    def apply(self, moe: SparseMoE, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              ops: FusedOps) -> torch.Tensor:
        """x ``[T, hidden]``, ids / weights ``[T, k]`` (global expert ids) -> ``[T, hidden]``: the sum over each
        token's experts held by ``moe`` of weight * expert(x); zeros for tokens none of whose experts it holds."""
        ...


class LoopExperts:
    """transformers' loop over the experts that any token chose (the reference)."""

    name = "loop"

    def apply(self, moe: SparseMoE, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              ops: FusedOps) -> torch.Tensor:
        out = torch.zeros_like(x)
        local = ids - moe.expert_start
        for e in torch.unique(local).tolist():
            if not 0 <= e < moe.num_local_experts:
                continue
            token, slot = torch.where(local == e)
            h = ops.silu_mul(nn.functional.linear(x[token], moe.w13[e]))
            y = nn.functional.linear(h, moe.w2[e]) * weights[token, slot, None].to(x.dtype)
            out.index_add_(0, token, y)
        return out


class GroupedExperts:
    """The pairs sorted by expert once, then each expert's GEMM once (see the module docstring)."""

    name = "grouped"

    def apply(self, moe: SparseMoE, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              ops: FusedOps) -> torch.Tensor:
        out = torch.zeros_like(x)
        expert, token, weight = sort_pairs(moe, ids, weights)
        n = expert.numel()
        if n == 0:
            return out
        num_experts = moe.num_local_experts
        counts = torch.bincount(expert, minlength=num_experts)  # [experts] rows per expert
        max_rows = int(counts.max())
        hit = int((counts > 0).sum())
        if hit > FEW_EXPERTS_FRACTION * num_experts and (
                max_rows <= PADDED_MAX_ROWS or max_rows * num_experts <= PADDED_MAX_WASTE * n):
            y = _padded(moe, x, expert, token, counts, max_rows, ops)
        else:
            y = _slices(moe, x[token], counts.tolist(), ops)
        out.index_add_(0, token, y * weight[:, None].to(x.dtype))
        return out


def sort_pairs(moe: SparseMoE, ids: torch.Tensor, weights: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs of experts ``moe`` holds, sorted by (local) expert, stable (so each expert's rows
    keep token order): (expert [n], token [n], weight [n])."""
    num_tokens, k = ids.shape
    expert = ids.reshape(-1) - moe.expert_start
    weight = weights.reshape(-1)
    token = torch.arange(num_tokens, device=ids.device).repeat_interleave(k)
    if moe.num_local_experts != moe.num_experts:  # expert parallel: only this rank's experts
        mine = (expert >= 0) & (expert < moe.num_local_experts)
        expert, weight, token = expert[mine], weight[mine], token[mine]
    order = torch.argsort(expert, stable=True)
    return expert[order], token[order], weight[order]


def _padded(moe: SparseMoE, x: torch.Tensor, expert: torch.Tensor, token: torch.Tensor, counts: torch.Tensor,
            max_rows: int, ops: FusedOps) -> torch.Tensor:
    """Every expert's rows padded to ``max_rows``: two batched matmuls. -> [n, hidden] in the pairs' order."""
    num_experts, hidden = moe.num_local_experts, x.shape[1]
    starts = counts.cumsum(0) - counts
    row = torch.arange(expert.numel(), device=x.device) - starts[expert]  # each pair's row within its expert
    xp = x.new_zeros(num_experts, max_rows, hidden)
    xp[expert, row] = x[token]
    h = torch.bmm(xp, moe.w13.transpose(1, 2))  # [experts, max_rows, 2 * inter]
    act = ops.silu_mul(h.view(num_experts * max_rows, -1)).view(num_experts, max_rows, -1)
    return torch.bmm(act, moe.w2.transpose(1, 2))[expert, row]  # [n, hidden]


def _slices(moe: SparseMoE, xs: torch.Tensor, counts: list[int], ops: FusedOps) -> torch.Tensor:
    """One GEMM per hit expert over its contiguous rows of ``xs`` (the pairs' tokens, sorted by expert)."""
    pieces = []
    start = 0
    for e, rows in enumerate(counts):
        if rows:
            h = ops.silu_mul(nn.functional.linear(xs[start : start + rows], moe.w13[e]))
            pieces.append(nn.functional.linear(h, moe.w2[e]))
            start += rows
    return torch.cat(pieces)


class SparseMoE(nn.Module):
    """A layer's routed experts: ``forward(x [T, hidden], ops) -> [T, hidden]``."""

    def __init__(self, hidden_size: int, options: MoEOptions) -> None:
        super().__init__()
        self.num_experts = options.num_experts  # the router's: every expert, wherever it is held
        self.top_k = options.experts_per_token
        self.renormalize = options.norm_topk_prob
        self.intermediate_size = options.intermediate_size  # held here (a tensor-parallel rank: its columns)
        # The router: replicated on every rank, and float under every quantization (routing must not move).
        self.gate = Linear(hidden_size, options.num_experts, bias=False)
        inter = options.intermediate_size
        self.w13 = nn.Parameter(torch.empty(options.num_experts, 2 * inter, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(options.num_experts, hidden_size, inter), requires_grad=False)
        self.expert_start = 0  # global id of w13[0] (expert parallelism holds a range)
        self.reduce: Communicator | None = None  # completes a rank's partial sums (tensor or expert parallel)
        self.experts: RoutedExperts = GroupedExperts()

    @property
    def num_local_experts(self) -> int:
        return self.w13.shape[0]

    def forward(self, x: torch.Tensor, ops: FusedOps) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts.apply(self, x, ids, weights, ops)
        return out if self.reduce is None else self.reduce.all_reduce_(out)

    def extra_repr(self) -> str:
        held = (f"experts [{self.expert_start}, {self.expert_start + self.num_local_experts}) of {self.num_experts}"
                if self.num_local_experts != self.num_experts else f"{self.num_experts} experts")
        return f"{held}, top_k={self.top_k}, inter={self.intermediate_size}, {self.experts.name}"
