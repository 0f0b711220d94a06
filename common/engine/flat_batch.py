"""A step's chunks laid end to end: the flat batch one forward takes (common/engine/model_runner.py, the decode
graphs' static buffers in common/engine/cuda_graphs.py, every rank of a parallel node)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.engine.scheduler_output import ScheduledChunk


@dataclass(frozen=True)
class FlatBatch:
    """A step's chunks laid end to end, each followed by its drafts: what one forward takes."""

    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]  # chunk tokens + drafts, per chunk
    context_lens: list[int]  # tokens before the chunk (with KV already), per chunk
    tables: list[list[int]]  # the blocks each chunk's positions reach

    @classmethod
    def of(cls, chunks: list[ScheduledChunk], drafts: list[list[int]] | None, block_size: int) -> FlatBatch:
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        for i, chunk in enumerate(chunks):
            extra = drafts[i] if drafts else []
            end = chunk.start + chunk.num_tokens + len(extra)
            input_ids.extend(chunk.request.token_slice(chunk.start, chunk.start + chunk.num_tokens))
            input_ids.extend(extra)
            positions.extend(range(chunk.start, end))
            query_lens.append(end - chunk.start)
            context_lens.append(chunk.start)
            tables.append(chunk.block_ids[: -(-end // block_size)])
        return cls(input_ids, positions, query_lens, context_lens, tables)

    @property
    def ends(self) -> list[int]:
        """Where each chunk's rows end in the flat batch."""
        return list(itertools.accumulate(self.query_lens))
