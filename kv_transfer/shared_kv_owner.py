"""The decode end of same-host KV transfer: the KV memory that same-host prefill nodes write, and its grants.

CPU: the KV tensor is moved into a shared-memory segment (KVCache.share_memory) that also holds the grant
words. CUDA: the tensor stays where it is and is shared by IPC handle (kv_transfer/cuda_ipc.py); a small
segment holds only the grant words. Every reserved, uncached block is granted to its transfer at ``expect``
and revoked before the block goes back to the caller (kv_transfer/block_grants.py), so a decode block is
never reused while a same-host copy into it may still land. The owner unlinks what it created at close.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from typing import TYPE_CHECKING

from common.kv.shared_segment import SharedMemoryUnavailable, SharedSegment
from kv_transfer.block_grants import BlockGrants, grant_token
from tandem.v1 import kv_transfer_pb2

if TYPE_CHECKING:
    from common.kv.kv_cache import KVCache

log = logging.getLogger(__name__)


class SharedKVOwner:
    """The decode node's shared KV: the handshake's ``SharedKV`` description, grants and their revocation."""

    def __init__(self, kv_cache: KVCache, segment: SharedSegment, description: kv_transfer_pb2.SharedKV,
                 owned: SharedSegment | None) -> None:
        self.kv_cache = kv_cache
        self.segment = segment
        self.description = description
        self.grants = BlockGrants(segment)
        self._owned = owned  # unlinked at close: the segment we created (not one the cache already had)

    @classmethod
    def create(cls, kv_cache: KVCache) -> SharedKVOwner:
        """Share ``kv_cache`` (raises SharedMemoryUnavailable, or RuntimeError from CUDA, when it cannot)."""
        if kv_cache.data.device.type == "cuda":
            from kv_transfer.cuda_ipc import export

            segment = SharedSegment.create(0, num_slots=kv_cache.num_blocks)  # the grant words only
            try:
                cuda = export(kv_cache.data)
            except BaseException:
                segment.close()
                raise
            owned: SharedSegment | None = segment
        else:
            owned = None if kv_cache.segment is not None else kv_cache.share_memory()
            segment, cuda = kv_cache.share_memory(), None
        description = kv_transfer_pb2.SharedKV(segment=segment.name, nonce=segment.nonce,
                                               segment_bytes=segment.size, cuda=cuda)
        return cls(kv_cache, segment, description, owned)

    @classmethod
    def maybe_create(cls, kv_cache: KVCache, node_id: str, required: bool) -> SharedKVOwner | None:
        """``create``, or None with a logged reason when shared memory is not ``required``."""
        try:
            return cls.create(kv_cache)
        except (SharedMemoryUnavailable, OSError, RuntimeError, ValueError) as exc:
            if required:
                raise SharedMemoryUnavailable(
                    f"kv_transport=shm: decode node {node_id} cannot share its KV: {exc}") from exc
            log.warning("decode node %s: same-host KV transport off, prefill nodes pair over sockets: %s",
                        node_id, exc)
            return None

    def grant(self, transfer_id: str, blocks: Collection[int]) -> None:
        self.grants.grant(grant_token(transfer_id), blocks)

    async def revoke(self, transfer_id: str, blocks: Collection[int], timeout_s: float) -> None:
        """Return once no same-host copy can land in ``blocks`` (waits out one in progress, up to ``timeout_s``)."""
        if not blocks or self.grants.try_revoke(blocks):
            return
        if not await asyncio.to_thread(self.grants.revoke, blocks, timeout_s):
            log.error("KV transfer %s: a same-host copy into its blocks is still running after %gs",
                      transfer_id, timeout_s)

    async def close(self, timeout_s: float) -> None:
        """Revoke every grant, then unlink the segment we created (mappings stay valid)."""
        await self.revoke("(all)", range(self.kv_cache.num_blocks), timeout_s)
        if self._owned is not None:
            self._owned.close()
