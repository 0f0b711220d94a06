"""The serving benchmark's workloads: requests (token-id prompts, exact output lengths) and when they arrive.

Everything comes from one seed, so two systems measured in one run, or in two runs, see the same requests
in the same order at the same offsets. Each workload draws from three independent streams (lengths, token
ids, arrivals), so changing a length bound moves neither the ids nor the arrivals. Lengths are log-uniform
between their bounds: real traffic is skewed toward short prompts and short answers (chat logs such as
ShareGPT have medians well below their means), and a log-uniform spread keeps a long tail without a data
set. Prompts are random token ids (no tokenizer needed), and requests ignore EOS so every output has its
exact length. Arrivals are Poisson: drawn at unit rate, then scaled by 1 / rate, so the order of the
requests is the same at every rate (and in a closed loop, which sends them in that order).

- ``serving``: independent chat requests; nothing to share between prompts.
- ``shared-prefix``: one long system prompt before every short question, the case prefix caching is for.
- ``mixed``: long prompts arriving while short chats decode, the case disaggregation is for.
- ``multi-turn``: conversations of several turns over a growing history (the previous turns' prompts and
  answers, then a new message), with think time between turns: the case KV reuse across turns is for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import Field, dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from benchmarks.slo import SLO

if TYPE_CHECKING:  # numpy is imported on use: `tandem` builds its parser (these defaults) on every call
    import numpy as np

# Ids below this are special and byte tokens in most vocabularies; tiny test vocabularies keep half.
LOWEST_ORDINARY_ID = 100


@dataclass(frozen=True)
class TimedRequest:
    index: int  # position in arrival order
    prompt_token_ids: tuple[int, ...]
    output_len: int  # exactly this many tokens are generated (EOS ignored)
    arrival_s: float  # seconds after the run's start at which the client sends it (open loop)
    kind: str  # the workload's class of request, for per-kind statistics ("chat", "question", "short", "long")
    # A later turn of a conversation: sent ``think_s`` after request ``follows`` ends, its prompt that request's
    # whole prompt, then the tokens it generated, then ``prompt_token_ids`` (the new message); the client
    # builds it (benchmarks/serve_client.py). None: an independent request, sent at ``arrival_s``.
    follows: int | None = None
    think_s: float = 0.0


class Workload(Protocol):
    """What to send. Implementations are frozen dataclasses (the JSON report records their fields)."""

    name: ClassVar[str]
    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]

    @property
    def num_requests(self) -> int: ...

    @property
    def seed(self) -> int: ...

    @property
    def max_total_len(self) -> int:
        """The longest prompt + output any request can have (must fit the model's context)."""
        ...

    def requests(self, vocab_size: int, rate: float) -> list[TimedRequest]:
        """The requests in arrival order, Poisson at ``rate`` requests/s; ``inf`` sends them all at 0."""
        ...

    def describe(self) -> str:
        """One sentence for the report."""
        ...


@dataclass(frozen=True)
class ServingWorkload:
    """Independent chat requests, prompts and outputs log-uniform, Poisson arrivals; kind "chat"."""

    name: ClassVar[str] = "serving"
    num_requests: int = 48
    prompt_len: tuple[int, int] = (32, 512)
    output_len: tuple[int, int] = (16, 128)
    seed: int = 0

    def __post_init__(self) -> None:
        _check_at_least("num_requests", self.num_requests, 1)
        _check_range("prompt_len", self.prompt_len)
        _check_range("output_len", self.output_len)

    @property
    def max_total_len(self) -> int:
        return self.prompt_len[1] + self.output_len[1]

    def requests(self, vocab_size: int, rate: float) -> list[TimedRequest]:
        lengths, ids, arrivals = _streams(self.seed)
        n = self.num_requests
        prompt_lens = log_uniform_ints(lengths, *self.prompt_len, n)
        output_lens = log_uniform_ints(lengths, *self.output_len, n)
        offsets = _scaled(_unit_arrivals(arrivals, n), rate)
        return [TimedRequest(i, _token_ids(ids, vocab_size, int(p)), int(o), t, "chat")
                for i, (p, o, t) in enumerate(zip(prompt_lens, output_lens, offsets, strict=True))]

    def describe(self) -> str:
        return (f"{self.num_requests} chat requests, prompts {_spread(self.prompt_len)}, "
                f"outputs {_spread(self.output_len)}")


@dataclass(frozen=True)
class SharedPrefixWorkload:
    """One system prompt (the same ``prefix_len`` ids) before every short question; kind "question".

    A system prompt, few-shot template or retrieved document repeated in front of each request: with
    prefix caching only the first request prefills the prefix and later ones prefill their question
    alone, so TTFT drops to a short prompt's; without, every request prefills the whole prompt. The
    default 768 tokens is 48 full 16-token blocks, all of them reusable (caches share whole blocks).
    """

    name: ClassVar[str] = "shared-prefix"
    num_requests: int = 48
    prefix_len: int = 768
    question_len: tuple[int, int] = (16, 64)
    output_len: tuple[int, int] = (16, 64)
    seed: int = 0

    def __post_init__(self) -> None:
        _check_at_least("num_requests", self.num_requests, 1)
        _check_at_least("prefix_len", self.prefix_len, 1)
        _check_range("question_len", self.question_len)
        _check_range("output_len", self.output_len)

    @property
    def max_total_len(self) -> int:
        return self.prefix_len + self.question_len[1] + self.output_len[1]

    def requests(self, vocab_size: int, rate: float) -> list[TimedRequest]:
        lengths, ids, arrivals = _streams(self.seed)
        n = self.num_requests
        question_lens = log_uniform_ints(lengths, *self.question_len, n)
        output_lens = log_uniform_ints(lengths, *self.output_len, n)
        offsets = _scaled(_unit_arrivals(arrivals, n), rate)
        prefix = _token_ids(ids, vocab_size, self.prefix_len)
        return [TimedRequest(i, prefix + _token_ids(ids, vocab_size, int(q)), int(o), t, "question")
                for i, (q, o, t) in enumerate(zip(question_lens, output_lens, offsets, strict=True))]

    def describe(self) -> str:
        return (f"{self.num_requests} questions after one shared {self.prefix_len}-token system prompt, "
                f"questions {_spread(self.question_len)}, outputs {_spread(self.output_len)}")


@dataclass(frozen=True)
class MixedWorkload:
    """Short chats decoding while long prompts arrive; kinds "short" and "long".

    A colocated engine mixes each long prompt's prefill into its decode steps, so every short request in
    flight sees its inter-token latency jump; disaggregation sends the prefill elsewhere. The shorts are
    Poisson at the rate with long outputs, so decoding is always going on; the longs are mostly prefill
    (short outputs), a Poisson process at ``long_rate_fraction`` of the rate that starts at the second
    short's arrival, so the first long prompt already meets decodes in flight. The split of
    ``num_requests`` makes both streams end together on average: the last short arrives at
    (num_short - 1) / rate, the last long at (1 + num_long / fraction) / rate, equal when
    num_long = fraction * (num_requests - 2) / (1 + fraction): 26 short + 6 long for the default 32.
    """

    name: ClassVar[str] = "mixed"
    num_requests: int = 32
    short_prompt_len: tuple[int, int] = (32, 128)
    short_output_len: tuple[int, int] = (64, 128)
    long_prompt_len: tuple[int, int] = (1024, 1536)  # + output stays under a 2048-token context
    long_output_len: tuple[int, int] = (8, 16)
    long_rate_fraction: float = 0.25
    seed: int = 0

    def __post_init__(self) -> None:
        _check_at_least("num_requests", self.num_requests, 3)  # two shorts before the first long, one long
        for name in ("short_prompt_len", "short_output_len", "long_prompt_len", "long_output_len"):
            _check_range(name, getattr(self, name))
        if not 0 < self.long_rate_fraction <= 1:
            raise ValueError(f"long_rate_fraction must be in (0, 1], got {self.long_rate_fraction}")

    @property
    def num_long(self) -> int:
        # At least one; at most (num_requests - 1) / 2 for a fraction <= 1, which leaves >= 2 shorts.
        f = self.long_rate_fraction
        return max(1, round(f * (self.num_requests - 2) / (1 + f)))

    @property
    def num_short(self) -> int:
        return self.num_requests - self.num_long

    @property
    def max_total_len(self) -> int:
        return max(self.short_prompt_len[1] + self.short_output_len[1],
                   self.long_prompt_len[1] + self.long_output_len[1])

    def requests(self, vocab_size: int, rate: float) -> list[TimedRequest]:
        import numpy as np

        lengths, ids, arrivals = _streams(self.seed)
        ns, nl = self.num_short, self.num_long
        prompt_lens = np.concatenate([log_uniform_ints(lengths, *self.short_prompt_len, ns),
                                      log_uniform_ints(lengths, *self.long_prompt_len, nl)])
        output_lens = np.concatenate([log_uniform_ints(lengths, *self.short_output_len, ns),
                                      log_uniform_ints(lengths, *self.long_output_len, nl)])
        # Unit time: the shorts' mean gap is 1 (the rate), the longs' 1 / fraction.
        short_at = _unit_arrivals(arrivals, ns)
        long_at = _unit_arrivals(arrivals, nl, mean_gap=1 / self.long_rate_fraction, after=float(short_at[1]))
        prompts = [_token_ids(ids, vocab_size, int(n)) for n in prompt_lens]
        outputs = [int(n) for n in output_lens]
        kinds = ["short"] * ns + ["long"] * nl
        unit = np.concatenate([short_at, long_at])
        order = np.argsort(unit, kind="stable")  # shorts then longs: index j is the j-th drawn
        offsets = _scaled(unit[order], rate)
        return [TimedRequest(i, prompts[j], outputs[j], t, kinds[j]) for i, (j, t) in enumerate(zip(
            order.tolist(), offsets, strict=True))]

    def describe(self) -> str:
        return (f"{self.num_short} short chats at the rate, prompts {_spread(self.short_prompt_len)}, outputs "
                f"{_spread(self.short_output_len)}, and {self.num_long} long prompts at {self.long_rate_fraction:g} "
                f"of the rate from the 2nd short's arrival on, prompts {_spread(self.long_prompt_len)}, outputs "
                f"{_spread(self.long_output_len)}")


@dataclass(frozen=True)
class MultiTurnWorkload:
    """Conversations: a shared system prompt, then ``turns`` turns each adding a user message and the model's
    answer to the history; kinds "turn 1", "turn 2", "turns 3+".

    Turn k + 1 is sent ``think`` seconds (exponential, mean ``think_s``) after turn k's last token, its prompt
    the system prompt, every earlier message and answer (the tokens the server generated, as the client
    received them) and the new message. With ``--rate R`` new conversations start as a Poisson process of R per
    second (every later turn follows its conversation); ``inf`` starts them all at once. Requests are numbered
    turn by turn (every conversation's first turn, then every second turn, ...), so a closed loop of C starts C
    conversations and keeps C requests in flight. Run it against a KV pool too small for every conversation's
    history (``--kv-cache-memory-gb`` / ``--num-blocks``) to see what survives between turns.
    """

    name: ClassVar[str] = "multi-turn"
    num_conversations: int = 16
    turns: int = 4
    system_len: int = 256
    message_len: tuple[int, int] = (16, 96)
    output_len: tuple[int, int] = (16, 64)
    think_s: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        _check_at_least("num_conversations", self.num_conversations, 1)
        _check_at_least("turns", self.turns, 1)
        _check_at_least("system_len", self.system_len, 0)
        _check_range("message_len", self.message_len)
        _check_range("output_len", self.output_len)
        if self.think_s < 0:
            raise ValueError(f"think_s must be >= 0, got {self.think_s}")

    @property
    def num_requests(self) -> int:
        return self.num_conversations * self.turns

    @property
    def max_total_len(self) -> int:
        return self.system_len + self.turns * (self.message_len[1] + self.output_len[1])

    def history_blocks(self, block_size: int) -> int:
        """The KV blocks of every conversation's whole history (its last prompt and answer) as a prefix cache
        holds them: the shared system prompt's full blocks once, each conversation's own blocks after them. What
        a pool would need to keep every conversation for its next turn."""
        reqs = self.requests(LOWEST_ORDINARY_ID + 1, 1.0)
        c = self.num_conversations
        shared = self.system_len // block_size
        tokens = [sum(len(reqs[t * c + conv].prompt_token_ids) + reqs[t * c + conv].output_len
                      for t in range(self.turns)) for conv in range(c)]
        return shared + sum(-(-n // block_size) - shared for n in tokens)

    def requests(self, vocab_size: int, rate: float) -> list[TimedRequest]:
        lengths, ids, arrivals = _streams(self.seed)
        c, t = self.num_conversations, self.turns
        message_lens = log_uniform_ints(lengths, *self.message_len, c * t)
        output_lens = log_uniform_ints(lengths, *self.output_len, c * t)
        starts = _scaled(_unit_arrivals(arrivals, c), rate)
        thinks = arrivals.exponential(self.think_s, c * t) if self.think_s > 0 else [0.0] * (c * t)
        system = _token_ids(ids, vocab_size, self.system_len)
        out = []
        for turn in range(t):
            kind = "turn 1" if turn == 0 else "turn 2" if turn == 1 else "turns 3+"
            for conv in range(c):
                i = turn * c + conv
                message = _token_ids(ids, vocab_size, int(message_lens[i]))
                out.append(TimedRequest(i, (system + message) if turn == 0 else message, int(output_lens[i]),
                                        starts[conv], kind, follows=None if turn == 0 else i - c,
                                        think_s=0.0 if turn == 0 else float(thinks[i])))
        return out

    def describe(self) -> str:
        return (f"{self.num_conversations} conversations of {self.turns} turns after one shared "
                f"{self.system_len}-token system prompt, messages {_spread(self.message_len)}, answers "
                f"{_spread(self.output_len)}, think time {self.think_s:g} s (exponential mean) between turns; "
                f"--rate: new conversations per second")


def log_uniform_ints(rng: np.random.Generator, low: int, high: int, n: int) -> np.ndarray:
    """``n`` integers in ``[low, high]``: floor(exp(u)) with u uniform on [ln low, ln(high + 1))."""
    import numpy as np

    u = rng.uniform(math.log(low), math.log(high + 1), n)
    return np.minimum(np.floor(np.exp(u)).astype(np.int64), high)


def log_uniform_mean(low: int, high: int) -> float:
    """The exact mean of ``log_uniform_ints(., low, high, .)``: P(k) = ln((k + 1) / k) / ln((high + 1) / low)."""
    norm = math.log((high + 1) / low)
    return sum(k * math.log((k + 1) / k) for k in range(low, high + 1)) / norm


def _unit_arrivals(rng: np.random.Generator, n: int, mean_gap: float = 1.0, after: float | None = None,
                   ) -> np.ndarray:
    """``n`` arrivals of a Poisson process in unit time (the rate's stream has mean gap 1): the first at 0,
    or, for a process that begins ``after``, the first one exponential wait after it."""
    import numpy as np

    if after is None:
        return np.concatenate([[0.0], np.cumsum(rng.exponential(mean_gap, n - 1))])
    return after + np.cumsum(rng.exponential(mean_gap, n))


def _scaled(unit: np.ndarray, rate: float) -> list[float]:
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if math.isinf(rate):
        return [0.0] * len(unit)
    return [float(t) for t in unit * (1.0 / rate)]  # a positive factor keeps the unit-time order


def _token_ids(rng: np.random.Generator, vocab_size: int, n: int) -> tuple[int, ...]:
    """``n`` ids uniform in ``[min(100, vocab_size // 2), vocab_size)``."""
    return tuple(rng.integers(min(LOWEST_ORDINARY_ID, vocab_size // 2), vocab_size, n).tolist())


def _streams(seed: int) -> list[np.random.Generator]:
    import numpy as np

    # Lengths, ids, arrivals: independent, so one changes without shifting the others.
    return [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3)]


def _spread(bounds: tuple[int, int]) -> str:
    lo, hi = bounds
    return f"{lo}-{hi} tokens (log-uniform, mean {log_uniform_mean(lo, hi):.0f})"


def _check_at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def _check_range(name: str, bounds: tuple[int, int]) -> None:
    lo, hi = bounds
    if not 1 <= lo <= hi:
        raise ValueError(f"{name} must be a range 1 <= low <= high, got {lo}..{hi}")


@dataclass(frozen=True)
class WorkloadPreset:
    """A workload as measured (``full``) and a smaller, shorter one (``quick``, about a minute), and the
    latency SLO its goodput is judged by unless the run names another (``--goodput``, ``--slo``)."""

    full: Workload
    quick: Workload
    slo: SLO


# The default SLOs: a few times what a lightly loaded request of the workload takes with SmolLM2-135M on
# the 2-core development machine, one core per node (fp32): chats of up to 512 prompt tokens TTFT 2.5 s;
# questions behind a cached system prompt 1.5 s; the mixed workload's long prompts (1-1.5k tokens, ~2 s of
# prefill on one core) 4 s. TPOT 200 ms everywhere: a reader's pace is ~5 tokens/s, and a colocated
# engine's decodes stalled behind a 512-token prefill chunk miss it.
WORKLOADS: Mapping[str, WorkloadPreset] = {p.full.name: p for p in (
    WorkloadPreset(ServingWorkload(), ServingWorkload(num_requests=12, prompt_len=(32, 256), output_len=(16, 64)),
                   SLO(ttft_s=2.5, tpot_s=0.2)),
    WorkloadPreset(SharedPrefixWorkload(), SharedPrefixWorkload(num_requests=12, prefix_len=256,
                                                                question_len=(16, 32), output_len=(16, 32)),
                   SLO(ttft_s=1.5, tpot_s=0.2)),
    # Quick: 10 short + 2 long, every request within a 1024-token context (the tiny test models').
    WorkloadPreset(MixedWorkload(), MixedWorkload(num_requests=12, short_prompt_len=(32, 96),
                                                  short_output_len=(32, 64), long_prompt_len=(512, 768)),
                   SLO(ttft_s=4.0, tpot_s=0.2)),
    # Quick: 4 conversations of 3 turns within a 1024-token context (the tiny test models').
    WorkloadPreset(MultiTurnWorkload(), MultiTurnWorkload(num_conversations=4, turns=3, system_len=64,
                                                          message_len=(16, 32), output_len=(16, 32), think_s=0.2),
                   SLO(ttft_s=2.5, tpot_s=0.2)),
)}
