"""The colocated engine: batching, preemption, chunked prefill and seeded sampling change nothing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from common.attention.metadata import AttentionMetadata
from common.config.engine_config import CacheConfig, SchedulerConfig
from common.engine.engine_core import ColocatedEngine, EngineCore
from common.model.llama import LlamaForCausalLM
from common.model.loader import load_model
from common.sampling.params import SamplingParams
from prefill_service.kv_producer import KVProducer


@pytest.fixture(scope="module")
def tiny(tiny_model_factory: Callable[..., Path]) -> LlamaForCausalLM:
    return load_model(tiny_model_factory("llama", num_attention_heads=6, num_key_value_heads=2, hidden_size=96),
                      dtype="float32")


def contiguous_greedy(model: LlamaForCausalLM, prompt: list[int], n: int) -> list[int]:
    """The oracle: no KV cache at all, the whole sequence recomputed for every token."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            meta = AttentionMetadata.build([len(ids)], [0])
            hidden = model(torch.tensor(ids), torch.arange(len(ids)), meta)
            ids.append(int(model.compute_logits(hidden[-1:]).argmax()))
    return ids[len(prompt):]


def prompts(n: int, vocab: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths]


def run_staggered(engine: ColocatedEngine, work: list[tuple[list[int], SamplingParams]],
                  arrivals: list[int]) -> dict[str, list[int]]:
    """Add request i at step arrivals[i]; step until all finish; return tokens by request id."""
    out: dict[str, list[int]] = {}
    step = 0
    while step < 10_000:
        for i, at in enumerate(arrivals):
            if at == step:
                engine.add_request(f"r{i}", work[i][0], work[i][1])
                out[f"r{i}"] = []
        if step > max(arrivals) and not engine.has_unfinished():
            break
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        step += 1
    engine.kv.check_integrity()
    assert engine.kv.num_used_blocks == 0
    return out


def test_batched_equals_alone_with_staggered_arrivals(tiny: LlamaForCausalLM) -> None:
    ps = prompts(8, tiny.config.vocab_size)
    work = [(p, SamplingParams(temperature=0.0, max_tokens=5 + 3 * i, ignore_eos=True)) for i, p in enumerate(ps)]
    engine = ColocatedEngine(tiny, CacheConfig(num_blocks=64, block_size=16),
                             SchedulerConfig(max_num_batched_tokens=48, max_prefill_chunk=32))
    got = run_staggered(engine, work, arrivals=[0, 0, 1, 3, 3, 4, 9, 15])
    for i, (p, params) in enumerate(work):
        assert got[f"r{i}"] == contiguous_greedy(tiny, p, params.max_tokens), i
    # The step counters (tandem:engine_*): every prompt token prefilled once, every token after a request's
    # first computed once as a decode token (no prefix shared, no preemption, no speculation here).
    stats = engine.stats()
    assert stats.step_prefill_tokens == sum(len(p) for p, _ in work)
    assert stats.step_decode_tokens == sum(params.max_tokens - 1 for _, params in work)
    assert 0 < stats.num_steps < 10_000 and stats.step_seconds > 0


def test_preemption_under_tiny_block_budget_changes_nothing(tiny: LlamaForCausalLM) -> None:
    ps = prompts(6, tiny.config.vocab_size, seed=1, lo=10, hi=30)
    work = [(p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)) for p in ps]
    engine = ColocatedEngine(tiny, CacheConfig(num_blocks=10, block_size=8),
                             SchedulerConfig(max_num_batched_tokens=64, watermark=0.0))
    got = run_staggered(engine, work, arrivals=[0] * 6)
    assert engine.scheduler.num_preemptions > 0
    for i, (p, params) in enumerate(work):
        assert got[f"r{i}"] == contiguous_greedy(tiny, p, params.max_tokens), i


def test_prefix_reuse_gives_the_same_tokens(tiny: LlamaForCausalLM) -> None:
    shared = prompts(1, tiny.config.vocab_size, seed=2, lo=40, hi=41)[0]
    a, b = shared + [5, 6, 7], shared + [9]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine = ColocatedEngine(tiny, CacheConfig(num_blocks=32, block_size=16))
    first = run_staggered(engine, [(a, params)], [0])["r0"]
    hits_before = engine.kv.prefix_cache_hits
    second = run_staggered(engine, [(b, params)], [0])["r0"]
    assert engine.kv.prefix_cache_hits - hits_before == 32  # two full blocks of the shared 40 tokens
    assert first == contiguous_greedy(tiny, a, 8)
    assert second == contiguous_greedy(tiny, b, 8)


@pytest.mark.parametrize("chunk", [1, 7, 16, None])
def test_chunked_prefill_same_kv_and_first_token(tiny: LlamaForCausalLM, chunk: int | None) -> None:
    prompt = prompts(1, tiny.config.vocab_size, seed=3, lo=45, hi=46)[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=3)

    def prefill(max_chunk: int | None) -> tuple[torch.Tensor, list[int], float]:
        engine = EngineCore(tiny, CacheConfig(num_blocks=8, block_size=16, enable_prefix_caching=False),
                            SchedulerConfig(max_num_batched_tokens=max_chunk or 256, max_prefill_chunk=max_chunk),
                            connector=KVProducer(block_size=16))
        engine.add_request("p", prompt, params)
        outs = []
        while engine.has_unfinished():
            outs.extend(engine.step())
        table = engine.kv.block_table("p")
        kv = engine.runner.kv_cache.gather(table)  # [blocks, layers, 2, block_size, kv_heads, head_dim]
        kv = kv.permute(1, 2, 0, 3, 4, 5).flatten(2, 3)[:, :, : len(prompt)]
        (out,) = outs
        assert out.logprobs is not None
        return kv, out.new_token_ids, out.logprobs[0][0]

    ref_kv, ref_token, ref_lp = prefill(None)
    kv, token, lp = prefill(chunk)
    assert token == ref_token == contiguous_greedy(tiny, prompt, 1)
    torch.testing.assert_close(kv, ref_kv, atol=1e-5, rtol=1e-5)
    assert lp == pytest.approx(ref_lp, abs=1e-4)


def test_seeded_sampling_reproducible_across_batches(tiny: LlamaForCausalLM) -> None:
    ps = prompts(4, tiny.config.vocab_size, seed=4)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    others = [SamplingParams(temperature=1.0, max_tokens=5 + i, ignore_eos=True) for i in range(3)]

    def engine() -> ColocatedEngine:
        return ColocatedEngine(tiny, CacheConfig(num_blocks=64, block_size=16))

    alone = run_staggered(engine(), [(ps[0], seeded)], [0])["r0"]
    batched = run_staggered(engine(), [(ps[1], others[0]), (ps[0], seeded), (ps[2], others[1]),
                                       (ps[3], others[2])], [0, 0, 1, 2])["r1"]
    assert alone == batched


def test_validation_errors_name_the_field(tiny: LlamaForCausalLM) -> None:
    engine = ColocatedEngine(tiny, CacheConfig(num_blocks=8, block_size=16), SchedulerConfig(max_model_len=64))
    p = SamplingParams()
    with pytest.raises(ValueError, match="prompt: must not be empty"):
        engine.add_request("a", [], p)
    with pytest.raises(ValueError, match="prompt: 64 tokens; the limit is max_model_len - 1 = 63"):
        engine.add_request("a", [5] * 64, p)
    with pytest.raises(ValueError, match=r"prompt_token_ids: ids must be in \[0, 128\)"):
        engine.add_request("a", [5, 500], p)
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request("a", [5], SamplingParams(stop_token_ids=(1000,)))
    assert not engine.has_unfinished()


@pytest.mark.real_model
def test_smollm2_batched_equals_alone(smollm2_dir: Path) -> None:
    from common.engine.simple_generator import SimpleGenerator
    from common.tokenizer import Tokenizer

    model = load_model(smollm2_dir, dtype="float32")
    tok = Tokenizer(smollm2_dir)
    texts = ["The capital of France is", "def quicksort(arr):", "List three colors:", "Water boils at"]
    work = [(tok.encode(t), SamplingParams(temperature=0.0, max_tokens=12 + 4 * i, ignore_eos=True))
            for i, t in enumerate(texts)]
    engine = ColocatedEngine(model, CacheConfig(num_blocks=64, block_size=16))
    got = run_staggered(engine, work, arrivals=[0, 0, 2, 5])
    alone = SimpleGenerator(model)
    for i, (p, params) in enumerate(work):
        assert got[f"r{i}"] == list(alone.stream(p, params)), texts[i]


@pytest.mark.real_model
def test_smollm2_prefix_reuse_equals_contiguous(smollm2_dir: Path) -> None:
    from common.tokenizer import Tokenizer

    model = load_model(smollm2_dir, dtype="float32")
    tok = Tokenizer(smollm2_dir)
    system = tok.encode_chat([{"role": "system", "content": "You are a terse assistant who answers in one line."},
                              {"role": "user", "content": "Name a colour."}])
    other = tok.encode_chat([{"role": "system", "content": "You are a terse assistant who answers in one line."},
                             {"role": "user", "content": "Name a planet."}])
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine = ColocatedEngine(model, CacheConfig(num_blocks=64, block_size=16))
    first = run_staggered(engine, [(system, params)], [0])["r0"]
    second = run_staggered(engine, [(other, params)], [0])["r0"]
    assert engine.kv.prefix_cache_hits >= 16  # the shared system prompt came from the cache
    assert first == contiguous_greedy(model, system, 10)
    assert second == contiguous_greedy(model, other, 10)


def test_reserve_queues_beyond_free_blocks_and_refuses_past_max_waiting(tiny: LlamaForCausalLM) -> None:
    """A decode engine queues reservations it cannot hold yet; only a full queue is refused."""
    from common.engine.commands import AbortRequest, AddRequest, ReserveKV
    from common.errors import QueueFullError
    from decode_service.kv_consumer import KVConsumer

    engine = EngineCore(tiny, CacheConfig(num_blocks=4, block_size=16), SchedulerConfig(max_waiting=1, watermark=0.0),
                        connector=KVConsumer())
    params = SamplingParams(temperature=0.0, max_tokens=4)
    assert engine.handle(ReserveKV("a", tuple(range(3, 50)), params, "t-a")) is None  # 3 of 4 blocks
    (announced,) = engine.take_announced()  # the reservation answers once: on the stream
    assert announced.request_id == "a" and len(announced.reserved_block_ids or ()) == 3
    engine.handle(ReserveKV("b", tuple(range(3, 40)), params, "t-b"))
    assert engine.take_announced() == [] and engine.stats().num_waiting == 2  # b queues
    with pytest.raises(QueueFullError, match="max_waiting = 1"):
        engine.handle(ReserveKV("c", tuple(range(3, 10)), params, "t-c"))
    with pytest.raises(QueueFullError):
        engine.handle(AddRequest("d", (3, 4, 5), params))
    assert engine.handle(AbortRequest("a"))
    outputs = engine.step()
    assert [(o.request_id, o.reserved_block_ids is not None) for o in outputs] == [("b", True)]
    assert engine.stats().num_waiting == 1 and engine.kv.num_used_blocks == 3


def test_finished_loads_reach_the_engine_through_its_connector(tiny: LlamaForCausalLM) -> None:
    """The receiver reports each transfer's end into the KVConsumer (any thread); the engine's next step
    starts a landed request with the prefill's token, aborts a failed one, and ignores a late report."""
    from common.engine.commands import ReserveKV
    from decode_service.kv_consumer import KVConsumer

    consumer = KVConsumer()
    engine = EngineCore(tiny, CacheConfig(num_blocks=8, block_size=16), connector=consumer)
    woken: list[bool] = []
    consumer.finished.wake = lambda: woken.append(True)
    params = SamplingParams(temperature=0.0, max_tokens=3)
    engine.handle(ReserveKV("a", tuple(range(3, 40)), params, "t-a"))
    engine.handle(ReserveKV("b", tuple(range(50, 70)), params, "t-b"))
    assert engine.kv.num_used_blocks == 5 and not engine.has_unfinished()  # both wait for their KV
    consumer.load_finished("t-a", 7, None)
    consumer.load_finished("t-b", None, "aborted by prefill node: boom")
    consumer.load_finished("t-b", None, "reported twice")  # ignored: nobody waits for t-b any more
    assert woken == [True, True] and engine.has_unfinished()
    first = engine.step()
    assert [(o.request_id, o.new_token_ids) for o in first][:1] == [("a", [7])]
    assert engine.kv.num_used_blocks == 3 and engine.stats().num_waiting == 0  # b's 2 blocks are free
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.num_used_blocks == 0


def test_a_request_id_in_use_is_refused_not_fatal(tiny: LlamaForCausalLM) -> None:
    """Reusing an id the engine still holds (a resend racing its own abort) is a caller error, and the engine
    keeps serving: the block manager's invariant must never be reached by input."""
    from common.engine.commands import AddRequest, ReserveKV
    from common.errors import InvalidRequestError

    engine = EngineCore(tiny, CacheConfig(num_blocks=8, block_size=16))
    params = SamplingParams(temperature=0.0, max_tokens=2)
    engine.handle(AddRequest("a", (3, 4, 5), params))
    with pytest.raises(InvalidRequestError, match="request_id"):
        engine.handle(AddRequest("a", (3, 4, 5), params))  # still queued
    engine.step()
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.handle(ReserveKV("a", (3, 4, 5), params, "t-a"))  # now running, with blocks
    while engine.has_unfinished():
        engine.step()
    engine.handle(AddRequest("a", (3, 4, 5), params))  # finished: the id is free again


class _PushTarget:
    """A KVPushTarget that records a prefill node's pushes; ``finish`` ends its transfer."""

    def __init__(self) -> None:
        self.pushed: list[tuple[list[int], list[int]]] = []
        self._callbacks: list[Callable[[], None]] = []

    def push(self, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        self.pushed.append((list(src_block_ids), list(dst_block_ids)))

    def when_finished(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def finish(self) -> None:
        for callback in self._callbacks:
            callback()


def test_a_prefill_request_computes_before_its_destination_and_pushes_when_it_comes(tiny: LlamaForCausalLM) -> None:
    """AddRequest(awaits_destination): the prompt computes and its first token comes with nowhere to push; the KV
    is held until AttachDestination, which pushes what the destination reads at once. One never attached is
    aborted with every block freed; an attach for a request no longer there answers False."""
    from common.engine.commands import AbortRequest, AddRequest, AttachDestination, KVDestination

    engine = EngineCore(tiny, CacheConfig(num_blocks=8, block_size=16),
                        SchedulerConfig(max_num_batched_tokens=16, max_prefill_chunk=16),
                        connector=KVProducer(block_size=16))
    params = SamplingParams(temperature=0.0, max_tokens=1)
    prompt = tuple(range(3, 40))  # 37 tokens: 3 blocks, in 3 chunks
    engine.handle(AddRequest("a", prompt, params, awaits_destination=True))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert [o.new_token_ids for o in outs] == [contiguous_greedy(tiny, list(prompt), 1)]
    table = engine.kv.block_table("a")
    assert len(table) == 3 and engine.kv.num_used_blocks == 3  # held, nothing pushed anywhere
    target = _PushTarget()
    assert not engine.handle(AttachDestination("gone", KVDestination(target, (10, 11, 12), skip_blocks=0)))
    assert engine.handle(AttachDestination("a", KVDestination(target, (10, 11, 12), skip_blocks=1)))
    assert target.pushed == [(table[1:], [11, 12])]  # block 0 cached on the decode node
    target.finish()
    engine.step()
    assert engine.kv.num_used_blocks == 0
    engine.handle(AddRequest("b", prompt, params, awaits_destination=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.num_used_blocks == 3
    assert engine.handle(AbortRequest("b"))
    assert engine.kv.num_used_blocks == 0 and engine.kv.num_free_blocks == 8
    engine.kv.check_integrity()


def test_a_windowed_prompt_too_long_to_hold_whole_waits_for_its_destination(
        tiny_model_factory: Callable[..., Path]) -> None:
    """Until its destination comes every block of a prompt is kept (any may be sent): a windowed prompt the pool
    cannot hold whole is parked, and computes once the destination says which blocks it needs (the window's)."""
    from common.engine.commands import AbortRequest, AddRequest, AttachDestination, KVDestination

    model = load_model(tiny_model_factory("mistral", seed=21, sliding_window=5), dtype="float32")
    engine = EngineCore(model, CacheConfig(num_blocks=4, block_size=4),
                        SchedulerConfig(max_num_batched_tokens=16, max_prefill_chunk=4),
                        connector=KVProducer(block_size=4))
    params = SamplingParams(temperature=0.0, max_tokens=1)
    prompt = tuple(range(3, 43))  # 40 tokens: 10 blocks, the pool 4
    engine.handle(AddRequest("a", prompt, params, awaits_destination=True))
    assert not engine.has_unfinished() and engine.kv.num_used_blocks == 0  # parked
    target = _PushTarget()
    # the decode node's first query (at 40) reads from block 8 on
    assert engine.handle(AttachDestination("a", KVDestination(target, (100, 101), skip_blocks=8, first_block=8)))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert [dst for _, dst in target.pushed] == [[100], [101]] and len(outs) == 1
    target.finish()
    engine.step()
    assert engine.kv.num_used_blocks == 0
    engine.handle(AddRequest("b", prompt, params, awaits_destination=True))
    assert engine.handle(AbortRequest("b"))  # parked, then given up
    assert not engine.handle(AttachDestination("b", KVDestination(target, (100, 101), skip_blocks=8, first_block=8)))
    engine.kv.check_integrity()
