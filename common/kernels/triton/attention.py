"""Triton paged-attention kernels: split-K flash decoding and extend (prefill over paged KV).

Both kernels read K/V through block tables from caches shaped ``[num_blocks, block_size,
num_kv_heads, head_dim]`` with arbitrary block/token/head strides (``KVCache.layer`` views) and a
contiguous last dim. One program owns one KV head and *all* of its GQA query heads, so each K/V
tile is loaded once per group instead of once per query head.

A program walks the context in tiles of ``TILE_N`` tokens that are independent of the cache block
size: each token's block id is looked up in the table, so any block size works and a tile may span
several blocks (or part of one). Softmax runs online in base 2 (``exp2``), accumulating in fp32.

Both take a sliding ``window`` (None: the whole sequence): the token at position p attends to positions
p - window + 1 .. p (transformers' sliding-window mask), and tiles wholly before every row's window are not
read. ``HAS_WINDOW`` is a compile-time switch, so the window-less kernels are the same code as before.
Both take Gemma 2's attention ``softcap`` too (None: none): the scaled scores become softcap * tanh(scores /
softcap) before the mask, behind the compile-time ``HAS_SOFTCAP``.

On CPU the kernels run under ``TRITON_INTERPRET=1`` (which must be set before this module is
imported). The interpreter mishandles bf16 arithmetic and 16-bit ``tl.dot``, so there every load is
upcast to fp32; on GPUs fp16/bf16 tiles feed ``tl.dot`` directly (fp32 accumulation).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

LOG2E = 1.4426950408889634  # softmax(x * scale) == exp2(x * scale * log2(e)) / sum(...)
MAX_SPLITS = 32


@triton.jit
def _load_kv_tile(
    cache_ptr, table_row_ptr, tok, tok_mask, d, d_mask,
    stride_block, stride_token, BLOCK_SIZE: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
):
    # tok: [TILE_N] positions in the sequence -> block id from the table, offset inside the block.
    # Masked tokens read block 0 from the table and nothing from the cache (other=0, never NaN).
    block_ids = tl.load(table_row_ptr + tok // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
    offsets = block_ids * stride_block + (tok % BLOCK_SIZE) * stride_token
    ptrs = cache_ptr + offsets[:, None] + d[None, :]
    tile = tl.load(ptrs, mask=tok_mask[:, None] & d_mask[None, :], other=0.0)
    return tile.to(COMPUTE_DTYPE)  # [TILE_N, HEAD_DIM_PAD]


@triton.jit
def _softcap(s, cap):
    # s: scores * log2(e); cap: softcap * log2(e), so cap * tanh(s / cap) is the capped score * log2(e).
    # tanh(t) = 1 - 2 / (e^2t + 1): +-1 without NaN where e^2t overflows to inf or underflows to 0.
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * (s / cap)) + 1.0))


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2e, window, softcap_log2e,
    stride_q_seq, stride_q_head,
    stride_k_block, stride_k_token, stride_k_head,
    stride_v_block, stride_v_token, stride_v_head,
    stride_bt_seq, stride_o_seq, stride_o_head,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    # grid: (num_seqs, num_kv_heads, NUM_SPLITS); this program: one sequence, one KV head, one slice.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Each sequence splits its own tiles evenly, so short sequences do not idle long ones' splits. With a
    # window the query (position seq_len - 1) reads positions >= lo: its tiles start at lo's.
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
        base_tile = lo // TILE_N
    else:
        lo = 0
        base_tile = 0
    num_tiles = tl.cdiv(seq_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles - base_tile, NUM_SPLITS)
    first_tile = base_tile + split * tiles_per_split
    last_tile = tl.minimum(first_tile + tiles_per_split, num_tiles)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    n = tl.arange(0, TILE_N)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    # q: [GROUP_PAD, HEAD_DIM_PAD] as given; the scale goes on the fp32 scores (no extra rounding).
    q = tl.load(
        q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    ).to(COMPUTE_DTYPE)
    table_row = block_tables_ptr + seq * stride_bt_seq
    k_base = k_cache_ptr + kv_head * stride_k_head
    v_base = v_cache_ptr + kv_head * stride_v_head

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for tile in range(first_tile, last_tile):
        tok = tile * TILE_N + n
        if HAS_WINDOW:
            tok_mask = (tok < seq_len) & (tok >= lo)
        else:
            tok_mask = tok < seq_len
        k = _load_kv_tile(k_base, table_row, tok, tok_mask, d, d_mask,
                          stride_k_block, stride_k_token, BLOCK_SIZE, COMPUTE_DTYPE)
        # s: [GROUP_PAD, TILE_N] scores in the log2 domain (exp2 is one instruction, exp is two).
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
        if HAS_SOFTCAP:
            s = _softcap(s, softcap_log2e)
        s = tl.where(tok_mask[None, :], s, float("-inf"))
        # Every tile visited holds >= 1 valid token, so m_new is finite and exp2 never sees -inf - -inf.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_kv_tile(v_base, table_row, tok, tok_mask, d, d_mask,
                          stride_v_block, stride_v_token, BLOCK_SIZE, COMPUTE_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE_DTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty slice (or seq_len 0) has l_i == 0: emit zeros with lse -inf, which the merge ignores.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        # part_out: [num_seqs, num_heads, NUM_SPLITS, HEAD_DIM_PAD]; part_lse: [num_seqs, num_heads, NUM_SPLITS]
        rows = (seq * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + rows[:, None] * HEAD_DIM_PAD + d[None, :], o, mask=g_mask[:, None])
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + rows, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_heads, stride_o_seq, stride_o_head,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    # grid: (num_seqs, num_heads). out = sum_s 2^(lse_s - max) * out_s / sum_s 2^(lse_s - max)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    sp_mask = sp < NUM_SPLITS
    row = (seq * num_heads + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + row + sp, mask=sp_mask, other=float("-inf"))  # [SPLITS_PAD]
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # empty sequence: all weights 0
    w = tl.exp2(lse - lse_max)
    denom = tl.sum(w, 0)
    denom = tl.where(denom > 0.0, denom, 1.0)
    part = tl.load(part_out_ptr + (row + sp)[:, None] * HEAD_DIM_PAD + d[None, :], mask=sp_mask[:, None], other=0.0)
    o = tl.sum(part * w[:, None], 0) / denom  # [HEAD_DIM_PAD]
    tl.store(out_ptr + seq * stride_o_seq + head * stride_o_head + d, o.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


@triton.jit
def _paged_extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    scale_log2e, window, softcap_log2e,
    stride_q_tok, stride_q_head,
    stride_k_block, stride_k_token, stride_k_head,
    stride_v_block, stride_v_token, stride_v_head,
    stride_bt_seq, stride_o_tok, stride_o_head,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    # grid: (num_seqs, num_kv_heads, cdiv(max_query_len, BLOCK_Q)). Rows of the tile are
    # BLOCK_Q query tokens x GROUP_PAD heads (BLOCK_M = BLOCK_Q * GROUP_PAD), token-major.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM_PAD)
    n = tl.arange(0, TILE_N)
    tok = q_tile * BLOCK_Q + r // GROUP_PAD  # new-token index inside the sequence
    g = r % GROUP_PAD
    row_mask = (tok < q_len) & (g < GROUP)
    d_mask = d < HEAD_DIM
    pos = context_len + tok  # absolute position: sees keys 0..pos
    heads = kv_head * GROUP + g
    q = tl.load(
        q_ptr + (q_start + tok)[:, None] * stride_q_tok + heads[:, None] * stride_q_head + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :], other=0.0,
    ).to(COMPUTE_DTYPE)  # [BLOCK_M, HEAD_DIM_PAD]
    table_row = block_tables_ptr + seq * stride_bt_seq
    k_base = k_cache_ptr + kv_head * stride_k_head
    v_base = v_cache_ptr + kv_head * stride_v_head

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    # Keys past this tile's last query position are masked for every row: stop the walk there.
    kv_end = tl.minimum(seq_len, context_len + (q_tile + 1) * BLOCK_Q)
    if HAS_WINDOW:
        # Keys before the window of this tile's first row are masked for every row: start the walk at them.
        first_tile = tl.maximum(context_len + q_tile * BLOCK_Q - window + 1, 0) // TILE_N
    else:
        first_tile = 0
    for tile in range(first_tile, tl.cdiv(kv_end, TILE_N)):
        key_pos = tile * TILE_N + n
        key_mask = key_pos < seq_len
        k = _load_kv_tile(k_base, table_row, key_pos, key_mask, d, d_mask,
                          stride_k_block, stride_k_token, BLOCK_SIZE, COMPUTE_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e  # [BLOCK_M, TILE_N]
        if HAS_SOFTCAP:
            s = _softcap(s, softcap_log2e)
        visible = key_mask[None, :] & (key_pos[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (key_pos[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if HAS_WINDOW:
            # A row may see no key of a tile before its window starts: keep exp2 off -inf - -inf (NaN).
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        # Without a window key 0 is visible to every row and sits in the first tile, so m_i is finite from then on.
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_kv_tile(v_base, table_row, key_pos, key_mask, d, d_mask,
                          stride_v_block, stride_v_token, BLOCK_SIZE, COMPUTE_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE_DTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if HAS_WINDOW:
        l_i = tl.where(l_i > 0.0, l_i, 1.0)  # padding rows past q_len may see no key at all
    o = acc / l_i[:, None]
    o_ptrs = out_ptr + (q_start + tok)[:, None] * stride_o_tok + heads[:, None] * stride_o_head + d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


# triton.jit picked interpreted or compiled kernels when this module was imported (TRITON_INTERPRET).
INTERPRETED: bool = isinstance(_paged_decode_kernel, InterpretedFunction)


def _check_device(query: torch.Tensor) -> None:
    if query.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            "Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before "
            "common.kernels.triton.attention is imported (CPU, slow: tests only)"
        )


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _compute_dtype(cache: torch.Tensor) -> tuple[tl.dtype, str]:
    """(dtype fed to tl.dot, its input precision) for a cache."""
    # Interpreter (CPU tensors): fp32 everywhere, it gets 16-bit dot/bf16 arithmetic wrong.
    # fp32 caches on GPU: "ieee" keeps fp32 accuracy instead of silently dropping to tf32.
    # 16-bit operands always run on tensor cores; the precision flag only matters for fp32.
    if INTERPRETED or cache.device.type != "cuda" or cache.dtype == torch.float32:
        return tl.float32, "ieee"
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[cache.dtype], "tf32"


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, tile_size: int, num_sms: int) -> int:
    """How many context slices per (sequence, KV head) for decode: about two waves of programs.

    Large batches already fill the GPU (one split); a few long sequences are split so every SM works,
    but each slice keeps at least two tiles so the merge stays small next to the attention itself.
    A power of two, so serving compiles at most log2(MAX_SPLITS) + 1 kernel variants.
    """
    programs = max(1, num_seqs * num_kv_heads)
    wanted = -(-2 * num_sms // programs)
    most = max(1, -(-max_seq_len // tile_size) // 2)
    splits = max(1, min(wanted, most, MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)


def _check_cache(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> int:
    assert key_cache.shape == value_cache.shape, "key and value caches differ in shape"
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1, "cache head_dim must be contiguous"
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    assert query.shape[2] == key_cache.shape[3], "query and cache head_dim differ"
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads"
    return num_heads // num_kv_heads


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    *,
    max_seq_len: int | None = None,
    tile_size: int = 64,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Split-K flash decoding: one new query token per sequence over its paged K/V.

    query: [num_seqs, num_heads, head_dim]; key_cache, value_cache: [num_blocks, block_size,
    num_kv_heads, head_dim]; block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32.
    ``max_seq_len`` (host int) sharpens the split heuristic; without it the table width bounds it.
    ``window``: the sliding window (None: the whole sequence); ``softcap``: Gemma 2's score cap (None: none).
    Returns [num_seqs, num_heads, head_dim] in query's dtype.
    """
    _check_device(query)
    group = _check_cache(query, key_cache, value_cache)
    query = query if query.stride(-1) == 1 else query.contiguous()
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    head_dim_pad = max(16, _next_pow2(head_dim))
    group_pad = max(16, _next_pow2(group))  # tl.dot wants M >= 16 on GPUs
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    if num_splits is None:
        read = max_seq_len if window is None else min(max_seq_len, window + tile_size)  # tiles one query reads
        num_splits = choose_num_splits(num_seqs, num_kv_heads, read, tile_size, _num_sms(query.device))
    compute_dtype, precision = _compute_dtype(key_cache)
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    # Scratch for the split results; unused (any tensor will do) when there is one split.
    part_out = torch.empty((num_seqs, num_heads, num_splits, head_dim_pad), dtype=torch.float32, device=query.device)
    part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_tables, seq_lens, out, part_out, part_lse,
        scale * LOG2E, window or 0, (softcap or 1.0) * LOG2E,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, TILE_N=tile_size, NUM_SPLITS=num_splits,
        COMPUTE_DTYPE=compute_dtype, DOT_PRECISION=precision, HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=num_splits,
            SPLITS_PAD=_next_pow2(num_splits),
        )
    return out


def paged_extend(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    tile_size: int = 32,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Several new tokens per sequence over paged K/V (their own K/V already in the cache).

    query: [num_tokens, num_heads, head_dim]; query_start_loc: [num_seqs + 1] int32; seq_lens:
    [num_seqs] int32. Query token i of a sequence with q_len new tokens sits at position
    seq_len - q_len + i and attends to positions <= that (and > that - ``window`` with one); ``softcap``: Gemma 2's
    score cap (None: none).
    ``max_query_len`` (host int) sizes the grid; without it num_tokens bounds it (correct, with idle programs).
    """
    _check_device(query)
    group = _check_cache(query, key_cache, value_cache)
    query = query if query.stride(-1) == 1 else query.contiguous()
    num_tokens, head_dim = query.shape[0], query.shape[2]
    num_seqs = seq_lens.shape[0]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = num_tokens
    head_dim_pad = max(16, _next_pow2(head_dim))
    group_pad = _next_pow2(group)
    # About 64 rows (query tokens x heads) per program, at least 16 for tl.dot, no more than needed.
    block_q = max(-(-16 // group_pad), min(max(1, 64 // group_pad), _next_pow2(max_query_len)))
    compute_dtype, precision = _compute_dtype(key_cache)
    grid = (num_seqs, num_kv_heads, -(-max_query_len // block_q))
    _paged_extend_kernel[grid](
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out,
        scale * LOG2E, window or 0, (softcap or 1.0) * LOG2E,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, TILE_N=tile_size, BLOCK_Q=block_q, BLOCK_M=block_q * group_pad,
        COMPUTE_DTYPE=compute_dtype, DOT_PRECISION=precision, HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None,
    )
    return out
