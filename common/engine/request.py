"""A request as the engines track it: tokens so far, how many have KV, and why it ended."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from common.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued for (re)computation of its KV
    WAITING_FOR_KV = "waiting_for_kv"  # decode node: blocks reserved, a remote prefill is filling them
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens or the model's length limit
    ABORT = "abort"  # cancelled by the caller or failed


@dataclass
class Request:
    """Mutable per-request state, owned by one scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    # Its prompt's KV is computed by another node and pushed here (vLLM's do_remote_prefill); the node's
    # KVConnector decides what that means (a decode node: wait for the KV before decoding).
    remote_prefill: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens (prompt + output) whose KV is in the cache; the rest must be computed before sampling.
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    arrival_seq: int = 0  # the scheduler's arrival order (add_request)
    prefill_skips: int = 0  # steps in a row it got no prefill chunk while a later arrival got one
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Speculative decoding: running acceptance-rate estimate (drives adaptive k) and counters.
    spec_acceptance: float = 0.6
    # ... and of the chance a draft after an accepted one is accepted too (None: the prior, economics')
    spec_continuation: float | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def __post_init__(self) -> None:
        assert self.prompt_token_ids, "a request needs at least one prompt token"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens ``start..stop-1`` of prompt + output, without building the concatenation."""
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def counters(self) -> RequestCounters:
        return RequestCounters(self.first_scheduled_time, self.num_preemptions, self.num_draft_tokens,
                               self.num_accepted_tokens)

    def check_stop(self, max_model_len: int) -> FinishReason | None:
        """Why the request must stop after its latest token, if it must."""
        last = self.output_token_ids[-1]
        n_out = len(self.output_token_ids)
        p = self.params
        if n_out >= p.min_tokens and (
            last in p.stop_token_ids or (not p.ignore_eos and last in self.eos_token_ids)
        ):
            return FinishReason.STOP
        if n_out >= p.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None


@dataclass(frozen=True)
class RequestCounters:
    """A request's engine-side counters, as its servicer reports them in spans and metrics."""

    first_scheduled_time: float | None  # time.monotonic() when it was first admitted for compute
    num_preemptions: int
    num_draft_tokens: int
    num_accepted_tokens: int


@dataclass(frozen=True)
class RequestOutput:
    """What one engine step produced for one request: new tokens, and the end if it ended."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    # per new token: (logprob of the token, top alternatives) when the request asked for logprobs
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    counters: RequestCounters | None = None  # on the request's last output
    # A queued request was admitted to wait for its KV from another node: the blocks to fill (no tokens yet).
    reserved_block_ids: tuple[int, ...] | None = None
