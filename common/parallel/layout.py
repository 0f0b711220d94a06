"""How a node of T x P ranks splits one Llama-family model: ``ParallelLayout`` and each rank's ``RankPlacement``.

Global rank ``g = pp_rank * T + tp_rank``: the T ranks of a pipeline stage are consecutive, so a stage's
tensor-parallel group is one run of ranks and rank ``g`` hands its hidden states to ``g + T``.

Tensor parallelism (Megatron / vLLM): each TP rank holds ``num_heads / T`` query heads and the KV heads they
read. With ``T <= num_kv_heads`` the KV heads split evenly (``num_kv_heads % T == 0``); with more ranks than
KV heads each KV head is replicated on ``T / num_kv_heads`` consecutive ranks (``T % num_kv_heads == 0``),
whose query heads all belong to that head's group. The MLP's intermediate columns split evenly, and the
vocabulary is padded to a multiple of T: rank r holds ids ``[r * ceil(V / T), (r + 1) * ceil(V / T))``
clipped to ``V`` (the last rank may hold fewer, even none, of the real ids).

A mixture of experts' routed layers (common/model/moe.py) split one of two ways over the T ranks, each ending
in the same all-reduce as a dense MLP: by default every expert's intermediate columns as the dense MLP's
(``moe_intermediate_size % T == 0``); with ``--expert-parallel``, whole experts, rank r holding experts
``[r * E / T, (r + 1) * E / T)`` (``num_experts % T == 0``) and computing only its experts' share of each
token (vLLM's expert parallelism with tensor-parallel attention; the router stays whole on every rank, so
the dispatch is local and the combine is the all-reduce). The router and the dense layers split as before.

Pipeline parallelism: stage s holds a contiguous layer range; layers split as evenly as possible and the
earlier stages take the remainder (8 layers on 3 stages: 3, 3, 2). Every stage holds at least one layer.

Pure Python: no torch import, so the CLI validates a layout before anything heavy is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.config.model_config import ModelConfig

TP_FLAG = "--tensor-parallel-size"
PP_FLAG = "--pipeline-parallel-size"
EP_FLAG = "--expert-parallel"


@dataclass(frozen=True)
class RankPlacement:
    """What one rank holds. Every range is half-open ``(start, stop)`` in the unsharded model's indices."""

    rank: int  # global rank in the node, pp_rank * tp_size + tp_rank
    tp_rank: int
    pp_rank: int
    tp_size: int
    pp_size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]  # into the KV cache's head axis; replicated heads are shared with neighbours
    intermediate: tuple[int, int]  # columns of gate, and the same columns of up, of the MLP
    experts: tuple[int, int]  # a mixture of experts: the experts held (all of them without expert parallelism)
    expert_intermediate: tuple[int, int]  # and the columns of each held expert (all of them with it)
    layers: tuple[int, int]
    vocab: tuple[int, int]  # real ids only; padded_vocab_per_rank - (stop - start) padding rows are not held
    padded_vocab_per_rank: int  # ceil(vocab_size / tp_size): each rank's logits width once padded
    tp_group: tuple[int, ...]  # global ranks of this stage, in tp_rank order
    pp_group: tuple[int, ...]  # global ranks with this tp_rank, in stage order
    prev_stage_rank: int | None  # who sends this rank its hidden states (None: the first stage)
    next_stage_rank: int | None  # whom this rank sends them to (None: the last stage)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


@dataclass(frozen=True)
class ParallelLayout:
    """T tensor-parallel ranks per stage, P pipeline stages; ``validate`` checks them against a model."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        for flag, size in ((TP_FLAG, self.tensor_parallel_size), (PP_FLAG, self.pipeline_parallel_size)):
            if size < 1:
                raise ValueError(f"{flag} must be >= 1, got {size}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def validate(self, config: ModelConfig) -> None:
        """Raise ValueError naming the flag and the constraint when ``config`` cannot be split this way."""
        t, p = self.tensor_parallel_size, self.pipeline_parallel_size
        heads, kv_heads, moe = config.num_heads, config.num_kv_heads, config.moe
        if heads % t:
            raise ValueError(f"{TP_FLAG} {t} must divide num_attention_heads ({heads}): each rank holds "
                             f"num_attention_heads / {TP_FLAG} query heads")
        if kv_heads % t and t % kv_heads:
            raise ValueError(f"{TP_FLAG} {t} must divide num_key_value_heads ({kv_heads}) or be a multiple of it "
                             f"(then each KV head is replicated on {TP_FLAG} / num_key_value_heads ranks)")
        if config.intermediate_size % t and (moe is None or not all(moe.layers)):
            raise ValueError(f"{TP_FLAG} {t} must divide intermediate_size ({config.intermediate_size}): each "
                             f"rank holds intermediate_size / {TP_FLAG} MLP columns")
        if self.expert_parallel and moe is None:
            raise ValueError(f"{EP_FLAG} splits a mixture of experts' experts; {config.model_type} has none")
        if self.expert_parallel and t < 2:
            raise ValueError(f"{EP_FLAG} splits the experts over the {TP_FLAG} ranks; {TP_FLAG} is {t}")
        if moe is not None and self.expert_parallel and moe.num_experts % t:
            raise ValueError(f"{TP_FLAG} {t} must divide num_experts ({moe.num_experts}) with {EP_FLAG}: each "
                             f"rank holds num_experts / {TP_FLAG} whole experts")
        if moe is not None and not self.expert_parallel and moe.intermediate_size % t:
            raise ValueError(f"{TP_FLAG} {t} must divide the experts' intermediate size ({moe.intermediate_size}): "
                             f"each rank holds that / {TP_FLAG} columns of every expert (or split whole experts: "
                             f"{EP_FLAG})")
        if p > config.num_layers:
            raise ValueError(f"{PP_FLAG} {p} exceeds num_hidden_layers ({config.num_layers}): every pipeline "
                             f"stage needs at least one layer")

    def placement(self, rank: int, config: ModelConfig) -> RankPlacement:
        """The placement of global ``rank`` (validates the layout against ``config`` first)."""
        self.validate(config)
        t, p = self.tensor_parallel_size, self.pipeline_parallel_size
        if not 0 <= rank < t * p:
            raise ValueError(f"rank {rank} is outside a node of {t} x {p} = {t * p} ranks")
        pp_rank, tp_rank = divmod(rank, t)
        per_rank = config.num_heads // t
        q0, q1 = tp_rank * per_rank, (tp_rank + 1) * per_rank
        group = config.num_queries_per_kv  # query heads per KV head
        # The KV heads this rank's query heads read: an even split, or the one head a replica group shares.
        kv0, kv1 = q0 // group, (q1 - 1) // group + 1
        inter = config.intermediate_size // t
        experts, expert_inter = (0, 0), (0, 0)
        if config.moe is not None:
            e, i = config.moe.num_experts, config.moe.intermediate_size
            if self.expert_parallel:
                experts, expert_inter = (tp_rank * e // t, (tp_rank + 1) * e // t), (0, i)
            else:
                experts, expert_inter = (0, e), (tp_rank * i // t, (tp_rank + 1) * i // t)
        vocab_per_rank = -(-config.vocab_size // t)
        v0 = min(tp_rank * vocab_per_rank, config.vocab_size)
        v1 = min(v0 + vocab_per_rank, config.vocab_size)
        return RankPlacement(
            rank=rank, tp_rank=tp_rank, pp_rank=pp_rank, tp_size=t, pp_size=p,
            q_heads=(q0, q1), kv_heads=(kv0, kv1), intermediate=(tp_rank * inter, (tp_rank + 1) * inter),
            experts=experts, expert_intermediate=expert_inter,
            layers=stage_layers(config.num_layers, p)[pp_rank], vocab=(v0, v1),
            padded_vocab_per_rank=vocab_per_rank,
            tp_group=tuple(range(pp_rank * t, (pp_rank + 1) * t)),
            pp_group=tuple(s * t + tp_rank for s in range(p)),
            prev_stage_rank=rank - t if pp_rank > 0 else None,
            next_stage_rank=rank + t if pp_rank < p - 1 else None,
        )


def stage_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges, as even as possible, the earlier stages taking the remainder."""
    assert 1 <= num_stages <= num_layers
    base, extra = divmod(num_layers, num_stages)
    ranges: list[tuple[int, int]] = []
    start = 0
    for s in range(num_stages):
        stop = start + base + (1 if s < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges
