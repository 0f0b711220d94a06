"""Conditional disaggregation: which prompts the decode node prefills itself (pure logic, no I/O).

Sending a prompt to a prefill node costs a KV transfer and a second queue; it pays when the prompt is long
(its prefill would stall the decode node's running streams) and the prefill nodes keep up. NVIDIA Dynamo
prefills locally below a length threshold and when the prefill queue is long; so does Tandem:

- a prompt of at most ``max_tokens`` tokens prefills on its decode node, always;
- a longer one, up to ``busy_factor * max_tokens``, also does when every reachable prefill node already has
  ``busy_queue_depth`` requests or more and the decode node has headroom (nothing queued, and free blocks
  for the prompt and then some);
- with no reachable prefill node at all, every prompt that fits prefills locally (degraded, not down).

``max_tokens = 0`` turns it off: every prompt goes to a prefill node (full disaggregation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.router import NodeState


@dataclass(frozen=True)
class LocalPrefillPolicy:
    max_tokens: int = 0  # prompts up to this many tokens: a decode node always prefills them itself; 0: never
    busy_queue_depth: int = 4  # a prefill node this deep (running + waiting) counts as busy
    busy_factor: int = 4  # while all prefill nodes are busy, prompts up to busy_factor * max_tokens go local
    headroom_blocks: int = 8  # free blocks the decode node must keep beyond the prompt to take a busy-time one

    def __post_init__(self) -> None:
        for name in ("max_tokens", "busy_queue_depth", "busy_factor", "headroom_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"local prefill {name} must be >= 0, got {getattr(self, name)}")


def prefill_locally(policy: LocalPrefillPolicy, num_prompt_tokens: int, decode: NodeState,
                    prefill_nodes: Sequence[NodeState], block_size: int) -> bool:
    """Whether ``decode`` should prefill a prompt of ``num_prompt_tokens`` tokens itself."""
    if policy.max_tokens == 0:
        return False
    reachable = [n for n in prefill_nodes if n.reachable]
    if not reachable:
        return True
    if num_prompt_tokens <= policy.max_tokens:
        return True
    if num_prompt_tokens > policy.busy_factor * policy.max_tokens:
        return False
    if min(n.queue_depth for n in reachable) < policy.busy_queue_depth:
        return False
    load = decode.load
    if load is None or load.num_waiting > 0:
        return False
    return load.free_blocks >= -(-num_prompt_tokens // block_size) + policy.headroom_blocks
