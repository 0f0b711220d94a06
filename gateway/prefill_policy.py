"""Conditional disaggregation: which prompts the decode node prefills itself (pure logic, no I/O).

Sending a prompt to a prefill node costs a KV transfer and a second queue; it pays when the prompt is long
(its prefill would stall the decode node's running streams) and the prefill nodes keep up. NVIDIA Dynamo
prefills locally below a length threshold and when the prefill queue is long; Tandem measures both sides'
queues in tokens of work (each node's prefill backlog: prompt tokens this gateway sent it that have not
produced their first token yet), and weighs them with ``local_cost_factor`` (f):

- a prompt of at most ``max_tokens`` tokens prefills on its decode node: the node's scheduler gives prefill
  chunks shortest prompt first (``prefill_order``, common/engine/scheduler.py), so it goes ahead of every
  longer prompt the node is prefilling and gets its first token within a step or two, without a KV transfer.
  (Sending a short one to an idle prefill node instead, while the decode node had streams or was prefilling
  another prompt, was measured on multi-turn chats in session 35: worse or tied, a served prefill step beside a
  streaming decode node running 14-21% slower: benchmarks/results/2026-12-06-turns/RESULTS.md);
- a longer one goes to a prefill node unless the decode node would give it its first token sooner:
  local when ``f * (local backlog + n) < remote backlog + n``, the decode node's side weighted because its
  decode steps share the core and wait behind the prompt's chunks, and the decode node has free blocks for
  the prompt and ``headroom_blocks`` more. So an idle prefill node always takes it, and when the prefill
  nodes fall behind, the decode node takes its share of the long prompts, as a colocated replica would.
  (Before the scheduler ordered prefills by length, a decode node took one long prompt at a time, so that a
  burst of them could not queue in front of its short ones; with the order by length that limit only cost
  goodput: benchmarks/results/2026-12-02-srpt/RESULTS.md, issue 16.)
- a prefill node's side counts only the prompt's tokens it does not hold already (its prefix cache, as the
  router's affinity index knows it), and its share of the prompts bound for the prefill nodes that still
  wait for their decode reservation (the admission queue: no prefill node has seen them yet);
- the decode node's side counts only the prompt's tokens it does not hold already: a conversation's next turn
  routed to the decode node that served the last one (``Router.pick_decode``'s history) finds the earlier turns
  in its prefix cache and prefills only the new message — locally, whenever those uncached tokens are few
  (``max_tokens``) or cheaper there than on a prefill node, which would prefill the whole history again;
- with no reachable prefill node at all, every prompt that fits prefills locally (degraded, not down).

``max_tokens = 0`` turns it off: every prompt goes to a prefill node (full disaggregation).
``local_wins`` is the comparison itself, shared with the planner's simulator (benchmarks/planner).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gateway.router import NodeState

# chosen from the mixed workload's measurements (benchmarks/results/2026-12-02-srpt/)
DEFAULT_LOCAL_PREFILL_MAX_TOKENS = 256


@dataclass(frozen=True)
class LocalPrefillPolicy:
    max_tokens: int = 0  # prompts up to this many tokens: always the decode node's own; 0: never
    # a prompt token prefilled on a decode node costs this many of a prefill node's (must be >= 1): its chunks
    # lengthen the steps of every stream there. Of 1.5, 2.5 and 4, 2.5 gave the mixed workload the best SLO
    # attainment at 4 / 8 / 10 req/s (2 cores, session 13; 1.5 let long streams miss their TPOT):
    # benchmarks/results/2026-12-02-srpt/RESULTS.md
    local_cost_factor: float = 2.5
    headroom_blocks: int = 8  # free blocks the decode node must keep beyond a longer prompt to take it

    def __post_init__(self) -> None:
        for name in ("max_tokens", "headroom_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"local prefill {name} must be >= 0, got {getattr(self, name)}")
        if not self.local_cost_factor >= 1.0:
            raise ValueError(f"local prefill local_cost_factor must be >= 1, got {self.local_cost_factor}")


def local_wins(policy: LocalPrefillPolicy, num_prompt_tokens: int, local_backlog: int,
               remote: Iterable[tuple[int, int]], local_cached: int = 0) -> bool:
    """Whether the decode node prefills a prompt itself, comparing the backlogs (the rules above).

    ``local_backlog``: the decode node's prefill backlog in tokens; ``remote``: (backlog, cached prompt
    tokens) of each reachable prefill node; ``local_cached``: the prompt's leading tokens the decode node holds.
    """
    n, f = num_prompt_tokens, policy.local_cost_factor
    local_new = n - local_cached
    if local_new <= policy.max_tokens:
        return True  # the decode node's shortest-first prefill order puts it ahead of every longer prompt
    remote_cost = min(backlog + n - cached for backlog, cached in remote)
    return f * (local_backlog + local_new) < remote_cost


def prefill_locally(policy: LocalPrefillPolicy, num_prompt_tokens: int, decode: NodeState,
                    prefill_nodes: Sequence[NodeState], block_size: int,
                    prefill_cached_tokens: Mapping[str, int] | None = None, queued_remote_tokens: int = 0,
                    queued_local_tokens: int = 0, decode_cached_tokens: int = 0) -> bool:
    """Whether ``decode`` should prefill a prompt of ``num_prompt_tokens`` tokens itself.

    ``prefill_cached_tokens``: per prefill node's target, the prompt's leading tokens it probably has cached;
    ``queued_remote_tokens``: prompts already bound for the prefill nodes but not sent to one yet (waiting for
    their decode reservation), spread evenly over the reachable ones; ``queued_local_tokens``: prompts already
    bound for this decode node's own prefill whose call it has not answered yet (its backlog counts them only
    from the answer on: without them, a burst's concurrent decisions all see the backlog before the burst);
    ``decode_cached_tokens``: the prompt's leading tokens ``decode`` probably holds (a conversation's history).
    """
    if policy.max_tokens == 0:
        return False
    reachable = [n for n in prefill_nodes if n.routable]  # a draining node takes no new prompt
    if not reachable:
        return True
    local_cached = min(decode_cached_tokens, num_prompt_tokens - 1)  # the last token is always computed
    if num_prompt_tokens - local_cached > policy.max_tokens:
        load = decode.load
        if load is None:
            return False
        if load.free_blocks < -(-(num_prompt_tokens - local_cached) // block_size) + policy.headroom_blocks:
            return False
    cached = prefill_cached_tokens or {}
    queued = queued_remote_tokens // len(reachable)
    return local_wins(policy, num_prompt_tokens, decode.prefill_tokens + queued_local_tokens,
                      ((n.prefill_tokens + queued, min(cached.get(n.target, 0), num_prompt_tokens - 1))
                       for n in reachable), local_cached)
