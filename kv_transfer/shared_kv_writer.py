"""The prefill end of a same-host pair: the decode node's KV blocks mapped into this process.

CPU: the decode node's KV tensor lives in its shared-memory segment, mapped here read-write. CUDA: the
segment holds only the grant words and the tensor comes by IPC handle (kv_transfer/cuda_ipc.py). Either
way a run is one plain copy between two contiguous block views, made only while its grant holds
(kv_transfer/block_grants.py) and finished (CUDA: synchronised) before the grant's lock is released.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.kv.shared_segment import SharedSegment
from kv_transfer.block_grants import BlockGrants, grant_token

if TYPE_CHECKING:
    import torch

    from common.kv.kv_cache import KVCache
    from kv_transfer.block_runs import BlockRun
    from tandem.v1 import kv_transfer_pb2


class SharedKVWriter:
    """Copies runs of this node's blocks into the decode node's blocks, each under its grant."""

    def __init__(self, segment: SharedSegment, blocks: torch.Tensor) -> None:
        self.segment = segment
        self.grants = BlockGrants(segment)
        self.blocks = blocks  # [decode num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
        self._stream: torch.cuda.Stream | None = None

    @classmethod
    def open(cls, shared: kv_transfer_pb2.SharedKV, source: KVCache) -> SharedKVWriter:
        """Map the decode node's KV described by ``shared`` (raises SharedMemoryUnavailable if it cannot)."""
        from common.kv.shared_segment import SharedMemoryUnavailable

        segment = SharedSegment.open(shared.segment, shared.nonce)
        try:
            shape = (segment.num_slots, *source.data.shape[1:])
            dtype = source.data.dtype
            if shared.HasField("cuda"):
                if source.data.device.type != "cuda":
                    raise SharedMemoryUnavailable("the decode node's KV is on CUDA, this node's is not")
                from kv_transfer.cuda_ipc import open_tensor

                blocks = open_tensor(shared.cuda, dtype, shape)
            else:
                bytes_per_block = source.spec.elements_per_block * source.data.element_size()
                if segment.data_bytes != segment.num_slots * bytes_per_block:
                    raise SharedMemoryUnavailable(f"segment {segment.name} holds {segment.data_bytes} bytes, "
                                                  f"not {segment.num_slots} blocks of {bytes_per_block}")
                blocks = segment.data().view(dtype).view(shape)
        except BaseException:
            segment.close()
            raise
        return cls(segment, blocks)

    def copy(self, transfer_id: str, source: KVCache, runs: list[BlockRun],
             ready: torch.cuda.Event | None) -> bool:
        """Copy ``runs`` (this node's blocks -> the decode node's); False at the first run whose blocks are
        no longer granted to ``transfer_id`` (nothing of that run, or any after it, is written)."""
        token = grant_token(transfer_id)
        for run in runs:
            with self.grants.holding(token, run.dst_start, run.num_blocks) as granted:
                if not granted:
                    return False
                src = source.blocks(run.src_start, run.src_start + run.num_blocks)
                dst = self.blocks[run.dst_start : run.dst_start + run.num_blocks]
                if dst.is_cuda:
                    self._copy_cuda(dst, src, ready)
                    ready = None  # waited for once
                else:
                    dst.copy_(src)
        return True

    def _copy_cuda(self, dst: torch.Tensor, src: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream(src.device)
        with torch.cuda.stream(self._stream):
            if ready is not None:
                self._stream.wait_event(ready)  # the forward that wrote the blocks
            dst.copy_(src, non_blocking=True)
        self._stream.synchronize()  # landed before the grant's lock is released and the chunk announced

    def close(self) -> None:
        """Close the segment and unmap it: call once no copy runs anymore (the pair's copy thread ended).

        The mapping of a decode node's whole KV counts in this process's RSS (RssShmem); a pair that broke
        (its decode node died and came back with a new segment) must not keep the old one mapped."""
        self.blocks = self.blocks.new_empty(0)  # our only lasting view of the mapping
        self.segment.close()
        self.segment.unmap()
