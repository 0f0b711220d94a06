"""Exact verification of speculated tokens for a batch: greedy prefix matching and speculative sampling.

Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): draft ``d_j`` drawn from ``q_j`` is
accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection the token is drawn from
``normalize(max(p_j - q_j, 0))``; if every draft is accepted a bonus token is drawn from ``p_k``. Every
emitted token then follows the target distribution ``p`` exactly, whatever ``q`` is, as long as the drafts
really were drawn from ``q`` (a deterministic proposer such as n-gram lookup is a point mass).

Randomness: a seeded request's draft at output position t is accepted or not with ``seeded_uniform(seed, t,
ACCEPT)``, and the token that ends the step (the correction or the bonus) at position t is drawn with
``seeded_uniform(seed, t, SAMPLE)``, whatever the outcome and whoever shares the batch, so a seeded request's
tokens do not depend on its batch neighbours (no decision reuses a uniform an earlier one used: positions only
advance past the ones decided). The final token is picked the way ``Sampler`` picks one (the distribution's
CDF inverted at that uniform: ``common.sampling.sampler.sample_from``), so a request with no drafts gets the
same token as a plain ``Sampler`` step. Unseeded requests draw from the global RNG; greedy ones draw nothing.

Penalties and the ``min_tokens`` mask are not applied (see ``target_probs``): the engine does not
speculate for requests that use them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.sampling.sampler import ACCEPT, SAMPLE, RequestSamplingState, sample_from, seeded_uniform, target_probs


@dataclass(frozen=True)
class VerifyResult:
    # Per request: the accepted drafts followed by one more token (the correction at the first rejection,
    # or the bonus token when all drafts were accepted), so always num_accepted[i] + 1 tokens. Stop tokens
    # and max_tokens are not applied here; the engine truncates as for any other output.
    token_ids: list[list[int]]
    num_accepted: list[int]  # drafts accepted per request


def verify(
    target_logits: torch.Tensor,
    draft_token_ids: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    states: list[RequestSamplingState],
) -> VerifyResult:
    """Accept or reject each request's drafts against the target model and emit one more token.

    ``target_logits``: ``[sum_i (k_i + 1), vocab]`` fp32, request after request; request ``i`` owns
    ``k_i + 1`` consecutive rows: row ``j`` is the target's distribution for the position of draft ``j``
    (given the context and drafts ``0..j-1``), the last row the one after all drafts.
    ``draft_token_ids[i]``: the ``k_i`` proposed tokens (``k_i`` may be 0).
    ``draft_probs[i]``: ``[k_i, vocab]`` normalised distribution the drafts were sampled from (row ``j``
    given drafts ``0..j-1``), or ``None`` for a deterministic proposer (a point mass at each draft).
    Ignored for greedy requests.
    ``states``: the requests; none may use penalties or be below ``min_tokens`` (the engine's rule).
    """
    num_reqs = len(states)
    assert len(draft_token_ids) == num_reqs and len(draft_probs) == num_reqs
    ks = [len(d) for d in draft_token_ids]
    assert target_logits.dim() == 2 and target_logits.shape[0] == sum(ks) + num_reqs, (
        f"target_logits has {target_logits.shape[0]} rows, expected sum(k_i + 1) = {sum(ks) + num_reqs}")
    vocab = target_logits.shape[1]
    for i, s in enumerate(states):
        assert not s.params.has_penalties, f"request {i}: speculation with penalties is not exact"
        assert len(s.output_token_ids) >= s.params.min_tokens, f"request {i}: min_tokens not reached"
        assert all(0 <= t < vocab for t in draft_token_ids[i]), f"request {i}: draft token out of vocab"
        q = draft_probs[i]
        assert q is None or tuple(q.shape) == (ks[i], vocab), f"request {i}: draft_probs shape {tuple(q.shape)}"

    starts: list[int] = []  # first row of each request in target_logits
    row = 0
    for k in ks:
        starts.append(row)
        row += k + 1

    token_ids: list[list[int]] = [[] for _ in range(num_reqs)]
    num_accepted = [0] * num_reqs
    greedy = [i for i in range(num_reqs) if states[i].params.greedy]
    sampled = [i for i in range(num_reqs) if not states[i].params.greedy]

    if greedy:
        greedy_rows = [starts[i] + j for i in greedy for j in range(ks[i] + 1)]
        argmax: list[int] = target_logits[greedy_rows].argmax(dim=-1).tolist()
        offset = 0
        for i in greedy:
            drafts, best = draft_token_ids[i], argmax[offset : offset + ks[i] + 1]
            offset += ks[i] + 1
            n = 0
            while n < ks[i] and drafts[n] == best[n]:
                n += 1
            token_ids[i] = [*drafts[:n], best[n]]
            num_accepted[i] = n

    if sampled:
        accepted, final = _speculative_sampling(
            target_logits, [starts[i] for i in sampled], [draft_token_ids[i] for i in sampled],
            [draft_probs[i] for i in sampled], [states[i] for i in sampled])
        for i, n, t in zip(sampled, accepted, final, strict=True):
            token_ids[i] = [*draft_token_ids[i][:n], t]
            num_accepted[i] = n
    return VerifyResult(token_ids, num_accepted)


def _speculative_sampling(
    target_logits: torch.Tensor,
    starts: list[int],
    drafts: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    states: list[RequestSamplingState],
) -> tuple[list[int], list[int]]:
    """Returns (drafts accepted, final token) per request; all requests here sample (temperature > 0)."""
    device = target_logits.device
    num_reqs = len(states)
    ks = [len(d) for d in drafts]
    max_k = max(ks)

    # p: [num_rows, vocab], this subset's rows of target_logits in order, processed with each request's params.
    rows = [start + j for start, k in zip(starts, ks, strict=True) for j in range(k + 1)]
    row_params = [s.params for s, k in zip(states, ks, strict=True) for _ in range(k + 1)]
    # rows ascend, so when every row is here they are target_logits itself: skip the copy.
    p = target_probs(target_logits if len(rows) == target_logits.shape[0] else target_logits[rows], row_params)
    local_starts: list[int] = []
    row = 0
    for k in ks:
        local_starts.append(row)
        row += k + 1

    # Padded [num_reqs, pad] views of the drafts; padding positions are never accepted.
    pad = max(max_k, 1)  # keeps the gathers below in bounds when no request has drafts
    draft = torch.tensor([d + [0] * (pad - len(d)) for d in drafts], dtype=torch.long, device=device)
    k_t = torch.tensor(ks, dtype=torch.long, device=device)  # [num_reqs]
    positions = torch.arange(pad, device=device).unsqueeze(0)  # [1, pad]
    valid = positions < k_t.unsqueeze(1)  # [num_reqs, pad]
    local_start = torch.tensor(local_starts, dtype=torch.long, device=device)  # [num_reqs]
    # Row of p for (request, position j), clamped to the request's last row for padding.
    p_row = local_start.unsqueeze(1) + torch.minimum(positions, k_t.unsqueeze(1))  # [num_reqs, pad]

    # q: the drafts' distributions, concatenated for the requests that have one; a point mass otherwise.
    dense = [q is not None and k > 0 for q, k in zip(draft_probs, ks, strict=True)]
    has_q = torch.tensor(dense, dtype=torch.bool, device=device)  # [num_reqs]
    q_all: torch.Tensor | None = None
    q_row = torch.zeros((num_reqs, pad), dtype=torch.long, device=device)  # row of q_all; 0 where not dense
    if any(dense):
        q_all = torch.cat([q.to(device=device, dtype=p.dtype) for q, d in zip(draft_probs, dense, strict=True)
                           if q is not None and d])  # [sum of dense k_i, vocab]
        q_len = k_t * has_q  # [num_reqs]
        q_start = q_len.cumsum(0) - q_len
        q_row = torch.where(valid & has_q.unsqueeze(1), q_start.unsqueeze(1) + positions, q_row)

    # Randomness: per request, an acceptance uniform per draft position and a final-token uniform for each
    # position the step may end at (the one after the accepted prefix is picked below). fp64: [num_reqs, pad]
    # and [num_reqs, pad + 1].
    uniform = torch.rand((num_reqs, pad), dtype=torch.float64, device=device)
    final_uniforms = torch.rand((num_reqs, pad + 1), dtype=torch.float64, device=device)
    seeded = [i for i, s in enumerate(states) if s.seed is not None]
    if seeded:
        accepts, finals = [], []
        for i in seeded:
            seed, base = states[i].seed, states[i].position
            assert seed is not None
            accepts.append([seeded_uniform(seed, base + j, ACCEPT) for j in range(pad)])
            finals.append([seeded_uniform(seed, base + j, SAMPLE) for j in range(pad + 1)])
        index = torch.tensor(seeded, device=device)
        uniform[index] = torch.tensor(accepts, dtype=torch.float64, device=device)
        final_uniforms[index] = torch.tensor(finals, dtype=torch.float64, device=device)

    # Accept d_j with probability min(1, p(d_j) / q(d_j)): u * q < p avoids dividing by q.
    p_draft = p[p_row, draft]  # [num_reqs, pad]
    q_draft = torch.ones_like(p_draft)
    if q_all is not None:
        q_draft = torch.where(has_q.unsqueeze(1), q_all[q_row, draft], q_draft)
    accept = (uniform * q_draft < p_draft) & valid  # [num_reqs, pad]
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [num_reqs]: length of the accepted prefix

    # The final token's distribution: the residual max(p - q, 0) at the first rejection, else p at the bonus row.
    rows_idx = torch.arange(num_reqs, device=device)
    rejected = num_accepted < k_t  # [num_reqs]
    at = num_accepted.clamp(max=pad - 1)  # position of the rejection (clamped: unused when not rejected)
    p_final = p[local_start + num_accepted]  # [num_reqs, vocab]
    q_final = torch.zeros_like(p_final)
    q_final[rows_idx, draft[rows_idx, at]] = 1.0  # point mass at the rejected draft
    if q_all is not None:
        q_final = torch.where(has_q.unsqueeze(1), q_all[q_row[rows_idx, at]], q_final)
    residual = (p_final - q_final * rejected.unsqueeze(1).to(p_final.dtype)).clamp(min=0.0)
    # p <= q everywhere only when p == q up to rounding, and then rejection is a rounding artefact: use p.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p_final, residual)
    final_uniform = final_uniforms[rows_idx, num_accepted]  # [num_reqs]: at the position the step ends at
    final = sample_from(residual, final_uniform)  # inverse CDF: needs no normalisation

    out: list[list[int]] = torch.stack([num_accepted, final]).tolist()
    return out[0], out[1]
