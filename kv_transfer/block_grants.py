"""Per-block write grants in a shared segment: the fence that keeps same-host copies inside their lifetimes.

Over sockets the decode node decides where bytes land (a refused chunk goes to scratch). Over shared memory
the prefill process writes the decode node's blocks itself, so it must be told, before each write, that the
block is still its transfer's: the segment's slot table holds one word per decode block, the grant token of
the transfer allowed to write it (0: nobody).

- decode, ``expect``: ``grant`` sets the words of the transfer's reserved, uncached blocks (a plain store:
  the sender can learn the destination only after ``expect`` returned, through the gateway).
- prefill, per run: ``holding`` takes a shared lock on the run's words, checks they all hold the token,
  copies, then unlocks. No grant: nothing is copied (the chunk is still announced, and the decode node
  refuses it with the real reason).
- decode, before a transfer's blocks go back to the caller (success or not): ``revoke`` takes an exclusive
  lock on the words (so it waits out a copy in progress), zeroes them, unlocks. After it no write can land.

A sender that dies mid-copy drops its lock with its process.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.kv.shared_segment import SharedSegment


def grant_token(transfer_id: str) -> int:
    """A transfer's nonzero 63-bit grant word (both sides derive it from the transfer id)."""
    digest = hashlib.blake2b(transfer_id.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 1) | 1


class BlockGrants:
    """The slot table of ``segment`` read as grant words, one per decode block."""

    def __init__(self, segment: SharedSegment) -> None:
        self.segment = segment
        self.num_blocks = segment.num_slots
        self._words = segment.table()  # [num_blocks] int64
        self._revoking = threading.Lock()  # one process's locks merge: its revokes must not interleave

    # ------------------------------------------------------------------ decode side

    def grant(self, token: int, blocks: Iterable[int]) -> None:
        import torch

        index = torch.tensor(sorted(blocks), dtype=torch.long)
        if index.numel():
            self._words[index] = token

    def try_revoke(self, blocks: Iterable[int]) -> bool:
        """Revoke without waiting; False (nothing changed) when a copy into the span is in progress."""
        return self._revoke(sorted(blocks), deadline=None)

    def revoke(self, blocks: Iterable[int], timeout_s: float) -> bool:
        """Revoke, waiting up to ``timeout_s`` for a copy in progress; False if it had to give up waiting
        (the words are zeroed anyway: only that one stuck copy can still land)."""
        return self._revoke(sorted(blocks), deadline=time.monotonic() + timeout_s)

    def _revoke(self, blocks: list[int], deadline: float | None) -> bool:
        import torch

        if not blocks:
            return True
        start, count = blocks[0], blocks[-1] - blocks[0] + 1
        index = torch.tensor(blocks, dtype=torch.long)
        with self._revoking:
            pause = 0.00005
            while not (locked := self.segment.lock_slots(start, count, exclusive=True, wait=False)):
                if deadline is None:
                    return False
                if time.monotonic() > deadline:
                    break
                time.sleep(pause)
                pause = min(pause * 2, 0.005)
            self._words[index] = 0
            if locked:
                self.segment.unlock_slots(start, count)
            return locked

    # ------------------------------------------------------------------ prefill side

    @contextlib.contextmanager
    def holding(self, token: int, start: int, count: int) -> Iterator[bool]:
        """Hold blocks ``start .. start+count-1`` for a copy; yields whether ``token`` holds all of them."""
        if start < 0 or start + count > self.num_blocks or count <= 0:
            yield False
            return
        self.segment.lock_slots(start, count, exclusive=False, wait=True)
        try:
            yield bool((self._words[start : start + count] == token).all())
        finally:
            self.segment.unlock_slots(start, count)
