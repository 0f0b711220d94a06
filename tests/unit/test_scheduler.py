"""The scheduler with exact expectations: who is scheduled, with how many tokens, who is preempted."""

from __future__ import annotations

from collections.abc import Callable

from common.config.engine_config import SchedulerConfig
from common.engine.commands import KVDestination
from common.engine.kv_connector import KVConnector
from common.engine.request import FinishReason, Request, RequestStatus
from common.engine.scheduler import Scheduler
from common.engine.scheduler_output import SchedulerOutput, StepResult
from common.kv.kv_cache_manager import NULL_BLOCK, KVCacheManager
from common.sampling.params import SamplingParams
from common.sampling.sampler import SampleResult
from decode_service.kv_consumer import KVConsumer
from prefill_service.kv_producer import KVProducer

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def make(num_blocks: int = 16, block_size: int = 4, connector: KVConnector | None = None, prefix_caching: bool = True,
         **cfg: object) -> Scheduler:
    config = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 16, "max_prefill_chunk": None,
                                "watermark": 0.0, **cfg})  # type: ignore[arg-type]
    return Scheduler(config, KVCacheManager(num_blocks, block_size, prefix_caching), max_model_len=64,
                     connector=connector)


def req(rid: str, n: int, params: SamplingParams = GREEDY, first: int = 0, remote: bool = False) -> Request:
    return Request(rid, list(range(first, first + n)), params, eos_token_ids=(99,), remote_prefill=remote)


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks]


def fake_sample(out: SchedulerOutput, token: int = 7) -> StepResult:
    n = sum(c.samples for c in out.chunks)
    return StepResult.from_samples(SampleResult([token] * n, [None] * n, [None] * n))


def step(s: Scheduler, token: int = 7) -> list[tuple[str, int, int]]:
    out = s.schedule()
    s.update(out, fake_sample(out, token))
    s.kv.check_integrity()
    return plan(out)


def test_chunked_prefill_then_decode_with_token_budget() -> None:
    s = make()
    s.add_request(req("a", 10))
    s.add_request(req("b", 10, first=50))
    assert step(s) == [("a", 0, 10), ("b", 0, 6)]  # budget 16: b gets a chunk of 6
    assert step(s) == [("a", 10, 1), ("b", 6, 4)]  # a decodes, b finishes its prompt
    assert step(s) == [("a", 11, 1), ("b", 10, 1)]


def test_max_prefill_chunk_caps_a_long_prompt() -> None:
    s = make(max_prefill_chunk=4, num_blocks=32)
    s.add_request(req("a", 10))
    assert [step(s), step(s), step(s), step(s)] == [
        [("a", 0, 4)], [("a", 4, 4)], [("a", 8, 2)], [("a", 10, 1)]]


def test_a_prefill_backlog_or_an_idle_decode_gets_the_backlog_budget_and_a_light_load_the_small_one() -> None:
    # Small steps of 8 tokens (chunks of 4); while more than 8 prompt tokens wait, 12 tokens (chunks of 6).
    s = make(max_num_batched_tokens=8, max_prefill_chunk=4, backlog_budget=(12, 6), num_blocks=48)
    s.add_request(req("a", 3))
    assert step(s) == [("a", 0, 3)]  # nothing decodes: the backlog's 12 tokens, no chunk limit
    s.add_request(req("b", 10, first=20))
    s.add_request(req("c", 9, first=50))  # backlog 17 beside a's decode (a token of each prompt is never counted)
    assert step(s) == [("a", 3, 1), ("c", 0, 6), ("b", 0, 5)]  # shortest first, 12 tokens in chunks of 6
    assert step(s) == [("a", 4, 1), ("c", 6, 3), ("b", 5, 4)]  # backlog 2 + 4 = 6: the small budget, chunks of 4
    assert step(s) == [("a", 5, 1), ("c", 9, 1), ("b", 9, 1)]  # all decode
    s = make(max_num_batched_tokens=8, max_prefill_chunk=4, backlog_budget=(12, 6), num_blocks=32)
    s.add_request(req("d", 12))  # backlog 11, but nothing decodes: no TPOT to protect, the larger step, whole
    assert step(s) == [("d", 0, 12)]
    s.add_request(req("e", 12, first=50))  # backlog 11 beside d's decode: more than the small step, the larger one
    assert step(s) == [("d", 12, 1), ("e", 0, 6)]
    assert step(s) == [("d", 13, 1), ("e", 6, 4)]  # backlog 5 (its last token is never counted): the small budget
    s = make(max_num_batched_tokens=8, max_prefill_chunk=4, backlog_budget=(12, 6), num_blocks=32)
    s.add_request(req("f", 20))  # nothing decodes: the backlog's 12 tokens in one chunk, then the rest
    assert step(s) == [("f", 0, 12)]
    assert step(s) == [("f", 12, 8)]


def test_a_prompt_that_fits_the_step_goes_whole_whatever_the_chunk_limit() -> None:
    s = make(max_num_batched_tokens=8, max_prefill_chunk=3, whole_prefill=6, num_blocks=32)
    s.add_request(req("a", 6))
    assert step(s) == [("a", 0, 6)]  # fits: one chunk of 6, not 3 + 3
    s.add_request(req("b", 7, first=50))  # longer than whole_prefill: the chunk limit
    s.add_request(req("c", 6, first=20))
    assert step(s) == [("a", 6, 1), ("c", 0, 6), ("b", 0, 1)]  # c whole (7 left of the step); b the last token
    assert step(s) == [("a", 7, 1), ("c", 6, 1), ("b", 1, 3)]  # b is longer than 6: chunks to its end
    s = make(max_num_batched_tokens=8, max_prefill_chunk=3, whole_prefill=6, num_blocks=32)
    s.add_request(req("d", 3, first=30))
    s.add_request(req("e", 8, first=40))
    assert step(s) == [("d", 0, 3), ("e", 0, 3)]  # e: more than whole_prefill, the chunk limit
    assert step(s) == [("d", 3, 1), ("e", 3, 3)]  # a long prompt's tail keeps the limit too
    s = make(max_num_batched_tokens=4, max_prefill_chunk=3, whole_prefill=6, num_blocks=32)
    s.add_request(req("f", 5))
    assert step(s) == [("f", 0, 3)]  # more than the step's budget: the chunk limit again
    s = make(max_num_batched_tokens=8, max_prefill_chunk=3, whole_prefill=6, num_blocks=32)
    s.add_request(req("g", 2, first=60))
    s.add_request(req("h", 6, first=70))
    assert step(s) == [("g", 0, 2), ("h", 0, 6)]  # shortest first; h whole in the 6 tokens left


def test_fcfs_max_num_seqs_and_finishing_frees_blocks() -> None:
    s = make(max_num_seqs=2)
    for rid in "abc":
        s.add_request(req(rid, 3, first=10 * ord(rid)))
    assert step(s) == [("a", 0, 3), ("b", 0, 3)]  # c waits: max_num_seqs
    for _ in range(3):
        step(s)
    # max_tokens=4: a and b are done after 4 sampled tokens; their blocks are back
    assert [r.request_id for r in s.running] == [] and s.kv.num_used_blocks == 0
    assert step(s) == [("c", 0, 3)]


def test_prefix_reuse_on_admission() -> None:
    s = make()
    s.add_request(req("a", 9))
    step(s)  # a's prompt computed; blocks [0..3],[4..7] full -> committed
    s.add_request(req("b", 9))
    assert step(s)[-1] == ("b", 8, 1)  # 8 of 9 tokens cached, one left to compute
    assert s.kv.prefix_cache_hits == 8


def test_a_prompt_whose_prefix_another_computes_in_the_step_waits_a_step_and_takes_it_from_the_cache() -> None:
    """In-batch prefix caching: b shares 3 blocks with a, which computes them in this step, so b waits a step and
    hits them; c shares 1 block only (below SHARED_PREFILL_BLOCKS) and goes beside a; d shares nothing."""
    shared = list(range(100, 112))  # 3 blocks of 4

    def four() -> list[Request]:
        return [Request("a", [*shared, 1, 2, 3, 4], GREEDY, eos_token_ids=(99,)),
                Request("b", [*shared, 5, 6, 7, 8], GREEDY, eos_token_ids=(99,)),
                Request("c", [*shared[:4], *range(200, 212)], GREEDY, eos_token_ids=(99,)),
                req("d", 16, first=300)]

    s = make(max_num_batched_tokens=64, num_blocks=32)
    for r in four():
        s.add_request(r)
    assert step(s) == [("a", 0, 16), ("c", 0, 16), ("d", 0, 16)]  # b waits: 48 of the 64 tokens
    assert step(s) == [("a", 16, 1), ("c", 16, 1), ("d", 16, 1), ("b", 12, 4)]  # its 12 shared tokens cached
    assert s.kv.prefix_cache_hits == 12
    s = make(max_num_batched_tokens=64, num_blocks=32, defer_shared_prefill=False)
    for r in four():
        s.add_request(r)
    assert step(s) == [("a", 0, 16), ("b", 0, 16), ("c", 0, 16), ("d", 0, 16)]  # off: b computes them again
    s = make(max_num_batched_tokens=64, num_blocks=32, max_prefill_chunk=8)
    for r in four()[:2]:
        s.add_request(r)
    assert step(s) == [("a", 0, 8)]  # a's first chunk computes 2 of the blocks b shares: b waits
    # a's second chunk computes the third shared block only (1 < 2): b goes beside it with the first two cached
    assert step(s) == [("a", 8, 8), ("b", 8, 8)]
    s = make(max_num_batched_tokens=64, num_blocks=32, prefix_caching=False)
    for r in four()[:2]:
        s.add_request(r)
    assert step(s) == [("a", 0, 16), ("b", 0, 16)]  # nothing to take from a cache that keeps nothing


def test_a_prompt_whose_kv_comes_from_another_node_never_waits_for_a_shared_prefix() -> None:
    """Conditional disaggregation: a local prompt computes the prefix a remote-prefill request shares; the remote
    one computes none of it, so it is admitted (and waits for its KV) in the same step."""
    s = make(connector=KVConsumer(), max_num_batched_tokens=64, num_blocks=32)
    s.add_request(req("a", 16))
    s.add_request(req("b", 16, remote=True))
    assert step(s) == [("a", 0, 16)] and "b" in s.waiting_for_kv


def test_preemption_recomputes_newest_and_keeps_fcfs() -> None:
    # 4 blocks of 4 tokens: a (5 tokens) and b (5 tokens) use 2 blocks each; decoding needs more.
    s = make(num_blocks=4, max_num_batched_tokens=32)
    long = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    s.add_request(req("a", 7, long))
    s.add_request(req("b", 7, long, first=20))
    assert step(s) == [("a", 0, 7), ("b", 0, 7)]  # 2 blocks each; 8th token slots are free
    assert step(s) == [("a", 7, 1), ("b", 7, 1)]
    # a needs a 3rd block: none free -> b (newest) is preempted, a goes on alone
    out = s.schedule()
    assert plan(out) == [("a", 8, 1)] and out.preempted == ["b"]
    s.update(out, fake_sample(out))
    b = s.waiting[0]
    assert b.status is RequestStatus.WAITING and b.num_preemptions == 1 and b.num_computed_tokens == 0
    assert s.num_preemptions == 1
    for _ in range(5):
        step(s)
    assert s.running == [] and s.kv.num_used_blocks == 0
    # b is re-admitted with its prompt and its 2 outputs, recomputed from scratch: a's growth evicted
    # b's cached blocks (LRU), and a's own cached blocks share no prefix with b
    assert step(s) == [("b", 0, 9)]
    assert b.output_token_ids == [7, 7, 7]  # recompute sampled the next token after the two it had


def test_preempted_request_reuses_its_cached_blocks_when_not_evicted() -> None:
    s = make(num_blocks=5, max_num_batched_tokens=32)
    long = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    s.add_request(req("a", 8, long))
    s.add_request(req("b", 8, long, first=20))
    step(s)  # 2 blocks each, full and committed; 1 block free
    out = s.schedule()  # both need a 3rd block: a takes the free one, b is preempted
    assert plan(out) == [("a", 8, 1)] and out.preempted == ["b"]
    s.update(out, fake_sample(out))
    # b's two full blocks are free but still cached. Next step a finishes; b does not fit beside it yet.
    assert step(s) == [("a", 9, 1)]
    assert s.kv.num_used_blocks == 0
    # Re-admitted, b finds its 8 prompt tokens in the cache and computes only its sampled token.
    assert step(s) == [("b", 8, 1)]


def test_stop_token_and_eos_finish_and_min_tokens() -> None:
    s = make()
    s.add_request(req("a", 3, SamplingParams(temperature=0.0, max_tokens=10)))
    out = s.schedule()
    (result,) = s.update(out, fake_sample(out, token=99))  # EOS
    assert result.finished and result.finish_reason is FinishReason.STOP
    s.add_request(req("b", 3, SamplingParams(temperature=0.0, max_tokens=10, min_tokens=2)))
    out = s.schedule()
    (result,) = s.update(out, fake_sample(out, token=99))
    assert not result.finished  # min_tokens holds EOS back
    assert s.kv.num_used_blocks == 1


def test_max_tokens_finishes_with_length() -> None:
    s = make()
    s.add_request(req("a", 3, SamplingParams(temperature=0.0, max_tokens=2)))
    step(s)
    out = s.schedule()
    (result,) = s.update(out, fake_sample(out))
    assert result.finished and result.finish_reason is FinishReason.LENGTH


def test_abort_frees_blocks_everywhere() -> None:
    s = make(max_num_seqs=1)
    s.add_request(req("a", 5))
    s.add_request(req("b", 5))
    step(s)
    assert s.abort("b") is not None and s.abort("a") is not None and s.abort("zz") is None
    assert s.kv.num_used_blocks == 0 and not s.has_work()


def test_prefill_role_holds_blocks_until_free_held() -> None:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, watermark=0.0)
    s = Scheduler(config, KVCacheManager(8, 4), max_model_len=64, connector=KVProducer(block_size=4))
    s.add_request(req("a", 6, SamplingParams(temperature=0.0, max_tokens=50)))
    out = s.schedule()
    (result,) = s.update(out, fake_sample(out))
    assert result.finished and result.finish_reason is None  # done here, decoding continues elsewhere
    assert "a" in s.held and s.kv.num_used_blocks == 2
    s.free_held("a")
    assert s.kv.num_used_blocks == 0


def test_decode_role_admit_now_then_kv_arrived() -> None:
    s = make(connector=KVConsumer())
    r = req("a", 6, remote=True)
    allocation = s.admit_now(r)
    assert allocation is not None and allocation.block_ids == [0, 1]
    assert r.status is RequestStatus.WAITING_FOR_KV and s.num_waiting == 1
    assert s.schedule().is_empty  # waiting for KV: nothing to compute
    first = s.kv_arrived("a", 42)
    assert first.new_token_ids == [42] and not first.finished
    assert step(s) == [("a", 6, 1)]
    assert r.output_token_ids == [42, 7]
    s.abort("a")
    assert s.kv.num_used_blocks == 0


def test_decode_role_recomputes_a_preempted_request_locally() -> None:
    """Once its first token is in, a request's KV no longer comes from elsewhere: the queue recomputes it."""
    s = make(connector=KVConsumer())
    r = req("a", 6, remote=True)
    assert s.admit_now(r) is not None
    s.kv_arrived("a", 42)
    s.running.remove(r)
    s._preempt(r)
    out = s.schedule()
    assert plan(out) == [("a", 4, 3)]  # its first full block is still in the prefix cache
    assert r.status is RequestStatus.RUNNING


def test_decode_role_admit_now_refuses_without_room() -> None:
    s = make(connector=KVConsumer(), num_blocks=2)
    assert s.admit_now(req("a", 6, remote=True)) is not None
    assert s.admit_now(req("b", 6, remote=True)) is None and "b" not in s.waiting_for_kv


def test_decode_role_admit_now_goes_ahead_of_the_queue_only_when_its_blocks_stay_free() -> None:
    """A reservation need not wait for the next step behind queued local prefills (its prefill node would idle
    meanwhile), but it may not take blocks a queued request needs: FCFS keeps its guarantee."""
    s = make(connector=KVConsumer(), num_blocks=5)
    s.add_request(req("local", 6, first=80))  # queued for the next step: 2 blocks
    assert s.blocks_waiting() == 2
    assert s.admit_now(req("a", 6, remote=True)) is not None  # 2 + the queued 2 of 5 free: ahead of the queue
    assert s.admit_now(req("b", 6, first=50, remote=True)) is None  # 2 + 2 > 3 free: the queued one's blocks
    assert "b" not in s.waiting_for_kv and s.kv.num_used_blocks == 2


def test_decode_role_queued_reservation_is_announced_when_blocks_free() -> None:
    """Load beyond free KV queues: the reservation waits FCFS and update() announces its blocks later."""
    s = make(connector=KVConsumer(), num_blocks=3)
    assert s.admit_now(req("a", 6, remote=True)) is not None  # 2 of 3 blocks
    assert [o.request_id for o in s.take_announced()] == ["a"]
    b = req("b", 6, first=50, remote=True)
    s.add_request(b)  # needs 2 blocks, 1 free: it queues
    out = s.schedule()
    assert out.is_empty and s.update(out, None) == [] and b.status is RequestStatus.WAITING
    assert not s.has_work()  # nothing can change until a caller frees blocks: the engine waits, not spins
    s.abort("a")
    assert s.has_work()
    out = s.schedule()
    assert out.is_empty and b.status is RequestStatus.WAITING_FOR_KV
    (announced,) = s.update(out, None)
    assert announced.request_id == "b" and announced.new_token_ids == [] and not announced.finished
    assert announced.reserved_block_ids == tuple(s.kv.block_table("b")) and len(announced.reserved_block_ids) == 2
    assert s.update(s.schedule(), None) == []  # announced once
    first = s.kv_arrived("b", 42)
    assert first.new_token_ids == [42] and step(s) == [("b", 6, 1)]


def test_prefill_role_does_not_spin_while_blocks_are_held() -> None:
    """A prefill node whose blocks all wait for their transfer has nothing to do until one is released."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, watermark=0.0)
    s = Scheduler(config, KVCacheManager(2, 4), max_model_len=64, connector=KVProducer(block_size=4))
    s.add_request(req("a", 6))
    s.update(out := s.schedule(), fake_sample(out))
    s.add_request(req("b", 6, first=50))
    assert s.schedule().is_empty and not s.has_work()
    s.free_held("a")
    assert s.has_work() and plan(s.schedule()) == [("b", 0, 6)]


def test_decode_role_computes_a_local_request_itself() -> None:
    """Conditional disaggregation: a request without remote_prefill is prefilled on the decode node."""
    s = make(connector=KVConsumer())
    s.add_request(req("a", 6))
    assert step(s) == [("a", 0, 6)] and not s.waiting_for_kv


def test_a_reservation_is_announced_once_whether_admitted_now_or_later() -> None:
    s = make(connector=KVConsumer(), num_blocks=16)
    assert s.admit_now(req("a", 40, remote=True)) is not None  # 10 blocks of 16
    (now,) = s.take_announced()
    assert now.request_id == "a" and now.reserved_block_ids is not None and len(now.reserved_block_ids) == 10
    b = req("b", 30, first=100, remote=True)  # 8 blocks: 6 are free
    assert s.admit_now(b) is None
    s.add_request(b)
    assert s.take_announced() == [] and s.schedule().is_empty
    s.abort("a")
    later = s.schedule()
    assert [o.request_id for o in s.update(later, None)] == ["b"] and s.take_announced() == []


def test_shortest_prefill_first_a_short_prompt_is_not_stuck_behind_long_ones() -> None:
    s = make(num_blocks=64, max_num_batched_tokens=8, max_prefill_chunk=4)
    s.add_request(req("long1", 20))
    s.add_request(req("long2", 20, first=100))
    assert step(s) == [("long1", 0, 4), ("long2", 0, 4)]  # equal lengths: arrival order
    s.add_request(req("short", 3, first=200))
    # the short prompt's whole prefill goes first (and samples its first token), the long ones share the rest
    assert step(s) == [("short", 0, 3), ("long1", 4, 4), ("long2", 4, 1)]
    assert s.running[-1].output_token_ids == [7]


def test_fcfs_prefill_order_keeps_arrival_order() -> None:
    s = make(num_blocks=64, max_num_batched_tokens=8, max_prefill_chunk=4, prefill_order="fcfs")
    s.add_request(req("long1", 20))
    s.add_request(req("long2", 20, first=100))
    step(s)
    s.add_request(req("short", 3, first=200))
    assert step(s) == [("long1", 4, 4), ("long2", 4, 4)]  # the short prompt waits behind both


def test_decodes_go_before_prefill_chunks_in_either_order() -> None:
    for order in ("shortest", "fcfs"):
        s = make(num_blocks=64, max_num_batched_tokens=8, max_prefill_chunk=8, prefill_order=order)
        s.add_request(req("a", 2))
        assert step(s) == [("a", 0, 2)]
        s.add_request(req("long", 20, first=100))
        assert step(s) == [("a", 2, 1), ("long", 0, 7)]


def test_a_long_prompt_passed_over_is_delayed_a_bounded_number_of_steps() -> None:
    s = make(num_blocks=256, max_num_batched_tokens=4, max_prefill_chunk=4, max_prefill_skips=3,
             max_num_seqs=64)
    s.add_request(req("long", 24))
    assert step(s) == [("long", 0, 4)]
    got_chunk = []
    for i in range(8):  # a new 4-token prompt every step would take the whole budget forever
        s.add_request(req(f"s{i}", 4, first=100 + 10 * i, params=SamplingParams(temperature=0.0, max_tokens=1)))
        got_chunk.append(any(rid == "long" for rid, _, _ in step(s)))
    # passed over 3 steps in a row by later arrivals, it goes first in the 4th; then the count starts again
    assert got_chunk == [False, False, False, True, False, False, False, True]


def test_blocks_are_granted_in_prefill_order() -> None:
    # 6 blocks of 4 tokens, "a" holds 3 and grows into a 4th: "big" and "bigger" (3 blocks each) wait, the
    # later "small" (1 block) fits and is first in shortest order
    s = make(num_blocks=6, max_num_batched_tokens=32)
    s.add_request(req("a", 12))
    assert step(s) == [("a", 0, 12)]
    s.add_request(req("big", 10, first=100))   # 3 blocks: does not fit (a holds 3 + grows into a 4th)
    s.add_request(req("bigger", 11, first=200))
    s.add_request(req("small", 2, first=300))  # 1 block: fits, and goes first in shortest order
    out = step(s)
    assert ("small", 0, 2) in out and all(rid not in ("big", "bigger") for rid, _, _ in out)


def test_a_smaller_prompt_does_not_take_the_blocks_a_higher_priority_one_waits_for() -> None:
    # preempted requests go first; while the first of the order does not fit, nobody after it is admitted
    s = make(num_blocks=4, max_num_batched_tokens=32)
    s.add_request(req("a", 8))
    step(s)
    s.waiting.appendleft(req("urgent", 12, first=100))
    s.waiting[0].num_preemptions = 1  # as if preempted: first in the order, needs 3 blocks, 2 free
    s.add_request(req("small", 2, first=200))  # 1 block would fit, but it must not overtake
    assert step(s) == [("a", 8, 1)]


def test_sliding_window_frees_blocks_before_the_window_mid_request() -> None:
    s = make(max_prefill_chunk=4)
    s.kv.window = 5  # every layer windowed: a query at q reads q - 4 .. q
    s.add_request(req("a", 10, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)))
    tables = []
    for _ in range(8):
        step(s)
        if s.kv.has_request("a"):
            tables.append(s.kv.block_table("a"))
    N = NULL_BLOCK
    assert tables == [
        [0],  # computed 4: admitted with its first chunk's block only; the next query (4) reads 0..4
        [N, 1],  # computed 8: the second chunk's block added, then block 0 (0..3) freed (the next query reads 4..8)
        [N, 1, 2],  # computed 10 (the prompt's last 2 tokens)
        [N, 1, 2],  # computed 11
        [N, N, 2],  # computed 12: block 1 (4..7) freed
        [N, N, 2, 3],  # computed 13, a new block from the head of the free queue
        [N, N, 2, 3],  # computed 14
    ]
    assert not s.has_work() and s.kv.num_free_blocks == 16
    assert s.kv.pool.peak_used_blocks == 2  # the window and one chunk, never the whole prompt (3)
    assert s.kv.get_computed_blocks(list(range(10)) + [7])[1] == 8  # the freed blocks stayed cached


# ---- sliding windows on disaggregated nodes: a decode node reserves and keeps only the window's blocks ----------


def test_decode_role_reserves_the_window_only_and_frees_blocks_as_it_decodes() -> None:
    s = make(connector=KVConsumer())
    s.kv.window = 5  # every layer windowed: a query at q reads q - 4 .. q
    r = req("a", 14, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), remote=True)
    allocation = s.admit_now(r)
    N = NULL_BLOCK
    # the first query computed here is at 14 (the prefill's first token): it reads 10..14, blocks 0 and 1 are dead
    assert allocation is not None and allocation.block_ids == [N, N, 0, 1]
    (announced,) = s.take_announced()
    assert announced.reserved_block_ids == (N, N, 0, 1) and s.kv.num_used_blocks == 2
    s.kv_arrived("a", 42)
    # the landed KV is cached for the window's block only: the dead ones hold no KV here
    assert s.kv.get_computed_blocks(list(range(14)) + [42])[1] == 0
    tables = []
    while s.has_work():
        step(s)
        if s.kv.has_request("a"):
            tables.append(s.kv.block_table("a"))
    assert tables == [
        [N, N, 0, 1],  # computed 15
        [N, N, N, 1],  # computed 16: the next query (16) reads 12..16, block 2 (8..11) freed
        [N, N, N, 1, 2],  # computed 17: a new block from the free queue's head (block 0 went to its tail)
        [N, N, N, 1, 2],  # computed 18; the next step samples the sixth token and finishes
    ]
    assert r.output_token_ids == [42, 7, 7, 7, 7, 7] and s.kv.num_free_blocks == 16
    assert s.kv.pool.peak_used_blocks == 2  # the full sequence (19 tokens) would have needed 5
    s.kv.check_integrity()


def test_decode_role_window_reservation_survives_preemption_and_abort() -> None:
    """A preempted request recomputes its whole prompt here (its dead blocks have no KV anywhere on this node);
    aborting in any state frees each held block exactly once."""
    s = make(connector=KVConsumer())
    s.kv.window = 5
    r = req("a", 14, remote=True)
    assert s.admit_now(r) is not None
    s.kv_arrived("a", 42)
    step(s)
    s.running.remove(r)
    s._preempt(r)
    s.kv.check_integrity()
    assert s.kv.num_used_blocks == 0
    assert step(s) == [("a", 0, 16)]  # nothing cached before the window: recomputed from 0 (budget 16)
    assert s.kv.block_table("a")[:3] == [NULL_BLOCK] * 3 and s.kv.num_used_blocks == 1  # then freed as usual
    s.abort("a")
    assert s.kv.num_used_blocks == 0
    b = req("b", 14, first=50, remote=True)
    assert s.admit_now(b) is not None
    s.abort("b")  # still waiting for its KV
    assert s.kv.num_used_blocks == 0 and not s.waiting_for_kv
    s.kv.check_integrity()


def test_decode_role_queued_remote_request_is_admitted_with_the_window_only() -> None:
    s = make(connector=KVConsumer(), num_blocks=3)
    s.kv.window = 5
    assert s.admit_now(req("x", 10, first=80, remote=True)) is not None  # its first query, 10, reads 6..10: 2 blocks
    s.take_announced()
    b = req("b", 14, first=50, remote=True)
    s.add_request(b)
    assert s.schedule().is_empty and b.status is RequestStatus.WAITING
    s.abort("x")
    (announced,) = s.update(s.schedule(), None)  # 2 blocks are enough now: the full prompt would need 4
    assert announced.reserved_block_ids == (NULL_BLOCK, NULL_BLOCK, 2, 1)


def _windowed_prefill(block_ids: tuple[int, ...], skip_blocks: int, first_block: int = 0,
                      ) -> tuple[Scheduler, _Target, list[list[int]]]:
    """A prefill node (window 5, blocks of 4) computing a 14-token prompt in chunks of 4 and pushing it to
    ``block_ids``: the scheduler, the push target and the request's block table after each step."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_prefill_chunk=4, watermark=0.0)
    producer = KVProducer(block_size=4)
    s = Scheduler(config, KVCacheManager(8, 4), max_model_len=64, connector=producer)
    s.kv.window = 5
    target = _Target()
    producer.attach("a", KVDestination(target, block_ids, skip_blocks=skip_blocks, first_block=first_block), None)
    s.add_request(req("a", 14, SamplingParams(temperature=0.0, max_tokens=50)))
    tables = []
    while s.has_work():
        out = s.schedule()
        producer.save_kv(out, 0)
        s.update(out, fake_sample(out))
        s.kv.check_integrity()
        tables.append(s.kv.block_table("a"))
    return s, target, tables


def test_prefill_role_frees_dead_blocks_the_transfer_never_reads_and_pushes_the_window_only() -> None:
    # the decode node holds blocks 100, 101 for the prompt's blocks 2 and 3 (first_block 2: outside its window)
    s, target, tables = _windowed_prefill((100, 101), skip_blocks=2, first_block=2)
    N = NULL_BLOCK
    # chunks of 4, 4, 4, 2: each chunk's block added as it comes, the dead ones freed behind it
    assert tables == [[0], [N, 1], [N, N, 2], [N, N, 2, 3]]
    assert s.kv.pool.peak_used_blocks == 2  # the whole prompt would hold 4
    assert target.pushed == [([2], [100]), ([3], [101])]  # never a block before the decode node's window
    assert "a" in s.held and s.kv.num_used_blocks == 2
    s.free_held("a")
    assert s.kv.num_used_blocks == 0


def test_prefill_role_keeps_every_block_a_full_destination_reads() -> None:
    """A decode node that reads the whole prompt (a draft model there): the window frees nothing it is sent."""
    s, target, _ = _windowed_prefill((100, 101, 102, 103), skip_blocks=1)  # block 0 cached there
    assert s.kv.block_table("a") == [NULL_BLOCK, 1, 2, 3]  # block 0 was never to be sent: freed
    assert target.pushed == [([1], [101]), ([2], [102]), ([3], [103])]


def _awaiting_prefill(steps: int | None) -> tuple[Scheduler, KVProducer]:
    """As ``_windowed_prefill``, but the destination is to come: ``steps`` steps run (None: to the prompt's end)."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_prefill_chunk=4, watermark=0.0)
    producer = KVProducer(block_size=4)
    s = Scheduler(config, KVCacheManager(8, 4), max_model_len=64, connector=producer)
    s.kv.window = 5
    producer.await_destination("a", None)
    s.add_request(req("a", 14, SamplingParams(temperature=0.0, max_tokens=50)))
    ran = 0
    while s.has_work() and (steps is None or ran < steps):
        out = s.schedule()
        producer.save_kv(out, 0)
        s.update(out, fake_sample(out))
        s.kv.check_integrity()
        ran += 1
    return s, producer


def test_prefill_role_awaiting_its_destination_keeps_every_block_and_pushes_them_when_it_comes() -> None:
    """The first token is sampled before the destination comes: no block was freed behind the window (any may be
    sent), none pushed; the destination then gets those it reads (from skip_blocks on) at once, in one push."""
    s, producer = _awaiting_prefill(None)
    assert "a" in s.held and s.kv.block_table("a") == [0, 1, 2, 3] and s.kv.pool.peak_used_blocks == 4
    target = _Target()
    producer.attach_destination("a", KVDestination(target, (100, 101), skip_blocks=2, first_block=2))
    assert target.pushed == [([2, 3], [100, 101])]
    s.free_held("a")
    assert s.kv.num_used_blocks == 0


def test_prefill_role_destination_arriving_mid_prompt_pushes_what_is_done_then_each_chunk() -> None:
    s, producer = _awaiting_prefill(2)  # 8 of 14 tokens computed: blocks 0 and 1 done
    request = s.running[0]
    assert s.kv.block_table("a") == [0, 1] and not producer.can_preempt(request)
    assert producer.kv_read_from(request) == 0
    target = _Target()
    producer.attach_destination("a", KVDestination(target, (100, 101, 102, 103), skip_blocks=0))
    assert target.pushed == [([0, 1], [100, 101])]
    while s.has_work():
        out = s.schedule()
        producer.save_kv(out, 0)
        s.update(out, fake_sample(out))
    assert target.pushed == [([0, 1], [100, 101]), ([2], [102]), ([3], [103])]
    assert "a" in s.held


def test_prefill_role_awaiting_request_is_preemptible_until_a_block_is_done() -> None:
    producer = KVProducer(block_size=4)
    producer.await_destination("a", None)
    assert producer.can_preempt(req("a", 14)) and producer.kv_read_from(req("a", 14)) == 0
    producer.forget("a")
    assert producer.kv_read_from(req("a", 14)) is None


def _run_to_end(s: Scheduler, limit: int = 500) -> None:
    for _ in range(limit):
        if not s.has_work():
            return
        step(s)
    raise AssertionError("did not finish")


def test_window_admits_a_prompt_many_times_the_pool_chunk_by_chunk() -> None:
    """A 200-token prompt (50 blocks) in a 6-block pool: admitted with its window and one chunk, never more held."""
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    s = make(num_blocks=6, max_prefill_chunk=8)
    s.max_model_len = 512
    s.kv.window = 9  # a chunk at p reads from p - 8: blocks_needed(9 + 8 + 2) = 5 at most
    assert s.peak_blocks(200) == 5
    r = req("a", 200, params)
    s.add_request(r)
    _run_to_end(s)
    assert r.output_token_ids == [7] * 5 and r.num_preemptions == 0
    assert s.kv.pool.peak_used_blocks <= 5 and s.kv.num_free_blocks == 6
    # the same prompt without a window: the pool could not hold it
    assert make(num_blocks=6).kv.blocks_needed(200) > 6


def test_window_chunked_admission_reserves_the_peak_and_preemption_leaks_nothing() -> None:
    """Two long windowed prompts in a pool for one peak: the second waits; preempting and aborting mid-prefill
    frees every block exactly once (the pool's free count comes back)."""
    s = make(num_blocks=6, max_prefill_chunk=8)
    s.max_model_len = 512
    s.kv.window = 9
    a, b = req("a", 100), req("b", 100, first=300)
    s.add_request(a)
    s.add_request(b)
    assert step(s) == [("a", 0, 8)]  # b's peak (5) does not fit beside a's growth (5 - 2 held)
    assert step(s) == [("a", 8, 8)] and b.status is RequestStatus.WAITING
    s.running.remove(a)  # preempt a mid-prefill, as a decode step short of blocks would
    s._preempt(a)
    s.kv.check_integrity()
    assert s.kv.num_used_blocks == 0
    step(s)
    assert s.kv.has_request("a") and not s.kv.has_request("b")
    s.abort("a")
    assert s.kv.num_used_blocks == 0
    _run_to_end(s)
    assert b.output_token_ids == [7] * 4 and s.kv.num_free_blocks == 6
    s.kv.check_integrity()


def test_window_prefill_chunk_growth_preempts_the_newest_unscheduled_request() -> None:
    """Decodes eat the blocks a windowed prefill reserved: its chunk's growth preempts the newest running request
    not scheduled in this step (here itself), never one whose chunk is already in the step."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    s = make(num_blocks=6, max_prefill_chunk=8)
    s.max_model_len = 512
    s.kv.window = 9
    d = req("d", 3, params, first=400)
    s.add_request(d)
    step(s)  # d prefilled: 1 block
    long = req("l", 100, first=500)
    s.add_request(long)
    step(s)
    assert s.kv.has_request("l")
    free0 = 6
    for _ in range(300):
        if not s.has_work():
            break
        out = s.schedule()
        ids = [c.request.request_id for c in out.chunks]
        assert not set(ids) & set(out.preempted)  # a preempted request has no chunk in the step
        s.update(out, fake_sample(out))
        s.kv.check_integrity()
    assert not s.has_work() and s.kv.num_free_blocks == free0
    assert d.output_token_ids == [7] * 40 and long.output_token_ids == [7] * 4
    assert s.num_preemptions == 1 and long.num_preemptions == 1


def test_window_prefill_node_with_a_small_pool_sends_only_live_blocks() -> None:
    """A prefill node whose pool cannot hold a 40-token prompt (10 blocks, 4 here) computes it in chunks, frees the
    blocks behind the window and pushes only the decode node's window (blocks 8, 9), never a freed block."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_prefill_chunk=4, watermark=0.0)
    producer = KVProducer(block_size=4)
    s = Scheduler(config, KVCacheManager(4, 4), max_model_len=64, connector=producer)
    s.kv.window = 5
    target = _Target()
    producer.attach("a", KVDestination(target, (100, 101), skip_blocks=8, first_block=8), None)
    assert s.peak_blocks(40, keep_from=8) <= 4
    s.add_request(req("a", 40, SamplingParams(temperature=0.0, max_tokens=50)))
    while s.has_work():
        out = s.schedule()
        producer.save_kv(out, 0)
        s.update(out, fake_sample(out))
        s.kv.check_integrity()
    assert target.pushed == [([0], [100]), ([1], [101])]  # the prompt's blocks 8 and 9, in recycled block ids
    assert s.kv.pool.peak_used_blocks == 2 and "a" in s.held
    s.free_held("a")
    assert s.kv.num_used_blocks == 0 and s.kv.num_free_blocks == 4


class _Target:
    """A KVPushTarget that records what a prefill node pushes."""

    def __init__(self) -> None:
        self.pushed: list[tuple[list[int], list[int]]] = []

    def push(self, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        self.pushed.append((list(src_block_ids), list(dst_block_ids)))

    def when_finished(self, callback: Callable[[], None]) -> None:
        pass
