// Prefill / extend attention on CPU, bf16 in AMX tiles (Intel Sapphire Rapids and later) or AVX512-BF16 vectors
// (AMD Zen 4 / 5) and fp32 in AVX-512 / AVX2 FMA vectors (those parts: further down), read straight from the paged
// KV cache: every new token of a step's sequences attends causally (and within a sliding window) over its
// sequence's cached context and the new tokens before it, whose K/V the layer has just written.
//
// Why: a prefill step's attention ran in PyTorch's flash SDPA, one call per sequence, at 190-270 GFLOP/s in
// bf16 on two Xeon cores (session 30: 0.89 ms for a 384-token causal prompt of SmolLM2's 9 heads of 64),
// about a third of a 2,048-token step's time beside the linears in AMX; vLLM's CPU backend runs this in its
// own AMX kernel. Here a work item is (sequence, KV head, 16 query positions): the GQA group's query heads
// over those positions form the rows of A (g x 16 rows: one K/V block serves the whole group), and per 32 keys
//
//   S = Q K^T            tdpbf16ps: A = Q rows (32 dims a tile), B = 16 keys' K in AMX's pair layout
//   online softmax       AVX-512 over S's rows: masked by position, running max and sum, P in bf16
//   O = O * alpha + P V  tdpbf16ps: A = P rows (32 keys), B = V's 32 keys x 16 dims in pair layout
//
// with O, the running max and sum in fp32 per row, divided and rounded to bf16 once at the end. K and V are
// repacked per 32 keys from the cache rows into the tiles' pair layout (O(keys x D) beside O(rows x keys x D)
// of work); keys no row of the item reads (before its first row's window, or padding past its last row) are
// zeroed, so a freed block's bytes never reach a product. Items are handed out heaviest first from an
// atomic counter (a causal item's work grows with its position). Tile registers, all 16 rows x 64 bytes:
//
//   S phase: T0, T1 scores (keys 0-15, 16-31); T2 Q; T3, T4 K of the two key groups
//   PV phase: T0-T3 outputs (64 dims a pass); T4 P; T5 V
//
// Shapes: query [T, H, D] bf16 or fp32, heads adjacent, any row stride (every sequence's rows end to end);
// caches [blocks, block_size, H_kv, D] of the query's dtype with unit stride over D; block_tables [S, max_blocks]
// int32; query_start_loc [S + 1] and seq_lens [S] int32; skip [S] uint8 or empty (sequences left unwritten: the
// caller computes them another way). D a multiple of 32 up to 256. ``prefill_amx_ready()`` is false where the CPU,
// the OS or the compiler lacks AMX, ``prefill_f32_ready()`` on the generic build: the caller keeps PyTorch's SDPA.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
// TANDEM_HAVE_AMX, tandem_amx::ready() and TileConfig: amx_tiles.h, included before this file.

namespace {

constexpr int64_t kQ = 16;        // query positions per item
constexpr int64_t kStep = 32;     // key granularity: one A tile of P (bf16); 2 AVX-512 / 4 AVX2 vectors (fp32)
constexpr int64_t kChunk = 512;   // keys a softmax pass covers (scores [M, 512] fp32 in L2)
// A masked score and the running max before any visible key: finite (the module builds with -ffast-math, which
// assumes no infinities), far below any score.
constexpr float kMasked = -3e38f;
constexpr float kMaskedBelow = -1e37f;
constexpr float kLog2e = 1.44269504088896341f;

struct Shape {
  int64_t H, Hkv, D, g, block_size;
  int64_t q_row_stride;  // elements between query rows (a view of the qkv projection's output)
  int64_t k_block_stride, k_row_stride, k_head_stride;  // elements
  int64_t v_block_stride, v_row_stride, v_head_stride;
  int64_t table_stride;  // elements between block-table rows (a view of a wider buffer)
  float scale;
  int64_t window;  // 0: the whole sequence
};

// One (sequence, KV head)'s keys [lo, seq_len), repacked once for every query block that reads them, from
// lo / 32 * 32 (zero below lo and past seq_len); keys: the packed count, a multiple of 32. Offsets into the
// shared K and V buffers, in elements.
struct Pack {
  int64_t seq, kvh, lo, keys;
  int64_t k_off, v_off;
};

// 16 query positions from i0 of a pack's sequence; work: the keys they read (the heaviest go first).
struct Item {
  int64_t pack, i0, work;
};

// Where an item's rows sit: its sequence's first row, its rows' count, the context before them, the pack's
// first key, its first and last rows' positions and the first key any of them reads.
struct ItemRows {
  int64_t q_start, nq, ctx, first, first_pos, last_pos, lo;
  // A cascade's prefix tile (cascade_prefix): nq rows, one a sequence, every one after all the keys.
  ItemRows(int64_t rows, int64_t keys)
      : q_start(0), nq(rows), ctx(keys), first(0), first_pos(keys), last_pos(keys + rows - 1), lo(0) {}
  ItemRows(const Item& it, const Pack& pk, const int32_t* starts, const int32_t* lens, int64_t window) {
    q_start = starts[pk.seq];
    const int64_t q_len = starts[pk.seq + 1] - q_start;
    ctx = lens[pk.seq] - q_len;
    nq = std::min<int64_t>(kQ, q_len - it.i0);
    first = pk.lo / kStep * kStep;
    first_pos = ctx + it.i0;
    last_pos = first_pos + nq - 1;
    lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  }
  // Row i's visible keys in the chunk of n keys from pack-relative c0, chunk-relative [a, b): from its window's
  // start (or the first key) through its own position; empty (a >= b) for a padding row.
  std::pair<int64_t, int64_t> visible(int64_t i, int64_t c0, int64_t n, int64_t window) const {
    const int64_t pos = first_pos + i;
    const int64_t rlo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    const int64_t b = i < nq ? std::clamp<int64_t>(pos - first - c0 + 1, 0, n) : 0;
    return {std::clamp<int64_t>(rlo - first - c0, 0, n), b};
  }
};

// The item's query rows, head-major (row m = head-in-group * 16 + position), padding rows zero.
template <typename T>
void gather_rows(T* qb, const T* query, const Shape& sh, const Item& it, const Pack& pk, int64_t q_start,
                 int64_t nq) {
  for (int64_t h = 0; h < sh.g; ++h) {
    for (int64_t i = 0; i < kQ; ++i) {
      T* dst = qb + (h * kQ + i) * sh.D;
      if (i < nq) {
        std::memcpy(dst, query + (q_start + it.i0 + i) * sh.q_row_stride + (pk.kvh * sh.g + h) * sh.D,
                    sh.D * sizeof(T));
      } else {
        std::memset(dst, 0, sh.D * sizeof(T));
      }
    }
  }
}

template <typename T>
T* align64(std::vector<T>& v) {
  auto p = reinterpret_cast<uintptr_t>(v.data());
  return reinterpret_cast<T*>((p + 63) & ~uintptr_t(63));
}

// The packs' buffers, one pair per calling thread, grown and kept: every element a call reads its packs write first,
// so a fresh zero-filled vector a call (the packs of a 2,048-token step: ~16 MB a layer) was memset for nothing,
// and faulted in page by page wherever malloc served it with mmap. 64-byte aligned.
template <typename T>
T* pack_buffer(int which, int64_t n) {
  thread_local std::vector<T> buffers[2];
  std::vector<T>& b = buffers[which];
  const auto need = static_cast<size_t>(n + 64 / sizeof(T));
  if (b.size() < need) b.resize(need);
  return align64(b);
}

// Cascade decode attention's shared prefix (cpu_decode.cpp's PrefixState, whose comment says why): sequences
// [begin, end) of a decode call share it where they are at least kCascadeMinSeqs and their block tables agree on
// the blocks of at least kCascadeMinPrefix tokens before each one's last token (its own row, written this step,
// stays in its suffix). The prefix's length, down to a multiple of kStep; 0 where there is none worth a pass (fewer
// sequences than a tile leave it mostly padding, and a short prefix is not worth its pack).
constexpr int64_t kCascadeMinSeqs = 8;
constexpr int64_t kCascadeMinPrefix = 64;

int64_t shared_prefix(const int32_t* tables, int64_t table_stride, const int64_t* lens, int64_t begin, int64_t end,
                      int64_t block_size) {
  if (end - begin < kCascadeMinSeqs) return 0;
  int64_t min_len = lens[begin];
  for (int64_t s = begin + 1; s < end; ++s) min_len = std::min(min_len, lens[s]);
  const int64_t max_blocks = (min_len - 1) / block_size;
  const int32_t* t0 = tables + begin * table_stride;
  int64_t shared = 0;
  for (; shared < max_blocks; ++shared) {
    bool same = true;
    for (int64_t s = begin + 1; s < end && same; ++s) same = tables[s * table_stride + shared] == t0[shared];
    if (!same) break;
  }
  const int64_t P = shared * block_size / kStep * kStep;
  return P >= kCascadeMinPrefix ? P : 0;
}

// The state buffer's three parts for ``rows`` query rows of D: unnormalised outputs, maxes, sums.
inline PrefixState prefix_state(std::vector<float>& state, int64_t rows, int64_t D, int64_t P) {
  state.resize(rows * (D + 2));
  float* o = state.data();
  return PrefixState{P, o, o + rows * D, o + rows * (D + 1)};
}

// What both cascade_prefix passes (bf16, fp32) start from: the prefix sequences [begin, end) share (P, 0: no pass),
// ``ps`` over ``state`` for their rows of heads [h_begin, h_end), and the kernels' shape (no causal window).
struct PrefixJob {
  int64_t P, n, g, nh, rows, M;
  Shape sh;
};

inline PrefixJob prefix_job(const int32_t* tables, int64_t table_stride, const int64_t* lens, const int64_t* kstride,
                            const int64_t* vstride, int64_t H, int64_t Hkv, int64_t D, int64_t block_size, float scale,
                            int64_t begin, int64_t end, int64_t h_begin, int64_t h_end, std::vector<float>& state,
                            PrefixState& ps) {
  const int64_t P = shared_prefix(tables, table_stride, lens, begin, end, block_size);
  const int64_t n = end - begin, g = H / Hkv, nh = h_end - h_begin, rows = n * nh * g;
  if (P > 0) ps = prefix_state(state, rows, D, P);
  const Shape sh{H, Hkv, D, g, block_size, H * D, kstride[0], kstride[1], kstride[2], vstride[0], vstride[1],
                 vstride[2], 0, scale, 0};
  return PrefixJob{P, n, g, nh, rows, g * kQ, sh};
}

// A cascade tile's rows into the state: row m = head-in-group * 16 + i (sequence s0 + i, KV head kvh) is state row
// ((s0 + i - begin) * nh + kvh - h_begin) * g + m / 16; its max times mx_scale (into natural-log units).
inline void store_tile(std::vector<float>& state, int64_t rows, int64_t D, int64_t g, int64_t nh, int64_t first_row,
                       int64_t nq, const float* ob, const float* mx, const float* sum, float mx_scale) {
  float* st_o = state.data();
  float* st_mx = st_o + rows * D;
  float* st_sum = st_mx + rows;
  for (int64_t h = 0; h < g; ++h) {
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t m = h * kQ + i, r = first_row + i * nh * g + h;
      std::memcpy(st_o + r * D, ob + m * D, D * sizeof(float));
      st_mx[r] = mx[m] * mx_scale;
      st_sum[r] = sum[m];
    }
  }
}

// fp32 vectors for both kernels' softmax and the fp32 kernel's products: AVX-512 (16 lanes) or AVX2 (8).
#if defined(__AVX512F__) || defined(__AVX2__)
#define TANDEM_PREFILL_F32 1
#if defined(__AVX512F__)
using pv = __m512;
constexpr int64_t kVW = 16;
constexpr int64_t kPvRows = 4;
inline pv pv_set(float v) { return _mm512_set1_ps(v); }
inline pv pv_zero() { return _mm512_setzero_ps(); }
inline pv pv_load(const float* p) { return _mm512_loadu_ps(p); }
inline void pv_store(float* p, pv v) { _mm512_storeu_ps(p, v); }
inline pv pv_fma(pv a, pv b, pv c) { return _mm512_fmadd_ps(a, b, c); }
inline pv pv_fms(pv a, pv b, pv c) { return _mm512_fmsub_ps(a, b, c); }
inline pv pv_max(pv a, pv b) { return _mm512_max_ps(a, b); }
inline pv pv_add(pv a, pv b) { return _mm512_add_ps(a, b); }
inline float pv_hmax(pv a) { return _mm512_reduce_max_ps(a); }
inline float pv_hsum(pv a) { return _mm512_reduce_add_ps(a); }
inline pv pv_exp2(pv t) {  // 2^t, t >= -126 after the clamp (a masked score: 0 by the caller)
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.f));
  const pv n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const pv f = _mm512_sub_ps(t, n);
  pv p = _mm512_set1_ps(1.3333558146428443e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#else
using pv = __m256;
constexpr int64_t kVW = 8;
constexpr int64_t kPvRows = 2;
inline pv pv_set(float v) { return _mm256_set1_ps(v); }
inline pv pv_zero() { return _mm256_setzero_ps(); }
inline pv pv_load(const float* p) { return _mm256_loadu_ps(p); }
inline void pv_store(float* p, pv v) { _mm256_storeu_ps(p, v); }
inline pv pv_fma(pv a, pv b, pv c) { return _mm256_fmadd_ps(a, b, c); }
inline pv pv_fms(pv a, pv b, pv c) { return _mm256_fmsub_ps(a, b, c); }
inline pv pv_max(pv a, pv b) { return _mm256_max_ps(a, b); }
inline pv pv_add(pv a, pv b) { return _mm256_add_ps(a, b); }
inline float pv_hmax(pv a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
inline float pv_hsum(pv a) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
inline pv pv_exp2(pv t) {
  t = _mm256_max_ps(t, _mm256_set1_ps(-126.f));
  const pv n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const pv f = _mm256_sub_ps(t, n);
  pv p = _mm256_set1_ps(1.3333558146428443e-3f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618129107628477e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550410866482158e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402265069591007e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931471805599453e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif
#endif  // fp32 vectors

#if defined(__AVX512F__) && defined(__AVX512BW__)
// bf16 packs, softmax and output for both bf16 kernels (AMX tiles, AVX512-BF16 vectors); the vector kernel.
#define TANDEM_PREFILL_BF16 1

#pragma GCC push_options
#pragma GCC target("avx512bf16")

struct PfScratch {
  std::vector<uint16_t> q;  // [M, D] bf16 query rows (row m = head-in-group * 16 + position)
  std::vector<float> s;     // [M, kChunk] scores of one key chunk
  std::vector<uint16_t> p;  // [M, kChunk] bf16 probabilities
  std::vector<float> o;     // [M, D] running output
  std::vector<float> tile;  // [4][16, 16] PV tiles
  std::vector<float> mx, sum;
  void size(int64_t M, int64_t D) {
    q.assign(M * D + 32, 0);
    s.assign(M * kChunk + 16, 0.f);
    p.assign(M * kChunk + 32, 0);
    o.assign(M * D + 16, 0.f);
    tile.assign(4 * 256 + 16, 0.f);
    mx.assign(M, 0.f);
    sum.assign(M, 0.f);
  }
};

// The pack's keys: K as [keys / 16][D / 2 pairs][16 keys] (uint32 pairs), V as [keys / 32][D / 16][16 key pairs]
// [16 dims][2 keys]. 16 keys in one cache block, all read, go in vectors: K as 16 x 16 pairs transposed in
// registers (transpose16), V's rows interleaved two at a time (one permute a 16-dim group). Element by element
// the pack took a fifth of a cascade's decode attention (48 sequences over a 512-token prefix, session 39).
// The others (the pack's edges, a block boundary inside 16 keys) go element by element.
// 16 vectors of 16 32-bit lanes transposed in place: r[i][j] <- r[j][i] (unpacks, then 128-bit lane shuffles).
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i) {
    for (int k = 0; k < 4; ++k) {
      t[8 * i + k] = _mm512_shuffle_i32x4(r[8 * i + k], r[8 * i + 4 + k], 0x88);
      t[8 * i + 4 + k] = _mm512_shuffle_i32x4(r[8 * i + k], r[8 * i + 4 + k], 0xdd);
    }
  }
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xdd);
  }
}

void pf_pack(const Pack& pk, const uint16_t* kc, const uint16_t* vc, const int32_t* tables, const int32_t* lens,
             const Shape& sh, uint32_t* kbuf, uint16_t* vbuf) {
  const int64_t D = sh.D, first = pk.lo / kStep * kStep, seq_len = lens[pk.seq];
  const int32_t* table = tables + pk.seq * sh.table_stride;
  uint32_t* kp = kbuf + pk.k_off;
  uint16_t* vp = vbuf + pk.v_off;
  // out[2i] = a[i], out[2i + 1] = b[i]: a in the low 16 words, b in the high 16
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const bool vectors = sh.block_size % 16 == 0;
  for (int64_t j = 0; j < pk.keys; ++j) {
    const int64_t key = first + j;
    if (vectors && j % 16 == 0 && j + 16 <= pk.keys && key >= pk.lo && key + 16 <= seq_len) {
      const int64_t blk = table[key / sh.block_size], off = key % sh.block_size;
      const uint16_t* k0 = kc + blk * sh.k_block_stride + off * sh.k_row_stride + pk.kvh * sh.k_head_stride;
      uint32_t* kg = kp + (j / 16) * (D / 2) * 16;
      for (int64_t cb = 0; cb < D / 32; ++cb) {  // 16 pairs of the 16 rows, transposed: a vector per pair
        __m512i r[16];
        for (int t = 0; t < 16; ++t) r[t] = _mm512_loadu_si512(k0 + t * sh.k_row_stride + cb * 32);
        transpose16(r);
        for (int t = 0; t < 16; ++t) _mm512_storeu_si512(kg + (cb * 16 + t) * 16, r[t]);
      }
      const uint16_t* v0 = vc + blk * sh.v_block_stride + off * sh.v_row_stride + pk.kvh * sh.v_head_stride;
      for (int64_t t = 0; t < 16; t += 2) {
        const uint16_t* va = v0 + t * sh.v_row_stride;
        const uint16_t* vb = va + sh.v_row_stride;
        uint16_t* vt = vp + ((j + t) / kStep) * D * kStep + (((j + t) % kStep) / 2) * kStep;
        for (int64_t dg = 0; dg < D / 16; ++dg) {
          const __m512i ab = _mm512_inserti64x4(
              _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(va + dg * 16))),
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vb + dg * 16)), 1);
          _mm512_storeu_si512(vt + dg * 16 * kStep, _mm512_permutexvar_epi16(interleave, ab));
        }
      }
      j += 15;
      continue;
    }
    uint32_t* kg = kp + (j / 16) * (D / 2) * 16 + (j % 16);
    uint16_t* vt = vp + (j / kStep) * D * kStep + ((j % kStep) / 2) * kStep + (j % 2);
    if (key < pk.lo || key >= seq_len) {
      for (int64_t r = 0; r < D / 2; ++r) kg[r * 16] = 0u;
      for (int64_t d = 0; d < D; ++d) vt[(d / 16) * 16 * kStep + (d % 16) * 2] = 0;
      continue;
    }
    const int64_t blk = table[key / sh.block_size], off = key % sh.block_size;
    const auto* k32 = reinterpret_cast<const uint32_t*>(kc + blk * sh.k_block_stride + off * sh.k_row_stride +
                                                        pk.kvh * sh.k_head_stride);
    const uint16_t* vrow = vc + blk * sh.v_block_stride + off * sh.v_row_stride + pk.kvh * sh.v_head_stride;
    for (int64_t r = 0; r < D / 2; ++r) kg[r * 16] = k32[r];
    for (int64_t d = 0; d < D; ++d) vt[(d / 16) * 16 * kStep + (d % 16) * 2] = vrow[d];
  }
}

// One item's buffers in a thread's scratch: its query rows gathered, its output, running max and sum reset.
struct ItemBuffers {
  uint16_t* q;
  float* s;
  uint16_t* p;
  float* o;
  float* mx;
  float* sum;
  ItemBuffers(PfScratch& sc, const Item& it, const Pack& pk, const uint16_t* query, const Shape& sh,
              const ItemRows& rows)
      : q(align64(sc.q)), s(align64(sc.s)), p(align64(sc.p)), o(align64(sc.o)), mx(sc.mx.data()),
        sum(sc.sum.data()) {
    const int64_t M = sh.g * kQ;
    gather_rows(q, query, sh, it, pk, rows.q_start, rows.nq);
    std::fill(o, o + M * sh.D, 0.f);
    std::fill(mx, mx + M, kMasked);
    std::fill(sum, sum + M, 0.f);
  }
};

// Every (sequence, KV head)'s keys packed, then the items handed out heaviest first from an atomic counter to
// torch's threads: ``worker(take)`` runs once on each, ``take()`` giving the next item's index, -1 when none is left.
template <typename Worker>
void pf_schedule(const std::vector<Pack>& packs, int64_t n_items, const uint16_t* kc, const uint16_t* vc,
                 const int32_t* tables, const int32_t* lens, const Shape& sh, uint32_t* kbuf, uint16_t* vbuf,
                 Worker worker) {
  at::parallel_for(0, static_cast<int64_t>(packs.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) pf_pack(packs[i], kc, vc, tables, lens, sh, kbuf, vbuf);
  });
  std::atomic<int64_t> next{0};
  const auto take = [&]() -> int64_t {
    const int64_t i = next.fetch_add(1);
    return i < n_items ? i : -1;
  };
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items));
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) worker(take);
  });
}

// Softmax over a chunk's scores (sb), row by row, for both bf16 paths: the visible keys [rlo, pos] as bf16 P (pb),
// the rest 0; each row's running max and sum updated, and alpha (the old output's factor) left in the row's first
// score slot (its scores are spent) for the PV pass.
void pf_softmax(const ItemRows& rows, const Shape& sh, int64_t M, int64_t c0, int64_t n, float* sb, uint16_t* pb,
                float* mx, float* sum) {
  const __m512 vscale2 = _mm512_set1_ps(sh.scale * kLog2e);
  for (int64_t m = 0; m < M; ++m) {
    float* srow = sb + m * kChunk;
    uint16_t* prow = pb + m * kChunk;
    const auto [a, b] = rows.visible(m % kQ, c0, n, sh.window);
    if (a >= b) {
      std::memset(prow, 0, n * 2);
      srow[0] = 1.f;  // alpha: nothing new
      continue;
    }
    __m512 vmax = _mm512_set1_ps(kMasked);
    for (int64_t j = a; j < b; j += 16) {
      const __mmask16 k = static_cast<__mmask16>(b - j >= 16 ? 0xFFFF : (1u << (b - j)) - 1);
      vmax = _mm512_mask_max_ps(vmax, k, vmax, _mm512_maskz_loadu_ps(k, srow + j));
    }
    const float m_new = std::max(mx[m], _mm512_reduce_max_ps(vmax) * sh.scale);
    const float alpha = mx[m] < kMaskedBelow ? 0.f : std::exp(mx[m] - m_new);
    const __m512 vm = _mm512_set1_ps(m_new * kLog2e);  // exp(s * scale - m) = 2^(s * scale * log2e - m * log2e)
    __m512 vsum = _mm512_setzero_ps();
    const int64_t a16 = a / 16 * 16;
    for (int64_t j = 0; j < a16; j += 16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + j), _mm256_setzero_si256());
    }
    for (int64_t j = a16; j < n; j += 16) {
      __mmask16 k = 0xFFFF;
      if (j < a) k &= static_cast<__mmask16>(~((1u << (a - j)) - 1));
      if (j + 16 > b) k &= static_cast<__mmask16>(b > j ? (1u << (b - j)) - 1 : 0);
      const __m512 e = _mm512_maskz_mov_ps(k, pv_exp2(_mm512_fmsub_ps(_mm512_loadu_ps(srow + j), vscale2, vm)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + j), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
      vsum = _mm512_add_ps(vsum, e);
    }
    sum[m] = sum[m] * alpha + _mm512_reduce_add_ps(vsum);
    mx[m] = m_new;
    srow[0] = alpha;  // the row's scores are spent: its first slot carries alpha to the PV pass
  }
}

// Each real row's output, O / sum rounded to bf16 once, into its head's slot of out.
void pf_finish(const Item& it, const Pack& pk, const ItemRows& rows, const Shape& sh, const float* ob,
               const float* sum, uint16_t* out) {
  const int64_t D = sh.D, g = sh.g, nq = rows.nq, q_start = rows.q_start;
  for (int64_t h = 0; h < g; ++h) {
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t m = h * kQ + i;
      const __m512 vinv = _mm512_set1_ps(sum[m] > 0.f ? 1.f / sum[m] : 0.f);
      uint16_t* dst = out + ((q_start + it.i0 + i) * sh.H + pk.kvh * g + h) * D;
      for (int64_t d = 0; d < D; d += 16) {
        const __m256bh bh = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(ob + m * D + d), vinv));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), reinterpret_cast<__m256i>(bh));
      }
    }
  }
}

// ---- bf16 in AVX512-BF16 vectors (vdpbf16ps), for CPUs with it and without AMX (AMD Zen 4 / 5) ----
//
// The AMX path's packs, items, chunks and softmax, with its tile products as vector loops: S = Q K^T from 8 rows x
// 32 keys in registers (a K vector is one pair of dims of 16 keys, the pack's layout; each row's pair of query
// elements broadcast), O = O * alpha + P V from 4 rows x up to 64 dims (a V vector is one pair of keys of 16 dims,
// each row's pair of bf16 probabilities broadcast). Each vdpbf16ps multiplies two bf16 pairs into fp32 sums: half
// the instructions of widening to fp32 and one FMA a product (the path before: 2-core Zen 5, SmolLM2's heads,
// 1,024 tokens 3.3 ms a layer), with P in bf16 as the AMX path has it.
constexpr int kBdRows = 8;    // score rows a pass
constexpr int kBdPvRows = 4;  // output rows a pass

// S[r0 .. r0 + 8, col .. col + 32) (row stride kChunk) over the 32 keys from pack-relative c0.
inline void bd_scores8(const uint16_t* qb, const uint32_t* kp, int64_t D, int64_t r0, int64_t c0, int64_t col,
                       float* s) {
  const uint32_t* k0 = kp + (c0 / 16) * (D / 2) * 16;
  const uint32_t* k1 = k0 + (D / 2) * 16;
  __m512 acc[kBdRows][2];
  for (int r = 0; r < kBdRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const uint16_t* q0 = qb + r0 * D;
  for (int64_t p = 0; p < D / 2; ++p) {
    const auto x = reinterpret_cast<__m512bh>(_mm512_loadu_si512(k0 + p * 16));
    const auto y = reinterpret_cast<__m512bh>(_mm512_loadu_si512(k1 + p * 16));
    for (int r = 0; r < kBdRows; ++r) {
      int32_t pair;
      std::memcpy(&pair, q0 + r * D + 2 * p, sizeof(pair));
      const auto b = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], y, b);
    }
  }
  for (int r = 0; r < kBdRows; ++r) {
    _mm512_storeu_ps(s + (r0 + r) * kChunk + col, acc[r][0]);
    _mm512_storeu_ps(s + (r0 + r) * kChunk + col + 16, acc[r][1]);
  }
}

// O[r0 .. r0 + 4, dg * 16 .. + CB * 16) = O * alpha + P[rows, 0 .. n) V[c0 .. c0 + n); alpha in each row's first
// score slot (pf_softmax).
template <int CB>
inline void bd_pv(const uint16_t* pb, const float* sb, const uint16_t* vp, int64_t D, int64_t r0, int64_t dg,
                  int64_t c0, int64_t n, float* ob) {
  __m512 acc[kBdPvRows][CB];
  for (int r = 0; r < kBdPvRows; ++r)
    for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 2) {
    const int64_t key = c0 + j;  // even: a pair of keys
    const uint16_t* vpair = vp + (key / kStep) * D * kStep + ((key % kStep) / 2) * kStep + dg * 16 * kStep;
    __m512bh v[CB];
    for (int c = 0; c < CB; ++c) v[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(vpair + c * 16 * kStep));
    for (int r = 0; r < kBdPvRows; ++r) {
      int32_t pair;
      std::memcpy(&pair, pb + (r0 + r) * kChunk + j, sizeof(pair));
      const auto b = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], v[c], b);
    }
  }
  for (int r = 0; r < kBdPvRows; ++r) {
    const __m512 alpha = _mm512_set1_ps(sb[(r0 + r) * kChunk]);
    float* orow = ob + (r0 + r) * D + dg * 16;
    for (int c = 0; c < CB; ++c)
      _mm512_storeu_ps(orow + c * 16, _mm512_fmadd_ps(_mm512_loadu_ps(orow + c * 16), alpha, acc[r][c]));
  }
}

// One chunk of n keys from pack-relative c0 for the item's rows: S = Q K^T, the online softmax (P in bf16),
// O = O * alpha + P V. Row groups at or past ``live`` rows of a 16 (a cascade tile's padding) are skipped (their
// softmax leaves P zero); M is the item's rows.
inline void bd_chunk(const ItemRows& rows, const Shape& sh, int64_t M, int64_t live, int64_t c0, int64_t n,
                     const ItemBuffers& b, const uint32_t* kp, const uint16_t* vp) {
  const int64_t D = sh.D;
  for (int64_t r0 = 0; r0 < M; r0 += kBdRows) {
    if (r0 % kQ >= live) continue;
    for (int64_t j = 0; j < n; j += kStep) bd_scores8(b.q, kp, D, r0, c0 + j, j, b.s);
  }
  pf_softmax(rows, sh, M, c0, n, b.s, b.p, b.mx, b.sum);
  const int64_t nv = D / 16;  // even: D is a multiple of 32
  for (int64_t r0 = 0; r0 < M; r0 += kBdPvRows) {
    if (r0 % kQ >= live) continue;
    int64_t dg = 0;
    for (; dg + 4 <= nv; dg += 4) bd_pv<4>(b.p, b.s, vp, D, r0, dg, c0, n, b.o);
    if (dg < nv) bd_pv<2>(b.p, b.s, vp, D, r0, dg, c0, n, b.o);
  }
}

void bd_run_item(const Item& it, const Pack& pk, const uint16_t* query, const int32_t* starts, const int32_t* lens,
                 const Shape& sh, const uint32_t* kbuf, const uint16_t* vbuf, uint16_t* out, PfScratch& sc) {
  const int64_t D = sh.D, g = sh.g, M = g * kQ;  // M: a multiple of 16
  const ItemRows rows(it, pk, starts, lens, sh.window);
  const int64_t first = rows.first, last_pos = rows.last_pos, lo = rows.lo;
  const uint32_t* kp = kbuf + pk.k_off;
  const uint16_t* vp = vbuf + pk.v_off;
  const ItemBuffers b(sc, it, pk, query, sh, rows);
  for (int64_t c0 = (lo - first) / kStep * kStep; c0 <= last_pos - first; c0 += kChunk) {
    const int64_t n = std::min<int64_t>(kChunk, (last_pos - first - c0) / kStep * kStep + kStep);
    bd_chunk(rows, sh, M, M, c0, n, b, kp, vp);
  }
  pf_finish(it, pk, rows, sh, b.o, b.sum, out);
}

void bd_run_all(const std::vector<Pack>& packs, const std::vector<Item>& items, const uint16_t* q,
                const uint16_t* kc, const uint16_t* vc, const int32_t* tables, const int32_t* starts,
                const int32_t* lens, const Shape& sh, uint32_t* kbuf, uint16_t* vbuf, uint16_t* o) {
  pf_schedule(packs, static_cast<int64_t>(items.size()), kc, vc, tables, lens, sh, kbuf, vbuf, [&](auto take) {
    PfScratch sc;
    sc.size(sh.g * kQ, sh.D);
    for (int64_t i = take(); i >= 0; i = take())
      bd_run_item(items[i], packs[items[i].pack], q, starts, lens, sh, kbuf, vbuf, o, sc);
  });
}

// Cascade decode attention's shared prefix (see shared_prefix above), bf16 in AVX512-BF16 vectors: the prefix is
// packed once a KV head and every sequence's query rows go over it in tiles of 16 sequences x the group's heads,
// the items of the prefill loops above with no causal mask: S = Q K^T, the online softmax (P in bf16, as the
// prefill path has it), O = O * alpha + P V. What is left per row (max, sum, unnormalised O) goes into ``state``,
// which ``ps`` points into; false (nothing computed) where no prefix is worth it.
bool cascade_prefix(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc, const int64_t* kstride,
                    const int64_t* vstride, const int32_t* tables, int64_t table_stride, const int64_t* lens, int64_t H,
                    int64_t Hkv, int64_t D, int64_t block_size, float scale, int64_t begin, int64_t end,
                    int64_t h_begin, int64_t h_end, std::vector<float>& state, PrefixState& ps) {
  if (D % 32 != 0 || !tandem_amx::bf16_dot()) return false;
  const auto [P, n, g, nh, rows, M, sh] = prefix_job(tables, table_stride, lens, kstride, vstride, H, Hkv, D,
                                                     block_size, scale, begin, end, h_begin, h_end, state, ps);
  if (P == 0) return false;
  thread_local PfScratch sc;
  if (static_cast<int64_t>(sc.mx.size()) != M || static_cast<int64_t>(sc.o.size()) < M * D + 16) sc.size(M, D);
  uint32_t* kbuf = pack_buffer<uint32_t>(0, P * D / 2 + 16);
  uint16_t* vbuf = pack_buffer<uint16_t>(1, P * D + 32);
  const int32_t* t0 = tables + begin * table_stride;
  const int32_t plen = static_cast<int32_t>(P);  // the pack reads keys [0, P) of the first sequence's table
  for (int64_t kvh = h_begin; kvh < h_end; ++kvh) {
    const Pack pk{0, kvh, 0, P, 0, 0};
    pf_pack(pk, reinterpret_cast<const uint16_t*>(kc), reinterpret_cast<const uint16_t*>(vc), t0, &plen, sh, kbuf,
            vbuf);
    for (int64_t s0 = begin; s0 < end; s0 += kQ) {
      const int64_t nq = std::min<int64_t>(kQ, end - s0);
      const ItemRows item(nq, P);
      // Row m = head-in-group * 16 + i: sequence s0 + i's query head kvh * g + m / 16 (padding rows zero).
      const ItemBuffers b(sc, Item{0, s0, 0}, pk, reinterpret_cast<const uint16_t*>(q), sh, item);
      for (int64_t c0 = 0; c0 < P; c0 += kChunk) bd_chunk(item, sh, M, nq, c0, std::min<int64_t>(kChunk, P - c0), b,
                                                            kbuf, vbuf);
      store_tile(state, rows, D, g, nh, ((s0 - begin) * nh + kvh - h_begin) * g, nq, b.o, b.mx, b.sum, 1.f);
    }
  }
  return true;
}

#pragma GCC pop_options

#endif  // TANDEM_PREFILL_BF16

#ifdef TANDEM_HAVE_AMX

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512bf16")

// Scores of rows [rg * 16, +16) over keys [c0, c0 + n) of the pack (n a multiple of 32), into s (row stride kChunk).
inline void pf_scores(const uint16_t* qb, const uint32_t* kp, int64_t D, int64_t rg, int64_t c0, int64_t n, float* s) {
  for (int64_t j = 0; j < n; j += 32) {
    const uint32_t* k0 = kp + ((c0 + j) / 16) * (D / 2) * 16;
    const uint32_t* k1 = k0 + (D / 2) * 16;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t c = 0; c < D / 32; ++c) {
      _tile_loadd(2, qb + rg * 16 * D + c * 32, D * 2);
      _tile_loadd(3, k0 + c * 256, 64);
      _tile_loadd(4, k1 + c * 256, 64);
      _tile_dpbf16ps(0, 2, 3);
      _tile_dpbf16ps(1, 2, 4);
    }
    _tile_stored(0, s + rg * 16 * kChunk + j, kChunk * 4);
    _tile_stored(1, s + rg * 16 * kChunk + j + 16, kChunk * 4);
  }
}

void pf_run_item(const Item& it, const Pack& pk, const uint16_t* query, const int32_t* starts,
                 const int32_t* lens, const Shape& sh, const uint32_t* kbuf, const uint16_t* vbuf, uint16_t* out,
                 PfScratch& sc) {
  const int64_t D = sh.D, g = sh.g, M = g * kQ;
  const ItemRows rows(it, pk, starts, lens, sh.window);
  const int64_t first = rows.first, last_pos = rows.last_pos, lo = rows.lo;
  const uint32_t* kp = kbuf + pk.k_off;
  const uint16_t* vp = vbuf + pk.v_off;
  const ItemBuffers b(sc, it, pk, query, sh, rows);
  float* tb = align64(sc.tile);
  // Key chunks (pack-relative, multiples of 32) from the item's first key through its last row's position.
  for (int64_t c0 = (lo - first) / kStep * kStep; c0 <= last_pos - first; c0 += kChunk) {
    const int64_t n = std::min<int64_t>(kChunk, (last_pos - first - c0) / kStep * kStep + kStep);
    for (int64_t rg = 0; rg < M / 16; ++rg) pf_scores(b.q, kp, D, rg, c0, n, b.s);
    pf_softmax(rows, sh, M, c0, n, b.s, b.p, b.mx, b.sum);
    // O = O * alpha + P V over the chunk, 16 rows and up to 64 dims a pass, the chunk's keys in the tiles.
    for (int64_t rg = 0; rg < M / 16; ++rg) {
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int64_t nt = std::min<int64_t>(4, (D - d0) / 16);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t j = 0; j < n; j += kStep) {
          const uint16_t* vblk = vp + ((c0 + j) / kStep) * D * kStep + (d0 / 16) * 16 * kStep;
          _tile_loadd(4, b.p + rg * 16 * kChunk + j, kChunk * 2);
          _tile_loadd(5, vblk, kStep * 2);
          _tile_dpbf16ps(0, 4, 5);
          if (nt > 1) {
            _tile_loadd(6, vblk + 16 * kStep, kStep * 2);
            _tile_dpbf16ps(1, 4, 6);
          }
          if (nt > 2) {
            _tile_loadd(7, vblk + 2 * 16 * kStep, kStep * 2);
            _tile_dpbf16ps(2, 4, 7);
          }
          if (nt > 3) {
            _tile_loadd(5, vblk + 3 * 16 * kStep, kStep * 2);
            _tile_dpbf16ps(3, 4, 5);
          }
        }
        _tile_stored(0, tb, 64);
        if (nt > 1) _tile_stored(1, tb + 256, 64);
        if (nt > 2) _tile_stored(2, tb + 512, 64);
        if (nt > 3) _tile_stored(3, tb + 768, 64);
        for (int64_t r = 0; r < 16; ++r) {
          const int64_t m = rg * 16 + r;
          const __m512 va = _mm512_set1_ps(b.s[m * kChunk]);
          for (int64_t t = 0; t < nt; ++t) {
            float* orow = b.o + m * D + d0 + t * 16;
            _mm512_storeu_ps(orow, _mm512_fmadd_ps(_mm512_loadu_ps(orow), va, _mm512_load_ps(tb + t * 256 + r * 16)));
          }
        }
      }
    }
  }
  pf_finish(it, pk, rows, sh, b.o, b.sum, out);
}

void pf_run_all(const std::vector<Pack>& packs, const std::vector<Item>& items, const uint16_t* q,
                const uint16_t* kc, const uint16_t* vc, const int32_t* tables, const int32_t* starts,
                const int32_t* lens, const Shape& sh, uint32_t* kbuf, uint16_t* vbuf, uint16_t* o) {
  pf_schedule(packs, static_cast<int64_t>(items.size()), kc, vc, tables, lens, sh, kbuf, vbuf, [&](auto take) {
    tandem_amx::TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.rows[t] = 16;
      cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
    PfScratch sc;
    sc.size(sh.g * kQ, sh.D);
    for (int64_t i = take(); i >= 0; i = take())
      pf_run_item(items[i], packs[items[i].pack], q, starts, lens, sh, kbuf, vbuf, o, sc);
    _tile_release();
  });
}

#pragma GCC pop_options

#endif  // TANDEM_HAVE_AMX


// ---- fp32: the same items, packs and chunks in AVX-512 / AVX2 FMA registers ----
//
// PyTorch's flash SDPA ran fp32 prefill attention at 56-73 GFLOP/s on two Xeon cores (session 30). Here per item
// (sequence, KV head, 16 query positions; the GQA group's heads stacked as rows) and per chunk of up to 512 keys:
// S = Q K^T from 4 rows x 2 vectors of keys in registers (K packed transposed per vector of keys, so each Q
// element is broadcast once per key vector pair), a two-pass softmax over the chunk, O = O * alpha + P V from
// 4 rows (2 on AVX2) x up to 4 vectors of dims in registers (V packed as plain rows). head_dim a multiple of
// 16 up to 256.
#ifdef TANDEM_PREFILL_F32


inline float widen(float x) { return x; }
inline float widen(uint16_t x) {  // bf16 bits -> fp32 (exact)
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// K: [keys / kVW][D][kVW] (each vector of keys transposed); V: [keys][D]. Zero outside [lo, seq_len). A bf16 cache
// (C = uint16_t: CPUs without AMX) is widened to fp32 here, once per key, for the fp32 products.
template <typename C>
void f32_pack(const Pack& pk, const C* kc, const C* vc, const int32_t* tables, const int32_t* lens,
              const Shape& sh, float* kbuf, float* vbuf) {
  const int64_t D = sh.D, first = pk.lo / kStep * kStep, seq_len = lens[pk.seq];
  const int32_t* table = tables + pk.seq * sh.table_stride;
  float* kp = kbuf + pk.k_off;
  float* vp = vbuf + pk.v_off;
  for (int64_t j = 0; j < pk.keys; ++j) {
    const int64_t key = first + j;
    float* kt = kp + (j / kVW) * D * kVW + (j % kVW);
    float* vr = vp + j * D;
    if (key < pk.lo || key >= seq_len) {
      for (int64_t d = 0; d < D; ++d) kt[d * kVW] = 0.f;
      std::memset(vr, 0, D * 4);
      continue;
    }
    const int64_t blk = table[key / sh.block_size], off = key % sh.block_size;
    const C* krow = kc + blk * sh.k_block_stride + off * sh.k_row_stride + pk.kvh * sh.k_head_stride;
    const C* vrow = vc + blk * sh.v_block_stride + off * sh.v_row_stride + pk.kvh * sh.v_head_stride;
    for (int64_t d = 0; d < D; ++d) kt[d * kVW] = widen(krow[d]);
    if constexpr (std::is_same_v<C, float>) {
      std::memcpy(vr, vrow, D * 4);
    } else {
      for (int64_t d = 0; d < D; ++d) vr[d] = widen(vrow[d]);
    }
  }
}

// S[r, col .. col + 2 kVW) for rows r0 .. r0 + 4 (row stride kChunk): the keys from pack-relative c0.
inline void f32_scores4(const float* qb, const float* kp, int64_t D, int64_t r0, int64_t c0, int64_t col, float* s) {
  const float* k0 = kp + (c0 / kVW) * D * kVW;
  const float* k1 = k0 + D * kVW;
  pv a00 = pv_zero(), a01 = pv_zero(), a10 = pv_zero(), a11 = pv_zero();
  pv a20 = pv_zero(), a21 = pv_zero(), a30 = pv_zero(), a31 = pv_zero();
  const float* q0 = qb + r0 * D;
  for (int64_t d = 0; d < D; ++d) {
    const pv x = pv_load(k0 + d * kVW), y = pv_load(k1 + d * kVW);
    pv b = pv_set(q0[d]);
    a00 = pv_fma(b, x, a00);
    a01 = pv_fma(b, y, a01);
    b = pv_set(q0[D + d]);
    a10 = pv_fma(b, x, a10);
    a11 = pv_fma(b, y, a11);
    b = pv_set(q0[2 * D + d]);
    a20 = pv_fma(b, x, a20);
    a21 = pv_fma(b, y, a21);
    b = pv_set(q0[3 * D + d]);
    a30 = pv_fma(b, x, a30);
    a31 = pv_fma(b, y, a31);
  }
  float* o = s + r0 * kChunk + col;
  pv_store(o, a00);
  pv_store(o + kVW, a01);
  pv_store(o + kChunk, a10);
  pv_store(o + kChunk + kVW, a11);
  pv_store(o + 2 * kChunk, a20);
  pv_store(o + 2 * kChunk + kVW, a21);
  pv_store(o + 3 * kChunk, a30);
  pv_store(o + 3 * kChunk + kVW, a31);
}

// O[r0 .. r0 + kPvRows, v0 * kVW .. + CB * kVW) = O * alpha + P[rows, 0 .. n) V[c0 .. c0 + n).
template <int CB>
inline void f32_pv(const float* pb, const float* vp, const float* alpha, int64_t D, int64_t r0, int64_t v0,
                   int64_t c0, int64_t n, float* ob) {
  pv acc[kPvRows][CB];
  for (int64_t r = 0; r < kPvRows; ++r)
    for (int c = 0; c < CB; ++c) acc[r][c] = pv_zero();
  for (int64_t j = 0; j < n; ++j) {
    const float* vrow = vp + (c0 + j) * D + v0 * kVW;
    pv v[CB];
    for (int c = 0; c < CB; ++c) v[c] = pv_load(vrow + c * kVW);
    for (int64_t r = 0; r < kPvRows; ++r) {
      const pv p = pv_set(pb[(r0 + r) * kChunk + j]);
      for (int c = 0; c < CB; ++c) acc[r][c] = pv_fma(p, v[c], acc[r][c]);
    }
  }
  for (int64_t r = 0; r < kPvRows; ++r) {
    const pv a = pv_set(alpha[r0 + r]);
    float* orow = ob + (r0 + r) * D + v0 * kVW;
    for (int c = 0; c < CB; ++c) pv_store(orow + c * kVW, pv_fma(pv_load(orow + c * kVW), a, acc[r][c]));
  }
}

struct F32Scratch {
  std::vector<float> q, s, o, mx, sum, alpha;
  void size(int64_t M, int64_t D) {
    q.assign(M * D, 0.f);
    s.assign(M * kChunk, 0.f);
    o.assign(M * D, 0.f);
    mx.assign(M, 0.f);
    sum.assign(M, 0.f);
    alpha.assign(M, 0.f);
  }
};

// One chunk of n keys from pack-relative c0 for the item's rows: S = Q K^T, the two-pass softmax (exp as 2^t, the
// running max in log2 units), O = O * alpha + P V. Row groups at or past ``live`` rows of a 16 (a cascade tile's
// padding) are skipped; M is the item's rows.
inline void f32_chunk(const ItemRows& rows, const Shape& sh, int64_t M, int64_t live, int64_t c0, int64_t n,
                      const float* qb, const float* kp, const float* vp, float* sb, float* ob, float* mx, float* sum,
                      float* alpha) {
  const int64_t D = sh.D;
  const float sl = sh.scale * kLog2e;
  for (int64_t r0 = 0; r0 < M; r0 += 4) {
    if (r0 % kQ >= live) continue;
    for (int64_t j = 0; j < n; j += 2 * kVW) f32_scores4(qb, kp, D, r0, c0 + j, j, sb);
  }
  for (int64_t m = 0; m < M; ++m) {
    float* row = sb + m * kChunk;
    const auto [a, b] = rows.visible(m % kQ, c0, n, sh.window);
    if (a >= b) {
      std::memset(row, 0, n * 4);
      alpha[m] = 1.f;
      continue;
    }
    float bmax = kMasked;
    int64_t j = a;
    for (; j < b && j % kVW; ++j) bmax = std::max(bmax, row[j]);
    pv vmax = pv_set(kMasked);
    for (; j + kVW <= b; j += kVW) vmax = pv_max(vmax, pv_load(row + j));
    for (; j < b; ++j) bmax = std::max(bmax, row[j]);
    bmax = std::max(bmax, pv_hmax(vmax));
    const float m_new = std::max(mx[m], bmax * sl);  // in log2 units
    const float al = mx[m] < kMaskedBelow ? 0.f : std::exp2(mx[m] - m_new);
    const pv vsl = pv_set(sl), vm = pv_set(m_new);
    for (int64_t c = 0; c < n; c += kVW) pv_store(row + c, pv_exp2(pv_fms(pv_load(row + c), vsl, vm)));
    for (int64_t c = 0; c < a; ++c) row[c] = 0.f;
    for (int64_t c = b; c < n; ++c) row[c] = 0.f;
    pv vs = pv_zero();
    for (int64_t c = 0; c < n; c += kVW) vs = pv_add(vs, pv_load(row + c));
    sum[m] = sum[m] * al + pv_hsum(vs);
    mx[m] = m_new;
    alpha[m] = al;
  }
  for (int64_t r0 = 0; r0 < M; r0 += kPvRows) {
    if (r0 % kQ >= live) continue;
    const int64_t nv = D / kVW;
    int64_t v0 = 0;
    for (; v0 + 4 <= nv; v0 += 4) f32_pv<4>(sb, vp, alpha, D, r0, v0, c0, n, ob);
    if (nv - v0 == 3) f32_pv<3>(sb, vp, alpha, D, r0, v0, c0, n, ob);
    if (nv - v0 == 2) f32_pv<2>(sb, vp, alpha, D, r0, v0, c0, n, ob);
    if (nv - v0 == 1) f32_pv<1>(sb, vp, alpha, D, r0, v0, c0, n, ob);
  }
}

void f32_run_item(const Item& it, const Pack& pk, const float* query, const int32_t* starts,
                  const int32_t* lens, const Shape& sh, const float* kbuf, const float* vbuf, float* out,
                  F32Scratch& sc) {
  const int64_t D = sh.D, g = sh.g, M = g * kQ;
  const ItemRows rows(it, pk, starts, lens, sh.window);
  const int64_t q_start = rows.q_start, nq = rows.nq, first = rows.first;
  const int64_t last_pos = rows.last_pos, lo = rows.lo;
  const float* kp = kbuf + pk.k_off;
  const float* vp = vbuf + pk.v_off;
  float* qb = sc.q.data();
  float* sb = sc.s.data();
  float* ob = sc.o.data();
  float* mx = sc.mx.data();
  float* sum = sc.sum.data();
  float* alpha = sc.alpha.data();
  gather_rows(qb, query, sh, it, pk, q_start, nq);
  std::fill(ob, ob + M * D, 0.f);
  std::fill(mx, mx + M, kMasked);
  std::fill(sum, sum + M, 0.f);
  for (int64_t c0 = (lo - first) / kStep * kStep; c0 <= last_pos - first; c0 += kChunk) {
    const int64_t n = std::min<int64_t>(kChunk, (last_pos - first - c0) / kStep * kStep + kStep);
    f32_chunk(rows, sh, M, M, c0, n, qb, kp, vp, sb, ob, mx, sum, alpha);
  }
  for (int64_t h = 0; h < g; ++h) {
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t m = h * kQ + i;
      const pv inv = pv_set(sum[m] > 0.f ? 1.f / sum[m] : 0.f);
      float* dst = out + ((q_start + it.i0 + i) * sh.H + pk.kvh * g + h) * D;
      for (int64_t d = 0; d < D; d += kVW) pv_store(dst + d, pv_fma(pv_load(ob + m * D + d), inv, pv_zero()));
    }
  }
}
// Cascade decode attention's shared prefix in fp32 (cascade_prefix above, bf16): the fp32 kernel's pack and chunks,
// every row after all the prefix's keys; the rows' maxes, kept in log2 units by the chunks, stored in natural ones.
bool cascade_prefix(const float* q, const float* kc, const float* vc, const int64_t* kstride, const int64_t* vstride,
                    const int32_t* tables, int64_t table_stride, const int64_t* lens, int64_t H, int64_t Hkv,
                    int64_t D, int64_t block_size, float scale, int64_t begin, int64_t end, int64_t h_begin,
                    int64_t h_end, std::vector<float>& state, PrefixState& ps) {
  if (D % kVW != 0 || D > 256) return false;
  const auto [P, n, g, nh, rows, M, sh] = prefix_job(tables, table_stride, lens, kstride, vstride, H, Hkv, D,
                                                     block_size, scale, begin, end, h_begin, h_end, state, ps);
  if (P == 0) return false;
  thread_local F32Scratch sc;
  float* kbuf = pack_buffer<float>(0, P * D);
  float* vbuf = pack_buffer<float>(1, P * D);
  if (static_cast<int64_t>(sc.mx.size()) != M || static_cast<int64_t>(sc.o.size()) < M * D) sc.size(M, D);
  const int32_t* t0 = tables + begin * table_stride;
  const int32_t plen = static_cast<int32_t>(P);  // the pack reads keys [0, P) of the first sequence's table
  constexpr float kLn2 = 0.693147180559945309f;
  for (int64_t kvh = h_begin; kvh < h_end; ++kvh) {
    const Pack pk{0, kvh, 0, P, 0, 0};
    f32_pack(pk, kc, vc, t0, &plen, sh, kbuf, vbuf);
    for (int64_t s0 = begin; s0 < end; s0 += kQ) {
      const int64_t nq = std::min<int64_t>(kQ, end - s0);
      const ItemRows item(nq, P);
      // Row m = head-in-group * 16 + i: sequence s0 + i's query head kvh * g + m / 16 (padding rows zero).
      gather_rows(sc.q.data(), q, sh, Item{0, s0, 0}, pk, 0, nq);
      std::fill(sc.o.begin(), sc.o.begin() + M * D, 0.f);
      std::fill(sc.mx.begin(), sc.mx.end(), kMasked);
      std::fill(sc.sum.begin(), sc.sum.end(), 0.f);
      for (int64_t c0 = 0; c0 < P; c0 += kChunk) {
        f32_chunk(item, sh, M, nq, c0, std::min<int64_t>(kChunk, P - c0), sc.q.data(), kbuf, vbuf, sc.s.data(),
                  sc.o.data(), sc.mx.data(), sc.sum.data(), sc.alpha.data());
      }
      store_tile(state, rows, D, g, nh, ((s0 - begin) * nh + kvh - h_begin) * g, nq, sc.o.data(), sc.mx.data(),
                 sc.sum.data(), kLn2);
    }
  }
  return true;
}
#endif  // fp32 vectors

}  // namespace

bool prefill_amx_ready() {
#ifdef TANDEM_HAVE_AMX
  return tandem_amx::ready();
#else
  return false;
#endif
}

bool prefill_bf16dot_ready() {
#ifdef TANDEM_PREFILL_BF16
  return tandem_amx::bf16_dot();
#else
  return false;
#endif
}

bool prefill_f32_ready() {
#ifdef TANDEM_PREFILL_F32
  return true;
#else
  return false;
#endif
}

namespace {

enum class Path { kBest, kWidened, kDot };  // kDot: AVX512-BF16 vectors even where AMX runs (tests)

torch::Tensor prefill(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                      torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor seq_lens,
                      torch::Tensor skip, double scale, int64_t window, Path path) {
  const bool bf16 = query.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || query.scalar_type() == at::kFloat, "paged_prefill: query must be bf16 or fp32, not ",
              query.scalar_type());
  // bf16 in AMX tiles where the CPU grants them, else in AVX512-BF16 vectors where it has them, else (or when
  // asked) in fp32 vectors, the caches widened as they are packed and the output rounded to bf16 once.
  const bool amx = bf16 && path == Path::kBest && prefill_amx_ready();
  const bool dot = bf16 && !amx && path != Path::kWidened && prefill_bf16dot_ready();
  TORCH_CHECK(path != Path::kDot || dot, "paged_prefill: bf16 vectors need AVX512-BF16 and the AVX-512 build");
  TORCH_CHECK(amx || dot || prefill_f32_ready(), "paged_prefill: ", bf16 ? "bf16 needs AMX or " : "fp32 needs ",
              "an AVX-512 or AVX2 build");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query must be a [T, H, D] tensor with unit stride over D and heads adjacent");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4, "caches must be [blocks, block_size, H_kv, D]");
  TORCH_CHECK(key_cache.stride(3) == 1 && value_cache.stride(3) == 1, "caches need unit stride over D");
  TORCH_CHECK(key_cache.scalar_type() == query.scalar_type() && value_cache.scalar_type() == query.scalar_type(),
              "caches must have the query's dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.dim() == 2 && block_tables.stride(1) == 1,
              "block_tables: int32 rows");
  TORCH_CHECK(query_start_loc.scalar_type() == torch::kInt32 && query_start_loc.is_contiguous() &&
                  seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous(),
              "query_start_loc and seq_lens: contiguous int32");
  const int64_t S = seq_lens.numel();
  TORCH_CHECK(query_start_loc.numel() == S + 1 && block_tables.size(0) == S, "one table and length per sequence");
  TORCH_CHECK(skip.numel() == 0 || (skip.numel() == S && skip.scalar_type() == torch::kUInt8 && skip.is_contiguous()),
              "skip: empty or one uint8 per sequence");
  TORCH_CHECK(window >= 0, "window: 0 (the whole sequence) or the positions a query reads");
  TORCH_CHECK(scale > 0, "scale must be positive");
  const int64_t H = query.size(1), D = query.size(2), Hkv = key_cache.size(2);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0 && key_cache.size(3) == D && value_cache.size(3) == D,
              "head counts or head_dim do not match");
  TORCH_CHECK(D % 32 == 0 && D <= 256, "paged_prefill: head_dim a multiple of 32 up to 256, not ", D);
  // The fp32 kernel reads fp32 query rows: a bf16 query is widened (a [T, H, D] copy, small beside the caches).
  const torch::Tensor q32 = bf16 && !amx && !dot ? query.to(at::kFloat) : query;
  auto out = torch::empty({query.size(0), H, D}, q32.options());
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const uint8_t* skips = skip.numel() ? skip.data_ptr<uint8_t>() : nullptr;
  const int64_t block_size = key_cache.size(1), max_blocks = block_tables.size(1);
  Shape sh{H, Hkv, D, H / Hkv, block_size, q32.stride(0),
           key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
           value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
           block_tables.stride(0), static_cast<float>(scale), window};
  // (sequence, KV head) packs of keys from a 32-aligned first key, and the items reading them, heaviest first.
  // K packs hold D / 2 pairs a key in bf16 (uint32 elements) and D floats in fp32; V packs D elements a key.
  std::vector<Pack> packs;
  std::vector<Item> items;
  int64_t k_total = 0, v_total = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = starts[s + 1] - starts[s];
    if (q_len <= 0 || (skips != nullptr && skips[s])) continue;
    TORCH_CHECK(lens[s] >= q_len && (lens[s] + block_size - 1) / block_size <= max_blocks,
                "seq_lens: at least the query rows and within the block table");
    const int64_t ctx = lens[s] - q_len;
    const int64_t lo = window > 0 ? std::max<int64_t>(0, ctx - window + 1) : 0;
    const int64_t keys = (lens[s] - lo / kStep * kStep + kStep - 1) / kStep * kStep;
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t pack = static_cast<int64_t>(packs.size());
      packs.push_back({s, h, lo, keys, k_total, v_total});
      k_total += keys * (amx || dot ? D / 2 : D);
      v_total += keys * D;
      for (int64_t i0 = 0; i0 < q_len; i0 += kQ) {
        const int64_t last = ctx + std::min<int64_t>(q_len, i0 + kQ) - 1;
        const int64_t first = window > 0 ? std::max<int64_t>(0, ctx + i0 - window + 1) : 0;
        items.push_back({pack, i0, last - first + 1});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.work > b.work; });
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  if (amx) {
#ifdef TANDEM_HAVE_AMX
    uint32_t* kbuf = pack_buffer<uint32_t>(0, k_total + 16);
    uint16_t* vbuf = pack_buffer<uint16_t>(1, v_total + 32);
    pf_run_all(packs, items, reinterpret_cast<const uint16_t*>(query.data_ptr()),
               reinterpret_cast<const uint16_t*>(key_cache.data_ptr()),
               reinterpret_cast<const uint16_t*>(value_cache.data_ptr()), tables, starts, lens, sh, kbuf, vbuf,
               reinterpret_cast<uint16_t*>(out.data_ptr()));
#endif
    return out;
  }
  if (dot) {
#ifdef TANDEM_PREFILL_BF16
    uint32_t* kbuf = pack_buffer<uint32_t>(0, k_total + 16);
    uint16_t* vbuf = pack_buffer<uint16_t>(1, v_total + 32);
    bd_run_all(packs, items, reinterpret_cast<const uint16_t*>(query.data_ptr()),
               reinterpret_cast<const uint16_t*>(key_cache.data_ptr()),
               reinterpret_cast<const uint16_t*>(value_cache.data_ptr()), tables, starts, lens, sh, kbuf, vbuf,
               reinterpret_cast<uint16_t*>(out.data_ptr()));
#endif
    return out;
  }
#ifdef TANDEM_PREFILL_F32
  float* kbuf = pack_buffer<float>(0, k_total);
  float* vbuf = pack_buffer<float>(1, v_total);
  const float* q = q32.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t n_packs = static_cast<int64_t>(packs.size()), n_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, n_packs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (bf16) {
        f32_pack(packs[i], reinterpret_cast<const uint16_t*>(key_cache.data_ptr()),
                 reinterpret_cast<const uint16_t*>(value_cache.data_ptr()), tables, lens, sh, kbuf, vbuf);
      } else {
        f32_pack(packs[i], key_cache.data_ptr<float>(), value_cache.data_ptr<float>(), tables, lens, sh, kbuf,
                 vbuf);
      }
    }
  });
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items));
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    F32Scratch sc;
    sc.size(sh.g * kQ, D);
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) {
        f32_run_item(items[i], packs[items[i].pack], q, starts, lens, sh, kbuf, vbuf, o, sc);
      }
    }
  });
#endif
  return bf16 ? out.to(at::kBFloat16) : out;
}

}  // namespace

torch::Tensor paged_prefill(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                            torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor seq_lens,
                            torch::Tensor skip, double scale, int64_t window) {
  return prefill(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, skip, scale, window,
                 Path::kBest);
}

// bf16 in fp32 vectors even where AMX runs (the path of CPUs without it, tested on every CPU).
torch::Tensor paged_prefill_widened(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                    torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor seq_lens,
                                    torch::Tensor skip, double scale, int64_t window) {
  return prefill(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, skip, scale, window,
                 Path::kWidened);
}

// bf16 in AVX512-BF16 vectors even where AMX runs (the path of Zen 4 / 5, tested on every CPU that has it).
torch::Tensor paged_prefill_bf16dot(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                    torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor seq_lens,
                                    torch::Tensor skip, double scale, int64_t window) {
  return prefill(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, skip, scale, window,
                 Path::kDot);
}
