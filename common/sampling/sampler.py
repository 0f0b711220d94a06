"""A batched sampler with per-request parameters and per-request seeded randomness.

Order of processing (as Hugging Face's warpers): penalties -> min_tokens mask -> temperature ->
top-k -> top-p -> min-p -> sample. Returned logprobs are the model's raw log-softmax (before any of
that processing), as vLLM returns them by default.

Determinism: a seeded request's randomness is a function of (seed, output position, use), never a generator's
running state (``seeded_uniform``): the token at output position i is drawn with the same uniform whichever
node samples it, whoever shares the batch, however many draws speculation made before. So a request that
continues on another node (the gateway's migration: the prompt then ends with ``resumed_output_tokens`` of
its own output) samples what the undisturbed run would have, and a prefill node's first token and a decode
node's next ones never reuse one draw. Unseeded requests draw from the global RNG.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from common.sampling.params import SamplingParams

# What a seeded request's uniform at one output position is for (``seeded_uniform``'s ``use``).
SAMPLE = 0  # the token sampled at the position (and a speculative step's correction or bonus token there)
ACCEPT = 1  # the acceptance test of a draft at the position
DRAFT = 2  # a draft model's sampling of its proposal for the position

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit integers whose outputs pass BigCrush as a stream."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, position: int, use: int = SAMPLE) -> float:
    """The uniform in [0, 1) (53 bits) a request seeded with ``seed`` uses at output ``position`` for ``use``.

    Counter-based (a hash of the three), so it needs no state to resume: any node computes the same number.
    """
    return (_mix64(_mix64(_mix64(seed) ^ position) ^ use) >> 11) * 2.0**-53


@dataclass
class RequestSamplingState:
    """What the sampler needs to know about one running request (owned by the engine)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)

    @staticmethod
    def create(params: SamplingParams, prompt_token_ids: list[int], eos_token_ids: tuple[int, ...] = (),
               device: torch.device | str = "cpu") -> RequestSamplingState:
        return RequestSamplingState(params, list(prompt_token_ids), tuple(eos_token_ids), [])

    @property
    def seed(self) -> int | None:
        return self.params.seed

    @property
    def position(self) -> int:
        """The output position of the next token sampled: a migrated request's earlier output counts."""
        return self.params.resumed_output_tokens + len(self.output_token_ids)

    def output_counted(self) -> list[int]:
        """The output penalties count: a migrated request's earlier output (the prompt's tail) and its new."""
        resumed = self.params.resumed_output_tokens
        earlier = self.prompt_token_ids[len(self.prompt_token_ids) - resumed:] if resumed else []
        return earlier + self.output_token_ids


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    # logprob of each sampled token and its top-n alternatives, for rows whose params ask for them
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum: the fused CPU kernel on CPU (common/model/fused_ops.py's ``argmax_rows``:
    faster than torch's argmax and max on logits fresh from the LM head), else ``max``'s indices (argmax's
    answer in less time). Measured: benchmarks/results/2026-12-02-amx-offline/RESULTS.md,
    benchmarks/results/figures-from-code.md."""
    from common.model.fused_ops import fused_ops_for

    return fused_ops_for(logits.device).argmax_rows(logits)


class Sampler:
    """Sample one next token per row of a ``[batch, vocab]`` fp32 logits tensor."""

    def __call__(self, logits: torch.Tensor, states: list[RequestSamplingState]) -> SampleResult:
        # logits: [batch, vocab] fp32
        assert logits.shape[0] == len(states)
        params = [s.params for s in states]
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        if any(p.has_penalties for p in params) or any(
            len(s.output_token_ids) < s.params.min_tokens for s in states
        ):
            # (a migrated request's min_tokens already counts its earlier output: the gateway lowered it)
            logits = logits.clone()
            self._apply_penalties_and_min_tokens(logits, states)

        if all(p.greedy for p in params):
            token_ids = greedy_tokens(logits)
        else:
            token_ids = self._sample(logits, states)
        tokens: list[int] = token_ids.tolist()
        return SampleResult(tokens, *self._logprobs(raw_logprobs, tokens, params))

    @staticmethod
    def _apply_penalties_and_min_tokens(logits: torch.Tensor, states: list[RequestSamplingState]) -> None:
        vocab = logits.shape[1]
        for row, s in enumerate(states):
            p = s.params
            if p.has_penalties and (s.output_token_ids or s.prompt_token_ids):
                out = torch.tensor(s.output_counted(), dtype=torch.long, device=logits.device)
                counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
                if p.repetition_penalty != 1.0:
                    # CTRL-style: applies to prompt and output tokens; divide positive logits, multiply negative
                    seen = torch.tensor(s.prompt_token_ids + s.output_token_ids, dtype=torch.long,
                                        device=logits.device).unique()
                    vals = logits[row, seen]
                    logits[row, seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                                    vals * p.repetition_penalty)
                logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
            if len(s.output_token_ids) < p.min_tokens:
                banned = [t for t in (*s.eos_token_ids, *p.stop_token_ids) if t < vocab]
                if banned:
                    logits[row, banned] = float("-inf")

    @staticmethod
    def _sample(logits: torch.Tensor, states: list[RequestSamplingState]) -> torch.Tensor:
        device = logits.device
        params = [s.params for s in states]
        if device.type == "cpu" and not any(p.top_k is not None or p.top_p < 1.0 or p.min_p > 0 for p in params):
            # Temperature only (what OpenAI clients send by default): one fused pass per row on CPU, no [n, V]
            # probabilities nor fp64 CDF (common/model/fused_ops.py's sample_rows; the same distribution).
            from common.model.fused_ops import fused_ops_for

            temps = torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)
            return fused_ops_for(device).sample_rows(logits, temps, row_uniforms(states, device))
        greedy = torch.tensor([s.params.greedy for s in states], device=device)
        probs = target_probs(logits, [s.params for s in states])  # [batch, vocab]
        sampled = sample_from(probs, row_uniforms(states, device))
        return torch.where(greedy, logits.argmax(dim=-1), sampled)

    @staticmethod
    def _logprobs(
        raw: torch.Tensor | None, tokens: list[int], params: list[SamplingParams]
    ) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
        n = len(tokens)
        if raw is None:
            return [None] * n, [None] * n
        rows = torch.arange(n, device=raw.device)
        chosen = raw[rows, torch.tensor(tokens, device=raw.device)].tolist()
        k = max(p.logprobs or 0 for p in params)
        top_vals, top_ids = raw.topk(k, dim=-1) if k else (raw[:, :0], raw[:, :0].long())
        top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
        out_lp: list[float | None] = []
        out_top: list[list[tuple[int, float]] | None] = []
        for i, p in enumerate(params):
            if p.logprobs is None:
                out_lp.append(None)
                out_top.append(None)
            else:
                out_lp.append(chosen[i])
                out_top.append(list(zip(top_ids_l[i][: p.logprobs], top_vals_l[i][: p.logprobs], strict=True)))
        return out_lp, out_top


def row_uniforms(states: Sequence[RequestSamplingState], device: torch.device) -> torch.Tensor:
    """One uniform in [0, 1) per row (fp64): a seeded request's ``seeded_uniform`` at its next output position,
    so its tokens do not depend on what else is in the batch nor on which node samples; the others' from the
    global RNG."""
    seeded = [i for i, s in enumerate(states) if s.seed is not None]
    if not seeded:
        return torch.rand(len(states), dtype=torch.float64, device=device)
    values = torch.rand(len(states), dtype=torch.float64).tolist() if len(seeded) < len(states) else \
        [0.0] * len(states)
    for i in seeded:
        s = states[i]
        assert s.seed is not None
        values[i] = seeded_uniform(s.seed, s.position)
    return torch.tensor(values, dtype=torch.float64, device=device)


def sample_from(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` (``[batch, vocab]``, non-negative, each row with positive mass, not
    necessarily normalised) by inverting its CDF at ``uniform`` (``[batch]`` in [0, 1)).

    One random number per row, where an exponential race (Gumbel-max) draws one per vocabulary entry, which
    at 49,152 entries cost a CPU step at batch 8 far more than this does (before and after:
    benchmarks/results/2026-12-03-serve-vllm/RESULTS.md, benchmarks/results/figures-from-code.md). The
    CDF is summed in fp64, so the chosen token's probability is exact to ~1e-12; a zero-probability token
    is never chosen (its CDF step is empty and the search takes the first entry strictly above the draw).
    Temperature-only batches on CPU skip this for the fused kernel (``FusedOps.sample_rows``: the same CDF
    inverted without the [batch, vocab] fp64 temporaries).
    """
    from common.model.fused_ops import inverse_cdf

    return inverse_cdf(probs, uniform)


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: temperature -> top-k -> top-p -> min-p, as ``Sampler`` does.

    ``logits``: ``[batch, vocab]`` fp32, one row per entry of ``params``. Returns ``[batch, vocab]`` fp32
    probabilities that sum to 1 per row; a greedy row (temperature 0) is a one-hot at its argmax.

    Penalties and the ``min_tokens`` mask are *not* applied: they depend on the tokens generated so far,
    so the caller applies them to ``logits`` first (``Sampler`` does). Speculative verification scores
    several positions at once and does not, which is why the engine switches speculation off for requests
    with penalties or whose ``min_tokens`` is not yet reached.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(params)
    device = logits.device
    # Greedy rows are scaled by 1 here and replaced by a one-hot at the end.
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
    scaled = logits / temps.unsqueeze(1)

    if any(p.top_k is not None or p.top_p < 1.0 for p in params):
        scaled = _top_k_top_p(scaled, params)
    probs = torch.softmax(scaled, dim=-1)  # [batch, vocab]
    min_ps = torch.tensor([p.min_p for p in params], device=device)
    if bool((min_ps > 0).any()):
        threshold = min_ps.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < threshold, torch.zeros_like(probs), probs)
        # The top token always survives (min_p <= 1), so every row keeps positive mass.
        probs = probs / probs.sum(dim=-1, keepdim=True)

    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        rows = torch.tensor(greedy, device=device)
        one_hot = torch.zeros((len(greedy), logits.shape[1]), dtype=probs.dtype, device=device)
        one_hot[torch.arange(len(greedy), device=device), logits[rows].argmax(dim=-1)] = 1.0
        probs[rows] = one_hot
    return probs


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p (nucleus) sets with -inf."""
    vocab = logits.shape[1]
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=device)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    remove = ranks >= ks.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    top_ps = torch.tensor([p.top_p for p in params], device=device, dtype=logits.dtype)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # A token is kept if the mass strictly before it is < top_p: the top token is always kept.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_ps.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
