"""Coalescing (src, dst) block pairs into runs that move with one send/recv each."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockRun:
    """Blocks ``src_start ..`` of the sender go to blocks ``dst_start ..`` of the receiver, ``num_blocks`` of them."""

    src_start: int
    dst_start: int
    num_blocks: int


def coalesce_runs(src_block_ids: list[int], dst_block_ids: list[int]) -> list[BlockRun]:
    """Split equal-length block lists into maximal runs where BOTH sides are consecutive, in list order.

    Block-major KV makes each side of a run one contiguous view, so a run is a single zero-copy send/recv.
    """
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(f"src_block_ids has {len(src_block_ids)} blocks, dst_block_ids {len(dst_block_ids)}")
    runs: list[BlockRun] = []
    src_start = dst_start = length = 0
    for src, dst in zip(src_block_ids, dst_block_ids, strict=True):
        if length and src == src_start + length and dst == dst_start + length:
            length += 1
            continue
        if length:
            runs.append(BlockRun(src_start, dst_start, length))
        src_start, dst_start, length = src, dst, 1
    if length:
        runs.append(BlockRun(src_start, dst_start, length))
    return runs
