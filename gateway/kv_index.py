"""The gateway's prefix index: which blocks each node's prefix cache holds, kept exact from its KV events.

Pure logic, no I/O: ``KvIndex.apply`` takes one node's batches in the order they arrive and says when the
view can no longer be trusted and how to heal it (``Resync``); ``resume_request`` is what to ask the node
for next. The rules (as vLLM's and Dynamo's routers retrofit them):

* a batch of another incarnation: the node restarted; its entries go at once and a snapshot replaces them;
* a skipped sequence (a dropped connection, an overflowing queue): replay from the first missing sequence
  (the node answers with a snapshot when its history no longer reaches back that far);
* ``dropped`` events inside a contiguous batch (the node's own log overflowed): a snapshot;
* a batch whose digest differs from the digest of the view once the batch is applied: drift, a snapshot.

The digest (``common.kv.kv_events.BlockDigest``) is order-independent and kept incrementally on both sides,
so checking it costs one comparison per batch; ``drift`` is the last comparison's difference in blocks
(0 when the digests agree) and is what the gateway reports per node.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from common.kv.block_hash import BlockHash
from common.kv.kv_events import DIGEST_MASK, BlockDigest, digest_term
from tandem.v1 import common_pb2


class Resync(enum.Enum):
    """Why a node's view must be healed; the value is the metric's ``reason`` label."""

    GAP = "gap"  # a skipped sequence: replay
    RESTART = "restart"  # another incarnation: snapshot
    DROPPED = "dropped"  # events lost inside the node's log: snapshot
    DRIFT = "drift"  # the digests disagree: snapshot
    DISCONNECT = "disconnect"  # the stream ended: replay once reconnected


@dataclass(eq=False)
class NodeView:
    """What the index believes one node caches, and where in the node's stream it stands."""

    incarnation: str = ""  # "" until a snapshot or a first batch
    sequence: int = 0  # the last batch applied
    hashes: set[BlockHash] = field(default_factory=set)
    digest_sum: int = 0  # BlockDigest sum of ``hashes``, kept as they change
    needs_snapshot: bool = True  # the next stream must start with a snapshot (no view to resume)
    drift: int = 0  # the last digest comparison, in blocks
    node_id: str = ""

    @property
    def digest(self) -> BlockDigest:
        return BlockDigest(self.digest_sum, len(self.hashes))

    def add(self, block_hashes: Iterable[bytes]) -> None:
        for block_hash in block_hashes:
            if block_hash not in self.hashes:
                self.hashes.add(block_hash)
                self.digest_sum = (self.digest_sum + digest_term(block_hash)) & DIGEST_MASK

    def discard(self, block_hashes: Iterable[bytes]) -> None:
        for block_hash in block_hashes:
            if block_hash in self.hashes:
                self.hashes.remove(block_hash)
                self.digest_sum = (self.digest_sum - digest_term(block_hash)) & DIGEST_MASK

    def clear(self) -> None:
        self.hashes.clear()
        self.digest_sum = 0


class KvIndex:
    """Per node (keyed by the address the gateway dials): the cached block hashes its KV events announced."""

    def __init__(self) -> None:
        self._views: dict[str, NodeView] = {}

    def __contains__(self, target: str) -> bool:
        return target in self._views

    def targets(self) -> list[str]:
        return list(self._views)

    def view(self, target: str) -> NodeView:
        return self._views.setdefault(target, NodeView())

    def hashes(self, target: str) -> set[BlockHash]:
        view = self._views.get(target)
        return set(view.hashes) if view is not None else set()

    def drift(self, target: str) -> int:
        view = self._views.get(target)
        return view.drift if view is not None else 0

    def forget(self, target: str) -> None:
        """The node left: none of its entries stay behind."""
        self._views.pop(target, None)

    def matched_blocks(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Per node, how many leading blocks of a prompt (its chained hashes) it caches; nodes with none omitted."""
        out: dict[str, int] = {}
        for target, view in self._views.items():
            n = 0
            while n < len(block_hashes) and block_hashes[n] in view.hashes:
                n += 1
            if n:
                out[target] = n
        return out

    def resume_request(self, target: str, max_queued_batches: int = 0) -> common_pb2.SubscribeKvEventsRequest:
        """What to ask the node for: a replay from the view's next sequence, or a snapshot when there is none."""
        view = self.view(target)
        if view.needs_snapshot or not view.incarnation:
            return common_pb2.SubscribeKvEventsRequest(max_queued_batches=max_queued_batches, snapshot=True)
        return common_pb2.SubscribeKvEventsRequest(max_queued_batches=max_queued_batches,
                                                   incarnation=view.incarnation, from_sequence=view.sequence + 1)

    def apply(self, target: str, batch: common_pb2.KvEventBatch) -> Resync | None:
        """Apply one batch of ``target``'s stream; a ``Resync`` means stop this stream and reconnect with
        ``resume_request`` (a gap leaves the view as it was before the batch, a restart empties it at once,
        dropped events and drift keep it until the snapshot replaces it)."""
        view = self.view(target)
        view.node_id = batch.node_id or view.node_id
        if batch.HasField("snapshot"):
            view.clear()
            view.add(batch.snapshot.block_hashes)
            view.incarnation, view.sequence, view.needs_snapshot = batch.incarnation, batch.sequence, False
            return self._check(view, batch)
        if view.needs_snapshot:  # a live batch before the snapshot asked for (a node that cannot snapshot)
            return None
        if batch.incarnation != view.incarnation:
            view.clear()  # the restarted node's cache is empty or unknown: nothing of the old one may route
            view.needs_snapshot, view.incarnation, view.sequence = True, "", 0
            return Resync.RESTART
        if batch.sequence <= view.sequence:  # already applied (a replay overlapping what arrived live)
            return None
        if batch.sequence != view.sequence + 1:
            return Resync.GAP
        if batch.dropped:
            view.needs_snapshot = True
            return Resync.DROPPED
        for event in batch.events:
            match event.WhichOneof("kind"):
                case "stored":
                    view.add(event.stored.block_hashes)
                case "removed":
                    view.discard(event.removed.block_hashes)
                case "cleared":
                    view.clear()
        view.sequence = batch.sequence
        return self._check(view, batch)

    def _check(self, view: NodeView, batch: common_pb2.KvEventBatch) -> Resync | None:
        if not batch.HasField("digest"):
            return None
        view.drift = view.digest.drift(BlockDigest(batch.digest.sum, batch.digest.count))
        if view.drift:
            view.needs_snapshot = True
            return Resync.DRIFT
        return None
