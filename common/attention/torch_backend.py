"""PyTorch attention: the CPU serving path and the oracle every other backend is tested against.

Three shapes of batch, three code paths:

- prefill-only (no sequence has cached context): causal SDPA over the new tokens, one call per
  sequence; the paged cache is only written, never read.
- decode-only (one new token per sequence): the hot path on CPU. The compiled kernel
  (``cpu_decode.cpp``) reads K/V in place through the block table when it builds here; otherwise
  sequences are processed in chunks whose gathered K/V stay about 2 MiB, in reused scratch buffers, so
  the gather stays in cache and is never page-faulted in afresh (one 100 MiB gather per call is much slower:
  benchmarks/results/figures-from-code.md).
- anything else: chunks of up to ``EXTEND_AS_DECODE_ROWS`` tokens over a cached prefix (speculative
  verification, a draft model's catch-up) run as decode rows, one per token, each over the prefix up to
  itself; longer chunks (chunked prefill over a cached prefix) as one masked SDPA per sequence over K/V
  gathered through its block table.

Every path takes the layer's sliding ``window`` (None: the whole sequence): a token at position p attends to
positions ``p - window + 1 .. p`` (itself and the ``window - 1`` before it: transformers' sliding-window mask),
and Gemma 2's ``softcap`` (scores -> softcap * tanh(scores / softcap) before the mask, as transformers' eager
attention): SDPA has no soft-cap, so such a layer's prefill and extend compute the scores explicitly, and its
decode rows take the PyTorch path (the compiled decode kernel has no soft-cap either).

``reference_paged_attention`` is the slow, obviously-correct loop the tests compare against.
"""

from __future__ import annotations

import logging
import math
from types import ModuleType

import torch
import torch.nn.functional as F

from common.attention.backend import AttentionBackend
from common.attention.metadata import AttentionMetadata
from common.kernels.cpu import paged_decode_kernel
from common.kv.kv_cache import write_kv

log = logging.getLogger(__name__)

# Gathered K+V bytes per decode chunk: small enough to stay in L2/L3, large enough that per-op
# overhead is noise (measured best at 1-2 sequences of 1k tokens per chunk for SmolLM2 shapes).
DECODE_CHUNK_BYTES = 2 << 20
# Chunks over a cached prefix up to this many tokens run as decode rows (measured on SmolLM2 shapes: a 5-row
# verification's attention as decode rows costs a fraction of one masked SDPA's;
# benchmarks/results/2026-12-01-panels/RESULTS.md, benchmarks/results/figures-from-code.md).
EXTEND_AS_DECODE_ROWS = 32


class TorchAttentionBackend(AttentionBackend):
    """Attention in plain PyTorch; correct on any device, fast enough to serve on CPU."""

    name = "torch"
    supports_softcap = True

    def __init__(self, decode_chunk_bytes: int = DECODE_CHUNK_BYTES, compiled_decode: bool = True) -> None:
        self.decode_chunk_bytes = decode_chunk_bytes
        self.workspace = Workspace()
        # Decode on CPU through the compiled kernel (cpu_decode.cpp, built on first use) when it builds here.
        self.compiled_decode = compiled_decode

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        if kv_cache is not None and meta.slot_mapping is not None:
            self._write_kv(kv_cache[0], kv_cache[1], key, value, meta.slot_mapping)
        plain_decode = meta.is_decode_only and meta.num_tokens == meta.num_seqs
        compiled = None if plain_decode else self._prefill_kernel(query, kv_cache, meta, softcap)
        if meta.is_prefill_only and compiled is None:
            return prefill_attention(query, key, value, meta.query_lens_cpu, scale, window, softcap)
        if kv_cache is None or meta.block_tables is None:
            raise ValueError("sequences with cached context need kv_cache and meta.block_tables")
        key_cache, value_cache = kv_cache
        if compiled is not None and meta.is_prefill_only:
            return self._prefill_compiled(compiled, query, key_cache, value_cache, meta, scale, window)
        if plain_decode:
            return self._decode(query, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.seq_lens_cpu,
                                scale, window, softcap)
        # Short chunks over a cached prefix (speculative verification, a draft model's catch-up, plain decode
        # rows beside a prefill chunk): each row is a decode row over the prefix up to and including itself
        # (its K/V is written above), so the decode kernel runs them all in one call: the same kernel and
        # lengths as plain decoding (verification rows equal plain decode rows), and no per-sequence SDPA.
        short = [i for i, q in enumerate(meta.query_lens_cpu) if q <= EXTEND_AS_DECODE_ROWS]
        if not short:
            if compiled is not None:
                return self._prefill_compiled(compiled, query, key_cache, value_cache, meta, scale, window)
            return paged_extend_attention(query, key_cache, value_cache, meta, scale, window=window, softcap=softcap)
        rows, lens = _decode_rows(meta, short)
        chunk_lens = torch.tensor([meta.query_lens_cpu[i] for i in short], device=query.device)
        tables = meta.block_tables[torch.repeat_interleave(torch.tensor(short, device=query.device), chunk_lens)]
        lens_t = torch.tensor(lens, dtype=torch.int32, device=query.device)
        if len(short) == meta.num_seqs:  # every row: no gather, no scatter
            return self._decode(query, key_cache, value_cache, tables, lens_t, tuple(lens), scale, window, softcap)
        if compiled is not None:
            out = self._prefill_compiled(compiled, query, key_cache, value_cache, meta, scale, window, short)
        else:
            out = paged_extend_attention(query, key_cache, value_cache, meta, scale, skip=frozenset(short),
                                         window=window, softcap=softcap)
        row_index = torch.tensor(rows, device=query.device)
        out[row_index] = self._decode(query[row_index], key_cache, value_cache, tables, lens_t, tuple(lens), scale,
                                      window, softcap)
        return out

    def _prefill_kernel(self, query: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
                        meta: AttentionMetadata, softcap: float | None) -> ModuleType | None:
        """The compiled prefill / extend kernel (cpu_prefill_attn.cpp) where it serves this call: bf16 on a CPU
        with AMX, or bf16 (in AVX512-BF16 vectors, or widened to fp32) and fp32 on an AVX-512 / AVX2 build where
        it measured faster than SDPA here (``prefill_pays``), a paged cache of the query's dtype with block tables, no
        softcap, head_dim a multiple of 32 up to 256; else None (PyTorch's SDPA per sequence)."""
        if (not self.compiled_decode or query.device.type != "cpu" or query.dtype not in (torch.bfloat16, torch.float32)
                or softcap is not None or kv_cache is None or meta.block_tables is None
                or kv_cache[0].dtype != query.dtype or kv_cache[1].dtype != query.dtype
                or query.shape[-1] % 32 or query.shape[-1] > 256 or query.stride(-1) != 1
                or query.stride(1) != query.shape[-1]):
            return None
        kernel = paged_decode_kernel()
        if kernel is None:
            return None
        if query.dtype == torch.bfloat16 and kernel.prefill_amx_ready():
            return kernel
        if not kernel.prefill_f32_ready():
            return None
        key = (query.shape[1], kv_cache[0].shape[2], query.shape[2], query.dtype)
        if key not in _PREFILL_PAYS:
            _PREFILL_PAYS[key] = prefill_pays(kernel, *key)
        return kernel if _PREFILL_PAYS[key] else None

    @staticmethod
    def _prefill_compiled(kernel: ModuleType, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, window: int | None,
                     skip: list[int] | None = None) -> torch.Tensor:
        """Every sequence's new rows over its cached context and themselves (their K/V written), in AMX tiles (bf16)
        or FMA vectors (fp32); the rows of sequences in ``skip`` are left unwritten (the caller's decode rows)."""
        flags = torch.empty(0, dtype=torch.uint8)
        if skip:
            flags = torch.zeros(meta.num_seqs, dtype=torch.uint8)
            flags[skip] = 1
        tables = meta.block_tables
        assert tables is not None
        if tables.dtype != torch.int32:
            tables = tables.to(torch.int32)
        starts, lens = meta.query_start_loc, meta.seq_lens
        if starts.dtype != torch.int32 or lens.dtype != torch.int32:
            starts, lens = starts.to(torch.int32).contiguous(), lens.to(torch.int32).contiguous()
        return kernel.paged_prefill(query, key_cache, value_cache, tables, starts, lens, flags, scale, window or 0)

    def forward_with_sinks(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: tuple[torch.Tensor, torch.Tensor] | None, meta: AttentionMetadata, scale: float,
                           window: int | None, sinks: torch.Tensor) -> torch.Tensor:
        """``forward`` for a layer with attention sinks (gpt-oss): ``sinks`` ``[num_heads]``, one logit per query
        head beside every row's scores in the softmax, dropped after it (transformers' eager gpt-oss attention).
        One masked attention per sequence over its cached context and new tokens, in fp32 softmax: the correct
        path, not a fast one (sinks have no compiled kernel here)."""
        if kv_cache is not None and meta.slot_mapping is not None:
            self._write_kv(kv_cache[0], kv_cache[1], key, value, meta.slot_mapping)
        return sink_attention(query, key, value, kv_cache, meta, scale, window, sinks)

    def _write_kv(self, key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
        kernel = paged_decode_kernel() if self.compiled_decode and key.device.type == "cpu" else None
        if (kernel is not None and key.dtype == key_cache.dtype and key.stride(-1) == 1 and value.stride(-1) == 1
                and key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1):
            kernel.write_kv(key_cache, value_cache, key, value, slot_mapping)
        else:
            write_kv(key_cache, value_cache, key, value, slot_mapping)

    def _decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor, seq_lens_cpu: tuple[int, ...],
                scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        kernel = (paged_decode_kernel() if self.compiled_decode and query.device.type == "cpu" and softcap is None
                  and query.dtype in (torch.float32, torch.bfloat16) else None)
        if kernel is not None and key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1:
            tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
            lens = seq_lens if seq_lens.dtype in (torch.int32, torch.int64) else seq_lens.to(torch.int64)
            return kernel.paged_decode(query if query.is_contiguous() else query.contiguous(), key_cache, value_cache,
                                       tables, lens, scale, window or 0)
        return paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, seq_lens_cpu, scale,
                                      self.decode_chunk_bytes, self.workspace, window, softcap)


# (heads, KV heads, head_dim, dtype) -> whether the compiled prefill kernel's fp32 vectors measured faster than
# SDPA here.
_PREFILL_PAYS: dict[tuple[int, int, int, torch.dtype], bool] = {}
F32_PREFILL_PROBE_TOKENS = 256


def prefill_pays(kernel: ModuleType, heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32) -> bool:
    """Race the compiled prefill kernel in fp32 vectors (a bf16 query and cache widened to fp32: CPUs without
    AMX) against PyTorch's SDPA in ``dtype`` once per head shape (a 256-token prompt, best of five,
    alternating; a loss looked at twice more): its AVX-512 build measured 1.5-1.8x faster in fp32 on two Xeon
    cores (session 30), bf16 widened 1.9x faster than SDPA's bf16 for a 99-token turn over 496 cached tokens
    on a Zen 4 EPYC (session 34), its AVX2 build has no measurement on an AVX2-only CPU yet, so the CPU it runs
    on decides."""
    import time

    gen = torch.Generator().manual_seed(0)
    n, bs = F32_PREFILL_PROBE_TOKENS, 16
    q = torch.randn(n, heads, head_dim, generator=gen).to(dtype)
    k_cache = torch.randn(n // bs, bs, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(n // bs, bs, kv_heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata.build([n], [0], [list(range(n // bs))], bs)
    assert meta.block_tables is not None
    k, v = k_cache.view(n, kv_heads, head_dim), v_cache.view(n, kv_heads, head_dim)
    runs = (lambda: kernel.paged_prefill(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                         torch.empty(0, dtype=torch.uint8), head_dim**-0.5, 0),
            lambda: prefill_attention(q, k, v, (n,), head_dim**-0.5))
    def race(probes: tuple[int, ...]) -> dict[int, tuple[float, float]]:
        best = [float("inf"), float("inf")]
        for _ in range(5):
            for i, run in enumerate(runs):
                start = time.perf_counter()
                run()
                best[i] = min(best[i], time.perf_counter() - start)
        return {m: (best[0], best[1]) for m in probes}

    from common.model.start_races import retime  # a loss timed again, as the GEMMs' races are

    best = retime(race((n,)), race, lambda t: tuple(m for m in t if t[m][0] > t[m][1]))[n]
    log.info("%s prefill attention, %d heads / %d KV heads of %d, %d tokens: compiled (fp32 vectors) %.2f ms, "
             "SDPA %.2f ms", dtype, heads, kv_heads, head_dim, n, best[0] * 1e3, best[1] * 1e3)
    return best[0] <= best[1]


def _decode_rows(meta: AttentionMetadata, seqs: list[int]) -> tuple[list[int], list[int]]:
    """(rows, K/V lengths) of the sequences ``seqs`` read as decode rows: a chunk's row j attends to
    the context and the chunk's first j + 1 tokens."""
    starts = [0]
    for q in meta.query_lens_cpu:
        starts.append(starts[-1] + q)
    rows: list[int] = []
    lens: list[int] = []
    for i in seqs:
        q, total = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
        rows += range(starts[i], starts[i] + q)
        lens += range(total - q + 1, total + 1)
    return rows, lens


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_lens: tuple[int, ...],
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over themselves (no cached context), within ``window``.

    query: [num_tokens, num_heads, head_dim]; key, value: [num_tokens, num_kv_heads, head_dim]
    """
    out = torch.empty_like(query)
    start = 0
    for q_len in query_lens:
        stop = start + q_len
        if q_len:
            # SDPA wants [batch, heads, len, dim]; enable_gqa broadcasts KV heads without a copy.
            q = query[start:stop].transpose(0, 1).unsqueeze(0)
            k = key[start:stop].transpose(0, 1).unsqueeze(0).to(query.dtype)
            v = value[start:stop].transpose(0, 1).unsqueeze(0).to(query.dtype)
            if softcap is not None:
                o = softcapped_attention(q, k, v, window_mask(q_len, q_len, window, query.device), scale, softcap)
            elif window is None or window >= q_len:  # the window covers every row's causal span
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                mask = window_mask(q_len, q_len, window, query.device)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:stop] = o[0].transpose(0, 1)
        start = stop
    return out


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_cpu: tuple[int, ...],
    scale: float,
    chunk_bytes: int = DECODE_CHUNK_BYTES,
    workspace: Workspace | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query token per sequence over its paged K/V, vectorised over chunks of sequences.

    query: [num_seqs, num_heads, head_dim]; key_cache, value_cache: [num_blocks, block_size,
    num_kv_heads, head_dim] (any block stride); block_tables: [num_seqs, max_blocks] int32.
    """
    workspace = workspace if workspace is not None else Workspace()
    num_seqs, head_dim = query.shape[0], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if window is not None:
        block_tables, seq_lens, seq_lens_cpu = _skip_blocks_before_window(block_tables, seq_lens_cpu,
                                                                         key_cache.shape[1], window)
    token_bytes = 2 * num_kv_heads * head_dim * key_cache.element_size()
    out = torch.empty_like(query)
    start = 0
    while start < num_seqs:
        # Greedily grow the chunk while its padded K+V gather fits the byte budget.
        stop, longest = start + 1, seq_lens_cpu[start]
        while stop < num_seqs:
            grown = max(longest, seq_lens_cpu[stop])
            if (stop + 1 - start) * grown * token_bytes > chunk_bytes:
                break
            stop, longest = stop + 1, grown
        out[start:stop] = _decode_chunk(
            query[start:stop], key_cache, value_cache, block_tables[start:stop], seq_lens[start:stop],
            seq_lens_cpu[start:stop], scale, workspace, window, softcap,
        )
        start = stop
    return out


def _skip_blocks_before_window(block_tables: torch.Tensor, seq_lens_cpu: tuple[int, ...], block_size: int,
                               window: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """(tables, seq_lens, host seq_lens) of decode rows with the blocks wholly before each row's window dropped from
    the front of its table, so a long sequence gathers only its window's blocks. The window stays the last
    ``window`` positions of the shortened lengths."""
    skipped = [max(0, s - window) // block_size for s in seq_lens_cpu]
    lens_cpu = tuple(s - b * block_size for s, b in zip(seq_lens_cpu, skipped, strict=True))
    device = block_tables.device
    width = block_tables.shape[1]
    # Entries shifted in past a table's end repeat its last column: padding, masked by the shortened length.
    cols = (torch.arange(width, device=device)[None, :] + torch.tensor(skipped, device=device)[:, None]).clamp(
        max=max(width - 1, 0))
    tables = block_tables.gather(1, cols)
    return tables, torch.tensor(lens_cpu, dtype=torch.int64, device=device), lens_cpu


def _decode_chunk(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_cpu: tuple[int, ...],
    scale: float,
    workspace: Workspace,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    n, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    num_blocks = -(-max(seq_lens_cpu) // block_size)
    padded = num_blocks * block_size
    index = block_tables[:, :num_blocks].reshape(-1).long()
    # k, v: [n, padded, num_kv_heads, head_dim], token-major as gathered.
    token_major = (n, padded, num_kv_heads, head_dim)
    k = gather_blocks(key_cache, index, workspace.take("k", token_major, key_cache)).view(token_major)
    v = gather_blocks(value_cache, index, workspace.take("v", token_major, value_cache)).view(token_major)
    # Slots past seq_len hold whatever the block's last owner left, NaN included, and 0 * NaN is NaN:
    # zero V's tails (only the padding is touched; scores are masked below).
    for i, seq_len in enumerate(seq_lens_cpu):
        if seq_len < padded:
            v[i, seq_len:] = 0
    # Head-major copies make both matmuls plain batched GEMMs: [n, num_kv_heads, padded, head_dim].
    head_major = (n, num_kv_heads, padded, head_dim)
    k = workspace.take("k_heads", head_major, query).copy_(k.transpose(1, 2))
    v = workspace.take("v_heads", head_major, query).copy_(v.transpose(1, 2))
    # q: [n, num_kv_heads, group, D] — a GQA group shares one K/V matrix, so no repeat_interleave.
    q = query.view(n, num_kv_heads, group, head_dim)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [n, H_kv, group, padded]
    if softcap is not None:  # Gemma 2, before the mask as transformers' eager attention
        scores = torch.tanh(scores / softcap) * softcap
    positions = torch.arange(padded, device=query.device)
    pad = positions[None, :] >= seq_lens[:, None].to(positions.dtype)  # [n, padded]
    if window is not None:  # and the positions before the window (the query sits at seq_len - 1)
        pad |= positions[None, :] < seq_lens[:, None].to(positions.dtype) - window
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    # Softmax in fp32 whatever the input dtype; probabilities go back to the K/V dtype for the GEMM.
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).view(n, num_heads, head_dim)


class Workspace:
    """Scratch buffers reused across chunks and calls.

    Multi-MiB temporaries allocated per call go back to the OS on free and are page-faulted in again
    on the next call (a much slower decode on CPU: benchmarks/results/figures-from-code.md); recycling them
    avoids that. Not thread-safe: one per backend instance, which one engine thread drives.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A ``[*shape]`` tensor with ``like``'s dtype and device; contents undefined."""
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._buffers[name] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel].view(shape)


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def gather_blocks(cache: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``cache[index]`` for a strided ``[num_blocks, ...]`` cache view, as a contiguous copy.

    index_select beats advanced indexing on CPU, and reinterpreting the elements as a same-width integer
    keeps it on its fast copy path (bf16 takes a much slower path in torch 2.13; the figures:
    benchmarks/results/figures-from-code.md). ``out``, when given, must have the cache's dtype and hold
    ``len(index)`` blocks.
    """
    as_int = _SAME_WIDTH_INT[cache.element_size()]
    if out is None:
        return cache.view(as_int).index_select(0, index).view(cache.dtype)
    out_int = out.view(as_int).view(len(index), *cache.shape[1:])
    return torch.index_select(cache.view(as_int), 0, index, out=out_int).view(cache.dtype)


def paged_extend_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    skip: frozenset[int] = frozenset(),
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Several new tokens per sequence over cached context + themselves, causal aligned to the end.

    query: [num_tokens, num_heads, head_dim]. The new tokens' K/V must already be in the cache.
    Query token i of a sequence sits at position context_len + i and sees positions <= that.
    Sequences in ``skip`` are left unwritten in the output (the caller computes them another way).
    """
    assert meta.block_tables is not None
    block_size = key_cache.shape[1]
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        stop = start + q_len
        if q_len and i not in skip:
            # With a window, only the blocks from the one holding the first row's window start are read.
            first = 0 if window is None else max(0, seq_len - q_len - window + 1) // block_size * block_size
            k, v = _gather_sequence(key_cache, value_cache, meta.block_tables[i], seq_len, block_size, first)
            q = query[start:stop].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            k_heads = k.transpose(0, 1).unsqueeze(0).to(query.dtype)
            v_heads = v.transpose(0, 1).unsqueeze(0).to(query.dtype)
            if softcap is None and seq_len == q_len and (window is None or window >= q_len):
                # No cached context (a whole prompt beside others' chunks): the mask is plain causal, which SDPA
                # computes without a mask and skips the upper triangle of (session 29, 2 Xeon cores, 9 heads of
                # 64: 384 tokens 0.68 -> 0.57 ms in bf16, 1,024 tokens 4.6 -> 2.8 ms; the same outputs)
                o = F.scaled_dot_product_attention(q, k_heads, v_heads, is_causal=True, scale=scale, enable_gqa=True)
            else:
                mask = window_mask(q_len, seq_len, window, query.device)[:, first:]
                o = (softcapped_attention(q, k_heads, v_heads, mask, scale, softcap) if softcap is not None else
                     F.scaled_dot_product_attention(q, k_heads, v_heads, attn_mask=mask, scale=scale, enable_gqa=True))
            out[start:stop] = o[0].transpose(0, 1)
        start = stop
    return out


def sink_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   kv_cache: tuple[torch.Tensor, torch.Tensor] | None, meta: AttentionMetadata, scale: float,
                   window: int | None, sinks: torch.Tensor) -> torch.Tensor:
    """Each sequence's new tokens over its context and themselves (causal, within ``window``) with a sink logit
    per query head in the softmax's denominator. query [num_tokens, H, D]; K/V of a sequence with cached context
    are read from ``kv_cache`` (the new tokens' already written), else from ``key`` / ``value``."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        stop = start + q_len
        if not q_len:
            continue
        if seq_len == q_len:  # no cached context: the new tokens' own K/V
            k, v = key[start:stop], value[start:stop]
        else:
            if kv_cache is None or meta.block_tables is None:
                raise ValueError("sequences with cached context need kv_cache and meta.block_tables")
            k, v = _gather_sequence(kv_cache[0], kv_cache[1], meta.block_tables[i], seq_len, kv_cache[0].shape[1])
        group = num_heads // k.shape[1]
        q = query[start:stop].transpose(0, 1).float()  # [H, q_len, D]
        kh = k.transpose(0, 1).float().repeat_interleave(group, dim=0)  # [H, seq_len, D]
        vh = v.transpose(0, 1).float().repeat_interleave(group, dim=0)
        scores = torch.matmul(q, kh.transpose(1, 2)) * scale  # [H, q_len, seq_len]
        scores.masked_fill_(~window_mask(q_len, seq_len, window, query.device)[None], float("-inf"))
        sink = sinks.float()[:, None, None].expand(num_heads, q_len, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out[start:stop] = torch.matmul(probs, vh).transpose(0, 1).to(query.dtype).view(q_len, num_heads, head_dim)
        start = stop
    return out


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                         softcap: float) -> torch.Tensor:
    """SDPA with Gemma 2's soft-capped scores, in transformers' eager order: q k^T * scale, softcap *
    tanh(scores / softcap), the mask, softmax in fp32, back to q's dtype, times v.

    q: [1, H, q_len, D]; k, v: [1, Hkv, kv_len, D]; mask: [q_len, kv_len] bool, True = may attend.
    Returns [1, H, q_len, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def window_mask(q_len: int, seq_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[q_len, seq_len] bool, True = may attend: the last ``q_len`` of ``seq_len`` positions, each seeing the
    positions up to itself and, with a window, after ``itself - window``."""
    rows = torch.arange(q_len, device=device)[:, None] + (seq_len - q_len)
    cols = torch.arange(seq_len, device=device)[None, :]
    mask = cols <= rows
    if window is not None:
        mask &= cols > rows - window
    return mask


def _gather_sequence(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    block_size: int,
    first: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K/V of positions first .. seq_len - 1 (``first`` a multiple of block_size), each
    [seq_len - first, num_kv_heads, head_dim], gathered through its table."""
    blocks = block_table[first // block_size : -(-seq_len // block_size)].long()
    k = gather_blocks(key_cache, blocks).flatten(0, 1)[: seq_len - first]
    v = gather_blocks(value_cache, blocks).flatten(0, 1)[: seq_len - first]
    return k, v


def reference_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The test oracle: token by token, in float64, reading the cache slot by slot.

    query: [num_tokens, num_heads, head_dim]; returns the same shape and dtype. Every new token's
    K/V must already be in the cache.
    """
    assert meta.block_tables is not None
    block_size = key_cache.shape[1]
    group = query.shape[1] // key_cache.shape[2]
    tables = meta.block_tables.tolist()
    out = torch.empty(query.shape, dtype=torch.float64)
    token = 0
    for table, q_len, seq_len in zip(tables, meta.query_lens_cpu, meta.seq_lens_cpu, strict=True):
        for i in range(q_len):
            position = seq_len - q_len + i
            # Slots first..position of this sequence: block table entry, then offset in the block.
            first = 0 if window is None else max(0, position - window + 1)
            blocks = [table[p // block_size] for p in range(first, position + 1)]
            offsets = [p % block_size for p in range(first, position + 1)]
            k = key_cache[blocks, offsets].double().repeat_interleave(group, dim=1)  # [pos+1, H, D]
            v = value_cache[blocks, offsets].double().repeat_interleave(group, dim=1)
            q = query[token].double()  # [H, D]
            scores = torch.einsum("hd,khd->hk", q, k) * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            out[token] = torch.einsum("hk,khd->hd", torch.softmax(scores, dim=-1), v)
            token += 1
    return out.to(query.dtype)
