"""The speculation policy the scheduler calls (common/spec_decode/policy.py), with exact expectations: adaptive
k's slots per step from the acceptance estimate, pausing and probing again, the measured price of a draft."""

from __future__ import annotations

import pytest

from common.config.engine_config import DraftEconomics, SchedulerConfig, SpeculativeConfig, SpeculativeMethod
from common.engine.request import Request
from common.engine.scheduler import Scheduler
from common.engine.scheduler_output import SchedulerOutput, StepResult
from common.kv.kv_cache_manager import KVCacheManager
from common.sampling.params import SamplingParams
from common.spec_decode.policy import SpeculationPolicy, adaptive_num_drafts

GREEDY = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


def make(method: SpeculativeMethod, k: int = 16) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_prefill_chunk=None, watermark=0.0)
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k)
    return Scheduler(config, KVCacheManager(64, 4), max_model_len=256, speculative=spec)


def verify_step(s: Scheduler, accepted: int) -> int:
    """Schedule one step; the runner proposes a draft per slot and ``accepted`` of them pass. Returns the slots."""
    out: SchedulerOutput = s.schedule()
    (chunk,) = out.chunks
    drafts = chunk.num_draft_slots
    tokens = [7] * (min(accepted, drafts) + 1)
    s.update(out, StepResult([tokens], [None], [drafts], [min(accepted, drafts)]))
    s.kv.check_integrity()
    return drafts


def decoding(s: Scheduler) -> Request:
    request = Request("a", list(range(10)), GREEDY)
    s.add_request(request)
    out = s.schedule()  # the prompt: no draft slots while prefilling
    assert [c.num_draft_slots for c in out.chunks] == [0]
    s.update(out, StepResult([[7]], [None], [0], [0]))
    return request


NGRAM = DraftEconomics(cost=0.03, continuation=0.9)
DRAFT = DraftEconomics(cost=0.3, continuation=None)


@pytest.mark.parametrize(("a", "economics", "max_drafts", "expected"), [
    (0.6, DRAFT, 16, 2),  # independent drafts: 0.6**2 = 0.36 > 0.3 > 0.6**3
    (0.9, DRAFT, 16, 11),  # 0.9**11 = 0.31
    (0.31, DRAFT, 16, 1),
    (0.6, NGRAM, 64, 29),  # runs: 0.6 * 0.9**28 = 0.031 > 0.03 > 0.6 * 0.9**29
    (0.6, NGRAM, 16, 16),  # never more than asked for
    (0.1, NGRAM, 64, 12),
    (0.05, NGRAM, 64, 5),
    (1.0, DRAFT, 16, 16),  # nothing rejected yet
])
def test_adaptive_num_drafts_pays_while_acceptance_beats_cost(a: float, economics: DraftEconomics,
                                                              max_drafts: int, expected: int) -> None:
    request = Request("a", [1], GREEDY, spec_acceptance=a)
    assert adaptive_num_drafts(request, max_drafts, economics) == expected
    assert request.spec_acceptance == a


def test_adaptive_num_drafts_pauses_below_cost_and_recovers() -> None:
    request = Request("a", [1], GREEDY, spec_acceptance=0.02)
    assert adaptive_num_drafts(request, 16, NGRAM) == 0
    assert request.spec_acceptance == pytest.approx(0.02 + 0.1 * (0.6 - 0.02))
    assert adaptive_num_drafts(request, 16, NGRAM) == 10  # 0.078 > 0.03: probe again


def test_ngram_slots_follow_first_draft_acceptance() -> None:
    s = make(SpeculativeMethod.NGRAM, k=16)
    request = decoding(s)
    assert verify_step(s, accepted=2) == 16  # prior a 0.6, h 0.9: runs make all 16 worth it
    assert request.spec_acceptance == pytest.approx(0.7 * 0.6 + 0.3)  # the first draft was accepted
    # 2 of 16 accepted: the run continued once and broke once, so h moves 0.3 of the way to 1/2
    assert request.spec_continuation == pytest.approx(0.9 + 0.3 * (0.5 - 0.9))
    for _ in range(4):
        verify_step(s, accepted=0)  # a first draft rejected says nothing of h
    assert request.spec_continuation == pytest.approx(0.78)
    # 0.72 * 0.7**4 = 0.173: 0.173 * 0.78**7 = 0.030 > 0.03 (the 8th draft's 0.023 is not)
    assert request.spec_acceptance == pytest.approx(0.72 * 0.7**4)
    assert verify_step(s, accepted=0) == 8
    # every rejection cuts the estimate by 0.7: fewer drafts, then a pause below the cost
    assert [verify_step(s, accepted=0) for _ in range(5)] == [6, 5, 3, 2, 0]
    assert s.num_accepted_tokens == 2


def test_the_continuation_follows_the_runs_a_request_accepts() -> None:
    s = make(SpeculativeMethod.NGRAM, k=4)
    request = decoding(s)
    assert request.spec_continuation is None  # the prior (0.9) until a run is observed
    verify_step(s, accepted=4)  # all 4 kept: 3 continuations, none broken
    assert request.spec_continuation == pytest.approx(0.9 + 0.3 * (1.0 - 0.9))
    verify_step(s, accepted=1)  # the first kept, the second rejected: a run broken at once
    assert request.spec_continuation == pytest.approx(0.93 + 0.3 * (0.0 - 0.93))


def test_a_measured_draft_cost_replaces_the_default_economics() -> None:
    s = make(SpeculativeMethod.NGRAM, k=16)
    decoding(s)
    out = s.schedule()
    (chunk,) = out.chunks
    assert chunk.num_draft_slots == 16  # the default cost 0.03
    s.update(out, StepResult([[7]], [None], [chunk.num_draft_slots], [0], draft_cost=0.2))
    assert s.speculation is not None and s.speculation.draft_cost == 0.2
    # a = 0.42, h = 0.9, c = 0.2: 0.42 * 0.9**7 = 0.201 > 0.2, the 9th draft's 0.18 is not
    assert s.schedule().chunks[0].num_draft_slots == 8
    # A config that names its own economics keeps them.
    pinned = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_prefill_chunk=None,
                                       watermark=0.0), KVCacheManager(64, 4), max_model_len=256,
                       speculative=SpeculativeConfig(method=SpeculativeMethod.NGRAM, num_speculative_tokens=16,
                                                     economics=NGRAM))
    decoding(pinned)
    out = pinned.schedule()
    pinned.update(out, StepResult([[7]], [None], [out.chunks[0].num_draft_slots], [0], draft_cost=0.2))
    assert pinned.speculation is not None and pinned.speculation.draft_cost is None


def test_draft_layers_pause_when_drafts_do_not_pay_and_probe_again() -> None:
    s = make(SpeculativeMethod.DRAFT_LAYERS, k=4)
    request = decoding(s)
    slots = [verify_step(s, accepted=0) for _ in range(12)]
    # 0.6 -> 0.42 -> 0.294: at or below the draft cost 0.3 speculation pauses, then a probe every few steps
    assert slots[:3] == [2, 1, 0]
    assert 0 in slots and slots.count(1) >= 2  # paused, then probed again
    assert s.num_draft_tokens == sum(slots) and s.num_accepted_tokens == 0
    assert request.spec_acceptance < 0.3


def test_the_policy_speculates_for_a_small_decode_batch_and_never_past_the_end() -> None:
    """The policy alone, without a scheduler: when a step speculates, and the slots' limits (k, the step's
    budget, the request's last token, a request that still prefills or uses penalties)."""
    spec = SpeculativeConfig(method=SpeculativeMethod.NGRAM, num_speculative_tokens=8, max_batch_size=2,
                             adaptive=False)
    policy = SpeculationPolicy(spec, max_model_len=256)

    def decoding(outputs: int, params: SamplingParams = GREEDY) -> Request:
        request = Request("r", [1, 2, 3], params, output_token_ids=[5] * outputs)
        request.num_computed_tokens = request.num_tokens - 1
        return request

    a, b, c = decoding(1), decoding(1), decoding(1)
    prefilling = Request("p", [1, 2, 3], GREEDY)
    assert policy.speculates([a, b, prefilling]) and not policy.speculates([a, b, c])
    assert not policy.speculates([prefilling])
    assert policy.num_drafts(a, budget=100) == 8
    assert policy.num_drafts(a, budget=3) == 3
    assert policy.num_drafts(decoding(196), budget=100) == 3  # 4 tokens left: the last is the target's own
    near_max_len = Request("x", list(range(253)), GREEDY, num_computed_tokens=252)
    assert policy.num_drafts(near_max_len, budget=100) == 2  # 3 positions left in max_model_len
    assert policy.num_drafts(prefilling, budget=100) == 0
    penalised = SamplingParams(temperature=0.0, max_tokens=200, repetition_penalty=1.2)
    assert policy.num_drafts(decoding(1, penalised), budget=100) == 0
    policy.record(a, drafts=8, accepted=3)
    policy.record(b, drafts=0, accepted=0)  # no drafts verified: nothing learnt, nothing counted
    assert (policy.num_spec_steps, policy.num_draft_tokens, policy.num_accepted_tokens) == (1, 8, 3)
    assert (a.num_draft_tokens, a.num_accepted_tokens, b.spec_acceptance) == (8, 3, 0.6)
