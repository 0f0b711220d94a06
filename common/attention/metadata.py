"""The one metadata object every attention backend reads.

A forward pass sees a flat, ragged batch: the new tokens of every sequence laid end to end
(``[num_tokens, ...]``), never padded to ``[batch, seq]``. Sequence ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i+1]``; those tokens sit at positions
``context_lens[i] .. seq_lens[i]-1`` of the sequence, after ``context_lens[i]`` tokens whose K/V are
already in the paged cache.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Shapes and indices of one ragged batch.

    Tensors live on the model's device. The ``*_cpu`` tuples are host copies of the same numbers so
    backends that loop over sequences never synchronise with the device to read them. The derived sizes
    are computed once per batch (every layer reads them).
    """

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths, starts at 0
    seq_lens: torch.Tensor  # [num_seqs] int32, context + new tokens, i.e. K/V length after this step
    context_lens: torch.Tensor  # [num_seqs] int32, tokens already cached before this step
    block_tables: torch.Tensor | None  # [num_seqs, max_blocks_per_seq] int32; None: no paged cache
    slot_mapping: torch.Tensor | None  # [num_tokens] int64, cache slot (block * block_size + offset)
    query_lens_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @cached_property
    def num_tokens(self) -> int:
        return sum(self.query_lens_cpu)

    @cached_property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @cached_property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def context_lens_cpu(self) -> tuple[int, ...]:
        return tuple(s - q for s, q in zip(self.seq_lens_cpu, self.query_lens_cpu, strict=True))

    @cached_property
    def is_decode_only(self) -> bool:
        """Every sequence adds exactly one token on top of a cached context."""
        return self.max_query_len == 1

    @cached_property
    def is_prefill_only(self) -> bool:
        """No sequence has cached context: attention needs only the new tokens' K/V."""
        return all(s == q for s, q in zip(self.seq_lens_cpu, self.query_lens_cpu, strict=True))

    @cached_property
    def kv_written(self) -> AttentionMetadata:
        """The same batch with ``slot_mapping`` None: its new K/V are in the cache already (a fused op wrote
        them), so a backend only reads. Made once per batch; every layer asks."""
        return replace(self, slot_mapping=None)

    @staticmethod
    def build(
        query_lens: list[int] | tuple[int, ...],
        context_lens: list[int] | tuple[int, ...],
        block_tables: list[list[int]] | None = None,
        block_size: int | None = None,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build metadata from per-sequence host lists (tests, simple loops).

        With ``block_tables`` the new tokens' slots are derived from each table and ``block_size``.
        Engines with their own persistent buffers fill the fields directly instead.
        """
        import torch

        assert len(query_lens) == len(context_lens)
        seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        tables_t: torch.Tensor | None = None
        slots_t: torch.Tensor | None = None
        if block_tables is not None:
            assert block_size is not None and len(block_tables) == len(query_lens)
            width = max((len(t) for t in block_tables), default=0)
            # Unused entries point at block 0: kernels must mask by seq_lens, never trust padding. So do slots
            # freed early outside a sliding window (NULL_BLOCK, -1): the window masks every position in them.
            tables_t = torch.tensor(
                [[max(b, 0) for b in t] + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32,
                device=device,
            ).reshape(len(block_tables), width)
            slots: list[int] = []
            for table, ctx, seq in zip(block_tables, context_lens, seq_lens, strict=True):
                assert len(table) * block_size >= seq, "block table too short for the sequence"
                slots.extend(table[p // block_size] * block_size + p % block_size for p in range(ctx, seq))
            slots_t = torch.tensor(slots, dtype=torch.int64, device=device)
        return AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            context_lens=torch.tensor(list(context_lens), dtype=torch.int32, device=device),
            block_tables=tables_t,
            slot_mapping=slots_t,
            query_lens_cpu=tuple(query_lens),
            seq_lens_cpu=tuple(seq_lens),
        )
