"""Conditional disaggregation's policy with exact expectations: which prompts a decode node prefills itself."""

from __future__ import annotations

import pytest

from gateway.prefill_policy import LocalPrefillPolicy, local_wins, prefill_locally
from gateway.router import NodeLoad, NodeState

POLICY = LocalPrefillPolicy(max_tokens=100, local_cost_factor=1.5, headroom_blocks=8)


def node(target: str, running: int = 0, waiting: int = 0, free: int = 1000, reachable: bool = True,
         backlog: int = 0) -> NodeState:
    state = NodeState(target, 0, NodeLoad(target, 1000, free, running, waiting, 16), reachable)
    state.prefill_tokens = backlog
    return state


@pytest.mark.parametrize(("tokens", "prefill_backlogs", "decode", "expected"), [
    (100, [0], node("d"), True),  # short, both idle: local
    (100, [5000], node("d", backlog=5000), True),  # short, both busy: local (5100 <= 1.5 * 5100)
    (100, [0], node("d", backlog=2000), True),  # short: ahead of the long one the decode node prefills
    (101, [0], node("d"), False),  # longer, prefill idle: disaggregate
    (1000, [499], node("d"), False),  # 1.5 * 1000 = 1500 local vs 1499 remote
    (1000, [501], node("d"), True),  # 1500 vs 1501: the decode node gives the first token sooner
    (1000, [5000, 0], node("d"), False),  # the shortest prefill backlog counts
    (1000, [2000], node("d", backlog=100), True),  # 1.5 * 1100 = 1650 local vs 3000 remote: local...
    (1000, [9000], node("d", backlog=1101), True),  # ...and a second long one: 1.5 * 2101 < 10000
    (1000, [2000], node("d", backlog=1101), False),  # ...but not while 3151.5 > 3000
    (1000, [5000], node("d", waiting=1), True),  # queued requests there are in its backlog already
    (160, [5000], node("d", free=17), False),  # 10 blocks + 8 headroom do not fit in 17
    (160, [5000], node("d", free=18), True),
])
def test_policy_decisions(tokens: int, prefill_backlogs: list[int], decode: NodeState, expected: bool) -> None:
    prefill = [node(f"p{i}", backlog=b) for i, b in enumerate(prefill_backlogs)]
    assert prefill_locally(POLICY, tokens, decode, prefill, block_size=16) is expected


def test_tokens_cached_on_a_prefill_node_are_not_its_work() -> None:
    """A 1000-token prompt whose 960-token prefix a busy prefill node holds stays there: 40 + 600 < 1500."""
    prefill = [node("p", backlog=600)]
    assert not prefill_locally(POLICY, 1000, node("d"), prefill, 16, {"p": 960})
    assert prefill_locally(POLICY, 1000, node("d"), prefill, 16, {})  # 1500 local vs 1600 remote
    assert prefill_locally(POLICY, 1000, node("d"), prefill, 16, {"other": 960})


def test_prompts_waiting_for_a_reservation_count_on_the_prefill_side() -> None:
    """A long prompt while the decode node prefills one: local only if the prefill side is busier."""
    busy_decode = node("d", backlog=900)
    assert not prefill_locally(POLICY, 1000, busy_decode, [node("p")], 16)  # 1.5 * 1900 > 1000
    assert prefill_locally(POLICY, 1000, busy_decode, [node("p")], 16, queued_remote_tokens=9000)
    # Spread over the reachable prefill nodes: 2 x 4500.
    assert prefill_locally(POLICY, 1000, busy_decode, [node("p"), node("q")], 16, queued_remote_tokens=9000)
    assert not prefill_locally(POLICY, 1000, busy_decode, [node("p"), node("q")], 16, queued_remote_tokens=1000)


def test_local_wins_compares_weighted_backlogs() -> None:
    assert local_wins(POLICY, 101, 0, [(200, 0)])  # 151.5 < 301
    assert local_wins(POLICY, 101, 101, [(5000, 0)])  # 303 < 5101: a second long prompt on the decode node
    assert not local_wins(POLICY, 101, 3500, [(5000, 0)])  # 1.5 * 3601 = 5401.5 > 5101
    assert not local_wins(POLICY, 101, 0, [(200, 0), (0, 0)])  # an idle prefill node: 151.5 > 101
    assert local_wins(POLICY, 100, 10_000, [(0, 0)])  # short: always the decode node's (shortest first there)
    assert not local_wins(LocalPrefillPolicy(max_tokens=1, local_cost_factor=3.0), 100, 0, [(200, 0)])


def test_off_means_never_even_without_prefill_nodes() -> None:
    assert not prefill_locally(LocalPrefillPolicy(), 1, node("d"), [], 16)


def test_no_reachable_prefill_node_prefills_everything_locally() -> None:
    assert prefill_locally(POLICY, 5000, node("d"), [node("p", reachable=False)], 16)


def test_a_decode_node_never_polled_gets_only_short_prompts() -> None:
    unpolled = NodeState("d", 0)
    assert prefill_locally(POLICY, 50, unpolled, [node("p", backlog=9000)], 16)
    assert not prefill_locally(POLICY, 150, unpolled, [node("p", backlog=9000)], 16)


def test_negative_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        LocalPrefillPolicy(max_tokens=-1)
    with pytest.raises(ValueError, match="local_cost_factor must be >= 1"):
        LocalPrefillPolicy(local_cost_factor=0.5)


def test_prompts_bound_for_the_decode_node_count_on_its_side() -> None:
    """A burst's concurrent decisions: the local prompts its node has not answered yet are its backlog too."""
    prefill = [node("p", backlog=2000)]
    assert prefill_locally(POLICY, 1000, node("d"), prefill, 16)  # 1500 < 3000
    assert not prefill_locally(POLICY, 1000, node("d"), prefill, 16, queued_local_tokens=1001)  # 3001.5 > 3000


def test_a_decode_node_holding_the_history_prefills_only_the_new_tokens() -> None:
    """A 1000-token turn whose first 960 tokens (the conversation so far) the decode node holds: 40 new tokens,
    within max_tokens: local, though a prefill node is idle; with 800 held, 200 new: 1.5 * 200 < 1000 remote."""
    prefill = [node("p")]
    assert not prefill_locally(POLICY, 1000, node("d"), prefill, 16)
    assert prefill_locally(POLICY, 1000, node("d"), prefill, 16, decode_cached_tokens=960)
    assert prefill_locally(POLICY, 1000, node("d"), prefill, 16, decode_cached_tokens=800)
    # ... unless the prefill node holds as much: 1.5 * 200 > 200
    assert not prefill_locally(POLICY, 1000, node("d"), prefill, 16, {"p": 800}, decode_cached_tokens=800)
    # the blocks it needs are the new ones only: 3 + 8 headroom fit in 11 free blocks
    assert prefill_locally(POLICY, 1000, node("d", free=11), prefill, 16, decode_cached_tokens=960)
    assert local_wins(POLICY, 1000, 0, [(0, 0)], local_cached=900)  # 100 new: within max_tokens
