"""Routing choices, with exact expectations."""

from __future__ import annotations

from common.kv.block_hash import hash_prompt_blocks
from gateway.router import AffinityIndex, NodeLoad, NodeState, Router


def load(free: int = 100, running: int = 0, waiting: int = 0, node_id: str = "") -> NodeLoad:
    return NodeLoad(node_id=node_id, num_blocks=100, free_blocks=free, num_running=running, num_waiting=waiting,
                    block_size=16)


def target(node: NodeState | None) -> str | None:
    return None if node is None else node.target


def blocks(*tokens: int, n: int = 4) -> list[bytes]:
    """Chained hashes of a prompt made of ``n`` blocks of 16 tokens each starting with ``tokens``."""
    ids = [*tokens, *range(1000, 1000 + 16 * n)][: 16 * n]
    return hash_prompt_blocks(ids, 16)


def test_decode_prefers_shallow_queue_then_free_blocks_then_order() -> None:
    r = Router(["p0"], ["d0", "d1", "d2"])
    assert target(r.pick_decode(4)) == "d0"  # never polled: all equal, first listed
    r.update("d0", load(free=50, running=3))
    r.update("d1", load(free=40, running=1))
    r.update("d2", load(free=90, running=1))
    assert target(r.pick_decode(4)) == "d2"  # d1 and d2 run 1 each; d2 has more free blocks
    r.update("d2", load(free=90, running=2))
    assert target(r.pick_decode(4)) == "d1"


def test_decode_skips_nodes_without_room_for_the_prompt() -> None:
    r = Router(["p0"], ["d0", "d1"])
    r.update("d0", load(free=10, running=0))
    r.update("d1", load(free=60, running=5))
    assert target(r.pick_decode(20)) == "d1"  # 21 blocks needed: only d1 fits, busier as it is
    assert target(r.pick_decode(5)) == "d0"
    r.update("d1", load(free=8, running=5))
    assert target(r.pick_decode(20)) == "d0"  # nobody fits: the shallowest queue waits for blocks


def test_inflight_counts_before_the_next_poll() -> None:
    r = Router(["p0"], ["d0", "d1"])
    first = r.pick_decode(1)
    assert first is not None and first.target == "d0"
    first.begin()
    assert target(r.pick_decode(1)) == "d1"
    r.update("d0", load(running=0))  # a poll taken before our request reached the node
    assert r.node("d0").queue_depth == 1  # max(in-flight 1, polled 0): not forgotten
    first.end()
    assert target(r.pick_decode(1)) == "d0"


def test_unreachable_and_excluded_nodes_are_skipped_until_a_poll_succeeds() -> None:
    r = Router(["p0", "p1"], ["d0", "d1"])
    r.mark_unreachable("d0")
    assert target(r.pick_decode(1)) == "d1"
    assert r.pick_decode(1, exclude=["d1"]) is None
    r.update("d0", load())
    assert target(r.pick_decode(1)) == "d0"
    assert target(r.pick_prefill([], exclude=["p0"])) == "p1"


def test_prefill_follows_the_longest_cached_prefix() -> None:
    r = Router(["p0", "p1", "p2"], ["d0"])
    shared = blocks(1, n=4)
    other = blocks(2, n=4)
    r.affinity.record(shared[:2], "p1")  # p1 computed the first two blocks
    r.affinity.record(shared[:3], "p2")  # p2 computed three (and now owns blocks 0-2)
    r.affinity.record(other, "p0")
    assert r.affinity.matched_blocks(shared) == {"p2": 3}
    assert target(r.pick_prefill(shared)) == "p2"
    assert target(r.pick_prefill(other)) == "p0"
    assert target(r.pick_prefill(blocks(3))) == "p0"  # no history: the shallowest queue, first listed


def test_prefill_choice_is_remembered_for_the_next_request_with_that_prefix() -> None:
    r = Router(["p0", "p1"], ["d0"])
    r.node("p0").begin()  # p0 is busy: a new prompt goes to p1
    prompt = blocks(7)
    assert target(r.pick_prefill(prompt)) == "p1"
    r.node("p1").begin()
    r.node("p1").begin()  # now p1 is the busier one, but it holds the prefix
    assert target(r.pick_prefill(prompt)) == "p1"


def test_affinity_gives_way_when_its_node_is_much_more_loaded() -> None:
    r = Router(["p0", "p1"], ["d0"], affinity_load_slack=2)
    prompt = blocks(5)
    r.affinity.record(prompt, "p1")
    r.update("p1", load(running=1, waiting=1))  # 2 deeper than p0: within the slack
    assert target(r.pick_prefill(prompt)) == "p1"
    r.update("p1", load(running=1, waiting=2))  # 3 deeper: too much
    assert target(r.pick_prefill(prompt)) == "p0"
    assert r.affinity.matched_blocks(prompt) == {"p0": 4}  # and p0 now owns the prefix


def test_affinity_index_is_a_bounded_lru() -> None:
    index = AffinityIndex(capacity=3)
    a, b = blocks(1, n=2), blocks(2, n=2)
    index.record(a, "p0")
    index.record(b[:1], "p1")
    index.record(a[:1], "p0")  # touch a[0]: a[1] is now the oldest
    index.record(b[1:], "p1")
    assert len(index) == 3
    assert index.matched_blocks(a) == {"p0": 1}  # a[1] was evicted
    assert index.matched_blocks(b) == {"p1": 2}


def test_node_id_comes_from_the_poll() -> None:
    r = Router(["127.0.0.1:7001"], ["127.0.0.1:7002"])
    assert r.node("127.0.0.1:7001").node_id == "127.0.0.1:7001"
    r.update("127.0.0.1:7001", load(node_id="prefill-a"))
    assert r.node("127.0.0.1:7001").node_id == "prefill-a"


def test_nodes_join_and_leave_at_runtime() -> None:
    r = Router([], [])
    assert r.pick_decode(1) is None and r.pick_prefill(blocks(1)) is None
    r.add("decode", "d0", node_id="decode-a")
    r.add("prefill", "p0")
    assert target(r.pick_decode(1)) == "d0" and target(r.pick_prefill(blocks(1))) == "p0"
    assert r.node("d0").node_id == "decode-a"  # the registered id until a poll says otherwise
    r.add("decode", "d1")
    assert r.node("d1").index > r.node("d0").index  # joiners break ties after the earlier members
    held = r.remove("d0")
    assert held is not None and r.find("d0") is None and r.remove("d0") is None
    r.mark_unreachable("d0")  # a call that was on the node reports it after it left: nothing to mark
    r.update("d0", load())
    assert r.find("d0") is None and target(r.pick_decode(1)) == "d1"


def test_a_draining_node_takes_no_new_request() -> None:
    r = Router(["p0", "p1"], ["d0", "d1"])
    prompt = blocks(3)
    r.affinity.record(prompt, "p0")
    r.node("p0").draining = r.node("d0").draining = True
    assert target(r.pick_prefill(prompt)) == "p1"  # affinity gives way too
    assert target(r.pick_decode(1)) == "d1"
    r.node("d1").draining = True
    assert r.pick_decode(1) is None


def test_a_conversations_next_turn_goes_to_the_decode_node_holding_its_history() -> None:
    r = Router(["p0"], ["d0", "d1"], affinity_load_slack=2)
    history = blocks(9, n=6)
    r.record_history(history[:5], "d1")  # d1 served the last turn: 5 blocks of prompt and answer
    assert r.history_blocks(history, "d1") == 5 and r.history_blocks(history, "d0") == 0
    assert target(r.pick_decode(6, block_hashes=history)) == "d1"
    assert target(r.pick_decode(6)) == "d0"  # without the hashes: the usual order
    r.update("d1", load(running=3))  # 3 deeper than d0: past the slack
    assert target(r.pick_decode(6, block_hashes=history)) == "d0"
    r.update("d1", load(running=2))
    assert target(r.pick_decode(6, block_hashes=history)) == "d1"
    r.update("d1", load(free=6, running=0))  # no room for 6 blocks + the first token: not there
    assert target(r.pick_decode(6, block_hashes=history)) == "d0"
    assert target(r.pick_decode(6, exclude=["d0"], block_hashes=history)) == "d1"  # the only one left


def test_what_the_nodes_say_they_cache_counts_beside_the_routers_records() -> None:
    """``cache_index`` (the nodes' KV events): a decode node caching a prompt the router never sent it is preferred;
    a prefill node's own report beats the router's guess about another one."""

    from gateway.kv_index import KvIndex

    r = Router(["p0", "p1"], ["d0", "d1"], affinity_load_slack=2)
    prompt = blocks(3, n=4)
    r.affinity.record(prompt[:1], "p0")
    index = KvIndex()  # as the nodes' KV events fill it (gateway/kv_event_merger.py's KvIndexSync)
    index.view("d1").add(prompt[:3])
    index.view("p1").add(prompt)
    r.cache_index = index
    assert r.cached_blocks(prompt) == {"p0": 1, "d1": 3, "p1": 4}
    assert target(r.pick_decode(4, block_hashes=prompt)) == "d1"
    assert target(r.pick_prefill(prompt)) == "p1"


def test_a_history_on_a_shared_tier_counts_for_the_prefill_nodes_on_that_tier() -> None:
    """A decode node's finished conversation is written to its shared offload tier: every prefill node reporting
    the same tier restores it, so it counts as cached there (a prefill node on another tier, or none, gets nothing)."""
    import dataclasses

    r = Router(["p0", "p1", "p2"], ["d0"])
    history = blocks(7, n=6)
    r.record_history(history[:5], "d0")
    assert r.cached_blocks(history) == {"d0": 5}  # no tier reported yet
    r.update("d0", dataclasses.replace(load(), shared_tier="t1"))
    r.update("p0", dataclasses.replace(load(), shared_tier="t1"))
    r.update("p1", dataclasses.replace(load(), shared_tier="t2"))
    r.update("p2", load())
    assert r.cached_blocks(history) == {"d0": 5, "p0": 5}
    assert target(r.pick_prefill(history)) == "p0"  # the warm node, as for its own prefix cache
