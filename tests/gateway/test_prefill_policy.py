"""Conditional disaggregation's policy with exact expectations: which prompts a decode node prefills itself."""

from __future__ import annotations

import pytest

from gateway.prefill_policy import LocalPrefillPolicy, prefill_locally
from gateway.router import NodeLoad, NodeState

POLICY = LocalPrefillPolicy(max_tokens=100, busy_queue_depth=4, busy_factor=4, headroom_blocks=8)


def node(target: str, running: int = 0, waiting: int = 0, free: int = 1000, reachable: bool = True) -> NodeState:
    return NodeState(target, 0, NodeLoad(target, 1000, free, running, waiting, 16), reachable)


@pytest.mark.parametrize(("tokens", "prefill_depths", "decode", "expected"), [
    (100, [0], node("d"), True),  # short: always local
    (101, [0], node("d"), False),  # longer, prefill idle: disaggregate
    (101, [3, 9], node("d"), False),  # one prefill node not busy yet
    (101, [4, 9], node("d"), True),  # every prefill node busy, decode has headroom
    (400, [4], node("d"), True),  # up to busy_factor * max_tokens
    (401, [9], node("d"), False),  # beyond it: always a prefill node
    (101, [4], node("d", waiting=1), False),  # the decode node queues already
    (160, [4], node("d", free=17), False),  # 10 blocks + 8 headroom do not fit in 17
    (160, [4], node("d", free=18), True),
])
def test_policy_decisions(tokens: int, prefill_depths: list[int], decode: NodeState, expected: bool) -> None:
    prefill = [node(f"p{i}", running=d) for i, d in enumerate(prefill_depths)]
    assert prefill_locally(POLICY, tokens, decode, prefill, block_size=16) is expected


def test_off_means_never_even_without_prefill_nodes() -> None:
    assert not prefill_locally(LocalPrefillPolicy(), 1, node("d"), [], 16)


def test_no_reachable_prefill_node_prefills_everything_locally() -> None:
    assert prefill_locally(POLICY, 5000, node("d"), [node("p", reachable=False)], 16)


def test_a_decode_node_never_polled_gets_no_busy_time_prompts() -> None:
    unpolled = NodeState("d", 0)
    assert prefill_locally(POLICY, 50, unpolled, [node("p", running=9)], 16)
    assert not prefill_locally(POLICY, 150, unpolled, [node("p", running=9)], 16)


def test_negative_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        LocalPrefillPolicy(max_tokens=-1)
