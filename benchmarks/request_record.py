"""What the serving benchmark's client saw of one request, whichever front it used."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    """What the client saw of one request (``time.perf_counter`` seconds)."""

    index: int
    kind: str
    prompt_len: int
    expected_tokens: int
    target: str = ""
    sent: float = 0.0
    first: float | None = None  # the first message carrying tokens
    last: float | None = None
    num_tokens: int = 0
    num_messages: int = 0
    gaps: list[float] = field(default_factory=list)  # between consecutive token-carrying messages
    # The server's own account, from the last message's timings: admission to the start of the prefill
    # compute, and the KV transfer from prefill to decode node (0 when colocated).
    queue_s: float | None = None
    kv_transfer_s: float | None = None
    error: str = ""
    output_ids: list[int] = field(default_factory=list)  # the generated tokens (gRPC), a later turn's history

    @property
    def ok(self) -> bool:
        return not self.error and self.first is not None

    @property
    def ttft_s(self) -> float | None:
        """Sent -> first token; None unless the request completed."""
        return self.first - self.sent if self.ok and self.first is not None else None

    @property
    def tpot_s(self) -> float | None:
        """(last token - first token) / (tokens - 1); None unless completed with two tokens or more."""
        if not self.ok or self.first is None or self.last is None or self.num_tokens < 2:
            return None
        return (self.last - self.first) / (self.num_tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        return self.last - self.sent if self.ok and self.last is not None else None
