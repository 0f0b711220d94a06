"""Which decode node reserves a request and which prefill node computes it. Pure logic, no I/O.

Load comes from two places: each node's last ``Stats`` (polled by ``NodePool``; it also counts requests
from other gateways) and the gateway's own in-flight count (exact and current, where polls are up to one
interval old). A node's queue depth is the larger of the two, so neither is counted twice.

Decode: nodes whose free blocks fit the prompt first, then the shallowest queue, then the most free
blocks, then the order of the targets — unless a node holds the longest part of this prompt as the history of
a conversation it served (the ``history`` index: the prompt and answer of each request a decode node finished,
whose blocks its prefix cache keeps), and its queue is at most ``affinity_load_slack`` deeper: then that node,
which can prefill the next turn from its own cache. Prefill: the node that last computed the longest prefix of
this prompt (its prefix cache probably still holds it), unless its queue is more than ``affinity_load_slack``
deeper than the shallowest one; otherwise the shallowest queue.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from common.kv.block_hash import BlockHash


@dataclass(frozen=True)
class NodeLoad:
    """A node's ``Stats`` answer, as the router uses it."""

    node_id: str
    num_blocks: int
    free_blocks: int
    num_running: int
    num_waiting: int
    block_size: int
    prefix_cache_queries: int = 0  # prompt tokens looked up, since the node started
    prefix_cache_hits: int = 0  # of which found (pool or offload tier)
    offload_hits: int = 0  # of which restored from its offload tier
    offload_blocks: int = 0  # blocks its offload tier holds
    shared_tier: str = ""  # its shared offload tier's id (--kv-offload shared): "" none


@dataclass(eq=False)
class NodeState:
    """What the router knows about one node."""

    target: str  # host:port
    index: int  # position in the configured targets: the last tie-break, so choices are deterministic
    load: NodeLoad | None = None  # None until the first successful poll
    reachable: bool = True  # optimistic until a poll or a call fails to connect
    draining: bool = False  # `tandem drain`: no new requests, the in-flight ones finish
    registered_id: str = ""  # the node id a registered node gave (gateway.membership); "" for a static target
    inflight: int = 0  # this gateway's requests on the node right now
    # prompt tokens this gateway sent the node to prefill (a prefill node's Prefill calls, a decode node's local
    # prefills) whose first token has not come back yet: the node's prefill backlog, in tokens
    prefill_tokens: int = 0

    @property
    def node_id(self) -> str:
        if self.load is not None and self.load.node_id:
            return self.load.node_id
        return self.registered_id or self.target

    @property
    def routable(self) -> bool:
        """Whether new requests may go to the node."""
        return self.reachable and not self.draining

    @property
    def queue_depth(self) -> int:
        polled = self.load.num_running + self.load.num_waiting if self.load is not None else 0
        return max(self.inflight, polled)

    def begin(self) -> None:
        self.inflight += 1

    def end(self) -> None:
        assert self.inflight > 0, f"{self.target}: end() without begin()"
        self.inflight -= 1

    def begin_prefill(self, num_tokens: int) -> None:
        self.prefill_tokens += num_tokens

    def end_prefill(self, num_tokens: int) -> None:
        assert self.prefill_tokens >= num_tokens, f"{self.target}: end_prefill() without begin_prefill()"
        self.prefill_tokens -= num_tokens


class BlockIndex(Protocol):
    """What the nodes' own KV events say they cache (gateway/kv_index.py's ``KvIndex``)."""

    def matched_blocks(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]: ...


class AffinityIndex:
    """Bounded LRU map from a chained block hash to the prefill node that last computed that prefix."""

    def __init__(self, capacity: int) -> None:
        assert capacity > 0
        self._capacity = capacity
        self._owner: OrderedDict[BlockHash, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def record(self, block_hashes: Sequence[BlockHash], target: str) -> None:
        for h in block_hashes:
            self._owner[h] = target
            self._owner.move_to_end(h)
        while len(self._owner) > self._capacity:
            self._owner.popitem(last=False)

    def matched_blocks(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """For each node, how many leading blocks of the prompt it computed last.

        Hashes are chained, so a node that computed block i computed the whole prefix up to block i.
        """
        matched: dict[str, int] = {}
        for i, h in enumerate(block_hashes):
            target = self._owner.get(h)
            if target is not None:
                matched[target] = i + 1
        return matched


class Router:
    """Picks nodes for requests; ``NodePool`` feeds it polls and the live membership, the coordinator reports
    failures. The nodes given at start (the static targets) come first; registered ones follow in the order
    they joined."""

    def __init__(self, prefill_targets: Sequence[str], decode_targets: Sequence[str],
                 affinity_capacity: int = 100_000, affinity_load_slack: int = 4) -> None:
        self.prefill: dict[str, NodeState] = {}
        self.decode: dict[str, NodeState] = {}
        self._next_index = 0
        for role, targets in (("prefill", prefill_targets), ("decode", decode_targets)):
            for target in targets:
                self.add(role, target)
        self.affinity = AffinityIndex(affinity_capacity)
        self.history = AffinityIndex(affinity_capacity)  # decode nodes: the conversations each one served last
        self.cache_index: BlockIndex | None = None  # the nodes' KV events, exact per node (set by the gateway)
        self._slack = affinity_load_slack

    def node(self, target: str) -> NodeState:
        return self.prefill.get(target) or self.decode[target]

    def find(self, target: str) -> NodeState | None:
        """The node at ``target``, or None when it is not (or no longer) a member."""
        return self.prefill.get(target) or self.decode.get(target)

    def add(self, role: str, target: str, node_id: str = "") -> NodeState:
        """A node joins routing (``role``: prefill or decode; ``node_id``: the id it registered with)."""
        assert role in ("prefill", "decode") and self.find(target) is None, (role, target)
        node = NodeState(target, self._next_index, registered_id=node_id)
        self._next_index += 1
        (self.prefill if role == "prefill" else self.decode)[target] = node
        return node

    def remove(self, target: str) -> NodeState | None:
        """A node leaves routing; the requests already on it hold its ``NodeState`` and finish as they may."""
        return self.prefill.pop(target, None) or self.decode.pop(target, None)

    def update(self, target: str, load: NodeLoad) -> None:
        """A successful poll: the node is reachable and this is its load."""
        if (node := self.find(target)) is not None:
            node.load, node.reachable = load, True

    def mark_unreachable(self, target: str) -> None:
        """A poll or a call could not reach the node; skip it until a poll succeeds again."""
        if (node := self.find(target)) is not None:  # a node that left meanwhile is no member to mark
            node.reachable = False

    def pick_decode(self, num_prompt_blocks: int, exclude: Collection[str] = (),
                    block_hashes: Sequence[BlockHash] = ()) -> NodeState | None:
        """The decode node for a prompt of ``num_prompt_blocks`` blocks (with these full-block hashes: a node
        holding its history is preferred within the slack), or None if none is reachable."""
        candidates = _candidates(self.decode, exclude)
        if not candidates:
            return None
        needed = num_prompt_blocks + 1  # the prompt and the first generated token

        def fits(n: NodeState) -> bool:
            free = n.load.free_blocks if n.load is not None else None
            return free is None or free >= needed  # never polled: assume it fits

        def key(n: NodeState) -> tuple[bool, int, int, int]:
            return (not fits(n), n.queue_depth, -(n.load.free_blocks if n.load is not None else 0), n.index)

        chosen = min(candidates, key=key)
        matched = self.cached_blocks(block_hashes) if block_hashes else {}
        warm = [n for n in candidates if matched.get(n.target, 0) > 0 and fits(n)]
        if warm:
            best = max(warm, key=lambda n: (matched[n.target], -n.queue_depth, -n.index))
            if best.queue_depth <= chosen.queue_depth + self._slack:
                chosen = best
        return chosen

    def history_blocks(self, block_hashes: Sequence[BlockHash], target: str) -> int:
        """How many leading blocks of a prompt decode node ``target`` holds as a conversation's history."""
        return self.history.matched_blocks(block_hashes).get(target, 0)

    def cached_blocks(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Per node, the prompt's leading blocks it probably caches: the most that the router's own records (the
        prefill node it sent the prefix to, the decode node that served the conversation) and the nodes' KV events
        (``cache_index``, when the gateway follows them) say."""
        out = self.affinity.matched_blocks(block_hashes)
        history = self.history.matched_blocks(block_hashes)
        sources = [history]
        if self.cache_index is not None:
            sources.append(self.cache_index.matched_blocks(block_hashes))
        for source in sources:
            for target, blocks in source.items():
                out[target] = max(out.get(target, 0), blocks)
        # A decode node that served the conversation wrote its blocks (prompt and answer) to its shared tier when
        # the request let go of them: every prefill node on the same tier restores them (common/kv/shared_tier.py).
        for target, blocks in history.items():
            node = self.decode.get(target)
            tier = node.load.shared_tier if node is not None and node.load is not None else ""
            if not tier:
                continue
            for prefill in self.prefill.values():
                if prefill.load is not None and prefill.load.shared_tier == tier:
                    out[prefill.target] = max(out.get(prefill.target, 0), blocks)
        return out

    def record_history(self, block_hashes: Sequence[BlockHash], target: str) -> None:
        """Decode node ``target`` finished a request over these blocks (its prompt and answer, full blocks)."""
        self.history.record(block_hashes, target)

    def pick_prefill(self, block_hashes: Sequence[BlockHash], exclude: Collection[str] = ()) -> NodeState | None:
        """The prefill node for a prompt with these full-block hashes, or None if none is reachable.

        The choice is remembered for the prompt's blocks right away, so concurrent requests sharing a
        prefix follow the first one to the same node.
        """
        candidates = _candidates(self.prefill, exclude)
        if not candidates:
            return None
        chosen = min(candidates, key=lambda n: (n.queue_depth, n.index))
        matched = self.cached_blocks(block_hashes)
        warm = [n for n in candidates if matched.get(n.target, 0) > 0]
        if warm:
            best = max(warm, key=lambda n: (matched[n.target], -n.queue_depth, -n.index))
            if best.queue_depth <= chosen.queue_depth + self._slack:
                chosen = best
        self.affinity.record(block_hashes, chosen.target)
        return chosen


def _candidates(nodes: dict[str, NodeState], exclude: Collection[str]) -> list[NodeState]:
    return [n for n in nodes.values() if n.routable and n.target not in exclude]
