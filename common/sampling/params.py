"""Per-request sampling parameters, validated with errors that name the field and the limit."""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import InvalidRequestError

MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 64
MAX_SPECULATIVE_TOKENS = 16


class SamplingParamsError(InvalidRequestError):
    """A caller mistake in sampling parameters; ``field`` names the offending field."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. ``temperature == 0`` means greedy.

    ``top_k`` / ``logprobs`` / ``seed`` use ``None`` for "off", never a -1 sentinel.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return beside the sampled token
    # Speculative tokens per step for this request: None = the deployment's setting, 0 = off.
    num_speculative_tokens: int | None = None
    # A migrated request (gateway/coordinator.py): the prompt's last N tokens are its own earlier output.
    # Penalties count them as output and seeded randomness continues at their position (sampler.py), so the
    # rest samples what an undisturbed run would. Set by the gateway (internal requests), never by clients.
    resumed_output_tokens: int = 0

    def __post_init__(self) -> None:
        _check(0.0 <= self.temperature <= 100.0, "temperature", f"must be in [0, 100], got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k is None or self.top_k >= 1, "top_k", f"must be >= 1 (or unset), got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(0.0 < self.repetition_penalty <= 10.0, "repetition_penalty",
               f"must be in (0, 10], got {self.repetition_penalty}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.seed is None or 0 <= self.seed < 2**63, "seed", f"must be in [0, 2^63), got {self.seed}")
        _check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
               f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "ids must be >= 0")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
               f"must be in [0, {MAX_LOGPROBS}] (or unset), got {self.logprobs}")
        _check(self.num_speculative_tokens is None or 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
               "num_speculative_tokens",
               f"must be in [0, {MAX_SPECULATIVE_TOKENS}] (or unset), got {self.num_speculative_tokens}")
        _check(self.resumed_output_tokens >= 0, "resumed_output_tokens",
               f"must be >= 0, got {self.resumed_output_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def can_speculate(self) -> bool:
        """Verification scores several positions at once, so history-dependent processing rules it out."""
        return not self.has_penalties and self.logprobs is None and self.num_speculative_tokens != 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Checks that need the model: token ids must exist."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        _check(not bad, "stop_token_ids", f"ids must be < vocab_size={vocab_size}, got {bad[:4]}")


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise SamplingParamsError(field, message)
