"""Robustness against real processes on loopback: fuzzed requests mixed with cancellations, and overload.

The fuzzer sends a seeded mix of valid and invalid requests (token ids out of range, huge max_tokens, bad
sampling values, empty prompts, an unknown model, odd unicode, stop strings, n values), some cancelled by the
client at a random moment. Every answer must be a status a client can act on, with a message that names the
field or the limit; afterwards every process is alive and no node holds a block or a request.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tandem_cli.launcher import Launcher, Topology
from tests.e2e.test_disaggregated import used_blocks, wait_all_blocks_free, waiting_requests

pytestmark = pytest.mark.e2e
VOCAB = 49152  # tiny_served_model_dir: SmolLM2's vocabulary
CALL_TIMEOUT_S = 60.0
# What a status message must name: a request field, or the limit a request ran into.
NAMED = ("request:", "model", "input", "text", "token_ids", "chat", "sampling.", "n:", "n ", "request_id", "stop",
         "max_tokens", "max_model_len", "max_inflight", "max_queued", "queue_timeout_s", "limit", "blocks")
STATUSES = {"OK", "INVALID_ARGUMENT", "CANCELLED", "RESOURCE_EXHAUSTED"}


@dataclass(frozen=True)
class Outcome:
    code: str
    details: str
    cancelled_by_client: bool
    seconds: float


def odd_text(rng: random.Random) -> str:
    """Unicode a tokenizer may stumble on: emoji, combining marks, RTL, zero-width, control characters."""
    pools = ("héllo wörld ", "日本語のテキスト", "🙂🚀👩‍👩‍👧‍👦", "\u0301\u0308\u20dd", "\u202e\u200f\u200b\ufeff",
             "\x00\x07\x1b", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "ﷺ", " " * 5, "\n\t\r")
    return "".join(rng.choice(pools) for _ in range(rng.randint(1, 12)))


def fuzzed_request(rng: random.Random, i: int) -> generate_pb2.GenerateRequest:
    """One request: about half valid (small outputs), the rest broken in one or two random ways."""
    sampling = common_pb2.SamplingParams(max_tokens=rng.randint(1, 8), temperature=rng.choice([0.0, 0.7, 1.0]))
    req = generate_pb2.GenerateRequest(sampling=sampling,
                                       stream=generate_pb2.StreamOptions(include_token_ids=rng.random() < 0.5))
    if rng.random() < 0.7:
        req.token_ids.ids.extend(rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 60)))
    else:
        req.text = odd_text(rng)
    if rng.random() < 0.2:
        req.stop.extend(rng.choice(["\n", "the", "🙂", "é", "xyz" * 3]) for _ in range(rng.randint(1, 3)))
    if rng.random() < 0.1:
        req.n = rng.randint(1, 3)
    if rng.random() < 0.45:
        return req
    for mutate in rng.sample(MUTATIONS, rng.choice([1, 1, 2])):
        mutate(req, rng)
    return req


def _set(field: str, *values: object) -> Callable[[generate_pb2.GenerateRequest, random.Random], None]:
    def mutate(req: generate_pb2.GenerateRequest, rng: random.Random) -> None:
        setattr(req.sampling, field, rng.choice(values))
    return mutate


def _ids_out_of_range(req: generate_pb2.GenerateRequest, rng: random.Random) -> None:
    req.token_ids.ids.extend([rng.choice([VOCAB, VOCAB + 1, 2**31, 2**32 - 1])])


def _empty_prompt(req: generate_pb2.GenerateRequest, rng: random.Random) -> None:
    choice = rng.randrange(4)
    if choice == 0:
        req.text = ""
    elif choice == 1:
        req.token_ids.SetInParent()
        del req.token_ids.ids[:]
    elif choice == 2:
        req.ClearField("token_ids")
        req.ClearField("text")
    else:
        req.chat.SetInParent()  # a chat with no messages


def _bad_stop(req: generate_pb2.GenerateRequest, rng: random.Random) -> None:
    req.stop.extend(rng.choice([[""], ["x"] * 40, ["y" * 1000]]))


def _bad_n(req: generate_pb2.GenerateRequest, rng: random.Random) -> None:
    req.n = rng.choice([17, 1000, 2**32 - 1])


def _bad_request_id(req: generate_pb2.GenerateRequest, rng: random.Random) -> None:
    # Unprintable or too long; or one of three ids that other requests use at the same moment.
    req.request_id = rng.choice(["\x00bad", "r" * 500, "tab\tid", "same-0", "same-1", "same-2"])


def _long_prompt(req: generate_pb2.GenerateRequest, rng: random.Random) -> None:
    req.token_ids.ids.extend([7] * rng.choice([1024, 5000]))


def _bad_stop_token_ids(req: generate_pb2.GenerateRequest, rng: random.Random) -> None:
    req.sampling.stop_token_ids.extend(rng.choice([[VOCAB + 5], [7] * 100]))


def _unknown_model(req: generate_pb2.GenerateRequest, rng: random.Random) -> None:
    req.model = rng.choice(["no-such-model", "🙂", "gpt-4"])


def _chat_without_role(req: generate_pb2.GenerateRequest, rng: random.Random) -> None:
    req.chat.messages.add(role="", content="hi")


MUTATIONS: list[Callable[[generate_pb2.GenerateRequest, random.Random], None]] = [
    _ids_out_of_range, _empty_prompt, _bad_stop, _bad_n, _bad_request_id, _long_prompt, _bad_stop_token_ids,
    _unknown_model, _chat_without_role,
    _set("max_tokens", 0, 2000, 10**6, 2**32 - 1),
    _set("temperature", -1.0, math.nan, math.inf, 1e30),
    _set("top_p", 0.0, -0.5, 1.5, math.nan),
    _set("top_k", 2**32 - 1, VOCAB + 1),
    _set("min_p", -1.0, 2.0, math.nan),
    _set("repetition_penalty", 0.0, -1.0, math.inf),
    _set("presence_penalty", 1e9, -1e9, math.nan),
    _set("frequency_penalty", math.inf, -3.0),
    _set("logprobs", 21, 2**32 - 1),
    _set("min_tokens", 50, 2**32 - 1),
    _set("num_speculative_tokens", 17, 2**32 - 1),
    _set("seed", 2**64 - 1, 0),
]


def corrupt_bytes(rng: random.Random) -> bytes:
    """A GenerateRequest's wire bytes that do not parse: text or a stop string not UTF-8, or a torn message."""
    return rng.choice([b"\x12\x03\xff\xfe\xfd", b"\x12\x02hi\x32\x02\xc3\x28", b"\xff\xff\xff\xff",
                       b"\x1a\x05\x0a", bytes(rng.randrange(256) for _ in range(rng.randint(1, 40)))])


def call(target: str, req: generate_pb2.GenerateRequest | bytes, cancel_after_s: float | None) -> Outcome:
    """One Generate; ``req`` as raw bytes goes on the wire as it is."""
    started = time.monotonic()
    with grpc.insecure_channel(target) as channel:
        if isinstance(req, bytes):
            raw = channel.unary_stream("/tandem.v1.Tandem/Generate", request_serializer=lambda b: b,
                                       response_deserializer=generate_pb2.GenerateResponse.FromString)
            stream = raw(req, timeout=CALL_TIMEOUT_S)
        else:
            stream = generate_pb2_grpc.TandemStub(channel).Generate(req, timeout=CALL_TIMEOUT_S)
        timer = threading.Timer(cancel_after_s, stream.cancel) if cancel_after_s is not None else None
        if timer is not None:
            timer.start()
        try:
            for _ in stream:
                pass
            return Outcome("OK", "", timer is not None, time.monotonic() - started)
        except grpc.RpcError as exc:
            return Outcome(exc.code().name, exc.details() or "", timer is not None, time.monotonic() - started)
        finally:
            if timer is not None:
                timer.cancel()


def unclear(outcomes: list[Outcome]) -> list[Outcome]:
    """Answers a client cannot act on: a status outside the expected four, CANCELLED it did not ask for, or
    an error message that names no field or limit."""
    bad = []
    for o in outcomes:
        wrong_status = o.code not in STATUSES or (o.code == "CANCELLED" and not o.cancelled_by_client)
        unnamed = o.code in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED") and not any(w in o.details for w in NAMED)
        if wrong_status or unnamed:
            bad.append(o)
    return bad


def assert_clean(launcher: Launcher) -> None:
    dead = {name: proc.returncode for name, proc in launcher.procs.items() if proc.poll() is not None}
    assert not dead, f"processes died: {dead}"
    wait_all_blocks_free(launcher, timeout_s=30.0)
    deadline = time.monotonic() + 10.0
    while any((waiting := waiting_requests(launcher)).values()):
        assert time.monotonic() < deadline, f"requests left on nodes: {waiting}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def system(tiny_served_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    topology = Topology(num_prefill=2, num_decode=2, free_ports=True, http_port=None,
                        model_args=("--model", str(tiny_served_model_dir), "--dtype", "float32"),
                        node_args=("--num-blocks", "256", "--kv-timeout-s", "20", "--grace-s", "1"),
                        gateway_args=("--local-prefill-max-tokens", "0",
                                      "--stats-interval-s", "0.3", "--shutdown-grace-s", "1"))
    with Launcher(topology, log_dir=tmp_path_factory.mktemp("robustness-logs")) as launcher:
        yield launcher


def run_fuzz(launcher: Launcher, num_fuzzed: int, num_cancelled: int, seed: int) -> list[Outcome]:
    """``num_fuzzed`` fuzzed requests and ``num_cancelled`` valid ones cancelled 0-1.5 s after they start (while
    queued, reserving, prefilling, transferring or decoding), interleaved, 24 at a time."""
    rng = random.Random(seed)
    jobs: list[tuple[generate_pb2.GenerateRequest | bytes, float | None]] = []
    for i in range(num_fuzzed):
        req = corrupt_bytes(rng) if rng.random() < 0.03 else fuzzed_request(rng, i)
        jobs.append((req, rng.uniform(0.0, 0.6) if rng.random() < 0.05 else None))
    for _ in range(num_cancelled):
        ids = [rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 120))]
        sampling = common_pb2.SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
        req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=ids), sampling=sampling)
        jobs.append((req, rng.uniform(0.0, 1.5)))
    rng.shuffle(jobs)
    target = launcher.gateway.target
    with ThreadPoolExecutor(24) as pool:
        return list(pool.map(lambda job: call(target, *job), jobs))


def check_fuzz(launcher: Launcher, outcomes: list[Outcome], num_cancelled: int) -> None:
    codes = Counter(o.code for o in outcomes)
    print(f"fuzz outcomes: {dict(codes)}; slowest {max(o.seconds for o in outcomes):.1f} s")
    for detail, count in Counter(o.details[:70] for o in outcomes if o.details).most_common(40):
        print(f"  {count:4d} {detail}")
    bad = unclear(outcomes)
    assert not bad, f"{len(bad)} unclear answers, e.g. {bad[:5]}; all: {codes}"
    assert codes["OK"] > len(outcomes) // 5 and codes["INVALID_ARGUMENT"] > len(outcomes) // 5, codes
    assert codes["CANCELLED"] > num_cancelled // 10, codes  # cancellations cut requests off (most, on 2 cores)
    assert_clean(launcher)


def test_fuzzed_requests_and_cancellations(system: Launcher) -> None:
    """1,000 fuzzed requests and 300 cancellations at random stages against 2 prefill + 2 decode nodes."""
    check_fuzz(system, run_fuzz(system, num_fuzzed=1000, num_cancelled=300, seed=21), num_cancelled=300)
    # The deployment still serves.
    req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[10, 11, 12]),
                                       sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True))
    assert call(system.gateway.target, req, None).code == "OK"
    assert not any(used_blocks(system).values())


def test_three_times_overload_is_served_or_rejected(tiny_served_model_dir: Path, tmp_path: Path) -> None:
    """A gateway that runs 4 requests and queues 8 (for at most 1 s) gets 36 at once, 3x what it can hold:
    each one is served in full or answered RESOURCE_EXHAUSTED naming the queue bound or timeout; none is lost
    or left hanging, and nothing stays behind on the nodes."""
    topology = Topology(num_prefill=1, num_decode=1, free_ports=True, http_port=None,
                        model_args=("--model", str(tiny_served_model_dir), "--dtype", "float32"),
                        node_args=("--num-blocks", "256", "--kv-timeout-s", "20", "--grace-s", "1"),
                        gateway_args=("--local-prefill-max-tokens", "0",
                                      "--stats-interval-s", "0.3", "--shutdown-grace-s", "1", "--max-inflight", "4",
                                      "--max-queued", "8", "--queue-timeout-s", "1"))
    rng = random.Random(3)
    reqs = [generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=[rng.randrange(3, VOCAB) for _ in range(rng.randint(10, 60))]),
        sampling=common_pb2.SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True),
        stream=generate_pb2.StreamOptions(include_token_ids=True)) for _ in range(36)]

    def served_tokens(req: generate_pb2.GenerateRequest) -> tuple[str, str, int, float]:
        started = time.monotonic()
        with grpc.insecure_channel(launcher.gateway.target) as channel:
            try:
                n = sum(len(r.token_ids) for r in generate_pb2_grpc.TandemStub(channel).Generate(
                    req, timeout=CALL_TIMEOUT_S))
                return "OK", "", n, time.monotonic() - started
            except grpc.RpcError as exc:
                return exc.code().name, exc.details() or "", 0, time.monotonic() - started

    with Launcher(topology, log_dir=tmp_path) as launcher, ThreadPoolExecutor(len(reqs)) as pool:
        results = list(pool.map(served_tokens, reqs))
        codes = Counter(code for code, *_ in results)
        print(f"overload outcomes: {dict(codes)}; slowest {max(r[3] for r in results):.1f} s")
        assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, results
        assert codes["OK"] >= 4 and codes["RESOURCE_EXHAUSTED"] >= 1, codes
        for code, details, n, seconds in results:
            if code == "OK":
                assert n == 256
            else:
                assert "max_queued" in details or "queue_timeout_s" in details, details
                assert seconds < 1.0 + 10.0  # rejected at once or after its queue timeout, not at the deadline
        assert_clean(launcher)
